//! Bearer tokens on the control plane's long streams: a worker's `Attach` stream and a
//! router's lease watch are authenticated when they open, so the plane ends each one
//! when its token expires, unless the worker renewed a fresh token in band; a refused
//! fresh token does not extend the stream. A real control plane over TLS with JWT
//! verification (no clock-skew leeway, so a token expires within seconds), real gRPC
//! clients and a real worker.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status, Streaming};
use valet_control::auth::{JwtVerifier, ServerSecurity, server_tls};
use valet_control::{Plane, PlaneConfig, SqliteStore};
use valet_proto::auth::{ClientCredentials, ClientTlsFiles, CpChannel, tcp_connector};
use valet_proto::leases::{self as lp, leases_client::LeasesClient};
use valet_proto::reload::Reloading;
use valet_proto::worker::{
    self as wk, WorkerCommand, worker_command::Command, worker_event::Event,
    workers_client::WorkersClient,
};
use valet_worker::{Worker, WorkerConfig};

/// Longer than any token here lives.
const WITHIN: Duration = Duration::from_secs(15);

/// A control plane requiring TLS and bearer tokens signed by `signing`.
struct Secured {
    plane: Plane,
    url: String,
    ca: PathBuf,
    signing: EncodingKey,
    dir: tempfile::TempDir,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A token signed by `key` that expires `secs` from now.
fn token(key: &EncodingKey, secs: u64) -> String {
    let claims = serde_json::json!({"aud": "valet", "iss": "test", "exp": now() + secs});
    jsonwebtoken::encode(&Header::new(Algorithm::ES256), &claims, key).unwrap()
}

fn ec_key() -> (EncodingKey, String) {
    let pair = KeyPair::generate().unwrap();
    (
        EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap(),
        pair.public_key_pem(),
    )
}

/// `plane` served on `listener` with `security` until `stop`.
fn serving(
    listener: tokio::net::TcpListener,
    plane: &Plane,
    stop: &CancellationToken,
    security: ServerSecurity,
) -> tokio::task::JoinHandle<()> {
    let (plane, stop) = (plane.clone(), stop.clone());
    tokio::spawn(async move {
        valet_control::serve(
            listener,
            plane,
            stop.cancelled_owned(),
            Duration::from_secs(5),
            security,
        )
        .await
        .unwrap();
    })
}

impl Secured {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let server_key = KeyPair::generate().unwrap();
        let server_cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&server_key, &ca)
            .unwrap();
        let cert = write(dir.path(), "server.pem", &server_cert.pem());
        let key = write(dir.path(), "server.key", &server_key.serialize_pem());
        let ca_file = write(dir.path(), "ca.pem", &ca.as_ref().pem());
        let (signing, public) = ec_key();
        let public = write(dir.path(), "jwt.pub.pem", &public);
        let verifier =
            JwtVerifier::from_public_key_file(&public, Some("valet".into()), Some("test".into()))
                .unwrap()
                .with_leeway(Duration::ZERO);
        let security = ServerSecurity {
            tls: Some(server_tls(&cert, &key, None).unwrap()),
            jwt: Some(Reloading::fixed("JWT verification keys", verifier)),
        };
        let store = SqliteStore::open(&dir.path().join("data")).unwrap();
        let plane = Plane::open(Arc::new(store), PlaneConfig::default())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        let server = serving(listener, &plane, &stop, security);
        Self {
            plane,
            url,
            ca: ca_file,
            signing,
            dir,
            stop,
            server,
        }
    }

    /// Credentials that present the token in `name` (written with `token`).
    fn credentials(&self, name: &str, token: &str) -> (ClientCredentials, PathBuf) {
        let file = write(self.dir.path(), name, token);
        let files = ClientTlsFiles {
            ca: self.ca.clone(),
            identity: None,
            server_name: None,
        };
        (ClientCredentials::tls(&files, Some(&file)).unwrap(), file)
    }

    fn channel(&self, creds: &ClientCredentials) -> CpChannel {
        creds.connect_lazy(&creds.endpoint(&self.url).unwrap(), tcp_connector())
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WITHIN, self.server)
            .await
            .expect("the server stops")
            .unwrap();
    }
}

/// A worker's stream, driven by the test.
struct Attached {
    tx: mpsc::Sender<wk::WorkerEvent>,
    inbound: Streaming<WorkerCommand>,
}

