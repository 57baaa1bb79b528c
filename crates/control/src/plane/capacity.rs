//! Capacity: first-come queues per pool, and the hand-off of a freed worker to the
//! oldest waiter.
//!
//! A waiting resume holds a [`Ticket`]; its queue entry goes when the ticket does, on
//! every path. A worker handed over (or picked free) is a [`Reservation`] until the
//! claim is durable; a reservation dropped unused passes its worker on to the next
//! waiter, so a waiter cancelled during a hand-off never strands the worker.
//!
//! Rule: a [`Reservation`] is never dropped while the state lock is held (its drop
//! takes the lock).

use std::sync::atomic::Ordering;

use tokio::sync::oneshot;

use super::{Plane, Slot, State};
use crate::model::ActorKey;

/// A queue entry: a resume waiting for a worker of its pool.
#[derive(Debug)]
pub(crate) struct Waiter {
    id: u64,
    actor: ActorKey,
    tx: oneshot::Sender<Reservation>,
}

impl Waiter {
    /// Whether its resume still waits.
    pub(crate) fn is_live(&self) -> bool {
        !self.tx.is_closed()
    }

    /// The actor it waits for.
    pub(crate) fn actor(&self) -> &ActorKey {
        &self.actor
    }
}

/// A resume's place in its pool's queue; it leaves the queue when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    plane: Plane,
    pool: String,
    id: u64,
    rx: Option<oneshot::Receiver<Reservation>>,
}

impl Ticket {
    /// Resolves when a worker is handed to this ticket. Cancel-safe.
    pub(crate) async fn handed(&mut self) -> Option<Reservation> {
        match self.rx.as_mut() {
            Some(rx) => rx.await.ok(),
            None => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        {
            let mut st = self.plane.lock();
            if let Some(q) = st.queues.get_mut(&self.pool)
                && let Some(pos) = q.iter().position(|w| w.id == self.id)
            {
                q.remove(pos);
            }
        }
        // Outside the lock: a worker handed to this ticket and never taken is passed on
        // by its reservation's drop.
        drop(self.rx.take());
    }
}

/// A worker promised to one actor's activation, before the claim is durable.
#[derive(Debug)]
pub(crate) struct Reservation {
    plane: Plane,
    worker: String,
    actor: ActorKey,
    settled: bool,
}

impl Reservation {
    /// The worker.
    pub(crate) fn worker(&self) -> &str {
        &self.worker
    }

    /// The claim is durable: the worker's slot follows the actor's row from now on.
    pub(crate) fn claimed(mut self) {
        self.settled = true;
        self.plane
            .lock()
            .forget_departed_reservation(&self.worker, &self.actor);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let freed = {
            let mut st = self.plane.lock();
            st.forget_departed_reservation(&self.worker, &self.actor);
            match st.workers.get_mut(&self.worker) {
                Some(w) if w.slot == Slot::Reserved(self.actor.clone()) => w.vacate(),
                _ => false,
            }
        };
        if freed {
            self.plane.hand_off(&self.worker);
        }
    }
}

impl State {
    /// The reservation of departed `worker` for `actor` ended (claimed or dropped):
    /// should the worker come back, it is not reserved any more.
    fn forget_departed_reservation(&mut self, worker: &str, actor: &ActorKey) {
        if let Some(d) = self.departed.get_mut(worker)
            && d.reserved.as_ref() == Some(actor)
        {
            d.reserved = None;
        }
    }

    /// A free worker of `pool` for a resume that has not queued, if any. None while a
    /// resume waits in the pool's queue: a worker that frees is handed to the oldest
    /// waiter in a step of its own, after the change that freed it (see
    /// [`Plane::hand_off`]), and a resume arriving in between queues behind the
    /// waiters instead of taking it.
    pub(crate) fn free_worker(&self, pool: &str) -> Option<String> {
        if self
            .queues
            .get(pool)
            .is_some_and(|q| q.iter().any(Waiter::is_live))
        {
            return None;
        }
        self.workers
            .iter()
            .find(|(_, w)| w.pool == pool && w.slot == Slot::Free && !w.link.is_closed())
            .map(|(id, _)| id.clone())
    }
}

impl Plane {
    /// Reserves free `worker` for `actor`.
    pub(crate) fn reserve(&self, st: &mut State, worker: &str, actor: &ActorKey) -> Reservation {
        if let Some(w) = st.workers.get_mut(worker) {
            w.slot = Slot::Reserved(actor.clone());
        }
        Reservation {
            plane: self.clone(),
            worker: worker.to_owned(),
            actor: actor.clone(),
            settled: false,
        }
    }

