//! The router's gRPC client against the real reference control plane and a real
//! worker: wire compatibility of ResumeActor, its extension, and its errors.

mod common;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::time::Instant;
use valet_control::Plane;
use valet_embedded::{Embedded, EmbeddedConfig};
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_router::{Decision, GrpcControlPlane, Metrics, Router, RouterArgs};

const WAIT: Duration = Duration::from_secs(10);

/// One `ResumeActor` attempt for `demo/p1` with no capacity wait, within `timeout`.
fn p1_attempt(timeout: Duration) -> valet_router::control::ResumeRequest {
    valet_router::control::ResumeRequest {
        actor: "demo/p1".parse().unwrap(),
        wait_for_capacity: None,
        timeout,
        lease_holder: None,
    }
}

struct Setup {
    embedded: Embedded,
    plane: Plane,
    router: Router,
    client: ControlClient<tonic::transport::Channel>,
    _dir: tempfile::TempDir,
}

async fn setup(router_flags: &[&str]) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let embedded = Embedded::start(EmbeddedConfig::counter(dir.path().join("data"), 1))
        .await
        .unwrap();
    let url = embedded.url();
    let mut flags = vec!["--control-plane", &url];
    flags.extend_from_slice(router_flags);
    let config = RouterArgs::try_parse_flags(flags)
        .unwrap()
        .resolve()
        .unwrap();
    let cp = GrpcControlPlane::connect_lazy(config.control_plane(), config.credentials()).unwrap();
    let router = Router::new(Arc::new(config), Arc::new(cp), Arc::new(Metrics::new()));
    let client = ControlClient::new(
        tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect_lazy(),
    );
    let mut c = client.clone();
    c.create_atespace(ateapi::CreateAtespaceRequest {
        name: "demo".into(),
    })
    .await
    .unwrap();
    for a in ["p1", "p2", "p3"] {
        c.create_actor(ateapi::CreateActorRequest {
            actor_ref: Some(ateapi::ActorRef {
                atespace: "demo".into(),
                name: a.into(),
            }),
            actor_template_namespace: "default".into(),
            actor_template_name: "counter".into(),
            worker_selector: None,
        })
        .await
        .unwrap();
    }
    Setup {
        plane: embedded.plane.clone(),
        embedded,
        router,
        client,
        _dir: dir,
    }
}

fn host(name: &str) -> String {
    format!("{name}.demo.actors.resources.substrate.ate.dev")
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

#[tokio::test]
async fn routes_parks_and_is_handed_a_freed_worker() {
    let s = setup(&[]).await;
    let d = s.router.decide(&host("p1"), deadline()).await;
    match &d {
        Decision::Route(r) => assert_eq!(r.addr, s.embedded.workers[0].app_addr()),
        other => panic!("{other:?}"),
    }

    let parked = {
        let router = s.router.clone();
        tokio::spawn(async move { router.decide(&host("p2"), deadline()).await })
    };
    assert!(
        s.plane
            .wait_until(WAIT, |p| p.waiters("counter") == 1)
            .await,
        "the router's second attempt waits for capacity at the control plane"
    );
    assert_eq!(s.router.lot().active(), 1);
    s.client
        .clone()
        .suspend_actor(ateapi::SuspendActorRequest {
            actor_ref: Some(ateapi::ActorRef {
                atespace: "demo".into(),
                name: "p1".into(),
            }),
        })
        .await
        .unwrap();
    let d = parked.await.unwrap();
    assert!(
        matches!(d, Decision::Route(ref r) if r.addr == s.embedded.workers[0].app_addr()),
        "{d:?}"
    );
    assert_eq!(
        s.plane.resume_calls_for("demo", "p2"),
        2,
        "one quick attempt, then one call that waited: no polling"
    );
    assert_eq!(s.plane.stats().handoffs, 1);
    assert_eq!(s.router.lot().active(), 0);
    assert_eq!(
        s.router.metrics().sample(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "served")]
        ),
        1.0
    );
    s.embedded.shutdown().await;
}

