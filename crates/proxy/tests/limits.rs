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

/// A router with `flags` in front of `cp`.
fn router_of(cp: Arc<dyn ControlPlane>, flags: &[&str]) -> Router {
    let config = RouterArgs::try_parse_flags(flags)
        .unwrap()
        .resolve()
        .unwrap();
    Router::new(Arc::new(config), cp, Arc::new(Metrics::new()))
}

async fn serve(cp: Arc<dyn ControlPlane>, flags: &[&str], limits: Limits) -> SocketAddr {
    let router = router_of(cp, flags);
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
        ..Limits::default()
    };
    let router = router_of(
        Arc::new(AlwaysRunning {
            port: closed_port(),
        }),
        &[],
    );
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        limits,
    )
    .unwrap();
    let addr = server.local_addr();
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
    // Counted, though no decision was made: a flood of them shows.
    assert_eq!(
        router.metrics().sample(
            "atenet_router_requests_total",
            &[("status", "431"), ("verdict", "headers_too_large")]
        ),
        2.0
    );
}

/// Waits (bounded) until `requests_total{status, verdict}` counts one: hyper may close
/// a connection it refused just before its task counts it.
async fn until_counted(router: &Router, status: &str, verdict: &str) {
    let labels = [("status", status), ("verdict", verdict)];
    let counted = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while router
            .metrics()
            .sample("atenet_router_requests_total", &labels)
            < 1.0
        {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(counted.is_ok(), "{status} {verdict} never counted");
}

/// With the default limits (100 fields), a head past hyper's own bound (it indexes 100
/// fields) is answered 431 by hyper before the router sees it: counted all the same
/// (before, it was in no metric).
#[tokio::test]
async fn a_head_hyper_refuses_itself_is_counted() {
    let router = router_of(
        Arc::new(AlwaysRunning {
            port: closed_port(),
        }),
        &[],
    );
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        Limits::default(),
    )
    .unwrap();
    let many: String = (0..110).map(|i| format!("x-h{i}: v\r\n")).collect();
    let (status, _) = raw(
        server.local_addr(),
        &format!("GET / HTTP/1.1\r\nHost: {HOST}\r\n{many}Connection: close\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 431);
    until_counted(&router, "431", "headers_too_large").await;

    // A target past hyper's URI limit: 414, counted as such (not as a 431).
    let long = "a".repeat(70 * 1024);
    let (status, _) = raw(
        server.local_addr(),
        &format!("GET /{long} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 414);
    until_counted(&router, "414", "uri_too_long").await;
    assert_eq!(
        router.metrics().sample(
            "atenet_router_requests_total",
            &[("status", "431"), ("verdict", "headers_too_large")],
        ),
        1.0
    );
}

/// At `max_connections` a listener accepts no more connections until one closes: a
/// flood of idle connections cannot take every file descriptor (before, each was
/// accepted until the process ran out of them).
#[tokio::test]
async fn a_listener_serves_at_most_max_connections() {
    let (cp, _calls) = valet_router::testing::Scripted::new();
    let limits = Limits {
        max_connections: 1,
        ..Limits::default()
    };
    let addr = serve(cp, &[], limits).await;
    let idle = TcpStream::connect(addr).await.unwrap();
    let waiting = tokio::spawn(raw(
        addr,
        "OPTIONS * HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    ));
    // Not a synchronization: however long it waits, it must not be served.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "served past the cap");
    drop(idle);
    let (status, _) = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
        .await
        .expect("served once a place is free")
        .unwrap();
    assert_eq!(status, 204);
}

/// The 502 is counted by its own status and verdict and shown so on the status page
/// (the decision before it counted the request routed).
#[tokio::test]
async fn unreachable_worker_answers_502() {
    let router = router_of(
        Arc::new(AlwaysRunning {
            port: closed_port(),
        }),
        &[],
    );
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        Limits::default(),
    )
    .unwrap();
    let (status, body) = raw(
        server.local_addr(),
        &format!("GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert_eq!((status, body.as_str()), (502, "actor demo/p1 unreachable"));
    assert_eq!(
        router.metrics().sample(
            "atenet_router_requests_answered_after_route_total",
            &[("status", "502"), ("verdict", "worker_unreachable")]
        ),
        1.0
    );
    let recent = router.recent_requests();
    assert_eq!(recent.len(), 1);
    assert_eq!(recent[0].verdict, "worker_unreachable");
    assert_eq!(recent[0].status, 502);
}

/// `OPTIONS *` is about the server, not an actor: the router answers it itself (before,
/// the asterisk was glued to the worker's address and the request went to port 80).
#[tokio::test]
async fn options_asterisk_is_answered_by_the_router() {
    let (cp, calls) = valet_router::testing::Scripted::new();
    let router = router_of(cp, &[]);
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        Limits::default(),
    )
    .unwrap();
    let addr = server.local_addr();
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
    // Counted once, as every request is.
    assert_eq!(
        router.metrics().sample(
            "atenet_router_requests_total",
            &[("status", "204"), ("verdict", "options")]
        ),
        1.0
    );
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
    let router = router_of(Arc::new(AlwaysRunning { port }), &[]);
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

/// A worker that answers `/stream` with one chunk, then ends the body when `finish`
/// is notified; anything else with `ok`.
async fn streaming_worker(finish: Arc<tokio::sync::Notify>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let finish = Arc::clone(&finish);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if head.starts_with(b"GET /stream ") {
                    let _ = s
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n",
                        )
                        .await;
                    finish.notified().await;
                    let _ = s.write_all(b"0\r\n\r\n").await;
                } else {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                }
                std::future::pending::<()>().await;
            });
        }
    });
    port
}

/// An HTTP/2 client connection to `addr`: its request sender and the task that ends
/// when the connection does.
async fn h2_connect(
    addr: SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    (send, tokio::spawn(async move { drop(conn.await) }))
}

fn h2_get(path: &str) -> http::Request<http_body_util::Empty<bytes::Bytes>> {
    http::Request::builder()
        .uri(format!("http://{HOST}{path}"))
        .body(http_body_util::Empty::new())
        .unwrap()
}

/// hyper's HTTP/2 server never closes an idle connection; the data plane closes one
/// with no request open for `idle_timeout`, and never one with a response streaming.
#[tokio::test]
async fn an_idle_http2_connection_is_closed_and_a_busy_one_kept() {
    use http_body_util::BodyExt as _;
    let finish = Arc::new(tokio::sync::Notify::new());
    let port = streaming_worker(Arc::clone(&finish)).await;
    let limits = Limits {
        idle_timeout: std::time::Duration::from_millis(300),
        ..Limits::default()
    };
    let addr = serve(Arc::new(AlwaysRunning { port }), &[], limits).await;
    let bound = std::time::Duration::from_secs(10);

    // Connection A streams a response that outlasts the idle timeout.
    let (mut busy, busy_conn) = h2_connect(addr).await;
    let mut streaming = busy.send_request(h2_get("/stream")).await.unwrap();
    assert_eq!(streaming.status(), 200);
    let first = streaming.body_mut().frame().await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "first");

    // Connection B, opened later and never used, is closed once idle_timeout passes:
    // A's timer, had it run, started earlier and would have ended first.
    let (_idle, idle_conn) = h2_connect(addr).await;
    tokio::time::timeout(bound, idle_conn)
        .await
        .expect("an idle connection is closed")
        .unwrap();

    // A still takes requests: it was not sent GOAWAY while its response streamed.
    let quick = busy.send_request(h2_get("/quick")).await.unwrap();
    assert_eq!(quick.status(), 200);
    let body = quick.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "ok");

    // Its stream done, A is idle too, and closed.
    finish.notify_one();
    let rest = streaming.into_body().collect().await.unwrap().to_bytes();
    assert!(rest.is_empty(), "{rest:?}");
    tokio::time::timeout(bound, busy_conn)
        .await
        .expect("the connection is closed once idle")
        .unwrap();
}

