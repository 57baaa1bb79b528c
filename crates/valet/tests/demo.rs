//! `valet demo parking` and `valet load run`: a short smoke run of the real binary.

mod common;

use std::process::Command;

#[test]
fn demo_parking_prints_results_and_writes_charts() {
    let out = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "demo",
            "parking",
            "--budget",
            "600ms",
            "--restore-delay",
            "10ms",
            "--duration",
            "1s",
            "--out",
            out.path().to_str().unwrap(),
        ])
        .env("VALET_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for want in [
        "p3-no-free-worker",
        "p3-served-after-park",
        "==> results",
        "    total requests : ",
        "    200 OK         : ",
        "    503 unavailable: ",
        "    other          : ",
        "    200 latency    : avg ",
    ] {
        assert!(stdout.contains(want), "{want:?} missing from:\n{stdout}");
    }
    for file in ["timeline.svg", "timeline.csv", "steady.svg", "steady.csv"] {
        let text = std::fs::read_to_string(out.path().join(file)).unwrap();
        if file.ends_with(".svg") {
            assert!(text.starts_with("<svg"), "{file}");
        } else {
            assert!(
                text.starts_with("label,actor,start_s,end_s,latency_s,status,body\n"),
                "{file}"
            );
            assert!(text.lines().count() > 2, "{file}");
        }
    }
}

#[test]
fn load_run_refuses_bad_input() {
    let o = Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "load",
            "run",
            "--router",
            "127.0.0.1:9",
            "--concurrency",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).trim(),
        "valet load: invalid configuration: --concurrency=0: must be >= 1"
    );
}

/// `valet load run` interrupted (SIGINT) keeps what it measured: it stops sending,
/// prints the summary of the requests answered until then, writes them, and exits 1
/// saying the run was cut short. Before, the signal dropped the run with every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_load_run_keeps_what_it_measured() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(AtomicUsize::new(0));
    {
        let served = Arc::clone(&served);
        tokio::spawn(async move {
            loop {
                let (io, _) = listener.accept().await.unwrap();
                let served = Arc::clone(&served);
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(
                    hyper_util::rt::TokioIo::new(io),
                    hyper::service::service_fn(move |_req| {
                        served.fetch_add(1, Ordering::Relaxed);
                        async {
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(
                                http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
                            ))
                        }
                    }),
                ));
            }
        });
    }
    let out = tempfile::tempdir().unwrap();
    let csv = out.path().join("run.csv");
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_valet"))
        .args([
            "load",
            "run",
            "--router",
            &addr.to_string(),
            "--actors",
            "demo/p1",
            "--rate",
            "50",
            "--duration",
            "120s",
            "--csv",
            csv.to_str().unwrap(),
        ])
        .env("VALET_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    common::eventually(
        "requests arrive",
        std::time::Duration::from_secs(30),
        || async { (served.load(Ordering::Relaxed) >= 20).then_some(()) },
    )
    .await;
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let o = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("it stops")
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("valet load: interrupted after"), "{stderr}");
    assert!(stdout.contains("requests (200: "), "{stdout}");
    let rows = std::fs::read_to_string(&csv).unwrap().lines().count() - 1;
    assert!(rows >= 20, "the answered requests are written: {rows}");
}
