//! Route leases and hosting leases on the control plane's side, on tokio's paused
//! clock: a router watch and a worker, both scripted by the test.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Code;
use valet_control::plane::PlaneConfig;
use valet_control::store::Store;
use valet_control::testing::{FakeWorker, MemoryStore};
use valet_control::{ActorKey, Plane};
use valet_proto::ateapi::actor::Status as S;
use valet_proto::leases as pb;
use valet_proto::worker::worker_command::Command;

fn key(name: &str) -> ActorKey {
    ActorKey::new("demo", name).unwrap()
}

const LEASE: Duration = Duration::from_secs(5);

fn config() -> PlaneConfig {
    PlaneConfig {
        route_lease: LEASE,
        hosting_lease: Duration::from_secs(15),
        ..PlaneConfig::default()
    }
}

async fn plane_on(store: &MemoryStore, actors: &[&str]) -> Plane {
    let plane = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    if plane.catalog().get_atespace("demo").is_err() {
        plane.catalog().create_atespace("demo").await.unwrap();
    }
    for a in actors {
        plane
            .catalog()
            .create_actor(key(a), "default", "counter", Vec::new())
            .await
            .unwrap();
    }
    plane
}

/// A worker whose app port accepts connections (it is alive), answering every restore
/// and checkpoint.
async fn live_worker(plane: &Plane, id: &str) -> (SocketAddr, tokio::net::TcpListener, FakeWorker) {
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = app.local_addr().unwrap();
    let (w, _) = FakeWorker::attach(plane, id, "counter", addr, None).unwrap();
    (addr, app, w)
}

async fn serve_commands(w: &mut FakeWorker) {
    while let Some(r) = w.next().await {
        if matches!(r.command, Command::Restore(_) | Command::Checkpoint(_)) {
            w.answer(r.id, Ok(()));
        }
    }
}

/// A router's watch, scripted: its revokes arrive on `rx`.
struct Router {
    id: String,
    rx: mpsc::Receiver<Result<pb::PlaneMessage, tonic::Status>>,
}

fn watch(plane: &Plane, id: &str) -> Router {
    let (tx, rx) = mpsc::channel(16);
    plane.leases().router_watching(id, tx).unwrap();
    Router { id: id.into(), rx }
}

impl Router {
    async fn revoked(&mut self) -> (String, u64) {
        loop {
            let m = self.rx.recv().await.expect("watch open").unwrap();
            if let Some(pb::plane_message::Message::Revoke(r)) = m.message {
                let a = r.actor.unwrap();
                return (format!("{}/{}", a.atespace, a.name), r.through);
            }
        }
    }
}

/// Resumes `name` (restored by whatever worker serves commands) asking a lease as
/// `holder`.
async fn resume(plane: &Plane, name: &str, holder: Option<&str>) -> Option<(Duration, u64)> {
    plane
        .resume_leased(key(name), None, holder)
        .await
        .unwrap()
        .2
}

#[tokio::test(start_paused = true)]
async fn leases_are_granted_to_watching_routers_only() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (_addr, _app, mut w) = live_worker(&plane, "w1").await;
    tokio::spawn(async move { serve_commands(&mut w).await });
    assert_eq!(
        resume(&plane, "a", Some("nobody")).await,
        None,
        "no watch: no lease"
    );
    let _r = watch(&plane, "r1");
    let (lease, first) = resume(&plane, "a", Some("r1")).await.unwrap();
    assert_eq!(lease, LEASE);
    assert_eq!(
        resume(&plane, "a", Some("r1")).await,
        Some((LEASE, first + 1)),
        "renewed, with the next number"
    );
    assert_eq!(resume(&plane, "a", None).await, None);
    assert_eq!(plane.leases().leases_held("demo", "a"), 1);
    let err = plane
        .leases()
        .router_watching("r1", mpsc::channel(1).0)
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists, "one watch per router id");
}

