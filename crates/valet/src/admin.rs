//! The admin server: `/metrics`, `/healthz`, `/readyz`, `/statusz` (HTML, or JSON with
//! `?format=json`). Loopback by default; it shows no secrets (paths lose their query
//! strings, no header values are kept).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use valet_proto::ateapi::control_client::ControlClient;
use valet_router::Router;

/// What readiness depends on.
#[derive(Debug, Default)]
pub(crate) struct Health {
    draining: AtomicBool,
    control_plane_reachable: AtomicBool,
    /// Whether the probe has answered at least once.
    control_plane_probed: AtomicBool,
}

impl Health {
    pub(crate) fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn reachable(&self) -> bool {
        self.control_plane_reachable.load(Ordering::SeqCst)
    }

    fn probed(&self) -> bool {
        self.control_plane_probed.load(Ordering::SeqCst)
    }

    /// Why the router is not ready, if it is not. Only a drain makes it so: an
    /// unreachable control plane is what parking absorbs, so it never takes the router
    /// out of its load balancer (it shows on `/statusz` and in a gauge instead).
    fn not_ready(&self) -> Option<&'static str> {
        self.draining().then_some("draining")
    }
}

#[derive(Clone)]
struct AdminState {
    router: Router,
    health: Arc<Health>,
    started: SystemTime,
    listeners: Arc<Vec<(&'static str, SocketAddr)>>,
}

/// Starts the admin server on `listener`; it stops when `stop` is cancelled.
pub(crate) fn spawn(
    listener: TcpListener,
    router: Router,
    health: Arc<Health>,
    listeners: Vec<(&'static str, SocketAddr)>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let state = AdminState {
        router,
        health,
        started: SystemTime::now(),
        listeners: Arc::new(listeners),
    };
    let app = axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/statusz", get(statusz))
        .with_state(state);
    valet_control::admin::serve_http(listener, app, stop, "admin server")
}

/// How often the control plane's reachability is probed.
const PROBE_INTERVAL: Duration = Duration::from_secs(2);
/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Probes the control plane every [`PROBE_INTERVAL`] (a cheap read) and records whether
/// it answers in the health, the `atenet.router.control_plane.reachable` gauge and one
/// log line per change; any gRPC answer, even an error, means it is reachable. With
/// several replicas, reachable means one of them answers. Before each probe, the
/// `--control-plane` host names are resolved again (a name with several addresses is
/// a replica per address).
pub(crate) fn spawn_probe(
    url: String,
    cp: valet_router::GrpcControlPlane,
    router: Router,
    health: Arc<Health>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut known = None;
        let mut tick = tokio::time::interval(PROBE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            tokio::select! {
                () = cp.resolve_again() => {}
                () = stop.cancelled() => return,
            }
            let mut reachable = false;
            for channel in cp.channels() {
                let client = ControlClient::new(channel);
                let mut probe = tonic::Request::new(());
                probe.set_timeout(PROBE_TIMEOUT);
                let mut client = client.clone();
                // A stop ends a probe in progress: the router's exit never waits
                // for an unreachable replica.
                let answer = tokio::select! {
                    answer = tokio::time::timeout(PROBE_TIMEOUT, client.list_atespaces(probe)) => answer,
                    () = stop.cancelled() => return,
                };
                reachable = match answer {
                    Ok(Ok(_)) => true,
                    Ok(Err(s)) => {
                        !valet_router::control::is_transport_failure(&s)
                            && !matches!(
                                s.code(),
                                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                            )
                    }
                    Err(_) => false,
                };
                if reachable {
                    break;
                }
            }
            health
                .control_plane_reachable
                .store(reachable, Ordering::SeqCst);
            health.control_plane_probed.store(true, Ordering::SeqCst);
            router.metrics().control_plane_reachable(reachable);
            if known != Some(reachable) {
                known = Some(reachable);
                if reachable {
                    tracing::info!(control_plane = %url, "control plane reachable");
                } else {
                    tracing::warn!(control_plane = %url, "control plane unreachable; requests park until it answers");
                }
            }
        }
    })
}

async fn metrics(State(s): State<AdminState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.router.metrics().render(),
    )
        .into_response()
}

