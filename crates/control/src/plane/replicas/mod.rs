//! Several replicas active at once on one PostgreSQL database (docs/scale-out.md):
//! what this one knows of the others and follows from their announcements, the
//! capacity queue they share, suspends forwarded to the replica a worker is attached
//! to, and what a replica that dies leaves behind.
//!
//! Who writes what: a RUNNING actor's record is written by the replica its worker is
//! attached to (a suspend decided elsewhere is forwarded there); a RESUMING or
//! SUSPENDING one by the replica whose operation holds it (`op_replica`); a SUSPENDED
//! or CRASHED one by any, compare-and-set on its version. A worker is placed only by
//! the replica it is attached to: a resume that finds none free here queues, and the
//! replica whose worker frees hands it to the oldest waiter, restoring the waiter's
//! actor itself when the waiter is on another replica. The replica waiting answers
//! its callers from the record once it is RUNNING there.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use valet_proto::ateapi;
use valet_proto::worker as wk;

pub(super) mod known;

pub(crate) use known::{Known, Touched};

use super::capacity::Handed;
use super::peers::{Boxed, Claim, Elsewhere, Observed, Peers};
use super::wait::CapacityWait;
use super::workers::Departure;
use super::{Op, OpKind, OpTarget, Outcome, Plane, Slot, crashed, not_found, shutting_down};
use crate::link::WorkerLink;
use crate::model::{ActorKey, ActorStatus};
use crate::replica_store::{Answer, Event, HandOff, QueueOp, ReplicaStore, WaiterRow, WorkerRow};
use crate::store::{ActorRow, Batch, StoreError};

/// How many answered forwarded suspends a replica remembers (so that a listing read
/// before an answer was written does not carry one out again).
const CARRIED_OUT_KEPT: usize = 1024;
/// How soon a free worker that found nobody it could take in a queue that is not
/// empty is offered again.
const OFFER_AGAIN: Duration = Duration::from_millis(200);
/// How long a resume that found its actor queued on another replica waits for that
/// queue entry's announcement.
const ANNOUNCED_WITHIN: Duration = Duration::from_secs(2);
/// How long past the worker's own restore timeout a forwarded suspend, or a resume
/// answered from another replica's restore, waits.
const MARGIN: Duration = Duration::from_secs(5);

/// A read of the record under way: from its start, this replica's writes are noted
/// (see [`Touched`]); the note goes when the read is applied or dropped.
struct Reading {
    plane: Plane,
    id: u64,
}

impl Reading {
    fn start(plane: &Plane) -> Self {
        let mut st = plane.lock();
        st.replicas.next_read += 1;
        let id = st.replicas.next_read;
        st.replicas.reads.insert(id, Touched::default());
        Self {
            plane: plane.clone(),
            id,
        }
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.plane.lock().replicas.reads.remove(&self.id);
    }
}

/// A write of this replica's on its way: a read of its actors meanwhile is not
/// applied (the write's own result is, once it lands or fails).
pub(crate) struct Writing {
    replicas: Replicas,
    plane: Plane,
    keys: Vec<ActorKey>,
}

impl Writing {
    pub(crate) fn start(replicas: &Replicas, plane: &Plane, batch: &Batch) -> Self {
        let keys: Vec<ActorKey> = batch
            .put_actors
            .iter()
            .map(ActorRow::key)
            .chain(batch.delete_actors.iter().cloned())
            .collect();
        let mut st = plane.lock();
        for k in &keys {
            *st.replicas.writing.entry(k.clone()).or_default() += 1;
        }
        Self {
            replicas: replicas.clone(),
            plane: plane.clone(),
            keys,
        }
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        let again: Vec<ActorKey> = {
            let mut st = self.plane.lock();
            let mut again = Vec::new();
            for k in &self.keys {
                if let Some(n) = st.replicas.writing.get_mut(k) {
                    *n -= 1;
                    if *n == 0 {
                        st.replicas.writing.remove(k);
                        if st.replicas.skipped.remove(k) {
                            again.push(k.clone());
                        }
                    }
                }
            }
            again
        };
        if !again.is_empty() {
            self.replicas.refresh(
                &self.plane,
                &Batch {
                    delete_actors: again,
                    ..Batch::default()
                },
            );
        }
    }
}

/// Watching ended with `outcome`.
fn done(outcome: Outcome) -> Observed {
    Observed::Done(Box::new(outcome))
}

/// A forwarded suspend's answer, as sent.
fn encode(result: &Result<ateapi::Actor, Status>) -> Answer {
    use prost::Message as _;
    match result {
        Ok(actor) => (0, String::new(), Some(actor.encode_to_vec())),
        Err(e) => (e.code() as i32, e.message().to_owned(), None),
    }
}

/// A forwarded suspend's answer, as received.
fn decode((code, message, actor): Answer) -> Result<ateapi::Actor, Status> {
    use prost::Message as _;
    if code == 0 {
        return actor
            .and_then(|b| ateapi::Actor::decode(b.as_slice()).ok())
            .ok_or_else(|| Status::internal("a forwarded suspend's answer has no actor"));
    }
    Err(Status::new(tonic::Code::from(code), message))
}

/// A change of this replica's waiters to write into the queue the replicas share.
#[derive(Debug)]
pub(crate) enum QueueWrite {
    /// A waiter here (its entry's id) queues `actor` for a worker of `pool`.
    Insert {
        pool: String,
        actor: ActorKey,
        id: u64,
    },
    /// A waiter here no longer waits: its row `seq` goes.
    Delete { seq: i64 },
}

/// What a replica follows once it starts: the store's announcements (taken once)
/// and its waiters to write into the shared queue.
pub(crate) struct Following {
    events: Option<mpsc::Receiver<Event>>,
    writes: mpsc::UnboundedReceiver<QueueWrite>,
}

/// One of several replicas active at once on one PostgreSQL database: the store they
/// share, the writer of this replica's waiters into their queue, and the tasks that
/// follow the others (they end once `unfollow` is cancelled, after the operations in
/// progress at a shutdown). Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Replicas {
    store: Arc<ReplicaStore>,
    queue: mpsc::UnboundedSender<QueueWrite>,
    followers: TaskTracker,
    unfollow: CancellationToken,
}

