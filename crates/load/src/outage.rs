//! Route leases measured (`valet load scenario leases`): what a revocation adds to a
//! suspend, and a control-plane outage under steady load through both data planes.
//!
//! The control plane runs as its own `valet control-plane` process (so it can be
//! SIGKILLed); the workers and the router (both data planes, leases on) run in this
//! process.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tonic::transport::Channel;
use valet_extproc::ExtProcServer;
use valet_proto::ateapi::{self, control_client::ControlClient};
use valet_proxy::{HttpServer, Limits};
use valet_router::{GrpcControlPlane, Metrics, Router, RouterArgs};
use valet_worker::{Worker, WorkerConfig};

use crate::extproc::{self, Answer};
use crate::generate::HttpClient;
use crate::processes::wait_workers;
use crate::record::Record;
use crate::scenario::Report;
use crate::stats::Latencies;
use crate::system::DOMAIN;

/// A `valet control-plane` child process.
struct ControlPlane {
    child: tokio::process::Child,
    addr: SocketAddr,
}

impl ControlPlane {
    async fn start(
        exe: &Path,
        data: &Path,
        listen: &str,
        opts: &LeaseOpts,
    ) -> Result<Self, String> {
        let mut child = crate::processes::part_command(exe)
            .args(["control-plane", "--listen", listen, "--data-dir"])
            .arg(data)
            .args([
                "--route-lease",
                &valet_router::config::fmt_duration(opts.lease),
            ])
            .args([
                "--capacity-wait",
                if opts.capacity_wait { "on" } else { "off" },
            ])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", exe.display()))?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let addr = tokio::time::timeout(Duration::from_secs(20), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(a) = line.strip_prefix("listening control-plane ") {
                    return a.parse::<SocketAddr>().ok();
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .ok_or("the control plane did not start")?;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self { child, addr })
    }

    async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

fn aref(name: &str) -> Option<ateapi::ActorRef> {
    Some(ateapi::ActorRef {
        atespace: "demo".into(),
        name: name.into(),
    })
}

/// The scenario's options.
#[derive(Debug, Clone)]
pub struct LeaseOpts {
    /// The `valet` binary to run the control plane with.
    pub exe: PathBuf,
    /// `--route-lease`.
    pub lease: Duration,
    /// Suspend cycles measured with and without a lease outstanding.
    pub cycles: usize,
    /// How long the control plane stays dead under load.
    pub outage: Duration,
    /// Clients per data plane during the outage run.
    pub clients: usize,
    /// The control plane's `--capacity-wait`.
    pub capacity_wait: bool,
    /// The router's `--parked-request-budget`.
    pub budget: Duration,
}

/// Runs the scenario.
///
/// # Errors
/// When a part cannot start or the system misbehaves (a request not answered).
pub async fn leases(opts: &LeaseOpts) -> Result<Report, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    let cp = ControlPlane::start(&opts.exe, &data, "127.0.0.1:0", opts).await?;
    let cp_addr = cp.addr;
    let url = format!("http://{cp_addr}");
    let mut workers = Vec::new();
    for i in 1..=4 {
        workers.push(
            Worker::spawn(WorkerConfig {
                credentials: Default::default(),
                control_plane: url.clone(),
                pool: "echo".into(),
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                snapshot_dir: dir.path().join("snapshots"),
                restore_delay: Duration::ZERO,
                worker_id: Some(format!("lease-echo-{i}")),
                advertise: None,
                templates: Default::default(),
                run_dir: dir.path().join("snapshots").with_file_name("run"),
                snapshot_max_bytes: valet_worker::DEFAULT_SNAPSHOT_MAX_BYTES,
                cgroup: None,
            })
            .await
            .map_err(|e| e.to_string())?,
        );
    }
    let ctl = ControlClient::new(
        tonic::transport::Endpoint::from_shared(url.clone())
            .map_err(|e| e.to_string())?
            .timeout(Duration::from_secs(30))
            .connect_lazy(),
    );
    wait_workers(&ctl, 4).await?;
    let mut c = ctl.clone();
    c.create_atespace(ateapi::CreateAtespaceRequest {
        name: "demo".into(),
    })
    .await
    .map_err(|e| e.to_string())?;
    let actors = ["l1", "l2", "l3", "l4"];
    for a in actors {
        c.create_actor(ateapi::CreateActorRequest {
            actor_ref: aref(a),
            actor_template_namespace: "default".into(),
            actor_template_name: "echo".into(),
            worker_selector: None,
        })
        .await
        .map_err(|e| e.to_string())?;
    }

    let budget = valet_router::config::fmt_duration(opts.budget);
    let config = RouterArgs::try_parse_flags_only([
        "--control-plane",
        url.as_str(),
        "--listen",
        "127.0.0.1:0",
        "--extproc-listen",
        "127.0.0.1:0",
        "--parked-request-budget",
        budget.as_str(),
    ])
    .map_err(|e| e.to_string())?
    .resolve()
    .map_err(|e| e.to_string())?;
    let grpc =
        GrpcControlPlane::connect_lazy(&url, config.credentials()).map_err(|e| e.to_string())?;
    let channel = grpc.channel();
    let router = Router::new(Arc::new(config), Arc::new(grpc), Arc::new(Metrics::new()));
    router.start_leases(channel);
    let http = HttpServer::spawn(
        TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?,
        router.clone(),
        Limits::default(),
    )
    .map_err(|e| e.to_string())?;
    let mut ext = ExtProcServer::spawn(
        TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?,
        router.clone(),
    )
    .map_err(|e| e.to_string())?;
    let client = HttpClient::new(DOMAIN);
    for a in actors {
        let (s, b) = client
            .get(http.local_addr(), &format!("demo/{a}"), "/")
            .await;
        if s != 200 {
            return Err(format!("demo/{a} not served: {s} {b}"));
        }
    }
    let until_leased = async {
        while router.route_cache().holder_for_test().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), until_leased)
        .await
        .map_err(|_| "the router never watched its leases")?;

    let mut text = format!(
        "control plane: --route-lease {}, --capacity-wait {}; router: --parked-request-budget {}\n",
        valet_router::config::fmt_duration(opts.lease),
        if opts.capacity_wait { "on" } else { "off" },
        budget,
    );
    revocations(
        &mut text,
        &router,
        &client,
        http.local_addr(),
        &ctl,
        opts.cycles,
    )
    .await?;
    let (cp, records) = outage(
        &mut text,
        &router,
        &opts.exe,
        &data,
        cp,
        cp_addr,
        opts,
        http.local_addr(),
        ext.local_addr(),
        &actors,
    )
    .await?;

    http.stop_accepting();
    ext.stop_accepting();
    router.stop_leases().await;
    http.close().await;
    ext.close().await;
    cp.kill().await;
    for w in workers {
        w.shutdown().await;
    }
    Ok(Report {
        name: "leases".into(),
        text,
        records,
        budget_s: Some(opts.budget.as_secs_f64()),
        failed: None,
    })
}

