//! Request bodies over real HTTP: held while parked (bounded per request and across the
//! lot, never shed), a client that leaves mid-wait noticed body or not, and a malformed
//! body answered 400 by the data plane itself.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::Code;
use valet_proxy::{HttpServer, Limits};
use valet_router::testing::{AlwaysRunning, Scripted};
use valet_router::{ControlPlane, Metrics, Router, RouterArgs};

const DOMAIN: &str = "actors.resources.substrate.ate.dev";
const WAIT: Duration = Duration::from_secs(10);

fn host(name: &str) -> String {
    format!("{name}.demo.{DOMAIN}")
}

async fn serve(cp: Arc<dyn ControlPlane>, flags: &[&str]) -> (Router, HttpServer) {
    serve_with(cp, flags, Limits::default()).await
}

async fn serve_with(
    cp: Arc<dyn ControlPlane>,
    flags: &[&str],
    limits: Limits,
) -> (Router, HttpServer) {
    let config = RouterArgs::try_parse_flags(flags)
        .unwrap()
        .resolve()
        .unwrap();
    let router = Router::new(Arc::new(config), cp, Arc::new(Metrics::new()));
    let server = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        router.clone(),
        limits,
    )
    .unwrap();
    (router, server)
}

/// A worker stand-in that reads each request's whole body, then answers with it.
async fn collecting_upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: http::Request<Incoming>| async move {
                    let body = req.into_body().collect().await?.to_bytes();
                    Ok::<_, hyper::Error>(http::Response::new(Full::new(body)))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    port
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

/// POSTs `body` over a fresh HTTP/1.1 connection and returns status and body.
async fn post(router: SocketAddr, name: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = http::Request::post(format!("http://{router}/upload"))
        .header("host", host(name))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    (
        status,
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
}

/// Waits (bounded) until the lot holds at least `n` bytes.
async fn held_at_least(router: &Router, n: u64) {
    let mut held = router.lot().bytes().watch();
    tokio::time::timeout(WAIT, held.wait_for(|h| *h >= n))
        .await
        .expect("bytes held in time")
        .unwrap();
}

fn held_gauge(router: &Router) -> f64 {
    router
        .metrics()
        .sample("atenet_router_parking_held_bytes", &[])
}

/// A parked POST whose client goes away, after sending its whole body or in the middle
/// of a chunked one: the slot is freed at once and `canceled` recorded; its held bytes
/// go back to the lot.
#[tokio::test]
async fn parked_post_whose_client_leaves_is_canceled() {
    let (cp, mut calls) = Scripted::new();
    let (router, server) = serve(cp, &[]).await;
    let addr = server.local_addr();

    let mut whole = TcpStream::connect(addr).await.unwrap();
    let body = pattern(200 * 1024, 1);
    whole
        .write_all(
            format!(
                "POST / HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n\r\n",
                host("p1"),
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let writer = tokio::spawn(async move {
        whole.write_all(&body).await.unwrap();
        whole
    });
    calls.next().await.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "parked");
    let whole = writer.await.unwrap();
    let all_held = async {
        while router.lot().bytes().held() < 200 * 1024 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(WAIT, all_held)
        .await
        .expect("the whole body is held");
    assert_eq!(held_gauge(&router), (200 * 1024) as f64);
    drop(whole);
    assert!(router.lot().wait_for_active(0, WAIT).await, "slot freed");
    assert_eq!(
        router.metrics().sample(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "canceled")]
        ),
        1.0
    );
    assert_eq!(router.lot().bytes().held(), 0);
    assert_eq!(held_gauge(&router), 0.0);

    let mut chunked = TcpStream::connect(addr).await.unwrap();
    chunked
        .write_all(
            format!(
                "POST / HTTP/1.1\r\nHost: {}\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
                host("p2")
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    calls.next().await.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "parked");
    drop(chunked);
    assert!(router.lot().wait_for_active(0, WAIT).await, "slot freed");
    assert_eq!(
        router.metrics().sample(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "canceled")]
        ),
        2.0
    );
    assert_eq!(router.lot().bytes().held(), 0);
}

/// Two parked uploads, together larger than the lot's byte budget: reading pauses when
/// the budget is spent (neither is shed nor refused), the held bytes never exceed it,
/// and both are served byte for byte once their actors run.
#[tokio::test]
async fn uploads_larger_than_the_lot_wait_and_are_served_whole() {
    const BUDGET: u64 = 256 * 1024;
    let upstream = collecting_upstream().await;
    let (cp, mut calls) = Scripted::new();
    let (router, server) = serve(cp, &["--parked-bytes-max", "256KiB"]).await;
    let addr = server.local_addr();

    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let observer = {
        let (mut held, peak) = (router.lot().bytes().watch(), Arc::clone(&peak));
        tokio::spawn(async move {
            loop {
                peak.fetch_max(
                    *held.borrow_and_update(),
                    std::sync::atomic::Ordering::SeqCst,
                );
                if held.changed().await.is_err() {
                    return;
                }
            }
        })
    };
    let a = pattern(600 * 1024, 7);
    let b = pattern(900 * 1024, 9);
    let (ta, tb) = (
        tokio::spawn(post(addr, "pa", a.clone())),
        tokio::spawn(post(addr, "pb", b.clone())),
    );
    let mut parked = Vec::new();
    for _ in 0..2 {
        let call = calls.next().await;
        parked.push(call.request.actor.clone());
        call.no_room();
    }
    assert!(router.lot().wait_for_active(2, WAIT).await, "both parked");
    held_at_least(&router, BUDGET).await;
    assert_eq!(
        held_gauge(&router),
        BUDGET as f64,
        "the lot's bytes are spent"
    );
    // Both flights retry; let them both run.
    for _ in 0..2 {
        calls.next().await.running(upstream);
    }
    let (sa, ra) = ta.await.unwrap();
    let (sb, rb) = tb.await.unwrap();
    assert_eq!((sa, ra.len()), (200, a.len()));
    assert!(ra == a, "first upload forwarded byte for byte");
    assert_eq!((sb, rb.len()), (200, b.len()));
    assert!(rb == b, "second upload forwarded byte for byte");
    observer.abort();
    let peak = peak.load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= BUDGET, "held {peak} bytes, budget {BUDGET}");
    assert_eq!(router.lot().bytes().held(), 0);
    assert_eq!(
        router.metrics().sample(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "served")]
        ),
        2.0
    );
    assert_eq!(
        router
            .metrics()
            .sample("atenet_router_parking_rejected_total", &[]),
        0.0
    );
}

