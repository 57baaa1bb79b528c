//! Idle suspension and demand eviction on tokio's paused clock, with scripted workers
//! (the worker double) and an in-memory store.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Code;
use valet_control::plane::PlaneConfig;
use valet_control::testing::{FakeWorker, MemoryStore, Received};
use valet_control::{ActorKey, Plane};
use valet_proto::ateapi::actor::Status as S;
use valet_proto::worker::checkpoint::Fence;
use valet_proto::worker::worker_command::Command;

fn key(name: &str) -> ActorKey {
    ActorKey::new("demo", name).unwrap()
}

async fn plane(config: PlaneConfig, actors: &[&str]) -> Plane {
    let plane = Plane::open(Arc::new(MemoryStore::default()), config)
        .await
        .unwrap();
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

fn worker(plane: &Plane, id: &str) -> FakeWorker {
    let port = 9000 + id.len() as u16 + id.bytes().map(u16::from).sum::<u16>() % 100;
    let app = format!("127.0.0.1:{port}").parse().unwrap();
    FakeWorker::attach(plane, id, "counter", app, None)
        .unwrap()
        .0
}

/// Resumes `name` onto `w` (which answers the restore).
async fn resumed_on(plane: &Plane, w: &mut FakeWorker, name: &str) {
    let resume = {
        let plane = plane.clone();
        let k = key(name);
        tokio::spawn(async move { plane.resume_actor(k, None).await })
    };
    let r = w.next().await.unwrap();
    assert!(matches!(r.command, Command::Restore(_)), "{r:?}");
    w.answer(r.id, Ok(()));
    resume.await.unwrap().unwrap();
}

/// The next command, which must be a policy's checkpoint naming `mark`.
async fn policy_checkpoint(w: &mut FakeWorker, mark: u64) -> Received {
    let r = w.next().await.unwrap();
    match &r.command {
        Command::Checkpoint(c) => assert_eq!(c.fence, Some(Fence::IdleSince(mark)), "{r:?}"),
        other => panic!("expected a checkpoint, got {other:?}"),
    }
    r
}

fn metric(plane: &Plane, name: &str) -> f64 {
    valet_telemetry::sample_of(&plane.render_metrics(), name, &[])
}

/// An actor idle for `--idle-suspend-after` is suspended; activity restarts the clock;
/// one with a request in flight is never suspended.
#[tokio::test(start_paused = true)]
async fn idle_actors_are_suspended() {
    let config = PlaneConfig {
        idle_suspend_after: Duration::from_secs(300),
        ..PlaneConfig::default()
    };
    let plane = plane(config, &["a", "b"]).await;
    let mut wa = worker(&plane, "wa");
    let mut wb = worker(&plane, "wb");
    resumed_on(&plane, &mut wa, "a").await;
    resumed_on(&plane, &mut wb, "b").await;
    let start = Instant::now();

    // a: idle, then a request at 100 s restarts its clock.
    tokio::time::sleep(Duration::from_secs(100)).await;
    wa.report(&key("a"), 1, 1);
    wa.report(&key("a"), 0, 2);
    // b: a request in flight from 200 s on, for good.
    tokio::time::sleep(Duration::from_secs(100)).await;
    wb.report(&key("b"), 1, 1);

    let r = policy_checkpoint(&mut wa, 2).await;
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(400),
        "300 s after its last request"
    );
    wa.answer(r.id, Ok(()));
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
    assert_eq!(metric(&plane, "valet_control_idle_suspensions_total"), 1.0);

    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(
        plane.status_of("demo", "b"),
        Some(S::Running),
        "busy: never suspended"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(1), wb.next())
            .await
            .is_err(),
        "b's worker was never asked"
    );
}

/// A resume waiting for a full pool evicts the least recently active idle actor once it
/// has been idle `--evict-idle-after`; its worker goes to the waiter.
#[tokio::test(start_paused = true)]
async fn a_waiter_evicts_the_least_recently_active() {
    let config = PlaneConfig {
        evict_idle_after: Duration::from_secs(10),
        ..PlaneConfig::default()
    };
    let plane = plane(config, &["old", "new", "waiting"]).await;
    let mut w1 = worker(&plane, "w1");
    let mut w2 = worker(&plane, "w2");
    resumed_on(&plane, &mut w1, "old").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    resumed_on(&plane, &mut w2, "new").await;
    let start = Instant::now();
    let waiter = {
        let plane = plane.clone();
        tokio::spawn(async move {
            plane
                .resume_actor(key("waiting"), Some(Duration::from_secs(60)))
                .await
        })
    };
    let r = policy_checkpoint(&mut w1, 0).await;
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(7),
        "when the oldest crosses 10 s idle"
    );
    w1.answer(r.id, Ok(()));
    let restore = w1.next().await.unwrap();
    assert!(
        matches!(restore.command, Command::Restore(_)),
        "the waiter gets w1"
    );
    w1.answer(restore.id, Ok(()));
    let (actor, resumed) = waiter.await.unwrap().unwrap();
    assert!(resumed);
    assert_eq!(actor.ateom_pod_name, "w1");
    assert_eq!(plane.status_of("demo", "old"), Some(S::Suspended));
    assert_eq!(plane.status_of("demo", "new"), Some(S::Running));
    assert_eq!(metric(&plane, "valet_control_evictions_total"), 1.0);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(1), w2.next())
            .await
            .is_err(),
        "one waiter, one eviction"
    );
}

