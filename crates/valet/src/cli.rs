//! The command-line tree: one subcommand per part (`cli.md`, "Subcommands").

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, Parser, Subcommand, ValueEnum};
use valet_control::PlaneConfig;
use valet_router::RouterArgs;
use valet_router::config::parse_duration;

use crate::EXIT_CONFIG;

/// valet: a request-parking router for actor platforms.
#[derive(Debug, Parser)]
#[command(name = "valet", version, about, propagate_version = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Format of the log lines on stderr: `json` (one object per line) or `text`.
    /// Default: text when stderr is a terminal, json otherwise. The `listening <part>
    /// <address>` lines on stdout stay plain text either way.
    #[arg(
        long,
        global = true,
        value_enum,
        env = "VALET_LOG_FORMAT",
        value_name = "FORMAT"
    )]
    pub(crate) log_format: Option<LogFormat>,
    /// Least severe level logged: error, warn, info, debug, trace or off; or
    /// comma-separated directives with targets (`info,valet_router=debug`). Default:
    /// info (warn for `load` and `demo`, which print results); when unset, the
    /// VALET_LOG variable (the same syntax) is read.
    #[arg(long, global = true, env = "VALET_LOG_LEVEL", value_parser = parse_log_level, value_name = "LEVEL")]
    pub(crate) log_level: Option<String>,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// One JSON object per line: timestamp, level, target, message and fields.
    Json,
    /// Human-readable lines.
    Text,
}

const LOG_LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

/// A running router's HTTP address: `http://host:port` (a trailing `/` allowed) or
/// `host:port`, resolved now (an IPv4 address first, as `valet up` listens on
/// 127.0.0.1).
pub(crate) fn parse_router_url(s: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs as _;
    if s.starts_with("https://") {
        return Err("the load client speaks plain HTTP: give http://host:port".into());
    }
    let authority = s.strip_prefix("http://").unwrap_or(s);
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.is_empty() || authority.contains('/') {
        return Err("must be http://<host>:<port>".into());
    }
    let addrs: Vec<std::net::SocketAddr> = authority
        .to_socket_addrs()
        .map_err(|e| format!("must be http://<host>:<port> ({e})"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| format!("{authority} resolves to no address"))
}

/// A control plane's URL, checked as the router checks its `--control-plane`.
pub(crate) fn parse_target_control_plane(s: &str) -> Result<String, String> {
    valet_router::config::parse_control_plane(s).map_err(|e| e.rule.to_string())
}

/// A count that must be at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a whole number: {e}")),
    }
}

/// An actor reference, `atespace/name` (kept as text).
fn parse_actor(s: &str) -> Result<String, String> {
    s.parse::<valet_router::ActorRef>()
        .map(|a| a.to_string())
        .map_err(|e| e.to_string())
}

/// A duration that must be more than zero.
fn positive_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("must be > 0".into()),
        d => Ok(d),
    }
}

/// `--hosting-lease`: a duration of at least [`valet_worker::MIN_HOSTING_LEASE`].
fn parse_hosting_lease(s: &str) -> Result<Duration, String> {
    let lease = parse_duration(s)?;
    let min = valet_worker::MIN_HOSTING_LEASE;
    if lease < min {
        return Err(format!(
            "must be at least {}s (workers renew their hosting every second)",
            min.as_secs()
        ));
    }
    Ok(lease)
}

/// A level, or directives `[target=]level` separated by commas; every level one of
/// [`LOG_LEVELS`] (a bare word that is not a level would silently name a target).
/// Returns the directives without the blanks around them, which the log filter would
/// otherwise read as part of a target's name.
pub(crate) fn parse_log_level(s: &str) -> Result<String, String> {
    let is_level = |l: &str| LOG_LEVELS.contains(&l.to_ascii_lowercase().as_str());
    let mut directives = Vec::new();
    for d in s.split(',').map(str::trim) {
        let ok = match d.split_once('=') {
            Some((target, level)) => !target.trim().is_empty() && is_level(level.trim()),
            None => is_level(d),
        };
        if !ok {
            return Err(format!(
                "`{d}` is not a level ({}) or a `target=level` directive",
                LOG_LEVELS.join(", ")
            ));
        }
        directives.push(match d.split_once('=') {
            Some((target, level)) => format!("{}={}", target.trim(), level.trim()),
            None => d.to_owned(),
        });
    }
    Ok(directives.join(","))
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// The router alone: parks requests for actors whose pool is full.
    Router(RouterCmd),
    /// The reference control plane (ateapi.Control) with its embedded database.
    ControlPlane(ControlPlaneArgs),
    /// One reference worker: joins a pool of a running control plane.
    Worker(WorkerArgs),
    /// A client of any ateapi.Control server.
    Ctl(CtlArgs),
    /// The whole system on loopback: control plane, workers and router.
    Up(Box<UpArgs>),
    /// Prints an Envoy bootstrap (YAML) wired to this router's ext_proc server.
    EnvoyBootstrap(EnvoyBootstrapArgs),
    /// Load generator and the seed's experiments as scenarios.
    #[command(subcommand)]
    Load(LoadCommand),
    /// Showcases.
    #[command(subcommand)]
    Demo(DemoCommand),
}

#[derive(Debug, Clone, Subcommand)]
pub(crate) enum DemoCommand {
    /// The seed's parking demo: the timeline (fig. 4.7) and the 30 s load run, with
    /// charts.
    Parking(DemoArgs),
}

#[derive(Debug, Clone, Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    pub(crate) target: TargetArgs,
    /// Length of the load run.
    #[arg(long, env = "VALET_DEMO_DURATION", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) duration: Duration,
    /// Where the CSV and SVG files go.
    #[arg(
        long,
        env = "VALET_DEMO_OUT",
        default_value = "./valet-results",
        value_name = "DIR"
    )]
    pub(crate) out: PathBuf,
}

