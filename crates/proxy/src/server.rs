//! The listener, connections, limits and the per-request path.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, header};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use valet_net::{Backoff, Budget, Connections, Keepalive, Listener};
use valet_router::status::RouteRecord;
use valet_router::{Decision, Denial, Router, Verdict};

use crate::answer::{Body, certificate_refused, connect_refused, options_asterisk, render};
use crate::body::{Held, RequestBody};
use crate::forward::{Outgoing, Sent, Tunnels};
use crate::lean::{self, Replayed};
use crate::limits::Limits;
use crate::tls::IngressTls;

struct Shared {
    router: Router,
    client: Client<HttpConnector, RequestBody>,
    limits: Limits,
    tunnels: Tunnels,
    /// hyper's servers, configured once for every connection.
    http1: hyper::server::conn::http1::Builder,
    http2: hyper::server::conn::http2::Builder<TokioExecutor>,
}

impl Shared {
    fn new(router: Router, limits: Limits, tunnels: Tunnels) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_keepalive(Some(KEEPALIVE_IDLE));
        connector.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
        connector.set_keepalive_retries(Some(KEEPALIVE_RETRIES));
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(valet_proto::WORKER_POOL_IDLE)
            .build(connector);
        let (http1, http2) = builders(limits, router.lot().capacity());
        Self {
            router,
            client,
            limits,
            tunnels,
            http1,
            http2,
        }
    }
}

/// The running HTTP data plane. Its accept loop, every connection and every upgraded
/// tunnel are owned here: [`Self::drained`] waits for them, [`Self::close`] ends them.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    stop: CancellationToken,
    connections: Connections,
    tunnels: Tunnels,
}

impl HttpServer {
    /// Starts serving plaintext HTTP/1.1 and h2c on `listener`.
    pub fn spawn(listener: TcpListener, router: Router, limits: Limits) -> std::io::Result<Self> {
        Self::spawn_with(listener, router, limits, None)
    }

    /// Starts serving HTTPS on `listener` (ALPN `h2` and `http/1.1`); a client
    /// certificate the allowlist refuses gets 403 for every request, before any
    /// control-plane call.
    pub fn spawn_https(
        listener: TcpListener,
        router: Router,
        limits: Limits,
        tls: IngressTls,
    ) -> std::io::Result<Self> {
        Self::spawn_with(listener, router, limits, Some(tls))
    }

