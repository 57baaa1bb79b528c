//! The reference control plane's state machine: atespaces, actors, pools of workers,
//! per-actor operation locks and the first-come capacity queues.
//!
//! Memory is the working copy; the [`Store`] is the record. Every change is written to
//! the store before the RPC that made it returns, and a worker is handed to another
//! actor only after the change that released it is durable, so the database never
//! shows one worker assigned twice. The state lock is a plain mutex, never held across
//! an `.await`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio_util::task::TaskTracker;
use tonic::Status;
use valet_proto::ateapi;
use valet_proto::ateapi::actor::Status as S;
use valet_proto::worker::{self as wk, worker_command::Command};

use crate::link::{LinkError, WorkerLink};
use crate::model::{self, ActorKey, NAMESPACE, Template, status_name};
use crate::store::{ActorRow, Store, StoreError};

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
    /// Known templates (the `counter` template is always there).
    pub templates: Vec<Template>,
    /// How long a worker may take to restore an actor.
    pub restore_timeout: Duration,
    /// How long a worker may take to checkpoint an actor.
    pub checkpoint_timeout: Duration,
    /// After a restart, how long a RUNNING actor's worker has to re-attach before the
    /// actor is released to SUSPENDED.
    pub rejoin_grace: Duration,
}

impl Default for PlaneConfig {
    fn default() -> Self {
        Self {
            capacity_wait: true,
            templates: vec![Template::counter()],
            restore_timeout: Duration::from_secs(60),
            checkpoint_timeout: Duration::from_secs(60),
            rejoin_grace: Duration::from_secs(10),
        }
    }
}

/// Counters of the control plane's own work, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct Stats {
    resume_calls: AtomicU64,
    activations: AtomicU64,
    handoffs: AtomicU64,
    queued: AtomicU64,
    per_actor: Mutex<HashMap<String, u64>>,
}

/// A copy of [`Stats`].
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
}

type Outcome = Result<(ateapi::Actor, bool), Status>;

/// What holds an actor's operation lock.
#[derive(Debug)]
enum Op {
    /// An operation that refuses others with `Aborted` (or, for resumes in progress,
    /// a revert with `FailedPrecondition`).
    Busy(&'static str),
    /// A resume waiting in its pool's queue; later resumes join it.
    Waiting(Arc<watch::Sender<Option<Outcome>>>),
}

#[derive(Debug)]
struct WorkerRec {
    pool: String,
    app_addr: SocketAddr,
    actor: Option<ActorKey>,
    link: Arc<WorkerLink>,
}

#[derive(Debug)]
struct Queued {
    id: u64,
    actor: ActorKey,
    handoff: oneshot::Sender<String>,
}

#[derive(Debug, Default)]
struct State {
    atespaces: BTreeSet<String>,
    creating_atespaces: HashSet<String>,
    actors: BTreeMap<ActorKey, ActorRow>,
    ops: HashMap<ActorKey, Op>,
    workers: BTreeMap<String, WorkerRec>,
    queues: HashMap<String, VecDeque<Queued>>,
    next_waiter: u64,
}

/// The reference control plane. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Plane {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// Bumped whenever the state changes, so observers wait without polling.
    changed: watch::Sender<u64>,
    store: Store,
    config: PlaneConfig,
    templates: HashMap<String, Template>,
    stats: Stats,
    tasks: TaskTracker,
}

fn key_of(row: &ActorRow) -> ActorKey {
    ActorKey::new(&row.atespace, &row.name).expect("stored names are valid")
}

fn slot(key: &ActorKey, row: &ActorRow) -> wk::ActorSlot {
    wk::ActorSlot {
        atespace: key.atespace().to_owned(),
        name: key.name().to_owned(),
        snapshot_key: format!("{}/{}/{}", key.atespace(), key.name(), row.uid),
    }
}

fn db_error(e: &StoreError) -> Status {
    tracing::error!(error = %e, "database write failed");
    Status::internal("control-plane database write failed")
}

impl State {
    fn free_worker(&self, pool: &str) -> Option<String> {
        self.workers
            .iter()
            .find(|(_, w)| w.pool == pool && w.actor.is_none())
            .map(|(id, _)| id.clone())
    }

    fn pool_size(&self, pool: &str) -> usize {
        self.workers.values().filter(|w| w.pool == pool).count()
    }

    /// Marks `worker` as claimed for `key`, which becomes RESUMING.
    fn claim(&mut self, worker: &str, key: &ActorKey) {
        if let Some(w) = self.workers.get_mut(worker) {
            w.actor = Some(key.clone());
        }
        if let Some(a) = self.actors.get_mut(key) {
            a.status = S::Resuming as i32;
            a.worker = Some(worker.to_owned());
            a.version += 1;
        }
    }