impl Attached {
    /// Attaches worker `id` and reads its Welcome.
    async fn open(channel: CpChannel, id: &str) -> Self {
        let (tx, rx) = mpsc::channel(8);
        tx.send(wk::WorkerEvent {
            event: Some(Event::Join(wk::Join {
                worker_id: id.into(),
                pool: "counter".into(),
                app_address: "127.0.0.1:9".into(),
                ..Default::default()
            })),
        })
        .await
        .unwrap();
        let mut inbound = WorkersClient::new(channel)
            .attach(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let first = inbound.message().await.unwrap().unwrap();
        assert!(
            matches!(first.command, Some(Command::Welcome(_))),
            "{first:?}"
        );
        Self { tx, inbound }
    }

    /// Renews with `token` (empty: none) and waits for the answer.
    async fn renew(&mut self, seq: u64, token: &str) -> Result<(), Status> {
        self.tx
            .send(wk::WorkerEvent {
                event: Some(Event::Renew(wk::Renew {
                    seq,
                    bearer_token: token.into(),
                })),
            })
            .await
            .map_err(|_| Status::internal("stream closed"))?;
        match self.next_command().await {
            Some(Command::Renewed(r)) if r.seq == seq => Ok(()),
            other => panic!("renewal {seq} answered with {other:?}"),
        }
    }

    /// The next command (bounded wait); panics on the stream's error.
    async fn next_command(&mut self) -> Option<Command> {
        tokio::time::timeout(WITHIN, self.inbound.message())
            .await
            .expect("an answer in time")
            .unwrap()
            .and_then(|c| c.command)
    }

    /// How the stream ends, waiting (bounded) for it.
    async fn end(mut self) -> Status {
        tokio::time::timeout(WITHIN, async {
            loop {
                match self.inbound.message().await {
                    Ok(Some(_)) => {}
                    Ok(None) => return Status::ok("ended without an error"),
                    Err(status) => return status,
                }
            }
        })
        .await
        .expect("the stream ends in time")
    }
}

fn assert_expired(status: &Status, what: &str) {
    assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
    assert!(
        status.message().starts_with("bearer token expired"),
        "{what}: {status:?}"
    );
}

/// Three workers attach with a token that expires in 6 s (a few seconds, so that
/// setting up fits well within it on a loaded machine): the one that renews nothing
/// and the one whose fresh token is refused are cut off at the expiry; the one that
/// renewed a valid fresh token stays attached after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stream_ends_at_its_tokens_expiry_unless_it_renews_a_valid_one() {
    let s = Secured::start().await;
    let (creds, _) = s.credentials("short", &token(&s.signing, 6));
    let plain = Attached::open(s.channel(&creds), "plain").await;
    let mut renewed = Attached::open(s.channel(&creds), "renewed").await;
    let mut refused = Attached::open(s.channel(&creds), "refused").await;
    assert_eq!(s.plane.pool("counter"), (3, 3));

    renewed.renew(1, &token(&s.signing, 3600)).await.unwrap();
    let (stranger, _) = ec_key();
    // Signed by a key the plane does not trust: the renewal is still answered (the
    // hosting lease is a separate matter), the token is not taken.
    refused.renew(1, &token(&stranger, 3600)).await.unwrap();

    assert_expired(&plain.end().await, "no renewed token");
    assert_expired(&refused.end().await, "a refused renewed token");
    // The first token has expired on the server (the streams above ended): the
    // renewed stream still lives, and the plane still counts its worker.
    renewed.renew(2, "").await.unwrap();
    assert_eq!(s.plane.pool("counter"), (1, 1));
    drop(renewed);
    s.stop().await;
}

/// A router's lease watch ends at its token's expiry with `Unauthenticated` (the
/// router then watches again, with the token in its file by then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_watch_ends_at_its_tokens_expiry() {
    let s = Secured::start().await;
    let (creds, _) = s.credentials("short", &token(&s.signing, 4));
    let (tx, rx) = mpsc::channel(4);
    tx.send(lp::RouterMessage {
        message: Some(lp::router_message::Message::Hello(lp::Hello {
            router_id: "r1".into(),
        })),
    })
    .await
    .unwrap();
    let mut inbound = LeasesClient::new(s.channel(&creds))
        .watch(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let welcome = inbound.message().await.unwrap().unwrap();
    assert!(
        matches!(
            welcome.message,
            Some(lp::plane_message::Message::Welcome(_))
        ),
        "{welcome:?}"
    );
    let end = tokio::time::timeout(WITHIN, inbound.message())
        .await
        .expect("the watch ends in time");
    assert_expired(&end.unwrap_err(), "the lease watch");
    drop(tx);
    s.stop().await;
}