/// A malformed chunked body to a running actor is the client's 400 with a body naming
/// the problem; 502 stays for the worker's failures.
#[tokio::test]
async fn malformed_chunked_body_is_400() {
    let upstream = collecting_upstream().await;
    let (router, server) = serve(Arc::new(AlwaysRunning { port: upstream }), &[]).await;
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    s.write_all(
        format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\nzz\r\nbad\r\n0\r\n\r\n",
            host("p1")
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 400 "), "{text}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; charset=utf-8"),
        "{head}"
    );
    assert!(
        body.starts_with("actor demo/p1: malformed request body: "),
        "{body}"
    );
    // Decided routed, answered by the data plane itself: counted so.
    assert_eq!(
        router.metrics().sample(
            "atenet_router_requests_answered_after_route_total",
            &[("status", "400"), ("verdict", "malformed_body")]
        ),
        1.0
    );
}

/// A worker stand-in that answers 421 (the actor moved) to the first `moved` requests
/// and then echoes each request's body.
async fn moving_upstream(moved: usize) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let left = Arc::new(std::sync::atomic::AtomicUsize::new(moved));
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            let left = Arc::clone(&left);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                    let left = Arc::clone(&left);
                    async move {
                        let body = req.into_body().collect().await?.to_bytes();
                        let moved = left
                            .fetch_update(
                                std::sync::atomic::Ordering::SeqCst,
                                std::sync::atomic::Ordering::SeqCst,
                                |n| n.checked_sub(1),
                            )
                            .is_ok();
                        let mut resp = http::Response::new(Full::new(body));
                        if moved {
                            *resp.status_mut() = http::StatusCode::MISDIRECTED_REQUEST;
                        }
                        Ok::<_, hyper::Error>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    port
}

