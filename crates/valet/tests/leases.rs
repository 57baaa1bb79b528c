//! Route leases and hosting leases across real processes: running actors ride out a
//! control-plane SIGKILL, a worker cut off from the control plane fences its actor
//! before it runs anywhere else, a stale route to a moved actor is resolved again
//! with no 421 reaching the client, and the compatibility mode.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{
    DOMAIN, Proc, client, control_plane, create, eventually, get, resume, router, status, worker,
    worker_with,
};
use valet_proto::ateapi::{self, actor::Status as S};

const WITHIN: Duration = Duration::from_secs(30);

fn host(name: &str) -> String {
    format!("{name}.demo.{DOMAIN}")
}

fn file_counter(body: &str) -> i64 {
    body.rsplit("preserved file counter: ")
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no file counter in {body:?}"))
}

async fn cp_metric(metrics: SocketAddr, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = common::http_get(metrics, "/metrics", &[]).await.1;
    valet_router::metrics::sample_of(&text, name, labels)
}

async fn demo(c: &tonic::transport::Channel) {
    let mut c = ateapi::control_client::ControlClient::new(c.clone());
    c.create_atespace(ateapi::CreateAtespaceRequest {
        name: "demo".into(),
    })
    .await
    .unwrap();
}

async fn workers_joined(
    c: &ateapi::control_client::ControlClient<tonic::transport::Channel>,
    n: usize,
) {
    eventually(&format!("{n} workers"), WITHIN, || async {
        let got = c
            .clone()
            .list_workers(())
            .await
            .ok()?
            .into_inner()
            .workers
            .len();
        (got == n).then_some(())
    })
    .await;
}

/// Requests through `router` to `name`, one after another, until `stop` says so; every
/// answer must be a 200 (returns the file counters seen).
fn steady(
    router: SocketAddr,
    name: &'static str,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Vec<i64>> {
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while !*stop.borrow() {
            let (code, body) = common::http_get(router, "/", &[("Host", &host(name))]).await;
            assert_eq!(code, 200, "request {}: {body}", seen.len());
            seen.push(file_counter(&body));
        }
        seen
    })
}

/// A steady stream of requests to a running actor through the built-in data plane:
/// under a route lease the router asks the control plane about once per lease, and
/// when the control plane is SIGKILLed and restarted every request is still served
/// (under the lease, then a stale one), each counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_actors_ride_out_a_control_plane_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let flags = ["--route-lease", "1s", "--metrics-listen", "127.0.0.1:0"];
    let cp = control_plane(&data, "127.0.0.1:0", &flags).await;
    let addr = cp.addr;
    let metrics = cp.addrs["metrics"];
    let c = client(addr);
    let _w = worker(addr, &dir.path().join("snapshots"), "w1").await;
    workers_joined(&c, 1).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    create(&c, "demo/p1").await.unwrap();
    resume(&c, "demo/p1").await.unwrap();
    let r = router(addr, &[]).await;
    let http = r.addrs["router"];
    eventually("the router watches its leases", WITHIN, || async {
        let (s, _) = common::http_get(http, "/", &[("Host", &host("p1"))]).await;
        let cached = r.metric("atenet_router_route_cached_total", &[]).await;
        (s == 200 && cached > 0.0).then_some(())
    })
    .await;

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let load = steady(http, "p1", stopped);
    let calls_before = cp_metric(metrics, "valet_control_resumes_total", &[]).await;
    eventually("100 requests under the lease", WITHIN, || async {
        (r.metric("atenet_router_route_cached_total", &[]).await >= 100.0).then_some(())
    })
    .await;
    let calls = cp_metric(metrics, "valet_control_resumes_total", &[]).await - calls_before;
    assert!(calls <= 10.0, "{calls} ResumeActor calls for 100 requests");

    cp.kill().await;
    eventually("requests served under a stale lease", WITHIN, || async {
        (r.metric("atenet_router_route_cached_total", &[("lease", "stale")])
            .await
            >= 20.0)
            .then_some(())
    })
    .await;
    let _cp = control_plane(&data, &addr.to_string(), &flags).await;
    eventually(
        "the router leased again from the new control plane",
        WITHIN,
        || async {
            let ok = r
                .metric("atenet_router_resume_attempts_total", &[("code", "OK")])
                .await;
            (ok >= 1.0).then_some(())
        },
    )
    .await;
    let before = r
        .metric("atenet_router_route_cached_total", &[("lease", "valid")])
        .await;
    eventually("served under a fresh lease", WITHIN, || async {
        let now = r
            .metric("atenet_router_route_cached_total", &[("lease", "valid")])
            .await;
        (now >= before + 50.0).then_some(())
    })
    .await;
    stop.send_replace(true);
    let seen = load.await.unwrap();
    for (i, n) in seen.iter().enumerate() {
        assert_eq!(
            *n,
            seen[0] + i as i64,
            "each request counted once: {seen:?}"
        );
    }
}

