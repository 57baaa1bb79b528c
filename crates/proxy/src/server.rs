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
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use valet_router::status::RouteRecord;
use valet_router::{Decision, Denial, Router, Verdict};

use crate::body::{Held, RequestBody};
use crate::forward::{Body, Outgoing, Sent, render};

/// Explicit input limits of the data plane.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most request header fields.
    pub max_headers: usize,
    /// Most bytes of request header names and values together.
    pub max_header_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_headers: 100,
            max_header_bytes: 64 * 1024,
        }
    }
}

struct Shared {
    router: Router,
    client: Client<HttpConnector, RequestBody>,
    limits: Limits,
    tunnels: Tunnels,
}

/// The upgraded connections (WebSocket and other protocols) spliced to workers: owned
/// here, so a drain waits for them and can close them.
#[derive(Debug, Clone)]
pub(crate) struct Tunnels {
    tasks: TaskTracker,
    close: CancellationToken,
}

impl Tunnels {
    /// Runs `splice` until it ends or the tunnels are closed.
    pub(crate) fn spawn(&self, splice: impl std::future::Future<Output = ()> + Send + 'static) {
        let close = self.close.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = splice => {}
                () = close.cancelled() => {}
            }
        });
    }
}

/// The running HTTP data plane. Its accept loop, every connection and every upgraded
/// tunnel are owned here: [`Self::drained`] waits for them, [`Self::close`] ends them.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    stop: CancellationToken,
    force: CancellationToken,
    connections: TaskTracker,
    tunnels: Tunnels,
}

impl HttpServer {
    /// Starts serving on `listener`.
    pub fn spawn(listener: TcpListener, router: Router, limits: Limits) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        let force = CancellationToken::new();
        let tunnels = Tunnels {
            tasks: TaskTracker::new(),
            close: force.child_token(),
        };
        let shared = Arc::new(Shared {
            router,
            client,
            limits,
            tunnels: tunnels.clone(),
        });
        let stop = CancellationToken::new();
        let connections = TaskTracker::new();
        connections.spawn(accept_loop(
            listener,
            shared,
            stop.clone(),
            force.clone(),
            connections.clone(),
        ));
        Ok(Self {
            addr,
            stop,
            force,
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
        self.connections.close();
        self.connections.wait().await;
        self.tunnels.tasks.close();
        self.tunnels.tasks.wait().await;
    }

    /// Closes every upgraded tunnel (WebSocket and the like): at the drain's cut-off.
    pub fn close_tunnels(&self) {
        self.tunnels.close.cancel();
    }

    /// Closes every connection and tunnel still open: the last step of a drain, after
    /// every waiting request has had its verdict.
    pub async fn close(&self) {
        self.force.cancel();
        self.drained().await;
    }

    /// Connections open now (the accept loop counts as one until it stops).
    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }

    /// Upgraded tunnels open now.
    pub fn open_tunnels(&self) -> usize {
        self.tunnels.tasks.len()
    }
}

/// hyper parses up to this many header fields without a heap allocation.
const HYPER_INLINE_HEADERS: usize = 100;

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    stop: CancellationToken,
    force: CancellationToken,
    connections: TaskTracker,
) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .max_buf_size(4 * shared.limits.max_header_bytes.max(8192))
        // Room for the count check in `handle` (which answers 431 with the limit), but
        // never past hyper's inline 100: above it hyper allocates its header index
        // arrays on the heap for every request it parses. Past it hyper answers 431
        // itself.
        .max_headers((2 * shared.limits.max_headers.max(10)).min(HYPER_INLINE_HEADERS))
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    builder
        .http2()
        .max_header_list_size(u32::try_from(4 * shared.limits.max_header_bytes).unwrap_or(u32::MAX))
        .timer(hyper_util::rt::TokioTimer::new());
    loop {
        let (stream, peer) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let shared = Arc::clone(&shared);
        let builder = builder.clone();
        let (stop, force) = (stop.clone(), force.clone());
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = Arc::clone(&shared);
                async move { Ok::<_, Infallible>(handle(&shared, req, peer).await) }
            });
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                }
                () = stop.cancelled() => {
                    // HTTP/1 closes after the request in progress, HTTP/2 sends GOAWAY.
                    conn.as_mut().graceful_shutdown();
                    tokio::select! {
                        _ = conn.as_mut() => {}
                        () = force.cancelled() => {}
                    }
                }
            }
        });
    }
}

async fn handle(shared: &Shared, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    let started = Instant::now();
    let limits = shared.limits;
    let headers = req.headers();
    if headers.len() > limits.max_headers {
        return render(&Verdict::of(&Denial::TooManyHeaders {
            count: headers.len(),
            limit: limits.max_headers,
        }));
    }
    let header_bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if header_bytes > limits.max_header_bytes {
        return render(&Verdict::of(&Denial::HeadersTooLarge {
            bytes: header_bytes,
            limit: limits.max_header_bytes,
        }));
    }
    let host = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| {
            headers
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .unwrap_or_default();
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();

    let router = &shared.router;
    let deadline = started + router.config().decision_timeout();
    let (parts, body) = req.into_parts();
    let mut held = Held::new(
        body,
        declared,
        router.config().parked_body_limit(),
        router.lot().bytes().charge(),
    );
    let decision = router.decide_holding(&host, deadline, held.fill()).await;
    let (resp, target, verdict) = match &decision {
        Decision::Route(route) => {
            let (body, failure) = held.into_body();
            let req = Request::from_parts(parts, body);
            match Outgoing::new(req, failure, route, &host, peer).await {
                Ok(mut out) => send(shared, &mut out, route, &host, deadline).await,
                Err(resp) => (resp, Some(route.addr), "routed"),
            }
        }
        Decision::Deny(_, v) => (render(v), None, v.reason()),
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
/// checkpointed as the request arrived) sends it through the pipeline once more if it
/// can be replayed, and answers `actor moved` otherwise.
async fn send(
    shared: &Shared,
    out: &mut Outgoing,
    route: &valet_router::Route,
    host: &str,
    deadline: Instant,
) -> (Response<Body>, Option<SocketAddr>, &'static str) {
    if let Sent::Answer(resp) = out.send(&shared.client, &shared.tunnels, route).await {
        return (resp, Some(route.addr), "routed");
    }
    shared.router.forget_route(&route.actor, route.addr);
    let moved = Verdict::of(&Denial::ActorMoved(route.actor.clone()));
    if !out.replayable() {
        return (render(&moved), Some(route.addr), moved.reason());
    }
    shared.router.metrics().replayed();
    match shared.router.decide(host, deadline).await {
        Decision::Route(again) => match out.send(&shared.client, &shared.tunnels, &again).await {
            Sent::Answer(resp) => (resp, Some(again.addr), "routed"),
            Sent::Moved => {
                shared.router.forget_route(&again.actor, again.addr);
                (render(&moved), Some(again.addr), moved.reason())
            }
        },
        Decision::Deny(_, v) => (render(&v), None, v.reason()),
    }
}
