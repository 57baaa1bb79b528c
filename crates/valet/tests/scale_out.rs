//! Control planes on PostgreSQL, as real processes over a throwaway PostgreSQL server:
//! one replica active, another waiting as a standby; the active one SIGKILLed while
//! requests park: the standby takes over, workers re-attach to it, routers listing
//! both replicas serve every request within its budget, and nothing acknowledged is
//! lost. Also: the configuration rules of `--database`, a schema newer than the
//! binary, and a lost database.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Proc, eventually, http_get};
use valet_control::tempdb::TempPostgres;
use valet_proto::ateapi;

const WITHIN: Duration = Duration::from_secs(60);

fn replica_args<'a>(
    listen: &'a str,
    metrics: &'a str,
    url: &'a str,
    data: &'a str,
) -> Vec<&'a str> {
    vec![
        "control-plane",
        "--listen",
        listen,
        "--database",
        url,
        "--data-dir",
        data,
        "--metrics-listen",
        metrics,
        "--rejoin-grace",
        "5s",
    ]
}

/// Two replicas on `url` with `--active-replicas one`, both on `127.0.0.1:0`: the
/// first active (listening), the second a standby (its gRPC port bound, its probes
/// saying `standby`).
async fn active_and_standby(url: &str, data: &str, logged: bool) -> (Proc, Proc) {
    let start = |part: &'static str| {
        let mut args = replica_args("127.0.0.1:0", "127.0.0.1:0", url, data);
        args.extend(["--active-replicas", "one"]);
        async move {
            if logged {
                Proc::start_logged(part, &args).await
            } else {
                Proc::start(part, &args).await
            }
        }
    };
    let active = start("control-plane").await;
    let standby = start("bound control-plane").await;
    let metrics = standby.addrs["metrics"];
    eventually("the standby's probes answer", WITHIN, || async {
        let ready = common::try_http_get(metrics, "/readyz", &[]).await?;
        (ready.0 == 503 && ready.1.contains("standby")).then_some(())
    })
    .await;
    (active, standby)
}

/// `valet worker` processes listing `replicas`, one per id, sharing `snapshots`.
async fn workers(replicas: &str, snapshots: &std::path::Path, ids: &[&str]) -> Vec<Proc> {
    let mut out = Vec::new();
    for id in ids {
        let args = [
            "worker",
            "--control-plane",
            replicas,
            "--snapshot-dir",
            snapshots.to_str().unwrap(),
            "--worker-id",
            id,
        ];
        out.push(Proc::start("worker", &args).await);
    }
    out
}

/// A `valet router` listing `replicas`, with parking budget `budget` (HTTP data plane
/// and admin server; no ext_proc).
async fn router(replicas: &str, budget: &str) -> Proc {
    Proc::start(
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
            replicas,
            "--parked-request-budget",
            budget,
        ],
    )
    .await
}

/// The router's resume attempts answered `Unavailable` (or failed to reach a replica).
async fn unavailable_attempts(router: &Proc) -> f64 {
    router
        .metric(
            "atenet_router_resume_attempts_total",
            &[("code", "UNAVAILABLE")],
        )
        .await
}

/// Waits until `standby` has taken over: its probes say ready.
async fn taken_over(standby: &Proc) {
    let metrics = standby.addrs["metrics"];
    eventually("the standby takes over", WITHIN, || async {
        let ready = common::try_http_get(metrics, "/readyz", &[]).await?;
        (ready.0 == 200).then_some(())
    })
    .await;
}

fn host(name: &str) -> String {
    format!("{name}.demo.{}", common::DOMAIN)
}

/// Two replicas on `url` serving together (`--active-replicas all`, the default),
/// both on `127.0.0.1:0`, each ready.
async fn both_serving(url: &str, data: &str) -> (Proc, Proc) {
    let args = replica_args("127.0.0.1:0", "127.0.0.1:0", url, data);
    let a = Proc::start_logged("control-plane", &args).await;
    let b = Proc::start_logged("control-plane", &args).await;
    for r in [&a, &b] {
        taken_over(r).await;
    }
    (a, b)
}

