//! Real processes for scenarios (`valet load scenario … --processes`):
//! PostgreSQL (a given URL, or a throwaway server this module starts), two
//! `valet control-plane` replicas on it (all active, with no leader),
//! `valet worker` processes listing both replicas, and two `valet router` processes
//! listing both replicas. Every child is killed when they are dropped; their
//! logs (at `warn`) go to files in a temporary directory, quoted when a part fails to
//! start.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::transport::Channel;
use valet_control::tempdb::TempPostgres;
use valet_proto::ateapi::{self, control_client::ControlClient};

use crate::generate::HttpClient;
use crate::system::DOMAIN;

/// How long one probe or metrics request may take.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a part may take to start.
const START_WITHIN: Duration = Duration::from_secs(30);

/// Which processes to start.
#[derive(Debug, Clone)]
pub struct ProcessesOpts {
    /// The `valet` binary every part runs as.
    pub exe: PathBuf,
    /// A PostgreSQL URL (`postgres://…`); a throwaway server when `None`.
    pub database: Option<String>,
    /// Control-plane replicas (all active).
    pub replicas: usize,
    /// Routers, each listing every replica.
    pub routers: usize,
    /// Workers in pool `counter`.
    pub workers: usize,
    /// Each restore's extra time.
    pub restore_delay: Duration,
    /// The control planes' `--capacity-wait`.
    pub capacity_wait: bool,
    /// Extra router flags.
    pub router_flags: Vec<String>,
}

/// The running processes.
pub struct Processes {
    /// The replicas' gRPC URLs, in the order they were started.
    pub replicas: Vec<String>,
    /// The routers' HTTP addresses.
    pub routers: Vec<SocketAddr>,
    /// The replicas' probe and metrics addresses, in the order of `replicas`.
    pub replica_metrics: Vec<SocketAddr>,
    /// The routers' admin addresses (`/metrics`), in the order of `routers`.
    pub router_admins: Vec<SocketAddr>,
    /// What the database is (a throwaway server's port or "given").
    pub database: String,
    children: Vec<Child>,
    drains: JoinSet<()>,
    // Dropped after the children (fields drop in order): the server outlives them.
    pg: Option<TempPostgres>,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for Processes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processes")
            .field("replicas", &self.replicas)
            .field("routers", &self.routers)
            .finish_non_exhaustive()
    }
}

/// `program` (a `valet` binary, or a profiler wrapping one) as a part a scenario
/// starts: only the flags given configure it, no `VALET_…` variable of this process (a
/// `--route-lease`, a budget, a log level left in the shell) leaks into it; it logs
/// warnings and is killed when dropped. Its stdin is a pipe nobody writes to, held by
/// its `Child`: should this process die without dropping it (SIGKILL), the pipe ends
/// and the part stops by itself (`VALET_STOP_WITH_PARENT`).
pub fn part_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("VALET_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("VALET_LOG", "warn")
        .env("VALET_STOP_WITH_PARENT", "1")
        .stdin(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// A child `valet` process, its log (stderr) in `log`.
fn command(exe: &Path, args: &[String], log: &Path) -> Result<Command, String> {
    let stderr = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = part_command(exe);
    cmd.args(args).stderr(stderr).kill_on_drop(true);
    Ok(cmd)
}

/// The last lines of a child's log, for an error message.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let last = lines[lines.len().saturating_sub(5)..].join("\n");
    if last.is_empty() {
        String::new()
    } else {
        format!("; its log ends:\n{last}")
    }
}

/// Starts `exe args…` (its log in `log`) and waits until it has printed a
/// `listening <part> <addr>` (or `bound <part> <addr>`) line for every part of
/// `parts`.
async fn spawn(
    exe: &Path,
    args: &[String],
    log: &Path,
    parts: &[&str],
    drains: &mut JoinSet<()>,
) -> Result<(Child, HashMap<String, SocketAddr>), String> {
    let what = args.first().map_or("valet", String::as_str).to_owned();
    let mut child = command(exe, args, log)?
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let mut seen = HashMap::new();
    tokio::time::timeout(START_WITHIN, async {
        while let Ok(Some(line)) = lines.next_line().await {
            // `listening <part> <addr>`, or `bound <part> <addr>` (a control plane's
            // reserved gRPC port, before it is active): keyed `<part>` and
            // `bound <part>`.
            let (prefix, rest) = match line.strip_prefix("listening ") {
                Some(rest) => ("", rest),
                None => match line.strip_prefix("bound ") {
                    Some(rest) => ("bound ", rest),
                    None => continue,
                },
            };
            if let Some((part, a)) = rest.split_once(' ')
                && let Ok(a) = a.parse::<SocketAddr>()
            {
                seen.insert(format!("{prefix}{part}"), a);
                if parts.iter().all(|p| seen.contains_key(*p)) {
                    return;
                }
            }
        }
    })
    .await
    .map_err(|_| {
        format!(
            "valet {what} did not start within {START_WITHIN:?}{}",
            tail(log)
        )
    })?;
    if !parts.iter().all(|p| seen.contains_key(*p)) {
        return Err(format!(
            "valet {what} exited before it listened{}",
            tail(log)
        ));
    }
    // Keep draining stdout so the child never blocks on a full pipe (owned by the
    // processes: aborted when it is dropped).
    drains.spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, seen))
}

