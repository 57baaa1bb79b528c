//! The plane's timeouts, its rejoin grace and its shutdown, on tokio's paused clock,
//! with a scripted worker (the worker double) and an in-memory store.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Code;
use valet_control::plane::PlaneConfig;
use valet_control::store::{ActorRow, Batch, Store};
use valet_control::testing::{FakeWorker, MemoryStore, Received};
use valet_control::{ActorKey, ActorStatus, Plane};
use valet_proto::ateapi::actor::Status as S;
use valet_proto::worker::worker_command::Command;

const APP: &str = "127.0.0.1:9001";

fn key(name: &str) -> ActorKey {
    ActorKey::new("demo", name).unwrap()
}

fn config() -> PlaneConfig {
    PlaneConfig {
        restore_timeout: Duration::from_secs(5),
        checkpoint_timeout: Duration::from_secs(7),
        rejoin_grace: Duration::from_secs(10),
        hosting_lease: Duration::from_secs(8),
        ..PlaneConfig::default()
    }
}

async fn plane_with(store: &MemoryStore, actors: &[&str]) -> Plane {
    plane_configured(store, config(), actors).await
}

/// A plane on `store` with `config`, atespace `demo` and `actors` in it.
async fn plane_configured(store: &MemoryStore, config: PlaneConfig, actors: &[&str]) -> Plane {
    let plane = Plane::open(Arc::new(store.clone()), config).await.unwrap();
    plane.catalog().create_atespace("demo").await.unwrap();
    for a in actors {
        plane
            .catalog()
            .create_actor(key(a), "default", "counter", Vec::new())
            .await
            .unwrap();
    }
    plane
}

/// [`plane_with`], honouring `wait_for_capacity`.
async fn waiting_plane(store: &MemoryStore, actors: &[&str]) -> Plane {
    let config = PlaneConfig {
        capacity_wait: true,
        ..config()
    };
    plane_configured(store, config, actors).await
}

/// `resume_actor(atespace demo, name, wait)` in a task of its own.
fn spawn_resume(
    plane: &Plane,
    name: &str,
    wait: Option<Duration>,
) -> tokio::task::JoinHandle<Result<(valet_proto::ateapi::Actor, bool), tonic::Status>> {
    let (plane, key) = (plane.clone(), key(name));
    tokio::spawn(async move { plane.resume_actor(key, wait).await })
}

/// A plane on a new store with actor `a`, worker `w1` (its app at `port`) attached,
/// and a resume of `a` whose restore `w1` was sent, unanswered.
async fn restoring(
    port: SocketAddr,
) -> (
    MemoryStore,
    Plane,
    FakeWorker,
    tokio::task::JoinHandle<Result<(valet_proto::ateapi::Actor, bool), tonic::Status>>,
    Received,
) {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", port, None).unwrap();
    let resume = spawn_resume(&plane, "a", None);
    let restore = expect(&mut w, "restore").await;
    (store, plane, w, resume, restore)
}

/// `w` answers `restore`, and the RUNNING record that follows waits at the store's
/// gate (closed) until the test opens it.
async fn restored_but_unwritten(store: &MemoryStore, w: &FakeWorker, restore: &Received) {
    store.gate.close();
    w.answer(restore.id, Ok(()));
    store.gate.until_waiting(1).await;
}

/// An address nothing listens on (a worker whose process is gone).
fn dead_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn app() -> SocketAddr {
    APP.parse().unwrap()
}

async fn expect(w: &mut FakeWorker, what: &str) -> Received {
    let r = w
        .next()
        .await
        .unwrap_or_else(|| panic!("no {what}: stream ended"));
    let name = match &r.command {
        Command::Restore(_) => "restore",
        Command::Checkpoint(_) => "checkpoint",
        Command::Evict(_) => "evict",
        Command::Detach(_) => "detach",
        Command::Welcome(_) => "welcome",
        Command::Renewed(_) => "renewed",
        Command::Drained(_) => "drained",
        Command::Logs(_) => "logs",
    };
    assert_eq!(name, what, "{r:?}");
    r
}

/// A suspend of `demo/a`, in a task, and the checkpoint it sends `w`.
async fn suspending(
    plane: &Plane,
    w: &mut FakeWorker,
) -> (
    tokio::task::JoinHandle<Result<valet_proto::ateapi::Actor, tonic::Status>>,
    Received,
) {
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    let c = expect(w, "checkpoint").await;
    (suspend, c)
}

/// Resumes `demo/<name>` and has `w` restore it: RUNNING on `w`.
async fn restored(plane: &Plane, w: &mut FakeWorker, name: &'static str) {
    let resume = spawn_resume(plane, name, None);
    let r = expect(w, "restore").await;
    w.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
}

/// A restore the worker never answers fails at `--restore-timeout`: the actor is
/// CRASHED, the worker told to drop it and free again.
#[tokio::test(start_paused = true)]
async fn restore_timeout_crashes_the_actor() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let start = Instant::now();
    let resume = spawn_resume(&plane, "a", None);
    expect(&mut w, "restore").await;
    let err = resume.await.unwrap().unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(plane.status_of("demo", "a"), Some(S::Crashed));
    assert_eq!(store.actor(&key("a")).unwrap().status, ActorStatus::Crashed);
    expect(&mut w, "evict").await;
    assert_eq!(plane.pool("counter"), (1, 1), "the worker is free again");
}

/// A checkpoint the worker never answers fails at `--checkpoint-timeout`: CRASHED.
#[tokio::test(start_paused = true)]
async fn checkpoint_timeout_crashes_the_actor() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    restored(&plane, &mut w, "a").await;
    let start = Instant::now();
    let (suspend, _) = suspending(&plane, &mut w).await;
    let err = suspend.await.unwrap().unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(7));
    assert_eq!(err.code(), Code::Internal);
    assert_eq!(
        err.message(),
        "checkpoint of actor demo/a failed: worker did not answer within 7s"
    );
    assert_eq!(plane.status_of("demo", "a"), Some(S::Crashed));
    expect(&mut w, "evict").await;
}