/// A worker draining frees nothing for the pool (it leaves): its actor's checkpoint
/// does not stand in for an eviction a waiter needs. Before, a waiter arriving during
/// a drain evicted nothing until the drain's checkpoint ended.
#[tokio::test(start_paused = true)]
async fn a_drain_does_not_hold_back_an_eviction() {
    let config = PlaneConfig {
        evict_idle_after: Duration::from_secs(10),
        ..PlaneConfig::default()
    };
    let plane = plane(config, &["old", "busy", "waiting"]).await;
    let mut w1 = worker(&plane, "w1");
    let mut w2 = worker(&plane, "w2");
    resumed_on(&plane, &mut w1, "old").await;
    resumed_on(&plane, &mut w2, "busy").await;
    w2.drain();
    let drain = w2.next().await.unwrap();
    assert!(matches!(drain.command, Command::Checkpoint(_)), "{drain:?}");
    let start = Instant::now();
    let _waiter = spawn_resume(&plane, "waiting", Some(Duration::from_secs(60)));
    // The drain's checkpoint is not answered: the busy actor's requests go on.
    let r = tokio::time::timeout(Duration::from_secs(20), policy_checkpoint(&mut w1, 0))
        .await
        .expect("no eviction while the other worker drains");
    assert_eq!(start.elapsed(), Duration::from_secs(10));
    w1.answer(r.id, Ok(()));
    let restore = w1.next().await.unwrap();
    assert!(
        matches!(restore.command, Command::Restore(_)),
        "{restore:?}"
    );
}

/// A router that polls (no capacity wait) and retries every 100 ms: its one parked
/// request makes exactly one eviction, and the next retry gets the freed worker.
#[tokio::test(start_paused = true)]
async fn a_polling_router_causes_exactly_one_eviction() {
    let config = PlaneConfig {
        capacity_wait: false,
        evict_idle_after: Duration::from_secs(10),
        ..PlaneConfig::default()
    };
    let plane = plane(config, &["a", "b", "c", "p"]).await;
    let mut ws = [
        worker(&plane, "w1"),
        worker(&plane, "w2"),
        worker(&plane, "w3"),
    ];
    for (w, a) in ws.iter_mut().zip(["a", "b", "c"]) {
        resumed_on(&plane, w, a).await;
    }
    tokio::time::sleep(Duration::from_secs(30)).await;
    let mut evicted = None;
    let mut served = false;
    for _ in 0..100 {
        let resume = {
            let plane = plane.clone();
            tokio::spawn(async move { plane.resume_actor(key("p"), None).await })
        };
        // Answer whatever the workers are asked meanwhile.
        for (i, w) in ws.iter_mut().enumerate() {
            while let Ok(Some(r)) = tokio::time::timeout(Duration::from_millis(1), w.next()).await {
                match r.command {
                    Command::Checkpoint(_) => {
                        assert!(evicted.is_none(), "a second eviction");
                        evicted = Some(i);
                        w.answer(r.id, Ok(()));
                    }
                    Command::Restore(_) => w.answer(r.id, Ok(())),
                    _ => {}
                }
            }
        }
        match resume.await.unwrap() {
            Ok(_) => {
                served = true;
                break;
            }
            Err(e) => assert!(
                matches!(e.code(), Code::ResourceExhausted | Code::Aborted),
                "{e:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served, "the parked request was served");
    assert!(evicted.is_some());
    tokio::time::sleep(Duration::from_secs(60)).await;
    for w in &mut ws {
        assert!(
            tokio::time::timeout(Duration::from_millis(1), w.next())
                .await
                .is_err()
        );
    }
    assert_eq!(metric(&plane, "valet_control_evictions_total"), 1.0);
}

/// A policy's checkpoint the worker refuses (the actor turned busy) leaves the actor
/// running, and the next idle one is taken instead.
#[tokio::test(start_paused = true)]
async fn a_busy_answer_skips_the_actor() {
    let config = PlaneConfig {
        evict_idle_after: Duration::from_secs(10),
        ..PlaneConfig::default()
    };
    let plane = plane(config, &["a", "b", "waiting"]).await;
    let mut wa = worker(&plane, "wa");
    let mut wb = worker(&plane, "wb");
    resumed_on(&plane, &mut wa, "a").await;
    resumed_on(&plane, &mut wb, "b").await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    let waiter = {
        let plane = plane.clone();
        tokio::spawn(async move {
            plane
                .resume_actor(key("waiting"), Some(Duration::from_secs(60)))
                .await
        })
    };
    let r = policy_checkpoint(&mut wa, 0).await;
    wa.answer_busy(r.id);
    let r = policy_checkpoint(&mut wb, 0).await;
    assert_eq!(
        plane.status_of("demo", "a"),
        Some(S::Running),
        "a left running"
    );
    wb.answer(r.id, Ok(()));
    let restore = wb.next().await.unwrap();
    wb.answer(restore.id, Ok(()));
    assert_eq!(waiter.await.unwrap().unwrap().0.ateom_pod_name, "wb");
    assert_eq!(metric(&plane, "valet_control_evictions_total"), 1.0);
}

/// An idle suspension the worker refuses (its report of a request had not arrived
/// yet) is tried again once the actor is idle under its new mark.
#[tokio::test(start_paused = true)]
async fn a_refused_suspension_is_tried_again() {
    let config = PlaneConfig {
        idle_suspend_after: Duration::from_secs(1),
        ..PlaneConfig::default()
    };
    let plane = plane(config, &["a"]).await;
    let mut w = worker(&plane, "w");
    resumed_on(&plane, &mut w, "a").await;
    let r = policy_checkpoint(&mut w, 0).await;
    w.answer_busy(r.id);
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| !p.is_busy("demo", "a"))
            .await
    );
    w.report(&key("a"), 0, 2);
    let start = Instant::now();
    let r = policy_checkpoint(&mut w, 2).await;
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    w.answer(r.id, Ok(()));
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.status_of("demo", "a")
                == Some(S::Suspended))
            .await
    );
}

