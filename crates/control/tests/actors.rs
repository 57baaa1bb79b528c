//! ateapi.Control against a real server with real workers: the ResumeActor table,
//! suspend, revert, delete, bad input, and the counter app's semantics.

mod common;

use std::time::Duration;

use common::{WAIT, addr_of, aref, http_get, status, system, system_with};
use tonic::Code;
use tonic_types::StatusExt;
use valet_control::{PlaneConfig, Template};
use valet_proto::ateapi::{self, actor::Status as S};

#[tokio::test]
async fn resume_table() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    sys.create("demo/p1").await.unwrap();
    sys.create("demo/p2").await.unwrap();

    // Empty or invalid names.
    for bad in ["/p1", "demo/", "Demo/p1", "demo/p_1"] {
        let e = sys.resume(bad).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad}");
    }
    let e = sys
        .client
        .clone()
        .resume_actor(ateapi::ResumeActorRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // No such actor.
    let e = sys.resume("demo/nope").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::NotFound, "actor demo/nope not found")
    );

    // A free worker: claimed, restored, RUNNING with its address.
    let (a, resumed) = sys.resume("demo/p1").await.unwrap();
    assert!(resumed);
    assert_eq!(status(&a), S::Running);
    assert_eq!(addr_of(&a), sys.workers[0].app_addr());
    assert_eq!(a.atespace, "demo");
    assert_eq!(a.actor_id, "p1");

    // Already RUNNING: OK at once, no write.
    let version = a.version;
    let (again, resumed) = sys.resume("demo/p1").await.unwrap();
    assert!(!resumed);
    assert_eq!(again.version, version);
    assert_eq!(addr_of(&again), addr_of(&a));

    // No free worker.
    let e = sys.resume("demo/p2").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::ResourceExhausted, "no worker has room for the actor")
    );
    sys.shutdown().await;
}

#[tokio::test]
async fn concurrent_operation_is_aborted() {
    let sys = system_with(1, PlaneConfig::default(), Duration::from_millis(1500)).await;
    sys.atespace("demo").await;
    sys.create("demo/p1").await.unwrap();
    let first = {
        let client = sys.client.clone();
        tokio::spawn(async move {
            client
                .clone()
                .resume_actor(ateapi::ResumeActorRequest {
                    actor_ref: Some(aref("demo/p1")),
                    ..Default::default()
                })
                .await
        })
    };
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.status_of("demo", "p1") == Some(S::Resuming))
            .await
    );
    let e = sys.resume("demo/p1").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::Aborted,
            "another operation is in progress for this actor"
        )
    );
    let e = sys.suspend("demo/p1").await.unwrap_err();
    assert_eq!(e.code(), Code::Aborted);
    let e = sys.revert("demo/p1").await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::FailedPrecondition,
        "revert refused while RESUMING"
    );
    assert!(e.message().contains("RESUMING"), "{}", e.message());
    first.await.unwrap().unwrap();
    sys.shutdown().await;
}

fn assert_crashed(e: &tonic::Status) {
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(
        e.message(),
        "AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)"
    );
    let info = e.get_details_error_info().expect("ErrorInfo detail");
    assert_eq!(info.reason, "ACTOR_CRASHED");
    assert_eq!(info.domain, "ateapi");
}