/// A suspend revokes the actor's leases: the router acks and the suspend goes on at
/// once; meanwhile ResumeActor answers Aborted and grants nothing.
#[tokio::test(start_paused = true)]
async fn revocation_waits_for_the_ack() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (_addr, _app, mut w) = live_worker(&plane, "w1").await;
    let mut r = watch(&plane, "r1");
    let resume_task = {
        let plane = plane.clone();
        tokio::spawn(async move { resume(&plane, "a", Some("r1")).await })
    };
    let restore = w.next().await.unwrap();
    w.answer(restore.id, Ok(()));
    let (_, id) = resume_task.await.unwrap().unwrap();

    let start = Instant::now();
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    assert_eq!(r.revoked().await, ("demo/a".into(), id));
    let refused = plane
        .resume_leased(key("a"), None, Some("r1"))
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Code::Aborted,
        "nothing granted while revoking"
    );
    plane.leases().lease_acked(
        &r.id,
        &pb::Actor {
            atespace: "demo".into(),
            name: "a".into(),
        },
        id,
    );
    let checkpoint = w.next().await.unwrap();
    assert!(matches!(checkpoint.command, Command::Checkpoint(_)));
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "the ack lets the suspend go on at once"
    );
    w.answer(checkpoint.id, Ok(()));
    assert_eq!(suspend.await.unwrap().unwrap().status, S::Suspended as i32);
    assert_eq!(plane.leases().leases_held("demo", "a"), 0);
}

/// Lease numbers never repeat: after a revocation (the router remembers `through`) and
/// after a restart, a new lease has a higher number than any revoked, so the router
/// installs it instead of refusing it as covered by the revocation.
#[tokio::test(start_paused = true)]
async fn lease_numbers_outgrow_every_revocation() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (addr, _app, mut w) = live_worker(&plane, "w1").await;
    let mut r = watch(&plane, "r1");
    tokio::spawn(async move { serve_commands(&mut w).await });
    let (_, first) = resume(&plane, "a", Some("r1")).await.unwrap();
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    let (_, through) = r.revoked().await;
    assert_eq!(through, first);
    let actor = pb::Actor {
        atespace: "demo".into(),
        name: "a".into(),
    };
    plane.leases().lease_acked(&r.id, &actor, through);
    suspend.await.unwrap().unwrap();
    let (_, again) = resume(&plane, "a", Some("r1")).await.unwrap();
    assert!(
        again > through,
        "lease {again} after revoke through {through}"
    );

    drop(plane);
    let plane = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    let (_w, kept) = FakeWorker::attach(&plane, "w1", "counter", addr, Some(&key("a"))).unwrap();
    assert!(kept);
    let _r = watch(&plane, "r1");
    let (_, restarted) = resume(&plane, "a", Some("r1")).await.unwrap();
    assert!(
        restarted > again,
        "lease {restarted} after a restart, {again} before"
    );
}

/// A router gone without releasing: the suspend waits until its lease ends, no longer.
/// One that released its leases (a clean stop) holds nothing up.
#[tokio::test(start_paused = true)]
async fn a_silent_holder_holds_up_a_suspend_at_most_its_lease() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a", "b"]).await;
    let (_addr, _app, mut w1) = live_worker(&plane, "w1").await;
    let (_addr2, _app2, mut w2) = live_worker(&plane, "w2").await;
    let gone = watch(&plane, "gone");
    let polite = watch(&plane, "polite");
    for (w, name, holder) in [(&mut w1, "a", "gone"), (&mut w2, "b", "polite")] {
        let t = {
            let plane = plane.clone();
            let holder = holder.to_owned();
            tokio::spawn(async move { resume(&plane, name, Some(&holder)).await })
        };
        let restore = w.next().await.unwrap();
        w.answer(restore.id, Ok(()));
        assert!(t.await.unwrap().is_some());
    }
    let granted = Instant::now();
    drop(gone);
    plane.leases().leases_released(&polite.id);

    let suspend_b = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("b")).await })
    };
    let c = w2.next().await.unwrap();
    assert_eq!(granted.elapsed(), Duration::ZERO, "released: no wait");
    w2.answer(c.id, Ok(()));
    suspend_b.await.unwrap().unwrap();

    let suspend_a = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    let c = w1.next().await.unwrap();
    assert_eq!(
        granted.elapsed(),
        LEASE,
        "waited for the lease to end, no more"
    );
    w1.answer(c.id, Ok(()));
    suspend_a.await.unwrap().unwrap();
}

/// Runs a plane on `store` with `--route-lease 5s` and grants one lease on `a`
/// (restored on `w1`, whose app port `app` is).
async fn grant_one_lease(store: &MemoryStore) -> tokio::net::TcpListener {
    let first = plane_on(store, &["a"]).await;
    let (_addr, app, mut w) = live_worker(&first, "w1").await;
    let _r = watch(&first, "r1");
    let t = {
        let plane = first.clone();
        tokio::spawn(async move { resume(&plane, "a", Some("r1")).await })
    };
    let restore = w.next().await.unwrap();
    w.answer(restore.id, Ok(()));
    assert_eq!(t.await.unwrap().map(|(l, _)| l), Some(LEASE));
    first.shutdown(Duration::ZERO).await;
    app
}