/// A control plane with `flags` (its data and the snapshots under `dir`), a worker with
/// `extra` flags attached to it through a proxy that `cut` turns into a black hole, and
/// the atespace `demo`.
async fn behind_a_black_hole(
    dir: &std::path::Path,
    flags: &[&str],
    extra: &[&str],
) -> (
    Proc,
    ateapi::control_client::ControlClient<tonic::transport::Channel>,
    tokio::sync::watch::Sender<bool>,
    Proc,
) {
    let snaps = dir.join("snapshots");
    let cp = control_plane(&dir.join("data"), "127.0.0.1:0", flags).await;
    let c = client(cp.addr);
    let (proxied, cut) = common::netfault::blackhole_proxy(cp.addr).await;
    let mut args = vec![
        "worker",
        "--control-plane",
        &proxied,
        "--snapshot-dir",
        snaps.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let w1 = Proc::start("worker", &args).await;
    workers_joined(&c, 1).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    (cp, c, cut, w1)
}

/// A worker whose attach stream alone is cut (a silent network between it and the
/// control plane) keeps serving under the leases it was given, then fences its actor
/// at its hosting lease; only after that does the control plane let the actor run on
/// another worker. Every request gets a 200 and no counter value is served twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_fences_its_actor_before_it_moves() {
    let dir = tempfile::tempdir().unwrap();
    let snaps = dir.path().join("snapshots");
    let flags = ["--route-lease", "1s", "--hosting-lease", "4s"];
    let (cp, c, cut, w1) = behind_a_black_hole(dir.path(), &flags, &["--worker-id", "w1"]).await;
    create(&c, "demo/p1").await.unwrap();
    resume(&c, "demo/p1").await.unwrap();
    let _w2 = worker(cp.addr, &snaps, "w2").await;
    workers_joined(&c, 2).await;
    let r = router(cp.addr, &["--parked-request-budget", "10s"]).await;
    let http = r.addrs["router"];

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let load = steady(http, "p1", stopped);
    eventually("served from w1", WITHIN, || async {
        (r.metric("atenet_router_requests_total", &[]).await >= 20.0).then_some(())
    })
    .await;
    cut.send_replace(true);
    eventually("p1 moved to w2", WITHIN, || async {
        let a = get(&c, "demo/p1").await.ok()?;
        (status(&a) == S::Running && a.ateom_pod_name == "w2").then_some(())
    })
    .await;
    let served = r.metric("atenet_router_requests_total", &[]).await;
    eventually("served from w2", WITHIN, || async {
        (r.metric("atenet_router_requests_total", &[]).await >= served + 20.0).then_some(())
    })
    .await;
    stop.send_replace(true);
    let seen = load.await.unwrap();
    for (i, n) in seen.iter().enumerate() {
        assert_eq!(
            *n,
            seen[0] + i as i64,
            "no counter value served twice: {seen:?}"
        );
    }
    let (code, body) = common::http_get(w1.addr, "/", &[("x-actor-ref", "demo/p1")]).await;
    assert_eq!(code, 421, "w1 fenced its actor: {body}");
    let (code, body) = common::http_get(w1.addr, "/whoami", &[("x-actor-ref", "demo/p1")]).await;
    assert_eq!(code, 421, "w1 fenced /whoami as well: {body}");
}

