//! `valet control-plane`.

use std::process::ExitCode;

use tokio::net::TcpListener;
use valet_control::{Plane, PlaneConfig, Store};

use crate::cli::{ControlPlaneArgs, OnOff};

pub(crate) async fn run(args: ControlPlaneArgs) -> ExitCode {
    let store = match Store::open(&args.data_dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("valet control-plane: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config = PlaneConfig {
        capacity_wait: args.capacity_wait == OnOff::On,
        templates: args.templates.clone(),
        restore_timeout: args.restore_timeout,
        checkpoint_timeout: args.restore_timeout,
        rejoin_grace: args.rejoin_grace,
    };
    let plane = match Plane::open(store.clone(), config).await {
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
    let addr = listener
        .local_addr()
        .map_or_else(|_| args.listen.to_string(), |a| a.to_string());
    println!("listening control-plane {addr}");
    tracing::info!(
        %addr,
        database = %store.path().display(),
        capacity_wait = args.capacity_wait == OnOff::On,
        "control plane serving"
    );
    let result = valet_control::serve(listener, plane.clone(), crate::signal::terminated()).await;
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