/// A restore that fails (the app refuses a corrupt data dir) crashes the actor and
/// frees the worker; a crashed actor fails fast until reverted from its last good
/// snapshot.
#[tokio::test]
async fn crash_revert_and_delete() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    let created = sys.create("demo/p1").await.unwrap();
    let (a, _) = sys.resume("demo/p1").await.unwrap();
    let (code, body) = http_get(addr_of(&a), "/", &[]).await;
    assert_eq!(code, 200);
    assert!(body.ends_with("preserved file counter: 1\n"), "{body}");
    sys.suspend("demo/p1").await.unwrap();

    // Corrupt the actor's data dir behind its back.
    let data = sys
        .dir
        .path()
        .join("snapshots/demo/p1")
        .join(&created.ateom_pod_uid)
        .join("data/counter");
    std::fs::write(&data, "garbage").unwrap();
    let e = sys.resume("demo/p1").await.unwrap_err();
    assert_crashed(&e);
    assert_eq!(status(&sys.get("demo/p1").await.unwrap()), S::Crashed);
    assert_eq!(sys.plane.pool("counter"), (1, 1), "worker freed");
    assert_crashed(&sys.resume("demo/p1").await.unwrap_err());
    let e = sys.suspend("demo/p1").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);

    // Revert: SUSPENDED, and the next restore starts from the last good snapshot.
    let e = sys.revert("demo/nope").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(status(&sys.revert("demo/p1").await.unwrap()), S::Suspended);
    let e = sys.revert("demo/p1").await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::FailedPrecondition,
        "only CRASHED actors revert"
    );
    let (a, _) = sys.resume("demo/p1").await.unwrap();
    let (_, body) = http_get(addr_of(&a), "/", &[]).await;
    assert!(body.ends_with("preserved file counter: 2\n"), "{body}");

    // Delete: refused while RUNNING; allowed when SUSPENDED or CRASHED.
    let e = sys.delete("demo/p1").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("STATUS_RUNNING"), "{}", e.message());
    sys.suspend("demo/p1").await.unwrap();
    sys.delete("demo/p1").await.unwrap();
    assert_eq!(sys.get("demo/p1").await.unwrap_err().code(), Code::NotFound);
    assert_eq!(
        sys.delete("demo/p1").await.unwrap_err().code(),
        Code::NotFound
    );

    sys.create("demo/p2").await.unwrap();
    let uid = sys.get("demo/p2").await.unwrap().ateom_pod_uid;
    let dir = sys
        .dir
        .path()
        .join("snapshots/demo/p2")
        .join(uid)
        .join("data");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("counter"), "garbage").unwrap();
    assert_crashed(&sys.resume("demo/p2").await.unwrap_err());
    sys.delete("demo/p2").await.unwrap();
    sys.shutdown().await;
}

#[tokio::test]
async fn suspend_rules() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    sys.create("demo/p1").await.unwrap();
    assert_eq!(
        sys.suspend("demo/nope").await.unwrap_err().code(),
        Code::NotFound
    );
    let s = sys.suspend("demo/p1").await.unwrap();
    assert_eq!(
        status(&s),
        S::Suspended,
        "suspending a suspended actor is a no-op"
    );
    let (a, _) = sys.resume("demo/p1").await.unwrap();
    assert_eq!(sys.plane.pool("counter"), (1, 0));
    let s = sys.suspend("demo/p1").await.unwrap();
    assert_eq!(status(&s), S::Suspended);
    assert!(s.ateom_pod_ip.is_empty());
    assert!(s.version > a.version);
    assert_eq!(
        sys.plane.pool("counter"),
        (1, 1),
        "suspend frees the worker"
    );
    sys.shutdown().await;
}

/// Data snapshots keep the file counter only; full snapshots keep the memory count
/// too. A worker answers 421 to a request for an actor it does not host.
#[tokio::test]
async fn counter_semantics_and_misdirected_requests() {
    let config = PlaneConfig {
        templates: vec!["counter-full:full".parse::<Template>().unwrap()],
        ..PlaneConfig::default()
    };
    let mut sys = system(1, config).await;
    sys.add_worker("counter-full", Duration::ZERO).await;
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.pool("counter-full") == (1, 1))
            .await
    );
    sys.atespace("demo").await;
    sys.create("demo/d").await.unwrap();
    sys.create_from("demo/f", "counter-full").await.unwrap();

    for (actor, after_suspend) in [("demo/d", (1, 3)), ("demo/f", (3, 3))] {
        let (a, _) = sys.resume(actor).await.unwrap();
        let addr = addr_of(&a);
        let hello = |m: u64, f: i64| {
            format!(
                "hello from: {actor} | preserved memory count: {m} | preserved file counter: {f}\n"
            )
        };
        assert_eq!(http_get(addr, "/", &[]).await, (200, hello(1, 1)));
        assert_eq!(
            http_get(addr, "/any/path?q=1", &[("x-actor-ref", actor)]).await,
            (200, hello(2, 2))
        );
        assert_eq!(
            http_get(addr, "/whoami", &[]).await,
            (200, format!("{actor}\n"))
        );
        assert_eq!(http_get(addr, "/readyz", &[]).await, (200, "ok\n".into()));
        let (code, body) = http_get(addr, "/", &[("x-actor-ref", "demo/other")]).await;
        assert_eq!(code, 421, "{body}");
        sys.suspend(actor).await.unwrap();
        let (code, _) = http_get(addr, "/", &[("x-actor-ref", actor)]).await;
        assert_eq!(code, 421, "not hosted after the suspend");
        let (a, _) = sys.resume(actor).await.unwrap();
        assert_eq!(
            http_get(addr_of(&a), "/", &[]).await,
            (200, hello(after_suspend.0, after_suspend.1)),
            "{actor} after suspend and resume"
        );
    }
    sys.shutdown().await;
}

