//! The retry loop of a flight: classify each `ResumeActor` answer, pace the next
//! attempt, and publish the flight's result.
//!
//! [`Pacing`] is the one place that decides when the next attempt starts and how long it
//! may ask the control plane to wait for capacity. An attempt in flight is never
//! cancelled by the budget: the loop only stops *starting* attempts.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use valet_net::Backoff;
use valet_proto::ateapi;

use crate::config::ParkingConfig;
use crate::control::{ControlPlane, ResumeError, ResumeRequest, code_name};
use crate::flight::{Flight, FlightError, FlightResult};
use crate::lease::RouteCache;
use crate::metrics::Metrics;

/// What one attempt's answer means for the flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Class {
    /// The actor runs at this address: route.
    Route(SocketAddr),
    /// Worth another attempt; with parking enabled, the flight parks.
    Retry(ResumeError),
    /// Waiting will not help.
    Fail(FlightError),
}

/// The classification table of `parking.md`, "The retry loop of a flight".
pub(crate) fn classify(
    answer: Result<ateapi::Actor, ResumeError>,
    parking_enabled: bool,
    default_port: u16,
) -> Class {
    let err = match answer {
        Ok(actor) => return route_of(&actor, default_port),
        Err(err) => err,
    };
    let retryable = match err.code() {
        Code::Aborted => true,
        Code::FailedPrecondition => parking_enabled && !err.is_crashed(),
        Code::ResourceExhausted | Code::Unavailable => parking_enabled,
        _ => false,
    };
    if retryable {
        Class::Retry(err)
    } else {
        Class::Fail(FlightError::Failed(err))
    }
}

fn route_of(actor: &ateapi::Actor, default_port: u16) -> Class {
    let unroutable = |why: String| Class::Fail(FlightError::Unroutable(why));
    if actor.status != ateapi::actor::Status::Running as i32 {
        return unroutable(format!("resumed actor has status {}", actor.status));
    }
    let Ok(ip) = actor.ateom_pod_ip.parse::<IpAddr>() else {
        return unroutable(format!(
            "resumed actor has no worker IP (got {:?})",
            actor.ateom_pod_ip
        ));
    };
    let port = match actor.worker_port {
        0 => default_port,
        p => match u16::try_from(p) {
            Ok(p) => p,
            Err(_) => return unroutable(format!("worker port {p} out of range")),
        },
    };
    Class::Route(SocketAddr::new(ip, port))
}

/// The waits between a flight's attempts: exponential (`--parked-request-retry-*`),
/// each stretched by up to its jitter fraction, and no cap: the budget alone bounds the
/// loop.
pub(crate) fn backoff(config: &ParkingConfig) -> Backoff {
    Backoff::new(config.retry_interval())
        .factor(config.retry_factor())
        .jitter(0.0..config.retry_jitter())
}

/// What the flight does after a retryable answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Start another attempt at this instant.
    Attempt(Instant),
    /// No attempt may start before the budget ends: answer `budget_exhausted` at this
    /// instant (the end of the budget, or now if it has passed).
    Exhausted(Instant),
}

/// Decides when attempts start and what they ask for.
#[derive(Debug)]
pub(crate) struct Pacing {
    backoff: Backoff,
    deadline: Instant,
}

impl Pacing {
    pub(crate) fn new(config: &ParkingConfig, deadline: Instant) -> Self {
        Self {
            backoff: backoff(config),
            deadline,
        }
    }

    /// After a retryable answer at `now`.
    pub(crate) fn after_retryable(&mut self, now: Instant) -> Next {
        if now >= self.deadline {
            return Next::Exhausted(now);
        }
        // The backoff has no cap (it saturates): past what the clock holds, the next
        // attempt is past any budget.
        match now.checked_add(self.backoff.next_delay()) {
            Some(at) if at < self.deadline => Next::Attempt(at),
            _ => Next::Exhausted(self.deadline),
        }
    }

    /// The `wait_for_capacity` of an attempt starting at `now`: none before the park
    /// transition (so it is observed after one quick attempt), the remaining budget
    /// after it.
    pub(crate) fn wait_for_capacity(&self, now: Instant, parked: bool) -> Option<Duration> {
        if !parked {
            return None;
        }
        Some(self.deadline.saturating_duration_since(now)).filter(|d| !d.is_zero())
    }
}

/// Runs a flight to its result and publishes it. Detached from every caller. Once
/// `wind_down` is cancelled (the router stops and nobody waits for the flight any
/// more) it starts no new attempt; `abandon` ends it even mid-attempt.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    mut flight: Flight,
    control_plane: Arc<dyn ControlPlane>,
    config: ParkingConfig,
    default_port: u16,
    metrics: Arc<Metrics>,
    cache: Arc<RouteCache>,
    wind_down: CancellationToken,
    abandon: CancellationToken,
) {
    let result = tokio::select! {
        r = attempts(&mut flight, control_plane.as_ref(), &config, default_port, &metrics, &cache, &wind_down) => r,
        () = abandon.cancelled() => Err(FlightError::Lost),
    };
    if let Err(err) = &result {
        tracing::debug!(actor = %flight.actor(), error = %err, "resume flight failed");
    }
    flight.publish(result);
}

