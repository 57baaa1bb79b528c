//! SIGTERM drains every data plane of a real router process together: nothing already
//! received is reset, parked requests keep their budget and get their normal verdict on
//! either plane, the drain timeout cuts off what still waits with `router shutting
//! down`, upgraded tunnels are closed, and the process exits 0.

mod common;

use std::time::Duration;

use common::extproc::{self, Answer};
use common::{
    DOMAIN, Proc, client, control_plane, create, eventually, resume, try_http_get, worker_with,
};
use futures_util::StreamExt;

const WITHIN: Duration = Duration::from_secs(30);

fn host(name: &str) -> String {
    format!("{name}.demo.{DOMAIN}")
}

fn capacity_503(name: &str) -> String {
    format!("actor demo/{name} unavailable: no worker has room for the actor")
}

/// A control plane with atespace `demo`, worker `w1` hosting `demo/p0`, and `actors`
/// created suspended.
async fn full_pool(dir: &std::path::Path, actors: &[String]) -> (Proc, Proc) {
    let cp = control_plane(&dir.join("data"), "127.0.0.1:0", &[]).await;
    let c = client(cp.addr);
    let w1 = worker_with(cp.addr, &dir.join("snapshots"), "w1", &[]).await;
    eventually("w1 joined", WITHIN, || async {
        let n = c
            .clone()
            .list_workers(())
            .await
            .ok()?
            .into_inner()
            .workers
            .len();
        (n == 1).then_some(())
    })
    .await;
    c.clone()
        .create_atespace(valet_proto::ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    create(&c, "demo/p0").await.unwrap();
    resume(&c, "demo/p0").await.unwrap();
    for a in actors {
        create(&c, &format!("demo/{a}")).await.unwrap();
    }
    (cp, w1)
}

/// A `valet router` process with both data planes (HTTP and ext_proc) and its admin
/// server, on `cp`, with `extra` flags.
async fn both_planes(cp: std::net::SocketAddr, extra: &[&str]) -> Proc {
    common::router_on(cp, "127.0.0.1:0", "127.0.0.1:0", extra).await
}

/// 1,000 requests parked over HTTP and 100 over ext_proc, and an open WebSocket, when
/// SIGTERM arrives: every request gets its complete capacity 503 at the budget (none is
/// reset), new connections are refused, the tunnel is closed at the drain timeout, and
/// the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_every_parked_request_on_both_planes() {
    let dir = tempfile::tempdir().unwrap();
    let actors: Vec<String> = (1..=20).map(|i| format!("q{i}")).collect();
    let (cp, _w1) = full_pool(dir.path(), &actors).await;
    let c = client(cp.addr);
    let _echo = worker_with(
        cp.addr,
        &dir.path().join("snapshots"),
        "e1",
        &["--pool", "echo"],
    )
    .await;
    common::create_from(&c, "demo/ws", "echo").await.unwrap();
    let mut router = both_planes(
        cp.addr,
        &[
            "--parked-request-budget",
            "4s",
            "--parked-request-max",
            "2000",
        ],
    )
    .await;
    let http = router.addrs["router"];
    let grpc = router.addrs["extproc"];

    let (ws, _) = common::websocket(http, &host("ws"), &[]).await;

    let mut by_http = Vec::new();
    for i in 0..1000 {
        let name = actors[i % 10].clone();
        by_http.push(tokio::spawn(async move {
            (
                try_http_get(http, "/", &[("Host", &host(&name))]).await,
                name,
            )
        }));
    }
    let ep = extproc::client(grpc);
    let mut by_extproc = Vec::new();
    for i in 0..100 {
        let (ep, name) = (ep.clone(), actors[10 + i % 10].clone());
        by_extproc.push(tokio::spawn(async move {
            (extproc::decide(&ep, &host(&name)).await, name)
        }));
    }
    eventually("1,100 parked", WITHIN, || async {
        (router.metric("atenet_router_parking_active", &[]).await == 1100.0).then_some(())
    })
    .await;

    router.terminate();
    eventually("new connections refused", WITHIN, || async {
        tokio::net::TcpStream::connect(http)
            .await
            .is_err()
            .then_some(())
    })
    .await;
    for r in by_http {
        let (answer, name) = r.await.unwrap();
        assert_eq!(answer, Some((503, capacity_503(&name))), "over HTTP");
    }
    for r in by_extproc {
        let (answer, name) = r.await.unwrap();
        assert_eq!(
            answer.unwrap(),
            Answer::Verdict(503, capacity_503(&name)),
            "over ext_proc"
        );
    }
    let (_, mut ws_in) = ws.split();
    let closed = tokio::time::timeout(WITHIN, async {
        while let Some(Ok(_)) = ws_in.next().await {}
    })
    .await;
    assert!(closed.is_ok(), "the tunnel is closed at the drain timeout");
    assert_eq!(router.exit_code(WITHIN).await, Some(0));
}