impl Processes {
    /// Starts the database (unless given), the replicas, the workers and the routers,
    /// and creates atespace `demo`.
    ///
    /// # Errors
    /// When a part does not start (the message names it).
    pub async fn start(opts: &ProcessesOpts) -> Result<Self, String> {
        if opts.replicas == 0 || opts.routers == 0 {
            return Err("the processes need at least one replica and one router".into());
        }
        if opts.database.is_none() {
            valet_control::tempdb::installed().map_err(|e| {
                format!(
                    "a throwaway database for --processes: {e}; or pass --database postgres://…"
                )
            })?;
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut drains = JoinSet::new();
        let (pg, url) = match &opts.database {
            Some(url) => (None, url.clone()),
            None => {
                // A failure panics with the failed step and its output (printed
                // above); the blocking task catches it.
                let pg = tokio::task::spawn_blocking(TempPostgres::start)
                    .await
                    .map_err(|_| {
                        "a throwaway PostgreSQL server did not start (see above); or pass --database postgres://…".to_owned()
                    })?;
                let url = pg.url();
                (Some(pg), url)
            }
        };
        let database = pg.as_ref().map_or_else(
            || "given by --database".to_owned(),
            |p| format!("throwaway PostgreSQL on 127.0.0.1:{}", p.port()),
        );
        let mut children = Vec::new();
        let mut replicas = Vec::new();
        let mut replica_metrics = Vec::new();
        for i in 0..opts.replicas {
            let args: Vec<String> = [
                "control-plane",
                "--listen",
                "127.0.0.1:0",
                "--database",
                &url,
                "--data-dir",
                &dir.path().join("unused").display().to_string(),
                "--metrics-listen",
                "127.0.0.1:0",
                "--capacity-wait",
                if opts.capacity_wait { "on" } else { "off" },
                "--idle-suspend-after",
                "0",
            ]
            .map(str::to_owned)
            .to_vec();
            let log = dir.path().join(format!("replica-{}.log", i + 1));
            // A replica reserves its gRPC port at start (`bound control-plane`), and
            // listens once it joined the others.
            let (child, seen) = spawn(
                &opts.exe,
                &args,
                &log,
                &["metrics", "bound control-plane"],
                &mut drains,
            )
            .await
            .map_err(|e| format!("replica {}: {e}", i + 1))?;
            children.push(child);
            // Every replica serves (`--active-replicas all`): its probes say ready.
            wait_ready(seen["metrics"])
                .await
                .map_err(|e| format!("replica {}: {e}{}", i + 1, tail(&log)))?;
            replicas.push(format!("http://{}", seen["bound control-plane"]));
            replica_metrics.push(seen["metrics"]);
        }
        let list = replicas.join(",");
        let ctl = ControlClient::new(
            tonic::transport::Endpoint::from_shared(replicas[0].clone())
                .map_err(|e| e.to_string())?
                .timeout(Duration::from_secs(30))
                .connect_lazy(),
        );
        let snapshots = dir.path().join("snapshots");
        for i in 0..opts.workers {
            let args: Vec<String> = [
                "worker",
                "--control-plane",
                &list,
                "--snapshot-dir",
                &snapshots.display().to_string(),
                "--worker-id",
                &format!("processes-w{i}"),
                "--restore-delay",
                &valet_router::config::fmt_duration(opts.restore_delay),
            ]
            .map(str::to_owned)
            .to_vec();
            let log = dir.path().join(format!("worker-{}.log", i + 1));
            let child = command(&opts.exe, &args, &log)?
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| format!("{}: {e}", opts.exe.display()))?;
            children.push(child);
        }
        if let Err(e) = wait_workers(&ctl, opts.workers).await {
            // What the workers said (the directory goes with this error).
            let said: String = (1..=opts.workers)
                .filter_map(|i| {
                    let t = tail(&dir.path().join(format!("worker-{i}.log")));
                    (!t.is_empty()).then(|| format!("\nworker {i}{t}"))
                })
                .take(3)
                .collect();
            return Err(format!("{e}{said}"));
        }
        match ctl
            .clone()
            .create_atespace(ateapi::CreateAtespaceRequest {
                name: "demo".into(),
            })
            .await
        {
            Ok(_) => {}
            Err(e) if e.code() == tonic::Code::AlreadyExists => {}
            Err(e) => return Err(format!("create atespace demo: {}", e.message())),
        }
        let mut routers = Vec::new();
        let mut router_admins = Vec::new();
        for i in 0..opts.routers {
            let mut args: Vec<String> = [
                "router",
                "--listen",
                "127.0.0.1:0",
                "--extproc-listen",
                "",
                "--admin-listen",
                "127.0.0.1:0",
                "--control-plane",
                &list,
            ]
            .map(str::to_owned)
            .to_vec();
            args.extend(opts.router_flags.iter().cloned());
            let log = dir.path().join(format!("router-{}.log", i + 1));
            let (child, seen) = spawn(&opts.exe, &args, &log, &["router", "admin"], &mut drains)
                .await
                .map_err(|e| format!("router {}: {e}", i + 1))?;
            children.push(child);
            routers.push(seen["router"]);
            router_admins.push(seen["admin"]);
        }
        Ok(Self {
            replicas,
            routers,
            replica_metrics,
            router_admins,
            database,
            children,
            drains,
            pg,
            _dir: dir,
        })
    }

