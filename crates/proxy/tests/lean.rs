//! Requests without a body are decided before hyper reads them (the lean path, so a
//! parked request holds no HTTP/1 connection buffers): over one keep-alive connection,
//! a parked request is served once its actor runs, verdicts the data plane writes
//! itself keep the connection, a `HEAD` verdict has no body, and `Connection: close`
//! closes it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::Code;
use valet_proxy::{HttpServer, Limits};
use valet_router::testing::Scripted;
use valet_router::{Metrics, Router, RouterArgs};

const DOMAIN: &str = "actors.resources.substrate.ate.dev";
const WAIT: Duration = Duration::from_secs(10);

fn host(name: &str) -> String {
    format!("{name}.demo.{DOMAIN}")
}

async fn serve() -> (Router, HttpServer, valet_router::testing::Calls) {
    let (cp, calls) = Scripted::new();
    let config = RouterArgs::try_parse_flags(&[] as &[&str])
        .unwrap()
        .resolve()
        .unwrap();
    let router = Router::new(Arc::new(config), cp, Arc::new(Metrics::new()));
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        Limits::default(),
    )
    .unwrap();
    (router, server, calls)
}

/// A worker stand-in that answers each request with its method, path and host.
async fn echo_upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: http::Request<Incoming>| async move {
                    let host = req.headers()["host"].to_str().unwrap().to_owned();
                    let text = format!("{} {} {host}", req.method(), req.uri());
                    Ok::<_, hyper::Error>(http::Response::new(http_body_util::Full::new(
                        Bytes::from(text),
                    )))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    port
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

async fn connect(server: &HttpServer) -> Sender {
    let stream = TcpStream::connect(server.local_addr()).await.unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// Sends `method path` for actor `name` and returns status, headers and body.
async fn send(
    sender: &mut Sender,
    method: &str,
    path: &str,
    name: &str,
) -> (u16, http::HeaderMap, String) {
    sender.ready().await.unwrap();
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", host(name))
        .body(Empty::new())
        .unwrap();
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("an answer in time")
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8(body.to_vec()).unwrap())
}

type Answer = (u16, http::HeaderMap, String);

/// [`send`] in a task of its own, so the test can answer the control plane meanwhile;
/// the connection comes back with the answer.
fn sending(
    mut conn: Sender,
    method: &'static str,
    path: &'static str,
    name: &'static str,
) -> tokio::task::JoinHandle<(Sender, Answer)> {
    tokio::spawn(async move {
        let answer = send(&mut conn, method, path, name).await;
        (conn, answer)
    })
}

#[tokio::test]
async fn a_parked_request_is_served_and_its_connection_keeps_serving() {
    let (router, server, mut calls) = serve().await;
    let port = echo_upstream().await;
    let conn = connect(&server).await;

    let parked = sending(conn, "GET", "/first?x=1", "p1");
    calls.next().await.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "parked");
    calls.next().await.running(port);
    let (conn, (status, _, body)) = parked.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(body, format!("GET /first?x=1 {}", host("p1")));

    // The same connection, now hyper's: the next request is routed as usual.
    let next = sending(conn, "GET", "/second", "p1");
    calls.next().await.running(port);
    let (_, (status, _, body)) = next.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(body, format!("GET /second {}", host("p1")));
    assert_eq!(parked_outcome(&router, "served"), 1.0);
    // Each request decided once, though hyper read the first after its decision.
    assert_eq!(decided(&router, "200", "routed"), 2.0);
    assert_eq!(router.recent_requests().len(), 2);
}

/// Parked requests that ended with `outcome`.
fn parked_outcome(router: &Router, outcome: &str) -> f64 {
    router.metrics().sample(
        "atenet_router_parking_wait_duration_seconds_count",
        &[("outcome", outcome)],
    )
}

fn decided(router: &Router, status: &str, verdict: &str) -> f64 {
    router.metrics().sample(
        "atenet_router_requests_total",
        &[("status", status), ("verdict", verdict)],
    )
}

/// Parked requests routed after the data plane stopped accepting are served: hyper
/// takes a request decided before it read it before any graceful shutdown, which
/// would otherwise close a connection that has read nothing (each such connection had
/// an even chance of closing without an answer).
#[tokio::test]
async fn parked_requests_routed_during_a_drain_are_served() {
    const N: usize = 8;
    let (router, server, mut calls) = serve().await;
    let port = echo_upstream().await;
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..N {
        let mut conn = connect(&server).await;
        clients.spawn(async move { send(&mut conn, "GET", &format!("/{i}"), "p1").await });
    }
    calls.next().await.no_room();
    assert!(router.lot().wait_for_active(N, WAIT).await, "all parked");
    server.stop_accepting();
    calls.next().await.running(port);
    let answers = clients.join_all().await;
    for (status, _, body) in &answers {
        assert_eq!(*status, 200, "{body}");
    }
    assert_eq!(decided(&router, "200", "routed"), N as f64);
    tokio::time::timeout(WAIT, server.drained())
        .await
        .expect("every connection closes after its answer");
}

