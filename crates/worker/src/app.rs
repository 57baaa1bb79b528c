//! The `counter` demo app, served by a worker for the actor it hosts.
//!
//! Every path but `/readyz` and `/whoami` answers
//! `hello from: <atespace>/<name> | preserved memory count: <N> | preserved file counter: <M>`
//! and counts the request twice: in memory (kept only by full snapshots) and in a file
//! in the actor's data directory (always kept).
//!
//! The `echo` app, for data-plane tests, streams each request body back, serves
//! `/bytes/<n>` as `n` streamed bytes, and echoes WebSocket messages.

use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio_util::task::TaskTracker;

use crate::traffic::{InFlight, Traffic};

/// The header the router sets on every routed request.
pub const ACTOR_REF_HEADER: &str = "x-actor-ref";

/// What a hosted actor runs.
#[derive(Debug)]
pub(crate) enum Served {
    /// The seed's demo.
    Counter(Counter),
    /// Streams bodies back, echoes WebSocket messages.
    Echo,
    /// A program of the worker's templates file.
    Program(Arc<crate::runtime::Host>),
}

/// Largest `/bytes/<n>` the echo app serves.
pub(crate) const MAX_ECHO_BYTES: u64 = 4 << 30;

/// The counter app's state: its memory count, and its data file.
#[derive(Debug)]
pub(crate) struct Counter {
    memory: AtomicU64,
    data_file: PathBuf,
    /// Serializes the file counter's read-increment-write.
    file_lock: Mutex<()>,
}

impl Counter {
    pub(crate) fn new(memory: u64, data_file: PathBuf) -> Self {
        Self {
            memory: AtomicU64::new(memory),
            data_file,
            file_lock: Mutex::new(()),
        }
    }

    pub(crate) fn memory(&self) -> u64 {
        self.memory.load(Ordering::SeqCst)
    }

    fn count(&self) -> std::io::Result<(u64, i64)> {
        let _guard = self.file_lock.lock().unwrap_or_else(|e| e.into_inner());
        let file = read_counter(&self.data_file)?.unwrap_or(0) + 1;
        write_atomically(&self.data_file, file.to_string().as_bytes())?;
        // Counted in memory once the file took it: a failed write counts nowhere.
        let memory = self.memory.fetch_add(1, Ordering::SeqCst) + 1;
        Ok((memory, file))
    }
}

/// The actor a worker hosts.
#[derive(Debug)]
pub(crate) struct Hosted {
    /// `atespace/name`.
    pub(crate) actor: String,
    pub(crate) app: Served,
    pub(crate) snapshot_key: String,
    /// Requests in flight, the activity mark, the checkpoint's fence.
    pub(crate) traffic: Arc<Traffic>,
}

impl Hosted {
    pub(crate) fn new(actor: String, app: Served, snapshot_key: String) -> Self {
        Self {
            actor,
            app,
            snapshot_key,
            traffic: Arc::default(),
        }
    }

    /// The actor left this worker: nothing more gets in, what is in flight ends, and
    /// its program, if it runs one, is killed (nothing of it is kept past its last
    /// snapshot).
    pub(crate) fn left(&self) {
        self.traffic.set_gone();
        if let Served::Program(host) = &self.app {
            host.kill();
        }
    }
}

