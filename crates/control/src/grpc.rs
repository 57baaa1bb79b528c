//! The gRPC face of the plane: `ateapi.Control`, `valet.worker.Workers` and server
//! reflection, on one listener.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use valet_net::{Accepted, FirstBytes, Listener};
use valet_proto::ateapi::{self, control_server};
use valet_proto::leases::{self as lp, leases_server};
use valet_proto::reload::Reloading;
use valet_proto::worker::{
    self as wk, worker_command::Command, worker_event::Event, workers_server,
};

use crate::auth::{Expiry, JwtVerifier, expired, refresh};
use crate::link::WorkerLink;
use crate::model::{self, ActorKey};
use crate::plane::Plane;

/// Largest gRPC message the control plane accepts.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// How long connections may stay open after the plane has shut down before the server
/// stops waiting for them.
pub const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Serves the plane on `listener` until `shutdown` resolves, then shuts down cleanly:
/// stop accepting (every connection gets GOAWAY), [`Plane::shutdown`] (capacity
/// waiters answered `Unavailable`, operations in progress given `shutdown_timeout`,
/// workers told to detach), and wait for the connections to close (bounded).
///
/// # Errors
/// When the server fails.
pub async fn serve(
    listener: TcpListener,
    plane: Plane,
    shutdown: impl Future<Output = ()> + Send + 'static,
    shutdown_timeout: Duration,
    security: crate::auth::ServerSecurity,
) -> Result<(), tonic::transport::Error> {
    use tonic::service::interceptor::InterceptedService;
    let authn = crate::auth::Authn(security.jwt.clone());
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(valet_proto::ateapi::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the embedded descriptor set is valid");
    let stop = tokio_util::sync::CancellationToken::new();
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(1)))
        .http2_keepalive_timeout(Some(Duration::from_secs(3)));
    // Every service checks the bearer token (when one is required), reflection too:
    // without a token nothing is answered, not even the schema.
    let router = builder
        .add_service(InterceptedService::new(
            control_server::ControlServer::new(ControlService {
                plane: plane.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
            authn.clone(),
        ))
        .add_service(InterceptedService::new(
            workers_server::WorkersServer::new(WorkersService {
                plane: plane.clone(),
                jwt: security.jwt.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
            authn.clone(),
        ))
        .add_service(InterceptedService::new(
            leases_server::LeasesServer::new(LeasesService {
                plane: plane.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
            authn.clone(),
        ))
        .add_service(InterceptedService::new(reflection, authn));
    let stopped = stop.clone().cancelled_owned();
    // The TLS accept loop owns the listener: it is ended (and the port let go) before
    // this returns, so that the caller can bind the port again at once.
    let mut accepting = None;
    let mut server: Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> =
        match security.tls {
            // TLS is done here rather than by tonic, so that each connection takes the
            // configuration current when it is accepted (rotated files, no restart).
            Some(tls) => {
                let listener = Listener::new(listener, "control plane");
                let (incoming, task) = tls_incoming(listener, tls, HANDSHAKE_CAPS);
                accepting = Some(task);
                Box::pin(router.serve_with_incoming_shutdown(incoming, stopped))
            }
            // `Server::tcp_nodelay` is ignored for a given incoming stream: the
            // listener sets it.
            None => {
                use tokio_stream::StreamExt as _;
                let incoming = Listener::new(listener, "control plane")
                    .incoming(stop.clone())
                    .map(|tcp| tcp.map(|tcp| FirstBytes::h2_preface(tcp, PREFACE_WITHIN)));
                Box::pin(router.serve_with_incoming_shutdown(incoming, stopped))
            }
        };
    let served = tokio::select! {
        served = &mut server => Some(served),
        () = shutdown => None,
    };
    let served = match served {
        Some(served) => served,
        None => {
            tracing::info!("control plane shutting down: accepting nothing new");
            stop.cancel();
            let closed = async {
                let (served, ()) = tokio::join!(&mut server, plane.shutdown(shutdown_timeout));
                served
            };
            match tokio::time::timeout(shutdown_timeout + CLOSE_GRACE, closed).await {
                Ok(served) => served,
                Err(_) => {
                    tracing::warn!("connections still open after the shutdown; closing them");
                    Ok(())
                }
            }
        }
    };
    drop(server);
    if let Some(task) = accepting {
        task.abort();
        let _ = task.await;
    }
    served
}

/// How long a client may take to complete its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS handshakes in progress at most, in all and from one peer address.
#[derive(Debug, Clone, Copy)]
struct HandshakeCaps {
    /// Past it no connection is accepted (they wait in the listen backlog) until one
    /// ends: clients that connect and never finish a handshake cannot take every file
    /// descriptor.
    total: usize,
    /// Past it a new connection from that address is closed at once: one client
    /// cannot take every place of `total` (its next attempt gets one once its own
    /// handshakes end).
    per_peer: usize,
}

const HANDSHAKE_CAPS: HandshakeCaps = HandshakeCaps {
    total: 256,
    per_peer: 32,
};

/// The connections [`tls_incoming`] hands over.
type TlsIncoming =
    ReceiverStream<Result<FirstBytes<tokio_rustls::server::TlsStream<Accepted>>, std::io::Error>>;

/// How long a connection may take to send the HTTP/2 connection preface (after its
/// TLS handshake, if any).
const PREFACE_WITHIN: Duration = HANDSHAKE_TIMEOUT;

/// Connections accepted on `listener`, through a TLS handshake with the configuration
/// current at accept time, at most `caps` at once, and the task that accepts them.
/// Failed handshakes are logged and dropped. The task (and the handshakes in progress)
/// end when the server drops the stream, or when it is aborted.
fn tls_incoming(
    listener: Listener,
    tls: valet_proto::reload::Reloading<tokio_rustls::rustls::ServerConfig>,
    caps: HandshakeCaps,
) -> (TlsIncoming, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(async move {
        let mut handshakes = tokio::task::JoinSet::new();
        // The peer address of each handshake in progress, and how many each has.
        let mut peers = std::collections::HashMap::<tokio::task::Id, std::net::IpAddr>::new();
        let mut per_peer = std::collections::HashMap::<std::net::IpAddr, usize>::new();
        let mut warned: Option<tokio::time::Instant> = None;
        // The task ends when the server drops the stream (or is aborted), not on a
        // token of its own.
        let never = tokio_util::sync::CancellationToken::new();
        loop {
            tokio::select! {
                () = tx.closed() => return,
                Some(ended) = handshakes.join_next_with_id(), if !handshakes.is_empty() => {
                    let id = match ended {
                        Ok((id, ())) => id,
                        Err(e) => e.id(),
                    };
                    if let Some(ip) = peers.remove(&id)
                        && let std::collections::hash_map::Entry::Occupied(mut n) = per_peer.entry(ip)
                    {
                        *n.get_mut() -= 1;
                        if *n.get() == 0 {
                            n.remove();
                        }
                    }
                }
                accepted = listener.accept(&never), if handshakes.len() < caps.total => {
                    let Some(tcp) = accepted else { return };
                    let peer = tcp.peer();
                    let ip = peer.ip().to_canonical();
                    let n = per_peer.entry(ip).or_default();
                    if *n >= caps.per_peer {
                        // Many workers behind one address (SNAT) reconnecting at once
                        // meet this too, and retry: said, at most every 10 s.
                        let now = tokio::time::Instant::now();
                        if warned.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(10)) {
                            warned = Some(now);
                            tracing::warn!(%peer, per_peer = caps.per_peer, "too many TLS handshakes in progress from one address; closing its new connections until some end");
                        }
                        continue;
                    }
                    *n += 1;
                    let acceptor = tokio_rustls::TlsAcceptor::from(tls.load());
                    let tx = tx.clone();
                    let handle = handshakes.spawn(async move {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(stream)) => {
                                let _ = tx.send(Ok(FirstBytes::h2_preface(stream, PREFACE_WITHIN))).await;
                            }
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            }
                            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                        }
                    });
                    peers.insert(handle.id(), ip);
                }
            }
        }
    });
    (ReceiverStream::new(rx), task)
}

/// `ateapi.Control` over the plane.
#[derive(Debug, Clone)]
pub struct ControlService {
    plane: Plane,
}

impl ControlService {
    /// The service alone, for a server built by hand (tests of a control plane
    /// without valet's extensions serve this and [`WorkersService`] only).
    pub fn new(plane: Plane) -> Self {
        Self { plane }
    }
}

type Res<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl control_server::Control for ControlService {
    async fn get_actor(
        &self,
        r: Request<ateapi::GetActorRequest>,
    ) -> Res<ateapi::GetActorResponse> {
        let key = ActorKey::from_ref(r.get_ref().actor_ref.as_ref())?;
        let actor = self.plane.catalog().get_actor(&key)?;
        Ok(Response::new(ateapi::GetActorResponse {
            actor: Some(actor),
        }))
    }

    async fn create_actor(
        &self,
        r: Request<ateapi::CreateActorRequest>,
    ) -> Res<ateapi::CreateActorResponse> {
        let r = r.into_inner();
        let key = ActorKey::from_ref(r.actor_ref.as_ref())?;
        if r.actor_template_name.is_empty() {
            return Err(Status::invalid_argument("actor_template_name is required"));
        }
        let mut selector: Vec<(String, String)> = r
            .worker_selector
            .map(|s| s.match_labels.into_iter().collect())
            .unwrap_or_default();
        selector.sort();
        if selector.len() > 32
            || selector
                .iter()
                .any(|(k, v)| k.len() > 63 || v.len() > 253 || k.contains('\n') || v.contains('\n'))
        {
            return Err(Status::invalid_argument(
                "worker_selector: at most 32 labels, keys up to 63 and values up to 253 characters, no newlines",
            ));
        }
        let ns = if r.actor_template_namespace.is_empty() {
            "default"
        } else {
            &r.actor_template_namespace
        };
        model::check_name("actor_template_namespace", ns)?;
        let actor = self
            .plane
            .catalog()
            .create_actor(key, ns, &r.actor_template_name, selector)
            .await?;
        Ok(Response::new(ateapi::CreateActorResponse {
            actor: Some(actor),
        }))
    }

    async fn suspend_actor(
        &self,
        r: Request<ateapi::SuspendActorRequest>,
    ) -> Res<ateapi::SuspendActorResponse> {
        let key = ActorKey::from_ref(r.get_ref().actor_ref.as_ref())?;
        let actor = self.plane.suspend_actor(key).await?;
        Ok(Response::new(ateapi::SuspendActorResponse {
            actor: Some(actor),
        }))
    }

    async fn resume_actor(
        &self,
        r: Request<ateapi::ResumeActorRequest>,
    ) -> Res<ateapi::ResumeActorResponse> {
        let r = r.into_inner();
        let key = ActorKey::from_ref(r.actor_ref.as_ref())?;
        let wait =
            match r.wait_for_capacity {
                None => None,
                Some(d) => Some(Duration::try_from(d).map_err(|_| {
                    Status::invalid_argument("wait_for_capacity must not be negative")
                })?),
            };
        let holder = Some(r.lease_holder.as_str()).filter(|h| !h.is_empty());
        let (actor, resumed, grant) = self.plane.resume_leased(key, wait, holder).await?;
        let (lease, lease_id) = match grant {
            Some((d, id)) => (d.try_into().ok(), id),
            None => (None, 0),
        };
        Ok(Response::new(ateapi::ResumeActorResponse {
            actor: Some(actor),
            resumed,
            lease,
            lease_id,
        }))
    }

    async fn delete_actor(&self, r: Request<ateapi::DeleteActorRequest>) -> Res<()> {
        let key = ActorKey::from_ref(r.get_ref().actor_ref.as_ref())?;
        self.plane.catalog().delete_actor(key).await?;
        Ok(Response::new(()))
    }

    async fn list_workers(&self, _: Request<()>) -> Res<ateapi::ListWorkersResponse> {
        Ok(Response::new(ateapi::ListWorkersResponse {
            workers: self.plane.membership().list_workers(),
        }))
    }

    async fn list_actors(
        &self,
        r: Request<ateapi::ListActorsRequest>,
    ) -> Res<ateapi::ListActorsResponse> {
        let r = r.get_ref();
        let (actors, next_page_token) =
            self.plane
                .catalog()
                .list_actors(&r.atespace, r.page_size, &r.page_token)?;
        Ok(Response::new(ateapi::ListActorsResponse {
            actors,
            next_page_token,
        }))
    }

    async fn create_atespace(
        &self,
        r: Request<ateapi::CreateAtespaceRequest>,
    ) -> Res<ateapi::CreateAtespaceResponse> {
        let atespace = self
            .plane
            .catalog()
            .create_atespace(&r.get_ref().name)
            .await?;
        Ok(Response::new(ateapi::CreateAtespaceResponse {
            atespace: Some(atespace),
        }))
    }

    async fn get_atespace(
        &self,
        r: Request<ateapi::GetAtespaceRequest>,
    ) -> Res<ateapi::GetAtespaceResponse> {
        let atespace = self.plane.catalog().get_atespace(&r.get_ref().name)?;
        Ok(Response::new(ateapi::GetAtespaceResponse {
            atespace: Some(atespace),
        }))
    }

    async fn list_atespaces(&self, _: Request<()>) -> Res<ateapi::ListAtespacesResponse> {
        Ok(Response::new(ateapi::ListAtespacesResponse {
            atespaces: self.plane.catalog().list_atespaces(),
        }))
    }

    async fn delete_atespace(&self, r: Request<ateapi::DeleteAtespaceRequest>) -> Res<()> {
        self.plane
            .catalog()
            .delete_atespace(&r.get_ref().name)
            .await?;
        Ok(Response::new(()))
    }

    async fn revert_actor(
        &self,
        r: Request<ateapi::RevertActorRequest>,
    ) -> Res<ateapi::RevertActorResponse> {
        let key = ActorKey::from_ref(r.get_ref().actor_ref.as_ref())?;
        let actor = self.plane.revert_actor(key).await?;
        Ok(Response::new(ateapi::RevertActorResponse {
            actor: Some(actor),
        }))
    }

    async fn get_actor_logs(
        &self,
        r: Request<ateapi::GetActorLogsRequest>,
    ) -> Res<ateapi::GetActorLogsResponse> {
        let key = ActorKey::from_ref(r.get_ref().actor_ref.as_ref())?;
        let (output, worker) = self.plane.catalog().actor_logs(&key).await?;
        Ok(Response::new(ateapi::GetActorLogsResponse {
            output,
            worker,
        }))
    }
}

/// `valet.leases.Leases`: routers' watches of their route leases.
#[derive(Debug, Clone)]
pub struct LeasesService {
    plane: Plane,
}

/// How long a stream may take to send its first message (a router's Hello, a worker's
/// Join) before the control plane gives up on it.
const FIRST_MESSAGE_WITHIN: Duration = Duration::from_secs(10);

/// The first message of `inbound`, within [`FIRST_MESSAGE_WITHIN`].
async fn first_message<T>(inbound: &mut Streaming<T>, what: &str) -> Result<Option<T>, Status> {
    tokio::time::timeout(FIRST_MESSAGE_WITHIN, inbound.message())
        .await
        .map_err(|_| {
            Status::deadline_exceeded(format!(
                "no {what} within {}s of opening the stream",
                FIRST_MESSAGE_WITHIN.as_secs()
            ))
        })?
}

#[tonic::async_trait]
impl leases_server::Leases for LeasesService {
    type WatchStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<lp::PlaneMessage, Status>> + Send>>;

    async fn watch(&self, r: Request<Streaming<lp::RouterMessage>>) -> Res<Self::WatchStream> {
        let expiry = Expiry::of(&r);
        let mut inbound = r.into_inner();
        let router = match first_message(&mut inbound, "Hello").await? {
            Some(lp::RouterMessage {
                message: Some(lp::router_message::Message::Hello(hello)),
            }) => hello.router_id,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message must be a Hello",
                ));
            }
        };
        let (tx, rx) = mpsc::channel(256);
        // The Welcome is queued before the watch is registered: a Revoke (sent once
        // it is) comes after it, never before, when the router knows the lease length
        // its memory of the revocation must last.
        let welcome = lp::PlaneMessage {
            message: Some(lp::plane_message::Message::Welcome(lp::Welcome {
                route_lease: self.plane.route_lease().try_into().ok(),
            })),
        };
        let _ = tx.try_send(Ok(welcome));
        let conn = self.plane.leases().router_watching(&router, tx.clone())?;
        // Weak: the stream ends when the plane drops its sender.
        let ending = tx.downgrade();
        drop(tx);
        let plane = self.plane.clone();
        self.plane.spawn_link(async move {
            loop {
                let message = tokio::select! {
                    m = inbound.message() => m,
                    () = expired(expiry) => {
                        // The router watches again with the token in its file now.
                        tracing::info!(%router, "the router's bearer token expired; ending its lease watch");
                        if let Some(tx) = ending.upgrade() {
                            let _ = tx.try_send(Err(Status::unauthenticated(
                                "bearer token expired: watch again with a fresh token",
                            )));
                        }
                        break;
                    }
                };
                match message {
                    Ok(Some(lp::RouterMessage {
                        message: Some(lp::router_message::Message::Ack(ack)),
                    })) => {
                        if let Some(actor) = &ack.actor {
                            plane.leases().lease_acked(&router, actor, ack.through);
                        }
                    }
                    Ok(Some(lp::RouterMessage {
                        message: Some(lp::router_message::Message::ReleaseAll(_)),
                    })) => plane.leases().leases_released(&router),
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            plane.leases().router_detached(&router, conn);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// `valet.worker.Workers`: the streams reference workers attach with.
#[derive(Debug, Clone)]
pub struct WorkersService {
    plane: Plane,
    /// Verifies the tokens workers renew in band (see [`Expiry`]).
    jwt: Option<Reloading<JwtVerifier>>,
}

impl WorkersService {
    /// The service alone, for a server built by hand (without bearer tokens).
    pub fn new(plane: Plane) -> Self {
        Self { plane, jwt: None }
    }
}

#[tonic::async_trait]
impl workers_server::Workers for WorkersService {
    type AttachStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<wk::WorkerCommand, Status>> + Send>>;

    async fn attach(&self, r: Request<Streaming<wk::WorkerEvent>>) -> Res<Self::AttachStream> {
        let mut expiry = Expiry::of(&r);
        let mut inbound = r.into_inner();
        let join = match first_message(&mut inbound, "Join").await? {
            Some(wk::WorkerEvent {
                event: Some(Event::Join(join)),
            }) => join,
            _ => return Err(Status::invalid_argument("the first event must be a Join")),
        };
        let (tx, rx) = mpsc::channel(64);
        let link = Arc::new(WorkerLink::new(tx));
        // Its Welcome is queued by the join itself, before any other command.
        self.plane
            .membership()
            .worker_attached(&join, Arc::clone(&link))
            .await?;
        let plane = self.plane.clone();
        let jwt = self.jwt.clone();
        self.plane.spawn_link(async move {
            // A worker whose stream stays open but that stops renewing (its loop is
            // stuck) has fenced its actor after a hosting lease: it leaves then, as
            // one whose stream ended, rather than be placed on record for good.
            let lease = plane.hosting_lease();
            let mut renewed = tokio::time::Instant::now();
            loop {
                let event = tokio::select! {
                    e = inbound.message() => e,
                    () = tokio::time::sleep_until(renewed + lease) => {
                        tracing::warn!(worker = %join.worker_id, ?lease, "no hosting renewal for a hosting lease; ending its stream");
                        link.end(Status::deadline_exceeded(
                            "no hosting renewal within the hosting lease: attach again",
                        ));
                        break;
                    }
                    () = expired(expiry) => {
                        tracing::warn!(worker = %join.worker_id, "the worker's bearer token expired and was not renewed; ending its stream");
                        link.end(Status::unauthenticated(
                            "bearer token expired: attach again with a fresh token",
                        ));
                        break;
                    }
                };
                match event {
                    Ok(Some(wk::WorkerEvent {
                        event: Some(Event::Reply(reply)),
                    })) => link.deliver(reply),
                    Ok(Some(wk::WorkerEvent {
                        event: Some(Event::Activity(activity)),
                    })) => plane.policies().activity(&join.worker_id, &link, &activity),
                    Ok(Some(wk::WorkerEvent {
                        event: Some(Event::Drain(_)),
                    })) => plane.membership().worker_draining(&join.worker_id, &link),
                    Ok(Some(wk::WorkerEvent {
                        event: Some(Event::Exited(exited)),
                    })) => plane.membership().actor_exited(&join.worker_id, &link, &exited),
                    Ok(Some(wk::WorkerEvent {
                        event: Some(Event::Renew(renew)),
                    })) => {
                        let token = renew.bearer_token.trim();
                        if !token.is_empty() {
                            match refresh(jwt.as_ref(), token) {
                                Some(Ok(fresh)) => expiry = Some(fresh),
                                Some(Err(why)) => tracing::warn!(worker = %join.worker_id, %why, "the worker's renewed bearer token is refused; its stream ends when the one it has expires"),
                                None => {}
                            }
                        }
                        if plane.membership().renewed(&join.worker_id, &link) {
                            renewed = tokio::time::Instant::now();
                            link.notify(Command::Renewed(wk::Renewed { seq: renew.seq }));
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            link.close();
            plane.membership().worker_left(&join.worker_id, &link);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_rustls::rustls;

    /// Clients that connect and never start their handshake hold at most
    /// `caps.total` places: past them no connection is accepted until one ends
    /// (before, every one was accepted, each holding a descriptor for 10 s).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_handshakes_in_progress_are_capped() {
        let (_dir, tls, config) = loopback_tls();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let caps = HandshakeCaps {
            total: 2,
            per_peer: 2,
        };
        let (_incoming, task) = tls_incoming(Listener::new(listener, "test"), tls, caps);

        let mut silent = Vec::new();
        for _ in 0..2 {
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let handshake = tokio::spawn(handshake_from("127.0.0.2", addr, config));
        // Not a synchronization: however long it waits, it must not be accepted.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!handshake.is_finished(), "accepted past the cap");
        drop(silent.pop());
        let done = tokio::time::timeout(Duration::from_secs(5), handshake).await;
        assert!(
            matches!(done, Ok(Ok(Ok(())))),
            "the handshake completes once a place is free: {done:?}"
        );
        task.abort();
    }

    /// One address cannot take every place: past its own cap, its next connection is
    /// closed at once, and another address still gets its handshake.
    #[tokio::test]
    async fn one_peer_cannot_take_every_handshake_place() {
        use tokio::io::AsyncReadExt as _;
        let (_dir, tls, config) = loopback_tls();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let caps = HandshakeCaps {
            total: 4,
            per_peer: 2,
        };
        let (_incoming, task) = tls_incoming(Listener::new(listener, "test"), tls, caps);

        let mut silent = Vec::new();
        for _ in 0..2 {
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let read = tokio::time::timeout(Duration::from_secs(5), third.read(&mut [0; 1])).await;
        assert!(
            matches!(read, Ok(Ok(0) | Err(_))),
            "closed at once: {read:?}"
        );
        let other = tokio::time::timeout(
            Duration::from_secs(5),
            handshake_from("127.0.0.2", addr, Arc::clone(&config)),
        )
        .await;
        assert!(matches!(other, Ok(Ok(()))), "{other:?}");
        // Once its own handshakes end (the server sees them closed a moment after),
        // the first address gets a place again.
        silent.clear();
        let again = tokio::time::timeout(Duration::from_secs(5), async {
            while handshake_from("127.0.0.1", addr, Arc::clone(&config))
                .await
                .is_err()
            {}
        })
        .await;
        assert!(again.is_ok(), "no place for the first address again");
        task.abort();
    }

    /// A server configuration with a certificate for 127.0.0.1, and a client
    /// configuration that trusts it.
    fn loopback_tls() -> (
        tempfile::TempDir,
        valet_proto::reload::Reloading<tokio_rustls::rustls::ServerConfig>,
        Arc<rustls::ClientConfig>,
    ) {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let (cert_file, key_file) = (dir.path().join("cp.pem"), dir.path().join("cp.key"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        let tls = crate::auth::server_tls(&cert_file, &key_file, None).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.as_ref().der().clone()).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        (dir, tls, Arc::new(config))
    }

    /// A TLS handshake with the server at `addr`, from `from`.
    async fn handshake_from(
        from: &str,
        addr: std::net::SocketAddr,
        config: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<()> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(format!("{from}:0").parse().unwrap())?;
        let tcp = socket.connect(addr).await?;
        tokio_rustls::TlsConnector::from(config)
            .connect("127.0.0.1".try_into().unwrap(), tcp)
            .await
            .map(drop)
    }
}
