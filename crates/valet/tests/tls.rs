//! TLS and bearer tokens between router, workers and control plane, across real
//! processes with certificates and keys generated here (rcgen): mTLS with and without
//! a client certificate, a wrong CA (each attempt `Unavailable`, the request parks and
//! gets the budget's 503), and JWTs: bad ones get the 401 verdict and are not
//! retried; a token file swapped by symlink is used at the next call.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{DOMAIN, Proc, eventually, http_get};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_proto::auth::{ClientCredentials, ClientTlsFiles, CpChannel};

const WITHIN: Duration = Duration::from_secs(30);

/// Certificates and keys, as PEM files in a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    other_ca: PathBuf,
    jwt_private: Vec<u8>,
    jwt_public: PathBuf,
    /// Private keys made later in a test (PEM), for [`assert_no_secrets`].
    extra_keys: std::sync::Mutex<Vec<String>>,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A certificate for `names` signed by `authority`, and its key, as PEM.
fn leaf(authority: &CertifiedIssuer<'static, KeyPair>, names: &[&str]) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let cert = CertificateParams::new(names)
        .unwrap()
        .signed_by(&key, authority)
        .unwrap();
    (cert.pem(), key.serialize_pem())
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, pem: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let authority = ca("valet test CA");
    let (server_cert, server_key) = leaf(&authority, &["localhost", "127.0.0.1"]);
    let (client_cert, client_key) = leaf(&authority, &["router.valet.test"]);
    let jwt = KeyPair::generate().unwrap();
    Pki {
        ca: write("ca.pem", authority.as_ref().pem()),
        server_cert: write("server.pem", server_cert),
        server_key: write("server.key", server_key),
        client_cert: write("client.pem", client_cert),
        client_key: write("client.key", client_key),
        other_ca: write("other-ca.pem", ca("some other CA").as_ref().pem()),
        jwt_private: jwt.serialize_pem().into_bytes(),
        jwt_public: write("jwt.pub.pem", jwt.public_key_pem()),
        extra_keys: std::sync::Mutex::default(),
        dir,
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn host(name: &str) -> String {
    format!("{name}.demo.{DOMAIN}")
}

async fn control_plane(pki: &Pki, extra: &[&str]) -> Proc {
    let data = pki.dir.path().join(format!("data-{}", rand_suffix()));
    let mut args = vec![
        "control-plane",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        s(&data),
        "--tls-cert-file",
        s(&pki.server_cert),
        "--tls-key-file",
        s(&pki.server_key),
    ];
    args.extend_from_slice(extra);
    Proc::start_logged("control-plane", &args).await
}

fn rand_suffix() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn url(cp: &Proc) -> String {
    format!("https://127.0.0.1:{}", cp.addr.port())
}

async fn worker(pki: &Pki, cp: &Proc, extra: &[&str]) -> Proc {
    worker_trusting(pki, cp, &pki.ca, extra).await
}

async fn worker_trusting(pki: &Pki, cp: &Proc, ca: &Path, extra: &[&str]) -> Proc {
    let snapshots = pki.dir.path().join("snapshots");
    let url = url(cp);
    let mut args = vec![
        "worker",
        "--control-plane",
        &url,
        "--snapshot-dir",
        s(&snapshots),
        "--ateapi-ca-file",
        s(ca),
    ];
    args.extend_from_slice(extra);
    Proc::start_logged("worker", &args).await
}

async fn router(pki: &Pki, cp: &Proc, ca: &Path, extra: &[&str]) -> Proc {
    let url = url(cp);
    let mut args = vec![
        "router",
        "--listen",
        "127.0.0.1:0",
        "--extproc-listen",
        "",
        "--admin-listen",
        "127.0.0.1:0",
        "--control-plane",
        &url,
        "--ateapi-ca-file",
        s(ca),
        "--parked-request-budget",
        "1s",
    ];
    args.extend_from_slice(extra);
    let _ = pki;
    Proc::start_logged("admin", &args).await
}

/// A client of the control plane over TLS (with a token file when given), as the
/// tests' own `valet ctl`.
fn client(pki: &Pki, cp: &Proc, identity: bool, token: Option<&Path>) -> ControlClient<CpChannel> {
    let files = ClientTlsFiles {
        ca: pki.ca.clone(),
        identity: identity.then(|| (pki.client_cert.clone(), pki.client_key.clone())),
        server_name: None,
    };
    let creds = ClientCredentials::tls(&files, token).unwrap();
    let endpoint = creds
        .endpoint(&url(cp))
        .unwrap()
        .timeout(Duration::from_secs(10));
    ControlClient::new(creds.connect_lazy(&endpoint, valet_proto::auth::tcp_connector()))
}

/// Atespace `demo` with actor `p1`, once a worker has joined.
async fn demo(c: &ControlClient<CpChannel>) {
    eventually("a worker joined", WITHIN, || async {
        let n = c
            .clone()
            .list_workers(())
            .await
            .ok()?
            .into_inner()
            .workers
            .len();
        (n == 1).then_some(())
    })
    .await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    c.clone()
        .create_actor(ateapi::CreateActorRequest {
            actor_ref: Some(ateapi::ActorRef {
                atespace: "demo".into(),
                name: "p1".into(),
            }),
            actor_template_namespace: "default".into(),
            actor_template_name: "counter".into(),
            worker_selector: None,
        })
        .await
        .unwrap();
}

/// A client's own credentials, which the router passes on and never logs.
const CLIENT_AUTHORIZATION: &str = "Bearer client-secret-0f3a9c";
const CLIENT_COOKIE: &str = "session=cookie-secret-7d21e4";

async fn get_p1(r: &Proc) -> (u16, String) {
    http_get(
        r.addrs["router"],
        "/",
        &[
            ("Host", &host("p1")),
            ("Authorization", CLIENT_AUTHORIZATION),
            ("Cookie", CLIENT_COOKIE),
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_verified_tls_serves_with_and_without_client_certificates() {
    let pki = pki();
    // Server TLS only: clients verify the server and present nothing (the seed's
    // deployed arguments).
    let cp = control_plane(&pki, &[]).await;
    let _w = worker(&pki, &cp, &[]).await;
    demo(&client(&pki, &cp, false, None)).await;
    let r = router(&pki, &cp, &pki.ca, &[]).await;
    let (status, body) = get_p1(&r).await;
    assert_eq!(status, 200, "{body}");

    // Client certificates required: with one, served; without, every attempt fails
    // the handshake (Unavailable), so the request parks and gets the budget's 503.
    let cp = control_plane(&pki, &["--client-ca-file", s(&pki.client_ca())]).await;
    let id = [
        "--ateapi-cert-file",
        s(&pki.client_cert),
        "--ateapi-key-file",
        s(&pki.client_key),
    ];
    let _w = worker(&pki, &cp, &id).await;
    demo(&client(&pki, &cp, true, None)).await;
    let r = router(&pki, &cp, &pki.ca, &id).await;
    let (status, body) = get_p1(&r).await;
    assert_eq!(status, 200, "{body}");
    let anonymous = router(&pki, &cp, &pki.ca, &[]).await;
    let (status, body) = get_p1(&anonymous).await;
    assert_eq!((status, body.as_str()), (503, "actor demo/p1 unavailable"));
    assert!(
        anonymous
            .metric(
                "atenet_router_resume_attempts_total",
                &[("code", "UNAVAILABLE")]
            )
            .await
            > 1.0,
        "retried under the budget"
    );
}

/// A replica pinned to one address of its URL's host name keeps the name for TLS: the
/// control plane's certificate names only `replicas.invalid`, and the call connected
/// to 127.0.0.1 is verified against that name (a server's answer, `NotFound`, not a
/// handshake failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_replica_checks_the_names_certificate() {
    use valet_router::ControlPlane as _;
    let pki = pki();
    let authority = ca("valet names CA");
    let (cert, key) = leaf(&authority, &["replicas.invalid"]);
    let write = |name: &str, pem: &str| {
        let p = pki.dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let (ca_file, cert_file, key_file) = (
        write("names-ca.pem", &authority.as_ref().pem()),
        write("names.pem", &cert),
        write("names.key", &key),
    );
    pki.extra_keys.lock().unwrap().push(key);
    let data = pki.dir.path().join("names-data");
    let cp = Proc::start_logged(
        "control-plane",
        &[
            "control-plane",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            s(&data),
            "--tls-cert-file",
            s(&cert_file),
            "--tls-key-file",
            s(&key_file),
        ],
    )
    .await;
    let files = ClientTlsFiles {
        ca: ca_file,
        identity: None,
        server_name: None,
    };
    let creds = ClientCredentials::tls(&files, None).unwrap();
    let port = cp.addr.port();
    let client = valet_router::GrpcControlPlane::replicas(
        &[format!("https://replicas.invalid:{port}")],
        &creds,
        None,
    )
    .unwrap();
    client
        .resolve_again_with(async |_, port| Ok(vec![([127, 0, 0, 1], port).into()]))
        .await;
    let answer = client
        .resume_actor(valet_router::ResumeRequest {
            actor: "demo/p1".parse().unwrap(),
            wait_for_capacity: None,
            timeout: WITHIN,
            lease_holder: None,
        })
        .await
        .unwrap_err();
    assert_eq!(
        answer.code(),
        tonic::Code::NotFound,
        "the server answered: {}",
        answer.message()
    );
}

impl Pki {
    /// Client certificates are issued by the same CA here.
    fn client_ca(&self) -> PathBuf {
        self.ca.clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_not_signed_by_the_pinned_ca_is_unavailable() {
    let pki = pki();
    let cp = control_plane(&pki, &[]).await;
    let r = router(&pki, &cp, &pki.other_ca, &[]).await;
    let (status, body) = get_p1(&r).await;
    assert_eq!((status, body.as_str()), (503, "actor demo/p1 unavailable"));
    assert!(
        r.metric(
            "atenet_router_resume_attempts_total",
            &[("code", "UNAVAILABLE")]
        )
        .await
            > 1.0,
        "each attempt Unavailable, retried under the budget"
    );
}

/// A worker that does not trust the control plane's certificate says why in its
/// log, not only `transport error` (the text of tonic's error, whose cause is in its
/// sources): before, it retried for good saying nothing of the certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_verify_the_control_plane_says_why() {
    let pki = pki();
    let cp = control_plane(&pki, &[]).await;
    let w = worker_trusting(&pki, &cp, &pki.other_ca, &[]).await;
    common::eventually(
        "the worker says why it cannot attach",
        Duration::from_secs(30),
        || async {
            let logs = w.logs();
            logs.lines()
                .find(|l| l.contains("control plane unreachable") && l.contains("UnknownIssuer"))
                .map(drop)
        },
    )
    .await;
}

/// Client certificates checked on `--listen-https` while a plaintext listener other
/// hosts can reach serves the same actors with none: the router says so at start,
/// naming the flag. A loopback plaintext listener is not warned about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_listener_beside_checked_client_certificates_is_warned_about() {
    let pki = pki();
    let start = |listen: &'static str| {
        let ca = s(&pki.ca).to_owned();
        async move {
            Proc::start_logged(
                "admin",
                &[
                    "router",
                    "--listen",
                    listen,
                    "--extproc-listen",
                    "",
                    "--admin-listen",
                    "127.0.0.1:0",
                    "--listen-https",
                    "127.0.0.1:0",
                    "--ingress-client-ca-file",
                    &ca,
                    "--control-plane",
                    "http://127.0.0.1:9",
                ],
            )
            .await
        }
    };
    let warning = "serves actors with no client certificate";
    let open = start("0.0.0.0:0").await;
    eventually("the warning", Duration::from_secs(10), || async {
        open.logs()
            .lines()
            .find(|l| l.contains(warning) && l.contains("--listen=0.0.0.0:0"))
            .map(drop)
    })
    .await;
    let local = start("127.0.0.1:0").await;
    assert!(!local.logs().contains(warning), "{}", local.logs());
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn es256(pki: &Pki, claims: &serde_json::Value) -> String {
    let key = jsonwebtoken::EncodingKey::from_ec_pem(&pki.jwt_private).unwrap();
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256),
        claims,
        &key,
    )
    .unwrap()
}

fn b64(v: &serde_json::Value) -> String {
    use base64_url::encode;
    encode(&serde_json::to_vec(v).unwrap())
}

mod base64_url {
    /// Unpadded base64url, enough for hand-made tokens.
    pub(crate) fn encode(bytes: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
            for i in 0..=chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            }
        }
        out
    }
}

/// Points the symlink `link` at a new file holding `token`, atomically (the way
/// Kubernetes rotates projected tokens).
fn swap_token(dir: &Path, link: &Path, token: &str) {
    let n = rand_suffix();
    let file = dir.join(format!("token-{n}"));
    std::fs::write(&file, token).unwrap();
    let next = dir.join(format!("link-{n}"));
    std::os::unix::fs::symlink(&file, &next).unwrap();
    std::fs::rename(&next, link).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_get_401_and_are_not_retried_and_a_swapped_token_is_used() {
    let pki = pki();
    let good = |pki: &Pki| {
        es256(
            pki,
            &serde_json::json!({"sub": "router", "aud": "valet", "iss": "test", "exp": now() + 3600}),
        )
    };
    let tokens = pki.dir.path().join("tokens");
    std::fs::create_dir(&tokens).unwrap();
    let link = tokens.join("token");
    swap_token(&tokens, &link, &good(&pki));

    let cp = control_plane(
        &pki,
        &[
            "--jwt-public-key-file",
            s(&pki.jwt_public),
            "--jwt-audience",
            "valet",
            "--jwt-issuer",
            "test",
        ],
    )
    .await;
    let jwt = ["--ateapi-auth", "jwt", "--ateapi-token-file", s(&link)];
    let _w = worker(&pki, &cp, &jwt).await;
    demo(&client(&pki, &cp, false, Some(&link))).await;
    // Without a token at all: Unauthenticated.
    let anonymous = client(&pki, &cp, false, None)
        .list_atespaces(())
        .await
        .unwrap_err();
    assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);

    let r = router(&pki, &cp, &pki.ca, &jwt).await;
    let t = now();
    let header = |alg: &str| serde_json::json!({"alg": alg, "typ": "JWT"});
    let claims = serde_json::json!({"aud": "valet", "iss": "test", "exp": t + 3600});
    let hmac = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        // The classic confusion: the public key's bytes as an HMAC secret.
        &jsonwebtoken::EncodingKey::from_secret(&std::fs::read(&pki.jwt_public).unwrap()),
    )
    .unwrap();
    let bad = [
        (
            "expired",
            es256(
                &pki,
                &serde_json::json!({"aud": "valet", "iss": "test", "exp": t - 3600}),
            ),
        ),
        (
            "not yet valid",
            es256(
                &pki,
                &serde_json::json!({"aud": "valet", "iss": "test", "exp": t + 7200, "nbf": t + 3600}),
            ),
        ),
        (
            "wrong audience",
            es256(
                &pki,
                &serde_json::json!({"aud": "other", "iss": "test", "exp": t + 3600}),
            ),
        ),
        (
            "wrong issuer",
            es256(
                &pki,
                &serde_json::json!({"aud": "valet", "iss": "other", "exp": t + 3600}),
            ),
        ),
        (
            "no audience",
            es256(&pki, &serde_json::json!({"iss": "test", "exp": t + 3600})),
        ),
        (
            "no issuer",
            es256(&pki, &serde_json::json!({"aud": "valet", "exp": t + 3600})),
        ),
        (
            "no expiry",
            es256(&pki, &serde_json::json!({"aud": "valet", "iss": "test"})),
        ),
        (
            "alg none",
            format!("{}.{}.", b64(&header("none")), b64(&claims)),
        ),
        ("HMAC", hmac),
    ];
    for (i, (what, token)) in bad.iter().enumerate() {
        swap_token(&tokens, &link, token);
        let (status, body) = get_p1(&r).await;
        assert_eq!(
            (status, body.as_str()),
            (401, "actor demo/p1 authentication required"),
            "{what}"
        );
        assert_eq!(
            r.metric(
                "atenet_router_resume_attempts_total",
                &[("code", "UNAUTHENTICATED")]
            )
            .await,
            (i + 1) as f64,
            "{what}: one attempt, not retried"
        );
    }
    // The good token again, by symlink swap: the next call carries it.
    swap_token(&tokens, &link, &good(&pki));
    let (status, body) = get_p1(&r).await;
    assert_eq!(status, 200, "{body}");

    // The verification key rotated on disk: tokens signed by the new key are accepted
    // once the control plane has re-read it, without a restart.
    let next = KeyPair::generate().unwrap();
    std::fs::write(&pki.jwt_public, next.public_key_pem()).unwrap();
    let next_token = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256),
        &serde_json::json!({"aud": "valet", "iss": "test", "exp": now() + 3600}),
        &jsonwebtoken::EncodingKey::from_ec_pem(next.serialize_pem().as_bytes()).unwrap(),
    )
    .unwrap();
    swap_token(&tokens, &link, &next_token);
    // Asked directly: the router's route lease for p1 would spare it the call.
    let direct = client(&pki, &cp, false, Some(&link));
    eventually("a token of the new key is accepted", WITHIN, || async {
        direct.clone().list_atespaces(()).await.ok()
    })
    .await;

    // No token or key material in any log (at debug) or on the status page.
    let mut tokens: Vec<String> = bad.into_iter().map(|(_, t)| t).collect();
    tokens.extend([good(&pki), next_token]);
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    assert_no_secrets(&pki, &[&cp, &r, &_w], &tokens).await;
}

