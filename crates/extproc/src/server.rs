//! The ext_proc server: one stream per HTTP request, answered with the pipeline's
//! decision rendered as Envoy messages.

use std::net::SocketAddr;
use std::pin::Pin;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, TrailersResponse,
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
    processing_request::Request as In,
    processing_response::Response as Out,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use futures_util::StreamExt as _;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use valet_net::{FirstBytes, Listener};
use valet_router::status::RouteRecord;
use valet_router::{Decision, Router, Verdict};

/// The request headers that name the actor; whichever comes last wins (as upstream).
pub const HOST_HEADERS: [&str; 2] = [":authority", "host"];

/// How long a connection may take to send the HTTP/2 preface.
const PREFACE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// How long [`ExtProcServer::close`] waits for streams to end before it drops the
/// server.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Largest ext_proc message accepted (Envoy sends headers only).
const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// HTTP/2 pings to Envoy, and how long an answer may take (as the built-in data
/// plane's).
const KEEPALIVE_EVERY: std::time::Duration = std::time::Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// The running ext_proc server. Its server task and every stream's task are owned here:
/// [`Self::drained`] waits for them, [`Self::close`] ends them.
#[derive(Debug)]
pub struct ExtProcServer {
    addr: SocketAddr,
    stop: CancellationToken,
    force: CancellationToken,
    streams: TaskTracker,
    done: Option<tokio::task::JoinHandle<()>>,
}

impl ExtProcServer {
    /// Serves ext_proc for `router` on `listener`.
    pub fn spawn(listener: TcpListener, router: Router) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        // Envoy's ext_proc breaker admits this many requests (streams) at once; a
        // peer gone silent is noticed by HTTP/2 pings.
        let max_streams = router.config().extproc_max_requests();
        let stop = CancellationToken::new();
        let force = CancellationToken::new();
        let streams = TaskTracker::new();
        let service = ExternalProcessorServer::new(Processor {
            router,
            streams: streams.clone(),
            force: force.clone(),
        })
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let shutdown = stop.clone();
        // `Server::tcp_nodelay` is ignored for a given incoming stream: the listener
        // sets it.
        // A client that connects and sends nothing is closed after PREFACE_WITHIN:
        // hyper's HTTP/2 server waits for the preface without a deadline.
        let incoming = {
            Listener::new(listener, "ext_proc")
                .incoming(stop.clone())
                .map(|c| c.map(|c| FirstBytes::h2_preface(c, PREFACE_WITHIN)))
        };
        let done = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .max_concurrent_streams(Some(max_streams))
                .http2_keepalive_interval(Some(KEEPALIVE_EVERY))
                .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async move {
                    shutdown.cancelled().await;
                })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "ext_proc server failed");
            }
        });
        Ok(Self {
            addr,
            stop,
            force,
            streams,
            done: Some(done),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections and streams (each connection gets GOAWAY); streams
    /// in progress, parked requests included, go on to their answer.
    pub fn stop_accepting(&self) {
        self.stop.cancel();
    }

    /// Streams in progress now.
    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// Waits until every stream has ended and every connection closed (after
    /// [`Self::stop_accepting`]). Cancel-safe.
    pub async fn drained(&mut self) {
        self.streams.close();
        self.streams.wait().await;
        if let Some(done) = self.done.as_mut() {
            let _ = done.await;
            self.done = None;
        }
    }

    /// Ends every stream and connection still open, answered or not: the last step of
    /// a drain, after every waiting request has had its verdict.
    pub async fn close(&mut self) {
        self.force.cancel();
        self.streams.close();
        // A stream ends when hyper next polls its response, which a peer that stopped
        // reading (no send window) may never allow: bounded, then the server goes.
        if tokio::time::timeout(CLOSE_WAIT, self.streams.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                streams = self.streams.len(),
                "ext_proc streams still open at close; they end with the process"
            );
        }
        if let Some(done) = self.done.take() {
            done.abort();
            let _ = done.await;
        }
    }
}

#[derive(Debug, Clone)]
struct Processor {
    router: Router,
    streams: TaskTracker,
    force: CancellationToken,
}

type OutStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = OutStream;

    async fn process(
        &self,
        req: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<OutStream>, Status> {
        // The responses are produced as tonic polls the response stream, in the task
        // that already serves this HTTP/2 stream: no task or channel of our own per
        // request. The tracker's token makes a drain wait for the stream; a reset
        // drops it, and with it the decision (which frees a parking slot).
        let state = StreamState {
            router: self.router.clone(),
            inbound: req.into_inner(),
            queued: None,
            inbound_open: true,
            _tracked: self.streams.token(),
        };
        let answers: OutStream = Box::pin(futures_util::stream::unfold(state, next_response));
        Ok(Response::new(Box::pin(futures_util::stream::unfold(
            Some((answers, self.force.clone())),
            until_closed,
        ))))
    }
}

/// The stream's answers until the server closes: a stream still open then ends with
/// an error status, never cleanly without an answer (which Envoy takes as "go on
/// unmodified": the request would pass unrouted).
async fn until_closed(
    state: Option<(OutStream, CancellationToken)>,
) -> Option<(
    Result<ProcessingResponse, Status>,
    Option<(OutStream, CancellationToken)>,
)> {
    let (mut answers, force) = state?;
    tokio::select! {
        biased;
        answer = answers.next() => answer.map(|a| (a, Some((answers, force)))),
        () = force.cancelled() => Some((Err(Status::unavailable("router shutting down")), None)),
    }
}

/// One stream's state between its answers.
struct StreamState {
    router: Router,
    inbound: Streaming<ProcessingRequest>,
    /// A message that arrived while the one before it was being decided.
    queued: Option<ProcessingRequest>,
    inbound_open: bool,
    _tracked: tokio_util::task::task_tracker::TaskTrackerToken,
}

/// Answers the stream's next message, in order. The stream's inbound side ending
/// (half-close) means no more messages, not a caller gone: the message in progress is
/// still answered. A reset, or the response side going away, is a caller gone (this
/// future is dropped). Once the request headers are answered the stream ends (after
/// any message that arrived meanwhile is answered too).
async fn next_response(
    mut s: StreamState,
) -> Option<(Result<ProcessingResponse, Status>, StreamState)> {
    let msg = match s.queued.take() {
        Some(m) => m,
        None if !s.inbound_open => return None,
        // Envoy sends a request's headers as it opens its stream, and gives up on it
        // after its message_timeout: a stream silent that long (not Envoy, or a
        // request Envoy abandoned) ends, so it holds neither memory nor a drain.
        None => {
            match tokio::time::timeout(s.router.config().decision_timeout(), s.inbound.message())
                .await
            {
                Ok(Ok(Some(m))) => m,
                Ok(Ok(None)) => return None,
                // A message that could not be read (too large, malformed) or a reset: the
                // stream ends with an error, never cleanly without an answer (which Envoy
                // takes as "go on unmodified": the request would pass unrouted).
                Ok(Err(e)) => return Some((Err(ended(e)), closed(s))),
                Err(_) => {
                    let e = Status::deadline_exceeded("no message on this ext_proc stream");
                    return Some((Err(ended(e)), closed(s)));
                }
            }
        }
    };
    let response = match msg.request {
        Some(In::RequestHeaders(headers)) => {
            let started = Instant::now();
            let (host, path) = host_and_path(&headers);
            let deadline = started + s.router.config().extproc_decision_timeout();
            // Decide, but notice a stream that ends meanwhile: the caller went away,
            // and dropping the decision frees its parking slot.
            let decided = {
                let decide = s.router.decide(&host, deadline);
                tokio::pin!(decide);
                loop {
                    tokio::select! {
                        d = &mut decide => break Ok(d),
                        next = s.inbound.message(), if s.queued.is_none() && s.inbound_open => match next {
                            // Envoy sends nothing else before this answer; keep it for after.
                            Ok(Some(m)) => s.queued = Some(m),
                            Ok(None) => s.inbound_open = false,
                            // A reset, or a message that could not be read.
                            Err(e) => break Err(e),
                        },
                    }
                }
            };
            // The decision is dropped on an error (its parking slot is freed), and an
            // error ends the stream.
            let decision = match decided {
                Ok(d) => d,
                Err(e) => return Some((Err(ended(e)), closed(s))),
            };
            // Nothing else is asked of this stream (request headers are the only
            // phase the processing mode sends): end it cleanly with the answer, in the
            // same write. Envoy then proceeds without consulting the server (the
            // ext_proc protocol), instead of holding the stream until the request ends.
            s.inbound_open = false;
            let (out, target, verdict) = render(&decision);
            s.router.record(RouteRecord::new(
                "extproc",
                &host,
                &path,
                decision.status().as_u16(),
                verdict,
                target,
                started.elapsed(),
            ));
            out
        }
        // Any other message gets the response of its own type, changing nothing.
        Some(In::ResponseHeaders(_)) => Out::ResponseHeaders(HeadersResponse::default()),
        Some(In::RequestBody(_)) => Out::RequestBody(BodyResponse::default()),
        Some(In::ResponseBody(_)) => Out::ResponseBody(BodyResponse::default()),
        Some(In::RequestTrailers(_)) => Out::RequestTrailers(TrailersResponse::default()),
        Some(In::ResponseTrailers(_)) => Out::ResponseTrailers(TrailersResponse::default()),
        None => {
            // The error ends the stream: nothing after it.
            s.inbound_open = false;
            s.queued = None;
            let e = Status::invalid_argument("ProcessingRequest without a request");
            return Some((Err(e), s));
        }
    };
    let reply = ProcessingResponse {
        response: Some(response),
        ..Default::default()
    };
    Some((Ok(reply), s))
}

