//! valet, embedded: the reference control plane serving gRPC on loopback (and its
//! probes and metrics, if asked), with in-process workers attached to it. `valet up`,
//! the scenarios and the tests that need a real control plane all start it the same
//! way.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use valet_control::plane::DEFAULT_SHUTDOWN_TIMEOUT;
use valet_control::{Plane, PlaneConfig, SqliteStore};
use valet_worker::{Worker, WorkerConfig};

/// How long a stop waits for the control plane's remaining tasks.
const CLOSE_MAX: Duration = Duration::from_secs(10);

/// How long workers may take to join their pools.
const JOIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Workers of one pool.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    /// The pool (and template) name.
    pub pool: String,
    /// How many workers.
    pub workers: usize,
    /// Worker ids are `<prefix>-<n>`, stable across restarts.
    pub id_prefix: String,
}

impl PoolSpec {
    /// `workers` workers in pool `pool`, with ids `<pool>-<n>`.
    pub fn new(pool: &str, workers: usize) -> Self {
        Self {
            pool: pool.to_owned(),
            workers,
            id_prefix: pool.to_owned(),
        }
    }
}

/// How to start an embedded system.
#[derive(Debug, Clone)]
pub struct EmbeddedConfig {
    /// The database and the snapshots live here.
    pub data_dir: PathBuf,
    /// The control plane's gRPC address (port 0 picks one).
    pub listen: SocketAddr,
    /// How the control plane behaves.
    pub plane: PlaneConfig,
    /// Extra time each restore takes.
    pub restore_delay: Duration,
    /// The workers to start.
    pub pools: Vec<PoolSpec>,
    /// Where the control plane serves `/metrics`, `/healthz` and `/readyz`, if at all.
    pub metrics_listen: Option<SocketAddr>,
    /// How long the control plane's shutdown waits for operations in progress.
    pub shutdown_timeout: Duration,
    /// TLS: the control plane's server settings and the workers' credentials; h2c
    /// when `None`.
    pub tls: Option<EmbeddedTls>,
    /// The templates the control plane and the workers know (the plane's own list is
    /// taken from here).
    pub templates: valet_template::Templates,
    /// The largest data directory a program's checkpoint snapshots.
    pub snapshot_max_bytes: u64,
    /// A cgroup v2 delegated to the workers, for their programs' limits.
    pub cgroup: Option<valet_worker::Cgroup>,
}

/// TLS inside the embedded system.
#[derive(Debug, Clone)]
pub struct EmbeddedTls {
    /// The control plane's server side.
    pub server: valet_control::auth::ServerSecurity,
    /// What the workers present and check.
    pub client: valet_proto::auth::ClientCredentials,
}

impl EmbeddedConfig {
    /// An embedded system in `data_dir` on a free loopback port with `workers` workers in pool
    /// `counter`.
    pub fn counter(data_dir: impl Into<PathBuf>, workers: usize) -> Self {
        Self {
            data_dir: data_dir.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            plane: PlaneConfig::default(),
            restore_delay: Duration::ZERO,
            pools: vec![PoolSpec::new("counter", workers)],
            metrics_listen: None,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            tls: None,
            templates: valet_template::Templates::builtin(),
            snapshot_max_bytes: valet_worker::DEFAULT_SNAPSHOT_MAX_BYTES,
            cgroup: None,
        }
    }

    /// Its pools' workers run `template`'s program or app: it is known to the control
    /// plane and the workers, and `pool` (its name) gets `workers` workers.
    pub fn with_template(mut self, template: valet_template::Template, workers: usize) -> Self {
        self.pools = vec![PoolSpec::new(template.name(), workers)];
        self.templates.insert(template);
        self
    }
}

/// A running control plane with its workers.
#[derive(Debug)]
pub struct Embedded {
    /// The control plane.
    pub plane: Plane,
    /// Where it serves gRPC.
    pub addr: SocketAddr,
    /// Where it serves its probes and metrics, if it does.
    pub metrics_addr: Option<SocketAddr>,
    /// Its workers, in the order of the pool specs.
    pub workers: Vec<Worker>,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<()>,
    metrics: Option<tokio::task::JoinHandle<()>>,
}

impl Embedded {
    /// Opens the store, serves the control plane, starts the workers and waits until
    /// every pool is complete.
    ///
    /// # Errors
    /// When a part cannot start, naming it.
    pub async fn start(config: EmbeddedConfig) -> Result<Self, String> {
        let store = SqliteStore::open(&config.data_dir).map_err(|e| e.to_string())?;
        Self::start_on(store, config).await
    }

