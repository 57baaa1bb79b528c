//! The reference control plane's state machine, in three layers.
//!
//! **Books** own the state, each the only one to change its part, under the plane's
//! one state lock ([`State`], whose fields are private to this module):
//! - [`records`]: atespaces and actor records, memory's copy of the store;
//! - [`workers`]: attached workers, their slots (the one place a slot changes), the
//!   departed that may still serve, and checkpoints awaiting a re-attach;
//! - [`queues`]: the first-come capacity queues per pool;
//! - [`locks`]: the operation locks, taken and released by [`Op`] only;
//! - [`signals`]: activity reports and recent refusals (the policies' inputs);
//! - [`wait`]: a resume's capacity wait, shared by its callers;
//! - [`leases`]' `LeaseBook`: routers' watches and route leases;
//! - `replicas::known`: what this replica knows of the others.
//!
//! **The ledger** ([`ledger`]) orders every step of every operation: the durable
//! write, then memory, then the operation's lock, then freed workers handed to the
//! oldest waiters. Nothing is applied unless the write was durable.
//!
//! **Operations** that span books are types whose one method holds the order of their
//! steps: [`activation::Activation`] and [`activation::Restore`],
//! [`checkpoint::Checkpoint`], [`settle::Settle`], [`release::Release`],
//! [`membership`]'s `Join` and `Drain`, [`lifecycle`]'s `Revert`, [`policy`]'s
//! `PolicyCheckpoint`; [`fencing`] says when a worker can no
//! longer serve. The plane's calls are grouped on [`Plane`] (resume, suspend, revert,
//! observation, shutdown) and its handles: [`Plane::catalog`], [`Plane::membership`],
//! [`Plane::leases`], [`Plane::policies`], and inside the crate `capacity()` and
//! `ledger()`.
//!
//! **Peers** ([`peers`]): the one seam to the control planes sharing the records, a
//! trait chosen once at startup ([`open`]): `Alone`, or [`replicas`] on one PostgreSQL
//! database. [`open`] and [`stop`] start and end the plane's chores.
//!
//! Calls between these modules have no cycles (`tools/plane-calls.py` checks it): this
//! module calls only the books, and the books nothing else in the plane; operations
//! call the ledger, `capacity`, the books and the operations below them (a drain
//! suspends through a checkpoint, a replica restores through `Restore`).

mod activation;
mod capacity;
mod catalog;
mod checkpoint;
mod fencing;
mod leases;
mod ledger;
mod lifecycle;
mod locks;
mod membership;
mod op;
mod open;
mod peers;
mod policy;
mod queues;
mod records;
mod release;
mod replicas;
mod settle;
mod signals;
mod stop;
mod wait;
mod workers;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use valet_proto::ateapi;

use crate::metrics::PlaneMetrics;
use crate::model::{self, ActorKey, ActorStatus, NAMESPACE, Template};
use crate::store::{ActorRow, Batch, Store, StoreError};

pub use leases::WatchTx;
pub(crate) use op::{Op, OpKind, OpTarget};
pub(crate) use workers::{Slot, WorkerRec, Workers, slot_of};

/// Largest `ListActors` page; bigger requests are clamped.
pub const MAX_PAGE_SIZE: usize = 1000;
/// `ListActors` page size when none is asked.
pub const DEFAULT_PAGE_SIZE: usize = 100;

/// How the control plane behaves.
#[derive(Debug, Clone)]
pub struct PlaneConfig {
    /// Honour `wait_for_capacity` (`--capacity-wait`); off behaves like a server
    /// without the extension.
    pub capacity_wait: bool,
    /// Known templates (the `counter` and `echo` templates are always there).
    pub templates: Vec<Template>,
    /// How long a worker may take to restore an actor.
    pub restore_timeout: Duration,
    /// How long a worker may take to checkpoint an actor.
    pub checkpoint_timeout: Duration,
    /// After a restart, how long a RUNNING actor's worker has to re-attach before the
    /// actor is released to SUSPENDED.
    pub rejoin_grace: Duration,
    /// Suspend an actor idle this long (`--idle-suspend-after`); zero: never.
    pub idle_suspend_after: Duration,
    /// While actors wait for a full pool, evict its least recently active actors idle
    /// at least this long (`--evict-idle-after`); zero: never.
    pub evict_idle_after: Duration,
    /// The route lease granted on `ResumeActor` answers (`--route-lease`); zero: none.
    pub route_lease: Duration,
    /// How long a worker may go without an answered renewal before it fences its
    /// actor, and how long after its last renewal its actor may run elsewhere
    /// (`--hosting-lease`).
    pub hosting_lease: Duration,
}