impl Replicas {
    /// This replica on `store`, and what it knows of the others now; followed once
    /// [`Self::start`] runs.
    pub(super) async fn open(
        store: Arc<ReplicaStore>,
    ) -> Result<(Self, Known, Following), StoreError> {
        let events = store.events();
        let known = Known::read(&store).await?;
        let (queue, writes) = mpsc::unbounded_channel();
        let replicas = Self {
            store,
            queue,
            followers: TaskTracker::new(),
            unfollow: CancellationToken::new(),
        };
        Ok((replicas, known, Following { events, writes }))
    }

    /// Follows the other replicas' announcements, writes this replica's waiters into
    /// the queue they share, and declares silent replicas dead, until the plane stops.
    pub(super) fn start(&self, plane: &Plane, following: Following) {
        let Following { events, writes } = following;
        // The announcements are taken once: a second plane on the same store follows
        // nothing and shares no queue (as before the seam).
        let Some(events) = events else {
            tracing::warn!(
                "the replica store's announcements were taken already; this plane follows no other replica"
            );
            return;
        };
        let (this, follower) = (self.clone(), plane.clone());
        self.followers
            .spawn(async move { this.follow(&follower, events).await });
        let (this, writer) = (self.clone(), plane.clone());
        self.followers
            .spawn(async move { this.write_queue(&writer, writes).await });
        let this = self.clone();
        self.followers
            .spawn(async move { this.watch_replicas().await });
    }

    /// Stops following the other replicas, once nothing in progress needs it.
    pub(super) async fn unfollow(&self) {
        self.unfollow.cancel();
        self.followers.close();
        self.followers.wait().await;
    }

