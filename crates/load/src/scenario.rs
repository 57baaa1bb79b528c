//! The seed's experiments (`seeds/002_…`, fig. 4.7 and 4.8, the load run, the overflow
//! bursts) and two of our own (parked scale, fast path), as scenarios.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use tokio::time::Instant;

use crate::generate::{HttpClient, closed_loop};
use crate::record::Record;
use crate::stats::{Latencies, Summary};
use crate::system::{DOMAIN, System};

/// What a scenario produced.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Its name.
    pub name: String,
    /// The human-readable result.
    pub text: String,
    /// Every request.
    pub records: Vec<Record>,
    /// The parking budget, for charts (seconds).
    pub budget_s: Option<f64>,
    /// Why the run failed, when it did: its records and text are published all the
    /// same (they are what explains the failure), then the run fails.
    pub failed: Option<String>,
}

fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

async fn one(client: &HttpClient, sys: &System, t0: Instant, label: &str, actor: &str) -> Record {
    let start = t0.elapsed();
    let (status, body) = client.get(sys.next_router(), actor, "/").await;
    Record {
        label: label.to_owned(),
        actor: actor.to_owned(),
        start,
        end: t0.elapsed(),
        status,
        body: Record::prefix(&body),
    }
}

fn row(out: &mut String, r: &Record) {
    let _ = writeln!(
        out,
        "{:<24} {:<10} {:>3} {:>9.6}  {}",
        r.label,
        r.actor,
        r.status,
        r.latency().as_secs_f64(),
        r.body
    );
}

