//! Forwarding a routed request to its worker, and rendering verdicts.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Body as _;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use valet_proto::hop::{is_upgrade, strip_hop_by_hop};
use valet_router::{CallerEnd, Denial, Route, Verdict};

use crate::answer::{Body, render};
use crate::body::{Failure, RequestBody};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The header naming the actor on every routed request.
pub(crate) const ACTOR_REF: &str = "x-actor-ref";

/// Why a small body was not read whole.
enum Unread {
    /// No frame came for the idle timeout.
    Stalled,
    /// The drain's cut-off came first.
    CutOff,
    /// The body broke off or was malformed (the [`Failure`] says which).
    Failed,
}

/// Reads `body` whole: each frame within `idle` of the last, all of it within
/// `within`, and before the drain's cut-off.
async fn read_whole(
    mut body: RequestBody,
    (idle, within): (Duration, Duration),
    tunnels: &Tunnels,
) -> Result<Bytes, Unread> {
    let mut all = Vec::new();
    let until = tokio::time::Instant::now() + within;
    loop {
        let by = until.min(tokio::time::Instant::now() + idle);
        let frame = tokio::select! {
            frame = tokio::time::timeout_at(by, body.frame()) => frame.map_err(|_| Unread::Stalled)?,
            () = tunnels.closing() => return Err(Unread::CutOff),
        };
        match frame {
            None => return Ok(Bytes::from(all)),
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    all.extend_from_slice(data);
                }
            }
            Some(Err(_)) => return Err(Unread::Failed),
        }
    }
}

/// Every field named `name`, joined by `separator` into one value, or `None` when
/// there is none. The fields are removed from `headers`.
fn join_fields(headers: &mut HeaderMap, name: HeaderName, separator: &[u8]) -> Option<Vec<u8>> {
    let http::header::Entry::Occupied(entry) = headers.entry(name) else {
        return None;
    };
    let mut joined = Vec::new();
    for (i, v) in entry.remove_entry_mult().1.enumerate() {
        if i > 0 {
            joined.extend_from_slice(separator);
        }
        joined.extend_from_slice(v.as_bytes());
    }
    Some(joined)
}

/// Whether an `Upgrade` value offers h2c.
fn names_h2c(upgrade: &HeaderValue) -> bool {
    upgrade
        .as_bytes()
        .split(|&b| b == b',')
        .any(|p| p.trim_ascii().eq_ignore_ascii_case(b"h2c"))
}

/// The largest declared body of a request that may be sent again after the worker
/// answered 421 (the actor moved): such a body is held until the worker's answer.
pub(crate) const REPLAY_BODY_MAX: u64 = 64 * 1024;

/// A routed request on its way to a worker, ready to be sent (and, when replayable,
/// sent again to another worker).
pub(crate) struct Outgoing {
    parts: http::request::Parts,
    body: OutgoingBody,
    /// The client's side of an upgrade, taken once.
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    failure: Failure,
}

enum OutgoingBody {
    /// Held whole (no body, or a declared one of at most [`REPLAY_BODY_MAX`]).
    Held(Bytes),
    /// Streamed: can be sent once.
    Streamed(RequestBody),
    /// Sent already, and not held.
    Spent,
}

/// What one send to a worker came to.
pub(crate) enum Sent {
    /// The worker's answer.
    Answer(Response<Body>),
    /// No answer from the worker: the data plane's own verdict (the worker could not
    /// be reached, the client's body was malformed or it left, the drain cut it off).
    Denied(Verdict),
    /// The worker does not host the actor (any more): 421.
    Moved,
    /// A leased route's worker refused the connection (nothing was sent): the actor
    /// may have left it. Decided again when the request can be replayed, this
    /// verdict (unreachable) otherwise.
    Refused(Verdict),
}

