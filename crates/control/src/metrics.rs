//! The control plane's metrics (meter `valet-control`): resumes by outcome, capacity
//! waiters and workers by pool, hand-offs, and operation latency.

use std::collections::BTreeMap;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};
use tonic::{Code, Status};
use valet_proto::ateapi;
use valet_telemetry::{Registry, SECONDS_BUCKETS};

/// The OpenTelemetry meter name.
pub(crate) const METER: &str = "valet-control";

/// The instruments of one control plane.
#[derive(Debug)]
pub(crate) struct PlaneMetrics {
    registry: Registry,
    resumes: Counter<u64>,
    handoffs: Counter<u64>,
    evictions: Counter<u64>,
    idle_suspensions: Counter<u64>,
    /// Plain Prometheus gauges: a series can be removed (pool names come from
    /// clients, and must not pile up in the exposition).
    waiters: prometheus::IntGaugeVec,
    workers: prometheus::IntGaugeVec,
    /// The pools each gauge shows (workers, waiters), and whether each read 0 at the
    /// last scrape: a pool that empties reads 0 once, then its series go.
    shown: std::sync::Mutex<(BTreeMap<String, bool>, BTreeMap<String, bool>)>,
    operation: Histogram<f64>,
    revocation: Histogram<f64>,
}

impl PlaneMetrics {
    pub(crate) fn new() -> Self {
        let registry = Registry::new(METER);
        let waiters = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "valet_control_waiters",
                "Resumes waiting for capacity, by pool.",
            ),
            &["pool"],
        )
        .expect("valid metric");
        let workers = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "valet_control_workers",
                "Attached workers by pool and state (free, busy).",
            ),
            &["pool", "state"],
        )
        .expect("valid metric");
        for g in [&waiters, &workers] {
            registry
                .prometheus()
                .register(Box::new(g.clone()))
                .expect("each name is registered once");
        }
        let meter = registry.meter();
        Self {
            resumes: meter
                .u64_counter("valet.control.resumes")
                .with_description(
                    "ResumeActor calls by outcome: running (already), resumed, no_room, aborted, crashed, not_found, unavailable, error.",
                )
                .build(),
            handoffs: meter
                .u64_counter("valet.control.handoffs")
                .with_description("Freed workers handed to the oldest capacity waiter.")
                .build(),
            evictions: meter
                .u64_counter("valet.control.evictions")
                .with_description(
                    "Idle actors checkpointed to free a worker for a waiting one, by pool.",
                )
                .build(),
            idle_suspensions: meter
                .u64_counter("valet.control.idle_suspensions")
                .with_description("Actors suspended for being idle, by pool.")
                .build(),
            waiters,
            workers,
            shown: std::sync::Mutex::default(),
            operation: meter
                .f64_histogram("valet.control.operation.duration")
                .with_description("Time of each operation (resume, restore, suspend), in seconds.")
                .with_unit("s")
                .with_boundaries(SECONDS_BUCKETS.to_vec())
                .build(),
            revocation: meter
                .f64_histogram("valet.control.lease.revocation.duration")
                .with_description(
                    "Time to revoke an actor's route leases (every holder acked, or its lease ended).",
                )
                .with_unit("s")
                .with_boundaries(SECONDS_BUCKETS.to_vec())
                .build(),
            registry,
        }
    }

    pub(crate) fn revoked(&self, took: Duration) {
        self.revocation.record(took.as_secs_f64(), &[]);
    }

    pub(crate) fn resumed(
        &self,
        result: &Result<(ateapi::Actor, ResumeHow), Status>,
        took: Duration,
    ) {
        let outcome = match result {
            Ok((_, ResumeHow::Activated)) => "resumed",
            Ok((_, ResumeHow::Joined)) => "joined",
            Ok((_, ResumeHow::Running)) => "running",
            Err(s) => match s.code() {
                Code::ResourceExhausted => "no_room",
                Code::Aborted => "aborted",
                Code::FailedPrecondition => "crashed",
                Code::NotFound => "not_found",
                Code::Unavailable => "unavailable",
                _ => "error",
            },
        };
        self.resumes.add(1, &[KeyValue::new("outcome", outcome)]);
        self.operation(
            if outcome == "running" {
                "resume_running"
            } else {
                "resume"
            },
            took,
        );
    }

    pub(crate) fn handoff(&self) {
        self.handoffs.add(1, &[]);
    }

    pub(crate) fn evicted(&self, pool: &str) {
        self.evictions
            .add(1, &[KeyValue::new("pool", pool.to_owned())]);
    }

    pub(crate) fn idle_suspended(&self, pool: &str) {
        self.idle_suspensions
            .add(1, &[KeyValue::new("pool", pool.to_owned())]);
    }

    pub(crate) fn operation(&self, op: &'static str, took: Duration) {
        self.operation
            .record(took.as_secs_f64(), &[KeyValue::new("op", op)]);
    }

    /// Exposition text, with the pool gauges set from `pools` (workers, free) and
    /// `waiters` first.
    pub(crate) fn render(
        &self,
        pools: &BTreeMap<String, (usize, usize)>,
        waiters: &[(String, usize)],
    ) -> String {
        let mut shown = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        let (worker_pools, waiter_pools) = &mut *shown;
        for (pool, (all, free)) in pools {
            for (state, n) in [("free", *free), ("busy", all - free)] {
                self.workers
                    .with_label_values(&[pool.as_str(), state])
                    .set(n as i64);
            }
            worker_pools.insert(pool.clone(), false);
        }
        worker_pools.retain(|pool, zeroed| {
            if pools.contains_key(pool) {
                return true;
            }
            for state in ["free", "busy"] {
                if *zeroed {
                    let _ = self.workers.remove_label_values(&[pool.as_str(), state]);
                } else {
                    self.workers
                        .with_label_values(&[pool.as_str(), state])
                        .set(0);
                }
            }
            let keep = !*zeroed;
            *zeroed = true;
            keep
        });
        let waiting: BTreeMap<&str, usize> = waiters
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(p, n)| (p.as_str(), *n))
            .collect();
        for (pool, n) in &waiting {
            self.waiters.with_label_values(&[*pool]).set(*n as i64);
            waiter_pools.insert((*pool).to_owned(), false);
        }
        waiter_pools.retain(|pool, zeroed| {
            if waiting.contains_key(pool.as_str()) {
                return true;
            }
            if *zeroed {
                let _ = self.waiters.remove_label_values(&[pool.as_str()]);
            } else {
                self.waiters.with_label_values(&[pool.as_str()]).set(0);
            }
            let keep = !*zeroed;
            *zeroed = true;
            keep
        });
        drop(shown);
        self.registry.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample of `metric` whose labels include every one of `labels`.
    fn sample(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{metric}{{")))
            .find(|l| labels.iter().all(|want| l.contains(want)))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    /// A pool whose last worker left, or whose last waiter was served, reads 0: the
    /// gauges keep every label set they have shown, so before, they kept the last
    /// value for good (capacity that no longer existed).
    #[test]
    fn a_pool_that_empties_reads_zero() {
        let m = PlaneMetrics::new();
        let pools = BTreeMap::from([("counter".to_owned(), (2, 1))]);
        let text = m.render(&pools, &[("counter".to_owned(), 3)]);
        let busy = ["pool=\"counter\"", "state=\"busy\""];
        assert_eq!(
            sample(&text, "valet_control_workers", &busy),
            Some(1.0),
            "{text}"
        );
        let waiting = ["pool=\"counter\""];
        assert_eq!(
            sample(&text, "valet_control_waiters", &waiting),
            Some(3.0),
            "{text}"
        );

        let text = m.render(&BTreeMap::new(), &[]);
        assert_eq!(
            sample(&text, "valet_control_workers", &busy),
            Some(0.0),
            "{text}"
        );
        let free = ["pool=\"counter\"", "state=\"free\""];
        assert_eq!(
            sample(&text, "valet_control_workers", &free),
            Some(0.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "valet_control_waiters", &waiting),
            Some(0.0),
            "{text}"
        );
        // Then its series are gone.
        let text = m.render(&BTreeMap::new(), &[]);
        assert_eq!(
            sample(&text, "valet_control_workers", &busy),
            None,
            "{text}"
        );
    }

    /// Pool names come from clients (a worker's join, an actor's template): a pool that
    /// empties reads 0 once, then its series are gone from the exposition and from
    /// memory (before, every name ever shown stayed).
    #[test]
    fn emptied_pools_are_not_remembered() {
        let m = PlaneMetrics::new();
        for i in 0..200 {
            let pool = format!("p{i}");
            m.render(&BTreeMap::from([(pool.clone(), (1, 1))]), &[(pool, 1)]);
        }
        // Each reads 0 once, then its series go.
        let text = m.render(&BTreeMap::new(), &[]);
        assert_eq!(
            sample(&text, "valet_control_waiters", &["pool=\"p199\""]),
            Some(0.0)
        );
        let text = m.render(&BTreeMap::new(), &[]);
        assert!(!text.contains("pool=\"p"), "{text}");
        let shown = m.shown.lock().unwrap();
        assert_eq!((shown.0.len(), shown.1.len()), (0, 0));
    }
}

/// How a successful `ResumeActor` came about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResumeHow {
    /// This call did the activation (`resumed`).
    Activated,
    /// It shared another call's activation.
    Joined,
    /// The actor was running already (the fast path).
    Running,
}
