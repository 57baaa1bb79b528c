//! The data plane's own answers over real HTTP: header limits (431) and an unreachable
//! worker (502), each a verdict with a `text/plain` body.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use valet_proxy::{HttpServer, Limits};
use valet_router::testing::AlwaysRunning;
use valet_router::{ControlPlane, Metrics, Router, RouterArgs};

const HOST: &str = "p1.demo.actors.resources.substrate.ate.dev";

async fn serve(cp: Arc<dyn ControlPlane>, flags: &[&str], limits: Limits) -> SocketAddr {
    let config = RouterArgs::try_parse_flags(flags)
        .unwrap()
        .resolve()
        .unwrap();
    let router = Router::new(Arc::new(config), cp, Arc::new(Metrics::new()));
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router,
        limits,
    )
    .unwrap();
    let addr = server.local_addr();
    std::mem::forget(server);
    addr
}

/// Sends a raw HTTP/1.1 request and returns the status and body.
async fn raw(addr: SocketAddr, head: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    (
        text[9..12].parse().unwrap(),
        text.split_once("\r\n\r\n").unwrap().1.to_owned(),
    )
}

fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn header_limits_answer_431() {
    let limits = Limits {
        max_headers: 20,
        max_header_bytes: 1024,
    };
    let addr = serve(
        Arc::new(AlwaysRunning {
            port: closed_port(),
        }),
        &[],
        limits,
    )
    .await;
    let many: String = (0..30).map(|i| format!("x-h{i}: v\r\n")).collect();
    let (status, body) = raw(
        addr,
        &format!("GET / HTTP/1.1\r\nHost: {HOST}\r\n{many}Connection: close\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 431);
    assert_eq!(body, "too many request header fields: 32 (limit 20)");
    let big = "a".repeat(2000);
    let (status, body) = raw(
        addr,
        &format!("GET / HTTP/1.1\r\nHost: {HOST}\r\nx-big: {big}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 431);
    assert!(
        body.starts_with("request header fields too large: "),
        "{body}"
    );
    assert!(body.ends_with("bytes (limit 1024)"), "{body}");
}

#[tokio::test]
async fn unreachable_worker_answers_502() {
    let addr = serve(
        Arc::new(AlwaysRunning {
            port: closed_port(),
        }),
        &[],
        Limits::default(),
    )
    .await;
    let (status, body) = raw(
        addr,
        &format!("GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert_eq!((status, body.as_str()), (502, "actor demo/p1 unreachable"));
}

/// `OPTIONS *` is about the server, not an actor: the router answers it itself (before,
/// the asterisk was glued to the worker's address and the request went to port 80).
#[tokio::test]
async fn options_asterisk_is_answered_by_the_router() {
    let (cp, calls) = valet_router::testing::Scripted::new();
    let addr = serve(cp, &[], Limits::default()).await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut s,
        b"OPTIONS * HTTP/1.1\r\nHost: p1.demo.actors.resources.substrate.ate.dev\r\nConnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let mut out = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut s, &mut out)
        .await
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 204 "), "{out}");
    assert!(
        out.to_ascii_lowercase()
            .contains("allow: get, head, post, put, patch, delete, options"),
        "{out}"
    );
    let mut calls = calls;
    assert!(calls.try_next().is_none(), "no actor resumed");
}

/// A request forwarded to a worker that never answers is answered `router shutting
/// down` at the drain's cut-off, not dropped with its connection.
#[tokio::test]
async fn a_request_its_worker_never_answers_gets_the_cut_offs_answer() {
    // A worker that takes the connection and the request, and says nothing.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let (got, mut requested) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        let (mut s, _) = silent.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        let _ = s.read(&mut buf).await;
        let _ = got.send(()).await;
        std::future::pending::<()>().await;
        drop(s);
    });
    let config = RouterArgs::try_parse_flags(&[] as &[&str])
        .unwrap()
        .resolve()
        .unwrap();
    let router = Router::new(
        Arc::new(config),
        Arc::new(AlwaysRunning { port }),
        Arc::new(Metrics::new()),
    );
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router,
        Limits::default(),
    )
    .unwrap();
    let addr = server.local_addr();
    let answer = tokio::spawn(async move {
        raw(
            addr,
            &format!("GET /slow HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"),
        )
        .await
    });
    requested.recv().await.expect("the worker got the request");
    server.stop_accepting();
    server.close_tunnels();
    let (status, body) = tokio::time::timeout(std::time::Duration::from_secs(10), answer)
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(
        (status, body.as_str()),
        (503, "actor demo/p1 unavailable: router shutting down")
    );
}