    /// Runs `task` among the followers (it is cut short once they stop).
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.followers.spawn(task);
    }

    async fn follow(&self, plane: &Plane, mut events: mpsc::Receiver<Event>) {
        let store = Arc::clone(&self.store);
        let mut backoff = super::store_backoff();
        loop {
            let first = tokio::select! {
                e = events.recv() => e,
                () = self.unfollow.cancelled() => return,
            };
            let Some(first) = first else { return };
            let mut batch = vec![first];
            while batch.len() < 1024
                && let Ok(e) = events.try_recv()
            {
                batch.push(e);
            }
            let resync = store.take_overflow() || batch.contains(&Event::Resync);
            let done = if resync {
                self.resync(plane, &store).await
            } else {
                self.apply_events(plane, &store, batch).await
            };
            if let Err(e) = done {
                // Read everything again once the database answers: what was missed
                // comes with it.
                tracing::warn!(error = %e, retry_in = ?backoff.peek(), "could not follow the other replicas' changes; reading everything again");
                if !backoff.wait(&self.unfollow).await {
                    return;
                }
                while self.resync(plane, &store).await.is_err() {
                    if !backoff.wait(&self.unfollow).await {
                        return;
                    }
                }
            }
            backoff.reset();
        }
    }

    /// Applies a batch of announcements: the records they name are read again first,
    /// then the rest in order, so that a waiter told its actor was claimed elsewhere
    /// finds the claim in memory (the claim's announcement comes first).
    async fn apply_events(
        &self,
        plane: &Plane,
        store: &Arc<ReplicaStore>,
        batch: Vec<Event>,
    ) -> Result<(), StoreError> {
        let me = store.replica();
        let mut actors = BTreeSet::new();
        let mut atespaces = false;
        let mut workers = BTreeSet::new();
        let mut rest = Vec::new();
        for event in batch {
            match event {
                Event::Resync => {}
                // This replica's own writes are in memory already (applied as they
                // landed), and so is a record at least as new.
                Event::Actor { by, .. } if by == me => {}
                Event::Actor {
                    key,
                    record: Some((uid, version)),
                    ..
                } if plane
                    .lock()
                    .records
                    .get(&key)
                    .is_some_and(|r| r.uid == uid && r.version >= version) => {}
                Event::Actor { key, .. } => {
                    actors.insert(key);
                }
                Event::Atespaces => atespaces = true,
                Event::Worker(id) => {
                    workers.insert(id);
                }
                other => rest.push(other),
            }
        }
        let keys: Vec<ActorKey> = actors.into_iter().collect();
        self.read_again(plane, store, &keys, atespaces).await?;
        for id in workers {
            let row = store.worker(&id).await?;
            self.apply_worker(plane, &id, row);
        }
        for event in rest {
            match event {
                Event::Waiter(row) => self.waiter_added(plane, row),
                Event::WaiterGone {
                    seq,
                    actor,
                    pool,
                    handed_by,
                } => self.waiter_gone(plane, seq, &actor, &pool, handed_by),
                Event::Evicting { seq, by } => {
                    {
                        let mut st = plane.lock();
                        if let Some(w) = st.replicas.waiting.get_mut(&seq) {
                            w.evicting = by;
                        }
                        st.replicas.waiters_seen += 1;
                    }
                    plane.wake_policies();
                }
                Event::Replica { id, dead: false } => {
                    plane.lock().replicas.live.insert(id);
                }
                Event::Replica { id, dead: true } => self.replica_died(plane, id),
                Event::Forward { target, .. } if target == me => self.spawn_forwarded(plane),
                Event::Answered { id, origin } if origin == me => self.spawn_answer(plane, id),
                Event::Forward { .. }
                | Event::Answered { .. }
                | Event::Resync
                | Event::Actor { .. }
                | Event::Atespaces
                | Event::Worker(_) => {}
            }
        }
        Ok(())
    }

    /// Applies records read again: rows newer than memory's replace them, and those
    /// read as gone (`complete`: every row was read) are forgotten unless this
    /// replica wrote them since the read began.
    fn apply_read(
        &self,
        plane: &Plane,
        reading: Reading,
        rows: Vec<(ActorKey, Option<ActorRow>)>,
        atespaces: Option<Vec<String>>,
        complete: bool,
    ) {
        let (freed, evict) = {
            let mut st = plane.lock();
            let touched = st.replicas.reads.remove(&reading.id).unwrap_or_default();
            let mut freed = Vec::new();
            let mut evict = Vec::new();
            let mut seen = HashSet::new();
            for (key, row) in rows {
                seen.insert(key.clone());
                // Written here during the read (the read may predate it), or being
                // written now (its own result applies; read again once it ends).
                if touched.actors.contains(&key) {
                    continue;
                }
                if st.replicas.writing.contains_key(&key) {
                    st.replicas.skipped.insert(key);
                    continue;
                }
                let cached = st.records.get(&key);
                // Newer: a later version, or another actor of the same name (deleted
                // and created again, its versions counting from 1 anew).
                let newer = |row: &ActorRow| {
                    cached.is_none_or(|c| c.uid != row.uid || c.version < row.version)
                };
                match row {
                    Some(row) if newer(&row) => {
                        // A worker of this replica that the record no longer places
                        // the actor on must not go on hosting it.
                        if let Some(w) = cached.and_then(|c| c.worker.clone())
                            && row.worker.as_ref() != Some(&w)
                            && st.workers.contains(&w)
                        {
                            evict.push((w, key.clone(), row.clone()));
                        }
                        freed.extend(st.apply(&Batch::put([row])));
                    }
                    None if cached.is_some() => {
                        freed.extend(st.apply(&Batch {
                            delete_actors: vec![key],
                            ..Batch::default()
                        }));
                    }
                    _ => {}
                }
            }
            if complete {
                let gone: Vec<ActorKey> = st
                    .records
                    .keys()
                    .filter(|k| {
                        !seen.contains(*k)
                            && !touched.actors.contains(*k)
                            && !st.replicas.writing.contains_key(*k)
                    })
                    .cloned()
                    .collect();
                if !gone.is_empty() {
                    freed.extend(st.apply(&Batch {
                        delete_actors: gone,
                        ..Batch::default()
                    }));
                }
            }
            if let Some(names) = atespaces {
                let kept: Vec<String> = st
                    .records
                    .atespaces()
                    .filter(|a| touched.atespaces.contains(*a))
                    .cloned()
                    .collect();
                st.records.read_atespaces(names, kept);
            }
            (freed, evict)
        };
        for (worker, key, row) in evict {
            tracing::warn!(actor = %key, worker, "another replica moved the actor off this replica's worker; evicting it there");
            plane.lock().workers.evict(&worker, &key, &row);
        }
        plane.ledger().hand_off_all(freed);
    }

    /// A worker's attachment as recorded now (`None`: it is attached nowhere).
    fn apply_worker(&self, plane: &Plane, id: &str, row: Option<WorkerRow>) {
        let moved = {
            let mut st = plane.lock();
            let me = st.replicas.me;
            match row {
                Some(r) if Some(r.replica) == me => {
                    st.replicas.workers.remove(id);
                    None
                }
                // A read older than what is known (an attachment here, or elsewhere,
                // recorded later): nothing changes.
                Some(r)
                    if st.workers.get(id).is_some_and(|w| w.attach() >= r.attach)
                        || st
                            .replicas
                            .workers
                            .get(id)
                            .is_some_and(|w| w.attach > r.attach) =>
                {
                    None
                }
                Some(r) => {
                    let pool = r.pool.clone();
                    st.replicas.workers.insert(id.to_owned(), r);
                    // It attached to another replica after it attached here: its
                    // stream here is stale. Its actor went with it, so it leaves here
                    // without a departure, and what it did here is that replica's now.
                    let moved = st.workers.remove(id).map(|rec| Arc::clone(rec.link()));
                    if moved.is_some() {
                        tracing::info!(worker = id, %pool, "worker attached to another replica");
                        let on_it: Vec<ActorKey> = st.records.on(id).map(ActorRow::key).collect();
                        for k in on_it {
                            st.signals.stopped(&k);
                        }
                    }
                    moved
                }
                None => {
                    st.replicas.workers.remove(id);
                    None
                }
            }
        };
        if let Some(link) = moved {
            link.end(Status::aborted(
                "the worker attached to another control-plane replica",
            ));
        }
        plane.wake_policies();
    }

    /// A resume queued (on any replica): a free worker here goes to the oldest waiter.
    fn waiter_added(&self, plane: &Plane, row: WaiterRow) {
        let pool = row.pool.clone();
        {
            let mut st = plane.lock();
            st.replicas.waiters_seen += 1;
            let seen = st.replicas.waiters_seen;
            st.replicas.added.insert(row.seq, seen);
            st.replicas.waiting.insert(row.seq, row);
        }
        plane.capacity().offer_free(&pool);
        plane.wake_policies();
    }

    /// A waiter left the queue. One of this replica's that another replica handed a
    /// worker to (its actor is restored there), or that left without one, is told so:
    /// its resume answers from the record. (Found by its actor: the announcement may
    /// come before the waiter here learned its row's `seq`.)
    fn waiter_gone(
        &self,
        plane: &Plane,
        seq: i64,
        actor: &ActorKey,
        pool: &str,
        handed_by: Option<i64>,
    ) {
        let waiter = {
            let mut st = plane.lock();
            st.replicas.waiting.remove(&seq);
            st.replicas.added.remove(&seq);
            if handed_by.is_some() && handed_by == st.replicas.me {
                None
            } else {
                st.waiters.take(pool, seq, actor)
            }
        };
        if let Some(w) = waiter {
            w.hand(Handed::Elsewhere {
                queued: false,
                on: Arc::new(self.clone()),
            });
        }
    }

    /// Replica `id` was declared dead: its workers re-attach elsewhere (until they
    /// do, an actor on one may run elsewhere only once its hosting lease passed);
    /// what its operations held is settled as an operation left half-way; its
    /// RUNNING actors are released unless their worker re-attaches in time.
    fn replica_died(&self, plane: &Plane, id: i64) {
        let lease = plane.config().hosting_lease;
        let orphans = {
            let mut st = plane.lock();
            if !st.replicas.live.remove(&id) {
                return;
            }
            st.replicas.waiting.retain(|_, w| w.replica != id);
            let known = &mut st.replicas;
            known.added.retain(|seq, _| known.waiting.contains_key(seq));
            let workers: Vec<WorkerRow> = st
                .replicas
                .workers
                .values()
                .filter(|w| w.replica == id)
                .cloned()
                .collect();
            let mut orphans = Vec::new();
            for w in workers {
                st.replicas.workers.remove(&w.id);
                let Ok(app) = w.app_address.parse() else {
                    continue;
                };
                let departure = Departure::unseen(
                    st.id(),
                    app,
                    Instant::now() + lease,
                    u64::from_ne_bytes(w.incarnation.to_ne_bytes()),
                );
                st.workers.orphaned(&w.id, departure.clone());
                let running: Vec<ActorKey> = st
                    .records
                    .values()
                    .filter(|r| {
                        r.worker.as_deref() == Some(w.id.as_str())
                            && r.status == ActorStatus::Running
                    })
                    .map(ActorRow::key)
                    .collect();
                for key in running {
                    orphans.push((w.id.clone(), key, departure.clone()));
                }
            }
            orphans
        };
        tracing::warn!(
            replica = id,
            actors_on_its_workers = orphans.len(),
            "a replica was declared dead; its workers attach elsewhere, what it left half-way is settled"
        );
        plane.inner.unsettled.notify_one();
        // Stopping: the next replica to look settles them.
        if plane.is_shutting_down() {
            return;
        }
        for (worker, key, departure) in orphans {
            super::release::Release::orphan(plane, worker, key, departure);
        }
        plane.wake_policies();
    }

    /// Declares replicas silent for [`crate::replica_store::DEAD_AFTER`] dead, every
    /// heartbeat, until the plane stops.
    async fn watch_replicas(&self) {
        let store = Arc::clone(&self.store);
        let mut tick = tokio::time::interval(crate::postgres::HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.unfollow.cancelled() => return,
            }
            let Ok(silent) = store.silent().await else {
                continue;
            };
            for id in silent {
                match store.declare_dead(id, false).await {
                    Ok(true) => tracing::warn!(
                        replica = id,
                        after = ?crate::replica_store::DEAD_AFTER,
                        "declared a silent replica dead"
                    ),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(replica = id, error = %e, "could not declare a silent replica dead")
                    }
                }
            }
        }
    }

    /// Reads everything again (after a reconnect, or having fallen behind) and makes
    /// memory agree with it.
    async fn resync(&self, plane: &Plane, store: &Arc<ReplicaStore>) -> Result<(), StoreError> {
        let reading = Reading::start(plane);
        let (view, atespaces, actors) = store.snapshot().await?;
        let rows = actors.into_iter().map(|r| (r.key(), Some(r))).collect();
        self.apply_read(plane, reading, rows, Some(atespaces), true);
        let me = store.replica();
        let (died, pools, moved) = {
            let mut st = plane.lock();
            let live: BTreeSet<i64> = view.live.iter().copied().chain([me]).collect();
            let died: Vec<i64> = st.replicas.live.difference(&live).copied().collect();
            st.replicas.live.extend(live);
            st.replicas.waiting = view.waiting_by_seq();
            let known = &mut st.replicas;
            known.added.retain(|seq, _| known.waiting.contains_key(seq));
            // Waiters of this replica whose rows went while it did not listen.
            let vanished = st
                .waiters
                .vanished(|seq| view.waiters.iter().any(|w| w.seq == seq));
            let pools: BTreeSet<String> = st
                .replicas
                .waiting
                .values()
                .map(|w| w.pool.clone())
                .collect();
            (died, pools, vanished)
        };
        for w in moved {
            w.hand(Handed::Elsewhere {
                queued: false,
                on: Arc::new(self.clone()),
            });
        }
        // Rows of this replica that no waiter here owns (a delete that failed): out.
        let orphaned: Vec<i64> = {
            let st = plane.lock();
            view.waiters
                .iter()
                .filter(|w| w.replica == me)
                .filter(|w| !st.waiters.has(&w.pool, &w.actor))
                .map(|w| w.seq)
                .collect()
        };
        for seq in orphaned {
            plane.capacity().dequeue(seq);
        }
        for w in &view.workers {
            self.apply_worker(plane, &w.id, Some(w.clone()));
        }
        {
            let mut st = plane.lock();
            let attached: HashSet<&str> = view.workers.iter().map(|w| w.id.as_str()).collect();
            st.replicas
                .workers
                .retain(|id, _| attached.contains(id.as_str()));
        }
        for id in died {
            // Not yet dead here: marked live above so that the death is handled.
            self.replica_died(plane, id);
        }
        for pool in pools {
            plane.capacity().offer_free(&pool);
        }
        self.spawn_forwarded(plane);
        let waiting: Vec<i64> = plane.lock().replicas.forwards.keys().copied().collect();
        for id in waiting {
            self.spawn_answer(plane, id);
        }
        Ok(())
    }

    /// Writes this replica's waiters into the queue the replicas share, and takes
    /// out those that left, in their order here (those that came together in one
    /// transaction), until the plane stops: a pool's order across replicas follows
    /// each one's arrivals, and a row that left always goes before the same actor
    /// queues again. A waiter whose actor is queued on another replica already is
    /// handed [`Handed::Elsewhere`]; one whose resume left meanwhile has its row taken
    /// out.
    async fn write_queue(&self, plane: &Plane, mut writes: mpsc::UnboundedReceiver<QueueWrite>) {
        let store = Arc::clone(&self.store);
        loop {
            let first = tokio::select! {
                w = writes.recv() => w,
                () = self.unfollow.cancelled() => return,
            };
            let Some(first) = first else { return };
            let mut batch = vec![first];
            while batch.len() < 256
                && let Ok(w) = writes.try_recv()
            {
                batch.push(w);
            }
            let ops: Vec<QueueOp> = batch
                .iter()
                .map(|w| match w {
                    QueueWrite::Insert { pool, actor, .. } => QueueOp::Insert {
                        actor: actor.clone(),
                        pool: pool.clone(),
                    },
                    QueueWrite::Delete { seq } => QueueOp::Delete { seq: *seq },
                })
                .collect();
            let written = store.queue(&ops).await;
            if let Err(e) = &written {
                tracing::warn!(error = %e, "could not write the shared queue; its deletions are tried again");
                let deletes: Vec<i64> = batch
                    .iter()
                    .filter_map(|w| match w {
                        QueueWrite::Delete { seq } => Some(*seq),
                        QueueWrite::Insert { .. } => None,
                    })
                    .collect();
                if !deletes.is_empty() {
                    let (this, plane) = (self.clone(), plane.clone());
                    self.followers.spawn(async move {
                        tokio::select! {
                            () = tokio::time::sleep(OFFER_AGAIN * 5) => {}
                            () = this.unfollow.cancelled() => return,
                        }
                        for seq in deletes {
                            this.dequeue(&plane, seq);
                        }
                    });
                }
            }
            let mut pools = BTreeSet::new();
            for (i, w) in batch.into_iter().enumerate() {
                let QueueWrite::Insert { pool, id, .. } = w else {
                    continue;
                };
                let written = match &written {
                    Ok(done) => Ok(done[i]),
                    Err(e) => Err(super::db_error(e)),
                };
                let mut st = plane.lock();
                match written {
                    // (The replicas' list of waiters follows the announcements, which
                    // come in the order of the writes: one that went already is not
                    // put back.)
                    Ok(Some(seq)) => {
                        if st.waiters.written(&pool, id, seq) {
                            pools.insert(pool);
                        } else {
                            // Its resume left while the row was written: the row goes
                            // too.
                            drop(st);
                            self.dequeue(plane, seq);
                        }
                    }
                    Ok(None) => {
                        let w = st.waiters.remove(&pool, id);
                        drop(st);
                        if let Some(w) = w {
                            w.hand(Handed::Elsewhere {
                                queued: true,
                                on: Arc::new(self.clone()),
                            });
                        }
                    }
                    Err(e) => {
                        let w = st.waiters.remove(&pool, id);
                        drop(st);
                        if let Some(w) = w {
                            w.hand(Handed::Failed(e));
                        }
                    }
                }
            }
            for pool in pools {
                // A worker free here goes to the oldest waiter, maybe one of these.
                plane.capacity().offer_free(&pool);
            }
            plane.wake_policies();
        }
    }

    /// Carries out the suspends forwarded to this replica not answered yet.
    fn spawn_forwarded(&self, plane: &Plane) {
        let store = Arc::clone(&self.store);
        let (this, plane) = (self.clone(), plane.clone());
        self.followers.spawn(async move {
            let pending = match store.forwarded_to_me().await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %e, "could not read the suspends forwarded to this replica");
                    return;
                }
            };
            for (id, key) in pending {
                if !plane.lock().replicas.executing.insert(id) {
                    continue;
                }
                let (plane, store) = (plane.clone(), Arc::clone(&store));
                this.followers.clone().spawn(async move {
                    let answer = encode(&super::checkpoint::Checkpoint::suspend(&plane, key).await);
                    let mut backoff = valet_net::Backoff::new(OFFER_AGAIN);
                    for _ in 0..4 {
                        match store.answer(id, answer.clone()).await {
                            Ok(()) => {
                                // Kept a while: a listing read before the answer was
                                // written may name it still.
                                let mut st = plane.lock();
                                st.replicas.carried_out.push_back(id);
                                if st.replicas.carried_out.len() > CARRIED_OUT_KEPT
                                    && let Some(old) = st.replicas.carried_out.pop_front()
                                {
                                    st.replicas.executing.remove(&old);
                                }
                                return;
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "could not answer a forwarded suspend; trying again");
                                tokio::time::sleep(backoff.next_delay()).await;
                            }
                        }
                    }
                    // Left in `executing`: never carried out twice (its caller gets
                    // `Unavailable` when its wait ends).
                });
            }
        });
    }

    /// Takes the answer of this replica's forwarded suspend `id` and hands it to the
    /// call waiting for it.
    fn spawn_answer(&self, plane: &Plane, id: i64) {
        let store = Arc::clone(&self.store);
        let plane = plane.clone();
        self.followers.spawn(async move {
            if let Ok(Some(answer)) = store.take_answer(id).await {
                let mut st = plane.lock();
                match st.replicas.forwards.remove(&id) {
                    Some(tx) => {
                        let _ = tx.send(answer);
                    }
                    // Its caller has not waited yet: it finds the answer here.
                    None => {
                        st.replicas.answers.insert(id, answer);
                    }
                }
            }
        });
    }

    /// Suspends `key`, RUNNING on a worker attached to replica `replica`, there: the
    /// request goes to that replica and its answer is awaited, up to
    /// `--checkpoint-timeout` and a margin (past it, `Unavailable`).
    pub(super) async fn forward_suspend(
        &self,
        plane: &Plane,
        replica: i64,
        key: &ActorKey,
    ) -> Result<ateapi::Actor, Status> {
        let store = Arc::clone(&self.store);
        let id = store
            .forward_suspend(replica, key)
            .await
            .map_err(|e| super::db_error(&e))?;
        let (tx, rx) = oneshot::channel();
        {
            let mut st = plane.lock();
            // Its answer may have come before the wait was registered.
            if let Some(answer) = st.replicas.answers.remove(&id) {
                return decode(answer);
            }
            st.replicas.forwards.insert(id, tx);
        }
        self.spawn_answer(plane, id);
        let within = plane.config().checkpoint_timeout + MARGIN;
        let answer = tokio::select! {
            a = rx => a.ok(),
            () = tokio::time::sleep(within) => None,
            () = plane.inner.shutdown.cancelled() => None,
        };
        {
            let mut st = plane.lock();
            st.replicas.forwards.remove(&id);
            st.replicas.answers.remove(&id);
        }
        match answer {
            Some(a) => decode(a),
            None => {
                let _ = store.withdraw(id).await;
                Err(Status::unavailable(format!(
                    "the replica actor {key}'s worker is attached to did not answer the suspend; try again"
                )))
            }
        }
    }

    /// Offers free `worker` (attached here) to the queue the replicas share: the
    /// oldest waiter of its pool gets it; a waiter here as a reservation, one on
    /// another replica by this replica claiming its actor on the worker and restoring
    /// it. Nobody waiting: it is free again (and offered again if a waiter came
    /// meanwhile).
    pub(super) fn offer(&self, plane: &Plane, worker: &str) {
        let store = Arc::clone(&self.store);
        // Stopping: it claims no other replica's waiter any more.
        if plane.is_shutting_down() {
            return;
        }
        let pool = {
            let mut st = plane.lock();
            let queued = |st: &super::State, pool: &str| {
                st.replicas.queued_in(pool) || st.waiters.any_live(pool)
            };
            let Some(w) = st.workers.get(worker) else {
                return;
            };
            if *w.slot() != Slot::Free || !w.is_open() || !queued(&st, w.pool()) {
                return;
            }
            let Some(pool) = st.workers.offer(worker) else {
                return;
            };
            pool
        };
        let (this, plane2) = (self.clone(), plane.clone());
        let worker = worker.to_owned();
        plane.inner.tasks.spawn(async move {
            this.offer_to_queue(&plane2, &store, &worker, &pool).await;
        });
    }

    async fn offer_to_queue(&self, plane: &Plane, store: &ReplicaStore, worker: &str, pool: &str) {
        loop {
            let taker = plane.clone();
            let take = move |key: &ActorKey| {
                let mut st = taker.lock();
                let ready =
                    st.records.get(key).is_some_and(|r| {
                        r.status == ActorStatus::Suspended && !st.held_elsewhere(r)
                    }) && st.busy(key).is_none();
                ready.then(|| {
                    Op::take(
                        &taker,
                        &mut st,
                        OpTarget::Actor(key.clone()),
                        OpKind::Busy("restoring for a waiter"),
                    )
                })
            };
            let seen = plane.lock().replicas.waiters_seen;
            let handed = store.hand_off(pool, worker, take).await;
            /// What to do once the state lock is released.
            enum Then {
                Done,
                Again,
                Hand(super::queues::Waiter, super::capacity::Reservation),
                Requeue(super::queues::Waiter),
                Later(Duration),
                Restore(Box<(WaiterRow, ActorRow, Op)>),
            }
            let then = {
                let mut st = plane.lock();
                let offered = st.workers.is_offered(worker);
                match handed {
                    Ok(HandOff::Nobody(present)) => {
                        // The pool's waiters memory lists that the database no longer
                        // has (heard before this offer) are gone.
                        let known = &mut st.replicas;
                        let added = &known.added;
                        known.waiting.retain(|seq, w| {
                            w.pool != pool
                                || present.contains(seq)
                                || added.get(seq).is_some_and(|&at| at > seen)
                        });
                        known.added.retain(|seq, _| known.waiting.contains_key(seq));
                        if !offered {
                            Then::Done
                        } else if st.replicas.waiters_seen != seen {
                            // A waiter came meanwhile: it is offered the worker too.
                            Then::Again
                        } else {
                            st.workers.withdraw(worker);
                            // Waiters it could not be given (busy here, or being
                            // handed a worker by another replica whose hand-off may
                            // yet fail): offered again a moment later.
                            if present.is_empty() {
                                Then::Done
                            } else {
                                Then::Later(OFFER_AGAIN)
                            }
                        }
                    }
                    Ok(HandOff::NotHere) => {
                        st.workers.withdraw(worker);
                        Then::Done
                    }
                    Ok(HandOff::Local(waiter)) => {
                        let local = st.waiters.take(pool, waiter.seq, &waiter.actor);
                        match local {
                            // It left meanwhile: the next one.
                            None => Then::Again,
                            // The worker is no longer this offer's (it left, or attached
                            // again): the waiter queues again, its row being gone.
                            Some(local) if !offered => Then::Requeue(local),
                            Some(local) => {
                                let reservation =
                                    plane.capacity().reserve(&mut st, worker, &waiter.actor);
                                Then::Hand(local, reservation)
                            }
                        }
                    }
                    Ok(HandOff::Claimed(waiter, row, op)) => {
                        let freed = st.apply(&Batch::put([(*row).clone()]));
                        debug_assert!(freed.is_empty());
                        Then::Restore(Box::new((waiter, *row, op)))
                    }
                    Err(e) => {
                        tracing::warn!(worker, %pool, error = %e, "could not hand a free worker to the queue; offering it again shortly");
                        st.workers.withdraw(worker);
                        Then::Later(OFFER_AGAIN * 5)
                    }
                }
            };
            match then {
                Then::Done => return,
                Then::Again => {}
                Then::Requeue(local) => {
                    local.hand(Handed::Elsewhere {
                        queued: false,
                        on: Arc::new(self.clone()),
                    });
                    return;
                }
                Then::Later(after) => {
                    tokio::select! {
                        () = tokio::time::sleep(after) => {}
                        () = plane.inner.shutdown.cancelled() => return,
                    }
                    // Still free and someone still queued (`offer` checks both).
                    self.offer(plane, worker);
                    return;
                }
                Then::Hand(local, reservation) => {
                    plane.capacity().handed_off();
                    // A waiter that left just now drops the reservation unused, which
                    // passes the worker on.
                    local.hand(Handed::Worker(reservation));
                    return;
                }
                Then::Restore(claimed) => {
                    let (waiter, row, op) = *claimed;
                    plane.capacity().handed_off();
                    plane
                        .inner
                        .stats
                        .activations
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::info!(actor = %waiter.actor, worker, waiter_replica = waiter.replica, "restoring an actor for a waiter on another replica");
                    let (tx, _) = watch::channel(None);
                    let restore = super::activation::Restore {
                        plane: plane.clone(),
                        op,
                        key: waiter.actor.clone(),
                        claimed: row,
                    };
                    let _ = restore.run(&tx, Instant::now()).await;
                    return;
                }
            }
        }
    }

    /// For a resume whose actor another replica restores (it handed one of its
    /// workers to this replica's waiter), or that waits in a queue on another replica:
    /// the outcome once the record shows it, waiting while the actor is RESUMING
    /// there (up to `--restore-timeout` and a margin) or queued there (while the
    /// callers wait: `capacity` says it is queued, so those past their own deadline
    /// leave).
    pub(super) async fn observe(
        &self,
        plane: &Plane,
        key: &ActorKey,
        queued_elsewhere: bool,
        capacity: &watch::Sender<CapacityWait>,
        tx: &watch::Sender<Option<Outcome>>,
    ) -> Observed {
        let lease = plane.config().hosting_lease;
        let bound = Instant::now() + plane.config().restore_timeout + MARGIN;
        // Queued on another replica: until its announcement is followed here, the
        // actor looks suspended and queued nowhere.
        let mut announced_by = queued_elsewhere.then(|| Instant::now() + ANNOUNCED_WITHIN);
        let mut changes = plane.inner.changed.subscribe();
        loop {
            changes.mark_unchanged();
            let (verdict, queued) = {
                let st = plane.lock();
                match st.records.get(key) {
                    None => (Some(done(Err(not_found(key)))), false),
                    Some(r) => match r.status {
                        ActorStatus::Running if st.serving(r, lease) => {
                            (Some(done(Ok((st.to_proto(r), true)))), false)
                        }
                        ActorStatus::Crashed => (Some(done(Err(crashed()))), false),
                        ActorStatus::Suspended if st.replicas.queued(key) => {
                            announced_by = None;
                            (None, true)
                        }
                        ActorStatus::Suspended
                            if announced_by.is_some_and(|t| Instant::now() < t) =>
                        {
                            (None, false)
                        }
                        ActorStatus::Suspended => {
                            let waits = capacity.borrow().until.is_some_and(|u| u > Instant::now());
                            let v = if waits {
                                Observed::Again
                            } else {
                                done(Err(Status::unavailable(format!(
                                    "the resume of actor {key} on another control-plane replica ended without it; try again"
                                ))))
                            };
                            (Some(v), false)
                        }
                        _ => (None, false),
                    },
                }
            };
            capacity.send_if_modified(|c| std::mem::replace(&mut c.queued, queued) != queued);
            if let Some(v) = verdict {
                capacity.send_if_modified(|c| std::mem::take(&mut c.queued));
                return v;
            }
            let until = if queued {
                capacity.borrow().until.map_or(bound, |u| u.max(bound))
            } else {
                announced_by.map_or(bound, |t| t.min(bound))
            };
            tokio::select! {
                r = changes.changed() => {
                    if r.is_err() {
                        return done(Err(shutting_down()));
                    }
                }
                () = tokio::time::sleep_until(until) => {
                    if announced_by.is_some_and(|t| t <= until) {
                        // Not announced after all: look again (it is gone, or here).
                        announced_by = None;
                        continue;
                    }
                    capacity.send_if_modified(|c| std::mem::take(&mut c.queued));
                    return done(Err(if queued {
                        super::no_room()
                    } else {
                        Status::unavailable(format!(
                            "the resume of actor {key} on another control-plane replica did not finish in time; try again"
                        ))
                    }));
                }
                () = tx.closed() => return done(Err(shutting_down())),
                () = plane.inner.shutdown.cancelled() => return done(Err(shutting_down())),
            }
        }
    }

    /// Reads the records `batch` wrote again (another replica changed one of them).
    pub(super) fn refresh(&self, plane: &Plane, batch: &Batch) {
        let store = Arc::clone(&self.store);
        let keys: Vec<ActorKey> = batch
            .put_actors
            .iter()
            .map(ActorRow::key)
            .chain(batch.delete_actors.iter().cloned())
            .collect();
        let atespaces = !batch.put_atespaces.is_empty() || !batch.delete_atespaces.is_empty();
        let (this, plane) = (self.clone(), plane.clone());
        self.followers.spawn(async move {
            if let Err(e) = this.read_again(&plane, &store, &keys, atespaces).await {
                tracing::debug!(error = %e, "could not read changed records again; the next announcement or resync does");
            }
        });
    }

    /// Reads `keys` (and the atespaces, with `atespaces`) again and applies them.
    async fn read_again(
        &self,
        plane: &Plane,
        store: &ReplicaStore,
        keys: &[ActorKey],
        atespaces: bool,
    ) -> Result<(), StoreError> {
        if keys.is_empty() && !atespaces {
            return Ok(());
        }
        let reading = Reading::start(plane);
        let rows = if keys.is_empty() {
            Vec::new()
        } else {
            store.actors(keys).await?
        };
        let names = if atespaces {
            Some(store.atespaces().await?)
        } else {
            None
        };
        self.apply_read(plane, reading, rows, names, false);
        Ok(())
    }

    /// The replica `worker` is attached to, when it is another live one.
    pub(super) fn replica_of(&self, plane: &Plane, worker: &str) -> Option<i64> {
        let st = plane.lock();
        st.replicas
            .workers
            .get(worker)
            .map(|w| w.replica)
            .filter(|r| st.replicas.live.contains(r))
    }
}

