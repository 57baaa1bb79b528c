//! Every answer the data plane writes itself, and nothing else: a verdict of the
//! pipeline ([`render`], whose texts are `valet_router::verdict`'s), and the three
//! the data plane gives before the pipeline is asked (a client certificate the
//! allowlist refuses, `OPTIONS *`, `CONNECT`). The lean path writes the same answers
//! as bytes, from these.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use valet_router::Verdict;

/// The body of every response the data plane sends.
pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// A response with a whole body.
pub(crate) fn full(status: StatusCode, content_type: &str, body: String) -> Response<Body> {
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

/// A client certificate the ingress allowlist refuses: 403 for every request, before
/// any control-plane call.
pub(crate) fn certificate_refused(why: &str) -> Response<Body> {
    full(
        StatusCode::FORBIDDEN,
        "text/plain; charset=utf-8",
        format!("client certificate not allowed: {why}\n"),
    )
}

/// `OPTIONS *` (the only request with an asterisk-form target) asks about the server
/// in general, not about a resource (RFC 9110, 9.3.7): the router answers it itself,
/// with no actor resumed and nothing forwarded.
pub(crate) fn options_asterisk() -> Response<Body> {
    let mut resp = full(
        StatusCode::NO_CONTENT,
        "text/plain; charset=utf-8",
        String::new(),
    );
    resp.headers_mut().remove(header::CONTENT_TYPE);
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
    resp
}

/// The methods the router forwards (for `Allow`).
pub(crate) const ALLOWED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// CONNECT asks for a tunnel, which the router makes to no one.
pub(crate) fn connect_refused() -> Response<Body> {
    let mut resp = full(
        StatusCode::METHOD_NOT_ALLOWED,
        "text/plain; charset=utf-8",
        "CONNECT is not supported: the router forwards requests to actors, it tunnels to no one"
            .into(),
    );
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
    resp
}
