//! The parking lot: a bounded set of parked requests, and the bytes of their bodies.
//!
//! A slot is an owned permit of a semaphore. It is taken at the park transition and
//! released exactly once, when the [`Slot`] goes away: [`Slot::finish`] records the
//! outcome; a slot dropped unfinished (its caller went away) records `canceled`. A
//! request that parked once and parks again after its worker's 421 takes a slot
//! without a permit ([`ParkingLot::park_again`]): it is never shed. The active count
//! counts both; each slot adds one and takes it off once, so it never goes below
//! zero (an attempt would be a bug, and is logged).
//!
//! Held body bytes are permits of a second semaphore of `--parked-bytes-max` permits,
//! owned by each request's [`Charge`] and given back as the bytes are forwarded or
//! dropped, so the bytes held across the lot never exceed the budget.

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
    bytes: HeldBytes,
}

impl ParkingLot {
    /// A lot of `capacity` slots (0: parking disabled, nothing ever parks) holding at
    /// most `max_bytes` bytes of request bodies.
    pub(crate) fn new(capacity: usize, max_bytes: u64, metrics: Arc<Metrics>) -> Self {
        Self {
            bytes: HeldBytes::new(max_bytes, Arc::clone(&metrics)),
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

    /// The bytes of request bodies the lot may hold.
    pub fn bytes(&self) -> &HeldBytes {
        &self.bytes
    }

    /// Requests parked now (a request parked again after a 421 included, see
    /// [`Self::park_again`]: this may exceed the lot's size by those).
    pub fn active(&self) -> usize {
        *self.active_tx.borrow()
    }

    /// Waits until exactly `n` requests are parked; false if `timeout` passes first.
    pub async fn wait_for_active(&self, n: usize, timeout: std::time::Duration) -> bool {
        let mut rx = self.active_tx.subscribe();
        // The watched value itself: the closure runs under the watch's read lock.
        tokio::time::timeout(timeout, rx.wait_for(|&v| v == n))
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
        let slot = self.take();
        if slot.is_none() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            self.metrics.rejected();
        }
        slot
    }

    /// Takes a slot if the lot has one free; a full lot rejects nothing (the caller is
    /// served either way: its flight already routed).
    pub(crate) fn take(&self) -> Option<Slot> {
        let permit = Arc::clone(&self.permits).try_acquire_owned().ok()?;
        self.admitted.fetch_add(1, Ordering::Relaxed);
        self.metrics.parked(1);
        self.active_tx.send_modify(|n| *n += 1);
        Some(Slot {
            permit: Some(permit),
            since: Instant::now(),
            metrics: Arc::clone(&self.metrics),
            finished: false,
            sampled: true,
            active_tx: Arc::clone(&self.active_tx),
        })
    }
}

impl ParkingLot {
    /// A place for a request that parked once already and parks again (the built-in
    /// data plane sends a request through the pipeline once more after its worker's
    /// 421): it is never shed, so it is not refused when the lot is full (it counts as
    /// parked, beyond `--parked-request-max`), and its wait is not sampled a second
    /// time.
    pub(crate) fn park_again(&self) -> Slot {
        self.metrics.parked(1);
        self.active_tx.send_modify(|n| *n += 1);
        Slot {
            permit: None,
            since: Instant::now(),
            metrics: Arc::clone(&self.metrics),
            finished: false,
            sampled: false,
            active_tx: Arc::clone(&self.active_tx),
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
    /// Its wait goes into the wait histogram (once per request: not for a request
    /// parked again).
    sampled: bool,
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
        if self.sampled {
            self.metrics.wait_ended(self.since.elapsed(), outcome);
        }
        self.metrics.parked(-1);
        // Release the slot before telling observers.
        drop(self.permit.take());
        self.active_tx.send_modify(|n| {
            if *n == 0 {
                tracing::error!("parking lot: a slot released twice (active count below zero)");
            }
            *n = n.saturating_sub(1);
        });
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.record(ParkOutcome::Canceled);
    }
}

/// The lot-wide budget of held request-body bytes (`--parked-bytes-max`).
#[derive(Debug)]
pub struct HeldBytes {
    permits: Arc<Semaphore>,
    capacity: u64,
    metrics: Arc<Metrics>,
    /// Bytes held, for observers that wait on it.
    held_tx: Arc<tokio::sync::watch::Sender<u64>>,
}

impl HeldBytes {
    fn new(capacity: u64, metrics: Arc<Metrics>) -> Self {
        let permits = usize::try_from(capacity)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(Semaphore::new(permits)),
            capacity: permits as u64,
            metrics,
            held_tx: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Every change of the bytes held, as it happens.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.held_tx.subscribe()
    }

    /// `--parked-bytes-max`.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held now, across the lot.
    pub fn held(&self) -> u64 {
        self.capacity - self.permits.available_permits() as u64
    }

