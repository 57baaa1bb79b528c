//! The load generator. Open loop: requests leave on schedule whatever the answers, so
//! queueing delay is never hidden. Closed loop: a fixed number of clients, each sending
//! its next request when the last is answered.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::record::Record;

/// Runs longer than this print a progress line every second.
pub const PROGRESS_AFTER: Duration = Duration::from_secs(3);

/// How long a request may wait for its whole answer: far past any parking budget, so
/// that a stalled router ends a run (the request counts as failed) instead of hanging it.
pub const NO_ANSWER_AFTER: Duration = Duration::from_secs(300);

/// An HTTP/1.1 client that addresses actors by `Host`.
#[derive(Debug, Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    domain: String,
}

impl HttpClient {
    /// A client for actors under `domain`.
    pub fn new(domain: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // Idle connections go before a worker closes them itself (the fast-path
        // scenario sends straight to a worker).
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .pool_idle_timeout(valet_proto::WORKER_POOL_IDLE)
            .build(connector);
        Self {
            client,
            domain: domain.to_owned(),
        }
    }

    /// GET `path` from `actor` (`atespace/name`) through the router at `addr`; status 0
    /// and the error text when no answer came.
    pub async fn get(&self, addr: SocketAddr, actor: &str, path: &str) -> (u16, String) {
        let host = match actor.split_once('/') {
            Some((atespace, name)) => format!("{name}.{atespace}.{}", self.domain),
            None => actor.to_owned(),
        };
        self.get_host(addr, &host, path).await
    }

    /// GET with an explicit `Host`.
    pub async fn get_host(&self, addr: SocketAddr, host: &str, path: &str) -> (u16, String) {
        self.send(addr, http::Method::GET, host, path, Bytes::new())
            .await
    }

    /// POST `body` to `actor` (`atespace/name`) through the router at `addr`.
    pub async fn post(
        &self,
        addr: SocketAddr,
        actor: &str,
        path: &str,
        body: Bytes,
    ) -> (u16, String) {
        let host = match actor.split_once('/') {
            Some((atespace, name)) => format!("{name}.{atespace}.{}", self.domain),
            None => actor.to_owned(),
        };
        self.send(addr, http::Method::POST, &host, path, body).await
    }

    async fn send(
        &self,
        addr: SocketAddr,
        method: http::Method,
        host: &str,
        path: &str,
        body: Bytes,
    ) -> (u16, String) {
        let req = match http::Request::builder()
            .method(method)
            .uri(format!("http://{addr}{path}"))
            .header(http::header::HOST, host)
            .body(Full::new(body))
        {
            Ok(r) => r,
            Err(e) => return (0, e.to_string()),
        };
        let answer = async {
            match self.client.request(req).await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    match resp.into_body().collect().await {
                        Ok(b) => (status, String::from_utf8_lossy(&b.to_bytes()).into_owned()),
                        Err(e) => (0, format!("body: {e}")),
                    }
                }
                Err(e) => (0, format!("request: {e}")),
            }
        };
        tokio::time::timeout(NO_ANSWER_AFTER, answer)
            .await
            .unwrap_or_else(|_| (0, format!("no answer within {NO_ANSWER_AFTER:?}")))
    }
}

/// The send times of an open-loop run: `rate` per second for `duration`.
pub fn schedule(rate: f64, duration: Duration) -> Vec<Duration> {
    if rate <= 0.0 {
        return Vec::new();
    }
    if duration.is_zero() {
        return Vec::new();
    }
    // Every i with i / rate < duration (the send at 0 always); the tolerance keeps a
    // product such as 0.1 x 30 (3.0000000000000004) from scheduling a send at the
    // very end.
    let n = (rate * duration.as_secs_f64() - 1e-9).ceil().max(1.0) as usize;
    (0..n)
        .map(|i| Duration::from_secs_f64(i as f64 / rate))
        .collect()
}

/// Sends one request per entry of `at` (offsets from now), to `actors` in turn, each at
/// its time whether or not earlier ones were answered.
pub async fn open_loop<F, Fut>(
    label: &str,
    at: &[Duration],
    actors: &[String],
    send: F,
) -> Vec<Record>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = (u16, String)> + Send + 'static,
{
    open_loop_until(label, at, actors, send, &CancellationToken::new()).await
}

