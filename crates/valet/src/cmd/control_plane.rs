//! `valet control-plane`.

use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use valet_control::{Plane, PlaneConfig, SqliteStore, Store};

use crate::EXIT_CONFIG;
use crate::cli::{ControlPlaneArgs, OnOff};

/// Parses an optional listen address: empty is off.
pub(crate) fn optional_listen(
    flag: &str,
    value: &str,
) -> Result<Option<std::net::SocketAddr>, String> {
    if value.is_empty() {
        return Ok(None);
    }
    value.parse().map(Some).map_err(|_| {
        format!(
            "invalid configuration: {flag}={value}: must be <ip>:<port> (port 0 picks one), or empty to turn it off"
        )
    })
}

pub(crate) async fn run(args: ControlPlaneArgs) -> ExitCode {
    // Before anything is printed: see `signal::terminated`.
    let terminated = crate::signal::terminated();
    let metrics_listen = match optional_listen("--metrics-listen", &args.metrics_listen) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("valet control-plane: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let security = match args.security.resolve() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("valet control-plane: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if security.jwt.is_some() && security.tls.is_none() {
        eprintln!(
            "valet control-plane: invalid configuration: --jwt-public-key-file/--jwt-jwks-file: bearer tokens need TLS (--tls-cert-file and --tls-key-file)"
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let tls = security.tls.is_some();
    let store = match SqliteStore::open(&args.data_dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("valet control-plane: {e}");
            return ExitCode::FAILURE;
        }
    };
    let database = store.describe();
    let config = PlaneConfig {
        capacity_wait: args.capacity_wait == OnOff::On,
        templates: args.templates.clone(),
        restore_timeout: args.restore_timeout,
        checkpoint_timeout: args.checkpoint_timeout,
        rejoin_grace: args.rejoin_grace,
        idle_suspend_after: args.policies.idle_suspend_after,
        evict_idle_after: args.policies.evict_idle_after,
        route_lease: args.leases.route_lease,
        hosting_lease: args.leases.hosting_lease,
    };
    let plane = match Plane::open(Arc::new(store), config).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!("valet control-plane: {e}");
            return ExitCode::FAILURE;
        }
    };
    let listener = match TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("valet control-plane: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let stop_metrics = CancellationToken::new();
    let metrics = match metrics_listen {
        Some(at) => match TcpListener::bind(at).await {
            Ok(l) => {
                let bound = l
                    .local_addr()
                    .map_or_else(|_| at.to_string(), |a| a.to_string());
                println!("listening metrics {bound}");
                Some(valet_control::admin::spawn(
                    l,
                    plane.clone(),
                    stop_metrics.clone(),
                ))
            }
            Err(e) => {
                eprintln!("valet control-plane: cannot listen on --metrics-listen={at}: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let addr = listener
        .local_addr()
        .map_or_else(|_| args.listen.to_string(), |a| a.to_string());
    println!("listening control-plane {addr}");
    tracing::info!(
        %addr,
        %database,
        capacity_wait = args.capacity_wait == OnOff::On,
        tls,
        "control plane serving"
    );
    let result = valet_control::serve(
        listener,
        plane.clone(),
        terminated,
        args.shutdown_timeout,
        security,
    )
    .await;
    stop_metrics.cancel();
    if let Some(m) = metrics {
        let _ = m.await;
    }
    match result {
        Ok(()) => {
            tracing::info!("control plane stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("valet control-plane: {e}");
            ExitCode::FAILURE
        }
    }
}