/// A resume of `demo/<name>` that waits up to 60 s for capacity, in a task.
fn resume_waiting(
    plane: &Plane,
    name: &'static str,
) -> tokio::task::JoinHandle<Result<(valet_proto::ateapi::Actor, bool), tonic::Status>> {
    let plane = plane.clone();
    tokio::spawn(async move {
        plane
            .resume_actor(key(name), Some(Duration::from_secs(60)))
            .await
    })
}

/// `demo/a` restored on worker `id` (attached for it), and a resume of `demo/b`
/// waiting for capacity (up to 60 s): the worker and that resume.
async fn a_running_and_b_waiting(
    plane: &Plane,
    id: &str,
) -> (
    FakeWorker,
    tokio::task::JoinHandle<Result<(valet_proto::ateapi::Actor, bool), tonic::Status>>,
) {
    let (mut w, _) = FakeWorker::attach(plane, id, "counter", app(), None).unwrap();
    restored(plane, &mut w, "a").await;
    let waiting = resume_waiting(plane, "b");
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.stats().queued == 1)
            .await
    );
    (w, waiting)
}

/// Suspending a suspended actor is a no-op (control-plane.md), also while a resume of
/// it waits for capacity: before, that answered `Aborted` (another operation holds
/// it). The waiting resume goes on.
#[tokio::test(start_paused = true)]
async fn suspending_a_suspended_actor_with_a_resume_waiting_is_a_no_op() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a", "b"]).await;
    let (_w, waiting) = a_running_and_b_waiting(&plane, "w1").await;
    let b = plane.suspend_actor(key("b")).await.unwrap();
    assert_eq!(b.status, S::Suspended as i32);
    assert_eq!(plane.stats().queued, 1, "the resume still waits");
    assert!(!waiting.is_finished());
}

/// A resume handed a worker writes its claim with the actor still SUSPENDED in
/// memory: a suspend then is refused `Aborted` (the actor is about to run), not
/// answered as a no-op, and a drain of that worker waits for the restore and then
/// checkpoints the actor instead of telling the worker `Drained` at once.
#[tokio::test(start_paused = true)]
async fn a_suspend_while_a_resume_claims_its_worker_is_aborted() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w1, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    store.gate.close();
    let resume = spawn_resume(&plane, "a", None);
    store.gate.until_waiting(1).await;
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspended));
    assert_eq!(
        plane.suspend_actor(key("a")).await.unwrap_err().code(),
        Code::Aborted
    );

    w1.drain();
    // The paused clock moves only once every task is idle: the drain has looked at
    // the actor by then.
    tokio::time::sleep(Duration::from_millis(1)).await;
    store.gate.open();
    let r = expect(&mut w1, "restore").await;
    w1.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
    let r = expect(&mut w1, "checkpoint").await;
    w1.answer(r.id, Ok(()));
    expect(&mut w1, "drained").await;
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspended));
}

/// A worker that drains (it got SIGTERM) has its actor checkpointed, not reverted
/// later: SUSPENDED with no revert pending, restored elsewhere from that snapshot. It is
/// never handed to a capacity waiter, even when its checkpoint frees it; a new worker
/// is.
#[tokio::test(start_paused = true)]
async fn a_draining_worker_checkpoints_its_actor_and_gets_nothing_new() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a", "b"]).await;
    let (mut w1, waiting) = a_running_and_b_waiting(&plane, "w1").await;

    w1.drain();
    let r = expect(&mut w1, "checkpoint").await;
    w1.answer(r.id, Ok(()));
    expect(&mut w1, "drained").await;
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspended));
    let row = store.actor(&key("a")).unwrap();
    assert_eq!((row.worker, row.revert_pending), (None, false));
    assert_eq!(plane.pool("counter"), (1, 0), "w1 has no room for anyone");
    assert!(!waiting.is_finished(), "b still waits");
    assert_eq!(
        plane.resume_actor(key("a"), None).await.unwrap_err().code(),
        Code::ResourceExhausted
    );

    let (mut w2, _) = FakeWorker::attach(&plane, "w2", "counter", app(), None).unwrap();
    let r = expect(&mut w2, "restore").await;
    w2.answer(r.id, Ok(()));
    waiting.await.unwrap().unwrap();
    assert_eq!(plane.status_of("demo", "b"), Some(S::Running));
    w1.leave();
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspended));
}

/// A worker whose stream broke in the middle of its drain (a control-plane failover)
/// re-attaches draining: it is never handed to a waiter, and its drain goes on (here:
/// nothing on it, so `Drained` at once).
#[tokio::test(start_paused = true)]
async fn a_worker_that_re_attaches_draining_gets_nothing_new() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a", "b"]).await;
    let (_w0, waiting) = a_running_and_b_waiting(&plane, "w0").await;

    let mut w1 = FakeWorker::attach_draining(&plane, "w1", "counter", app()).unwrap();
    expect(&mut w1, "drained").await;
    assert_eq!(plane.pool("counter"), (2, 0), "w1 has no room for anyone");
    assert!(!waiting.is_finished(), "b still waits");
    w1.leave();
    waiting.abort();
}

/// A worker that drains while an actor is being restored onto it waits for the
/// restore, then checkpoints that actor and is told `Drained`.
#[tokio::test(start_paused = true)]
async fn a_drain_during_a_restore_checkpoints_the_actor_once_it_runs() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w1, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let resume = spawn_resume(&plane, "a", None);
    let restore = expect(&mut w1, "restore").await;
    w1.drain();
    w1.answer(restore.id, Ok(()));
    resume.await.unwrap().unwrap();
    let r = expect(&mut w1, "checkpoint").await;
    w1.answer(r.id, Ok(()));
    expect(&mut w1, "drained").await;
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspended));
    assert!(!store.actor(&key("a")).unwrap().revert_pending);
}

