//! `valet up`: the reference control plane, its workers and the router in one process
//! on loopback.

use std::process::ExitCode;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use valet_control::{ActorKey, Plane, PlaneConfig, Store};
use valet_worker::{Worker, WorkerConfig};

use crate::EXIT_CONFIG;
use crate::cli::{OnOff, UpArgs};
use crate::serve::RunningRouter;

pub(crate) async fn run(args: UpArgs) -> ExitCode {
    match up(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(UpError::Config(e)) => {
            eprintln!("valet up: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(UpError::Start(e)) => {
            eprintln!("valet up: {e}");
            ExitCode::FAILURE
        }
    }
}

enum UpError {
    Config(String),
    Start(String),
}

fn demo_actors(spec: &str) -> Result<Vec<ActorKey>, String> {
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (a, n) = s.split_once('/').ok_or_else(|| {
                format!(
                    "invalid configuration: --demo-actors={spec}: {s:?} is not <atespace>/<name>"
                )
            })?;
            ActorKey::new(a, n).map_err(|e| {
                format!(
                    "invalid configuration: --demo-actors={spec}: {}",
                    e.message()
                )
            })
        })
        .collect()
}

async fn up(mut args: UpArgs) -> Result<(), UpError> {
    let actors = demo_actors(&args.demo_actors).map_err(UpError::Config)?;
    if args.workers == 0 {
        return Err(UpError::Config(
            "invalid configuration: --workers=0: must be >= 1".into(),
        ));
    }
    // Validate the router's flags before anything is bound.
    args.router.control_plane = format!("http://{}", args.control_plane_listen);
    args.router
        .resolve()
        .map_err(|e| UpError::Config(e.to_string()))?;

    let store = Store::open(&args.data_dir).map_err(|e| UpError::Start(e.to_string()))?;
    let plane = Plane::open(
        store,
        PlaneConfig {
            capacity_wait: args.capacity_wait == OnOff::On,
            ..PlaneConfig::default()
        },
    )
    .await
    .map_err(|e| UpError::Start(e.to_string()))?;
    let cp_listener = TcpListener::bind(args.control_plane_listen)
        .await
        .map_err(|e| {
            UpError::Start(format!(
                "cannot listen on --control-plane-listen={}: {e}",
                args.control_plane_listen
            ))
        })?;
    let cp_addr = cp_listener
        .local_addr()
        .map_err(|e| UpError::Start(e.to_string()))?;
    println!("listening control-plane {cp_addr}");
    let stop_cp = CancellationToken::new();
    let cp_task = {
        let (plane, stop) = (plane.clone(), stop_cp.clone());
        tokio::spawn(async move {
            if let Err(e) =
                valet_control::serve(cp_listener, plane, async move { stop.cancelled().await })
                    .await
            {
                tracing::error!(error = %e, "control plane failed");
            }
        })
    };

    let mut workers = Vec::new();
    let pools = [
        ("counter", args.workers, "up-worker"),
        ("echo", args.echo_workers, "up-echo"),
    ];
    for (pool, count, prefix) in pools {
        for i in 1..=count {
            let w = Worker::spawn(WorkerConfig {
                control_plane: format!("http://{cp_addr}"),
                pool: pool.into(),
                listen: "127.0.0.1:0".parse().expect("valid"),
                snapshot_dir: args.data_dir.join("snapshots"),
                restore_delay: args.restore_delay,
                worker_id: Some(format!("{prefix}-{i}")),
            })
            .await
            .map_err(|e| UpError::Start(e.to_string()))?;
            workers.push(w);
        }
    }
    let (n, e) = (args.workers, args.echo_workers);
    if !plane
        .wait_until(Duration::from_secs(10), |p| {
            p.pool("counter").0 == n && p.pool("echo").0 == e
        })
        .await
    {
        return Err(UpError::Start("workers did not join their pools".into()));
    }

    for key in &actors {
        match plane.create_atespace(key.atespace()).await {
            Ok(_) => {}
            Err(e) if e.code() == tonic::Code::AlreadyExists => {}
            Err(e) => {
                return Err(UpError::Start(format!(
                    "atespace {}: {}",
                    key.atespace(),
                    e.message()
                )));
            }
        }
        match plane
            .create_actor(key.clone(), "default", "counter", Vec::new())
            .await
        {
            Ok(_) => {}
            Err(e) if e.code() == tonic::Code::AlreadyExists => {}
            Err(e) => return Err(UpError::Start(format!("actor {key}: {}", e.message()))),
        }
    }

    args.router.control_plane = format!("http://{cp_addr}");
    let config = args
        .router
        .resolve()
        .map_err(|e| UpError::Config(e.to_string()))?;
    let domain = config.actor_domain().to_string();
    let running = RunningRouter::start(config).await.map_err(UpError::Start)?;
    let names: Vec<String> = actors.iter().map(ToString::to_string).collect();
    println!(
        "valet up: pool counter with {n} workers; actors {}; data in {}",
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(" ")
        },
        args.data_dir.display()
    );
    if let (Some(router), Some(first)) = (running.addr("router"), actors.first()) {
        println!(
            "try: curl -H 'Host: {}.{}.{domain}' http://{router}/",
            first.name(),
            first.atespace()
        );
    }
    if let Some(admin) = running.addr("admin") {
        println!("status: http://{admin}/statusz   metrics: http://{admin}/metrics");
    }
    println!("press Ctrl-C to stop");

    crate::signal::terminated().await;
    running.drain().await;
    for w in workers {
        w.shutdown().await;
    }
    stop_cp.cancel();
    let _ = cp_task.await;
    plane.close().await;
    tracing::info!("valet up stopped");
    Ok(())
}
