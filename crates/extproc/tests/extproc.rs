//! A real tonic ext_proc client drives the real server over loopback.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ImmediateResponse, ProcessingRequest, ProcessingResponse,
    external_processor_client::ExternalProcessorClient, processing_request::Request as In,
    processing_response::Response as Out,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;
use valet_extproc::ExtProcServer;
use valet_router::control::ResumeError;
use valet_router::testing::{Calls, Scripted};
use valet_router::{ControlPlane, GrpcControlPlane, Metrics, Router, RouterArgs};

const DOMAIN: &str = "actors.resources.substrate.ate.dev";

async fn serve(
    flags: &[&str],
    cp: Arc<dyn ControlPlane>,
) -> (Router, ExternalProcessorClient<Channel>) {
    let (router, client, server) = serve_kept(flags, cp).await;
    std::mem::forget(server);
    (router, client)
}

/// [`serve`], with the server for the test to close.
async fn serve_kept(
    flags: &[&str],
    cp: Arc<dyn ControlPlane>,
) -> (Router, ExternalProcessorClient<Channel>, ExtProcServer) {
    let config = RouterArgs::try_parse_flags(flags)
        .unwrap()
        .resolve()
        .unwrap();
    let router = Router::new(Arc::new(config), cp, Arc::new(Metrics::new()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = ExtProcServer::spawn(listener, router.clone()).unwrap();
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", server.local_addr()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    (router, ExternalProcessorClient::new(channel), server)
}

async fn scripted(flags: &[&str]) -> (Router, ExternalProcessorClient<Channel>, Calls) {
    let (cp, calls) = Scripted::new();
    let (router, client) = serve(flags, cp).await;
    (router, client, calls)
}

struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(client: &ExternalProcessorClient<Channel>) -> Self {
        let (tx, rx) = mpsc::channel(4);
        let rx = client
            .clone()
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx }
    }

    async fn send(&self, request: In) {
        self.tx
            .send(ProcessingRequest {
                request: Some(request),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    async fn headers(&self, authority: &str) {
        self.send(In::RequestHeaders(headers(&[
            (":method", "GET"),
            (":path", "/x?token=secret"),
            (":authority", authority),
        ])))
        .await;
    }

    async fn next(&mut self) -> Out {
        self.rx.message().await.unwrap().unwrap().response.unwrap()
    }
}

fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream: true,
        ..Default::default()
    }
}

fn host(name: &str) -> String {
    format!("{name}.demo.{DOMAIN}")
}

fn header<'a>(imm: &'a ImmediateResponse, key: &str) -> Option<&'a HeaderValue> {
    let set = &imm.headers.as_ref()?.set_headers;
    set.iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == key)
}

/// Checks an immediate response: status, body, content-type and Retry-After, all set
/// through raw_value.
fn check_immediate(out: Out, status: i32, body: &str, retry_after: bool) {
    let Out::ImmediateResponse(imm) = out else {
        panic!("want an ImmediateResponse, got {out:?}")
    };
    assert_eq!(imm.status.unwrap().code, status);
    assert_eq!(String::from_utf8(imm.body.clone()).unwrap(), body);
    let ct = header(&imm, "content-type").expect("content-type");
    assert!(ct.value.is_empty());
    assert_eq!(ct.raw_value, b"text/plain; charset=utf-8");
    match header(&imm, "retry-after") {
        Some(h) => {
            assert!(retry_after, "unexpected Retry-After on {status} {body}");
            assert!(h.value.is_empty());
            assert_eq!(h.raw_value, b"1");
        }
        None => assert!(!retry_after, "missing Retry-After on {status} {body}"),
    }
}

