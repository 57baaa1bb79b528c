//! Doubles for tests of the plane (feature `testing`): an in-memory store whose writes
//! a test can hold or fail, a gate in front of any store, and a worker on the Attach
//! interface whose every answer the test gives. They run on tokio's paused clock.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tonic::Status;
use valet_proto::worker::{self as wk, WorkerCommand, worker_command::Command};

use crate::link::WorkerLink;
use crate::model::ActorKey;
use crate::plane::Plane;
use crate::store::{ActorRow, Batch, Loaded, Store, StoreError, StoreFuture};

/// Holds writes until released: every write waits at the gate while it is closed, and
/// tests see how many wait.
#[derive(Debug)]
pub struct Gate {
    closed: watch::Sender<bool>,
    waiting: watch::Sender<usize>,
    fail: Mutex<bool>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            closed: watch::Sender::new(false),
            waiting: watch::Sender::new(0),
            fail: Mutex::new(false),
        }
    }
}

impl Gate {
    /// From now on writes wait until [`Self::open`].
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// Lets every waiting write (and later ones) through.
    pub fn open(&self) {
        self.closed.send_replace(false);
    }

    /// Makes writes fail (`true`) or succeed again.
    pub fn fail(&self, fail: bool) {
        *self.fail.lock().unwrap_or_else(|e| e.into_inner()) = fail;
    }

    /// Waits until `n` writes wait at the gate.
    pub async fn until_waiting(&self, n: usize) {
        let mut rx = self.waiting.subscribe();
        let _ = rx.wait_for(|w| *w >= n).await;
    }

    async fn pass(&self) -> Result<(), StoreError> {
        let mut closed = self.closed.subscribe();
        if *closed.borrow() {
            self.waiting.send_modify(|n| *n += 1);
            let _ = closed.wait_for(|c| !*c).await;
            self.waiting.send_modify(|n| *n -= 1);
        }
        if *self.fail.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(StoreError::Refused("the test made writes fail".into()));
        }
        Ok(())
    }
}

/// What a [`MemoryStore`] holds: atespaces, actors and the (route, hosting) lease
/// bounds.
type Records = (
    BTreeSet<String>,
    BTreeMap<ActorKey, ActorRow>,
    (Option<Duration>, Option<Duration>),
);

/// A store in memory, for the paused clock (the SQLite store runs on the blocking
/// pool, whose work the paused clock does not wait for). Clones share their data.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    data: Arc<Mutex<Records>>,
    /// The gate every write passes.
    pub gate: Arc<Gate>,
}

impl MemoryStore {
    /// One actor as stored.
    pub fn actor(&self, key: &ActorKey) -> Option<ActorRow> {
        self.data
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .get(key)
            .cloned()
    }
}

impl Store for MemoryStore {
    fn load(&self) -> StoreFuture<'_, Loaded> {
        Box::pin(async move {
            let data = self.data.lock().unwrap_or_else(|e| e.into_inner());
            Ok(Loaded {
                atespaces: data.0.iter().cloned().collect(),
                actors: data.1.values().cloned().collect(),
                route_lease: data.2.0,
                hosting_lease: data.2.1,
            })
        })
    }

    fn write(&self, batch: Batch) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.gate.pass().await?;
            let mut data = self.data.lock().unwrap_or_else(|e| e.into_inner());
            // As the real stores: the whole batch or nothing, and no worker recorded
            // for two actors (store migration 2).
            let mut next = data.clone();
            for a in batch.put_atespaces {
                next.0.insert(a);
            }
            for row in batch.put_actors {
                next.1.insert(row.key(), row);
            }
            for key in batch.delete_actors {
                next.1.remove(&key);
            }
            for a in batch.delete_atespaces {
                next.0.remove(&a);
            }
            if let Some(lease) = batch.route_lease {
                next.2.0 = Some(lease);
            }
            if let Some(lease) = batch.hosting_lease {
                next.2.1 = Some(lease);
            }
            let mut workers = BTreeSet::new();
            for row in next.1.values() {
                if let Some(w) = &row.worker
                    && !workers.insert(w.clone())
                {
                    return Err(StoreError::Refused(format!(
                        "worker {w} recorded for two actors"
                    )));
                }
            }
            *data = next;
            Ok(())
        })
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}

/// Any store behind a [`Gate`].
#[derive(Debug)]
pub struct Gated<S> {
    inner: S,
    /// The gate every write passes.
    pub gate: Arc<Gate>,
}

