//! The control plane and workers as real processes: SIGKILL them and check that
//! nothing acknowledged is lost and nothing is stuck.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{
    DOMAIN, client, control_plane, create, eventually, get, http_get, resume, router, status,
    suspend, try_http_get, worker, worker_with,
};
use tonic::transport::Channel;
use valet_proto::ateapi::{self, actor::Status as S, control_client::ControlClient};

const WITHIN: Duration = Duration::from_secs(20);

/// Waits (bounded) until `n` workers have joined.
async fn workers_joined(c: &ControlClient<Channel>, n: usize) {
    eventually("the workers join", WITHIN, || async {
        let joined = c
            .clone()
            .list_workers(())
            .await
            .ok()?
            .into_inner()
            .workers
            .len();
        (joined == n).then_some(())
    })
    .await;
}

/// Waits (bounded) until two workers have joined, then creates atespace `demo`.
async fn two_workers_and_demo(c: &ControlClient<Channel>) {
    workers_joined(c, 2).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
}

/// A control plane in `dir` (with `flags`), worker `w1` in `pool` joined, and the
/// atespace `demo`.
async fn one_worker(
    dir: &std::path::Path,
    flags: &[&str],
    pool: &str,
) -> (common::Proc, ControlClient<Channel>, common::Proc) {
    let cp = control_plane(&dir.join("data"), "127.0.0.1:0", flags).await;
    let c = client(cp.addr);
    let w1 = worker_with(cp.addr, &dir.join("snapshots"), "w1", &["--pool", pool]).await;
    workers_joined(&c, 1).await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    (cp, c, w1)
}

fn addr_of(a: &ateapi::Actor) -> std::net::SocketAddr {
    format!("{}:{}", a.ateom_pod_ip, a.worker_port)
        .parse()
        .unwrap()
}

/// SIGKILL a worker: its actor goes back to SUSPENDED from its last snapshot, the pool
/// shrinks, and the actor resumes on the other worker with its file counter intact.
#[tokio::test]
async fn killed_worker_releases_its_actor() {
    let dir = tempfile::tempdir().unwrap();
    let snaps = dir.path().join("snapshots");
    let cp = control_plane(&dir.path().join("data"), "127.0.0.1:0", &[]).await;
    let c = client(cp.addr);
    let w1 = worker(cp.addr, &snaps, "w1").await;
    let w2 = worker(cp.addr, &snaps, "w2").await;
    two_workers_and_demo(&c).await;
    create(&c, "demo/p1").await.unwrap();
    let a = resume(&c, "demo/p1").await.unwrap();
    for n in 1..=2 {
        let (code, body) = http_get(addr_of(&a), "/", &[]).await;
        assert_eq!(code, 200);
        assert!(
            body.ends_with(&format!("preserved file counter: {n}\n")),
            "{body}"
        );
    }
    let (victim, survivor) = if a.ateom_pod_name == "w1" {
        (w1, w2)
    } else {
        (w2, w1)
    };
    assert_eq!(addr_of(&a), victim.addr);
    victim.kill().await;

    let back = eventually("actor released", WITHIN, || async {
        let a = get(&c, "demo/p1").await.ok()?;
        (status(&a) == S::Suspended).then_some(a)
    })
    .await;
    assert!(back.ateom_pod_ip.is_empty());
    let workers = c
        .clone()
        .list_workers(())
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert_eq!(workers.len(), 1, "the pool shrank");

    let a = resume(&c, "demo/p1").await.unwrap();
    assert_eq!(addr_of(&a), survivor.addr);
    let (code, body) = http_get(addr_of(&a), "/", &[]).await;
    assert_eq!(code, 200);
    assert_eq!(
        body,
        "hello from: demo/p1 | preserved memory count: 1 | preserved file counter: 3\n"
    );
}

