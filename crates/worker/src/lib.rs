//! valet's reference worker: hosts one actor at a time on its own address, running
//! either a built-in app (`counter`, `echo`) or a program of its templates file.
//!
//! ```text
//! control plane ◀── Attach stream (agent: Join, then Restore / Checkpoint / Evict) ──▶ worker
//! router ── HTTP ──▶ worker's address ──▶ built-in app, or ──▶ the program on 127.0.0.1:$PORT
//! ```
//!
//! Snapshots are files under `--snapshot-dir`, per actor in `<atespace>/<name>/<uid>/`.
//! The counter's: `data/counter` (the data directory, always kept), `memory` (the
//! memory count, kept by full snapshots only) and `good/counter` (the data at the last
//! checkpoint, for reverts). A program's: `program/<sha256>.tar.zst` (its data
//! directory), and `output.log` (its last output). A program's live directory is in
//! `--run-dir` (see `program`).

// `unsafe` in one module only (`spawn`: what a program's process does before exec),
// for the reasons written there.
#![deny(unsafe_code)]

mod app;
mod forward;
mod group;
mod hosting;
mod limits;
mod output;
mod program;
mod runtime;
mod snapshot;
mod spawn;
mod traffic;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use valet_net::{Backoff, Connections, Listener};

use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use valet_proto::worker::{
    self as wk, worker_command::Command, worker_event::Event, workers_client::WorkersClient,
};

pub use app::{ACTOR_REF_HEADER, pattern};
use app::{Counter, Hosted, Served, Slot, create_dir_durably, read_counter, write_durably};
pub use hosting::MIN_HOSTING_LEASE;
use hosting::{HostingLease, RENEW_EVERY};
pub use limits::{Cgroup, check as check_template};
use traffic::Fence;

/// Why a command was not carried out.
#[derive(Debug)]
enum Refusal {
    /// It failed, for this reason.
    Failed(String),
    /// A checkpoint failed with the actor still served here.
    StillRunning(String),
    /// A checkpoint found the actor busy: not idle since a policy's mark, or its
    /// requests in flight did not end within the idle wait.
    Busy,
    /// A checkpoint of an actor this worker does not host.
    NotHosting(String),
}

/// A raised fence, lowered when dropped unless kept: a checkpoint given up before its
/// snapshot (it failed, or its future was dropped) lets the actor serve again.
struct FenceHeld<'a>(Option<&'a traffic::Traffic>);

impl FenceHeld<'_> {
    /// The snapshot is taken: the actor leaves this worker fenced.
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for FenceHeld<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.0 {
            t.unfence();
        }
    }
}

/// `atespace/name` of a command's actor (empty without one).
fn actor_name(slot: Option<&wk::ActorSlot>) -> String {
    slot.map(|a| format!("{}/{}", a.atespace, a.name))
        .unwrap_or_default()
}

/// The answer to command `id`.
fn reply(id: u64, result: Result<Done, Refusal>) -> wk::Reply {
    match result {
        Ok(done) => wk::Reply {
            id,
            ok: true,
            snapshot: done.snapshot,
            output: done.output,
            ..Default::default()
        },
        Err(Refusal::StillRunning(error)) => wk::Reply {
            id,
            error,
            still_running: true,
            ..Default::default()
        },
        Err(Refusal::Failed(error)) => wk::Reply {
            id,
            error,
            ..Default::default()
        },
        Err(Refusal::Busy) => wk::Reply {
            id,
            busy: true,
            error: "the actor is busy".into(),
            ..Default::default()
        },
        Err(Refusal::NotHosting(error)) => wk::Reply {
            id,
            not_hosting: true,
            error,
            ..Default::default()
        },
    }
}

/// What a command that succeeded answers besides.
#[derive(Debug, Default)]
struct Done {
    /// A program's checkpoint: its snapshot.
    snapshot: String,
    /// Logs: the actor's output.
    output: Vec<u8>,
}

/// A restore or checkpoint in progress beside the command loop: its command's id, its
/// actor, whether it has changed anything yet (a restore always may; a checkpoint once
/// it has fenced the actor), and the work itself.
type Working<'a> = (
    u64,
    String,
    Arc<std::sync::atomic::AtomicBool>,
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Done, Refusal>> + Send + 'a>>,
);

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The control plane to attach to (`http://host:port` or `https://host:port`), or
    /// a comma-separated list of replicas: an attachment that fails or ends moves on
    /// to the next.
    pub control_plane: String,
    /// How the control plane is reached (TLS, token); plaintext by default.
    pub credentials: valet_proto::auth::ClientCredentials,
    /// The pool to join.
    pub pool: String,
    /// Where the app listens (port 0 picks one).
    pub listen: SocketAddr,
    /// Where snapshots live; workers that share it can move actors between them.
    pub snapshot_dir: PathBuf,
    /// Extra time each restore takes (the restore cost of a real sandbox).
    pub restore_delay: Duration,
    /// This worker's id; random when `None`.
    pub worker_id: Option<String>,
    /// The IP routers reach the app at (with the bound port); the bound IP when
    /// `None` (which must then be a specific address, not `0.0.0.0`).
    pub advertise: Option<std::net::IpAddr>,
    /// The templates it knows: the built-in apps, and the programs of a templates
    /// file. Its pool's template, if a program, is checked at the start.
    pub templates: valet_template::Templates,
    /// Where programs' live directories are; workers on one machine share it.
    pub run_dir: PathBuf,
    /// The largest data directory a program's checkpoint snapshots.
    pub snapshot_max_bytes: u64,
    /// A cgroup v2 delegated to the worker, for programs' `memory.max` and `cpu.max`.
    pub cgroup: Option<Cgroup>,
}

/// Default `--snapshot-max-bytes`.
pub const DEFAULT_SNAPSHOT_MAX_BYTES: u64 = 1 << 30;