#[tokio::test]
async fn budget_exhausted_and_not_found_bodies_come_from_the_control_plane() {
    let s = setup(&["--parked-request-budget", "300ms"]).await;
    assert!(matches!(
        s.router.decide(&host("p1"), deadline()).await,
        Decision::Route(_)
    ));
    let d = s.router.decide(&host("p2"), deadline()).await;
    assert_eq!(d.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    let Decision::Deny(_, v) = &d else {
        unreachable!()
    };
    assert_eq!(
        v.body(),
        "actor demo/p2 unavailable: no worker has room for the actor"
    );
    assert_eq!(v.retry_after_secs(), Some(1));

    let d = s.router.decide(&host("nope"), deadline()).await;
    let Decision::Deny(_, v) = &d else {
        panic!("{d:?}")
    };
    assert_eq!(
        (v.status().as_u16(), v.body()),
        (404, "actor demo/nope not found")
    );
    s.embedded.shutdown().await;
}

#[tokio::test]
async fn unreachable_control_plane_is_unavailable_after_the_budget() {
    // A port nothing listens on.
    let port = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let config =
        RouterArgs::try_parse_flags(["--control-plane", &url, "--parked-request-budget", "300ms"])
            .unwrap()
            .resolve()
            .unwrap();
    let cp = GrpcControlPlane::connect_lazy(config.control_plane(), config.credentials()).unwrap();
    let router = Router::new(Arc::new(config), Arc::new(cp), Arc::new(Metrics::new()));
    let d = router.decide(&host("p1"), deadline()).await;
    let Decision::Deny(_, v) = &d else {
        panic!("{d:?}")
    };
    assert_eq!(
        (v.status().as_u16(), v.body()),
        (503, "actor demo/p1 unavailable")
    );
    assert!(
        router.metrics().sample(
            "atenet_router_resume_attempts_total",
            &[("code", "UNAVAILABLE")]
        ) >= 2.0,
        "parked and retried"
    );
}

/// A control plane that goes silent mid-wait (every packet dropped, no reset) is
/// noticed by the client's pings: the parked request gets the budget's 503, not the
/// decision deadline's 504.
#[tokio::test]
async fn silent_control_plane_is_unavailable_not_a_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let embedded = Embedded::start(EmbeddedConfig::counter(dir.path().join("data"), 1))
        .await
        .unwrap();
    let plane = embedded.plane.clone();
    plane.catalog().create_atespace("demo").await.unwrap();
    for a in ["p1", "p2"] {
        let key = valet_control::ActorKey::new("demo", a).unwrap();
        plane
            .catalog()
            .create_actor(key, "default", "counter", Vec::new())
            .await
            .unwrap();
    }
    let (url, drop_all) = common::netfault::blackhole_proxy(embedded.addr).await;
    let config =
        RouterArgs::try_parse_flags(["--control-plane", &url, "--parked-request-budget", "2s"])
            .unwrap()
            .resolve()
            .unwrap();
    let decision_timeout = config.decision_timeout();
    let cp = GrpcControlPlane::connect_lazy(config.control_plane(), config.credentials()).unwrap();
    let router = Router::new(Arc::new(config), Arc::new(cp), Arc::new(Metrics::new()));
    let d = router
        .decide(&host("p1"), Instant::now() + decision_timeout)
        .await;
    assert!(matches!(d, Decision::Route(_)), "{d:?}");

    let parked = {
        let router = router.clone();
        tokio::spawn(async move {
            router
                .decide(&host("p2"), Instant::now() + decision_timeout)
                .await
        })
    };
    assert!(
        plane.wait_until(WAIT, |p| p.waiters("counter") == 1).await,
        "the attempt waits at the control plane"
    );
    drop_all.send_replace(true);
    let d = parked.await.unwrap();
    let Decision::Deny(_, v) = &d else {
        panic!("{d:?}")
    };
    assert_eq!(
        (v.status().as_u16(), v.body()),
        (503, "actor demo/p2 unavailable")
    );
    assert_eq!(
        router.metrics().sample(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "budget_exhausted")]
        ),
        1.0
    );
    embedded.shutdown().await;
}