/// Starts a plane on `store` with `--route-lease` `lease`, and returns it and how
/// long after its start a suspend of `a` (kept by `w1` re-attaching) sends the
/// checkpoint.
async fn restart_and_suspend(
    store: &MemoryStore,
    app: &tokio::net::TcpListener,
    lease: Duration,
) -> (Plane, Duration) {
    let restarted = Instant::now();
    let plane = Plane::open(
        Arc::new(store.clone()),
        PlaneConfig {
            route_lease: lease,
            ..config()
        },
    )
    .await
    .unwrap();
    let addr = app.local_addr().unwrap();
    let (mut w, kept) = FakeWorker::attach(&plane, "w1", "counter", addr, Some(&key("a"))).unwrap();
    assert!(kept);
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    let c = w.next().await.unwrap();
    assert!(matches!(c.command, Command::Checkpoint(_)));
    let waited = restarted.elapsed();
    w.answer(c.id, Ok(()));
    suspend.await.unwrap().unwrap();
    // Back to RUNNING on w1 for the next start.
    let t = {
        let plane = plane.clone();
        tokio::spawn(async move { resume(&plane, "a", None).await })
    };
    let restore = w.next().await.unwrap();
    w.answer(restore.id, Ok(()));
    t.await.unwrap();
    (plane, waited)
}

