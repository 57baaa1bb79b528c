//! The router's view of the control plane: one call, `ResumeActor`.
//!
//! [`ControlPlane`] is what the retry loop calls; [`GrpcControlPlane`] speaks
//! `ateapi.Control` over h2c. Errors are read once here into [`ResumeError`], so the
//! classification downstream never looks at raw `tonic::Status` details again.
//!
//! A transport failure is not the server's answer: a control plane that dies, resets
//! the stream or sends GOAWAY mid-attempt surfaces as `Unavailable`, whatever code the
//! client library gives it, so the flight parks and goes on under its budget. One that
//! dies silently is noticed by HTTP/2 pings (also while idle) and `TCP_USER_TIMEOUT`.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

use tonic::Code;
use tonic_types::StatusExt;
use valet_proto::ateapi;
use valet_proto::auth::{ClientCredentials, CpChannel};

use crate::addr::ActorRef;

/// The `ErrorInfo.reason` of a crashed actor; never parked.
pub const ACTOR_CRASHED: &str = "ACTOR_CRASHED";

/// One `ResumeActor` attempt.
#[derive(Debug, Clone)]
pub struct ResumeRequest {
    /// The actor to resume.
    pub actor: ActorRef,
    /// The `wait_for_capacity` extension: `None` asks the control plane not to wait.
    pub wait_for_capacity: Option<Duration>,
    /// The attempt's own deadline, sent as `grpc-timeout` and enforced locally.
    pub timeout: Duration,
    /// The router id to ask a route lease for (`docs/leases.md`); `None` asks none.
    pub lease_holder: Option<String>,
}

/// A route lease the control plane granted on an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// How long, counted from when the request was sent.
    pub lease: Duration,
    /// Its number, growing per actor.
    pub id: u64,
}

/// A successful `ResumeActor` answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Resumed {
    /// The actor as the control plane answered it.
    pub actor: ateapi::Actor,
    /// The route lease granted with it, if any.
    pub grant: Option<Grant>,
}

impl From<ateapi::Actor> for Resumed {
    fn from(actor: ateapi::Actor) -> Self {
        Self { actor, grant: None }
    }
}

/// What a failed attempt said, read once from the gRPC status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeError {
    code: Code,
    message: String,
    crashed: bool,
}

impl ResumeError {
    /// An error with no details.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            crashed: false,
        }
    }

    /// The `FailedPrecondition` of a crashed actor (`ErrorInfo.reason = ACTOR_CRASHED`).
    pub fn crashed(message: impl Into<String>) -> Self {
        Self {
            code: Code::FailedPrecondition,
            message: message.into(),
            crashed: true,
        }
    }

    /// The gRPC code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The control plane's own description (the status message, never a wrapper's text).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the status carried `ErrorInfo{reason: "ACTOR_CRASHED"}`.
    pub fn is_crashed(&self) -> bool {
        self.crashed
    }
}

/// The message tonic gives a stream that ended cleanly without a gRPC status: a peer
/// or proxy reset it (hyper turns `RST_STREAM(NO_ERROR|CANCEL)` into a clean end).
const MISSING_STATUS: &str = "protocol error: missing grpc-status trailer";

/// Whether `status` was made by the client library for a failed transport (connection
/// refused, reset, GOAWAY, ping timeout, a stream cut short) rather than sent by the
/// server. The library attaches the underlying error as the status's source; a status
/// read from the server's trailers has none.
pub fn is_transport_failure(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some() || status.message().starts_with(MISSING_STATUS)
}

/// Whether `status` is the client library's own timer ending the call (the
/// `grpc-timeout` the request carries is also enforced locally): no answer in time,
/// as the router's timer would have said a moment later.
fn timed_out_locally(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = e.source();
    }
    false
}

impl From<tonic::Status> for ResumeError {
    fn from(status: tonic::Status) -> Self {
        if timed_out_locally(&status) {
            return Self::new(Code::DeadlineExceeded, "resume attempt timed out");
        }
        if is_transport_failure(&status) {
            return Self::new(Code::Unavailable, status.message());
        }
        let crashed = status
            .get_details_error_info()
            .is_some_and(|info| info.reason == ACTOR_CRASHED);
        Self {
            code: status.code(),
            message: status.message().to_owned(),
            crashed,
        }
    }
}