    fn spawn_with(
        listener: TcpListener,
        router: Router,
        limits: Limits,
        tls: Option<IngressTls>,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let connections = Connections::new();
        let tunnels = Tunnels::new(connections.force().child_token());
        // A place per connection: at the cap, connections wait in the listen backlog.
        let listener = Listener::new(listener, "router")
            .budget(Budget::new(limits.max_connections))
            .keepalive(KEEPALIVE);
        let shared = Arc::new(Shared::new(router, limits, tunnels.clone()));
        let stop = CancellationToken::new();
        connections.spawn(accept_loop(
            listener,
            tls,
            shared,
            stop.clone(),
            connections.clone(),
        ));
        Ok(Self {
            addr,
            stop,
            connections,
            tunnels,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections; connections finish the requests they have (HTTP/1
    /// closes after the request in progress, HTTP/2 sends GOAWAY).
    pub fn stop_accepting(&self) {
        self.stop.cancel();
    }

    /// Waits until every connection and every upgraded tunnel has closed (after
    /// [`Self::stop_accepting`]).
    pub async fn drained(&self) {
        self.connections.wait().await;
        self.tunnels.wait().await;
    }

    /// Closes every upgraded tunnel (WebSocket and the like): at the drain's cut-off.
    pub fn close_tunnels(&self) {
        self.tunnels.close_now();
    }

    /// Closes every connection and tunnel still open: the last step of a drain, after
    /// every waiting request has had its verdict.
    pub async fn close(&self) {
        self.connections.force_now();
        self.drained().await;
    }

    /// Connections open now (the accept loop counts as one until it stops).
    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }

    /// Upgraded tunnels open now.
    pub fn open_tunnels(&self) -> usize {
        self.tunnels.len()
    }
}

/// TCP keepalive on the data plane's connections, to clients and to workers: a peer
/// gone without a word (its host lost, a NAT entry dropped) is noticed after about
/// `IDLE + INTERVAL × RETRIES` (90 s) of silence, and the exchange or tunnel to it
/// ends instead of holding its actor busy for good (HTTP/2 has its pings besides).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;

/// The keepalive of accepted connections (data sent and left unacknowledged for its
/// whole reach, 90 s, ends one too).
const KEEPALIVE: Keepalive = Keepalive {
    idle: KEEPALIVE_IDLE,
    interval: KEEPALIVE_INTERVAL,
    retries: KEEPALIVE_RETRIES,
};

/// hyper parses up to this many header fields without a heap allocation.
const HYPER_INLINE_HEADERS: usize = 100;

/// How long an HTTP/2 keep-alive ping may go unanswered before its connection is
/// closed.
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// The HTTP/2 connection preface (RFC 9113, section 3.4): how an h2c client begins.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The protocol a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// Tells HTTP/1 from h2c by peeking at the first bytes, without consuming them: hyper
/// then reads the request from the socket into its own buffer in one go. (hyper-util's
/// automatic builder reads the first bytes itself and hands them on, which makes
/// hyper's first read a partial one and doubles its read buffer to 16 KiB for every
/// connection: see docs/BENCHMARKS.md, "Memory per parked request".) `None`: the
/// client closed before sending a byte.
async fn sniff(stream: &TcpStream) -> std::io::Result<Option<Protocol>> {
    let mut buf = [0u8; H2_PREFACE.len()];
    let mut pause = Backoff::new(Duration::from_millis(2)).cap(Duration::from_millis(200));
    loop {
        let n = stream.peek(&mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Ok(Some(Protocol::Http1));
        }
        if n == H2_PREFACE.len() {
            return Ok(Some(Protocol::Http2));
        }
        // A prefix of the preface so far: the peek would see the same bytes again at
        // once, so give the rest a moment to arrive, backing off (2 ms doubling to
        // 200 ms) so a client that stalls mid-preface costs little; the caller bounds
        // the whole wait.
        tokio::time::sleep(pause.next_delay()).await;
    }
}

/// Streams an HTTP/2 connection may have open beyond `--parked-request-max` (hyper's
/// default limit).
const H2_STREAMS_BESIDE_THE_LOT: usize = 200;

/// hyper's HTTP/1 and HTTP/2 servers under `limits`, for a lot of `parked_max`.
fn builders(
    limits: Limits,
    parked_max: usize,
) -> (
    hyper::server::conn::http1::Builder,
    hyper::server::conn::http2::Builder<TokioExecutor>,
) {
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .max_buf_size(4 * limits.max_header_bytes.max(8192))
        // Room for the count check in `handle` (which answers 431 with the limit), but
        // never past hyper's inline 100: above it hyper allocates its header index
        // arrays on the heap for every request it parses. Past it hyper answers 431
        // itself.
        .max_headers((2 * limits.max_headers.max(10)).min(HYPER_INLINE_HEADERS))
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.idle_timeout);
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .max_header_list_size(u32::try_from(4 * limits.max_header_bytes).unwrap_or(u32::MAX))
        // A peer gone without a word (its host lost, a NAT entry dropped) with
        // requests open, parked ones among them, is noticed by its unanswered ping.
        .keep_alive_interval(limits.idle_timeout)
        .keep_alive_timeout(H2_PING_TIMEOUT)
        // Room on one connection for the whole lot parked, and as many requests again
        // as hyper's default allows in flight: a connection that multiplexes many
        // clients (a browser, a proxy in front) parks or sheds them as the lot says,
        // rather than holding them unseen in the client past a stream limit.
        .max_concurrent_streams(
            u32::try_from(parked_max.saturating_add(H2_STREAMS_BESIDE_THE_LOT)).unwrap_or(u32::MAX),
        )
        .timer(hyper_util::rt::TokioTimer::new());
    (http1, http2)
}

async fn accept_loop(
    listener: Listener,
    tls: Option<IngressTls>,
    shared: Arc<Shared>,
    stop: CancellationToken,
    connections: Connections,
) {
    while let Some(accepted) = listener.accept(&stop).await {
        let (stream, peer, place) = accepted.into_parts();
        let shared = Arc::clone(&shared);
        let (stop, force) = (stop.clone(), connections.force());
        let tls = tls.clone();
        connections.spawn(async move {
            let _place = place;
            let conn = Conn {
                shared,
                peer,
                stop,
                force,
            };
            // The TLS path is boxed: its handshake and session state (several KiB)
            // would otherwise size every plaintext connection's task too.
            match tls {
                None => conn.plain(stream).await,
                Some(tls) => Box::pin(conn.https(stream, tls)).await,
            }
        });
    }
}

/// One accepted connection and what serving it needs.
struct Conn {
    shared: Arc<Shared>,
    peer: SocketAddr,
    stop: CancellationToken,
    force: CancellationToken,
}

impl Conn {
    async fn plain(self, mut stream: TcpStream) {
        let peer = self.peer;
        let mut first = true;
        loop {
            // A connection that has sent nothing (since its last answer) has no request
            // to lose: a drain closes it.
            let protocol = tokio::select! {
                biased;
                sniffed = tokio::time::timeout(self.shared.limits.idle_timeout, sniff(&stream)) => match sniffed {
                    Ok(Ok(Some(p))) => p,
                    Ok(Ok(None)) => return,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "connection failed before a request");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "no request within the header read timeout");
                        return;
                    }
                },
                () = self.stop.cancelled() => return,
            };
            if protocol == Protocol::Http2 && first {
                let io = TokioIo::new(Replayed::new(stream, bytes::Bytes::new()));
                return Box::pin(self.serve(io, protocol, None, None)).await;
            }
            first = false;
            // Boxed: sized to what a request decided here waits with, apart from the
            // task's own future.
            match Box::pin(self.lean(stream)).await {
                Lean::Answered(s) => stream = s,
                Lean::Closed => return,
                // Boxed: a connection waiting in `lean` is not sized for hyper's.
                Lean::Hyper(io, pre) => {
                    let serve = self.serve(TokioIo::new(io), Protocol::Http1, None, pre);
                    return Box::pin(serve).await;
                }
            }
        }
    }

    /// Decides the request at the head of `stream` when it has no body (see
    /// [`crate::lean`]); anything else goes to hyper untouched.
    async fn lean(&self, mut stream: TcpStream) -> Lean {
        use std::task::Poll;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let head = {
            let mut buf = vec![0u8; lean::PEEK];
            match stream.peek(&mut buf).await {
                Ok(n) => lean::parse(&buf[..n], self.shared.limits),
                Err(_) => return Lean::Closed,
            }
        };
        let Some(head) = head else {
            return Lean::Hyper(Replayed::new(stream, bytes::Bytes::new()), None);
        };
        let router = &self.shared.router;
        let started = Instant::now();
        let deadline = started + router.config().decision_timeout();
        // Polled only from the park transition: whether the request parked.
        let parked = std::sync::atomic::AtomicBool::new(false);
        let decide = router.decide_holding(&head.host, deadline, async {
            parked.store(true, std::sync::atomic::Ordering::Relaxed);
            std::future::pending().await
        });
        tokio::pin!(decide);
        // The head once it is off the socket, and what the client sent after it.
        let mut taken = Vec::new();
        let mut extra = Vec::new();
        let decision = match std::future::poll_fn(|cx| Poll::Ready(decide.as_mut().poll(cx))).await
        {
            // Decided at once (a route under a lease, a denial): the head stays on the
            // socket.
            Poll::Ready(decision) => decision,
            // It waits (a resume in progress, or parked): the head comes off the
            // socket, so the wait holds only it, and a client that leaves is seen. As
            // with hyper, a client gone or the drain's last step drops the wait
            // (`canceled`).
            Poll::Pending => {
                taken = vec![0u8; head.len];
                if stream.read_exact(&mut taken).await.is_err() {
                    return Lean::Closed;
                }
                tokio::select! {
                    decision = &mut decide => decision,
                    () = lean::gone(&stream, &mut extra) => return Lean::Closed,
                    () = self.force.cancelled() => return Lean::Closed,
                }
            }
        };
        let verdict = match decision {
            Decision::Route(_) => {
                let pre = PreDecided {
                    host: head.host.clone(),
                    started,
                    decision,
                    parked: parked.load(std::sync::atomic::Ordering::Relaxed),
                };
                taken.extend_from_slice(&extra);
                let io = Replayed::new(stream, bytes::Bytes::from(taken));
                return Lean::Hyper(io, Some(Box::new(pre)));
            }
            Decision::Deny(_, verdict) => verdict,
        };
        if taken.is_empty() {
            let mut buf = vec![0u8; head.len];
            if stream.read_exact(&mut buf).await.is_err() {
                return Lean::Closed;
            }
        }
        // As hyper after a graceful shutdown: the answer closes the connection.
        let close = head.close || self.stop.is_cancelled();
        router.record(RouteRecord::new(
            "http",
            &head.host,
            &head.path,
            verdict.status().as_u16(),
            verdict.reason(),
            None,
            started.elapsed(),
        ));
        let out = lean::response(&verdict, head.head_only, close);
        let written = tokio::select! {
            w = stream.write_all(&out) => w.is_ok(),
            () = self.force.cancelled() => false,
        };
        if !written || close {
            let _ = stream.shutdown().await;
            // Bytes of the client's left unread would make the close a reset, which
            // can discard the answer before the client reads it.
            lean::discard_readable(&stream);
            return Lean::Closed;
        }
        if !extra.is_empty() {
            // The client's next request arrived (in part) while this one waited:
            // hyper reads it from here.
            return Lean::Hyper(Replayed::new(stream, bytes::Bytes::from(extra)), None);
        }
        Lean::Answered(stream)
    }

    async fn https(self, stream: TcpStream, tls: IngressTls) {
        let peer = self.peer;
        let accepted = tokio::select! {
            a = tokio::time::timeout(self.shared.limits.idle_timeout, tokio_rustls::TlsAcceptor::from(tls.config.load()).accept(stream)) => a,
            () = self.stop.cancelled() => return,
        };
        let stream = match accepted {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "no TLS handshake within the header read timeout");
                return;
            }
        };
        let (_, session) = stream.get_ref();
        let protocol = if session.alpn_protocol() == Some(b"h2".as_slice()) {
            Protocol::Http2
        } else {
            Protocol::Http1
        };
        let refused = tls.allowlist.as_ref().and_then(|allowlist| {
            let leaf = session.peer_certificates().and_then(|c| c.first());
            match leaf {
                Some(der) => allowlist.check(der).err(),
                None => Some("no client certificate".to_owned()),
            }
        });
        if let Some(why) = &refused {
            tracing::info!(%peer, %why, "client certificate refused");
        }
        self.serve(TokioIo::new(stream), protocol, refused.map(Arc::from), None)
            .await;
    }

    /// Serves `io` in `protocol`; with `refused`, every request gets 403 and nothing
    /// reaches the pipeline; with `pre`, the first request was decided already.
    async fn serve<I>(
        self,
        io: TokioIo<I>,
        protocol: Protocol,
        refused: Option<Arc<str>>,
        pre: Option<Box<PreDecided>>,
    ) where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Self {
            shared,
            peer,
            stop,
            force,
        } = self;
        let shared_conn = Arc::clone(&shared);
        let pre = std::sync::Mutex::new(pre);
        // hyper's HTTP/1 server closes an idle connection itself (its header read
        // timeout also runs between requests); its HTTP/2 server never does.
        let streams = (protocol == Protocol::Http2).then(OpenStreams::default);
        let counted = streams.clone();
        let service = hyper::service::service_fn(move |req| {
            let refused = refused.clone();
            let pre = pre.lock().unwrap_or_else(|e| e.into_inner()).take();
            let open = counted.as_ref().map(OpenStreams::open);
            // Before hyper reads on: see `own_head`.
            let req = own_head(req);
            let shared = Arc::clone(&shared);
            async move {
                let response = match refused {
                    Some(why) => {
                        let resp = certificate_refused(&why);
                        let (parts, body) = req.into_parts();
                        shared
                            .router
                            .metrics()
                            .answered_undecided(403, "client_certificate_refused");
                        let mut held =
                            Held::new(body, None, 0, shared.router.lot().bytes().charge());
                        unforwarded(&parts, &mut held, resp, false).await
                    }
                    None => handle(&shared, req, peer, pre).await,
                };
                Ok::<_, Infallible>(match open {
                    // Open until hyper has sent the body, or the stream is reset.
                    Some(open) => response.map(|body| Body::new(Tracked { body, _open: open })),
                    None => response,
                })
            }
        });
        // Boxed, each sized to its protocol: the task's own future stays small
        // instead of the larger of the two.
        let ends = Ends {
            peer,
            stop: &stop,
            force: &force,
            router: &shared_conn.router,
        };
        match streams {
            None => {
                let conn = shared_conn
                    .http1
                    .serve_connection(io, service)
                    .with_upgrades();
                let idle = std::future::pending;
                Box::pin(drive(conn, |c| c.graceful_shutdown(), idle, ends)).await;
            }
            Some(streams) => {
                let conn = shared_conn.http2.serve_connection(io, service);
                let idle = || streams.idle_for(shared_conn.limits.idle_timeout);
                Box::pin(drive(conn, |c| c.graceful_shutdown(), idle, ends)).await;
            }
        }
    }
}

