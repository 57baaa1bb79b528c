//! Mutating RPCs whose caller leaves mid-write (its deadline passes, or its connection
//! drops) finish as a unit; writes that fail change nothing. A real gRPC server, a
//! real SQLite file behind a gate the test opens, and a scripted worker.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::Code;
use tonic::transport::Channel;
use valet_control::testing::{FakeWorker, Gate, Gated};
use valet_control::{ActorKey, Plane, PlaneConfig, SqliteStore};
use valet_proto::ateapi::actor::Status as S;
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_proto::worker::worker_command::Command;

use common::{WAIT, aref};

struct Served {
    plane: Plane,
    client: ControlClient<Channel>,
    gate: Arc<Gate>,
    sqlite: SqliteStore,
    dir: tempfile::TempDir,
}

async fn served() -> Served {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path()).unwrap();
    let gated = Gated::new(sqlite.clone());
    let gate = Arc::clone(&gated.gate);
    let plane = Plane::open(Arc::new(gated), PlaneConfig::default())
        .await
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(valet_control::serve(
        listener,
        plane.clone(),
        std::future::pending(),
        Duration::from_secs(10),
        Default::default(),
    ));
    let client = ControlClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy(),
    );
    Served {
        plane,
        client,
        gate,
        sqlite,
        dir,
    }
}

/// A worker that answers every restore and checkpoint at once.
fn obliging_worker(plane: &Plane, id: &str) {
    let (mut w, _) = FakeWorker::attach(
        plane,
        id,
        "counter",
        "127.0.0.1:9001".parse().unwrap(),
        None,
    )
    .unwrap();
    tokio::spawn(async move {
        while let Some(r) = w.next().await {
            if matches!(r.command, Command::Restore(_) | Command::Checkpoint(_)) {
                w.answer(r.id, Ok(()));
            }
        }
    });
}

/// How a caller leaves.
#[derive(Debug, Clone, Copy)]
enum Leave {
    /// Its deadline passes (`grpc-timeout`).
    Deadline,
    /// It drops the call (the stream is reset).
    Drop,
}

/// Runs `call` with the store's writes held, makes its caller leave once the write
/// waits, then lets the write through and waits until no operation is left.
async fn cancelled_mid_write<F, Fut, T>(s: &Served, leave: Leave, call: F)
where
    F: FnOnce(ControlClient<Channel>, Option<Duration>) -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>> + Send + 'static,
    T: Send + 'static,
{
    s.gate.close();
    let deadline = matches!(leave, Leave::Deadline).then_some(Duration::from_millis(200));
    let task = tokio::spawn(call(s.client.clone(), deadline));
    s.gate.until_waiting(1).await;
    match leave {
        Leave::Deadline => {
            let err = task.await.unwrap().err().expect("the deadline passed");
            assert!(
                matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
                "{err:?}"
            );
        }
        Leave::Drop => {
            task.abort();
            let _ = task.await;
        }
    }
    s.gate.open();
    assert!(
        s.plane
            .wait_until(WAIT, |p| p.operations_in_progress() == 0)
            .await,
        "the operation finished without its caller"
    );
}

fn timed<T>(msg: T, deadline: Option<Duration>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(d) = deadline {
        r.set_timeout(d);
    }
    r
}