    /// Frees `worker` and hands it to the oldest live waiter of its pool at once.
    /// Returns whether a waiter got it.
    fn release(&mut self, worker: &str, stats: &Stats) -> bool {
        let Some(w) = self.workers.get_mut(worker) else {
            return false;
        };
        w.actor = None;
        let pool = w.pool.clone();
        let Some(queue) = self.queues.get_mut(&pool) else {
            return false;
        };
        while let Some(q) = queue.pop_front() {
            if q.handoff.send(worker.to_owned()).is_ok() {
                self.claim(worker, &q.actor);
                self.ops.insert(q.actor, Op::Busy("resuming"));
                stats.handoffs.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    fn to_proto(&self, row: &ActorRow) -> ateapi::Actor {
        let worker = row
            .worker
            .as_ref()
            .and_then(|id| self.workers.get(id).map(|w| (id, w)));
        let running = row.status == S::Running as i32;
        let (pod, ip, port) = match worker {
            Some((id, w)) if running => (
                id.clone(),
                w.app_addr.ip().to_string(),
                u32::from(w.app_addr.port()),
            ),
            Some((id, _)) => (id.clone(), String::new(), 0),
            None => (row.worker.clone().unwrap_or_default(), String::new(), 0),
        };
        ateapi::Actor {
            actor_id: row.name.clone(),
            version: row.version,
            actor_template_namespace: row.template_namespace.clone(),
            actor_template_name: row.template.clone(),
            status: row.status,
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
        }
    }
}

impl Plane {
    /// Opens the store, recovers from an unclean stop, and returns the plane.
    ///
    /// Recovery: actors left RESUMING or SUSPENDING go back to SUSPENDED from their
    /// last snapshot; RUNNING actors keep their worker for `rejoin_grace`, then go back
    /// to SUSPENDED if it has not re-attached.
    ///
    /// # Errors
    /// When the store cannot be read or written.
    pub async fn open(store: Store, config: PlaneConfig) -> Result<Self, StoreError> {
        let loaded = store.load()?;
        let mut templates: HashMap<String, Template> = config
            .templates
            .iter()
            .map(|t| (t.name().to_owned(), t.clone()))
            .collect();
        for builtin in [Template::counter(), Template::echo()] {
            templates
                .entry(builtin.name().to_owned())
                .or_insert(builtin);
        }

        let mut recovered = Vec::new();
        let mut state = State {
            atespaces: loaded.atespaces.into_iter().collect(),
            ..State::default()
        };
        for mut row in loaded.actors {
            if row.status == S::Resuming as i32 || row.status == S::Suspending as i32 {
                tracing::warn!(
                    actor = %key_of(&row),
                    was = status_name(row.status),
                    "recovered actor left mid-operation; back to SUSPENDED from its last snapshot"
                );
                row.status = S::Suspended as i32;
                row.worker = None;
                row.version += 1;
                recovered.push(row.clone());
            }
            state.actors.insert(key_of(&row), row);
        }
        store.put_actors(recovered).await?;

        let plane = Self {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                changed: watch::Sender::new(0),
                store,
                config,
                templates,
                stats: Stats::default(),
                tasks: TaskTracker::new(),
            }),
        };
        plane.spawn_rejoin_deadline();
        Ok(plane)
    }

    fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            guard: Some(self.inner.state.lock().unwrap_or_else(|e| e.into_inner())),
            dirty: false,
            changed: &self.inner.changed,
        }
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
    pub fn status_of(&self, atespace: &str, name: &str) -> Option<S> {
        let key = ActorKey::new(atespace, name).ok()?;
        let st = self.lock();
        st.actors.get(&key).and_then(|r| S::try_from(r.status).ok())
    }

    /// Counters of the plane's own work.
    pub fn stats(&self) -> StatsSnapshot {
        let s = &self.inner.stats;
        StatsSnapshot {
            resume_calls: s.resume_calls.load(Ordering::Relaxed),
            activations: s.activations.load(Ordering::Relaxed),
            handoffs: s.handoffs.load(Ordering::Relaxed),
            queued: s.queued.load(Ordering::Relaxed),
        }
    }

    /// `ResumeActor` calls received for one actor.
    pub fn resume_calls_for(&self, atespace: &str, name: &str) -> u64 {
        let per = self
            .inner
            .stats
            .per_actor
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        per.get(&format!("{atespace}/{name}")).copied().unwrap_or(0)
    }

    /// Capacity waiters queued in `pool` now.
    pub fn waiters(&self, pool: &str) -> usize {
        self.lock()
            .queues
            .get(pool)
            .map_or(0, |q| q.iter().filter(|w| !w.handoff.is_closed()).count())
    }

