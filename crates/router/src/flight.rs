//! The flight registry: one resume flight per actor, shared by every request that
//! arrives while it is in progress.
//!
//! A flight's whole lifecycle lives here. [`Flight::park`] signals the park transition
//! once; [`Flight::publish`] takes the flight by value and owns the ordering: remove
//! the flight from the registry, *then* make the result visible, so a caller that sees
//! the result can never join the finished flight, and a caller that arrives after it
//! starts a new one. A flight dropped without publishing (its task panicked) publishes
//! [`FlightError::Lost`] from `Drop`, so no caller waits on it forever.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::addr::ActorRef;
use crate::control::ResumeError;
use crate::metrics::Metrics;

/// How a flight ended when it did not produce a worker address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlightError {
    /// The budget ran out while the resume was still blocked on a retryable condition;
    /// carries the last such answer.
    #[error("budget exhausted: {0:?}")]
    BudgetExhausted(ResumeError),
    /// The resume failed with an error waiting does not cure (or parking is disabled).
    #[error("resume failed: {0:?}")]
    Failed(ResumeError),
    /// The control plane answered OK without a routable worker address.
    #[error("unroutable actor: {0}")]
    Unroutable(String),
    /// The flight ended without a result (its task panicked or was aborted).
    #[error("flight lost")]
    Lost,
}

/// What a finished flight resolved to: the worker address, or why not.
pub type FlightResult = Result<SocketAddr, FlightError>;

/// What callers observe of a flight.
#[derive(Debug, Clone)]
pub(crate) enum FlightState {
    /// The first attempt (or a non-parking retry) is in progress.
    Resolving,
    /// The flight met a retryable condition; its callers hold parking slots.
    Parked,
    /// The flight is over and out of the registry. `parked` says whether it had parked:
    /// a caller that never saw [`FlightState::Parked`] (this state overwrote it) still
    /// parks, so every caller of a parked flight is parked or shed exactly once; one
    /// whose flight routed is never shed (it parks only if the lot has room).
    Done { result: FlightResult, parked: bool },
}

/// All flights of one router. Cheap to share.
#[derive(Debug)]
pub(crate) struct Registry {
    inner: Mutex<Flights>,
    metrics: Arc<Metrics>,
}

#[derive(Debug, Default)]
struct Flights {
    by_actor: HashMap<ActorRef, Entry>,
    next_id: u64,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    rx: watch::Receiver<FlightState>,
}

/// A caller's membership of a flight: a view of its state.
pub(crate) type FlightWatch = watch::Receiver<FlightState>;