/// How a request [`Conn::lean`] took up ended.
enum Lean {
    /// Its verdict is written; the connection waits for its next request.
    Answered(TcpStream),
    /// The connection is done (the client left, asked to close, or the drain ended).
    Closed,
    /// hyper serves the connection from here, its first request decided or not.
    Hyper(Replayed, Option<Box<PreDecided>>),
}

/// The decision for the request hyper is about to read, made before it read it.
struct PreDecided {
    host: String,
    started: Instant,
    decision: Decision,
    /// The request parked before it was routed.
    parked: bool,
}

/// What ends a connection besides its client: the data plane's drain (`stop`, then at
/// its last step `force`).
struct Ends<'a> {
    peer: SocketAddr,
    stop: &'a CancellationToken,
    force: &'a CancellationToken,
    /// Counts the requests hyper refused itself.
    router: &'a Router,
}

/// Runs one connection to its end; when the data plane stops accepting or the
/// connection has been `idle`, shuts it down gracefully (HTTP/1 closes after the
/// request in progress, HTTP/2 sends GOAWAY and finishes its open streams), and closes
/// it at the drain's last step, or when it stays idle as long again (a client that
/// never sent its HTTP/2 preface, which hyper would wait for forever).
async fn drive<C, F>(
    conn: C,
    graceful: impl FnOnce(std::pin::Pin<&mut C>),
    idle: impl Fn() -> F,
    ends: Ends<'_>,
) where
    C: std::future::Future<Output = Result<(), hyper::Error>>,
    F: std::future::Future<Output = ()>,
{
    let Ends {
        peer,
        stop,
        force,
        router,
    } = ends;
    tokio::pin!(conn);
    // The connection first: a request decided before hyper read it (see `lean`) is
    // read and taken on hyper's first poll; shut down gracefully before that, hyper
    // would close a connection that has read nothing, dropping the request.
    let why = tokio::select! {
        biased;
        r = conn.as_mut() => {
            if let Err(e) = r {
                count_refused_by_hyper(router, &e);
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            return;
        }
        () = stop.cancelled() => "the data plane is draining",
        () = idle() => "idle",
    };
    tracing::debug!(%peer, why, "closing the connection gracefully");
    graceful(conn.as_mut());
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                count_refused_by_hyper(router, &e);
            }
        }
        () = force.cancelled() => {}
        () = idle() => tracing::debug!(%peer, "closing a connection still idle"),
    }
}