impl WorkerConfig {
    /// A worker of `pool` attached to `control_plane`, its snapshots in
    /// `snapshot_dir` and its programs' live directories in `run_dir`, on a free
    /// loopback port, with the built-in templates and every other setting at its
    /// default.
    pub fn new(control_plane: String, pool: &str, snapshot_dir: PathBuf, run_dir: PathBuf) -> Self {
        Self {
            control_plane,
            credentials: Default::default(),
            pool: pool.to_owned(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            snapshot_dir,
            restore_delay: Duration::ZERO,
            worker_id: None,
            advertise: None,
            templates: valet_template::Templates::builtin(),
            run_dir,
            snapshot_max_bytes: DEFAULT_SNAPSHOT_MAX_BYTES,
            cgroup: None,
        }
    }
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    id: String,
    app_addr: SocketAddr,
    slot: Slot,
    /// Stops the agent and the hosting watchdog.
    stop: CancellationToken,
    /// Stops the app's server, which [`Worker::shutdown`] stops first.
    app_stop: CancellationToken,
    app: tokio::task::JoinHandle<()>,
    drain: Drain,
    tasks: TaskTracker,
    programs: Arc<runtime::Context>,
}

/// A drain asked of the control plane (see [`Worker::drain`]).
#[derive(Debug, Clone, Default)]
struct Drain {
    /// Asked: the agent sends `Drain` on every attachment from now on.
    asked: CancellationToken,
    /// The control plane answered `Drained`.
    done: CancellationToken,
    /// Whether the agent is attached now.
    attached: Arc<std::sync::atomic::AtomicBool>,
}

/// An error starting a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("snapshot dir {path}: {source}")]
    SnapshotDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid control plane address {0:?}")]
    ControlPlane(String),
    /// Its pool's template cannot run here (a missing command, a limit that cannot
    /// be applied).
    #[error("{0}")]
    Template(String),
}

impl Worker {
    /// Binds the app's listener and starts the app and the agent. The agent attaches
    /// to the control plane and re-attaches whenever the stream breaks.
    ///
    /// # Errors
    /// When the listener or the snapshot dir cannot be set up.
    pub async fn spawn(config: WorkerConfig) -> Result<Self, WorkerError> {
        if let Some(t) = config.templates.get(&config.pool) {
            limits::check(t, config.cgroup.as_ref()).map_err(WorkerError::Template)?;
        }
        // Durably: the first checkpoint acknowledged must not vanish with a directory
        // entry that never reached the disk.
        app::create_dir_durably(&config.snapshot_dir).map_err(|source| {
            WorkerError::SnapshotDir {
                path: config.snapshot_dir.clone(),
                source,
            }
        })?;
        let endpoints = config
            .control_plane
            .split(',')
            .map(|url| {
                config
                    .credentials
                    .endpoint(url.trim())
                    .map_err(|_| WorkerError::ControlPlane(config.control_plane.clone()))
                    .map(|e| {
                        e.connect_timeout(Duration::from_secs(2))
                            .http2_keep_alive_interval(Duration::from_secs(1))
                            .keep_alive_timeout(Duration::from_secs(3))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let credentials = config.credentials.clone();
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| WorkerError::Listen {
                    addr: config.listen,
                    source,
                })?;
        let bound = listener
            .local_addr()
            .map_err(|source| WorkerError::Listen {
                addr: config.listen,
                source,
            })?;
        let app_addr = SocketAddr::new(config.advertise.unwrap_or(bound.ip()), bound.port());
        // Programs a worker that died left running are killed before anything is
        // restored here.
        let swept = program::sweep(&config.run_dir).await;
        if swept > 0 {
            tracing::warn!(run_dir = %config.run_dir.display(), programs = swept, "killed programs left running by workers that died");
        }
        let id = config
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("w-{:08x}", rand::random::<u32>()));
        let slot: Slot = Arc::new(watch::Sender::new(None));
        let (exits_tx, exits) = mpsc::unbounded_channel();
        let programs = Arc::new(runtime::Context {
            run_dir: config.run_dir.clone(),
            snapshot_max: config.snapshot_max_bytes,
            cgroup: config.cgroup.clone(),
            exits: exits_tx,
            slot: Arc::downgrade(&slot),
            kills: TaskTracker::new(),
        });
        let stop = CancellationToken::new();
        let app_stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        // As a container's PID 1, the worker adopts the orphans of its programs'
        // children: they are reaped here, or they would pile up as zombies.
        if rustix::process::getpid().is_init() {
            let stop = stop.clone();
            tasks.spawn(async move {
                let mut tick = tokio::time::interval(ORPHANS_REAPED_EVERY);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    let _ = tokio::task::spawn_blocking(group::reap_orphans).await;
                }
            });
        }
        let app = tokio::spawn(serve_app(listener, Arc::clone(&slot), app_stop.clone()));
        let lease = HostingLease::new();
        tasks.spawn(Arc::clone(&lease).watchdog(Arc::clone(&slot), id.clone(), stop.clone()));
        let drain = Drain::default();
        let agent = Agent {
            id: id.clone(),
            incarnation: rand::random::<u64>().max(1),
            config,
            app_addr,
            slot: Arc::clone(&slot),
            lease,
            drain: drain.clone(),
            programs: Arc::clone(&programs),
        };
        tasks.spawn(agent.run(endpoints, credentials, stop.clone(), exits));
        Ok(Self {
            id,
            app_addr,
            slot,
            stop,
            app_stop,
            app,
            drain,
            tasks,
            programs,
        })
    }

    /// The worker's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where its app answers.
    pub fn app_addr(&self) -> SocketAddr {
        self.app_addr
    }

    /// The actor hosted now (`atespace/name`).
    pub fn hosting(&self) -> Option<String> {
        self.slot.borrow().as_ref().map(|h| h.actor.clone())
    }

    /// Stops as a rollout wants it (`valet worker` on SIGTERM): asks the control plane
    /// to checkpoint the hosted actor and give this worker nothing new, keeps serving
    /// the actor's requests in flight meanwhile (the checkpoint waits for them), and
    /// once the control plane answers, or `timeout` passes, stops as [`Self::shutdown`]
    /// does. Whether the control plane answered. A worker that hosts nothing and is not
    /// attached stops at once.
    pub async fn drain(self, timeout: Duration) -> bool {
        use std::sync::atomic::Ordering;
        let idle = self.hosting().is_none() && !self.drain.attached.load(Ordering::Relaxed);
        self.drain.asked.cancel();
        let drained = !idle
            && tokio::time::timeout(timeout, self.drain.done.cancelled())
                .await
                .is_ok();
        if !drained && !idle {
            tracing::warn!(
                worker = %self.id,
                hosting = ?self.hosting(),
                ?timeout,
                "the control plane did not answer the drain in time; stopping (its actor goes back to its last snapshot)"
            );
        }
        self.shutdown().await;
        drained
    }

    /// Stops the app, then the agent (the control plane sees the worker leave), and
    /// waits for both. The app goes first: its requests in flight finish (for up to
    /// [`APP_DRAIN`]) while the worker still holds its actor, so no other worker can
    /// have restored the actor while they still write its data.
    pub async fn shutdown(self) {
        self.app_stop.cancel();
        if let Err(e) = self.app.await {
            tracing::warn!(worker = %self.id, error = %e, "the app's server failed");
        }
        // Its program stops as a checkpoint would stop it (its signal, its grace):
        // no process of it outlives the worker.
        let hosted = self.slot.borrow().clone();
        if let Some(h) = hosted
            && let Served::Program(host) = &h.app
            && let Err(e) = host.stop().await
        {
            tracing::warn!(worker = %self.id, actor = %h.actor, error = %e, "stopping the actor's program failed");
        }
        self.programs.kills.close();
        self.programs.kills.wait().await;
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// How often a worker that is PID 1 reaps the orphans it adopted.
const ORPHANS_REAPED_EVERY: Duration = Duration::from_secs(5);

/// How long the app's connections may take to finish their requests once it stops.
const APP_DRAIN: Duration = Duration::from_secs(5);

/// How long a connection to the app may take to send a request's head (an idle
/// keep-alive connection included: hyper's timer runs while it waits for the next).
const APP_HEADER_TIMEOUT: Duration = valet_proto::WORKER_APP_HEADER_TIMEOUT;

/// Serves the app on `listener` until `stop`; then lets the connections finish the
/// requests they have (HTTP/1 closes after the one in progress, HTTP/2 sends GOAWAY)
/// and the open tunnels end, for up to [`APP_DRAIN`], and closes what is left.
async fn serve_app(listener: TcpListener, slot: Slot, stop: CancellationToken) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // Without a timer hyper drops its header read timeout silently: a connection that
    // never finishes its headers would be held for good.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(APP_HEADER_TIMEOUT);
    builder.http2().timer(hyper_util::rt::TokioTimer::new());
    let listener = Listener::new(listener, "worker");
    let connections = Connections::new();
    let tunnels = app::Tunnels::default();
    while let Some(stream) = listener.accept(&stop).await {
        let slot = Arc::clone(&slot);
        let builder = builder.clone();
        let (stop, force) = (stop.clone(), connections.force());
        let tunnels = tunnels.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                app::handle(req, Arc::clone(&slot), tunnels.clone())
            });
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                () = stop.cancelled() => conn.as_mut().graceful_shutdown(),
            }
            tokio::select! {
                _ = conn.as_mut() => {}
                () = force.cancelled() => {}
            }
        });
    }
    // New connections are refused from now on, not left in the backlog.
    drop(listener);
    let drained = async {
        connections.wait().await;
        tunnels.wait().await;
    };
    if tokio::time::timeout(APP_DRAIN, drained).await.is_err() {
        tracing::warn!(
            after = ?APP_DRAIN,
            "the app's requests did not end in time; closing their connections"
        );
        connections.force_now();
        tunnels.close_now();
        connections.wait().await;
        tunnels.wait().await;
    }
}