impl<S: Store> Gated<S> {
    /// `inner` behind a new, open gate.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            gate: Arc::default(),
        }
    }
}

impl<S: Store> Store for Gated<S> {
    fn load(&self) -> StoreFuture<'_, Loaded> {
        self.inner.load()
    }

    fn write(&self, batch: Batch) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.gate.pass().await?;
            self.inner.write(batch).await
        })
    }

    fn describe(&self) -> String {
        format!("gated {}", self.inner.describe())
    }
}

/// A command the plane sent a [`FakeWorker`].
#[derive(Debug, Clone)]
pub struct Received {
    /// The id to answer with.
    pub id: u64,
    /// The command.
    pub command: Command,
}

/// A worker the test drives: attached to the plane as a real worker's stream would
/// be, with each command answered by the test.
#[derive(Debug)]
pub struct FakeWorker {
    plane: Plane,
    id: String,
    link: Arc<WorkerLink>,
    rx: mpsc::Receiver<Result<WorkerCommand, Status>>,
}

impl FakeWorker {
    /// Attaches worker `id` to `pool`, reporting `hosting`; also returns whether the
    /// plane let it keep that actor.
    ///
    /// # Errors
    /// The plane's refusal of the join.
    pub fn attach(
        plane: &Plane,
        id: &str,
        pool: &str,
        app: SocketAddr,
        hosting: Option<&ActorKey>,
    ) -> Result<(Self, bool), Status> {
        Self::join(plane, id, pool, app, hosting, false, 0)
    }

    /// [`Self::attach`] as the worker process `incarnation` (`Join.incarnation`).
    ///
    /// # Errors
    /// The plane's refusal of the join.
    pub fn attach_as(
        plane: &Plane,
        id: &str,
        pool: &str,
        app: SocketAddr,
        incarnation: u64,
    ) -> Result<Self, Status> {
        Self::join(plane, id, pool, app, None, false, incarnation).map(|(w, _)| w)
    }

    /// [`Self::attach`] for a worker that re-attaches in the middle of its drain.
    ///
    /// # Errors
    /// The plane's refusal of the join.
    pub fn attach_draining(
        plane: &Plane,
        id: &str,
        pool: &str,
        app: SocketAddr,
    ) -> Result<Self, Status> {
        Self::join(plane, id, pool, app, None, true, 0).map(|(w, _)| w)
    }

    /// [`Self::attach`] through the path a worker's attach stream takes: with several
    /// replicas (a plane on a `ReplicaStore`), the attachment, and whether it keeps
    /// `hosting`, is written to the store first.
    ///
    /// # Errors
    /// The plane's refusal of the join.
    pub async fn attach_recorded(
        plane: &Plane,
        id: &str,
        pool: &str,
        app: SocketAddr,
        hosting: Option<&ActorKey>,
    ) -> Result<(Self, bool), Status> {
        let (join, link, rx) = Self::join_message(id, pool, app, hosting, false, 0);
        let kept = plane
            .membership()
            .worker_attached(&join, Arc::clone(&link))
            .await?;
        Ok((Self::on(plane, id, link, rx), kept))
    }

    fn join(
        plane: &Plane,
        id: &str,
        pool: &str,
        app: SocketAddr,
        hosting: Option<&ActorKey>,
        draining: bool,
        incarnation: u64,
    ) -> Result<(Self, bool), Status> {
        let (join, link, rx) = Self::join_message(id, pool, app, hosting, draining, incarnation);
        let kept = plane.membership().worker_joined(&join, Arc::clone(&link))?;
        Ok((Self::on(plane, id, link, rx), kept))
    }

    fn on(
        plane: &Plane,
        id: &str,
        link: Arc<WorkerLink>,
        rx: mpsc::Receiver<Result<WorkerCommand, Status>>,
    ) -> Self {
        Self {
            plane: plane.clone(),
            id: id.to_owned(),
            link,
            rx,
        }
    }

