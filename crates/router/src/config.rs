//! The router's configuration: flags (each with a `VALET_…` variable), their defaults,
//! and the one place they are validated and derived values are resolved.
//!
//! [`RouterArgs::resolve`] runs once at start-up, before any port is bound; every
//! consumer (retry loop, Envoy timeouts, drain) reads the same [`RouterConfig`].

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

use crate::addr::ActorDomain;
use valet_proto::auth::{ClientCredentials, ClientTlsFiles};

/// Default `--parked-request-budget`.
pub const DEFAULT_BUDGET: &str = "5s";
/// Default `--parked-request-max`.
pub const DEFAULT_MAX_PARKED: usize = 1024;
/// Default `--parked-request-retry-interval`.
pub const DEFAULT_RETRY_INTERVAL: &str = "100ms";
/// Default `--parked-request-retry-factor`.
pub const DEFAULT_RETRY_FACTOR: f64 = 1.1;
/// Default `--parked-request-retry-jitter`.
pub const DEFAULT_RETRY_JITTER: f64 = 0.1;
/// Default `--resume-attempt-timeout`.
pub const DEFAULT_RESUME_ATTEMPT_TIMEOUT: &str = "30s";
/// The floor of the derived `--extproc-max-requests` (Envoy's own default).
pub const MIN_DERIVED_EXTPROC_MAX_REQUESTS: u32 = 1024;
/// How much longer than the budget Envoy (and the built-in data plane) give a decision,
/// and the derived `--drain-timeout` beyond the budget.
pub const DECISION_MARGIN: Duration = Duration::from_secs(5);
/// How much sooner than Envoy's `message_timeout` the ext_proc plane gives its 504.
pub const EXTPROC_ANSWER_LEAD: Duration = Duration::from_millis(500);
/// The budget of a flight when parking is disabled: only `Aborted` is retried.
pub const DISABLED_ABORTED_BUDGET: Duration = Duration::from_secs(15);

/// Default `--parked-request-max-body`.
pub const DEFAULT_PARKED_BODY_LIMIT: &str = "1MiB";
/// Default `--parked-bytes-max`.
pub const DEFAULT_PARKED_BYTES_MAX: &str = "64MiB";

/// Default `--listen` of the router's built-in HTTP data plane.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";
/// Default `--extproc-listen`.
pub const DEFAULT_EXTPROC_LISTEN: &str = "0.0.0.0:50051";
/// Default `--admin-listen` (loopback: admin pages are not for the network).
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:4040";
/// Default `--control-plane`.
pub const DEFAULT_CONTROL_PLANE: &str = "http://127.0.0.1:7070";
/// Default `--actor-domain`.
pub const DEFAULT_ACTOR_DOMAIN: &str = "actors.resources.substrate.ate.dev";
/// Default `--worker-port`.
pub const DEFAULT_WORKER_PORT: u16 = 80;
/// Default `--route-stale-max` (the control plane's default hosting lease).
pub const DEFAULT_ROUTE_STALE_MAX: &str = "15s";
/// Default of `--control-plane-ping-interval`.
pub const DEFAULT_CONTROL_PLANE_PING_INTERVAL: &str = "2s";

/// Flags of `valet router` (and of `valet up`, which runs a router too).
#[derive(Debug, Clone, Args)]
pub struct RouterArgs {
    /// Address of the built-in HTTP data plane; empty turns it off, port 0 picks one.
    #[arg(long, env = "VALET_LISTEN", default_value = DEFAULT_LISTEN, value_name = "ADDR")]
    pub listen: String,

    /// Address of the Envoy ext_proc gRPC server; empty turns it off, port 0 picks one.
    #[arg(long, env = "VALET_EXTPROC_LISTEN", default_value = DEFAULT_EXTPROC_LISTEN, value_name = "ADDR")]
    pub extproc_listen: String,

    /// Address of the admin server (/metrics, /statusz, /healthz, /readyz); empty turns it off.
    #[arg(long, env = "VALET_ADMIN_LISTEN", default_value = DEFAULT_ADMIN_LISTEN, value_name = "ADDR")]
    pub admin_listen: String,

    /// The control plane (`ateapi.Control`) to resume actors with; `http://` means h2c.
    /// Several replicas: a comma-separated list, or a host name with several addresses
    /// (a replica per address; names are resolved again every 2s). Attempts are spread
    /// over the replicas in turn; one that cannot be reached, or answers UNAVAILABLE,
    /// is passed over for 1s.
    #[arg(long, env = "VALET_CONTROL_PLANE", default_value = DEFAULT_CONTROL_PLANE, value_name = "URL[,URL…]")]
    pub control_plane: String,

    /// DNS suffix of actor hosts: `<name>.<atespace>.<actor-domain>`.
    #[arg(long, env = "VALET_ACTOR_DOMAIN", default_value = DEFAULT_ACTOR_DOMAIN, value_name = "DOMAIN")]
    pub actor_domain: String,

    /// Port to route to when the control plane names none for an actor.
    #[arg(long, env = "VALET_WORKER_PORT", default_value_t = DEFAULT_WORKER_PORT, value_name = "PORT")]
    pub worker_port: u16,

    /// While the control plane is unreachable, how long after a route lease ended the
    /// built-in data plane may still route under it (the worker's hosting lease and its
    /// 421 keep this safe); 0 never. The Envoy data plane never does.
    #[arg(long, env = "VALET_ROUTE_STALE_MAX", default_value = DEFAULT_ROUTE_STALE_MAX, value_parser = parse_duration, value_name = "DURATION")]
    pub route_stale_max: Duration,

    /// How often the router pings each control plane over HTTP/2 when nothing came
    /// from it, also while no call is open, so that one that vanished is noticed (and
    /// passed over) before a request needs it; 0 sends no pings (a vanished control
    /// plane is then noticed by the call that finds it, within about 5s). A grpc-go
    /// server by default takes pings at most every 5 minutes during calls and none
    /// between them, and closes a connection that pings more often (GOAWAY
    /// `too_many_pings`): in front of one, give 0 or loosen its keepalive enforcement
    /// policy.
    #[arg(long, env = "VALET_CONTROL_PLANE_PING_INTERVAL", default_value = DEFAULT_CONTROL_PLANE_PING_INTERVAL, value_parser = parse_duration, value_name = "DURATION")]
    pub control_plane_ping_interval: Duration,

    #[command(flatten)]
    pub parking: ParkingArgs,

    #[command(flatten)]
    pub ateapi: AteapiArgs,
}