/// How often a busy actor's activity is reported at most.
const BUSY_REPORT_EVERY: Duration = Duration::from_secs(1);

/// Reports the hosted actor's activity on `tx`: at once when it turns idle or busy, at
/// most once a second while it stays either. Ends when `tx` closes.
async fn report_activity(
    mut slot: watch::Receiver<Option<Arc<Hosted>>>,
    tx: mpsc::Sender<wk::WorkerEvent>,
) {
    loop {
        let hosted = slot.borrow_and_update().clone();
        let Some(hosted) = hosted else {
            if slot.changed().await.is_err() {
                return;
            }
            continue;
        };
        let mut gauge = hosted.traffic.watch();
        let mut last: Option<(tokio::time::Instant, bool)> = None;
        loop {
            let g = *gauge.borrow_and_update();
            let idle = g.in_flight == 0;
            let due = match last {
                None => tokio::time::Instant::now(),
                // A turn from busy to idle, or from idle to busy, goes at once.
                Some((_, was_busy)) if idle == was_busy => tokio::time::Instant::now(),
                Some((at, _)) => at + BUSY_REPORT_EVERY,
            };
            if tokio::time::Instant::now() >= due {
                let (atespace, name) = hosted.actor.split_once('/').unwrap_or_default();
                let event = wk::WorkerEvent {
                    event: Some(Event::Activity(wk::Activity {
                        actor: Some(wk::ActorSlot {
                            atespace: atespace.to_owned(),
                            name: name.to_owned(),
                            snapshot_key: hosted.snapshot_key.clone(),
                        }),
                        in_flight: g.in_flight,
                        mark: g.mark,
                    })),
                };
                if tx.send(event).await.is_err() {
                    return;
                }
                last = Some((tokio::time::Instant::now(), !idle));
                tokio::select! {
                    r = gauge.changed() => if r.is_err() { break },
                    r = slot.changed() => if r.is_err() { return } else { break },
                }
            } else {
                tokio::select! {
                    () = tokio::time::sleep_until(due) => {}
                    r = gauge.changed() => if r.is_err() { break },
                    r = slot.changed() => if r.is_err() { return } else { break },
                }
            }
        }
    }
}

struct Agent {
    id: String,
    /// This process among any others given the same id (`Join.incarnation`).
    incarnation: u64,
    config: WorkerConfig,
    app_addr: SocketAddr,
    slot: Slot,
    lease: Arc<HostingLease>,
    drain: Drain,
    programs: Arc<runtime::Context>,
}

/// How often an unchanged token goes with a renewal again: the control plane may have
/// refused it (signed by a key it had not loaded yet, during a rotation) without
/// telling the worker, and takes it once it has the key.
const TOKEN_RESEND_EVERY: Duration = Duration::from_secs(10);

/// The token in the token file when it differs from `sent`, or was sent
/// [`TOKEN_RESEND_EVERY`] ago (it then becomes `sent`); empty otherwise, or without a
/// token file. An unreadable or empty file sends nothing: the stream keeps the token
/// it has until that one expires. Read off the runtime.
async fn changed_token(
    token: &valet_proto::auth::BearerToken,
    sent: &mut Option<(String, tokio::time::Instant)>,
) -> String {
    let Some(path) = token.path() else {
        return String::new();
    };
    let now = tokio::time::Instant::now();
    match tokio::fs::read_to_string(path).await {
        Ok(t) if t.trim().is_empty() => String::new(),
        Ok(t) => {
            let t = t.trim();
            let due = sent.as_ref().is_none_or(|(last, at)| {
                last != t || now.duration_since(*at) >= TOKEN_RESEND_EVERY
            });
            if !due {
                return String::new();
            }
            *sent = Some((t.to_owned(), now));
            t.to_owned()
        }
        Err(e) => {
            tracing::debug!(file = %path.display(), error = %e, "token not refreshed on the attachment");
            String::new()
        }
    }
}

