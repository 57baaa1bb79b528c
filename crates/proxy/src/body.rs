//! Request bodies on their way to the worker.
//!
//! A request that parks has its body read into memory while it waits ([`Held::fill`]),
//! so a client that leaves is noticed whether or not it sent a body: up to
//! `--parked-request-max-body` per request, charged to the lot's `--parked-bytes-max`
//! (a declared length reserves at the park transition, the rest is charged as it
//! arrives, and reading pauses while the lot's bytes are spent). Past either bound the
//! router reads no more (back-pressure). Once routed, [`Held::into_body`] forwards the
//! held frames first, giving their bytes back to the lot, then streams the rest. A body
//! that never parked is streamed untouched.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use valet_router::CallerEnd;
use valet_router::lot::Charge;

/// What the forwarding path learns of the client's body once it has handed it on;
/// shared with the [`RequestBody`].
pub(crate) type Failure = Arc<BodyEnds>;

/// Why the client's body failed, once it has (so a failed forward can tell the
/// client's fault, 400, from the worker's, 502); and what was left of it, unread, when
/// the request to the worker ended before it (so the data plane's own answer can read
/// and throw it away first, rather than be lost to a reset).
#[derive(Debug, Default)]
pub(crate) struct BodyEnds {
    failed: Mutex<Option<CallerEnd>>,
    /// The rest, and whether any of it was asked for (past `Expect: 100-continue`).
    left: Mutex<Option<(Incoming, bool)>>,
}

impl BodyEnds {
    /// Why the client's body failed, if it did (taken).
    pub(crate) fn take_failure(&self) -> Option<CallerEnd> {
        self.failed.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn failed(&self, end: CallerEnd) {
        *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(end);
    }

    /// Reads what was left of the body and throws it away, as [`discard`]: whether
    /// nothing is left unread. A rest never asked for, that the client holds back for
    /// `100 Continue` (`held_back`), is not asked for now: false.
    pub(crate) async fn discard_left(
        &self,
        within: std::time::Duration,
        max: u64,
        held_back: bool,
    ) -> bool {
        let left = self.left.lock().unwrap_or_else(|e| e.into_inner()).take();
        match left {
            None => true,
            Some((_, false)) if held_back => false,
            Some((mut rest, _)) => discard(&mut rest, within, max).await,
        }
    }
}

/// A request's body, read into memory while the request is parked.
pub(crate) struct Held {
    rest: Option<Incoming>,
    frames: VecDeque<Frame<Bytes>>,
    /// Data bytes in `frames`.
    held: u64,
    /// Of those, how many are charged to the lot.
    charged: u64,
    limit: u64,
    declared: Option<u64>,
    charge: Charge,
    started: bool,
    failure: Failure,
}

impl Held {
    /// `body`, with nothing read yet; `declared` is its Content-Length, if any.
    pub(crate) fn new(body: Incoming, declared: Option<u64>, limit: u64, charge: Charge) -> Self {
        Self {
            rest: Some(body),
            frames: VecDeque::new(),
            held: 0,
            charged: 0,
            limit,
            declared,
            charge,
            started: false,
            failure: Failure::default(),
        }
    }

    /// Reads the body into memory, within its bounds, for as long as the request is
    /// parked. Resolves only when the client's side ends the wait: it left (the body
    /// broke off) or sent a malformed body. Cancel-safe: every frame read is kept.
    pub(crate) async fn fill(&mut self) -> CallerEnd {
        if !self.started {
            self.started = true;
            if let Some(len) = self.declared {
                self.charge.reserve_now(len.min(self.limit));
            }
        }
        loop {
            if self.charged < self.held {
                self.charge.charge(self.held - self.charged).await;
                self.charged = self.held;
            }
            if self.held >= self.limit {
                return std::future::pending().await;
            }
            let Some(rest) = self.rest.as_mut() else {
                return std::future::pending().await;
            };
            match rest.frame().await {
                None => self.rest = None,
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        self.held += data.len() as u64;
                    }
                    self.frames.push_back(frame);
                }
                Some(Err(e)) => {
                    self.rest = None;
                    let end = caller_end(&e);
                    self.failure.failed(end.clone());
                    return end;
                }
            }
        }
    }

    /// Whether its body was being read while the request was parked (so the client is
    /// past any `Expect: 100-continue`, and may be blocked sending the rest).
    pub(crate) fn was_read(&self) -> bool {
        self.started
    }

    /// The request was answered without being forwarded (a verdict): the held frames
    /// go back to the lot, and the rest of the body is read and thrown away, up to
    /// `max` bytes within `within`, so that the answer is not lost to a reset (a
    /// socket closed with unread data resets; a client still sending never reads the
    /// answer). Whether the body was read to its end.
    pub(crate) async fn discard_rest(&mut self, within: std::time::Duration, max: u64) -> bool {
        self.frames.clear();
        self.held = 0;
        self.charged = 0;
        self.charge.release(u64::MAX);
        let Some(rest) = self.rest.as_mut() else {
            return true;
        };
        let ended = discard(rest, within, max).await;
        if ended {
            self.rest = None;
        }
        ended
    }

    /// The body to forward: the held frames, then the rest; and where a failure of the
    /// client's side of it is recorded.
    /// The rest fails once the client sends nothing of it for `stall_after`.
    pub(crate) fn into_body(self, stall_after: Duration) -> (RequestBody, Failure) {
        let failure = Arc::clone(&self.failure);
        let body = RequestBody {
            frames: self.frames,
            rest: self.rest,
            charge: Some(self.charge),
            failure: self.failure,
            polled: self.started,
            stall: Some(Stall {
                after: stall_after,
                timer: Box::pin(tokio::time::sleep(stall_after)),
            }),
        };
        (body, failure)
    }
}

