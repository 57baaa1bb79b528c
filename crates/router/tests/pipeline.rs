//! The pipeline end to end over a scripted control plane, on tokio's paused clock.
//! Each test drives the flights by answering the control plane's calls itself.

mod common;

use std::time::Duration;

use common::{answer_until_done, body, elapse, harness, settle_until, status};
use tokio::time::Instant;
use tonic::Code;
use valet_router::control::ResumeError;
use valet_router::{Decision, Denial, FlightError};

const MS: Duration = Duration::from_millis(1);

#[tokio::test(start_paused = true)]
async fn running_actor_is_routed_without_parking() {
    let mut h = harness(&[]);
    let req = h.request("demo/p1");
    let call = h.calls.next().await;
    assert_eq!(call.request.actor.to_string(), "demo/p1");
    assert_eq!(call.request.wait_for_capacity, None);
    assert_eq!(call.request.timeout, Duration::from_secs(30));
    call.running(9001);
    let d = req.await.unwrap();
    match d {
        Decision::Route(r) => assert_eq!(r.addr.to_string(), "127.0.0.1:9001"),
        other => panic!("{other:?}"),
    }
    h.assert_lot(0, 0, &[]);
    assert_eq!(
        h.metric("atenet_router_requests_total", &[("status", "200")]),
        1.0
    );
    assert_eq!(
        h.metric("atenet_router_resume_attempts_total", &[("code", "OK")]),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn invalid_host_is_404_without_a_call() {
    let mut h = harness(&[]);
    let d = h
        .router
        .decide("p1.demo.example.com", Instant::now() + MS)
        .await;
    assert_eq!(status(&d), 404);
    assert_eq!(
        body(&d),
        "invalid host \"p1.demo.example.com\": not under the actor domain actors.resources.substrate.ate.dev"
    );
    assert!(h.calls.try_next().is_none());
}

/// Answers that fail at once: no park, no slot, no wait sample, verdict right away.
#[tokio::test(start_paused = true)]
async fn fail_fast_rows_never_park() {
    let cases: Vec<(&[&str], ResumeError, u16)> = vec![
        (
            &[],
            ResumeError::new(Code::NotFound, "actor demo/p1 not found"),
            404,
        ),
        (
            &[],
            ResumeError::crashed("AssignWorker prerequisite not met"),
            503,
        ),
        (&[], ResumeError::new(Code::PermissionDenied, "no"), 403),
        (&[], ResumeError::new(Code::Unauthenticated, "no"), 401),
        (&[], ResumeError::new(Code::DeadlineExceeded, "slow"), 504),
        (&[], ResumeError::new(Code::Internal, "boom"), 500),
        (
            &["--parked-request-max", "0"],
            ResumeError::new(Code::ResourceExhausted, "no worker has room for the actor"),
            503,
        ),
        (
            &["--parked-request-max", "0"],
            ResumeError::new(Code::FailedPrecondition, "busy"),
            503,
        ),
        (
            &["--parked-request-max", "0"],
            ResumeError::new(Code::Unavailable, "down"),
            503,
        ),
    ];
    for (flags, err, want) in cases {
        let mut h = harness(flags);
        let start = Instant::now();
        let req = h.request("demo/p1");
        h.calls.next().await.answer(Err(err.clone()));
        let d = req.await.unwrap();
        assert_eq!(status(&d), want, "{err:?} with {flags:?}");
        assert_eq!(Instant::now(), start, "answered without waiting: {err:?}");
        assert!(h.calls.try_next().is_none(), "one attempt only: {err:?}");
        h.assert_lot(0, 0, &[]);
    }
}

/// Retryable answers park (parking on): the request holds a slot until the flight
/// resolves, and is then served.
#[tokio::test(start_paused = true)]
async fn each_retryable_code_parks_then_serves() {
    for code in [
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Unavailable,
        Code::Aborted,
    ] {
        let mut h = harness(&[]);
        let req = h.request("demo/p1");
        h.calls.next().await.fail(code, "wait");
        settle_until("parked", || h.parked() == 1).await;
        h.assert_lot(1, 0, &[]);
        let retry = h.calls.next().await;
        assert!(retry.request.wait_for_capacity.is_some(), "{code:?}");
        retry.running(9001);
        assert_eq!(status(&req.await.unwrap()), 200, "{code:?}");
        h.assert_lot(0, 0, &[("served", 1)]);
    }
}

/// With parking disabled only Aborted is retried, within 15 s, and nothing parks.
#[tokio::test(start_paused = true)]
async fn disabled_parking_retries_aborted_for_15s_without_parking() {
    let mut h = harness(&[
        "--parked-request-max",
        "0",
        "--parked-request-retry-jitter",
        "0",
    ]);
    let start = Instant::now();
    // Under the data planes' own deadline, which must leave the flight its 15 s.
    let decision_timeout = h.router.config().decision_timeout();
    let req = h.request_with_deadline("demo/p1", decision_timeout);
    let router = h.router.clone();
    let (d, times) = answer_until_done(&mut h.calls, req, |call| {
        assert_eq!(call.request.wait_for_capacity, None, "never asks to wait");
        assert_eq!(router.lot().active(), 0, "never parks");
        call.fail(
            Code::Aborted,
            "another operation is in progress for this actor",
        );
    })
    .await;
    assert!(times.len() > 10);
    assert!(times.iter().all(|t| *t < start + Duration::from_secs(15)));
    assert_eq!(Instant::now(), start + Duration::from_secs(15));
    assert_eq!(status(&d), 503);
    assert_eq!(
        body(&d),
        "actor demo/p1 unavailable: another operation is in progress for this actor"
    );
    h.assert_lot(0, 0, &[]);
}

/// An attempt due just before the budget ends, whose timer wakes at the end (tokio's
/// timers round up to the millisecond), does not start: the budget has ended.
#[tokio::test(start_paused = true)]
async fn no_attempt_starts_at_the_end_of_the_budget() {
    let mut h = harness(&[
        "--parked-request-retry-jitter",
        "0",
        "--parked-request-retry-interval",
        "999.5ms",
        "--parked-request-budget",
        "1s",
    ]);
    let start = Instant::now();
    let req = h.request("demo/p1");
    let (d, times) = answer_until_done(&mut h.calls, req, |c| c.no_room()).await;
    assert_eq!(times, [start], "one attempt");
    assert_eq!(Instant::now(), start + Duration::from_secs(1));
    assert_eq!(status(&d), 503);
}

/// The waits between attempts follow interval × factor^n with no cap, and no attempt
/// starts after the budget; the verdict comes at the budget.
#[tokio::test(start_paused = true)]
async fn backoff_sequence_and_budget() {
    let mut h = harness(&[
        "--parked-request-retry-jitter",
        "0",
        "--parked-request-retry-interval",
        "100ms",
        "--parked-request-retry-factor",
        "1.5",
        "--parked-request-budget",
        "3s",
    ]);
    let start = Instant::now();
    let req = h.request("demo/p1");
    let (d, times) = answer_until_done(&mut h.calls, req, |c| c.no_room()).await;
    // Gaps 100, 150, 225, 337.5, 506.25, 759.375 ms (tokio's timer rounds each up to
    // the next millisecond); the next, 1139 ms, would start after the 3 s budget.
    assert_eq!(times[0], start);
    let gaps: Vec<f64> = times
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    let want = [100.0, 150.0, 225.0, 337.5, 506.25, 759.375];
    assert_eq!(gaps.len(), want.len(), "attempts: {gaps:?}");
    for (got, want) in gaps.iter().zip(want) {
        assert!(
            *got >= want && *got < want + 1.0,
            "gap {got} ms, want {want} ms"
        );
    }
    assert_eq!(
        Instant::now(),
        start + Duration::from_secs(3),
        "verdict at the budget"
    );
    assert_eq!(status(&d), 503);
    assert_eq!(
        body(&d),
        "actor demo/p1 unavailable: no worker has room for the actor"
    );
    match &d {
        Decision::Deny(Denial::Flight(_, FlightError::BudgetExhausted(e)), v) => {
            assert_eq!(e.code(), Code::ResourceExhausted);
            assert!(v.retry_after_secs().is_some());
        }
        other => panic!("{other:?}"),
    }
    h.assert_lot(0, 0, &[("budget_exhausted", 1)]);
}

/// With jitter each wait lies in [base, base × (1 + jitter)).
#[tokio::test(start_paused = true)]
async fn backoff_jitter_bounds() {
    let mut h = harness(&[
        "--parked-request-retry-jitter",
        "0.5",
        "--parked-request-budget",
        "20s",
    ]);
    let req = h.request("demo/p1");
    let (_, times) = answer_until_done(&mut h.calls, req, |c| c.no_room()).await;
    let mut base = 0.1_f64;
    let mut stretched = 0;
    for pair in times.windows(2) {
        let gap = (pair[1] - pair[0]).as_secs_f64();
        assert!(
            // tokio's timer rounds each wait up to the next millisecond.
            gap >= base - 1e-6 && gap < base * 1.5 + 0.001 + 1e-6,
            "gap {gap} base {base}"
        );
        if gap > base * 1.01 {
            stretched += 1;
        }
        base *= 1.1;
    }
    assert!(times.len() > 20);
    assert!(stretched > 0, "jitter stretches some waits");
}

/// An attempt in flight when the budget ends is awaited, never cancelled: success is
/// served late.
#[tokio::test(start_paused = true)]
async fn attempt_in_flight_at_budget_end_is_served_late() {
    let mut h = harness(&[
        "--parked-request-budget",
        "1s",
        "--parked-request-retry-jitter",
        "0",
    ]);
    let start = Instant::now();
    let req = h.request("demo/p1");
    h.calls.next().await.no_room();
    let slow = h.calls.next().await; // at 100 ms, asks to wait 900 ms
    assert_eq!(
        slow.request.wait_for_capacity,
        Some(Duration::from_millis(900))
    );
    assert_eq!(slow.request.timeout, Duration::from_millis(30_900));
    elapse(Duration::from_secs(3)).await; // the control plane takes its time
    assert!(
        !req.is_finished(),
        "still waiting for the attempt in flight"
    );
    h.assert_lot(1, 0, &[]);
    slow.running(9001);
    let d = req.await.unwrap();
    assert_eq!(status(&d), 200);
    assert_eq!(Instant::now(), start + Duration::from_millis(3100));
    assert!(h.calls.try_next().is_none(), "no attempt after the budget");
    h.assert_lot(0, 0, &[("served", 1)]);
}

/// ... and a retryable answer after the budget becomes the budget-exhausted verdict.
#[tokio::test(start_paused = true)]
async fn attempt_in_flight_at_budget_end_retryable_is_exhausted() {
    let mut h = harness(&[
        "--parked-request-budget",
        "1s",
        "--parked-request-retry-jitter",
        "0",
    ]);
    let req = h.request("demo/p1");
    h.calls.next().await.no_room();
    let slow = h.calls.next().await;
    elapse(Duration::from_secs(2)).await;
    slow.fail(Code::FailedPrecondition, "actor is SUSPENDING");
    let d = req.await.unwrap();
    assert_eq!(status(&d), 503);
    assert_eq!(body(&d), "actor demo/p1 unavailable: actor is SUSPENDING");
    assert!(h.calls.try_next().is_none());
    h.assert_lot(0, 0, &[("budget_exhausted", 1)]);
}

/// The first attempt asks for no capacity wait; every attempt after the park asks for
/// the remaining budget; an immediate answer falls back to the backoff.
#[tokio::test(start_paused = true)]
async fn capacity_wait_after_park_with_backoff_fallback() {
    let mut h = harness(&["--parked-request-retry-jitter", "0"]);
    let start = Instant::now();
    let req = h.request("demo/p1");
    let mut asked = Vec::new();
    let (d, times) = answer_until_done(&mut h.calls, req, |c| {
        asked.push(c.request.wait_for_capacity);
        c.no_room() // a server without the extension answers at once
    })
    .await;
    assert_eq!(asked[0], None);
    for (t, wait) in times.iter().zip(&asked).skip(1) {
        assert_eq!(*wait, Some(start + Duration::from_secs(5) - *t));
    }
    assert_eq!(
        (times[1] - times[0]).as_millis(),
        100,
        "backoff after the immediate answer"
    );
    assert_eq!((times[2] - times[1]).as_millis(), 110);
    assert_eq!(status(&d), 503);
}

/// A control plane that honours the wait hands the worker over mid-wait: served with
/// no further attempt.
#[tokio::test(start_paused = true)]
async fn capacity_wait_served_by_hand_off() {
    let mut h = harness(&["--parked-request-retry-jitter", "0"]);
    let start = Instant::now();
    let req = h.request("demo/p1");
    h.calls.next().await.no_room();
    let waiting = h.calls.next().await;
    assert_eq!(
        waiting.request.wait_for_capacity,
        Some(Duration::from_millis(4900))
    );
    elapse(Duration::from_millis(2270)).await; // a worker frees at 2.37 s
    waiting.running(9002);
    let d = req.await.unwrap();
    assert_eq!(status(&d), 200);
    assert_eq!(Instant::now() - start, Duration::from_millis(2370));
    assert!(h.calls.try_next().is_none());
    h.assert_lot(0, 0, &[("served", 1)]);
}