impl Outgoing {
    /// Prepares `req` (from `host`, client `peer`): hop-by-hop headers stripped, the
    /// upgrade taken, `x-forwarded-for` extended, cookies in one field; a small body
    /// is read whole so the request can be replayed. Its frames must come within
    /// `idle` of each other and all of it within `within` (a client that
    /// stalls or trickles gets the 504 verdict rather than holding the request), and
    /// before the drain's cut-off.
    pub(crate) async fn new(
        req: Request<RequestBody>,
        failure: Failure,
        route: &Route,
        host: &str,
        peer: SocketAddr,
        (idle, within): (Duration, Duration),
        tunnels: &Tunnels,
    ) -> Result<Self, (Response<Body>, &'static str)> {
        let (mut parts, body) = req.into_parts();
        // An h2c upgrade is never passed on: past it, the worker would read requests
        // on that connection that never went through the router.
        let upgrade = (parts.version == Version::HTTP_11 && is_upgrade(&parts.headers))
            .then(|| parts.headers.get(header::UPGRADE).cloned())
            .flatten()
            .filter(|up| !names_h2c(up));
        let client_upgrade = upgrade
            .as_ref()
            .and_then(|_| parts.extensions.remove::<hyper::upgrade::OnUpgrade>());
        let headers = &mut parts.headers;
        strip_hop_by_hop(headers);
        if let Some(up) = upgrade {
            headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(header::UPGRADE, up);
        }
        if let Ok(h) = HeaderValue::from_str(host) {
            headers.insert(header::HOST, h);
        }
        let peer = peer.ip().to_string();
        let forwarded_for = join_fields(headers, HeaderName::from_static("x-forwarded-for"), b", ")
            .map_or_else(
                || peer.clone().into_bytes(),
                |mut prior| {
                    prior.extend_from_slice(b", ");
                    prior.extend_from_slice(peer.as_bytes());
                    prior
                },
            );
        if let Ok(v) = HeaderValue::from_bytes(&forwarded_for) {
            headers.insert("x-forwarded-for", v);
        }
        // HTTP/2 sends each cookie as its own field; an HTTP/1.1 server expects them
        // in one (RFC 9113 §8.2.3).
        if let Some(cookies) = join_fields(headers, header::COOKIE, b"; ")
            && let Ok(v) = HeaderValue::from_bytes(&cookies)
        {
            headers.insert(header::COOKIE, v);
        }
        parts.version = Version::HTTP_11;
        let small = body
            .size_hint()
            .upper()
            .is_some_and(|n| n <= REPLAY_BODY_MAX);
        let body = if body.is_end_stream() {
            OutgoingBody::Held(Bytes::new())
        } else if small {
            let actor = route.actor.clone();
            let denial = match read_whole(body, (idle, within), tunnels).await {
                Ok(all) => return Ok(Self::held(parts, all, client_upgrade, failure)),
                Err(Unread::Stalled) => Denial::CallerDeadline(actor),
                Err(Unread::CutOff) => Denial::ShuttingDown(actor),
                Err(Unread::Failed) => match failure.take_failure() {
                    Some(CallerEnd::MalformedBody(why)) => Denial::MalformedBody(actor, why),
                    Some(CallerEnd::Stalled) => Denial::CallerDeadline(actor),
                    Some(CallerEnd::Gone) | None => Denial::CallerGone(actor),
                },
            };
            let v = Verdict::of(&denial);
            return Err((render(&v), v.reason()));
        } else {
            OutgoingBody::Streamed(body)
        };
        Ok(Self {
            parts,
            body,
            client_upgrade,
            failure,
        })
    }

    fn held(
        parts: http::request::Parts,
        body: Bytes,
        client_upgrade: Option<hyper::upgrade::OnUpgrade>,
        failure: Failure,
    ) -> Self {
        Self {
            parts,
            body: OutgoingBody::Held(body),
            client_upgrade,
            failure,
        }
    }

    /// Whether it can be sent again after a 421.
    pub(crate) fn replayable(&self) -> bool {
        matches!(self.body, OutgoingBody::Held(_))
    }