/// [`open_loop`], ending early once `stop` is cancelled: nothing more is sent, and
/// the requests in flight then are given up (not recorded).
pub async fn open_loop_until<F, Fut>(
    label: &str,
    at: &[Duration],
    actors: &[String],
    send: F,
    stop: &CancellationToken,
) -> Vec<Record>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = (u16, String)> + Send + 'static,
{
    let start = Instant::now();
    let total = at.last().copied().unwrap_or_default();
    let progress = Progress::spawn(label, total, start);
    let mut tasks = JoinSet::new();
    for (i, offset) in at.iter().enumerate() {
        tokio::select! {
            () = tokio::time::sleep_until(start + *offset) => {}
            () = stop.cancelled() => break,
        }
        let actor = actors[i % actors.len()].clone();
        let fut = send(actor.clone());
        let label = label.to_owned();
        let counters = Arc::clone(&progress.counters);
        counters.0.fetch_add(1, Ordering::Relaxed);
        // Latency counts from the scheduled time, not from when the request left: a
        // generator (or a runtime) that falls behind must not hide the delay.
        let scheduled = *offset;
        let stop = stop.clone();
        tasks.spawn(async move {
            let (status, body) = tokio::select! {
                answered = fut => answered,
                () = stop.cancelled() => return None,
            };
            counters.1.fetch_add(1, Ordering::Relaxed);
            Some(Record {
                label,
                actor,
                start: scheduled,
                end: start.elapsed(),
                status,
                body: Record::prefix(&body),
            })
        });
    }
    let mut records: Vec<Record> = tasks.join_all().await.into_iter().flatten().collect();
    progress.stop();
    records.sort_by_key(|r| r.start);
    records
}

/// `concurrency` clients, each sending to `actors` in turn until `duration` has passed.
pub async fn closed_loop<F, Fut>(
    label: &str,
    concurrency: usize,
    duration: Duration,
    actors: &[String],
    send: F,
) -> Vec<Record>
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = (u16, String)> + Send + 'static,
{
    closed_loop_until(
        label,
        concurrency,
        duration,
        actors,
        send,
        &CancellationToken::new(),
    )
    .await
}

/// [`closed_loop`], ending early once `stop` is cancelled: the requests in flight
/// then are given up (not recorded).
pub async fn closed_loop_until<F, Fut>(
    label: &str,
    concurrency: usize,
    duration: Duration,
    actors: &[String],
    send: F,
    stop: &CancellationToken,
) -> Vec<Record>
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = (u16, String)> + Send + 'static,
{
    let start = Instant::now();
    let progress = Progress::spawn(label, duration, start);
    let mut tasks = JoinSet::new();
    for c in 0..concurrency {
        let send = send.clone();
        let actors = actors.to_vec();
        let label = label.to_owned();
        let counters = Arc::clone(&progress.counters);
        let stop = stop.clone();
        tasks.spawn(async move {
            let mut out = Vec::new();
            let mut i = c;
            while start.elapsed() < duration {
                let actor = actors[i % actors.len()].clone();
                i += concurrency;
                counters.0.fetch_add(1, Ordering::Relaxed);
                let sent = start.elapsed();
                let (status, body) = tokio::select! {
                    answered = send(actor.clone()) => answered,
                    () = stop.cancelled() => break,
                };
                counters.1.fetch_add(1, Ordering::Relaxed);
                out.push(Record {
                    label: label.clone(),
                    actor,
                    start: sent,
                    end: start.elapsed(),
                    status,
                    body: Record::prefix(&body),
                });
            }
            out
        });
    }
    let mut records: Vec<Record> = tasks.join_all().await.into_iter().flatten().collect();
    progress.stop();
    records.sort_by_key(|r| r.start);
    records
}

/// A progress line on stderr every second, for runs longer than [`PROGRESS_AFTER`].
struct Progress {
    counters: Arc<(AtomicUsize, AtomicUsize)>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    fn spawn(label: &str, total: Duration, start: Instant) -> Self {
        let counters = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let task = (total > PROGRESS_AFTER).then(|| {
            let counters = Arc::clone(&counters);
            let label = label.to_owned();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval_at(
                    start + Duration::from_secs(1),
                    Duration::from_secs(1),
                );
                loop {
                    tick.tick().await;
                    // Answered first: a request counted in between is in flight.
                    let done = counters.1.load(Ordering::Relaxed);
                    let sent = counters.0.load(Ordering::Relaxed);
                    progress!(
                        "{label}: {:>4.0}s/{:.0}s  sent {sent}  answered {done}  in flight {}",
                        start.elapsed().as_secs_f64(),
                        total.as_secs_f64(),
                        sent.saturating_sub(done)
                    );
                }
            })
        });
        Self { counters, task }
    }

    fn stop(self) {
        drop(self);
    }
}