/// The replica (of `n`) a worker with `id` attaches to first: its id's FNV-1a hash,
/// stable across restarts and platforms.
fn first_replica(id: &str, n: usize) -> usize {
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    usize::try_from(hash % n.max(1) as u64).unwrap_or(0)
}

/// Which control-plane replica a worker attaches to next: after an attachment fails
/// or ends, the next one; a pause once every one was tried since the last pause,
/// wherever the rotation started.
#[derive(Debug)]
struct Rotation {
    n: usize,
    next: usize,
    tried: usize,
}

impl Rotation {
    fn starting_at(first: usize, n: usize) -> Self {
        Self {
            n: n.max(1),
            next: first,
            tried: 0,
        }
    }

    /// The replica to try now.
    fn current(&self) -> usize {
        self.next % self.n
    }

    /// Moves on after a try; whether to pause first (every replica was tried).
    fn advance(&mut self) -> bool {
        self.next = (self.next + 1) % self.n;
        self.tried += 1;
        if self.tried < self.n {
            return false;
        }
        self.tried = 0;
        true
    }
}

impl Agent {
    async fn run(
        self,
        endpoints: Vec<tonic::transport::Endpoint>,
        credentials: valet_proto::auth::ClientCredentials,
        stop: CancellationToken,
        mut exits: mpsc::UnboundedReceiver<wk::Exited>,
    ) {
        // Jittered (half to the whole wait): workers that lost one control plane together
        // do not all attach again at the same instant.
        let mut backoff = Backoff::new(Duration::from_millis(100))
            .cap(Duration::from_secs(2))
            .jitter(-0.5..0.0);
        // Which replica to attach to next: after an attachment fails or ends, the next
        // one, at once; after every one was tried, wait (backing off) first. The first
        // is chosen by the worker's id, so that a pool's workers spread over replicas
        // that all serve.
        let mut turn =
            Rotation::starting_at(first_replica(&self.id, endpoints.len()), endpoints.len());
        loop {
            let endpoint = &endpoints[turn.current()];
            let attached = tokio::select! {
                () = stop.cancelled() => return,
                r = self.attach_once(endpoint, &credentials, &stop, &mut exits) => r,
            };
            self.drain
                .attached
                .store(false, std::sync::atomic::Ordering::Relaxed);
            // Also once drained: until `stop` (after the app has stopped) the worker
            // may still serve its actor, and the control plane must see it attached
            // (draining) meanwhile, not gone with its app port already closed.
            match attached {
                Ok(()) => backoff.reset(),
                Err(e) if e.code() == tonic::Code::AlreadyExists => {
                    tracing::warn!(worker = %self.id, control_plane = %endpoint.uri(), error = %e.message(), "the control plane counts another process with this worker id as live (for up to its hosting lease after that one left); retrying")
                }
                Err(e) if e.code() == tonic::Code::Unauthenticated => {
                    tracing::warn!(worker = %self.id, control_plane = %endpoint.uri(), error = %e.message(), "the control plane refused the worker's bearer token; attaching again with the token file's current one")
                }
                Err(e) => {
                    tracing::warn!(worker = %self.id, control_plane = %endpoint.uri(), error = %e, "control plane unreachable; retrying")
                }
            }
            if stop.is_cancelled() {
                return;
            }
            if !turn.advance() {
                continue;
            }
            if !backoff.wait(&stop).await {
                return;
            }
        }
    }

