//! Capacity: a resume's place in its pool's queue (the queues themselves are the
//! [`super::queues`] book), reservations, and the hand-off of a freed worker to the
//! oldest waiter.
//!
//! A waiting resume holds a [`Ticket`]; its queue entry goes when the ticket does, on
//! every path. A worker handed over (or picked free) is a [`Reservation`] until the
//! claim is durable; a reservation dropped unused passes its worker on to the next
//! waiter, so a waiter cancelled during a hand-off never strands the worker.
//!
//! Rule: a [`Reservation`] is never dropped while the state lock is held (its drop
//! takes the lock).
//!
//! With several replicas on one database the queue is theirs (`valet_waiters`, see
//! [`super::replicas`]): a ticket's entry here mirrors its row there, and a worker
//! that frees is offered to the oldest waiter of any replica.

use std::sync::atomic::Ordering;

use tokio::sync::oneshot;

use super::queues::Waiter;
use super::{Plane, Slot, State};
use crate::model::ActorKey;

/// What a waiting resume is handed.
#[derive(Debug)]
pub(crate) enum Handed {
    /// A worker of this replica, reserved for its activation.
    Worker(Reservation),
    /// Its actor's resume goes on elsewhere (several replicas): another replica
    /// claimed it on one of its workers, or it waits in the queue there already
    /// (`queued`). The record tells the outcome.
    Elsewhere {
        queued: bool,
        on: std::sync::Arc<dyn super::peers::Elsewhere>,
    },
    /// It could not be queued (the database refused): this is the answer.
    Failed(tonic::Status),
}

/// A resume's place in its pool's queue; it leaves the queue when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    plane: Plane,
    pool: String,
    id: u64,
    rx: Option<oneshot::Receiver<Handed>>,
}

impl Ticket {
    /// Resolves when something is handed to this ticket. Cancel-safe.
    pub(crate) async fn handed(&mut self) -> Option<Handed> {
        match self.rx.as_mut() {
            Some(rx) => rx.await.ok(),
            None => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let seq = {
            let mut st = self.plane.lock();
            st.waiters.remove(&self.pool, self.id).and_then(|w| w.seq())
        };
        // Its row goes too (one still being written goes once it is: see `enqueue`).
        if let Some(seq) = seq {
            self.plane.capacity().dequeue(seq);
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
            .workers
            .forget_reservation(&self.worker, &self.actor);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let freed = {
            self.plane
                .lock()
                .workers
                .unreserve(&self.worker, &self.actor)
        };
        if freed {
            self.plane.capacity().hand_off(&self.worker);
        }
    }
}

impl State {
    /// A free worker of `pool` for a resume that has not queued, if any. None while a
    /// resume waits in the pool's queue: a worker that frees is handed to the oldest
    /// waiter in a step of its own, after the change that freed it (see
    /// [`Capacity::hand_off`]), and a resume arriving in between queues behind the
    /// waiters instead of taking it.
    pub(crate) fn free_worker(&self, pool: &str) -> Option<String> {
        if self.waiters.any_live(pool) || self.replicas.queued_in(pool) {
            return None;
        }
        self.workers.free_in(pool)
    }
}

/// The plane's capacity: reservations, the queues' tickets, and the hand-off of a
/// freed worker to the oldest waiter. Obtained with [`Plane::capacity`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Capacity<'a> {
    plane: &'a Plane,
}

impl Plane {
    /// The plane's capacity.
    pub(crate) fn capacity(&self) -> Capacity<'_> {
        Capacity { plane: self }
    }
}