/// SIGTERM a worker (a rollout) while a client sends request after request through a
/// router: the worker asks the control plane to checkpoint its actor before it stops,
/// so the actor resumes on the other worker from that checkpoint, memory included (a
/// full-snapshot template), where a SIGKILL would lose the memory. Every request is
/// answered 200 and counted exactly once (one the checkpoint's fence turned away is
/// replayed by the router). The draining worker exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_worker_checkpoints_its_actor_before_it_stops() {
    let dir = tempfile::tempdir().unwrap();
    let snaps = dir.path().join("snapshots");
    let (cp, c, mut w1) = one_worker(dir.path(), &["--template", "agent:full"], "agent").await;
    common::create_from(&c, "demo/p1", "agent").await.unwrap();
    let a = resume(&c, "demo/p1").await.unwrap();
    assert_eq!(addr_of(&a), w1.addr);
    for n in 1..=3 {
        let (code, body) = http_get(addr_of(&a), "/", &[]).await;
        assert_eq!(code, 200);
        assert!(
            body.ends_with(&format!(
                "memory count: {n} | preserved file counter: {n}\n"
            )),
            "{body}"
        );
    }
    let w2 = worker_with(cp.addr, &snaps, "w2", &["--pool", "agent"]).await;
    workers_joined(&c, 2).await;

    let router = router(cp.addr, &["--parked-request-budget", "20s"]).await;
    let (progress, mut answered) = tokio::sync::watch::channel(0usize);
    let http = router.addrs["router"];
    let client = tokio::spawn(async move {
        let mut bodies = Vec::new();
        for i in 0..40 {
            let (code, body) = http_get(http, "/", &[("Host", &actor_host("p1"))]).await;
            assert_eq!(code, 200, "request {i}: {body}");
            bodies.push(body);
            progress.send_replace(i + 1);
        }
        bodies
    });
    answered.wait_for(|n| *n >= 5).await.unwrap();
    w1.terminate();
    assert_eq!(w1.exit_code(WITHIN).await, Some(0));
    for (i, body) in client.await.unwrap().iter().enumerate() {
        let n = i + 4;
        assert_eq!(
            body,
            &format!(
                "hello from: demo/p1 | preserved memory count: {n} | preserved file counter: {n}\n"
            ),
            "request {i} through the router"
        );
    }
    let a = get(&c, "demo/p1").await.unwrap();
    assert_eq!(status(&a), S::Running);
    assert_eq!(addr_of(&a), w2.addr, "resumed on the other worker");
}

/// SIGTERM a worker whose actor holds a WebSocket open: the drain cannot checkpoint it
/// (busy at every try), and the control plane tells the worker `Drained` with the
/// actor still there. The worker keeps its attachment until its app has stopped (the
/// tunnel closed at the app's drain), so the actor is released only after that, never
/// while the old worker may still serve it (before, the stream ended at `Drained`, the
/// control plane found the app port already closed and released the actor at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_worker_keeps_its_actor_until_its_app_stopped() {
    use futures_util::StreamExt as _;
    let dir = tempfile::tempdir().unwrap();
    let (_cp, c, mut w1) = one_worker(dir.path(), &["--checkpoint-timeout", "200ms"], "echo").await;
    common::create_from(&c, "demo/ws", "echo").await.unwrap();
    let a = resume(&c, "demo/ws").await.unwrap();
    assert_eq!(addr_of(&a), w1.addr);
    let (ws, code) = common::websocket(w1.addr, "ws.demo", &[]).await;
    assert_eq!(code, 101);
    // Read to the end in the background: says when the old worker closed it.
    let (closed, mut is_closed) = tokio::sync::watch::channel(false);
    let reader = tokio::spawn(async move {
        let (_, mut ws_in) = ws.split();
        while let Some(Ok(_)) = ws_in.next().await {}
        closed.send_replace(true);
    });

    w1.terminate();
    // Released: SUSPENDED from its last snapshot (the drain's tries pass through
    // SUSPENDING and back).
    eventually("actor released", WITHIN, || async {
        let a = get(&c, "demo/ws").await.ok()?;
        (status(&a) == S::Suspended).then_some(())
    })
    .await;
    // This process may not have read the close yet: a moment, well under the app's
    // 5 s drain the actor was released before.
    let read = tokio::time::timeout(Duration::from_secs(3), is_closed.wait_for(|c| *c)).await;
    assert!(
        read.is_ok(),
        "the actor was released while its old worker still served its WebSocket"
    );
    assert_eq!(w1.exit_code(WITHIN).await, Some(0));
    reader.await.unwrap();
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Acked {
    Created,
    Running,
    Suspended,
}