    /// One attachment: join, then serve commands until the stream ends.
    async fn attach_once(
        &self,
        endpoint: &tonic::transport::Endpoint,
        credentials: &valet_proto::auth::ClientCredentials,
        stop: &CancellationToken,
        exits: &mut mpsc::UnboundedReceiver<wk::Exited>,
    ) -> Result<(), tonic::Status> {
        let channel = credentials
            .connect(endpoint, valet_proto::auth::tcp_connector())
            .await
            .map_err(|e| tonic::Status::unavailable(valet_proto::error_chain(&e)))?;
        let mut client = WorkersClient::new(channel);
        let (tx, rx) = mpsc::channel(16);
        let hosting = self.slot.borrow().as_ref().map(|h| {
            let (atespace, name) = h.actor.split_once('/').unwrap_or_default();
            wk::ActorSlot {
                atespace: atespace.to_owned(),
                name: name.to_owned(),
                snapshot_key: h.snapshot_key.clone(),
            }
        });
        // Re-attaching during a drain: the control plane goes on with it at once.
        let draining = self.drain.asked.is_cancelled();
        let join = wk::Join {
            worker_id: self.id.clone(),
            pool: self.config.pool.clone(),
            app_address: self.app_addr.to_string(),
            hosting,
            draining,
            incarnation: self.incarnation,
        };
        // Exits of programs reported to no attachment: the Join says what this worker
        // hosts now, which is what the control plane goes by.
        while let Ok(stale) = exits.try_recv() {
            tracing::debug!(worker = %self.id, actor = ?stale.actor.map(|a| format!("{}/{}", a.atespace, a.name)), "an exit reported while detached is told by the Join instead");
        }
        let joined_at = tokio::time::Instant::now();
        tx.send(wk::WorkerEvent {
            event: Some(Event::Join(join)),
        })
        .await
        .map_err(|_| tonic::Status::internal("event channel closed"))?;
        let mut inbound = client.attach(ReceiverStream::new(rx)).await?.into_inner();
        tracing::info!(worker = %self.id, pool = %self.config.pool, "attached to the control plane");
        self.drain
            .attached
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // Sent even when the Join says so: a control plane older than that field
        // learns of the drain only this way (a newer one ignores the repeat).
        let mut drain_sent = false;
        let reporter = report_activity(self.slot.subscribe(), tx.clone());
        tokio::pin!(reporter);
        let mut renewals = tokio::time::interval(RENEW_EVERY);
        renewals.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sent: std::collections::VecDeque<(u64, tokio::time::Instant)> =
            std::collections::VecDeque::new();
        let mut seq = 0u64;
        // The token this stream last carried, and when; a changed one goes with the
        // next renewal.
        let mut sent_token = None;
        // A lease that ran out before this attachment is renewed by its Welcome.
        let mut watch_lease = !self.lease.is_cut_off();
        // A restore or a checkpoint (which waits for the actor's requests in flight to
        // end) runs beside the loop: meanwhile it goes on renewing, and takes an
        // eviction or the end of a drain. One at a time: the worker has one slot.
        let mut working: Option<Working<'_>> = None;
        let ended: Result<(), tonic::Status> = async {
        loop {
            let cmd = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                done = async {
                    match working.as_mut() {
                        Some((_, _, _, w)) => w.as_mut().await,
                        None => std::future::pending().await,
                    }
                }, if working.is_some() => {
                    let (id, _, _, _) = working.take().expect("polled above");
                    if tx.send(wk::WorkerEvent { event: Some(Event::Reply(reply(id, done))) }).await.is_err() {
                        return Err(tonic::Status::unavailable("control plane stream closed"));
                    }
                    continue;
                }
                m = inbound.message() => m?,
                // Not while a restore runs: its answer goes first, so the control plane
                // knows the run an exit names before it hears of the exit.
                Some(exited) = exits.recv(), if working.is_none() => {
                    let event = wk::WorkerEvent { event: Some(Event::Exited(exited)) };
                    if tx.send(event).await.is_err() {
                        return Err(tonic::Status::unavailable("control plane stream closed"));
                    }
                    continue;
                }
                () = &mut reporter => {
                    return Err(tonic::Status::unavailable("control plane stream closed"));
                }
                () = self.drain.asked.cancelled(), if !drain_sent => {
                    drain_sent = true;
                    tracing::info!(worker = %self.id, hosting = ?self.hosting(), "stopping: asking the control plane to checkpoint the actor and give this worker nothing new");
                    let drain = wk::WorkerEvent { event: Some(Event::Drain(wk::Drain {})) };
                    if tx.send(drain).await.is_err() {
                        return Err(tonic::Status::unavailable("control plane stream closed"));
                    }
                    continue;
                }
                () = self.lease.cut_off(), if watch_lease => {
                    return Err(tonic::Status::unavailable("hosting lease ran out; attaching anew"));
                }
                _ = renewals.tick() => {
                    seq += 1;
                    sent.push_back((seq, tokio::time::Instant::now()));
                    if sent.len() > 64 {
                        sent.pop_front();
                    }
                    let bearer_token = changed_token(credentials.bearer_token(), &mut sent_token).await;
                    let renew = wk::WorkerEvent { event: Some(Event::Renew(wk::Renew { seq, bearer_token })) };
                    if tx.send(renew).await.is_err() {
                        return Err(tonic::Status::unavailable("control plane stream closed"));
                    }
                    continue;
                }
            };
            let Some(cmd) = cmd else {
                return Err(tonic::Status::unavailable(
                    "control plane closed the stream",
                ));
            };
            let Some(command) = cmd.command else { continue };
            let result = match command {
                Command::Welcome(w) => {
                    if !w.hosting_kept && hosting::vacate(&self.slot, None) {
                        tracing::warn!(worker = %self.id, "control plane did not keep our actor; evicting");
                    }
                    let lease = w
                        .hosting_lease
                        .and_then(|d| Duration::try_from(d).ok())
                        .unwrap_or(hosting::DEFAULT_HOSTING_LEASE);
                    // The kept actor's fence is lowered with the lease, in one step (the
                    // watchdog would too, a moment later): a command right behind the
                    // welcome finds it lowered.
                    let kept = self.slot.borrow().clone();
                    if w.hosting_kept
                        && let Some(Served::Program(host)) = kept.as_ref().map(|h| &h.app)
                    {
                        host.kept();
                    }
                    self.lease.welcomed(lease, joined_at, kept.as_ref().map(|h| &*h.traffic));
                    watch_lease = true;
                    continue;
                }
                Command::Renewed(r) => {
                    if let Some(&(_, at)) = sent.iter().find(|(s, _)| *s == r.seq) {
                        self.lease.answered(at);
                    }
                    continue;
                }
                Command::Restore(_) | Command::Checkpoint(_) if working.is_some() => Err(
                    Refusal::Failed("a restore or checkpoint is in progress on this worker".into()),
                ),
                Command::Restore(r) => {
                    let actor = actor_name(r.actor.as_ref());
                    let restore_id = cmd.id;
                    let restore = async move {
                        self.restore(r, restore_id).await.map(|()| Done::default()).map_err(Refusal::Failed)
                    };
                    let started = Arc::new(std::sync::atomic::AtomicBool::new(true));
                    working = Some((cmd.id, actor, started, Box::pin(restore)));
                    continue;
                }
                Command::Checkpoint(c) => {
                    let actor = actor_name(c.actor.as_ref());
                    let fenced = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    let checkpoint = self.checkpoint(c, Arc::clone(&fenced));
                    working = Some((cmd.id, actor, fenced, Box::pin(checkpoint)));
                    continue;
                }
                Command::Evict(e) => {
                    // A restore or checkpoint of the evicted actor is dropped (a
                    // checkpoint's fence with it): the actor is not here any more.
                    let evicted = actor_name(e.actor.as_ref());
                    if let Some((id, actor, _, _)) =
                        working.take_if(|(_, actor, _, _)| *actor == evicted)
                    {
                        let gone = Refusal::NotHosting(format!(
                            "{actor} was evicted during its restore or checkpoint"
                        ));
                        if tx
                            .send(wk::WorkerEvent {
                                event: Some(Event::Reply(reply(id, Err(gone)))),
                            })
                            .await
                            .is_err()
                        {
                            return Err(tonic::Status::unavailable("control plane stream closed"));
                        }
                    }
                    self.evict(e);
                    continue;
                }
                Command::Logs(l) => {
                    let logs = self.logs(l).await.map_err(Refusal::Failed);
                    if tx
                        .send(wk::WorkerEvent {
                            event: Some(Event::Reply(reply(cmd.id, logs))),
                        })
                        .await
                        .is_err()
                    {
                        return Err(tonic::Status::unavailable("control plane stream closed"));
                    }
                    continue;
                }
                Command::Drained(_) => {
                    tracing::info!(worker = %self.id, "drained: the control plane released this worker");
                    self.drain.done.cancel();
                    // The attachment stays until the worker stops (`stop`, once its app
                    // has): told `Drained` with its actor still here (the drain could
                    // not checkpoint it), the worker serves the actor's requests in
                    // flight meanwhile, and the control plane must not see it leave (and
                    // find its app port closed) before they end.
                    continue;
                }
                Command::Detach(_) => {
                    tracing::info!(
                        worker = %self.id,
                        hosting = ?self.hosting(),
                        "the control plane is shutting down; keeping the actor and attaching again later"
                    );
                    return Ok(());
                }
            };
            let reply = reply(cmd.id, result.map(|()| Done::default()));
            if tx
                .send(wk::WorkerEvent {
                    event: Some(Event::Reply(reply)),
                })
                .await
                .is_err()
            {
                return Err(tonic::Status::unavailable("control plane stream closed"));
            }
        }
        }
        .await;
        // Leaving the stream (cut, detached, drained) during a restore, or a checkpoint
        // that has fenced the actor: it runs to its end first, as it would have had it
        // been the only command, so the actor is not left half-restored, nor its
        // snapshot half-written, while the control plane moves on (it waits for this
        // worker to fence the actor, and sees what it hosts when it attaches again). A
        // checkpoint still waiting for the actor's requests to end is given up: nothing
        // changed yet, and a snapshot taken later could land after the control plane
        // has moved the actor. (A worker that stops drops either: its process ends.)
        if let Some((_, actor, started, work)) = working.take()
            && started.load(std::sync::atomic::Ordering::Acquire)
        {
            tracing::info!(worker = %self.id, %actor, "finishing the restore or checkpoint in progress before leaving the stream");
            let _ = work.await;
        }
        ended
    }

    fn hosting(&self) -> Option<String> {
        self.slot.borrow().as_ref().map(|h| h.actor.clone())
    }

    fn actor_dir(&self, slot: &wk::ActorSlot) -> Result<PathBuf, String> {
        let key = Path::new(&slot.snapshot_key);
        let safe = key
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !safe || slot.snapshot_key.is_empty() {
            return Err(format!("invalid snapshot key {:?}", slot.snapshot_key));
        }
        Ok(self.config.snapshot_dir.join(key))
    }

    /// Restores `r`'s actor, for the Restore command `restore_id`.
    async fn restore(&self, r: wk::Restore, restore_id: u64) -> Result<(), String> {
        let slot = r.actor.ok_or("restore without an actor")?;
        let actor = format!("{}/{}", slot.atespace, slot.name);
        if let Some(h) = self.slot.borrow().as_ref() {
            if h.actor == actor {
                return Ok(());
            }
            return Err(format!("worker already hosts {}", h.actor));
        }
        let dir = self.actor_dir(&slot)?;
        let app = if r.app.is_empty() {
            let template = self
                .config
                .templates
                .get(&r.template)
                .ok_or_else(|| format!(
                    "restore of {actor} failed: this worker has no template {:?} (give it the templates file with --templates)",
                    r.template
                ))?;
            let Some(program) = template.program() else {
                return Err(format!(
                    "restore of {actor} failed: template {} is a built-in app here, a program on the control plane",
                    r.template
                ));
            };
            let spec = Arc::new(program.clone());
            tokio::time::sleep(self.config.restore_delay).await;
            let host = runtime::Host::restore(&self.programs, slot.clone(), dir, spec, &r.snapshot)
                .await
                .map_err(|e| {
                    tracing::warn!(worker = %self.id, %actor, error = %e, "restore failed");
                    format!("restore of {actor} failed: {e}")
                })?;
            Served::Program(host)
        } else {
            let builtin: valet_template::Builtin = r.app.parse()?;
            let revert = r.revert;
            let memory = tokio::task::spawn_blocking({
                let dir = dir.clone();
                move || prepare_restore(&dir, revert)
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("restore of {actor} failed: {e}"))?;
            tokio::time::sleep(self.config.restore_delay).await;
            match builtin {
                valet_template::Builtin::Counter => {
                    Served::Counter(Counter::new(memory, dir.join("data").join("counter")))
                }
                valet_template::Builtin::Echo => Served::Echo,
            }
        };
        let program = match &app {
            Served::Program(host) => Some(Arc::clone(host)),
            Served::Counter(_) | Served::Echo => None,
        };
        let hosted = Hosted::new(actor.clone(), app, slot.snapshot_key.clone());
        self.lease.install(&self.slot, Arc::new(hosted));
        if let Some(host) = program
            && let Err(e) = host.installed(restore_id)
        {
            hosting::vacate(&self.slot, Some(&actor));
            tracing::warn!(worker = %self.id, %actor, error = %e, "restore failed");
            return Err(format!("restore of {actor} failed: {e}"));
        }
        tracing::info!(worker = %self.id, %actor, "restored");
        Ok(())
    }

    /// Fences the actor (a policy's checkpoint only if it is idle since the mark it
    /// names; an explicit one once its requests in flight have ended), then snapshots it
    /// and lets it go.
    async fn checkpoint(
        &self,
        c: wk::Checkpoint,
        fence_raised: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Done, Refusal> {
        let slot = c
            .actor
            .ok_or(Refusal::Failed("checkpoint without an actor".into()))?;
        let actor = format!("{}/{}", slot.atespace, slot.name);
        let hosted = self.slot.borrow().clone();
        let Some(hosted) = hosted.filter(|h| h.actor == actor) else {
            return Err(Refusal::NotHosting(format!("worker does not host {actor}")));
        };
        let dir = self.actor_dir(&slot).map_err(Refusal::Failed)?;
        let fence = match c.fence {
            Some(wk::checkpoint::Fence::IdleSince(mark)) => Fence::IdleSince(mark),
            Some(wk::checkpoint::Fence::WaitIdle(_)) | None => Fence::WaitIdle,
        };
        let idle_wait = c
            .idle_wait
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or(Duration::MAX);
        let fenced = match tokio::time::timeout(idle_wait, hosted.traffic.fence(fence)).await {
            Ok(fenced) => fenced.is_ok(),
            Err(_) => false,
        };
        if !fenced {
            tracing::debug!(worker = %self.id, %actor, "checkpoint refused: the actor is busy");
            return Err(Refusal::Busy);
        }
        // Dropped before the snapshot is taken (the checkpoint was given up): the
        // actor serves again.
        let fence_held = FenceHeld(Some(&hosted.traffic));
        fence_raised.store(true, std::sync::atomic::Ordering::Release);
        let snapshot = match &hosted.app {
            Served::Program(host) => match host.checkpoint(&c.snapshot).await {
                Ok(taken) => taken.id,
                Err(runtime::CheckpointFailure::StillRunning(e)) => {
                    drop(fence_held);
                    tracing::warn!(worker = %self.id, %actor, error = %e, "checkpoint failed; the actor keeps running");
                    return Err(Refusal::StillRunning(e));
                }
                Err(runtime::CheckpointFailure::Failed(e)) => {
                    // Its program is not running: the actor leaves this worker.
                    fence_held.keep();
                    hosting::vacate(&self.slot, Some(&actor));
                    return Err(Refusal::Failed(e));
                }
            },
            Served::Counter(_) | Served::Echo => {
                let memory = match &hosted.app {
                    Served::Counter(c) => c.memory(),
                    _ => 0,
                };
                let full = c.full;
                let taken = tokio::task::spawn_blocking(move || take_snapshot(&dir, full, memory))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.map_err(|e| format!("checkpoint of {actor} failed: {e}")));
                if let Err(e) = taken {
                    drop(fence_held);
                    return Err(Refusal::Failed(e));
                }
                String::new()
            }
        };
        fence_held.keep();
        hosting::vacate(&self.slot, Some(&actor));
        tracing::info!(worker = %self.id, %actor, full = c.full, snapshot, "checkpointed");
        Ok(Done {
            snapshot,
            ..Done::default()
        })
    }

    /// The last output of an actor's program: from the program hosted here, or from
    /// its output file in the snapshot directory.
    async fn logs(&self, l: wk::Logs) -> Result<Done, String> {
        let slot = l.actor.ok_or("logs without an actor")?;
        let actor = format!("{}/{}", slot.atespace, slot.name);
        let hosted = self.slot.borrow().clone();
        if let Some(h) = hosted.filter(|h| h.actor == actor)
            && let Served::Program(host) = &h.app
        {
            return Ok(Done {
                output: host.output().contents(),
                ..Done::default()
            });
        }
        let dir = self.actor_dir(&slot)?;
        let output = tokio::task::spawn_blocking(move || output::read_file(&dir))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("reading the output of {actor}: {e}"))?;
        Ok(Done {
            output,
            ..Done::default()
        })
    }

    fn evict(&self, e: wk::Evict) {
        let Some(slot) = e.actor else { return };
        let actor = format!("{}/{}", slot.atespace, slot.name);
        if hosting::vacate(&self.slot, Some(&actor)) {
            tracing::info!(worker = %self.id, %actor, "evicted");
        }
    }
}

