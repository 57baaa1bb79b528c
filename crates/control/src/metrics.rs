//! The control plane's metrics (meter `valet-control`): resumes by outcome, capacity
//! waiters and workers by pool, hand-offs, and operation latency.

use std::collections::BTreeMap;
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

    pub(crate) fn resumed(&self, result: &Result<(ateapi::Actor, bool), Status>, took: Duration) {
        let outcome = match result {
            Ok((_, true)) => "resumed",
            Ok((_, false)) => "running",
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
        for (pool, (all, free)) in pools {
            let busy = all - free;
            for (state, n) in [("free", *free), ("busy", busy)] {
                self.workers.record(
                    n as i64,
                    &[
                        KeyValue::new("pool", pool.clone()),
                        KeyValue::new("state", state),
                    ],
                );
            }
        }
        for (pool, n) in waiters {
            self.waiters
                .record(*n as i64, &[KeyValue::new("pool", pool.clone())]);
        }
        self.registry.render()
    }
}