impl Registry {
    pub(crate) fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Flights::default()),
            metrics,
        })
    }

    /// Joins `actor`'s flight, or starts one whose budget ends `budget` from now.
    /// Returns the new [`Flight`] when this caller started it; the caller must run it.
    pub(crate) fn join(
        self: &Arc<Self>,
        actor: &ActorRef,
        budget: Duration,
    ) -> (FlightWatch, Option<Flight>) {
        let mut flights = self.lock();
        if let Some(entry) = flights.by_actor.get(actor) {
            return (entry.rx.clone(), None);
        }
        let id = flights.next_id;
        flights.next_id += 1;
        let (tx, rx) = watch::channel(FlightState::Resolving);
        flights
            .by_actor
            .insert(actor.clone(), Entry { id, rx: rx.clone() });
        drop(flights);
        self.metrics.flight_started();
        let flight = Flight {
            registry: Arc::clone(self),
            actor: actor.clone(),
            id,
            deadline: Instant::now() + budget,
            tx,
            parked: false,
            published: false,
        };
        (rx, Some(flight))
    }

    /// Flights in progress.
    pub(crate) fn len(&self) -> usize {
        self.lock().by_actor.len()
    }

    fn remove(&self, actor: &ActorRef, id: u64) {
        let mut flights = self.lock();
        if flights.by_actor.get(actor).is_some_and(|e| e.id == id) {
            flights.by_actor.remove(actor);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Flights> {
        // The map stays consistent under panics: every mutation is one call.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One resume flight, owned by the task that runs its retry loop.
#[derive(Debug)]
pub(crate) struct Flight {
    registry: Arc<Registry>,
    actor: ActorRef,
    id: u64,
    deadline: Instant,
    tx: watch::Sender<FlightState>,
    parked: bool,
    published: bool,
}

impl Flight {
    pub(crate) fn actor(&self) -> &ActorRef {
        &self.actor
    }

    /// When the flight stops starting attempts.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    pub(crate) fn is_parked(&self) -> bool {
        self.parked
    }

    /// Marks the park transition. Only the first call has an effect.
    pub(crate) fn park(&mut self) {
        if !self.parked {
            self.parked = true;
            self.tx.send_replace(FlightState::Parked);
        }
    }

    /// Ends the flight: out of the registry first, then the result to every caller.
    pub(crate) fn publish(mut self, result: FlightResult) {
        self.finish(result);
    }

    fn finish(&mut self, result: FlightResult) {
        if self.published {
            return;
        }
        self.published = true;
        self.registry.remove(&self.actor, self.id);
        self.registry.metrics.flight_ended();
        self.tx.send_replace(FlightState::Done {
            result,
            parked: self.parked,
        });
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if !self.published {
            tracing::error!(actor = %self.actor, "resume flight ended without a result");
            self.finish(Err(FlightError::Lost));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor() -> ActorRef {
        "demo/p1".parse().unwrap()
    }

    #[tokio::test]
    async fn joiners_share_one_flight_until_it_publishes() {
        let registry = Registry::new(Arc::new(Metrics::new()));
        let (mut first, flight) = registry.join(&actor(), Duration::from_secs(5));
        let flight = flight.expect("first caller starts the flight");
        let (mut second, none) = registry.join(&actor(), Duration::from_secs(5));
        assert!(none.is_none());
        assert_eq!(registry.len(), 1);

        let addr: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        flight.publish(Ok(addr));
        assert_eq!(
            registry.len(),
            0,
            "removed before anyone can see the result"
        );
        for rx in [&mut first, &mut second] {
            assert!(matches!(
                &*rx.borrow_and_update(),
                FlightState::Done { result: Ok(a), parked: false } if *a == addr
            ));
        }
        let (_, next) = registry.join(&actor(), Duration::from_secs(5));
        assert!(
            next.is_some(),
            "a caller after the result starts a new flight"
        );
    }

    #[tokio::test]
    async fn park_signals_once() {
        let registry = Registry::new(Arc::new(Metrics::new()));
        let (mut rx, flight) = registry.join(&actor(), Duration::from_secs(5));
        let mut flight = flight.unwrap();
        flight.park();
        assert!(matches!(*rx.borrow_and_update(), FlightState::Parked));
        flight.park();
        assert!(!rx.has_changed().unwrap(), "second park is a no-op");
        flight.publish(Err(FlightError::Lost));
        assert!(
            matches!(&*rx.borrow(), FlightState::Done { parked: true, .. }),
            "the result says the flight had parked"
        );
    }

    #[tokio::test]
    async fn dropped_flight_publishes_lost() {
        let registry = Registry::new(Arc::new(Metrics::new()));
        let (rx, flight) = registry.join(&actor(), Duration::from_secs(5));
        drop(flight);
        assert_eq!(registry.len(), 0);
        assert!(matches!(
            &*rx.borrow(),
            FlightState::Done {
                result: Err(FlightError::Lost),
                ..
            }
        ));
    }

    #[tokio::test]
    async fn stale_flight_does_not_remove_its_successor() {
        let registry = Registry::new(Arc::new(Metrics::new()));
        let (_, old) = registry.join(&actor(), Duration::from_secs(5));
        let mut old = old.unwrap();
        // Simulate the old flight having been removed already.
        registry.remove(&actor(), old.id);
        let (_, new) = registry.join(&actor(), Duration::from_secs(5));
        assert!(new.is_some());
        old.finish(Err(FlightError::Lost));
        assert_eq!(registry.len(), 1, "the successor stays registered");
    }
}