/// Two requests in one write, the first parked: its verdict comes first, then the
/// second (read while the first waited) is served, on the same connection.
#[tokio::test]
async fn a_request_pipelined_behind_a_parked_one_is_answered_after_it() {
    let (router, server, mut calls) = serve().await;
    let port = echo_upstream().await;
    let mut raw = TcpStream::connect(server.local_addr()).await.unwrap();
    raw.write_all(
        format!(
            "GET /one HTTP/1.1\r\nHost: {}\r\n\r\nGET /two HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            host("gone"),
            host("p2")
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let first = calls.next().await;
    assert_eq!(first.request.actor.to_string(), "demo/gone");
    first.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "parked");
    calls.next().await.fail(Code::NotFound, "no such actor");
    calls.next().await.running(port);
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, raw.read_to_end(&mut out))
        .await
        .expect("both answered, then closed")
        .unwrap();
    let out = String::from_utf8(out).unwrap();
    let second = out.find("HTTP/1.1 200").expect("the second answered");
    assert!(out.starts_with("HTTP/1.1 404 Not Found\r\n"), "{out}");
    assert!(
        out[second..].ends_with(&format!("GET /two {}", host("p2"))),
        "{out}"
    );
}

/// On a connection hyper serves (its first request was routed), a request that parks
/// is hyper's: a client that leaves it is still noticed.
#[tokio::test]
async fn a_client_that_leaves_a_request_parked_under_hyper_is_canceled() {
    let (router, server, mut calls) = serve().await;
    let port = echo_upstream().await;
    let conn = connect(&server).await;
    let first = sending(conn, "GET", "/", "p1");
    calls.next().await.running(port);
    let (mut conn, (status, _, _)) = first.await.unwrap();
    assert_eq!(status, 200);
    let parked = tokio::spawn(async move {
        conn.ready().await.unwrap();
        let req = http::Request::get("/")
            .header("host", host("p2"))
            .body(Empty::new())
            .unwrap();
        let _ = conn.send_request(req).await;
    });
    calls.next().await.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "parked");
    parked.abort();
    let _ = parked.await;
    assert!(router.lot().wait_for_active(0, WAIT).await, "slot freed");
    assert_eq!(parked_outcome(&router, "canceled"), 1.0);
    assert_eq!(decided(&router, "408", "canceled"), 1.0);
    assert_eq!(router.recent_requests().len(), 1, "only the first answered");
}

#[tokio::test]
async fn verdicts_written_before_hyper_keep_the_connection_until_it_is_closed() {
    let (router, server, mut calls) = serve().await;
    let conn = connect(&server).await;

    let first = sending(conn, "GET", "/", "gone");
    calls.next().await.fail(Code::NotFound, "no such actor");
    let (conn, (status, headers, body)) = first.await.unwrap();
    assert_eq!(status, 404);
    assert!(headers.contains_key("date"));
    assert_eq!(headers["content-length"], body.len().to_string().as_str());
    assert!(!body.is_empty());

    // HEAD: the same headers, no body, and the connection still serves.
    let head = sending(conn, "HEAD", "/", "gone");
    calls.next().await.fail(Code::NotFound, "no such actor");
    let (_conn, (status, headers, head_body)) = head.await.unwrap();
    assert_eq!(status, 404);
    assert_eq!(headers["content-length"], body.len().to_string().as_str());
    assert_eq!(head_body, "");

    // Connection: close is answered and closes.
    let mut raw = TcpStream::connect(server.local_addr()).await.unwrap();
    raw.write_all(
        format!(
            "GET / HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            host("gone")
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    calls.next().await.fail(Code::NotFound, "no such actor");
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, raw.read_to_end(&mut out))
        .await
        .expect("closed after the answer")
        .unwrap();
    let out = String::from_utf8(out).unwrap();
    assert!(out.starts_with("HTTP/1.1 404 Not Found\r\n"), "{out}");
    assert!(out.contains("\r\nconnection: close\r\n"), "{out}");

    let recent = router.recent_requests();
    assert_eq!(recent.len(), 3, "every verdict recorded");
}

/// A client that closes its connection while its request is parked frees the slot
/// (`canceled`), and nothing is written to it.
#[tokio::test]
async fn a_client_that_leaves_while_parked_is_canceled() {
    let (router, server, mut calls) = serve().await;
    let mut raw = TcpStream::connect(server.local_addr()).await.unwrap();
    raw.write_all(format!("GET / HTTP/1.1\r\nHost: {}\r\n\r\n", host("p1")).as_bytes())
        .await
        .unwrap();
    calls.next().await.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "parked");
    drop(raw);
    assert!(router.lot().wait_for_active(0, WAIT).await, "slot freed");
    assert_eq!(parked_outcome(&router, "canceled"), 1.0);
    assert_eq!(decided(&router, "408", "canceled"), 1.0);
    assert!(router.recent_requests().is_empty(), "nothing answered");
}