#[tokio::test]
async fn bad_input() {
    let sys = system(0, PlaneConfig::default()).await;
    let mut c = sys.client.clone();
    for name in ["", "UPPER", "has space", "-dash", &"x".repeat(64)] {
        let e = c
            .create_atespace(ateapi::CreateAtespaceRequest { name: name.into() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{name:?}");
    }
    sys.atespace("demo").await;
    let e = c
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);

    assert_eq!(
        sys.create("demo/").await.unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        sys.create("demo/a.b").await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let e = sys.create_from("demo/p1", "nope").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::FailedPrecondition,
            "ActorTemplate default/nope not found"
        )
    );
    let e = sys.create("elsewhere/p1").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "atespace must exist");
    let created = sys.create("demo/p1").await.unwrap();
    assert_eq!(status(&created), S::Suspended, "new actors are SUSPENDED");
    assert_eq!(
        sys.create("demo/p1").await.unwrap_err().code(),
        Code::AlreadyExists
    );

    let e = c
        .delete_atespace(ateapi::DeleteAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "atespace with actors");
    let e = c
        .get_atespace(ateapi::GetAtespaceRequest {
            name: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    let e = c
        .list_actors(ateapi::ListActorsRequest {
            page_token: "garbage".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .resume_actor(ateapi::ResumeActorRequest {
            actor_ref: Some(aref("demo/p1")),
            boot: false,
            wait_for_capacity: Some(prost_types::Duration {
                seconds: -1,
                nanos: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    sys.shutdown().await;
}

/// An oversized page size is clamped to 1000; pages chain to the end.
#[tokio::test]
async fn list_pages_are_clamped() {
    let sys = system(0, PlaneConfig::default()).await;
    sys.atespace("a").await;
    sys.atespace("b").await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1001 {
        let client = sys.client.clone();
        tasks.spawn(async move {
            client
                .clone()
                .create_actor(ateapi::CreateActorRequest {
                    actor_ref: Some(aref(&format!("a/x{i:04}"))),
                    actor_template_namespace: "default".into(),
                    actor_template_name: "counter".into(),
                    worker_selector: None,
                })
                .await
                .unwrap();
        });
    }
    tasks.join_all().await;
    sys.create("b/only").await.unwrap();
    let mut c = sys.client.clone();
    let page = c
        .list_actors(ateapi::ListActorsRequest {
            page_size: 5000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.actors.len(), 1000);
    assert_eq!(page.next_page_token, "a/x0999");
    let rest = c
        .list_actors(ateapi::ListActorsRequest {
            page_size: 5000,
            page_token: page.next_page_token,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = rest
        .actors
        .iter()
        .map(|a| format!("{}/{}", a.atespace, a.actor_id))
        .collect();
    assert_eq!(names, vec!["a/x1000", "b/only"]);
    assert!(rest.next_page_token.is_empty());
    let only_b = c
        .list_actors(ateapi::ListActorsRequest {
            atespace: "b".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(only_b.actors.len(), 1);
    sys.shutdown().await;
}

#[tokio::test]
async fn reflection_lists_the_control_service() {
    use tokio_stream::StreamExt;
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let sys = system(0, PlaneConfig::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", sys.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = client
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let resp = stream.next().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = resp.message_response else {
        panic!("unexpected reflection answer");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"ateapi.Control"), "{names:?}");
    sys.shutdown().await;
}

/// One echo worker hosting `demo/busy` (and `demo/<also>` created, suspended) with a
/// request in flight its worker reports: a chunked upload held open. The actor, and
/// the held connection (`0\r\n\r\n` ends the upload).
async fn busy_echo_actor(
    sys: &mut common::System,
    also: &[&str],
) -> (ateapi::Actor, tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    sys.add_worker("echo", Duration::ZERO).await;
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.pool("echo") == (1, 1))
            .await
    );
    sys.atespace("demo").await;
    sys.create_from("demo/busy", "echo").await.unwrap();
    for name in also {
        sys.create_from(&format!("demo/{name}"), "echo")
            .await
            .unwrap();
    }
    let (a, _) = sys.resume("demo/busy").await.unwrap();
    let mut held = tokio::net::TcpStream::connect(addr_of(&a)).await.unwrap();
    held.write_all(
        b"POST /upload HTTP/1.1\r\nHost: a\r\nx-actor-ref: demo/busy\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    let key = valet_control::ActorKey::new("demo", "busy").unwrap();
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.catalog().get_actor(&key).is_ok_and(|a| a.busy))
            .await,
        "the worker reports the request in flight"
    );
    (a, held)
}

/// A suspend of an actor whose request stays in flight, with real workers: the worker
/// waits for it at most half the checkpoint timeout, then answers busy; the actor
/// keeps running (nothing CRASHED), and the worker keeps renewing its hosting
/// meanwhile (the wait is longer than its hosting lease, and it never re-attaches). A
/// resume waiting for that worker gets it once the request has ended and a suspend
/// succeeds.
#[tokio::test]
async fn a_suspend_of_a_busy_actor_leaves_it_running_with_real_workers() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = PlaneConfig {
        checkpoint_timeout: Duration::from_secs(6),
        hosting_lease: Duration::from_secs(2),
        templates: vec![Template::echo()],
        ..PlaneConfig::default()
    };
    let mut sys = system(0, config).await;
    // A request in flight: a chunked upload that does not end.
    let (_, mut held) = busy_echo_actor(&mut sys, &["next"]).await;
    let next = {
        let client = sys.client.clone();
        tokio::spawn(async move {
            client
                .clone()
                .resume_actor(ateapi::ResumeActorRequest {
                    actor_ref: Some(aref("demo/next")),
                    wait_for_capacity: Some(Duration::from_secs(30).try_into().unwrap()),
                    ..Default::default()
                })
                .await
        })
    };
    assert!(sys.plane.wait_until(WAIT, |p| p.waiters("echo") == 1).await);

    let e = sys.suspend("demo/busy").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::Aborted,
            "actor demo/busy is busy: its requests in flight did not end within 3s; it keeps running"
        )
    );
    assert_eq!(status(&sys.get("demo/busy").await.unwrap()), S::Running);
    assert_eq!(
        sys.plane.stats().attachments,
        1,
        "the worker renewed its hosting during the wait: it never re-attached"
    );

    // The request ends and is answered in full.
    held.write_all(b"0\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    held.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("5\r\nhello\r\n0\r\n\r\n"), "{answer}");

    sys.suspend("demo/busy").await.unwrap();
    let r = next.await.unwrap().unwrap().into_inner();
    assert_eq!(status(&r.actor.unwrap()), S::Running);
    assert_eq!(status(&sys.get("demo/busy").await.unwrap()), S::Suspended);
    sys.shutdown().await;
}

/// A worker that stops lets its app's requests in flight finish, and leaves the control
/// plane only then: before, stopping shut each connection down gracefully and then
/// dropped it at once, resetting them, and the worker left at the same moment.
#[tokio::test]
async fn a_stopping_worker_lets_its_requests_in_flight_finish() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = PlaneConfig {
        templates: vec![Template::echo()],
        ..PlaneConfig::default()
    };
    let mut sys = system(0, config).await;
    let (a, mut held) = busy_echo_actor(&mut sys, &[]).await;

    // The worker stops: its app first, which takes no new connection...
    let app = addr_of(&a);
    let worker = sys.workers.pop().unwrap();
    let stopped = tokio::spawn(worker.shutdown());
    let refused = async {
        while tokio::net::TcpStream::connect(app).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(WAIT, refused)
        .await
        .expect("the app stops accepting");
    // ...while the worker keeps its actor: no other worker may restore it while the
    // request in flight still writes its data. (Correct, it never leaves before the
    // answer: the window only gives a wrong order the time to show.)
    assert!(
        !sys.plane
            .wait_until(Duration::from_millis(500), |p| p.pool("echo").0 == 0)
            .await,
        "the worker left before its request in flight ended"
    );
    assert_eq!(sys.plane.pool("echo"), (1, 0), "still attached, hosting");

    // The upload still ends and is answered in full; then the worker leaves.
    held.write_all(b"0\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    let _ = held.read_to_string(&mut answer).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(answer.ends_with("5\r\nhello\r\n0\r\n\r\n"), "{answer:?}");
    tokio::time::timeout(WAIT, stopped)
        .await
        .expect("the worker stops once its requests are done")
        .unwrap();
    assert!(
        sys.plane.wait_until(WAIT, |p| p.pool("echo").0 == 0).await,
        "the worker left"
    );
    sys.shutdown().await;
}

/// A restore longer than the hosting lease, with real workers: the worker goes on
/// renewing its hosting while it restores, so it keeps its one attachment (before, its
/// lease ran out during the restore and it attached anew).
#[tokio::test]
async fn a_worker_renews_its_hosting_during_a_long_restore() {
    let config = PlaneConfig {
        hosting_lease: Duration::from_secs(2),
        ..PlaneConfig::default()
    };
    let sys = system_with(1, config, Duration::from_secs(3)).await;
    sys.atespace("demo").await;
    sys.create("demo/p1").await.unwrap();
    let (a, resumed) = sys.resume("demo/p1").await.unwrap();
    assert!(resumed);
    assert_eq!(status(&a), S::Running);
    assert_eq!(
        sys.plane.stats().attachments,
        1,
        "the worker never lost its hosting lease"
    );
    let (code, _) = http_get(addr_of(&a), "/", &[("x-actor-ref", "demo/p1")]).await;
    assert_eq!(code, 200);
    sys.shutdown().await;
}

/// A template namespace follows the rule of names, and no error message repeats more
/// than 64 characters of what a client sent.
#[tokio::test]
async fn template_namespaces_are_names_and_errors_stay_short() {
    let sys = system(0, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    let long = "n".repeat(100_000);
    let e = sys
        .client
        .clone()
        .create_actor(ateapi::CreateActorRequest {
            actor_ref: Some(aref("demo/p1")),
            actor_template_namespace: long.clone(),
            actor_template_name: "counter".into(),
            worker_selector: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().starts_with("actor_template_namespace \"nnn"),
        "{}",
        e.message()
    );
    assert!(e.message().len() < 200, "{} bytes", e.message().len());
    let e = sys
        .client
        .clone()
        .create_actor(ateapi::CreateActorRequest {
            actor_ref: Some(aref("demo/p1")),
            actor_template_namespace: "default".into(),
            actor_template_name: long,
            worker_selector: None,
        })
        .await
        .unwrap_err();
    assert!(e.message().len() < 200, "{} bytes", e.message().len());
}

/// A worker whose stream stays open but that stops renewing (its loop is stuck, its
/// connection alive) leaves once a hosting lease has passed without a renewal, as one
/// whose stream ended: its stream is ended and it is no longer counted in its pool.
/// Before, it stayed attached for good, and an actor on it answered Unavailable.
#[tokio::test]
async fn a_worker_that_stops_renewing_leaves() {
    use valet_proto::worker::{self as wk, worker_event::Event};
    let config = PlaneConfig {
        hosting_lease: Duration::from_millis(500),
        ..PlaneConfig::default()
    };
    let sys = system(0, config).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(wk::WorkerEvent {
        event: Some(Event::Join(wk::Join {
            worker_id: "stuck".into(),
            pool: "counter".into(),
            app_address: "127.0.0.1:9".into(),
            incarnation: 7,
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", sys.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut inbound = wk::workers_client::WorkersClient::new(channel)
        .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.pool("counter") == (1, 1))
            .await
    );
    // No renewal is ever sent; the stream's sending side (tx) stays open.
    let ended = tokio::time::timeout(WAIT, async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => {}
                Ok(None) => return None,
                Err(status) => return Some(status.code()),
            }
        }
    })
    .await
    .expect("the stream ends");
    assert_eq!(ended, Some(Code::DeadlineExceeded));
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.pool("counter") == (0, 0))
            .await,
        "it left its pool"
    );
    drop(tx);
    sys.shutdown().await;
}