/// How often a client pings the control plane by default (`--control-plane-ping-interval`).
pub const PING_INTERVAL: Duration = Duration::from_secs(2);
/// How long a ping may go unanswered before the connection counts as dead.
pub const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// How long sent data may stay unacknowledged before the kernel drops the connection.
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A lazily connecting channel to a control plane at `url` with `credentials` (TLS
/// and a bearer token for `https://`), with the router's liveness checks: pings every
/// `ping` when nothing came (also while no call is open; none when `None`), answered
/// within [`PING_TIMEOUT`], `TCP_USER_TIMEOUT`, `TCP_NODELAY`.
///
/// # Errors
/// When `url` is not a valid endpoint.
pub fn channel(
    url: &str,
    credentials: &ClientCredentials,
    ping: Option<Duration>,
) -> Result<CpChannel, tonic::transport::Error> {
    channel_to(url, None, credentials, ping)
}

/// [`channel`], every connection to `addr` when given (one address of the URL's host).
fn channel_to(
    url: &str,
    addr: Option<SocketAddr>,
    credentials: &ClientCredentials,
    ping: Option<Duration>,
) -> Result<CpChannel, tonic::transport::Error> {
    let mut http = valet_proto::auth::tcp_connector();
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    http.set_tcp_user_timeout(Some(TCP_USER_TIMEOUT));
    let mut endpoint = credentials.endpoint(url)?.connect_timeout(CONNECT_TIMEOUT);
    if let Some(every) = ping {
        endpoint = endpoint
            .http2_keep_alive_interval(every)
            .keep_alive_timeout(PING_TIMEOUT)
            .keep_alive_while_idle(true);
    }
    Ok(match addr {
        Some(addr) => credentials.connect_lazy_to(&endpoint, http, addr),
        None => credentials.connect_lazy(&endpoint, http),
    })
}

/// The longest route lease taken from the wire: a year (the plane's own bound on
/// durations), so that adding it to the clock can never overflow.
pub const MAX_WIRE_LEASE: Duration = Duration::from_secs(365 * 24 * 3600);

/// A lease length the control plane sent: `None` for none or zero, at most
/// [`MAX_WIRE_LEASE`].
pub fn wire_lease(d: Option<prost_types::Duration>) -> Option<Duration> {
    d.and_then(|d| Duration::try_from(d).ok())
        .filter(|d| !d.is_zero())
        .map(|d| d.min(MAX_WIRE_LEASE))
}

/// The boxed future a [`ControlPlane`] returns.
pub type ResumeFuture<'a> = Pin<Box<dyn Future<Output = Result<Resumed, ResumeError>> + Send + 'a>>;

/// A control plane the router can resume actors with.
pub trait ControlPlane: Send + Sync + 'static {
    /// One `ResumeActor` attempt. Must honour `req.timeout`.
    fn resume_actor(&self, req: ResumeRequest) -> ResumeFuture<'_>;
}

/// How long a replica that could not be reached, or answered `Unavailable` itself,
/// is passed over while another one may answer.
pub const FAILOVER_HOLD: Duration = Duration::from_secs(1);

/// How long one resolution of a `--control-plane` host name may take.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// `ateapi.Control` over gRPC (h2c for `http://` addresses), on one control plane or
/// spread over several replicas: those listed, and each address a listed host name
/// resolves to (see [`Self::resolve_again`]).
#[derive(Debug, Clone)]
pub struct GrpcControlPlane {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// As configured, in order.
    urls: Vec<String>,
    credentials: ClientCredentials,
    ping: Option<Duration>,
    /// The replicas attempts are spread over; swapped whole when a name resolves to
    /// other addresses.
    replicas: ArcSwap<Vec<Arc<Replica>>>,
    next: AtomicUsize,
    /// The first URL's channel by name (the lease watch's).
    first: CpChannel,
    /// The system resolver's lookup of every listed name, while it runs (on a
    /// blocking thread, which no timeout can stop): one at a time, so a resolver that
    /// hangs holds one thread, not one per probe.
    lookup: std::sync::Mutex<Option<tokio::task::JoinHandle<Vec<Resolved>>>>,
    /// Per URL, why its name could not be resolved the last time (said once per change).
    unresolved: std::sync::Mutex<Vec<Option<String>>>,
}

