//! The system a scenario runs against: embedded parts (a reference control plane,
//! workers and a router, on loopback) or a running system given by its addresses.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tonic::transport::Channel;
use valet_control::{ActorKey, PlaneConfig};
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_proxy::{HttpServer, Limits};
use valet_router::{GrpcControlPlane, Metrics, Router, RouterArgs};

use valet_embedded::{Embedded, EmbeddedConfig, PoolSpec};

use crate::generate::HttpClient;
use crate::processes::{Processes, ProcessesOpts};

/// The default actor domain.
pub const DOMAIN: &str = "actors.resources.substrate.ate.dev";

/// How to build an embedded system.
#[derive(Debug, Clone)]
pub struct SystemOpts {
    /// Workers in pool `counter`.
    pub workers: usize,
    /// Each restore's extra time (the seed measured 230 ms).
    pub restore_delay: Duration,
    /// Whether the control plane honours `wait_for_capacity`.
    pub capacity_wait: bool,
    /// Extra router flags (`--parked-request-budget 5s`, ...).
    pub router_flags: Vec<String>,
    /// Run the router as this `valet` binary in its own process (to measure its
    /// memory); in this process when `None`.
    pub router_exe: Option<PathBuf>,
    /// The control plane's `--evict-idle-after` (zero, as for the seed's figures:
    /// off).
    pub evict_idle_after: Duration,
    /// Workers in pool `echo` (whose app answers without touching a disk).
    pub echo_workers: usize,
    /// The control plane's `--route-lease` (zero, as for the seed's figures: the router
    /// asks for every request, as the seed's does).
    pub route_lease: Duration,
    /// A program to run as the scenario's actors (template and pool `app`) instead of
    /// the counter.
    pub app: Option<valet_template::Program>,
}

impl Default for SystemOpts {
    fn default() -> Self {
        Self {
            workers: 2,
            restore_delay: Duration::from_millis(230),
            capacity_wait: true,
            router_flags: Vec::new(),
            router_exe: None,
            evict_idle_after: Duration::ZERO,
            echo_workers: 0,
            route_lease: Duration::ZERO,
            app: None,
        }
    }
}

/// A system under load.
pub struct System {
    /// The router's HTTP data plane.
    pub router: SocketAddr,
    /// The router's ext_proc server, when it runs in its own process.
    pub router_extproc: Option<SocketAddr>,
    /// The router's admin server (`/metrics`), when it runs in its own process.
    pub router_admin: Option<SocketAddr>,
    /// Every router requests may go to (`router` first); scenarios take them in turn.
    pub routers: Vec<SocketAddr>,
    next_router: AtomicUsize,
    ctl: ControlClient<Channel>,
    embedded: Option<Embedded>,
    processes: Option<Processes>,
    _dir: Option<tempfile::TempDir>,
    child: Option<tokio::process::Child>,
    in_process: Option<(Router, HttpServer)>,
    /// The template the scenario's actors are created from.
    template: String,
}

impl std::fmt::Debug for System {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("System")
            .field("router", &self.router)
            .finish_non_exhaustive()
    }
}

fn ctl_client(url: &str) -> Result<ControlClient<Channel>, String> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(|e| format!("control plane {url}: {e}"))?
        .timeout(Duration::from_secs(60));
    Ok(ControlClient::new(endpoint.connect_lazy()))
}

fn aref(actor: &str) -> Option<ateapi::ActorRef> {
    let (atespace, name) = actor.split_once('/').unwrap_or(("demo", actor));
    Some(ateapi::ActorRef {
        atespace: atespace.into(),
        name: name.into(),
    })
}

impl System {
    /// Starts a control plane, `opts.workers` workers and a router, all on loopback.
    ///
    /// # Errors
    /// When a part cannot start.
    pub async fn embedded(opts: &SystemOpts) -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut templates = valet_template::Templates::builtin();
        let template = match &opts.app {
            Some(program) => {
                templates.insert(valet_template::Template::new(
                    "app",
                    valet_template::Kind::Program(Box::new(program.clone())),
                )?);
                "app"
            }
            None => "counter",
        };
        let embedded = Embedded::start(EmbeddedConfig {
            templates,
            plane: PlaneConfig {
                capacity_wait: opts.capacity_wait,
                evict_idle_after: opts.evict_idle_after,
                route_lease: opts.route_lease,
                ..PlaneConfig::default()
            },
            restore_delay: opts.restore_delay,
            pools: vec![
                PoolSpec {
                    pool: template.into(),
                    workers: opts.workers,
                    id_prefix: "load-w".into(),
                },
                PoolSpec {
                    pool: "echo".into(),
                    workers: opts.echo_workers,
                    id_prefix: "load-echo".into(),
                },
            ],
            ..EmbeddedConfig::counter(dir.path().join("data"), opts.workers)
        })
        .await?;
        embedded
            .plane
            .catalog()
            .create_atespace("demo")
            .await
            .map_err(|e| e.message().to_owned())?;
        let cp_url = embedded.url();