/// SIGKILL the control plane in the middle of a stream of creates, resumes and
/// suspends; restart it on the same data dir: every acknowledged change is there and
/// nothing is stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_control_plane_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let snaps = dir.path().join("snapshots");
    let grace = ["--rejoin-grace", "2s", "--hosting-lease", "4s"];
    let cp = control_plane(&data, "127.0.0.1:0", &grace).await;
    let addr = cp.addr;
    let c = client(addr);
    let _w1 = worker(addr, &snaps, "w1").await;
    let _w2 = worker(addr, &snaps, "w2").await;
    two_workers_and_demo(&c).await;

    // Two concurrent streams of operations; each records what was acknowledged.
    let (acked_tx, mut acked_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut streams = Vec::new();
    for s in 0..2 {
        let c = c.clone();
        let acked_tx = acked_tx.clone();
        streams.push(tokio::spawn(async move {
            for i in 0.. {
                let actor = format!("demo/s{s}-{i}");
                if create(&c, &actor).await.is_err() {
                    return;
                }
                let _ = acked_tx.send((actor.clone(), Acked::Created));
                if resume(&c, &actor).await.is_err() {
                    return;
                }
                let _ = acked_tx.send((actor.clone(), Acked::Running));
                if i % 3 != 0 {
                    if suspend(&c, &actor).await.is_err() {
                        return;
                    }
                    let _ = acked_tx.send((actor.clone(), Acked::Suspended));
                } else {
                    // Keep the pool busy a while, then free it.
                    let _ = suspend(&c, &actor).await.map(|_| {
                        let _ = acked_tx.send((actor.clone(), Acked::Suspended));
                    });
                }
            }
        }));
    }
    drop(acked_tx);
    // Let a good number of operations be acknowledged, then kill mid-stream.
    let mut acked: HashMap<String, Acked> = HashMap::new();
    while acked.len() < 30 {
        let (actor, state) = acked_rx.recv().await.unwrap();
        acked.insert(actor, state);
    }
    cp.kill().await;
    for s in streams {
        s.await.unwrap();
    }
    while let Ok((actor, state)) = acked_rx.try_recv() {
        acked.insert(actor, state);
    }

    let cp = control_plane(&data, &addr.to_string(), &grace).await;
    assert_eq!(cp.addr, addr);
    // After the rejoin grace, every actor is settled: RUNNING on an attached worker
    // that hosts it, or SUSPENDED.
    let listed = eventually("settled after restart", WITHIN, || async {
        let actors = c
            .clone()
            .list_actors(ateapi::ListActorsRequest {
                page_size: 1000,
                ..Default::default()
            })
            .await
            .ok()?
            .into_inner()
            .actors;
        let workers = c.clone().list_workers(()).await.ok()?.into_inner().workers;
        let settled = workers.len() == 2
            && actors.iter().all(|a| match status(a) {
                S::Suspended => true,
                S::Running => workers
                    .iter()
                    .any(|w| w.worker_pod == a.ateom_pod_name && w.actor_id == a.actor_id),
                _ => false,
            });
        settled.then_some(actors)
    })
    .await;
    let by_name: HashMap<String, ateapi::Actor> = listed
        .into_iter()
        .map(|a| (format!("{}/{}", a.atespace, a.actor_id), a))
        .collect();
    // The last acknowledged operation of each actor may have been followed by one that
    // was in flight at the kill; only that next step may differ.
    for (actor, state) in &acked {
        let a = by_name
            .get(actor)
            .unwrap_or_else(|| panic!("acknowledged create of {actor} lost"));
        let now = status(a);
        let ok = match state {
            Acked::Created => matches!(now, S::Suspended | S::Running),
            Acked::Running => matches!(now, S::Running | S::Suspended),
            Acked::Suspended => now == S::Suspended,
        };
        assert!(ok, "{actor}: acknowledged {state:?}, now {now:?}");
    }
    // A RUNNING acknowledged actor whose worker survived stays RUNNING unless a suspend
    // was in flight; no two actors share a worker.
    let mut hosts = std::collections::HashSet::new();
    for a in by_name.values().filter(|a| status(a) == S::Running) {
        assert!(
            hosts.insert(a.ateom_pod_name.clone()),
            "worker assigned twice"
        );
    }
    // Nothing is stuck: every actor can be operated on again.
    for actor in by_name.keys() {
        suspend(&c, actor).await.unwrap();
    }
    drop(cp);
}

