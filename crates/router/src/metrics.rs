//! The router's metrics: OpenTelemetry instruments (meter `atenet-router`) exported
//! through a Prometheus registry that [`Metrics::render`] turns into exposition text.
//!
//! Names follow `parking.md`; Prometheus replaces dots with underscores, adds `_total` to
//! counters and the unit to the histograms (`…_wait_duration_seconds`).

use std::fmt;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, UpDownCounter};
pub use valet_telemetry::sample_of;
use valet_telemetry::{Registry, SECONDS_BUCKETS};

/// The OpenTelemetry meter name.
pub const METER: &str = "atenet-router";

/// How a parked request's wait ended: the `outcome` label of
/// `atenet.router.parking.wait.duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParkOutcome {
    /// The flight succeeded and the request was routed.
    Served,
    /// The budget ran out on a retryable condition.
    BudgetExhausted,
    /// The client went away while parked.
    Canceled,
    /// The request's own deadline ended while parked.
    Timeout,
    /// The flight failed with a non-retryable error.
    Error,
}

impl ParkOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ParkOutcome::Served => "served",
            ParkOutcome::BudgetExhausted => "budget_exhausted",
            ParkOutcome::Canceled => "canceled",
            ParkOutcome::Timeout => "timeout",
            ParkOutcome::Error => "error",
        }
    }
}