/// Counts a request hyper refused itself, before `handle` saw it, as the checks in
/// `handle` count theirs: a head past hyper's own bounds (more header fields than it
/// indexes, or past its buffer) answered 431, a target past its URI limit answered
/// 414. (Its other refusals, 400 for a malformed head and 408 for one not finished in
/// time, answer something that is not a request: not counted.)
fn count_refused_by_hyper(router: &Router, e: &hyper::Error) {
    if !e.is_parse_too_large() {
        return;
    }
    // hyper tells the two apart by its message only.
    if e.to_string().contains("URI too long") {
        router.metrics().answered_undecided(414, "uri_too_long");
    } else {
        router
            .metrics()
            .answered_undecided(431, "headers_too_large");
    }
}

/// The requests open on one HTTP/2 connection: what tells an idle connection.
#[derive(Clone, Default)]
struct OpenStreams(Arc<tokio::sync::watch::Sender<usize>>);

impl OpenStreams {
    /// Counts a request open until the returned guard is dropped.
    fn open(&self) -> OpenStream {
        self.0.send_modify(|n| *n += 1);
        OpenStream(self.clone())
    }

    /// Ends once no request has been open for `idle` in a row.
    async fn idle_for(&self, idle: Duration) {
        let mut open = self.0.subscribe();
        loop {
            // The sender lives in `self`: neither wait can see it closed.
            let _ = open.wait_for(|n| *n == 0).await;
            if tokio::time::timeout(idle, open.changed()).await.is_err() {
                return;
            }
        }
    }
}