/// A worker cut off from the control plane ends its actor's open WebSocket at its
/// hosting lease, as it fences new requests: from then on the control plane may run
/// the actor elsewhere (before, the tunnel went on echoing indefinitely).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_closes_its_actors_open_connections() {
    use futures_util::{SinkExt as _, StreamExt as _};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_tungstenite::tungstenite::Message;
    let dir = tempfile::tempdir().unwrap();
    let (_cp, c, cut, w1) = behind_a_black_hole(
        dir.path(),
        &["--hosting-lease", "4s"],
        &["--worker-id", "e1", "--pool", "echo"],
    )
    .await;
    common::create_from(&c, "demo/ws", "echo").await.unwrap();
    resume(&c, "demo/ws").await.unwrap();
    let (mut ws, _) =
        common::websocket(w1.addr, &w1.addr.to_string(), &[("x-actor-ref", "demo/ws")]).await;
    ws.send(Message::text("hi")).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::text("hi"));
    // And an upload echoed as it streams (chunked both ways).
    let mut upload = tokio::net::TcpStream::connect(w1.addr).await.unwrap();
    upload
        .write_all(
            b"POST /echo HTTP/1.1\r\nHost: w\r\nx-actor-ref: demo/ws\r\n\
              Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("hello") {
        let mut buf = [0u8; 1024];
        let n = upload.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "the echo ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }

    cut.send_replace(true);
    let closed = async {
        loop {
            match ws.next().await {
                None | Some(Err(_) | Ok(Message::Close(_))) => return,
                Some(Ok(_)) => {}
            }
        }
    };
    tokio::time::timeout(WITHIN, closed)
        .await
        .expect("the worker closes the tunnel once its lease runs out");
    // The upload's echo, idle (its client sends nothing more), is cut, not ended as
    // if complete: the connection ends with no last chunk.
    let mut rest = Vec::new();
    tokio::time::timeout(WITHIN, upload.read_to_end(&mut rest))
        .await
        .expect("the worker ends the idle stream")
        .ok();
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        !rest.contains("0\r\n\r\n"),
        "the echo ended cleanly: {rest:?}"
    );
}

/// A route to an actor that moved while the control plane was down (its worker
/// restarted empty) is resolved again: the worker's 421 never reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_route_to_a_moved_actor_is_resolved_again() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let snaps = dir.path().join("snapshots");
    let flags = [
        "--route-lease",
        "1s",
        "--rejoin-grace",
        "1s",
        "--hosting-lease",
        "4s",
    ];
    let cp = control_plane(&data, "127.0.0.1:0", &flags).await;
    let addr = cp.addr;
    let c = client(addr);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let w1_flags = ["--listen", port.as_str()];
    let w1 = worker_with(addr, &snaps, "w1", &w1_flags).await;
    workers_joined(&c, 1).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    create(&c, "demo/p1").await.unwrap();
    let r = router(addr, &["--parked-request-budget", "15s"]).await;
    let http = r.addrs["router"];
    eventually("p1 leased", WITHIN, || async {
        let (s, _) = common::http_get(http, "/", &[("Host", &host("p1"))]).await;
        let cached = r.metric("atenet_router_route_cached_total", &[]).await;
        (s == 200 && cached > 0.0).then_some(())
    })
    .await;

    cp.kill().await;
    w1.kill().await;
    let _w1 = worker_with(addr, &snaps, "w1", &w1_flags).await;
    eventually("the router routes under a stale lease", WITHIN, || async {
        r.route_is_stale().await.then_some(())
    })
    .await;
    let request =
        tokio::spawn(async move { common::http_get(http, "/", &[("Host", &host("p1"))]).await });
    eventually(
        "the stale route met the 421 and was replayed",
        WITHIN,
        || async {
            (r.metric("atenet_router_requests_replayed_total", &[]).await >= 1.0).then_some(())
        },
    )
    .await;
    let _cp = control_plane(&data, &addr.to_string(), &flags).await;
    let (code, body) = request.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.starts_with("hello from: demo/p1 |"), "{body}");
}

