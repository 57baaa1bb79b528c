//! Programs as actors, measured with real processes (docs/BENCHMARKS.md, "Your app as
//! an actor"): `cargo bench -p valet --bench apps`.
//!
//! - the notes example's start alone (spawned by hand, polled every millisecond until
//!   it answers) beside a `ResumeActor` that restores it through valet (snapshot
//!   unpacked, program started, probed, recorded RUNNING);
//! - the hand-off lag with a real restore: a suspend's answer to the answer of the
//!   resume that waited for the worker it freed;
//! - a checkpoint and a restore of a 100 MiB data directory, beside `tar | zstd` by hand
//!   on the same directory;
//! - the worker's own memory for a hosted program (the program is a process of its
//!   own: not counted).
//!
//! Figures, not assertions: a benchmark never fails on a time.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use valet_proto::ateapi::{self, control_client::ControlClient};

const ROUNDS: usize = 20;

fn notes() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/notes/app.py")
}

struct Proc {
    child: Child,
    addr: SocketAddr,
}

async fn start(args: &[&str], part: &str) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_valet"))
        .args(args)
        .env("VALET_LOG_LEVEL", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("valet starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next_line().await.unwrap().expect("listening line");
        if let Some(rest) = line.strip_prefix(&format!("listening {part} ")) {
            break rest.parse().unwrap();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Proc { child, addr }
}

fn aref(name: &str) -> Option<ateapi::ActorRef> {
    Some(ateapi::ActorRef {
        atespace: "demo".into(),
        name: name.into(),
    })
}

async fn resume(c: &mut ControlClient<tonic::transport::Channel>, name: &str, wait: Duration) {
    c.resume_actor(ateapi::ResumeActorRequest {
        actor_ref: aref(name),
        wait_for_capacity: Some(wait.try_into().unwrap()),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("resume {name}: {e:?}"));
}

async fn suspend(c: &mut ControlClient<tonic::transport::Channel>, name: &str) {
    c.suspend_actor(ateapi::SuspendActorRequest {
        actor_ref: aref(name),
    })
    .await
    .unwrap_or_else(|e| panic!("suspend {name}: {e:?}"));
}

/// Whether an HTTP server answers `GET /healthz` on `addr` now.
async fn answers(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.is_ok() && head.starts_with(b"HTTP/1.")
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| {
                    l.strip_prefix("VmRSS:")
                        .map(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
                })
                .flatten()
        })
        .unwrap_or(0)
}

/// Fills `dir` with `mib` MiB in 1 MiB files: half of each pseudo-random, half text.
fn fill(dir: &Path, mib: usize) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..mib {
        let mut buf = Vec::with_capacity(1 << 20);
        while buf.len() < 1 << 19 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            buf.extend_from_slice(&x.to_le_bytes());
        }
        while buf.len() < 1 << 20 {
            buf.extend_from_slice(
                format!("note {i}: a line of text that repeats {}\n", buf.len() % 97).as_bytes(),
            );
        }
        buf.truncate(1 << 20);
        std::fs::write(dir.join(format!("blob-{i:03}")), &buf).unwrap();
    }
}