    /// The bytes of the body it holds to send again.
    pub(crate) fn held_bytes(&self) -> u64 {
        match &self.body {
            OutgoingBody::Held(b) => b.len() as u64,
            OutgoingBody::Streamed(_) | OutgoingBody::Spent => 0,
        }
    }

    /// Sends it to `route`'s worker. A protocol upgrade the worker accepts (101) is
    /// spliced through in both directions. A send that fails because the client's body
    /// did is the client's 400, otherwise the worker's 502. The held body is let go
    /// once the worker answers anything but 421.
    pub(crate) async fn send(
        &mut self,
        client: &Client<HttpConnector, RequestBody>,
        tunnels: &Tunnels,
        route: &Route,
    ) -> Sent {
        let uri = worker_uri(route.addr, self.parts.uri.path_and_query());
        // How the body is framed when the client's framing (Transfer-Encoding, or an
        // h2 stream) went with the hop: said explicitly, since hyper would send a GET
        // without it as a GET with no body.
        let (body, framing) = match std::mem::replace(&mut self.body, OutgoingBody::Spent) {
            OutgoingBody::Held(bytes) => {
                let again = RequestBody::whole(bytes.clone());
                let framing = (!bytes.is_empty())
                    .then(|| (header::CONTENT_LENGTH, HeaderValue::from(bytes.len())));
                self.body = OutgoingBody::Held(bytes);
                (again, framing)
            }
            OutgoingBody::Streamed(b) => {
                let framing = (!b.is_end_stream()).then(|| {
                    (
                        header::TRANSFER_ENCODING,
                        HeaderValue::from_static("chunked"),
                    )
                });
                (b, framing)
            }
            OutgoingBody::Spent => (RequestBody::whole(Bytes::new()), None),
        };
        let mut req = Request::new(body);
        *req.method_mut() = self.parts.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = self.parts.headers.clone();
        if let Some((name, value)) = framing
            && !req.headers().contains_key(header::CONTENT_LENGTH)
        {
            req.headers_mut().insert(name, value);
        }
        if let Ok(v) = HeaderValue::from_str(&route.actor.to_string()) {
            req.headers_mut().insert(ACTOR_REF, v);
        }
        // The drain's cut-off (the tunnels close with it) answers a request still
        // waiting for its worker's answer, rather than the connection being dropped
        // with it at the end of the grace.
        let answer = tokio::select! {
            r = client.request(req) => r,
            () = tunnels.closing() => {
                return Sent::Denied(Verdict::of(&Denial::ShuttingDown(route.actor.clone())));
            }
        };
        let mut resp = match answer {
            Ok(r) => r,
            Err(e) => {
                let client_side = self.failure.take_failure();
                let denial = match client_side {
                    Some(CallerEnd::MalformedBody(why)) => {
                        tracing::debug!(actor = %route.actor, error = %why, "malformed request body");
                        Denial::MalformedBody(route.actor.clone(), why)
                    }
                    Some(CallerEnd::Gone) => Denial::CallerGone(route.actor.clone()),
                    // Its body stalled on the way to the worker: the request's own
                    // deadline, as for a body that stalls before it is sent.
                    Some(CallerEnd::Stalled) => Denial::CallerDeadline(route.actor.clone()),
                    // A lease's worker that refuses the connection (nothing was sent):
                    // the actor may have left it (it died with the control plane,
                    // say), as a 421 would say; the request is decided again.
                    None if route.cached && e.is_connect() => {
                        tracing::debug!(actor = %route.actor, worker = %route.addr, error = %e, "a leased route's worker cannot be reached");
                        return Sent::Refused(Verdict::of(&Denial::WorkerUnreachable(
                            route.actor.clone(),
                        )));
                    }
                    None => {
                        tracing::warn!(actor = %route.actor, worker = %route.addr, error = %e, "worker unreachable");
                        Denial::WorkerUnreachable(route.actor.clone())
                    }
                };
                return Sent::Denied(Verdict::of(&denial));
            }
        };
        if resp.status() == StatusCode::MISDIRECTED_REQUEST {
            tracing::debug!(actor = %route.actor, worker = %route.addr, "the actor moved");
            return Sent::Moved;
        }
        self.body = OutgoingBody::Spent;
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS
            && let Some(client_upgrade) = self.client_upgrade.take()
        {
            let worker_upgrade = hyper::upgrade::on(&mut resp);
            let actor = route.actor.clone();
            tunnels.spawn(async move {
                match tokio::try_join!(client_upgrade, worker_upgrade) {
                    Ok((c, w)) => {
                        let (mut c, mut w) = (TokioIo::new(c), TokioIo::new(w));
                        if let Err(e) = tokio::io::copy_bidirectional(&mut c, &mut w).await {
                            tracing::debug!(%actor, error = %e, "upgraded connection ended");
                        }
                    }
                    Err(e) => tracing::debug!(%actor, error = %e, "upgrade failed"),
                }
            });
            // Only what the switch itself needs crosses this hop.
            let upgrade = resp.headers().get(header::UPGRADE).cloned();
            strip_hop_by_hop(resp.headers_mut());
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            if let Some(up) = upgrade {
                resp.headers_mut().insert(header::UPGRADE, up);
            }
            return Sent::Answer(resp.map(BodyExt::boxed));
        }
        strip_hop_by_hop(resp.headers_mut());
        Sent::Answer(resp.map(BodyExt::boxed))
    }
}