/// A route lease's renewal is no activity of the actor's: a router renews the lease
/// of an actor it routed to at some point in the lease, and the worker's own reports
/// say when that was. Before, each renewal restarted the idle clock, so an idle actor
/// under a lease was suspended up to a lease late.
#[tokio::test(start_paused = true)]
async fn a_lease_renewal_is_no_activity() {
    let config = PlaneConfig {
        idle_suspend_after: Duration::from_secs(300),
        route_lease: Duration::from_secs(60),
        ..PlaneConfig::default()
    };
    let plane = plane(config, &["a"]).await;
    let (tx, _watch) = tokio::sync::mpsc::channel(16);
    plane.leases().router_watching("r1", tx).unwrap();
    let mut w = worker(&plane, "w");
    let start = Instant::now();
    let resume = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.resume_leased(key("a"), None, Some("r1")).await })
    };
    let r = w.next().await.unwrap();
    w.answer(r.id, Ok(()));
    assert!(resume.await.unwrap().unwrap().2.is_some(), "leased");

    tokio::time::sleep(Duration::from_secs(50)).await;
    w.renew();
    let (_, _, renewed) = plane
        .resume_leased(key("a"), None, Some("r1"))
        .await
        .unwrap();
    assert!(renewed.is_some(), "renewed");

    let c = policy_checkpoint(&mut w, 0).await;
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(300),
        "300 s after the restore, the renewal aside"
    );
    w.answer(c.id, Ok(()));
}

/// `checkpoint_all(timeout)` running on its own task.
fn spawn_checkpoint_all(plane: &Plane, timeout: Duration) -> tokio::task::JoinHandle<Vec<String>> {
    let plane = plane.clone();
    tokio::spawn(async move { plane.checkpoint_all(timeout).await })
}

/// `resume_actor(name, wait)` running on its own task.
fn spawn_resume(
    plane: &Plane,
    name: &str,
    wait: Option<Duration>,
) -> tokio::task::JoinHandle<Result<(valet_proto::ateapi::Actor, bool), tonic::Status>> {
    let (plane, k) = (plane.clone(), key(name));
    tokio::spawn(async move { plane.resume_actor(k, wait).await })
}

/// The worker's next command within 30 s (of the paused clock): `what` otherwise.
async fn next_within(w: &mut FakeWorker, what: &str) -> Received {
    tokio::time::timeout(Duration::from_secs(30), w.next())
        .await
        .unwrap_or_else(|_| panic!("{what}"))
        .unwrap()
}