fn running_on(name: &str, worker: &str) -> ActorRow {
    ActorRow {
        atespace: "demo".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        template_namespace: "default".into(),
        template: "counter".into(),
        pool: "counter".into(),
        status: ActorStatus::Running,
        version: 3,
        worker: Some(worker.into()),
        selector: Vec::new(),
        revert_pending: false,
        op_replica: None,
        snapshot: String::new(),
        reason: String::new(),
    }
}

/// After a restart, a RUNNING actor whose worker does not re-attach within the grace
/// goes back to SUSPENDED; one whose worker re-attaches reporting it keeps running.
#[tokio::test(start_paused = true)]
async fn rejoin_grace_after_a_restart() {
    let store = MemoryStore::default();
    store
        .write(Batch {
            put_atespaces: vec!["demo".into()],
            put_actors: vec![running_on("gone", "w1"), running_on("kept", "w2")],
            ..Batch::default()
        })
        .await
        .unwrap();
    let plane = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_w2, kept) =
        FakeWorker::attach(&plane, "w2", "counter", app(), Some(&key("kept"))).unwrap();
    assert!(kept, "its worker re-attached with it");
    tokio::time::sleep(Duration::from_millis(4999)).await;
    assert_eq!(
        plane.status_of("demo", "gone"),
        Some(S::Running),
        "still within the grace"
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.status_of("demo", "gone")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(
        store.actor(&key("gone")).unwrap().status,
        ActorStatus::Suspended
    );
    assert_eq!(plane.status_of("demo", "kept"), Some(S::Running));
    assert_eq!(
        store.actor(&key("kept")).unwrap().status,
        ActorStatus::Running
    );
}

/// Shutdown answers capacity waiters `Unavailable` at once, gives a restore in progress
/// up to the shutdown timeout, then tells the worker to detach and ends its stream.
#[tokio::test(start_paused = true)]
async fn shutdown_answers_waiters_waits_for_restores_and_detaches_workers() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a", "b"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let restoring = spawn_resume(&plane, "a", None);
    let restore = expect(&mut w, "restore").await;
    let waiting = resume_waiting(&plane, "b");
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.waiters("counter") == 1)
            .await
    );

    let start = Instant::now();
    let shutdown = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.shutdown(Duration::from_secs(3)).await })
    };
    let err = waiting.await.unwrap().unwrap_err();
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "the waiter is answered at once"
    );
    assert_eq!(
        (err.code(), err.message()),
        (Code::Unavailable, "the control plane is shutting down")
    );
    assert!(plane.is_shutting_down());
    let refused = plane.suspend_actor(key("a")).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "no new operation starts");

    tokio::time::sleep(Duration::from_secs(1)).await;
    w.answer(restore.id, Ok(()));
    let (actor, resumed) = restoring.await.unwrap().unwrap();
    assert!(resumed);
    assert_eq!(actor.status, S::Running as i32);
    shutdown.await.unwrap();
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(1),
        "no longer than the restore"
    );
    expect(&mut w, "detach").await;
    assert!(w.next().await.is_none(), "the stream ends");
    w.leave();
    plane.close().await;
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Running,
        "a worker told to detach keeps its actor on the record"
    );
}

/// A restore that outlasts the shutdown timeout is left to the next start.
#[tokio::test(start_paused = true)]
async fn shutdown_waits_at_most_its_timeout() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let _restoring = spawn_resume(&plane, "a", None);
    expect(&mut w, "restore").await;
    let start = Instant::now();
    plane.shutdown(Duration::from_secs(3)).await;
    assert_eq!(start.elapsed(), Duration::from_secs(3));
    expect(&mut w, "detach").await;
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Resuming,
        "recorded mid-restore: the next start settles it"
    );
    let reopened = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    let opened = Instant::now();
    assert_eq!(
        reopened.status_of("demo", "a"),
        Some(S::Resuming),
        "its worker may still host it"
    );
    assert!(
        reopened
            .wait_until(Duration::from_secs(60), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert!(
        opened.elapsed() >= config().hosting_lease,
        "settled before a hosting lease passed: {:?}",
        opened.elapsed()
    );
}

/// The record of a plane stopped in the middle of `demo/a`'s checkpoint on `w1`, whose
/// stream was cut first: `a` is SUSPENDING on `w1`.
async fn checkpoint_cut_by_a_restart() -> MemoryStore {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w1, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    restored(&plane, &mut w1, "a").await;
    let (_suspend, _checkpoint) = suspending(&plane, &mut w1).await;
    w1.leave();
    plane.shutdown(Duration::from_secs(1)).await;
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Suspending
    );
    store
}

/// A restart in the middle of a checkpoint (its worker's stream cut, the actor perhaps
/// still served there) moves the actor only once that worker must have fenced it: a
/// resume after the restart restores it on another worker no sooner than a hosting
/// lease after the start. Before, the restart recorded it SUSPENDED at once and the
/// other worker restored it while the first could still serve it.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_cut_by_a_restart_moves_the_actor_once_its_worker_fenced() {
    let store = checkpoint_cut_by_a_restart().await;

    let reopened = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    let opened = Instant::now();
    let (mut w2, _) = FakeWorker::attach(&reopened, "w2", "counter", app(), None).unwrap();
    let resume = {
        let plane = reopened.clone();
        tokio::spawn(async move { plane.resume_actor(key("a"), None).await })
    };
    let r = expect(&mut w2, "restore").await;
    assert!(
        opened.elapsed() >= config().hosting_lease,
        "restored elsewhere {:?} after the start",
        opened.elapsed()
    );
    w2.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
    assert_eq!(reopened.status_of("demo", "a"), Some(S::Running));
}