    /// Workers attached to `pool` now, and how many of them are free.
    pub fn pool(&self, pool: &str) -> (usize, usize) {
        let st = self.lock();
        let all = st.pool_size(pool);
        let free = st
            .workers
            .values()
            .filter(|w| w.pool == pool && w.actor.is_none())
            .count();
        (all, free)
    }

    /// Waits until every background task (activations, suspends) has ended.
    pub async fn close(&self) {
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    // ----- atespaces -----

    pub async fn create_atespace(&self, name: &str) -> Result<ateapi::Atespace, Status> {
        model::check_name("atespace", name)?;
        {
            let mut st = self.lock();
            if st.atespaces.contains(name) || !st.creating_atespaces.insert(name.to_owned()) {
                return Err(Status::already_exists(format!(
                    "atespace {name} already exists"
                )));
            }
        }
        let result = self.inner.store.put_atespace(name.to_owned()).await;
        let mut st = self.lock();
        st.creating_atespaces.remove(name);
        result.map_err(|e| db_error(&e))?;
        st.atespaces.insert(name.to_owned());
        Ok(ateapi::Atespace {
            name: name.to_owned(),
        })
    }

    pub fn get_atespace(&self, name: &str) -> Result<ateapi::Atespace, Status> {
        model::check_name("atespace", name)?;
        if self.lock().atespaces.contains(name) {
            Ok(ateapi::Atespace {
                name: name.to_owned(),
            })
        } else {
            Err(Status::not_found(format!("atespace {name} not found")))
        }
    }

    pub fn list_atespaces(&self) -> Vec<ateapi::Atespace> {
        self.lock()
            .atespaces
            .iter()
            .map(|n| ateapi::Atespace { name: n.clone() })
            .collect()
    }

    pub async fn delete_atespace(&self, name: &str) -> Result<(), Status> {
        model::check_name("atespace", name)?;
        {
            let st = self.lock();
            if !st.atespaces.contains(name) {
                return Err(Status::not_found(format!("atespace {name} not found")));
            }
            if st.actors.keys().any(|k| k.atespace() == name) {
                return Err(Status::failed_precondition(format!(
                    "atespace {name} still has actors; delete them first"
                )));
            }
        }
        self.inner
            .store
            .delete_atespace(name.to_owned())
            .await
            .map_err(|e| db_error(&e))?;
        self.lock().atespaces.remove(name);
        Ok(())
    }

    // ----- actors -----

    pub async fn create_actor(
        &self,
        key: ActorKey,
        template_namespace: &str,
        template_name: &str,
        selector: Vec<(String, String)>,
    ) -> Result<ateapi::Actor, Status> {
        let template = self.inner.templates.get(template_name).ok_or_else(|| {
            Status::failed_precondition(format!(
                "ActorTemplate {template_namespace}/{template_name} not found"
            ))
        })?;
        let row = ActorRow {
            atespace: key.atespace().to_owned(),
            name: key.name().to_owned(),
            uid: format!("{:016x}", rand::random::<u64>()),
            template_namespace: template_namespace.to_owned(),
            template: template.name().to_owned(),
            pool: template.pool().to_owned(),
            status: S::Suspended as i32,
            version: 1,
            worker: None,
            selector,
            revert_pending: false,
        };
        {
            let mut st = self.lock();
            if !st.atespaces.contains(key.atespace()) {
                return Err(Status::failed_precondition(format!(
                    "atespace {} not found; create it first",
                    key.atespace()
                )));
            }
            if st.actors.contains_key(&key) || st.ops.contains_key(&key) {
                return Err(Status::already_exists(format!(
                    "actor {key} already exists"
                )));
            }
            st.ops.insert(key.clone(), Op::Busy("creating"));
        }
        self.commit(key, row).await
    }

    /// Writes `row` for `key`, whose operation lock the caller holds; only once it is
    /// durable does it become visible, and the lock is released either way.
    async fn commit(&self, key: ActorKey, row: ActorRow) -> Result<ateapi::Actor, Status> {
        let result = self.inner.store.put_actor(row.clone()).await;
        let mut st = self.lock();
        st.ops.remove(&key);
        result.map_err(|e| db_error(&e))?;
        let proto = st.to_proto(&row);
        st.actors.insert(key, row);
        Ok(proto)
    }

    pub fn get_actor(&self, key: &ActorKey) -> Result<ateapi::Actor, Status> {
        let st = self.lock();
        let row = st.actors.get(key).ok_or_else(|| model::not_found(key))?;
        Ok(st.to_proto(row))
    }

    /// One page of actors, ordered by `atespace/name`; `page_size` is clamped to
    /// [`MAX_PAGE_SIZE`].
    pub fn list_actors(
        &self,
        atespace: &str,
        page_size: i32,
        page_token: &str,
    ) -> Result<(Vec<ateapi::Actor>, String), Status> {
        if !atespace.is_empty() {
            model::check_name("atespace", atespace)?;
        }
        let size = match usize::try_from(page_size) {
            Ok(0) | Err(_) => DEFAULT_PAGE_SIZE,
            Ok(n) => n.min(MAX_PAGE_SIZE),
        };
        let after = if page_token.is_empty() {
            None
        } else {
            let (a, n) = page_token
                .split_once('/')
                .ok_or_else(|| Status::invalid_argument("invalid page_token"))?;
            Some(ActorKey::new(a, n).map_err(|_| Status::invalid_argument("invalid page_token"))?)
        };
        let st = self.lock();
        let mut page = Vec::with_capacity(size.min(st.actors.len()));
        let mut last = None;
        let mut more = false;
        let range = match &after {
            Some(k) => st.actors.range((
                std::ops::Bound::Excluded(k.clone()),
                std::ops::Bound::Unbounded,
            )),
            None => st.actors.range(..),
        };
        for (k, row) in range {
            if !atespace.is_empty() && k.atespace() != atespace {
                continue;
            }
            if page.len() == size {
                more = true;
                break;
            }
            page.push(st.to_proto(row));
            last = Some(k.clone());
        }
        let token = match (more, last) {
            (true, Some(k)) => k.to_string(),
            _ => String::new(),
        };
        Ok((page, token))
    }

    /// `ResumeActor`: see `control-plane.md`. Returns the actor and whether this call
    /// did the activation.
    pub async fn resume_actor(
        &self,
        key: ActorKey,
        wait_for_capacity: Option<Duration>,
    ) -> Result<(ateapi::Actor, bool), Status> {
        let stats = &self.inner.stats;
        stats.resume_calls.fetch_add(1, Ordering::Relaxed);
        *stats
            .per_actor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.to_string())
            .or_default() += 1;
        self.inner.changed.send_modify(|v| *v += 1);
        let wait = wait_for_capacity.filter(|d| !d.is_zero() && self.inner.config.capacity_wait);

        let mut outcome = {
            let mut st = self.lock();
            let row = st.actors.get(&key).ok_or_else(|| model::not_found(&key))?;
            if let Some(op) = st.ops.get(&key) {
                match op {
                    Op::Waiting(tx) => tx.subscribe(),
                    Op::Busy(_) => return Err(model::aborted()),
                }
            } else if row.status == S::Running as i32 {
                let connected = row
                    .worker
                    .as_ref()
                    .is_some_and(|w| st.workers.contains_key(w));
                if !connected {
                    return Err(Status::unavailable(format!(
                        "the worker of actor {key} has not re-attached yet"
                    )));
                }
                return Ok((st.to_proto(row), false));
            } else if row.status == S::Crashed as i32 {
                return Err(model::crashed());
            } else {
                let pool = row.pool.clone();
                let tx = Arc::new(watch::Sender::new(None));
                let rx = tx.subscribe();
                let start = match st.free_worker(&pool) {
                    Some(worker) => {
                        st.claim(&worker, &key);
                        st.ops.insert(key.clone(), Op::Busy("resuming"));
                        Start::Claimed(worker)
                    }
                    None => {
                        let Some(wait) = wait else {
                            return Err(model::no_room());
                        };
                        let id = st.next_waiter;
                        st.next_waiter += 1;
                        let (handoff, handoff_rx) = oneshot::channel();
                        st.queues.entry(pool).or_default().push_back(Queued {
                            id,
                            actor: key.clone(),
                            handoff,
                        });
                        st.ops.insert(key.clone(), Op::Waiting(Arc::clone(&tx)));
                        self.inner.stats.queued.fetch_add(1, Ordering::Relaxed);
                        Start::Queued {
                            id,
                            rx: handoff_rx,
                            wait,
                        }
                    }
                };
                drop(st);
                self.spawn_activation(key.clone(), start, tx);
                rx
            }
        };
        let result = outcome
            .wait_for(Option::is_some)
            .await
            .map(|o| o.clone().expect("waited for Some"));
        match result {
            Ok(o) => o,
            Err(_) => Err(Status::internal("resume ended without a result")),
        }
    }