/// The README's Envoy recipe (`--listen ''`): 100 requests parked over ext_proc keep
/// their budget through SIGTERM and get the capacity 503; a restore that outlives the
/// drain timeout gets `router shutting down`; the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_on_an_extproc_only_router() {
    let dir = tempfile::tempdir().unwrap();
    let actors: Vec<String> = (1..=10).map(|i| format!("q{i}")).collect();
    let (cp, _w1) = full_pool(dir.path(), &actors).await;
    let c = client(cp.addr);
    create(&c, "demo/slow").await.unwrap();
    let _w2 = worker_with(
        cp.addr,
        &dir.path().join("snapshots"),
        "w2",
        &["--restore-delay", "60s"],
    )
    .await;
    let mut router = common::router_on(
        cp.addr,
        "",
        "127.0.0.1:0",
        &["--parked-request-budget", "3s", "--drain-timeout", "4s"],
    )
    .await;
    let ep = extproc::client(router.addrs["extproc"]);
    let slow = {
        let ep = ep.clone();
        tokio::spawn(async move { extproc::decide(&ep, &host("slow")).await })
    };
    eventually("slow RESUMING on w2", WITHIN, || async {
        let a = common::get(&c, "demo/slow").await.ok()?;
        (common::status(&a) == valet_proto::ateapi::actor::Status::Resuming).then_some(())
    })
    .await;
    let mut parked = Vec::new();
    for i in 0..100 {
        let (ep, name) = (ep.clone(), actors[i % 10].clone());
        parked.push(tokio::spawn(async move {
            (extproc::decide(&ep, &host(&name)).await, name)
        }));
    }
    eventually("100 parked", WITHIN, || async {
        (router.metric("atenet_router_parking_active", &[]).await == 100.0).then_some(())
    })
    .await;

    router.terminate();
    for r in parked {
        let (answer, name) = r.await.unwrap();
        assert_eq!(answer.unwrap(), Answer::Verdict(503, capacity_503(&name)));
    }
    assert_eq!(
        slow.await.unwrap().unwrap(),
        Answer::Verdict(
            503,
            "actor demo/slow unavailable: router shutting down".into()
        )
    );
    assert_eq!(router.exit_code(WITHIN).await, Some(0));
}

/// A worker freed during the drain goes to the parked requests, which are routed and
/// answered by their actor, on both planes: SIGTERM keeps a parked request's chance to
/// be served, not only its verdict. The HTTP requests go through the lean path (no
/// body), so the head it took off each socket is handed to hyper during the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_serves_parked_requests_a_worker_frees_for() {
    let dir = tempfile::tempdir().unwrap();
    let (cp, _w1) = full_pool(dir.path(), &["q1".to_owned()]).await;
    let c = client(cp.addr);
    let mut router = both_planes(cp.addr, &["--parked-request-budget", "20s"]).await;
    let http = router.addrs["router"];
    let by_http: Vec<_> = (0..200)
        .map(|_| {
            tokio::spawn(async move { try_http_get(http, "/", &[("Host", &host("q1"))]).await })
        })
        .collect();
    let ep = extproc::client(router.addrs["extproc"]);
    let by_extproc: Vec<_> = (0..20)
        .map(|_| {
            let ep = ep.clone();
            tokio::spawn(async move { extproc::decide(&ep, &host("q1")).await })
        })
        .collect();
    eventually("220 parked", WITHIN, || async {
        (router.metric("atenet_router_parking_active", &[]).await == 220.0).then_some(())
    })
    .await;

    router.terminate();
    eventually("new connections refused", WITHIN, || async {
        tokio::net::TcpStream::connect(http)
            .await
            .is_err()
            .then_some(())
    })
    .await;
    common::suspend(&c, "demo/p0").await.unwrap();

    for r in by_http {
        let (status, body) = r.await.unwrap().expect("an answer over HTTP");
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("hello from: demo/q1 |"), "{body}");
    }
    let mut authorities = std::collections::BTreeSet::new();
    for r in by_extproc {
        match r.await.unwrap().unwrap() {
            Answer::Routed(authority) => authorities.insert(authority),
            other => panic!("over ext_proc: {other:?}"),
        };
    }
    assert_eq!(authorities.len(), 1, "one worker: {authorities:?}");
    assert!(!authorities.first().unwrap().is_empty());
    assert_eq!(router.exit_code(WITHIN).await, Some(0));
}