/// Neither a token, nor the signature part of one, nor the body of any private key,
/// nor an `authorization` value appears in the logs of `procs` or on their status pages.
async fn assert_no_secrets(pki: &Pki, procs: &[&Proc], tokens: &[&str]) {
    let mut secrets: Vec<String> = vec!["client-secret".into(), "cookie-secret".into()];
    for t in tokens {
        secrets.push((*t).to_owned());
        if let Some((_, signature)) = t.rsplit_once('.')
            && signature.len() >= 16
        {
            secrets.push(signature.to_owned());
        }
    }
    let mut keys = vec![
        std::fs::read_to_string(&pki.server_key).unwrap(),
        std::fs::read_to_string(&pki.client_key).unwrap(),
        String::from_utf8(pki.jwt_private.clone()).unwrap(),
    ];
    keys.extend(pki.extra_keys.lock().unwrap().iter().cloned());
    for key in keys {
        secrets.extend(
            key.lines()
                .filter(|l| !l.starts_with("-----") && l.len() >= 16)
                .map(str::to_owned),
        );
    }
    for p in procs {
        let mut seen = p.logs();
        assert!(!seen.is_empty(), "the logs were captured");
        if let Some(admin) = p.addrs.get("admin") {
            seen.push_str(&http_get(*admin, "/statusz", &[]).await.1);
            seen.push_str(&http_get(*admin, "/statusz?format=json", &[]).await.1);
        }
        for needle in ["PRIVATE KEY", "Bearer ", "authorization: "] {
            assert!(!seen.contains(needle), "`{needle}` in {seen}");
        }
        for secret in &secrets {
            assert!(!seen.contains(secret.as_str()), "secret material in {seen}");
        }
    }
}