/// The worker's URI for a request target: `http://<worker>` and the origin-form path
/// (an asterisk-form target is answered before it gets here; anything else would be
/// read as part of the authority, and sent elsewhere). Assembled from parts, never
/// parsed again: a target as long as hyper reads is more than `http::Uri` parses whole
/// once the address is in front of it.
fn worker_uri(addr: SocketAddr, target: Option<&http::uri::PathAndQuery>) -> Uri {
    let path = match target {
        Some(p) if p.as_str().starts_with('/') => p.clone(),
        Some(p) => http::uri::PathAndQuery::try_from(format!("/{}", p.as_str()))
            .unwrap_or_else(|_| http::uri::PathAndQuery::from_static("/")),
        None => http::uri::PathAndQuery::from_static("/"),
    };
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(http::uri::Scheme::HTTP);
    parts.authority = http::uri::Authority::try_from(addr.to_string()).ok();
    parts.path_and_query = Some(path);
    Uri::from_parts(parts).expect("a scheme, a socket address and a path make a URI")
}

/// The upgraded connections (WebSocket and other protocols) spliced to workers: owned
/// here, so a drain waits for them and can close them.
#[derive(Debug, Clone)]
pub(crate) struct Tunnels {
    tasks: TaskTracker,
    close: CancellationToken,
}

impl Tunnels {
    /// Tunnels closed when `close` is cancelled.
    pub(crate) fn new(close: CancellationToken) -> Self {
        Self {
            tasks: TaskTracker::new(),
            close,
        }
    }

    /// Takes no more tunnels, and waits until every one has ended.
    pub(crate) async fn wait(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// Closes every tunnel at once.
    pub(crate) fn close_now(&self) {
        self.close.cancel();
    }

    /// Tunnels open now.
    pub(crate) fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Resolves at the drain's cut-off.
    pub(crate) async fn closing(&self) {
        self.close.cancelled().await;
    }

    /// Runs `splice` until it ends or the tunnels are closed.
    pub(crate) fn spawn(&self, splice: impl std::future::Future<Output = ()> + Send + 'static) {
        let close = self.close.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = splice => {}
                () = close.cancelled() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-secret-hop"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("yes"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn upgrade_detection() {
        let mut h = HeaderMap::new();
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        assert!(!is_upgrade(&h));
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert!(is_upgrade(&h));
    }
}