/// A client that opened a connection to the admin server and never finished its
/// request does not hold the router's shutdown: SIGTERM still ends the process with 0.
/// Before, the admin server's graceful shutdown waited for that request for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_admin_request_does_not_hold_the_shutdown() {
    use tokio::io::AsyncWriteExt;
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut r = common::router(nowhere, &[]).await;
    let admin = r.addrs["admin"];
    let mut half = tokio::net::TcpStream::connect(admin).await.unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Served after it on a second connection: the admin server took the first.
    let (code, _) = common::http_get(admin, "/healthz", &[]).await;
    assert_eq!(code, 200);
    r.terminate();
    assert_eq!(r.exit_code(WITHIN).await, Some(0));
    drop(half);
}

/// A second SIGTERM during the drain stops the router at once (exit 143), without
/// waiting for the parked request's 60 s budget that the drain would give it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_stops_the_drain_at_once() {
    // A control plane that is not there: the request parks, retrying, for 60 s.
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let r = common::router(nowhere, &["--parked-request-budget", "60s"]).await;
    a_second_sigterm_ends_the_drain(r).await;
}

/// The second SIGTERM stops the router at once even when stderr is a closed pipe
/// (`valet router 2>&1 | tee`, tee ended by the first signal). Before, its message
/// panicked the task that was to exit, and the router drained on for the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_stops_the_drain_with_stderr_closed() {
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let url = format!("http://{nowhere}");
    let r = Proc::start_stderr_closed(
        "admin",
        &[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--extproc-listen",
            "",
            "--admin-listen",
            "127.0.0.1:0",
            "--control-plane",
            &url,
            "--parked-request-budget",
            "60s",
        ],
    )
    .await;
    a_second_sigterm_ends_the_drain(r).await;
}

/// With a request parked on router `r` (before a control plane that is not there):
/// SIGTERM, then once it drains a second SIGTERM ends it at once (exit 143), the
/// request cut short with the process.
async fn a_second_sigterm_ends_the_drain(mut r: Proc) {
    let http = r.addrs["router"];
    let parked =
        tokio::spawn(async move { try_http_get(http, "/", &[("Host", &host("p1"))]).await });
    eventually("the request parked", WITHIN, || async {
        (r.metric("atenet_router_parking_active", &[]).await == 1.0).then_some(())
    })
    .await;
    r.terminate();
    let admin = r.addrs["admin"];
    eventually("draining (not ready)", WITHIN, || async {
        (common::http_get(admin, "/readyz", &[]).await.0 == 503).then_some(())
    })
    .await;
    r.terminate();
    assert_eq!(r.exit_code(WITHIN).await, Some(143));
    assert_eq!(parked.await.unwrap(), None, "cut short with the process");
}

/// `valet router` with only its HTTP data plane, on a free port, in front of a
/// control plane that is not there, as `cmd` starts it; and that port.
fn lone_router(mut cmd: tokio::process::Command) -> (tokio::process::Child, std::net::SocketAddr) {
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let child = cmd
        .args([
            "router",
            "--control-plane",
            "http://127.0.0.1:9",
            "--listen",
            &listen.to_string(),
            "--admin-listen",
            "",
            "--extproc-listen",
            "",
        ])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    (child, listen)
}

/// Waits until the router on `listen` answers (a 404 for a host that is no actor's).
async fn serves(listen: std::net::SocketAddr) {
    eventually("the router serves", WITHIN, || async {
        try_http_get(listen, "/", &[("Host", "bad host")])
            .await
            .map(drop)
    })
    .await;
}

/// A router whose stdout is closed (a reader that took the `listening` lines it wanted
/// and left) serves and stops cleanly. Before, printing its `listening` lines panicked
/// on the closed pipe and the process exited 101.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_does_not_end_the_router() {
    let (out, gone) = std::os::unix::net::UnixStream::pair().unwrap();
    drop(gone);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"));
    cmd.env("VALET_LOG", "error")
        .stdout(std::process::Stdio::from(std::os::fd::OwnedFd::from(out)));
    let (mut child, listen) = lone_router(cmd);
    serves(listen).await;
    common::signal(&child, "TERM");
    let status = tokio::time::timeout(WITHIN, child.wait())
        .await
        .expect("stopped")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// A part started by `valet load` (VALET_STOP_WITH_PARENT, a pipe on stdin) stops
/// cleanly by itself once that pipe ends, as when `valet load` is killed with SIGKILL
/// and cannot stop its parts. Before, such parts ran on for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_whose_parent_is_gone_stops() {
    let (mut child, listen) = lone_router(valet_load::processes::part_command(env!(
        "CARGO_BIN_EXE_valet"
    )));
    serves(listen).await;
    assert!(child.try_wait().unwrap().is_none(), "it runs");
    drop(child.stdin.take());
    let status = tokio::time::timeout(WITHIN, child.wait())
        .await
        .expect("stopped once its parent was gone")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}