#[tokio::test]
async fn bad_tls_flags_are_configuration_errors() {
    let pki = pki();
    let garbage = pki.dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a key").unwrap();
    // A client certificate that expired would fail every handshake.
    let (expired, expired_key) = expired_leaf(&ca("valet test CA"), &["router.valet.test"]);
    let (expired_cert, expired_key_file) = (
        pki.dir.path().join("expired.pem"),
        pki.dir.path().join("expired.key"),
    );
    std::fs::write(&expired_cert, expired).unwrap();
    std::fs::write(&expired_key_file, expired_key).unwrap();
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "router",
                "--control-plane",
                "https://127.0.0.1:7070",
                "--ateapi-ca-file",
                s(&pki.ca),
                "--ateapi-cert-file",
                s(&expired_cert),
                "--ateapi-key-file",
                s(&expired_key_file),
            ],
            "--ateapi-cert-file",
        ),
        (
            &[
                "router",
                "--control-plane",
                "https://127.0.0.1:7070",
                "--ateapi-ca-file",
                s(&pki.ca),
                "--ateapi-server-name",
                "not a name!",
            ],
            "--ateapi-server-name",
        ),
        (
            // A token for another service must not pass: the audience is required.
            &[
                "control-plane",
                "--tls-cert-file",
                s(&pki.server_cert),
                "--tls-key-file",
                s(&pki.server_key),
                "--jwt-public-key-file",
                s(&pki.jwt_public),
                "--jwt-issuer",
                "test",
            ],
            "--jwt-audience",
        ),
        (&["control-plane", "--jwt-issuer", "test"], "--jwt-issuer"),
        (
            &[
                "control-plane",
                "--tls-cert-file",
                s(&pki.server_cert),
                "--tls-key-file",
                s(&pki.server_cert),
            ],
            "--tls-key-file",
        ),
        (
            &[
                "worker",
                "--control-plane",
                "https://127.0.0.1:7070",
                "--ateapi-ca-file",
                s(&pki.ca),
                "--ateapi-cert-file",
                s(&pki.client_cert),
                "--ateapi-key-file",
                s(&garbage),
            ],
            "--ateapi-key-file",
        ),
        (
            &[
                "router",
                "--control-plane",
                "http://127.0.0.1:7070",
                "--ateapi-token-file",
                s(&pki.ca),
            ],
            "--ateapi-token-file",
        ),
        (
            &["control-plane", "--tls-cert-file", s(&pki.server_cert)],
            "--tls-key-file",
        ),
        (
            &[
                "router",
                "--control-plane",
                "http://127.0.0.1:7070",
                "--ateapi-auth",
                "jwt",
            ],
            "--ateapi-auth",
        ),
        (
            &["router", "--control-plane", "https://127.0.0.1:7070"],
            "--ateapi-ca-file",
        ),
        (
            &[
                "worker",
                "--control-plane",
                "https://127.0.0.1:7070",
                "--ateapi-ca-file",
                "/nonexistent/ca.pem",
            ],
            "--ateapi-ca-file",
        ),
        (
            &[
                "ctl",
                "--control-plane",
                "https://127.0.0.1:7070",
                "--ateapi-ca-file",
                s(&pki.ca),
                "--ateapi-auth",
                "jwt",
                "atespace",
                "list",
            ],
            "--ateapi-token-file",
        ),
        (
            &[
                "control-plane",
                "--tls-cert-file",
                s(&pki.server_cert),
                "--tls-key-file",
                s(&pki.server_key),
                "--jwt-public-key-file",
                s(&garbage),
                "--jwt-audience",
                "valet",
                "--jwt-issuer",
                "test",
            ],
            "--jwt-public-key-file",
        ),
    ];
    for &(args, flag) in cases {
        // A case that starts a server instead would hang: bounded, and killed.
        let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
            .args(args)
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(WITHIN, run)
            .await
            .unwrap_or_else(|_| panic!("{args:?} did not exit"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}

/// A client certificate signed by `authority` with these URI SANs (SPIFFE IDs).
fn spiffe_client(
    authority: &CertifiedIssuer<'static, KeyPair>,
    uris: &[&str],
) -> (
    Vec<rustls_pki_types::CertificateDer<'static>>,
    rustls_pki_types::PrivateKeyDer<'static>,
) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    for u in uris {
        params.subject_alt_names.push(rcgen::SanType::URI(
            rcgen::string::Ia5String::try_from(*u).unwrap(),
        ));
    }
    let cert = params.signed_by(&key, authority).unwrap();
    (
        vec![cert.der().clone()],
        rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
}

/// One GET over HTTPS with `alpn`, presenting `identity`; the status and the HTTP
/// version answered, or `None` when the TLS handshake fails.
async fn https_get(
    addr: std::net::SocketAddr,
    ca: &Path,
    identity: Option<(
        Vec<rustls_pki_types::CertificateDer<'static>>,
        rustls_pki_types::PrivateKeyDer<'static>,
    )>,
    alpn: &[u8],
) -> Option<(u16, http::Version)> {
    let tls = tls_connect(addr, &tls_connector(ca, identity, alpn)).await?;
    let io = hyper_util::rt::TokioIo::new(tls);
    let req = |uri: &str| {
        http::Request::builder()
            .uri(uri)
            .header("host", host("p1"))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    };
    let resp = if alpn == b"h2" {
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .ok()?;
        tokio::spawn(conn);
        send.send_request(req(&format!("https://{}/", host("p1"))))
            .await
            .ok()?
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.ok()?;
        tokio::spawn(conn);
        send.send_request(req("/")).await.ok()?
    };
    Some((resp.status().as_u16(), resp.version()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_ingress_speaks_both_protocols_and_checks_spiffe_ids() {
    let pki = pki();
    // The client certificates' CA (also the server's here).
    let authority = ca("ingress clients CA");
    let clients_ca = pki.dir.path().join("clients-ca.pem");
    std::fs::write(&clients_ca, authority.as_ref().pem()).unwrap();
    let args = [
        "router",
        "--listen",
        "",
        "--extproc-listen",
        "",
        "--admin-listen",
        "127.0.0.1:0",
        "--listen-https",
        "127.0.0.1:0",
        "--ingress-tls-cert-file",
        s(&pki.server_cert),
        "--ingress-tls-key-file",
        s(&pki.server_key),
        "--ingress-client-ca-file",
        s(&clients_ca),
        "--ingress-allowed-spiffe-ids",
        "spiffe://cluster.local/ns/apps/,spiffe://cluster.local/ns/ops/sa/admin",
        // No control plane listens here: an admitted request parks and gets 503.
        "--control-plane",
        "http://127.0.0.1:9",
        "--parked-request-budget",
        "200ms",
    ];
    let r = Proc::start_logged("admin", &args).await;
    let addr = r.addrs["router-https"];
    let attempts = || r.metric("atenet_router_resume_attempts_total", &[]);

    let admitted = [
        &["spiffe://cluster.local/ns/ops/sa/admin"][..],
        &["spiffe://cluster.local/ns/apps/sa/x"][..],
    ];
    for uris in admitted {
        for alpn in [&b"h2"[..], &b"http/1.1"[..]] {
            let before = attempts().await;
            let (status, version) =
                https_get(addr, &pki.ca, Some(spiffe_client(&authority, uris)), alpn)
                    .await
                    .unwrap_or_else(|| panic!("{uris:?}: handshake failed"));
            assert_eq!(status, 503, "{uris:?} reaches the pipeline");
            let expected = if alpn == b"h2" {
                http::Version::HTTP_2
            } else {
                http::Version::HTTP_11
            };
            assert_eq!(version, expected, "ALPN {}", String::from_utf8_lossy(alpn));
            assert!(
                attempts().await > before,
                "{uris:?}: the control plane was asked"
            );
        }
    }
    let refused = [
        &["spiffe://cluster.local/ns/apps-evil/sa/x"][..],
        &[
            "spiffe://cluster.local/ns/apps/sa/x",
            "spiffe://cluster.local/ns/ops/sa/admin",
        ][..],
        &[][..],
        &["spiffe://cluster.local/ns/ops/sa/admin2"][..],
    ];
    for uris in refused {
        let before = attempts().await;
        let (status, _) = https_get(
            addr,
            &pki.ca,
            Some(spiffe_client(&authority, uris)),
            b"http/1.1",
        )
        .await
        .unwrap_or_else(|| panic!("{uris:?}: handshake failed"));
        assert_eq!(status, 403, "{uris:?}");
        assert_eq!(
            attempts().await,
            before,
            "{uris:?}: refused before any control-plane call"
        );
    }
    // A refused client still sending a large upload gets its 403, not a reset: the
    // body is read and thrown away first.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let identity = spiffe_client(&authority, &["spiffe://cluster.local/ns/x/sa/y"]);
        let tls = tls_connect(addr, &tls_connector(&pki.ca, Some(identity), b"http/1.1"))
            .await
            .expect("handshake");
        let (mut rd, mut wr) = tokio::io::split(tls);
        let len = 8 * 1024 * 1024;
        let head = format!(
            "POST /up HTTP/1.1\r\nhost: {}\r\ncontent-length: {len}\r\n\r\n",
            host("p1")
        );
        let writer = tokio::spawn(async move {
            wr.write_all(head.as_bytes()).await?;
            wr.write_all(&vec![7u8; len]).await?;
            wr.flush().await?;
            Ok::<_, std::io::Error>(wr)
        });
        let mut out = Vec::new();
        let want = "client certificate not allowed";
        let read = tokio::time::timeout(WITHIN, async {
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&out).contains(want) {
                let n = rd.read(&mut buf).await.expect("no reset");
                assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&out));
                out.extend_from_slice(&buf[..n]);
            }
        })
        .await;
        let out = String::from_utf8_lossy(&out);
        assert!(read.is_ok(), "the 403 arrives: {out}");
        assert!(out.starts_with("HTTP/1.1 403 "), "{out}");
        let _wr = writer
            .await
            .unwrap()
            .expect("the router read the whole body, and did not reset the connection");
    }
    // No client certificate: the server refuses the handshake (under TLS 1.3 the client
    // learns it at its first read), before any control-plane call.
    let before = attempts().await;
    let refused = match tls_connect(addr, &tls_client(&pki.ca, None, b"http/1.1")).await {
        None => panic!("the client's side of the handshake completes"),
        Some(mut tls) => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = tls.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await;
            let mut buf = [0u8; 64];
            match tls.read(&mut buf).await {
                Err(e) => e.to_string(),
                Ok(n) => format!("read {n} bytes"),
            }
        }
    };
    assert!(refused.contains("CertificateRequired"), "{refused}");
    assert_eq!(attempts().await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valet_up_with_tls_serves_the_walkthrough_over_https() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let up = common::Up::start_in(dir, &data, &["--tls", "--listen-https", "127.0.0.1:0"]).await;
    let ca = data.join("tls").join("ca.pem");
    // The README's first request, over HTTPS, verified against the throwaway CA: the
    // router resumed p1 through a TLS control plane that its worker reached over TLS.
    for alpn in [&b"http/1.1"[..], &b"h2"[..]] {
        let answer = https_get(up.https.expect("an HTTPS listener"), &ca, None, alpn).await;
        assert_eq!(
            answer.map(|(s, _)| s),
            Some(200),
            "{}",
            String::from_utf8_lossy(alpn)
        );
    }
    // valet ctl reaches the same control plane over TLS.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "ctl",
            "--control-plane",
            &format!("https://{}", up.control_plane),
            "--ateapi-ca-file",
            s(&ca),
            "actor",
            "list",
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("p1") && stdout.contains("RUNNING"),
        "{stdout}"
    );
    // Plaintext to the control plane is refused now.
    let plain = common::client(up.control_plane).list_atespaces(()).await;
    assert!(plain.is_err(), "h2c against a TLS control plane");

    // A second `valet up --tls` on the same data dir is refused before it writes
    // anything: the running one keeps its certificates.
    let before = std::fs::read(&ca).unwrap();
    let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
        .args(["up", "--tls", "--data-dir", s(&data)])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("in use"), "{stderr}");
    assert!(std::fs::read(&ca).unwrap() == before, "the CA was replaced");
}