impl fmt::Display for ParkOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The instruments of one router, with their own registry (so routers in one process,
/// as in tests, never share counts).
pub struct Metrics {
    registry: Registry,
    parking_active: UpDownCounter<i64>,
    parking_wait: Histogram<f64>,
    parking_rejected: Counter<u64>,
    requests: prometheus::IntCounterVec,
    /// `requests{status=200, verdict=routed}`, resolved once: the hot path.
    routed: prometheus::IntCounter,
    resume_attempts: Counter<u64>,
    resume_in_progress: UpDownCounter<i64>,
    replays: Counter<u64>,
    after_route: Counter<u64>,
    leases: UpDownCounter<i64>,
    lease_renewals: Counter<u64>,
    /// `route.cached{lease=valid}` and `{lease=stale}`, resolved once.
    cached: [prometheus::IntCounter; 2],
    held_bytes: UpDownCounter<i64>,
    control_plane_reachable: Gauge<i64>,
    flights_active: UpDownCounter<i64>,
    decision_duration: prometheus::Histogram,
    recent_waits: std::sync::Mutex<std::collections::VecDeque<f64>>,
}

/// How many recent parked waits the status page's percentiles cover.
pub const RECENT_WAITS: usize = 1000;

/// Percentiles (seconds) of the recent parked waits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WaitPercentiles {
    /// How many waits they cover.
    pub count: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates the instruments on a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new(METER);
        let meter = registry.meter();
        // The instruments every decision touches are plain Prometheus ones with their
        // label values resolved once: one atomic add each, no attribute hashing.
        let requests = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "atenet_router_requests_total",
                "Requests decided, by HTTP status and verdict (with those a data plane refused before a decision: header limits, a refused client certificate, CONNECT).",
            ),
            &["status", "verdict"],
        )
        .expect("valid metric");
        let routed = requests.with_label_values(&["200", "routed"]);
        let cached_vec = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                "atenet_router_route_cached_total",
                "Requests routed from the route cache with no control-plane call, by lease (valid, stale).",
            ),
            &["lease"],
        )
        .expect("valid metric");
        let cached = [
            cached_vec.with_label_values(&["valid"]),
            cached_vec.with_label_values(&["stale"]),
        ];
        let decision_duration = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new(
                "atenet_router_route_duration_seconds",
                "Time from a request's arrival to the router's decision.",
            )
            .buckets(SECONDS_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(cached_vec),
            Box::new(decision_duration.clone()),
        ] {
            registry
                .prometheus()
                .register(c)
                .expect("each name is registered once");
        }
        Self {
            parking_active: meter
                .i64_up_down_counter("atenet.router.parking.active")
                .with_description("Requests currently parked.")
                .build(),
            parking_wait: meter
                .f64_histogram("atenet.router.parking.wait.duration")
                .with_description(
                    "Time each parked request spent parked, recorded once when its wait ends.",
                )
                .with_unit("s")
                .with_boundaries(SECONDS_BUCKETS.to_vec())
                .build(),
            parking_rejected: meter
                .u64_counter("atenet.router.parking.rejected")
                .with_description("Requests shed because the parking lot was full.")
                .build(),
            resume_attempts: meter
                .u64_counter("atenet.router.resume.attempts")
                .with_description("ResumeActor attempts, by gRPC code.")
                .build(),
            resume_in_progress: meter
                .i64_up_down_counter("atenet.router.resume.in_progress")
                .with_description("ResumeActor calls in progress.")
                .build(),
            replays: meter
                .u64_counter("atenet.router.requests.replayed")
                .with_description(
                    "Requests sent through the pipeline again after the worker answered 421 (the actor moved), or after a leased route's worker refused the connection.",
                )
                .build(),
            after_route: meter
                .u64_counter("atenet.router.requests.answered_after_route")
                .with_description(
                    "Routed requests the data plane answered itself (the worker could not be reached, a malformed body, the drain's cut-off), by status and verdict; requests_total counted them routed.",
                )
                .build(),
            leases: meter
                .i64_up_down_counter("atenet.router.leases.active")
                .with_description("Route leases in the route cache.")
                .build(),
            lease_renewals: meter
                .u64_counter("atenet.router.leases.renewals")
                .with_description("Route leases renewed in the background for actors in use.")
                .build(),
            held_bytes: meter
                .i64_up_down_counter("atenet.router.parking.held_bytes")
                .with_description(
                    "Request body bytes held in memory for parked requests (at most --parked-bytes-max).",
                )
                .build(),
            control_plane_reachable: meter
                .i64_gauge("atenet.router.control_plane.reachable")
                .with_description("1 while the control plane answers, 0 while it does not.")
                .build(),
            flights_active: meter
                .i64_up_down_counter("atenet.router.flights.active")
                .with_description("Resume flights in progress.")
                .build(),
            requests,
            routed,
            cached,
            decision_duration,
            registry,
            recent_waits: std::sync::Mutex::new(std::collections::VecDeque::with_capacity(
                RECENT_WAITS,
            )),
        }
    }

    pub(crate) fn parked(&self, delta: i64) {
        self.parking_active.add(delta, &[]);
    }

    pub(crate) fn wait_ended(&self, waited: Duration, outcome: ParkOutcome) {
        {
            let mut recent = self.recent_waits.lock().unwrap_or_else(|e| e.into_inner());
            if recent.len() == RECENT_WAITS {
                recent.pop_front();
            }
            recent.push_back(waited.as_secs_f64());
        }
        self.parking_wait.record(
            waited.as_secs_f64(),
            &[KeyValue::new("outcome", outcome.as_str())],
        );
    }

    pub(crate) fn rejected(&self) {
        self.parking_rejected.add(1, &[]);
    }

    /// Counts a request a data plane answered before the pipeline could decide it
    /// (its headers over the limits, a refused client certificate, CONNECT), by status
    /// and verdict in `requests_total`; it has no decision latency.
    pub fn answered_undecided(&self, status: u16, verdict: &'static str) {
        self.requests
            .with_label_values(&[&status.to_string(), verdict])
            .inc();
    }

    pub(crate) fn decided(&self, status: u16, verdict: &'static str, took: Duration) {
        if status == 200 && verdict == "routed" {
            self.routed.inc();
        } else {
            self.requests
                .with_label_values(&[&status.to_string(), verdict])
                .inc();
        }
        self.decision_duration.observe(took.as_secs_f64());
    }

    pub(crate) fn resume_attempt(&self, code: &'static str) {
        self.resume_attempts.add(1, &[KeyValue::new("code", code)]);
    }

    /// Counts a `ResumeActor` call as in progress until the guard drops.
    pub(crate) fn attempt_in_progress(&self) -> InProgress<'_> {
        self.resume_in_progress.add(1, &[]);
        InProgress(&self.resume_in_progress)
    }

    pub(crate) fn held_bytes(&self, delta: i64) {
        self.held_bytes.add(delta, &[]);
    }

    pub(crate) fn leases(&self, delta: i64) {
        if delta != 0 {
            self.leases.add(delta, &[]);
        }
    }

    pub(crate) fn renewed(&self) {
        self.lease_renewals.add(1, &[]);
    }

    pub(crate) fn routed_from_cache(&self, stale: bool) {
        self.cached[usize::from(stale)].inc();
    }

    /// Counts a request sent through the pipeline again (its actor moved).
    pub fn replayed(&self) {
        self.replays.add(1, &[]);
    }

    /// Counts a routed request the data plane answered itself (status, verdict).
    pub fn answered_after_route(&self, status: u16, verdict: &'static str) {
        self.after_route.add(
            1,
            &[
                KeyValue::new("status", i64::from(status)),
                KeyValue::new("verdict", verdict),
            ],
        );
    }

    /// Records whether the control plane answers.
    pub fn control_plane_reachable(&self, reachable: bool) {
        self.control_plane_reachable
            .record(i64::from(reachable), &[]);
    }

    pub(crate) fn flight_started(&self) {
        self.flights_active.add(1, &[]);
    }

    pub(crate) fn flight_ended(&self) {
        self.flights_active.add(-1, &[]);
    }

    /// Percentiles of the last [`RECENT_WAITS`] parked waits, if any.
    pub fn recent_wait_percentiles(&self) -> Option<WaitPercentiles> {
        let mut waits: Vec<f64> = {
            let recent = self.recent_waits.lock().unwrap_or_else(|e| e.into_inner());
            recent.iter().copied().collect()
        };
        if waits.is_empty() {
            return None;
        }
        waits.sort_by(f64::total_cmp);
        let at = |q: f64| waits[((waits.len() - 1) as f64 * q).round() as usize];
        Some(WaitPercentiles {
            count: waits.len(),
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: waits[waits.len() - 1],
        })
    }

    /// Every metric as Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        self.registry.render()
    }

    /// The value of one series of [`Self::render`]'s output: the sample called `name`
    /// whose labels include `labels`, summed over the other labels; 0 when absent.
    pub fn sample(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        sample_of(&self.render(), name, labels)
    }
}