/// After a restart, an actor left mid-operation on a worker that attaches again is
/// settled at once: attaching, the worker is told to drop what it may still host.
#[tokio::test(start_paused = true)]
async fn a_half_way_actor_settles_once_its_worker_attaches_again() {
    let store = checkpoint_cut_by_a_restart().await;

    // No route leases to wait out: the settler goes straight to waiting for w1.
    let no_leases = PlaneConfig {
        route_lease: Duration::ZERO,
        ..config()
    };
    let reopened = Plane::open(Arc::new(store.clone()), no_leases)
        .await
        .unwrap();
    let opened = Instant::now();
    // The settler is at it (waiting for w1) before w1 is back.
    assert!(
        reopened
            .wait_until(Duration::from_secs(60), |p| p.is_busy("demo", "a"))
            .await
    );
    let (mut w1, kept) =
        FakeWorker::attach(&reopened, "w1", "counter", app(), Some(&key("a"))).unwrap();
    assert!(!kept);
    expect(&mut w1, "evict").await;
    assert!(
        reopened
            .wait_until(Duration::from_secs(60), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert!(
        opened.elapsed() < config().hosting_lease,
        "waited out the lease: {:?}",
        opened.elapsed()
    );
    assert_eq!(reopened.pool("counter"), (1, 1), "w1 free again");
}

/// After a restart with route leases, a worker that re-attaches without the actor the
/// record places on it is not free until that actor's release is recorded (after the
/// leases it may have granted ran out): a resume of another actor meanwhile waits for
/// the worker instead of recording it for two actors (a failed write, a 500).
#[tokio::test(start_paused = true)]
async fn a_worker_rejoining_empty_is_free_only_once_its_old_actor_is_released() {
    let store = MemoryStore::default();
    store
        .write(Batch {
            put_atespaces: vec!["demo".into()],
            put_actors: vec![running_on("old", "w1")],
            ..Batch::default()
        })
        .await
        .unwrap();
    let leased = PlaneConfig {
        route_lease: Duration::from_secs(5),
        ..config()
    };
    let plane = Plane::open(Arc::new(store.clone()), leased).await.unwrap();
    plane
        .catalog()
        .create_actor(key("new"), "default", "counter", Vec::new())
        .await
        .unwrap();
    // The worker restarted: it re-attaches hosting nothing.
    let (mut w, kept) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    assert!(!kept);
    let mut resume = {
        let plane = plane.clone();
        tokio::spawn(async move {
            plane
                .resume_actor(key("new"), Some(Duration::from_secs(30)))
                .await
        })
    };
    let r = tokio::select! {
        r = expect(&mut w, "restore") => r,
        done = &mut resume => panic!("no restore; the resume ended with {done:?}"),
    };
    assert_eq!(
        store.actor(&key("old")).unwrap().status,
        ActorStatus::Suspended,
        "the old actor was released before the worker was claimed again"
    );
    w.answer(r.id, Ok(()));
    resume.await.unwrap().expect("served, not a failed write");
    assert_eq!(plane.status_of("demo", "new"), Some(S::Running));
}

/// After a restart, a suspend waits out the previous run's route leases; a worker that
/// re-attaches meanwhile reporting the actor is told to drop it (an operation is in
/// progress on it). The checkpoint then finds the actor gone from the worker: it goes
/// back to its last snapshot, SUSPENDED, not CRASHED.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_of_an_actor_its_worker_dropped_suspends_it() {
    let store = MemoryStore::default();
    store
        .write(Batch {
            put_atespaces: vec!["demo".into()],
            put_actors: vec![running_on("a", "w1")],
            ..Batch::default()
        })
        .await
        .unwrap();
    let plane = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    tokio::task::yield_now().await;
    let (mut w, kept) =
        FakeWorker::attach(&plane, "w1", "counter", app(), Some(&key("a"))).unwrap();
    assert!(!kept, "an operation is in progress on it");
    expect(&mut w, "evict").await;
    let c = expect(&mut w, "checkpoint").await;
    w.answer_not_hosting(c.id);
    let suspended = suspend.await.unwrap().unwrap();
    assert_eq!(suspended.status, S::Suspended as i32);
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Suspended
    );
    assert_eq!(plane.pool("counter"), (1, 1), "its worker is free");
}

/// An explicit suspend's checkpoint tells the worker to wait for requests in flight at
/// most half the checkpoint timeout; a worker that answers busy leaves the actor
/// RUNNING, and the suspend answers Aborted saying so.
#[tokio::test(start_paused = true)]
async fn a_busy_actor_is_left_running_by_a_suspend() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    restored(&plane, &mut w, "a").await;
    let (suspend, c) = suspending(&plane, &mut w).await;
    let Command::Checkpoint(cmd) = &c.command else {
        unreachable!()
    };
    assert_eq!(
        cmd.idle_wait.and_then(|d| Duration::try_from(d).ok()),
        Some(Duration::from_millis(3500)),
        "half the 7 s checkpoint timeout"
    );
    w.answer_busy(c.id);
    let err = suspend.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Aborted);
    assert_eq!(
        err.message(),
        "actor demo/a is busy: its requests in flight did not end within 3.5s; it keeps running"
    );
    assert_eq!(plane.status_of("demo", "a"), Some(S::Running));
    assert_eq!(plane.pool("counter"), (1, 0));
}

/// Runs `name` on a fresh worker `id` whose app port refuses connections (its process
/// is gone as soon as its stream ends).
async fn running_on_a_dead_port(plane: &Plane, id: &str, name: &'static str) -> FakeWorker {
    let dead = dead_port();
    let (mut w, _) = FakeWorker::attach(plane, id, "counter", dead, None).unwrap();
    let resume = spawn_resume(plane, name, None);
    let r = expect(&mut w, "restore").await;
    w.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
    w
}

/// The release of a gone worker's actor whose write fails is tried again until it
/// lands; meanwhile a resume of the actor is told to retry (Aborted).
#[tokio::test(start_paused = true)]
async fn a_release_whose_write_fails_is_tried_again() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let w = running_on_a_dead_port(&plane, "w1", "a").await;
    store.gate.fail(true);
    w.leave();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(plane.status_of("demo", "a"), Some(S::Running));
    let e = plane.resume_actor(key("a"), None).await.unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    store.gate.fail(false);
    assert!(
        plane
            .wait_until(Duration::from_secs(10), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Suspended
    );
}