/// Default `--route-lease`.
pub const DEFAULT_ROUTE_LEASE: Duration = Duration::from_secs(5);
/// Default `--hosting-lease`.
pub const DEFAULT_HOSTING_LEASE: Duration = Duration::from_secs(15);

/// Default `--restore-timeout` and `--checkpoint-timeout`.
pub const DEFAULT_WORKER_TIMEOUT: Duration = Duration::from_secs(60);
/// Default `--rejoin-grace`.
pub const DEFAULT_REJOIN_GRACE: Duration = Duration::from_secs(10);
/// Default `--shutdown-timeout`.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

impl PlaneConfig {
    /// Whether its templates' programs fit its timeouts: a program's start within a
    /// restore's time, its stop (and the wait for its requests) within a checkpoint's.
    ///
    /// # Errors
    /// The first template that does not, naming it, its setting and the flag.
    pub fn check_templates(&self) -> Result<(), String> {
        // What a worker may spend besides: a restore waits for a stale program to die
        // (5 s for its lock, 5 s for its kill); a stop, for SIGKILL to take (5 s).
        const RESTORE_EXTRA: Duration = Duration::from_secs(10);
        const STOP_EXTRA: Duration = Duration::from_secs(5);
        for t in &self.templates {
            let Some(p) = t.program() else { continue };
            if p.start_timeout + RESTORE_EXTRA >= self.restore_timeout {
                return Err(format!(
                    "template {}: start_timeout {:?} must be below --restore-timeout {:?} less {RESTORE_EXTRA:?} (a restore may first wait that long for a program left running to die)",
                    t.name(),
                    p.start_timeout,
                    self.restore_timeout
                ));
            }
            // An explicit suspend waits half the checkpoint timeout for requests.
            if p.stop_grace + STOP_EXTRA >= self.checkpoint_timeout / 2 {
                return Err(format!(
                    "template {}: stop_grace {:?} must be below half --checkpoint-timeout ({:?}) less {STOP_EXTRA:?}: the other half waits for the actor's requests in flight, and SIGKILL may take that long",
                    t.name(),
                    p.stop_grace,
                    self.checkpoint_timeout / 2
                ));
            }
        }
        Ok(())
    }
}

impl Default for PlaneConfig {
    fn default() -> Self {
        Self {
            capacity_wait: true,
            templates: vec![Template::counter()],
            restore_timeout: DEFAULT_WORKER_TIMEOUT,
            checkpoint_timeout: DEFAULT_WORKER_TIMEOUT,
            rejoin_grace: DEFAULT_REJOIN_GRACE,
            idle_suspend_after: Duration::ZERO,
            evict_idle_after: Duration::ZERO,
            route_lease: DEFAULT_ROUTE_LEASE,
            hosting_lease: DEFAULT_HOSTING_LEASE,
        }
    }
}

/// Counters of the control plane's own work, for tests and benchmarks.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    resume_calls: AtomicU64,
    activations: AtomicU64,
    handoffs: AtomicU64,
    queued: AtomicU64,
    attachments: AtomicU64,
    per_actor: Mutex<HashMap<ActorKey, u64>>,
}

/// A copy of the plane's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// `ResumeActor` calls received.
    pub resume_calls: u64,
    /// Resumes that restored an actor on a worker.
    pub activations: u64,
    /// Workers handed to a capacity waiter the moment they freed.
    pub handoffs: u64,
    /// Resumes that waited in a capacity queue.
    pub queued: u64,
    /// Worker streams the plane accepted (a worker that attaches again counts again).
    pub attachments: u64,
}

/// What a resume comes to: the actor and whether this call activated it.
pub(crate) type Outcome = Result<(ateapi::Actor, bool), Status>;

#[derive(Debug, Default)]
pub(crate) struct State {
    /// Atespaces and actor records (memory's copy of the store).
    records: records::Records,
    /// The operation locks held.
    ops: locks::Ops,
    /// The workers attached here, their slots, and those departed.
    workers: Workers,
    /// The capacity queues.
    waiters: queues::Waiters,
    /// The last id handed out (operations, waiters, departures).
    next_id: u64,
    /// What the policies read: activity and refusals.
    signals: signals::Signals,
    /// Routers' watches and the route leases of every actor.
    leases: leases::LeaseBook,
    /// Several replicas on one database: what this one knows of the others.
    replicas: replicas::Known,
}

