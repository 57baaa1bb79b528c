//! The control plane's own probes and metrics (`--metrics-listen`): `/metrics`,
//! `/healthz` (the process lives) and `/readyz` (serving, not shutting down, and its
//! database answers; a standby waiting to become active is alive but not ready).

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::ListenerExt as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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

/// How long an admin server waits, once told to stop, for its connections to finish
/// before it stops without them.
pub const ADMIN_CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Serves `app` on `listener` (an admin server: probes, `/metrics`, `/statusz`) until
/// `stop`; then lets its connections finish for [`ADMIN_CLOSE_GRACE`], so that one that
/// never finishes its request cannot hold the process's shutdown.
pub fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    stop: CancellationToken,
    what: &'static str,
) -> tokio::task::JoinHandle<()> {
    let listener = listener.tap_io(move |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, what, "cannot set TCP_NODELAY on a connection");
        }
    });
    tokio::spawn(async move {
        let serve =
            axum::serve(listener, app).with_graceful_shutdown(stop.clone().cancelled_owned());
        let grace_over = async {
            stop.cancelled().await;
            tokio::time::sleep(ADMIN_CLOSE_GRACE).await;
        };
        tokio::select! {
            served = serve => if let Err(e) = served {
                tracing::warn!(error = %e, what, "server failed");
            },
            () = grace_over => tracing::debug!(what, "connections still open after the grace; leaving them"),
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
            "not ready: standby, waiting to become the active control plane\n",
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
