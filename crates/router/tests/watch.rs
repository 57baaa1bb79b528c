//! The router's lease watch against a real gRPC server: a watch the control plane
//! refuses (its bearer token expired) is the control plane answering, not a control
//! plane out of reach, so expired leases are not used as stale routes meanwhile.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tonic::{Request, Response, Status, Streaming};
use valet_proto::leases::{self as pb, leases_server};
use valet_router::{GrpcControlPlane, Metrics, Router, RouterArgs};

/// The first watch is welcomed, then refused with `refusal`; the second is never
/// answered.
struct Script {
    watches: AtomicUsize,
    second: Notify,
    refusal: Status,
}

#[derive(Clone)]
struct Refusing(Arc<Script>);

impl Refusing {
    fn with(refusal: Status) -> Self {
        Self(Arc::new(Script {
            watches: AtomicUsize::new(0),
            second: Notify::new(),
            refusal,
        }))
    }
}

type Out = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::PlaneMessage, Status>> + Send>>;

#[tonic::async_trait]
impl leases_server::Leases for Refusing {
    type WatchStream = Out;

    async fn watch(
        &self,
        _: Request<Streaming<pb::RouterMessage>>,
    ) -> Result<Response<Out>, Status> {
        if self.0.watches.fetch_add(1, Ordering::SeqCst) == 0 {
            let welcome = pb::PlaneMessage {
                message: Some(pb::plane_message::Message::Welcome(pb::Welcome {
                    route_lease: Duration::from_secs(5).try_into().ok(),
                })),
            };
            let refused = self.0.refusal.clone();
            return Ok(Response::new(Box::pin(tokio_stream::iter([
                Ok(welcome),
                Err(refused),
            ]))));
        }
        self.0.second.notify_one();
        Ok(Response::new(Box::pin(tokio_stream::pending())))
    }
}

/// A real gRPC server of `leases` on a loopback port, and a router whose lease client
/// watches it.
async fn watching<S: leases_server::Leases>(
    leases: S,
) -> (
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    Router,
    Arc<valet_router::lease::LeaseClient>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(leases_server::LeasesServer::new(leases))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let config = RouterArgs::try_parse_flags_only(["--control-plane", &url])
        .unwrap()
        .resolve()
        .unwrap();
    let cp = GrpcControlPlane::connect_lazy(&url, config.credentials()).unwrap();
    let channel = cp.channel();
    let router = Router::new(Arc::new(config), Arc::new(cp), Arc::new(Metrics::new()));
    let leases = router.start_leases(channel);
    (server, router, leases)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_watch_is_not_an_unreachable_control_plane() {
    // An expired token; and the plane still holding this router's earlier watch (a
    // reset that reached only the router): before, that one counted as unreachable.
    for refusal in [
        Status::unauthenticated("bearer token expired: watch again"),
        Status::already_exists("router r1 already watches"),
    ] {
        let script = Refusing::with(refusal.clone());
        let (server, router, leases) = watching(script.clone()).await;
        tokio::time::timeout(Duration::from_secs(10), script.0.second.notified())
            .await
            .expect("the router watches again after the refusal");
        let cache = router.route_cache();
        assert!(cache.holder_for_test().is_none(), "the watch is down");
        assert!(
            !cache.unreachable(),
            "{refusal:?} is an answer: the control plane is reachable"
        );
        leases.shutdown().await;
        server.abort();
    }
}

/// Records whether a watch released every lease before it ended; ends the watch when
/// the router half-closes it, as the control plane does.
#[derive(Clone, Default)]
struct Releasing {
    released: Arc<std::sync::atomic::AtomicBool>,
    welcomed: Arc<Notify>,
    /// The router's route cache: whether it still asked for leases when its release
    /// arrived.
    cache: Arc<std::sync::OnceLock<Arc<valet_router::lease::RouteCache>>>,
    holder_at_release: Arc<std::sync::Mutex<Option<Option<String>>>>,
}

#[tonic::async_trait]
impl leases_server::Leases for Releasing {
    type WatchStream = Out;

    async fn watch(
        &self,
        request: Request<Streaming<pb::RouterMessage>>,
    ) -> Result<Response<Out>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let welcome = pb::PlaneMessage {
            message: Some(pb::plane_message::Message::Welcome(pb::Welcome {
                route_lease: Duration::from_secs(5).try_into().ok(),
            })),
        };
        tx.send(Ok(welcome)).await.unwrap();
        self.welcomed.notify_one();
        let released = Arc::clone(&self.released);
        let (cache, holder_at_release) =
            (Arc::clone(&self.cache), Arc::clone(&self.holder_at_release));
        tokio::spawn(async move {
            // A busy control plane: it reads the router's messages a while later.
            tokio::time::sleep(Duration::from_millis(200)).await;
            while let Ok(Some(m)) = inbound.message().await {
                if matches!(m.message, Some(pb::router_message::Message::ReleaseAll(_))) {
                    released.store(true, Ordering::SeqCst);
                    *holder_at_release.lock().unwrap() =
                        Some(cache.get().and_then(|c| c.holder_for_test()));
                }
            }
            drop(tx);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// A stopping router's release of its leases has reached the control plane by the time
/// its lease client has stopped, so the plane need not wait the leases out; by the time
/// it is sent, the router asks for and routes on leases no more (before, it did until
/// its watch ended, after the plane could have moved the actors).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_router_releases_its_leases_before_it_stops() {
    let script = Releasing::default();
    let (server, router, _leases) = watching(script.clone()).await;
    let _ = script.cache.set(Arc::clone(router.route_cache()));
    tokio::time::timeout(Duration::from_secs(10), script.welcomed.notified())
        .await
        .expect("the router watches");
    tokio::time::timeout(Duration::from_secs(10), async {
        while router.route_cache().holder_for_test().is_none() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the router takes the welcome");
    router.stop_leases().await;
    assert!(
        script.released.load(Ordering::SeqCst),
        "the release reached the control plane before the router stopped"
    );
    assert_eq!(
        *script.holder_at_release.lock().unwrap(),
        Some(None),
        "no lease asked for once the release is sent"
    );
    server.abort();
}