/// How a client reaches the control plane over TLS (the seed's flag names): the
/// router's, the workers' and `valet ctl`'s.
#[derive(Debug, Clone, Default, Args)]
pub struct AteapiArgs {
    /// With an `https://` control plane: `mtls` verifies it against --ateapi-ca-file
    /// and presents a client certificate when --ateapi-cert-file and --ateapi-key-file
    /// are given; `jwt` also sends `authorization: Bearer` with the token in
    /// --ateapi-token-file. Default: mtls for https (none for http). Server
    /// verification is never skipped.
    #[arg(
        long,
        global = true,
        env = "VALET_ATEAPI_AUTH",
        value_enum,
        value_name = "MODE"
    )]
    pub ateapi_auth: Option<AteapiAuth>,
    /// PEM CA the control plane's certificate must chain to (required for https).
    #[arg(long, global = true, env = "VALET_ATEAPI_CA_FILE", value_name = "PATH")]
    pub ateapi_ca_file: Option<PathBuf>,
    /// PEM client certificate (with --ateapi-key-file).
    #[arg(
        long,
        global = true,
        env = "VALET_ATEAPI_CERT_FILE",
        value_name = "PATH"
    )]
    pub ateapi_cert_file: Option<PathBuf>,
    /// PEM key of the client certificate (with --ateapi-cert-file).
    #[arg(
        long,
        global = true,
        env = "VALET_ATEAPI_KEY_FILE",
        value_name = "PATH"
    )]
    pub ateapi_key_file: Option<PathBuf>,
    /// Name checked in the control plane's certificate and sent as SNI (default: the
    /// URL's host).
    #[arg(
        long,
        global = true,
        env = "VALET_ATEAPI_SERVER_NAME",
        value_name = "NAME"
    )]
    pub ateapi_server_name: Option<String>,
    /// File holding the bearer token (`jwt`), read again for every call.
    #[arg(
        long,
        global = true,
        env = "VALET_ATEAPI_TOKEN_FILE",
        value_name = "PATH"
    )]
    pub ateapi_token_file: Option<PathBuf>,
}

/// `--ateapi-auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AteapiAuth {
    /// TLS with a pinned CA; a client certificate when one is given.
    Mtls,
    /// TLS with a pinned CA and a bearer token.
    Jwt,
}

impl AteapiArgs {
    /// The flags given, with their values (paths and names, never a file's content).
    pub fn given(&self) -> Vec<(&'static str, String)> {
        let mode = self
            .ateapi_auth
            .map(|m| if m == AteapiAuth::Jwt { "jwt" } else { "mtls" }.to_owned());
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        [
            ("--ateapi-auth", mode),
            ("--ateapi-ca-file", path(&self.ateapi_ca_file)),
            ("--ateapi-cert-file", path(&self.ateapi_cert_file)),
            ("--ateapi-key-file", path(&self.ateapi_key_file)),
            ("--ateapi-server-name", self.ateapi_server_name.clone()),
            ("--ateapi-token-file", path(&self.ateapi_token_file)),
        ]
        .into_iter()
        .filter_map(|(flag, value)| value.map(|v| (flag, v)))
        .collect()
    }

    /// The rules between the flags, no file read: a certificate goes with its key,
    /// `jwt` with a token file and a token file with `jwt`, a server name is one.
    /// The client identity (certificate, key) and the token file.
    ///
    /// # Errors
    /// The first rule broken, naming the flag.
    pub fn check_pairs(&self) -> Result<(Option<Identity>, Option<&Path>), ConfigError> {
        let show = |p: &Option<PathBuf>| {
            p.as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        };
        let identity = match (&self.ateapi_cert_file, &self.ateapi_key_file) {
            (Some(c), Some(k)) => Some((c.clone(), k.clone())),
            (None, None) => None,
            (Some(_), None) => {
                return Err(ConfigError::new(
                    "--ateapi-cert-file",
                    show(&self.ateapi_cert_file),
                    "needs --ateapi-key-file too",
                ));
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    "--ateapi-key-file",
                    show(&self.ateapi_key_file),
                    "needs --ateapi-cert-file too",
                ));
            }
        };
        let token = match (
            self.ateapi_auth.unwrap_or(AteapiAuth::Mtls),
            &self.ateapi_token_file,
        ) {
            (AteapiAuth::Jwt, Some(t)) => Some(t.as_path()),
            (AteapiAuth::Jwt, None) => {
                return Err(ConfigError::new(
                    "--ateapi-auth",
                    "jwt",
                    "needs --ateapi-token-file",
                ));
            }
            (AteapiAuth::Mtls, Some(_)) => {
                return Err(ConfigError::new(
                    "--ateapi-token-file",
                    show(&self.ateapi_token_file),
                    "is only sent with --ateapi-auth jwt",
                ));
            }
            (AteapiAuth::Mtls, None) => None,
        };
        if let Some(name) = &self.ateapi_server_name
            && !valet_proto::auth::valid_server_name(name)
        {
            return Err(ConfigError::new(
                "--ateapi-server-name",
                name,
                "must be a DNS name or an IP address",
            ));
        }
        Ok((identity, token))
    }

    /// The credentials for `url` (already checked to be `http://` or `https://`),
    /// every file read now.
    ///
    /// # Errors
    /// The first rule broken, naming the flag: TLS flags on an `http://` URL, `jwt`
    /// without a token file, a certificate without its key, a file that cannot be read.
    pub fn credentials(&self, url: &str) -> Result<ClientCredentials, ConfigError> {
        if url.starts_with("http://") {
            // Any TLS or token flag on a plaintext URL is a mistake, never ignored.
            if let Some((flag, value)) = self.given().into_iter().next() {
                return Err(ConfigError::new(
                    flag,
                    value,
                    format!("needs an https:// --control-plane, not {url}"),
                ));
            }
            return Ok(ClientCredentials::plaintext());
        }
        let Some(ca) = &self.ateapi_ca_file else {
            return Err(ConfigError::new(
                "--ateapi-ca-file",
                "",
                format!(
                    "is required for an https:// --control-plane ({url}): the control plane is always verified"
                ),
            ));
        };
        let (identity, token) = self.check_pairs()?;
        let files = ClientTlsFiles {
            ca: ca.clone(),
            identity,
            server_name: self.ateapi_server_name.clone(),
        };
        ClientCredentials::tls(&files, token).map_err(|e| {
            let flag = if Some(&e.path) == self.ateapi_token_file.as_ref() {
                "--ateapi-token-file"
            } else if Some(&e.path) == self.ateapi_cert_file.as_ref() {
                "--ateapi-cert-file"
            } else if Some(&e.path) == self.ateapi_key_file.as_ref() {
                "--ateapi-key-file"
            } else {
                "--ateapi-ca-file"
            };
            ConfigError::new(flag, e.path.display(), format!("cannot be used: {}", e.why))
        })
    }
}