/// Where scenarios run: embedded parts by default, or a running system.
#[derive(Debug, Clone, Args)]
pub(crate) struct TargetArgs {
    /// A running router's built-in HTTP data plane (http://host:port, or host:port);
    /// with --control-plane. Embedded parts when unset.
    #[arg(
        long,
        env = "VALET_TARGET_ROUTER",
        value_name = "URL",
        requires = "control_plane",
        value_parser = parse_router_url
    )]
    pub(crate) router: Option<std::net::SocketAddr>,
    /// The running system's control plane (http://host:port).
    #[arg(
        long,
        env = "VALET_TARGET_CONTROL_PLANE",
        value_name = "URL",
        requires = "router",
        value_parser = parse_target_control_plane
    )]
    pub(crate) control_plane: Option<String>,
    /// Run against processes this command starts: two control-plane
    /// replicas on PostgreSQL (one active, one standby), the scenario's workers, and two
    /// routers listing both replicas, requests sent to each router in turn (timeline,
    /// steady, bursts and overflow).
    /// (`--cluster` is an older name of it.)
    #[arg(
        long,
        env = "VALET_TARGET_PROCESSES",
        alias = "cluster",
        conflicts_with = "router"
    )]
    pub(crate) processes: bool,
    /// The processes' PostgreSQL (postgres://…): an empty database no control plane
    /// uses, which the run writes to; when unset, a throwaway server in a temporary
    /// directory (initdb and pg_ctl from /usr/lib/postgresql/*/bin, PATH or
    /// VALET_PG_BIN).
    #[arg(
        long,
        env = "VALET_TARGET_DATABASE",
        hide_env_values = true,
        value_name = "URL",
        requires = "processes"
    )]
    pub(crate) database: Option<String>,
    /// The parking budget of the embedded router (or the --processes routers).
    #[arg(long, env = "VALET_TARGET_BUDGET", default_value = "5s", value_parser = positive_duration, value_name = "DURATION")]
    pub(crate) budget: Duration,
    /// Each restore's extra time on embedded (or --processes) workers (the seed measured
    /// 230ms; with --app, give 0s to measure the app's own restore).
    #[arg(long, env = "VALET_TARGET_RESTORE_DELAY", default_value = "230ms", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) restore_delay: Duration,
    /// Run this program as the scenario's actors (template and pool `app`) instead of
    /// the counter, on embedded parts: as `valet up --app` takes it (its port in $PORT,
    /// its data directory in $VALET_DATA_DIR).
    #[arg(long, env = "VALET_TARGET_APP", value_name = "COMMAND", conflicts_with_all = ["router", "processes"])]
    pub(crate) app: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Scenario {
    /// Fig. 4.7: full-pool 503s at the budget, then a parked request served.
    Timeline,
    /// The demo's load script: 4 actors on 2 workers, suspend after each answer.
    Steady,
    /// Fig. 4.8: 1, 2, 4, 8, 16 resumes at the same instant, five rounds each.
    Bursts,
    /// 32 at once into 14 free places; again with 16 freed 1.5 s into the wait.
    Overflow,
    /// 10,000 requests parked on one router: memory and verdict accuracy.
    ParkedScale,
    /// A running actor through the router against the worker directly.
    FastPath,
    /// A small pool saturated for --duration (10m) with clients that give up and actors
    /// suspended at random; fails unless the router's books balance at the end.
    Soak,
    /// Demand eviction: --runs requests, one after another, each parked on a full pool
    /// of idle actors until the control plane evicts one (--evict-idle-after, 10s).
    Eviction,
    /// Route leases: what a revocation adds to a suspend, and a control-plane process
    /// SIGKILLed for --duration (10s) under steady load through both data planes.
    Leases,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum CapacityWait {
    On,
    Off,
    Both,
}

#[derive(Debug, Clone, Subcommand)]
pub(crate) enum LoadCommand {
    /// Sends HTTP load to actors through a router.
    Run(LoadRunArgs),
    /// Runs one of the seed's experiments (or ours) and reports it.
    Scenario(ScenarioArgs),
}

#[derive(Debug, Clone, Args)]
pub(crate) struct LoadRunArgs {
    /// The router's built-in HTTP data plane (http://host:port, or host:port).
    #[arg(
        long,
        env = "VALET_LOAD_RUN_ROUTER",
        value_name = "URL",
        value_parser = parse_router_url
    )]
    pub(crate) router: std::net::SocketAddr,
    /// Actors to address in turn, atespace/name,...
    #[arg(
        long,
        env = "VALET_LOAD_RUN_ACTORS",
        value_delimiter = ',',
        default_value = "demo/p1",
        value_parser = parse_actor,
        value_name = "LIST"
    )]
    pub(crate) actors: Vec<String>,
    /// Open loop: requests per second, sent on schedule whatever the answers.
    #[arg(
        long,
        env = "VALET_LOAD_RUN_RATE",
        conflicts_with = "concurrency",
        value_name = "PER_SECOND"
    )]
    pub(crate) rate: Option<f64>,
    /// Closed loop: clients, each sending when its last request is answered. Default: 1
    /// (without --rate).
    #[arg(long, env = "VALET_LOAD_RUN_CONCURRENCY", value_name = "N")]
    pub(crate) concurrency: Option<usize>,
    /// How long to send.
    #[arg(long, env = "VALET_LOAD_RUN_DURATION", default_value = "10s", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) duration: Duration,
    /// The path to request.
    #[arg(long, env = "VALET_LOAD_RUN_PATH", default_value = "/")]
    pub(crate) path: String,
    /// The actor domain.
    #[arg(long, env = "VALET_LOAD_RUN_ACTOR_DOMAIN", default_value = valet_router::config::DEFAULT_ACTOR_DOMAIN)]
    pub(crate) actor_domain: String,
    /// Write one CSV row per request here.
    #[arg(long, env = "VALET_LOAD_RUN_CSV", value_name = "FILE")]
    pub(crate) csv: Option<PathBuf>,
    /// Write an SVG chart here.
    #[arg(long, env = "VALET_LOAD_RUN_SVG", value_name = "FILE")]
    pub(crate) svg: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct ScenarioArgs {
    /// Which experiment.
    #[arg(value_enum)]
    pub(crate) scenario: Scenario,
    #[command(flatten)]
    pub(crate) target: TargetArgs,
    /// Run with the control plane's capacity wait on, off, or both (embedded or
    /// --processes parts; not with --router).
    #[arg(
        long,
        env = "VALET_SCENARIO_CAPACITY_WAIT",
        value_enum,
        default_value = "both"
    )]
    pub(crate) capacity_wait: CapacityWait,
    /// Length of timed runs. Default: per scenario (steady: 30s; fast-path: 10s per
    /// side; leases: a 10s outage; soak: 10m).
    #[arg(long, env = "VALET_SCENARIO_DURATION", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) duration: Option<Duration>,
    /// Requests of the parked-scale scenario.
    #[arg(long, env = "VALET_SCENARIO_REQUESTS", default_value_t = 10_000, value_parser = at_least_one)]
    pub(crate) requests: usize,
    /// Runs of the eviction scenario (and workers of its pool), and suspend cycles of
    /// the leases scenario.
    #[arg(long, env = "VALET_SCENARIO_RUNS", default_value_t = 50, value_parser = at_least_one)]
    pub(crate) runs: usize,
    /// The control plane's --evict-idle-after for the eviction scenario and the soak
    /// (the seed's experiments always run with it off). Default: 10s for the eviction
    /// scenario, off for the soak.
    #[arg(long, env = "VALET_SCENARIO_EVICT_IDLE_AFTER", value_parser = positive_duration, value_name = "DURATION")]
    pub(crate) evict_idle_after: Option<Duration>,
    /// The control plane's --route-lease for the fast-path and leases scenarios (0: the
    /// router asks for every request, as the seed's does). Default: 5s.
    #[arg(long, env = "VALET_SCENARIO_ROUTE_LEASE", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) route_lease: Option<Duration>,
    /// Workers of the soak's pool (its actors: --actors).
    #[arg(long, env = "VALET_SCENARIO_WORKERS", default_value_t = 2, value_parser = at_least_one)]
    pub(crate) workers: usize,
    /// Actors of the soak.
    #[arg(long, env = "VALET_SCENARIO_ACTORS", default_value_t = 8, value_parser = at_least_one)]
    pub(crate) actors: usize,
    /// Suspended actors the parked-scale requests are spread over (one flight each).
    #[arg(long, env = "VALET_SCENARIO_PARKED_ACTORS", default_value_t = 100, value_parser = at_least_one)]
    pub(crate) parked_actors: usize,
    /// ext_proc exchanges of the parked-scale scenario's CPU figure (0: skip).
    #[arg(
        long,
        env = "VALET_SCENARIO_EXTPROC_REQUESTS",
        default_value_t = 20_000
    )]
    pub(crate) extproc_requests: usize,
    /// Body of each parked-scale request (a POST when > 0); bytes, or with KiB, MiB.
    #[arg(long, env = "VALET_SCENARIO_BODY", default_value = "0", value_parser = valet_router::config::parse_bytes, value_name = "BYTES")]
    pub(crate) body: u64,
    /// Where the CSV and SVG files go.
    #[arg(
        long,
        env = "VALET_SCENARIO_OUT",
        default_value = "./valet-results",
        value_name = "DIR"
    )]
    pub(crate) out: PathBuf,
}