/// What one name resolved to.
type Resolved = std::io::Result<Vec<SocketAddr>>;

#[derive(Debug)]
struct Replica {
    /// The configured URL this replica is reached by.
    url: String,
    /// The address it is pinned to; `None`: the URL's host, resolved per connection.
    addr: Option<SocketAddr>,
    client: ateapi::control_client::ControlClient<CpChannel>,
    channel: CpChannel,
    /// Passed over until then: its last attempt was `Unavailable` (or unreachable).
    down_until: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Replica {
    fn new(
        url: &str,
        addr: Option<SocketAddr>,
        credentials: &ClientCredentials,
        ping: Option<Duration>,
    ) -> Result<Self, tonic::transport::Error> {
        let channel = channel_to(url, addr, credentials, ping)?;
        Ok(Self {
            url: url.to_owned(),
            addr,
            client: ateapi::control_client::ControlClient::new(channel.clone()),
            channel,
            down_until: std::sync::Mutex::new(None),
        })
    }

    fn is_down(&self, now: tokio::time::Instant) -> bool {
        self.down_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| now < until)
    }

    fn mark(&self, unavailable: bool) {
        *self
            .down_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            unavailable.then(|| tokio::time::Instant::now() + FAILOVER_HOLD);
    }
}

/// The host and port of a `--control-plane` URL when the host is a name (not an IP
/// address), so that it may resolve to several replicas.
fn host_name(url: &str) -> Option<(String, u16)> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?;
    let port = uri.port_u16()?;
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    literal
        .parse::<std::net::IpAddr>()
        .is_err()
        .then(|| (host.to_owned(), port))
}

impl GrpcControlPlane {
    /// A client that connects on first use and reconnects as needed; an unreachable
    /// control plane shows up as `Unavailable` on each attempt.
    ///
    /// # Errors
    /// When `url` is not a valid endpoint.
    pub fn connect_lazy(
        url: &str,
        credentials: &ClientCredentials,
    ) -> Result<Self, tonic::transport::Error> {
        Self::replicas(&[url.to_owned()], credentials, Some(PING_INTERVAL))
    }