/// Worker ids (`w<n>`) whose first replica of two is the first listed (the worker
/// picks it by its id's FNV-1a hash, as `valet worker` does).
fn ids_attaching_first(n: usize) -> Vec<String> {
    let fnv = |id: &str| {
        id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    (0..)
        .map(|i| format!("w{i}"))
        .filter(|id| fnv(id) % 2 == 0)
        .take(n)
        .collect()
}

/// How a replica is stopped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// SIGKILL: declared dead by the other after 5 s without a heartbeat.
    Kill,
    /// SIGTERM: it answers its waiters `Unavailable`, declares itself gone, exits 0.
    Term,
}

/// Two replicas serve together; one is SIGKILLed while requests wait for capacity
/// (parked in the router, their attempts waiting on both replicas) and while both
/// workers are attached to it. The workers re-attach to the other replica keeping
/// their actors RUNNING (with their memory), the parked requests are served through
/// the other replica within their budget once it frees workers, the dead replica is
/// declared so, and nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_s_parked_requests_are_served_through_the_other() {
    one_replica_stops_mid_parking(Stop::Kill).await;
}

/// The same with SIGTERM (a rolling update's stop): the replica exits 0 having
/// declared itself gone, and the rest goes as after SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_serving_replica_s_parked_requests_are_served_through_the_other() {
    one_replica_stops_mid_parking(Stop::Term).await;
}