/// Against a control plane that grants no lease (`--route-lease 0`) the router asks
/// for every request, as the seed's router does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_leases_every_request_asks() {
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(
        &dir.path().join("data"),
        "127.0.0.1:0",
        &["--route-lease", "0", "--metrics-listen", "127.0.0.1:0"],
    )
    .await;
    let metrics = cp.addrs["metrics"];
    let c = client(cp.addr);
    let _w = worker(cp.addr, &dir.path().join("snapshots"), "w1").await;
    workers_joined(&c, 1).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    create(&c, "demo/p1").await.unwrap();
    resume(&c, "demo/p1").await.unwrap();
    let r = router(cp.addr, &[]).await;
    let before = cp_metric(
        metrics,
        "valet_control_resumes_total",
        &[("outcome", "running")],
    )
    .await;
    for _ in 0..50 {
        let (s, _) = common::http_get(r.addrs["router"], "/", &[("Host", &host("p1"))]).await;
        assert_eq!(s, 200);
    }
    let after = cp_metric(
        metrics,
        "valet_control_resumes_total",
        &[("outcome", "running")],
    )
    .await;
    assert_eq!(after - before, 50.0, "one ResumeActor per request");
    assert_eq!(r.metric("atenet_router_route_cached_total", &[]).await, 0.0);
    let _ = demo;
}

/// Against a control plane without the extension at all (its server has no
/// `valet.leases.Leases`: the router's watch gets `Unimplemented`) the router asks for
/// every request, as the seed's router does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_a_control_plane_without_the_extension_every_request_asks() {
    use valet_control::grpc::{ControlService, WorkersService};
    use valet_proto::ateapi::control_server::ControlServer;
    use valet_proto::worker::workers_server::WorkersServer;

    let dir = tempfile::tempdir().unwrap();
    let store = valet_control::SqliteStore::open(&dir.path().join("data")).unwrap();
    let plane = valet_control::Plane::open(
        std::sync::Arc::new(store),
        valet_control::PlaneConfig::default(),
    )
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cp_addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ControlServer::new(ControlService::new(plane.clone())))
            .add_service(WorkersServer::new(WorkersService::new(plane.clone())))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                stop.clone().cancelled_owned(),
            ),
    );
    let c = client(cp_addr);
    let w = worker(cp_addr, &dir.path().join("snapshots"), "w1").await;
    workers_joined(&c, 1).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    create(&c, "demo/p1").await.unwrap();
    resume(&c, "demo/p1").await.unwrap();
    let r = router(cp_addr, &[]).await;
    for _ in 0..50 {
        let (s, _) = common::http_get(r.addrs["router"], "/", &[("Host", &host("p1"))]).await;
        assert_eq!(s, 200);
    }
    assert_eq!(
        r.metric("atenet_router_resume_attempts_total", &[("code", "OK")])
            .await,
        50.0,
        "one ResumeActor per request"
    );
    assert_eq!(r.metric("atenet_router_route_cached_total", &[]).await, 0.0);
    // The worker's attach stream would hold a graceful shutdown open: stop the
    // processes first, then the server.
    drop(r);
    drop(w);
    stop.cancel();
    server.abort();
}