/// Here the ingress flags describe Envoy's own HTTPS listener: Envoy reads the
/// certificate files itself, so they are required (no generated certificate), and the
/// client CA applies to Envoy's HTTPS listener.
#[derive(Debug, Clone, Args)]
#[command(
    mut_arg("listen_https", |a| a.help(
        "Address of Envoy's HTTPS listener (ALPN h2 and http/1.1); empty turns it off"
    )),
    mut_arg("ingress_tls_cert_file", |a| a.help(
        "PEM certificate chain of Envoy's HTTPS listener, read by Envoy; required with --listen-https (Envoy cannot use a generated certificate)"
    )),
    mut_arg("ingress_client_ca_file", |a| a.help(
        "PEM CA client certificates must chain to; makes them required on Envoy's HTTPS listener (only: --envoy-listen asks for none)"
    )),
)]
pub(crate) struct EnvoyBootstrapArgs {
    /// The router's flags: the bootstrap is derived from the same configuration.
    #[command(flatten)]
    pub(crate) router: RouterArgs,

    /// Envoy's HTTP listener.
    #[arg(
        long,
        env = "VALET_ENVOY_LISTEN",
        default_value = "0.0.0.0:10000",
        value_name = "ADDR"
    )]
    pub(crate) envoy_listen: std::net::SocketAddr,

    /// Envoy's admin interface.
    #[arg(
        long,
        env = "VALET_ENVOY_ADMIN",
        default_value = "127.0.0.1:9901",
        value_name = "ADDR"
    )]
    pub(crate) envoy_admin: std::net::SocketAddr,

    /// Envoy's HTTPS listener (helps overridden above).
    #[command(flatten)]
    pub(crate) ingress: IngressArgs,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct RouterCmd {
    #[command(flatten)]
    pub(crate) args: RouterArgs,

    /// Validate the configuration, print the effective flags and exit.
    #[arg(long, env = "VALET_ROUTER_CHECK")]
    pub(crate) check: bool,

    #[command(flatten)]
    pub(crate) ingress: IngressArgs,
}

/// HTTPS ingress of the built-in data plane.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct IngressArgs {
    /// Address of the HTTPS listener (ALPN h2 and http/1.1); empty turns it off.
    #[arg(
        long,
        env = "VALET_LISTEN_HTTPS",
        default_value = "",
        value_name = "ADDR"
    )]
    pub(crate) listen_https: String,
    /// PEM certificate chain of the HTTPS listener; without it (and its key) a
    /// self-signed certificate is generated at start, with a warning.
    #[arg(
        long,
        env = "VALET_INGRESS_TLS_CERT_FILE",
        value_name = "PATH",
        requires = "ingress_tls_key_file"
    )]
    pub(crate) ingress_tls_cert_file: Option<PathBuf>,
    /// PEM key of --ingress-tls-cert-file.
    #[arg(
        long,
        env = "VALET_INGRESS_TLS_KEY_FILE",
        value_name = "PATH",
        requires = "ingress_tls_cert_file"
    )]
    pub(crate) ingress_tls_key_file: Option<PathBuf>,
    /// PEM CA client certificates must chain to; makes them required on
    /// --listen-https (only: --listen and --extproc-listen ask for none; set them
    /// empty or to loopback to require certificates of every client).
    #[arg(long, env = "VALET_INGRESS_CLIENT_CA_FILE", value_name = "PATH")]
    pub(crate) ingress_client_ca_file: Option<PathBuf>,
    /// Comma-separated SPIFFE IDs admitted (the client certificate's only URI SAN):
    /// an entry ending in `/` admits IDs extending it by whole path segments. Others
    /// get 403 before any control-plane call. Needs --ingress-client-ca-file.
    #[arg(long, env = "VALET_INGRESS_ALLOWED_SPIFFE_IDS", value_name = "IDS")]
    pub(crate) ingress_allowed_spiffe_ids: Option<String>,
}

impl IngressArgs {
    /// The flags given, with their values (paths, never a file's content).
    pub(crate) fn given(&self) -> Vec<(&'static str, String)> {
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        [
            (
                "--listen-https",
                (!self.listen_https.is_empty()).then(|| self.listen_https.clone()),
            ),
            ("--ingress-tls-cert-file", path(&self.ingress_tls_cert_file)),
            ("--ingress-tls-key-file", path(&self.ingress_tls_key_file)),
            (
                "--ingress-client-ca-file",
                path(&self.ingress_client_ca_file),
            ),
            (
                "--ingress-allowed-spiffe-ids",
                self.ingress_allowed_spiffe_ids.clone(),
            ),
        ]
        .into_iter()
        .filter_map(|(flag, value)| value.map(|v| (flag, v)))
        .collect()
    }