        let own_process = opts.router_exe.is_some();
        // A router in its own process also serves ext_proc and admin (the parked-scale
        // scenario measures both); one in this process serves HTTP only.
        let side = if own_process { "127.0.0.1:0" } else { "" };
        let mut flags = vec![
            "--listen".to_owned(),
            "127.0.0.1:0".into(),
            "--extproc-listen".into(),
            side.into(),
            "--admin-listen".into(),
            side.into(),
            "--control-plane".into(),
            cp_url.clone(),
        ];
        flags.extend(opts.router_flags.iter().cloned());
        let mut router_extproc = None;
        let mut router_admin = None;
        let (router, child, in_process) = match &opts.router_exe {
            Some(exe) => {
                // VALET_LOAD_ROUTER_WRAPPER runs the router under a profiler
                // (`heaptrack -o /tmp/router`); see docs/BENCHMARKS.md.
                let wrapper: Vec<String> = std::env::var("VALET_LOAD_ROUTER_WRAPPER")
                    .map(|w| w.split_whitespace().map(str::to_owned).collect())
                    .unwrap_or_default();
                let mut cmd = match wrapper.split_first() {
                    Some((program, args)) => {
                        let mut c = crate::processes::part_command(program);
                        c.args(args).arg(exe);
                        c
                    }
                    None => crate::processes::part_command(exe),
                };
                let mut child = cmd
                    .arg("router")
                    .args(&flags)
                    .stdout(Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("{}: {e}", exe.display()))?;
                let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
                let mut seen = std::collections::HashMap::new();
                tokio::time::timeout(Duration::from_secs(20), async {
                    while let Ok(Some(line)) = lines.next_line().await {
                        if let Some((part, a)) = line
                            .strip_prefix("listening ")
                            .and_then(|rest| rest.split_once(' '))
                            && let Ok(a) = a.parse::<SocketAddr>()
                        {
                            seen.insert(part.to_owned(), a);
                            if seen.len() == 3 {
                                return;
                            }
                        }
                    }
                })
                .await
                .map_err(|_| "the router process did not start")?;
                let addr = *seen
                    .get("router")
                    .ok_or("the router process did not start")?;
                router_extproc = seen.get("extproc").copied();
                router_admin = seen.get("admin").copied();
                tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
                (addr, Some(child), None)
            }
            None => {
                let config = RouterArgs::try_parse_flags_only(&flags)
                    .map_err(|e| e.to_string())?
                    .resolve()
                    .map_err(|e| e.to_string())?;
                let cp = GrpcControlPlane::connect_lazy(&cp_url, config.credentials())
                    .map_err(|e| e.to_string())?;
                let channel = cp.channel();
                let router = Router::new(Arc::new(config), Arc::new(cp), Arc::new(Metrics::new()));
                router.start_leases(channel);
                let l = TcpListener::bind("127.0.0.1:0")
                    .await
                    .map_err(|e| e.to_string())?;
                let server = HttpServer::spawn(l, router.clone(), Limits::default())
                    .map_err(|e| e.to_string())?;
                (server.local_addr(), None, Some((router, server)))
            }
        };
        Ok(Self {
            router,
            router_extproc,
            router_admin,
            routers: vec![router],
            next_router: AtomicUsize::new(0),
            ctl: ctl_client(&cp_url)?,
            embedded: Some(embedded),
            processes: None,
            _dir: Some(dir),
            child,
            in_process,
            template: template.to_owned(),
        })
    }

    /// A running system: its router's HTTP address and its control plane's URL.
    ///
    /// # Errors
    /// When the control plane URL is invalid.
    pub fn remote(router: SocketAddr, control_plane: &str) -> Result<Self, String> {
        Ok(Self {
            router,
            router_extproc: None,
            router_admin: None,
            routers: vec![router],
            next_router: AtomicUsize::new(0),
            ctl: ctl_client(control_plane)?,
            embedded: None,
            processes: None,
            _dir: None,
            child: None,
            in_process: None,
            template: "counter".into(),
        })
    }

    /// A set of processes over PostgreSQL (see [`Processes`]): requests go to its
    /// routers in turn; actors are managed through its active replica.
    ///
    /// # Errors
    /// When a part does not start.
    pub async fn start_processes(opts: &ProcessesOpts) -> Result<Self, String> {
        let processes = Processes::start(opts).await?;
        Ok(Self {
            router: processes.routers[0],
            router_extproc: None,
            router_admin: None,
            routers: processes.routers.clone(),
            next_router: AtomicUsize::new(0),
            ctl: processes.control_client()?,
            embedded: None,
            processes: Some(processes),
            _dir: None,
            child: None,
            in_process: None,
            template: "counter".into(),
        })
    }

    /// The router the next request goes to: each of [`Self::routers`] in turn.
    pub fn next_router(&self) -> SocketAddr {
        let i = self.next_router.fetch_add(1, Ordering::Relaxed) % self.routers.len();
        self.routers[i]
    }

    /// The requests each of the processes' routers has counted
    /// (`atenet_router_requests_total`, from its own `/metrics`); empty unless the
    /// system is a set of processes.
    pub async fn requests_per_router(&self) -> Vec<(SocketAddr, f64)> {
        let Some(p) = &self.processes else {
            return Vec::new();
        };
        let client = HttpClient::new(DOMAIN);
        let mut out = Vec::new();
        for (router, admin) in p.routers.iter().zip(&p.router_admins) {
            let (status, text) = tokio::time::timeout(
                crate::processes::PROBE_TIMEOUT,
                client.get_host(*admin, "127.0.0.1", "/metrics"),
            )
            .await
            .unwrap_or_else(|_| (0, String::new()));
            let n = if status == 200 {
                valet_telemetry::sample_of(&text, "atenet_router_requests_total", &[])
            } else {
                f64::NAN
            };
            out.push((*router, n));
        }
        out
    }

    /// Its processes, when it is a set of processes.
    pub fn processes(&self) -> Option<&Processes> {
        self.processes.as_ref()
    }

    /// Creates `actor` (template `counter`, or `app` with [`SystemOpts::app`]) unless
    /// it exists, and makes sure it is suspended.
    pub async fn fresh(&self, actor: &str) -> Result<(), String> {
        self.fresh_of(actor, &self.template).await
    }

    /// [`Self::fresh`] with template `template`.
    pub async fn fresh_of(&self, actor: &str, template: &str) -> Result<(), String> {
        let mut c = self.ctl.clone();
        let created = c
            .create_actor(ateapi::CreateActorRequest {
                actor_ref: aref(actor),
                actor_template_namespace: "default".into(),
                actor_template_name: template.into(),
                worker_selector: None,
            })
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(e) if e.code() == tonic::Code::AlreadyExists => self.suspend(actor).await,
            Err(e) => Err(format!("create {actor}: {}", e.message())),
        }
    }

    /// Suspends `actor` (a no-op when it is suspended).
    pub async fn suspend(&self, actor: &str) -> Result<(), String> {
        let mut c = self.ctl.clone();
        for _ in 0..50 {
            match c
                .suspend_actor(ateapi::SuspendActorRequest {
                    actor_ref: aref(actor),
                })
                .await
            {
                Ok(_) => return Ok(()),
                // Mid-resume: try again shortly.
                Err(e) if e.code() == tonic::Code::Aborted => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(format!("suspend {actor}: {}", e.message())),
            }
        }
        Err(format!("suspend {actor}: still busy"))
    }

    /// Whether `actor` is RUNNING now.
    pub async fn running(&self, actor: &str) -> bool {
        let mut c = self.ctl.clone();
        c.get_actor(ateapi::GetActorRequest {
            actor_ref: aref(actor),
        })
        .await
        .ok()
        .and_then(|r| r.into_inner().actor)
        .is_some_and(|a| a.status == ateapi::actor::Status::Running as i32)
    }

    /// The address of `actor`'s worker, when it runs.
    pub async fn worker_of(&self, actor: &str) -> Option<SocketAddr> {
        let mut c = self.ctl.clone();
        let a = c
            .get_actor(ateapi::GetActorRequest {
                actor_ref: aref(actor),
            })
            .await
            .ok()?
            .into_inner()
            .actor?;
        format!("{}:{}", a.ateom_pod_ip, a.worker_port).parse().ok()
    }

    /// `ResumeActor` calls the embedded control plane has received for `actor`.
    pub fn resume_calls_for(&self, actor: &str) -> Option<u64> {
        let key: ActorKey = {
            let (a, n) = actor.split_once('/')?;
            ActorKey::new(a, n).ok()?
        };
        self.embedded
            .as_ref()
            .map(|c| c.plane.resume_calls_for(key.atespace(), key.name()))
    }

    /// The embedded control plane's `/metrics` text, when it runs in this process.
    pub fn control_plane_metrics(&self) -> Option<String> {
        self.embedded.as_ref().map(|c| c.plane.render_metrics())
    }

    /// How long `actor` has been idle, when it runs and is idle.
    pub async fn idle_for(&self, actor: &str) -> Option<Duration> {
        let mut c = self.ctl.clone();
        let a = c
            .get_actor(ateapi::GetActorRequest {
                actor_ref: aref(actor),
            })
            .await
            .ok()?
            .into_inner()
            .actor?;
        a.idle_for.and_then(|d| Duration::try_from(d).ok())
    }

    /// The embedded router, when it runs in this process.
    pub fn in_process_router(&self) -> Option<&Router> {
        self.in_process.as_ref().map(|(r, _)| r)
    }

    /// Names of the actors the control plane knows in atespace `demo` that run now.
    pub async fn running_actors(&self) -> Vec<String> {
        let mut c = self.ctl.clone();
        let listed = c
            .list_actors(ateapi::ListActorsRequest {
                page_size: 1000,
                atespace: "demo".into(),
                ..Default::default()
            })
            .await;
        listed
            .map(|r| r.into_inner().actors)
            .unwrap_or_default()
            .into_iter()
            .filter(|a| a.status == ateapi::actor::Status::Running as i32)
            .map(|a| format!("{}/{}", a.atespace, a.actor_id))
            .collect()
    }

    /// Suspends `actor` once; false when the control plane refused (busy, not running).
    pub async fn try_suspend(&self, actor: &str) -> bool {
        let mut c = self.ctl.clone();
        c.suspend_actor(ateapi::SuspendActorRequest {
            actor_ref: aref(actor),
        })
        .await
        .is_ok()
    }

    /// The router process's peak resident memory (VmHWM), in KiB, when it runs in its
    /// own process.
    pub fn router_peak_rss_kib(&self) -> Option<u64> {
        self.router_status("VmHWM:")
    }

    /// The router process's resident memory now (VmRSS), in KiB, when it runs in its
    /// own process.
    pub fn router_rss_kib(&self) -> Option<u64> {
        self.router_status("VmRSS:")
    }

    fn router_status(&self, field: &str) -> Option<u64> {
        let pid = self.child.as_ref()?.id()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// The CPU time (user and system, all threads) the router process has used, when
    /// it runs in its own process; 10 ms resolution.
    pub fn router_cpu(&self) -> Option<Duration> {
        let pid = self.child.as_ref()?.id()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name (which may hold spaces, so split after its
        // closing parenthesis): state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        // USER_HZ: 100 on every Linux architecture's user-space ABI.
        Some(Duration::from_millis(ticks * 10))
    }

    /// One sample of the router's `/metrics` (summed over labels), when its admin
    /// server runs.
    pub async fn router_metric(&self, name: &str) -> Option<f64> {
        let admin = self.router_admin?;
        let (status, text) = HttpClient::new(DOMAIN)
            .get_host(admin, "127.0.0.1", "/metrics")
            .await;
        (status == 200).then(|| valet_telemetry::sample_of(&text, name, &[]))
    }

    /// `ResumeActor` calls the embedded control plane has answered in all.
    pub fn resume_calls(&self) -> Option<f64> {
        self.control_plane_metrics()
            .map(|m| valet_telemetry::sample_of(&m, "valet_control_resumes_total", &[]))
    }

    /// Stops every embedded part.
    pub async fn shutdown(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
        if let Some((router, server)) = self.in_process.take() {
            server.stop_accepting();
            router.stop_leases().await;
        }
        if let Some(embedded) = self.embedded.take() {
            embedded.shutdown().await;
        }
        if let Some(processes) = self.processes.take() {
            processes.shutdown().await;
        }
    }
}
