//! Real `valet` processes on 127.0.0.1:0: started, their `listening <part> <addr>`
//! line read, killed on drop.

#![allow(dead_code, unreachable_pub, unused_imports)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::transport::Channel;
use valet_proto::ateapi::{self, control_client::ControlClient};

pub use valet_load::extproc;
pub mod netfault;
pub mod socket;

/// A `valet` child process, killed when dropped.
#[derive(Debug)]
pub struct Proc {
    pub child: Child,
    /// The address of the part it was started for.
    pub addr: SocketAddr,
    /// Every `listening <part> <addr>` it printed before that part's.
    pub addrs: std::collections::HashMap<String, SocketAddr>,
    /// Its stderr, when started with [`Proc::start_logged`].
    pub logs: std::sync::Arc<std::sync::Mutex<String>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stderr {
    Inherit,
    Logged,
    Closed,
}

impl Proc {
    /// Starts `valet <args>` and waits (bounded) for its `listening <part> <addr>` line
    /// (or `bound <part> <addr>`, with `part` = `bound <part>`).
    pub async fn start(part: &str, args: &[&str]) -> Self {
        Self::spawn(part, args, Stderr::Inherit).await
    }

    /// As [`Proc::start`], logging everything at `debug` into [`Proc::logs`].
    pub async fn start_logged(part: &str, args: &[&str]) -> Self {
        Self::spawn(part, args, Stderr::Logged).await
    }

    /// As [`Proc::start`], with stderr a pipe whose reader is gone (`valet … 2>&1 |
    /// tee`, tee ended by the first Ctrl-C).
    pub async fn start_stderr_closed(part: &str, args: &[&str]) -> Self {
        Self::spawn(part, args, Stderr::Closed).await
    }

    async fn spawn(part: &str, args: &[&str], stderr: Stderr) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_valet"))
            .args(args)
            .env(
                "VALET_LOG",
                if stderr == Stderr::Logged {
                    "debug"
                } else {
                    "warn"
                },
            )
            .stdout(Stdio::piped())
            .stderr(if stderr == Stderr::Inherit {
                Stdio::inherit()
            } else {
                Stdio::piped()
            })
            .kill_on_drop(true)
            .spawn()
            .expect("valet starts");
        let logs = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        if stderr == Stderr::Closed {
            drop(child.stderr.take());
        }
        if let Some(stderr) = child.stderr.take() {
            let logs = logs.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(l)) = lines.next_line().await {
                    let mut logs = logs.lock().unwrap();
                    logs.push_str(&l);
                    logs.push('\n');
                }
            });
        }
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut addrs = std::collections::HashMap::new();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                // `listening <part> <addr>`, keyed `<part>`; `bound <part> <addr>` (a
                // control plane's gRPC port, reserved before it listens), keyed
                // `bound <part>`.
                let (prefix, rest) = match line.strip_prefix("listening ") {
                    Some(rest) => ("", rest),
                    None => match line.strip_prefix("bound ") {
                        Some(rest) => ("bound ", rest),
                        None => continue,
                    },
                };
                if let Some((p, a)) = rest.split_once(' ') {
                    let a = a.parse::<SocketAddr>().unwrap();
                    let key = format!("{prefix}{p}");
                    addrs.insert(key.clone(), a);
                    if key == part {
                        return a;
                    }
                }
            }
            panic!("valet {part} exited before listening");
        })
        .await
        .expect("valet prints its address");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            addr,
            addrs,
            logs,
        }
    }

    /// What it has logged so far (with [`Proc::start_logged`]).
    pub fn logs(&self) -> String {
        self.logs.lock().unwrap().clone()
    }

    /// SIGKILL, and reap.
    pub async fn kill(mut self) {
        self.child.kill().await.unwrap();
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        signal(&self.child, "TERM");
    }

    /// Waits (bounded) for the process to exit; its exit code.
    pub async fn exit_code(&mut self, within: Duration) -> Option<i32> {
        tokio::time::timeout(within, self.child.wait())
            .await
            .expect("the process exits in time")
            .unwrap()
            .code()
    }

    /// Whether the router's last cached route was under a stale lease, judged by its
    /// metrics: the control plane counts as unreachable and a lease has expired.
    pub async fn route_is_stale(&self) -> bool {
        let (s, body) = http_get(self.addrs["admin"], "/statusz?format=json", &[]).await;
        s == 200 && body.contains("\"control_plane_reachable\": false")
    }

    /// The value of one series of its admin server's metrics (`addrs["admin"]`).
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = http_get(self.addrs["admin"], "/metrics", &[]).await.1;
        valet_router::metrics::sample_of(&text, name, labels)
    }
}

