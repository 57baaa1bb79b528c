//! Pool capacity and the `wait_for_capacity` extension, against a real server with
//! real workers.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{WAIT, status, system};
use tonic::Code;
use valet_control::PlaneConfig;
use valet_proto::ateapi::actor::Status as S;

const LONG: Option<Duration> = Some(Duration::from_secs(30));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_resumes_on_ten_workers() {
    let sys = system(10, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    for i in 0..100 {
        sys.create(&format!("demo/a{i}")).await.unwrap();
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..100 {
        let client = sys.client.clone();
        tasks.spawn(async move {
            client
                .clone()
                .resume_actor(valet_proto::ateapi::ResumeActorRequest {
                    actor_ref: Some(common::aref(&format!("demo/a{i}"))),
                    ..Default::default()
                })
                .await
        });
    }
    let results = tasks.join_all().await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let exhausted: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(ok, 10);
    assert_eq!(exhausted.len(), 90);
    for e in exhausted {
        assert_eq!(
            (e.code(), e.message()),
            (Code::ResourceExhausted, "no worker has room for the actor")
        );
    }
    let workers = sys.workers().await;
    assert_eq!(workers.len(), 10);
    let hosted: HashSet<String> = workers.iter().map(|w| w.actor_id.clone()).collect();
    assert_eq!(hosted.len(), 10, "each worker hosts a different actor");
    assert!(!hosted.contains(""), "every worker hosts one");
    let mut running = 0;
    for i in 0..100 {
        if status(&sys.get(&format!("demo/a{i}")).await.unwrap()) == S::Running {
            running += 1;
        }
    }
    assert_eq!(running, 10);
    sys.shutdown().await;
}

/// Waiters get freed workers in arrival order, handed over at once: each waiter's one
/// call is answered, with no retry.
#[tokio::test]
async fn waiters_are_served_first_come_by_hand_off() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    for a in ["p0", "p1", "p2", "p3"] {
        sys.create(&format!("demo/{a}")).await.unwrap();
    }
    sys.resume("demo/p0").await.unwrap();

    let mut waiting = Vec::new();
    for (i, a) in ["p1", "p2", "p3"].into_iter().enumerate() {
        let sys_client = sys.client.clone();
        let actor = format!("demo/{a}");
        waiting.push(tokio::spawn(async move {
            sys_client
                .clone()
                .resume_actor(valet_proto::ateapi::ResumeActorRequest {
                    actor_ref: Some(common::aref(&actor)),
                    boot: false,
                    wait_for_capacity: LONG.map(|d| d.try_into().unwrap()),
                    ..Default::default()
                })
                .await
        }));
        assert!(
            sys.plane
                .wait_until(WAIT, |p| p.waiters("counter") == i + 1)
                .await
        );
    }

    let mut order = Vec::new();
    let mut holder = "demo/p0".to_owned();
    for task in waiting {
        sys.suspend(&holder).await.unwrap();
        let r = task.await.unwrap().unwrap().into_inner();
        assert!(r.resumed);
        let a = r.actor.unwrap();
        assert_eq!(status(&a), S::Running);
        holder = format!("demo/{}", a.actor_id);
        order.push(a.actor_id);
    }
    assert_eq!(order, vec!["p1", "p2", "p3"]);
    for a in ["p1", "p2", "p3"] {
        assert_eq!(
            sys.plane.resume_calls_for("demo", a),
            1,
            "{a} asked once, never retried"
        );
    }
    assert_eq!(sys.plane.stats().handoffs, 3);
    sys.shutdown().await;
}

#[tokio::test]
async fn departed_waiter_leaves_the_queue() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    sys.create("demo/p0").await.unwrap();
    sys.create("demo/p1").await.unwrap();
    sys.resume("demo/p0").await.unwrap();
    let client = sys.client.clone();
    let gone = tokio::spawn(async move {
        client
            .clone()
            .resume_actor(valet_proto::ateapi::ResumeActorRequest {
                actor_ref: Some(common::aref("demo/p1")),
                boot: false,
                wait_for_capacity: LONG.map(|d| d.try_into().unwrap()),
                ..Default::default()
            })
            .await
    });
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.waiters("counter") == 1)
            .await
    );
    gone.abort();
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.status_of("demo", "p1") == Some(S::Suspended)
                && p.waiters("counter") == 0)
            .await,
        "the waiter left the queue"
    );
    sys.suspend("demo/p0").await.unwrap();
    // With several replicas the freed worker may be offered to the shared queue
    // first (the waiter's row leaves it in the background): it comes back free.
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.pool("counter") == (1, 1))
            .await,
        "the freed worker stays free"
    );
    assert_eq!(status(&sys.get("demo/p1").await.unwrap()), S::Suspended);
    // The actor is not locked by the departed wait.
    let (a, _) = sys.resume("demo/p1").await.unwrap();
    assert_eq!(status(&a), S::Running);
    sys.shutdown().await;
}