    fn spawn_activation(
        &self,
        key: ActorKey,
        start: Start,
        tx: Arc<watch::Sender<Option<Outcome>>>,
    ) {
        let plane = self.clone();
        self.inner.tasks.spawn(async move {
            let outcome = plane.activate(&key, start, &tx).await;
            if let Some(outcome) = outcome {
                tx.send_replace(Some(outcome));
            }
        });
    }

    /// Runs one activation: wait for a worker if queued, then restore. Returns `None`
    /// when every client left the queue before a worker came.
    async fn activate(
        &self,
        key: &ActorKey,
        start: Start,
        tx: &watch::Sender<Option<Outcome>>,
    ) -> Option<Outcome> {
        let worker = match start {
            Start::Claimed(worker) => worker,
            Start::Queued { id, mut rx, wait } => {
                let got = tokio::select! {
                    w = &mut rx => w.ok(),
                    () = tokio::time::sleep(wait) => None,
                    () = tx.closed() => None,
                };
                match got {
                    Some(w) => w,
                    None => {
                        let mut st = self.lock();
                        let queued = st.queues.values_mut().find_map(|q| {
                            q.iter().position(|w| w.id == id).map(|pos| q.remove(pos))
                        });
                        if queued.is_some() {
                            st.ops.remove(key);
                            return Some(Err(model::no_room()));
                        }
                        drop(st);
                        // Handed a worker just as the wait ended: use it.
                        rx.try_recv().ok()?
                    }
                }
            }
        };
        self.inner.stats.activations.fetch_add(1, Ordering::Relaxed);
        Some(self.restore_on(key, &worker).await)
    }