impl State {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Whether `row`'s worker is attached and renewing its hosting: a worker silent for
    /// half its hosting lease may have fenced the actor already (it fences at the whole
    /// lease, counted from a renewal it sent no later), so nothing is routed there.
    pub(crate) fn serving(&self, row: &ActorRow, hosting_lease: Duration) -> bool {
        let Some(worker) = row.worker.as_ref() else {
            return false;
        };
        match self.workers.get(worker) {
            Some(w) => w.last_renewal().elapsed() < hosting_lease / 2,
            // Attached to another live replica, which renews its hosting.
            None => self.replicas.attached_elsewhere(worker),
        }
    }

    /// Whether another live replica's operation holds `row` (several replicas).
    pub(crate) fn held_elsewhere(&self, row: &ActorRow) -> bool {
        self.replicas.held_by_other(row.op_replica)
    }

    pub(crate) fn busy(&self, key: &ActorKey) -> Option<&OpKind> {
        self.ops.holder(&OpTarget::Actor(key.clone()))
    }

    /// The actor as the wire shows it: its worker's address only while RUNNING.
    pub(crate) fn to_proto(&self, row: &ActorRow) -> ateapi::Actor {
        let worker = row.worker.as_ref().and_then(|id| {
            self.workers
                .get(id)
                .map(WorkerRec::app_addr)
                .or_else(|| self.replicas.remote_address(id))
                .map(|addr| (id, addr))
        });
        let running = row.status == ActorStatus::Running;
        let (pod, ip, port) = match worker {
            Some((id, addr)) if running => {
                (id.clone(), addr.ip().to_string(), u32::from(addr.port()))
            }
            Some((id, _)) => (id.clone(), String::new(), 0),
            None => (row.worker.clone().unwrap_or_default(), String::new(), 0),
        };
        ateapi::Actor {
            actor_id: row.name.clone(),
            version: row.version,
            actor_template_namespace: row.template_namespace.clone(),
            actor_template_name: row.template.clone(),
            status: row.status.wire(),
            ateom_pod_namespace: if pod.is_empty() {
                String::new()
            } else {
                NAMESPACE.into()
            },
            ateom_pod_name: pod,
            ateom_pod_ip: ip,
            ateom_pod_uid: row.uid.clone(),
            worker_selector: Some(ateapi::Selector {
                match_labels: row.selector.iter().cloned().collect(),
            }),
            worker_pool_name: row.pool.clone(),
            atespace: row.atespace.clone(),
            worker_port: port,
            idle_for: self
                .signals
                .activity(&row.key())
                .filter(|a| running && a.in_flight == 0)
                .and_then(|a| a.since.elapsed().try_into().ok()),
            busy: running
                && self
                    .signals
                    .activity(&row.key())
                    .is_some_and(|a| a.in_flight > 0),
            status_reason: row.reason.clone(),
        }
    }

    /// Applies a durable batch to memory; returns the workers it freed. The one place
    /// worker slots follow actor rows.
    fn apply(&mut self, batch: &Batch) -> Vec<String> {
        let mut freed = Vec::new();
        self.replicas.written(batch);
        for name in &batch.put_atespaces {
            self.records.put_atespace(name);
        }
        for row in &batch.put_actors {
            let key = row.key();
            // Several replicas: a newer record of the same actor may be in memory
            // already (another replica wrote after this one).
            if self
                .records
                .get(&key)
                .is_some_and(|r| r.uid == row.uid && r.version > row.version)
            {
                continue;
            }
            if !matches!(row.status, ActorStatus::Running | ActorStatus::Suspending) {
                self.signals.stopped(&key);
            }
            let before = self.records.put(row.clone());
            if before != row.worker {
                if let Some(w) = before
                    && self.workers.release(&w, &key)
                {
                    freed.push(w);
                }
                if let Some(w) = &row.worker {
                    self.workers.host(w, &key);
                }
            }
        }
        for key in &batch.delete_actors {
            self.signals.forget(key);
            if let Some(w) = self.records.delete(key)
                && self.workers.release(&w, key)
            {
                freed.push(w);
            }
        }
        for name in &batch.delete_atespaces {
            self.records.delete_atespace(name);
        }
        freed
    }
}