/// A real worker whose token file is rotated after it attached renews the new token in
/// band and keeps its one attachment past the first token's expiry. The clock is a
/// stream that attached with a token expiring later and renews nothing: once it is cut
/// off, the worker's first token is at least three seconds past its expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_worker_renews_its_rotated_token_and_stays_attached() {
    let s = Secured::start().await;
    let (creds, file) = s.credentials("worker-token", &token(&s.signing, 6));
    let worker = Worker::spawn(WorkerConfig {
        credentials: creds,
        control_plane: s.url.clone(),
        pool: "counter".into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        snapshot_dir: s.dir.path().join("snapshots"),
        restore_delay: Duration::ZERO,
        worker_id: Some("w1".into()),
        advertise: None,
        templates: Default::default(),
        run_dir: s.dir.path().join("snapshots").with_file_name("run"),
        snapshot_max_bytes: valet_worker::DEFAULT_SNAPSHOT_MAX_BYTES,
        cgroup: None,
    })
    .await
    .unwrap();
    assert!(
        s.plane
            .wait_until(WITHIN, |p| p.pool("counter") == (1, 1))
            .await,
        "the worker attaches"
    );
    // Rotated as Kubernetes does it: the new file replaces the old one at once.
    let next = write(s.dir.path(), "worker-token.next", &token(&s.signing, 3600));
    std::fs::rename(next, &file).unwrap();

    let (clock, _) = s.credentials("clock", &token(&s.signing, 10));
    assert_expired(
        &Attached::open(s.channel(&clock), "clock").await.end().await,
        "the clock stream",
    );
    assert_eq!(
        s.plane.stats().attachments,
        2,
        "the worker attached once (and the clock stream once)"
    );
    assert_eq!(s.plane.pool("counter"), (1, 1));
    worker.shutdown().await;
    s.stop().await;
}

/// Reflection answers only a caller with a valid token, as every other service: before,
/// it described the schema to anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_needs_a_token_too() {
    use tokio_stream::StreamExt;
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest,
    };
    let cp = Secured::start().await;
    let list = |channel: CpChannel| async move {
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = ServerReflectionClient::new(channel)
            .server_reflection_info(tokio_stream::iter([req]))
            .await?
            .into_inner();
        answers.next().await.expect("an answer").map(drop)
    };
    let anonymous = ClientCredentials::tls(
        &ClientTlsFiles {
            ca: cp.ca.clone(),
            identity: None,
            server_name: None,
        },
        None,
    )
    .unwrap();
    let refused = list(cp.channel(&anonymous)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    let (signed, _) = cp.credentials("token", &token(&cp.signing, 600));
    list(cp.channel(&signed))
        .await
        .expect("answered with a token");
    cp.stop().await;
}

/// A connection that never sends the HTTP/2 preface (hyper's server would wait for it
/// for good, holding the connection) is closed 10 s after it was accepted: in plain
/// text, after part of the preface, and after a TLS handshake.
#[tokio::test(start_paused = true)]
async fn a_connection_that_never_sends_its_preface_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    async fn closed_within(mut s: impl tokio::io::AsyncRead + Unpin, what: &str) {
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 256];
        let read_to_end = async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), read_to_end)
            .await
            .unwrap_or_else(|_| panic!("{what}: still open after 60 s"));
        assert!(
            started.elapsed() >= Duration::from_secs(10),
            "{what}: not before 10 s"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("data")).unwrap();
    let plane = Plane::open(Arc::new(store), PlaneConfig::default())
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let server = serving(listener, &plane, &stop, ServerSecurity::default());
    let silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    closed_within(silent, "silent").await;
    let mut partial = tokio::net::TcpStream::connect(addr).await.unwrap();
    partial.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    closed_within(partial, "part of the preface").await;
    stop.cancel();
    server.await.unwrap();
}

/// Over TLS too: the preface's 10 s start after the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_that_never_sends_its_preface_is_closed() {
    use tokio::io::AsyncReadExt;
    use tokio_rustls::rustls;
    let cp = Secured::start().await;
    let addr = cp.url.trim_start_matches("https://").to_owned();
    let mut roots = rustls::RootCertStore::empty();
    for cert in valet_proto::auth::pem_certificates(&cp.ca).unwrap() {
        roots.add(cert).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("127.0.0.1".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "still open 30 s after the handshake");
    cp.stop.cancel();
}