async fn one_replica_stops_mid_parking(stop: Stop) {
    let pg = TempPostgres::start_async().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("unused");
    let data = data.to_str().unwrap();
    let url = pg.url();
    let (mut doomed, survivor) = both_serving(&url, data).await;
    let replicas = format!("http://{},http://{}", doomed.addr, survivor.addr);
    let ids = ids_attaching_first(2);
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let _workers = workers(&replicas, &dir.path().join("snapshots"), &ids).await;
    let on_doomed = common::client(doomed.addr);
    common::workers_and_demo(&on_doomed, 2, &["p1", "p2", "p3", "p4"].map(String::from)).await;
    let router = router(&replicas, "30s").await;
    let get = |name: &'static str| {
        let addr = router.addrs["router"];
        async move { http_get(addr, "/", &[("Host", &host(name))]).await }
    };
    for (name, count) in [("p1", 1), ("p1", 2), ("p2", 1)] {
        let (status, body) = get(name).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(&format!("memory count: {count}")), "{body}");
    }
    // Both workers are the doomed replica's.
    let c = common::client(survivor.addr);
    let workers_of = |replica: &'static str| {
        let url = url.clone();
        async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            let task = tokio::spawn(conn);
            let n: i64 = client
                .query_one(
                    &format!("SELECT count(*) FROM valet_workers WHERE replica {replica}"),
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            drop(client);
            let _ = task.await;
            n
        }
    };
    assert_eq!(
        workers_of("= 1").await,
        2,
        "both attached to the first replica"
    );

    // p3 and p4 park: the pool is full.
    let parked: Vec<_> = ["p3", "p4"]
        .into_iter()
        .map(|n| tokio::spawn(get(n)))
        .collect();
    eventually("two requests parked", WITHIN, || async {
        let n = router.metric("atenet_router_parking_active", &[]).await;
        (n == 2.0).then_some(())
    })
    .await;
    match stop {
        Stop::Kill => doomed.kill().await,
        Stop::Term => {
            doomed.terminate();
            assert_eq!(doomed.exit_code(WITHIN).await, Some(0), "a clean exit");
        }
    }

    // The workers attach to the survivor, keeping their actors.
    eventually(
        "both workers re-attached to the other replica",
        WITHIN,
        || async { (workers_of("= 2").await == 2).then_some(()) },
    )
    .await;
    let (status, body) = get("p1").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("memory count: 3"), "p1 kept running: {body}");
    // Capacity frees on the survivor: each freed worker goes to a parked request.
    for name in ["demo/p1", "demo/p2"] {
        eventually("the suspend goes through", WITHIN, || async {
            common::suspend(&c, name).await.ok()
        })
        .await;
    }
    for r in parked {
        let (status, body) = r.await.unwrap();
        assert_eq!(status, 200, "served through the other replica: {body}");
        assert!(body.contains("memory count: 1"), "{body}");
    }
    if stop == Stop::Kill {
        eventually("the killed replica is declared dead", WITHIN, || async {
            survivor
                .logs()
                .contains("declared a silent replica dead")
                .then_some(())
        })
        .await;
    }
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    let dead: bool = client
        .query_one("SELECT dead FROM valet_replicas WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        dead,
        "the stopped replica's row is dead (its writes fenced)"
    );
    drop(client);
    let _ = task.await;
    // Nothing acknowledged was lost.
    let actors = c
        .clone()
        .list_actors(ateapi::ListActorsRequest {
            atespace: "demo".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .actors;
    let states: Vec<(String, i32)> = actors
        .iter()
        .map(|a| (a.actor_id.clone(), a.status))
        .collect();
    let (running, suspended) = (
        ateapi::actor::Status::Running as i32,
        ateapi::actor::Status::Suspended as i32,
    );
    assert_eq!(
        states,
        [
            ("p1".into(), suspended),
            ("p2".into(), suspended),
            ("p3".into(), running),
            ("p4".into(), running),
        ]
    );
    assert_eq!(
        http_get(survivor.addrs["metrics"], "/readyz", &[]).await.0,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_a_killed_replica_and_parked_requests_are_served() {
    let pg = TempPostgres::start_async().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("unused");
    let data = data.to_str().unwrap();
    let url = pg.url();
    // The second waits for the database's active lock, not listening for gRPC; its
    // probes say it is alive but not ready.
    let (first, second) = active_and_standby(&url, data, true).await;
    let replicas = format!("http://{},http://{}", first.addr, second.addr);
    let b_metrics = second.addrs["metrics"];
    assert_eq!(http_get(b_metrics, "/healthz", &[]).await.0, 200);

    let _workers = workers(&replicas, &dir.path().join("snapshots"), &["w1", "w2"]).await;
    let c = common::client(first.addr);
    common::workers_and_demo(&c, 2, &["p1", "p2", "p3", "p4"].map(String::from)).await;
    let router = router(&replicas, "30s").await;
    let get = |name: &'static str| {
        let addr = router.addrs["router"];
        async move { http_get(addr, "/", &[("Host", &host(name))]).await }
    };
    let (status, body) = get("p1").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("count: 1"), "{body}");

    // The active replica dies while requests are in flight and more arrive: they
    // park (each attempt Unavailable) until the standby has taken over.
    let in_flight: Vec<_> = ["p1", "p2", "p1", "p2"]
        .into_iter()
        .map(|n| tokio::spawn(get(n)))
        .collect();
    first.kill().await;
    let next: Vec<_> = ["p2", "p1"]
        .into_iter()
        .map(|n| tokio::spawn(get(n)))
        .collect();
    taken_over(&second).await;
    for r in in_flight.into_iter().chain(next) {
        let (status, body) = r.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    assert!(
        unavailable_attempts(&router).await >= 1.0,
        "requests parked while no replica was active"
    );

    // Nothing acknowledged was lost: every actor created on the first replica is
    // there, and p1's memory survived (its worker kept it running).
    let c = common::client(second.addr);
    let actors = c
        .clone()
        .list_actors(ateapi::ListActorsRequest {
            atespace: "demo".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .actors;
    let mut names: Vec<String> = actors.iter().map(|a| a.actor_id.clone()).collect();
    names.sort();
    assert_eq!(names, ["p1", "p2", "p3", "p4"]);
    eventually(
        "both workers re-attached to the new replica",
        WITHIN,
        || async {
            let n = c
                .clone()
                .list_workers(())
                .await
                .ok()?
                .into_inner()
                .workers
                .len();
            (n == 2).then_some(())
        },
    )
    .await;
    let (status, body) = get("p1").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("count: 5"),
        "p1 counted every request: {body}"
    );
    assert!(
        second.logs().contains("active on the database"),
        "{}",
        second.logs()
    );

    // Its probes reflect the database.
    let metrics = second.addrs["metrics"];
    assert_eq!(http_get(metrics, "/readyz", &[]).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_rules_a_newer_schema_and_a_lost_database() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let run = |args: Vec<String>| async move {
        let out = tokio::time::timeout(
            WITHIN,
            tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
                .args(&args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("{args:?} did not exit"))
        .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["control-plane", "--listen", "127.0.0.1:0", "--data-dir"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        v.push(data.to_str().unwrap().to_owned());
        v.extend(extra.iter().map(|s| (*s).to_owned()));
        v
    };
    // Route leases are not shared across replicas yet: an explicit one is refused.
    let (code, err) = run(args(&["--database", &url, "--route-lease", "5s"])).await;
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("--route-lease") && err.lines().count() == 1,
        "{err}"
    );
    let (code, err) = run(args(&["--database", "mysql://db/x"])).await;
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("--database"), "{err}");

    // A live replica, then its database gone: it stops serving and exits 1.
    let mut cp = Proc::start_logged(
        "control-plane",
        &[
            "control-plane",
            "--listen",
            "127.0.0.1:0",
            "--database",
            &url,
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .await;
    assert_eq!(http_get(cp.addrs["metrics"], "/readyz", &[]).await.0, 200);
    // A schema newer than the binary: refused at start, in one line, exit 1.
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    client
        .batch_execute("UPDATE valet_schema SET version = version + 1")
        .await
        .unwrap();
    let (code, err) = run(args(&["--database", &url])).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("newer than this binary") && err.lines().count() == 1,
        "{err}"
    );
    // Every connection of the live replica cut, as a database restart would: it
    // stops serving, and, waiting to be active again, finds the newer schema: a newer
    // version took the database over, so it exits 1.
    client
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'valet control-plane'",
        )
        .await
        .unwrap();
    drop(client);
    let _ = task.await;
    assert_eq!(cp.exit_code(WITHIN).await, Some(1));
    // Its stderr is read by a task of its own: wait for the last line to be read.
    eventually("the newer-schema line", WITHIN, || async {
        cp.logs()
            .lines()
            .any(|l| l.starts_with("valet control-plane: ") && l.contains("newer than this binary"))
            .then_some(())
    })
    .await;
    let logs = cp.logs();
    assert!(logs.contains("lost the database"), "{logs}");
}

/// The database restarts under an active replica and a standby: neither process
/// ends. While it is down both are standbys (`/readyz` 503); once it is back one of
/// them is active again, on its same port, with every acknowledged record; SIGTERM
/// then stops both with 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_replicas_ride_out_a_database_restart() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (mut a, mut b) = active_and_standby(&url, data.to_str().unwrap(), true).await;
    let c = common::client(a.addr);
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    common::create(&c, "demo/p1").await.unwrap();

    pg.stop().await;
    let ready = |p: &Proc| {
        let metrics = p.addrs["metrics"];
        async move { common::try_http_get(metrics, "/readyz", &[]).await }
    };
    eventually("the active replica stops serving", WITHIN, || async {
        let r = ready(&a).await?;
        (r.0 == 503 && r.1.contains("standby")).then_some(())
    })
    .await;
    assert_eq!(ready(&b).await.unwrap().0, 503);
    for p in [&mut a, &mut b] {
        assert!(p.child.try_wait().unwrap().is_none(), "{}", p.logs());
    }

    pg.start_again().await;
    let active = eventually("a replica is active again", WITHIN, || async {
        for p in [&a, &b] {
            if ready(p).await.is_some_and(|r| r.0 == 200) {
                let addr = p.addrs["bound control-plane"];
                return Some(addr);
            }
        }
        None
    })
    .await;
    assert!(
        [
            a.addrs["bound control-plane"],
            b.addrs["bound control-plane"]
        ]
        .contains(&active)
    );
    let p1 = common::get(&common::client(active), "demo/p1")
        .await
        .unwrap();
    assert_eq!(p1.actor_id, "p1");
    for mut p in [a, b] {
        p.terminate();
        assert_eq!(p.exit_code(WITHIN).await, Some(0), "{}", p.logs());
    }
}

/// The database restarts under two replicas serving together: neither process ends.
/// While it is down both stop serving (`/readyz` 503: their heartbeats fail); once it
/// is back both serve again (each joined again as a new replica), with every
/// acknowledged record; SIGTERM then stops both with 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_serving_replicas_ride_out_a_database_restart() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (mut a, mut b) = both_serving(&url, data.to_str().unwrap()).await;
    let c = common::client(a.addr);
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    common::create(&c, "demo/p1").await.unwrap();

    pg.stop().await;
    let ready = |p: &Proc| {
        let metrics = p.addrs["metrics"];
        async move { common::try_http_get(metrics, "/readyz", &[]).await }
    };
    for p in [&a, &b] {
        eventually("the replica stops serving", WITHIN, || async {
            (ready(p).await?.0 == 503).then_some(())
        })
        .await;
    }
    for p in [&mut a, &mut b] {
        assert!(p.child.try_wait().unwrap().is_none(), "{}", p.logs());
    }

    pg.start_again().await;
    for p in [&a, &b] {
        taken_over(p).await;
        let p1 = common::get(&common::client(p.addr), "demo/p1")
            .await
            .unwrap();
        assert_eq!(p1.actor_id, "p1");
    }
    for mut p in [a, b] {
        p.terminate();
        assert_eq!(p.exit_code(WITHIN).await, Some(0), "{}", p.logs());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_every_interface_advertises_a_reachable_address() {
    let dir = tempfile::tempdir().unwrap();
    let snapshots = dir.path().join("snapshots");
    let snapshots = snapshots.to_str().unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "worker",
            "--listen",
            "0.0.0.0:0",
            "--snapshot-dir",
            snapshots,
        ])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("--listen=0.0.0.0:0"), "{err}");
    assert!(err.contains("--advertise-address"), "{err}");
    // Told the address to advertise, it reports it (with the port it bound), and the
    // app answers there.
    let w = Proc::start(
        "worker",
        &[
            "worker",
            "--listen",
            "0.0.0.0:0",
            "--advertise-address",
            "127.0.0.1",
            "--snapshot-dir",
            snapshots,
            "--control-plane",
            "http://127.0.0.1:9",
        ],
    )
    .await;
    assert_eq!(w.addr.ip(), std::net::IpAddr::from([127, 0, 0, 1]));
    assert!(common::try_http_get(w.addr, "/", &[]).await.is_some());
}

/// Two replicas serving together on one PostgreSQL, 20 workers attached with both
/// addresses (spread over both replicas), 200 concurrent resumes of 200 actors sent
/// through the router's replica client with both addresses (spread over both):
/// exactly 20 actors RUNNING, on 20 different workers, in the database as in the
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_resumes_over_both_replicas_fill_twenty_workers_once() {
    use valet_router::control::{ControlPlane, GrpcControlPlane, ResumeRequest};
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("unused");
    let data = data.to_str().unwrap();
    let (first, second) = both_serving(&url, data).await;
    let (a, b) = (first.addr, second.addr);
    let urls = vec![format!("http://{b}"), format!("http://{a}")];
    let mut workers = Vec::new();
    for i in 0..20 {
        workers.push(
            valet_worker::Worker::spawn(valet_worker::WorkerConfig {
                control_plane: urls.join(","),
                credentials: Default::default(),
                pool: "counter".into(),
                listen: "127.0.0.1:0".parse().unwrap(),
                snapshot_dir: dir.path().join("snapshots"),
                restore_delay: Duration::ZERO,
                worker_id: Some(format!("w{i:02}")),
                advertise: None,
                templates: Default::default(),
                run_dir: dir.path().join("snapshots").with_file_name("run"),
                snapshot_max_bytes: valet_worker::DEFAULT_SNAPSHOT_MAX_BYTES,
                cgroup: None,
            })
            .await
            .unwrap(),
        );
    }
    let c = common::client(first.addr);
    common::workers_and_demo(
        &c,
        20,
        &(0..200).map(|i| format!("a{i:03}")).collect::<Vec<_>>(),
    )
    .await;

    let cp = std::sync::Arc::new(
        GrpcControlPlane::replicas(
            &urls,
            &Default::default(),
            Some(valet_router::control::PING_INTERVAL),
        )
        .unwrap(),
    );
    let resumes: Vec<_> = (0..200)
        .map(|i| {
            let cp = std::sync::Arc::clone(&cp);
            tokio::spawn(async move {
                let req = || ResumeRequest {
                    actor: valet_router::addr::ActorRef::new("demo", &format!("a{i:03}")).unwrap(),
                    wait_for_capacity: None,
                    timeout: Duration::from_secs(30),
                    lease_holder: None,
                };
                // As a parked request would: an attempt that another replica's
                // operation holds (Aborted) is retried.
                for _ in 0..50 {
                    match cp.resume_actor(req()).await {
                        Err(e) if e.code() == tonic::Code::Aborted => continue,
                        other => return other.map(|r| r.actor.ateom_pod_ip),
                    }
                }
                panic!("a{i:03}: every attempt Aborted");
            })
        })
        .collect();
    let mut served = 0;
    for r in resumes {
        match r.await.unwrap() {
            Ok(_) => served += 1,
            Err(e) => assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}"),
        }
    }
    assert_eq!(served, 20);

    // In the database: 20 RUNNING, on 20 different workers.
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    let running: i64 = client
        .query_one(
            "SELECT count(*) FROM actors WHERE status = $1",
            &[&valet_control::ActorStatus::Running.wire()],
        )
        .await
        .unwrap()
        .get(0);
    let workers_used: i64 = client
        .query_one(
            "SELECT count(DISTINCT worker) FROM actors WHERE worker IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let claimed: i64 = client
        .query_one("SELECT count(*) FROM actors WHERE worker IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((running, claimed, workers_used), (20, 20, 20));
    // Both replicas took part: each had workers attached.
    let per_replica: i64 = client
        .query_one("SELECT count(DISTINCT replica) FROM valet_workers", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(per_replica, 2, "workers spread over both replicas");
    drop(client);
    let _ = task.await;
    drop(second);
    for w in workers {
        w.shutdown().await;
    }
}

/// One control plane, two workers held by running actors, 8 requests for 8 suspended
/// actors sent through `routers` routers, then one worker freed: the (served, 503)
/// counts.
async fn overflow_counts(routers: usize) -> (usize, usize) {
    let dir = tempfile::tempdir().unwrap();
    let cp = common::control_plane(
        &dir.path().join("data"),
        "127.0.0.1:0",
        &["--metrics-listen", "127.0.0.1:0"],
    )
    .await;
    let snapshots = dir.path().join("snapshots");
    let _w1 = common::worker(cp.addr, &snapshots, "w1").await;
    let _w2 = common::worker(cp.addr, &snapshots, "w2").await;
    let c = common::client(cp.addr);
    let overflow: Vec<String> = (1..=8).map(|i| format!("o{i}")).collect();
    let mut actors = vec!["h1".to_owned(), "h2".to_owned()];
    actors.extend(overflow.iter().cloned());
    common::workers_and_demo(&c, 2, &actors).await;
    let mut fronts = Vec::new();
    for _ in 0..routers {
        fronts.push(common::router(cp.addr, &["--parked-request-budget", "4s"]).await);
    }
    for h in ["h1", "h2"] {
        let (status, body) = http_get(fronts[0].addrs["router"], "/", &[("Host", &host(h))]).await;
        assert_eq!(status, 200, "{body}");
    }
    let sent: Vec<_> = overflow
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let addr = fronts[i % routers].addrs["router"];
            let host = host(name);
            tokio::spawn(async move { http_get(addr, "/", &[("Host", &host)]).await })
        })
        .collect();
    let metrics = cp.addrs["metrics"];
    eventually("8 waiters at the control plane", WITHIN, || async {
        let text = http_get(metrics, "/metrics", &[]).await.1;
        let n = valet_router::metrics::sample_of(
            &text,
            "valet_control_waiters",
            &[("pool", "counter")],
        );
        (n == 8.0).then_some(())
    })
    .await;
    // One worker freed: it goes to the oldest waiter, whichever router parked it.
    common::suspend(&c, "demo/h1").await.unwrap();
    let (mut served, mut refused) = (0, 0);
    for r in sent {
        match r.await.unwrap().0 {
            200 => served += 1,
            503 => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    (served, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_in_front_count_as_one() {
    let one = overflow_counts(1).await;
    assert_eq!(one, (1, 7), "one hand-off, seven budgets ended");
    let two = overflow_counts(2).await;
    assert_eq!(two, one, "two routers: the same counts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_with_a_replica_list_is_reachable_through_any_replica() {
    let dir = tempfile::tempdir().unwrap();
    let cp = common::control_plane(&dir.path().join("data"), "127.0.0.1:0", &[]).await;
    // The first replica listed never answers: bound and never listening, so
    // connections to it are refused and nothing else can take the port meanwhile.
    let silent = tokio::net::TcpSocket::new_v4().unwrap();
    silent.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let replicas = format!("http://{},http://{}", silent.local_addr().unwrap(), cp.addr);
    let router = router(&replicas, "5s").await;
    let admin = router.addrs["admin"];
    eventually("the router sees a replica answer", WITHIN, || async {
        let (s, body) = http_get(admin, "/statusz?format=json", &[]).await;
        (s == 200 && body.contains("\"control_plane_reachable\": true")).then_some(())
    })
    .await;
    assert_eq!(
        router
            .metric("atenet_router_control_plane_reachable", &[])
            .await,
        1.0
    );
    // A host name works as well: the router's probe resolves it, and each address
    // is a replica connected under the name.
    let port = cp.addr.port();
    let by_name = Proc::start_logged(
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
            &format!("http://localhost:{port}"),
        ],
    )
    .await;
    let admin = by_name.addrs["admin"];
    eventually("the router reaches the replica by name", WITHIN, || async {
        let (s, body) = http_get(admin, "/statusz?format=json", &[]).await;
        (s == 200 && body.contains("\"control_plane_reachable\": true")).then_some(())
    })
    .await;
    eventually("the name is resolved into replicas", WITHIN, || async {
        let logs = by_name.logs();
        (logs.contains("control-plane replicas")
            && logs.contains(&format!("http://localhost:{port} at 127.0.0.1:{port}")))
        .then_some(())
    })
    .await;
}

/// Runs `valet load scenario <scenario> --processes` (capacity wait on, a 3 s budget,
/// 10 ms restores) with its records in `out`; its output, once it succeeded.
async fn processes_scenario(scenario: &str, out: &std::path::Path) -> String {
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "load",
            "scenario",
            scenario,
            "--processes",
            "--capacity-wait",
            "on",
            "--budget",
            "3s",
            "--restore-delay",
            "10ms",
            "--out",
        ])
        .arg(out)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let o = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .expect("the scenario ends")
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// `valet load scenario overflow --processes`: two replicas on a throwaway PostgreSQL,
/// both serving (started by the scenario), 16 workers and two routers, all processes; requests alternate between the
/// routers. The first burst's counts match the single-process run (14 of 32 served,
/// 18 × 503 into 14 free places); more are served once 16 are freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overflow_scenario_runs_on_processes() {
    let out = tempfile::tempdir().unwrap();
    let stdout = processes_scenario("overflow", out.path()).await;
    assert!(
        stdout.contains("processes: 16 workers; replicas "),
        "{stdout}"
    );
    assert!(stdout.contains("throwaway PostgreSQL"), "{stdout}");
    assert!(
        stdout.contains("burst-32: 14 of 32 returned 200") && stdout.contains("18 returned 503"),
        "{stdout}"
    );
    let relief: usize = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("burst-32-relief: "))
        .find_map(|l| l.split_once(" of 32 returned 200"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no relief round: {stdout}"));
    assert!(relief > 14, "freed workers serve parked requests: {stdout}");
    // Both routers served requests: 2 holders and 32 actors per round, in turn, as
    // each router's own metrics count them.
    let per_router = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("requests each router counted (atenet_router_requests_total): ")
        })
        .unwrap_or_else(|| panic!("no per-router counts: {stdout}"));
    let counts: Vec<&str> = per_router
        .split(", ")
        .filter_map(|r| r.rsplit(": ").next())
        .collect();
    assert_eq!(counts, ["34", "34"], "{stdout}");
    assert!(
        out.path()
            .join("overflow-processes-capacity-wait-on.csv")
            .exists()
    );
}

/// `valet load scenario timeline --processes`: the same processes with two workers;
/// the full pool's nine requests get 503 at their budget, the parked one is served
/// once a worker is freed, and requests went through both routers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeline_scenario_runs_on_processes() {
    let out = tempfile::tempdir().unwrap();
    let stdout = processes_scenario("timeline", out.path()).await;
    assert!(
        stdout.contains("processes: 2 workers; replicas "),
        "{stdout}"
    );
    assert!(stdout.contains("(all active)"), "{stdout}");
    assert!(stdout.contains("full pool: 9 returned 503"), "{stdout}");
    let served = stdout.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3 && f[..3] == ["p3-served-after-park", "demo/p3", "200"]
    });
    assert!(served, "the parked request is served: {stdout}");
    let counted: Vec<u64> = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("requests each router counted (atenet_router_requests_total): ")
        })
        .unwrap_or_else(|| panic!("no per-router counts: {stdout}"))
        .split(", ")
        .filter_map(|r| r.rsplit(": ").next()?.parse().ok())
        .collect();
    assert!(
        counted.len() == 2 && counted.iter().all(|&n| n > 0),
        "both routers took requests: {stdout}"
    );
    assert!(
        out.path()
            .join("timeline-processes-capacity-wait-on.csv")
            .exists()
    );
}