/// Waits (a paused second at most) until the store records `lease` as the longest.
async fn recorded_lease_becomes(store: &MemoryStore, lease: Duration) {
    let deadline = Instant::now() + Duration::from_secs(1);
    while store.load().await.unwrap().route_lease != Some(lease) {
        assert!(Instant::now() < deadline, "{lease:?} never recorded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A plane restarted on a store its previous run used moves nothing for a lease's
/// length: leases granted before the restart may still be held.
#[tokio::test(start_paused = true)]
async fn a_restarted_plane_waits_out_unknown_leases() {
    let store = MemoryStore::default();
    let app = grant_one_lease(&store).await;
    let (_plane, waited) = restart_and_suspend(&store, &app, LEASE).await;
    assert_eq!(waited, LEASE);
}

/// A plane restarted with a shorter `--route-lease`, or none, still waits out the
/// longer leases its previous run granted; once they ended it records its own, so
/// the start after waits only that. Before, it waited its own lease (none at all
/// with `--route-lease 0`) while routers still held the previous run's.
#[tokio::test(start_paused = true)]
async fn a_plane_restarted_with_shorter_leases_waits_out_the_longer_ones() {
    for shorter in [Duration::from_secs(1), Duration::ZERO] {
        let store = MemoryStore::default();
        let app = grant_one_lease(&store).await;
        let (plane, waited) = restart_and_suspend(&store, &app, shorter).await;
        assert_eq!(waited, LEASE, "restarted with --route-lease {shorter:?}");
        recorded_lease_becomes(&store, shorter).await;
        plane.shutdown(Duration::ZERO).await;
        let (_plane, waited) = restart_and_suspend(&store, &app, shorter).await;
        assert_eq!(waited, shorter, "the start after, with {shorter:?}");
    }
}

/// The recorded lease never falls short of one that may be held: a plane that
/// cannot record its longer `--route-lease` does not start, and one that could not
/// record its shorter one once the previous run's ended leaves the longer one
/// recorded, for the next start to wait out.
#[tokio::test(start_paused = true)]
async fn the_recorded_lease_never_falls_short() {
    let store = MemoryStore::default();
    let app = grant_one_lease(&store).await;
    let open = |lease| {
        Plane::open(
            Arc::new(store.clone()),
            PlaneConfig {
                route_lease: lease,
                ..config()
            },
        )
    };
    store.gate.fail(true);
    assert!(
        open(LEASE * 2).await.is_err(),
        "a longer lease is recorded before any is granted"
    );
    let shorter = Duration::from_secs(1);
    let second = open(shorter).await.unwrap();
    tokio::time::sleep(LEASE * 2).await;
    store.gate.fail(false);
    assert_eq!(store.load().await.unwrap().route_lease, Some(LEASE));
    second.shutdown(Duration::ZERO).await;
    let (_plane, waited) = restart_and_suspend(&store, &app, shorter).await;
    assert_eq!(waited, LEASE);
}

/// A worker whose stream ends while its port still answers (only the stream was cut)
/// keeps its actor on record until the hosting lease has passed since its last
/// renewal; one whose port refuses connections (the process died) loses it at once.
#[tokio::test(start_paused = true)]
async fn a_cut_off_worker_keeps_its_actor_for_the_hosting_lease() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a", "b"]).await;
    let (_addr, _app, mut alive) = live_worker(&plane, "alive").await;
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (mut dead, _) = FakeWorker::attach(&plane, "dead", "counter", dead_port, None).unwrap();
    for (w, name) in [(&mut alive, "a"), (&mut dead, "b")] {
        let t = {
            let plane = plane.clone();
            tokio::spawn(async move { resume(&plane, name, None).await })
        };
        let restore = w.next().await.unwrap();
        w.answer(restore.id, Ok(()));
        t.await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    alive.renew();
    let renewed = Instant::now();
    alive.leave();
    dead.leave();
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.status_of("demo", "b")
                == Some(S::Suspended))
            .await,
        "the dead worker's actor is released at once"
    );
    assert_eq!(plane.status_of("demo", "a"), Some(S::Running));
    assert!(
        plane
            .wait_until(Duration::from_secs(60), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(
        renewed.elapsed(),
        Duration::from_secs(15),
        "released at the hosting lease"
    );
}

/// Resumes `name` on `w`, which restores it.
async fn run_on(plane: &Plane, w: &mut FakeWorker, name: &str) {
    let t = {
        let plane = plane.clone();
        let name = name.to_owned();
        tokio::spawn(async move { resume(&plane, &name, None).await })
    };
    let restore = w.next().await.unwrap();
    assert!(matches!(restore.command, Command::Restore(_)));
    w.answer(restore.id, Ok(()));
    t.await.unwrap();
}

/// A worker whose stream is cut, that comes back with its actor and whose stream is cut
/// again, keeps its actor for a hosting lease from its *last* renewal: the release the
/// first cut scheduled does not run at the first lease's end.
#[tokio::test(start_paused = true)]
async fn a_worker_cut_off_twice_keeps_its_actor_a_lease_from_its_last_renewal() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (addr, _app, mut w) = live_worker(&plane, "w1").await;
    run_on(&plane, &mut w, "a").await;
    w.leave();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (w, kept) = FakeWorker::attach(&plane, "w1", "counter", addr, Some(&key("a"))).unwrap();
    assert!(kept, "it came back with its actor");
    // The first cut's lease ends 5 s after the renewal below.
    renewed_in_9s_then_cut_off(&plane, w).await;
}

/// After a restart, a worker that re-attached with its actor and was then cut off
/// keeps it for a hosting lease from its last renewal, past the restart's grace.
#[tokio::test(start_paused = true)]
async fn after_a_restart_a_worker_that_rejoined_and_was_cut_off_keeps_its_actor() {
    use valet_control::store::{ActorRow, Batch};
    let store = MemoryStore::default();
    store
        .write(Batch {
            put_atespaces: vec!["demo".into()],
            put_actors: vec![ActorRow {
                atespace: "demo".into(),
                name: "a".into(),
                uid: "uid-a".into(),
                template_namespace: "default".into(),
                template: "counter".into(),
                pool: "counter".into(),
                status: valet_control::model::ActorStatus::Running,
                version: 3,
                worker: Some("w1".into()),
                selector: Vec::new(),
                revert_pending: false,
                op_replica: None,
                snapshot: String::new(),
                reason: String::new(),
            }],
            ..Batch::default()
        })
        .await
        .unwrap();
    let plane = plane_on(&store, &[]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = app.local_addr().unwrap();
    let (w, kept) = FakeWorker::attach(&plane, "w1", "counter", addr, Some(&key("a"))).unwrap();
    assert!(kept);
    // The restart's grace (the hosting lease, 15 s) ends 5 s after the renewal below.
    renewed_in_9s_then_cut_off(&plane, w).await;
}

/// Suspending an actor whose worker's stream is gone (before or during the checkpoint)
/// does not hand the actor on before the worker has fenced it: the suspend ends a
/// hosting lease after the worker's last renewal, unless its process is gone.
#[tokio::test(start_paused = true)]
async fn a_suspend_waits_for_a_cut_off_worker_to_fence_its_actor() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["before", "during"]).await;

    // Cut off before the suspend.
    let (_addr, _app, mut w) = live_worker(&plane, "w1").await;
    run_on(&plane, &mut w, "before").await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    w.renew();
    let renewed = Instant::now();
    w.leave();
    let suspended = plane.suspend_actor(key("before")).await.unwrap();
    assert_eq!(suspended.status, S::Suspended as i32);
    assert_eq!(renewed.elapsed(), Duration::from_secs(15));

    // Cut off while the worker checkpoints.
    let (_addr, _app2, mut w) = live_worker(&plane, "w2").await;
    run_on(&plane, &mut w, "during").await;
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("during")).await })
    };
    let c = w.next().await.unwrap();
    assert!(matches!(c.command, Command::Checkpoint(_)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cut = Instant::now();
    w.leave();
    suspend.await.unwrap().unwrap();
    assert_eq!(
        cut.elapsed(),
        Duration::from_secs(13),
        "a lease from its attachment, 2 s before the cut"
    );
    assert_eq!(plane.status_of("demo", "during"), Some(S::Suspended));
}

/// A suspend that finds its worker's stream gone, whose worker attaches again still
/// hosting the actor within its hosting lease, checkpoints it over the new stream: what
/// the actor did since its last snapshot is kept. Before, the re-attach was told to
/// drop the actor (the checkpoint held it) and it went back to its last snapshot.
#[tokio::test(start_paused = true)]
async fn a_suspend_checkpoints_over_the_new_stream_of_a_worker_that_came_back() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (addr, _app, mut w) = live_worker(&plane, "w1").await;
    run_on(&plane, &mut w, "a").await;
    w.leave();
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    assert!(
        plane
            .wait_until(Duration::from_secs(10), |p| p.status_of("demo", "a")
                == Some(S::Suspending))
            .await
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut w, kept) = FakeWorker::attach(&plane, "w1", "counter", addr, Some(&key("a"))).unwrap();
    assert!(kept, "kept for the checkpoint");
    let c = w.next().await.unwrap();
    assert!(matches!(c.command, Command::Checkpoint(_)), "{c:?}");
    w.answer(c.id, Ok(()));
    let a = suspend.await.unwrap().unwrap();
    assert_eq!(a.status, S::Suspended as i32);
    // The worker is free for the next actor.
    assert_eq!(plane.pool("counter"), (1, 1));
}