/// One open request of [`OpenStreams`].
struct OpenStream(OpenStreams);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.0.send_modify(|n| *n -= 1);
    }
}

/// A response body that keeps its request counted open until it is dropped.
struct Tracked {
    body: Body,
    _open: OpenStream,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Copies the request's URI and header values into one allocation of their own size.
///
/// hyper parses them as slices of the connection's read buffer (8 KiB), so a request
/// that parks would keep that buffer alive, and hyper, which goes on reading to notice
/// the client leaving, would allocate a second one. Called before hyper reads on, this
/// leaves the read buffer unshared, so hyper reuses it: half the memory of a parked
/// request (docs/BENCHMARKS.md, "Memory per parked request").
fn own_head<B>(req: Request<B>) -> Request<B> {
    use std::fmt::Write as _;
    let (mut parts, body) = req.into_parts();
    let values: usize = parts.headers.values().map(http::HeaderValue::len).sum();
    let mut buf = bytes::BytesMut::with_capacity(values + 64);
    let _ = write!(buf, "{}", parts.uri);
    let uri_len = buf.len();
    for v in parts.headers.values() {
        buf.extend_from_slice(v.as_bytes());
    }
    let all = buf.freeze();
    // Printing and parsing back is exact for every HTTP/1 form; an h2 request's URI is
    // assembled from pseudo-headers and may not survive it (`OPTIONS *` would print
    // as `http://host*`): then the original stays.
    if let Ok(uri) = http::Uri::from_maybe_shared(all.slice(..uri_len))
        && uri == parts.uri
    {
        parts.uri = uri;
    }
    let mut at = uri_len;
    for v in parts.headers.values_mut() {
        let end = at + v.len();
        if let Ok(mut owned) = http::HeaderValue::from_maybe_shared(all.slice(at..end)) {
            owned.set_sensitive(v.is_sensitive());
            *v = owned;
        }
        at = end;
    }
    Request::from_parts(parts, body)
}

/// How long, and how many bytes of, the rest of a request body answered with a verdict
/// is read and thrown away before the answer is written (see [`Held::discard_rest`]).
const DISCARD_WITHIN: Duration = Duration::from_secs(2);
const DISCARD_MAX: u64 = 64 * 1024 * 1024;

/// An answer the data plane gives itself to a request it does not forward (a verdict,
/// `OPTIONS *`). HTTP/1: the rest of the body, still coming, is read and thrown away
/// first (up to DISCARD_MAX within DISCARD_WITHIN), so that the answer is not lost to a
/// reset: a socket closed with unread data resets, and a client still sending never
/// reads the answer. A body the client holds back until `100 Continue` is never asked
/// for. The connection closes after the answer when the body was not read to its end,
/// or when `close`.
async fn unforwarded(
    parts: &http::request::Parts,
    held: &mut Held,
    mut resp: Response<Body>,
    close: bool,
) -> Response<Body> {
    if parts.version > http::Version::HTTP_11 {
        return resp;
    }
    let held_back = !held.was_read() && expects_continue(&parts.headers);
    let whole = !held_back && held.discard_rest(DISCARD_WITHIN, DISCARD_MAX).await;
    if !whole || close {
        resp.headers_mut()
            .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    }
    resp
}

/// Whether the client holds its body back until `100 Continue`.
fn expects_continue(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

async fn handle(
    shared: &Shared,
    req: Request<Incoming>,
    peer: SocketAddr,
    pre: Option<Box<PreDecided>>,
) -> Response<Body> {
    let mut started = Instant::now();
    let limits = shared.limits;
    let router = &shared.router;
    let (parts, body) = req.into_parts();
    let headers = &parts.headers;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut held = Held::new(
        body,
        declared,
        router.config().parked_body_limit(),
        router.lot().bytes().charge(),
    );
    // HTTP/1 gives `*` as the whole target; HTTP/2 as the path, beside an authority.
    if parts.method == http::Method::OPTIONS && (parts.uri == "*" || parts.uri.path() == "*") {
        router.metrics().answered_undecided(204, "options");
        return unforwarded(&parts, &mut held, options_asterisk(), false).await;
    }
    // The router tunnels to no one: answered before any actor is resumed.
    if parts.method == http::Method::CONNECT {
        router
            .metrics()
            .answered_undecided(405, "method_not_allowed");
        return unforwarded(&parts, &mut held, connect_refused(), true).await;
    }
    if headers.len() > limits.max_headers {
        let v = Verdict::of(&Denial::TooManyHeaders {
            count: headers.len(),
            limit: limits.max_headers,
        });
        router
            .metrics()
            .answered_undecided(v.status().as_u16(), v.reason());
        return unforwarded(&parts, &mut held, render(&v), false).await;
    }
    let header_bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if header_bytes > limits.max_header_bytes {
        let v = Verdict::of(&Denial::HeadersTooLarge {
            bytes: header_bytes,
            limit: limits.max_header_bytes,
        });
        router
            .metrics()
            .answered_undecided(v.status().as_u16(), v.reason());
        return unforwarded(&parts, &mut held, render(&v), false).await;
    }
    // Two Host fields name no one actor (RFC 9112 §3.2): the empty host, whose
    // verdict is `invalid host`.
    let host = parts
        .uri
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            let mut hosts = headers.get_all(header::HOST).iter();
            let first = hosts.next();
            if hosts.next().is_some() {
                return None;
            }
            first.and_then(|v| v.to_str().ok()).map(str::to_owned)
        })
        .unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();

