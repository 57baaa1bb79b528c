//! `parked-scale`: many requests parked at once on one router process, and what they
//! cost it: resident memory per parked request, how late each 503 comes after its
//! flight's budget, and the ext_proc server's CPU per request for a running actor.
//!
//! Every connection is opened before any request is sent, so that connection set-up
//! (and the kernel's SYN backlog) does not smear the start of the flights; the memory
//! over idle counts the connections too, as the target does.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpStream;
use tokio::sync::{Barrier, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::record::Record;
use crate::scenario::Report;
use crate::system::{DOMAIN, System};

/// What to park.
#[derive(Debug, Clone)]
pub struct ParkedScaleOpts {
    /// Requests parked at once, each on its own connection.
    pub requests: usize,
    /// Suspended actors they are spread over (one flight each).
    pub actors: usize,
    /// Body of each request (a POST when > 0).
    pub body: usize,
    /// The router's parking budget.
    pub budget: Duration,
    /// ext_proc exchanges for the CPU figure (0: skip it).
    pub extproc_requests: usize,
}

/// The targets of the lighter-lot issue, printed beside the figures.
const TARGET_KIB_PER_PARKED: f64 = 8.0;
const TARGET_LATENESS_MS: f64 = 100.0;
const TARGET_EXTPROC_US: f64 = 50.0;

/// Connections opened at once while setting up (under the listener's backlog).
const CONNECTING_AT_ONCE: usize = 256;

/// Runs the scenario on `sys` (whose router must run in its own process, with a pool
/// of one worker that the scenario fills with a running `holder` actor).
///
/// # Errors
/// When the system cannot be set up or a figure cannot be read.
pub async fn parked_scale(sys: &System, o: &ParkedScaleOpts) -> Result<Report, String> {
    let client = crate::generate::HttpClient::new(DOMAIN);
    sys.fresh("demo/holder").await?;
    let names: Vec<String> = (1..=o.actors.max(1))
        .map(|i| format!("demo/s{i}"))
        .collect();
    for a in &names {
        sys.fresh(a).await?;
    }
    let (status, body) = client.get(sys.router, "demo/holder", "/").await;
    if status != 200 {
        return Err(format!("holder not served: {body}"));
    }
    // The ext_proc figure first, while the router has nothing else to do (after the
    // parking phase it would also count the teardown of the parked connections).
    let mut extproc_text = String::new();
    if o.extproc_requests > 0 {
        extproc_cost(&mut extproc_text, sys, o.extproc_requests).await?;
    }
    let idle_kib = sys.router_rss_kib();

    progress!("parked-scale: opening {} connections", o.requests);
    let streams = connect_all(sys, o.requests).await?;
    let connected_kib = sys.router_rss_kib();

    progress!("parked-scale: sending {} requests", o.requests);
    let t0 = Instant::now();
    let barrier = Arc::new(Barrier::new(o.requests + 1));
    let payload = Bytes::from(vec![b'x'; o.body]);
    let mut tasks = JoinSet::new();
    for (i, mut stream) in streams.into_iter().enumerate() {
        let actor = names[i % names.len()].clone();
        let (barrier, payload, budget) = (Arc::clone(&barrier), payload.clone(), o.budget);
        tasks.spawn(async move {
            let (atespace, name) = actor.split_once('/').unwrap_or(("demo", &actor));
            let method = if payload.is_empty() { "GET" } else { "POST" };
            let head = format!(
                "{method} / HTTP/1.1\r\nhost: {name}.{atespace}.{DOMAIN}\r\ncontent-length: {}\r\n\r\n",
                payload.len()
            );
            barrier.wait().await;
            let start = t0.elapsed();
            // Bounded: a verdict that never comes is a result, not a hang.
            let (status, body) = tokio::time::timeout(
                budget + VERDICT_MARGIN,
                exchange(&mut stream, head.as_bytes(), &payload),
            )
            .await
            .unwrap_or_else(|_| Err("no answer within the budget and a margin".into()))
            .unwrap_or_else(|e| (0, e));
            let record = Record {
                label: "parked".into(),
                actor,
                start,
                end: t0.elapsed(),
                status,
                body: Record::prefix(&body),
            };
            // The connection stays open until every verdict is in: clients closing
            // theirs would load the router with teardowns while it writes verdicts.
            (record, stream)
        });
    }
    barrier.wait().await;

    // Every request parked (the lot holds all of them): the resident memory now.
    let all_parked = async {
        loop {
            if let Some(n) = sys.router_metric("atenet_router_parking_active").await
                && n as usize >= o.requests
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let parked_kib = match tokio::time::timeout(o.budget, all_parked).await {
        Ok(()) => sys.router_rss_kib(),
        Err(_) => None,
    };
    let (mut records, streams): (Vec<Record>, Vec<TcpStream>) =
        tasks.join_all().await.into_iter().unzip();
    drop(streams);
    records.sort_by_key(|r| r.start);
    let s = crate::stats::Summary::of(&records);

    let mut text = format!(
        "{} requests over {} actors, {}\n{s}\n",
        o.requests,
        names.len(),
        if o.body == 0 {
            "GET".to_owned()
        } else {
            format!("POST with a {}-byte body", o.body)
        }
    );
    memory(&mut text, o.requests, idle_kib, connected_kib, parked_kib);
    if let Some(kib) = sys.router_peak_rss_kib() {
        let _ = writeln!(
            text,
            "router process peak memory (VmHWM): {:.1} MiB",
            kib as f64 / 1024.0
        );
    }
    lateness(&mut text, &records, o.budget);
    text.push_str(&extproc_text);
    sys.suspend("demo/holder").await?;
    Ok(Report {
        name: "parked-scale".into(),
        text,
        records,
        budget_s: Some(o.budget.as_secs_f64()),
        failed: None,
    })
}

/// `n` TCP connections to the router, open and idle.
async fn connect_all(sys: &System, n: usize) -> Result<Vec<TcpStream>, String> {
    let gate = Arc::new(Semaphore::new(CONNECTING_AT_ONCE));
    let mut set = JoinSet::new();
    for _ in 0..n {
        let (gate, addr) = (Arc::clone(&gate), sys.router);
        set.spawn(async move {
            let _permit = gate.acquire_owned().await.map_err(|e| e.to_string())?;
            let stream = TcpStream::connect(addr)
                .await
                .map_err(|e| format!("connect {addr}: {e}"))?;
            let _ = stream.set_nodelay(true);
            Ok::<_, String>(stream)
        });
    }
    let mut out = Vec::with_capacity(n);
    let mut next_report = n / 4;
    while let Some(r) = set.join_next().await {
        out.push(r.map_err(|e| e.to_string())??);
        if out.len() == next_report && out.len() < n {
            progress!("parked-scale: {}/{n} connected", out.len());
            next_report += n / 4;
        }
    }
    Ok(out)
}

/// How long after the budget a parked request's answer may come before it counts as
/// none.
const VERDICT_MARGIN: Duration = Duration::from_secs(30);

/// Largest response head the scenario reads.
const MAX_RESPONSE_HEAD: usize = 16 * 1024;

/// One HTTP/1.1 request (`head`, then `body`) on `stream`, and the response's status
/// and body. A plain exchange on the connection, no client machinery (a connection
/// task, a dispatcher) of its own: the load generator shares the two cores with the
/// router, and its cost per verdict would otherwise delay the verdicts it measures.
/// Reads a `content-length` body.
async fn exchange(
    stream: &mut TcpStream,
    head: &[u8],
    body: &[u8],
) -> Result<(u16, String), String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    stream
        .write_all(head)
        .await
        .map_err(|e| format!("request: {e}"))?;
    if !body.is_empty() {
        stream
            .write_all(body)
            .await
            .map_err(|e| format!("request body: {e}"))?;
    }
    let mut buf = Vec::with_capacity(512);
    let (status, head_len, length, chunked) = loop {
        if stream
            .read_buf(&mut buf)
            .await
            .map_err(|e| format!("response: {e}"))?
            == 0
        {
            return Err("response: connection closed".into());
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                let header = |name: &str| {
                    resp.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| String::from_utf8_lossy(h.value).into_owned())
                };
                let length = header("content-length").and_then(|v| v.trim().parse::<usize>().ok());
                let chunked = header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
                break (resp.code.unwrap_or(0), n, length, chunked);
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_RESPONSE_HEAD => {}
            Ok(httparse::Status::Partial) => return Err("response: head too large".into()),
            Err(e) => return Err(format!("response: {e}")),
        }
    };
    // The router's verdicts carry a content-length; a chunked body (a worker's, if one
    // freed) is not decoded here.
    if chunked {
        return Ok((status, "(chunked body, not read)".into()));
    }
    let done = |buf: &[u8]| length.is_none_or(|n| buf.len() >= head_len + n);
    while !done(&buf) {
        if stream
            .read_buf(&mut buf)
            .await
            .map_err(|e| format!("body: {e}"))?
            == 0
        {
            return Err("body: connection closed".into());
        }
    }
    Ok((
        status,
        String::from_utf8_lossy(&buf[head_len..]).into_owned(),
    ))
}

fn memory(
    text: &mut String,
    requests: usize,
    idle: Option<u64>,
    connected: Option<u64>,
    parked: Option<u64>,
) {
    let (Some(idle), Some(connected), Some(parked)) = (idle, connected, parked) else {
        let _ = writeln!(
            text,
            "router memory: n/a (router in this process, or not every request parked)"
        );
        return;
    };
    let per = |kib: u64| kib.saturating_sub(idle) as f64 / requests as f64;
    let _ = writeln!(
        text,
        "router resident memory (VmRSS): idle {:.1} MiB, {requests} connections open {:.1} MiB, all parked {:.1} MiB",
        idle as f64 / 1024.0,
        connected as f64 / 1024.0,
        parked as f64 / 1024.0
    );
    let each = per(parked);
    let _ = writeln!(
        text,
        "memory per parked request over idle: {each:.2} KiB (of which the open connection {:.2} KiB); target <= {TARGET_KIB_PER_PARKED} KiB: {}",
        per(connected),
        verdict(each <= TARGET_KIB_PER_PARKED)
    );
}

/// How late each 503 came after its flight's budget ended. A flight starts when its
/// first request arrives, which is after that request was sent: the earliest send to
/// an actor stands for its flight's start, so the figure errs on the late side.
fn lateness(text: &mut String, records: &[Record], budget: Duration) {
    let mut first: HashMap<&str, Duration> = HashMap::new();
    for r in records {
        first
            .entry(r.actor.as_str())
            .and_modify(|t| *t = (*t).min(r.start))
            .or_insert(r.start);
    }
    let mut late: Vec<f64> = records
        .iter()
        // The budget's verdicts only (not `router at capacity`, answered at once).
        .filter(|r| r.status == 503 && !r.body.contains("router at capacity"))
        .map(|r| (r.end.as_secs_f64() - (first[r.actor.as_str()] + budget).as_secs_f64()) * 1e3)
        .collect();
    if late.is_empty() {
        let _ = writeln!(text, "no 503 verdicts");
        return;
    }
    late.sort_by(f64::total_cmp);
    let at = |q: f64| late[((late.len() - 1) as f64 * q).round() as usize];
    let _ = writeln!(
        text,
        "503 verdicts after their flight's budget: {:+.1} ms min, {:+.1} ms median, {:+.1} ms p99, {:+.1} ms max; target p99 <= +{TARGET_LATENESS_MS} ms: {}",
        at(0.0),
        at(0.5),
        at(0.99),
        at(1.0),
        verdict(at(0.99) <= TARGET_LATENESS_MS)
    );
}

/// The router's CPU per ext_proc header exchange for the running, leased `holder`
/// (so no control-plane call): 32 clients, one stream per request, as Envoy opens.
async fn extproc_cost(text: &mut String, sys: &System, n: usize) -> Result<(), String> {
    let Some(addr) = sys.router_extproc else {
        let _ = writeln!(text, "ext_proc cost: n/a (no ext_proc listener)");
        return Ok(());
    };
    let client = crate::extproc::client(addr);
    let host = format!("holder.demo.{DOMAIN}");
    match crate::extproc::decide(&client, &host).await {
        Ok(crate::extproc::Answer::Routed(_)) => {}
        other => return Err(format!("ext_proc warm-up for holder: {other:?}")),
    }
    progress!("parked-scale: {n} ext_proc exchanges");
    let cpu0 = sys.router_cpu();
    let calls0 = sys.resume_calls();
    let started = Instant::now();
    let failed = match extproc_clients(addr, host, n).await {
        Ok(failed) => failed,
        Err(e) => {
            let _ = writeln!(text, "ext_proc cost: n/a ({e})");
            return Ok(());
        }
    };
    let elapsed = started.elapsed();
    let (Some(cpu0), Some(cpu1)) = (cpu0, sys.router_cpu()) else {
        let _ = writeln!(text, "ext_proc cost: n/a (router in this process)");
        return Ok(());
    };
    let per = (cpu1 - cpu0).as_secs_f64() * 1e6 / n as f64;
    let calls = match (calls0, sys.resume_calls()) {
        (Some(a), Some(b)) => format!("{}", b - a),
        _ => "n/a".into(),
    };
    let _ = writeln!(
        text,
        "ext_proc, running leased actor: {n} exchanges ({failed} not routed) in {:.2}s, {:.0}/s; ResumeActor calls meanwhile: {calls}",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64()
    );
    let _ = writeln!(
        text,
        "router CPU per ext_proc exchange: {per:.1} us; target <= {TARGET_EXTPROC_US} us: {}",
        verdict(per <= TARGET_EXTPROC_US)
    );
    Ok(())
}

/// Concurrent ext_proc clients, each opening one stream per request.
const EXTPROC_CLIENTS: usize = 32;

/// No exchange waits longer than this for its answer.
const EXTPROC_ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Runs `n` exchanges for `host` from [`EXTPROC_CLIENTS`] clients over one HTTP/2
/// connection, on a thread of their own with a single-threaded runtime: as one Envoy
/// worker thread does (an event loop with its own connection to the ext_proc cluster).
/// A multi-threaded client on the router's two cores wakes its threads for every
/// answer and charges the router with the context switches; see docs/BENCHMARKS.md.
/// Returns how many were not routed.
///
/// # Errors
/// An exchange the router did not answer within [`EXTPROC_ANSWER_WAIT`]: the run
/// stops there, and fewer than `n` exchanges ran, so no figure per exchange is given.
async fn extproc_clients(
    addr: std::net::SocketAddr,
    host: String,
    n: usize,
) -> Result<usize, String> {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("extproc-clients".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = done_tx.send(Err(format!("ext_proc clients' runtime: {e}")));
                    return;
                }
            };
            let timed_out = std::rc::Rc::new(std::cell::Cell::new(false));
            let failed = runtime.block_on(async {
                let client = crate::extproc::client(addr);
                let next = std::rc::Rc::new(std::cell::Cell::new(0usize));
                let clients = (0..EXTPROC_CLIENTS).map(|_| {
                    let (client, host, next) = (&client, &host, std::rc::Rc::clone(&next));
                    let timed_out = std::rc::Rc::clone(&timed_out);
                    async move {
                        let mut failed = 0usize;
                        while next.replace(next.get() + 1) < n {
                            let answer = tokio::time::timeout(
                                EXTPROC_ANSWER_WAIT,
                                crate::extproc::decide(client, host),
                            )
                            .await;
                            match answer {
                                Ok(Ok(crate::extproc::Answer::Routed(_))) => {}
                                Ok(_) => failed += 1,
                                // A router that does not answer in time: the run ends
                                // here, with no figure.
                                Err(_) => {
                                    failed += 1;
                                    timed_out.set(true);
                                    next.set(n);
                                }
                            }
                        }
                        failed
                    }
                });
                futures_util::future::join_all(clients)
                    .await
                    .into_iter()
                    .sum::<usize>()
            });
            let result = if timed_out.get() {
                Err(format!(
                    "an ext_proc exchange got no answer within {EXTPROC_ANSWER_WAIT:?}: the run stopped, no figure per exchange"
                ))
            } else {
                Ok(failed)
            };
            let _ = done_tx.send(result);
        })
        .map_err(|e| format!("ext_proc clients' thread: {e}"))?;
    let result = done_rx
        .await
        .unwrap_or_else(|_| Err("ext_proc clients' thread panicked".into()));
    // It has sent its result: the join returns at once (off the runtime's threads).
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    result
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A router that never answers an exchange gives no figure per exchange (before,
    /// the run stopped early and its CPU was divided by every exchange asked for).
    #[tokio::test]
    async fn a_silent_ext_proc_server_gives_no_figure() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let holder = tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let (conn, _) = listener.accept().await.unwrap();
                held.push(conn);
            }
        });
        let e = extproc_clients(addr, "holder.demo.x".into(), 1000)
            .await
            .unwrap_err();
        assert!(e.contains("no figure"), "{e}");
        holder.abort();
    }
}