/// A 421 that comes after the request's decision deadline (the worker answered it
/// late) is decided again with a deadline of its own: the replay is served, not
/// answered 504 at once.
#[tokio::test]
async fn a_late_421_is_decided_again_with_its_own_deadline() {
    // The worker holds its first request past the decision deadline, then says 421.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap().port();
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (cp, mut calls) = Scripted::new();
    let (router, server) = serve(cp, &["--parked-request-budget", "100ms"]).await;
    let late = router.config().decision_timeout() + Duration::from_millis(300);
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            let first = Arc::clone(&first);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                    let first = Arc::clone(&first);
                    async move {
                        let body = req.into_body().collect().await?.to_bytes();
                        let mut resp = http::Response::new(Full::new(body));
                        if first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                            // The scenario's delay, not a synchronization.
                            tokio::time::sleep(late).await;
                            *resp.status_mut() = http::StatusCode::MISDIRECTED_REQUEST;
                        }
                        Ok::<_, hyper::Error>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    let small = pattern(1000, 6);
    let req = tokio::spawn(post(server.local_addr(), "p1", small.clone()));
    calls.next().await.running(upstream);
    let again = tokio::time::timeout(late * 2, calls.next()).await;
    again
        .expect("the replay asks for the actor")
        .running(upstream);
    let (status, body) = req.await.unwrap();
    assert_eq!((status, body == small), (200, true));
}

/// A worker's 421 (its actor moved) sends a small request through the pipeline again,
/// body and all, once; a request whose body was streamed (too large to hold), or one
/// that meets a second 421, gets 503 `actor moved` with Retry-After. No 421 reaches the
/// client.
#[tokio::test]
async fn a_moved_actor_is_resolved_again() {
    let upstream = moving_upstream(1).await;
    let (cp, mut calls) = Scripted::new();
    let (router, server) = serve(cp, &[]).await;
    let addr = server.local_addr();

    let small = pattern(1000, 3);
    let req = tokio::spawn(post(addr, "p1", small.clone()));
    calls.next().await.running(upstream);
    calls.next().await.running(upstream);
    let (status, body) = req.await.unwrap();
    assert_eq!((status, body == small), (200, true));
    assert_eq!(
        router
            .metrics()
            .sample("atenet_router_requests_replayed_total", &[]),
        1.0
    );

    let upstream = moving_upstream(2).await;
    let req = tokio::spawn(post(addr, "p2", small));
    calls.next().await.running(upstream);
    calls.next().await.running(upstream);
    let (status, body) = req.await.unwrap();
    assert_eq!(
        (status, String::from_utf8(body).unwrap().as_str()),
        (503, "actor demo/p2 unavailable: actor moved")
    );

    let upstream = moving_upstream(1).await;
    let big = pattern(100 * 1024, 4);
    let req = tokio::spawn(post(addr, "p3", big));
    calls.next().await.running(upstream);
    let (status, body) = req.await.unwrap();
    assert_eq!(
        (status, String::from_utf8(body).unwrap().as_str()),
        (503, "actor demo/p3 unavailable: actor moved")
    );
    assert!(
        calls.try_next().is_none(),
        "a streamed body is never replayed"
    );

    // A replay the pipeline denies: the request was counted routed when it was first
    // decided, and is counted once more only as answered after its route.
    let upstream = moving_upstream(1).await;
    let req = tokio::spawn(post(addr, "p4", pattern(1000, 5)));
    calls.next().await.running(upstream);
    calls
        .next()
        .await
        .fail(Code::NotFound, "actor demo/p4 not found");
    let (status, _) = req.await.unwrap();
    assert_eq!(status, 404);
    let m = router.metrics();
    assert_eq!(
        (
            m.sample("atenet_router_requests_total", &[]),
            m.sample("atenet_router_route_duration_seconds_count", &[]),
        ),
        (4.0, 4.0),
        "each of the four requests is decided once, replayed or not"
    );
    assert_eq!(
        m.sample(
            "atenet_router_requests_answered_after_route_total",
            &[("status", "404")]
        ),
        1.0
    );
}

