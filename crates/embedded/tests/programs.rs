//! Programs as actors, end to end in one process: the reference control plane and its
//! workers running a real program (`tests/apps/testapp.py`, and Python's own
//! `http.server`) for each actor. What every test asserts is what a client and an
//! operator see: answers, statuses, reasons, and which processes are left.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use valet_control::ActorKey;
use valet_embedded::{Embedded, EmbeddedConfig};
use valet_proto::ateapi::actor::Status;
use valet_template::{Kind, Program, Template};

const WITHIN: Duration = Duration::from_secs(30);

fn testapp() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/apps/testapp.py")
}

/// The test app as template `app`, in `mode` (see the app), with short timeouts.
fn app(mode: &str) -> Template {
    with_program(app_program(mode))
}

fn app_program(mode: &str) -> Program {
    let mut p =
        Program::from_command_line(&format!("python3 {}", testapp().display()), None).unwrap();
    if !mode.is_empty() {
        p.env.insert("TESTAPP_MODE".into(), mode.into());
    }
    p.env.insert("PYTHONDONTWRITEBYTECODE".into(), "1".into());
    p.start_timeout = Duration::from_secs(10);
    p.stop_grace = Duration::from_secs(2);
    // Not `/`, which counts requests.
    p.ready = valet_template::Probe::Http {
        path: "/env/PORT".into(),
        explicit: true,
    };
    p
}

fn with_program(p: Program) -> Template {
    Template::new("app", Kind::Program(Box::new(p))).unwrap()
}

struct System {
    dir: tempfile::TempDir,
    embedded: Embedded,
}

impl System {
    async fn start(template: Template, workers: usize) -> Self {
        Self::start_with(template, workers, |_| {}).await
    }

    async fn start_with(
        template: Template,
        workers: usize,
        tune: impl FnOnce(&mut EmbeddedConfig),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config = EmbeddedConfig::counter(dir.path(), 0).with_template(template, workers);
        tune(&mut config);
        let embedded = Embedded::start(config).await.unwrap();
        embedded
            .plane
            .catalog()
            .create_atespace("demo")
            .await
            .unwrap();
        for name in ["p1", "p2"] {
            embedded
                .plane
                .catalog()
                .create_actor(key(name), "default", "app", Vec::new())
                .await
                .unwrap();
        }
        Self { dir, embedded }
    }

    /// Resumes `name`; where its worker answers.
    async fn resume(&self, name: &str) -> Result<SocketAddr, tonic::Status> {
        let (a, _) = self
            .embedded
            .plane
            .resume_actor(key(name), Some(WITHIN))
            .await?;
        Ok(SocketAddr::new(
            a.ateom_pod_ip.parse().unwrap(),
            a.worker_port as u16,
        ))
    }

    fn actor(&self, name: &str) -> valet_proto::ateapi::Actor {
        self.embedded.plane.catalog().get_actor(&key(name)).unwrap()
    }

    async fn until_status(&self, name: &str, status: Status) {
        let k = key(name);
        let reached = self
            .embedded
            .plane
            .wait_until(WITHIN, |p| {
                p.catalog()
                    .get_actor(&k)
                    .is_ok_and(|a| a.status == status as i32)
                    && !p.is_busy("demo", k.name())
            })
            .await;
        assert!(reached, "{name} never {status:?}: {:?}", self.actor(name));
    }

    /// The live data directory of `name`.
    fn live(&self, name: &str) -> PathBuf {
        self.dir.path().join("run/demo").join(name).join("data")
    }

    /// The directory of `name`'s program snapshots.
    fn snapshots(&self, name: &str) -> PathBuf {
        let uid = self.actor(name).ateom_pod_uid;
        self.dir
            .path()
            .join("snapshots/demo")
            .join(name)
            .join(uid)
            .join("program")
    }

    async fn stop(self) {
        self.embedded.shutdown().await;
    }
}

fn key(name: &str) -> ActorKey {
    ActorKey::new("demo", name).unwrap()
}

/// One request for `actor` to its worker at `addr`; the status and body.
async fn request(
    addr: SocketAddr,
    actor: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", format!("{}.actors.test", actor.replace('/', ".")))
        .header("x-actor-ref", actor)
        .body(Full::new(Bytes::copy_from_slice(body)))
        .unwrap();
    match send.send_request(req).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
        Err(e) => (0, e.to_string()),
    }
}

async fn get(addr: SocketAddr, name: &str, path: &str) -> (u16, String) {
    request(addr, &format!("demo/{name}"), "GET", path, b"").await
}

