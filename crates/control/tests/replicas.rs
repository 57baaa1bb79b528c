//! Several control-plane replicas active at once on one PostgreSQL database
//! (docs/scale-out.md): real planes serving gRPC on loopback, real workers attached
//! to one replica each, a throwaway PostgreSQL server.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Code;
use valet_control::tempdb::TempPostgres;
use valet_control::{Plane, PlaneConfig, ReplicaStore};
use valet_proto::ateapi;
use valet_worker::Worker;

use common::{Served, WAIT, addr_of, create_on, resume_on, status, suspend_on};

/// One replica: its plane served over gRPC, and its store.
struct Replica {
    served: Served,
    store: Arc<ReplicaStore>,
}

impl std::ops::Deref for Replica {
    type Target = Served;
    fn deref(&self) -> &Served {
        &self.served
    }
}

async fn replica(url: &str, config: PlaneConfig) -> Replica {
    let store = Arc::new(ReplicaStore::join(url).await.unwrap());
    let plane = Plane::open_replica(Arc::clone(&store), config)
        .await
        .unwrap();
    Replica {
        served: common::serve(plane).await,
        store,
    }
}

/// Two replicas on a fresh throwaway server.
async fn two_replicas(config: PlaneConfig) -> (TempPostgres, Replica, Replica) {
    common::log_if_asked();
    let pg = TempPostgres::start_async().await;
    let a = replica(&pg.url(), config.clone()).await;
    let b = replica(&pg.url(), config).await;
    (pg, a, b)
}

/// `n` workers of pool `counter` attached to `to` only.
async fn workers_on(to: &Replica, n: usize, snapshots: &std::path::Path) -> Vec<Worker> {
    let mut ws = Vec::new();
    for _ in 0..n {
        ws.push(common::worker_on(&to.url(), "counter", snapshots, Duration::ZERO, None).await);
    }
    let at = to.plane.pool("counter").0;
    assert!(
        to.plane
            .wait_until(WAIT, |p| p.pool("counter").0 == at.max(n))
            .await,
        "{n} workers attach"
    );
    ws
}

/// Waits (bounded) until `replica` lists `n` workers, its own and the others'.
async fn lists_workers(replica: &Replica, n: usize) {
    let listed = replica
        .plane
        .wait_until(WAIT, |p| p.membership().list_workers().len() == n)
        .await;
    assert!(listed, "{n} workers listed on every replica");
}

async fn sql_count(url: &str, query: &str) -> i64 {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    let n: i64 = client.query_one(query, &[]).await.unwrap().get(0);
    drop(client);
    let _ = task.await;
    n
}

async fn demo(on: &Replica, actors: impl IntoIterator<Item = String>) {
    on.client
        .clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    for a in actors {
        create_on(&on.client, &format!("demo/{a}"), "counter")
            .await
            .unwrap();
    }
}

/// Resumes waiting on replica B are served in their arrival order by workers freed
/// on replica A (A restores each waiter's actor on its freed worker and B answers
/// from the record), one hand-off per freed worker, with no polling: B got one call
/// per waiter and asked nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_one_replica_are_served_in_order_by_workers_freed_on_another() {
    let (_pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let workers = workers_on(&a, 3, dir.path()).await;
    lists_workers(&b, 3).await;
    let names = (1..=3)
        .map(|i| format!("r{i}"))
        .chain((1..=5).map(|i| format!("x{i}")));
    demo(&a, names).await;
    for i in 1..=3 {
        let (r, _) = resume_on(&a.client, &format!("demo/r{i}"), None)
            .await
            .unwrap();
        assert_eq!(status(&r), ateapi::actor::Status::Running);
    }
    // The waiters arrive on B one after the other.
    let mut waiting = Vec::new();
    for i in 1..=5 {
        let c = b.client.clone();
        waiting.push(tokio::spawn(async move {
            let r = resume_on(&c, &format!("demo/x{i}"), Some(Duration::from_secs(60))).await;
            (r, Instant::now())
        }));
        assert!(
            b.plane
                .wait_until(WAIT, |p| p.waiters("counter") == i)
                .await,
            "x{i} queued on B"
        );
    }
    let handoffs = a.plane.stats().handoffs;
    let mut freed_at = Vec::new();
    for (i, w) in waiting.iter_mut().take(3).enumerate() {
        let r = format!("demo/r{}", i + 1);
        let freed_worker = addr_of(&a.plane.catalog().get_actor(&key(&r)).unwrap());
        suspend_on(&a.client, &r).await.unwrap();
        freed_at.push(Instant::now());
        let (served, at) = tokio::time::timeout(WAIT, w).await.unwrap().unwrap();
        let (actor, resumed) = served.unwrap_or_else(|e| panic!("x{} served: {e:?}", i + 1));
        assert_eq!(status(&actor), ateapi::actor::Status::Running);
        assert!(resumed, "the call that queued did the activation");
        assert_eq!(
            addr_of(&actor),
            freed_worker,
            "x{} on the freed worker",
            i + 1
        );
        eprintln!(
            "hand-off across replicas {}: {:?} from the suspend's answer to the waiter's",
            i + 1,
            at.saturating_duration_since(freed_at[i])
        );
    }
    // The later waiters still wait, in order; nothing was asked twice.
    assert!(waiting[3..].iter().all(|w| !w.is_finished()));
    assert_eq!(b.plane.waiters("counter"), 2);
    assert_eq!(a.plane.stats().handoffs - handoffs, 3);
    assert_eq!(b.plane.stats().resume_calls, 5, "no polling");
    assert_eq!(b.plane.stats().queued, 5);
    for w in workers {
        w.shutdown().await;
    }
    b.served.stop().await;
    for w in waiting.into_iter().skip(3) {
        let (r, _) = w.await.unwrap();
        assert_eq!(
            r.unwrap_err().code(),
            Code::Unavailable,
            "answered at shutdown"
        );
    }
    a.served.stop().await;
}