/// What a client gets that declares a body of `declared` bytes, sends `sent` of it and
/// then nothing, with a 300 ms idle timeout.
async fn stalled_mid_body(declared: usize, sent: &[u8]) -> String {
    let upstream = collecting_upstream().await;
    let (_router, server) = serve_with(
        Arc::new(AlwaysRunning { port: upstream }),
        &[],
        Limits {
            idle_timeout: Duration::from_millis(300),
            ..Limits::default()
        },
    )
    .await;
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    s.write_all(
        format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n",
            host("p1")
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    s.write_all(sent).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut out))
        .await
        .expect("answered")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// A client that stalls in the middle of a small body (read whole before it is sent,
/// so that a 421 can replay it) gets the 504 verdict once no byte came for the idle
/// timeout, instead of holding the request (and a drain) for as long as it likes.
#[tokio::test]
async fn a_client_stalled_mid_body_gets_504_after_the_idle_timeout() {
    let text = stalled_mid_body(100, b"only ten b").await;
    assert!(text.starts_with("HTTP/1.1 504 "), "{text}");
    assert!(text.ends_with("actor demo/p1 request timed out"), "{text}");
}

/// A client that stalls in the middle of a large body (streamed to the worker as it
/// comes) gets the same 504 once no byte came for the idle timeout, and the worker's
/// connection is let go. Before, nothing bounded a streamed body: the request, a
/// worker connection and the actor's busy mark were held for good.
#[tokio::test]
async fn a_client_stalled_mid_streamed_body_gets_504_after_the_idle_timeout() {
    let text = stalled_mid_body(1024 * 1024, &pattern(100 * 1024, 7)).await;
    assert!(text.starts_with("HTTP/1.1 504 "), "{text}");
    assert!(text.ends_with("actor demo/p1 request timed out"), "{text}");
}

/// A small body that trickles in, each byte well within the idle timeout, still gets
/// the 504 verdict once it has taken longer than `small_body_within` in all: a client
/// cannot hold a request for as long as it likes one byte at a time.
#[tokio::test]
async fn a_trickling_small_body_gets_504_after_its_total_bound() {
    let upstream = collecting_upstream().await;
    let (_router, server) = serve_with(
        Arc::new(AlwaysRunning { port: upstream }),
        &[],
        Limits {
            idle_timeout: Duration::from_secs(30),
            small_body_within: Duration::from_millis(500),
            ..Limits::default()
        },
    )
    .await;
    let s = TcpStream::connect(server.local_addr()).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    wr.write_all(
        format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nContent-Length: 100\r\nConnection: close\r\n\r\n",
            host("p1")
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            // The client's own pace (the whole body would take 10 s), not a
            // synchronization.
            tokio::time::sleep(Duration::from_millis(100)).await;
            if wr.write_all(b"x").await.is_err() {
                break;
            }
        }
    });
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, rd.read_to_end(&mut out))
        .await
        .expect("answered before the body was whole")
        .unwrap();
    trickle.abort();
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 504 "), "{text}");
    assert!(text.ends_with("actor demo/p1 request timed out"), "{text}");
}