/// The live processes whose environment names `dir` as their data directory (an
/// actor's program, and its children that kept their environment).
fn programs_in(dir: &Path) -> Vec<i32> {
    let marker = format!("VALET_DATA_DIR={}", dir.display()).into_bytes();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        let ours = std::fs::read(format!("/proc/{pid}/environ"))
            .map(|env| env.split(|&b| b == 0).any(|kv| kv == marker.as_slice()))
            .unwrap_or(false);
        if ours && !zombie {
            found.push(pid);
        }
    }
    found
}

/// The first promise: what the app writes survives a suspend and resume, and
/// an eviction; two actors of one template keep separate data; the program sees
/// only the environment it is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_survives_suspend_resume_and_eviction_and_actors_keep_their_own() {
    let sys = System::start_with(app(""), 1, |c| {
        c.plane.evict_idle_after = Duration::from_millis(1);
    })
    .await;
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(get(p1, "p1", "/").await, (200, "count 1\n".into()));
    assert_eq!(get(p1, "p1", "/").await, (200, "count 2\n".into()));
    assert_eq!(
        request(p1, "demo/p1", "PUT", "/write/note", b"remember me").await,
        (200, "wrote 11\n".into())
    );
    assert_eq!(get(p1, "p1", "/env/VALET_ACTOR").await.1, "demo/p1\n");
    assert_eq!(
        get(p1, "p1", "/env/VALET_DATA_DIR").await.1,
        format!("{}\n", sys.live("p1").display())
    );
    // The worker's own environment stays out.
    assert_eq!(get(p1, "p1", "/env/CARGO_MANIFEST_DIR").await.1, "\n");

    let suspended = sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
    assert_eq!(suspended.status, Status::Suspended as i32);
    assert!(
        programs_in(&sys.live("p1")).is_empty(),
        "its program is gone once SUSPENDED"
    );
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(
        get(p1, "p1", "/read/note").await,
        (200, "remember me".into())
    );
    assert_eq!(get(p1, "p1", "/").await, (200, "count 3\n".into()));

    // The pool's one worker is p1's: p2's resume evicts p1 (idle), with its data.
    let p2 = sys.resume("p2").await.unwrap();
    assert_eq!(sys.actor("p1").status, Status::Suspended as i32, "evicted");
    assert_eq!(
        get(p2, "p2", "/").await,
        (200, "count 1\n".into()),
        "its own count"
    );
    assert_eq!(get(p2, "p2", "/read/note").await.0, 404, "not p1's data");
    sys.embedded.plane.suspend_actor(key("p2")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(
        get(p1, "p1", "/").await,
        (200, "count 4\n".into()),
        "after its eviction"
    );
    assert_eq!(
        get(p1, "p1", "/read/note").await,
        (200, "remember me".into())
    );
    let live = sys.live("p1");
    sys.stop().await;
    assert!(
        programs_in(&live).is_empty(),
        "nothing outlives the workers"
    );
}

/// A program that exits, or is never ready, fails its restore: the actor is CRASHED
/// with the reason and the program's last output, its worker is free again, and no
/// process of it is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_that_exits_at_start_or_is_never_ready_crashes_its_actor() {
    for (mode, timeout, reason) in [
        (
            "exit-at-start",
            10,
            "its program exited with status 2 before it was ready; its last output:\n[out] exiting at start on purpose",
        ),
        (
            "wrong-port",
            2,
            "its program was not ready within 2s (start_timeout): connecting to 127.0.0.1:",
        ),
        (
            "not-ready",
            2,
            "its program was not ready within 2s (start_timeout): HTTP GET /env/PORT answered 503 Service Unavailable",
        ),
    ] {
        let mut p = app_program(mode);
        p.start_timeout = Duration::from_secs(timeout);
        let sys = System::start(with_program(p), 1).await;
        let e = sys.resume("p1").await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{mode}: {e:?}");
        let a = sys.actor("p1");
        assert_eq!(a.status, Status::Crashed as i32, "{mode}");
        assert!(
            a.status_reason.contains(reason),
            "{mode}: {:?}",
            a.status_reason
        );
        assert!(
            a.status_reason.starts_with("restore of demo/p1 failed: "),
            "{mode}: {:?}",
            a.status_reason
        );
        if mode == "wrong-port" {
            assert!(
                a.status_reason
                    .contains("does it listen on 127.0.0.1:$PORT"),
                "{:?}",
                a.status_reason
            );
        }
        assert_eq!(
            sys.embedded.plane.pool("app"),
            (1, 1),
            "{mode}: the worker is free"
        );
        assert!(
            programs_in(&sys.live("p1")).is_empty(),
            "{mode}: no process left"
        );
        sys.stop().await;
    }
}