/// A control plane in `dir` (with `flags`) with worker `w1` and actor `demo/p1`, and
/// a router (with `router_flags`) that has routed to it and holds its lease.
async fn leased_p1(
    dir: &std::path::Path,
    flags: &[&str],
    router_flags: &[&str],
) -> (Proc, Proc, Proc) {
    let cp = control_plane(&dir.join("data"), "127.0.0.1:0", flags).await;
    let c = client(cp.addr);
    let w1 = worker(cp.addr, &dir.join("snapshots"), "w1").await;
    workers_joined(&c, 1).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    create(&c, "demo/p1").await.unwrap();
    let r = router(cp.addr, router_flags).await;
    let http = r.addrs["router"];
    eventually("a route is cached under a lease", WITHIN, || async {
        let (s, _) = common::http_get(http, "/", &[("Host", &host("p1"))]).await;
        let leases = r.metric("atenet_router_leases_active", &[]).await;
        (s == 200 && leases == 1.0).then_some(())
    })
    .await;
    (cp, w1, r)
}

/// A control plane restarted with `--route-lease 0` grants and revokes nothing: the
/// router drops the routes it cached under the previous run's leases as soon as its
/// watch says so, instead of using them to the end of a 60 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_cached_before_a_restart_without_leases_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (cp, _w, r) = leased_p1(dir.path(), &["--route-lease", "60s"], &[]).await;
    let addr = cp.addr;
    cp.kill().await;
    let _cp = control_plane(&data, &addr.to_string(), &["--route-lease", "0"]).await;
    eventually(
        "the cached route is dropped",
        Duration::from_secs(20),
        || async { (r.metric("atenet_router_leases_active", &[]).await == 0.0).then_some(()) },
    )
    .await;
}

/// The control plane and the worker of a leased actor die together (a machine lost):
/// the router's route (stale, the plane unreachable) points at a worker that refuses
/// the connection. The request is decided again, parks, and is served once a control
/// plane and a worker are back. Before, it got `502 unreachable` at once, as did every
/// request for the stale window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_route_to_a_dead_worker_parks_instead_of_502() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let snaps = dir.path().join("snapshots");
    let flags = ["--route-lease", "2s", "--hosting-lease", "4s"];
    let (cp, w1, r) = leased_p1(dir.path(), &flags, &["--parked-request-budget", "60s"]).await;
    let addr = cp.addr;
    let http = r.addrs["router"];
    cp.kill().await;
    w1.kill().await;
    let request =
        tokio::spawn(async move { common::http_get(http, "/", &[("Host", &host("p1"))]).await });
    eventually("the request parked", WITHIN, || async {
        (r.metric("atenet_router_parking_active", &[]).await == 1.0).then_some(())
    })
    .await;
    assert!(!request.is_finished(), "no 502");
    assert_eq!(
        r.metric("atenet_router_requests_replayed_total", &[]).await,
        1.0,
        "sent through the pipeline again after the refusal"
    );
    let _cp = control_plane(&data, &addr.to_string(), &flags).await;
    let _w2 = worker(addr, &snaps, "w2").await;
    let (s, body) = tokio::time::timeout(Duration::from_secs(60), request)
        .await
        .expect("answered within its budget")
        .unwrap();
    assert_eq!(s, 200, "{body}");
    assert!(body.starts_with("hello from: demo/p1"), "{body}");
}

/// As above, a request whose body is too large to hold for a replay cannot be sent
/// through again: it gets the unreachable worker's 502, as from any route, and the
/// lease is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_route_to_a_dead_worker_502s_what_cannot_be_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--route-lease", "2s"];
    let (cp, w1, r) = leased_p1(dir.path(), &flags, &["--parked-request-budget", "60s"]).await;
    cp.kill().await;
    w1.kill().await;
    let http = r.addrs["router"];
    let (s, _, body) = common::request(http, "POST", &host("p1"), "/", vec![b'x'; 1 << 20]).await;
    assert_eq!(
        (s, String::from_utf8_lossy(&body).as_ref()),
        (502, "actor demo/p1 unreachable")
    );
    assert_eq!(
        r.metric("atenet_router_leases_active", &[]).await,
        0.0,
        "forgotten"
    );
}