    /// The HTTPS listener's address and TLS, when on; every file read now.
    pub(crate) fn resolve(
        &self,
    ) -> Result<Option<(std::net::SocketAddr, valet_proxy::tls::IngressTls)>, String> {
        let resolved = self.check()?;
        if resolved.is_some() && self.ingress_tls_cert_file.is_none() {
            tracing::warn!(
                "no --ingress-tls-cert-file: the HTTPS listener serves a self-signed certificate generated at start"
            );
        }
        Ok(resolved)
    }

    /// [`Self::resolve`] without a word: a check of the flags made before the real
    /// start (`valet up`'s).
    pub(crate) fn check(
        &self,
    ) -> Result<Option<(std::net::SocketAddr, valet_proxy::tls::IngressTls)>, String> {
        use valet_proxy::tls::{IngressCert, IngressTls, SpiffeAllowlist};
        if self.listen_https.is_empty() {
            if let Some((flag, value)) = self.given().into_iter().next() {
                return Err(format!(
                    "invalid configuration: {flag}={value}: needs an HTTPS listener (--listen-https is empty)"
                ));
            }
            return Ok(None);
        }
        let addr: std::net::SocketAddr = self.listen_https.parse().map_err(|_| {
            format!(
                "invalid configuration: --listen-https={}: must be <ip>:<port> (port 0 picks one), or empty to turn it off",
                self.listen_https
            )
        })?;
        let allowlist = match &self.ingress_allowed_spiffe_ids {
            Some(ids) if self.ingress_client_ca_file.is_none() => {
                return Err(format!(
                    "invalid configuration: --ingress-allowed-spiffe-ids={ids}: needs --ingress-client-ca-file: only verified client certificates are checked"
                ));
            }
            Some(ids) => Some(SpiffeAllowlist::parse(ids).map_err(|why| {
                format!("invalid configuration: --ingress-allowed-spiffe-ids={ids}: {why}")
            })?),
            None => None,
        };
        let cert = match (&self.ingress_tls_cert_file, &self.ingress_tls_key_file) {
            (Some(cert), Some(key)) => IngressCert::Files { cert, key },
            _ => IngressCert::SelfSigned(vec!["localhost".into(), addr.ip().to_string()]),
        };
        // The warning (in `resolve`) only once the configuration holds: a refused one
        // prints its one line.
        let tls = IngressTls::new(cert, self.ingress_client_ca_file.as_deref(), allowlist)
            .map_err(|e| e.to_string())?;
        Ok(Some((addr, tls)))
    }
}

#[derive(Debug, Clone, Args)]
pub(crate) struct UpArgs {
    /// Every router flag (`main::command` sets its listeners' loopback defaults and
    /// takes its --control-plane away: the router uses the embedded one).
    #[command(flatten)]
    pub(crate) router: RouterArgs,

    /// Validate the configuration, print the router's effective flags and exit, as
    /// `valet router --check` (nothing is started or written; not with --tls, whose
    /// certificates are made at the start).
    #[arg(long, env = "VALET_UP_CHECK")]
    pub(crate) check: bool,

    /// Workers in pool `counter`.
    #[arg(long, env = "VALET_WORKERS", default_value_t = 2, value_name = "N")]
    pub(crate) workers: usize,

    /// Workers in pool `echo`, whose app streams request bodies back and echoes
    /// WebSocket messages (for trying data planes); actors of template `echo` run there.
    #[arg(
        long,
        env = "VALET_ECHO_WORKERS",
        default_value_t = 0,
        value_name = "N"
    )]
    pub(crate) echo_workers: usize,

    /// Extra time each restore takes (the seed measured about 230ms).
    #[arg(long, env = "VALET_RESTORE_DELAY", default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) restore_delay: Duration,

    /// Directory of the database and the snapshots.
    #[arg(long, env = "VALET_DATA_DIR", default_value = DEFAULT_DATA_DIR, value_name = "DIR")]
    pub(crate) data_dir: PathBuf,

    /// gRPC address of the embedded control plane; port 0 picks one.
    #[arg(long, env = "VALET_CONTROL_PLANE_LISTEN", default_value = DEFAULT_CONTROL_PLANE_LISTEN, value_name = "ADDR")]
    pub(crate) control_plane_listen: std::net::SocketAddr,

    /// TLS everywhere on loopback: a throwaway CA and certificates are generated under
    /// <data-dir>/tls at each start; the control plane serves TLS, workers and router
    /// verify it, and the router also serves HTTPS on --listen-https (127.0.0.1:8443
    /// unless given; an empty one turns it off) with the throwaway ingress certificate
    /// (unless --ingress-tls-cert-file is given). With --client-ca-file, the control
    /// plane asks for client certificates (the workers and router present
    /// --ateapi-cert-file).
    #[arg(long, env = "VALET_TLS")]
    pub(crate) tls: bool,

    /// Whether --listen-https was given (set by `main`): with --tls, an empty one
    /// turns HTTPS off instead of taking the default.
    #[arg(skip)]
    pub(crate) listen_https_given: bool,

    #[command(flatten)]
    pub(crate) ingress: IngressArgs,

    /// Actors to create (if missing) at start, as atespace/name,...; empty for none.
    #[arg(
        long,
        env = "VALET_DEMO_ACTORS",
        default_value = "demo/p1,demo/p2,demo/p3,demo/p4",
        value_name = "LIST"
    )]
    pub(crate) demo_actors: String,

    /// The embedded control plane's flags, as `valet control-plane` takes them.
    #[command(flatten)]
    pub(crate) plane: PlaneArgs,

    /// Run this program as the demo pool's actors instead of the counter (`'python3
    /// app.py'`): split as a shell would, run from the current directory, with its port
    /// in $PORT and its data directory in $VALET_DATA_DIR (`{port}` and `{data}` in it
    /// are substituted too). It becomes template (and pool) `app`; for more settings
    /// write a templates file (--templates).
    #[arg(long, env = "VALET_APP", value_name = "COMMAND")]
    pub(crate) app: Option<String>,

    /// The template of the demo pool (its --workers workers, its --demo-actors):
    /// `app` with --app, else `counter`; with --templates, any template of the file.
    #[arg(long, env = "VALET_DEMO_TEMPLATE", value_name = "NAME")]
    pub(crate) demo_template: Option<String>,

    /// The largest data directory a program's checkpoint snapshots; a checkpoint of a
    /// larger one is refused and the actor keeps running. Bytes, or with KiB, MiB, GiB.
    #[arg(long, env = "VALET_SNAPSHOT_MAX_BYTES", default_value = DEFAULT_SNAPSHOT_MAX_BYTES, value_parser = valet_router::config::parse_bytes, value_name = "BYTES")]
    pub(crate) snapshot_max_bytes: u64,

    /// A cgroup v2 directory delegated to valet (writable, memory and cpu in its
    /// cgroup.subtree_control): each program runs in a child cgroup with its template's
    /// memory.max and cpu.max. Without it, limits.cpu is refused.
    #[arg(long, env = "VALET_CGROUP", value_name = "DIR")]
    pub(crate) cgroup: Option<PathBuf>,
}

