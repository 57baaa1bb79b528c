//! `valet control-plane`.

use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};
use tokio_util::sync::CancellationToken;
use valet_control::{Plane, PlaneConfig, PostgresStore, SqliteStore, Store};

use crate::EXIT_CONFIG;
use crate::cli::{ControlPlaneArgs, OnOff};

/// The gRPC listener's backlog.
const LISTEN_BACKLOG: u32 = 1024;

/// A socket bound to `addr` and not listening: connections to it are refused, and no
/// other process can bind the port. Bound without `SO_REUSEADDR` (with it, another
/// socket with it could bind the same port while this one does not listen); with it
/// when the port is only held by an earlier process's connections in `TIME_WAIT`.
fn reserve(addr: std::net::SocketAddr) -> std::io::Result<TcpSocket> {
    let new = || {
        if addr.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }
    };
    let socket = new()?;
    match socket.bind(addr) {
        Ok(()) => Ok(socket),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let socket = new()?;
            socket.set_reuseaddr(true)?;
            socket.bind(addr)?;
            // Off again while it does not listen. (Best effort: while the earlier
            // connections linger, the kernel may still let another socket with
            // SO_REUSEADDR bind the port; the takeover's listen would then fail.)
            socket.set_reuseaddr(false)?;
            Ok(socket)
        }
        Err(e) => Err(e),
    }
}

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
    if let Some(url) = &args.database {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            eprintln!(
                "valet control-plane: invalid configuration: --database: must be a postgres:// URL"
            );
            return ExitCode::from(EXIT_CONFIG);
        }
        if !args.leases.route_lease.is_zero() {
            eprintln!(
                "valet control-plane: invalid configuration: --route-lease={}: must be 0 with --database (route leases are not shared across replicas yet)",
                humantime_secs(args.leases.route_lease)
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    // Probes first: a standby waiting for the database is alive, not ready.
    let slot = valet_control::admin::PlaneSlot::default();
    let stop_metrics = CancellationToken::new();
    let metrics = match metrics_listen {
        Some(at) => match TcpListener::bind(at).await {
            Ok(l) => {
                let bound = l
                    .local_addr()
                    .map_or_else(|_| at.to_string(), |a| a.to_string());
                println!("listening metrics {bound}");
                Some(valet_control::admin::spawn_slot(
                    l,
                    slot.clone(),
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
    // The gRPC port is taken now, not when this replica becomes active: a port in
    // use is an error at start, and nothing else takes it while a standby waits. It
    // listens (and so accepts, instead of refusing) only once the plane is open.
    let socket = match reserve(args.listen) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("valet control-plane: cannot bind {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    if let Ok(bound) = socket.local_addr() {
        println!("bound control-plane {bound}");
    }
    let mut terminated = Box::pin(terminated);
    // Losing the database's active lock: another replica may take over, so stop.
    let mut lost = CancellationToken::new();
    let store: Arc<dyn Store> = match &args.database {
        None => match SqliteStore::open(&args.data_dir) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                eprintln!("valet control-plane: {e}");
                return ExitCode::FAILURE;
            }
        },
        Some(url) => {
            // A standby waits here until it is the active replica; SIGTERM ends the wait.
            let opened = tokio::select! {
                opened = PostgresStore::open(url) => opened,
                () = &mut terminated => return ExitCode::SUCCESS,
            };
            match opened {
                Ok(s) => {
                    lost = s.lost();
                    Arc::new(s)
                }
                Err(e) => {
                    eprintln!("valet control-plane: {e}");
                    return ExitCode::FAILURE;
                }
            }
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
    let plane = match Plane::open(store, config).await {
        Ok(p) => p,
        Err(e) => {
            eprintln!("valet control-plane: {e}");
            return ExitCode::FAILURE;
        }
    };
    // SO_REUSEADDR from here on: the connections it accepts inherit it, so that once
    // they linger in TIME_WAIT after this process ends, a restart can bind the port.
    let listener = match socket
        .set_reuseaddr(true)
        .and_then(|()| socket.listen(LISTEN_BACKLOG))
    {
        Ok(l) => l,
        Err(e) => {
            eprintln!("valet control-plane: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    slot.get_or_init(|| plane.clone());
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
    let stop = {
        let lost = lost.clone();
        async move {
            tokio::select! {
                () = terminated => {}
                () = lost.cancelled() => {}
            }
        }
    };
    let result = valet_control::serve(
        listener,
        plane.clone(),
        stop,
        args.shutdown_timeout,
        security,
    )
    .await;
    if lost.is_cancelled() {
        stop_metrics.cancel();
        eprintln!(
            "valet control-plane: lost the database lock ({database}): another replica may take over; exiting"
        );
        return ExitCode::FAILURE;
    }
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

/// `d` as the flag would take it (`5s`, `1.5s`).
fn humantime_secs(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs_f64())
}
