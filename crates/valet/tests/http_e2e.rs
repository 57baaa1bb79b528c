//! The built-in HTTP data plane end to end: the real `valet up` binary on 127.0.0.1:0,
//! real HTTP clients, the control plane driven over gRPC.

mod common;

use std::time::Duration;

use common::{DOMAIN, Up, eventually, get, get_text, request};
use valet_proto::ateapi;

const HELLO_P1: &str =
    "hello from: demo/p1 | preserved memory count: 1 | preserved file counter: 1\n";

fn aref(name: &str) -> Option<ateapi::ActorRef> {
    Some(ateapi::ActorRef {
        atespace: "demo".into(),
        name: name.into(),
    })
}

async fn suspend(up: &Up, name: &str) {
    up.client()
        .suspend_actor(ateapi::SuspendActorRequest {
            actor_ref: aref(name),
        })
        .await
        .unwrap();
}

async fn create(up: &Up, name: &str, template: &str) -> ateapi::Actor {
    up.client()
        .create_actor(ateapi::CreateActorRequest {
            actor_ref: aref(name),
            actor_template_namespace: "default".into(),
            actor_template_name: template.into(),
            worker_selector: None,
        })
        .await
        .unwrap()
        .into_inner()
        .actor
        .unwrap()
}

async fn attempts(up: &Up) -> f64 {
    up.metric("atenet_router_resume_attempts_total", &[]).await
}

/// Every verdict row reached over HTTP, on a pool of two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdicts_over_http() {
    let up = Up::start(&["--workers", "2", "--parked-request-budget", "3s"]).await;

    // Running actor.
    let (s, h, b) = get_text(up.router, "p1", "/").await;
    assert_eq!((s, b.as_str()), (200, HELLO_P1));
    assert!(h.get("retry-after").is_none());

    // Unknown actor: 404 at once, one attempt.
    let before = attempts(&up).await;
    let (s, h, b) = get_text(up.router, "nope", "/").await;
    assert_eq!((s, b.as_str()), (404, "actor demo/nope not found"));
    assert_eq!(h["content-type"], "text/plain; charset=utf-8");
    assert_eq!(attempts(&up).await - before, 1.0, "no waiting");

    // Invalid host.
    let (s, _, b) = request(up.router, "GET", "p1.demo.example.com", "/", Vec::new()).await;
    assert_eq!(s, 404);
    assert_eq!(
        String::from_utf8(b).unwrap(),
        format!("invalid host \"p1.demo.example.com\": not under the actor domain {DOMAIN}")
    );

    // Crashed actor: 503 at once with the control plane's description, no Retry-After.
    let crash = create(&up, "crash", "counter").await;
    let dir = up
        .dir
        .path()
        .join("data/snapshots/demo/crash")
        .join(&crash.ateom_pod_uid)
        .join("data");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("counter"), "not a number").unwrap();
    let before = attempts(&up).await;
    let (s, h, b) = get_text(up.router, "crash", "/").await;
    assert_eq!(s, 503);
    assert_eq!(
        b,
        "actor demo/crash unavailable: AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)"
    );
    assert!(h.get("retry-after").is_none());
    assert_eq!(attempts(&up).await - before, 1.0, "crashed fails fast");
    let (s, _, _) = get_text(up.router, "crash", "/").await;
    assert_eq!(s, 503);

    // Full pool: 503 after the budget with the exact body and Retry-After.
    let (s, _, _) = get_text(up.router, "p2", "/").await;
    assert_eq!(s, 200);
    let (s, h, b) = get_text(up.router, "p3", "/").await;
    assert_eq!(s, 503);
    assert_eq!(
        b,
        "actor demo/p3 unavailable: no worker has room for the actor"
    );
    assert_eq!(h["retry-after"], "1");
    assert_eq!(h["content-type"], "text/plain; charset=utf-8");
    assert_eq!(
        up.metric(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "budget_exhausted")]
        )
        .await,
        1.0
    );

    // A worker freed mid-wait: 200 before the budget, handed over without a backoff
    // tick: one quick attempt, then one that waited at the control plane.
    let before = attempts(&up).await;
    let router = up.router;
    let parked = tokio::spawn(async move { get_text(router, "p3", "/").await });
    up.until_parked(1.0).await;
    suspend(&up, "p1").await;
    let (s, _, b) = parked.await.unwrap();
    assert_eq!(s, 200);
    assert!(b.starts_with("hello from: demo/p3 |"), "{b}");
    assert_eq!(
        attempts(&up).await - before,
        2.0,
        "served by hand-off, no polling"
    );
    assert_eq!(
        up.metric(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "served")]
        )
        .await,
        1.0
    );
    assert_eq!(up.metric("atenet_router_parking_active", &[]).await, 0.0);
}

/// With the lot full, a request reaching its park transition is shed with `router at
/// capacity`, and requests to running actors still succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_lot_sheds_parking_requests_but_not_running_ones() {
    let up = Up::start(&[
        "--workers",
        "1",
        "--parked-request-max",
        "1",
        "--parked-request-budget",
        "10s",
    ])
    .await;
    assert_eq!(get_text(up.router, "p1", "/").await.0, 200);
    let router = up.router;
    let parked = tokio::spawn(async move { get_text(router, "p2", "/").await });
    up.until_parked(1.0).await;

    // A second request for the parked actor joins its parked flight and needs a slot
    // at once. (A request for another actor would start a flight of its own that, shed
    // or not, keeps waiting for capacity and could take the next free worker.)
    let (s, h, b) = get_text(up.router, "p2", "/").await;
    assert_eq!(
        (s, b.as_str()),
        (503, "actor demo/p2 unavailable: router at capacity")
    );
    assert_eq!(h["retry-after"], "1");
    assert_eq!(
        up.metric("atenet_router_parking_rejected_total", &[]).await,
        1.0
    );

    for n in 2..=21 {
        let (s, _, b) = get_text(up.router, "p1", "/").await;
        assert_eq!(s, 200, "running actor served while the lot is full");
        assert!(b.ends_with(&format!("file counter: {n}\n")), "{b}");
    }
    assert_eq!(up.metric("atenet_router_parking_active", &[]).await, 1.0);
    suspend(&up, "p1").await;
    assert_eq!(parked.await.unwrap().0, 200);
}