/// A small body that keeps coming, slowly, is read whole and delivered even when it
/// takes longer than the request's decision deadline: routed already, the request is
/// past deciding. Before, it got 504 at that deadline.
#[tokio::test]
async fn a_slow_small_upload_is_delivered_past_the_decision_deadline() {
    let upstream = collecting_upstream().await;
    let (router, server) = serve_with(
        Arc::new(AlwaysRunning { port: upstream }),
        &["--parked-request-budget", "100ms"],
        Limits {
            // Far above the client's pace below, so a loaded machine's delays do not
            // turn its gaps into stalls.
            idle_timeout: Duration::from_secs(5),
            ..Limits::default()
        },
    )
    .await;
    let gap = Duration::from_millis(700);
    let chunks = (router.config().decision_timeout().as_millis() / gap.as_millis() + 2) as usize;
    let body = pattern(chunks * 10, 3);
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    s.write_all(
        format!(
            "POST / HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            host("p1"),
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    for chunk in body.chunks(10) {
        // The client's own pace, not a synchronization.
        tokio::time::sleep(gap).await;
        s.write_all(chunk).await.unwrap();
    }
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut out))
        .await
        .expect("answered")
        .unwrap();
    assert!(
        out.starts_with(b"HTTP/1.1 200 "),
        "{}",
        String::from_utf8_lossy(&out)
    );
    assert!(out.ends_with(&body), "the whole body reached the worker");
}

/// A worker stand-in that answers with every `cookie` and `x-forwarded-for` field it
/// got, each list on its own line.
async fn header_echo_upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: http::Request<Incoming>| async move {
                    let all = |name: &str| {
                        req.headers()
                            .get_all(name)
                            .iter()
                            .map(|v| v.to_str().unwrap().to_owned())
                            .collect::<Vec<_>>()
                    };
                    let text = format!(
                        "cookie={:?}\nxff={:?}",
                        all("cookie"),
                        all("x-forwarded-for")
                    );
                    Ok::<_, hyper::Error>(http::Response::new(Full::new(Bytes::from(text))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    port
}

/// An HTTP/2 client's cookies, one field each as browsers send them, reach the
/// HTTP/1.1 worker in one field (RFC 9113 §8.2.3), and every `x-forwarded-for` field
/// a proxy in front added is kept, the router's peer after them.
#[tokio::test]
async fn http2_cookies_are_joined_and_every_forwarded_hop_kept() {
    let upstream = header_echo_upstream().await;
    let (_router, server) = serve(Arc::new(AlwaysRunning { port: upstream }), &[]).await;
    let tcp = TcpStream::connect(server.local_addr()).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/", host("p1")))
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .header("x-forwarded-for", "10.0.0.1")
        .header("x-forwarded-for", "10.0.0.2")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        String::from_utf8_lossy(&body),
        "cookie=[\"a=1; b=2\"]\nxff=[\"10.0.0.1, 10.0.0.2, 127.0.0.1\"]"
    );
}

/// A request sent again after a 421 holds its body while it waits: should it park, the
/// body counts against the lot's bytes (`--parked-bytes-max`) like any parked body, and
/// is given back once it is decided.
#[tokio::test]
async fn a_replay_that_parks_charges_its_body_to_the_lot() {
    let upstream = moving_upstream(1).await;
    let (cp, mut calls) = Scripted::new();
    let (router, server) = serve(cp, &[]).await;
    let body = pattern(1000, 5);
    let req = tokio::spawn(post(server.local_addr(), "p1", body.clone()));
    calls.next().await.running(upstream);
    // The replay finds no room and parks.
    calls.next().await.no_room();
    held_at_least(&router, 1000).await;
    calls.next().await.running(upstream);
    let (status, echoed) = req.await.unwrap();
    assert_eq!((status, echoed == body), (200, true));
    assert_eq!(router.lot().bytes().held(), 0, "given back");
}

/// A parked upload larger than the per-request limit (read no further past it) whose
/// flight ends in a verdict: the rest of the body is read and thrown away so that the
/// client, still sending, gets the 503 instead of a connection reset.
#[tokio::test]
async fn a_verdict_to_a_large_parked_upload_reaches_the_client() {
    let (cp, mut calls) = Scripted::new();
    let (_router, server) = serve(cp, &["--parked-request-budget", "300ms"]).await;
    let answering = tokio::spawn(async move {
        loop {
            calls.next().await.no_room();
        }
    });
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    let body = vec![7u8; 8 * 1024 * 1024];
    let head = format!(
        "POST /up HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n\r\n",
        host("p1"),
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body)
        .await
        .expect("the router reads the whole body, and does not reset the connection");
    let want = "actor demo/p1 unavailable: no worker has room for the actor";
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&out).contains(want) {
            let n = s.read(&mut buf).await.expect("no reset");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&out));
            out.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("the verdict arrives");
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 503 "));
    answering.abort();
}