/// Flags of request parking (`parking.md`, "Configuration").
#[derive(Debug, Clone, Args)]
pub struct ParkingArgs {
    /// How long a resume flight may keep starting attempts. Requests that join an
    /// in-flight resume share its remaining budget. Must be > 0.
    #[arg(long, env = "VALET_PARKED_REQUEST_BUDGET", default_value = DEFAULT_BUDGET, value_parser = parse_duration, value_name = "DURATION")]
    pub parked_request_budget: Duration,

    /// Most requests parked at once; a slot is taken only when a request's resume must
    /// wait. Requests parking beyond it are shed with 503. 0 disables parking.
    #[arg(long, env = "VALET_PARKED_REQUEST_MAX", default_value_t = DEFAULT_MAX_PARKED, value_name = "N")]
    pub parked_request_max: usize,

    /// Delay before a parked request's first resume retry. Must be > 0.
    #[arg(long, env = "VALET_PARKED_REQUEST_RETRY_INTERVAL", default_value = DEFAULT_RETRY_INTERVAL, value_parser = parse_duration, value_name = "DURATION")]
    pub parked_request_retry_interval: Duration,

    /// Multiplier of the retry delay after each attempt. Must be >= 1; no cap.
    #[arg(long, env = "VALET_PARKED_REQUEST_RETRY_FACTOR", default_value_t = DEFAULT_RETRY_FACTOR, allow_negative_numbers = true, value_name = "FACTOR")]
    pub parked_request_retry_factor: f64,

    /// Random fraction in [0, 1) of each delay added to it, to spread retries out.
    #[arg(long, env = "VALET_PARKED_REQUEST_RETRY_JITTER", default_value_t = DEFAULT_RETRY_JITTER, allow_negative_numbers = true, value_name = "FRACTION")]
    pub parked_request_retry_jitter: f64,

    /// Envoy circuit-breaker max_requests of the ext_proc cluster. 0 derives
    /// max(2 x --parked-request-max, 1024); an explicit value must be >= --parked-request-max.
    #[arg(
        long,
        env = "VALET_EXTPROC_MAX_REQUESTS",
        default_value_t = 0,
        value_name = "N"
    )]
    pub extproc_max_requests: u32,

    /// Deadline of one ResumeActor attempt (plus any capacity wait it asks for); never
    /// derived from a caller. Must be > 0.
    #[arg(long, env = "VALET_RESUME_ATTEMPT_TIMEOUT", default_value = DEFAULT_RESUME_ATTEMPT_TIMEOUT, value_parser = parse_duration, value_name = "DURATION")]
    pub resume_attempt_timeout: Duration,

    /// Most bytes of a parked request's body read into memory while it waits, so a
    /// client that leaves is noticed; past it the router stops reading (back-pressure)
    /// and forwards the held bytes, then the rest, once the request is routed. Never a
    /// reason to refuse a request. Bytes, or with KiB, MiB, GiB.
    #[arg(long, env = "VALET_PARKED_REQUEST_MAX_BODY", default_value = DEFAULT_PARKED_BODY_LIMIT, value_parser = parse_bytes, value_name = "BYTES")]
    pub parked_request_max_body: u64,

    /// Most bytes of parked requests' bodies held across the lot. A declared
    /// Content-Length reserves up to --parked-request-max-body at the park transition; a
    /// chunked body is charged as it arrives; when the lot's bytes are spent the router
    /// pauses reading. Bytes, or with KiB, MiB, GiB.
    #[arg(long, env = "VALET_PARKED_BYTES_MAX", default_value = DEFAULT_PARKED_BYTES_MAX, value_parser = parse_bytes, value_name = "BYTES")]
    pub parked_bytes_max: u64,

    /// On SIGTERM, how long readiness reports not-ready before the router stops accepting.
    #[arg(long, env = "VALET_DRAIN_DELAY", default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub drain_delay: Duration,

    /// How long requests already received may still wait during shutdown. 0 derives
    /// budget + 5s (20s with parking disabled, whose flights retry Aborted for 15s); an
    /// explicit value must be >= the budget.
    #[arg(long, env = "VALET_DRAIN_TIMEOUT", default_value = "0s", value_parser = parse_duration, value_name = "DURATION")]
    pub drain_timeout: Duration,
}

/// A client certificate file and its key file.
type Identity = (PathBuf, PathBuf);

/// An invalid configuration: names the flag, the value and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {flag}={value}: {rule}")]
pub struct ConfigError {
    /// The flag, with its dashes.
    pub flag: &'static str,
    /// The value as given (durations as parsed), its control characters escaped so
    /// that the message stays one line (a value from a file often ends in a newline).
    pub value: String,
    /// The rule it breaks.
    pub rule: String,
}

impl ConfigError {
    fn new(flag: &'static str, value: impl fmt::Display, rule: impl Into<String>) -> Self {
        Self {
            flag,
            value: one_line(&value.to_string()),
            rule: rule.into(),
        }
    }
}