/// Reads a counter file: `None` when absent.
///
/// # Errors
/// When the file cannot be read or does not hold a number (a corrupt snapshot).
pub(crate) fn read_counter(path: &Path) -> std::io::Result<Option<i64>> {
    match std::fs::read_to_string(path) {
        Ok(s) => s.trim().parse().map(Some).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("corrupt counter file {}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes a file so a crash leaves either the old or the new content (the app's own
/// writes: what a checkpoint has not taken may be lost, never torn).
pub(crate) fn write_atomically(path: &Path, content: &[u8]) -> std::io::Result<()> {
    // A name of its own per write: two writers of one file (an app and a restore's
    // revert, two processes over one snapshot dir, both pid 1 in their containers)
    // never rename each other's bytes.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(
        ".{}.{n}.{:016x}.tmp",
        std::process::id(),
        rand::random::<u64>()
    ));
    let tmp = path.with_file_name(name);
    let written = std::fs::write(&tmp, content)
        .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// [`write_atomically`], and once it returns the new content survives a crash (the
/// rename is synced with its directory): for snapshots, which a checkpoint acknowledges.
pub(crate) fn write_durably(path: &Path, content: &[u8]) -> std::io::Result<()> {
    write_atomically(path, content)?;
    sync_dir_of(path)
}

/// Syncs the directory holding `path`, so that a rename, removal or new entry in it is
/// durable.
pub(crate) fn sync_dir_of(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::File::open(dir)?.sync_all(),
        _ => Ok(()),
    }
}

/// Creates `dir` (and its parents) durably: a new directory's entry is synced in its
/// parent.
pub(crate) fn create_dir_durably(dir: &Path) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent()
        && !parent.as_os_str().is_empty()
    {
        create_dir_durably(parent)?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => sync_dir_of(dir),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// The app's upgraded connections (WebSockets), owned by the app's server: it waits
/// for them when it stops, and closes those still open after its drain.
#[derive(Clone, Default)]
pub(crate) struct Tunnels {
    tasks: TaskTracker,
    closed: tokio_util::sync::CancellationToken,
}

impl Tunnels {
    /// Runs `tunnel` until it ends or [`Tunnels::close_now`].
    pub(crate) fn spawn(&self, tunnel: impl std::future::Future<Output = ()> + Send + 'static) {
        let closed = self.closed.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = tunnel => {}
                () = closed.cancelled() => {}
            }
        });
    }

    /// Ends every open tunnel.
    pub(crate) fn close_now(&self) {
        self.closed.cancel();
    }

    /// Waits until every tunnel has ended; no tunnel starts after.
    pub(crate) async fn wait(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// The slot the app reads its hosted actor from; the agent watches it change.
pub(crate) type Slot = Arc<tokio::sync::watch::Sender<Option<Arc<Hosted>>>>;

/// The body of every app response.
pub(crate) type Body = BoxBody<Bytes, BoxError>;

/// A response body's error: the client's body broke, or the actor's stream was cut.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub(crate) fn text(status: StatusCode, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("static parts are valid")
}

