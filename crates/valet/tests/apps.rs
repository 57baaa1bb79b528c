//! Programs as actors with real `valet` processes: `valet up --app`, workers SIGKILLed
//! and SIGTERMed with their programs' processes checked, `valet ctl actor logs`, and
//! the templates file refused at the start.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Up, client, eventually, get_text, request};
use valet_proto::ateapi::actor::Status;

const WITHIN: Duration = Duration::from_secs(30);

fn testapp() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/apps/testapp.py")
        .display()
        .to_string()
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

fn valet(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_valet"))
        .args(args)
        .output()
        .expect("valet runs")
}

/// The one-line path of a newcomer: `valet up --app 'python3 app.py'`. What the app
/// writes survives a suspend and a restart of `valet up` (Ctrl-C checkpoints it);
/// nothing of it runs once `valet up` has stopped; `valet ctl actor logs` prints its
/// output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valet_up_runs_an_app_and_keeps_its_state_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let live = data.join("run/demo/p1/data");
    let app = format!("python3 {}", testapp());
    let up = Up::start_in(tempfile::tempdir().unwrap(), &data, &["--app", &app]).await;
    assert_eq!(get_text(up.router, "p1", "/").await.2, "count 1\n");
    let (s, _, _) = request(
        up.router,
        "PUT",
        &Up::host("p1"),
        "/write/note",
        b"kept".to_vec(),
    )
    .await;
    assert_eq!(s, 200);
    let cp = format!("http://{}", up.control_plane);
    let suspended = valet(&["ctl", "--control-plane", &cp, "actor", "suspend", "demo/p1"]);
    assert!(suspended.status.success(), "{suspended:?}");
    assert!(String::from_utf8_lossy(&suspended.stdout).contains("SUSPENDED"));
    assert!(programs_in(&live).is_empty(), "no program while SUSPENDED");
    assert_eq!(get_text(up.router, "p1", "/").await.2, "count 2\n");
    let logs = valet(&["ctl", "--control-plane", &cp, "actor", "logs", "demo/p1"]);
    assert!(logs.status.success(), "{logs:?}");
    let logs = String::from_utf8_lossy(&logs.stdout);
    assert!(logs.contains("[out] listening on 127.0.0.1:"), "{logs}");
    assert!(
        logs.contains("[valet] stopped: its program killed by signal 15 (SIGTERM)"),
        "{logs}"
    );

    // Ctrl-C: every running actor is checkpointed, and nothing of it runs on.
    let mut child = up.child;
    common::signal(&child, "INT");
    let status = tokio::time::timeout(WITHIN, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(
        programs_in(&live).is_empty(),
        "{:?} left",
        programs_in(&live)
    );

    let up = Up::start_in(tempfile::tempdir().unwrap(), &data, &["--app", &app]).await;
    assert_eq!(get_text(up.router, "p1", "/").await.2, "count 3\n");
    assert_eq!(get_text(up.router, "p1", "/read/note").await.2, "kept");
    assert_eq!(
        get_text(up.router, "p2", "/").await.2,
        "count 1\n",
        "its own data"
    );
    drop(up);
}