/// A `ResumeActor` call in progress; counted until dropped.
#[derive(Debug)]
pub(crate) struct InProgress<'a>(&'a UpDownCounter<i64>);

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.add(-1, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_exposition() {
        let m = Metrics::new();
        m.parked(1);
        m.wait_ended(Duration::from_millis(300), ParkOutcome::Served);
        m.rejected();
        m.decided(200, "routed", Duration::from_millis(2));
        m.resume_attempt("RESOURCE_EXHAUSTED");
        m.flight_started();
        let text = m.render();
        for name in [
            "atenet_router_parking_active",
            "atenet_router_parking_wait_duration_seconds_bucket",
            "atenet_router_parking_rejected_total",
            "atenet_router_requests_total",
            "atenet_router_resume_attempts_total",
            "atenet_router_flights_active",
            "atenet_router_route_duration_seconds_count",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        assert_eq!(m.sample("atenet_router_parking_active", &[]), 1.0);
        assert_eq!(
            m.sample(
                "atenet_router_parking_wait_duration_seconds_count",
                &[("outcome", "served")]
            ),
            1.0
        );
        assert_eq!(
            m.sample(
                "atenet_router_parking_wait_duration_seconds_sum",
                &[("outcome", "served")]
            ),
            0.3
        );
        assert_eq!(
            m.sample(
                "atenet_router_requests_total",
                &[("status", "200"), ("verdict", "routed")]
            ),
            1.0
        );
        assert_eq!(
            m.sample(
                "atenet_router_resume_attempts_total",
                &[("code", "RESOURCE_EXHAUSTED")]
            ),
            1.0
        );
        assert_eq!(m.sample("atenet_router_parking_rejected_total", &[]), 1.0);
        assert_eq!(m.sample("absent", &[]), 0.0);
    }
}