/// SIGTERM of the active replica while a request waits for capacity on it: the
/// replica answers its waiter `Unavailable`, exits 0 and releases the database; the
/// standby takes over, the workers re-attach with their actors, and the parked
/// request is served once a worker is freed on the new replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_replica_hands_over_and_a_parked_request_is_served() {
    let pg = TempPostgres::start_async().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("unused");
    let data = data.to_str().unwrap();
    let url = pg.url();
    let (mut first, second) = active_and_standby(&url, data, true).await;
    let (a, b) = (first.addr, second.addr);
    let replicas = format!("http://{a},http://{b}");
    // The standby holds its gRPC port from the start, refusing connections: nothing
    // else can take the port before it does.
    let reserved = b;
    assert_eq!(
        std::net::TcpListener::bind(reserved).unwrap_err().kind(),
        std::io::ErrorKind::AddrInUse
    );
    assert_eq!(
        tokio::net::TcpStream::connect(reserved)
            .await
            .unwrap_err()
            .kind(),
        std::io::ErrorKind::ConnectionRefused
    );
    let _workers = workers(&replicas, &dir.path().join("snapshots"), &["w1", "w2"]).await;
    common::workers_and_demo(
        &common::client(first.addr),
        2,
        &["p1", "p2", "p3"].map(String::from),
    )
    .await;
    let router = router(&replicas, "60s").await;
    let http = router.addrs["router"];
    for name in ["p1", "p2"] {
        let (status, body) = http_get(http, "/", &[("Host", &host(name))]).await;
        assert_eq!(status, 200, "{body}");
    }
    // The pool is full: p3 parks, waiting for capacity on the active replica.
    let parked = tokio::spawn(async move { http_get(http, "/", &[("Host", &host("p3"))]).await });
    eventually("p3 parked", WITHIN, || async {
        (router.metric("atenet_router_parking_active", &[]).await == 1.0).then_some(())
    })
    .await;

    first.terminate();
    assert_eq!(first.exit_code(WITHIN).await, Some(0), "{}", first.logs());
    taken_over(&second).await;
    let c = common::client(second.addr);
    eventually(
        "both workers re-attached with their actors",
        WITHIN,
        || async {
            let running = c
                .clone()
                .list_actors(ateapi::ListActorsRequest {
                    atespace: "demo".into(),
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner()
                .actors
                .iter()
                .filter(|a| common::status(a) == ateapi::actor::Status::Running)
                .count();
            let workers = c.clone().list_workers(()).await.ok()?.into_inner().workers;
            (workers.len() == 2 && running == 2).then_some(())
        },
    )
    .await;
    assert!(!parked.is_finished(), "p3 still parked, not failed");
    common::suspend(&c, "demo/p1").await.unwrap();
    let (status, body) = tokio::time::timeout(WITHIN, parked)
        .await
        .expect("p3 served")
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("hello from: demo/p3"), "{body}");
    assert!(
        unavailable_attempts(&router).await >= 1.0,
        "the terminated replica's waiter was answered Unavailable, then retried"
    );
}