/// A suspend whose last write fails leaves the actor SUSPENDING and its worker taken;
/// once writes succeed again the plane settles it by itself: SUSPENDED, worker free.
#[tokio::test(start_paused = true)]
async fn an_actor_left_half_way_by_a_failed_write_is_settled() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    restored(&plane, &mut w, "a").await;
    let (suspend, c) = suspending(&plane, &mut w).await;
    store.gate.fail(true);
    w.answer(c.id, Ok(()));
    let e = suspend.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspending));
    assert_eq!(plane.pool("counter"), (1, 0), "its worker is still taken");
    tokio::time::sleep(Duration::from_secs(3)).await;
    store.gate.fail(false);
    assert!(
        plane
            .wait_until(Duration::from_secs(10), |p| p.status_of("demo", "a")
                == Some(S::Suspended)
                && p.pool("counter") == (1, 1))
            .await
    );
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Suspended
    );
}

/// A checkpoint still running when the shutdown timeout ends is cut as the plane tells
/// its worker to detach (the worker keeps its actor): the actor stays SUSPENDING on
/// record for the next start, never SUSPENDED while the worker may still serve it.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_cut_by_shutdown_is_left_for_the_next_start() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    restored(&plane, &mut w, "a").await;
    let (suspend, _) = suspending(&plane, &mut w).await;
    plane.shutdown(Duration::from_secs(1)).await;
    let e = suspend.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    expect(&mut w, "detach").await;
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Suspending
    );
}

/// A worker whose stream ends while its actor's checkpoint is refused as busy keeps
/// the actor RUNNING on record; the release its departure scheduled still happens.
#[tokio::test(start_paused = true)]
async fn an_actor_left_running_on_a_worker_that_left_is_released() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let mut w = running_on_a_dead_port(&plane, "w1", "a").await;
    let (suspend, c) = suspending(&plane, &mut w).await;
    w.answer_busy(c.id);
    w.leave();
    let e = suspend.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert!(
        plane
            .wait_until(Duration::from_secs(30), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await,
        "released: its worker is gone"
    );
}

/// An actor left half-way whose worker's stream then ends is settled only once that
/// worker must have fenced it: its hosting lease after its last renewal.
#[tokio::test(start_paused = true)]
async fn settling_waits_for_a_cut_off_worker_to_fence() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (mut w, _) =
        FakeWorker::attach(&plane, "w1", "counter", app.local_addr().unwrap(), None).unwrap();
    restored(&plane, &mut w, "a").await;
    let (suspend, c) = suspending(&plane, &mut w).await;
    store.gate.fail(true);
    w.answer(c.id, Ok(()));
    suspend.await.unwrap().unwrap_err();
    w.renew();
    let renewed = Instant::now();
    w.leave();
    store.gate.fail(false);
    assert!(
        plane
            .wait_until(Duration::from_secs(30), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(
        renewed.elapsed(),
        Duration::from_secs(8),
        "the hosting lease"
    );
}

/// Resumes of names that are no actor are counted in total, but keep nothing per name:
/// anyone can send such names through a router.
#[tokio::test(start_paused = true)]
async fn resumes_of_unknown_actors_keep_nothing_per_name() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    for i in 0..100 {
        let e = plane
            .resume_actor(key(&format!("nope{i}")), None)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
    }
    assert_eq!(plane.resume_calls_for("demo", "nope7"), 0);
    assert_eq!(plane.stats().resume_calls, 100);

    // A deleted actor's count goes with it: one created anew under its name starts
    // from zero.
    let _ = plane.resume_actor(key("a"), None).await;
    assert_eq!(plane.resume_calls_for("demo", "a"), 1);
    plane.catalog().delete_actor(key("a")).await.unwrap();
    assert_eq!(plane.resume_calls_for("demo", "a"), 0);
    plane
        .catalog()
        .create_actor(key("a"), "default", "counter", Vec::new())
        .await
        .unwrap();
    assert_eq!(plane.resume_calls_for("demo", "a"), 0);
}

/// A resume that may wait for capacity, joining one that may not (held here while the
/// actor, left mid-restore by a restart, is settled), is not refused with it when no
/// worker is free: it waits in the queue itself, and gets the next worker freed.
#[tokio::test(start_paused = true)]
async fn a_waiting_resume_that_joined_a_refused_one_waits_itself() {
    let store = MemoryStore::default();
    let mut half_way = running_on("a", "w9");
    half_way.status = ActorStatus::Resuming;
    store
        .write(Batch {
            put_atespaces: vec!["demo".into()],
            put_actors: vec![half_way, running_on("b", "w1")],
            ..Batch::default()
        })
        .await
        .unwrap();
    let plane = Plane::open(
        Arc::new(store.clone()),
        PlaneConfig {
            capacity_wait: true,
            ..config()
        },
    )
    .await
    .unwrap();
    let (mut w1, kept) =
        FakeWorker::attach(&plane, "w1", "counter", app(), Some(&key("b"))).unwrap();
    assert!(kept);
    let resume = |wait: Option<Duration>| spawn_resume(&plane, "a", wait);
    let no_wait = resume(None);
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.resume_calls_for("demo", "a")
                == 1)
            .await
    );
    let waiting = resume(Some(Duration::from_secs(60)));
    assert_eq!(
        no_wait.await.unwrap().unwrap_err().code(),
        Code::ResourceExhausted,
        "w1 hosts b"
    );
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.waiters("counter") == 1)
            .await,
        "the waiting call queued itself"
    );
    let (_suspend, c) = {
        let plane = plane.clone();
        let suspend = tokio::spawn(async move { plane.suspend_actor(key("b")).await });
        (suspend, expect(&mut w1, "checkpoint").await)
    };
    w1.answer(c.id, Ok(()));
    let r = expect(&mut w1, "restore").await;
    w1.answer(r.id, Ok(()));
    let (actor, resumed) = waiting.await.unwrap().unwrap();
    assert!(resumed);
    assert_eq!(actor.status, S::Running as i32);
}