    /// A charge of nothing yet.
    pub fn charge(&self) -> Charge {
        Charge {
            permits: None,
            bytes: 0,
            used: 0,
            semaphore: Arc::clone(&self.permits),
            capacity: self.capacity,
            metrics: Arc::clone(&self.metrics),
            held_tx: Arc::clone(&self.held_tx),
        }
    }
}

/// The held bytes one request owns; given back on drop.
#[derive(Debug)]
pub struct Charge {
    permits: Option<OwnedSemaphorePermit>,
    /// Permits owned.
    bytes: u64,
    /// Of those, how many cover bytes already held.
    used: u64,
    semaphore: Arc<Semaphore>,
    capacity: u64,
    metrics: Arc<Metrics>,
    held_tx: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Charge {
    /// Bytes this charge holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Reserves up to `want` more bytes from what the lot has free now, without waiting
    /// (a declared body's reservation at the park transition).
    pub fn reserve_now(&mut self, want: u64) {
        let free = self.semaphore.available_permits() as u64;
        let n = want.min(free);
        if n == 0 {
            return;
        }
        let Ok(n32) = u32::try_from(n) else { return };
        if let Ok(p) = Arc::clone(&self.semaphore).try_acquire_many_owned(n32) {
            self.add(p, n);
        }
    }

    /// Charges `n` bytes that have just been read: from what is reserved and unused
    /// first, then from the lot, waiting while the lot's bytes are spent (the caller
    /// reads nothing more meanwhile). A charge never waits for more than the whole
    /// lot, so one frame larger than the lot takes all of it; once this charge holds
    /// the whole lot, a charge for more waits until bytes are released elsewhere
    /// (never, for this caller: it reads nothing more until its bytes are handed on).
    ///
    /// Cancel-safe: dropping the future gives back nothing and takes nothing more.
    pub async fn charge(&mut self, n: u64) {
        let unused = self.bytes - self.used;
        let want = n.saturating_sub(unused);
        if want > 0 && self.bytes >= self.capacity {
            return std::future::pending().await;
        }
        let need = want.min(self.capacity - self.bytes);
        if need > 0 {
            let need32 = u32::try_from(need).unwrap_or(u32::MAX);
            match Arc::clone(&self.semaphore).acquire_many_owned(need32).await {
                Ok(p) => self.add(p, u64::from(need32)),
                Err(_) => return,
            }
        }
        self.used = (self.used + n).min(self.bytes);
    }

    /// Gives back `n` bytes that were handed on (forwarded), or all that is left.
    pub fn release(&mut self, n: u64) {
        let n = n.min(self.bytes);
        if n == 0 {
            return;
        }
        let Some(permits) = self.permits.as_mut() else {
            return;
        };
        if n == self.bytes {
            self.permits = None;
        } else if let Some(part) = permits.split(n as usize) {
            drop(part);
        }
        self.bytes -= n;
        self.used = self.used.saturating_sub(n);
        self.metrics.held_bytes(-(n as i64));
        self.held_tx.send_modify(|h| *h = h.saturating_sub(n));
    }

    fn add(&mut self, permit: OwnedSemaphorePermit, n: u64) {
        match self.permits.as_mut() {
            Some(p) => p.merge(permit),
            None => self.permits = Some(permit),
        }
        self.bytes += n;
        self.metrics.held_bytes(n as i64);
        self.held_tx.send_modify(|h| *h += n);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // The permits go back when the field drops, after this.
            self.metrics.held_bytes(-(self.bytes as i64));
            let n = self.bytes;
            self.held_tx.send_modify(|h| *h = h.saturating_sub(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_released_once() {
        let metrics = Arc::new(Metrics::new());
        let lot = ParkingLot::new(2, 0, Arc::clone(&metrics));
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
        let lot = ParkingLot::new(0, 0, Arc::new(Metrics::new()));
        assert!(lot.try_park().is_none());
        assert_eq!(lot.active(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn held_bytes_never_exceed_the_budget() {
        let metrics = Arc::new(Metrics::new());
        let lot = ParkingLot::new(4, 100, Arc::clone(&metrics));
        let bytes = lot.bytes();
        let held = || metrics.sample("atenet_router_parking_held_bytes", &[]);

        let mut a = bytes.charge();
        a.reserve_now(60);
        assert_eq!((a.bytes(), bytes.held(), held()), (60, 60, 60.0));
        a.charge(40).await;
        assert_eq!(a.bytes(), 60, "charged from the reservation");

        let mut b = bytes.charge();
        b.reserve_now(60);
        assert_eq!(b.bytes(), 40, "only what is free");
        b.charge(40).await;
        {
            let more = b.charge(10);
            tokio::pin!(more);
            assert!(
                futures_poll_once(more.as_mut()).await.is_pending(),
                "the lot is spent: b waits"
            );
            a.release(30);
            more.await;
        }
        assert_eq!((b.bytes(), bytes.held(), held()), (50, 80, 80.0));

        drop((a, b));
        assert_eq!((bytes.held(), held()), (0, 0.0));
        let mut c = bytes.charge();
        c.charge(1000).await;
        assert_eq!(
            c.bytes(),
            100,
            "a frame larger than the lot takes all of it"
        );
        {
            let more = c.charge(50);
            tokio::pin!(more);
            assert!(
                futures_poll_once(more.as_mut()).await.is_pending(),
                "holding the whole lot, c reads nothing more"
            );
        }
        assert_eq!(c.bytes(), 100);
        c.release(100);
        assert_eq!((bytes.held(), held()), (0, 0.0));
    }

    async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> std::task::Poll<F::Output> {
        let mut f = Some(f);
        std::future::poll_fn(|cx| {
            let p = std::pin::Pin::new(f.as_mut().unwrap()).poll(cx);
            std::task::Poll::Ready(p)
        })
        .await
    }
}
