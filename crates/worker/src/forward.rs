//! The worker's proxy to a hosted program: each request for the actor goes to the
//! program's loopback port (HTTP/1.1 or h2c, as its template says), bodies streamed
//! both ways; a protocol upgrade (WebSocket) the program accepts becomes a tunnel
//! that counts as a request in flight while it is open.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use valet_proto::hop::{is_upgrade, strip_hop_by_hop};
use valet_template::Protocol;

use crate::app::{Body, Tunnels, streamed, text};
use crate::program::Running;
use crate::traffic::InFlight;

/// One run of a program as requests reach it: its process and a client pool to it.
#[derive(Debug)]
pub(crate) struct Upstream {
    pub(crate) running: Running,
    client: Client<HttpConnector, Incoming>,
    protocol: Protocol,
}

impl Upstream {
    pub(crate) fn new(running: Running, protocol: Protocol) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(std::time::Duration::from_secs(5)));
        let mut builder = Client::builder(TokioExecutor::new());
        builder.pool_idle_timeout(std::time::Duration::from_secs(30));
        if protocol == Protocol::H2c {
            builder.http2_only(true);
        }
        Self {
            running,
            client: builder.build(connector),
            protocol,
        }
    }
}

/// Sends `req` for `actor` to `upstream`, and its answer back; 502 when the program
/// does not answer.
pub(crate) async fn forward(
    mut req: Request<Incoming>,
    actor: &str,
    upstream: Arc<Upstream>,
    in_flight: InFlight,
    tunnels: &Tunnels,
) -> Response<Body> {
    let addr = upstream.running.addr();
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let upgrade = req.version() == Version::HTTP_11
        && upstream.protocol == Protocol::Http1
        && is_upgrade(req.headers());
    // The host the client asked for (an HTTP/2 request carries it in its URI).
    if !req.headers().contains_key(header::HOST)
        && let Some(authority) = req.uri().authority()
        && let Ok(v) = HeaderValue::from_str(authority.as_str())
    {
        req.headers_mut().insert(header::HOST, v);
    }
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let asked = parts.headers.get(header::UPGRADE).cloned();
    strip_hop_by_hop(&mut parts.headers);
    if let Some(up) = asked.filter(|_| upgrade) {
        parts.headers.insert(header::UPGRADE, up);
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    parts.version = match upstream.protocol {
        Protocol::Http1 => Version::HTTP_11,
        Protocol::H2c => Version::HTTP_2,
    };
    parts.uri = match Uri::builder()
        .scheme("http")
        .authority(addr.to_string())
        .path_and_query(path)
        .build()
    {
        Ok(u) => u,
        Err(e) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("bad request target: {e}\n"),
            );
        }
    };
    let outgoing = Request::from_parts(parts, body);
    let answer = if upgrade {
        send_upgrade(outgoing, addr, tunnels).await
    } else {
        upstream
            .client
            .request(outgoing)
            .await
            .map_err(|e| valet_proto::error_chain(&e))
    };
    let mut resp = match answer {
        Ok(r) => r,
        Err(e) => {
            let why = match upstream.running.exit() {
                Some(exit) => format!("its program {exit}"),
                None => format!("its program did not answer: {e}"),
            };
            tracing::debug!(%actor, %why, "request to the program failed");
            return text(
                StatusCode::BAD_GATEWAY,
                format!("actor {actor} failed: {why}\n"),
            );
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        let program_upgrade = hyper::upgrade::on(&mut resp);
        let actor = actor.to_owned();
        let (parts, _) = resp.into_parts();
        tunnels.spawn(async move {
            let tunnel = async {
                match tokio::try_join!(client_upgrade, program_upgrade) {
                    Ok((client, program)) => {
                        let (mut a, mut b) = (TokioIo::new(client), TokioIo::new(program));
                        if let Err(e) = tokio::io::copy_bidirectional(&mut a, &mut b).await {
                            tracing::debug!(%actor, error = %e, "tunnel to the program ended");
                        }
                    }
                    Err(e) => tracing::debug!(%actor, error = %e, "upgrade to the program failed"),
                }
            };
            // It counts as in flight until it closes, or its actor is cut off or gone.
            tokio::select! {
                () = tunnel => {}
                () = in_flight.stopped() => {}
            }
        });
        let mut back = Response::from_parts(
            parts,
            http_body_util::Empty::<Bytes>::new()
                .map_err(|never| match never {})
                .boxed(),
        );
        *back.version_mut() = Version::HTTP_11;
        return back;
    }
    strip_hop_by_hop(resp.headers_mut());
    streamed(resp.map(|b| b.map_err(Into::into).boxed()), in_flight)
}

/// An upgrade goes over a connection of its own, which becomes the tunnel.
async fn send_upgrade(
    req: Request<Incoming>,
    addr: std::net::SocketAddr,
    tunnels: &Tunnels,
) -> Result<Response<Incoming>, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tunnels.spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let mut req = req;
    // An HTTP/1.1 connection's request target is the path.
    *req.uri_mut() = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    send.send_request(req).await.map_err(|e| e.to_string())
}
