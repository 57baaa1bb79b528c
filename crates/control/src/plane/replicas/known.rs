//! The replicas' book: what this replica knows of the others, followed from their
//! announcements (their live set, workers, the queue they share) and this replica's
//! own bookkeeping of reads, writes and forwarded suspends. Its fields are the
//! replicas module's; the rest of the plane asks its methods.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::model::ActorKey;
use crate::plane::records::Records;
use crate::replica_store::{Answer, ReplicaStore, WaiterRow, WorkerRow};
use crate::store::{ActorRow, Batch, StoreError};

/// How long a resume that may not wait queues all the same when another replica
/// seems to have a free worker: time for that replica to hand it over.
pub(crate) const HAND_OVER_WAIT: Duration = Duration::from_secs(1);

/// What this replica knows of the others (empty with one control plane).
#[derive(Debug, Default)]
pub(crate) struct Known {
    /// This replica's id; `None` with one control plane.
    pub(super) me: Option<i64>,
    /// Replicas not declared dead, this one included.
    pub(super) live: BTreeSet<i64>,
    /// Workers attached to other replicas, by id.
    pub(super) workers: BTreeMap<String, WorkerRow>,
    /// Every replica's capacity waiters, by `seq`: a pool's oldest is its first.
    pub(super) waiting: BTreeMap<i64, WaiterRow>,
    /// This replica's forwarded suspends waiting for their answer.
    pub(super) forwards: HashMap<i64, oneshot::Sender<Answer>>,
    /// Suspends forwarded to this replica being carried out, or carried out (the
    /// latest ones): never carried out twice.
    pub(super) executing: HashSet<i64>,
    pub(super) carried_out: std::collections::VecDeque<i64>,
    /// Reads of the record under way, by id: what this replica wrote meanwhile, which
    /// a read may predate (never forgotten because of it).
    pub(super) reads: HashMap<u64, Touched>,
    pub(super) next_read: u64,
    /// Actors this replica is writing now (how many writes of each): a read of them
    /// is not applied, the write's result is.
    pub(super) writing: HashMap<ActorKey, usize>,
    /// Reads not applied because of a write in progress: read again once it ends
    /// (it may have failed).
    pub(super) skipped: HashSet<ActorKey>,
    /// Bumped by whatever may let an offer that found nobody find someone now (a
    /// waiter announced, an operation on a queued actor ended, an eviction's claim
    /// given up): such an offer looks again.
    pub(super) waiters_seen: u64,
    /// When each waiter in `waiting` was announced (`waiters_seen` then).
    pub(super) added: HashMap<i64, u64>,
    /// Answers of this replica's forwarded suspends that came before their caller
    /// waited for them.
    pub(super) answers: HashMap<i64, Answer>,
}

/// Records written here while a read of the record was under way.
#[derive(Debug, Default)]
pub(crate) struct Touched {
    pub(super) actors: HashSet<ActorKey>,
    pub(super) atespaces: HashSet<String>,
}

impl Known {
    /// The others as recorded now, for a replica that starts.
    pub(in crate::plane) async fn read(store: &ReplicaStore) -> Result<Self, StoreError> {
        let view = store.view().await?;
        let me = store.replica();
        let waiting = view.waiting_by_seq();
        Ok(Self {
            me: Some(me),
            live: view.live.into_iter().chain([me]).collect(),
            workers: view
                .workers
                .into_iter()
                .filter(|w| w.replica != me)
                .map(|w| (w.id.clone(), w))
                .collect(),
            waiting,
            ..Self::default()
        })
    }

    /// Whether `worker` is attached to another live replica.
    pub(crate) fn attached_elsewhere(&self, worker: &str) -> bool {
        self.workers
            .get(worker)
            .is_some_and(|w| self.live.contains(&w.replica))
    }

    /// The app address of `worker`, attached to another replica.
    pub(crate) fn remote_address(&self, worker: &str) -> Option<SocketAddr> {
        self.workers.get(worker)?.app_address.parse().ok()
    }

    /// Notes a write of this replica (for a read of the record under way).
    pub(crate) fn written(&mut self, batch: &Batch) {
        for t in self.reads.values_mut() {
            t.actors.extend(batch.put_actors.iter().map(ActorRow::key));
            t.actors.extend(batch.delete_actors.iter().cloned());
            t.atespaces.extend(batch.put_atespaces.iter().cloned());
            t.atespaces.extend(batch.delete_atespaces.iter().cloned());
        }
    }

    /// Whether any replica's resume waits for a worker of `pool`.
    pub(crate) fn queued_in(&self, pool: &str) -> bool {
        self.waiting.values().any(|w| w.pool == pool)
    }

    /// Whether this is one of several replicas.
    pub(crate) fn is_shared(&self) -> bool {
        self.me.is_some()
    }

    /// Whether an operation of replica `op_replica` (from a record) belongs to
    /// another live replica.
    pub(crate) fn held_by_other(&self, op_replica: Option<i64>) -> bool {
        op_replica.is_some_and(|r| Some(r) != self.me && self.live.contains(&r))
    }

    /// The workers attached to other live replicas, by id.
    pub(crate) fn live_workers(&self) -> impl Iterator<Item = (&String, &WorkerRow)> {
        self.workers
            .iter()
            .filter(|(_, w)| self.live.contains(&w.replica))
    }

    /// Worker `id` attached here: not another replica's any more.
    pub(crate) fn attached_here(&mut self, id: &str) {
        self.workers.remove(id);
    }

    /// Something may let an offer that found nobody find someone now (an operation
    /// on a queued actor ended): such an offer looks again.
    pub(crate) fn passed_over(&mut self) {
        self.waiters_seen += 1;
    }

    /// The actors every replica's waiters of `pool` wait for that no eviction serves
    /// yet.
    pub(crate) fn unclaimed<'a>(
        &'a self,
        pool: &'a str,
    ) -> impl Iterator<Item = &'a ActorKey> + 'a {
        self.waiting
            .values()
            .filter(move |w| w.pool == pool && w.evicting.is_none())
            .map(|w| &w.actor)
    }

    /// Whether a resume of `actor` waits in a queue (on any replica).
    pub(crate) fn queued(&self, actor: &ActorKey) -> bool {
        self.waiting.values().any(|w| w.actor == *actor)
    }
}

impl Known {
    /// Whether a worker of `pool` seems free on another live replica (not leaving, and
    /// no actor the `records` place on it): a hint that the queue hands one over soon.
    pub(crate) fn free_elsewhere(&self, pool: &str, records: &Records) -> bool {
        self.free_elsewhere_count(pool, records) > 0
    }

    /// How many workers of `pool` seem free on other live replicas.
    pub(crate) fn free_elsewhere_count(&self, pool: &str, records: &Records) -> usize {
        let candidates: Vec<&str> = self
            .workers
            .values()
            .filter(|w| w.pool == pool && !w.leaving && self.live.contains(&w.replica))
            .map(|w| w.id.as_str())
            .collect();
        if candidates.is_empty() {
            return 0;
        }
        let taken: HashSet<&str> = records
            .values()
            .filter_map(|r| r.worker.as_deref())
            .collect();
        candidates.iter().filter(|w| !taken.contains(*w)).count()
    }
}

impl crate::replica_store::View {
    /// Every replica's waiters, by `seq`.
    pub(super) fn waiting_by_seq(&self) -> BTreeMap<i64, WaiterRow> {
        self.waiters.iter().map(|w| (w.seq, w.clone())).collect()
    }
}