/// A second process attached under a live worker's id is refused (ALREADY_EXISTS):
/// two processes would take turns hosting its actor. The same process re-attaching
/// replaces its stream; once the first stops renewing for the hosting lease, another
/// process may take the id.
#[tokio::test(start_paused = true)]
async fn a_second_process_with_a_live_workers_id_is_refused() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &[]).await;
    let first = FakeWorker::attach_as(&plane, "w1", "counter", app(), 1).unwrap();
    let e = FakeWorker::attach_as(&plane, "w1", "counter", app(), 2).unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert!(e.message().contains("--worker-id"), "{e}");

    // The same process again (its old stream died on its side): replaced.
    let mut again = FakeWorker::attach_as(&plane, "w1", "counter", app(), 1).unwrap();
    drop(first);
    tokio::time::sleep(config().hosting_lease / 2).await;
    again.renew();
    let e = FakeWorker::attach_as(&plane, "w1", "counter", app(), 2).unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "still renewing: {e}");

    // Silent for a hosting lease: it has fenced its actor, another process may attach.
    tokio::time::sleep(config().hosting_lease).await;
    let _second = FakeWorker::attach_as(&plane, "w1", "counter", app(), 2).unwrap();
    assert!(again.next().await.is_none(), "the replaced stream is ended");
}

/// A process whose stream ended may still serve its actor until its hosting lease
/// runs out: another process with its id is refused until then, and the actor stays
/// on the record (before, the newcomer got in and the actor was released at once).
#[tokio::test(start_paused = true)]
async fn a_second_process_is_refused_while_the_first_may_still_serve() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["p1", "p2"]).await;
    let mut first = FakeWorker::attach_as(&plane, "w1", "counter", app(), 1).unwrap();
    restored(&plane, &mut first, "p1").await;
    first.leave();
    let e = FakeWorker::attach_as(&plane, "w1", "counter", app(), 2).unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    let p1 = plane.catalog().get_actor(&key("p1")).unwrap();
    assert_eq!(
        p1.status(),
        S::Running,
        "still placed on w1 while it may serve"
    );
    // A process that had no actor may be replaced as soon as its stream ended.
    let idle = FakeWorker::attach_as(&plane, "w2", "counter", app(), 1).unwrap();
    idle.leave();
    let newcomer = FakeWorker::attach_as(&plane, "w2", "counter", app(), 2).unwrap();
    newcomer.leave();
    // Nor one that names no incarnation: it cannot take over a live process's id
    // (and its actor's traffic) by leaving the field out.
    let e = FakeWorker::attach(&plane, "w1", "counter", app(), Some(&key("p1"))).unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    // A worker that names none (an older one) replaces its own record as before, and
    // keeps the actor it reports.
    let (mut old, _) = FakeWorker::attach(&plane, "w3", "counter", app(), None).unwrap();
    restored(&plane, &mut old, "p2").await;
    old.leave();
    let (mut back, kept) =
        FakeWorker::attach(&plane, "w3", "counter", app(), Some(&key("p2"))).unwrap();
    assert!(kept);
    drop(back.next());
}

/// A worker that attaches again while its actor's RUNNING record is being written
/// is told to evict the actor (an operation still held it): once that write lands,
/// the actor goes back to SUSPENDED instead of staying RUNNING, on record, on a worker
/// that no longer hosts it (every resume would be routed there and get 421).
#[tokio::test(start_paused = true)]
async fn an_actor_evicted_by_a_reattach_during_its_last_write_is_released() {
    let (store, plane, w, resume, r) = restoring(app()).await;
    restored_but_unwritten(&store, &w, &r).await;
    let (mut again, kept) =
        FakeWorker::attach(&plane, "w1", "counter", app(), Some(&key("a"))).unwrap();
    assert!(!kept, "an operation holds the actor");
    expect(&mut again, "evict").await;
    store.gate.open();
    let _ = resume.await.unwrap();
    assert!(
        plane
            .wait_until(Duration::from_secs(30), |p| p.status_of("demo", "a")
                == Some(S::Suspended)
                && p.pool("counter") == (1, 1))
            .await,
        "released: {:?}",
        plane.status_of("demo", "a")
    );
    // A later activation of it may use that worker, on that same stream.
    let resume = spawn_resume(&plane, "a", None);
    let r = tokio::time::timeout(Duration::from_secs(10), expect(&mut again, "restore"))
        .await
        .unwrap_or_else(|_| panic!("no restore: {:?}", plane.status_of("demo", "a")));
    again.answer(r.id, Ok(()));
    assert_eq!(resume.await.unwrap().unwrap().0.status, S::Running as i32);
}

/// A worker that leaves while its actor's RUNNING record is being written leaves no
/// answer to route to: the resume answers `Unavailable` (the router parks and asks
/// again), whether the worker's process died (its port refuses) or only its stream
/// was cut. Before, it answered RUNNING with no address, which the router turns into
/// a 500 at once.
#[tokio::test(start_paused = true)]
async fn a_resume_whose_worker_left_during_its_last_write_is_unavailable() {
    for port in [dead_port(), app()] {
        let (store, _plane, w, resume, r) = restoring(port).await;
        restored_but_unwritten(&store, &w, &r).await;
        w.leave();
        store.gate.open();
        let answer = resume.await.unwrap();
        assert_eq!(
            answer.as_ref().map_err(tonic::Status::code).err(),
            Some(Code::Unavailable),
            "{port}: {answer:?}"
        );
    }
}

/// A suspend the worker refuses (the actor is busy) whose write of RUNNING back
/// fails keeps trying that write: the actor runs on. Before, the record stayed
/// SUSPENDING with no operation on it, and the settler evicted the busy actor and
/// took it back to its last snapshot, losing everything it did since.
#[tokio::test(start_paused = true)]
async fn a_busy_actor_stays_running_when_its_record_cannot_be_written() {
    let (store, plane, mut w, resume, r) = restoring(app()).await;
    w.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    let c = expect(&mut w, "checkpoint").await;
    store.gate.fail(true);
    w.answer_busy(c.id);
    // Long enough for the settler's first rounds (0.5 s doubling).
    tokio::time::sleep(Duration::from_secs(4)).await;
    store.gate.fail(false);
    assert_eq!(
        suspend.await.unwrap().unwrap_err().code(),
        Code::Aborted,
        "busy: it keeps running"
    );
    assert!(
        plane
            .wait_until(Duration::from_secs(30), |p| p.status_of("demo", "a")
                == Some(S::Running))
            .await
    );
    assert_eq!(store.actor(&key("a")).unwrap().status, ActorStatus::Running);
    let next = tokio::time::timeout(Duration::from_secs(30), w.next()).await;
    assert!(
        !matches!(&next, Ok(Some(r)) if matches!(r.command, Command::Evict(_))),
        "the busy actor was evicted"
    );
}