/// A program that crashes mid-request: the request gets 502, the actor is CRASHED
/// with its exit status and last words, the worker is free, and a revert brings it
/// back from its last snapshot (not from what it wrote since).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_that_crashes_while_hosted_is_crashed_and_reverted_from_its_last_snapshot() {
    let sys = System::start(app(""), 1).await;
    let p1 = sys.resume("p1").await.unwrap();
    request(p1, "demo/p1", "PUT", "/write/kept", b"snapshotted").await;
    sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    request(p1, "demo/p1", "PUT", "/write/lost", b"not snapshotted").await;
    let (status, body) = get(p1, "p1", "/crash").await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("actor demo/p1 failed"), "{body}");
    sys.until_status("p1", Status::Crashed).await;
    let a = sys.actor("p1");
    assert!(
        a.status_reason
            .starts_with("its program exited with status 3"),
        "{:?}",
        a.status_reason
    );
    assert!(
        a.status_reason.contains("[err] crashing on purpose"),
        "{:?}",
        a.status_reason
    );
    let freed = sys
        .embedded
        .plane
        .wait_until(WITHIN, |p| p.pool("app") == (1, 1))
        .await;
    assert!(freed, "the worker is free again");
    // Fails fast while CRASHED, as the spec says (once the release that wrote it has
    // let the actor go: until then, Aborted).
    assert!(
        sys.embedded
            .plane
            .wait_until(WITHIN, |p| !p.is_busy("demo", "p1"))
            .await
    );
    let e = sys.resume("p1").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    // Its output outlives it.
    let (logs, _) = sys
        .embedded
        .plane
        .catalog()
        .actor_logs(&key("p1"))
        .await
        .unwrap();
    let logs = String::from_utf8(logs).unwrap();
    assert!(logs.contains("[err] crashing on purpose"), "{logs}");
    assert!(
        logs.contains("[valet] its program exited with status 3"),
        "{logs}"
    );

    let reverted = sys.embedded.plane.revert_actor(key("p1")).await.unwrap();
    assert_eq!(reverted.status, Status::Suspended as i32);
    assert!(reverted.status_reason.is_empty());
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(
        get(p1, "p1", "/read/kept").await,
        (200, "snapshotted".into())
    );
    assert_eq!(
        get(p1, "p1", "/read/lost").await.0,
        404,
        "written after the snapshot"
    );
    sys.stop().await;
}

/// A program that ignores SIGTERM is killed after its grace and its snapshot still
/// written; one that forks leaves no child behind (one that left its process group,
/// and kept the directory's lock, included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_kills_what_ignores_the_signal_and_every_child() {
    for mode in ["ignore-term", "fork"] {
        let sys = System::start(app(mode), 1).await;
        let p1 = sys.resume("p1").await.unwrap();
        request(p1, "demo/p1", "PUT", "/write/note", mode.as_bytes()).await;
        if mode == "fork" {
            let pids = get(p1, "p1", "/pids").await.1;
            assert_eq!(pids.split_whitespace().count(), 3, "{pids}");
            assert_eq!(programs_in(&sys.live("p1")).len(), 3);
        }
        let started = tokio::time::Instant::now();
        let a = sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
        assert_eq!(a.status, Status::Suspended as i32, "{mode}");
        if mode == "ignore-term" {
            assert!(
                started.elapsed() >= Duration::from_secs(2),
                "killed only after its grace"
            );
        }
        assert!(
            programs_in(&sys.live("p1")).is_empty(),
            "{mode}: {:?} left",
            programs_in(&sys.live("p1"))
        );
        let p1 = sys.resume("p1").await.unwrap();
        assert_eq!(
            get(p1, "p1", "/read/note").await,
            (200, mode.into()),
            "{mode}: snapshot written"
        );
        let live = sys.live("p1");
        sys.stop().await;
        assert!(
            programs_in(&live).is_empty(),
            "{mode}: nothing left after the workers stop"
        );
    }
}