    /// A client of several replicas (all serving, `--active-replicas all`): attempts
    /// are spread over them in turn; one that cannot be reached (a transport failure,
    /// or no answer in time) or that answered `Unavailable` itself (its database
    /// write failed, it is stopping) is passed over for [`FAILOVER_HOLD`]. A failed
    /// attempt counts as `Unavailable`, so a parked request's next attempt goes to
    /// another replica; one with no answer within `--resume-attempt-timeout` counts
    /// as `DeadlineExceeded`, which ends the flight (the spec's verdict table), and
    /// the replica is passed over by the flights after it. (In front of
    /// `--active-replicas one`, a standby refuses connections and is passed over the
    /// same way; a Service that routes to the ready replica only spares those
    /// attempts.) Until [`Self::resolve_again`] runs, each URL is one replica whose
    /// host is resolved per connection.
    ///
    /// # Errors
    /// When a URL is not a valid endpoint.
    ///
    /// # Panics
    /// When `urls` is empty.
    pub fn replicas(
        urls: &[String],
        credentials: &ClientCredentials,
        ping: Option<Duration>,
    ) -> Result<Self, tonic::transport::Error> {
        assert!(!urls.is_empty(), "at least one control plane");
        let replicas = urls
            .iter()
            .map(|url| Replica::new(url, None, credentials, ping).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let first = replicas[0].channel.clone();
        Ok(Self {
            inner: Arc::new(Inner {
                urls: urls.to_vec(),
                credentials: credentials.clone(),
                ping,
                replicas: ArcSwap::from_pointee(replicas),
                next: AtomicUsize::new(0),
                first,
                lookup: std::sync::Mutex::new(None),
                unresolved: std::sync::Mutex::new(vec![None; urls.len()]),
            }),
        })
    }

    /// Resolves every listed host name again, with the system's resolver: a name
    /// with several addresses (a headless Service: one per replica) is one replica
    /// per address, each connected to its address under the name (`:authority`, the
    /// certificate's name); a connection its address refuses goes to the name's other
    /// addresses instead (a name of a dual-stack host whose server listens on one
    /// family, an address already gone). A name that cannot be resolved now keeps the
    /// replicas it had (at first: itself, resolved per connection). Replicas whose
    /// address stays keep their connection and their pass-over; an address reached
    /// through two listed URLs is one replica. The router's probe calls this every two
    /// seconds. The lookup runs on a blocking thread and is waited for at most
    /// [`RESOLVE_TIMEOUT`]; one still running is waited for again by the next call,
    /// never started twice.
    pub async fn resolve_again(&self) {
        let names: Vec<(String, u16)> = self
            .inner
            .urls
            .iter()
            .filter_map(|u| host_name(u))
            .collect();
        if names.is_empty() {
            return;
        }
        let running = self
            .inner
            .lookup
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let mut lookup = running.unwrap_or_else(|| {
            tokio::task::spawn_blocking(move || {
                names
                    .iter()
                    .map(|(host, port)| {
                        std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), *port))
                            .map(Iterator::collect)
                    })
                    .collect()
            })
        });
        let results = match tokio::time::timeout(RESOLVE_TIMEOUT, &mut lookup).await {
            Ok(Ok(results)) => results,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the control plane's name lookup failed");
                return;
            }
            Err(_) => {
                tracing::debug!("the control plane's name lookup is still running");
                *self
                    .inner
                    .lookup
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(lookup);
                return;
            }
        };
        let mut results = results.into_iter();
        self.apply(|_, _| results.next().unwrap_or_else(|| Ok(Vec::new())));
    }

    /// [`Self::resolve_again`] with `resolve` in place of the system's resolver.
    pub async fn resolve_again_with(&self, resolve: impl AsyncFn(&str, u16) -> Resolved) {
        let mut results = Vec::new();
        for (host, port) in self.inner.urls.iter().filter_map(|u| host_name(u)) {
            results.push(resolve(&host, port).await);
        }
        let mut results = results.into_iter();
        self.apply(|_, _| results.next().unwrap_or_else(|| Ok(Vec::new())));
    }

    /// Rebuilds the replica set from what each listed name resolved to (`resolved`,
    /// called once per name, in the order of the URLs).
    fn apply(&self, mut resolved: impl FnMut(&str, u16) -> Resolved) {
        let inner = &self.inner;
        let current = inner.replicas.load_full();
        let mut next: Vec<Arc<Replica>> = Vec::with_capacity(current.len());
        let mut pinned = std::collections::HashSet::new();
        let mut unresolved = inner
            .unresolved
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (i, url) in inner.urls.iter().enumerate() {
            let had = || current.iter().filter(|r| r.url == *url).cloned();
            let Some((host, port)) = host_name(url) else {
                next.extend(had());
                continue;
            };
            let why = match resolved(&host, port) {
                Ok(addrs) if addrs.is_empty() => Err("it resolves to no address".to_owned()),
                Ok(addrs) => Ok(addrs),
                Err(e) => Err(e.to_string()),
            };
            let mut addrs = match why {
                Ok(addrs) => {
                    if unresolved[i].take().is_some() {
                        tracing::info!(control_plane = %url, "resolved again");
                    }
                    addrs
                }
                Err(why) => {
                    if unresolved[i].as_ref() != Some(&why) {
                        tracing::warn!(control_plane = %url, error = %why, "cannot be resolved; keeping its replicas");
                        unresolved[i] = Some(why);
                    }
                    next.extend(had().filter(|r| r.addr.is_none_or(|a| pinned.insert(a))));
                    continue;
                }
            };
            addrs.sort_unstable();
            addrs.dedup();
            for addr in addrs {
                if !pinned.insert(addr) {
                    continue;
                }
                if let Some(kept) = had().find(|r| r.addr == Some(addr)) {
                    next.push(kept);
                    continue;
                }
                match Replica::new(url, Some(addr), &inner.credentials, inner.ping) {
                    Ok(r) => next.push(Arc::new(r)),
                    // The URL made a valid endpoint at start; it still does.
                    Err(e) => {
                        tracing::warn!(control_plane = %url, %addr, error = %e, "cannot make a channel");
                    }
                }
            }
        }
        drop(unresolved);
        let same = next.len() == current.len()
            && next
                .iter()
                .zip(current.iter())
                .all(|(a, b)| Arc::ptr_eq(a, b));
        if same || next.is_empty() {
            return;
        }
        let addrs: Vec<String> = next
            .iter()
            .map(|r| match r.addr {
                Some(a) => format!("{} at {a}", r.url),
                None => r.url.clone(),
            })
            .collect();
        tracing::info!(replicas = ?addrs, "control-plane replicas");
        inner.replicas.store(Arc::new(next));
    }

    /// The channel of the first URL, by name (the lease watch uses it; with several
    /// replicas, `--database` turns leases off).
    pub fn channel(&self) -> CpChannel {
        self.inner.first.clone()
    }

    /// Every replica's channel, in order (names' addresses in address order).
    pub fn channels(&self) -> Vec<CpChannel> {
        self.inner
            .replicas
            .load()
            .iter()
            .map(|r| r.channel.clone())
            .collect()
    }

    /// The address each replica is pinned to (`None`: resolved per connection), in
    /// the order of [`Self::channels`].
    pub fn addresses(&self) -> Vec<Option<SocketAddr>> {
        self.inner.replicas.load().iter().map(|r| r.addr).collect()
    }

    /// The replica for the next attempt: the next one in turn that is not passed
    /// over (when all are: the next one in turn); and whether there are several.
    fn pick(&self) -> (Arc<Replica>, bool) {
        let replicas = self.inner.replicas.load();
        let n = replicas.len();
        let start = if n > 1 {
            self.inner.next.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        let now = tokio::time::Instant::now();
        let i = (0..n)
            .map(|i| (start + i) % n)
            .find(|&i| !replicas[i].is_down(now))
            .unwrap_or(start % n);
        (Arc::clone(&replicas[i]), n > 1)
    }
}