/// `s` with nothing more to answer: the response stream ends after the next item.
fn closed(mut s: StreamState) -> StreamState {
    s.inbound_open = false;
    s.queued = None;
    s
}

/// The error a stream ends with when its next message could not be read.
fn ended(e: Status) -> Status {
    tracing::debug!(error = %e, "ext_proc stream ended by a read error");
    e
}

/// The host (from `:authority` or `host`, whichever comes last) and the path.
fn host_and_path(headers: &HttpHeaders) -> (String, String) {
    let mut host = String::new();
    let mut path = String::new();
    for h in headers.headers.iter().flat_map(|m| m.headers.iter()) {
        let value = || {
            if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            }
        };
        if HOST_HEADERS.iter().any(|k| h.key.eq_ignore_ascii_case(k)) {
            host = value();
        } else if h.key.eq_ignore_ascii_case(":path") {
            path = value();
        }
    }
    (host, path)
}

fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            // Envoy drops `value` in ext_proc mutations and refuses both: raw_value only.
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// The decision as an ext_proc response, with what the status page records.
fn render(decision: &Decision) -> (Out, Option<SocketAddr>, &'static str) {
    match decision {
        Decision::Route(route) => {
            let mutation = HeaderMutation {
                set_headers: vec![
                    set(":authority", &route.addr.to_string()),
                    set("x-actor-ref", &route.actor.to_string()),
                ],
                ..Default::default()
            };
            let out = Out::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(mutation),
                    ..Default::default()
                }),
            });
            (out, Some(route.addr), "routed")
        }
        Decision::Deny(_, v) => (Out::ImmediateResponse(immediate(v)), None, v.reason()),
    }
}

fn immediate(v: &Verdict) -> ImmediateResponse {
    let mut headers = vec![set("content-type", v.content_type())];
    if let Some(secs) = v.retry_after_secs() {
        headers.push(set("retry-after", &secs.to_string()));
    }
    ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(v.status().as_u16()),
        }),
        headers: Some(HeaderMutation {
            set_headers: headers,
            ..Default::default()
        }),
        body: v.body().as_bytes().to_vec(),
        details: format!("valet_{}", v.reason()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;

    fn hv(key: &str, value: &str, raw: bool) -> HeaderValue {
        HeaderValue {
            key: key.into(),
            value: if raw { String::new() } else { value.into() },
            raw_value: if raw {
                value.as_bytes().to_vec()
            } else {
                Vec::new()
            },
        }
    }

    #[test]
    fn host_comes_from_the_last_of_authority_and_host() {
        let headers = |hs: Vec<HeaderValue>| HttpHeaders {
            headers: Some(HeaderMap { headers: hs }),
            ..Default::default()
        };
        let h = headers(vec![
            hv(":authority", "a.example", true),
            hv(":path", "/x?y", true),
        ]);
        assert_eq!(host_and_path(&h), ("a.example".into(), "/x?y".into()));
        let h = headers(vec![
            hv(":authority", "a.example", false),
            hv("host", "b.example", true),
        ]);
        assert_eq!(host_and_path(&h).0, "b.example");
        let h = headers(vec![
            hv("host", "b.example", true),
            hv(":authority", "a.example", false),
        ]);
        assert_eq!(host_and_path(&h).0, "a.example");
    }

    #[test]
    fn mutations_use_raw_value_only() {
        let o = set(":authority", "127.0.0.1:9000");
        let h = o.header.unwrap();
        assert!(h.value.is_empty());
        assert_eq!(h.raw_value, b"127.0.0.1:9000");
    }
}