/// Reads `body` and throws it away, up to `max` bytes within `within`: whether it was
/// read to its end.
pub(crate) async fn discard(body: &mut Incoming, within: std::time::Duration, max: u64) -> bool {
    if body.is_end_stream() {
        return true;
    }
    let mut read = 0u64;
    tokio::time::timeout(within, async {
        while read <= max {
            match body.frame().await {
                None => return true,
                Some(Ok(frame)) => {
                    read += frame.data_ref().map_or(0, |d| d.len() as u64);
                }
                Some(Err(_)) => return false,
            }
        }
        false
    })
    .await
    .unwrap_or(false)
}

/// What a broken-off body means: the client's framing is malformed (hyper's decoder
/// reports invalid input), or the client went away.
fn caller_end(e: &hyper::Error) -> CallerEnd {
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput => {
                    CallerEnd::MalformedBody(io.to_string())
                }
                _ => CallerEnd::Gone,
            };
        }
        source = err.source();
    }
    if e.is_parse() {
        CallerEnd::MalformedBody(e.to_string())
    } else {
        CallerEnd::Gone
    }
}

/// A forwarded request's body: held frames first (each gives its bytes back to the lot
/// as it is handed on), then the rest of the client's body, streamed.
pub(crate) struct RequestBody {
    frames: VecDeque<Frame<Bytes>>,
    rest: Option<Incoming>,
    charge: Option<Charge>,
    failure: Failure,
    /// Whether the rest was ever asked for.
    polled: bool,
    /// How long the client may send nothing of the rest while it is asked for; each
    /// frame starts it over. A body streamed to the worker is bounded by nothing
    /// else: without it, a client that sends a large body's head and then nothing
    /// held a worker connection (and the actor busy) for good.
    stall: Option<Stall>,
}

struct Stall {
    after: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

/// The error of a body whose client stopped sending it.
#[derive(Debug, thiserror::Error)]
#[error("the client sent nothing of the request body for {0:?}")]
pub(crate) struct BodyStalled(Duration);

impl Drop for RequestBody {
    /// Dropped before its end (the request to the worker failed, or the worker answered
    /// without reading it all): what is left goes back to the forwarding path.
    fn drop(&mut self) {
        if let Some(rest) = self.rest.take()
            && !rest.is_end_stream()
        {
            *self.failure.left.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((rest, self.polled));
        }
    }
}

impl RequestBody {
    /// A body of `bytes`, all held (a replayed request's).
    pub(crate) fn whole(bytes: Bytes) -> Self {
        let frames = if bytes.is_empty() {
            VecDeque::new()
        } else {
            VecDeque::from([Frame::data(bytes)])
        };
        Self {
            frames,
            rest: None,
            charge: None,
            failure: Failure::default(),
            polled: false,
            stall: None,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(frame) = this.frames.pop_front() {
            if let (Some(data), Some(charge)) = (frame.data_ref(), this.charge.as_mut()) {
                charge.release(data.len() as u64);
            }
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(charge) = this.charge.as_mut() {
            charge.release(u64::MAX);
        }
        let Some(rest) = this.rest.as_mut() else {
            return Poll::Ready(None);
        };
        if !this.polled
            && let Some(stall) = this.stall.as_mut()
        {
            // Counted from when the rest is first asked for.
            stall
                .timer
                .as_mut()
                .reset(tokio::time::Instant::now() + stall.after);
        }
        this.polled = true;
        match Pin::new(rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(stall) = this.stall.as_mut() {
                    stall
                        .timer
                        .as_mut()
                        .reset(tokio::time::Instant::now() + stall.after);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.failure.failed(caller_end(&e));
                Poll::Ready(Some(Err(e.into())))
            }
            // Read to its end: nothing is left.
            Poll::Ready(None) => {
                this.rest = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let Some(stall) = this.stall.as_mut() else {
                    return Poll::Pending;
                };
                if stall.timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                // Nothing left to give back: the client's side is done with.
                this.rest = None;
                this.failure.failed(CallerEnd::Stalled);
                Poll::Ready(Some(Err(BodyStalled(stall.after).into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self
            .frames
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + held);
        }
        hint.set_lower(rest.lower() + held);
        hint
    }
}