async fn readyz(State(s): State<AdminState>) -> Response {
    match s.health.not_ready() {
        None => (StatusCode::OK, "ready\n").into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The status as JSON; the HTML page renders the same document.
fn status_json(s: &AdminState) -> Value {
    let r = &s.router;
    let lot = r.lot();
    let p = r.config().parking();
    let waits = r.metrics().recent_wait_percentiles().map(|w| {
        json!({ "count": w.count, "p50_seconds": w.p50, "p90_seconds": w.p90, "p99_seconds": w.p99, "max_seconds": w.max })
    });
    let requests: Vec<Value> = r
        .recent_requests()
        .into_iter()
        .map(|q| {
            json!({
                "at": unix_secs(q.at),
                "data_plane": q.data_plane,
                "host": q.host,
                "path": q.path,
                "status": q.status,
                "verdict": q.verdict,
                "target": q.target.map(|t| t.to_string()),
                "took_ms": q.took.as_secs_f64() * 1000.0,
            })
        })
        .collect();
    json!({
        "parking": {
            "enabled": p.enabled(),
            "parked": lot.active(),
            "max": p.max_parked(),
            "budget_seconds": p.budget().as_secs_f64(),
            "rejected_total": lot.rejected_total(),
            "parked_total": lot.admitted_total(),
            "flights_in_progress": r.flights_in_progress(),
            "wait_percentiles": waits,
        },
        "ready": s.health.not_ready().is_none(),
        "draining": s.health.draining(),
        "control_plane_reachable": s.health.reachable(),
        "control_plane_probed": s.health.probed(),
        "uptime_seconds": s.started.elapsed().map_or(0.0, |d| d.as_secs_f64()),
        "listeners": s.listeners.iter().map(|(k, a)| json!({ "part": k, "address": a.to_string() })).collect::<Vec<_>>(),
        "flags": r.config().effective_flags().into_iter().map(|(f, v)| json!({ "flag": f, "value": v })).collect::<Vec<_>>(),
        "requests": requests,
    })
}

async fn statusz(
    State(s): State<AdminState>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Response {
    let doc = status_json(&s);
    if q.get("format").map(String::as_str) == Some("json") {
        return (
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::to_string_pretty(&doc).unwrap_or_default(),
        )
            .into_response();
    }
    Html(render_html(&doc)).into_response()
}

fn esc(v: &Value) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    };
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn render_html(doc: &Value) -> String {
    let p = &doc["parking"];
    let mut h = String::new();
    h.push_str(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>valet router status</title>\
         <style>body{font-family:sans-serif;margin:2em}section{border:1px solid #ccc;border-radius:6px;\
         padding:1em;margin-bottom:1em}table{border-collapse:collapse}td,th{padding:2px 8px;text-align:left}\
         th{background:#eee}.big{font-size:1.6em}</style></head><body><h1>valet router</h1>",
    );
    let enabled = p["enabled"].as_bool().unwrap_or(false);
    let _ = write!(
        h,
        "<section id=\"parking\"><h2>Request Parking</h2>\
         <p>Parking is <b id=\"parking-enabled\">{}</b>.</p>\
         <p class=\"big\">Parked now: <span id=\"parked\">{}</span> / <span id=\"parked-max\">{}</span></p>\
         <table><tr><th>budget</th><td id=\"budget\">{} s</td></tr>\
         <tr><th>rejected (lot full)</th><td id=\"rejected\">{}</td></tr>\
         <tr><th>parked in total</th><td id=\"parked-total\">{}</td></tr>\
         <tr><th>flights in progress</th><td id=\"flights\">{}</td></tr>",
        if enabled { "enabled" } else { "disabled" },
        esc(&p["parked"]),
        esc(&p["max"]),
        esc(&p["budget_seconds"]),
        esc(&p["rejected_total"]),
        esc(&p["parked_total"]),
        esc(&p["flights_in_progress"]),
    );
    match p["wait_percentiles"].as_object() {
        Some(w) => {
            let _ = write!(
                h,
                "<tr><th>recent waits</th><td id=\"waits\">{} waits: p50 {:.3} s, p90 {:.3} s, p99 {:.3} s, max {:.3} s</td></tr>",
                esc(&w["count"]),
                w["p50_seconds"].as_f64().unwrap_or(0.0),
                w["p90_seconds"].as_f64().unwrap_or(0.0),
                w["p99_seconds"].as_f64().unwrap_or(0.0),
                w["max_seconds"].as_f64().unwrap_or(0.0),
            );
        }
        None => h.push_str("<tr><th>recent waits</th><td id=\"waits\">none yet</td></tr>"),
    }
    h.push_str("</table></section>");
    let _ = write!(
        h,
        "<section id=\"health\"><h2>Health</h2><p>ready: <b id=\"ready\">{}</b>; draining: {}; control plane reachable: {}</p></section>",
        esc(&doc["ready"]),
        esc(&doc["draining"]),
        esc(&doc["control_plane_reachable"]),
    );
    h.push_str("<section id=\"flags\"><h2>Effective flags</h2><table>");
    for f in doc["flags"].as_array().into_iter().flatten() {
        let _ = write!(
            h,
            "<tr><th>{}</th><td>{}</td></tr>",
            esc(&f["flag"]),
            esc(&f["value"])
        );
    }
    h.push_str("</table></section><section id=\"requests\"><h2>Last routed requests</h2><table>\
                <tr><th>plane</th><th>host</th><th>path</th><th>status</th><th>verdict</th><th>target</th><th>ms</th></tr>");
    for q in doc["requests"].as_array().into_iter().flatten() {
        let _ = write!(
            h,
            "<tr class=\"request\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td></tr>",
            esc(&q["data_plane"]),
            esc(&q["host"]),
            esc(&q["path"]),
            esc(&q["status"]),
            esc(&q["verdict"]),
            esc(&q["target"]),
            q["took_ms"].as_f64().unwrap_or(0.0),
        );
    }
    h.push_str("</table></section></body></html>");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Request-controlled values (a host, a path) are shown as text, never markup.
    #[test]
    fn the_status_page_escapes_what_clients_send() {
        let doc = json!({
            "parking": { "enabled": true },
            "requests": [{
                "host": "<script>alert(1)</script>.demo.x",
                "path": "/\"><img src=x onerror=alert(2)>",
                "data_plane": "http",
                "verdict": "invalid_host",
                "status": 404,
            }],
        });
        let html = render_html(&doc);
        assert!(!html.contains("<script>alert"), "{html}");
        assert!(!html.contains("<img"), "{html}");
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{html}"
        );
        assert!(html.contains("&quot;&gt;&lt;img"), "{html}");
    }
}