/// A control plane that takes the call and never answers gives `DeadlineExceeded`
/// every time (the verdict table's 504), never `Unavailable`. Before, tonic's own
/// timer (from `grpc-timeout`) raced the router's, and when both fired in the same
/// millisecond the attempt counted as a transport failure, one run in several.
#[tokio::test]
async fn an_attempt_no_one_answers_is_always_deadline_exceeded() {
    use valet_router::ControlPlane as _;
    let url = common::netfault::unanswering_server().await;
    let config = RouterArgs::try_parse_flags(["--control-plane", &url])
        .unwrap()
        .resolve()
        .unwrap();
    let cp = GrpcControlPlane::connect_lazy(config.control_plane(), config.credentials()).unwrap();
    let mut codes = std::collections::BTreeMap::new();
    for _ in 0..60 {
        let e = cp
            .resume_actor(p1_attempt(Duration::from_millis(20)))
            .await
            .unwrap_err();
        *codes.entry(format!("{:?}", e.code())).or_insert(0) += 1;
    }
    assert_eq!(
        codes,
        std::collections::BTreeMap::from([("DeadlineExceeded".to_owned(), 60)])
    );
}

/// A replica that answers `Unavailable` itself (its database write failed) is left
/// for the next one on the next attempt. Before, only a replica that could not be
/// reached was, and every attempt went back to the refusing one.
#[tokio::test]
async fn a_replica_that_answers_unavailable_is_left_for_the_next() {
    use valet_router::ControlPlane as _;
    let s = setup(&[]).await;
    let refusing = common::netfault::unavailable_server().await;
    let config = RouterArgs::try_parse_flags(["--control-plane", &refusing])
        .unwrap()
        .resolve()
        .unwrap();
    let cp = GrpcControlPlane::replicas(
        &[refusing, s.embedded.url()],
        config.credentials(),
        config.control_plane_ping_interval(),
    )
    .unwrap();
    let attempt = || cp.resume_actor(p1_attempt(WAIT));
    let first = attempt().await.unwrap_err();
    assert_eq!(
        (first.code(), first.message()),
        (tonic::Code::Unavailable, "the database write failed")
    );
    let second = attempt()
        .await
        .expect("the second attempt goes to the live replica");
    assert_eq!(second.actor.status, ateapi::actor::Status::Running as i32);
    s.embedded.shutdown().await;
}

/// A `--control-plane` host name with several addresses (a headless Service) is a
/// replica per address, each connected under the name: attempts are spread over them
/// and one refusing is left for the next. A name that cannot be resolved keeps its
/// replicas; one that resolves to fewer addresses drops the others. Before, the name
/// was one replica, whatever it resolved to.
#[tokio::test]
async fn a_name_with_several_addresses_is_a_replica_per_address() {
    use std::net::SocketAddr;
    use valet_router::ControlPlane as _;
    let s = setup(&[]).await;
    let at = |url: &str| -> SocketAddr { url.strip_prefix("http://").unwrap().parse().unwrap() };
    let refusing = at(&common::netfault::unavailable_server().await);
    let live = at(&s.embedded.url());
    // `.invalid` never resolves through the system's resolver.
    let cp = GrpcControlPlane::replicas(
        &["http://replicas.invalid:7070".to_owned()],
        &Default::default(),
        None,
    )
    .unwrap();
    let attempt = || cp.resume_actor(p1_attempt(WAIT));
    let outcome = |r: Result<valet_router::control::Resumed, valet_router::ResumeError>| match r {
        Ok(r) => format!("status {}", r.actor.status),
        Err(e) => format!("{:?}: {}", e.code(), e.message()),
    };
    assert_eq!(cp.addresses(), [None], "by name until resolved");
    assert_eq!(
        attempt().await.unwrap_err().code(),
        tonic::Code::Unavailable
    );

    let resolved = std::sync::Mutex::new(Ok(vec![live, refusing, live]));
    let resolve = async |host: &str, port: u16| {
        assert_eq!((host, port), ("replicas.invalid", 7070));
        match &*resolved.lock().unwrap() {
            Ok(addrs) => Ok(addrs.clone()),
            Err(()) => Err(std::io::Error::other("no such name")),
        }
    };
    cp.resolve_again_with(resolve).await;
    let mut both = vec![Some(live), Some(refusing)];
    both.sort_unstable();
    assert_eq!(cp.addresses(), both, "one replica per address, once each");
    let mut seen = vec![outcome(attempt().await), outcome(attempt().await)];
    seen.sort_unstable();
    let running = format!("status {}", ateapi::actor::Status::Running as i32);
    assert_eq!(
        seen,
        [
            "Unavailable: the database write failed".to_owned(),
            running.clone()
        ],
        "two attempts, one on each address"
    );
    assert_eq!(
        outcome(attempt().await),
        running,
        "the refusing one is passed over"
    );

    *resolved.lock().unwrap() = Err(());
    cp.resolve_again_with(resolve).await;
    assert_eq!(
        cp.addresses(),
        both,
        "kept while the name cannot be resolved"
    );

    *resolved.lock().unwrap() = Ok(vec![live]);
    cp.resolve_again_with(resolve).await;
    assert_eq!(cp.addresses(), [Some(live)]);
    for _ in 0..3 {
        assert_eq!(outcome(attempt().await), running);
    }
    s.embedded.shutdown().await;
}