#[tokio::test]
async fn routed_mutation_sets_one_authority_through_raw_value() {
    let (router, client, mut calls) = scripted(&[]).await;
    let mut s = Stream::open(&client).await;
    s.headers(&host("p1")).await;
    calls.next().await.running(9001);
    let Out::RequestHeaders(h) = s.next().await else {
        panic!("want a HeadersResponse")
    };
    let mutation = h.response.unwrap().header_mutation.unwrap();
    let authorities: Vec<_> = mutation
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .filter(|h| h.key == ":authority")
        .collect();
    assert_eq!(authorities.len(), 1);
    assert!(authorities[0].value.is_empty(), "raw_value only");
    assert_eq!(authorities[0].raw_value, b"127.0.0.1:9001");
    let actor_ref = mutation
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == "x-actor-ref")
        .unwrap();
    assert_eq!(actor_ref.raw_value, b"demo/p1");
    assert!(actor_ref.value.is_empty());
    // Nothing else is asked of the stream: the router ends it cleanly with its answer
    // (Envoy then goes on without the server) before Envoy's side has closed.
    let end = tokio::time::timeout(std::time::Duration::from_secs(10), s.rx.message())
        .await
        .expect("the router ends the stream after its answer");
    assert!(end.unwrap().is_none(), "the stream ended OK");
    // The status page keeps the request without its query string.
    let recent = router.recent_requests();
    assert_eq!(recent[0].data_plane, "extproc");
    assert_eq!(recent[0].path, "/x");
}

#[tokio::test]
async fn every_verdict_row() {
    let (_router, client, mut calls) = scripted(&["--parked-request-budget", "200ms"]).await;
    let cases: Vec<(ResumeError, i32, &str, bool)> = vec![
        (
            ResumeError::new(Code::NotFound, "x"),
            404,
            "actor demo/a not found",
            false,
        ),
        (
            ResumeError::crashed(
                "AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)",
            ),
            503,
            "actor demo/a unavailable: AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)",
            false,
        ),
        (
            ResumeError::new(Code::DeadlineExceeded, "x"),
            504,
            "actor demo/a request timed out",
            false,
        ),
        (
            ResumeError::new(Code::PermissionDenied, "x"),
            403,
            "actor demo/a access denied",
            false,
        ),
        (
            ResumeError::new(Code::Unauthenticated, "x"),
            401,
            "actor demo/a authentication required",
            false,
        ),
        (
            ResumeError::new(Code::Internal, "secret"),
            500,
            "error resuming actor demo/a",
            false,
        ),
    ];
    for (err, status, body, retry_after) in cases {
        let mut s = Stream::open(&client).await;
        s.headers(&host("a")).await;
        calls.next().await.answer(Err(err));
        check_immediate(s.next().await, status, body, retry_after);
    }
    // Budget exhausted on each retryable code.
    for (code, msg, body) in [
        (
            Code::ResourceExhausted,
            "no worker has room for the actor",
            "actor demo/b unavailable: no worker has room for the actor",
        ),
        (
            Code::FailedPrecondition,
            "actor is SUSPENDING",
            "actor demo/b unavailable: actor is SUSPENDING",
        ),
        (
            Code::Unavailable,
            "connection refused",
            "actor demo/b unavailable",
        ),
        (
            Code::Aborted,
            "another operation is in progress for this actor",
            "actor demo/b unavailable: another operation is in progress for this actor",
        ),
    ] {
        let mut s = Stream::open(&client).await;
        s.headers(&host("b")).await;
        let answer = async {
            loop {
                calls.next().await.fail(code, msg);
            }
        };
        let out = tokio::select! {
            out = s.next() => out,
            () = answer => unreachable!(),
        };
        check_immediate(out, 503, body, true);
        while let Some(c) = calls.try_next() {
            c.fail(code, msg);
        }
    }
    // Invalid host: no call.
    let mut s = Stream::open(&client).await;
    s.headers("p1.demo.example.com").await;
    check_immediate(
        s.next().await,
        404,
        &format!("invalid host \"p1.demo.example.com\": not under the actor domain {DOMAIN}"),
        false,
    );
}

#[tokio::test]
async fn lot_full_and_host_header_precedence() {
    let (router, client, mut calls) = scripted(&["--parked-request-max", "1"]).await;
    let mut parked = Stream::open(&client).await;
    parked.headers(&host("a")).await;
    calls.next().await.no_room();
    let mut shed = Stream::open(&client).await;
    // `host` after `:authority` wins, as upstream.
    shed.send(In::RequestHeaders(headers(&[
        (":authority", "ignored.example"),
        ("host", &host("a")),
    ])))
    .await;
    check_immediate(
        shed.next().await,
        503,
        "actor demo/a unavailable: router at capacity",
        true,
    );
    assert_eq!(router.lot().active(), 1);
    let retry = calls.next().await;
    retry.running(9002);
    assert!(matches!(parked.next().await, Out::RequestHeaders(_)));
}