/// `text` with its control characters escaped (`\n`, `\t`, `\u{1b}`): a message
/// that quotes a value stays on one line.
pub fn one_line(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// The resolved, validated router configuration. Fields are read-only: every consumer
/// sees the same derived values.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    listen: Option<SocketAddr>,
    extproc_listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
    control_plane: String,
    control_planes: Vec<String>,
    credentials: ClientCredentials,
    actor_domain: ActorDomain,
    worker_port: u16,
    route_stale_max: Duration,
    control_plane_ping_interval: Option<Duration>,
    parking: ParkingConfig,
    extproc_max_requests: u32,
    extproc_max_requests_derived: bool,
    parked_body_limit: u64,
    parked_bytes_max: u64,
    drain_delay: Duration,
    drain_timeout: Duration,
    /// Flags given beside the router's own (`--ateapi-*`, the HTTPS listener's), for
    /// the effective flags.
    more_flags: Vec<(&'static str, String)>,
}

impl RouterConfig {
    /// Adds flags that configure the router from outside this config (the HTTPS
    /// listener's) to [`Self::effective_flags`].
    pub fn with_flags(mut self, flags: Vec<(&'static str, String)>) -> Self {
        self.more_flags.extend(flags);
        self
    }

    /// The built-in HTTP data plane's address, if on.
    pub fn listen(&self) -> Option<SocketAddr> {
        self.listen
    }
    /// The ext_proc server's address, if on.
    pub fn extproc_listen(&self) -> Option<SocketAddr> {
        self.extproc_listen
    }
    /// The admin server's address, if on.
    pub fn admin_listen(&self) -> Option<SocketAddr> {
        self.admin_listen
    }
    /// The control plane's URLs as configured, comma-separated (`http://host:port`
    /// or `https://host:port`).
    pub fn control_plane(&self) -> &str {
        &self.control_plane
    }
    /// Each control-plane replica's URL.
    pub fn control_planes(&self) -> &[String] {
        &self.control_planes
    }
    /// How the control plane is reached (TLS, token).
    pub fn credentials(&self) -> &ClientCredentials {
        &self.credentials
    }
    /// The actor host suffix.
    pub fn actor_domain(&self) -> &ActorDomain {
        &self.actor_domain
    }
    /// The port routed to when the control plane names none.
    pub fn worker_port(&self) -> u16 {
        self.worker_port
    }
    /// How long an expired route lease may still be used while the control plane is
    /// unreachable (built-in data plane only).
    pub fn route_stale_max(&self) -> Duration {
        self.route_stale_max
    }
    /// How often the control planes are pinged over HTTP/2 (`None`: never).
    pub fn control_plane_ping_interval(&self) -> Option<Duration> {
        self.control_plane_ping_interval
    }
    /// The parking part.
    pub fn parking(&self) -> &ParkingConfig {
        &self.parking
    }
    /// The effective Envoy circuit-breaker `max_requests` of the ext_proc cluster.
    pub fn extproc_max_requests(&self) -> u32 {
        self.extproc_max_requests
    }
    /// Whether [`Self::extproc_max_requests`] was derived rather than given.
    pub fn extproc_max_requests_derived(&self) -> bool {
        self.extproc_max_requests_derived
    }
    /// Most bytes of one parked request's body held in memory.
    pub fn parked_body_limit(&self) -> u64 {
        self.parked_body_limit
    }
    /// Most bytes of parked requests' bodies held across the lot.
    pub fn parked_bytes_max(&self) -> u64 {
        self.parked_bytes_max
    }
    /// How long readiness fails before the router stops accepting.
    pub fn drain_delay(&self) -> Duration {
        self.drain_delay
    }
    /// The effective drain timeout.
    pub fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }
    /// How long a data plane may take to decide a request: a flight's budget + 5 s
    /// (Envoy's `message_timeout` and the built-in data plane's decision deadline). With
    /// parking disabled a flight retries `Aborted` for 15 s, so this is 20 s.
    pub fn decision_timeout(&self) -> Duration {
        self.parking.flight_budget() + DECISION_MARGIN
    }
    /// How long the ext_proc plane may take to decide a request: [`Self::decision_timeout`]
    /// less [`EXTPROC_ANSWER_LEAD`]. Envoy's `message_timeout` (the whole decision
    /// timeout) starts when Envoy sends the headers, before the router sees them; the
    /// router answers its own 504 first, so Envoy never abandons a request with a reply
    /// of its own.
    pub fn extproc_decision_timeout(&self) -> Duration {
        self.decision_timeout().saturating_sub(EXTPROC_ANSWER_LEAD)
    }

    /// The effective flags as `(flag, value)` pairs, for logs and `/statusz`.
    pub fn effective_flags(&self) -> Vec<(&'static str, String)> {
        let addr = |a: Option<SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
        let p = &self.parking;
        vec![
            ("--listen", addr(self.listen)),
            ("--extproc-listen", addr(self.extproc_listen)),
            ("--admin-listen", addr(self.admin_listen)),
            ("--control-plane", self.control_plane.clone()),
            ("--actor-domain", self.actor_domain.to_string()),
            ("--worker-port", self.worker_port.to_string()),
            ("--route-stale-max", fmt_duration(self.route_stale_max)),
            (
                "--control-plane-ping-interval",
                fmt_duration(self.control_plane_ping_interval.unwrap_or_default()),
            ),
            ("--parked-request-budget", fmt_duration(p.budget)),
            ("--parked-request-max", p.max_parked.to_string()),
            (
                "--parked-request-retry-interval",
                fmt_duration(p.retry_interval),
            ),
            ("--parked-request-retry-factor", p.retry_factor.to_string()),
            ("--parked-request-retry-jitter", p.retry_jitter.to_string()),
            (
                "--extproc-max-requests",
                self.extproc_max_requests.to_string(),
            ),
            (
                "--resume-attempt-timeout",
                fmt_duration(p.resume_attempt_timeout),
            ),
            (
                "--parked-request-max-body",
                fmt_bytes(self.parked_body_limit),
            ),
            ("--parked-bytes-max", fmt_bytes(self.parked_bytes_max)),
            ("--drain-delay", fmt_duration(self.drain_delay)),
            ("--drain-timeout", fmt_duration(self.drain_timeout)),
        ]
        .into_iter()
        .chain(self.more_flags.iter().cloned())
        .collect()
    }
}

/// The resolved parking configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkingConfig {
    budget: Duration,
    max_parked: usize,
    retry_interval: Duration,
    retry_factor: f64,
    retry_jitter: f64,
    resume_attempt_timeout: Duration,
}

/// The largest `--parked-request-max`: twice it (the derived
/// `--extproc-max-requests`) still fits the ext_proc server's `u32` stream cap, and
/// the lot's semaphore holds it.
pub const MAX_PARKED: usize = (u32::MAX / 2) as usize;

impl ParkingConfig {
    /// Validates a parking configuration on its own (the rules of `parking.md`).
    ///
    /// # Errors
    /// The first rule broken.
    pub fn new(
        budget: Duration,
        max_parked: usize,
        retry_interval: Duration,
        retry_factor: f64,
        retry_jitter: f64,
        resume_attempt_timeout: Duration,
    ) -> Result<Self, ConfigError> {
        if budget.is_zero() {
            return Err(ConfigError::new(
                "--parked-request-budget",
                fmt_duration(budget),
                "must be > 0",
            ));
        }
        if retry_interval.is_zero() {
            return Err(ConfigError::new(
                "--parked-request-retry-interval",
                fmt_duration(retry_interval),
                "must be > 0",
            ));
        }
        if !(retry_factor >= 1.0 && retry_factor.is_finite()) {
            return Err(ConfigError::new(
                "--parked-request-retry-factor",
                retry_factor,
                "must be >= 1",
            ));
        }
        if !(0.0..1.0).contains(&retry_jitter) {
            return Err(ConfigError::new(
                "--parked-request-retry-jitter",
                retry_jitter,
                "must be in [0, 1)",
            ));
        }
        if resume_attempt_timeout.is_zero() {
            return Err(ConfigError::new(
                "--resume-attempt-timeout",
                fmt_duration(resume_attempt_timeout),
                "must be > 0",
            ));
        }
        if max_parked > MAX_PARKED {
            return Err(ConfigError::new(
                "--parked-request-max",
                max_parked,
                format!("must be <= {MAX_PARKED}"),
            ));
        }
        Ok(Self {
            budget,
            max_parked,
            retry_interval,
            retry_factor,
            retry_jitter,
            resume_attempt_timeout,
        })
    }

