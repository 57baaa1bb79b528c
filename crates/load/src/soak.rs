//! The soak: a small pool saturated for a long time, with clients that give up at
//! random and actors suspended at random. At the end the router's books must balance:
//! nothing parked, no flight left, every parked request sampled under exactly one
//! outcome, and every decision the client did not see owned by a request it abandoned.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rand::RngExt as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use valet_router::Router;

use crate::record::Record;
use crate::scenario::Report;
use crate::system::{DOMAIN, System};

/// How a soak runs.
#[derive(Debug, Clone)]
pub struct SoakOpts {
    /// How long load is sent.
    pub duration: Duration,
    /// Client loops.
    pub clients: usize,
    /// Actors the clients address, on the system's pool.
    pub actors: usize,
    /// The router's budget (for how long a client may wait before giving up).
    pub budget: Duration,
    /// The chance that a client gives up on a request, at a random instant of its wait.
    pub abandon: f64,
    /// The longest pause between two random suspends.
    pub suspend_every: Duration,
}

impl Default for SoakOpts {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(600),
            clients: 32,
            actors: 8,
            budget: Duration::from_secs(5),
            abandon: 0.2,
            suspend_every: Duration::from_millis(500),
        }
    }
}

/// What one client request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The router's (or the actor's) status.
    Answered(u16),
    /// The client gave up before the answer.
    Abandoned,
    /// The connection failed or ended without a complete answer.
    Broken,
}

/// One GET over a fresh connection, given up after `give_up` if set; one the router
/// never answers is broken after [`crate::generate::NO_ANSWER_AFTER`] (the soak ends,
/// and its books say so, instead of hanging).
async fn request(router: SocketAddr, host: &str, give_up: Option<Duration>) -> (Outcome, String) {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(router).await.ok()?;
        let req = format!("GET /soak HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text.get(9..12)?.parse::<u16>().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
        Some((status, body))
    };
    let answered = match give_up {
        Some(after) => match tokio::time::timeout(after, exchange).await {
            Ok(a) => a,
            Err(_) => return (Outcome::Abandoned, "abandoned by the client".into()),
        },
        None => tokio::time::timeout(crate::generate::NO_ANSWER_AFTER, exchange)
            .await
            .ok()
            .flatten(),
    };
    match answered {
        Some((status, body)) => (Outcome::Answered(status), body),
        None => (Outcome::Broken, "broken: no complete answer".into()),
    }
}

/// Counts by category.
#[derive(Debug, Default)]
struct Tally {
    answered: std::collections::BTreeMap<u16, u64>,
    abandoned: u64,
    broken: u64,
}

impl Tally {
    fn total(&self) -> u64 {
        self.answered.values().sum::<u64>() + self.abandoned + self.broken
    }
}