fn key(actor: &str) -> valet_control::ActorKey {
    let (a, n) = actor.split_once('/').unwrap();
    valet_control::ActorKey::new(a, n).unwrap()
}

/// A suspend asked of a replica the actor's worker is not attached to is carried out
/// by the one it is attached to, and answered through the first; the worker is free
/// again, and a resume through either replica restores it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspend_is_carried_out_by_the_replica_the_worker_is_attached_to() {
    let (pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let workers = workers_on(&a, 1, dir.path()).await;
    lists_workers(&b, 1).await;
    demo(&a, ["p1".to_owned()]).await;
    let (running, _) = resume_on(&a.client, "demo/p1", None).await.unwrap();
    // B answers for it too: RUNNING on A's worker.
    assert!(
        b.plane
            .wait_until(WAIT, |p| p.status_of("demo", "p1")
                == Some(ateapi::actor::Status::Running))
            .await
    );
    let (through_b, resumed) = resume_on(&b.client, "demo/p1", None).await.unwrap();
    assert!(!resumed);
    assert_eq!(addr_of(&through_b), addr_of(&running));

    let suspended = suspend_on(&b.client, "demo/p1").await.unwrap();
    assert_eq!(status(&suspended), ateapi::actor::Status::Suspended);
    assert_eq!(a.plane.pool("counter"), (1, 1), "A's worker is free again");
    assert_eq!(
        sql_count(&pg.url(), "SELECT count(*) FROM valet_forwards").await,
        0,
        "the forwarded request is gone"
    );
    // Resumed through B: restored on A's worker (handed over through the queue).
    let (again, resumed) = resume_on(&b.client, "demo/p1", None).await.unwrap();
    assert!(resumed);
    assert_eq!(addr_of(&again), addr_of(&running));
    let (status_code, body) =
        common::http_get(addr_of(&again), "/", &[("x-actor-ref", "demo/p1")]).await;
    assert_eq!(status_code, 200);
    assert!(body.contains("preserved file counter: 1"), "{body}");
    for w in workers {
        w.shutdown().await;
    }
    b.served.stop().await;
    a.served.stop().await;
}