/// A data directory over --snapshot-max-bytes: the checkpoint is refused naming the
/// actor, the size and the limit; the actor keeps running; its last good snapshot
/// stays (a crash and revert find it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_over_the_limit_keeps_running_and_its_last_snapshot() {
    let sys = System::start_with(app(""), 1, |c| c.snapshot_max_bytes = 1 << 20).await;
    let p1 = sys.resume("p1").await.unwrap();
    request(p1, "demo/p1", "PUT", "/write/note", b"small").await;
    sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    get(p1, "p1", "/grow/2000000").await;
    let e = sys
        .embedded
        .plane
        .suspend_actor(key("p1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message()
            .starts_with("checkpoint of actor demo/p1 refused: its data directory holds 20000"),
        "{}",
        e.message()
    );
    assert!(
        e.message().contains("over --snapshot-max-bytes 1048576"),
        "{}",
        e.message()
    );
    assert_eq!(sys.actor("p1").status, Status::Running as i32);
    assert_eq!(
        get(p1, "p1", "/read/note").await,
        (200, "small".into()),
        "still served"
    );
    get(p1, "p1", "/crash").await;
    sys.until_status("p1", Status::Crashed).await;
    sys.embedded.plane.revert_actor(key("p1")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(get(p1, "p1", "/read/note").await, (200, "small".into()));
    assert_eq!(
        get(p1, "p1", "/read/big").await.0,
        404,
        "the last good snapshot"
    );
    sys.stop().await;
}

/// A snapshot that cannot be written (here its directory's place is taken by a file;
/// a full disk fails the same way) fails the checkpoint after the program was stopped:
/// the program is started again on its data, and the actor serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_cannot_be_written_restarts_the_program() {
    let sys = System::start(app(""), 1).await;
    let p1 = sys.resume("p1").await.unwrap();
    request(p1, "demo/p1", "PUT", "/write/note", b"not lost").await;
    let blocked = sys.snapshots("p1");
    std::fs::create_dir_all(blocked.parent().unwrap()).unwrap();
    std::fs::write(&blocked, "a file where the snapshots go").unwrap();
    let e = sys
        .embedded
        .plane
        .suspend_actor(key("p1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message()
            .starts_with("checkpoint of actor demo/p1 failed: "),
        "{}",
        e.message()
    );
    assert!(
        e.message()
            .ends_with("its last snapshot stays; it keeps running here"),
        "{}",
        e.message()
    );
    assert_eq!(sys.actor("p1").status, Status::Running as i32);
    assert_eq!(
        get(p1, "p1", "/read/note").await,
        (200, "not lost".into()),
        "served again"
    );
    std::fs::remove_file(&blocked).unwrap();
    sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(get(p1, "p1", "/read/note").await, (200, "not lost".into()));
    sys.stop().await;
}

/// A tmpfs of `size` mounted at `at` (as root), unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(at).ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(at.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A real full disk under the snapshots (a 2 MiB tmpfs, where this test may mount
/// one; reported as skipped elsewhere): the checkpoint fails saying so, the program is
/// started again, the actor serves on with its data, and the last good snapshot
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_checkpoint_and_the_actor_serves_on() {
    let mut disk = None;
    let sys = System::start_with(app(""), 1, |c| {
        disk = Tmpfs::mount(&c.data_dir.join("snapshots"), "2m");
    })
    .await;
    if disk.is_none() {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
        sys.stop().await;
        return;
    }
    let p1 = sys.resume("p1").await.unwrap();
    request(p1, "demo/p1", "PUT", "/write/note", b"small").await;
    sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    get(p1, "p1", "/random/4000000").await;
    let e = sys
        .embedded
        .plane
        .suspend_actor(key("p1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("No space left on device"),
        "{}",
        e.message()
    );
    assert!(
        e.message()
            .ends_with("its last snapshot stays; it keeps running here"),
        "{}",
        e.message()
    );
    assert_eq!(
        get(p1, "p1", "/read/note").await,
        (200, "small".into()),
        "served on"
    );
    get(p1, "p1", "/crash").await;
    sys.until_status("p1", Status::Crashed).await;
    sys.embedded.plane.revert_actor(key("p1")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(
        get(p1, "p1", "/read/note").await,
        (200, "small".into()),
        "the last good snapshot"
    );
    assert_eq!(get(p1, "p1", "/read/random").await.0, 404);
    sys.stop().await;
    drop(disk);
}

/// A damaged or missing snapshot fails the restore with a clear reason: the app is
/// never started on an empty directory in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_or_missing_snapshot_fails_the_restore() {
    let sys = System::start(app(""), 1).await;
    let p1 = sys.resume("p1").await.unwrap();
    request(p1, "demo/p1", "PUT", "/write/note", b"precious").await;
    sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
    let archive = std::fs::read_dir(sys.snapshots("p1"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "zst"))
        .unwrap();
    let mut bytes = std::fs::read(&archive).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&archive, &bytes).unwrap();
    let e = sys.resume("p1").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    let reason = sys.actor("p1").status_reason;
    assert!(
        reason.contains(&format!(
            "snapshot {} is damaged",
            archive
                .file_stem()
                .unwrap()
                .to_string_lossy()
                .trim_end_matches(".tar")
        )),
        "{reason}"
    );
    assert!(programs_in(&sys.live("p1")).is_empty(), "never started");

    std::fs::remove_file(&archive).unwrap();
    sys.embedded.plane.revert_actor(key("p1")).await.unwrap();
    sys.resume("p1").await.unwrap_err();
    let reason = sys.actor("p1").status_reason;
    assert!(reason.contains("is missing"), "{reason}");
    assert!(
        reason.contains("the app is not started on an empty directory in its place"),
        "{reason}"
    );
    sys.stop().await;
}

/// Requests reach the program whole: bodies streamed both ways, a protocol upgrade
/// as a tunnel, and HTTP/2 (h2c) from the router to the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_upgrades_and_h2c_reach_the_program() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let sys = System::start(app(""), 1).await;
    let p1 = sys.resume("p1").await.unwrap();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let (status, echoed) = {
        let stream = tokio::net::TcpStream::connect(p1).await.unwrap();
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = http::Request::post("/echo")
            .header("host", "p1")
            .header("x-actor-ref", "demo/p1")
            .body(Full::new(Bytes::from(big.clone())))
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        (
            resp.status(),
            resp.into_body().collect().await.unwrap().to_bytes(),
        )
    };
    assert_eq!(status, 200);
    assert!(
        echoed == big,
        "the body came back whole ({} bytes)",
        echoed.len()
    );

    let mut c = tokio::net::TcpStream::connect(p1).await.unwrap();
    c.write_all(b"GET /tunnel HTTP/1.1\r\nHost: p1\r\nx-actor-ref: demo/p1\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n").await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        c.read_exact(&mut b).await.unwrap();
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: echo"), "{head}");
    c.write_all(b"ping through the tunnel").await.unwrap();
    let mut back = [0u8; 23];
    c.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping through the tunnel");
    // An open tunnel is a request in flight: a policy's checkpoint would not take it.
    assert!(
        sys.actor("p1").busy || {
            sys.embedded
                .plane
                .wait_until(WITHIN, |p| {
                    p.catalog().get_actor(&key("p1")).is_ok_and(|a| a.busy)
                })
                .await
        }
    );
    drop(c);

    let stream = tokio::net::TcpStream::connect(p1).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{p1}/"))
        .header("x-actor-ref", "demo/p1")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &body[..],
        b"count 1\n",
        "an h2c request, answered by an HTTP/1.1 program"
    );
    sys.stop().await;
}

