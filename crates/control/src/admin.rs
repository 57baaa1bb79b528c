//! The control plane's own probes and metrics (`--metrics-listen`): `/metrics`,
//! `/healthz` (the process lives) and `/readyz` (serving, not shutting down, and,
//! with PostgreSQL, its database answers; a standby waiting to become active is alive
//! but not ready). The SQLite store is a file the process holds open: it is not asked.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use valet_net::{Budget, Connections, Listener};

use crate::plane::Plane;

/// The plane the probes describe while there is one: a standby has none, and a
/// replica that lost its database goes back to having none.
#[derive(Debug, Clone, Default)]
pub struct PlaneSlot(std::sync::Arc<std::sync::RwLock<Option<Plane>>>);

impl PlaneSlot {
    /// A slot holding `plane`.
    pub fn with(plane: Plane) -> Self {
        let slot = Self::default();
        slot.set(Some(plane));
        slot
    }

    /// Describe `plane` from now on (`None`: standby).
    pub fn set(&self, plane: Option<Plane>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = plane;
    }

    /// The plane now, if any.
    pub fn get(&self) -> Option<Plane> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Serves the probes and metrics of `plane` on `listener` until `stop` is cancelled.
pub fn spawn(
    listener: TcpListener,
    plane: Plane,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    spawn_slot(listener, PlaneSlot::with(plane), stop)
}

/// As [`spawn`], for a plane that may not exist yet: until `slot` is filled,
/// `/healthz` answers `ok`, `/readyz` 503 (standby) and `/metrics` nothing.
pub fn spawn_slot(
    listener: TcpListener,
    slot: PlaneSlot,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let app = axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(slot);
    serve_http(listener, app, stop, "control-plane metrics server")
}

/// The bounds of an admin server's connections.
#[derive(Debug, Clone, Copy)]
pub struct AdminLimits {
    /// How long, once told to stop, it waits for its connections to finish before it
    /// stops without them.
    pub close_grace: std::time::Duration,
    /// How long a connection may take to send a request's head, also the first one
    /// and the next one on a kept-alive connection; it is closed after that.
    pub header_timeout: std::time::Duration,
    /// How many connections it serves at once; past that, new ones wait in the listen
    /// backlog until one closes (at most `header_timeout` for an idle one).
    pub max_connections: usize,
    /// How long a connection is kept: then it closes after the request in progress,
    /// whose answer has `header_timeout` more to be read. A client that never reads
    /// its answers holds its place no longer than that.
    pub lifetime: std::time::Duration,
}

impl AdminLimits {
    /// Every admin server's: a 2 s grace, 10 s for a head, 128 connections, each
    /// kept 30 s.
    pub const DEFAULT: Self = Self {
        close_grace: std::time::Duration::from_secs(2),
        header_timeout: std::time::Duration::from_secs(10),
        max_connections: 128,
        lifetime: std::time::Duration::from_secs(30),
    };
}

/// The largest request head an admin server reads (hyper's smallest read buffer).
const ADMIN_MAX_HEAD: usize = 8 * 1024;

/// Serves `app` on `listener` (an admin server: probes, `/metrics`, `/statusz`) over
/// HTTP/1.1 until `stop`, within [`AdminLimits::DEFAULT`]; then lets its connections
/// finish for the grace and ends those still open, so that one that never finishes its
/// request cannot hold the process's shutdown. Every connection is bounded: the time
/// to send a head, its size ([`ADMIN_MAX_HEAD`]), how many at once.
pub fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    stop: CancellationToken,
    what: &'static str,
) -> tokio::task::JoinHandle<()> {
    serve_http_within(listener, app, stop, what, AdminLimits::DEFAULT)
}

/// [`serve_http`] within `limits`.
pub fn serve_http_within(
    listener: TcpListener,
    app: axum::Router,
    stop: CancellationToken,
    what: &'static str,
    limits: AdminLimits,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .max_buf_size(ADMIN_MAX_HEAD);
        let listener = Listener::new(listener, what).budget(Budget::new(limits.max_connections));
        // Owns every connection's task: those still open after the grace are ended.
        let connections = Connections::new();
        while let Some(tcp) = listener.accept(&stop).await {
            let app = app.clone();
            let service = hyper::service::service_fn(move |request| {
                let mut app = app.clone();
                tower_service::Service::call(&mut app, request)
            });
            let conn = http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
            let (stop, force) = (stop.clone(), connections.force());
            connections.spawn(async move {
                let mut conn = std::pin::pin!(conn);
                let served = tokio::select! {
                    served = conn.as_mut() => served,
                    () = stop.cancelled() => {
                        conn.as_mut().graceful_shutdown();
                        tokio::select! {
                            served = conn.as_mut() => served,
                            () = force.cancelled() => return,
                        }
                    }
                    () = tokio::time::sleep(limits.lifetime) => {
                        conn.as_mut().graceful_shutdown();
                        match tokio::time::timeout(limits.header_timeout, conn.as_mut()).await {
                            Ok(served) => served,
                            Err(_) => {
                                tracing::debug!(what, "connection closed: its answer was not read");
                                return;
                            }
                        }
                    }
                };
                if let Err(e) = served {
                    tracing::debug!(error = %e, what, "connection ended");
                }
            });
        }
        drop(listener);
        if !connections.drain(limits.close_grace).await {
            tracing::debug!(what, "connections still open after the grace; closed them");
        }
    })
}

