//! A running router: its data planes, its admin server, and the drain that stops them
//! (`parking.md`, "Shutdown").

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use valet_extproc::ExtProcServer;
use valet_proxy::{HttpServer, Limits};
use valet_router::{GrpcControlPlane, Metrics, Router, RouterConfig};

use crate::admin::{self, Health};

/// The router with everything it serves.
pub(crate) struct RunningRouter {
    router: Router,
    http: Option<HttpServer>,
    extproc: Option<ExtProcServer>,
    admin: Option<tokio::task::JoinHandle<()>>,
    probe: tokio::task::JoinHandle<()>,
    health: Arc<Health>,
    stop_admin: CancellationToken,
    /// `(part, address)` of every listener, as printed.
    pub(crate) listeners: Vec<(&'static str, SocketAddr)>,
}

async fn bind(flag: &str, addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {flag}={addr}: {e}"))
}

impl RunningRouter {
    /// Binds every configured listener and starts serving; prints one
    /// `listening <part> <address>` line per listener.
    pub(crate) async fn start(config: RouterConfig) -> Result<Self, String> {
        let config = Arc::new(config);
        let cp = GrpcControlPlane::connect_lazy(config.control_plane())
            .map_err(|e| format!("--control-plane={}: {e}", config.control_plane()))?;
        let router = Router::new(Arc::clone(&config), Arc::new(cp), Arc::new(Metrics::new()));
        let health = Arc::new(Health::default());
        let stop_admin = CancellationToken::new();
        let mut listeners = Vec::new();

        let http = match config.listen() {
            Some(addr) => {
                let l = bind("--listen", addr).await?;
                let server = HttpServer::spawn(l, router.clone(), Limits::default())
                    .map_err(|e| format!("--listen={addr}: {e}"))?;
                listeners.push(("router", server.local_addr()));
                Some(server)
            }
            None => None,
        };
        let extproc = match config.extproc_listen() {
            Some(addr) => {
                let l = bind("--extproc-listen", addr).await?;
                let server = ExtProcServer::spawn(l, router.clone())
                    .map_err(|e| format!("--extproc-listen={addr}: {e}"))?;
                listeners.push(("extproc", server.local_addr()));
                Some(server)
            }
            None => None,
        };
        let admin_listener = match config.admin_listen() {
            Some(addr) => {
                let l = bind("--admin-listen", addr).await?;
                let a = l.local_addr().map_err(|e| e.to_string())?;
                listeners.push(("admin", a));
                Some(l)
            }
            None => None,
        };
        let admin = admin_listener.map(|l| {
            admin::spawn(
                l,
                router.clone(),
                Arc::clone(&health),
                listeners.clone(),
                stop_admin.clone(),
            )
        });
        let probe = admin::spawn_probe(
            config.control_plane().to_owned(),
            router.clone(),
            Arc::clone(&health),
            stop_admin.clone(),
        );
        for (part, addr) in &listeners {
            println!("listening {part} {addr}");
        }
        tracing::info!(
            control_plane = config.control_plane(),
            budget = ?config.parking().budget(),
            lot = config.parking().max_parked(),
            "router serving"
        );
        Ok(Self {
            router,
            http,
            extproc,
            admin,
            probe,
            health,
            stop_admin,
            listeners,
        })
    }

    /// The address of one listener.
    pub(crate) fn addr(&self, part: &str) -> Option<SocketAddr> {
        self.listeners
            .iter()
            .find(|(p, _)| *p == part)
            .map(|(_, a)| *a)
    }

    /// The shutdown of `parking.md`: readiness fails, `--drain-delay`, stop accepting,
    /// requests already received keep their budget until `--drain-timeout`, whatever
    /// still waits then gets `router shutting down`, and every request gets an answer.
    pub(crate) async fn drain(mut self) {
        let config = self.router.config().clone();
        self.health.set_draining();
        tracing::info!(delay = ?config.drain_delay(), "draining: readiness fails");
        tokio::time::sleep(config.drain_delay()).await;
        if let Some(http) = &self.http {
            http.stop_accepting();
        }
        if let Some(extproc) = &self.extproc {
            extproc.stop_accepting();
        }
        tracing::info!(timeout = ?config.drain_timeout(), "stopped accepting; waiting for requests in progress");
        let drained = async {
            if let Some(http) = &self.http {
                http.drained().await;
            }
        };
        if tokio::time::timeout(config.drain_timeout(), drained)
            .await
            .is_err()
        {
            tracing::warn!(
                parked = self.router.lot().active(),
                "drain timeout: answering what still waits with 'router shutting down'"
            );
            self.router.cut_off_waiting();
            let (http, extproc) = (&self.http, &mut self.extproc);
            let answered = async {
                if let Some(http) = http {
                    http.drained().await;
                }
                if let Some(extproc) = extproc {
                    extproc.drained().await;
                }
            };
            if tokio::time::timeout(std::time::Duration::from_secs(5), answered)
                .await
                .is_err()
            {
                tracing::warn!("connections still open after the cut-off; closing");
            }
        }
        self.stop_admin.cancel();
        let _ = self.probe.await;
        if let Some(admin) = self.admin {
            let _ = admin.await;
        }
        tracing::info!("router stopped");
    }
}
