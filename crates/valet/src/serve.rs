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
    /// The plaintext and the HTTPS listeners of the built-in data plane, when on.
    http: Vec<HttpServer>,
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

/// With client certificates checked on `--listen-https`, a plaintext listener other
/// hosts can reach serves the same actors with no certificate: the check (and the
/// SPIFFE allowlist) would be for show. Said once at start, per listener.
fn warn_plain_listeners(config: &RouterConfig) {
    for (flag, addr) in [
        ("--listen", config.listen()),
        ("--extproc-listen", config.extproc_listen()),
    ] {
        if let Some(addr) = addr.filter(|a| !a.ip().is_loopback()) {
            tracing::warn!(
                "{flag}={addr} serves actors with no client certificate: --ingress-client-ca-file and --ingress-allowed-spiffe-ids apply to --listen-https only (set {flag} '' or a loopback address to require them)"
            );
        }
    }
}

impl RunningRouter {
    /// Binds every configured listener and starts serving; prints one
    /// `listening <part> <address>` line per listener.
    pub(crate) async fn start(
        config: RouterConfig,
        https: Option<(SocketAddr, valet_proxy::tls::IngressTls)>,
    ) -> Result<Self, String> {
        if https
            .as_ref()
            .is_some_and(|(_, tls)| tls.checks_client_certificates())
        {
            warn_plain_listeners(&config);
        }
        let config = Arc::new(config);
        let cp = GrpcControlPlane::replicas(
            config.control_planes(),
            config.credentials(),
            config.control_plane_ping_interval(),
        )
        .map_err(|e| format!("--control-plane={}: {e}", config.control_plane()))?;
        let channel = cp.channel();
        let cp_for_probe = cp.clone();
        // Every port first: a bind that fails leaves nothing running (no lease watch).
        let bound = |flag: &'static str, addr: Option<SocketAddr>| async move {
            match addr {
                Some(addr) => bind(flag, addr).await.map(|l| Some((addr, l))),
                None => Ok(None),
            }
        };
        let http_listener = bound("--listen", config.listen()).await?;
        let https_listener = bound("--listen-https", https.as_ref().map(|(a, _)| *a)).await?;
        let extproc_listener = bound("--extproc-listen", config.extproc_listen()).await?;
        let admin_listener = bound("--admin-listen", config.admin_listen()).await?;
        let router = Router::new(Arc::clone(&config), Arc::new(cp), Arc::new(Metrics::new()));
        let health = Arc::new(Health::default());
        let stop_admin = CancellationToken::new();
        let mut listeners = Vec::new();

        let http = match http_listener {
            Some((addr, l)) => {
                let server = HttpServer::spawn(l, router.clone(), Limits::default())
                    .map_err(|e| format!("--listen={addr}: {e}"))?;
                listeners.push(("router", server.local_addr()));
                Some(server)
            }
            None => None,
        };
        let https = match https.zip(https_listener) {
            Some(((_, tls), (addr, l))) => {
                let server = HttpServer::spawn_https(l, router.clone(), Limits::default(), tls)
                    .map_err(|e| format!("--listen-https={addr}: {e}"))?;
                listeners.push(("router-https", server.local_addr()));
                Some(server)
            }
            None => None,
        };
        let http: Vec<HttpServer> = http.into_iter().chain(https).collect();
        let extproc = match extproc_listener {
            Some((addr, l)) => {
                let server = ExtProcServer::spawn(l, router.clone())
                    .map_err(|e| format!("--extproc-listen={addr}: {e}"))?;
                listeners.push(("extproc", server.local_addr()));
                Some(server)
            }
            None => None,
        };
        let admin_listener = match admin_listener {
            Some((_, l)) => {
                let a = l.local_addr().map_err(|e| e.to_string())?;
                listeners.push(("admin", a));
                Some(l)
            }
            None => None,
        };
        // Last of all: nothing that can fail follows, so a start that fails leaves no
        // lease watch behind. Requests taken before it ask no lease.
        router.start_leases(channel);
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
            cp_for_probe,
            router.clone(),
            Arc::clone(&health),
            stop_admin.clone(),
        );
        for (part, addr) in &listeners {
            say!("listening {part} {addr}");
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

    /// The shutdown of `parking.md`, over every data plane at once: readiness fails;
    /// after `--drain-delay` the HTTP plane and the ext_proc server stop accepting;
    /// requests already received (parked ones included, on either plane) keep their
    /// budget until `--drain-timeout`; then whatever still waits gets `router shutting
    /// down`, upgraded tunnels are closed, and once every answer is written (bounded by
    /// [`CUT_OFF_GRACE`]) every connection and stream still open is ended. Flights start
    /// no new attempt; one already sent is waited for until the drain timeout.
    pub(crate) async fn drain(self) {
        let config = self.router.config().clone();
        self.health.set_draining();
        tracing::info!(delay = ?config.drain_delay(), "draining: readiness fails");
        tokio::time::sleep(config.drain_delay()).await;
        for http in &self.http {
            http.stop_accepting();
        }
        if let Some(extproc) = &self.extproc {
            extproc.stop_accepting();
        }
        tracing::info!(
            timeout = ?config.drain_timeout(),
            parked = self.router.lot().active(),
            "stopped accepting; requests in progress keep their budget"
        );
        let drain_ends = tokio::time::Instant::now() + config.drain_timeout();
        let Self {
            router,
            http,
            mut extproc,
            admin,
            probe,
            stop_admin,
            ..
        } = self;
        {
            let mut drained = std::pin::pin!(planes_drained(&http, extproc.as_mut()));
            if tokio::time::timeout(config.drain_timeout(), &mut drained)
                .await
                .is_ok()
            {
                tracing::info!("every request answered");
            } else {
                tracing::warn!(
                    parked = router.lot().active(),
                    "drain timeout: answering what still waits with 'router shutting down'"
                );
                router.cut_off_waiting();
                for http in &http {
                    http.close_tunnels();
                }
                if tokio::time::timeout(CUT_OFF_GRACE, &mut drained)
                    .await
                    .is_err()
                {
                    tracing::warn!("connections still open after the cut-off; closing them");
                }
            }
        }
        for http in &http {
            http.close().await;
        }
        if let Some(extproc) = extproc.as_mut() {
            extproc.close().await;
        }
        router.stop_flights(drain_ends).await;
        router.stop_leases().await;
        stop_admin.cancel();
        let _ = probe.await;
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        tracing::info!("router stopped");
    }
}

/// How long the answers of the drain's cut-off may take to be written before the
/// connections still open are closed.
pub(crate) const CUT_OFF_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Resolves once every connection, tunnel and stream of both data planes has ended.
async fn planes_drained(http: &[HttpServer], extproc: Option<&mut ExtProcServer>) {
    let http = async {
        for h in http {
            h.drained().await;
        }
    };
    let extproc = async {
        if let Some(extproc) = extproc {
            extproc.drained().await;
        }
    };
    tokio::join!(http, extproc);
}