/// A worker's attachment recorded in the database that is undone when dropped,
/// unless kept (its Join was refused after all, or its call was dropped).
struct Unrecorded {
    replicas: Replicas,
    id: String,
    attach: Option<i64>,
}

impl Unrecorded {
    fn keep(mut self) {
        self.attach = None;
    }
}

impl Drop for Unrecorded {
    fn drop(&mut self) {
        let Some(attach) = self.attach else {
            return;
        };
        // Leaving altogether: its leaving takes every attachment of it out.
        if self.replicas.unfollow.is_cancelled() {
            return;
        }
        let id = std::mem::take(&mut self.id);
        let store = Arc::clone(&self.replicas.store);
        self.replicas.spawn(async move {
            if let Err(e) = store.detach_worker(&id, attach).await {
                tracing::warn!(worker = id, error = %e, "could not undo a refused worker's attachment");
            }
        });
    }
}

impl Replicas {
    /// A worker attached (or re-attached) over its stream: joined as
    /// [`super::membership::Membership::worker_joined`] does once its attachment is recorded (after the Join
    /// is checked, and undone when it is refused after all or this call is dropped):
    /// refused when another process holds its id on another live replica.
    pub(super) async fn attach(
        &self,
        plane: &Plane,
        join: &wk::Join,
        link: Arc<WorkerLink>,
    ) -> Result<bool, Status> {
        if plane.is_shutting_down() {
            return Err(shutting_down());
        }
        let (_, hosting) = super::membership::Join::read(join)?;
        // The actor it reports: kept only if the record has it RUNNING there when
        // the attachment is written (a release built from it elsewhere then fails).
        super::membership::Join::refuse_duplicate(plane, &plane.lock(), join)?;
        let keep = hosting;
        let row = WorkerRow {
            id: join.worker_id.clone(),
            pool: join.pool.clone(),
            app_address: join.app_address.clone(),
            replica: self.store.replica(),
            incarnation: i64::from_ne_bytes(join.incarnation.to_ne_bytes()),
            leaving: join.draining,
            attach: 0,
        };
        let (attach, kept) = match self.store.attach_worker(&row, keep.as_ref()).await {
            Ok(Some(attached)) => attached,
            Ok(None) => {
                return Err(Status::already_exists(format!(
                    "worker id {} is attached by another live process on another control-plane replica; give each worker its own --worker-id",
                    crate::model::shown(&join.worker_id)
                )));
            }
            Err(e) => return Err(super::db_error(&e)),
        };
        let undo = Unrecorded {
            replicas: self.clone(),
            id: join.worker_id.clone(),
            attach: Some(attach),
        };
        let veto = {
            let mut st = plane.lock();
            match kept {
                Some(row) => {
                    let freed = st.apply(&Batch::put([row]));
                    debug_assert!(freed.is_empty());
                    false
                }
                // Not kept by the record. Unless it is SUSPENDING with its checkpoint
                // (an operation of this replica) waiting for this attach: only that
                // operation changes its record, so memory decides (below). Before,
                // such a worker was told to drop the actor, and the checkpoint lost
                // the actor's state since its last snapshot.
                None => keep.as_ref().is_some_and(|k| !st.workers.awaited(k)),
            }
        };
        let joined = super::membership::Join {
            plane,
            join,
            link,
            veto,
            attach,
        }
        .run();
        if joined.is_ok() {
            undo.keep();
        }
        joined
    }