/// A real, unmodified third-party server: Python's `http.server` serving files from
/// the data directory, restored from its snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmodified_http_server_serves_its_restored_data() {
    let p = Program::from_command_line(
        "python3 -m http.server {port} --bind 127.0.0.1 --directory {data}",
        None,
    )
    .unwrap();
    let sys = System::start(with_program(p), 1).await;
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(
        get(p1, "p1", "/hello.txt").await.0,
        404,
        "a new actor starts empty"
    );
    // What the app's own writes would be: the directory it serves.
    std::fs::write(sys.live("p1").join("hello.txt"), "hello from a snapshot\n").unwrap();
    sys.embedded.plane.suspend_actor(key("p1")).await.unwrap();
    assert!(
        programs_in(&sys.live("p1")).is_empty(),
        "stopped while SUSPENDED"
    );
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(
        get(p1, "p1", "/hello.txt").await,
        (200, "hello from a snapshot\n".into())
    );
    sys.stop().await;
}

/// Limits from the template hold from the program's first instruction; going over
/// the memory limit or the CPU time is a crash like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_apply_and_going_over_them_is_a_crash() {
    let mut p = app_program("");
    p.limits.memory = Some(512 << 20);
    p.limits.cpu_time = Some(Duration::from_secs(1));
    p.limits.open_files = Some(200);
    let sys = System::start(with_program(p), 1).await;
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(
        get(p1, "p1", "/rlimits").await,
        (200, format!("{} 1 200\n", 512u64 << 20))
    );
    assert_eq!(get(p1, "p1", "/alloc/1024").await.0, 502);
    sys.until_status("p1", Status::Crashed).await;
    let reason = sys.actor("p1").status_reason;
    assert!(
        reason.starts_with("its program exited with status 1"),
        "{reason}"
    );
    assert!(
        reason.contains("out of memory allocating 1024 MiB"),
        "{reason}"
    );

    sys.embedded.plane.revert_actor(key("p1")).await.unwrap();
    let p1 = sys.resume("p1").await.unwrap();
    assert_eq!(get(p1, "p1", "/spin").await.0, 502);
    sys.until_status("p1", Status::Crashed).await;
    let reason = sys.actor("p1").status_reason;
    assert!(
        reason.starts_with("its program killed by signal"),
        "{reason}"
    );
    assert!(reason.contains("over limits.cpu_time"), "{reason}");
    sys.stop().await;
}