/// A client that completes its TLS handshake (ALPN h2) and then sends nothing, not even
/// the HTTP/2 preface hyper waits for without a deadline, is closed once it has been
/// idle for `idle_timeout` twice (GOAWAY first, then the connection).
#[tokio::test]
async fn a_tls_client_that_never_sends_its_preface_is_closed() {
    use tokio_rustls::rustls;
    let dir = std::env::temp_dir().join(format!(
        "valet-proxy-preface-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let issued = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, issued.cert.pem()).unwrap();
    std::fs::write(&key, issued.signing_key.serialize_pem()).unwrap();
    let tls = valet_proxy::tls::IngressTls::new(
        valet_proxy::tls::IngressCert::Files {
            cert: &cert,
            key: &key,
        },
        None,
        None,
    )
    .unwrap();
    let (cp, _calls) = valet_router::testing::Scripted::new();
    let router = router_of(cp, &[]);
    let limits = Limits {
        idle_timeout: std::time::Duration::from_millis(200),
        ..Limits::default()
    };
    let server = HttpServer::spawn_https(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router,
        limits,
        tls,
    )
    .unwrap();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(issued.cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(server.local_addr()).await.unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(Arc::new(client))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    // Read what the server sends (its SETTINGS, perhaps a GOAWAY) until it closes.
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    closed.expect("the server closes a connection that never sent its preface");
}

/// A `user:password@` part in an absolute-form URI or in `Host` is an invalid host
/// (404, as the spec says of any other host form), and never shown: neither the
/// answer nor `/statusz`'s record of the request repeats the credentials.
#[tokio::test]
async fn credentials_in_the_authority_are_never_shown() {
    let router = router_of(
        Arc::new(AlwaysRunning {
            port: closed_port(),
        }),
        &[],
    );
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        Limits::default(),
    )
    .unwrap();
    let addr = server.local_addr();
    let (status, body) = raw(
        addr,
        &format!(
            "GET http://alice:s3cret@{HOST}/ HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    let want = format!("invalid host \"{HOST}\": credentials (user@) are not part of a host");
    assert_eq!((status, body.as_str()), (404, want.as_str()));
    let (status, body) = raw(
        addr,
        "GET / HTTP/1.1\r\nHost: alice:s3cret@elsewhere.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert!(!body.contains("s3cret"), "{body}");
    let recorded = router.recent_requests();
    assert_eq!(recorded.len(), 2);
    for r in &recorded {
        assert!(
            !r.host.contains("s3cret") && !r.host.contains('@'),
            "{}",
            r.host
        );
    }
}

/// One HTTP/2 connection may park as many requests as the lot holds: past hyper's
/// default of 200 streams, a multiplexing client's requests would wait unseen in the
/// client, neither parked nor shed.
#[tokio::test]
async fn one_http2_connection_parks_more_than_200_requests() {
    const N: usize = 300;
    let (cp, mut calls) = valet_router::testing::Scripted::new();
    let router = router_of(cp, &[]);
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        Limits::default(),
    )
    .unwrap();
    let (send, _conn) = h2_connect(server.local_addr()).await;
    let requests: Vec<_> = (0..N)
        .map(|_| {
            let mut send = send.clone();
            tokio::spawn(async move {
                send.ready().await.unwrap();
                send.send_request(h2_get("/")).await.unwrap().status()
            })
        })
        .collect();
    let wait = std::time::Duration::from_secs(10);
    tokio::time::timeout(wait, calls.next())
        .await
        .expect("the first call")
        .no_room();
    assert!(
        router.lot().wait_for_active(N, wait).await,
        "parked on one connection: {}",
        router.lot().active()
    );
    tokio::time::timeout(wait, calls.next())
        .await
        .expect("the retry")
        .fail(tonic::Code::NotFound, "no such actor");
    for r in requests {
        assert_eq!(r.await.unwrap(), 404);
    }
}

/// A worker stand-in answering each request with what it saw: the length of its
/// target, the headers named `seen`, and its body.
async fn telling_upstream() -> u16 {
    use http_body_util::BodyExt as _;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let target = req.uri().to_string().len();
                        let mut told = format!("target={target}\n");
                        for name in ["upgrade", "http2-settings", "connection"] {
                            for v in req.headers().get_all(name) {
                                told.push_str(&format!("{name}={}\n", v.to_str().unwrap()));
                            }
                        }
                        let body = req.into_body().collect().await?.to_bytes();
                        told.push_str(&format!("body={}", String::from_utf8_lossy(&body)));
                        Ok::<_, hyper::Error>(http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from(told),
                        )))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    port
}

/// Requests forwarded as sent: a target as long as hyper reads (before, building the
/// worker's URI from it panicked the connection's task, and the client got no
/// answer), and a GET's chunked body (before, sent as a GET with none).
#[tokio::test]
async fn long_targets_and_get_bodies_reach_the_worker() {
    let port = telling_upstream().await;
    let addr = serve(Arc::new(AlwaysRunning { port }), &[], Limits::default()).await;
    let path = format!("/{}", "a".repeat(65_529));
    let (status, body) = raw(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("target=65530\n"), "{body}");
    let (status, body) = raw(
        addr,
        &format!(
            "GET /search HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        ),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.ends_with("body=hello"), "{body}");
}

/// What the data plane does not tunnel: CONNECT is answered 405 before any
/// control-plane call, an `Upgrade: h2c` (a tunnel around the router's headers) is not
/// passed on, and two `Host` fields name no one actor (the invalid-host verdict).
#[tokio::test]
async fn connect_h2c_and_two_hosts_are_not_forwarded() {
    let port = telling_upstream().await;
    let router = router_of(Arc::new(AlwaysRunning { port }), &[]);
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        Limits::default(),
    )
    .unwrap();
    let addr = server.local_addr();
    let attempts = || {
        router
            .metrics()
            .sample("atenet_router_resume_attempts_total", &[])
    };
    let (status, body) = raw(
        addr,
        &format!("CONNECT {HOST}:80 HTTP/1.1\r\nHost: {HOST}:80\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert_eq!(status, 405, "{body}");
    assert_eq!(attempts(), 0.0, "no actor resumed");
    let (status, body) = raw(
        addr,
        &format!(
            "GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
        ),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains("upgrade="), "{body}");
    assert!(!body.contains("http2-settings="), "{body}");
    for host_lines in [
        format!("Host: {HOST}\r\nHost: p2.demo.actors.resources.substrate.ate.dev\r\n"),
        format!("Host: {HOST}\r\nHost: {HOST}\r\n"),
    ] {
        let (status, body) = raw(
            addr,
            &format!("GET / HTTP/1.1\r\n{host_lines}Connection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(status, 404, "{body}");
        assert!(body.starts_with("invalid host"), "{body}");
    }
}

/// A worker's 101 reaches the client with only the headers the switch needs: its
/// hop-by-hop headers (Keep-Alive, those its Connection names) stay on its hop.
#[tokio::test]
async fn a_switch_of_protocols_keeps_its_hop_by_hop_headers_on_its_hop() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            head.extend_from_slice(&buf[..n]);
        }
        s.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade, x-hop\r\nUpgrade: websocket\r\nx-hop: 1\r\nKeep-Alive: timeout=5\r\nx-end: 1\r\n\r\n",
        )
        .await
        .unwrap();
        // Keep the tunnel open until the client has read the head.
        let _ = s.read(&mut buf).await;
    });
    let addr = serve(Arc::new(AlwaysRunning { port }), &[], Limits::default()).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "GET /ws HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&head));
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101 "), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    assert!(head.contains("connection: upgrade\r\n"), "{head}");
    assert!(head.contains("x-end: 1"), "{head}");
    assert!(!head.contains("x-hop"), "{head}");
    assert!(!head.contains("keep-alive"), "{head}");
}