    /// Restores `key` on the `worker` claimed for it (the actor is RESUMING).
    async fn restore_on(&self, key: &ActorKey, worker: &str) -> Outcome {
        let (row, link) = {
            let st = self.lock();
            let row = st.actors.get(key).cloned().expect("claimed actors exist");
            let link = st.workers.get(worker).map(|w| Arc::clone(&w.link));
            (row, link)
        };
        let store = &self.inner.store;
        if let Err(e) = store.put_actor(row.clone()).await {
            self.back_to_suspended(key, worker, &row).await;
            return Err(db_error(&e));
        }
        let result = match link {
            Some(link) => {
                let app = self
                    .inner
                    .templates
                    .get(&row.template)
                    .map_or("counter", Template::app)
                    .to_owned();
                let cmd = Command::Restore(wk::Restore {
                    actor: Some(slot(key, &row)),
                    revert: row.revert_pending,
                    app,
                });
                link.call(cmd, self.inner.config.restore_timeout).await
            }
            None => Err(LinkError::Gone),
        };
        match result {
            Ok(()) => {
                let mut running = row;
                running.status = S::Running as i32;
                running.revert_pending = false;
                running.version += 1;
                if let Err(e) = store.put_actor(running.clone()).await {
                    self.back_to_suspended(key, worker, &running).await;
                    return Err(db_error(&e));
                }
                let mut st = self.lock();
                let proto = st.to_proto(&running);
                st.actors.insert(key.clone(), running);
                st.ops.remove(key);
                tracing::info!(actor = %key, worker, "actor RUNNING");
                Ok((proto, true))
            }
            Err(LinkError::Gone) => {
                tracing::warn!(actor = %key, worker, "worker went away during restore");
                self.back_to_suspended(key, worker, &row).await;
                Err(Status::unavailable(format!(
                    "the worker restoring actor {key} went away"
                )))
            }
            Err(e) => {
                tracing::warn!(actor = %key, worker, error = %e, "restore failed; actor CRASHED");
                let mut crashed = row;
                crashed.status = S::Crashed as i32;
                crashed.worker = None;
                crashed.version += 1;
                let persisted = store.put_actor(crashed.clone()).await;
                let mut st = self.lock();
                if let Some(w) = st.workers.get(worker) {
                    w.link.notify(Command::Evict(wk::Evict {
                        actor: Some(slot(key, &crashed)),
                    }));
                }
                st.actors.insert(key.clone(), crashed);
                st.ops.remove(key);
                st.release(worker, &self.inner.stats);
                persisted.map_err(|e| db_error(&e))?;
                Err(model::crashed())
            }
        }
    }

    /// Puts `key` back to SUSPENDED (from its last snapshot), frees `worker` if it is
    /// still attached, and drops the actor's operation lock.
    async fn back_to_suspended(&self, key: &ActorKey, worker: &str, row: &ActorRow) {
        let mut back = row.clone();
        back.status = S::Suspended as i32;
        back.worker = None;
        back.version += 1;
        if let Err(e) = self.inner.store.put_actor(back.clone()).await {
            db_error(&e);
        }
        let mut st = self.lock();
        st.actors.insert(key.clone(), back);
        st.ops.remove(key);
        if st
            .workers
            .get(worker)
            .is_some_and(|w| w.actor.as_ref() == Some(key))
        {
            st.release(worker, &self.inner.stats);
        }
    }

