//! The listener, connections, limits and the per-request path.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use valet_router::status::RouteRecord;
use valet_router::{Decision, Router};

use crate::forward::{Body, forward, full, render};

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
    client: Client<HttpConnector, Incoming>,
    limits: Limits,
}

/// The running HTTP data plane.
#[derive(Debug)]
pub struct HttpServer {
    addr: SocketAddr,
    stop: CancellationToken,
    connections: TaskTracker,
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
        let shared = Arc::new(Shared {
            router,
            client,
            limits,
        });
        let stop = CancellationToken::new();
        let connections = TaskTracker::new();
        tokio::spawn(accept_loop(
            listener,
            shared,
            stop.clone(),
            connections.clone(),
        ));
        Ok(Self {
            addr,
            stop,
            connections,
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

    /// Waits until every connection has closed (after [`Self::stop_accepting`]).
    pub async fn drained(&self) {
        self.connections.close();
        self.connections.wait().await;
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    stop: CancellationToken,
    connections: TaskTracker,
) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .max_buf_size(4 * shared.limits.max_header_bytes.max(8192))
        .max_headers(2 * shared.limits.max_headers.max(10))
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
        let stop = stop.clone();
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
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.as_mut().await;
                }
            }
        });
    }
}

fn too_large(message: String) -> Response<Body> {
    full(
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        "text/plain; charset=utf-8",
        message,
    )
}

async fn handle(shared: &Shared, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    let started = Instant::now();
    let limits = shared.limits;
    let headers = req.headers();
    if headers.len() > limits.max_headers {
        return too_large(format!(
            "too many request header fields: {} (limit {})\n",
            headers.len(),
            limits.max_headers
        ));
    }
    let header_bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if header_bytes > limits.max_header_bytes {
        return too_large(format!(
            "request header fields too large: {header_bytes} bytes (limit {})\n",
            limits.max_header_bytes
        ));
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
    let body_len = headers
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
    let decision = router.decide_request(&host, deadline, body_len).await;
    let (resp, target, verdict) = match &decision {
        Decision::Route(route) => (
            forward(&shared.client, req, route, &host, peer).await,
            Some(route.addr),
            "routed",
        ),
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