/// A stop's checkpoint of every actor also takes the one still being restored (a
/// parked request's resume, say): it is checkpointed once it runs. Before, only the
/// actors RUNNING when the stop began were, and that one stayed RUNNING on a worker
/// about to stop, reported by no one.
#[tokio::test(start_paused = true)]
async fn checkpoint_all_takes_an_actor_being_restored() {
    let plane = plane(PlaneConfig::default(), &["a", "b"]).await;
    let mut wa = worker(&plane, "wa");
    let mut wb = worker(&plane, "wb");
    resumed_on(&plane, &mut wa, "a").await;
    let resume_b = spawn_resume(&plane, "b", None);
    let restore = wb.next().await.unwrap();
    assert!(
        matches!(restore.command, Command::Restore(_)),
        "{restore:?}"
    );

    let all = spawn_checkpoint_all(&plane, Duration::from_secs(10));
    let c = wa.next().await.unwrap();
    assert!(matches!(c.command, Command::Checkpoint(_)), "{c:?}");
    wa.answer(c.id, Ok(()));
    wb.answer(restore.id, Ok(()));
    resume_b.await.unwrap().unwrap();
    let c = next_within(&mut wb, "b is checkpointed too").await;
    assert!(matches!(c.command, Command::Checkpoint(_)), "b too: {c:?}");
    wb.answer(c.id, Ok(()));
    assert_eq!(all.await.unwrap(), Vec::<String>::new());
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspended));
    assert_eq!(plane.status_of("demo", "b"), Some(S::Suspended));
}

/// An actor whose requests in flight do not end in time (`Aborted`) is tried again
/// within the stop's timeout.
#[tokio::test(start_paused = true)]
async fn checkpoint_all_tries_a_busy_actor_again() {
    let plane = plane(PlaneConfig::default(), &["a"]).await;
    let mut wa = worker(&plane, "wa");
    resumed_on(&plane, &mut wa, "a").await;
    let start = Instant::now();
    let all = spawn_checkpoint_all(&plane, Duration::from_secs(10));
    let c = wa.next().await.unwrap();
    wa.answer_busy(c.id);
    let c = next_within(&mut wa, "asked again").await;
    assert!(
        matches!(c.command, Command::Checkpoint(_)),
        "asked again: {c:?}"
    );
    wa.answer(c.id, Ok(()));
    assert_eq!(all.await.unwrap(), Vec::<String>::new());
    assert!(start.elapsed() < Duration::from_secs(10));
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspended));
}

/// A resume waiting for capacity when the stop begins (still SUSPENDED, its
/// operation held) gets the worker the stop's first checkpoint frees, and is then
/// checkpointed in turn: the stop leaves nothing running.
#[tokio::test(start_paused = true)]
async fn checkpoint_all_takes_a_resume_waiting_for_capacity() {
    let plane = plane(PlaneConfig::default(), &["a", "b"]).await;
    let mut w = worker(&plane, "w");
    resumed_on(&plane, &mut w, "a").await;
    let resume_b = spawn_resume(&plane, "b", Some(Duration::from_secs(60)));
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.waiters("counter") == 1)
            .await,
        "b waits for capacity"
    );
    let all = spawn_checkpoint_all(&plane, Duration::from_secs(30));
    let c = next_within(&mut w, "a command").await;
    assert!(
        matches!(c.command, Command::Checkpoint(_)),
        "a first: {c:?}"
    );
    w.answer(c.id, Ok(()));
    let r = next_within(&mut w, "a command").await;
    assert!(
        matches!(r.command, Command::Restore(_)),
        "b gets the worker: {r:?}"
    );
    w.answer(r.id, Ok(()));
    resume_b.await.unwrap().unwrap();
    let c = next_within(&mut w, "b is checkpointed too").await;
    assert!(matches!(c.command, Command::Checkpoint(_)), "{c:?}");
    w.answer(c.id, Ok(()));
    assert_eq!(all.await.unwrap(), Vec::<String>::new());
    assert_eq!(plane.status_of("demo", "b"), Some(S::Suspended));
}

/// A resume still queued for capacity when the stop begins (no worker will come) is
/// not waited for: the stop ends at once, and the plane's shutdown answers it. (One
/// handed a worker is: see `checkpoint_all_takes_a_resume_waiting_for_capacity`.)
#[tokio::test(start_paused = true)]
async fn checkpoint_all_does_not_wait_for_a_resume_still_queued() {
    let plane = plane(PlaneConfig::default(), &["b"]).await;
    let resume_b = spawn_resume(&plane, "b", Some(Duration::from_secs(60)));
    assert!(
        plane
            .wait_until(Duration::from_secs(1), |p| p.waiters("counter") == 1)
            .await,
        "b waits for capacity"
    );
    let start = Instant::now();
    assert_eq!(
        spawn_checkpoint_all(&plane, Duration::from_secs(30))
            .await
            .unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(start.elapsed(), Duration::ZERO, "not the whole timeout");
    assert_eq!(plane.status_of("demo", "b"), Some(S::Suspended));
    resume_b.abort();
}
