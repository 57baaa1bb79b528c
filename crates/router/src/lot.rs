//! The parking lot: a bounded set of parked requests.
//!
//! A slot is an owned permit of a semaphore. It is taken at the park transition and
//! released exactly once, when the [`Slot`] goes away: [`Slot::finish`] records the
//! outcome; a slot dropped unfinished (its caller went away) records `canceled`. The
//! active count is the semaphore's and can never go negative.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::metrics::{Metrics, ParkOutcome};

/// The parking lot of one router.
#[derive(Debug)]
pub struct ParkingLot {
    permits: Arc<Semaphore>,
    capacity: usize,
    admitted: AtomicU64,
    rejected: AtomicU64,
    metrics: Arc<Metrics>,
    /// The active count, for observers that wait on it.
    active_tx: Arc<tokio::sync::watch::Sender<usize>>,
}

impl ParkingLot {
    /// A lot of `capacity` slots (0: parking disabled, nothing ever parks).
    pub(crate) fn new(capacity: usize, metrics: Arc<Metrics>) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(capacity.min(Semaphore::MAX_PERMITS))),
            capacity,
            admitted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            metrics,
            active_tx: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// `--parked-request-max`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Requests parked now.
    pub fn active(&self) -> usize {
        self.capacity - self.permits.available_permits()
    }

    /// Waits until exactly `n` requests are parked; false if `timeout` passes first.
    pub async fn wait_for_active(&self, n: usize, timeout: std::time::Duration) -> bool {
        let mut rx = self.active_tx.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|_| self.active() == n))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Requests ever parked (slots ever taken).
    pub fn admitted_total(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }

    /// Requests ever shed because the lot was full.
    pub fn rejected_total(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Takes a slot, or counts a rejection when the lot is full.
    pub(crate) fn try_park(&self) -> Option<Slot> {
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => {
                self.admitted.fetch_add(1, Ordering::Relaxed);
                self.metrics.parked(1);
                self.active_tx.send_modify(|n| *n += 1);
                Some(Slot {
                    permit: Some(permit),
                    since: Instant::now(),
                    metrics: Arc::clone(&self.metrics),
                    finished: false,
                    active_tx: Arc::clone(&self.active_tx),
                })
            }
            Err(_) => {
                self.rejected.fetch_add(1, Ordering::Relaxed);
                self.metrics.rejected();
                None
            }
        }
    }
}

/// One parked request's place in the lot.
#[derive(Debug)]
pub(crate) struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    since: Instant,
    metrics: Arc<Metrics>,
    finished: bool,
    active_tx: Arc<tokio::sync::watch::Sender<usize>>,
}

impl Slot {
    /// Ends the wait with `outcome`: one wait sample, one release.
    pub(crate) fn finish(mut self, outcome: ParkOutcome) {
        self.record(outcome);
    }

    fn record(&mut self, outcome: ParkOutcome) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.metrics.wait_ended(self.since.elapsed(), outcome);
        self.metrics.parked(-1);
        // Release the slot before telling observers.
        drop(self.permit.take());
        self.active_tx.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.record(ParkOutcome::Canceled);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_released_once() {
        let metrics = Arc::new(Metrics::new());
        let lot = ParkingLot::new(2, Arc::clone(&metrics));
        let a = lot.try_park().unwrap();
        let b = lot.try_park().unwrap();
        assert_eq!(lot.active(), 2);
        assert!(lot.try_park().is_none());
        assert_eq!(
            metrics.sample("atenet_router_parking_rejected_total", &[]),
            1.0
        );
        assert_eq!(metrics.sample("atenet_router_parking_active", &[]), 2.0);

        a.finish(ParkOutcome::Served);
        assert_eq!(lot.active(), 1);
        drop(b);
        assert_eq!(lot.active(), 0);
        assert_eq!(metrics.sample("atenet_router_parking_active", &[]), 0.0);
        let count = |o: &str| {
            metrics.sample(
                "atenet_router_parking_wait_duration_seconds_count",
                &[("outcome", o)],
            )
        };
        assert_eq!(count("served"), 1.0);
        assert_eq!(count("canceled"), 1.0);
    }

    #[test]
    fn zero_capacity_parks_nothing() {
        let lot = ParkingLot::new(0, Arc::new(Metrics::new()));
        assert!(lot.try_park().is_none());
        assert_eq!(lot.active(), 0);
    }
}