    /// `worker` drains: recorded, in the background.
    pub(super) fn worker_draining(&self, worker: &str) {
        let (store, worker) = (Arc::clone(&self.store), worker.to_owned());
        self.spawn(async move {
            if let Err(e) = store.worker_leaving(&worker).await {
                tracing::warn!(worker, error = %e, "could not record that the worker drains");
            }
        });
    }

    /// `worker`'s attachment `attach` ended: recorded, in the background.
    pub(super) fn worker_left(&self, worker: &str, attach: i64) {
        let (store, worker) = (Arc::clone(&self.store), worker.to_owned());
        self.spawn(async move {
            if let Err(e) = store.detach_worker(&worker, attach).await {
                tracing::warn!(worker, error = %e, "could not record that the worker left");
            }
        });
    }

    /// For releases of `rows` (the records they were built from) refused because a
    /// record changed: the records that still place their actor RUNNING on the same
    /// worker, that worker not attached to another replica, to release again. `None`
    /// when there is nothing to do again (shutting down, or the database not
    /// answering).
    pub(super) async fn releases_still_due(
        &self,
        plane: &Plane,
        rows: &[ActorRow],
    ) -> Option<Vec<ActorRow>> {
        if plane.is_shutting_down() {
            return None;
        }
        let store = &self.store;
        let keys: Vec<ActorKey> = rows.iter().map(ActorRow::key).collect();
        let now = store.actors(&keys).await.ok()?;
        let mut again = Vec::new();
        for (was, (_, row)) in rows.iter().zip(now) {
            let Some(row) = row else { continue };
            if row.uid != was.uid
                || row.status != ActorStatus::Running
                || row.worker.is_none()
                || row.worker != was.worker
            {
                continue;
            }
            let w = row.worker.clone().unwrap_or_default();
            let elsewhere = store
                .worker(&w)
                .await
                .ok()?
                .is_some_and(|a| a.replica != store.replica());
            if !elsewhere {
                again.push(row);
            }
        }
        Some(again)
    }