/// A replica pinned to an address that refuses connections (a dual-stack name whose
/// server listens on one family, or an address already gone) connects by its name
/// instead. Before, each of its attempts failed until the next resolution.
#[tokio::test]
async fn a_pinned_address_that_refuses_falls_back_to_the_name() {
    use valet_router::ControlPlane as _;
    let s = setup(&[]).await;
    let live: std::net::SocketAddr = s
        .embedded
        .url()
        .strip_prefix("http://")
        .unwrap()
        .parse()
        .unwrap();
    // 127.0.0.2 is loopback too, and nothing listens on the port there.
    let refused = std::net::SocketAddr::from(([127, 0, 0, 2], live.port()));
    let cp = GrpcControlPlane::replicas(
        &[format!("http://localhost:{}", live.port())],
        &Default::default(),
        None,
    )
    .unwrap();
    cp.resolve_again_with(async |_, _| Ok(vec![refused])).await;
    assert_eq!(cp.addresses(), [Some(refused)]);
    let resumed = cp
        .resume_actor(p1_attempt(WAIT))
        .await
        .expect("served through the name");
    assert_eq!(resumed.actor.status, ateapi::actor::Status::Running as i32);
    s.embedded.shutdown().await;
}

/// `--control-plane-ping-interval`: the router pings an idle control plane at that
/// interval, and with 0 sends it nothing between calls (a grpc-go server closes a
/// connection that pings while no call is open). Before, it pinged every 2 s, always.
/// The window below is how long idleness is watched, not a synchronization.
#[tokio::test]
async fn an_idle_control_plane_is_pinged_as_configured() {
    use std::sync::atomic::Ordering;
    use valet_router::ControlPlane as _;
    let server = common::netfault::unavailable_server().await;
    let idle_bytes = |ping: &'static str| {
        let server = server.clone();
        async move {
            let (url, sent) = common::netfault::counting_proxy(&server).await;
            let config = RouterArgs::try_parse_flags([
                "--control-plane",
                url.as_str(),
                "--control-plane-ping-interval",
                ping,
            ])
            .unwrap()
            .resolve()
            .unwrap();
            let cp = GrpcControlPlane::replicas(
                config.control_planes(),
                config.credentials(),
                config.control_plane_ping_interval(),
            )
            .unwrap();
            let answered = cp.resume_actor(p1_attempt(WAIT)).await;
            assert!(answered.is_err(), "the server answers UNAVAILABLE");
            let before = sent.load(Ordering::Relaxed);
            assert!(before > 0, "the call went through the proxy");
            tokio::time::sleep(Duration::from_millis(3500)).await;
            sent.load(Ordering::Relaxed) - before
        }
    };
    let (pinged, quiet) = tokio::join!(idle_bytes("1s"), idle_bytes("0"));
    assert!(
        pinged > 0,
        "no ping in 3.5 s with --control-plane-ping-interval 1s"
    );
    assert_eq!(
        quiet, 0,
        "bytes sent while idle with --control-plane-ping-interval 0"
    );
}