/// Messages other than request headers get the response of their own type.
#[tokio::test]
async fn other_messages_get_their_own_response_type() {
    let (_router, client, _calls) = scripted(&[]).await;
    let mut s = Stream::open(&client).await;
    s.send(In::RequestBody(HttpBody::default())).await;
    assert!(matches!(s.next().await, Out::RequestBody(_)));
    s.send(In::ResponseHeaders(HttpHeaders::default())).await;
    assert!(matches!(s.next().await, Out::ResponseHeaders(_)));
    s.send(In::ResponseBody(HttpBody::default())).await;
    assert!(matches!(s.next().await, Out::ResponseBody(_)));
    s.send(In::RequestTrailers(HttpTrailers::default())).await;
    assert!(matches!(s.next().await, Out::RequestTrailers(_)));
    s.send(In::ResponseTrailers(HttpTrailers::default())).await;
    assert!(matches!(s.next().await, Out::ResponseTrailers(_)));
    // A message with no request at all closes the stream with a clear status.
    s.tx.send(ProcessingRequest::default()).await.unwrap();
    let e = s.rx.message().await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
}

/// Many streams parked on a full pool are released when a worker frees; a stream that
/// ends while parked frees its slot and records `canceled`. Against the real control
/// plane and a real worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_streams_released_when_a_worker_frees() {
    use valet_embedded::{Embedded, EmbeddedConfig};
    use valet_proto::ateapi::{self, control_client::ControlClient};
    let dir = tempfile::tempdir().unwrap();
    let embedded = Embedded::start(EmbeddedConfig::counter(dir.path().join("data"), 1))
        .await
        .unwrap();
    let cp_addr = embedded.addr;
    let worker = &embedded.workers[0];
    let mut ctl = ControlClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{cp_addr}"))
            .unwrap()
            .connect_lazy(),
    );
    ctl.create_atespace(ateapi::CreateAtespaceRequest {
        name: "demo".into(),
    })
    .await
    .unwrap();
    for a in ["p1", "p2"] {
        ctl.create_actor(ateapi::CreateActorRequest {
            actor_ref: Some(ateapi::ActorRef {
                atespace: "demo".into(),
                name: a.into(),
            }),
            actor_template_namespace: "default".into(),
            actor_template_name: "counter".into(),
            worker_selector: None,
        })
        .await
        .unwrap();
    }
    let url = format!("http://{cp_addr}");
    let cp = Arc::new(GrpcControlPlane::connect_lazy(&url, &Default::default()).unwrap());
    let (router, client) = serve(
        &["--control-plane", &url, "--parked-request-budget", "20s"],
        cp,
    )
    .await;

    let mut first = Stream::open(&client).await;
    first.headers(&host("p1")).await;
    assert!(matches!(first.next().await, Out::RequestHeaders(_)));

    let mut parked = Vec::new();
    for _ in 0..20 {
        let s = Stream::open(&client).await;
        s.headers(&host("p2")).await;
        parked.push(s);
    }
    let gone = Stream::open(&client).await;
    gone.headers(&host("p2")).await;
    assert!(
        router
            .lot()
            .wait_for_active(21, Duration::from_secs(10))
            .await
    );

    drop(gone);
    assert!(
        router
            .lot()
            .wait_for_active(20, Duration::from_secs(10))
            .await
    );
    assert_eq!(
        router.metrics().sample(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "canceled")]
        ),
        1.0
    );

    ctl.suspend_actor(ateapi::SuspendActorRequest {
        actor_ref: Some(ateapi::ActorRef {
            atespace: "demo".into(),
            name: "p1".into(),
        }),
    })
    .await
    .unwrap();
    for mut s in parked {
        let Out::RequestHeaders(h) = s.next().await else {
            panic!("want a route")
        };
        let set = h.response.unwrap().header_mutation.unwrap().set_headers;
        assert_eq!(
            set[0].header.as_ref().unwrap().raw_value,
            worker.app_addr().to_string().as_bytes()
        );
    }
    assert_eq!(router.lot().active(), 0);
    assert_eq!(
        router.metrics().sample(
            "atenet_router_parking_wait_duration_seconds_count",
            &[("outcome", "served")]
        ),
        20.0
    );
}