impl ControlPlane for GrpcControlPlane {
    fn resume_actor(&self, req: ResumeRequest) -> ResumeFuture<'_> {
        let (replica, several) = self.pick();
        let mut client = replica.client.clone();
        Box::pin(async move {
            let mut request = tonic::Request::new(ateapi::ResumeActorRequest {
                actor_ref: Some(ateapi::ActorRef {
                    atespace: req.actor.atespace().to_owned(),
                    name: req.actor.name().to_owned(),
                }),
                boot: false,
                wait_for_capacity: req.wait_for_capacity.and_then(|d| d.try_into().ok()),
                lease_holder: req.lease_holder.unwrap_or_default(),
            });
            request.set_timeout(req.timeout);
            // grpc-timeout tells the server; the local timer covers a server that
            // never answers.
            let mut unreachable = false;
            let result = match tokio::time::timeout(req.timeout, client.resume_actor(request)).await
            {
                Ok(Ok(response)) => {
                    let r = response.into_inner();
                    let grant = wire_lease(r.lease).map(|lease| Grant {
                        lease,
                        id: r.lease_id,
                    });
                    r.actor
                        .map(|actor| Resumed { actor, grant })
                        .ok_or_else(|| ResumeError::new(Code::Internal, "response without actor"))
                }
                Ok(Err(status)) => {
                    unreachable = is_transport_failure(&status);
                    Err(status.into())
                }
                Err(_) => {
                    unreachable = true;
                    Err(ResumeError::new(
                        Code::DeadlineExceeded,
                        "resume attempt timed out",
                    ))
                }
            };
            // A replica that could not be reached (or never answered), or that
            // answered `Unavailable` itself (its database write failed, it is
            // stopping), is passed over for a while: the others may serve.
            if several {
                let refused = matches!(&result, Err(e) if e.code() == Code::Unavailable);
                replica.mark(unreachable || refused);
            }
            result
        })
    }
}