/// A run dropped before its end (interrupted, or timed out by its caller) stops
/// printing too.
impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run dropped before its end leaves no progress task printing behind it.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_run_stops_its_progress_lines() {
        let schedule = schedule(1.0, Duration::from_secs(10));
        let actors = ["demo/a".to_owned()];
        let run = open_loop("t", &schedule, &actors, |_| {
            std::future::pending::<(u16, String)>()
        });
        assert!(
            tokio::time::timeout(Duration::from_secs(2), run)
                .await
                .is_err()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks(),
            0,
            "nothing left running"
        );
    }

    #[test]
    fn schedule_is_evenly_spaced() {
        let s = schedule(4.0, Duration::from_secs(2));
        assert_eq!(s.len(), 8);
        assert_eq!(s[0], Duration::ZERO);
        assert_eq!(s[1], Duration::from_millis(250));
        assert_eq!(s[7], Duration::from_millis(1750));
        assert!(schedule(0.0, Duration::from_secs(1)).is_empty());
        // 0, 1/3, 2/3, 1 and 4/3 s all fall within 1.5 s.
        assert_eq!(schedule(3.0, Duration::from_millis(1500)).len(), 5);
        assert_eq!(schedule(0.1, Duration::from_secs(30)).len(), 3);
        assert_eq!(schedule(0.5, Duration::from_secs(1)).len(), 1);
        assert_eq!(
            schedule(1e-12, Duration::from_millis(1)).len(),
            1,
            "the send at 0"
        );
    }

    /// A server that takes 10 s per answer does not slow the open loop down: every
    /// request leaves at its scheduled time.
    #[tokio::test(start_paused = true)]
    async fn open_loop_is_open() {
        let at = schedule(10.0, Duration::from_secs(2));
        let actors = vec!["demo/a".to_owned(), "demo/b".to_owned()];
        let records = open_loop("t", &at, &actors, |_| async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            (200, "ok".to_owned())
        })
        .await;
        assert_eq!(records.len(), 20);
        for (r, want) in records.iter().zip(&at) {
            assert_eq!(r.start, *want, "left on schedule");
            assert_eq!(r.latency(), Duration::from_secs(10));
        }
        assert_eq!(records[0].actor, "demo/a");
        assert_eq!(records[1].actor, "demo/b");
    }

    /// A request that leaves late (here the one-thread runtime is blocked by the
    /// answer before it) is measured from its scheduled time: the delay is in its
    /// latency, never hidden (coordinated omission).
    #[tokio::test(flavor = "current_thread")]
    async fn open_loop_latency_counts_from_the_schedule() {
        let at = [Duration::ZERO, Duration::from_millis(10)];
        let actors = vec!["demo/a".to_owned(), "demo/b".to_owned()];
        let records = open_loop("t", &at, &actors, |actor| async move {
            if actor == "demo/a" {
                std::thread::sleep(Duration::from_millis(100));
            }
            (200, "ok".to_owned())
        })
        .await;
        assert_eq!(records[1].actor, "demo/b");
        assert_eq!(records[1].start, at[1], "measured from its schedule");
        assert!(
            records[1].latency() >= Duration::from_millis(90),
            "the 100 ms the runtime was blocked are in its latency: {:?}",
            records[1].latency()
        );
    }

    /// The closed loop sends the next request only after the last answer.
    #[tokio::test(start_paused = true)]
    async fn closed_loop_waits_for_answers() {
        let actors = vec!["demo/a".to_owned()];
        let records = closed_loop("t", 2, Duration::from_secs(1), &actors, |_| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            (503, "busy".to_owned())
        })
        .await;
        // Two clients, each 4 requests (0, 0.3, 0.6, 0.9 s).
        assert_eq!(records.len(), 8);
        assert!(
            records
                .iter()
                .all(|r| r.latency() == Duration::from_millis(300))
        );
        assert_eq!(records.last().unwrap().start, Duration::from_millis(900));
    }
}