async fn sh(cmd: &str) -> Duration {
    let t = Instant::now();
    let ok = Command::new("sh")
        .args(["-c", cmd])
        .status()
        .await
        .unwrap()
        .success();
    assert!(ok, "{cmd}");
    t.elapsed()
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();
    let templates = dir.path().join("templates.toml");
    std::fs::write(
        &templates,
        format!(
            "[templates.notes]\ncommand = [\"python3\", {:?}]\nready = \"/healthz\"\n",
            notes().display().to_string()
        ),
    )
    .unwrap();
    let t = templates.to_str().unwrap();
    let run_dir = dir.path().join("run");
    let cp = start(
        &[
            "control-plane",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            dir.path().join("cp").to_str().unwrap(),
            "--templates",
            t,
        ],
        "control-plane",
    )
    .await;
    let url = format!("http://{}", cp.addr);
    let worker = start(
        &[
            "worker",
            "--control-plane",
            &url,
            "--pool",
            "notes",
            "--templates",
            t,
            "--snapshot-dir",
            dir.path().join("snapshots").to_str().unwrap(),
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--snapshot-max-bytes",
            "1GiB",
        ],
        "worker",
    )
    .await;
    let mut c = ControlClient::new(
        tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .timeout(Duration::from_secs(60))
            .connect_lazy(),
    );
    c.create_atespace(ateapi::CreateAtespaceRequest {
        name: "demo".into(),
    })
    .await
    .unwrap();
    for name in ["p1", "p2"] {
        c.create_actor(ateapi::CreateActorRequest {
            actor_ref: aref(name),
            actor_template_namespace: "default".into(),
            actor_template_name: "notes".into(),
            worker_selector: None,
        })
        .await
        .unwrap();
    }

    // 1. The app's own start, alone.
    let mut alone = Vec::new();
    for i in 0..ROUNDS {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let data = dir.path().join(format!("alone-{i}"));
        let t = Instant::now();
        let mut app = Command::new("python3")
            .arg(notes())
            .env("PORT", port.to_string())
            .env("VALET_DATA_DIR", &data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        while !answers(SocketAddr::from(([127, 0, 0, 1], port))).await {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        alone.push(t.elapsed());
        let _ = app.kill().await;
    }

    // 2. A restore through valet (ResumeActor at the client), its snapshot unpacked.
    resume(&mut c, "p1", Duration::from_secs(30)).await;
    let mut restores = Vec::new();
    let mut checkpoints = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        suspend(&mut c, "p1").await;
        checkpoints.push(t.elapsed());
        let t = Instant::now();
        resume(&mut c, "p1", Duration::from_secs(30)).await;
        restores.push(t.elapsed());
    }

    // 3. Memory: the worker's own, hosting the program, then not.
    let hosting = rss_kib(worker.child.id().unwrap());
    suspend(&mut c, "p1").await;
    let idle = rss_kib(worker.child.id().unwrap());

    // 4. The hand-off lag with a real restore: p2 waits for p1's worker.
    let mut lags = Vec::new();
    for round in 0..10 {
        let (running, waiting) = if round % 2 == 0 {
            ("p1", "p2")
        } else {
            ("p2", "p1")
        };
        resume(&mut c, running, Duration::from_secs(30)).await;
        let mut c2 = c.clone();
        let waiter = tokio::spawn(async move {
            resume(&mut c2, waiting, Duration::from_secs(30)).await;
            Instant::now()
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        suspend(&mut c, running).await;
        let freed = Instant::now();
        lags.push(waiter.await.unwrap().duration_since(freed));
        suspend(&mut c, waiting).await;
    }

    // 5. 100 MiB of data: a checkpoint and a restore, beside tar | zstd by hand.
    resume(&mut c, "p1", Duration::from_secs(30)).await;
    let live = run_dir.join("demo/p1/data");
    fill(&live, 100);
    let t = Instant::now();
    suspend(&mut c, "p1").await;
    let big_checkpoint = t.elapsed();
    let t = Instant::now();
    resume(&mut c, "p1", Duration::from_secs(60)).await;
    let big_restore = t.elapsed();
    let by_hand = dir.path().join("by-hand.tar.zst");
    let out = dir.path().join("by-hand");
    std::fs::create_dir_all(&out).unwrap();
    let tar_zstd = sh(&format!(
        "tar -C {} -cf - . | zstd -3 -q -T1 -o {} && sync {}",
        live.display(),
        by_hand.display(),
        by_hand.display()
    ))
    .await;
    let unzstd_tar = sh(&format!(
        "zstd -dc -q {} | tar -C {} -xf -",
        by_hand.display(),
        out.display()
    ))
    .await;
    suspend(&mut c, "p1").await;

    let med = |v: &[Duration]| percentile(v.to_vec(), 0.5);
    let added = med(&restores).saturating_sub(med(&alone));
    let snapshot_time = big_checkpoint.saturating_sub(med(&checkpoints));
    let unpack_time = big_restore.saturating_sub(med(&restores));
    let mibps = |d: Duration| 100.0 / d.as_secs_f64();
    println!("Programs as actors: the notes example (Python, SQLite), {ROUNDS} rounds each");
    println!(
        "  app alone, start to first answer:     median {}, p90 {}",
        ms(med(&alone)),
        ms(percentile(alone.clone(), 0.9))
    );
    println!(
        "  ResumeActor restoring it through valet: median {}, p90 {}",
        ms(med(&restores)),
        ms(percentile(restores.clone(), 0.9))
    );
    println!("  valet's added time (medians):           {}", ms(added));
    println!(
        "  SuspendActor (stop + snapshot):         median {}, p90 {}",
        ms(med(&checkpoints)),
        ms(percentile(checkpoints.clone(), 0.9))
    );
    println!(
        "  hand-off lag with the restore (10):     median {}, p90 {}",
        ms(med(&lags)),
        ms(percentile(lags.clone(), 0.9))
    );
    println!("  100 MiB data directory:");
    println!(
        "    checkpoint {} ({} over an empty one: {:.0} MiB/s); tar | zstd -3 by hand {} ({:.0} MiB/s)",
        ms(big_checkpoint),
        ms(snapshot_time),
        mibps(snapshot_time),
        ms(tar_zstd),
        mibps(tar_zstd)
    );
    println!(
        "    restore    {} ({} over an empty one: {:.0} MiB/s); zstd -d | tar by hand {} ({:.0} MiB/s)",
        ms(big_restore),
        ms(unpack_time),
        mibps(unpack_time),
        ms(unzstd_tar),
        mibps(unzstd_tar)
    );
    println!(
        "  worker RSS: {idle} KiB idle, {hosting} KiB hosting the program ({} KiB for it)",
        hosting.saturating_sub(idle)
    );
    drop(worker);
    drop(cp);
}

fn main() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run());
}
