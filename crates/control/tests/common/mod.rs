//! A real control plane (gRPC on 127.0.0.1:0) with real worker tasks attached over
//! gRPC, on SQLite in a temp dir, or, with `VALET_TEST_STORE=postgres`, on a throwaway
//! PostgreSQL server (the README's test command runs these tests both ways).

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use valet_control::{Plane, PlaneConfig, SqliteStore};
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_worker::{Worker, WorkerConfig};

pub const WAIT: Duration = Duration::from_secs(10);

/// Logs to the test's output with `VALET_TEST_LOG=<filter>` (`info`, `valet_control=debug`).
pub fn log_if_asked() {
    if let Ok(filter) = std::env::var("VALET_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}

pub struct System {
    pub plane: Plane,
    pub addr: SocketAddr,
    pub client: ControlClient<Channel>,
    pub workers: Vec<Worker>,
    pub dir: tempfile::TempDir,
    /// The PostgreSQL server under the plane (`VALET_TEST_STORE=postgres`).
    pub postgres: Option<valet_control::tempdb::TempPostgres>,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for System {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("System").field("addr", &self.addr).finish()
    }
}

pub async fn system(workers: usize, config: PlaneConfig) -> System {
    system_with(workers, config, Duration::ZERO).await
}

pub async fn system_with(workers: usize, config: PlaneConfig, restore_delay: Duration) -> System {
    log_if_asked();
    let dir = tempfile::tempdir().unwrap();
    // On PostgreSQL, as one of the replicas that serve together (`valet
    // control-plane --database`'s default): one replica of several.
    let (plane, postgres) = match std::env::var("VALET_TEST_STORE").as_deref() {
        Ok("postgres") => {
            let pg = valet_control::tempdb::TempPostgres::start_async().await;
            let store = valet_control::ReplicaStore::join(&pg.url()).await.unwrap();
            let plane = Plane::open_replica(std::sync::Arc::new(store), config)
                .await
                .unwrap();
            (plane, Some(pg))
        }
        Ok("sqlite") | Err(_) => {
            let store = SqliteStore::open(&dir.path().join("data")).unwrap();
            let plane = Plane::open(std::sync::Arc::new(store), config)
                .await
                .unwrap();
            (plane, None)
        }
        Ok(other) => panic!("VALET_TEST_STORE={other}: sqlite or postgres"),
    };
    let Served {
        plane,
        addr,
        client,
        stop,
        server,
    } = serve(plane).await;
    let mut sys = System {
        plane,
        addr,
        client,
        workers: Vec::new(),
        dir,
        postgres,
        stop,
        server,
    };
    for _ in 0..workers {
        sys.add_worker("counter", restore_delay).await;
    }
    let n = sys.workers.len();
    assert!(
        sys.plane
            .wait_until(WAIT, |p| p.pool("counter") == (n, n))
            .await,
        "{n} workers attach"
    );
    sys
}

/// A plane serving `ateapi.Control` (and its workers' service) on 127.0.0.1:0.
pub struct Served {
    pub plane: Plane,
    pub addr: SocketAddr,
    pub client: ControlClient<Channel>,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<()>,
}

impl Served {
    /// Stops serving (the plane's shutdown: its workers are told to detach).
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.server.await;
    }

    /// Its gRPC URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Serves `plane` on 127.0.0.1:0 (10 s shutdown timeout, no TLS).
pub async fn serve(plane: Plane) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let server = {
        let plane = plane.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let stopped = async move { stop.cancelled().await };
            valet_control::serve(
                listener,
                plane,
                stopped,
                Duration::from_secs(10),
                Default::default(),
            )
            .await
            .unwrap();
        })
    };
    let client = ControlClient::new(
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy(),
    );
    Served {
        plane,
        addr,
        client,
        stop,
        server,
    }
}

/// A worker of `pool` attached to `control_plane` (a URL, or a comma-separated list).
pub async fn worker_on(
    control_plane: &str,
    pool: &str,
    snapshots: &std::path::Path,
    restore_delay: Duration,
    id: Option<&str>,
) -> Worker {
    Worker::spawn(WorkerConfig {
        credentials: Default::default(),
        control_plane: control_plane.to_owned(),
        pool: pool.to_owned(),
        listen: "127.0.0.1:0".parse().unwrap(),
        snapshot_dir: snapshots.to_owned(),
        restore_delay,
        worker_id: id.map(str::to_owned),
        advertise: None,
        templates: Default::default(),
        run_dir: snapshots.with_file_name("run"),
        snapshot_max_bytes: valet_worker::DEFAULT_SNAPSHOT_MAX_BYTES,
        cgroup: None,
    })
    .await
    .unwrap()
}

