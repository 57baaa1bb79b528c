//! `ResumeActor` latency over loopback gRPC against the reference control plane with
//! in-process workers: the router's per-request fast path (a RUNNING actor), and a
//! SUSPENDED actor restored with no restore delay; then restores per second over a pool
//! of 20 workers (20 clients, each resuming and suspending its own actor).
//!
//! `cargo bench -p valet-control --bench resume`; with `VALET_BENCH_STORE=postgres`,
//! on a throwaway PostgreSQL server (initdb and pg_ctl must be installed).

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::net::TcpListener;
use valet_control::{Plane, PlaneConfig, SqliteStore};
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_worker::{Worker, WorkerConfig};

const FAST_PATH_CALLS: usize = 20_000;
const RESTORES: usize = 2_000;
/// Workers (and clients, one actor each) of the throughput run.
const POOL: usize = 20;
const THROUGHPUT_FOR: Duration = Duration::from_secs(5);

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

fn aref(name: &str) -> Option<ateapi::ActorRef> {
    Some(ateapi::ActorRef {
        atespace: "bench".into(),
        name: name.into(),
    })
}

fn report(what: &str, h: &Histogram<u64>) {
    let us = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{what:<34} n={:<6} median {:>8.1} us   p99 {:>8.1} us   max {:>8.1} us",
        h.len(),
        us(0.5),
        us(0.99),
        h.max() as f64 / 1000.0
    );
}

/// A worker in pool `counter` of the control plane at `addr`, restoring at once.
async fn spawn_worker(addr: std::net::SocketAddr, dir: &std::path::Path) -> Worker {
    Worker::spawn(WorkerConfig {
        credentials: Default::default(),
        control_plane: format!("http://{addr}"),
        pool: "counter".into(),
        listen: "127.0.0.1:0".parse().unwrap(),
        snapshot_dir: dir.join("snapshots"),
        restore_delay: Duration::ZERO,
        worker_id: None,
        advertise: None,
        templates: Default::default(),
        run_dir: dir.join("snapshots").with_file_name("run"),
        snapshot_max_bytes: valet_worker::DEFAULT_SNAPSHOT_MAX_BYTES,
        cgroup: None,
    })
    .await
    .unwrap()
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _postgres): (std::sync::Arc<dyn valet_control::Store>, _) =
        if std::env::var("VALET_BENCH_STORE").as_deref() == Ok("postgres") {
            let pg = valet_control::tempdb::TempPostgres::start_async().await;
            let store = valet_control::PostgresStore::open(&pg.url()).await.unwrap();
            (std::sync::Arc::new(store), Some(pg))
        } else {
            (
                std::sync::Arc::new(SqliteStore::open(&dir.path().join("data")).unwrap()),
                None,
            )
        };
    println!("store: {}", store.describe());
    let plane = Plane::open(store, PlaneConfig::default()).await.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(valet_control::serve(
        listener,
        plane.clone(),
        std::future::pending(),
        Duration::from_secs(10),
        Default::default(),
    ));
    let worker = spawn_worker(addr, dir.path()).await;
    assert!(
        plane
            .wait_until(Duration::from_secs(10), |p| p.pool("counter") == (1, 1))
            .await
    );

    let mut c = ControlClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    c.create_atespace(ateapi::CreateAtespaceRequest {
        name: "bench".into(),
    })
    .await
    .unwrap();
    for name in ["running", "cold"] {
        c.create_actor(ateapi::CreateActorRequest {
            actor_ref: aref(name),
            actor_template_namespace: "default".into(),
            actor_template_name: "counter".into(),
            worker_selector: None,
        })
        .await
        .unwrap();
    }

    // Fast path.
    let resume = |name: &'static str| ateapi::ResumeActorRequest {
        actor_ref: aref(name),
        ..Default::default()
    };
    c.resume_actor(resume("running")).await.unwrap();
    let mut fast = Histogram::<u64>::new(3).unwrap();
    for _ in 0..1000 {
        c.resume_actor(resume("running")).await.unwrap();
    }
    for _ in 0..FAST_PATH_CALLS {
        let t = Instant::now();
        c.resume_actor(resume("running")).await.unwrap();
        fast.record(t.elapsed().as_nanos() as u64).unwrap();
    }
    report("ResumeActor, RUNNING actor", &fast);
    c.suspend_actor(ateapi::SuspendActorRequest {
        actor_ref: aref("running"),
    })
    .await
    .unwrap();

    // Restore path: resume a suspended actor, then suspend it again (not timed).
    let mut cold = Histogram::<u64>::new(3).unwrap();
    for _ in 0..RESTORES {
        let t = Instant::now();
        let r = c.resume_actor(resume("cold")).await.unwrap().into_inner();
        cold.record(t.elapsed().as_nanos() as u64).unwrap();
        assert!(r.resumed);
        c.suspend_actor(ateapi::SuspendActorRequest {
            actor_ref: aref("cold"),
        })
        .await
        .unwrap();
    }
    report("ResumeActor, SUSPENDED, delay 0", &cold);

    // Throughput: POOL workers, POOL clients, each resuming its own suspended actor
    // and suspending it again, for THROUGHPUT_FOR.
    let mut pool = vec![worker];
    for _ in 1..POOL {
        pool.push(spawn_worker(addr, dir.path()).await);
    }
    assert!(
        plane
            .wait_until(Duration::from_secs(30), |p| p.pool("counter").0 == POOL)
            .await
    );
    let names: Vec<String> = (0..POOL).map(|i| format!("t{i}")).collect();
    for name in &names {
        c.create_actor(ateapi::CreateActorRequest {
            actor_ref: aref(name),
            actor_template_namespace: "default".into(),
            actor_template_name: "counter".into(),
            worker_selector: None,
        })
        .await
        .unwrap();
    }
    let start = Instant::now();
    let loops = names.into_iter().map(|name| {
        let mut c = c.clone();
        tokio::spawn(async move {
            let mut restores = 0u64;
            while start.elapsed() < THROUGHPUT_FOR {
                let r = c
                    .resume_actor(ateapi::ResumeActorRequest {
                        actor_ref: aref(&name),
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert!(r.resumed);
                restores += 1;
                c.suspend_actor(ateapi::SuspendActorRequest {
                    actor_ref: aref(&name),
                })
                .await
                .unwrap();
            }
            restores
        })
    });
    let mut restores = 0;
    for l in loops.collect::<Vec<_>>() {
        restores += l.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "restores, {POOL} workers, {POOL} clients     {restores} in {secs:.1} s: {:.0} restores/s (each with its suspend)",
        restores as f64 / secs
    );
    for w in pool {
        w.shutdown().await;
    }
}