/// Fig. 4.7: two workers, p1 and p2 running; requests to p3 while the pool is full get
/// 503 at the budget; then a request to p3 while p1 is suspended `free_at` into its
/// wait gets 200.
pub async fn timeline(
    sys: &System,
    budget: Duration,
    full_requests: usize,
    free_at: Duration,
) -> Result<Report, String> {
    let client = HttpClient::new(DOMAIN);
    for a in ["demo/p1", "demo/p2", "demo/p3"] {
        sys.fresh(a).await?;
    }
    let t0 = Instant::now();
    let mut records = Vec::new();
    for a in ["demo/p1", "demo/p2"] {
        records.push(one(&client, sys, t0, "free-worker", a).await);
    }
    for _ in 0..full_requests {
        records.push(one(&client, sys, t0, "p3-no-free-worker", "demo/p3").await);
    }
    let calls_before = sys.resume_calls_for("demo/p3");
    let parked = {
        let client = client.clone();
        let router = sys.next_router();
        tokio::spawn(async move {
            let start = t0.elapsed();
            let (status, body) = client.get(router, "demo/p3", "/").await;
            (start, t0.elapsed(), status, body)
        })
    };
    // Its wait begins when the control plane first sees it (observable with an
    // embedded control plane): `free_at` counts from there, however late the request
    // was sent.
    if let Some(before) = calls_before {
        let seen = Instant::now() + budget;
        while sys.resume_calls_for("demo/p3") == Some(before) && Instant::now() < seen {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    tokio::time::sleep(free_at).await;
    sys.suspend("demo/p1").await?;
    let freed = t0.elapsed();
    let (start, end, status, body) = parked.await.map_err(|e| e.to_string())?;
    let served = Record {
        label: "p3-served-after-park".into(),
        actor: "demo/p3".into(),
        start,
        end,
        status,
        body: Record::prefix(&body),
    };
    let calls = match (calls_before, sys.resume_calls_for("demo/p3")) {
        (Some(b), Some(a)) => format!("{}", a - b),
        _ => "n/a (the control plane runs in another process)".into(),
    };
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{:<24} {:<10} {:>3} {:>9}  body",
        "event", "actor", "HTTP", "seconds"
    );
    for r in &records {
        row(&mut text, r);
    }
    row(&mut text, &served);
    let full: Vec<Record> = records
        .iter()
        .filter(|r| r.label == "p3-no-free-worker")
        .cloned()
        .collect();
    let _ = writeln!(
        text,
        "full pool: {} (budget {})",
        refusals(&full),
        secs(budget)
    );
    let _ = writeln!(
        text,
        "freed a worker {} into the wait; p3 answered {} after the suspend returned ({} total); ResumeActor calls for that wait: {calls}",
        secs(freed.saturating_sub(start)),
        if end >= freed {
            secs(end - freed)
        } else {
            format!("-{}", secs(freed - end))
        },
        secs(end - start),
    );
    records.push(served);
    Ok(Report {
        name: "timeline".into(),
        text,
        records,
        budget_s: Some(budget.as_secs_f64()),
        failed: None,
    })
}

/// The demo's load script: four actors on two workers for `duration`, each answer
/// followed by a suspend of its actor.
pub async fn steady(sys: &System, duration: Duration) -> Result<Report, String> {
    let actors = ["demo/p1", "demo/p2", "demo/p3", "demo/p4"];
    for a in actors {
        sys.fresh(a).await?;
    }
    let client = HttpClient::new(DOMAIN);
    let sys_ref = sys;
    let t0 = Instant::now();
    let loops = actors.iter().map(|actor| {
        let client = client.clone();
        async move {
            let mut out = Vec::new();
            while t0.elapsed() < duration {
                let r = one(&client, sys_ref, t0, "load", actor).await;
                let ok = r.status == 200;
                out.push(r);
                if ok {
                    sys_ref.suspend(actor).await?;
                }
            }
            Ok::<_, String>(out)
        }
    });
    let mut records = Vec::new();
    for r in futures_util::future::join_all(loops).await {
        records.extend(r?);
    }
    records.sort_by_key(|r| r.start);
    let s = Summary::of(&records);
    Ok(Report {
        name: "steady".into(),
        text: s.seed_block(),
        records,
        budget_s: None,
        failed: None,
    })
}

/// Fires one request to each of `actors` at the same instant.
async fn burst(
    client: &HttpClient,
    sys: &System,
    t0: Instant,
    label: &str,
    actors: &[String],
) -> Vec<Record> {
    burst_with_body(client, sys, t0, label, actors, 0).await
}

/// [`burst`], each request a POST with a body of `body` bytes when `body` > 0.
async fn burst_with_body(
    client: &HttpClient,
    sys: &System,
    t0: Instant,
    label: &str,
    actors: &[String],
    body: usize,
) -> Vec<Record> {
    let payload = bytes::Bytes::from(vec![b'x'; body]);
    let barrier = Arc::new(Barrier::new(actors.len()));
    let mut tasks = tokio::task::JoinSet::new();
    for a in actors {
        let (client, barrier, router, a, label, payload) = (
            client.clone(),
            Arc::clone(&barrier),
            sys.next_router(),
            a.clone(),
            label.to_owned(),
            payload.clone(),
        );
        tasks.spawn(async move {
            barrier.wait().await;
            let start = t0.elapsed();
            let (status, body) = if payload.is_empty() {
                client.get(router, &a, "/").await
            } else {
                client.post(router, &a, "/", payload).await
            };
            Record {
                label,
                actor: a,
                start,
                end: t0.elapsed(),
                status,
                body: Record::prefix(&body),
            }
        });
    }
    let mut out = tasks.join_all().await;
    out.sort_by_key(|r| r.start);
    out
}

/// Fig. 4.8: `n` suspended actors requested at the same instant, for each `n` of
/// `levels`, `rounds` times each, on a pool with room for all of them.
pub async fn bursts(sys: &System, levels: &[usize], rounds: usize) -> Result<Report, String> {
    let client = HttpClient::new(DOMAIN);
    let max = levels.iter().copied().max().unwrap_or(0);
    let actors: Vec<String> = (1..=max).map(|i| format!("demo/b{i}")).collect();
    for a in &actors {
        sys.fresh(a).await?;
    }
    let t0 = Instant::now();
    let mut records = Vec::new();
    let mut text = format!(
        "{:>6} {:>9} {:>9} {:>9} {:>9}\n",
        "at once", "requests", "200", "median", "slowest"
    );
    for &n in levels {
        let mut level = Vec::new();
        for _ in 0..rounds {
            let batch = burst(&client, sys, t0, &format!("burst-{n}"), &actors[..n]).await;
            for a in &actors[..n] {
                sys.suspend(a).await?;
            }
            level.extend(batch);
        }
        let s = Summary::of(&level);
        // Median and slowest of the 200s: a failure is counted, not timed.
        let (median, slowest) = s.ok.as_ref().map_or(("-".to_owned(), "-".to_owned()), |l| {
            (secs(l.median), secs(l.max))
        });
        let _ = writeln!(
            text,
            "{n:>6} {:>9} {:>9} {:>9} {:>9}",
            s.total,
            s.count(200),
            median,
            slowest
        );
        records.extend(level);
    }
    Ok(Report {
        name: "bursts".into(),
        text,
        records,
        budget_s: None,
        failed: None,
    })
}

/// The overflow bursts: 32 actors at once into a pool with 14 free places; then again
/// with 16 actors suspended `free_at` into the wait.
pub async fn overflow(sys: &System, budget: Duration, free_at: Duration) -> Result<Report, String> {
    let client = HttpClient::new(DOMAIN);
    let holders = ["demo/r1", "demo/r2"];
    let actors: Vec<String> = (1..=32).map(|i| format!("demo/o{i}")).collect();
    for a in holders
        .iter()
        .map(|s| (*s).to_owned())
        .chain(actors.iter().cloned())
    {
        sys.fresh(&a).await?;
    }
    let t0 = Instant::now();
    let mut text = String::new();
    let mut records = Vec::new();
    for (round, relief) in [("burst-32", false), ("burst-32-relief", true)] {
        for h in holders {
            let r = one(&client, sys, t0, "holder", h).await;
            if r.status != 200 {
                return Err(format!("holder {h} not served: {} {}", r.status, r.body));
            }
        }
        let calls_before: u64 = actors.iter().filter_map(|a| sys.resume_calls_for(a)).sum();
        let started = t0.elapsed();
        let fire = burst(&client, sys, t0, round, &actors);
        let batch = if relief {
            let relieve = async {
                tokio::time::sleep(free_at).await;
                let mut running = Vec::new();
                for a in holders
                    .iter()
                    .map(|s| (*s).to_owned())
                    .chain(actors.iter().cloned())
                {
                    if running.len() < 16 && sys.running(&a).await {
                        running.push(a);
                    }
                }
                for a in &running {
                    sys.suspend(a).await?;
                }
                Ok::<_, String>((running.len(), t0.elapsed()))
            };
            let (batch, freed) = tokio::join!(fire, relieve);
            let (n, at) = freed?;
            let _ = writeln!(
                text,
                "{round}: suspended {n} actors {} into the wait",
                secs(at - started)
            );
            batch
        } else {
            fire.await
        };
        let calls_after: u64 = actors.iter().filter_map(|a| sys.resume_calls_for(a)).sum();
        let s = Summary::of(&batch);
        let ok =
            s.ok.map(|l| format!("median {}, slowest {}", secs(l.median), secs(l.max)))
                .unwrap_or_default();
        let _ = writeln!(text, "{round}: {}", overflow_line(&batch, &s, &ok));
        if sys.resume_calls_for("demo/o1").is_some() {
            let _ = writeln!(
                text,
                "{round}: ResumeActor calls for the 32 actors: {}",
                calls_after - calls_before
            );
        }
        records.extend(batch);
        for a in holders
            .iter()
            .map(|s| (*s).to_owned())
            .chain(actors.iter().cloned())
        {
            sys.suspend(&a).await?;
        }
    }
    Ok(Report {
        name: "overflow".into(),
        text,
        records,
        budget_s: Some(budget.as_secs_f64()),
        failed: None,
    })
}

/// A running `echo` actor through the router, through nginx `proxy_pass` to the same
/// worker (when an `nginx` binary is on PATH), and at its worker directly: closed loop
/// with `concurrency` clients for `duration` each. Also counts the control plane's
/// `ResumeActor` calls during the router's run (with route leases: about one per lease
/// period, not one per request).
pub async fn fast_path(
    sys: &System,
    concurrency: usize,
    duration: Duration,
) -> Result<Report, String> {
    let client = HttpClient::new(DOMAIN);
    sys.fresh_of("demo/fast", "echo").await?;
    let t0 = Instant::now();
    let first = one(&client, sys, t0, "warm", "demo/fast").await;
    if first.status != 200 {
        return Err(format!("demo/fast not served: {}", first.body));
    }
    let worker = sys
        .worker_of("demo/fast")
        .await
        .ok_or("no worker address")?;
    let actors = vec!["demo/fast".to_owned()];
    let calls_before = sys.resume_calls();
    let via = {
        let (client, router) = (client.clone(), sys.router);
        closed_loop("router", concurrency, duration, &actors, move |a| {
            let client = client.clone();
            async move { client.get(router, &a, "/").await }
        })
        .await
    };
    let calls = sys
        .resume_calls()
        .zip(calls_before)
        .map(|(after, before)| after - before);
    let nginx = match crate::nginx::Nginx::start(worker, "demo/fast").await {
        Ok(Some(n)) => {
            let client = client.clone();
            let addr = n.addr;
            let recs = closed_loop("nginx", concurrency, duration, &actors, move |_| {
                let client = client.clone();
                async move { client.get_host(addr, "fast", "/").await }
            })
            .await;
            n.stop().await;
            Some(recs)
        }
        Ok(None) => None,
        Err(e) => return Err(e),
    };
    let direct = {
        let client = client.clone();
        closed_loop("worker", concurrency, duration, &actors, move |_| {
            let client = client.clone();
            async move { client.get_host(worker, "worker", "/").await }
        })
        .await
    };
    let mut text = format!(
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
        "path", "req/s", "median", "p90", "p99", "max"
    );
    let mut rates = Vec::new();
    let mut sides: Vec<(&str, &Vec<Record>)> = vec![("router", &via)];
    if let Some(n) = &nginx {
        sides.push(("nginx", n));
    }
    sides.push(("worker", &direct));
    for (name, recs) in &sides {
        let s = Summary::of(recs.iter());
        // Served requests only: quick failures must not pass for throughput.
        let l = s.ok.ok_or_else(|| format!("{name}: no request served"))?;
        let ms = |d: Duration| format!("{:.3}ms", d.as_secs_f64() * 1000.0);
        let rate = s.count(200) as f64 / duration.as_secs_f64();
        rates.push((*name, rate, l.p99));
        let _ = writeln!(
            text,
            "{name:<8} {:>10.0} {:>10} {:>10} {:>10} {:>10}   ({} x 200 of {})",
            rate,
            ms(l.median),
            ms(l.p90),
            ms(l.p99),
            ms(l.max),
            s.count(200),
            s.total
        );
    }
    if let (Some((_, r, rp)), Some((_, n, np))) = (
        rates.iter().find(|(s, _, _)| *s == "router"),
        rates.iter().find(|(s, _, _)| *s == "nginx"),
    ) {
        let _ = writeln!(
            text,
            "router / nginx: {:.2}x the requests per second (target >= 0.9x), p99 {:.2}x (target <= 2x)",
            r / n,
            rp.as_secs_f64() / np.as_secs_f64()
        );
    } else {
        let _ = writeln!(text, "nginx: not on PATH, no reference run");
    }
    if let Some(calls) = calls {
        let _ = writeln!(
            text,
            "ResumeActor calls during the router's run: {calls} for {} requests",
            via.len()
        );
    }
    let mut records = via;
    records.extend(nginx.into_iter().flatten());
    records.extend(direct);
    Ok(Report {
        name: "fast-path".into(),
        text,
        records,
        budget_s: None,
        failed: None,
    })
}

/// Demand eviction: a pool of `workers` full of actors idle at least `evict_after`;
/// `requests` requests, one after another, each to another suspended actor: each parks
/// on the full pool until the control plane evicts the least recently active idle
/// actor for it. Reports the time from each request to its 200, and the evictions.
pub async fn eviction(
    sys: &System,
    workers: usize,
    requests: usize,
    evict_after: Duration,
) -> Result<Report, String> {
    let client = HttpClient::new(DOMAIN);
    let holders: Vec<String> = (1..=workers).map(|i| format!("demo/h{i}")).collect();
    let parked: Vec<String> = (1..=requests).map(|i| format!("demo/e{i}")).collect();
    for a in holders.iter().chain(&parked) {
        sys.fresh(a).await?;
    }
    let t0 = Instant::now();
    for h in &holders {
        let r = one(&client, sys, t0, "holder", h).await;
        if r.status != 200 {
            return Err(format!("holder {h} not served: {} {}", r.status, r.body));
        }
    }
    // Every holder idle at least the threshold (the last one served is the youngest).
    let youngest = holders.last().ok_or("no workers")?;
    let idle_by = Instant::now() + evict_after + Duration::from_secs(30);
    loop {
        if sys
            .idle_for(youngest)
            .await
            .is_some_and(|d| d >= evict_after)
        {
            break;
        }
        if Instant::now() >= idle_by {
            return Err(format!(
                "the control plane never reported {youngest} idle for {} (is it reachable?)",
                secs(evict_after)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let evictions = |sys: &System| {
        sys.control_plane_metrics()
            .map(|m| valet_telemetry::sample_of(&m, "valet_control_evictions_total", &[]))
    };
    let before = evictions(sys);
    let mut records = Vec::new();
    for a in &parked {
        records.push(one(&client, sys, t0, "evicted-for", a).await);
    }
    let after = evictions(sys);
    let s = Summary::of(&records);
    let mut text = format!(
        "{workers} workers full of actors idle >= {}; {requests} requests one after another, each to a suspended actor\n",
        secs(evict_after)
    );
    if let Some(l) = &s.ok {
        let _ = writeln!(
            text,
            "{} of {} returned 200: request to 200 median {}, p90 {}, p99 {}, max {}",
            s.count(200),
            s.total,
            secs(l.median),
            secs(l.p90),
            secs(l.p99),
            secs(l.max)
        );
    } else {
        let _ = writeln!(text, "none of {} returned 200: {s}", s.total);
    }
    if let (Some(b), Some(a)) = (before, after) {
        let _ = writeln!(text, "evictions: {}", a - b);
    }
    Ok(Report {
        name: "eviction".into(),
        text,
        records,
        budget_s: None,
        failed: None,
    })
}

/// One overflow round's outcome: the 200s, the 503s (and when they came), and any
/// other status apart (a transport failure is not a 503).
fn overflow_line(batch: &[Record], s: &Summary, ok: &str) -> String {
    format!(
        "{} of {} returned 200 ({ok}); {}",
        s.count(200),
        s.total,
        refusals(batch)
    )
}

/// How many of `batch` returned 503 and when (over the 503s only), then how many
/// failed otherwise (a reset at 10 ms is no early 503).
fn refusals(batch: &[Record]) -> String {
    let refused = Latencies::of(
        batch
            .iter()
            .filter(|r| r.status == 503)
            .map(Record::latency)
            .collect(),
    );
    let other = batch
        .iter()
        .filter(|r| r.status != 200 && r.status != 503)
        .count();
    format!(
        "{} returned 503{}{}",
        refused.as_ref().map_or(0, |l| l.count),
        refused
            .map(|l| format!(" after {} to {}", secs(l.min), secs(l.max)))
            .unwrap_or_default(),
        if other > 0 {
            format!("; {other} failed otherwise")
        } else {
            String::new()
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: u16, ms: u64) -> Record {
        Record {
            label: "t".into(),
            actor: "demo/a".into(),
            start: Duration::ZERO,
            end: Duration::from_millis(ms),
            status,
            body: String::new(),
        }
    }

    /// The 503s' range covers the 503s only: a connection reset at 10 ms is a
    /// failure of its own, not an early 503.
    #[test]
    fn the_overflow_line_keeps_503s_and_other_failures_apart() {
        let batch = [record(200, 100), record(503, 5100), record(0, 10)];
        let s = Summary::of(batch.iter());
        assert_eq!(
            overflow_line(&batch, &s, "ok"),
            "1 of 3 returned 200 (ok); 1 returned 503 after 5.100s to 5.100s; 1 failed otherwise"
        );
        assert_eq!(
            refusals(&[record(503, 5000), record(0, 10)]),
            "1 returned 503 after 5.000s to 5.000s; 1 failed otherwise"
        );
        assert_eq!(refusals(&[record(200, 10)]), "0 returned 503");
    }
}