/// Default `--snapshot-max-bytes`.
pub(crate) const DEFAULT_SNAPSHOT_MAX_BYTES: &str = "1GiB";
/// Default `valet worker --run-dir`.
pub(crate) const DEFAULT_RUN_DIR: &str = "./valet-data/run";

/// The actor templates a control plane (or `valet up`) knows.
#[derive(Debug, Clone, Args)]
pub(crate) struct TemplateArgs {
    /// A templates file (TOML): programs that run as actors, each a template whose pool
    /// has its name (`[templates.NAME]` with command, dir, env, ready, start_timeout,
    /// stop_signal, stop_grace, protocol, limits; see docs/apps.md). Workers of those
    /// pools need the same file.
    #[arg(long = "templates", env = "VALET_TEMPLATES_FILE", value_name = "FILE")]
    pub(crate) file: Option<PathBuf>,

    /// Declares a built-in app's template (its pool has the same name): NAME,
    /// NAME:data or NAME:full (the snapshot a suspend takes), NAME:KIND:echo for the
    /// echo app. `counter` (data) and `echo` are always known; `counter:full` makes the
    /// demo's actors keep their memory count.
    #[arg(
        long = "template",
        env = "VALET_TEMPLATES",
        value_delimiter = ',',
        value_name = "NAME[:data|full[:APP]]"
    )]
    pub(crate) builtin: Vec<valet_control::Template>,
}

impl TemplateArgs {
    /// The templates: built-in ones, the file's, then the --template flags'.
    ///
    /// # Errors
    /// The file's error, as an invalid configuration of --templates.
    pub(crate) fn resolve(&self) -> Result<valet_template::Templates, String> {
        let mut templates = match &self.file {
            Some(f) => valet_template::Templates::load(f).map_err(|e| {
                format!(
                    "invalid configuration: --templates={}: {}",
                    f.display(),
                    e.message
                )
            })?,
            None => valet_template::Templates::builtin(),
        };
        for t in &self.builtin {
            templates.insert(t.clone());
        }
        Ok(templates)
    }
}

/// Default `--metrics-listen` of `valet up`.
pub(crate) const DEFAULT_UP_METRICS_LISTEN: &str = "127.0.0.1:7071";

/// Default `--listen` of the control plane.
pub(crate) const DEFAULT_CONTROL_PLANE_LISTEN: &str = "127.0.0.1:7070";
/// Default `--data-dir`.
pub(crate) const DEFAULT_DATA_DIR: &str = "./valet-data";
/// Default `valet worker --drain-timeout`: within Kubernetes' default 30 s grace.
pub(crate) const DEFAULT_WORKER_DRAIN_TIMEOUT: &str = "25s";
/// Default control-plane address of workers and `valet ctl`.
pub(crate) const DEFAULT_CONTROL_PLANE: &str = "http://127.0.0.1:7070";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OnOff {
    On,
    Off,
}

/// How many control-plane replicas on one PostgreSQL serve at once (`--active-replicas`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ActiveReplicas {
    All,
    One,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct ControlPlaneArgs {
    /// gRPC address of ateapi.Control; port 0 picks one.
    #[arg(long, env = "VALET_CONTROL_PLANE_LISTEN", default_value = DEFAULT_CONTROL_PLANE_LISTEN, value_name = "ADDR")]
    pub(crate) listen: std::net::SocketAddr,

    /// Directory of the embedded database; one control plane at a time uses it (it
    /// holds the directory's control-plane.lock; a second one exits 1).
    #[arg(long, env = "VALET_DATA_DIR", default_value = DEFAULT_DATA_DIR, value_name = "DIR")]
    pub(crate) data_dir: PathBuf,

    /// PostgreSQL instead of the embedded database: postgres://USER[:PASSWORD]@HOST[:PORT]/DB
    /// (docs/scale-out.md). Every control plane started on it serves, or one at a time
    /// with --active-replicas one. Needs --route-lease 0, which it sets unless --route-lease is
    /// given.
    #[arg(
        long,
        env = "VALET_DATABASE",
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) database: Option<String>,

    /// With --database: `all`, every replica on the database serves at once, with no
    /// leader (a replica silent for 5 s is declared dead, and the others take over its
    /// workers and what it left half-way); `one`, one serves and the others wait as
    /// standbys, not listening, taking over when its connection ends. The two kinds
    /// never serve one database together: one of the other kind waits.
    #[arg(
        long,
        env = "VALET_ACTIVE_REPLICAS",
        default_value = "all",
        value_name = "ALL|ONE"
    )]
    pub(crate) active_replicas: ActiveReplicas,

    #[command(flatten)]
    pub(crate) plane: PlaneArgs,
}

/// The control plane's settings, flags of `valet control-plane` and of `valet up` alike
/// (`main::command` gives `up` its own defaults for three of them); the one place they
/// become a [`PlaneConfig`] is [`PlaneArgs::plane_config`].
#[derive(Debug, Clone, Args)]
pub(crate) struct PlaneArgs {
    /// Honour ResumeActor's wait_for_capacity (first-come hand-off of freed workers);
    /// off answers at once, like a server without the extension.
    #[arg(
        long,
        env = "VALET_CAPACITY_WAIT",
        default_value = "on",
        value_name = "ON|OFF"
    )]
    pub(crate) capacity_wait: OnOff,

    #[command(flatten)]
    pub(crate) templates: TemplateArgs,

    /// How long a worker may take to restore an actor before it counts as crashed.
    #[arg(long, env = "VALET_RESTORE_TIMEOUT", default_value = DEFAULT_WORKER_TIMEOUT, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) restore_timeout: Duration,

    /// How long a worker may take to checkpoint an actor before it counts as crashed.
    #[arg(long, env = "VALET_CHECKPOINT_TIMEOUT", default_value = DEFAULT_WORKER_TIMEOUT, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) checkpoint_timeout: Duration,

    /// On SIGTERM (Ctrl-C for `valet up`): stop accepting, answer capacity waiters
    /// Unavailable, give restores and checkpoints in progress this long, tell workers to
    /// detach (they keep their actors running), exit 0. `valet up` first checkpoints
    /// every running actor within it; one not checkpointed by then comes back from its
    /// last snapshot, with a warning.
    #[arg(long, env = "VALET_SHUTDOWN_TIMEOUT", default_value = DEFAULT_SHUTDOWN_TIMEOUT, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) shutdown_timeout: Duration,

    /// Where the control plane serves /metrics, /healthz and /readyz; empty turns it off
    /// (port 0 picks one). Keep it on loopback or a private network.
    #[arg(
        long,
        env = "VALET_METRICS_LISTEN",
        default_value = "",
        value_name = "ADDR"
    )]
    pub(crate) metrics_listen: String,

    /// After a restart, how long RUNNING actors' workers have to re-attach before the
    /// actors go back to SUSPENDED.
    #[arg(long, env = "VALET_REJOIN_GRACE", default_value = DEFAULT_REJOIN_GRACE, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) rejoin_grace: Duration,

    #[command(flatten)]
    pub(crate) policies: PolicyArgs,

    #[command(flatten)]
    pub(crate) leases: LeaseArgs,

    /// TLS and bearer tokens (with `valet up --tls`, the throwaway certificate unless
    /// --tls-cert-file is given; its workers use the router's --ateapi-* credentials).
    #[command(flatten)]
    pub(crate) security: ServerSecurityArgs,
}