    // hyper read the very head that was decided (the lean path parses the host as
    // this function does): a different host would be a bug, and is decided afresh.
    let pre = pre.filter(|p| {
        let same = p.host == host;
        if !same {
            tracing::warn!(
                decided = %p.host,
                read = %host,
                "a decision made before hyper read the request is for another host; \
                 deciding again"
            );
        }
        debug_assert!(same, "lean decision for {} applied to {host}", p.host);
        same
    });
    if let Some(p) = &pre {
        started = p.started;
    }
    let deadline = started + router.config().decision_timeout();
    let (decision, parked_before) = match pre {
        Some(p) => (p.decision, p.parked),
        None => (
            router.decide_holding(&host, deadline, held.fill()).await,
            false,
        ),
    };
    let (resp, target, verdict) = match &decision {
        // Boxed: the forwarding state is large and a parked request never needs it,
        // so it is not part of the future that waits (docs/BENCHMARKS.md).
        Decision::Route(route) => {
            Box::pin(async {
                // Its body was read while it waited only if it parked; the decision
                // says so too when the request never saw its flight park.
                let parked = route.parked || parked_before || held.was_read();
                let (body, failure) = held.into_body(shared.limits.idle_timeout);
                let ends = Arc::clone(&failure);
                let version = parts.version;
                let held_back = expects_continue(&parts.headers);
                let req = Request::from_parts(parts, body);
                let (mut resp, target, verdict) = match Outgoing::new(
                    req,
                    failure,
                    route,
                    &host,
                    peer,
                    (shared.limits.idle_timeout, shared.limits.small_body_within),
                    &shared.tunnels,
                )
                .await
                {
                    Ok(mut out) => send(shared, &mut out, route, &host, deadline, parked).await,
                    Err((resp, verdict)) => {
                        shared
                            .router
                            .metrics()
                            .answered_after_route(resp.status().as_u16(), verdict);
                        (resp, Some(route.addr), verdict)
                    }
                };
                // HTTP/1: what the request to the worker left of the body unread (it
                // failed, or the worker answered without reading it all) is read and
                // thrown away before the answer, as for a verdict (`unforwarded`).
                if version <= http::Version::HTTP_11
                    && !ends
                        .discard_left(DISCARD_WITHIN, DISCARD_MAX, held_back)
                        .await
                {
                    resp.headers_mut()
                        .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
                }
                (resp, target, verdict)
            })
            .await
        }
        Decision::Deny(_, v) => {
            // At the drain's cut-off (a parked request's verdict, within the drain's
            // grace) the connection then closes.
            let cut_off = matches!(decision, Decision::Deny(Denial::ShuttingDown(_), _));
            let resp = unforwarded(&parts, &mut held, render(v), cut_off).await;
            (resp, None, v.reason())
        }
    };
    router.record(RouteRecord::new(
        "http",
        &host,
        &path,
        resp.status().as_u16(),
        verdict,
        target,
        started.elapsed(),
    ));
    resp
}

