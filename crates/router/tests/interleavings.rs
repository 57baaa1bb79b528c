//! Property test: random interleavings of arrivals, cancellations, deadlines and
//! control-plane answers keep the lot's books straight.

mod common;

use std::collections::VecDeque;
use std::time::Duration;

use common::{elapse, harness, host};
use proptest::prelude::*;
use tokio::time::Instant;
use tonic::Code;
use valet_router::control::ResumeError;
use valet_router::testing::Call;

const BUDGET: Duration = Duration::from_millis(1000);

#[derive(Debug, Clone, Copy)]
enum Answer {
    Running,
    NoRoom,
    Aborted,
    Unavailable,
    NotFound,
    Crashed,
}

#[derive(Debug, Clone)]
enum Op {
    Arrive { actor: u8, deadline_ms: Option<u16> },
    Cancel(usize),
    Answer(Answer),
    Advance(u16),
}

fn op() -> impl Strategy<Value = Op> {
    let answer = prop_oneof![
        3 => Just(Answer::Running),
        5 => Just(Answer::NoRoom),
        1 => Just(Answer::Aborted),
        1 => Just(Answer::Unavailable),
        1 => Just(Answer::NotFound),
        1 => Just(Answer::Crashed),
    ];
    prop_oneof![
        4 => (0u8..4, proptest::option::weighted(0.2, 50u16..2500))
            .prop_map(|(actor, deadline_ms)| Op::Arrive { actor, deadline_ms }),
        1 => any::<usize>().prop_map(Op::Cancel),
        4 => answer.prop_map(Op::Answer),
        3 => (1u16..400).prop_map(Op::Advance),
    ]
}

fn answer(call: Call, a: Answer) {
    match a {
        Answer::Running => call.running(9000),
        Answer::NoRoom => call.no_room(),
        Answer::Aborted => call.fail(
            Code::Aborted,
            "another operation is in progress for this actor",
        ),
        Answer::Unavailable => call.fail(Code::Unavailable, "down"),
        Answer::NotFound => call.fail(Code::NotFound, "not found"),
        Answer::Crashed => call.answer(Err(ResumeError::crashed("crashed"))),
    }
}

struct Request {
    arrived: Instant,
    deadline: Instant,
    task: tokio::task::JoinHandle<Instant>,
}

async fn run(ops: Vec<Op>, lot: usize) -> Result<(), TestCaseError> {
    let mut h = harness(&[
        "--parked-request-budget",
        "1s",
        "--parked-request-max",
        &lot.to_string(),
    ]);
    let mut requests: Vec<Request> = Vec::new();
    let mut pending: VecDeque<Call> = VecDeque::new();
    let mut longest_attempt = Duration::ZERO;

    let settle = || async {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    };

    for op in ops {
        settle().await;
        while let Some(c) = h.calls.try_next() {
            pending.push_back(c);
        }
        match op {
            Op::Arrive { actor, deadline_ms } => {
                let router = h.router.clone();
                let host = host(&format!("demo/a{actor}"));
                let arrived = Instant::now();
                let deadline = arrived
                    + deadline_ms.map_or(Duration::from_secs(3600), |ms| {
                        Duration::from_millis(ms.into())
                    });
                let task = tokio::spawn(async move {
                    router.decide(&host, deadline).await;
                    Instant::now()
                });
                requests.push(Request {
                    arrived,
                    deadline,
                    task,
                });
            }
            Op::Cancel(i) => {
                if !requests.is_empty() {
                    let n = requests.len();
                    requests[i % n].task.abort();
                }
            }
            Op::Answer(a) => {
                if let Some(call) = pending.pop_front() {
                    longest_attempt = longest_attempt.max(Instant::now() - call.asked_at);
                    answer(call, a);
                }
            }
            Op::Advance(ms) => elapse(Duration::from_millis(ms.into())).await,
        }
    }

    // Drain: the control plane answers everything at once, "no room", until every
    // request and flight is done.
    for _ in 0..10_000 {
        settle().await;
        while let Some(call) = pending.pop_front().or_else(|| h.calls.try_next()) {
            longest_attempt = longest_attempt.max(Instant::now() - call.asked_at);
            call.no_room();
        }
        if requests.iter().all(|r| r.task.is_finished()) && h.router.flights_in_progress() == 0 {
            break;
        }
        elapse(Duration::from_millis(5)).await;
    }

    let total = requests.len() as f64;
    for r in requests {
        prop_assert!(r.task.is_finished());
        if let Ok(answered) = r.task.await {
            let waited = answered - r.arrived;
            let bound = BUDGET + longest_attempt + Duration::from_millis(2);
            prop_assert!(waited <= bound, "answered after {waited:?} > {bound:?}");
            prop_assert!(answered <= r.deadline + Duration::from_millis(1));
        }
    }
    prop_assert_eq!(h.router.lot().active(), 0);
    prop_assert_eq!(h.active_gauge(), 0.0);
    prop_assert_eq!(h.router.flights_in_progress(), 0);
    prop_assert_eq!(h.all_waits(), h.router.lot().admitted_total() as f64);
    prop_assert_eq!(h.metric("atenet_router_requests_total", &[]), total);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn books_balance_under_any_interleaving(
        ops in proptest::collection::vec(op(), 1..80),
        lot in prop_oneof![Just(1usize), Just(3), Just(1024)],
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(run(ops, lot))?;
    }
}
