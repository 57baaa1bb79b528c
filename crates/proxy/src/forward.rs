//! Forwarding a routed request to its worker, and rendering verdicts.

use std::net::SocketAddr;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use valet_router::{CallerEnd, Denial, Route, Verdict};

use crate::body::{Failure, RequestBody};
use crate::server::Tunnels;

/// The body of every response the data plane sends.
pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// The header naming the actor on every routed request.
pub(crate) const ACTOR_REF: &str = "x-actor-ref";

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn full(status: StatusCode, content_type: &str, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("static parts are valid")
}

/// A verdict as an HTTP response.
pub(crate) fn render(v: &Verdict) -> Response<Body> {
    let mut resp = full(v.status(), v.content_type(), v.body().to_owned());
    if let Some(secs) = v.retry_after_secs() {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    resp
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

/// Removes hop-by-hop headers and those the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

/// Sends `req` to the route's worker and streams the answer back. A protocol upgrade
/// the worker accepts (101) is spliced through in both directions. A forward that fails
/// because the client's body did (`failure`) is the client's 400, otherwise the
/// worker's 502.
pub(crate) async fn forward(
    client: &Client<HttpConnector, RequestBody>,
    tunnels: &Tunnels,
    mut req: Request<RequestBody>,
    failure: Failure,
    route: &Route,
    host: &str,
    peer: SocketAddr,
) -> Response<Body> {
    let upgrade = (req.version() == Version::HTTP_11 && is_upgrade(req.headers()))
        .then(|| req.headers().get(header::UPGRADE).cloned())
        .flatten();
    let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));

    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let uri: Uri = format!("http://{}{}", route.addr, path)
        .parse()
        .expect("a socket address and a parsed request path make a valid URI");
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    let headers = req.headers_mut();
    strip_hop_by_hop(headers);
    if let Some(up) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, up);
    }
    if let Ok(h) = HeaderValue::from_str(host) {
        headers.insert(header::HOST, h);
    }
    if let Ok(v) = HeaderValue::from_str(&route.actor.to_string()) {
        headers.insert(ACTOR_REF, v);
    }
    let forwarded_for = match headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
        Some(prior) => format!("{prior}, {}", peer.ip()),
        None => peer.ip().to_string(),
    };
    if let Ok(v) = HeaderValue::from_str(&forwarded_for) {
        headers.insert("x-forwarded-for", v);
    }

    let mut resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            let client_side = failure.lock().unwrap_or_else(|e| e.into_inner()).take();
            let denial = match client_side {
                Some(CallerEnd::MalformedBody(why)) => {
                    tracing::debug!(actor = %route.actor, error = %why, "malformed request body");
                    Denial::MalformedBody(route.actor.clone(), why)
                }
                Some(CallerEnd::Gone) => Denial::CallerGone(route.actor.clone()),
                None => {
                    tracing::warn!(actor = %route.actor, worker = %route.addr, error = %e, "worker unreachable");
                    Denial::WorkerUnreachable(route.actor.clone())
                }
            };
            return render(&Verdict::of(&denial));
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
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
        return resp.map(BodyExt::boxed);
    }
    strip_hop_by_hop(resp.headers_mut());
    resp.map(BodyExt::boxed)
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