/// Sends `SIG<name>` to `child`.
pub fn signal(child: &Child, name: &str) {
    let pid = child.id().expect("running").to_string();
    let ok = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{name} {pid}");
}

/// `valet router` on 127.0.0.1:0 (HTTP and admin; no ext_proc) in front of `cp`.
pub async fn router(cp: SocketAddr, extra: &[&str]) -> Proc {
    router_on(cp, "127.0.0.1:0", "", extra).await
}

/// `valet router` in front of `cp` with its HTTP data plane on `listen` and its
/// ext_proc server on `extproc` (empty: off), and its admin server on 127.0.0.1:0.
pub async fn router_on(cp: SocketAddr, listen: &str, extproc: &str, extra: &[&str]) -> Proc {
    let url = format!("http://{cp}");
    let mut args = vec![
        "router",
        "--listen",
        listen,
        "--extproc-listen",
        extproc,
        "--admin-listen",
        "127.0.0.1:0",
        "--control-plane",
        &url,
    ];
    args.extend_from_slice(extra);
    Proc::start("admin", &args).await
}

pub async fn control_plane(data_dir: &Path, listen: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "control-plane",
        "--listen",
        listen,
        "--data-dir",
        data_dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Proc::start("control-plane", &args).await
}

pub async fn worker(cp: SocketAddr, snapshots: &Path, id: &str) -> Proc {
    worker_with(cp, snapshots, id, &[]).await
}

pub async fn worker_with(cp: SocketAddr, snapshots: &Path, id: &str, extra: &[&str]) -> Proc {
    let url = format!("http://{cp}");
    let mut args = vec![
        "worker",
        "--control-plane",
        &url,
        "--snapshot-dir",
        snapshots.to_str().unwrap(),
        "--worker-id",
        id,
    ];
    args.extend_from_slice(extra);
    Proc::start("worker", &args).await
}

pub fn client(cp: SocketAddr) -> ControlClient<Channel> {
    ControlClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{cp}"))
            .unwrap()
            .timeout(Duration::from_secs(20))
            .connect_lazy(),
    )
}

pub fn aref(actor: &str) -> Option<ateapi::ActorRef> {
    let (atespace, name) = actor.split_once('/').unwrap();
    Some(ateapi::ActorRef {
        atespace: atespace.into(),
        name: name.into(),
    })
}

pub async fn get(c: &ControlClient<Channel>, actor: &str) -> Result<ateapi::Actor, tonic::Status> {
    Ok(c.clone()
        .get_actor(ateapi::GetActorRequest {
            actor_ref: aref(actor),
        })
        .await?
        .into_inner()
        .actor
        .unwrap())
}

pub async fn resume(
    c: &ControlClient<Channel>,
    actor: &str,
) -> Result<ateapi::Actor, tonic::Status> {
    Ok(c.clone()
        .resume_actor(ateapi::ResumeActorRequest {
            actor_ref: aref(actor),
            ..Default::default()
        })
        .await?
        .into_inner()
        .actor
        .unwrap())
}

pub async fn suspend(
    c: &ControlClient<Channel>,
    actor: &str,
) -> Result<ateapi::Actor, tonic::Status> {
    Ok(c.clone()
        .suspend_actor(ateapi::SuspendActorRequest {
            actor_ref: aref(actor),
        })
        .await?
        .into_inner()
        .actor
        .unwrap())
}

pub async fn create(
    c: &ControlClient<Channel>,
    actor: &str,
) -> Result<ateapi::Actor, tonic::Status> {
    create_from(c, actor, "counter").await
}

/// Creates `actor` from the template `template` (in `default`).
pub async fn create_from(
    c: &ControlClient<Channel>,
    actor: &str,
    template: &str,
) -> Result<ateapi::Actor, tonic::Status> {
    Ok(c.clone()
        .create_actor(ateapi::CreateActorRequest {
            actor_ref: aref(actor),
            actor_template_namespace: "default".into(),
            actor_template_name: template.into(),
            worker_selector: None,
        })
        .await?
        .into_inner()
        .actor
        .unwrap())
}

/// Polls `check` until it returns `Some`, at most `within`: for conditions in another
/// process, which cannot notify this one.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    let mut tick = tokio::time::interval(Duration::from_millis(25));
    loop {
        tick.tick().await;
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
    }
}

pub fn status(a: &ateapi::Actor) -> ateapi::actor::Status {
    ateapi::actor::Status::try_from(a.status).unwrap()
}

/// One HTTP/1.1 GET over a fresh connection; returns status and body.
pub async fn http_get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    try_http_get(addr, path, headers)
        .await
        .unwrap_or_else(|| panic!("GET {path} from {addr}: no complete answer"))
}