/// `ResumeActor` of `actor` (`atespace/name`) on `c`, waiting for capacity up to `wait`.
pub async fn resume_on(
    c: &ControlClient<Channel>,
    actor: &str,
    wait: Option<Duration>,
) -> Result<(ateapi::Actor, bool), tonic::Status> {
    let r = c
        .clone()
        .resume_actor(ateapi::ResumeActorRequest {
            actor_ref: Some(aref(actor)),
            boot: false,
            wait_for_capacity: wait.map(|d| d.try_into().unwrap()),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok((r.actor.unwrap(), r.resumed))
}

/// `SuspendActor` of `actor` on `c`.
pub async fn suspend_on(
    c: &ControlClient<Channel>,
    actor: &str,
) -> Result<ateapi::Actor, tonic::Status> {
    let r = c
        .clone()
        .suspend_actor(ateapi::SuspendActorRequest {
            actor_ref: Some(aref(actor)),
        })
        .await?;
    Ok(r.into_inner().actor.unwrap())
}

/// `CreateActor` of `actor` from `template` on `c`.
pub async fn create_on(
    c: &ControlClient<Channel>,
    actor: &str,
    template: &str,
) -> Result<ateapi::Actor, tonic::Status> {
    let r = c
        .clone()
        .create_actor(ateapi::CreateActorRequest {
            actor_ref: Some(aref(actor)),
            actor_template_namespace: "default".into(),
            actor_template_name: template.into(),
            worker_selector: None,
        })
        .await?;
    Ok(r.into_inner().actor.unwrap())
}

impl System {
    pub async fn add_worker(&mut self, pool: &str, restore_delay: Duration) {
        let w = worker_on(
            &format!("http://{}", self.addr),
            pool,
            &self.dir.path().join("snapshots"),
            restore_delay,
            None,
        )
        .await;
        self.workers.push(w);
    }

    pub async fn atespace(&self, name: &str) {
        self.client
            .clone()
            .create_atespace(ateapi::CreateAtespaceRequest { name: name.into() })
            .await
            .unwrap();
    }

    pub async fn create(&self, actor: &str) -> Result<ateapi::Actor, tonic::Status> {
        self.create_from(actor, "counter").await
    }

    pub async fn create_from(
        &self,
        actor: &str,
        template: &str,
    ) -> Result<ateapi::Actor, tonic::Status> {
        create_on(&self.client, actor, template).await
    }

    pub async fn resume(&self, actor: &str) -> Result<(ateapi::Actor, bool), tonic::Status> {
        self.resume_waiting(actor, None).await
    }

    pub async fn resume_waiting(
        &self,
        actor: &str,
        wait: Option<Duration>,
    ) -> Result<(ateapi::Actor, bool), tonic::Status> {
        resume_on(&self.client, actor, wait).await
    }

    pub async fn suspend(&self, actor: &str) -> Result<ateapi::Actor, tonic::Status> {
        suspend_on(&self.client, actor).await
    }

    pub async fn get(&self, actor: &str) -> Result<ateapi::Actor, tonic::Status> {
        let r = self
            .client
            .clone()
            .get_actor(ateapi::GetActorRequest {
                actor_ref: Some(aref(actor)),
            })
            .await?;
        Ok(r.into_inner().actor.unwrap())
    }

    pub async fn revert(&self, actor: &str) -> Result<ateapi::Actor, tonic::Status> {
        let r = self
            .client
            .clone()
            .revert_actor(ateapi::RevertActorRequest {
                actor_ref: Some(aref(actor)),
            })
            .await?;
        Ok(r.into_inner().actor.unwrap())
    }

    pub async fn delete(&self, actor: &str) -> Result<(), tonic::Status> {
        self.client
            .clone()
            .delete_actor(ateapi::DeleteActorRequest {
                actor_ref: Some(aref(actor)),
            })
            .await
            .map(drop)
    }

    pub async fn workers(&self) -> Vec<ateapi::Worker> {
        self.client
            .clone()
            .list_workers(())
            .await
            .unwrap()
            .into_inner()
            .workers
    }

    pub async fn shutdown(self) {
        for w in self.workers {
            w.shutdown().await;
        }
        self.stop.cancel();
        let _ = self.server.await;
    }
}

pub fn aref(actor: &str) -> ateapi::ActorRef {
    let (atespace, name) = actor.split_once('/').unwrap_or(("", actor));
    ateapi::ActorRef {
        atespace: atespace.into(),
        name: name.into(),
    }
}

pub fn addr_of(a: &ateapi::Actor) -> SocketAddr {
    format!("{}:{}", a.ateom_pod_ip, a.worker_port)
        .parse()
        .unwrap()
}

pub fn status(a: &ateapi::Actor) -> ateapi::actor::Status {
    ateapi::actor::Status::try_from(a.status).unwrap()
}

/// One HTTP/1.1 request over a fresh connection; returns status and body.
pub async fn http_get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: actor\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text[9..12].parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