    /// A waiter here (entry `id`) queued `actor` for a worker of `pool`: written by
    /// one task, in the order of arrival here (`seq` follows it).
    pub(super) fn queued(&self, pool: &str, actor: &ActorKey, id: u64) {
        let _ = self.queue.send(QueueWrite::Insert {
            pool: pool.to_owned(),
            actor: actor.clone(),
            id,
        });
    }

    /// Takes this replica's waiter `seq` out of the queue the replicas share, in the
    /// background (its resume no longer waits), by the task that writes the queue,
    /// after this replica's earlier changes of it. A row a hand-off took already
    /// stays taken.
    pub(super) fn dequeue(&self, plane: &Plane, seq: i64) {
        plane.lock().replicas.waiting.remove(&seq);
        let _ = self.queue.send(QueueWrite::Delete { seq });
    }

    /// An eviction in `pool` serves one waiter, claimed in the queue the replicas
    /// share, so that two replicas never evict for the same one (a router that polls
    /// instead of waiting is this replica's own demand).
    pub(super) async fn claim_eviction(
        &self,
        plane: &Plane,
        key: &ActorKey,
        pool: &str,
    ) -> super::peers::Claim {
        use super::peers::Claim;
        match self.store.claim_eviction(pool).await {
            Ok(Some(seq)) => Claim::Waiter(seq),
            Ok(None) if plane.lock().refused_demand(pool) > 0 => Claim::Own,
            Ok(None) => Claim::Nobody,
            Err(e) => {
                tracing::warn!(actor = %key, error = %e, "could not claim a waiter to evict for");
                Claim::Nobody
            }
        }
    }