    /// A client of the active replica.
    ///
    /// # Errors
    /// Never in practice (the URL was built here).
    pub fn control_client(&self) -> Result<ControlClient<Channel>, String> {
        Ok(ControlClient::new(
            tonic::transport::Endpoint::from_shared(self.replicas[0].clone())
                .map_err(|e| e.to_string())?
                .timeout(Duration::from_secs(60))
                .connect_lazy(),
        ))
    }

    /// Kills every process, then stops the throwaway server (off the runtime's
    /// threads: `pg_ctl stop` waits).
    pub async fn shutdown(mut self) {
        for child in self.children.iter_mut().rev() {
            let _ = child.kill().await;
        }
        self.drains.shutdown().await;
        if let Some(pg) = self.pg.take() {
            let _ = tokio::task::spawn_blocking(move || drop(pg)).await;
        }
    }
}

/// Waits until a replica's `/readyz` says it serves (200).
async fn wait_ready(metrics: SocketAddr) -> Result<(), String> {
    let client = HttpClient::new(DOMAIN);
    let deadline = Instant::now() + START_WITHIN;
    loop {
        let (status, body) = tokio::time::timeout(
            PROBE_TIMEOUT,
            client.get_host(metrics, "127.0.0.1", "/readyz"),
        )
        .await
        .unwrap_or_else(|_| (0, "no answer".into()));
        if status == 200 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            // Until it joined the others, a starting replica looks like a standby:
            // still one after the wait, a control plane with `--active-replicas one`
            // holds the database.
            let hint = if status == 503 && body.contains("standby") {
                "; does a control plane with --active-replicas one hold this database? --database must be one no control plane uses"
            } else {
                ""
            };
            return Err(format!(
                "not serving within {START_WITHIN:?} (/readyz: {status} {}){hint}",
                body.trim()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `n` workers are attached.
pub(crate) async fn wait_workers(ctl: &ControlClient<Channel>, n: usize) -> Result<(), String> {
    let deadline = Instant::now() + START_WITHIN;
    let mut attached = 0;
    while Instant::now() < deadline {
        let listed = tokio::time::timeout_at(deadline, ctl.clone().list_workers(())).await;
        if let Ok(Ok(w)) = listed {
            attached = w.into_inner().workers.len();
            if attached == n {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!(
        "{attached} of {n} workers attached within {START_WITHIN:?}"
    ))
}