/// Runs the soak against an embedded system (the router's books are read in process).
///
/// When the books do not balance the report says which line, and its `failed` why.
///
/// # Errors
/// When the system cannot be set up.
pub async fn soak(sys: &System, opts: &SoakOpts) -> Result<Report, String> {
    let router = sys
        .in_process_router()
        .ok_or("the soak reads the router's books: run it on embedded parts")?
        .clone();
    let actors: Vec<String> = (1..=opts.actors).map(|i| format!("demo/soak{i}")).collect();
    for a in &actors {
        sys.fresh(a).await?;
    }
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..opts.clients {
        let (actors, stop, opts) = (actors.clone(), Arc::clone(&stop), opts.clone());
        let addr = sys.router;
        clients.spawn(async move {
            let mut records = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let (actor, give_up) = {
                    let mut rng = rand::rng();
                    let actor = actors[rng.random_range(0..actors.len())].clone();
                    let give_up = rng
                        .random_bool(opts.abandon)
                        .then(|| opts.budget.mul_f64(rng.random_range(0.0..1.0)));
                    (actor, give_up)
                };
                let (name, atespace) = {
                    let (a, n) = actor.split_once('/').unwrap_or(("demo", &actor));
                    (n.to_owned(), a.to_owned())
                };
                let host = format!("{name}.{atespace}.{DOMAIN}");
                let start = started.elapsed();
                let (outcome, body) = request(addr, &host, give_up).await;
                records.push((
                    outcome,
                    Record {
                        label: "soak".into(),
                        actor,
                        start,
                        end: started.elapsed(),
                        status: match outcome {
                            Outcome::Answered(s) => s,
                            Outcome::Abandoned | Outcome::Broken => 0,
                        },
                        body: Record::prefix(&body),
                    },
                ));
            }
            records
        });
    }
    let mut suspends = 0u64;
    let mut next_progress = started + Duration::from_secs(10);
    while started.elapsed() < opts.duration {
        let pause = opts
            .suspend_every
            .mul_f64(rand::rng().random_range(0.1..1.0));
        tokio::time::sleep(pause).await;
        let running = sys.running_actors().await;
        if !running.is_empty() {
            let pick = running[rand::rng().random_range(0..running.len())].clone();
            if sys.try_suspend(&pick).await {
                suspends += 1;
            }
        }
        if Instant::now() >= next_progress {
            next_progress += Duration::from_secs(10);
            progress!(
                "soak: {:.0}s of {:.0}s, {} parked now, {} suspends",
                started.elapsed().as_secs_f64(),
                opts.duration.as_secs_f64(),
                router.lot().active(),
                suspends
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut tally = Tally::default();
    let mut records = Vec::new();
    for (outcome, record) in clients.join_all().await.into_iter().flatten() {
        match outcome {
            Outcome::Answered(s) => *tally.answered.entry(s).or_default() += 1,
            Outcome::Abandoned => tally.abandoned += 1,
            Outcome::Broken => tally.broken += 1,
        }
        records.push(record);
    }
    records.sort_by_key(|r| r.start);
    let quiet = quiesce(&router, opts.budget + Duration::from_secs(40)).await;
    let (mut text, balanced) = books(&router, &tally, suspends, opts, quiet);
    if let Some(m) = sys.control_plane_metrics() {
        let evictions = valet_telemetry::sample_of(&m, "valet_control_evictions_total", &[]);
        let _ = writeln!(
            text,
            "evictions: {evictions} ({:.2}/s)",
            evictions / started.elapsed().as_secs_f64()
        );
    }
    let report = Report {
        name: "soak".into(),
        text,
        records,
        budget_s: Some(opts.budget.as_secs_f64()),
        failed: balanced
            .err()
            .map(|why| format!("the books do not balance: {why}")),
    };
    Ok(report)
}

/// Waits (bounded) until nothing is parked and no flight runs.
async fn quiesce(router: &Router, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if router.lot().active() == 0 && router.flights_in_progress() == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

fn books(
    router: &Router,
    client: &Tally,
    suspends: u64,
    opts: &SoakOpts,
    quiet: bool,
) -> (String, Result<(), String>) {
    let m = router.metrics();
    let decided = |status: u16| {
        m.sample(
            "atenet_router_requests_total",
            &[("status", &status.to_string())],
        ) as u64
    };
    let outcomes = ["served", "budget_exhausted", "canceled", "timeout", "error"];
    let waits: Vec<(&str, u64)> = outcomes
        .iter()
        .map(|o| {
            let n = m.sample(
                "atenet_router_parking_wait_duration_seconds_count",
                &[("outcome", o)],
            );
            (*o, n as u64)
        })
        .collect();
    // A request replayed after its actor moved is decided twice.
    let replayed = m.sample("atenet_router_requests_replayed_total", &[]) as u64;
    let router_total =
        (m.sample("atenet_router_requests_total", &[]) as u64).saturating_sub(replayed);
    let canceled = decided(408);
    let lot = router.lot();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "soak: {:.0}s, {} clients, {} actors, budget {:?}, {:.0}% of requests given up at random; {suspends} random suspends",
        opts.duration.as_secs_f64(),
        opts.clients,
        opts.actors,
        opts.budget,
        opts.abandon * 100.0
    );
    let answered: Vec<String> = client
        .answered
        .iter()
        .map(|(s, n)| format!("{n} x {s}"))
        .collect();
    let _ = writeln!(
        text,
        "client: {} requests: {}; {} abandoned; {} broken",
        client.total(),
        answered.join(", "),
        client.abandoned,
        client.broken
    );
    // A status the router decides itself is counted under it; anything else the client
    // saw (the actor's own answer, or a forward that failed after the route) was a
    // routed decision, counted as 200.
    let verdicts = [400u16, 401, 403, 404, 408, 413, 431, 500, 503, 504];
    let mut seen_by_decision = std::collections::BTreeMap::<u16, u64>::new();
    for (status, n) in &client.answered {
        let decision = if verdicts.contains(status) {
            *status
        } else {
            200
        };
        *seen_by_decision.entry(decision).or_default() += n;
    }
    let mut problems = Vec::new();
    let mut router_line = Vec::new();
    for (status, n) in &seen_by_decision {
        let r = decided(*status);
        router_line.push(format!("{r} x {status}"));
        if r < *n {
            problems.push(format!(
                "the client saw {n} answers of decisions {status}, the router decided {r}"
            ));
        }
    }
    let seen: u64 = seen_by_decision.values().sum();
    let unseen = router_total.saturating_sub(canceled + seen);
    let _ = writeln!(
        text,
        "router: {router_total} requests decided: {} (routed counted as 200), {canceled} x 408 (client gone); {replayed} replayed after their actor moved",
        router_line.join(", ")
    );
    let parked_total = lot.admitted_total();
    let sampled: u64 = waits.iter().map(|(_, n)| n).sum();
    let waits_line: Vec<String> = waits.iter().map(|(o, n)| format!("{n} {o}")).collect();
    let _ = writeln!(
        text,
        "lot: {parked_total} parked: {}; {} shed; {} parked now, {} flights, {} bytes held",
        waits_line.join(", "),
        lot.rejected_total(),
        lot.active(),
        router.flights_in_progress(),
        lot.bytes().held()
    );
    if !quiet || lot.active() != 0 || router.flights_in_progress() != 0 {
        problems.push("requests still parked or flights still running".into());
    }
    if sampled != parked_total {
        problems.push(format!("{parked_total} parked, {sampled} wait samples"));
    }
    if lot.bytes().held() != 0 {
        problems.push("body bytes still held".into());
    }
    if client.broken != 0 {
        problems.push(format!(
            "{} requests broken without an answer",
            client.broken
        ));
    }
    if unseen + canceled > client.abandoned {
        problems.push(format!(
            "{unseen} decisions the client did not see and {canceled} x 408, but only {} abandoned",
            client.abandoned
        ));
    }
    if router_total > client.total() {
        problems.push(format!(
            "the router decided {router_total} requests, the client sent {}",
            client.total()
        ));
    }
    let _ = writeln!(
        text,
        "books: {}",
        if problems.is_empty() {
            "balanced (every decision the client did not see belongs to a request it abandoned)"
                .to_owned()
        } else {
            problems.join("; ")
        }
    );
    let verdict = if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    };
    (text, verdict)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request the router accepts and never answers is counted broken after
    /// [`crate::generate::NO_ANSWER_AFTER`]: the soak ends and says so.
    #[tokio::test(start_paused = true)]
    async fn a_request_never_answered_is_broken_in_the_end() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let holder = tokio::spawn(async move {
            let (conn, _) = listener.accept().await.unwrap();
            std::future::pending::<()>().await;
            drop(conn);
        });
        let outcome = tokio::time::timeout(
            Duration::from_secs(3600),
            request(addr, "soak1.demo.x", None),
        )
        .await
        .expect("the request ends");
        assert!(matches!(outcome.0, Outcome::Broken), "{:?}", outcome.0);
        holder.abort();
    }
}