/// Actors and atespaces as a plane shows them (without worker addresses).
async fn view(client: &ControlClient<Channel>) -> BTreeMap<String, (i32, i64)> {
    let mut c = client.clone();
    let mut out = BTreeMap::new();
    for a in c.list_atespaces(()).await.unwrap().into_inner().atespaces {
        out.insert(format!("atespace {}", a.name), (0, 0));
    }
    let actors = c
        .list_actors(ateapi::ListActorsRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .actors;
    for a in actors {
        out.insert(
            format!("actor {}/{}", a.atespace, a.actor_id),
            (a.status, a.version),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mutating_rpc_finishes_without_its_caller() {
    let s = served().await;
    obliging_worker(&s.plane, "w1");
    for leave in [Leave::Deadline, Leave::Drop] {
        let space = match leave {
            Leave::Deadline => "dl",
            Leave::Drop => "dr",
        };
        let actor = format!("{space}/a");
        cancelled_mid_write(&s, leave, |mut c, d| async move {
            c.create_atespace(timed(
                ateapi::CreateAtespaceRequest { name: space.into() },
                d,
            ))
            .await
        })
        .await;
        let a = actor.clone();
        cancelled_mid_write(&s, leave, |mut c, d| async move {
            c.create_actor(timed(
                ateapi::CreateActorRequest {
                    actor_ref: Some(aref(&a)),
                    actor_template_namespace: "default".into(),
                    actor_template_name: "counter".into(),
                    worker_selector: None,
                },
                d,
            ))
            .await
        })
        .await;
        let a = actor.clone();
        cancelled_mid_write(&s, leave, |mut c, d| async move {
            c.resume_actor(timed(
                ateapi::ResumeActorRequest {
                    actor_ref: Some(aref(&a)),
                    ..Default::default()
                },
                d,
            ))
            .await
        })
        .await;
        assert_eq!(s.plane.status_of(space, "a"), Some(S::Running));
        let a = actor.clone();
        cancelled_mid_write(&s, leave, |mut c, d| async move {
            c.suspend_actor(timed(
                ateapi::SuspendActorRequest {
                    actor_ref: Some(aref(&a)),
                },
                d,
            ))
            .await
        })
        .await;
        assert_eq!(s.plane.status_of(space, "a"), Some(S::Suspended));
        let a = actor.clone();
        cancelled_mid_write(&s, leave, |mut c, d| async move {
            c.delete_actor(timed(
                ateapi::DeleteActorRequest {
                    actor_ref: Some(aref(&a)),
                },
                d,
            ))
            .await
        })
        .await;
        assert_eq!(s.plane.status_of(space, "a"), None);
        cancelled_mid_write(&s, leave, |mut c, d| async move {
            c.delete_atespace(timed(
                ateapi::DeleteAtespaceRequest { name: space.into() },
                d,
            ))
            .await
        })
        .await;
    }
    // Revert needs a crashed actor: one whose restore the worker refuses.
    let mut c = s.client.clone();
    c.create_atespace(ateapi::CreateAtespaceRequest { name: "rv".into() })
        .await
        .unwrap();
    c.create_actor(ateapi::CreateActorRequest {
        actor_ref: Some(aref("rv/x")),
        actor_template_namespace: "default".into(),
        actor_template_name: "counter".into(),
        worker_selector: None,
    })
    .await
    .unwrap();
    let (mut refusing, _) = FakeWorker::attach(
        &s.plane,
        "w1",
        "counter",
        "127.0.0.1:9001".parse().unwrap(),
        None,
    )
    .unwrap();
    let resume = {
        let mut c = c.clone();
        tokio::spawn(async move {
            c.resume_actor(ateapi::ResumeActorRequest {
                actor_ref: Some(aref("rv/x")),
                ..Default::default()
            })
            .await
        })
    };
    let r = refusing.next().await.unwrap();
    refusing.answer(r.id, Err("corrupt snapshot"));
    assert_eq!(
        resume.await.unwrap().unwrap_err().code(),
        Code::FailedPrecondition
    );
    assert_eq!(s.plane.status_of("rv", "x"), Some(S::Crashed));
    cancelled_mid_write(&s, Leave::Drop, |mut c, d| async move {
        c.revert_actor(timed(
            ateapi::RevertActorRequest {
                actor_ref: Some(aref("rv/x")),
            },
            d,
        ))
        .await
    })
    .await;
    assert_eq!(s.plane.status_of("rv", "x"), Some(S::Suspended));

    // Every actor and atespace answers every RPC normally afterwards.
    c.create_atespace(ateapi::CreateAtespaceRequest { name: "dl".into() })
        .await
        .unwrap();
    c.delete_atespace(ateapi::DeleteAtespaceRequest { name: "dl".into() })
        .await
        .unwrap();
    c.delete_actor(ateapi::DeleteActorRequest {
        actor_ref: Some(aref("rv/x")),
    })
    .await
    .unwrap();

    // Memory matches the database: a plane restarted on it shows the same.
    let before = view(&s.client).await;
    let again = Plane::open(Arc::new(s.sqlite.clone()), PlaneConfig::default())
        .await
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(valet_control::serve(
        listener,
        again,
        std::future::pending(),
        Duration::from_secs(10),
        Default::default(),
    ));
    let restarted = ControlClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy(),
    );
    assert_eq!(view(&restarted).await, before);
    drop(s.dir);
}

/// A write that fails (the database turned read-only under the plane) changes nothing:
/// the caller gets an error, nothing is applied, no worker is handed over; once the
/// database is writable the next call works. Also when the failing write is the last
/// step of an operation whose worker already acted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_applies_nothing_and_hands_nothing_over() {
    let s = served().await;
    let (mut w, _) = FakeWorker::attach(
        &s.plane,
        "w1",
        "counter",
        "127.0.0.1:9001".parse().unwrap(),
        None,
    )
    .unwrap();
    let plane = s.plane.clone();
    plane.catalog().create_atespace("demo").await.unwrap();
    for a in ["a", "b"] {
        plane
            .catalog()
            .create_actor(
                ActorKey::new("demo", a).unwrap(),
                "default",
                "counter",
                Vec::new(),
            )
            .await
            .unwrap();
    }
    let key = |n: &str| ActorKey::new("demo", n).unwrap();
    let resume_a = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.resume_actor(key("a"), None).await })
    };
    let r = w.next().await.unwrap();
    w.answer(r.id, Ok(()));
    resume_a.await.unwrap().unwrap();
    let waiter = {
        let plane = plane.clone();
        tokio::spawn(async move {
            plane
                .resume_actor(key("b"), Some(Duration::from_secs(60)))
                .await
        })
    };
    assert!(plane.wait_until(WAIT, |p| p.waiters("counter") == 1).await);

    // The first write of a suspend fails: nothing happens at all.
    s.sqlite.set_read_only(true).await.unwrap();
    let err = plane.suspend_actor(key("a")).await.unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (Code::Unavailable, "control-plane database write failed")
    );
    assert_eq!(plane.status_of("demo", "a"), Some(S::Running));
    assert_eq!(plane.waiters("counter"), 1, "no worker handed over");
    assert!(
        tokio::time::timeout(Duration::from_millis(100), w.next())
            .await
            .is_err(),
        "the worker was told nothing"
    );
    s.sqlite.set_read_only(false).await.unwrap();

    // The last write of a suspend fails after the checkpoint: the actor stays where
    // the database has it, and its worker is not handed to the waiter.
    let suspend = {
        let plane = plane.clone();
        tokio::spawn(async move { plane.suspend_actor(key("a")).await })
    };
    let r = w.next().await.unwrap();
    assert!(matches!(r.command, Command::Checkpoint(_)));
    s.sqlite.set_read_only(true).await.unwrap();
    w.answer(r.id, Ok(()));
    let err = suspend.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(plane.status_of("demo", "a"), Some(S::Suspending));
    assert_eq!(
        s.sqlite.get_actor(&key("a")).await.unwrap().unwrap().status,
        valet_control::ActorStatus::Suspending
    );
    assert_eq!(plane.waiters("counter"), 1, "no worker handed over");
    assert!(!waiter.is_finished());

    // Writable again: the next call settles the actor, and the waiter gets the worker.
    s.sqlite.set_read_only(false).await.unwrap();
    let a = plane.suspend_actor(key("a")).await.unwrap();
    assert_eq!(a.status, S::Suspended as i32);
    let r = w.next().await.unwrap();
    assert!(matches!(r.command, Command::Evict(_)), "{r:?}");
    let r = w.next().await.unwrap();
    assert!(matches!(r.command, Command::Restore(_)), "{r:?}");
    w.answer(r.id, Ok(()));
    let (b, resumed) = waiter.await.unwrap().unwrap();
    assert!(resumed);
    assert_eq!(b.status, S::Running as i32);
}
