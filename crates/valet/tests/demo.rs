//! `valet demo parking` and `valet load run`: a short smoke run of the real binary.

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