/// A response body that keeps its request in flight until it is sent (or dropped).
/// A streamed one (`cut`) is cut short, as an error, once its actor is cut off or
/// gone from this worker: hyper then aborts it rather than ending it as if complete.
struct Guarded {
    inner: Body,
    in_flight: InFlight,
    /// For a streamed response: resolves once its actor is cut off or gone (so an idle
    /// stream, waiting for its client, is cut then, not at its next frame).
    stopped: Option<Pin<Box<dyn Future<Output = ()> + Send + Sync>>>,
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let cut = match self.stopped.as_mut() {
            Some(stopped) => stopped.as_mut().poll(cx).is_ready(),
            None => false,
        };
        if cut {
            return Poll::Ready(Some(
                Err("the actor was cut off or left this worker".into()),
            ));
        }
        // And checked as each frame comes.
        let stopped = |g: &Self| g.stopped.is_some() && g.in_flight.is_stopped();
        if stopped(&self) {
            return Poll::Ready(Some(
                Err("the actor was cut off or left this worker".into()),
            ));
        }
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(Some(Ok(_)))) && stopped(&self) {
            return Poll::Ready(Some(
                Err("the actor was cut off or left this worker".into()),
            ));
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Answers one request for the hosted actor. It counts as in flight from admission
/// until its response is sent (an upgraded connection: until it closes); a fenced actor
/// (being checkpointed) turns every request away with 421.
pub(crate) async fn handle(
    req: Request<Incoming>,
    slot: Slot,
    tunnels: Tunnels,
) -> Result<Response<Body>, Infallible> {
    let hosted = slot.borrow().clone();
    // A name that is not UTF-8 names no actor this worker hosts: 421, not served.
    let named = req
        .headers()
        .get(ACTOR_REF_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    if let Some(named) = &named
        && hosted.as_ref().is_none_or(|h| &h.actor != named)
    {
        let hosting = hosted.as_ref().map_or("no actor", |h| h.actor.as_str());
        return Ok(text(
            StatusCode::MISDIRECTED_REQUEST,
            format!("misdirected request: this worker hosts {hosting}, not {named}\n"),
        ));
    }
    let path = req.uri().path();
    let Some(hosted) = hosted else {
        let status = StatusCode::SERVICE_UNAVAILABLE;
        return Ok(text(status, "no actor hosted\n".into()));
    };
    // A program owns every path of its own.
    if let Served::Program(host) = &hosted.app {
        let Some(in_flight) = hosted.traffic.enter() else {
            return Ok(text(
                StatusCode::MISDIRECTED_REQUEST,
                format!(
                    "misdirected request: actor {} is being checkpointed here\n",
                    hosted.actor
                ),
            ));
        };
        let Some(upstream) = host.upstream() else {
            return Ok(text(
                StatusCode::BAD_GATEWAY,
                format!(
                    "actor {} failed: its program is not running\n",
                    hosted.actor
                ),
            ));
        };
        return Ok(
            crate::forward::forward(req, &hosted.actor, upstream, in_flight, &tunnels).await,
        );
    }
    // The app's own readiness, whatever the fence; every request for the actor
    // (`/whoami` included) goes through the fence.
    if path == "/readyz" {
        return Ok(text(StatusCode::OK, "ok\n".into()));
    }
    let Some(in_flight) = hosted.traffic.enter() else {
        return Ok(text(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "misdirected request: actor {} is being checkpointed here\n",
                hosted.actor
            ),
        ));
    };
    if path == "/whoami" {
        drop(in_flight);
        return Ok(text(StatusCode::OK, format!("{}\n", hosted.actor)));
    }
    let resp = serve(req, &hosted, in_flight, &tunnels).await;
    Ok(resp)
}

async fn serve(
    req: Request<Incoming>,
    hosted: &Arc<Hosted>,
    in_flight: InFlight,
    tunnels: &Tunnels,
) -> Response<Body> {
    match hosted.app {
        Served::Echo => return echo(req, in_flight, tunnels),
        Served::Counter(_) => {}
        Served::Program(_) => unreachable!("forwarded above"),
    }
    // The request stays in flight until its write ends, even if the client leaves
    // first: a checkpoint's fence waits for it.
    let counted = {
        let hosted = Arc::clone(hosted);
        tokio::task::spawn_blocking(move || {
            let Served::Counter(c) = &hosted.app else {
                unreachable!("a counter")
            };
            (c.count().map_err(|e| (e, c.memory())), in_flight)
        })
        .await
    };
    let Ok((counted, in_flight)) = counted else {
        return text(StatusCode::INTERNAL_SERVER_ERROR, "internal error\n".into());
    };
    let (memory, file) = counted.unwrap_or_else(|(e, memory)| {
        tracing::warn!(actor = %hosted.actor, error = %e, "counter file update failed");
        (memory, -1)
    });
    let resp = text(
        StatusCode::OK,
        format!(
            "hello from: {} | preserved memory count: {memory} | preserved file counter: {file}\n",
            hosted.actor
        ),
    );
    guarded(resp, in_flight)
}

/// `resp` with its request in flight until its body is sent (a response made whole
/// before it is sent: never cut).
fn guarded(resp: Response<Body>, in_flight: InFlight) -> Response<Body> {
    resp.map(|inner| {
        BodyExt::boxed(Guarded {
            inner,
            in_flight,
            stopped: None,
        })
    })
}

/// [`guarded`] for a streamed response: cut once its actor is cut off or gone.
pub(crate) fn streamed(resp: Response<Body>, in_flight: InFlight) -> Response<Body> {
    resp.map(|inner| {
        let mut gauge = in_flight.watch();
        BodyExt::boxed(Guarded {
            inner,
            in_flight,
            stopped: Some(Box::pin(async move {
                let _ = gauge.wait_for(crate::traffic::Gauge::stopped).await;
            })),
        })
    })
}

fn echo(req: Request<Incoming>, in_flight: InFlight, tunnels: &Tunnels) -> Response<Body> {
    let is_websocket = req
        .headers()
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if is_websocket {
        return websocket_echo(req, in_flight, tunnels);
    }
    if let Some(n) = req.uri().path().strip_prefix("/bytes/") {
        let Ok(n) = n.parse::<u64>() else {
            return text(StatusCode::BAD_REQUEST, "want /bytes/<n>\n".into());
        };
        if n > MAX_ECHO_BYTES {
            return text(
                StatusCode::BAD_REQUEST,
                format!("at most {MAX_ECHO_BYTES} bytes\n"),
            );
        }
        let resp = Response::builder()
            .header(http::header::CONTENT_TYPE, "application/octet-stream")
            .header(http::header::CONTENT_LENGTH, n)
            .body(pattern_body(n))
            .expect("static parts are valid");
        return streamed(resp, in_flight);
    }
    let mut builder = Response::builder().header("x-echo-method", req.method().as_str());
    if let Some(len) = req.headers().get(http::header::CONTENT_LENGTH) {
        builder = builder.header(http::header::CONTENT_LENGTH, len.clone());
    }
    let resp = builder
        .body(req.into_body().map_err(Into::into).boxed())
        .expect("static parts are valid");
    streamed(resp, in_flight)
}

/// `n` bytes of the repeating pattern `0, 1, ..., 250`, streamed in 64 KiB frames.
pub fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((offset + i) % 251) as u8)
        .collect()
}