/// Workers killed with their programs running. SIGKILL: the program's leader dies with
/// its worker; children it left run on until a worker starting on the same run dir
/// sweeps them, or a restore of the actor elsewhere kills them (one holds the actor
/// directory's lock) before it unpacks anything. SIGTERM: the worker drains (the
/// actor is checkpointed), and no process of the program is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_workers_leave_no_program_behind() {
    let dir = tempfile::tempdir().unwrap();
    let templates = dir.path().join("templates.toml");
    std::fs::write(
        &templates,
        format!(
            "[templates.app]\ncommand = [\"python3\", {:?}]\nenv = {{ TESTAPP_MODE = \"fork\" }}\nstop_grace = \"2s\"\n",
            testapp()
        ),
    )
    .unwrap();
    let t = templates.to_str().unwrap();
    let snapshots = dir.path().join("snapshots");
    let run = dir.path().join("run");
    let live = run.join("demo/p1/data");
    let cp =
        common::control_plane(&dir.path().join("cp"), "127.0.0.1:0", &["--templates", t]).await;
    let worker = |id: &'static str| {
        let (snapshots, run) = (snapshots.clone(), run.clone());
        async move {
            common::worker_with(
                cp.addr,
                &snapshots,
                id,
                &[
                    "--pool",
                    "app",
                    "--templates",
                    t,
                    "--run-dir",
                    run.to_str().unwrap(),
                ],
            )
            .await
        }
    };
    let mut workers = vec![("w1", worker("w1").await), ("w2", worker("w2").await)];
    let c = client(cp.addr);
    c.clone()
        .create_atespace(valet_proto::ateapi::CreateAtespaceRequest {
            name: "demo".into(),
        })
        .await
        .unwrap();
    common::create_from(&c, "demo/p1", "app").await.unwrap();
    // Resumes demo/p1 (asking again while the control plane settles a worker that
    // died): the worker hosting it and its address.
    let resume = || {
        let c = c.clone();
        async move {
            eventually("demo/p1 resumes", WITHIN, || async {
                let r = c
                    .clone()
                    .resume_actor(valet_proto::ateapi::ResumeActorRequest {
                        actor_ref: common::aref("demo/p1"),
                        wait_for_capacity: Some(Duration::from_secs(5).try_into().unwrap()),
                        ..Default::default()
                    })
                    .await
                    .ok()?
                    .into_inner()
                    .actor?;
                let addr =
                    std::net::SocketAddr::new(r.ateom_pod_ip.parse().ok()?, r.worker_port as u16);
                Some((r.ateom_pod_name, addr))
            })
            .await
        }
    };
    let (_, addr) = resume().await;
    assert_eq!(
        worker_request(addr, "PUT", "/write/note", b"snapshotted")
            .await
            .0,
        200
    );
    common::suspend(&c, "demo/p1").await.unwrap();
    let (on, _) = resume().await;
    assert_eq!(
        programs_in(&live).len(),
        3,
        "the program and its two children"
    );

    // SIGKILL its worker: the leader goes with it, its two children stay.
    let i = workers.iter().position(|(id, _)| *id == on).unwrap();
    workers.remove(i).1.kill().await;
    eventually("the leader dies with its worker", WITHIN, || async {
        (programs_in(&live).len() == 2).then_some(())
    })
    .await;
    // A worker starting on the run dir sweeps them.
    workers.push(("w3", worker("w3").await));
    assert!(
        programs_in(&live).is_empty(),
        "swept: {:?}",
        programs_in(&live)
    );

    // Again, and now a restore on a worker already running kills them.
    let (on, _) = resume().await;
    assert_eq!(programs_in(&live).len(), 3);
    let i = workers.iter().position(|(id, _)| *id == on).unwrap();
    workers.remove(i).1.kill().await;
    eventually("the leader dies with its worker", WITHIN, || async {
        (programs_in(&live).len() == 2).then_some(())
    })
    .await;
    let orphans = programs_in(&live);
    let (on, addr) = resume().await;
    for pid in &orphans {
        assert!(
            !programs_in(&live).contains(pid),
            "orphan {pid} killed by the restore"
        );
    }
    assert_eq!(
        worker_request(addr, "GET", "/read/note", b"").await,
        (200, "snapshotted".into())
    );

    // SIGTERM: the worker drains, and its program is stopped whole.
    let i = workers.iter().position(|(id, _)| *id == on).unwrap();
    let (_, mut w) = workers.remove(i);
    w.terminate();
    assert_eq!(w.exit_code(WITHIN).await, Some(0));
    assert!(
        programs_in(&live).is_empty(),
        "{:?} left",
        programs_in(&live)
    );
    let a = common::get(&c, "demo/p1").await.unwrap();
    assert_eq!(common::status(&a), Status::Suspended);
    drop(workers);
    drop(cp);
}