/// Default `--restore-timeout` and `--checkpoint-timeout`
/// ([`valet_control::plane::DEFAULT_WORKER_TIMEOUT`]).
pub(crate) const DEFAULT_WORKER_TIMEOUT: &str = "60s";
/// Default `--shutdown-timeout` ([`valet_control::plane::DEFAULT_SHUTDOWN_TIMEOUT`]).
pub(crate) const DEFAULT_SHUTDOWN_TIMEOUT: &str = "10s";
/// Default `--rejoin-grace` ([`valet_control::plane::DEFAULT_REJOIN_GRACE`]).
pub(crate) const DEFAULT_REJOIN_GRACE: &str = "10s";
/// Default `--route-lease` ([`valet_control::plane::DEFAULT_ROUTE_LEASE`]).
pub(crate) const DEFAULT_ROUTE_LEASE: &str = "5s";
/// Default `--hosting-lease` ([`valet_control::plane::DEFAULT_HOSTING_LEASE`]).
pub(crate) const DEFAULT_HOSTING_LEASE: &str = "15s";
/// `valet up`'s default `--idle-suspend-after` (off for `valet control-plane`).
pub(crate) const DEFAULT_UP_IDLE_SUSPEND_AFTER: &str = "5m";
/// `valet up`'s default `--evict-idle-after` (off for `valet control-plane`).
pub(crate) const DEFAULT_UP_EVICT_IDLE_AFTER: &str = "10s";

impl PlaneArgs {
    /// The plane's configuration from these flags, with `templates` (the flags'
    /// [`TemplateArgs::resolve`], and whatever the command adds to them).
    ///
    /// # Errors
    /// A template that does not fit the timeouts, as an invalid configuration.
    pub(crate) fn plane_config(
        &self,
        templates: &valet_template::Templates,
    ) -> Result<PlaneConfig, String> {
        let config = PlaneConfig {
            capacity_wait: self.capacity_wait == OnOff::On,
            templates: templates.iter().cloned().collect(),
            restore_timeout: self.restore_timeout,
            checkpoint_timeout: self.checkpoint_timeout,
            rejoin_grace: self.rejoin_grace,
            idle_suspend_after: self.policies.idle_suspend_after,
            evict_idle_after: self.policies.evict_idle_after,
            route_lease: self.leases.route_lease,
            hosting_lease: self.leases.hosting_lease,
        };
        config
            .check_templates()
            .map_err(|e| format!("invalid configuration: --templates: {e}"))?;
        Ok(config)
    }
}

/// TLS and bearer tokens of the control plane's gRPC server.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct ServerSecurityArgs {
    /// PEM certificate chain: serve TLS (with --tls-key-file) instead of h2c.
    #[arg(
        long,
        env = "VALET_TLS_CERT_FILE",
        value_name = "PATH",
        requires = "tls_key_file"
    )]
    pub(crate) tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(
        long,
        env = "VALET_TLS_KEY_FILE",
        value_name = "PATH",
        requires = "tls_cert_file"
    )]
    pub(crate) tls_key_file: Option<PathBuf>,
    /// PEM CA that client certificates must chain to; makes them required. Needs
    /// --tls-cert-file (or, for `valet up`, --tls).
    #[arg(long, env = "VALET_CLIENT_CA_FILE", value_name = "PATH")]
    pub(crate) client_ca_file: Option<PathBuf>,
    /// PEM public key (RSA, EC or Ed25519) that bearer tokens must be signed with (or
    /// several, one after the other: a token signed by any of them verifies); every call then needs `authorization: Bearer <JWT>` (exp required, nbf checked,
    /// aud and iss required: --jwt-audience, --jwt-issuer). Asymmetric algorithms
    /// only: never `none`, never HMAC.
    #[arg(
        long,
        env = "VALET_JWT_PUBLIC_KEY_FILE",
        value_name = "PATH",
        conflicts_with = "jwt_jwks_file",
        requires_all = ["jwt_audience", "jwt_issuer"]
    )]
    pub(crate) jwt_public_key_file: Option<PathBuf>,
    /// JWKS document of the keys tokens may be signed with (chosen by `kid`; keys not
    /// for signatures or of unsupported types are skipped with a warning).
    #[arg(
        long,
        env = "VALET_JWT_JWKS_FILE",
        value_name = "PATH",
        requires_all = ["jwt_audience", "jwt_issuer"]
    )]
    pub(crate) jwt_jwks_file: Option<PathBuf>,
    /// The `aud` tokens must carry (required with a JWT key: a token minted for
    /// another service is refused).
    #[arg(long, env = "VALET_JWT_AUDIENCE", value_name = "AUD")]
    pub(crate) jwt_audience: Option<String>,
    /// The `iss` tokens must carry (required with a JWT key).
    #[arg(long, env = "VALET_JWT_ISSUER", value_name = "ISS")]
    pub(crate) jwt_issuer: Option<String>,
}

impl ServerSecurityArgs {
    /// The JWT key flag given, with its value (`--jwt-jwks-file=/etc/jwks.json`), for
    /// errors about it.
    pub(crate) fn jwt_flag(&self) -> Option<String> {
        [
            ("--jwt-public-key-file", &self.jwt_public_key_file),
            ("--jwt-jwks-file", &self.jwt_jwks_file),
        ]
        .into_iter()
        .find_map(|(flag, path)| path.as_ref().map(|p| format!("{flag}={}", p.display())))
    }