/// The same at the drain's cut-off: the parked upload's 503 `router shutting down`
/// reaches the client still sending (before, the connection was closed with the body
/// unread, and the client saw a reset).
#[tokio::test]
async fn the_cut_off_verdict_to_a_large_parked_upload_reaches_the_client() {
    let (cp, mut calls) = Scripted::new();
    let (router, server) = serve(cp, &[]).await;
    let answering = tokio::spawn(async move {
        loop {
            calls.next().await.no_room();
        }
    });
    let s = TcpStream::connect(server.local_addr()).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let head = format!(
        "POST /up HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n\r\n",
        host("p1"),
        8 * 1024 * 1024
    );
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        wr.write_all(&vec![7u8; 8 * 1024 * 1024]).await?;
        Ok::<_, std::io::Error>(wr)
    });
    held_at_least(&router, 1 << 20).await;
    router.cut_off_waiting();
    let want = "actor demo/p1 unavailable: router shutting down";
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&out).contains(want) {
            let n = rd.read(&mut buf).await.expect("no reset");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&out));
            out.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("the verdict arrives");
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 503 "));
    let _wr = writer
        .await
        .unwrap()
        .expect("the router read the whole body, and did not reset the connection");
    answering.abort();
}

/// A request sent through the pipeline again after its worker's 421 is never shed: it
/// parks again even with the lot full (here, one place, taken by another request), is
/// served, and its wait is sampled once.
#[tokio::test]
async fn a_request_sent_again_after_a_421_is_never_shed() {
    let upstream = moving_upstream(1).await;
    let (cp, mut calls) = Scripted::new();
    let (router, server) = serve(cp, &["--parked-request-max", "1"]).await;
    let addr = server.local_addr();
    let body = pattern(100, 6);
    let first = tokio::spawn(post(addr, "p1", body.clone()));
    calls.next().await.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "p1 parked");
    calls.next().await.running(upstream);
    // The worker answered 421: p1 is decided again.
    let again = calls.next().await;
    assert_eq!(again.request.actor.to_string(), "demo/p1");
    // Meanwhile p2 takes the lot's one place.
    let second = tokio::spawn(post(addr, "p2", Vec::new()));
    let p2 = calls.next().await;
    assert_eq!(p2.request.actor.to_string(), "demo/p2");
    p2.no_room();
    assert!(router.lot().wait_for_active(1, WAIT).await, "p2 parked");
    again.no_room();
    assert!(
        router.lot().wait_for_active(2, WAIT).await,
        "p1 parked again, beyond the lot's size"
    );
    // Both flights retry: serve them.
    for _ in 0..2 {
        calls.next().await.running(upstream);
    }
    let (status, echoed) = first.await.unwrap();
    assert_eq!((status, echoed == body), (200, true));
    assert_eq!(second.await.unwrap().0, 200);
    let waits = router.metrics().sample(
        "atenet_router_parking_wait_duration_seconds_count",
        &[("outcome", "served")],
    );
    assert_eq!(waits, 2.0, "one wait sample per parked request");
}

