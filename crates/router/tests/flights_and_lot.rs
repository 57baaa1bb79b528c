//! Flights shared by many callers, and the parking lot, on tokio's paused clock.

mod common;

use std::time::Duration;

use common::{answer_until_done, body, elapse, harness, settle_until, status};
use tokio::time::Instant;
use tonic::Code;
use valet_router::Decision;

/// Many concurrent callers share one flight: one ResumeActor call at a time.
#[tokio::test(start_paused = true)]
async fn concurrent_callers_share_one_call_at_a_time() {
    let mut h = harness(&["--parked-request-retry-jitter", "0"]);
    let reqs: Vec<_> = (0..50).map(|_| h.request("demo/hot")).collect();
    let first = h.calls.next().await;
    settle_until("all callers joined", || h.router.flights_in_progress() == 1).await;
    assert!(h.calls.try_next().is_none(), "one call for fifty callers");
    first.no_room();
    settle_until("all parked", || h.parked() == 50).await;
    h.assert_lot(50, 0, &[]);
    for _ in 0..5 {
        h.calls.next().await.no_room();
    }
    h.calls.next().await.running(9001);
    for r in reqs {
        assert_eq!(status(&r.await.unwrap()), 200);
    }
    assert_eq!(h.cp.max_concurrent_per_actor(), 1);
    h.assert_lot(0, 0, &[("served", 50)]);
    assert_eq!(h.router.flights_in_progress(), 0);
    assert_eq!(h.metric("atenet_router_flights_active", &[]), 0.0);
}

/// A late joiner shares the flight's remaining budget: it fails at the flight's budget,
/// after waiting less than a budget itself.
#[tokio::test(start_paused = true)]
async fn late_joiner_shares_the_remaining_budget() {
    let mut h = harness(&["--parked-request-retry-jitter", "0"]);
    let start = Instant::now();
    let early = h.request("demo/p3");
    h.calls.next().await.no_room();
    elapse(Duration::from_secs(4)).await;
    // Answer the retries so far without letting the test task fall behind.
    while let Some(c) = h.calls.try_next() {
        c.no_room();
    }
    let late = h.request("demo/p3");
    settle_until("late joiner parked", || h.parked() == 2).await;
    let mut calls_after_join = 0;
    let (d_early, _) = answer_until_done(&mut h.calls, early, |c| {
        calls_after_join += 1;
        c.no_room()
    })
    .await;
    let d_late = late.await.unwrap();
    assert_eq!(Instant::now(), start + Duration::from_secs(5));
    for d in [&d_early, &d_late] {
        assert_eq!(status(d), 503);
        assert_eq!(
            body(d),
            "actor demo/p3 unavailable: no worker has room for the actor"
        );
    }
    h.assert_lot(0, 0, &[("budget_exhausted", 2)]);
    // The late joiner's own wait was one second, the early one's five.
    let sum = h.metric(
        "atenet_router_parking_wait_duration_seconds_sum",
        &[("outcome", "budget_exhausted")],
    );
    assert!(
        (sum - 6.0).abs() < 1e-6,
        "waits sum to 5 s + 1 s, got {sum}"
    );
}

/// A caller arriving after the result is published starts a new flight.
#[tokio::test(start_paused = true)]
async fn caller_after_publish_starts_a_new_flight() {
    let mut h = harness(&[]);
    let first = h.request("demo/p1");
    h.calls.next().await.running(9001);
    assert_eq!(status(&first.await.unwrap()), 200);
    assert_eq!(h.router.flights_in_progress(), 0);
    let second = h.request("demo/p1");
    let call = h.calls.next().await;
    assert_eq!(
        call.request.wait_for_capacity, None,
        "a fresh flight's first attempt"
    );
    call.running(9002);
    match second.await.unwrap() {
        Decision::Route(r) => assert_eq!(r.addr.port(), 9002, "not the old flight's result"),
        other => panic!("{other:?}"),
    }
}