    /// The server's security settings, every file read now.
    pub(crate) fn resolve(
        &self,
    ) -> Result<valet_control::auth::ServerSecurity, valet_control::auth::SecurityError> {
        use valet_control::auth::{JwtKeys, jwt_verifier, server_tls};
        let tls = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(c), Some(k)) => Some(server_tls(c, k, self.client_ca_file.as_deref())?),
            _ => None,
        };
        if let (None, Some(ca)) = (&tls, &self.client_ca_file) {
            return Err(valet_control::auth::SecurityError {
                flag: "--client-ca-file",
                path: ca.clone(),
                why: "needs --tls-cert-file and --tls-key-file: client certificates are asked for over TLS".into(),
            });
        }
        let (aud, iss) = (self.jwt_audience.clone(), self.jwt_issuer.clone());
        if self.jwt_public_key_file.is_none() && self.jwt_jwks_file.is_none() {
            let given = [("--jwt-audience", &aud), ("--jwt-issuer", &iss)];
            if let Some((flag, Some(value))) = given.into_iter().find(|(_, v)| v.is_some()) {
                return Err(valet_control::auth::SecurityError {
                    flag,
                    path: value.into(),
                    why: "needs --jwt-public-key-file or --jwt-jwks-file".into(),
                });
            }
        }
        let jwt = match (&self.jwt_public_key_file, &self.jwt_jwks_file) {
            (Some(p), _) => Some(jwt_verifier(JwtKeys::PublicKeyFile(p.clone()), aud, iss)?),
            (None, Some(j)) => Some(jwt_verifier(JwtKeys::JwksFile(j.clone()), aud, iss)?),
            (None, None) => None,
        };
        Ok(valet_control::auth::ServerSecurity { tls, jwt })
    }
}

/// Route leases and hosting leases (docs/leases.md).
#[derive(Debug, Clone, Args)]
pub(crate) struct LeaseArgs {
    /// Route lease granted to routers on ResumeActor answers: they route a running
    /// actor's requests without asking, for this long; 0 grants none (one ResumeActor
    /// per request, as the seed's router).
    #[arg(long, env = "VALET_ROUTE_LEASE", default_value = DEFAULT_ROUTE_LEASE, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) route_lease: Duration,

    /// A worker whose hosting renewals go unanswered this long fences its actor; an
    /// actor whose worker left may run elsewhere only this long after its last renewal.
    /// At least 4s: workers renew every second, and the control plane routes to an
    /// actor only while its worker renewed within half the lease.
    #[arg(long, env = "VALET_HOSTING_LEASE", default_value = DEFAULT_HOSTING_LEASE, value_parser = parse_hosting_lease, value_name = "DURATION")]
    pub(crate) hosting_lease: Duration,
}

/// The capacity that frees itself (both off by default).
#[derive(Debug, Clone, Args)]
pub(crate) struct PolicyArgs {
    /// Checkpoint and suspend an actor idle this long (no request in flight, none
    /// ended since); 0 turns it off.
    #[arg(long, env = "VALET_IDLE_SUSPEND_AFTER", default_value = "0", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) idle_suspend_after: Duration,

    /// While actors wait for a full pool, checkpoint its least recently active actors
    /// idle at least this long, one per waiting actor, and hand each freed worker to the
    /// oldest waiter; 0 turns it off (a full pool answers ResourceExhausted).
    #[arg(long, env = "VALET_EVICT_IDLE_AFTER", default_value = "0", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) evict_idle_after: Duration,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct WorkerArgs {
    /// The control plane to join; several replicas: a comma-separated list (an
    /// attachment that fails or ends moves on to the next).
    #[arg(long, env = "VALET_CONTROL_PLANE", default_value = DEFAULT_CONTROL_PLANE, value_name = "URL[,URL…]")]
    pub(crate) control_plane: String,

    /// The pool to join.
    #[arg(
        long,
        env = "VALET_POOL",
        default_value = "counter",
        value_name = "NAME"
    )]
    pub(crate) pool: String,

    /// Address of the hosted actor's app; port 0 picks one.
    #[arg(
        long,
        env = "VALET_WORKER_LISTEN",
        default_value = "127.0.0.1:0",
        value_name = "ADDR"
    )]
    pub(crate) listen: std::net::SocketAddr,

    /// Directory of actor snapshots; workers sharing it can move actors between them.
    #[arg(
        long,
        env = "VALET_SNAPSHOT_DIR",
        default_value = "./valet-data/snapshots",
        value_name = "DIR"
    )]
    pub(crate) snapshot_dir: PathBuf,

    /// Extra time each restore takes, to model a real sandbox's restore cost.
    #[arg(long, env = "VALET_RESTORE_DELAY", default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) restore_delay: Duration,

    /// The templates file (TOML) the control plane has: a pool whose template is a
    /// program there runs that program for each actor (its command must be here and
    /// executable, and its limits applicable: checked at the start).
    #[arg(long = "templates", env = "VALET_TEMPLATES_FILE", value_name = "FILE")]
    pub(crate) templates: Option<PathBuf>,

    /// Where programs' live directories are (`<atespace>/<name>/data`, locked while a
    /// program runs). Workers on one machine share it: a restore kills a program a
    /// dead worker left, and a worker starting kills those of dead workers.
    #[arg(long, env = "VALET_RUN_DIR", default_value = DEFAULT_RUN_DIR, value_name = "DIR")]
    pub(crate) run_dir: PathBuf,

    /// The largest data directory a program's checkpoint snapshots; a checkpoint of a
    /// larger one is refused and the actor keeps running. Bytes, or with KiB, MiB, GiB.
    #[arg(long, env = "VALET_SNAPSHOT_MAX_BYTES", default_value = DEFAULT_SNAPSHOT_MAX_BYTES, value_parser = valet_router::config::parse_bytes, value_name = "BYTES")]
    pub(crate) snapshot_max_bytes: u64,

    /// A cgroup v2 directory delegated to this worker (writable, with memory and cpu
    /// in its cgroup.subtree_control): each program runs in a child cgroup of it with
    /// the template's memory.max and cpu.max. Without it, limits.memory is an address
    /// space limit and a template with limits.cpu is refused.
    #[arg(long, env = "VALET_CGROUP", value_name = "DIR")]
    pub(crate) cgroup: Option<PathBuf>,

    /// This worker's id (default: a random one); keep it to re-attach with the same actor.
    /// One process per id: while a process with this id is attached, or left less than
    /// the control plane's --hosting-lease ago (it may still serve its actor), another
    /// is refused and keeps retrying.
    #[arg(long, env = "VALET_WORKER_ID", value_name = "ID")]
    pub(crate) worker_id: Option<String>,

    /// The IP routers reach the actor's app at, with the port it listens on (in
    /// Kubernetes: the pod IP). Required when --listen is 0.0.0.0 or [::].
    #[arg(long, env = "VALET_ADVERTISE_ADDRESS", value_name = "IP")]
    pub(crate) advertise_address: Option<std::net::IpAddr>,

    /// On SIGTERM, how long to wait for the control plane to checkpoint the hosted
    /// actor and release this worker (its requests in flight end first) before
    /// stopping anyway; the actor then goes back to its last snapshot. Keep it within
    /// the pod's terminationGracePeriodSeconds.
    #[arg(long, env = "VALET_WORKER_DRAIN_TIMEOUT", default_value = DEFAULT_WORKER_DRAIN_TIMEOUT, value_parser = parse_duration, value_name = "DURATION")]
    pub(crate) drain_timeout: Duration,

    #[command(flatten)]
    pub(crate) ateapi: valet_router::config::AteapiArgs,
}