/// One request for demo/p1 straight to its worker at `addr`.
async fn worker_request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, String) {
    use http_body_util::{BodyExt as _, Full};
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "p1")
        .header("x-actor-ref", "demo/p1")
        .body(Full::new(bytes::Bytes::copy_from_slice(body)))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A templates file with an unknown key or a bad duration, or a template whose
/// command is missing, is refused at the start: exit 64 and one line naming the file,
/// the template and the key (or the command).
#[test]
fn bad_templates_are_refused_at_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.toml");
    let f = file.to_str().unwrap();
    let check = |args: &[&str], want: &str| {
        let o = valet(args);
        assert_eq!(o.status.code(), Some(64), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(lines[0].contains(want), "{args:?}: {}", lines[0]);
    };
    std::fs::write(
        &file,
        "[templates.notes]\ncommand = \"python3 app.py\"\nstart_timout = \"5s\"\n",
    )
    .unwrap();
    let unknown = format!("--templates={f}: template notes: unknown field `start_timout`");
    check(&["worker", "--pool", "notes", "--templates", f], &unknown);
    check(
        &["control-plane", "--listen", "127.0.0.1:0", "--templates", f],
        &unknown,
    );
    check(&["up", "--templates", f, "--check"], &unknown);
    std::fs::write(
        &file,
        "[templates.notes]\ncommand = \"python3 app.py\"\nstop_grace = \"ten seconds\"\n",
    )
    .unwrap();
    check(
        &["worker", "--pool", "notes", "--templates", f],
        "template notes: stop_grace: \"ten seconds\" is not a duration",
    );
    std::fs::write(
        &file,
        "[templates.notes]\ncommand = \"valet-no-such-program\"\n",
    )
    .unwrap();
    check(
        &[
            "worker",
            "--pool",
            "notes",
            "--templates",
            f,
            "--run-dir",
            dir.path().join("run").to_str().unwrap(),
            "--snapshot-dir",
            dir.path().join("s").to_str().unwrap(),
        ],
        "valet worker: invalid configuration: --templates: template notes: command \"valet-no-such-program\" is not found on PATH",
    );
    check(
        &[
            "up",
            "--app",
            "valet-no-such-program --port {port}",
            "--check",
        ],
        "valet up: invalid configuration: --app: template app: command \"valet-no-such-program\" is not found on PATH",
    );
    std::fs::write(
        &file,
        "[templates.notes]\ncommand = \"sleep 1\"\nstart_timeout = \"90s\"\n",
    )
    .unwrap();
    check(
        &["control-plane", "--listen", "127.0.0.1:0", "--templates", f],
        "template notes: start_timeout 90s must be below --restore-timeout 60s less 10s",
    );
}

/// The notes example's walkthrough (examples/notes/README.md): write a note, let the
/// actor be evicted by another's request, read the note back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_notes_example_survives_its_eviction() {
    let notes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/notes/app.py");
    let app = format!("python3 {}", notes.display());
    let up = Up::start(&["--app", &app, "--workers", "1", "--evict-idle-after", "1s"]).await;
    let (s, _, id) = request(
        up.router,
        "POST",
        &Up::host("p1"),
        "/notes",
        b"buy milk".to_vec(),
    )
    .await;
    assert_eq!((s, String::from_utf8_lossy(&id).trim()), (201, "1"));
    // p2 parks until p1 has been idle a second, then takes its worker.
    let (s, _, body) = get_text(up.router, "p2", "/").await;
    assert_eq!((s, body.as_str()), (200, "no notes yet\n"));
    let cp = format!("http://{}", up.control_plane);
    let list = valet(&["ctl", "--control-plane", &cp, "actor", "list"]);
    let list = String::from_utf8_lossy(&list.stdout);
    let p1 = list.lines().find(|l| l.starts_with("demo/p1 ")).unwrap();
    assert!(p1.contains("SUSPENDED"), "{list}");
    let (s, _, body) = get_text(up.router, "p1", "/").await;
    assert_eq!((s, body.as_str()), (200, "1: buy milk\n"));
}