/// Suspends of an actor the router holds a lease on (revocation acked over the watch),
/// against suspends of one it does not: what the revocation adds.
async fn revocations(
    text: &mut String,
    router: &Router,
    client: &HttpClient,
    http: SocketAddr,
    ctl: &ControlClient<Channel>,
    cycles: usize,
) -> Result<(), String> {
    let mut leased = Vec::new();
    let mut unleased = Vec::new();
    for _ in 0..cycles {
        let (s, b) = client.get(http, "demo/l1", "/").await;
        if s != 200 {
            return Err(format!("demo/l1: {s} {b}"));
        }
        let held = router
            .route_cache()
            .route(&"demo/l1".parse().expect("valid"), false)
            .is_some();
        let started = Instant::now();
        ctl.clone()
            .suspend_actor(ateapi::SuspendActorRequest {
                actor_ref: aref("l1"),
            })
            .await
            .map_err(|e| e.to_string())?;
        let took = started.elapsed();
        if held {
            leased.push(took);
        }
        ctl.clone()
            .resume_actor(ateapi::ResumeActorRequest {
                actor_ref: aref("l1"),
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?;
        let started = Instant::now();
        ctl.clone()
            .suspend_actor(ateapi::SuspendActorRequest {
                actor_ref: aref("l1"),
            })
            .await
            .map_err(|e| e.to_string())?;
        unleased.push(started.elapsed());
    }
    let ms = |d: Duration| format!("{:.2}ms", d.as_secs_f64() * 1000.0);
    let (Some(l), Some(u)) = (Latencies::of(leased), Latencies::of(unleased)) else {
        return Err("no suspend measured".into());
    };
    let _ = writeln!(
        text,
        "suspend of a leased actor (the router acks the revocation): median {}, p99 {} over {} cycles",
        ms(l.median),
        ms(l.p99),
        l.count
    );
    let _ = writeln!(
        text,
        "suspend with no lease outstanding: median {}, p99 {}; the revocation adds {} at the median, {} at p99 (target <= 5ms)",
        ms(u.median),
        ms(u.p99),
        ms(l.median.saturating_sub(u.median)),
        ms(l.p99.saturating_sub(u.p99))
    );
    // Leave l1 running for the outage.
    let (s, _) = client.get(http, "demo/l1", "/").await;
    if s != 200 {
        return Err("demo/l1 not served again".into());
    }
    Ok(())
}

/// Steady load through both data planes; the control plane is SIGKILLed after a while
/// and restarted `opts.outage` later.
#[allow(clippy::too_many_arguments)]
async fn outage(
    text: &mut String,
    router: &Router,
    exe: &Path,
    data: &Path,
    cp: ControlPlane,
    cp_addr: SocketAddr,
    opts: &LeaseOpts,
    http: SocketAddr,
    ext: SocketAddr,
    actors: &[&str],
) -> Result<(ControlPlane, Vec<Record>), String> {
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..opts.clients {
        let (http_stop, name) = (
            Arc::clone(&stop),
            format!("demo/{}", actors[i % actors.len()]),
        );
        let client = HttpClient::new(DOMAIN);
        tasks.spawn(async move {
            let mut out = Vec::new();
            while !http_stop.load(Ordering::Relaxed) {
                let start = t0.elapsed();
                let (status, body) = client.get(http, &name, "/").await;
                out.push(Record {
                    label: "http".into(),
                    actor: name.clone(),
                    start,
                    end: t0.elapsed(),
                    status,
                    body: Record::prefix(&body),
                });
            }
            out
        });
        let (ext_stop, name) = (Arc::clone(&stop), actors[i % actors.len()].to_owned());
        let ep = extproc::client(ext);
        tasks.spawn(async move {
            let mut out = Vec::new();
            while !ext_stop.load(Ordering::Relaxed) {
                let start = t0.elapsed();
                let answer = extproc::decide(&ep, &format!("{name}.demo.{DOMAIN}")).await;
                let (status, body) = match answer {
                    Ok(Answer::Routed(to)) => (200, to),
                    Ok(Answer::Verdict(s, b)) => (u16::try_from(s).unwrap_or(0), b),
                    Err(e) => (0, e.message().to_owned()),
                };
                out.push(Record {
                    label: "extproc".into(),
                    actor: format!("demo/{name}"),
                    start,
                    end: t0.elapsed(),
                    status,
                    body: Record::prefix(&body),
                });
            }
            out
        });
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let killed = t0.elapsed();
    cp.kill().await;
    // No lease is renewed from here until the restart: when each ends is final.
    let lease_ends: BTreeMap<String, Duration> = actors
        .iter()
        .filter_map(|a| {
            let name = format!("demo/{a}");
            let end = router.route_cache().lease_end(&name.parse().ok()?)?;
            Some((name, end.saturating_duration_since(t0)))
        })
        .collect();
    progress!(
        "leases: control plane SIGKILLed; down for {:?}",
        opts.outage
    );
    tokio::time::sleep(opts.outage).await;
    let back = ControlPlane::start(exe, data, &cp_addr.to_string(), opts).await?;
    let restarted = t0.elapsed();
    progress!("leases: control plane restarted");
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.store(true, Ordering::Relaxed);
    let mut records: Vec<Record> = tasks.join_all().await.into_iter().flatten().collect();
    records.sort_by_key(|r| r.start);
    let _ = writeln!(
        text,
        "outage: {} clients per data plane over {} running actors; control plane SIGKILLed at {:.1}s, restarted at {:.1}s ({:?} down); the router's leases ended at {}",
        opts.clients,
        actors.len(),
        killed.as_secs_f64(),
        restarted.as_secs_f64(),
        opts.outage,
        lease_ends
            .values()
            .map(|d| format!("{:.1}s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for plane in ["http", "extproc"] {
        let during: Vec<&Record> = records
            .iter()
            .filter(|r| r.label == plane && r.start >= killed && r.start < restarted)
            .collect();
        let all: Vec<&Record> = records.iter().filter(|r| r.label == plane).collect();
        let mut by: BTreeMap<u16, usize> = BTreeMap::new();
        for r in &during {
            *by.entry(r.status).or_default() += 1;
        }
        let ok = during.iter().filter(|r| r.status == 200).count();
        let in_lease: Vec<&&Record> = during
            .iter()
            .filter(|r| lease_ends.get(&r.actor).is_some_and(|end| r.start < *end))
            .collect();
        let ok_in_lease = in_lease.iter().filter(|r| r.status == 200).count();
        // A request sent just before its lease ended may be decided just after: how
        // close to the end the refused ones were sent.
        let refused_before_end = in_lease
            .iter()
            .filter(|r| r.status != 200)
            .filter_map(|r| Some(lease_ends.get(&r.actor)?.saturating_sub(r.start)))
            .max();
        let _ = writeln!(
            text,
            "{plane:<8} while it was down: {ok} of {} served ({:.1}%); under a lease still valid: {ok_in_lease} of {} served; statuses {by:?}; all run: {} of {} served",
            during.len(),
            100.0 * ok as f64 / during.len().max(1) as f64,
            in_lease.len(),
            all.iter().filter(|r| r.status == 200).count(),
            all.len()
        );
        if let Some(gap) = refused_before_end {
            let _ = writeln!(
                text,
                "{:<8} (the {} refused under a valid lease were sent at most {:.2}ms before it ended: decided after it)",
                "",
                in_lease.len() - ok_in_lease,
                gap.as_secs_f64() * 1000.0
            );
        }
    }
    Ok((back, records))
}
