//! `valet control-plane`.

use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};
use tokio_util::sync::CancellationToken;
use valet_control::store::StoreError;
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
        if let Err(why) = PostgresStore::check_url(url) {
            eprintln!(
                "valet control-plane: invalid configuration: --database: not a PostgreSQL URL: {why}"
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
    // SIGTERM, as a token: it ends a standby's wait as well as serving.
    let stopping = CancellationToken::new();
    {
        let stopping = stopping.clone();
        tokio::spawn(async move {
            terminated.await;
            stopping.cancel();
        });
    }
    // Where a replica that lost its database binds again to wait as a standby: the
    // same port, also when it was picked at random.
    let bound = socket.local_addr().unwrap_or(args.listen);
    let mut socket = Some(socket);
    let mut reached = false;
    let code = loop {
        let socket = match socket.take().map_or_else(|| reserve(bound), Ok) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("valet control-plane: cannot bind {bound} again: {e}");
                break ExitCode::FAILURE;
            }
        };
        // Losing the database's active lock: another replica may take over, so stop
        // serving (and wait as a standby again).
        let (store, lost): (Arc<dyn Store>, CancellationToken) = match &args.database {
            None => match SqliteStore::open(&args.data_dir) {
                Ok(s) => (Arc::new(s), CancellationToken::new()),
                Err(e) => {
                    eprintln!("valet control-plane: {e}");
                    break ExitCode::FAILURE;
                }
            },
            Some(url) => match open_replica(url, &mut reached, &stopping).await {
                Ok(Some(s)) => {
                    let lost = s.lost();
                    (Arc::new(s), lost)
                }
                Ok(None) => break ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("valet control-plane: {e}");
                    break ExitCode::FAILURE;
                }
            },
        };
        let database = store.describe();
        let plane = match Plane::open(store, config.clone()).await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("valet control-plane: {e}");
                break ExitCode::FAILURE;
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
                eprintln!("valet control-plane: cannot listen on {bound}: {e}");
                break ExitCode::FAILURE;
            }
        };
        slot.set(Some(plane.clone()));
        let addr = listener
            .local_addr()
            .map_or_else(|_| bound.to_string(), |a| a.to_string());
        println!("listening control-plane {addr}");
        tracing::info!(
            %addr,
            %database,
            capacity_wait = args.capacity_wait == OnOff::On,
            tls,
            "control plane serving"
        );
        let stop = {
            let (stopping, lost) = (stopping.clone(), lost.clone());
            async move {
                tokio::select! {
                    () = stopping.cancelled() => {}
                    () = lost.cancelled() => {}
                }
            }
        };
        let result = valet_control::serve(
            listener,
            plane,
            stop,
            args.shutdown_timeout,
            security.clone(),
        )
        .await;
        slot.set(None);
        if lost.is_cancelled() && !stopping.is_cancelled() {
            tracing::warn!(
                %database,
                "lost the database lock: another replica may take over; stopped serving, waiting as a standby"
            );
            continue;
        }
        break match result {
            Ok(()) => {
                tracing::info!("control plane stopped");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("valet control-plane: {e}");
                ExitCode::FAILURE
            }
        };
    };
    stop_metrics.cancel();
    if let Some(m) = metrics {
        let _ = m.await;
    }
    code
}

/// Opens the PostgreSQL store as the active replica, waiting as a standby until it
/// is; `None` when SIGTERM ends the wait. Once this process has reached the database,
/// a database it cannot reach again (restarting, or cut off) is waited for, trying
/// again every few seconds: a database restart does not end the replicas. Before that,
/// an unreachable database is an error (a wrong host, port or password shows at once),
/// as is a schema newer than this binary (a newer version took the database over).
async fn open_replica(
    url: &str,
    reached: &mut bool,
    stopping: &CancellationToken,
) -> Result<Option<PostgresStore>, StoreError> {
    let mut backoff = std::time::Duration::from_millis(500);
    loop {
        let opened = tokio::select! {
            opened = PostgresStore::open(url) => opened,
            () = stopping.cancelled() => return Ok(None),
        };
        match opened {
            Ok(s) => {
                *reached = true;
                return Ok(Some(s));
            }
            Err(e @ StoreError::NewerSchema { .. }) => return Err(e),
            Err(e @ StoreError::Unreachable { .. }) if !*reached => return Err(e),
            Err(e) => {
                // Anything but a failed connection means it was reached.
                *reached = true;
                tracing::warn!(error = %e, retry_in = ?backoff, "database unavailable; waiting for it as a standby");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stopping.cancelled() => return Ok(None),
                }
                backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
            }
        }
    }
}

/// `d` as the flag would take it (`5s`, `1.5s`).
fn humantime_secs(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs_f64())
}