/// A template whose command is missing, or that asks for a limit this machine cannot
/// apply, is refused when its worker starts, naming the template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_cannot_run_here_is_refused_at_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let missing =
        with_program(Program::from_command_line("valet-no-such-program --x", None).unwrap());
    let e = Embedded::start(EmbeddedConfig::counter(dir.path(), 0).with_template(missing, 1))
        .await
        .unwrap_err();
    assert_eq!(
        e,
        "template app: command \"valet-no-such-program\" is not found on PATH"
    );

    let not_exec = dir.path().join("app.sh");
    std::fs::write(&not_exec, "#!/bin/sh\n").unwrap();
    let t =
        with_program(Program::from_command_line(&not_exec.display().to_string(), None).unwrap());
    let e = Embedded::start(EmbeddedConfig::counter(dir.path(), 0).with_template(t, 1))
        .await
        .unwrap_err();
    assert!(
        e.starts_with("template app: command ") && e.ends_with("is not executable"),
        "{e}"
    );

    let mut p = Program::from_command_line("python3 -V", None).unwrap();
    p.limits.cpu = Some(0.5);
    let e =
        Embedded::start(EmbeddedConfig::counter(dir.path(), 0).with_template(with_program(p), 1))
            .await
            .unwrap_err();
    assert!(
        e.starts_with("template app: limits.cpu needs a cgroup v2"),
        "{e}"
    );
}

/// cgroup v2 limits, where this machine delegates the memory and cpu controllers
/// (writable cgroup2 with both available); reported as skipped elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cgroup_limits_where_the_machine_delegates_them() {
    let Some(root) = delegated_cgroup() else {
        eprintln!(
            "skipped: no cgroup v2 with the memory and cpu controllers can be delegated here"
        );
        return;
    };
    let cgroup = valet_worker::Cgroup::open(&root).unwrap();
    let mut p = app_program("");
    p.limits.memory = Some(256 << 20);
    p.limits.cpu = Some(0.5);
    let t = with_program(p);
    valet_worker::check_template(&t, Some(&cgroup)).unwrap();
    let sys = System::start_with(t, 1, |c| c.cgroup = Some(cgroup)).await;
    let p1 = sys.resume("p1").await.unwrap();
    let pid = get(p1, "p1", "/pids")
        .await
        .1
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let path = cg.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
    let mount = root.parent().unwrap();
    let dir = mount.join(path.trim_start_matches('/'));
    assert!(
        dir.starts_with(&root),
        "in a child of the delegated cgroup: {}",
        dir.display()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("memory.max"))
            .unwrap()
            .trim(),
        (256u64 << 20).to_string()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("cpu.max")).unwrap().trim(),
        "50000 100000"
    );
    assert_eq!(
        get(p1, "p1", "/alloc/512").await.0,
        502,
        "over memory.max: a crash"
    );
    sys.until_status("p1", Status::Crashed).await;
    sys.stop().await;
    let _ = std::fs::remove_dir(&root);
}

/// A cgroup v2 directory with memory and cpu enabled for its children, made under
/// the unified hierarchy, if this machine allows it.
fn delegated_cgroup() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let mount = mounts
        .lines()
        .find(|l| l.split_whitespace().nth(2) == Some("cgroup2"))?
        .split_whitespace()
        .nth(1)?
        .to_owned();
    let controllers = std::fs::read_to_string(Path::new(&mount).join("cgroup.controllers")).ok()?;
    if !(controllers.contains("memory") && controllers.contains("cpu")) {
        return None;
    }
    let dir = Path::new(&mount).join(format!("valet-test-{}", std::process::id()));
    std::fs::create_dir(&dir).ok()?;
    std::fs::write(dir.join("cgroup.subtree_control"), "+memory +cpu").ok()?;
    Some(dir)
}
