//! `--log-format` and `--log-level`, on every subcommand (cli.md, "Flags").

mod common;

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

#[tokio::test]
async fn json_logs_go_to_stderr_and_listening_lines_stay_plain() {
    let lines = control_plane_log(&["--log-format", "json", "--log-level", "info"]).await;
    assert!(!lines.is_empty(), "the control plane logs its start");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{l}");
        assert!(v["timestamp"].is_string(), "{l}");
    }
    assert!(
        lines.iter().any(|l| l.contains("control plane serving")),
        "{lines:?}"
    );
}

/// Starts `valet control-plane` with `flags`, stops it with SIGTERM once it listens,
/// and returns its stderr lines.
async fn control_plane_log(flags: &[&str]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_valet"))
        .args(["control-plane", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(flags)
        .env_remove("VALET_LOG")
        .env_remove("VALET_LOG_FORMAT")
        .env_remove("VALET_LOG_LEVEL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    // Plain lines on stdout whatever the log format: the reserved port, then the
    // listener.
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(30), out.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
    };
    let bound = next().await;
    assert!(
        bound.starts_with("bound control-plane 127.0.0.1:"),
        "{bound}"
    );
    let listening = next().await;
    assert!(
        listening.starts_with("listening control-plane 127.0.0.1:"),
        "{listening}"
    );
    let pid = child.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut lines = Vec::new();
    while let Ok(Some(l)) = tokio::time::timeout(Duration::from_secs(30), err.next_line())
        .await
        .unwrap()
    {
        lines.push(l);
    }
    assert!(child.wait().await.unwrap().success());
    lines
}

#[tokio::test]
async fn log_level_warn_drops_info_and_text_is_not_json() {
    let info = control_plane_log(&["--log-format", "text", "--log-level", "info"]).await;
    assert!(
        info.iter()
            .any(|l| l.contains("INFO") && l.contains("control plane serving")),
        "{info:?}"
    );
    assert!(
        info.iter().all(|l| !l.trim_start().starts_with('{')),
        "{info:?}"
    );
    let warn = control_plane_log(&["--log-format", "text", "--log-level", "warn"]).await;
    assert!(warn.iter().all(|l| !l.contains("INFO")), "{warn:?}");
}

#[tokio::test]
async fn a_bad_log_flag_is_a_configuration_error() {
    for (flag, value) in [
        ("--log-level", "loud"),
        ("--log-level", "valet=loud"),
        ("--log-format", "xml"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_valet"))
            .args(["router", flag, value])
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(64), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(flag) && stderr.contains(value), "{stderr}");
        if flag == "--log-format" {
            assert!(stderr.contains("[possible values: json, text]"), "{stderr}");
        }
    }
}

#[tokio::test]
async fn logs_are_json_when_stderr_is_not_a_terminal() {
    let lines = control_plane_log(&["--log-level", "info"]).await;
    assert!(!lines.is_empty());
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["message"].is_string(), "{l}");
    }
}

/// A clean stop is not a warning: `valet up` stopped with SIGTERM, after serving an
/// actor, logs nothing at `warn` about its own workers leaving (they were told to
/// detach). Every embedded scenario printed one such line per worker before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_logs_no_warning_about_its_own_workers() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "up",
            "--control-plane-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "",
            "--extproc-listen",
            "",
            "--metrics-listen",
            "",
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .env("VALET_LOG", "warn")
        .env_remove("VALET_LOG_FORMAT")
        .env_remove("VALET_LOG_LEVEL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let router = tokio::time::timeout(Duration::from_secs(30), async {
        let mut router = None;
        while let Some(line) = out.next_line().await.unwrap() {
            if let Some(a) = line.strip_prefix("listening router ") {
                router = Some(a.parse::<std::net::SocketAddr>().unwrap());
            }
            if line.starts_with("press Ctrl-C") {
                return router.expect("a router address");
            }
        }
        panic!("valet up exited before it was ready");
    })
    .await
    .expect("valet up gets ready");
    let (status, body) = common::http_get(
        router,
        "/",
        &[("Host", &format!("p1.demo.{}", common::DOMAIN))],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    common::signal(&child, "TERM");
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut logged = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = err.next_line().await {
            logged.push(line);
        }
    })
    .await
    .expect("valet up stops");
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{logged:?}");
    assert!(
        !logged.iter().any(|l| l.contains("left its pool")),
        "{logged:#?}"
    );
}
