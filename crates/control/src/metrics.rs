//! The control plane's metrics (meter `valet-control`): resumes by outcome, capacity
//! waiters and workers by pool, hand-offs, and operation latency.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram};
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
    waiters: Gauge<i64>,
    workers: Gauge<i64>,
    /// The pools the gauges showed non-empty at the last scrape (workers, waiters): one
    /// that empties reads 0 once, not the last value it had (a gauge keeps every label
    /// set it has seen), and is then forgotten, so pool names (which clients choose)
    /// do not pile up here.
    shown: std::sync::Mutex<(BTreeSet<String>, BTreeSet<String>)>,
    operation: Histogram<f64>,
    revocation: Histogram<f64>,
}

impl PlaneMetrics {
    pub(crate) fn new() -> Self {
        let registry = Registry::new(METER);
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
            waiters: meter
                .i64_gauge("valet.control.waiters")
                .with_description("Resumes waiting for capacity, by pool.")
                .build(),
            workers: meter
                .i64_gauge("valet.control.workers")
                .with_description("Attached workers by pool and state (free, busy).")
                .build(),
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
        worker_pools.extend(pools.keys().cloned());
        for pool in worker_pools.iter() {
            let (all, free) = pools.get(pool).copied().unwrap_or_default();
            for (state, n) in [("free", free), ("busy", all - free)] {
                self.workers.record(
                    n as i64,
                    &[
                        KeyValue::new("pool", pool.clone()),
                        KeyValue::new("state", state),
                    ],
                );
            }
        }
        worker_pools.retain(|pool| pools.contains_key(pool));
        waiter_pools.extend(waiters.iter().map(|(pool, _)| pool.clone()));
        for pool in waiter_pools.iter() {
            let n = waiters
                .iter()
                .find_map(|(p, n)| (p == pool).then_some(*n))
                .unwrap_or(0);
            self.waiters
                .record(n as i64, &[KeyValue::new("pool", pool.clone())]);
        }
        waiter_pools.retain(|pool| waiters.iter().any(|(p, n)| p == pool && *n > 0));
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
        // Still 0 once forgotten.
        let text = m.render(&BTreeMap::new(), &[]);
        assert_eq!(
            sample(&text, "valet_control_workers", &busy),
            Some(0.0),
            "{text}"
        );
    }

    /// Pool names come from clients (a worker's join, an actor's template): the pools
    /// remembered between scrapes are only those not empty at the last one.
    #[test]
    fn emptied_pools_are_not_remembered() {
        let m = PlaneMetrics::new();
        for i in 0..200 {
            let pool = format!("p{i}");
            m.render(&BTreeMap::from([(pool.clone(), (1, 1))]), &[(pool, 1)]);
        }
        m.render(&BTreeMap::new(), &[]);
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