    /// The defaults of `parking.md`.
    pub fn defaults() -> Self {
        Self::new(
            Duration::from_secs(5),
            DEFAULT_MAX_PARKED,
            Duration::from_millis(100),
            DEFAULT_RETRY_FACTOR,
            DEFAULT_RETRY_JITTER,
            Duration::from_secs(30),
        )
        .expect("the defaults are valid")
    }

    /// Whether requests park (`--parked-request-max` > 0).
    pub fn enabled(&self) -> bool {
        self.max_parked > 0
    }
    /// `--parked-request-budget`.
    pub fn budget(&self) -> Duration {
        self.budget
    }
    /// The budget a flight runs under: the park budget, or the `Aborted`-only budget of
    /// 15 s when parking is disabled.
    pub fn flight_budget(&self) -> Duration {
        if self.enabled() {
            self.budget
        } else {
            DISABLED_ABORTED_BUDGET
        }
    }
    /// `--parked-request-max`.
    pub fn max_parked(&self) -> usize {
        self.max_parked
    }
    /// `--parked-request-retry-interval`.
    pub fn retry_interval(&self) -> Duration {
        self.retry_interval
    }
    /// `--parked-request-retry-factor`.
    pub fn retry_factor(&self) -> f64 {
        self.retry_factor
    }
    /// `--parked-request-retry-jitter`.
    pub fn retry_jitter(&self) -> f64 {
        self.retry_jitter
    }
    /// `--resume-attempt-timeout`.
    pub fn resume_attempt_timeout(&self) -> Duration {
        self.resume_attempt_timeout
    }
}

/// `RouterArgs` parsed on their own, for tests, benchmarks and embedders.
#[derive(Debug, clap::Parser)]
#[command(no_binary_name = true)]
struct RouterFlags {
    #[command(flatten)]
    args: RouterArgs,
}

impl RouterArgs {
    /// Parses router flags (no program name), with the defaults and `VALET_…` variables.
    ///
    /// # Errors
    /// Clap's error for an unknown flag or an unparsable value.
    pub fn try_parse_flags<I, T>(flags: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        <RouterFlags as clap::Parser>::try_parse_from(flags).map(|f| f.args)
    }