/// The reference control plane. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Plane {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    state: Mutex<State>,
    /// Bumped whenever the state changes, so observers wait without polling.
    changed: watch::Sender<u64>,
    store: Arc<dyn Store>,
    config: PlaneConfig,
    templates: HashMap<String, Template>,
    stats: Stats,
    metrics: PlaneMetrics,
    /// Operations, activations and releases: shutdown waits for them.
    tasks: TaskTracker,
    /// Background chores (the rejoin grace): shutdown cancels them.
    chores: TaskTracker,
    /// The readers of workers' attach streams: they end with the streams.
    links: TaskTracker,
    /// Cancelled when the plane shuts down.
    shutdown: CancellationToken,
    /// Wakes the policies (idle suspension, eviction) when their inputs change.
    policy: tokio::sync::Notify,
    /// Woken by a failed write: an operation may have left an actor half-way (see
    /// [`settle::Settle::spawn_settler`]).
    unsettled: tokio::sync::Notify,
    /// Until when leases granted before this start may still be held: nothing moves
    /// before then (the start itself on a fresh store: none can be).
    leases_unknown_until: tokio::time::Instant,
    /// Until when a worker that has not attached since this start may still serve an
    /// actor the records place on it (it fences at its hosting lease, counted from a
    /// renewal before the start).
    workers_unknown_until: tokio::time::Instant,
    /// Who else writes its records: nobody, or other replicas on one database.
    peers: Box<dyn peers::Peers>,
}

/// A failed write changed nothing: `Unavailable`, so that a router parks the request
/// and retries (on this replica once the database answers again, or on another).
fn db_error(e: &StoreError) -> Status {
    tracing::error!(error = %e, "database write failed");
    Status::unavailable("control-plane database write failed")
}

fn shutting_down() -> Status {
    Status::unavailable("the control plane is shutting down")
}