/// A first run told its workers a hosting lease of `lease`, with `a` RUNNING on `w1`
/// (its app at `port`); it has stopped.
async fn ran_with_hosting_lease(store: &MemoryStore, lease: Duration, port: SocketAddr) {
    let config = PlaneConfig {
        hosting_lease: lease,
        ..config()
    };
    let first = plane_configured(store, config, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&first, "w1", "counter", port, None).unwrap();
    let resume = spawn_resume(&first, "a", None);
    let r = expect(&mut w, "restore").await;
    w.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
    first.shutdown(Duration::ZERO).await;
}

/// How long after `since` the plane records `a` SUSPENDED (bounded).
async fn released_after(plane: &Plane, since: Instant) -> Duration {
    assert!(
        plane
            .wait_until(Duration::from_secs(120), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    since.elapsed()
}

/// A plane restarted with a shorter `--hosting-lease` still waits out the longer one
/// its previous run told the workers before it releases an actor whose worker did not
/// re-attach: that worker may serve it until then. Before, it waited its own lease
/// (or the rejoin grace) only.
#[tokio::test(start_paused = true)]
async fn a_restart_with_a_shorter_hosting_lease_waits_out_the_longer_one() {
    let longer = Duration::from_secs(30);
    let store = MemoryStore::default();
    ran_with_hosting_lease(&store, longer, app()).await;
    let restarted = Instant::now();
    let plane = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    let waited = released_after(&plane, restarted).await;
    assert!(waited >= longer, "released {waited:?} after the start");
    // Once that has passed, the record is this run's lease again.
    plane.shutdown(Duration::ZERO).await;
    assert_eq!(
        store.load().await.unwrap().hosting_lease,
        Some(config().hosting_lease)
    );
}

/// The same for a worker that re-attaches after such a restart but whose stream ends
/// before it reads its Welcome: it still goes by the longer lease. Before, its actor
/// was released this run's lease after its attach.
#[tokio::test(start_paused = true)]
async fn a_worker_gone_before_its_welcome_goes_by_the_longer_hosting_lease() {
    let longer = Duration::from_secs(30);
    // Its app still answers: only its stream was cut.
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = app.local_addr().unwrap();
    let store = MemoryStore::default();
    ran_with_hosting_lease(&store, longer, port).await;
    let restarted = Instant::now();
    let plane = Plane::open(Arc::new(store.clone()), config())
        .await
        .unwrap();
    let (w, kept) = FakeWorker::attach(&plane, "w1", "counter", port, Some(&key("a"))).unwrap();
    assert!(kept);
    w.leave();
    let waited = released_after(&plane, restarted).await;
    assert!(waited >= longer, "released {waited:?} after the start");
    drop(app);
}

/// A plane that lost its database lock (another replica may be active) detaches its
/// workers at once, even with an operation in progress, and takes no new one: none
/// keeps hosting on its renewals while that operation winds down. Before, workers were
/// detached only after the operations' shutdown time.
#[tokio::test(start_paused = true)]
async fn a_plane_that_steps_down_detaches_its_workers_first() {
    let (_store, plane, mut w, resume, _restore) = restoring(app()).await;
    plane.step_down();
    expect(&mut w, "detach").await;
    let again = FakeWorker::attach(&plane, "w2", "counter", app(), None);
    assert_eq!(
        again.err().map(|e| e.code()),
        Some(Code::Unavailable),
        "no join once stepped down"
    );
    plane.shutdown(Duration::from_secs(1)).await;
    drop(resume);
}

/// The same when the worker's process dies during that write (its port refuses at
/// once): the release of its actor waits for the operation to end instead of giving
/// up, so the actor does not stay RUNNING on a worker that is gone.
#[tokio::test(start_paused = true)]
async fn an_actor_whose_worker_dies_during_its_last_write_is_released() {
    let (store, plane, w, resume, r) = restoring(dead_port()).await;
    restored_but_unwritten(&store, &w, &r).await;
    w.leave();
    // The departure's release runs (the port refuses) while the write still waits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    store.gate.open();
    let _ = resume.await.unwrap();
    assert!(
        plane
            .wait_until(Duration::from_secs(30), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await,
        "released: {:?}",
        plane.status_of("demo", "a")
    );
    assert_eq!(
        store.actor(&key("a")).unwrap().status,
        ActorStatus::Suspended
    );
}

/// A worker reserved for one actor's activation whose stream ends and comes back
/// while that actor's claim is being written stays reserved for it: it is not handed
/// to another actor meanwhile (two actors on one worker, which a database's
/// constraint would refuse as the second claim's write, failing that resume).
#[tokio::test(start_paused = true)]
async fn a_reservation_outlives_its_workers_reattach() {
    let store = MemoryStore::default();
    let plane = waiting_plane(&store, &["a", "b"]).await;
    let (w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    store.gate.close();
    let resume = |name: &'static str, wait: Option<Duration>| spawn_resume(&plane, name, wait);
    let a = resume("a", None);
    store.gate.until_waiting(1).await;
    w.leave();
    let (mut again, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let b = resume("b", Some(Duration::from_secs(60)));
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.waiters("counter") == 1)
            .await,
        "b waits: w1 is a's"
    );
    store.gate.open();
    let r = expect(&mut again, "restore").await;
    again.answer(r.id, Ok(()));
    let (actor, _) = a.await.unwrap().unwrap();
    assert_eq!(actor.status, S::Running as i32);
    assert!(!b.is_finished(), "b waits on");
    assert_eq!(store.actor(&key("b")).unwrap().worker, None);
}

/// A worker whose stream the plane has ended (it stopped reading its commands) is
/// not given an actor in the moment before its stream's end reaches the plane: the
/// restore would fail and the resume answer Unavailable. The pool has no room.
#[tokio::test(start_paused = true)]
async fn a_worker_whose_stream_is_ending_gets_no_actor() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    w.cut();
    let e = plane.resume_actor(key("a"), None).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(w.next().await.is_none(), "no restore was sent");
}

/// The reservation of a worker whose stream ended is forgotten when it ends without
/// a claim (its write failed): the worker, back, is free for the next actor.
#[tokio::test(start_paused = true)]
async fn a_reservation_that_ended_while_its_worker_was_away_is_forgotten() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a", "b"]).await;
    let (w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    store.gate.close();
    let a = spawn_resume(&plane, "a", None);
    store.gate.until_waiting(1).await;
    w.leave();
    store.gate.fail(true);
    store.gate.open();
    assert_eq!(a.await.unwrap().unwrap_err().code(), Code::Unavailable);
    store.gate.fail(false);
    let (mut again, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    assert_eq!(plane.pool("counter"), (1, 1), "w1 is free");
    let b = spawn_resume(&plane, "b", None);
    let r = expect(&mut again, "restore").await;
    again.answer(r.id, Ok(()));
    assert_eq!(b.await.unwrap().unwrap().0.actor_id, "b");
}

/// A worker's Welcome is the first command it reads, even when an actor waiting for
/// capacity is handed to it as it attaches: a Restore read before a Welcome that
/// keeps nothing would be undone by that Welcome (the worker drops what it does not
/// keep), leaving the actor RUNNING on record on a worker without it.
#[tokio::test(start_paused = true)]
async fn the_welcome_comes_before_any_restore() {
    let store = MemoryStore::default();
    let plane = waiting_plane(&store, &["a"]).await;
    let waiting = spawn_resume(&plane, "a", Some(Duration::from_secs(60)));
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.waiters("counter") == 1)
            .await
    );
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let first = w.next_with_welcome().await;
    assert!(
        matches!(first, Some(Command::Welcome(ref welcome)) if !welcome.hosting_kept),
        "{first:?}"
    );
    let r = expect(&mut w, "restore").await;
    w.answer(r.id, Ok(()));
    assert_eq!(waiting.await.unwrap().unwrap().0.status, S::Running as i32);
}

/// A `wait_for_capacity` past what the clock holds (any client may send one) is taken
/// as a long wait, not a panic of the call.
#[tokio::test(start_paused = true)]
async fn a_wait_for_capacity_past_the_clock_is_a_long_wait() {
    let store = MemoryStore::default();
    let plane = waiting_plane(&store, &["a"]).await;
    let waiting = spawn_resume(&plane, "a", Some(Duration::MAX));
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.waiters("counter") == 1)
            .await,
        "it waits"
    );
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let r = expect(&mut w, "restore").await;
    w.answer(r.id, Ok(()));
    assert_eq!(waiting.await.unwrap().unwrap().0.status, S::Running as i32);
}

