//! The `counter` demo app, served by a worker for the actor it hosts.
//!
//! Every path but `/readyz` and `/whoami` answers
//! `hello from: <atespace>/<name> | preserved memory count: <N> | preserved file counter: <M>`
//! and counts the request twice: in memory (kept only by full snapshots) and in a file
//! in the actor's data directory (always kept).

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;

/// The header the router sets on every routed request.
pub const ACTOR_REF_HEADER: &str = "x-actor-ref";

/// The actor a worker hosts.
#[derive(Debug)]
pub(crate) struct Hosted {
    /// `atespace/name`.
    pub(crate) actor: String,
    pub(crate) snapshot_key: String,
    memory: AtomicU64,
    data_file: PathBuf,
    /// Serializes the file counter's read-increment-write.
    file_lock: Mutex<()>,
}

impl Hosted {
    pub(crate) fn new(
        actor: String,
        snapshot_key: String,
        memory: u64,
        data_file: PathBuf,
    ) -> Self {
        Self {
            actor,
            snapshot_key,
            memory: AtomicU64::new(memory),
            data_file,
            file_lock: Mutex::new(()),
        }
    }

    pub(crate) fn memory(&self) -> u64 {
        self.memory.load(Ordering::SeqCst)
    }

    fn count(&self) -> std::io::Result<(u64, i64)> {
        let memory = self.memory.fetch_add(1, Ordering::SeqCst) + 1;
        let _guard = self.file_lock.lock().unwrap_or_else(|e| e.into_inner());
        let file = read_counter(&self.data_file)?.unwrap_or(0) + 1;
        write_atomically(&self.data_file, file.to_string().as_bytes())?;
        Ok((memory, file))
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

/// Writes a file so a crash leaves either the old or the new content.
pub(crate) fn write_atomically(path: &Path, content: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content)?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// The slot the app reads its hosted actor from.
pub(crate) type Slot = Arc<Mutex<Option<Arc<Hosted>>>>;

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body)))
        .expect("static parts are valid")
}

/// Answers one request for the hosted actor.
pub(crate) async fn handle<B>(
    req: Request<B>,
    slot: Slot,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let hosted = slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let named = req
        .headers()
        .get(ACTOR_REF_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
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
    match path {
        "/readyz" => Ok(text(StatusCode::OK, "ok\n".into())),
        "/whoami" => Ok(text(StatusCode::OK, format!("{}\n", hosted.actor))),
        _ => {
            let counted = {
                let hosted = Arc::clone(&hosted);
                tokio::task::spawn_blocking(move || hosted.count()).await
            };
            match counted {
                Ok(Ok((memory, file))) => Ok(text(
                    StatusCode::OK,
                    format!(
                        "hello from: {} | preserved memory count: {memory} | preserved file counter: {file}\n",
                        hosted.actor
                    ),
                )),
                Ok(Err(e)) => {
                    tracing::warn!(actor = %hosted.actor, error = %e, "counter file update failed");
                    Ok(text(
                        StatusCode::OK,
                        format!(
                            "hello from: {} | preserved memory count: {} | preserved file counter: -1\n",
                            hosted.actor,
                            hosted.memory()
                        ),
                    ))
                }
                Err(_) => Ok(text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error\n".into(),
                )),
            }
        }
    }
}