/// A caller that goes away while parked frees its slot at once and records
/// `canceled`; the flight goes on and serves a later caller.
#[tokio::test(start_paused = true)]
async fn cancelled_caller_frees_its_slot_and_the_flight_goes_on() {
    let mut h = harness(&["--parked-request-retry-jitter", "0"]);
    let gone = h.request("demo/p3");
    h.calls.next().await.no_room();
    settle_until("parked", || h.parked() == 1).await;
    h.assert_lot(1, 0, &[]);

    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    h.assert_lot(0, 0, &[("canceled", 1)]);
    assert_eq!(h.router.flights_in_progress(), 1, "the flight goes on");
    assert_eq!(
        h.metric(
            "atenet_router_requests_total",
            &[("status", "408"), ("verdict", "canceled")]
        ),
        1.0
    );

    let later = h.request("demo/p3");
    settle_until("later caller parked on the parked flight", || {
        h.parked() == 1
    })
    .await;
    let retry = h.calls.next().await;
    assert!(
        retry.request.wait_for_capacity.is_some(),
        "same flight, already parked"
    );
    retry.running(9001);
    assert_eq!(status(&later.await.unwrap()), 200);
    h.assert_lot(0, 0, &[("canceled", 1), ("served", 1)]);
}

/// A full lot never sheds nor delays requests to running actors (the regression of
/// seed 003: slots are taken only at the park transition).
#[tokio::test(start_paused = true)]
async fn full_lot_never_touches_running_actors() {
    let mut h = harness(&[
        "--parked-request-max",
        "1",
        "--parked-request-retry-jitter",
        "0",
    ]);
    let parked = h.request("demo/p3");
    h.calls.next().await.no_room();
    settle_until("lot full", || h.parked() == 1).await;
    h.assert_lot(1, 0, &[]);

    for i in 0..20 {
        let start = Instant::now();
        let fast = h.request(&format!("demo/run{i}"));
        let call = h.calls.next().await;
        assert_eq!(call.request.actor.name(), format!("run{i}"));
        call.running(9000 + i);
        assert_eq!(status(&fast.await.unwrap()), 200);
        assert_eq!(Instant::now(), start, "not delayed");
    }
    h.assert_lot(1, 0, &[]);

    let retry = h.calls.next().await;
    retry.running(9100);
    assert_eq!(status(&parked.await.unwrap()), 200);
    h.assert_lot(0, 0, &[("served", 1)]);
}

/// At the park transition with no free slot, the caller is shed at once with the exact
/// body; the flight goes on for the callers that hold slots.
#[tokio::test(start_paused = true)]
async fn shed_at_the_park_transition() {
    let mut h = harness(&[
        "--parked-request-max",
        "2",
        "--parked-request-retry-jitter",
        "0",
    ]);
    let a = h.request("demo/a");
    let b = h.request("demo/b");
    let c = h.request("demo/c");
    let mut first = Vec::new();
    for _ in 0..3 {
        first.push(h.calls.next().await);
    }
    first.sort_by_key(|c| c.request.actor.name().to_owned());
    let mut first = first.into_iter();
    first.next().unwrap().no_room(); // a
    settle_until("a parked", || h.parked() == 1).await;
    h.assert_lot(1, 0, &[]);
    first.next().unwrap().no_room(); // b
    settle_until("b parked", || h.parked() == 2).await;
    h.assert_lot(2, 0, &[]);
    let start = Instant::now();
    first.next().unwrap().no_room(); // c: lot full
    let d = c.await.unwrap();
    assert_eq!(Instant::now(), start, "shed at once");
    assert_eq!(status(&d), 503);
    assert_eq!(body(&d), "actor demo/c unavailable: router at capacity");
    match &d {
        Decision::Deny(_, v) => {
            assert_eq!(v.retry_after_secs(), Some(1));
            assert_eq!(v.content_type(), "text/plain; charset=utf-8");
        }
        other => panic!("{other:?}"),
    }
    h.assert_lot(2, 1, &[]);
    // A second caller for c joins c's parked flight and is shed too.
    let c2 = h.request("demo/c");
    assert_eq!(
        body(&c2.await.unwrap()),
        "actor demo/c unavailable: router at capacity"
    );
    h.assert_lot(2, 2, &[]);

    let answer = |call: valet_router::testing::Call| {
        if call.request.actor.name() == "c" {
            call.no_room();
        } else {
            call.running(9000);
        }
    };
    let (da, _) = answer_until_done(&mut h.calls, a, answer).await;
    let (db, _) = answer_until_done(&mut h.calls, b, answer).await;
    assert_eq!((status(&da), status(&db)), (200, 200));
    h.assert_lot(0, 2, &[("served", 2)]);
}