/// One data dir, one control plane: a second process given it exits 1 with one line
/// naming the first's pid, and the first goes on serving. Once the first is SIGKILLed
/// the kernel has released its lock: a new process starts on the same records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_takes_one_control_plane_and_outlives_its_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cp = control_plane(&data, "127.0.0.1:0", &[]).await;
    let c = client(cp.addr);
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    create(&c, "demo/a").await.unwrap();
    let pid = cp.child.id().unwrap();

    let second = tokio::time::timeout(
        WITHIN,
        tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
            .args(["control-plane", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .env("VALET_LOG", "off")
            .output(),
    )
    .await
    .expect("the second control plane exits at once")
    .unwrap();
    assert_eq!(second.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&second.stderr),
        format!(
            "valet control-plane: data dir {} is in use by another control plane (pid {pid}): stop it, or give this one another --data-dir\n",
            data.display()
        )
    );
    assert_eq!(
        String::from_utf8_lossy(&second.stdout),
        "",
        "it says it took no port"
    );
    get(&c, "demo/a").await.expect("the first still serves");

    cp.kill().await;
    let cp = control_plane(&data, "127.0.0.1:0", &[]).await;
    get(&client(cp.addr), "demo/a")
        .await
        .expect("a new control plane on the records");
}

/// `valet ctl` against a control-plane process: tables for people, JSON for scripts,
/// and one-line errors with the gRPC code.
#[tokio::test]
async fn ctl_tables_json_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&dir.path().join("data"), "127.0.0.1:0", &[]).await;
    let url = format!("http://{}", cp.addr);
    let ctl = |args: &[&str]| {
        let mut all = vec!["ctl", "--control-plane", &url];
        all.extend_from_slice(args);
        std::process::Command::new(env!("CARGO_BIN_EXE_valet"))
            .args(&all)
            .output()
            .unwrap()
    };
    let o = ctl(&["atespace", "create", "demo"]);
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "atespace demo created\n"
    );
    assert_eq!(ctl(&["actor", "create", "demo/p1"]).status.code(), Some(0));
    let o = ctl(&["actor", "list"]);
    let table = String::from_utf8_lossy(&o.stdout).into_owned();
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("ACTOR    STATUS     TEMPLATE  WORKER  ADDRESS  VERSION"),
        "{table}"
    );
    assert!(
        lines[1].starts_with("demo/p1  SUSPENDED  counter   -       -"),
        "{table}"
    );
    let o = ctl(&["actor", "get", "demo/p1", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["status"], "SUSPENDED");
    assert_eq!(v["name"], "p1");
    assert_eq!(v["worker"], serde_json::Value::Null);
    let o = ctl(&["actor", "resume", "demo/p1"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).trim(),
        "valet ctl: RESOURCE_EXHAUSTED: no worker has room for the actor"
    );
    let o = ctl(&["actor", "get", "p1"]);
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).trim(),
        "valet ctl: actor \"p1\": want <atespace>/<name>"
    );
}

/// Readiness fails only while draining: a router whose control plane does not answer
/// stays ready (parking absorbs the blip) and shows it on `/statusz` and in a gauge.
#[tokio::test]
async fn readiness_fails_only_while_draining() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cp_addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut router = router(cp_addr, &["--drain-delay", "30s"]).await;
    let admin = router.addrs["admin"];
    let status = || async move {
        let (_, body) = http_get(admin, "/statusz?format=json", &[]).await;
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    eventually("the probe saw the control plane down", WITHIN, || async {
        let s = status().await;
        (s["control_plane_probed"] == true).then_some(())
    })
    .await;
    assert_eq!(status().await["control_plane_reachable"], false);
    assert_eq!(
        router
            .metric("atenet_router_control_plane_reachable", &[])
            .await,
        0.0
    );
    assert_eq!(
        http_get(admin, "/readyz", &[]).await,
        (200, "ready\n".to_owned())
    );

    let dir = tempfile::tempdir().unwrap();
    let _cp = control_plane(&dir.path().join("data"), &cp_addr.to_string(), &[]).await;
    eventually("the gauge follows the control plane", WITHIN, || async {
        let up = router
            .metric("atenet_router_control_plane_reachable", &[])
            .await;
        (up == 1.0).then_some(())
    })
    .await;
    assert_eq!(status().await["control_plane_reachable"], true);

    router.terminate();
    eventually("not ready while draining", WITHIN, || async {
        let (s, b) = http_get(admin, "/readyz", &[]).await;
        (s == 503 && b == "not ready: draining\n").then_some(())
    })
    .await;
    assert_eq!(
        http_get(admin, "/healthz", &[]).await,
        (200, "ok\n".to_owned())
    );
    router.child.kill().await.unwrap();
}