/// 200 concurrent resumes of 200 actors, spread over two replicas with 10 workers
/// attached to each: exactly 20 actors RUNNING, on 20 different workers, in the
/// database as in the answers; every other resume answered `ResourceExhausted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_resumes_over_two_replicas_fill_twenty_workers_once() {
    let (pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut workers = workers_on(&a, 10, dir.path()).await;
    workers.extend(workers_on(&b, 10, dir.path()).await);
    lists_workers(&a, 20).await;
    lists_workers(&b, 20).await;
    demo(&a, (0..200).map(|i| format!("a{i:03}"))).await;
    assert!(
        b.plane
            .wait_until(WAIT, |p| p
                .catalog()
                .list_actors("demo", 1000, "")
                .unwrap()
                .0
                .len()
                == 200)
            .await
    );
    let calls: Vec<_> = (0..200)
        .map(|i| {
            let c = if i % 2 == 0 { &a.client } else { &b.client }.clone();
            tokio::spawn(async move { resume_on(&c, &format!("demo/a{i:03}"), None).await })
        })
        .collect();
    let mut served = std::collections::BTreeSet::new();
    let mut refused = 0;
    for call in calls {
        match call.await.unwrap() {
            Ok((actor, _)) => {
                assert!(served.insert(addr_of(&actor)), "one worker, one actor");
            }
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                refused += 1;
            }
        }
    }
    assert_eq!((served.len(), refused), (20, 180));
    let running = sql_count(
        &pg.url(),
        &format!(
            "SELECT count(*) FROM actors WHERE status = {}",
            valet_control::ActorStatus::Running.wire()
        ),
    )
    .await;
    let on_workers = sql_count(
        &pg.url(),
        "SELECT count(DISTINCT worker) FROM actors WHERE worker IS NOT NULL",
    )
    .await;
    let claimed = sql_count(
        &pg.url(),
        "SELECT count(*) FROM actors WHERE worker IS NOT NULL",
    )
    .await;
    assert_eq!((running, claimed, on_workers), (20, 20, 20));
    for w in workers {
        w.shutdown().await;
    }
    b.served.stop().await;
    a.served.stop().await;
}

/// One actor resumed through both replicas at once, many times: it is restored once
/// (one activation in all), and every call is answered with it RUNNING, or `Aborted`
/// while the other replica's operation holds it (the router retries those).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_actor_resumed_through_both_replicas_is_restored_once() {
    let (_pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut workers = workers_on(&a, 1, dir.path()).await;
    workers.extend(workers_on(&b, 1, dir.path()).await);
    lists_workers(&a, 2).await;
    lists_workers(&b, 2).await;
    demo(&a, ["p1".to_owned()]).await;
    assert!(
        b.plane
            .wait_until(WAIT, |p| p.status_of("demo", "p1").is_some())
            .await
    );
    let calls: Vec<_> = (0..20)
        .map(|i| {
            let c = if i % 2 == 0 { &a.client } else { &b.client }.clone();
            tokio::spawn(async move {
                for _ in 0..100 {
                    match resume_on(&c, "demo/p1", Some(Duration::from_secs(10))).await {
                        Err(e) if e.code() == Code::Aborted => {
                            tokio::task::yield_now().await;
                        }
                        other => return other,
                    }
                }
                panic!("always Aborted");
            })
        })
        .collect();
    let mut at = std::collections::BTreeSet::new();
    for call in calls {
        let (actor, _) = call.await.unwrap().unwrap();
        assert_eq!(status(&actor), ateapi::actor::Status::Running);
        at.insert(addr_of(&actor));
    }
    assert_eq!(at.len(), 1, "one worker: {at:?}");
    assert_eq!(
        a.plane.stats().activations + b.plane.stats().activations,
        1,
        "restored once"
    );
    for w in workers {
        w.shutdown().await;
    }
    b.served.stop().await;
    a.served.stop().await;
}

/// A replica declared dead (its row marked so, as another replica does after 5 s
/// without a heartbeat) has every later write refused, and stops serving (its `lost`
/// token): its late writes never land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_declared_dead_is_fenced() {
    let (pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    client
        .execute(
            "UPDATE valet_replicas SET dead = TRUE WHERE id = $1",
            &[&a.store.replica()],
        )
        .await
        .unwrap();
    let e = a
        .client
        .clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "late".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(a.store.lost().is_cancelled(), "it stops serving");
    let late: i64 = client
        .query_one("SELECT count(*) FROM atespaces WHERE name = 'late'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(late, 0, "the late write did not land");
    // The live replica writes on.
    b.client
        .clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "live".into(),
        })
        .await
        .unwrap();
    drop(client);
    let _ = conn.await;
    b.served.stop().await;
    a.served.stop().await;
}

