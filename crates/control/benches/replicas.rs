//! Several control-plane replicas on one throwaway PostgreSQL server, in process, with
//! in-process workers (restore delay 0) and real gRPC over loopback:
//!
//! - the hand-off across replicas: a resume waits for capacity on replica B while the
//!   only worker, attached to replica A, is held by another actor; A suspends that
//!   actor; the time from A's answer to the suspend to B's answer to the waiting
//!   resume (A claims the waiter's actor on the freed worker, restores it, and B
//!   answers from the record). The same with both on one replica, for comparison.
//! - restores per second over a pool of 20 workers, with one replica and with two
//!   (10 workers attached to each, clients alternating): 20 clients, each resuming
//!   its own suspended actor and suspending it again.
//!
//! `cargo bench -p valet-control --bench replicas` (initdb and pg_ctl must be
//! installed).

use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::net::TcpListener;
use tonic::transport::Channel;
use valet_control::tempdb::TempPostgres;
use valet_control::{Plane, PlaneConfig, ReplicaStore};
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_worker::{Worker, WorkerConfig};

const HANDOFFS: usize = 300;
const POOL: usize = 20;
const THROUGHPUT_FOR: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(30);

fn main() {
    if let Ok(filter) = std::env::var("VALET_BENCH_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .try_init();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

struct Replica {
    plane: Plane,
    url: String,
    client: ControlClient<Channel>,
}

async fn replica(db: &str) -> Replica {
    let store = Arc::new(ReplicaStore::join(db).await.unwrap());
    let plane = Plane::open_replica(store, PlaneConfig::default())
        .await
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(valet_control::serve(
        listener,
        plane.clone(),
        std::future::pending(),
        Duration::from_secs(10),
        Default::default(),
    ));
    let url = format!("http://{addr}");
    let client = ControlClient::connect(url.clone()).await.unwrap();
    Replica { plane, url, client }
}

async fn workers(on: &Replica, n: usize, dir: &std::path::Path) -> Vec<Worker> {
    let before = on.plane.pool("counter").0;
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(
            Worker::spawn(WorkerConfig {
                credentials: Default::default(),
                control_plane: on.url.clone(),
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
            .unwrap(),
        );
    }
    assert!(
        on.plane
            .wait_until(WAIT, |p| p.pool("counter").0 == before + n)
            .await
    );
    out
}

fn aref(name: &str) -> Option<ateapi::ActorRef> {
    Some(ateapi::ActorRef {
        atespace: "bench".into(),
        name: name.into(),
    })
}

async fn create(c: &ControlClient<Channel>, names: impl IntoIterator<Item = String>) {
    let _ = c
        .clone()
        .create_atespace(ateapi::CreateAtespaceRequest {
            name: "bench".into(),
        })
        .await;
    for name in names {
        c.clone()
            .create_actor(ateapi::CreateActorRequest {
                actor_ref: aref(&name),
                actor_template_namespace: "default".into(),
                actor_template_name: "counter".into(),
                worker_selector: None,
            })
            .await
            .unwrap();
    }
}

async fn resume(
    c: &ControlClient<Channel>,
    name: &str,
    wait: Option<Duration>,
) -> Result<ateapi::ResumeActorResponse, tonic::Status> {
    c.clone()
        .resume_actor(ateapi::ResumeActorRequest {
            actor_ref: aref(name),
            wait_for_capacity: wait.map(|d| d.try_into().unwrap()),
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

async fn suspend(c: &ControlClient<Channel>, name: &str) {
    c.clone()
        .suspend_actor(ateapi::SuspendActorRequest {
            actor_ref: aref(name),
        })
        .await
        .unwrap();
}

fn report(what: &str, h: &Histogram<u64>) {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1e6;
    println!(
        "{what:<48} n={:<5} median {:>7.2} ms   p99 {:>7.2} ms   max {:>7.2} ms",
        h.len(),
        ms(0.5),
        ms(0.99),
        h.max() as f64 / 1e6
    );
}

/// `HANDOFFS` rounds: `holder` runs on `owner`'s only worker, `waiter` waits through
/// `waits_on`, `owner` suspends `holder`; the time from that answer to the waiter's.
async fn hand_offs(
    owner: &Replica,
    waits_on: &Replica,
    holder: &str,
    waiter: &str,
) -> Histogram<u64> {
    let mut h = Histogram::<u64>::new(3).unwrap();
    for _ in 0..HANDOFFS {
        resume(&owner.client, holder, None).await.unwrap();
        let c = waits_on.client.clone();
        let w = waiter.to_owned();
        let waiting = tokio::spawn(async move {
            let r = resume(&c, &w, Some(WAIT)).await;
            (r, Instant::now())
        });
        assert!(
            waits_on
                .plane
                .wait_until(WAIT, |p| p.waiters("counter") == 1)
                .await
        );
        suspend(&owner.client, holder).await;
        let freed = Instant::now();
        let (r, answered) = waiting.await.unwrap();
        assert!(r.unwrap().resumed);
        h.record(answered.saturating_duration_since(freed).as_nanos() as u64)
            .unwrap();
        suspend(&waits_on.client, waiter).await;
    }
    h
}

/// Restores per second with `POOL` clients, client `i` on `replicas[i % n]`.
async fn restores_per_second(replicas: &[&Replica], prefix: &str) -> f64 {
    let names: Vec<String> = (0..POOL).map(|i| format!("{prefix}{i}")).collect();
    create(&replicas[0].client, names.clone()).await;
    for r in replicas {
        assert!(
            r.plane
                .wait_until(WAIT, |p| p.status_of("bench", &names[POOL - 1]).is_some())
                .await
        );
    }
    let start = Instant::now();
    let loops: Vec<_> = names
        .into_iter()
        .enumerate()
        .map(|(i, name)| {
            let c = replicas[i % replicas.len()].client.clone();
            tokio::spawn(async move {
                let mut restores = 0u64;
                while start.elapsed() < THROUGHPUT_FOR {
                    match resume(&c, &name, Some(WAIT)).await {
                        Ok(r) if r.resumed => restores += 1,
                        Ok(_) => {}
                        // Another replica's write won a race: asked again.
                        Err(e) if e.code() == tonic::Code::Aborted => continue,
                        Err(e) => panic!("{name}: {e:?}"),
                    }
                    suspend(&c, &name).await;
                }
                restores
            })
        })
        .collect();
    let mut restores = 0;
    for l in loops {
        restores += l.await.unwrap();
    }
    restores as f64 / start.elapsed().as_secs_f64()
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();

    // The hand-off.
    let pg = TempPostgres::start_async().await;
    let a = replica(&pg.url()).await;
    let b = replica(&pg.url()).await;
    let _one = workers(&a, 1, dir.path()).await;
    create(&a.client, ["holder".to_owned(), "waiter".to_owned()]).await;
    assert!(
        b.plane
            .wait_until(WAIT, |p| p.status_of("bench", "waiter").is_some())
            .await
    );
    report(
        "hand-off, waiter on the worker's replica",
        &hand_offs(&a, &a, "holder", "waiter").await,
    );
    report(
        "hand-off across replicas (waiter on the other)",
        &hand_offs(&a, &b, "holder", "waiter").await,
    );
    drop(_one);
    drop((a, b));
    drop(pg);

    // Restores per second, one replica, then two.
    let pg = TempPostgres::start_async().await;
    let one = replica(&pg.url()).await;
    let _pool = workers(&one, POOL, dir.path()).await;
    let per_s = restores_per_second(&[&one], "one").await;
    println!(
        "restores/s, {POOL} workers, one replica             {per_s:.0}/s (each with its suspend)"
    );
    drop(_pool);
    drop(one);
    drop(pg);

    let pg = TempPostgres::start_async().await;
    let a = replica(&pg.url()).await;
    let b = replica(&pg.url()).await;
    let _wa = workers(&a, POOL / 2, dir.path()).await;
    let _wb = workers(&b, POOL / 2, dir.path()).await;
    let per_s = restores_per_second(&[&a, &b], "two").await;
    println!(
        "restores/s, {POOL} workers, two replicas (10 each)  {per_s:.0}/s (each with its suspend)"
    );
}