/// A client that disconnects while parked frees its slot at once and records
/// `canceled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_while_parked_frees_the_slot() {
    use tokio::io::AsyncWriteExt;
    let up = Up::start(&["--workers", "1", "--parked-request-budget", "30s"]).await;
    assert_eq!(get_text(up.router, "p1", "/").await.0, 200);
    let mut conn = tokio::net::TcpStream::connect(up.router).await.unwrap();
    conn.write_all(format!("GET / HTTP/1.1\r\nHost: {}\r\n\r\n", Up::host("p2")).as_bytes())
        .await
        .unwrap();
    up.until_parked(1.0).await;
    drop(conn);
    up.until_parked(0.0).await;
    assert_eq!(
        up.metric(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "canceled")]
        )
        .await,
        1.0
    );
}

/// WebSocket echo and HTTP/2 through the router; a large streamed upload and download
/// arrive intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_http2_and_large_streams() {
    use futures_util::{SinkExt, StreamExt};
    use http_body_util::BodyExt;
    use tokio_tungstenite::tungstenite::Message;

    let up = Up::start(&["--workers", "1", "--echo-workers", "1"]).await;
    create(&up, "echo", "echo").await;

    // WebSocket.
    let (mut ws, status) = common::websocket(up.router, &Up::host("echo"), &[]).await;
    assert_eq!(status, 101);
    for text in ["hello", "parked requests are served"] {
        ws.send(Message::text(text)).await.unwrap();
        let echoed = ws.next().await.unwrap().unwrap();
        assert_eq!(echoed.into_text().unwrap().as_str(), text);
    }
    ws.send(Message::binary(vec![1u8, 2, 3])).await.unwrap();
    assert_eq!(
        ws.next().await.unwrap().unwrap().into_data().to_vec(),
        vec![1u8, 2, 3]
    );
    ws.close(None).await.unwrap();

    // HTTP/2 (h2c, prior knowledge): the actor is named by :authority.
    let tcp = tokio::net::TcpStream::connect(up.router).await.unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .uri(format!("http://{}/over-h2", Up::host("p1")))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = h2.send_request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, HELLO_P1.as_bytes());

    // A 48 MiB upload, streamed back by the echo app.
    let upload: Vec<u8> = valet_worker::pattern(7, 48 << 20);
    let (s, _, echoed) = request(
        up.router,
        "POST",
        &Up::host("echo"),
        "/upload",
        upload.clone(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(echoed.len(), upload.len());
    assert!(echoed == upload, "upload arrives intact");

    // A 64 MiB download.
    let n = 64u64 << 20;
    let (s, h, body) = request(
        up.router,
        "GET",
        &Up::host("echo"),
        &format!("/bytes/{n}"),
        Vec::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(h["content-length"], n.to_string());
    assert!(
        body == valet_worker::pattern(0, n as usize),
        "download arrives intact"
    );
}

/// SIGTERM with parked requests in progress: readiness fails, each parked request gets
/// a real verdict (none is reset), and the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_parked_requests() {
    let mut up = Up::start(&[
        "--workers",
        "1",
        "--parked-request-budget",
        "2s",
        "--drain-delay",
        "500ms",
    ])
    .await;
    assert_eq!(get_text(up.router, "p1", "/").await.0, 200);
    let router = up.router;
    let parked: Vec<_> = ["p2", "p3", "p2"]
        .into_iter()
        .map(|a| tokio::spawn(async move { get_text(router, a, "/").await }))
        .collect();
    up.until_parked(3.0).await;
    up.terminate();
    eventually(
        "readiness fails while draining",
        Duration::from_secs(5),
        || async {
            let (s, b) = common::http_get(up.admin, "/readyz", &[]).await;
            (s == 503 && b == "not ready: draining\n").then_some(())
        },
    )
    .await;
    for p in parked {
        let (s, _, b) = p.await.expect("each parked request gets an answer");
        assert_eq!(s, 503);
        assert!(
            b.ends_with("unavailable: no worker has room for the actor"),
            "{b}"
        );
    }
    let status = tokio::time::timeout(Duration::from_secs(20), up.child.wait())
        .await
        .expect("exits after the drain")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// A second `valet up` on the same data dir finds its atespace and actors again, with
/// their file counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_on_the_same_data_dir() {
    let mut first = Up::start(&["--workers", "1"]).await;
    assert_eq!(get_text(first.router, "p1", "/").await.0, 200);
    assert_eq!(get_text(first.router, "p1", "/").await.0, 200);
    first.terminate();
    assert_eq!(first.child.wait().await.unwrap().code(), Some(0));

    let data = first.dir.path().join("data");
    let dir = tempfile::tempdir().unwrap();
    let mut second = Up::start_in(dir, &data, &["--workers", "1"]).await;
    let p1 = get(&second.client(), "demo/p1").await.unwrap();
    assert_eq!(p1.atespace, "demo");
    let (s, _, b) = get_text(second.router, "p1", "/").await;
    assert_eq!(s, 200);
    assert!(b.ends_with("preserved file counter: 3\n"), "{b}");
    second.terminate();
    assert_eq!(second.child.wait().await.unwrap().code(), Some(0));
    drop(first);
}