    /// [`Self::try_parse_flags`] without the `VALET_…` variables: only the flags given
    /// and the defaults, as a benchmark's own router needs (a variable left in the
    /// shell must not change what it measures).
    ///
    /// # Errors
    /// Clap's error for an unknown flag or an unparsable value.
    pub fn try_parse_flags_only<I, T>(flags: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory, FromArgMatches};
        let matches = RouterFlags::command()
            .mut_args(|a| a.env(None::<&'static str>))
            .try_get_matches_from(flags)?;
        RouterFlags::from_arg_matches(&matches).map(|f| f.args)
    }

    /// Validates every flag and derives `--extproc-max-requests` and `--drain-timeout`.
    ///
    /// # Errors
    /// The first rule broken, naming the flag, its value and the rule.
    pub fn resolve(&self) -> Result<RouterConfig, ConfigError> {
        let listen = parse_listen("--listen", &self.listen)?;
        let extproc_listen = parse_listen("--extproc-listen", &self.extproc_listen)?;
        let admin_listen = parse_listen("--admin-listen", &self.admin_listen)?;
        distinct_listeners(&[
            ("--listen", listen),
            ("--extproc-listen", extproc_listen),
            ("--admin-listen", admin_listen),
        ])?;
        let control_planes = parse_control_planes(&self.control_plane)?;
        let control_plane = control_planes.join(",");
        let credentials = self.ateapi.credentials(&control_planes[0])?;
        let actor_domain: ActorDomain = self
            .actor_domain
            .parse()
            .map_err(|e| ConfigError::new("--actor-domain", &self.actor_domain, format!("{e}")))?;
        if self.worker_port == 0 {
            return Err(ConfigError::new("--worker-port", 0, "must be in 1..=65535"));
        }
        let ping = self.control_plane_ping_interval;
        if !ping.is_zero() && ping < Duration::from_secs(1) {
            return Err(ConfigError::new(
                "--control-plane-ping-interval",
                fmt_duration(ping),
                "must be 0 (no pings) or at least 1s",
            ));
        }

        let p = &self.parking;
        let parking = ParkingConfig::new(
            p.parked_request_budget,
            p.parked_request_max,
            p.parked_request_retry_interval,
            p.parked_request_retry_factor,
            p.parked_request_retry_jitter,
            p.resume_attempt_timeout,
        )?;

        let (extproc_max_requests, extproc_max_requests_derived) = if p.extproc_max_requests == 0 {
            let doubled = u32::try_from(parking.max_parked.saturating_mul(2)).unwrap_or(u32::MAX);
            (doubled.max(MIN_DERIVED_EXTPROC_MAX_REQUESTS), true)
        } else {
            if (p.extproc_max_requests as usize) < parking.max_parked {
                return Err(ConfigError::new(
                    "--extproc-max-requests",
                    p.extproc_max_requests,
                    format!(
                        "must be >= --parked-request-max ({}), or 0 to derive it",
                        parking.max_parked
                    ),
                ));
            }
            (p.extproc_max_requests, false)
        };

        let drain_timeout = if p.drain_timeout.is_zero() {
            parking.flight_budget() + DECISION_MARGIN
        } else {
            // A flight retries for its budget: with parking disabled that is the fixed
            // budget for `Aborted`, not `--parked-request-budget` (unused then).
            if p.drain_timeout < parking.flight_budget() {
                let rule = if parking.enabled() {
                    format!(
                        "must be >= --parked-request-budget ({}), or 0 to derive it",
                        fmt_duration(parking.budget)
                    )
                } else {
                    format!(
                        "must be >= {} (how long a request retries with parking disabled), or 0 to derive it",
                        fmt_duration(parking.flight_budget())
                    )
                };
                return Err(ConfigError::new(
                    "--drain-timeout",
                    fmt_duration(p.drain_timeout),
                    rule,
                ));
            }
            p.drain_timeout
        };

        Ok(RouterConfig {
            listen,
            extproc_listen,
            admin_listen,
            control_plane,
            control_planes,
            credentials,
            actor_domain,
            worker_port: self.worker_port,
            route_stale_max: self.route_stale_max,
            control_plane_ping_interval: (!ping.is_zero()).then_some(ping),
            parking,
            extproc_max_requests,
            extproc_max_requests_derived,
            parked_body_limit: p.parked_request_max_body,
            parked_bytes_max: p.parked_bytes_max,
            drain_delay: p.drain_delay,
            drain_timeout,
            more_flags: self.ateapi.given(),
        })
    }
}

/// Refuses two listeners of one process on one address: the same address, or one on
/// every address and another on the same port (`0.0.0.0` beside an IPv4 address,
/// `[::]` beside any). The second would
/// fail to bind after the first had started; refused here, before anything starts,
/// it is a configuration error naming both flags.
///
/// # Errors
/// The later of two listeners that overlap, naming the earlier one.
pub fn distinct_listeners(
    listeners: &[(&'static str, Option<SocketAddr>)],
) -> Result<(), ConfigError> {
    let fixed: Vec<(&'static str, SocketAddr)> = listeners
        .iter()
        .filter_map(|&(flag, addr)| addr.filter(|a| a.port() != 0).map(|a| (flag, a)))
        .collect();
    // `0.0.0.0` covers every IPv4 address; `[::]` every address of both families (a
    // dual-stack socket); an IPv4-mapped IPv6 address is its IPv4 address.
    let covers = |wide: IpAddr, ip: IpAddr| match wide {
        IpAddr::V6(v6) if v6.is_unspecified() => true,
        IpAddr::V4(v4) if v4.is_unspecified() => ip.is_ipv4(),
        _ => false,
    };
    for (i, &(flag, addr)) in fixed.iter().enumerate() {
        let overlaps = |b: &SocketAddr| {
            let (x, y) = (b.ip().to_canonical(), addr.ip().to_canonical());
            b.port() == addr.port() && (x == y || covers(x, y) || covers(y, x))
        };
        if let Some((earlier, _)) = fixed[..i].iter().find(|(_, b)| overlaps(b)) {
            return Err(ConfigError::new(
                flag,
                addr,
                format!("{earlier} listens there already: give each listener its own port"),
            ));
        }
    }
    Ok(())
}

fn parse_listen(flag: &'static str, value: &str) -> Result<Option<SocketAddr>, ConfigError> {
    if value.is_empty() {
        return Ok(None);
    }
    value.parse().map(Some).map_err(|_| {
        ConfigError::new(
            flag,
            value,
            "must be <ip>:<port> (port 0 picks one), or empty to turn it off",
        )
    })
}

/// `--control-plane`: one control-plane URL, or a comma-separated list of replicas,
/// each `http://<host>:<port>` (h2c) or `https://<host>:<port>` (TLS), all of one
/// scheme, normalized without a trailing slash.
///
/// # Errors
/// Anything else, naming the flag.
pub fn parse_control_planes(value: &str) -> Result<Vec<String>, ConfigError> {
    let urls = value
        .split(',')
        .map(|u| {
            parse_control_plane(u.trim())
                .map_err(|e| ConfigError::new("--control-plane", value, e.rule))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let https = urls[0].starts_with("https://");
    if urls.iter().any(|u| u.starts_with("https://") != https) {
        return Err(ConfigError::new(
            "--control-plane",
            value,
            "replicas must all be http:// or all https://",
        ));
    }
    for (i, u) in urls.iter().enumerate() {
        if urls[..i].contains(u) {
            return Err(ConfigError::new(
                "--control-plane",
                value,
                format!("{u} is listed twice"),
            ));
        }
    }
    Ok(urls)
}

/// Parses one `--control-plane` URL.
///
/// # Errors
/// Not an `http://` or `https://` URL of a host and port.
pub fn parse_control_plane(value: &str) -> Result<String, ConfigError> {
    let rule = "must be http://<host>:<port> (h2c) or https://<host>:<port> (TLS)";
    let (scheme, rest) = value
        .strip_prefix("http://")
        .map(|r| ("http", r))
        .or_else(|| value.strip_prefix("https://").map(|r| ("https", r)))
        .ok_or_else(|| ConfigError::new("--control-plane", value, rule))?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    // The port is named: a URL without one would silently mean 80 or 443.
    let valid = !authority.is_empty()
        && !authority.contains('/')
        && !authority.contains(['@', '?', '#'])
        && value
            .parse::<http::Uri>()
            .is_ok_and(|u| u.port_u16().is_some());
    if !valid {
        return Err(ConfigError::new("--control-plane", value, rule));
    }
    // Host names are case-insensitive: one spelling, so a replica listed twice in two
    // cases is seen as listed twice.
    Ok(format!("{scheme}://{}", authority.to_ascii_lowercase()))
}

pub use valet_proto::units::{MAX_DURATION, fmt_bytes, fmt_duration, parse_bytes, parse_duration};

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        router: RouterArgs,
    }

    fn resolve(args: &[&str]) -> Result<RouterConfig, ConfigError> {
        let mut argv = vec!["valet"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().router.resolve()
    }

    fn rule_of(args: &[&str]) -> String {
        resolve(args).unwrap_err().to_string()
    }

    /// A value read from a file (a ConfigMap's, say) ends in a newline: the message
    /// stays one line, the newline shown escaped.
    #[test]
    fn a_refused_value_is_shown_on_one_line() {
        let e = rule_of(&["--listen", "0.0.0.0:8080\n"]);
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(
            e.contains("--listen=0.0.0.0:8080\\n: must be <ip>:<port>"),
            "{e}"
        );
    }

    /// Two listeners on one port (the same address, or every address and one of
    /// them) are refused before anything starts: before, the second failed to bind
    /// after the first had started (exit 1).
    #[test]
    fn two_listeners_on_one_address_are_refused() {
        let e = rule_of(&[
            "--admin-listen",
            "127.0.0.1:8080",
            "--listen",
            "127.0.0.1:8080",
        ]);
        assert!(
            e.contains("--admin-listen=127.0.0.1:8080: --listen listens there already"),
            "{e}"
        );
        let e = rule_of(&[
            "--listen",
            "0.0.0.0:9000",
            "--extproc-listen",
            "127.0.0.1:9000",
        ]);
        assert!(
            e.contains("--extproc-listen=127.0.0.1:9000: --listen"),
            "{e}"
        );
        // `[::]` is dual-stack: it takes the IPv4 addresses of its port too; an
        // IPv4-mapped address is its IPv4 one.
        for (wide, narrow) in [
            ("[::]:9000", "127.0.0.1:9000"),
            ("127.0.0.1:9000", "[::ffff:127.0.0.1]:9000"),
        ] {
            let e = rule_of(&["--listen", wide, "--admin-listen", narrow]);
            assert!(e.contains("--listen listens there already"), "{e}");
        }
        // `0.0.0.0` takes no IPv6 address.
        resolve(&["--listen", "0.0.0.0:9000", "--admin-listen", "[::1]:9000"]).unwrap();
        // Port 0 picks a free one each time; other ports do not overlap.
        resolve(&["--listen", "127.0.0.1:0", "--extproc-listen", "127.0.0.1:0"]).unwrap();
        resolve(&[
            "--listen",
            "127.0.0.1:9000",
            "--admin-listen",
            "127.0.0.2:9000",
        ])
        .unwrap();
    }

    #[test]
    fn control_plane_replicas_are_a_list_of_one_scheme() {
        let c = resolve(&["--control-plane", "http://a:1, http://b:2/"]).unwrap();
        assert_eq!(c.control_planes(), ["http://a:1", "http://b:2"]);
        assert_eq!(c.control_plane(), "http://a:1,http://b:2");
        let mixed = rule_of(&["--control-plane", "http://a:1,https://b:2"]);
        assert!(
            mixed.contains("must all be http:// or all https://"),
            "{mixed}"
        );
        let twice = rule_of(&["--control-plane", "http://a:1,http://a:1"]);
        assert!(twice.contains("listed twice"), "{twice}");
        let twice = rule_of(&["--control-plane", "http://CP:1,http://cp:1"]);
        assert!(
            twice.contains("listed twice"),
            "host names are case-insensitive: {twice}"
        );
        let no_port = rule_of(&["--control-plane", "http://cp"]);
        assert!(
            no_port.contains("must be http://<host>:<port>"),
            "a port is named: {no_port}"
        );
        let empty = rule_of(&["--control-plane", "http://a:1,"]);
        assert!(empty.contains("--control-plane"), "{empty}");
        // Nothing that could carry a secret into logs and /statusz: credentials, a
        // query, a fragment.
        for url in [
            "http://u:p@a:1",
            "http://a:1?token=x",
            "http://a:1/?token=x",
            "http://a:1#x",
        ] {
            let e = rule_of(&["--control-plane", url]);
            assert!(e.contains("must be http://<host>:<port>"), "{url}: {e}");
        }
    }

    #[test]
    fn defaults_resolve() {
        let c = resolve(&[]).unwrap();
        let p = c.parking();
        assert_eq!(p.budget(), Duration::from_secs(5));
        assert_eq!(p.max_parked(), 1024);
        assert!(p.enabled());
        assert_eq!(p.retry_interval(), Duration::from_millis(100));
        assert_eq!(p.retry_factor(), 1.1);
        assert_eq!(p.retry_jitter(), 0.1);
        assert_eq!(p.resume_attempt_timeout(), Duration::from_secs(30));
        assert_eq!(c.extproc_max_requests(), 2048);
        assert!(c.extproc_max_requests_derived());
        assert_eq!(c.drain_timeout(), Duration::from_secs(10));
        assert_eq!(c.drain_delay(), Duration::ZERO);
        assert_eq!(c.decision_timeout(), Duration::from_secs(10));
        assert_eq!(c.listen(), Some("0.0.0.0:8080".parse().unwrap()));
        assert_eq!(c.extproc_listen(), Some("0.0.0.0:50051".parse().unwrap()));
        assert_eq!(c.admin_listen(), Some("127.0.0.1:4040".parse().unwrap()));
        assert_eq!(c.control_plane(), "http://127.0.0.1:7070");
        assert_eq!(c.actor_domain().as_str(), DEFAULT_ACTOR_DOMAIN);
        assert_eq!(c.worker_port(), 80);
    }

    #[test]
    fn derived_extproc_max_requests() {
        let cases: [(&str, u32); 5] = [
            ("1024", 2048),
            ("100", 1024),
            ("0", 1024),
            ("511", 1024),
            ("3000", 6000),
        ];
        for (max, want) in cases {
            let c = resolve(&["--parked-request-max", max]).unwrap();
            assert_eq!(c.extproc_max_requests(), want, "lot {max}");
        }
        let c = resolve(&[
            "--parked-request-max",
            "100",
            "--extproc-max-requests",
            "100",
        ])
        .unwrap();
        assert_eq!(c.extproc_max_requests(), 100);
        assert!(!c.extproc_max_requests_derived());
        assert_eq!(
            rule_of(&[
                "--parked-request-max",
                "100",
                "--extproc-max-requests",
                "99"
            ]),
            "invalid configuration: --extproc-max-requests=99: must be >= --parked-request-max (100), or 0 to derive it"
        );
    }

    #[test]
    fn derived_drain_timeout() {
        let c = resolve(&["--parked-request-budget", "2s"]).unwrap();
        assert_eq!(c.drain_timeout(), Duration::from_secs(7));
        let c = resolve(&["--parked-request-budget", "2s", "--drain-timeout", "2s"]).unwrap();
        assert_eq!(c.drain_timeout(), Duration::from_secs(2));
        assert_eq!(
            rule_of(&["--parked-request-budget", "2s", "--drain-timeout", "1500ms"]),
            "invalid configuration: --drain-timeout=1.5s: must be >= --parked-request-budget (2s), or 0 to derive it"
        );
        // With parking disabled a request retries `Aborted` for the fixed budget, and
        // --parked-request-budget is unused.
        assert_eq!(
            rule_of(&["--parked-request-max", "0", "--drain-timeout", "5s"]),
            "invalid configuration: --drain-timeout=5s: must be >= 15s (how long a request retries with parking disabled), or 0 to derive it"
        );
        let c = resolve(&[
            "--parked-request-max",
            "0",
            "--parked-request-budget",
            "30s",
            "--drain-timeout",
            "20s",
        ])
        .unwrap();
        assert_eq!(c.drain_timeout(), Duration::from_secs(20));
    }

    /// A lot past what the ext_proc stream cap (twice the lot, in a `u32`) and the
    /// lot's semaphore hold is refused, naming the flag.
    #[test]
    fn control_plane_pings_are_off_or_at_least_a_second_apart() {
        let c = resolve(&[]).unwrap();
        assert_eq!(
            c.control_plane_ping_interval(),
            Some(Duration::from_secs(2))
        );
        let c = resolve(&["--control-plane-ping-interval", "0"]).unwrap();
        assert_eq!(c.control_plane_ping_interval(), None);
        assert!(
            c.effective_flags()
                .contains(&("--control-plane-ping-interval", "0s".into()))
        );
        let c = resolve(&["--control-plane-ping-interval", "5m"]).unwrap();
        assert_eq!(
            c.control_plane_ping_interval(),
            Some(Duration::from_secs(300))
        );
        assert_eq!(
            rule_of(&["--control-plane-ping-interval", "500ms"]),
            "invalid configuration: --control-plane-ping-interval=500ms: must be 0 (no pings) or at least 1s"
        );
    }

    #[test]
    fn the_lot_has_a_bound() {
        assert_eq!(
            rule_of(&["--parked-request-max", "4294967296"]),
            format!(
                "invalid configuration: --parked-request-max=4294967296: must be <= {MAX_PARKED}"
            )
        );
        let c = resolve(&["--parked-request-max", &MAX_PARKED.to_string()]).unwrap();
        assert_eq!(c.extproc_max_requests() as usize, 2 * MAX_PARKED);
    }

    #[test]
    fn every_rule() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--parked-request-budget", "0ms"],
                "invalid configuration: --parked-request-budget=0s: must be > 0",
            ),
            (
                &["--parked-request-retry-interval", "0"],
                "invalid configuration: --parked-request-retry-interval=0s: must be > 0",
            ),
            (
                &["--parked-request-retry-factor", "0.9"],
                "invalid configuration: --parked-request-retry-factor=0.9: must be >= 1",
            ),
            (
                &["--parked-request-retry-factor", "NaN"],
                "invalid configuration: --parked-request-retry-factor=NaN: must be >= 1",
            ),
            (
                &["--parked-request-retry-jitter", "1"],
                "invalid configuration: --parked-request-retry-jitter=1: must be in [0, 1)",
            ),
            (
                &["--parked-request-retry-jitter", "-0.1"],
                "invalid configuration: --parked-request-retry-jitter=-0.1: must be in [0, 1)",
            ),
            (
                &["--resume-attempt-timeout", "0s"],
                "invalid configuration: --resume-attempt-timeout=0s: must be > 0",
            ),
            (
                &["--listen", "localhost:80"],
                "invalid configuration: --listen=localhost:80: must be <ip>:<port> (port 0 picks one), or empty to turn it off",
            ),
            (
                &["--admin-listen", "127.0.0.1"],
                "invalid configuration: --admin-listen=127.0.0.1: must be <ip>:<port> (port 0 picks one), or empty to turn it off",
            ),
            (
                &["--extproc-listen", ":50051"],
                "invalid configuration: --extproc-listen=:50051: must be <ip>:<port> (port 0 picks one), or empty to turn it off",
            ),
            (
                &["--control-plane", "https://cp:443"],
                "invalid configuration: --ateapi-ca-file=: is required for an https:// --control-plane (https://cp:443): the control plane is always verified",
            ),
            (
                &["--control-plane", "http://"],
                "invalid configuration: --control-plane=http://: must be http://<host>:<port> (h2c) or https://<host>:<port> (TLS)",
            ),
            (
                &["--control-plane", "http://cp:7070/path"],
                "invalid configuration: --control-plane=http://cp:7070/path: must be http://<host>:<port> (h2c) or https://<host>:<port> (TLS)",
            ),
            (
                &["--actor-domain", "bad_domain"],
                "invalid configuration: --actor-domain=bad_domain: label \"bad_domain\" may only contain a-z, 0-9 and '-'",
            ),
            (
                &["--worker-port", "0"],
                "invalid configuration: --worker-port=0: must be in 1..=65535",
            ),
        ];
        for (args, want) in cases {
            assert_eq!(rule_of(args), *want, "{args:?}");
        }
    }

    #[test]
    fn listeners_turn_off_when_empty() {
        let c = resolve(&["--listen", "", "--extproc-listen", "", "--admin-listen", ""]).unwrap();
        assert_eq!(c.listen(), None);
        assert_eq!(c.extproc_listen(), None);
        assert_eq!(c.admin_listen(), None);
        let c = resolve(&["--listen", "127.0.0.1:0"]).unwrap();
        assert_eq!(c.listen(), Some("127.0.0.1:0".parse().unwrap()));
    }

    #[test]
    fn disabled_parking() {
        let c = resolve(&["--parked-request-max", "0"]).unwrap();
        assert!(!c.parking().enabled());
        assert_eq!(c.parking().flight_budget(), Duration::from_secs(15));
        // Every data plane (and the drain) gives a flight its whole 15 s.
        assert_eq!(c.decision_timeout(), Duration::from_secs(20));
        assert_eq!(c.drain_timeout(), Duration::from_secs(20));
        assert_eq!(
            resolve(&[]).unwrap().parking().flight_budget(),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("525600m"), Ok(MAX_DURATION));
        for bad in [
            "",
            "5",
            "s",
            "-1s",
            "5h",
            "1e3s",
            "abc",
            "525601m",
            "9999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        for d in ["250ms", "5s", "1.5s", "0s"] {
            assert_eq!(fmt_duration(parse_duration(d).unwrap()), d);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("65536"), Ok(65536));
        assert_eq!(parse_bytes("512KiB"), Ok(512 << 10));
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("0"), Ok(0));
        for bad in [
            "",
            "MiB",
            "1.5MiB",
            "-1",
            "1MB",
            "1 MiB",
            "99999999999999999999GiB",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
        for n in ["1MiB", "64MiB", "3KiB", "1000", "0", "2GiB"] {
            assert_eq!(fmt_bytes(parse_bytes(n).unwrap()), n);
        }
        let c = resolve(&[]).unwrap();
        assert_eq!(c.parked_body_limit(), 1 << 20);
        assert_eq!(c.parked_bytes_max(), 64 << 20);
    }

    #[test]
    fn bad_duration_is_a_parse_error_naming_the_flag() {
        let err = Cli::try_parse_from(["valet", "--parked-request-budget", "5"]).unwrap_err();
        let text = err.to_string();
        let first = text.lines().next().unwrap();
        assert!(first.contains("--parked-request-budget"), "{first}");
        assert!(first.contains("'5'"), "{first}");
    }
}