    /// `SuspendActor`: RUNNING → SUSPENDING → checkpoint → SUSPENDED, freeing the worker
    /// (a capacity event). A suspended actor is left as it is.
    pub async fn suspend_actor(&self, key: ActorKey) -> Result<ateapi::Actor, Status> {
        let (row, worker, link) = {
            let mut st = self.lock();
            let row = st
                .actors
                .get(&key)
                .ok_or_else(|| model::not_found(&key))?
                .clone();
            if st.ops.contains_key(&key) {
                return Err(model::aborted());
            }
            match S::try_from(row.status) {
                Ok(S::Suspended) => return Ok(st.to_proto(&row)),
                Ok(S::Running) => {}
                _ => {
                    return Err(Status::failed_precondition(format!(
                        "actor {key} is {}; only RUNNING actors can be suspended",
                        status_name(row.status)
                    )));
                }
            }
            let worker = row.worker.clone().unwrap_or_default();
            let link = st.workers.get(&worker).map(|w| Arc::clone(&w.link));
            st.ops.insert(key.clone(), Op::Busy("suspending"));
            if let Some(a) = st.actors.get_mut(&key) {
                a.status = S::Suspending as i32;
                a.version += 1;
            }
            (st.actors[&key].clone(), worker, link)
        };
        // Detached so a client that goes away cannot strand the actor mid-checkpoint.
        let plane = self.clone();
        let (done_tx, done_rx) = oneshot::channel();
        self.inner.tasks.spawn(async move {
            let r = plane.checkpoint(&key, &worker, row, link).await;
            let _ = done_tx.send(r);
        });
        done_rx
            .await
            .unwrap_or_else(|_| Err(Status::internal("suspend ended without a result")))
    }

    async fn checkpoint(
        &self,
        key: &ActorKey,
        worker: &str,
        row: ActorRow,
        link: Option<Arc<WorkerLink>>,
    ) -> Result<ateapi::Actor, Status> {
        let store = &self.inner.store;
        if let Err(e) = store.put_actor(row.clone()).await {
            let mut st = self.lock();
            if let Some(a) = st.actors.get_mut(key) {
                a.status = S::Running as i32;
            }
            st.ops.remove(key);
            return Err(db_error(&e));
        }
        let full = self
            .inner
            .templates
            .get(&row.template)
            .is_some_and(Template::full_snapshot);
        let result = match link {
            Some(link) => {
                let cmd = Command::Checkpoint(wk::Checkpoint {
                    actor: Some(slot(key, &row)),
                    full,
                });
                link.call(cmd, self.inner.config.checkpoint_timeout).await
            }
            None => Err(LinkError::Gone),
        };
        let mut done = row;
        done.worker = None;
        done.version += 1;
        done.status = match &result {
            Ok(()) => S::Suspended as i32,
            Err(LinkError::Gone) => {
                tracing::warn!(actor = %key, worker, "worker went away during checkpoint; actor back to its last snapshot");
                S::Suspended as i32
            }
            Err(e) => {
                tracing::warn!(actor = %key, worker, error = %e, "checkpoint failed; actor CRASHED");
                S::Crashed as i32
            }
        };
        let persisted = store.put_actor(done.clone()).await;
        let mut st = self.lock();
        if let Err(e) = &result
            && *e != LinkError::Gone
            && let Some(w) = st.workers.get(worker)
        {
            w.link.notify(Command::Evict(wk::Evict {
                actor: Some(slot(key, &done)),
            }));
        }
        let proto = st.to_proto(&done);
        st.actors.insert(key.clone(), done);
        st.ops.remove(key);
        st.release(worker, &self.inner.stats);
        drop(st);
        persisted.map_err(|e| db_error(&e))?;
        match result {
            Ok(()) | Err(LinkError::Gone) => {
                tracing::info!(actor = %key, worker, "actor SUSPENDED");
                Ok(proto)
            }
            Err(e) => Err(Status::internal(format!(
                "checkpoint of actor {key} failed: {e}"
            ))),
        }
    }

    /// `RevertActor`: CRASHED → SUSPENDED; its next restore starts from the last good
    /// snapshot.
    pub async fn revert_actor(&self, key: ActorKey) -> Result<ateapi::Actor, Status> {
        let row = {
            let mut st = self.lock();
            let row = st
                .actors
                .get(&key)
                .ok_or_else(|| model::not_found(&key))?
                .clone();
            match st.ops.get(&key) {
                Some(Op::Waiting(_) | Op::Busy("resuming")) => {
                    return Err(Status::failed_precondition(format!(
                        "actor {key} is STATUS_RESUMING; wait for the resume to finish"
                    )));
                }
                Some(Op::Busy(_)) => return Err(model::aborted()),
                None => {}
            }
            if row.status != S::Crashed as i32 {
                return Err(Status::failed_precondition(format!(
                    "actor {key} is {}; only CRASHED actors can be reverted",
                    status_name(row.status)
                )));
            }
            st.ops.insert(key.clone(), Op::Busy("reverting"));
            row
        };
        let mut reverted = row;
        reverted.status = S::Suspended as i32;
        reverted.revert_pending = true;
        reverted.version += 1;
        self.commit(key, reverted).await
    }