/// The canonical name of a gRPC code (`RESOURCE_EXHAUSTED`), for metric labels.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_types::{ErrorDetails, StatusExt};

    #[test]
    fn reads_crashed_from_error_info() {
        let status = tonic::Status::with_error_details(
            Code::FailedPrecondition,
            "AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)",
            ErrorDetails::with_error_info(ACTOR_CRASHED, "ateapi", []),
        );
        let e = ResumeError::from(status);
        assert!(e.is_crashed());
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert_eq!(
            e.message(),
            "AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)"
        );

        let other = tonic::Status::with_error_details(
            Code::FailedPrecondition,
            "x",
            ErrorDetails::with_error_info("SOMETHING_ELSE", "ateapi", []),
        );
        assert!(!ResumeError::from(other).is_crashed());
        assert!(!ResumeError::from(tonic::Status::failed_precondition("x")).is_crashed());
    }

    /// A lease from the wire is bounded, so that adding it to the clock cannot
    /// panic (a misbehaving plane's `i64::MAX` seconds); zero and negative are none.
    #[test]
    fn wire_leases_are_bounded() {
        let d = |seconds| Some(prost_types::Duration { seconds, nanos: 0 });
        assert_eq!(wire_lease(d(i64::MAX)), Some(MAX_WIRE_LEASE));
        assert!(
            tokio::time::Instant::now()
                .checked_add(MAX_WIRE_LEASE)
                .is_some()
        );
        assert_eq!(wire_lease(d(5)), Some(Duration::from_secs(5)));
        assert_eq!(wire_lease(d(0)), None);
        assert_eq!(wire_lease(d(-1)), None);
        assert_eq!(wire_lease(None), None);
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// A replica passed over stays passed over when the set is rebuilt around it, and
    /// an address reached through two listed URLs is one replica. (Channels connect
    /// lazily: nothing here touches the network.)
    #[tokio::test(start_paused = true)]
    async fn a_rebuilt_set_keeps_each_replicas_pass_over_and_each_address_once() {
        let cp = GrpcControlPlane::replicas(
            &[
                "http://a.invalid:7070".to_owned(),
                "http://b.invalid:7070".to_owned(),
            ],
            &ClientCredentials::default(),
            None,
        )
        .unwrap();
        let (a1, a2, b1) = (
            addr("10.0.0.1:7070"),
            addr("10.0.0.2:7070"),
            addr("10.0.0.3:7070"),
        );
        cp.resolve_again_with(async |host, _| {
            Ok(if host == "a.invalid" {
                vec![a2, a1]
            } else {
                vec![b1, a1]
            })
        })
        .await;
        assert_eq!(cp.addresses(), [Some(a1), Some(a2), Some(b1)]);
        let held = cp.inner.replicas.load()[1].clone();
        held.mark(true);

        let a3 = addr("10.0.0.0:7070");
        cp.resolve_again_with(async |host, _| {
            Ok(if host == "a.invalid" {
                vec![a1, a2, a3]
            } else {
                vec![b1]
            })
        })
        .await;
        assert_eq!(cp.addresses(), [Some(a3), Some(a1), Some(a2), Some(b1)]);
        assert!(Arc::ptr_eq(&cp.inner.replicas.load()[2], &held), "kept");
        let picked: Vec<_> = (0..8).map(|_| cp.pick().0.addr).collect();
        assert!(!picked.contains(&Some(a2)), "{picked:?}");
        assert!(
            picked.contains(&Some(a3)) && picked.contains(&Some(b1)),
            "{picked:?}"
        );

        tokio::time::advance(FAILOVER_HOLD).await;
        let picked: Vec<_> = (0..8).map(|_| cp.pick().0.addr).collect();
        assert!(
            picked.contains(&Some(a2)),
            "back after the hold: {picked:?}"
        );
    }

    #[test]
    fn only_host_names_are_resolved_into_replicas() {
        assert_eq!(
            host_name("http://cp.valet.svc:7070"),
            Some(("cp.valet.svc".to_owned(), 7070))
        );
        assert_eq!(
            host_name("https://localhost:1"),
            Some(("localhost".to_owned(), 1))
        );
        assert_eq!(host_name("http://127.0.0.1:7070"), None);
        assert_eq!(host_name("http://[::1]:7070"), None);
    }

    #[test]
    fn transport_failures_are_unavailable_whatever_their_code() {
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
        let status = tonic::Status::from_error(Box::new(reset));
        assert_eq!(status.code(), Code::Unknown, "what tonic itself reports");
        assert_eq!(ResumeError::from(status).code(), Code::Unavailable);

        let cut = tonic::Status::unknown(
            "protocol error: missing grpc-status trailer, stream was terminated without a final status",
        );
        assert_eq!(ResumeError::from(cut).code(), Code::Unavailable);

        // Statuses the server sent keep their code.
        for code in [
            Code::Unknown,
            Code::Internal,
            Code::Cancelled,
            Code::NotFound,
        ] {
            let sent = tonic::Status::new(code, "from the server");
            assert_eq!(ResumeError::from(sent).code(), code);
        }
    }
}