/// A worker cut off in the middle of a restore schedules the release of that actor;
/// when the actor has since gone back to SUSPENDED and runs on another worker, that
/// release does not touch it (only the other worker's own departure does).
#[tokio::test(start_paused = true)]
async fn a_release_scheduled_by_one_worker_spares_the_actor_on_another() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (_a1, _app1, mut w1) = live_worker(&plane, "w1").await;
    let cut = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.resume_actor(key("a"), None).await })
    };
    let restore = w1.next().await.unwrap();
    assert!(matches!(restore.command, Command::Restore(_)));
    w1.leave();
    let e = cut.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    // Back to SUSPENDED once w1 has fenced it (a_cut_off_restore_holds_the_actor_until_its_worker_fenced).
    assert!(
        plane
            .wait_until(Duration::from_secs(60), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );

    let (_a2, _app2, mut w2) = live_worker(&plane, "w2").await;
    run_on(&plane, &mut w2, "a").await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    w2.renew();
    let renewed = Instant::now();
    w2.leave();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(plane.status_of("demo", "a"), Some(S::Running));
    assert!(
        plane
            .wait_until(Duration::from_secs(60), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(renewed.elapsed(), Duration::from_secs(15));
}

/// A worker whose stream ends while it restores an actor may have installed it: the
/// caller is answered `Unavailable` at once (it asks again), but the actor goes back
/// to SUSPENDED, free to run elsewhere, only once that worker has fenced it, a hosting
/// lease after its last renewal. Before, it was SUSPENDED at once, and the next resume
/// could run it on a second worker while the first still hosted it.
#[tokio::test(start_paused = true)]
async fn a_cut_off_restore_holds_the_actor_until_its_worker_fenced() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (_a1, _app1, mut w1) = live_worker(&plane, "w1").await;
    let attached = Instant::now();
    let cut = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.resume_actor(key("a"), None).await })
    };
    let restore = w1.next().await.unwrap();
    assert!(matches!(restore.command, Command::Restore(_)));
    w1.leave();
    let e = cut.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(attached.elapsed(), Duration::ZERO, "answered at once");
    let (_a2, _app2, mut w2) = live_worker(&plane, "w2").await;
    let again = plane.resume_actor(key("a"), None).await.unwrap_err();
    assert_eq!(again.code(), Code::Aborted, "not restored on w2 meanwhile");
    assert_eq!(plane.status_of("demo", "a"), Some(S::Resuming));
    assert!(
        plane
            .wait_until(Duration::from_secs(60), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(attached.elapsed(), Duration::from_secs(15), "w1 fenced it");
    run_on(&plane, &mut w2, "a").await;
    assert_eq!(plane.status_of("demo", "a"), Some(S::Running));
}

/// `w`, hosting `demo/a`, renews 9 s from now and is cut off at once: `a` still runs
/// 10 s later (an earlier deadline passed meanwhile), and is released exactly a
/// hosting lease (15 s) after that renewal.
async fn renewed_in_9s_then_cut_off(plane: &Plane, w: FakeWorker) {
    tokio::time::sleep(Duration::from_secs(9)).await;
    w.renew();
    let renewed = Instant::now();
    w.leave();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        plane.status_of("demo", "a"),
        Some(S::Running),
        "the worker may still serve it"
    );
    assert!(
        plane
            .wait_until(Duration::from_secs(60), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(renewed.elapsed(), Duration::from_secs(15));
}

/// The lease book keeps no record of what has ended: a suspend with no lease
/// outstanding drops the actor's record, and a grant drops the ended leases of
/// routers that came and went (router ids are new with every router process).
/// Before, both stayed for good, one per actor ever leased and per router start.
#[tokio::test(start_paused = true)]
async fn the_lease_book_forgets_what_has_ended() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a"]).await;
    let (_addr, _app, mut w) = live_worker(&plane, "w1").await;
    for i in 0..20 {
        let id = format!("router-{i}");
        let _r = watch(&plane, &id);
        let t = {
            let plane = plane.clone();
            tokio::spawn(async move { resume(&plane, "a", Some(&id)).await })
        };
        if i == 0 {
            let restore = w.next().await.unwrap();
            w.answer(restore.id, Ok(()));
        }
        assert!(t.await.unwrap().is_some());
        tokio::time::sleep(LEASE + Duration::from_secs(1)).await;
        w.renew();
    }
    assert_eq!(
        plane.leases().lease_records(),
        (1, 1),
        "only the last grant is kept"
    );
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    let checkpoint = w.next().await.unwrap();
    w.answer(checkpoint.id, Ok(()));
    suspend.await.unwrap().unwrap();
    assert_eq!(plane.leases().lease_records(), (0, 0));
}

/// A router behind on its watch (its queue full) still gets every Revoke once it
/// reads: a suspend waits for its ack, not for the lease to end. Before, a Revoke
/// that found the queue full was dropped, and that suspend waited out the lease.
#[tokio::test(start_paused = true)]
async fn a_revoke_waits_for_room_on_a_full_watch() {
    let store = MemoryStore::default();
    let plane = plane_on(&store, &["a", "b"]).await;
    for id in ["w1", "w2"] {
        let (_addr, app, mut w) = live_worker(&plane, id).await;
        tokio::spawn(async move {
            let _app = app;
            serve_commands(&mut w).await;
        });
    }
    let (tx, rx) = mpsc::channel(1);
    plane.leases().router_watching("r1", tx).unwrap();
    let mut r = Router {
        id: "r1".into(),
        rx,
    };
    for a in ["a", "b"] {
        assert!(resume(&plane, a, Some("r1")).await.is_some());
    }
    let start = Instant::now();
    let suspends: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|a| {
            let plane = plane.clone();
            tokio::spawn(async move { plane.suspend_actor(key(a)).await })
        })
        .collect();
    // Both revocations are under way before the router reads: the queue holds one.
    tokio::time::sleep(Duration::from_millis(1)).await;
    for _ in 0..2 {
        let (actor, through) = tokio::time::timeout(Duration::from_secs(1), r.revoked())
            .await
            .expect("every Revoke arrives");
        let (atespace, name) = actor.split_once('/').unwrap();
        plane.leases().lease_acked(
            &r.id,
            &pb::Actor {
                atespace: atespace.into(),
                name: name.into(),
            },
            through,
        );
    }
    for s in suspends {
        s.await.unwrap().unwrap();
    }
    assert!(
        start.elapsed() < LEASE,
        "acked, not waited out: {:?}",
        start.elapsed()
    );
}