    /// `DeleteActor`: only SUSPENDED or CRASHED actors.
    pub async fn delete_actor(&self, key: ActorKey) -> Result<(), Status> {
        {
            let mut st = self.lock();
            let row = st.actors.get(&key).ok_or_else(|| model::not_found(&key))?;
            let status = row.status;
            if st.ops.contains_key(&key) {
                return Err(model::aborted());
            }
            if status != S::Suspended as i32 && status != S::Crashed as i32 {
                return Err(Status::failed_precondition(format!(
                    "actor {key} is {}; only SUSPENDED or CRASHED actors can be deleted",
                    status_name(status)
                )));
            }
            st.ops.insert(key.clone(), Op::Busy("deleting"));
        }
        let result = self
            .inner
            .store
            .delete_actor(key.atespace().to_owned(), key.name().to_owned())
            .await;
        let mut st = self.lock();
        st.ops.remove(&key);
        result.map_err(|e| db_error(&e))?;
        st.actors.remove(&key);
        Ok(())
    }

    /// `ListWorkers`.
    pub fn list_workers(&self) -> Vec<ateapi::Worker> {
        let st = self.lock();
        st.workers
            .iter()
            .map(|(id, w)| {
                let actor = w
                    .actor
                    .as_ref()
                    .and_then(|k| st.actors.get(k).map(|r| (k, r)));
                ateapi::Worker {
                    worker_namespace: NAMESPACE.into(),
                    worker_pool: w.pool.clone(),
                    worker_pod: id.clone(),
                    actor_namespace: actor
                        .map(|(_, r)| r.template_namespace.clone())
                        .unwrap_or_default(),
                    actor_template: actor.map(|(_, r)| r.template.clone()).unwrap_or_default(),
                    actor_id: actor.map(|(k, _)| k.name().to_owned()).unwrap_or_default(),
                    ip: w.app_addr.to_string(),
                    version: actor.map(|(_, r)| r.version).unwrap_or_default(),
                    worker_pod_uid: id.clone(),
                    node_name: "localhost".into(),
                    actor_atespace: actor
                        .map(|(k, _)| k.atespace().to_owned())
                        .unwrap_or_default(),
                }
            })
            .collect()
    }

    // ----- workers -----

    /// A worker attached (or re-attached). Returns whether it keeps the actor it
    /// reported; one it may not keep is evicted.
    pub(crate) fn worker_joined(
        &self,
        join: &wk::Join,
        link: Arc<WorkerLink>,
    ) -> Result<bool, Status> {
        if join.worker_id.is_empty() || join.worker_id.len() > 128 {
            return Err(Status::invalid_argument(
                "worker_id must be 1-128 characters",
            ));
        }
        model::check_name("pool", &join.pool)?;
        let app_addr: SocketAddr = join.app_address.parse().map_err(|_| {
            Status::invalid_argument(format!("app_address {:?} is not ip:port", join.app_address))
        })?;
        let hosting = match &join.hosting {
            Some(h) if !h.name.is_empty() => Some(ActorKey::new(&h.atespace, &h.name)?),
            _ => None,
        };
        let mut st = self.lock();
        if let Some(old) = st.workers.remove(&join.worker_id) {
            old.link.close();
        }
        let kept = hosting.as_ref().filter(|k| {
            st.actors.get(*k).is_some_and(|r| {
                r.status == S::Running as i32
                    && r.worker.as_deref() == Some(join.worker_id.as_str())
            }) && !st.ops.contains_key(*k)
        });
        let kept = kept.cloned();
        if let (Some(h), None) = (&join.hosting, &kept)
            && !h.name.is_empty()
        {
            link.notify(Command::Evict(wk::Evict {
                actor: Some(h.clone()),
            }));
        }
        st.workers.insert(
            join.worker_id.clone(),
            WorkerRec {
                pool: join.pool.clone(),
                app_addr,
                actor: kept.clone(),
                link,
            },
        );
        tracing::info!(
            worker = %join.worker_id,
            pool = %join.pool,
            app = %app_addr,
            hosting = ?kept.as_ref().map(ToString::to_string),
            workers = st.pool_size(&join.pool),
            "worker joined pool"
        );
        // Actors the records place on this worker that it no longer hosts (it
        // restarted) go back to SUSPENDED from their last snapshot.
        let stale: Vec<ActorRow> = st
            .actors
            .iter()
            .filter(|(k, r)| {
                r.status == S::Running as i32
                    && r.worker.as_deref() == Some(join.worker_id.as_str())
                    && kept.as_ref() != Some(*k)
                    && !st.ops.contains_key(*k)
            })
            .map(|(_, r)| r.clone())
            .collect();
        for row in &stale {
            st.ops.insert(key_of(row), Op::Busy("releasing"));
        }
        if kept.is_none() {
            st.release(&join.worker_id, &self.inner.stats);
        }
        drop(st);
        if !stale.is_empty() {
            self.spawn_release(stale);
        }
        Ok(kept.is_some())
    }