#[derive(Debug, Clone, Args)]
pub(crate) struct CtlArgs {
    /// The ateapi.Control server; several replicas: a comma-separated list, asked in
    /// turn while the one asked is unavailable.
    #[arg(long, env = "VALET_CONTROL_PLANE", default_value = DEFAULT_CONTROL_PLANE, value_name = "URL[,URL…]", global = true)]
    pub(crate) control_plane: String,

    /// Print JSON instead of tables.
    #[arg(long, env = "VALET_JSON", global = true)]
    pub(crate) json: bool,

    #[command(flatten)]
    pub(crate) ateapi: valet_router::config::AteapiArgs,

    /// Deadline of the whole command, connecting included (with --wait-for-capacity,
    /// that long more). With several --control-plane URLs the next is asked only when
    /// one cannot be reached, never after a call got no answer in time (it may be
    /// carried out all the same).
    #[arg(long, env = "VALET_CTL_TIMEOUT", default_value = "30s", value_parser = parse_duration, value_name = "DURATION", global = true)]
    pub(crate) timeout: Duration,

    #[command(subcommand)]
    pub(crate) command: CtlCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub(crate) enum CtlCommand {
    /// Atespaces: create, list, delete.
    #[command(subcommand)]
    Atespace(AtespaceCommand),
    /// Actors: create, get, list, suspend, resume, revert, delete.
    #[command(subcommand)]
    Actor(ActorCommand),
    /// Workers and the actors they host.
    Workers,
}

#[derive(Debug, Clone, Subcommand)]
pub(crate) enum AtespaceCommand {
    /// Creates an atespace.
    Create { name: String },
    /// Lists atespaces.
    List,
    /// Deletes an (empty) atespace.
    Delete { name: String },
}

#[derive(Debug, Clone, Subcommand)]
pub(crate) enum ActorCommand {
    /// Creates an actor (SUSPENDED) from a template.
    Create {
        /// `atespace/name`.
        actor: String,
        /// The template (and so the pool).
        #[arg(long, env = "VALET_CTL_TEMPLATE", default_value = "counter")]
        template: String,
        /// The template's namespace.
        #[arg(long, env = "VALET_CTL_TEMPLATE_NAMESPACE", default_value = "default")]
        template_namespace: String,
    },
    /// Shows one actor.
    Get { actor: String },
    /// Lists actors, all pages.
    List {
        /// Only this atespace.
        #[arg(long, env = "VALET_CTL_ATESPACE")]
        atespace: Option<String>,
        /// Actors per page asked of the server.
        #[arg(long, env = "VALET_CTL_PAGE_SIZE", default_value_t = 100, value_parser = clap::value_parser!(i32).range(1..))]
        page_size: i32,
    },
    /// Suspends a running actor (checkpoint, free its worker).
    Suspend { actor: String },
    /// Resumes an actor on a free worker of its pool.
    Resume {
        actor: String,
        /// Wait this long for a worker when the pool is full (the extension).
        #[arg(long, env = "VALET_CTL_WAIT_FOR_CAPACITY", value_parser = parse_duration, value_name = "DURATION")]
        wait_for_capacity: Option<Duration>,
    },
    /// Brings a crashed actor back to SUSPENDED from its last good snapshot.
    Revert { actor: String },
    /// Deletes a suspended or crashed actor.
    Delete { actor: String },
    /// Prints the last 64 KiB of output of an actor's program.
    ///
    /// Its stdout and stderr lines, tagged, as the worker hosting it now (or any worker
    /// of its pool, from the snapshot directory they share) keeps them.
    Logs { actor: String },
}

/// Prints a command-line error and picks the exit status: 0 for `--help` and
/// `--version`, 64 (one line naming the flag, the value and the rule) for the rest.
pub(crate) fn parse_error_exit(e: &clap::Error) -> ExitCode {
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(EXIT_CONFIG)
        }
        _ => {
            let rendered = e.render().to_string();
            let line = rendered
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid command line");
            // A missing required argument is named on the next line: keep it.
            if e.kind() == ErrorKind::MissingRequiredArgument {
                let missing: Vec<&str> = rendered
                    .lines()
                    .skip_while(|l| *l != line)
                    .skip(1)
                    .map(str::trim)
                    .take_while(|l| !l.is_empty())
                    .collect();
                say_usage!("{line} {}", missing.join(", "));
                return ExitCode::from(EXIT_CONFIG);
            }
            // The rule of an enumerated flag is its possible values: on the same line.
            match rendered
                .lines()
                .map(str::trim)
                .find(|l| l.starts_with("[possible values:"))
            {
                Some(values) => say_usage!("{line} {values}"),
                None => say_usage!("{line}"),
            }
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

#[cfg(test)]
mod tests {
    /// The flags' defaults are the control crate's: one value, written twice only
    /// because clap takes a string.
    #[test]
    fn the_control_planes_flag_defaults_are_its_constants() {
        use valet_control::plane as c;
        for (flag, want) in [
            (DEFAULT_WORKER_TIMEOUT, c::DEFAULT_WORKER_TIMEOUT),
            (DEFAULT_SHUTDOWN_TIMEOUT, c::DEFAULT_SHUTDOWN_TIMEOUT),
            (DEFAULT_REJOIN_GRACE, c::DEFAULT_REJOIN_GRACE),
            (DEFAULT_ROUTE_LEASE, c::DEFAULT_ROUTE_LEASE),
            (DEFAULT_HOSTING_LEASE, c::DEFAULT_HOSTING_LEASE),
        ] {
            assert_eq!(parse_duration(flag).unwrap(), want, "{flag}");
        }
    }

    use super::*;

    /// Blanks around directives are dropped (the log filter would read them as part of
    /// a target's name, and log nothing for it); a word that is not a level is refused.
    #[test]
    fn log_levels_are_checked_and_trimmed() {
        assert_eq!(
            parse_log_level(" info, valet_router = debug ").as_deref(),
            Ok("info,valet_router=debug")
        );
        assert_eq!(parse_log_level("WARN").as_deref(), Ok("WARN"));
        for bad in ["", "loud", "info,", "=debug", "valet=loud"] {
            assert!(parse_log_level(bad).is_err(), "{bad:?}");
        }
    }
}