/// A second resume of an actor that is waiting joins the wait and gets its result.
#[tokio::test]
async fn second_resume_joins_the_wait() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    sys.create("demo/p0").await.unwrap();
    sys.create("demo/p1").await.unwrap();
    sys.resume("demo/p0").await.unwrap();
    let spawn_wait = |wait: Option<Duration>| {
        let client = sys.client.clone();
        tokio::spawn(async move {
            client
                .clone()
                .resume_actor(valet_proto::ateapi::ResumeActorRequest {
                    actor_ref: Some(common::aref("demo/p1")),
                    boot: false,
                    wait_for_capacity: wait.map(|d| d.try_into().unwrap()),
                    ..Default::default()
                })
                .await
        })
    };
    let first = spawn_wait(LONG);
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.waiters("counter") == 1)
            .await
    );
    let second = spawn_wait(None);
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.resume_calls_for("demo", "p1") == 2)
            .await
    );
    assert_eq!(sys.plane.waiters("counter"), 1, "joined, not queued twice");
    sys.suspend("demo/p0").await.unwrap();
    let a = first.await.unwrap().unwrap().into_inner();
    let b = second.await.unwrap().unwrap().into_inner();
    assert_eq!(a.actor.unwrap().ateom_pod_ip, b.actor.unwrap().ateom_pod_ip);
    assert!(
        a.resumed && !b.resumed,
        "only the call that did the activation says so"
    );
    let metrics = sys.plane.render_metrics();
    for outcome in ["resumed", "joined"] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("valet_control_resumes_total{")
                    && l.contains(&format!("outcome=\"{outcome}\""))),
            "{outcome}: {metrics}"
        );
    }
    assert_eq!(
        sys.plane.stats().activations,
        2,
        "p0 and one activation of p1"
    );
    sys.shutdown().await;
}

/// A waiter whose wait ends without a worker gets ResourceExhausted.
#[tokio::test]
async fn wait_ends_with_resource_exhausted() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    sys.create("demo/p0").await.unwrap();
    sys.create("demo/p1").await.unwrap();
    sys.resume("demo/p0").await.unwrap();
    let e = sys
        .resume_waiting("demo/p1", Some(Duration::from_millis(200)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(sys.plane.stats().queued, 1, "it waited in the queue");
    assert_eq!(sys.plane.waiters("counter"), 0);
    sys.shutdown().await;
}

/// With --capacity-wait=off the server ignores the wait and answers at once.
#[tokio::test]
async fn capacity_wait_off_answers_at_once() {
    let config = PlaneConfig {
        capacity_wait: false,
        ..PlaneConfig::default()
    };
    let sys = system(1, config).await;
    sys.atespace("demo").await;
    sys.create("demo/p0").await.unwrap();
    sys.create("demo/p1").await.unwrap();
    sys.resume("demo/p0").await.unwrap();
    let e = sys.resume_waiting("demo/p1", LONG).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(sys.plane.stats().queued, 0, "never queued a waiter");
    sys.shutdown().await;
}

/// A resume that joined a wait keeps the activation's place in the queue when the
/// call that started it leaves (its shorter wait ended): the next freed worker goes
/// to that actor, before an actor that queued after the join. Before, the joined call
/// queued again at the back, with a new full wait.
#[tokio::test]
async fn a_joined_wait_keeps_its_place_when_the_first_caller_leaves() {
    let sys = system(1, PlaneConfig::default()).await;
    sys.atespace("demo").await;
    for a in ["p0", "p1", "p2"] {
        sys.create(&format!("demo/{a}")).await.unwrap();
    }
    sys.resume("demo/p0").await.unwrap();
    let spawn_wait = |actor: &str, wait: Duration| {
        let client = sys.client.clone();
        let actor = actor.to_owned();
        tokio::spawn(async move {
            client
                .clone()
                .resume_actor(valet_proto::ateapi::ResumeActorRequest {
                    actor_ref: Some(common::aref(&actor)),
                    boot: false,
                    wait_for_capacity: Some(wait.try_into().unwrap()),
                    ..Default::default()
                })
                .await
        })
    };
    let first = spawn_wait("demo/p1", Duration::from_secs(2));
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.waiters("counter") == 1)
            .await
    );
    let joined = spawn_wait("demo/p1", LONG.unwrap());
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.resume_calls_for("demo", "p1") == 2)
            .await
    );
    let later = spawn_wait("demo/p2", LONG.unwrap());
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.waiters("counter") == 2)
            .await
    );
    let e = first.await.unwrap().unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "its own wait ended");
    assert_eq!(sys.plane.waiters("counter"), 2, "p1 is still waiting");
    sys.suspend("demo/p0").await.unwrap();
    let r = joined.await.unwrap().unwrap().into_inner();
    assert!(r.resumed, "the call that stayed says it did the activation");
    assert_eq!(r.actor.unwrap().actor_id, "p1", "p1 was first in line");
    assert!(!later.is_finished(), "p2 waits on");
    assert_eq!(
        sys.plane.stats().activations,
        2,
        "p0, and one activation of p1"
    );
    sys.suspend("demo/p1").await.unwrap();
    let r = later.await.unwrap().unwrap().into_inner();
    assert_eq!(r.actor.unwrap().actor_id, "p2");
    sys.shutdown().await;
}