/// `valet up --tls --client-ca-file`: the embedded control plane (on its throwaway
/// certificate) asks for client certificates, which its workers and router present
/// from --ateapi-cert-file; a client without one is refused. An empty --listen-https
/// turns HTTPS off. Before, the client CA was refused without --tls-cert-file, and
/// an empty --listen-https took the default 127.0.0.1:8443.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valet_up_with_tls_asks_for_client_certificates() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let up = common::Up::start_in(
        dir,
        &data,
        &[
            "--tls",
            "--listen-https",
            "",
            "--client-ca-file",
            s(&pki.client_ca()),
            "--ateapi-cert-file",
            s(&pki.client_cert),
            "--ateapi-key-file",
            s(&pki.client_key),
        ],
    )
    .await;
    assert_eq!(up.https, None, "HTTPS off");
    let (status, body) = common::http_get(up.router, "/", &[("Host", &host("p1"))]).await;
    assert_eq!(status, 200, "{body}");
    let ca = data.join("tls").join("ca.pem");
    let ctl = |identity: &[&str]| {
        let mut args = vec![
            "ctl".to_owned(),
            "--control-plane".into(),
            format!("https://{}", up.control_plane),
            "--ateapi-ca-file".into(),
            s(&ca).to_owned(),
        ];
        args.extend(identity.iter().map(|a| (*a).to_owned()));
        args.extend(["actor".into(), "list".into()]);
        tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
            .args(args)
            .output()
    };
    let without = ctl(&[]).await.unwrap();
    assert!(!without.status.success(), "no client certificate: refused");
    let with = ctl(&[
        "--ateapi-cert-file",
        s(&pki.client_cert),
        "--ateapi-key-file",
        s(&pki.client_key),
    ])
    .await
    .unwrap();
    assert!(with.status.success(), "{with:?}");
}