/// Sends `head` and then `len` bytes of body on one HTTP/1.1 connection, writing and
/// reading at once, and returns what came back until `want` was read. Panics on a
/// reset: the client, still sending, must get the answer.
async fn upload_answered(addr: SocketAddr, head: String, len: usize, want: &str) -> String {
    let s = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        wr.write_all(&vec![7u8; len]).await?;
        Ok::<_, std::io::Error>(wr)
    });
    let mut out = Vec::new();
    let read = tokio::time::timeout(WAIT, async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&out).contains(want) {
            let n = rd.read(&mut buf).await.expect("no reset");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&out));
            out.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    let out = String::from_utf8_lossy(&out).into_owned();
    assert!(read.is_ok(), "the verdict arrives: {out}");
    let _wr = writer
        .await
        .unwrap()
        .expect("the router read the whole body, and did not reset the connection");
    out
}

/// A verdict decided without parking (parking disabled, an unknown actor, too many
/// headers) to a large upload the client is still sending: the rest of the body is read
/// and thrown away first, so the client gets the answer instead of a connection reset.
#[tokio::test]
async fn an_immediate_verdict_to_a_large_upload_reaches_the_client() {
    let (cp, mut calls) = Scripted::new();
    let limits = Limits {
        max_headers: 20,
        ..Limits::default()
    };
    let (_router, server) = serve_with(cp, &["--parked-request-max", "0"], limits).await;
    let answering = tokio::spawn(async move {
        loop {
            let call = calls.next().await;
            if call.request.actor.to_string() == "demo/gone" {
                call.fail(tonic::Code::NotFound, "actor demo/gone not found");
            } else {
                call.no_room();
            }
        }
    });
    let len = 8 * 1024 * 1024;
    let head = |name: &str, extra: &str| {
        format!(
            "POST /up HTTP/1.1\r\nHost: {}\r\nContent-Length: {len}\r\n{extra}\r\n",
            host(name)
        )
    };
    let addr = server.local_addr();
    let full = upload_answered(
        addr,
        head("p1", ""),
        len,
        "no worker has room for the actor",
    )
    .await;
    assert!(full.starts_with("HTTP/1.1 503 "), "{full}");
    let gone = upload_answered(addr, head("gone", ""), len, "not found").await;
    assert!(gone.starts_with("HTTP/1.1 404 "), "{gone}");
    let many: String = (0..30).map(|i| format!("x-h{i}: v\r\n")).collect();
    let headers = upload_answered(addr, head("p1", &many), len, "too many request header").await;
    assert!(headers.starts_with("HTTP/1.1 431 "), "{headers}");
    answering.abort();
}

/// A request that waits for `100 Continue` and is answered at once gets the answer
/// with no `100 Continue` first: its body is never asked for.
#[tokio::test]
async fn an_immediate_verdict_does_not_ask_for_an_expected_body() {
    let (cp, mut calls) = Scripted::new();
    let (_router, server) = serve(cp, &["--parked-request-max", "0"]).await;
    let answering = tokio::spawn(async move {
        loop {
            calls.next().await.no_room();
        }
    });
    let mut s = TcpStream::connect(server.local_addr()).await.unwrap();
    let head = format!(
        "POST /up HTTP/1.1\r\nHost: {}\r\nContent-Length: 1048576\r\nExpect: 100-continue\r\n\r\n",
        host("p1")
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut out))
        .await
        .expect("answered and closed")
        .expect("no reset");
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 503 "), "{out}");
    assert!(!out.contains("100 Continue"), "{out}");
    answering.abort();
}

/// A routed upload whose worker cannot be reached: the data plane's 502 reaches the
/// client still sending (the body is read and thrown away first), not a reset.
#[tokio::test]
async fn a_502_to_a_large_upload_reaches_the_client() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (_router, server) = serve(Arc::new(AlwaysRunning { port: closed }), &[]).await;
    let len = 8 * 1024 * 1024;
    let head = format!(
        "POST /up HTTP/1.1\r\nHost: {}\r\nContent-Length: {len}\r\n\r\n",
        host("p1")
    );
    let out = upload_answered(server.local_addr(), head, len, "unreachable").await;
    assert!(out.starts_with("HTTP/1.1 502 "), "{out}");
}
