//! The queues book: the first-come capacity queues, one per pool, oldest waiter
//! first. Entries are added, taken and dropped here only; what a waiter is handed
//! ([`Handed`]) is the capacity's.

use std::collections::{HashMap, VecDeque};

use tokio::sync::oneshot;

use super::capacity::Handed;
use crate::model::ActorKey;

/// A queue entry: a resume waiting for a worker of its pool.
#[derive(Debug)]
pub(crate) struct Waiter {
    id: u64,
    actor: ActorKey,
    /// Its row in the queue the replicas share, once written.
    seq: Option<i64>,
    tx: oneshot::Sender<Handed>,
}

impl Waiter {
    /// Whether its resume still waits.
    pub(crate) fn is_live(&self) -> bool {
        !self.tx.is_closed()
    }

    /// A new entry: entry `id` of its queue, for `actor`'s resume, which hears on
    /// `tx` what it is handed.
    pub(crate) fn new(id: u64, actor: ActorKey, tx: oneshot::Sender<Handed>) -> Self {
        Self {
            id,
            actor,
            seq: None,
            tx,
        }
    }

    /// The actor whose resume waits.
    pub(crate) fn actor(&self) -> &ActorKey {
        &self.actor
    }

    /// Tells its resume what it got. One that left drops it: a reservation then
    /// passes its worker on.
    pub(crate) fn hand(self, handed: Handed) {
        let _ = self.tx.send(handed);
    }

    /// Tells its resume what it got; what it got back, when the resume left.
    pub(crate) fn try_hand(self, handed: Handed) -> Result<(), Handed> {
        self.tx.send(handed)
    }

    /// Its row in the queue the replicas share, once written.
    pub(crate) fn seq(&self) -> Option<i64> {
        self.seq
    }
}

/// The capacity queues, one per pool, oldest waiter first: the only place entries
/// are added, taken and dropped.
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    queues: HashMap<String, VecDeque<Waiter>>,
}

impl Waiters {
    pub(crate) fn push(&mut self, pool: &str, waiter: Waiter) {
        self.queues
            .entry(pool.to_owned())
            .or_default()
            .push_back(waiter);
    }

    /// Entry `id` of `pool`'s queue, out of it.
    pub(crate) fn remove(&mut self, pool: &str, id: u64) -> Option<Waiter> {
        let q = self.queues.get_mut(pool)?;
        let i = q.iter().position(|w| w.id == id)?;
        q.remove(i)
    }

    /// The oldest entry of `pool`'s queue, out of it.
    pub(crate) fn pop(&mut self, pool: &str) -> Option<Waiter> {
        self.queues.get_mut(pool)?.pop_front()
    }

    /// Whether a resume still waits for a worker of `pool`.
    pub(crate) fn any_live(&self, pool: &str) -> bool {
        self.queues
            .get(pool)
            .is_some_and(|q| q.iter().any(Waiter::is_live))
    }

    /// How many resumes wait for a worker of `pool`.
    pub(crate) fn live(&self, pool: &str) -> usize {
        self.queues
            .get(pool)
            .map_or(0, |q| q.iter().filter(|w| w.is_live()).count())
    }

    /// How many resumes wait, by pool.
    pub(crate) fn live_by_pool(&self) -> Vec<(String, usize)> {
        self.queues
            .iter()
            .map(|(pool, q)| (pool.clone(), q.iter().filter(|w| w.is_live()).count()))
            .collect()
    }

    /// The actors whose resumes wait for a worker of `pool`.
    pub(crate) fn live_actors<'a>(&'a self, pool: &str) -> impl Iterator<Item = &'a ActorKey> + 'a {
        self.queues
            .get(pool)
            .into_iter()
            .flatten()
            .filter(|w| w.is_live())
            .map(|w| &w.actor)
    }

    /// The actors whose resumes wait for a worker of `pool` and whose shared rows are
    /// not written yet.
    pub(crate) fn unwritten_actors<'a>(
        &'a self,
        pool: &str,
    ) -> impl Iterator<Item = &'a ActorKey> + 'a {
        self.queues
            .get(pool)
            .into_iter()
            .flatten()
            .filter(|w| w.is_live() && w.seq.is_none())
            .map(|w| &w.actor)
    }

    /// Whether `actor` has an entry in `pool`'s queue.
    pub(crate) fn has(&self, pool: &str, actor: &ActorKey) -> bool {
        self.queues
            .get(pool)
            .is_some_and(|q| q.iter().any(|w| &w.actor == actor))
    }

    /// The waiter here whose row is `seq` (of `actor`), out of its queue: the one with
    /// that `seq`, or the actor's one that does not know its row yet.
    pub(crate) fn take(&mut self, pool: &str, seq: i64, actor: &ActorKey) -> Option<Waiter> {
        let q = self.queues.get_mut(pool)?;
        let i = q
            .iter()
            .position(|w| &w.actor == actor && w.seq.is_none_or(|s| s == seq))?;
        q.remove(i)
    }

    /// Entry `id` of `pool`'s queue has its shared row `seq`; whether it is there.
    pub(crate) fn written(&mut self, pool: &str, id: u64, seq: i64) -> bool {
        match self
            .queues
            .get_mut(pool)
            .and_then(|q| q.iter_mut().find(|w| w.id == id))
        {
            Some(w) => {
                w.seq = Some(seq);
                true
            }
            None => false,
        }
    }

    /// Entries whose shared rows are gone (`present` says which are not), out of
    /// their queues.
    pub(crate) fn vanished(&mut self, present: impl Fn(i64) -> bool) -> Vec<Waiter> {
        let mut gone = Vec::new();
        for q in self.queues.values_mut() {
            let mut i = 0;
            while i < q.len() {
                if q[i].seq.is_some_and(|seq| !present(seq)) {
                    gone.extend(q.remove(i));
                } else {
                    i += 1;
                }
            }
        }
        gone
    }
}