/// The request's own deadline ends while parked: 504, outcome `timeout`.
#[tokio::test(start_paused = true)]
async fn own_deadline_while_parked_is_timeout() {
    let mut h = harness(&["--parked-request-budget", "10s"]);
    let start = Instant::now();
    let req = h.request_with_deadline("demo/p3", Duration::from_secs(2));
    let router = h.router.clone();
    let (d, _) = answer_until_done(&mut h.calls, req, |c| c.no_room()).await;
    assert_eq!(Instant::now(), start + Duration::from_secs(2));
    assert_eq!(status(&d), 504);
    assert_eq!(body(&d), "actor demo/p3 request timed out");
    h.assert_lot(0, 0, &[("timeout", 1)]);
    assert_eq!(
        router.flights_in_progress(),
        1,
        "the flight outlives the caller"
    );
}

/// Past the drain timeout every waiting request gets `router shutting down`.
#[tokio::test(start_paused = true)]
async fn cut_off_answers_shutting_down() {
    let mut h = harness(&[]);
    let parked = h.request("demo/p3");
    let resolving = h.request("demo/p4");
    let mut calls = vec![h.calls.next().await, h.calls.next().await];
    calls.sort_by_key(|c| c.request.actor.name().to_owned());
    let p4_call = calls.pop().unwrap();
    calls.pop().unwrap().no_room();
    settle_until("p3 parked", || h.parked() == 1).await;
    h.router.cut_off_waiting();
    for r in [parked, resolving] {
        let d = r.await.unwrap();
        assert_eq!(status(&d), 503);
        assert!(
            body(&d).ends_with("unavailable: router shutting down"),
            "{}",
            body(&d)
        );
    }
    h.assert_lot(0, 0, &[("timeout", 1)]);
    drop(p4_call);
}

/// Control-plane descriptions pass through verbatim, whatever the code.
#[tokio::test(start_paused = true)]
async fn not_found_fails_fast_with_exact_body() {
    let mut h = harness(&[]);
    let req = h.request("demo/nope");
    h.calls
        .next()
        .await
        .fail(Code::NotFound, "actor demo/nope not found");
    let d = req.await.unwrap();
    assert_eq!(status(&d), 404);
    assert_eq!(body(&d), "actor demo/nope not found");
}

