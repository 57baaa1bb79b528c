//! Shared set-up of the pipeline tests: a router over a scripted control plane.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use valet_router::testing::{Calls, Scripted};
use valet_router::{Decision, Metrics, Router, RouterArgs};

pub const DOMAIN: &str = "actors.resources.substrate.ate.dev";

#[derive(Debug)]
pub struct Harness {
    pub router: Router,
    pub cp: Arc<Scripted>,
    pub calls: Calls,
}

/// A router with the given flags over a scripted control plane.
pub fn harness(flags: &[&str]) -> Harness {
    let config = RouterArgs::try_parse_flags(flags)
        .expect("flags parse")
        .resolve()
        .expect("flags are valid");
    let (cp, calls) = Scripted::new();
    let router = Router::new(Arc::new(config), cp.clone(), Arc::new(Metrics::new()));
    Harness { router, cp, calls }
}

pub fn host(actor: &str) -> String {
    let (atespace, name) = actor.split_once('/').unwrap();
    format!("{name}.{atespace}.{DOMAIN}")
}

impl Harness {
    /// Starts a request for `actor` (`atespace/name`) with a deadline far away.
    pub fn request(&self, actor: &str) -> JoinHandle<Decision> {
        self.request_with_deadline(actor, Duration::from_secs(3600))
    }

    /// A request as the built-in data plane makes it (it may use a stale lease).
    pub fn request_holding(&self, actor: &str) -> JoinHandle<Decision> {
        let router = self.router.clone();
        let host = host(actor);
        let deadline = Instant::now() + Duration::from_secs(3600);
        tokio::spawn(async move {
            router
                .decide_holding(&host, deadline, std::future::pending())
                .await
        })
    }

    pub fn request_with_deadline(&self, actor: &str, within: Duration) -> JoinHandle<Decision> {
        let router = self.router.clone();
        let host = host(actor);
        let deadline = Instant::now() + within;
        tokio::spawn(async move { router.decide(&host, deadline).await })
    }

    pub fn parked(&self) -> usize {
        self.router.lot().active()
    }

    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.router.metrics().sample(name, labels)
    }

    pub fn active_gauge(&self) -> f64 {
        self.metric("atenet_router_parking_active", &[])
    }

    pub fn rejected(&self) -> f64 {
        self.metric("atenet_router_parking_rejected_total", &[])
    }

    pub fn waits(&self, outcome: &str) -> f64 {
        self.metric(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", outcome)],
        )
    }

    pub fn all_waits(&self) -> f64 {
        self.metric("atenet_router_parking_wait_duration_seconds_count", &[])
    }

    /// Asserts the lot's three instruments at once: parked now (gauge and lot agree),
    /// rejected total, and wait samples per outcome.
    pub fn assert_lot(&self, parked: usize, rejected: u64, waits: &[(&str, u64)]) {
        assert_eq!(self.parked(), parked, "lot active");
        assert_eq!(self.active_gauge(), parked as f64, "parking.active gauge");
        assert_eq!(self.rejected(), rejected as f64, "parking.rejected");
        let mut total = 0;
        for (outcome, n) in waits {
            assert_eq!(
                self.waits(outcome),
                *n as f64,
                "wait samples with outcome {outcome}"
            );
            total += n;
        }
        assert_eq!(self.all_waits(), total as f64, "no other wait samples");
    }
}

/// Lets every runnable task run without letting the paused clock move; panics when
/// `cond` does not become true.
pub async fn settle_until(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never reached: {what}");
}

pub fn status(d: &Decision) -> u16 {
    d.status().as_u16()
}

pub fn body(d: &Decision) -> &str {
    match d {
        Decision::Route(_) => "",
        Decision::Deny(_, v) => v.body(),
    }
}

/// Answers every control-plane call with `answer` until `req` finishes; returns the
/// decision and the instant of each call.
pub async fn answer_until_done(
    calls: &mut valet_router::testing::Calls,
    mut req: JoinHandle<Decision>,
    mut answer: impl FnMut(valet_router::testing::Call),
) -> (Decision, Vec<Instant>) {
    let mut times = Vec::new();
    loop {
        tokio::select! {
            biased;
            d = &mut req => return (d.expect("request task"), times),
            call = calls.next() => {
                times.push(Instant::now());
                answer(call);
            }
        }
    }
}

/// Lets `d` of virtual time pass on the paused clock. Unlike `tokio::time::advance`,
/// every timer on the way fires at its own instant, so each task sees the time it
/// asked for.
pub async fn elapse(d: std::time::Duration) {
    tokio::time::sleep(d).await;
}
