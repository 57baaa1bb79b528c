//! The control plane's own probes and metrics (`--metrics-listen`): `/metrics`,
//! `/healthz` (the process lives) and `/readyz` (serving, not shutting down, and its
//! database answers).

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::ListenerExt as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::plane::Plane;

/// Serves the probes and metrics of `plane` on `listener` until `stop` is cancelled.
pub fn spawn(
    listener: TcpListener,
    plane: Plane,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let app = axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(plane);
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a metrics connection");
        }
    });
    tokio::spawn(async move {
        let serve = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await });
        if let Err(e) = serve.await {
            tracing::warn!(error = %e, "control-plane metrics server failed");
        }
    })
}

async fn metrics(State(plane): State<Plane>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        plane.render_metrics(),
    )
        .into_response()
}

async fn readyz(State(plane): State<Plane>) -> Response {
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