    /// Queues `actor` for the next worker of `pool` to free.
    pub(crate) fn enqueue(&self, st: &mut State, pool: &str, actor: &ActorKey) -> Ticket {
        let id = st.id();
        let (tx, rx) = oneshot::channel();
        st.queues
            .entry(pool.to_owned())
            .or_default()
            .push_back(Waiter {
                id,
                actor: actor.clone(),
                tx,
            });
        self.inner.stats.queued.fetch_add(1, Ordering::Relaxed);
        Ticket {
            plane: self.clone(),
            pool: pool.to_owned(),
            id,
            rx: Some(rx),
        }
    }

    /// Hands free `worker` to the oldest live waiter of its pool, if any; otherwise it
    /// stays free. Call only after the change that freed it is durable, and never with
    /// the state lock held.
    pub(crate) fn hand_off(&self, worker: &str) {
        loop {
            let (waiter, reservation) = {
                let mut st = self.lock();
                let Some(w) = st.workers.get(worker) else {
                    return;
                };
                // A worker whose stream is ending is leaving, not free.
                if w.slot != Slot::Free || w.link.is_closed() {
                    return;
                }
                let pool = w.pool.clone();
                let Some(waiter) = st.queues.get_mut(&pool).and_then(|q| q.pop_front()) else {
                    return;
                };
                let reservation = self.reserve(&mut st, worker, &waiter.actor);
                (waiter, reservation)
            };
            match waiter.tx.send(reservation) {
                Ok(()) => {
                    self.inner.stats.handoffs.fetch_add(1, Ordering::Relaxed);
                    self.metrics().handoff();
                    return;
                }
                Err(mut unused) => {
                    // That waiter left: take the worker back and try the next one.
                    unused.settled = true;
                    let mut st = self.lock();
                    // Its stream may have ended in between: the departure must not
                    // keep the reservation either.
                    st.forget_departed_reservation(worker, &unused.actor);
                    if let Some(w) = st.workers.get_mut(worker)
                        && w.slot == Slot::Reserved(unused.actor.clone())
                    {
                        w.vacate();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::link::WorkerLink;
    use crate::plane::WorkerRec;

    fn worker(pool: &str) -> WorkerRec {
        WorkerRec {
            pool: pool.into(),
            app_addr: "127.0.0.1:1".parse().unwrap(),
            slot: Slot::Free,
            link: Arc::new(WorkerLink::new(tokio::sync::mpsc::channel(1).0)),
            last_renewal: tokio::time::Instant::now(),
            leaving: false,
            incarnation: 0,
            not_kept: Vec::new(),
        }
    }

    /// A worker that freed is not taken by a new resume while an older one waits for
    /// it (between the change that freed it and its hand-off to the oldest waiter).
    #[tokio::test]
    async fn a_free_worker_goes_to_waiters_first() {
        let mut st = State::default();
        st.workers.insert("w1".into(), worker("p"));
        assert_eq!(st.free_worker("p").as_deref(), Some("w1"));
        let (tx, rx) = oneshot::channel();
        st.queues.entry("p".into()).or_default().push_back(Waiter {
            id: 1,
            actor: ActorKey::new("demo", "a").unwrap(),
            tx,
        });
        assert_eq!(st.free_worker("p"), None, "the waiter comes first");
        assert_eq!(st.free_worker("q"), None, "no worker in that pool");
        drop(rx);
        assert_eq!(
            st.free_worker("p").as_deref(),
            Some("w1"),
            "a waiter that left does not count"
        );
    }
}