fn pattern_body(n: u64) -> Body {
    const CHUNK: u64 = 64 * 1024;
    let frames = (0..n.div_ceil(CHUNK)).map(move |i| {
        let len = CHUNK.min(n - i * CHUNK) as usize;
        Ok::<_, BoxError>(Frame::data(Bytes::from(pattern(i * CHUNK, len))))
    });
    BodyExt::boxed(StreamBody::new(futures_util::stream::iter(frames)))
}

fn websocket_echo(
    req: Request<Incoming>,
    in_flight: InFlight,
    tunnels: &Tunnels,
) -> Response<Body> {
    let Some(key) = req.headers().get("sec-websocket-key").cloned() else {
        return text(
            StatusCode::BAD_REQUEST,
            "missing sec-websocket-key\n".into(),
        );
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    tunnels.spawn(async move {
        // The open connection counts as a request in flight until it closes, or until
        // the actor is cut off or gone from this worker.
        let echo = async {
            let upgraded = match hyper::upgrade::on(req).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::debug!(error = %e, "websocket upgrade failed");
                    return;
                }
            };
            let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
                TokioIo::new(upgraded),
                tokio_tungstenite::tungstenite::protocol::Role::Server,
                None,
            )
            .await;
            while let Some(Ok(msg)) = ws.next().await {
                if (msg.is_text() || msg.is_binary()) && ws.send(msg).await.is_err() {
                    break;
                }
            }
        };
        // Dropping the connection closes it.
        tokio::select! {
            () = echo => {}
            () = in_flight.stopped() => {}
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(http::header::CONNECTION, "upgrade")
        .header(http::header::UPGRADE, "websocket")
        .header("sec-websocket-accept", accept)
        .body(
            Full::new(Bytes::new())
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("static parts are valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two writers of one file never fail each other and never leave it torn. Before,
    /// both wrote `<name>.tmp`: one's rename published the other's bytes and the
    /// other's rename failed (ENOENT), which a request saw as a failed count.
    #[test]
    fn concurrent_writers_of_one_file_do_not_collide() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("counter");
        std::thread::scope(|s| {
            for w in 0..2_i64 {
                let path = &path;
                s.spawn(move || {
                    for i in 0..500_i64 {
                        write_atomically(path, (w * 1_000_000 + i).to_string().as_bytes())
                            .expect("no write fails");
                        read_counter(path).expect("never torn");
                    }
                });
            }
        });
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, [std::ffi::OsString::from("counter")]);
    }
}