    /// [`Self::start`] on a store the caller opened (and so locked) already. A part
    /// that cannot start stops those started before it: nothing outlives the error,
    /// the store's lock included.
    ///
    /// # Errors
    /// When a part cannot start, naming it.
    pub async fn start_on(store: SqliteStore, mut config: EmbeddedConfig) -> Result<Self, String> {
        config.plane.templates = config.templates.iter().cloned().collect();
        config.plane.check_templates()?;
        // Every port first: nothing is running yet should one be taken.
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let metrics_listener = match config.metrics_listen {
            Some(at) => Some(
                TcpListener::bind(at)
                    .await
                    .map_err(|e| format!("cannot listen on --metrics-listen={at}: {e}"))?,
            ),
            None => None,
        };
        let metrics_addr = match &metrics_listener {
            Some(l) => Some(l.local_addr().map_err(|e| e.to_string())?),
            None => None,
        };
        let plane = Plane::open(Arc::new(store), config.plane.clone())
            .await
            .map_err(|e| e.to_string())?;
        let stop = CancellationToken::new();
        let metrics = metrics_listener
            .map(|l| valet_control::admin::spawn(l, plane.clone(), stop.child_token()));
        let (security, credentials, scheme) = match &config.tls {
            Some(t) => (t.server.clone(), t.client.clone(), "https"),
            None => (Default::default(), Default::default(), "http"),
        };
        let server = {
            let (plane, stop) = (plane.clone(), stop.clone());
            let timeout = config.shutdown_timeout;
            tokio::spawn(async move {
                let shutdown = async move { stop.cancelled().await };
                if let Err(e) =
                    valet_control::serve(listener, plane, shutdown, timeout, security).await
                {
                    tracing::error!(error = %e, "control plane failed");
                }
            })
        };
        let mut embedded = Self {
            plane,
            addr,
            metrics_addr,
            workers: Vec::new(),
            stop,
            server,
            metrics,
        };
        if let Err(e) = embedded.start_workers(&config, &credentials, scheme).await {
            embedded.shutdown().await;
            return Err(e);
        }
        Ok(embedded)
    }

    /// Starts the workers of every pool and waits until each pool has as many (at
    /// least: a worker started separately may have joined too).
    async fn start_workers(
        &mut self,
        config: &EmbeddedConfig,
        credentials: &valet_proto::auth::ClientCredentials,
        scheme: &str,
    ) -> Result<(), String> {
        for spec in &config.pools {
            for i in 1..=spec.workers {
                let worker = Worker::spawn(WorkerConfig {
                    credentials: credentials.clone(),
                    control_plane: format!("{scheme}://{}", self.addr),
                    pool: spec.pool.clone(),
                    listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                    snapshot_dir: config.data_dir.join("snapshots"),
                    restore_delay: config.restore_delay,
                    worker_id: Some(format!("{}-{i}", spec.id_prefix)),
                    advertise: None,
                    templates: config.templates.clone(),
                    run_dir: config.data_dir.join("run"),
                    snapshot_max_bytes: config.snapshot_max_bytes,
                    cgroup: config.cgroup.clone(),
                })
                .await
                .map_err(|e| e.to_string())?;
                self.workers.push(worker);
            }
        }
        let pools = config.pools.clone();
        let complete = self
            .plane
            .wait_until(JOIN_TIMEOUT, |p| {
                pools.iter().all(|s| p.pool(&s.pool).0 >= s.workers)
            })
            .await;
        if !complete {
            return Err(format!(
                "workers did not join their pools within {JOIN_TIMEOUT:?} (is the control plane refusing their credentials?)"
            ));
        }
        Ok(())
    }

    /// The control plane's URL (`http://ip:port`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Checkpoints every running actor (each waits for its requests in flight), so the
    /// next start restores each from a fresh snapshot; bounded by `timeout`, after which
    /// the actors not checkpointed come back from their last snapshot.
    pub async fn checkpoint_all(&self, timeout: Duration) {
        let left = self.plane.checkpoint_all(timeout).await;
        if !left.is_empty() {
            tracing::warn!(
                actors = ?left,
                "not checkpointed within the shutdown timeout; they resume from their last snapshot"
            );
        }
    }

    /// Shuts the control plane down cleanly (waiters answered, operations in progress
    /// finished, workers detached), then stops the workers.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.server.await;
        if let Some(m) = self.metrics {
            let _ = m.await;
        }
        // Together: each may finish a restore or checkpoint in progress first, and a
        // stop waits for the slowest of them, not for their sum.
        let mut workers = tokio::task::JoinSet::new();
        for w in self.workers {
            workers.spawn(w.shutdown());
        }
        workers.join_all().await;
        // The plane's shutdown (in `serve`) already gave its operations their time:
        // what is left of its tasks gets a bounded moment, then ends with the process.
        if tokio::time::timeout(CLOSE_MAX, self.plane.close())
            .await
            .is_err()
        {
            tracing::warn!(
                "the control plane's tasks did not end within {CLOSE_MAX:?}; stopping without them"
            );
        }
    }
}