/// The retry loop: attempts, paced, until one routes, one fails for good, or the budget
/// ends on a retryable answer.
async fn attempts(
    flight: &mut Flight,
    control_plane: &dyn ControlPlane,
    config: &ParkingConfig,
    default_port: u16,
    metrics: &Metrics,
    cache: &RouteCache,
    wind_down: &CancellationToken,
) -> FlightResult {
    let mut pacing = Pacing::new(config, flight.deadline());
    loop {
        if wind_down.is_cancelled() {
            return Err(FlightError::Lost);
        }
        let sent_at = Instant::now();
        let wait_for_capacity = pacing.wait_for_capacity(sent_at, flight.is_parked());
        let request = ResumeRequest {
            actor: flight.actor().clone(),
            wait_for_capacity,
            timeout: config.resume_attempt_timeout() + wait_for_capacity.unwrap_or_default(),
            lease_holder: cache.holder(),
        };
        let answer = {
            let _in_progress = metrics.attempt_in_progress();
            control_plane.resume_actor(request).await
        };
        let code = match &answer {
            Ok(_) => Code::Ok,
            Err(e) => e.code(),
        };
        metrics.resume_attempt(code_name(code));
        cache.answered(code != Code::Unavailable);
        let (answer, grant) = match answer {
            Ok(r) => (Ok(r.actor), r.grant),
            Err(e) => (Err(e), None),
        };
        let err = match classify(answer, config.enabled(), default_port) {
            Class::Route(addr) => {
                if let Some(grant) = grant {
                    cache.install(flight.actor(), addr, grant, sent_at);
                }
                return Ok(addr);
            }
            Class::Fail(err) => return Err(err),
            Class::Retry(err) => err,
        };
        // A retryable answer parks the flight even when it comes after the budget (it
        // then ends `budget_exhausted` at once), so every caller that waited on it is
        // counted as parked.
        let now = Instant::now();
        if config.enabled() {
            flight.park();
        }
        let (at, exhausted) = match pacing.after_retryable(now) {
            Next::Attempt(at) => (at, false),
            Next::Exhausted(at) => (at, true),
        };
        tokio::select! {
            () = tokio::time::sleep_until(at) => {}
            () = wind_down.cancelled() => return Err(FlightError::Lost),
        }
        // Timers wake at whole milliseconds, and a busy runtime later: an attempt due
        // just before the end of the budget may find it ended, and then never starts.
        if exhausted || Instant::now() >= flight.deadline() {
            return Err(FlightError::BudgetExhausted(err));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(ip: &str, port: u32) -> ateapi::Actor {
        ateapi::Actor {
            status: ateapi::actor::Status::Running as i32,
            ateom_pod_ip: ip.to_owned(),
            worker_port: port,
            ..Default::default()
        }
    }

    fn err(code: Code) -> ResumeError {
        ResumeError::new(code, "msg")
    }

    #[test]
    fn classification_table_parking_enabled() {
        let route: SocketAddr = "10.0.0.1:9000".parse().unwrap();
        assert_eq!(
            classify(Ok(running("10.0.0.1", 9000)), true, 80),
            Class::Route(route)
        );
        for code in [
            Code::Aborted,
            Code::ResourceExhausted,
            Code::FailedPrecondition,
            Code::Unavailable,
        ] {
            assert_eq!(
                classify(Err(err(code)), true, 80),
                Class::Retry(err(code)),
                "{code:?}"
            );
        }
        let crashed = ResumeError::crashed("AssignWorker prerequisite not met");
        assert_eq!(
            classify(Err(crashed.clone()), true, 80),
            Class::Fail(FlightError::Failed(crashed))
        );
        for code in [
            Code::NotFound,
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::DeadlineExceeded,
            Code::InvalidArgument,
            Code::Internal,
            Code::Unknown,
            Code::Cancelled,
            Code::Unimplemented,
        ] {
            assert_eq!(
                classify(Err(err(code)), true, 80),
                Class::Fail(FlightError::Failed(err(code))),
                "{code:?}"
            );
        }
    }

    #[test]
    fn classification_table_parking_disabled() {
        let route: SocketAddr = "10.0.0.1:80".parse().unwrap();
        assert_eq!(
            classify(Ok(running("10.0.0.1", 0)), false, 80),
            Class::Route(route)
        );
        assert_eq!(
            classify(Err(err(Code::Aborted)), false, 80),
            Class::Retry(err(Code::Aborted))
        );
        for code in [
            Code::ResourceExhausted,
            Code::FailedPrecondition,
            Code::Unavailable,
            Code::NotFound,
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::DeadlineExceeded,
            Code::Internal,
        ] {
            assert_eq!(
                classify(Err(err(code)), false, 80),
                Class::Fail(FlightError::Failed(err(code))),
                "{code:?}"
            );
        }
        let crashed = ResumeError::crashed("x");
        assert_eq!(
            classify(Err(crashed.clone()), false, 80),
            Class::Fail(FlightError::Failed(crashed))
        );
    }

    #[test]
    fn ok_without_a_routable_worker_fails() {
        for actor in [
            running("", 0),
            running("not-an-ip", 0),
            running("10.0.0.1", 70000),
            ateapi::Actor {
                status: ateapi::actor::Status::Suspended as i32,
                ateom_pod_ip: "10.0.0.1".into(),
                ..Default::default()
            },
        ] {
            assert!(matches!(
                classify(Ok(actor), true, 80),
                Class::Fail(FlightError::Unroutable(_))
            ));
        }
        let v6: SocketAddr = "[::1]:8080".parse().unwrap();
        assert_eq!(
            classify(Ok(running("::1", 8080)), true, 80),
            Class::Route(v6)
        );
    }

    fn config(interval_ms: u64, factor: f64, jitter: f64) -> ParkingConfig {
        ParkingConfig::new(
            Duration::from_secs(5),
            1024,
            Duration::from_millis(interval_ms),
            factor,
            jitter,
            Duration::from_secs(30),
        )
        .unwrap()
    }

    #[test]
    fn backoff_sequence_without_jitter_draw() {
        let mut b = backoff(&config(100, 1.1, 0.1));
        let waits: Vec<Duration> = (0..5).map(|_| b.next_delay_with(0.0)).collect();
        let want = [100.0, 110.0, 121.0, 133.1, 146.41];
        for (got, want) in waits.iter().zip(want) {
            assert!(
                (got.as_secs_f64() * 1000.0 - want).abs() < 1e-6,
                "{got:?} vs {want}"
            );
        }
        // The largest draw stretches by almost the whole jitter fraction.
        let mut b = backoff(&config(100, 1.1, 0.1));
        let d = b.next_delay_with(0.999_999);
        assert!(d < Duration::from_millis(110) && d > Duration::from_micros(109_999));
    }

    #[test]
    fn backoff_jitter_stays_in_bounds_and_varies() {
        let mut b = backoff(&config(100, 1.1, 0.1));
        let mut base = 0.1_f64;
        let mut seen_nonzero = false;
        for _ in 0..60 {
            let d = b.next_delay().as_secs_f64();
            assert!(
                d >= base * (1.0 - 1e-9) && d < base * 1.1 * (1.0 + 1e-9),
                "{d} vs {base}"
            );
            seen_nonzero |= d > base * 1.001;
            base *= 1.1;
        }
        assert!(seen_nonzero, "jitter is drawn");
    }

    #[test]
    fn backoff_has_no_cap() {
        let mut b = backoff(&config(100, 2.0, 0.0));
        let mut last = Duration::ZERO;
        for _ in 0..40 {
            let d = b.next_delay_with(0.0);
            assert!(d > last, "waits keep growing: {d:?} after {last:?}");
            last = d;
        }
        // Growth saturates instead of panicking.
        for _ in 0..2000 {
            b.next_delay_with(0.5);
        }
        assert_eq!(b.next_delay_with(0.5), Duration::MAX);
    }

    /// A wait past what the clock holds (a huge --parked-request-retry-factor, whose
    /// waits saturate) ends the budget; before, adding it to the clock panicked the
    /// flight, and its callers got a 500.
    #[tokio::test(start_paused = true)]
    async fn a_wait_past_the_clock_ends_the_budget() {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(5);
        let mut p = Pacing::new(&config(100, 1e300, 0.0), deadline);
        assert_eq!(
            p.after_retryable(start),
            Next::Attempt(start + Duration::from_millis(100))
        );
        let then = start + Duration::from_millis(100);
        assert_eq!(p.after_retryable(then), Next::Exhausted(deadline));
    }

    #[tokio::test(start_paused = true)]
    async fn pacing_never_schedules_past_the_budget() {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(1);
        let mut p = Pacing::new(&config(100, 2.0, 0.0), deadline);
        assert_eq!(
            p.after_retryable(start),
            Next::Attempt(start + Duration::from_millis(100))
        );
        let t = start + Duration::from_millis(100);
        assert_eq!(
            p.after_retryable(t),
            Next::Attempt(t + Duration::from_millis(200))
        );
        let t = start + Duration::from_millis(300);
        assert_eq!(
            p.after_retryable(t),
            Next::Attempt(t + Duration::from_millis(400))
        );
        let t = start + Duration::from_millis(700);
        // 800 ms more would start after the budget: answer at the budget instead.
        assert_eq!(p.after_retryable(t), Next::Exhausted(deadline));
        let late = deadline + Duration::from_millis(5);
        assert_eq!(p.after_retryable(late), Next::Exhausted(late));
    }

    #[tokio::test(start_paused = true)]
    async fn capacity_wait_only_after_park() {
        let start = Instant::now();
        let p = Pacing::new(&config(100, 1.1, 0.1), start + Duration::from_secs(5));
        assert_eq!(p.wait_for_capacity(start, false), None);
        assert_eq!(
            p.wait_for_capacity(start + Duration::from_secs(1), true),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            p.wait_for_capacity(start + Duration::from_secs(5), true),
            None
        );
    }
}