/// A replica silent for 5 s is declared dead by another, which waits for its writes in
/// progress first (one holding its row's share lock); its waiters and workers'
/// attachments go with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_replica_is_declared_dead_after_its_writes_in_progress() {
    let (pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let workers = workers_on(&a, 1, dir.path()).await;
    lists_workers(&b, 1).await;
    let url = pg.url();
    let (held, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    // A's heartbeat stops (it lost its session, as a process that died does)...
    a.store.lost().cancel();
    // ...while a write of it is in progress: its row share-locked.
    held.batch_execute(&format!(
        "BEGIN; SELECT 1 FROM valet_replicas WHERE id = {} FOR SHARE",
        a.store.replica()
    ))
    .await
    .unwrap();
    let dead = format!(
        "SELECT count(*) FROM valet_replicas WHERE id = {} AND dead",
        a.store.replica()
    );
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                   AND application_name = 'valet control-plane'";
    let deadline = Instant::now() + Duration::from_secs(30);
    while sql_count(&url, waiting).await == 0 {
        assert!(
            Instant::now() < deadline,
            "B waits for A's write in progress"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        sql_count(&url, &dead).await,
        0,
        "not before the write ended"
    );
    held.batch_execute("COMMIT").await.unwrap();
    while sql_count(&url, &dead).await == 0 {
        assert!(
            Instant::now() < deadline,
            "declared dead once the write ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        sql_count(
            &url,
            &format!(
                "SELECT count(*) FROM valet_workers WHERE replica = {}",
                a.store.replica()
            )
        )
        .await,
        0,
        "its workers' attachments went with it"
    );
    drop(held);
    let _ = conn.await;
    for w in workers {
        w.shutdown().await;
    }
    b.served.stop().await;
    a.served.stop().await;
}

/// An actor deleted and created again (its versions counting from 1 anew) in one go,
/// as another replica's one announcement tells it: it is the new one here too.
/// Before, the replica kept the old record (a version not newer), and a write of it
/// would have replaced the new actor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_created_again_is_the_new_one_on_every_replica() {
    let (pg, a, b) = two_replicas(PlaneConfig::default()).await;
    demo(&a, ["p1".to_owned()]).await;
    assert!(
        b.plane
            .wait_until(WAIT, |p| p.catalog().get_actor(&key("demo/p1")).is_ok())
            .await
    );
    let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    client
        .batch_execute(
            "BEGIN; \
             DELETE FROM actors WHERE atespace = 'demo' AND name = 'p1'; \
             INSERT INTO actors (atespace, name, uid, template_namespace, template, pool, \
             status, version, worker, selector, revert_pending) VALUES ('demo', 'p1', \
             'again', 'default', 'echo', 'echo', 4, 1, NULL, '', false); \
             SELECT pg_notify('valet', '{\"e\": \"actor\", \"a\": \"demo\", \"n\": \"p1\", \"by\": 999}'); \
             COMMIT",
        )
        .await
        .unwrap();
    assert!(
        b.plane
            .wait_until(WAIT, |p| p.catalog().get_actor(&key("demo/p1")).is_ok_and(
                |r| r.actor_template_name == "echo" && r.ateom_pod_uid == "again"
            ))
            .await,
        "B has the new actor"
    );
    drop(client);
    let _ = conn.await;
    b.served.stop().await;
    a.served.stop().await;
}

/// A worker whose Join is refused records no attachment: before, its row was written
/// first and stayed, so the other replicas counted a worker that was never there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_join_records_no_attachment() {
    use valet_proto::worker as wk;
    let (pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let mut workers = valet_proto::worker::workers_client::WorkersClient::connect(a.url())
        .await
        .unwrap();
    let join = wk::WorkerEvent {
        event: Some(wk::worker_event::Event::Join(wk::Join {
            worker_id: "bad".into(),
            pool: "counter".into(),
            app_address: "not an address".into(),
            ..Default::default()
        })),
    };
    let refused = workers
        .attach(tokio_stream::iter([join]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(
        sql_count(&pg.url(), "SELECT count(*) FROM valet_workers").await,
        0
    );
    assert!(b.plane.membership().list_workers().is_empty());
    b.served.stop().await;
    a.served.stop().await;
}

/// Waiters arriving on both replicas in turn, with workers freeing on both in turn, are
/// served in their order of arrival across the replicas; one that leaves before its
/// turn (its caller gone) is passed over, and the worker goes to the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_both_replicas_are_served_in_arrival_order() {
    let (pg, a, b) = two_replicas(PlaneConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut workers = workers_on(&a, 2, dir.path()).await;
    workers.extend(workers_on(&b, 2, dir.path()).await);
    lists_workers(&a, 4).await;
    lists_workers(&b, 4).await;
    let names = (1..=4)
        .map(|i| format!("r{i}"))
        .chain((1..=5).map(|i| format!("x{i}")));
    demo(&a, names).await;
    assert!(
        b.plane
            .wait_until(WAIT, |p| p.status_of("demo", "x5").is_some())
            .await
    );
    // r1, r2 on A's workers; r3, r4 on B's.
    for (i, on) in [(1, &a), (2, &a), (3, &b), (4, &b)] {
        resume_on(&on.client, &format!("demo/r{i}"), None)
            .await
            .unwrap();
    }
    let url = pg.url();
    let queued = "SELECT count(*) FROM valet_waiters";
    let mut waiting = Vec::new();
    for (i, on) in [(1, &b), (2, &a), (3, &b), (4, &a), (5, &b)] {
        let c = on.client.clone();
        waiting.push(tokio::spawn(async move {
            resume_on(&c, &format!("demo/x{i}"), Some(Duration::from_secs(60))).await
        }));
        let deadline = Instant::now() + WAIT;
        while sql_count(&url, queued).await < i {
            assert!(Instant::now() < deadline, "x{i} queued");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // x3's caller leaves.
    waiting[2].abort();
    let deadline = Instant::now() + WAIT;
    while sql_count(&url, queued).await != 4 {
        assert!(Instant::now() < deadline, "x3 left the queue");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Workers free on B, A, B, A: x1, x2, x4, x5 in that order.
    let order = [(3, &b, 0), (1, &a, 1), (4, &b, 3), (2, &a, 4)];
    for (r, on, x) in order {
        let freed = addr_of(
            &on.plane
                .catalog()
                .get_actor(&key(&format!("demo/r{r}")))
                .unwrap(),
        );
        suspend_on(&on.client, &format!("demo/r{r}")).await.unwrap();
        let served = tokio::time::timeout(WAIT, &mut waiting[x])
            .await
            .unwrap_or_else(|_| panic!("x{} served", x + 1))
            .unwrap()
            .unwrap_or_else(|e| panic!("x{} served: {e:?}", x + 1));
        assert_eq!(addr_of(&served.0), freed, "x{} on the worker freed", x + 1);
        for (i, later) in waiting.iter().enumerate().skip(x + 1) {
            assert!(i == 2 || !later.is_finished(), "x{} still waits", i + 1);
        }
    }
    for w in workers {
        w.shutdown().await;
    }
    b.served.stop().await;
    a.served.stop().await;
}

/// A worker whose stream ended during its actor's checkpoint attaches again
/// (to the same replica) still hosting it: on a plane over PostgreSQL it keeps the
/// actor, and the checkpoint goes over the new stream. Before, the store's keep
/// check (RUNNING only) failed, the worker was told to evict the actor, and the
/// checkpoint lost its state since the last snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_back_during_its_checkpoint_keeps_the_actor_on_a_replica() {
    use valet_control::ActorKey;
    use valet_control::testing::FakeWorker;
    use valet_proto::worker::worker_command::Command;
    common::log_if_asked();
    let pg = TempPostgres::start_async().await;
    let store = Arc::new(ReplicaStore::join(&pg.url()).await.unwrap());
    let plane = Plane::open_replica(store, PlaneConfig::default())
        .await
        .unwrap();
    let a = ActorKey::new("demo", "a").unwrap();
    plane.catalog().create_atespace("demo").await.unwrap();
    plane
        .catalog()
        .create_actor(a.clone(), "default", "counter", Vec::new())
        .await
        .unwrap();
    // The app port accepts connections: the worker's process is alive.
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = app.local_addr().unwrap();
    let (mut w, _) = FakeWorker::attach_recorded(&plane, "w1", "counter", addr, None)
        .await
        .unwrap();
    let resume = {
        let (plane, a) = (plane.clone(), a.clone());
        tokio::spawn(async move { plane.resume_actor(a, None).await })
    };
    let restore = w.next().await.unwrap();
    assert!(matches!(restore.command, Command::Restore(_)));
    w.answer(restore.id, Ok(()));
    resume.await.unwrap().unwrap();

    // The stream ends with the checkpoint sent on it, unanswered (SUSPENDING is
    // recorded, with the worker attached here).
    let suspend = {
        let (plane, a) = (plane.clone(), a.clone());
        tokio::spawn(async move { plane.suspend_actor(a).await })
    };
    let first = w.next().await.unwrap();
    assert!(matches!(first.command, Command::Checkpoint(_)), "{first:?}");
    w.leave();
    assert!(
        plane
            .wait_until(WAIT, |p| p.checkpoint_awaits_worker("demo", "a"))
            .await,
        "the checkpoint waits for the worker"
    );
    let (mut w, kept) = FakeWorker::attach_recorded(&plane, "w1", "counter", addr, Some(&a))
        .await
        .unwrap();
    assert!(kept, "kept for the checkpoint");
    let c = w.next().await.unwrap();
    assert!(matches!(c.command, Command::Checkpoint(_)), "{c:?}");
    w.answer(c.id, Ok(()));
    let done = suspend.await.unwrap().unwrap();
    assert_eq!(done.status, ateapi::actor::Status::Suspended as i32);
    assert_eq!(plane.pool("counter"), (1, 1), "the worker is free again");
    plane.close().await;
}