    /// The eviction that claimed waiter `seq` ended.
    pub(super) async fn release_eviction(&self, plane: &Plane, seq: i64) {
        if let Err(e) = self.store.release_eviction(seq).await {
            tracing::debug!(seq, error = %e, "could not release an eviction's claim");
        }
        if let Some(w) = plane.lock().replicas.waiting.get_mut(&seq) {
            w.evicting = None;
        }
    }
}

impl Peers for Replicas {
    fn attach<'a>(
        &'a self,
        plane: &'a Plane,
        join: &'a wk::Join,
        link: Arc<WorkerLink>,
    ) -> Boxed<'a, Option<Result<bool, Status>>> {
        Box::pin(async move { Some(Replicas::attach(self, plane, join, link).await) })
    }

    fn worker_draining(&self, worker: &str) {
        Replicas::worker_draining(self, worker);
    }

    fn worker_left(&self, worker: &str, attach: i64) {
        Replicas::worker_left(self, worker, attach);
    }

    fn releases_still_due<'a>(
        &'a self,
        plane: &'a Plane,
        rows: &'a [ActorRow],
    ) -> Boxed<'a, Option<Vec<ActorRow>>> {
        Box::pin(Replicas::releases_still_due(self, plane, rows))
    }

    fn queued(&self, pool: &str, actor: &ActorKey, id: u64) {
        Replicas::queued(self, pool, actor, id);
    }

    fn dequeue(&self, plane: &Plane, seq: i64) {
        Replicas::dequeue(self, plane, seq);
    }

    fn offer(&self, plane: &Plane, worker: &str) -> bool {
        Replicas::offer(self, plane, worker);
        true
    }

    fn claim_eviction<'a>(
        &'a self,
        plane: &'a Plane,
        key: &'a ActorKey,
        pool: &'a str,
    ) -> Boxed<'a, Claim> {
        Box::pin(Replicas::claim_eviction(self, plane, key, pool))
    }

    fn release_eviction<'a>(&'a self, plane: &'a Plane, seq: i64) -> Boxed<'a, ()> {
        Box::pin(Replicas::release_eviction(self, plane, seq))
    }

    fn writing(&self, plane: &Plane, batch: &Batch) -> Option<Box<dyn Send>> {
        Some(Box::new(Writing::start(self, plane, batch)))
    }

    fn changed_elsewhere(&self, plane: &Plane, batch: &Batch) {
        self.refresh(plane, batch);
    }

    fn suspend_elsewhere<'a>(
        &'a self,
        plane: &'a Plane,
        key: &'a ActorKey,
        worker: &'a str,
    ) -> Boxed<'a, Option<Result<ateapi::Actor, Status>>> {
        Box::pin(async move {
            let replica = self.replica_of(plane, worker)?;
            Some(self.forward_suspend(plane, replica, key).await)
        })
    }

    fn unfollow(&self) -> Boxed<'_, ()> {
        Box::pin(Replicas::unfollow(self))
    }
}

impl Elsewhere for Replicas {
    fn observe<'a>(
        &'a self,
        plane: &'a Plane,
        key: &'a ActorKey,
        queued: bool,
        capacity: &'a watch::Sender<CapacityWait>,
        tx: &'a watch::Sender<Option<Outcome>>,
    ) -> Boxed<'a, Observed> {
        Box::pin(Replicas::observe(self, plane, key, queued, capacity, tx))
    }
}