fn actor_host(name: &str) -> String {
    format!("{name}.demo.{DOMAIN}")
}

/// SIGKILL the control plane while ten requests wait for capacity, restart it on the
/// same data dir: no parked request gets a 500; they keep waiting, a worker freed after
/// the restart serves one, and the rest get the budget's 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_requests_ride_out_a_control_plane_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let snaps = dir.path().join("snapshots");
    let cp = control_plane(&data, "127.0.0.1:0", &[]).await;
    let addr = cp.addr;
    let c = client(addr);
    let _w1 = worker(addr, &snaps, "w1").await;
    let _w2 = worker(addr, &snaps, "w2").await;
    two_workers_and_demo(&c).await;
    let waiting: Vec<String> = (1..=10).map(|i| format!("q{i}")).collect();
    for a in ["p1", "p2"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain(waiting.clone())
    {
        create(&c, &format!("demo/{a}")).await.unwrap();
    }
    resume(&c, "demo/p1").await.unwrap();
    resume(&c, "demo/p2").await.unwrap();

    let router = router(addr, &["--parked-request-budget", "12s"]).await;
    let http = router.addrs["router"];
    let requests: Vec<_> = waiting
        .iter()
        .map(|a| {
            let host = actor_host(a);
            tokio::spawn(async move { http_get(http, "/", &[("Host", &host)]).await })
        })
        .collect();
    eventually(
        "ten parked, each waiting at the control plane",
        WITHIN,
        || async {
            let parked = router.metric("atenet_router_parking_active", &[]).await;
            let first = router
                .metric("atenet_router_resume_attempts_total", &[])
                .await;
            let waiting = router.metric("atenet_router_resume_in_progress", &[]).await;
            (parked == 10.0 && first == 10.0 && waiting == 10.0).then_some(())
        },
    )
    .await;

    cp.kill().await;
    let _cp = control_plane(&data, &addr.to_string(), &[]).await;
    eventually("both workers back, p1 still RUNNING", WITHIN, || async {
        let workers = c.clone().list_workers(()).await.ok()?.into_inner().workers;
        let p1 = get(&c, "demo/p1").await.ok()?;
        (workers.len() == 2 && status(&p1) == S::Running).then_some(())
    })
    .await;
    suspend(&c, "demo/p1").await.unwrap();

    let mut answers = HashMap::<u16, Vec<String>>::new();
    for r in requests {
        let (code, body) = r.await.unwrap();
        answers.entry(code).or_default().push(body);
    }
    assert_eq!(answers.get(&200).map(Vec::len), Some(1), "{answers:?}");
    let capacity = answers.get(&503).cloned().unwrap_or_default();
    assert_eq!(capacity.len(), 9, "{answers:?}");
    for body in capacity {
        assert!(
            body.starts_with("actor demo/q")
                && body.ends_with(" unavailable: no worker has room for the actor"),
            "{body}"
        );
    }
    assert_eq!(
        router.metric("atenet_router_parking_active", &[]).await,
        0.0
    );
}

/// SIGKILL the router while the control plane restores an actor for it: the restore
/// finishes without its caller, exactly one worker hosts the actor, and a new router's
/// request (a re-sent ResumeActor) is served by that worker with one count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_outlives_its_router() {
    let dir = tempfile::tempdir().unwrap();
    let snaps = dir.path().join("snapshots");
    let cp = control_plane(&dir.path().join("data"), "127.0.0.1:0", &[]).await;
    let c = client(cp.addr);
    let slow = ["--restore-delay", "2s"];
    let _w1 = worker_with(cp.addr, &snaps, "w1", &slow).await;
    let _w2 = worker_with(cp.addr, &snaps, "w2", &slow).await;
    two_workers_and_demo(&c).await;
    create(&c, "demo/p1").await.unwrap();

    let first = router(cp.addr, &[]).await;
    let http = first.addrs["router"];
    let lost =
        tokio::spawn(async move { try_http_get(http, "/", &[("Host", &actor_host("p1"))]).await });
    eventually("p1 RESUMING", WITHIN, || async {
        (status(&get(&c, "demo/p1").await.ok()?) == S::Resuming).then_some(())
    })
    .await;
    first.kill().await;
    assert_eq!(
        lost.await.unwrap(),
        None,
        "the router died before answering"
    );

    let running = eventually("p1 RUNNING without its caller", WITHIN, || async {
        let a = get(&c, "demo/p1").await.ok()?;
        (status(&a) == S::Running).then_some(a)
    })
    .await;
    let workers = c
        .clone()
        .list_workers(())
        .await
        .unwrap()
        .into_inner()
        .workers;
    let hosts: Vec<_> = workers.iter().filter(|w| w.actor_id == "p1").collect();
    assert_eq!(hosts.len(), 1, "{workers:?}");
    assert_eq!(hosts[0].worker_pod, running.ateom_pod_name);

    let second = router(cp.addr, &[]).await;
    let (code, body) = http_get(second.addrs["router"], "/", &[("Host", &actor_host("p1"))]).await;
    assert_eq!(
        (code, body.as_str()),
        (
            200,
            "hello from: demo/p1 | preserved memory count: 1 | preserved file counter: 1\n"
        )
    );
    assert_eq!(
        get(&c, "demo/p1").await.unwrap().ateom_pod_name,
        running.ateom_pod_name
    );
}

