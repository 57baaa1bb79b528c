//! `valet control-plane`.

use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};
use tokio_util::sync::CancellationToken;
use valet_control::standby::{Active, Next, Opened, Replica};
use valet_control::{Plane, PostgresStore, SqliteStore};

use crate::EXIT_CONFIG;
use crate::cli::{ActiveReplicas, ControlPlaneArgs, OnOff};

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
    let metrics_listen = match optional_listen("--metrics-listen", &args.plane.metrics_listen)
        .and_then(|m| {
            valet_router::config::distinct_listeners(&[
                ("--listen", Some(args.listen)),
                ("--metrics-listen", m),
            ])
            .map_err(|e| e.to_string())
            .map(|()| m)
        }) {
        Ok(a) => a,
        Err(e) => {
            say_usage!("valet control-plane: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let security = match args.plane.security.resolve() {
        Ok(s) => s,
        Err(e) => {
            say_usage!("valet control-plane: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Some(jwt) = args
        .plane
        .security
        .jwt_flag()
        .filter(|_| security.jwt.is_some() && security.tls.is_none())
    {
        say_usage!(
            "valet control-plane: invalid configuration: {jwt}: bearer tokens need TLS (--tls-cert-file and --tls-key-file)"
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let templates = match args.plane.templates.resolve() {
        Ok(t) => t,
        Err(e) => {
            say_usage!("valet control-plane: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let config = match args.plane.plane_config(&templates) {
        Ok(c) => c,
        Err(e) => {
            say_usage!("valet control-plane: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let tls = security.tls.is_some();
    if let Some(url) = &args.database {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            say_usage!(
                "valet control-plane: invalid configuration: --database: must be a postgres:// URL"
            );
            return ExitCode::from(EXIT_CONFIG);
        }
        if let Err(why) = PostgresStore::check_url(url) {
            say_usage!("valet control-plane: invalid configuration: --database: {why}");
            return ExitCode::from(EXIT_CONFIG);
        }
        if !args.plane.leases.route_lease.is_zero() {
            say_usage!(
                "valet control-plane: invalid configuration: --route-lease={}: must be 0 with --database (route leases are not shared across replicas yet)",
                humantime_secs(args.plane.leases.route_lease)
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    }
    // The embedded database first: a data dir another control plane holds is refused
    // before this one says it took a port.
    let mut sqlite = match &args.database {
        None => match SqliteStore::open(&args.data_dir) {
            Ok(s) => Some(s),
            Err(e) => {
                say_err!("valet control-plane: {e}");
                return ExitCode::FAILURE;
            }
        },
        Some(_) => None,
    };
    // Probes first: a standby waiting for the database is alive, not ready.
    let slot = valet_control::admin::PlaneSlot::default();
    let stop_metrics = CancellationToken::new();
    let metrics = match metrics_listen {
        Some(at) => match TcpListener::bind(at).await {
            Ok(l) => {
                let bound = l
                    .local_addr()
                    .map_or_else(|_| at.to_string(), |a| a.to_string());
                say!("listening metrics {bound}");
                Some(valet_control::admin::spawn_slot(
                    l,
                    slot.clone(),
                    stop_metrics.clone(),
                ))
            }
            Err(e) => {
                say_err!("valet control-plane: cannot listen on --metrics-listen={at}: {e}");
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
            say_err!(
                "valet control-plane: cannot listen on --listen={}: {e}",
                args.listen
            );
            return ExitCode::FAILURE;
        }
    };
    if let Ok(bound) = socket.local_addr() {
        say!("bound control-plane {bound}");
    }
    // SIGTERM, as a token: it ends a standby's wait as well as serving. The task
    // ends with the process's signal handling; it is aborted on the way out.
    let stopping = CancellationToken::new();
    let signals = {
        let stopping = stopping.clone();
        tokio::spawn(async move {
            terminated.await;
            stopping.cancel();
        })
    };
    // Where a replica that lost its database binds again to wait as a standby: the
    // same port, also when it was picked at random.
    let bound = socket.local_addr().unwrap_or(args.listen);
    let mut socket = Some(socket);
    // With --database: a replica of it, waiting as a standby while it may not serve.
    let mut replica = args.database.as_ref().map(|url| {
        let active = match args.active_replicas {
            ActiveReplicas::All => Active::All,
            ActiveReplicas::One => Active::One,
        };
        Replica::new(url.clone(), active)
    });
    let code = loop {
        let reserved = match socket.take().map_or_else(|| reserve(bound), Ok) {
            Ok(s) => s,
            Err(e) => {
                say_err!("valet control-plane: cannot bind {bound} again: {e}");
                break ExitCode::FAILURE;
            }
        };
        // Losing the database's active lock (one active replica), or this replica's
        // heartbeat (all active): another replica may take over, so stop serving (and
        // wait as a standby, or join again, as a new replica).
        let opened = match replica.as_mut() {
            None => match sqlite
                .take()
                .map_or_else(|| SqliteStore::open(&args.data_dir), Ok)
            {
                Ok(s) => Opened {
                    store: Arc::new(s),
                    lost: CancellationToken::new(),
                    replicas: None,
                },
                Err(e) => {
                    say_err!("valet control-plane: {e}");
                    break ExitCode::FAILURE;
                }
            },
            Some(replica) => match replica.open(&stopping).await {
                Ok(Some(opened)) => opened,
                Ok(None) => break ExitCode::SUCCESS,
                Err(e) => {
                    say_err!("valet control-plane: {e}");
                    break ExitCode::FAILURE;
                }
            },
        };
        let (store, lost) = (Arc::clone(&opened.store), opened.lost.clone());
        let database = store.describe();
        let loaded = match &opened.replicas {
            Some(c) => Plane::open_replica(Arc::clone(c), config.clone()).await,
            None => Plane::open(store, config.clone()).await,
        };
        let plane = match loaded {
            Ok(p) => p,
            // The database went away again while the records loaded: wait as a
            // standby again (with the same port).
            Err(e) if replica.as_mut().is_some_and(|r| r.waits_out(&e)) => {
                tracing::warn!(error = %e, "database unavailable while loading the records; waiting for it as a standby");
                opened.store.close().await;
                socket = Some(reserved);
                let waited = match replica.as_mut() {
                    Some(r) => r.pause(&stopping).await,
                    None => false,
                };
                if !waited {
                    break ExitCode::SUCCESS;
                }
                continue;
            }
            Err(e) => {
                say_err!("valet control-plane: {e}");
                break ExitCode::FAILURE;
            }
        };
        if let Some(r) = replica.as_mut() {
            r.serving();
        }
        let socket = reserved;
        // SO_REUSEADDR from here on: the connections it accepts inherit it, so that once
        // they linger in TIME_WAIT after this process ends, a restart can bind the port.
        let listener = match socket
            .set_reuseaddr(true)
            .and_then(|()| socket.listen(LISTEN_BACKLOG))
        {
            Ok(l) => l,
            Err(e) => {
                say_err!("valet control-plane: cannot listen on {bound}: {e}");
                break ExitCode::FAILURE;
            }
        };
        slot.set(Some(plane.clone()));
        let addr = listener
            .local_addr()
            .map_or_else(|_| bound.to_string(), |a| a.to_string());
        say!("listening control-plane {addr}");
        tracing::info!(
            %addr,
            %database,
            capacity_wait = args.plane.capacity_wait == OnOff::On,
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
        // Another replica may be active once the lock is lost: no worker keeps hosting
        // on this one's word while its operations wind down, also when the lock goes
        // during a shutdown SIGTERM began.
        let step_down = {
            let (lost, plane) = (lost.clone(), plane.clone());
            tokio::spawn(async move {
                lost.cancelled().await;
                plane.step_down();
            })
        };
        let result = valet_control::serve(
            listener,
            plane,
            stop,
            args.plane.shutdown_timeout,
            security.clone(),
        )
        .await;
        step_down.abort();
        slot.set(None);
        let next = match replica.as_mut() {
            Some(r) => r.after_serving(&opened, stopping.is_cancelled()).await,
            None => Next::Exit,
        };
        // The store's own tasks (its session, heartbeat and listener) end here, before
        // the next store is opened or the process exits.
        opened.store.close().await;
        if next != Next::Exit {
            continue;
        }
        break match result {
            Ok(()) => {
                tracing::info!("control plane stopped");
                ExitCode::SUCCESS
            }
            Err(e) => {
                say_err!("valet control-plane: {e}");
                ExitCode::FAILURE
            }
        };
    };
    signals.abort();
    stop_metrics.cancel();
    if let Some(m) = metrics {
        let _ = m.await;
    }
    code
}

/// `d` as the flag would take it (`5s`, `1.5s`).
fn humantime_secs(d: std::time::Duration) -> String {
    format!("{}s", d.as_secs_f64())
}