/// A decision that outlasts the budget (an attempt in progress is not cut short, and a
/// restore may run long) is answered with the router's own 504 before Envoy's
/// `message_timeout` (`budget + 5s`, counted from before the router saw the headers)
/// would end the request with a reply of Envoy's.
#[tokio::test(start_paused = true)]
async fn a_slow_decision_gets_the_routers_504_before_envoy_gives_up() {
    let (router, client, mut calls) = scripted(&["--parked-request-budget", "1s"]).await;
    let message_timeout = router.config().decision_timeout();
    let mut s = Stream::open(&client).await;
    let sent = tokio::time::Instant::now();
    s.headers(&host("a")).await;
    // The control plane never answers this attempt.
    let _held = calls.next().await;
    check_immediate(s.next().await, 504, "actor demo/a request timed out", false);
    let took = sent.elapsed();
    assert!(
        took < message_timeout && took >= router.config().extproc_decision_timeout(),
        "answered after {took:?}; Envoy gives up at {message_timeout:?}"
    );
}

/// A message the server cannot read (here larger than its 1 MiB limit) ends the stream
/// with an error, never cleanly without an answer: Envoy takes a clean end as "go on
/// unmodified", which would let the request through unrouted.
#[tokio::test]
async fn an_unreadable_message_ends_the_stream_with_an_error() {
    let (_router, client, _calls) = scripted(&[]).await;
    let mut s = Stream::open(&client).await;
    let big = "x".repeat(1100 * 1024);
    s.send(In::RequestHeaders(headers(&[
        (":method", "GET"),
        (":path", "/"),
        (":authority", &host("a")),
        ("x-big", &big),
    ])))
    .await;
    let end = s.rx.message().await;
    assert!(end.is_err(), "an error status, not a clean end: {end:?}");
}

/// A stream still open when the server closes (its request headers not even sent)
/// ends with an error status, never cleanly without an answer, which Envoy would take
/// as "go on unmodified".
#[tokio::test]
async fn a_stream_open_at_close_ends_with_an_error() {
    let (cp, _calls) = Scripted::new();
    let (_router, client, mut server) = serve_kept(&[], cp).await;
    let mut s = Stream::open(&client).await;
    server.close().await;
    let end = s.rx.message().await;
    assert!(
        end.as_ref()
            .is_err_and(|e| e.code() == tonic::Code::Unavailable),
        "an error status, not a clean end: {end:?}"
    );
}

/// A stream that never sends its request headers (Envoy sends them as it opens one,
/// and gives up after its message_timeout) ends with an error once that time has
/// passed: it holds no memory, and no drain, for ever.
#[tokio::test(start_paused = true)]
async fn a_stream_that_sends_nothing_ends() {
    let (cp, _calls) = Scripted::new();
    let (router, client, server) = serve_kept(&["--parked-request-budget", "1s"], cp).await;
    let mut s = Stream::open(&client).await;
    let end = tokio::time::timeout(router.config().decision_timeout() * 2, s.rx.message())
        .await
        .expect("the stream ends");
    assert!(
        end.as_ref()
            .is_err_and(|e| e.code() == tonic::Code::DeadlineExceeded),
        "an error status: {end:?}"
    );
    assert_eq!(server.open_streams(), 0);
    drop(s);
}

/// A client that connects and never sends the HTTP/2 preface is closed after 10 s
/// (before, hyper waited for it without a deadline, holding the connection and its
/// place in the listener's budget for good).
#[tokio::test(start_paused = true)]
async fn a_connection_that_never_sends_its_preface_is_closed() {
    use tokio::io::AsyncReadExt as _;
    let (cp, _calls) = Scripted::new();
    let config = RouterArgs::try_parse_flags::<[&str; 0], &str>([])
        .unwrap()
        .resolve()
        .unwrap();
    let router = Router::new(Arc::new(config), cp, Arc::new(Metrics::new()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut server = ExtProcServer::spawn(listener, router).unwrap();
    let mut silent = tokio::net::TcpStream::connect(server.local_addr())
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match silent.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "still open after 60 s");
    assert!(
        started.elapsed() >= Duration::from_secs(10),
        "not before 10 s"
    );
    server.close().await;
}
