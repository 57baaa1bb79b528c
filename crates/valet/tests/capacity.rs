//! Capacity that frees itself, end to end on the real `valet up` binary: demand
//! eviction, idle suspension never cutting a request short, checkpoints racing new
//! requests, and a graceful stop that checkpoints every actor.

mod common;

use std::time::Duration;

use common::{Up, eventually, get, get_text, status};
use valet_proto::ateapi::actor::Status as S;

const WITHIN: Duration = Duration::from_secs(60);

fn counters(body: &str) -> (u64, i64) {
    let memory = body
        .split("preserved memory count: ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no memory count in {body:?}"));
    let file = body
        .split("preserved file counter: ")
        .nth(1)
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or_else(|| panic!("no file counter in {body:?}"));
    (memory, file)
}

async fn cp_metric(up: &Up, name: &str) -> f64 {
    let text = common::http_get(up.metrics, "/metrics", &[]).await.1;
    valet_router::metrics::sample_of(&text, name, &[])
}

/// The seed's demo on `valet up`'s defaults: p1 and p2 fill both workers; once both
/// have been idle 10 s a request to p3 is served with no manual suspend, after one
/// checkpoint (p1, the least recently active) and one restore; p1 then continues its
/// file counter on its next resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_frees_itself() {
    let up = Up::start(&[]).await;
    for name in ["p1", "p2"] {
        let (s, _, b) = get_text(up.router, name, "/").await;
        assert_eq!(s, 200, "{b}");
    }
    let c = up.client();
    eventually("p1 and p2 idle 10 s", WITHIN, || async {
        let idle = |a: valet_proto::ateapi::Actor| {
            a.idle_for
                .and_then(|d| Duration::try_from(d).ok())
                .is_some_and(|d| d >= Duration::from_secs(10))
        };
        (idle(get(&c, "demo/p1").await.ok()?) && idle(get(&c, "demo/p2").await.ok()?)).then_some(())
    })
    .await;
    let resumed_before = cp_metric(&up, "valet_control_resumes_total").await;
    let (s, _, b) = get_text(up.router, "p3", "/").await;
    assert_eq!((s, counters(&b)), (200, (1, 1)), "{b}");
    assert_eq!(cp_metric(&up, "valet_control_evictions_total").await, 1.0);
    assert_eq!(
        status(&get(&c, "demo/p1").await.unwrap()),
        S::Suspended,
        "p1 evicted"
    );
    assert_eq!(status(&get(&c, "demo/p2").await.unwrap()), S::Running);
    assert!(cp_metric(&up, "valet_control_resumes_total").await - resumed_before <= 3.0);

    let (s, _, b) = get_text(up.router, "p1", "/").await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(counters(&b).1, 2, "p1's file counter continues: {b}");
}

/// A checkpoint racing new requests never loses one's effect: a client sends request
/// after request to p1 while p1 is suspended again and again; every answer is a 200
/// (a request the fence turned away is replayed by the router, never a 421 to the
/// client), and the file counter goes up by exactly one each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_racing_requests_lose_nothing() {
    let up = Up::start(&["--workers", "1", "--evict-idle-after", "0"]).await;
    let router = up.router;
    let (progress, mut answered) = tokio::sync::watch::channel(0usize);
    let client = tokio::spawn(async move {
        let mut seen = Vec::new();
        for i in 0..120 {
            let (s, _, b) = get_text(router, "p1", "/").await;
            assert_eq!(s, 200, "request {i}: {b}");
            seen.push(counters(&b).1);
            progress.send_replace(i + 1);
        }
        seen
    });
    let c = up.client();
    let mut suspends = 0;
    loop {
        // Suspend while the client is mid-stream, then let it make progress again.
        let at = *answered.borrow_and_update();
        if common::suspend(&c, "demo/p1").await.is_ok() {
            suspends += 1;
        }
        if answered
            .wait_for(|n| *n >= at + 3 || *n == 120)
            .await
            .map(|n| *n == 120)
            .unwrap_or(true)
        {
            break;
        }
    }
    let seen = client.await.unwrap();
    assert!(suspends >= 10, "the actor was suspended {suspends} times");
    for (i, n) in seen.iter().enumerate() {
        assert_eq!(*n, i as i64 + 1, "request {i}: {seen:?}");
    }
}

/// An actor with a request in flight (an open WebSocket) is never idle-suspended, while
/// idle actors around it are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_is_never_suspended() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;

    let up = Up::start(&[
        "--workers",
        "1",
        "--echo-workers",
        "1",
        "--idle-suspend-after",
        "1s",
    ])
    .await;
    let c = up.client();
    common::create_from(&c, "demo/ws", "echo").await.unwrap();
    let (mut ws, _) = common::websocket(up.router, &Up::host("ws"), &[]).await;

    for (round, name) in ["p1", "p2"].iter().enumerate() {
        let (s, _, _) = get_text(up.router, name, "/").await;
        assert_eq!(s, 200);
        eventually(&format!("{name} idle-suspended"), WITHIN, || async {
            (status(&get(&c, &format!("demo/{name}")).await.ok()?) == S::Suspended).then_some(())
        })
        .await;
        assert_eq!(
            cp_metric(&up, "valet_control_idle_suspensions_total").await,
            round as f64 + 1.0
        );
        let ws_actor = get(&c, "demo/ws").await.unwrap();
        assert_eq!(status(&ws_actor), S::Running, "the open WebSocket keeps it");
        assert!(ws_actor.busy);
    }
    ws.send(Message::text("still here")).await.unwrap();
    let echoed = ws.next().await.unwrap().unwrap();
    assert_eq!(echoed.into_text().unwrap().as_str(), "still here");
}

/// Ctrl-C on `valet up` checkpoints every running actor; started again on the same
/// data dir, each resumes from that fresh snapshot: the file counter continues, and
/// with full snapshots the memory count too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_checkpoints_every_actor() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let flags = ["--template", "counter:full"];
    let mut up = Up::start_in(tempfile::tempdir().unwrap(), &data, &flags).await;
    for n in 1..=2 {
        let (s, _, b) = get_text(up.router, "p1", "/").await;
        assert_eq!((s, counters(&b)), (200, (n, n as i64)), "{b}");
    }
    common::signal(&up.child, "INT");
    let code = tokio::time::timeout(WITHIN, up.child.wait())
        .await
        .unwrap()
        .unwrap()
        .code();
    assert_eq!(code, Some(0));

    let up = Up::start_in(tempfile::tempdir().unwrap(), &data, &flags).await;
    assert_eq!(
        status(&get(&up.client(), "demo/p1").await.unwrap()),
        S::Suspended,
        "checkpointed at the stop, not left running"
    );
    let (s, _, b) = get_text(up.router, "p1", "/").await;
    assert_eq!((s, counters(&b)), (200, (3, 3)), "{b}");
}