/// Readies an actor's directory for a restore and returns its memory count.
fn prepare_restore(dir: &Path, revert: bool) -> std::io::Result<u64> {
    let data = dir.join("data");
    create_dir_durably(&data)?;
    // What a crash left between a temporary file's write and its rename: never
    // read, and nothing else would ever remove it.
    for d in [dir.to_path_buf(), data.clone(), dir.join("good")] {
        remove_temporaries(&d)?;
    }
    let counter = data.join("counter");
    if revert {
        match read_counter(&dir.join("good").join("counter")) {
            Ok(Some(n)) => write_durably(&counter, n.to_string().as_bytes())?,
            // A revert to an unreadable snapshot fails: it never silently starts over.
            Err(e) => return Err(e),
            Ok(None) => match std::fs::remove_file(&counter) {
                Ok(()) => app::sync_dir_of(&counter)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            },
        }
    }
    // The app refuses to start on a corrupt data directory.
    read_counter(&counter)?;
    // No memory file: the last snapshot kept the data only.
    let memory_file = dir.join("memory");
    match std::fs::read_to_string(&memory_file) {
        Ok(s) => s.trim().parse().map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("corrupt memory snapshot {}", memory_file.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

/// Removes the temporary files (`*.tmp`, see `app::write_atomically`) in `dir`.
fn remove_temporaries(dir: &Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|x| x == "tmp") && path.is_file() {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Writes a snapshot: the memory count for a full one (dropped for a data one), and
/// the data directory's counter as the last good snapshot.
fn take_snapshot(dir: &Path, full: bool, memory: u64) -> std::io::Result<()> {
    // The app's last write to its data directory (a rename) is made durable before
    // the checkpoint is acknowledged: a restore reads that directory.
    let data = dir.join("data");
    if data.exists() {
        app::sync_dir_of(&data.join("counter"))?;
    }
    let memory_file = dir.join("memory");
    if full {
        write_durably(&memory_file, memory.to_string().as_bytes())?;
    } else {
        match std::fs::remove_file(&memory_file) {
            Ok(()) => app::sync_dir_of(&memory_file)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    let good = dir.join("good");
    create_dir_durably(&good)?;
    match read_counter(&dir.join("data").join("counter"))? {
        Some(n) => write_durably(&good.join("counter"), n.to_string().as_bytes()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that starts on the second of two replicas tries the first at once when
    /// the second fails, and pauses only once both were tried. Before, it paused after
    /// trying only the second (the pause came at each pass over index 0).
    #[test]
    fn every_replica_is_tried_before_a_pause_wherever_the_rotation_starts() {
        let mut turn = Rotation::starting_at(1, 2);
        let mut seen = Vec::new();
        for _ in 0..4 {
            let at = turn.current();
            seen.push((at, turn.advance()));
        }
        assert_eq!(seen, [(1, false), (0, true), (1, false), (0, true)]);
        let mut one = Rotation::starting_at(0, 1);
        assert_eq!((one.current(), one.advance()), (0, true));
    }

    /// A pool's workers spread over the replicas they list (each starts with the one
    /// its id picks), and one replica is always the first.
    #[test]
    fn workers_spread_over_replicas() {
        let mut counts = [0usize; 2];
        for i in 0..20 {
            counts[first_replica(&format!("w{i:02}"), 2)] += 1;
        }
        assert!(counts.iter().all(|&c| c >= 5), "{counts:?}");
        assert_eq!(first_replica("w01", 1), 0);
        assert_eq!(first_replica("anything", 0), 0);
        assert_eq!(first_replica("w01", 3), first_replica("w01", 3), "stable");
    }

    /// The app on a loopback port, hosting `demo/p1`; stopped when the token is.
    async fn app_serving() -> (SocketAddr, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hosted = Hosted::new(
            "demo/p1".into(),
            Served::Counter(Counter::new(0, PathBuf::from("/nonexistent/counter"))),
            "demo/p1".into(),
        );
        let slot: Slot = Arc::new(tokio::sync::watch::Sender::new(Some(Arc::new(hosted))));
        let stop = CancellationToken::new();
        tokio::spawn(serve_app(listener, slot, stop.clone()));
        (addr, stop)
    }

    /// What the app answers to `request` (raw bytes), read until it closes.
    async fn raw(addr: SocketAddr, request: &[u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(request).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(120), c.read_to_end(&mut out))
            .await
            .expect("the app closes the connection");
        String::from_utf8_lossy(&out).into_owned()
    }

    /// An `x-actor-ref` that is not UTF-8 names no actor hosted here: 421. Before, it
    /// counted as no header, and the hosted actor served the request.
    #[tokio::test]
    async fn an_actor_ref_that_is_not_utf8_is_misdirected() {
        let (addr, stop) = app_serving().await;
        let answer = raw(
            addr,
            b"GET / HTTP/1.1\r\nHost: w\r\nx-actor-ref: demo/p\xff1\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 421"), "{answer}");
        stop.cancel();
    }

    /// An idle keep-alive connection outlives the clients' pools
    /// ([`valet_proto::WORKER_POOL_IDLE`]): a client never sends a request on one the
    /// app is closing that moment. Before, the app closed idle connections exactly when
    /// the router's pool let them go, and a request racing the close got a 502.
    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_outlives_the_clients_pools() {
        let (addr, stop) = app_serving().await;
        let io = hyper_util::rt::TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
        let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        let get = || {
            hyper::Request::get("/")
                .header("host", "w")
                .header("x-actor-ref", "demo/other")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap()
        };
        let first = send.send_request(get()).await.unwrap();
        assert_eq!(first.status(), 421);
        drop(first);
        tokio::time::sleep(valet_proto::WORKER_POOL_IDLE + Duration::from_secs(5)).await;
        let again = send
            .send_request(get())
            .await
            .expect("the connection is still open");
        assert_eq!(again.status(), 421);
        stop.cancel();
    }

    /// A connection that never finishes its request's headers is closed after
    /// [`APP_HEADER_TIMEOUT`]. Before, hyper had no timer and held it for good.
    #[tokio::test(start_paused = true)]
    async fn a_request_whose_headers_never_end_is_closed() {
        let (addr, stop) = app_serving().await;
        let started = tokio::time::Instant::now();
        let answer = raw(addr, b"GET / HTTP/1.1\r\nHost: w\r\n").await;
        assert!(
            started.elapsed() >= APP_HEADER_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
        assert!(!answer.contains("200 OK"), "{answer}");
        stop.cancel();
    }

    /// A restore removes the temporary files a crash left (between a write and its
    /// rename); the files themselves stay as they were.
    #[test]
    fn a_restore_removes_leftover_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let actor = dir.path();
        std::fs::create_dir_all(actor.join("data")).unwrap();
        std::fs::create_dir_all(actor.join("good")).unwrap();
        std::fs::write(actor.join("data").join("counter"), "7").unwrap();
        let left = [
            actor.join("data").join("counter.41.0.00ff00ff00ff00ff.tmp"),
            actor.join("good").join("counter.41.1.00ff00ff00ff00ff.tmp"),
            actor.join("memory.41.2.00ff00ff00ff00ff.tmp"),
        ];
        for f in &left {
            std::fs::write(f, "9").unwrap();
        }
        assert_eq!(prepare_restore(actor, false).unwrap(), 0);
        for f in &left {
            assert!(!f.exists(), "{} removed", f.display());
        }
        assert_eq!(
            std::fs::read_to_string(actor.join("data").join("counter")).unwrap(),
            "7"
        );
    }

    /// A restore never starts an actor over from an unreadable snapshot: a corrupt
    /// last good data snapshot (on revert) or memory snapshot is an error.
    #[test]
    fn a_restore_from_an_unreadable_snapshot_fails() {
        let dir = tempfile::tempdir().unwrap();
        let actor = dir.path();
        std::fs::create_dir_all(actor.join("data")).unwrap();
        std::fs::create_dir_all(actor.join("good")).unwrap();
        std::fs::write(actor.join("data").join("counter"), "7").unwrap();
        std::fs::write(actor.join("good").join("counter"), "5").unwrap();
        std::fs::write(actor.join("memory"), "3").unwrap();
        assert_eq!(prepare_restore(actor, false).unwrap(), 3);
        assert_eq!(prepare_restore(actor, true).unwrap(), 3);
        assert_eq!(
            std::fs::read_to_string(actor.join("data").join("counter")).unwrap(),
            "5",
            "reverted to the last good snapshot"
        );

        std::fs::write(actor.join("good").join("counter"), "garbage").unwrap();
        let e = prepare_restore(actor, true).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(
            std::fs::read_to_string(actor.join("data").join("counter")).unwrap(),
            "5",
            "the data is left as it was"
        );

        std::fs::write(actor.join("memory"), "garbage").unwrap();
        let e = prepare_restore(actor, false).unwrap_err();
        assert!(e.to_string().contains("corrupt memory snapshot"), "{e}");
        std::fs::remove_file(actor.join("memory")).unwrap();
        assert_eq!(prepare_restore(actor, false).unwrap(), 0, "a data snapshot");
    }

    /// A renewal carries the token when it changed, and an unchanged one again every
    /// 10 s: the control plane may have refused it (a key it had not loaded yet)
    /// without a word, and would otherwise never see it again.
    #[tokio::test(start_paused = true)]
    async fn renewals_carry_a_changed_token_and_resend_it_every_10s() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "one\n").unwrap();
        let token = valet_proto::auth::BearerToken::file(&file);
        let mut sent = None;
        assert_eq!(changed_token(&token, &mut sent).await, "one");
        assert_eq!(changed_token(&token, &mut sent).await, "", "unchanged");
        std::fs::write(&file, "two").unwrap();
        assert_eq!(changed_token(&token, &mut sent).await, "two");
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(changed_token(&token, &mut sent).await, "");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(changed_token(&token, &mut sent).await, "two", "sent again");
        std::fs::write(&file, "").unwrap();
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(
            changed_token(&token, &mut sent).await,
            "",
            "never an empty one"
        );
    }
}