impl Plane {
    pub(crate) fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            guard: Some(self.inner.state.lock().unwrap_or_else(|e| e.into_inner())),
            dirty: false,
            changed: &self.inner.changed,
        }
    }

    pub(crate) fn config(&self) -> &PlaneConfig {
        &self.inner.config
    }

    /// The route lease it grants (`--route-lease`).
    pub fn route_lease(&self) -> Duration {
        self.inner.config.route_lease
    }

    /// The hosting lease of its workers (`--hosting-lease`).
    pub fn hosting_lease(&self) -> Duration {
        self.inner.config.hosting_lease
    }

    pub(crate) fn template(&self, name: &str) -> Option<&Template> {
        self.inner.templates.get(name)
    }

    pub(crate) fn metrics(&self) -> &PlaneMetrics {
        &self.inner.metrics
    }

    /// The plane's `/metrics` text.
    pub fn render_metrics(&self) -> String {
        let (pools, waiters) = {
            let st = self.lock();
            let mut pools: BTreeMap<String, (usize, usize)> = BTreeMap::new();
            for (_, w) in st.workers.iter() {
                let e = pools.entry(w.pool().to_owned()).or_default();
                e.0 += 1;
                if *w.slot() == Slot::Free {
                    e.1 += 1;
                }
            }
            let waiters = st.waiters.live_by_pool();
            (pools, waiters)
        };
        self.inner.metrics.render(&pools, &waiters)
    }

    /// Whether its database answers now (`/readyz`).
    ///
    /// # Errors
    /// The database's error.
    pub async fn database_ready(&self) -> Result<(), StoreError> {
        self.inner.store.ping().await
    }

    /// Whether the plane has begun shutting down.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutdown.is_cancelled()
    }

    /// Runs a mutating operation detached on the plane's task tracker and waits for its
    /// result: a caller that goes away (deadline, reset) never cuts it short, so it
    /// finishes or rolls back as a unit.
    pub(crate) async fn detached<T, F>(&self, op: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, Status>> + Send + 'static,
    {
        if self.is_shutting_down() {
            return Err(shutting_down());
        }
        let (tx, rx) = oneshot::channel();
        self.inner.tasks.spawn(async move {
            let _ = tx.send(op.await);
        });
        rx.await
            .unwrap_or_else(|_| Err(Status::internal("operation ended without a result")))
    }

    /// Re-evaluates the policies now (idle suspension, eviction).
    pub(crate) fn wake_policies(&self) {
        self.inner.policy.notify_one();
    }

    /// Waits until `cond` holds, re-checking whenever the state changes; false if
    /// `timeout` passes first.
    pub async fn wait_until(&self, timeout: Duration, cond: impl Fn(&Plane) -> bool) -> bool {
        let mut changes = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            changes.mark_unchanged();
            if cond(self) {
                return true;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return cond(self),
            }
        }
    }

    /// The status of an actor now, if it exists.
    pub fn status_of(&self, atespace: &str, name: &str) -> Option<ateapi::actor::Status> {
        let key = ActorKey::new(atespace, name).ok()?;
        let st = self.lock();
        st.records
            .get(&key)
            .and_then(|r| ateapi::actor::Status::try_from(r.status.wire()).ok())
    }

    /// Whether a checkpoint of `atespace/name` waits for its worker to attach again.
    pub fn checkpoint_awaits_worker(&self, atespace: &str, name: &str) -> bool {
        ActorKey::new(atespace, name).is_ok_and(|k| self.lock().workers.awaited(&k))
    }

    /// Whether an operation holds `atespace/name` now.
    pub fn is_busy(&self, atespace: &str, name: &str) -> bool {
        ActorKey::new(atespace, name)
            .ok()
            .is_some_and(|k| self.lock().busy(&k).is_some())
    }

    /// Operations in progress now, on actors and atespaces.
    pub fn operations_in_progress(&self) -> usize {
        self.lock().ops.len()
    }

    /// Counters of the plane's own work.
    pub fn stats(&self) -> StatsSnapshot {
        let s = &self.inner.stats;
        StatsSnapshot {
            resume_calls: s.resume_calls.load(Ordering::Relaxed),
            activations: s.activations.load(Ordering::Relaxed),
            handoffs: s.handoffs.load(Ordering::Relaxed),
            queued: s.queued.load(Ordering::Relaxed),
            attachments: s.attachments.load(Ordering::Relaxed),
        }
    }

    /// Drops a deleted actor's count: a new actor of its name starts from zero, and
    /// deleted actors keep nothing in memory.
    pub(crate) fn forget_resume_calls(&self, key: &ActorKey) {
        self.inner
            .stats
            .per_actor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }

    /// `ResumeActor` calls received for one actor.
    pub fn resume_calls_for(&self, atespace: &str, name: &str) -> u64 {
        let Ok(key) = ActorKey::new(atespace, name) else {
            return 0;
        };
        let per = self
            .inner
            .stats
            .per_actor
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        per.get(&key).copied().unwrap_or(0)
    }

    /// Capacity waiters queued in `pool` now.
    pub fn waiters(&self, pool: &str) -> usize {
        self.lock().waiters.live(pool)
    }

    /// Workers attached to `pool` now, and how many of them are free.
    pub fn pool(&self, pool: &str) -> (usize, usize) {
        let st = self.lock();
        (
            st.workers.pool_size(pool),
            st.workers.all_free_in(pool).len(),
        )
    }

    /// Runs the reader of a worker's attach stream; it ends with the stream.
    pub(crate) fn spawn_link(&self, reader: impl Future<Output = ()> + Send + 'static) {
        self.inner.links.spawn(reader);
    }
}

/// The state lock; on release after a mutation it tells [`Plane::wait_until`]
/// observers. No `.await` while it is held.
pub(crate) struct StateGuard<'a> {
    guard: Option<MutexGuard<'a, State>>,
    dirty: bool,
    changed: &'a watch::Sender<u64>,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.guard.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.dirty = true;
        self.guard.as_mut().expect("held until drop")
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        // Release the state first, then wake observers.
        drop(self.guard.take());
        if self.dirty {
            self.changed.send_modify(|v| *v += 1);
        }
    }
}

pub(crate) use model::{aborted, crashed, no_room, not_found};

/// How long a shutdown waits at least for the work it does for other replicas
/// (forwarded suspends' answers) once its operations ended.
const UNFOLLOW_GRACE: Duration = Duration::from_secs(1);

/// The waits between tries of a write to the store, or of a read of it, that must land
/// (0.5 s doubling to 5 s): a database restart takes seconds.
pub fn store_backoff() -> valet_net::Backoff {
    valet_net::Backoff::new(Duration::from_millis(500)).cap(Duration::from_secs(5))
}