async fn metrics(State(slot): State<PlaneSlot>) -> Response {
    let Some(plane) = slot.get() else {
        return (StatusCode::OK, String::new()).into_response();
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        plane.render_metrics(),
    )
        .into_response()
}

async fn readyz(State(slot): State<PlaneSlot>) -> Response {
    let Some(plane) = slot.get() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: not serving yet (joining the database, or a standby waiting to become active)\n",
        )
            .into_response();
    };
    if plane.is_shutting_down() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: shutting down\n",
        )
            .into_response()
    } else if let Err(e) = plane.database_ready().await {
        (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")).into_response()
    } else {
        (StatusCode::OK, "ready\n").into_response()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;

    /// Far longer than anything here takes on a loaded machine.
    const BOUND: Duration = Duration::from_secs(30);

    /// A `/healthz` server within `limits`, on the real clock.
    async fn probes(
        limits: AdminLimits,
    ) -> (
        std::net::SocketAddr,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let app = axum::Router::new().route("/healthz", get(|| async { "ok\n" }));
        let served = serve_http_within(listener, app, stop.clone(), "test", limits);
        (addr, stop, served)
    }

    /// Sends `GET /healthz` on `tcp` and reads the answer's first bytes.
    async fn healthz(tcp: &mut TcpStream) -> String {
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = vec![0; 1024];
        let n = tcp.read(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer[..n]).into_owned()
    }

    /// Reads until the server closes `tcp`, bounded.
    async fn closed(tcp: &mut TcpStream) -> bool {
        let mut rest = Vec::new();
        tokio::time::timeout(BOUND, tcp.read_to_end(&mut rest))
            .await
            .is_ok()
    }

    /// A connection that never finishes its request head, or stays idle after an
    /// answer, is closed after the header timeout, not held open for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_admin_connection_is_closed_after_the_header_timeout() {
        let limits = AdminLimits {
            header_timeout: Duration::from_millis(200),
            ..AdminLimits::DEFAULT
        };
        let (addr, _stop, _served) = probes(limits).await;
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        assert!(closed(&mut half).await, "the half-sent request was kept");

        let mut idle = TcpStream::connect(addr).await.unwrap();
        assert!(healthz(&mut idle).await.starts_with("HTTP/1.1 200"));
        assert!(closed(&mut idle).await, "the idle connection was kept");
    }

    /// Past its connection limit, a new connection is served only once another
    /// closes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn admin_connections_are_capped() {
        let limits = AdminLimits {
            max_connections: 4,
            ..AdminLimits::DEFAULT
        };
        let (addr, _stop, _served) = probes(limits).await;
        let mut held = Vec::new();
        for _ in 0..limits.max_connections {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            // Answered: the server took the connection (and keeps it alive).
            assert!(healthz(&mut tcp).await.starts_with("HTTP/1.1 200"));
            held.push(tcp);
        }
        let late = tokio::spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            healthz(&mut tcp).await
        });
        // Not a synchronization: however long it waits, it must not be served.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!late.is_finished(), "served past the cap");
        drop(held.pop());
        let answer = tokio::time::timeout(BOUND, late).await;
        assert!(
            answer
                .as_ref()
                .is_ok_and(|a| a.as_ref().unwrap().starts_with("HTTP/1.1 200")),
            "{answer:?}"
        );
    }

    /// A client that asks and never reads its answers holds its connection (and the
    /// only place under the cap here) no longer than the connection's lifetime and the
    /// time to read an answer: then the next client is served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_never_reads_its_answers_is_closed() {
        let limits = AdminLimits {
            max_connections: 1,
            header_timeout: Duration::from_millis(200),
            lifetime: Duration::from_millis(300),
            ..AdminLimits::DEFAULT
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let big = axum::body::Bytes::from(vec![b'x'; 64 << 20]);
        let app = axum::Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/big", get(move || async move { big.clone() }));
        let _served = serve_http_within(listener, app, CancellationToken::new(), "test", limits);
        let mut stuck = TcpStream::connect(addr).await.unwrap();
        stuck
            .write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let next = tokio::spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            healthz(&mut tcp).await
        });
        let answer = tokio::time::timeout(BOUND, next).await;
        assert!(
            answer
                .as_ref()
                .is_ok_and(|a| a.as_ref().unwrap().starts_with("HTTP/1.1 200")),
            "{answer:?}"
        );
        drop(stuck);
    }

    /// Once told to stop, the server ends every connection still open within its
    /// grace, and stops listening.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_admin_server_ends_its_connections() {
        let limits = AdminLimits {
            close_grace: Duration::from_millis(200),
            ..AdminLimits::DEFAULT
        };
        let (addr, stop, served) = probes(limits).await;
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /healthz HTTP/1.1\r\n").await.unwrap();
        let mut kept = TcpStream::connect(addr).await.unwrap();
        assert!(healthz(&mut kept).await.starts_with("HTTP/1.1 200"));
        stop.cancel();
        tokio::time::timeout(BOUND, served)
            .await
            .expect("the server stopped")
            .unwrap();
        assert!(closed(&mut kept).await);
        assert!(closed(&mut half).await);
        assert!(TcpStream::connect(addr).await.is_err(), "still listening");
    }
}