/// The data plane's work while parked (reading a body) starts only at the park
/// transition, never on the first attempt; when it reports the client gone the wait ends
/// `canceled` and its slot is freed, and the flight goes on for the others.
#[tokio::test(start_paused = true)]
async fn while_parked_starts_at_the_park_and_can_end_the_wait() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use valet_router::verdict::CallerEnd;

    let mut h = harness(&["--parked-request-retry-jitter", "0"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let holding = |end: CallerEnd| {
        let started = Arc::new(AtomicBool::new(false));
        let (leave, left) = tokio::sync::oneshot::channel::<()>();
        let router = h.router.clone();
        let flag = Arc::clone(&started);
        let task = tokio::spawn(async move {
            let while_parked = async move {
                flag.store(true, Ordering::SeqCst);
                let _ = left.await;
                end
            };
            router
                .decide_holding(&common::host("demo/p3"), deadline, while_parked)
                .await
        });
        (started, leave, task)
    };
    let (gone_started, gone, gone_task) = holding(CallerEnd::Gone);
    let (bad_started, bad, bad_task) =
        holding(CallerEnd::MalformedBody("invalid chunk size line".into()));
    let stays = h.request("demo/p3");
    let first = h.calls.next().await;
    settle_until("all joined", || h.router.flights_in_progress() == 1).await;
    assert!(!gone_started.load(Ordering::SeqCst), "not before the park");
    first.no_room();
    settle_until("parked", || h.parked() == 3).await;
    settle_until("holding", || {
        gone_started.load(Ordering::SeqCst) && bad_started.load(Ordering::SeqCst)
    })
    .await;

    gone.send(()).unwrap();
    let d = gone_task.await.unwrap();
    assert_eq!(status(&d), 408);
    h.assert_lot(2, 0, &[("canceled", 1)]);

    bad.send(()).unwrap();
    let d = bad_task.await.unwrap();
    assert_eq!(
        (status(&d), body(&d)),
        (
            400,
            "actor demo/p3: malformed request body: invalid chunk size line"
        )
    );
    h.assert_lot(1, 0, &[("canceled", 1), ("error", 1)]);

    h.calls.next().await.running(9000);
    assert_eq!(status(&stays.await.unwrap()), 200);
    h.assert_lot(0, 0, &[("canceled", 1), ("error", 1), ("served", 1)]);
}

/// A flight's first retryable answer that arrives after the budget still parks it: it
/// ends `budget_exhausted` at once, and every caller (none of which saw the flight
/// parked before it was done) is counted as parked exactly once.
#[tokio::test(start_paused = true)]
async fn retryable_answer_after_the_budget_still_parks_every_caller() {
    let mut h = harness(&["--parked-request-budget", "1s"]);
    let reqs: Vec<_> = (0..3).map(|_| h.request("demo/p3")).collect();
    let first = h.calls.next().await;
    settle_until("all joined", || h.router.flights_in_progress() == 1).await;
    elapse(Duration::from_secs(2)).await;
    first.no_room();
    for r in reqs {
        let d = r.await.unwrap();
        assert_eq!(
            (status(&d), body(&d)),
            (
                503,
                "actor demo/p3 unavailable: no worker has room for the actor"
            )
        );
    }
    assert!(h.calls.try_next().is_none(), "no attempt after the budget");
    h.assert_lot(0, 0, &[("budget_exhausted", 3)]);
}

/// Callers that park at their flight's end hold a slot only for that instant: with a
/// lot of one, both take it in turn, and neither is shed.
#[tokio::test(start_paused = true)]
async fn late_park_holds_a_slot_only_for_an_instant() {
    let mut h = harness(&["--parked-request-budget", "1s", "--parked-request-max", "1"]);
    let reqs: Vec<_> = (0..2).map(|_| h.request("demo/p3")).collect();
    let first = h.calls.next().await;
    settle_until("all joined", || h.router.flights_in_progress() == 1).await;
    elapse(Duration::from_secs(2)).await;
    first.no_room();
    for r in reqs {
        assert_eq!(
            body(&r.await.unwrap()),
            "actor demo/p3 unavailable: no worker has room for the actor"
        );
    }
    h.assert_lot(0, 0, &[("budget_exhausted", 2)]);
}

/// At shutdown, a flight nobody waits for any more starts no new attempt, but the
/// attempt it already sent is waited for, never cancelled, while the drain lasts: the
/// control plane may have committed a restore to it (`parking.md`).
#[tokio::test(start_paused = true)]
async fn stopping_waits_for_an_attempt_in_flight_until_the_drain_ends() {
    let mut h = harness(&[]);
    let gone = h.request("demo/p1");
    let in_flight = h.calls.next().await;
    let backing_off = h.request("demo/p2");
    h.calls.next().await.no_room();
    settle_until("p2 parked", || h.parked() == 1).await;
    for r in [gone, backing_off] {
        r.abort();
        assert!(r.await.unwrap_err().is_cancelled());
    }

    let router = h.router.clone();
    let drain_ends = Instant::now() + Duration::from_secs(10);
    let stopping = tokio::spawn(async move { router.stop_flights(drain_ends).await });
    elapse(Duration::from_secs(3)).await;
    assert!(
        !in_flight.abandoned(),
        "the attempt in flight was cancelled"
    );
    assert!(
        !stopping.is_finished(),
        "stopped without the attempt's answer"
    );
    assert!(
        h.calls.try_next().is_none(),
        "a new attempt started while stopping"
    );
    in_flight.running(9001);
    stopping.await.unwrap();
    assert_eq!(h.router.flights_in_progress(), 0);
}

/// An attempt still in flight when the drain ends is abandoned then: the router's exit
/// is bounded.
#[tokio::test(start_paused = true)]
async fn an_attempt_still_in_flight_when_the_drain_ends_is_abandoned() {
    let mut h = harness(&[]);
    let gone = h.request("demo/p1");
    let in_flight = h.calls.next().await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    let started = Instant::now();
    h.router
        .stop_flights(started + Duration::from_secs(10))
        .await;
    assert_eq!(started.elapsed(), Duration::from_secs(10));
    assert!(in_flight.abandoned());
}