/// A program's exit reported by its worker: the actor is CRASHED with the status and
/// the last output, its worker free, its record durable.
#[tokio::test(start_paused = true)]
async fn a_reported_exit_crashes_the_actor_and_frees_its_worker() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let resume = spawn_resume(&plane, "a", None);
    let r = expect(&mut w, "restore").await;
    w.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
    w.exited(&key("a"), "exited with status 3", r.id);
    assert!(
        plane
            .wait_until(Duration::from_secs(5), |p| p.status_of("demo", "a")
                == Some(S::Crashed))
            .await
    );
    let a = plane.catalog().get_actor(&key("a")).unwrap();
    assert_eq!(
        a.status_reason,
        "its program exited with status 3; its last output:\nlast words"
    );
    let stored = store.actor(&key("a")).unwrap();
    assert_eq!(stored.status, ActorStatus::Crashed);
    assert_eq!(stored.reason, a.status_reason, "durable");
    assert!(
        plane
            .wait_until(Duration::from_secs(5), |p| p.pool("counter") == (1, 1))
            .await
    );
    // A revert clears the reason.
    let reverted = plane.revert_actor(key("a")).await.unwrap();
    assert!(reverted.status_reason.is_empty());
}

/// An exit reported after the worker answered a checkpoint, and was given the same
/// actor again (a new run), is of the old run: the new one is not crashed.
#[tokio::test(start_paused = true)]
async fn a_late_exit_report_does_not_crash_a_later_run() {
    let store = MemoryStore::default();
    let plane = plane_with(&store, &["a"]).await;
    let (mut w, _) = FakeWorker::attach(&plane, "w1", "counter", app(), None).unwrap();
    let resume = spawn_resume(&plane, "a", None);
    let first = expect(&mut w, "restore").await;
    w.answer(first.id, Ok(()));
    resume.await.unwrap().unwrap();
    let (suspend, c) = suspending(&plane, &mut w).await;
    w.answer(c.id, Ok(()));
    suspend.await.unwrap().unwrap();
    let resume = spawn_resume(&plane, "a", None);
    let second = expect(&mut w, "restore").await;
    // The first run's exit comes now, while the second restore is in progress.
    w.exited(&key("a"), "exited with status 1", first.id);
    w.answer(second.id, Ok(()));
    resume.await.unwrap().unwrap();
    let crashed = plane
        .wait_until(Duration::from_secs(30), |p| {
            p.status_of("demo", "a") == Some(S::Crashed)
        })
        .await;
    assert!(
        !crashed,
        "the second run is not crashed by the first's exit"
    );
    assert_eq!(plane.status_of("demo", "a"), Some(S::Running));
    // Its own exit does crash it.
    w.exited(&key("a"), "exited with status 2", second.id);
    assert!(
        plane
            .wait_until(Duration::from_secs(5), |p| p.status_of("demo", "a")
                == Some(S::Crashed))
            .await
    );
}