/// Replaces `path` with `contents` the way deployment tools do: written beside it,
/// then renamed over it.
fn replace(path: &Path, contents: &str) {
    let next = path.with_extension(format!("next-{}", rand_suffix()));
    std::fs::write(&next, contents).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// A rustls client trusting the PEM CAs in `ca`, presenting `identity` (PEM files).
fn tls_client(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    alpn: &[u8],
) -> tokio_rustls::TlsConnector {
    use rustls_pki_types::pem::PemObject;
    let identity = identity.map(|(cert, key)| {
        (
            rustls_pki_types::CertificateDer::pem_file_iter(cert)
                .unwrap()
                .map(Result::unwrap)
                .collect(),
            rustls_pki_types::PrivateKeyDer::from_pem_file(key).unwrap(),
        )
    });
    tls_connector(ca, identity, alpn)
}

/// A rustls client trusting the PEM CAs in `ca`, presenting `identity`, offering
/// `alpn`.
fn tls_connector(
    ca: &Path,
    identity: Option<(
        Vec<rustls_pki_types::CertificateDer<'static>>,
        rustls_pki_types::PrivateKeyDer<'static>,
    )>,
    alpn: &[u8],
) -> tokio_rustls::TlsConnector {
    use rustls_pki_types::pem::PemObject;
    use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto::ring};
    let mut roots = RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder =
        ClientConfig::builder_with_provider(std::sync::Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
    let mut config = match identity {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

/// A TLS connection to `addr` as `localhost`, or `None` when the handshake fails.
async fn tls_connect(
    addr: std::net::SocketAddr,
    client: &tokio_rustls::TlsConnector,
) -> Option<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    client.connect(name, tcp).await.ok()
}

/// The end-entity certificate a TLS server presented.
fn presented(tls: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> Vec<u8> {
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// The DER of the first certificate in `pem`.
fn der(pem: &str) -> Vec<u8> {
    use rustls_pki_types::pem::PemObject;
    rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_certificates_rotate_on_disk_without_a_restart() {
    let pki = pki();
    let dir = pki.dir.path();
    let authority = ca("rotating CA");
    let trust = dir.join("rotating-ca.pem");
    std::fs::write(&trust, authority.as_ref().pem()).unwrap();
    let (cert, key) = (dir.join("ingress.pem"), dir.join("ingress.key"));
    let (first, first_key) = leaf(&authority, &["localhost"]);
    std::fs::write(&cert, &first).unwrap();
    std::fs::write(&key, &first_key).unwrap();
    let r = Proc::start_logged(
        "admin",
        &[
            "router",
            "--listen",
            "",
            "--extproc-listen",
            "",
            "--admin-listen",
            "127.0.0.1:0",
            "--listen-https",
            "127.0.0.1:0",
            "--ingress-tls-cert-file",
            s(&cert),
            "--ingress-tls-key-file",
            s(&key),
            // Nothing listens here: requests park and get the budget's 503.
            "--control-plane",
            "http://127.0.0.1:9",
            "--parked-request-budget",
            "200ms",
        ],
    )
    .await;
    let addr = r.addrs["router-https"];
    let client = tls_client(&trust, None, b"http/1.1");

    // A connection made before the rotation, kept open.
    let before = tls_connect(addr, &client).await.expect("handshake");
    assert_eq!(presented(&before), der(&first));
    let (mut old, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(before))
            .await
            .unwrap();
    tokio::spawn(conn);
    let request = || {
        http::Request::builder()
            .uri("/")
            .header("host", host("p1"))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    };
    assert_eq!(old.send_request(request()).await.unwrap().status(), 503);

    // Rotated on disk: new connections get the new certificate.
    let (second, second_key) = leaf(&authority, &["localhost"]);
    pki.extra_keys
        .lock()
        .unwrap()
        .extend([first_key, second_key.clone()]);
    replace(&key, &second_key);
    replace(&cert, &second);
    eventually(
        "new connections get the new certificate",
        WITHIN,
        || async {
            let tls = tls_connect(addr, &client).await?;
            (presented(&tls) == der(&second)).then_some(())
        },
    )
    .await;
    // The connection made before keeps serving, on its old credentials.
    assert_eq!(old.send_request(request()).await.unwrap().status(), 503);

    // A file that cannot be used: the reload fails, says why, and keeps the last good
    // certificate.
    replace(&cert, "not a certificate");
    // Counted by this reason only: a poll between the key's and the certificate's
    // replacement above may have failed on a mismatched pair.
    let failures = || {
        r.logs()
            .lines()
            .filter(|l| l.contains("reload failed") && l.contains("no readable PEM certificate"))
            .count()
    };
    eventually("the failed reload is logged", WITHIN, || async {
        (failures() > 0).then_some(())
    })
    .await;
    assert!(r.logs().contains("ingress TLS"), "{}", r.logs());
    let tls = tls_connect(addr, &client).await.expect("still serving");
    assert_eq!(presented(&tls), der(&second));

    // SIGHUP re-reads the files, changed or not (and does not stop the process).
    let seen = failures();
    common::signal(&r.child, "HUP");
    eventually("SIGHUP re-read the files", WITHIN, || async {
        (failures() > seen).then_some(())
    })
    .await;
    assert!(r.logs().contains("SIGHUP received"), "{}", r.logs());
    let tls = tls_connect(addr, &client).await.expect("still serving");
    assert_eq!(presented(&tls), der(&second));

    // An expired certificate (and its key) swapped in would fail every handshake:
    // refused like an unreadable one, the last good certificate kept.
    let (expired, expired_key) = expired_leaf(&authority, &["localhost"]);
    pki.extra_keys.lock().unwrap().push(expired_key.clone());
    replace(&key, &expired_key);
    replace(&cert, &expired);
    eventually("the expired certificate is refused", WITHIN, || async {
        r.logs()
            .lines()
            .find(|l| l.contains("reload failed") && l.contains("the certificate expired at"))
            .map(drop)
    })
    .await;
    let tls = tls_connect(addr, &client).await.expect("still serving");
    assert_eq!(presented(&tls), der(&second));
    assert_no_secrets(&pki, &[&r], &[]).await;
}

/// As [`leaf`], valid only in 2001.
fn expired_leaf(authority: &CertifiedIssuer<'static, KeyPair>, names: &[&str]) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let mut params = CertificateParams::new(names).unwrap();
    params.not_before = rcgen::date_time_ymd(2001, 1, 1);
    params.not_after = rcgen::date_time_ymd(2001, 12, 31);
    let cert = params.signed_by(&key, authority).unwrap();
    (cert.pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_credentials_rotate_on_disk_without_a_restart() {
    let pki = pki();
    let dir = pki.dir.path();
    let wrong = std::fs::read_to_string(&pki.other_ca).unwrap();
    let right = std::fs::read_to_string(&pki.ca).unwrap();
    // The files the processes were started with: every CA the wrong one.
    let (cp_cert, cp_key) = (dir.join("cp.pem"), dir.join("cp.key"));
    std::fs::copy(&pki.server_cert, &cp_cert).unwrap();
    std::fs::copy(&pki.server_key, &cp_key).unwrap();
    let clients_ca = dir.join("cp-clients-ca.pem");
    std::fs::write(&clients_ca, &wrong).unwrap();
    let trust = dir.join("trusted-ca.pem");
    std::fs::write(&trust, &wrong).unwrap();

    let data = dir.join("data");
    let cp = Proc::start_logged(
        "control-plane",
        &[
            "control-plane",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            s(&data),
            "--tls-cert-file",
            s(&cp_cert),
            "--tls-key-file",
            s(&cp_key),
            "--client-ca-file",
            s(&clients_ca),
            // Every request asks the control plane (no route lease spares the call),
            // so "connections made before go on serving" is observed below.
            "--route-lease",
            "0",
        ],
    )
    .await;
    let id = [
        "--ateapi-cert-file",
        s(&pki.client_cert),
        "--ateapi-key-file",
        s(&pki.client_key),
    ];
    let w = worker_trusting(&pki, &cp, &trust, &id).await;
    let r = router(&pki, &cp, &trust, &id).await;
    let (status, _) = get_p1(&r).await;
    assert_eq!(status, 503, "neither side trusts the other yet");

    // The clients' CA, then the server's client CA, rewritten: the worker attaches and
    // the router is served, with no restart.
    replace(&trust, &right);
    replace(&clients_ca, &right);
    demo(&client(&pki, &cp, true, None)).await;
    eventually("the router is served", WITHIN, || async {
        (get_p1(&r).await.0 == 200).then_some(())
    })
    .await;

    // The server's certificate rotated to one from a new CA (clients trust both first):
    // new connections get it, connections made before go on serving.
    let next_ca = ca("next CA");
    replace(&trust, &format!("{right}{}", next_ca.as_ref().pem()));
    let (next, next_key) = leaf(&next_ca, &["localhost", "127.0.0.1"]);
    pki.extra_keys.lock().unwrap().push(next_key.clone());
    replace(&cp_key, &next_key);
    replace(&cp_cert, &next);
    let client = tls_client(&trust, Some((&pki.client_cert, &pki.client_key)), b"h2");
    eventually(
        "new connections get the new certificate",
        WITHIN,
        || async {
            let tls = tls_connect(cp.addr, &client).await?;
            (presented(&tls) == der(&next)).then_some(())
        },
    )
    .await;
    let asked = r
        .metric("atenet_router_resume_attempts_total", &[("code", "OK")])
        .await;
    assert_eq!(get_p1(&r).await.0, 200);
    assert!(
        r.metric("atenet_router_resume_attempts_total", &[("code", "OK")])
            .await
            > asked,
        "served over the router's connection made before the rotation"
    );
    // A new client trusting only the new CA is served.
    let only_next = dir.join("only-next-ca.pem");
    std::fs::write(&only_next, next_ca.as_ref().pem()).unwrap();
    let files = ClientTlsFiles {
        ca: only_next,
        identity: Some((pki.client_cert.clone(), pki.client_key.clone())),
        server_name: None,
    };
    let creds = ClientCredentials::tls(&files, None).unwrap();
    let endpoint = creds.endpoint(&url(&cp)).unwrap();
    let mut fresh =
        ControlClient::new(creds.connect_lazy(&endpoint, valet_proto::auth::tcp_connector()));
    assert!(fresh.list_atespaces(()).await.is_ok());
    assert_no_secrets(&pki, &[&cp, &w, &r], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valet_up_takes_the_routers_ingress_flags_and_the_control_planes_tls_flags() {
    // Without --tls: the router's own HTTPS flags serve the walkthrough over HTTPS with
    // the given certificate, and the control plane's own TLS flags make the embedded
    // control plane serve TLS, which the workers and the router verify against the
    // router's --ateapi-ca-file.
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let up = common::Up::start_in(
        dir,
        &data,
        &[
            "--listen-https",
            "127.0.0.1:0",
            "--ingress-tls-cert-file",
            s(&pki.server_cert),
            "--ingress-tls-key-file",
            s(&pki.server_key),
            "--tls-cert-file",
            s(&pki.server_cert),
            "--tls-key-file",
            s(&pki.server_key),
            "--ateapi-ca-file",
            s(&pki.ca),
        ],
    )
    .await;
    let answer = https_get(up.https.expect("an HTTPS listener"), &pki.ca, None, b"h2").await;
    assert_eq!(answer.map(|(s, _)| s), Some(200));
    let plain = common::client(up.control_plane).list_atespaces(()).await;
    assert!(plain.is_err(), "the embedded control plane serves TLS");
    let files = ClientTlsFiles {
        ca: pki.ca.clone(),
        identity: None,
        server_name: None,
    };
    let creds = ClientCredentials::tls(&files, None).unwrap();
    let endpoint = creds
        .endpoint(&format!("https://{}", up.control_plane))
        .unwrap();
    let mut c =
        ControlClient::new(creds.connect_lazy(&endpoint, valet_proto::auth::tcp_connector()));
    assert!(c.list_atespaces(()).await.is_ok());
}

/// A signal while `valet up` is still starting stops it there (exit 0), never held
/// until the start ends. Here the start would never end by itself: its workers trust
/// another CA than its control plane's, so they never join. Before, Ctrl-C waited for
/// the 20 s join timeout, then the process exited 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_during_valet_ups_start_stops_it() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cp = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "up",
            "--tls",
            "--ateapi-ca-file",
            s(&pki.ca),
            "--control-plane-listen",
            &cp.to_string(),
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "",
            "--extproc-listen",
            "",
            "--metrics-listen",
            "",
            "--data-dir",
            s(&data),
        ])
        .env("VALET_LOG", "error")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually(
        "its control plane listens",
        Duration::from_secs(30),
        || async { tokio::net::TcpStream::connect(cp).await.ok().map(drop) },
    )
    .await;
    common::signal(&child, "INT");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("stopped during its start")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}