/// Sends a routed request; when the worker answers 421 (the actor moved, say it was
/// checkpointed as the request arrived), or a leased route's worker refuses the
/// connection, sends it through the pipeline once more if it can be replayed, and
/// answers `actor moved` (or the unreachable worker's 502) otherwise.
async fn send(
    shared: &Shared,
    out: &mut Outgoing,
    route: &valet_router::Route,
    host: &str,
    deadline: Instant,
    parked: bool,
) -> (Response<Body>, Option<SocketAddr>, &'static str) {
    let moved = Verdict::of(&Denial::ActorMoved(route.actor.clone()));
    // What the client gets when the request cannot be sent through again.
    let otherwise = match out.send(&shared.client, &shared.tunnels, route).await {
        Sent::Answer(resp) => return (resp, Some(route.addr), "routed"),
        Sent::Denied(v) => return denied_after_route(shared, &v, route.addr),
        Sent::Moved => moved.clone(),
        Sent::Refused(v) => v,
    };
    shared.router.forget_route(&route.actor, route.addr);
    if !out.replayable() {
        return denied_after_route(shared, &otherwise, route.addr);
    }
    shared.router.metrics().replayed();
    // Should the replay park, the body it holds is charged to the lot's bytes
    // (--parked-bytes-max) like any parked request's, until it is decided.
    let held = out.held_bytes();
    let mut charge = shared.router.lot().bytes().charge();
    let holding = async {
        charge.charge(held).await;
        std::future::pending::<valet_router::CallerEnd>().await
    };
    // A request that parked before is never shed now (it may park again past the
    // lot's size); one that did not is decided as any request is. A decision of its
    // own, with a deadline of its own: its first decision's may have passed while the
    // body came in or the worker answered.
    let deadline = deadline.max(Instant::now() + shared.router.config().decision_timeout());
    let decided = shared
        .router
        .decide_replay(host, deadline, holding, parked)
        .await;
    drop(charge);
    match decided {
        Decision::Route(again) => match out.send(&shared.client, &shared.tunnels, &again).await {
            Sent::Answer(resp) => (resp, Some(again.addr), "routed"),
            Sent::Denied(v) => denied_after_route(shared, &v, again.addr),
            Sent::Refused(v) => {
                shared.router.forget_route(&again.actor, again.addr);
                denied_after_route(shared, &v, again.addr)
            }
            Sent::Moved => {
                shared.router.forget_route(&again.actor, again.addr);
                denied_after_route(shared, &moved, again.addr)
            }
        },
        Decision::Deny(_, v) => {
            // Counted routed when it was first decided.
            shared
                .router
                .metrics()
                .answered_after_route(v.status().as_u16(), v.reason());
            (render(&v), None, v.reason())
        }
    }
}

/// A routed request the data plane answered itself: counted by its own status and
/// verdict (the decision counted it routed), and shown so on the status page.
fn denied_after_route(
    shared: &Shared,
    v: &Verdict,
    worker: SocketAddr,
) -> (Response<Body>, Option<SocketAddr>, &'static str) {
    shared
        .router
        .metrics()
        .answered_after_route(v.status().as_u16(), v.reason());
    (render(v), Some(worker), v.reason())
}

#[cfg(test)]
mod tests {
    use super::{Conn, H2_PREFACE, Lean, Protocol, Shared, Tunnels, own_head, sniff};
    use std::time::Duration;
    use tokio::io::AsyncWriteExt as _;
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;
    use valet_net::Listener;