    /// Persists `rows` as SUSPENDED (worker released), then applies them and drops
    /// their operation locks.
    fn spawn_release(&self, rows: Vec<ActorRow>) {
        let rows: Vec<ActorRow> = rows
            .into_iter()
            .map(|mut r| {
                r.status = S::Suspended as i32;
                r.worker = None;
                r.version += 1;
                r
            })
            .collect();
        let plane = self.clone();
        self.inner.tasks.spawn(async move {
            if let Err(e) = plane.inner.store.put_actors(rows.clone()).await {
                db_error(&e);
            }
            let mut st = plane.lock();
            for row in rows {
                let key = key_of(&row);
                tracing::warn!(actor = %key, "actor back to SUSPENDED from its last snapshot");
                st.actors.insert(key.clone(), row);
                st.ops.remove(&key);
            }
        });
    }

    /// A worker's stream ended: the pool shrinks and its actor goes back to SUSPENDED
    /// from its last snapshot (unless an operation in progress on it handles that).
    pub(crate) fn worker_left(&self, worker: &str, link: &Arc<WorkerLink>) {
        let released = {
            let mut st = self.lock();
            let current = st
                .workers
                .get(worker)
                .is_some_and(|w| Arc::ptr_eq(&w.link, link));
            if !current {
                return;
            }
            let rec = st.workers.remove(worker).expect("checked above");
            let left = st.pool_size(&rec.pool);
            let mut released = None;
            if let Some(key) = rec.actor
                && !st.ops.contains_key(&key)
                && let Some(row) = st.actors.get(&key)
                && row.status == S::Running as i32
            {
                let row = row.clone();
                st.ops.insert(key, Op::Busy("releasing"));
                released = Some(row);
            }
            tracing::warn!(
                worker,
                pool = %rec.pool,
                workers_left = left,
                actor = ?released.as_ref().map(|r| key_of(r).to_string()),
                "worker left its pool"
            );
            released
        };
        if let Some(row) = released {
            self.spawn_release(vec![row]);
        }
    }

    fn spawn_rejoin_deadline(&self) {
        let plane = self.clone();
        let grace = self.inner.config.rejoin_grace;
        self.inner.tasks.spawn(async move {
            tokio::time::sleep(grace).await;
            let released: Vec<ActorRow> = {
                let mut st = plane.lock();
                let stale: Vec<ActorKey> = st
                    .actors
                    .iter()
                    .filter(|(k, r)| {
                        r.status == S::Running as i32
                            && !st.ops.contains_key(*k)
                            && !r.worker.as_ref().is_some_and(|w| st.workers.contains_key(w))
                    })
                    .map(|(k, _)| k.clone())
                    .collect();
                stale
                    .into_iter()
                    .map(|k| {
                        st.ops.insert(k.clone(), Op::Busy("releasing"));
                        let mut back = st.actors[&k].clone();
                        back.status = S::Suspended as i32;
                        back.worker = None;
                        back.version += 1;
                        back
                    })
                    .collect()
            };
            if released.is_empty() {
                return;
            }
            let result = plane.inner.store.put_actors(released.clone()).await;
            if let Err(e) = &result {
                db_error(e);
            }
            let mut st = plane.lock();
            for row in released {
                let key = key_of(&row);
                tracing::warn!(actor = %key, "worker did not re-attach after restart; actor back to SUSPENDED");
                st.actors.insert(key.clone(), row);
                st.ops.remove(&key);
            }
        });
    }
}

/// The state lock; on release after a mutation it tells [`Plane::wait_until`]
/// observers. No `.await` while it is held.
struct StateGuard<'a> {
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

/// How an activation starts: with a worker already claimed, or queued for one.
#[derive(Debug)]
enum Start {
    Claimed(String),
    Queued {
        id: u64,
        rx: oneshot::Receiver<String>,
        wait: Duration,
    },
}