    #[allow(clippy::type_complexity)]
    fn join_message(
        id: &str,
        pool: &str,
        app: SocketAddr,
        hosting: Option<&ActorKey>,
        draining: bool,
        incarnation: u64,
    ) -> (
        wk::Join,
        Arc<WorkerLink>,
        mpsc::Receiver<Result<WorkerCommand, Status>>,
    ) {
        let (tx, rx) = mpsc::channel(64);
        let link = Arc::new(WorkerLink::new(tx));
        let join = wk::Join {
            worker_id: id.to_owned(),
            pool: pool.to_owned(),
            app_address: app.to_string(),
            hosting: hosting.map(|k| wk::ActorSlot {
                atespace: k.atespace().to_owned(),
                name: k.name().to_owned(),
                snapshot_key: String::new(),
            }),
            draining,
            incarnation,
        };
        (join, link, rx)
    }

    /// The next command; `None` once the plane ended the stream (it told the worker to
    /// detach).
    pub async fn next(&mut self) -> Option<Received> {
        loop {
            let cmd = self.rx.recv().await?.ok()?;
            if let Some(command) = cmd.command
                && !matches!(command, Command::Welcome(_))
            {
                return Some(Received {
                    id: cmd.id,
                    command,
                });
            }
        }
    }

    /// The next command as the worker reads it, its Welcome included.
    pub async fn next_with_welcome(&mut self) -> Option<Command> {
        self.rx.recv().await?.ok()?.command
    }

    /// Answers command `id`.
    pub fn answer(&self, id: u64, result: Result<(), &str>) {
        self.link.deliver(wk::Reply {
            id,
            ok: result.is_ok(),
            error: result.err().unwrap_or_default().to_owned(),
            busy: false,
            not_hosting: false,
            ..Default::default()
        });
    }

    /// Answers a checkpoint `id`: it failed with the actor still served (its data over
    /// the limit, say).
    pub fn answer_still_running(&self, id: u64, why: &str) {
        self.link.deliver(wk::Reply {
            id,
            error: why.into(),
            still_running: true,
            ..Default::default()
        });
    }

    /// Answers a program's checkpoint `id`: its snapshot is `snapshot`.
    pub fn answer_snapshot(&self, id: u64, snapshot: &str) {
        self.link.deliver(wk::Reply {
            id,
            ok: true,
            snapshot: snapshot.into(),
            ..Default::default()
        });
    }

    /// Reports that hosted `actor`'s program, started by Restore command `restore`,
    /// exited with `status`.
    pub fn exited(&self, actor: &ActorKey, status: &str, restore: u64) {
        self.plane.membership().actor_exited(
            &self.id,
            &self.link,
            &wk::Exited {
                actor: Some(wk::ActorSlot {
                    atespace: actor.atespace().into(),
                    name: actor.name().into(),
                    snapshot_key: String::new(),
                }),
                status: status.into(),
                output: "last words".into(),
                restore,
            },
        );
    }

    /// Answers a policy's checkpoint `id`: the actor is busy.
    pub fn answer_busy(&self, id: u64) {
        self.link.deliver(wk::Reply {
            id,
            ok: false,
            error: "the actor is busy".into(),
            busy: true,
            not_hosting: false,
            ..Default::default()
        });
    }

    /// Answers a checkpoint `id`: this worker does not host the actor (it dropped it).
    pub fn answer_not_hosting(&self, id: u64) {
        self.link.deliver(wk::Reply {
            id,
            ok: false,
            error: "worker does not host the actor".into(),
            busy: false,
            not_hosting: true,
            ..Default::default()
        });
    }

    /// Reports what hosted `actor` is doing: `in_flight` requests, activity `mark`.
    pub fn report(&self, actor: &ActorKey, in_flight: u32, mark: u64) {
        let activity = wk::Activity {
            actor: Some(wk::ActorSlot {
                atespace: actor.atespace().to_owned(),
                name: actor.name().to_owned(),
                snapshot_key: String::new(),
            }),
            in_flight,
            mark,
        };
        self.plane
            .policies()
            .activity(&self.id, &self.link, &activity);
    }

    /// Renews its hosting lease.
    pub fn renew(&self) {
        let _ = self.plane.membership().renewed(&self.id, &self.link);
    }

    /// The worker asks to drain (it is stopping).
    pub fn drain(&self) {
        self.plane
            .membership()
            .worker_draining(&self.id, &self.link);
    }

    /// The plane ends the worker's stream from its side (as when the worker stops
    /// reading its commands), before the stream's end reaches the plane.
    pub fn cut(&self) {
        self.link.end(Status::aborted("cut by the test"));
    }

    /// The worker's stream ends.
    pub fn leave(self) {
        self.link.close();
        self.plane.membership().worker_left(&self.id, &self.link);
    }
}