/// [`http_get`], or `None` when the connection fails or ends without a status line.
pub async fn try_http_get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let mut req = format!("GET {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str("Host: actor\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.ok()?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.get(9..12)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// A `valet up` process with every listener on 127.0.0.1:0 and its data in a temp dir.
#[derive(Debug)]
pub struct Up {
    pub child: Child,
    pub control_plane: SocketAddr,
    pub router: SocketAddr,
    pub admin: SocketAddr,
    pub extproc: Option<SocketAddr>,
    /// The HTTPS listener (with `--tls`).
    pub https: Option<SocketAddr>,
    /// The control plane's probes and metrics.
    pub metrics: SocketAddr,
    pub dir: tempfile::TempDir,
}

pub const DOMAIN: &str = "actors.resources.substrate.ate.dev";

impl Up {
    /// Starts `valet up <extra>` with its data in a new temp dir and reads its
    /// listening lines (bounded).
    pub async fn start(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        Self::start_in(dir, &data, extra).await
    }

    /// [`Self::start`] with the data in `data`.
    pub async fn start_in(dir: tempfile::TempDir, data: &Path, extra: &[&str]) -> Self {
        let mut args = vec![
            "up",
            "--control-plane-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--extproc-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_valet"))
            .args(&args)
            .env("VALET_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("valet up starts");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut found: std::collections::HashMap<String, SocketAddr> = Default::default();
        tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(rest) = line.strip_prefix("listening ") {
                    let (part, addr) = rest.split_once(' ').unwrap();
                    found.insert(part.to_owned(), addr.parse().unwrap());
                }
                if line.starts_with("press Ctrl-C") {
                    return;
                }
            }
            panic!("valet up exited before it was ready");
        })
        .await
        .expect("valet up gets ready");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            control_plane: found["control-plane"],
            router: found["router"],
            admin: found["admin"],
            extproc: found.get("extproc").copied(),
            https: found.get("router-https").copied(),
            metrics: found["metrics"],
            dir,
        }
    }

    pub fn client(&self) -> ControlClient<Channel> {
        client(self.control_plane)
    }

    pub fn host(name: &str) -> String {
        format!("{name}.demo.{DOMAIN}")
    }

    /// The router's metrics text.
    pub async fn metrics(&self) -> String {
        http_get(self.admin, "/metrics", &[]).await.1
    }

    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        valet_router::metrics::sample_of(&self.metrics().await, name, labels)
    }

    /// Waits (bounded, polling the admin server) until `n` requests are parked.
    pub async fn until_parked(&self, n: f64) {
        eventually(&format!("{n} parked"), Duration::from_secs(20), || async {
            (self.metric("atenet_router_parking_active", &[]).await == n).then_some(())
        })
        .await;
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        signal(&self.child, "TERM");
    }
}

/// A request through the router: status, headers and body.
pub async fn request(
    router: SocketAddr,
    method: &str,
    host: &str,
    path: &str,
    body: Vec<u8>,
) -> (u16, http::HeaderMap, Vec<u8>) {
    use http_body_util::{BodyExt, Full};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{router}{path}"))
        .header("host", host)
        .body(Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = client.request(req).await.expect("router answers");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("whole body")
        .to_bytes()
        .to_vec();
    (status, headers, body)
}

pub async fn get_text(
    router: SocketAddr,
    actor: &str,
    path: &str,
) -> (u16, http::HeaderMap, String) {
    let (s, h, b) = request(router, "GET", &Up::host(actor), path, Vec::new()).await;
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

/// Waits (bounded) until `workers` workers have joined, then creates atespace `demo`
/// and the actors `demo/<name>` (template `counter`).
pub async fn workers_and_demo(c: &ControlClient<Channel>, workers: usize, actors: &[String]) {
    eventually("workers attached", Duration::from_secs(60), || async {
        let n = c
            .clone()
            .list_workers(())
            .await
            .ok()?
            .into_inner()
            .workers
            .len();
        (n == workers).then_some(())
    })
    .await;
    c.clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    for name in actors {
        create(c, &format!("demo/{name}")).await.unwrap();
    }
}

/// A WebSocket opened on `addr` for `host` (`/chat`), with `extra` request headers;
/// also the handshake's status.
pub async fn websocket(
    addr: SocketAddr,
    host: &str,
    extra: &[(&str, &str)],
) -> (
    tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
    http::StatusCode,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = http::Request::builder()
        .uri(format!("ws://{host}/chat"))
        .header("host", host)
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header(
            "sec-websocket-key",
            tokio_tungstenite::tungstenite::handshake::client::generate_key(),
        );
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let (ws, resp) = tokio_tungstenite::client_async(req.body(()).unwrap(), tcp)
        .await
        .expect("websocket handshake");
    (ws, resp.status())
}