    /// A connected pair: (client, server).
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        (client, server)
    }

    /// An accepted connection probes a silent peer: keepalive on, after 60 s of
    /// silence, every 10 s, 3 times (before, a vanished client held its tunnel, and its
    /// actor busy, for good).
    #[tokio::test]
    async fn an_accepted_connection_probes_a_silent_peer() {
        let l = Listener::new(TcpListener::bind("127.0.0.1:0").await.unwrap(), "test")
            .keepalive(super::KEEPALIVE);
        let _client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let stop = CancellationToken::new();
        let (server, _, _place) = l.accept(&stop).await.unwrap().into_parts();
        let sock = socket2::SockRef::from(&server);
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), super::KEEPALIVE_IDLE);
        assert_eq!(
            sock.tcp_keepalive_interval().unwrap(),
            super::KEEPALIVE_INTERVAL
        );
        assert_eq!(
            sock.tcp_keepalive_retries().unwrap(),
            super::KEEPALIVE_RETRIES
        );
        assert_eq!(
            sock.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(90)),
            "IDLE + INTERVAL × RETRIES"
        );
        assert!(server.nodelay().unwrap());
    }

    /// A connection's task for `router`, as the accept loop makes it.
    fn conn(router: valet_router::Router) -> Conn {
        let tunnels = Tunnels::new(tokio_util::sync::CancellationToken::new());
        Conn {
            shared: std::sync::Arc::new(Shared::new(router, crate::Limits::default(), tunnels)),
            peer: "127.0.0.1:1".parse().unwrap(),
            stop: tokio_util::sync::CancellationToken::new(),
            force: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// What `Conn::lean` makes of one request: answered itself, handed to hyper
    /// decided, or handed to hyper untouched.
    #[tokio::test]
    async fn the_lean_path_answers_routes_or_leaves_to_hyper() {
        use tokio::io::AsyncReadExt as _;
        let (cp, mut calls) = valet_router::testing::Scripted::new();
        let config = valet_router::RouterArgs::try_parse_flags(&[] as &[&str])
            .unwrap()
            .resolve()
            .unwrap();
        let router = valet_router::Router::new(
            std::sync::Arc::new(config),
            cp,
            std::sync::Arc::new(valet_router::Metrics::new()),
        );
        let host = "p1.demo.actors.resources.substrate.ate.dev";

        // Denied after a wait: the lean path writes the verdict itself.
        let (mut client, server) = pair().await;
        client
            .write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let lean = tokio::spawn({
            let conn = conn(router.clone());
            async move { matches!(conn.lean(server).await, Lean::Answered(_)) }
        });
        calls
            .next()
            .await
            .fail(tonic::Code::NotFound, "no such actor");
        assert!(lean.await.unwrap(), "answered by the lean path");
        let mut answer = [0u8; 12];
        client.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"HTTP/1.1 404");

        // Routed after a wait: hyper gets the connection and the decision, and the
        // head put back.
        let (mut client, server) = pair().await;
        client
            .write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let lean = tokio::spawn({
            let conn = conn(router.clone());
            async move {
                match conn.lean(server).await {
                    Lean::Hyper(mut io, Some(pre)) => {
                        let mut head = vec![0u8; 16];
                        io.read_exact(&mut head).await.unwrap();
                        Some((pre.host, head))
                    }
                    _ => None,
                }
            }
        });
        calls.next().await.running(9);
        let (decided_for, head) = lean.await.unwrap().expect("handed to hyper, decided");
        assert_eq!(decided_for, host);
        assert_eq!(&head, b"GET / HTTP/1.1\r\n");

        // A body: hyper's, untouched, with no decision made.
        let (mut client, server) = pair().await;
        client
            .write_all(
                format!("POST / HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n\r\nhi")
                    .as_bytes(),
            )
            .await
            .unwrap();
        let lean = conn(router.clone()).lean(server).await;
        assert!(matches!(lean, Lean::Hyper(_, None)));
        assert!(calls.try_next().is_none(), "no decision for it");
    }

    #[tokio::test]
    async fn sniffing_tells_http1_from_h2c_without_consuming() {
        let (mut c, s) = pair().await;
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(sniff(&s).await.unwrap(), Some(Protocol::Http1));
        // Nothing was read: hyper gets the whole request.
        let mut buf = [0u8; 3];
        assert_eq!(s.peek(&mut buf).await.unwrap(), 3);
        assert_eq!(&buf, b"GET");

        // A POST starts like the preface ("P") and differs at its second byte.
        let (mut c, s) = pair().await;
        c.write_all(b"POST / HTTP/1.1\r\n").await.unwrap();
        assert_eq!(sniff(&s).await.unwrap(), Some(Protocol::Http1));
    }

    #[tokio::test]
    async fn a_preface_sent_in_pieces_is_h2c() {
        let (mut c, s) = pair().await;
        let sniffed = tokio::spawn(async move { sniff(&s).await.unwrap() });
        c.write_all(&H2_PREFACE[..7]).await.unwrap();
        c.flush().await.unwrap();
        tokio::task::yield_now().await;
        c.write_all(&H2_PREFACE[7..]).await.unwrap();
        assert_eq!(sniffed.await.unwrap(), Some(Protocol::Http2));
    }

    #[tokio::test]
    async fn a_client_that_closes_at_once_has_no_protocol() {
        let (c, s) = pair().await;
        drop(c);
        assert_eq!(sniff(&s).await.unwrap(), None);
    }

    #[test]
    fn an_owned_head_keeps_every_value_uri_and_sensitivity() {
        let mut req = http::Request::builder()
            .uri("/a/b?c=d")
            .header("host", "p1.demo.example")
            .header("x-multi", "one")
            .header("x-multi", "two")
            .header("x-empty", "")
            .body(())
            .unwrap();
        let mut secret = http::HeaderValue::from_static("Bearer t");
        secret.set_sensitive(true);
        req.headers_mut().insert("authorization", secret);
        let before = req.headers().clone();
        let owned = own_head(req);
        assert_eq!(owned.uri(), "/a/b?c=d");
        assert_eq!(owned.headers(), &before);
        let all: Vec<_> = owned.headers().get_all("x-multi").iter().collect();
        assert_eq!(all, ["one", "two"]);
        assert!(owned.headers()["authorization"].is_sensitive());
    }

    #[test]
    fn an_h2_uri_that_does_not_print_back_is_kept_as_it_was() {
        // As hyper's h2 server assembles `OPTIONS *` from its pseudo-headers.
        let uri = http::Uri::builder()
            .scheme("http")
            .authority("p1.demo.example")
            .path_and_query("*")
            .build()
            .unwrap();
        let req = http::Request::builder()
            .method("OPTIONS")
            .uri(uri.clone())
            .body(())
            .unwrap();
        let owned = own_head(req);
        assert_eq!(owned.uri(), &uri);
        assert_eq!(owned.uri().authority().unwrap(), "p1.demo.example");
    }

    #[test]
    fn an_absolute_form_uri_stays_absolute() {
        let req = http::Request::builder()
            .uri("http://p1.demo.example:8080/x")
            .body(())
            .unwrap();
        let owned = own_head(req);
        assert_eq!(owned.uri().authority().unwrap(), "p1.demo.example:8080");
        assert_eq!(owned.uri().path(), "/x");
    }
}