/// SIGTERM the real control plane with two workers hosting actors and a resume waiting
/// for capacity: the waiter gets `Unavailable`, the process exits 0, the workers keep
/// their actors; restarted on the same data dir, both actors are RUNNING again without
/// a restore, their memory counts intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_control_plane_keeps_actors_running() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let snaps = dir.path().join("snapshots");
    let flags = ["--metrics-listen", "127.0.0.1:0"];
    let mut cp = control_plane(&data, "127.0.0.1:0", &flags).await;
    let addr = cp.addr;
    let metrics = cp.addrs["metrics"];
    let c = client(addr);
    let _w1 = worker(addr, &snaps, "w1").await;
    let _w2 = worker(addr, &snaps, "w2").await;
    two_workers_and_demo(&c).await;
    let mut at = HashMap::new();
    for a in ["demo/p1", "demo/p2", "demo/p3"] {
        create(&c, a).await.unwrap();
    }
    for a in ["demo/p1", "demo/p2"] {
        let actor = resume(&c, a).await.unwrap();
        let (code, _) = http_get(addr_of(&actor), "/", &[("x-actor-ref", a)]).await;
        assert_eq!(code, 200);
        at.insert(a, addr_of(&actor));
    }
    let waiter = {
        let c = c.clone();
        tokio::spawn(async move {
            c.clone()
                .resume_actor(ateapi::ResumeActorRequest {
                    actor_ref: common::aref("demo/p3"),
                    wait_for_capacity: Some(Duration::from_secs(60).try_into().unwrap()),
                    ..Default::default()
                })
                .await
        })
    };
    eventually("p3 waits for capacity", WITHIN, || async {
        let text = http_get(metrics, "/metrics", &[]).await.1;
        let waiting = valet_router::metrics::sample_of(
            &text,
            "valet_control_waiters",
            &[("pool", "counter")],
        );
        (waiting == 1.0).then_some(())
    })
    .await;

    cp.terminate();
    let err = waiter.await.unwrap().unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert_eq!(cp.exit_code(WITHIN).await, Some(0));
    for (a, worker) in &at {
        let (code, body) = http_get(*worker, "/", &[("x-actor-ref", a)]).await;
        assert_eq!(code, 200, "{a} keeps running on its worker");
        assert!(body.contains("preserved memory count: 2 "), "{body}");
    }

    let _cp = control_plane(&data, &addr.to_string(), &flags).await;
    eventually("both workers back with their actors", WITHIN, || async {
        let workers = c.clone().list_workers(()).await.ok()?.into_inner().workers;
        let hosting = workers.iter().filter(|w| !w.actor_id.is_empty()).count();
        (workers.len() == 2 && hosting == 2).then_some(())
    })
    .await;
    for (a, worker) in &at {
        let actor = get(&c, a).await.unwrap();
        assert_eq!(status(&actor), S::Running, "{a}");
        assert_eq!(addr_of(&actor), *worker, "{a} on the same worker");
        let (code, body) = http_get(*worker, "/", &[("x-actor-ref", a)]).await;
        assert_eq!(code, 200);
        assert!(
            body.contains("preserved memory count: 3 "),
            "{a}: no restore, memory intact: {body}"
        );
    }
}