impl Capacity<'_> {
    /// Reserves free `worker` for `actor`.
    pub(crate) fn reserve(&self, st: &mut State, worker: &str, actor: &ActorKey) -> Reservation {
        let plane = self.plane;
        st.workers.reserve(worker, actor);
        Reservation {
            plane: plane.clone(),
            worker: worker.to_owned(),
            actor: actor.clone(),
            settled: false,
        }
    }

    /// Queues `actor` for the next worker of `pool` to free. With several replicas it
    /// is queued in the database too, behind every replica's older waiters: the
    /// ticket is handed [`Handed::Elsewhere`] when the actor waits on another
    /// replica already, and [`Handed::Failed`] when the database refuses.
    pub(crate) fn enqueue(&self, st: &mut State, pool: &str, actor: &ActorKey) -> Ticket {
        let plane = self.plane;
        let id = st.id();
        let (tx, rx) = oneshot::channel();
        st.waiters.push(pool, Waiter::new(id, actor.clone(), tx));
        plane.inner.stats.queued.fetch_add(1, Ordering::Relaxed);
        plane.inner.peers.queued(pool, actor, id);
        Ticket {
            plane: plane.clone(),
            pool: pool.to_owned(),
            id,
            rx: Some(rx),
        }
    }

    /// Hands free `worker` to the oldest live waiter of its pool, if any; otherwise it
    /// stays free. Call only after the change that freed it is durable, and never with
    /// the state lock held.
    pub(crate) fn hand_off(&self, worker: &str) {
        let plane = self.plane;
        if !plane.inner.peers.offer(plane, worker) {
            self.hand_off_here(worker);
        }
    }

    /// [`Self::hand_off`] with no other replica: to the oldest live waiter here.
    fn hand_off_here(&self, worker: &str) {
        let plane = self.plane;
        loop {
            let (waiter, reservation) = {
                let mut st = plane.lock();
                let Some(w) = st.workers.get(worker) else {
                    return;
                };
                // A worker whose stream is ending is leaving, not free.
                if *w.slot() != Slot::Free || !w.is_open() {
                    return;
                }
                let pool = w.pool().to_owned();
                let Some(waiter) = st.waiters.pop(&pool) else {
                    return;
                };
                let reservation = plane.capacity().reserve(&mut st, worker, waiter.actor());
                (waiter, reservation)
            };
            match waiter.try_hand(Handed::Worker(reservation)) {
                Ok(()) => {
                    plane.capacity().handed_off();
                    return;
                }
                Err(Handed::Elsewhere { .. } | Handed::Failed(_)) => return,
                Err(Handed::Worker(mut unused)) => {
                    // That waiter left: take the worker back and try the next one.
                    unused.settled = true;
                    // Its stream may have ended in between: the departure must not
                    // keep the reservation either.
                    plane.lock().workers.unreserve(worker, &unused.actor);
                }
            }
        }
    }
}

impl Capacity<'_> {
    /// Offers every free worker of `pool` attached here to the queue.
    pub(super) fn offer_free(&self, pool: &str) {
        let plane = self.plane;
        let free = plane.lock().workers.all_free_in(pool);
        for w in free {
            plane.capacity().hand_off(&w);
        }
    }

    /// A worker was handed to a waiter (here or, several replicas, elsewhere).
    pub(super) fn handed_off(&self) {
        let plane = self.plane;
        plane
            .inner
            .stats
            .handoffs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        plane.metrics().handoff();
    }
}

impl Capacity<'_> {
    /// Takes this replica's waiter `seq` out of the queue the replicas share, in the
    /// background (its resume no longer waits). A row a hand-off took already stays
    /// taken.
    pub(crate) fn dequeue(&self, seq: i64) {
        let plane = self.plane;
        plane.inner.peers.dequeue(plane, seq);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::link::WorkerLink;
    use crate::plane::workers::Joined;

    fn worker(pool: &str) -> Joined {
        Joined {
            pool: pool.into(),
            app_addr: "127.0.0.1:1".parse().unwrap(),
            slot: Slot::Free,
            link: Arc::new(WorkerLink::new(tokio::sync::mpsc::channel(1).0)),
            leaving: false,
            incarnation: 0,
            not_kept: Vec::new(),
            attach: 0,
        }
    }

    /// A worker that freed is not taken by a new resume while an older one waits for
    /// it (between the change that freed it and its hand-off to the oldest waiter).
    #[tokio::test]
    async fn a_free_worker_goes_to_waiters_first() {
        let mut st = State::default();
        st.workers.join("w1", worker("p"));
        assert_eq!(st.free_worker("p").as_deref(), Some("w1"));
        let (tx, rx) = oneshot::channel();
        st.waiters
            .push("p", Waiter::new(1, ActorKey::new("demo", "a").unwrap(), tx));
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
