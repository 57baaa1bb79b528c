//! Route leases on the router's side (`docs/leases.md`): the route cache that lets a
//! request to a leased actor go straight to its worker, the watch on which the control
//! plane revokes leases, and the background renewal of leases in use.
//!
//! A lease counts from when its `ResumeActor` was *sent*, so it always ends before the
//! control plane's record of it. A revocation drops the lease and remembers the number
//! it covered, so an answer crossing it on another stream is never installed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use valet_net::Backoff;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use valet_proto::auth::CpChannel as Channel;
use valet_proto::leases as pb;

use crate::addr::ActorRef;
use crate::control::{ControlPlane, Grant, ResumeRequest};
use crate::metrics::Metrics;

/// A lease in the cache.
#[derive(Debug, Clone, Copy)]
struct Entry {
    addr: SocketAddr,
    id: u64,
    until: Instant,
    /// A request used it since it was granted: renew it before it ends.
    used: bool,
    /// Its renewal was sent (in progress, or failed): one per lease. A failed one is
    /// not sent again (the next request's own call asks for a new lease once this one
    /// ends); before, it was sent again at every tick, ten a second.
    renewing: bool,
}

/// Keyed by actor with foldhash: host names are client input, and foldhash is
/// randomly seeded per process (as `RandomState` is) but several times faster.
type Map<V> = HashMap<ActorRef, V, foldhash::fast::RandomState>;

/// A revocation remembered: leases up to `through` on the actor are never installed.
#[derive(Debug, Clone, Copy)]
struct Floor {
    through: u64,
    /// From then on no answer it covers can still be installed: each such answer
    /// granted a lease that ended by then (it was sent before the revocation, and its
    /// lease counts from when its request was sent), and expired grants are refused.
    forget_at: Instant,
}

#[derive(Debug, Default)]
struct Book {
    entries: Map<Entry>,
    /// The highest lease number revoked, per actor, while an answer it covers could
    /// still arrive.
    revoked: Map<Floor>,
}

/// The route cache: which worker each leased actor runs on, until when.
#[derive(Debug)]
pub struct RouteCache {
    book: std::sync::Mutex<Book>,
    /// The router id to ask leases for, and the lease the control plane grants, while
    /// the watch is open.
    holder: std::sync::Mutex<Holder>,
    /// The control plane answers (its watch is up, or a recent call did not end
    /// `Unavailable`).
    reachable: AtomicBool,
    stale_max: Duration,
    metrics: Arc<Metrics>,
}

/// Who asks leases: the watch's holder while it is open, never again once stopped.
#[derive(Debug, Default)]
struct Holder {
    current: Option<(String, Duration)>,
    /// The router stops: a watch welcomed late sets no holder any more.
    stopped: bool,
}

/// How a request was routed from the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cached {
    /// Under a valid lease.
    Valid(SocketAddr),
    /// Under an expired lease, within `--route-stale-max`, while the control plane is
    /// unreachable.
    Stale(SocketAddr),
}

impl RouteCache {
    pub(crate) fn new(stale_max: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            book: std::sync::Mutex::default(),
            holder: std::sync::Mutex::default(),
            reachable: AtomicBool::new(true),
            stale_max,
            metrics,
        }
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The router id to ask leases for, while the watch is open.
    pub(crate) fn holder(&self) -> Option<String> {
        self.watching().map(|(id, _)| id)
    }

    /// The router id leases are asked for now, if the watch is open.
    pub fn holder_for_test(&self) -> Option<String> {
        self.holder()
    }

    fn holding(&self) -> std::sync::MutexGuard<'_, Holder> {
        self.holder.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn watching(&self) -> Option<(String, Duration)> {
        self.holding().current.clone()
    }

    /// Asks leases as `holder` (the watch is open; the plane grants `lease`), or none.
    /// Ignored once [`Self::stop_holding`] was called.
    pub fn set_holder(&self, holder: Option<(String, Duration)>) {
        let mut h = self.holding();
        if !h.stopped {
            h.current = holder;
        }
    }

    /// Asks no lease and takes none from now on, whatever a watch says later (the
    /// router stops).
    pub(crate) fn stop_holding(&self) {
        let mut h = self.holding();
        h.stopped = true;
        h.current = None;
    }

    /// Records whether the last control-plane call got an answer (`false`: it ended
    /// `Unavailable`).
    pub(crate) fn answered(&self, answered: bool) {
        self.reachable.store(answered, Ordering::Relaxed);
    }

    /// Whether the control plane counts as unreachable: its watch is down and the last
    /// call ended `Unavailable`.
    pub fn unreachable(&self) -> bool {
        self.holder().is_none() && !self.reachable.load(Ordering::Relaxed)
    }

    /// The worker to route `actor` to without asking, if a lease allows it. An expired
    /// lease is used only when `stale_ok` (a data plane that can replay a 421) and the
    /// control plane is unreachable, for up to `--route-stale-max` after it ended.
    pub fn route(&self, actor: &ActorRef, stale_ok: bool) -> Option<Cached> {
        self.route_at(actor, stale_ok, Instant::now())
    }

    /// [`Self::route`] at `now`.
    pub(crate) fn route_at(
        &self,
        actor: &ActorRef,
        stale_ok: bool,
        now: Instant,
    ) -> Option<Cached> {
        let mut book = self.book();
        let e = book.entries.get_mut(actor)?;
        if now < e.until {
            e.used = true;
            return Some(Cached::Valid(e.addr));
        }
        let addr = e.addr;
        let ended = e.until;
        if now >= ended + self.stale_max {
            // Of no use any more, also while the watch (whose renewals prune) is down.
            book.entries.remove(actor);
            self.metrics.leases(-1);
            return None;
        }
        drop(book);
        if stale_ok && now < ended + self.stale_max && self.unreachable() {
            return Some(Cached::Stale(addr));
        }
        None
    }

    /// Installs a lease on `actor` at `addr`, granted on a request sent at `sent_at`,
    /// unless a revocation already covered its number, the lease already ended, or the
    /// cache holds a valid lease granted after it (two answers crossed: a renewal's and
    /// a request's, say).
    pub(crate) fn install(
        &self,
        actor: &ActorRef,
        addr: SocketAddr,
        grant: Grant,
        sent_at: Instant,
    ) {
        self.install_at(actor, addr, grant, sent_at, Instant::now());
    }

    /// [`Self::install`] at `now`.
    fn install_at(
        &self,
        actor: &ActorRef,
        addr: SocketAddr,
        grant: Grant,
        sent_at: Instant,
        now: Instant,
    ) {
        let until = sent_at + grant.lease;
        // Not while no watch is open (the router stops, or its watch is down): no
        // revocation could reach this router, and a stopping one has released them.
        // Looked at under the book's lock: a stop that takes the holder away and then
        // empties the book cannot run in between.
        let mut book = self.book();
        if until <= now || self.watching().is_none() {
            return;
        }
        if book
            .revoked
            .get(actor)
            .is_some_and(|r| grant.id <= r.through)
        {
            return;
        }
        if book
            .entries
            .get(actor)
            .is_some_and(|e| now < e.until && grant.id < e.id)
        {
            return;
        }
        let fresh = book.entries.insert(
            actor.clone(),
            Entry {
                addr,
                id: grant.id,
                until,
                used: false,
                renewing: false,
            },
        );
        if fresh.is_none() {
            self.metrics.leases(1);
        }
    }

    /// The control plane revoked the leases on `actor` up to `through`.
    pub(crate) fn revoke(&self, actor: &ActorRef, through: u64) {
        self.revoke_at(actor, through, Instant::now());
    }

    /// [`Self::revoke`] at `now`.
    fn revoke_at(&self, actor: &ActorRef, through: u64, now: Instant) {
        // Any answer the revocation covers granted at most the lease the plane grants
        // now (while no watch is open, no answer grants one).
        let lease = self.watching().map_or(Duration::ZERO, |(_, lease)| lease);
        let mut book = self.book();
        let floor = book.revoked.entry(actor.clone()).or_insert(Floor {
            through,
            forget_at: now,
        });
        floor.through = floor.through.max(through);
        floor.forget_at = floor.forget_at.max(now + lease);
        if book.entries.get(actor).is_some_and(|e| e.id <= through) {
            book.entries.remove(actor);
            self.metrics.leases(-1);
        }
    }

    /// [`Self::revoke`], for tests of the race with a crossing answer.
    #[cfg(any(test, feature = "testing"))]
    pub fn revoke_for_test(&self, actor: &ActorRef, through: u64) {
        self.revoke(actor, through);
    }

    /// When the lease this router holds on `actor` ends, if it holds one.
    pub fn lease_end(&self, actor: &ActorRef) -> Option<Instant> {
        self.book().entries.get(actor).map(|e| e.until)
    }

    /// `actor`'s worker at `addr` answered that it does not host it: drop the lease.
    pub fn forget(&self, actor: &ActorRef, addr: SocketAddr) {
        let mut book = self.book();
        if book.entries.get(actor).is_some_and(|e| e.addr == addr) {
            book.entries.remove(actor);
            self.metrics.leases(-1);
        }
    }

    /// Drops every lease (the router stops; the control plane is told by ReleaseAll).
    fn clear(&self) {
        let mut book = self.book();
        let n = book.entries.len() as i64;
        book.entries.clear();
        self.metrics.leases(-n);
    }

    /// Leases in the cache, valid or not.
    pub fn len(&self) -> usize {
        self.book().entries.len()
    }

    /// Whether the cache holds no lease.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Leases used since their grant that end within `margin`: each is marked as
    /// renewing (one renewal per actor at a time). Expired leases past the stale window
    /// are dropped.
    fn due(&self, margin: Duration) -> Vec<ActorRef> {
        self.due_at(margin, Instant::now())
    }

    /// [`Self::due`] at `now`.
    fn due_at(&self, margin: Duration, now: Instant) -> Vec<ActorRef> {
        let mut book = self.book();
        let before = book.entries.len();
        let stale_max = self.stale_max;
        book.entries.retain(|_, e| now < e.until + stale_max);
        book.revoked.retain(|_, r| now < r.forget_at);
        self.metrics
            .leases(book.entries.len() as i64 - before as i64);
        book.entries
            .iter_mut()
            .filter(|(_, e)| e.used && !e.renewing && now < e.until && e.until - now <= margin)
            .map(|(a, e)| {
                e.renewing = true;
                a.clone()
            })
            .collect()
    }
}

/// How long before its end a lease in use is renewed, for a lease of `lease`.
fn renewal_margin(lease: Duration) -> Duration {
    (lease / 5).max(Duration::from_millis(200))
}

/// How often due renewals are looked for.
const RENEWAL_TICK: Duration = Duration::from_millis(100);
/// How long a stopping router waits for the control plane to take its release of
/// every lease.
const RELEASE_WAIT: Duration = Duration::from_secs(1);

/// The router's side of the lease protocol: its id, the watch, the renewals.
#[derive(Debug)]
pub struct LeaseClient {
    router_id: String,
    cache: Arc<RouteCache>,
    stop: CancellationToken,
    tasks: TaskTracker,
    up: AtomicBool,
}

impl LeaseClient {
    /// Starts watching leases over `channel` as a router with a fresh random id, and
    /// renewing the leases in use through `control_plane`.
    pub fn spawn(
        channel: Channel,
        cache: Arc<RouteCache>,
        control_plane: Arc<dyn ControlPlane>,
        attempt_timeout: Duration,
        default_port: u16,
    ) -> Arc<Self> {
        let client = Arc::new(Self {
            router_id: format!("router-{:016x}", rand::random::<u64>()),
            cache,
            stop: CancellationToken::new(),
            tasks: TaskTracker::new(),
            up: AtomicBool::new(false),
        });
        client.tasks.spawn(Arc::clone(&client).watch_loop(channel));
        client.tasks.spawn(Arc::clone(&client).renew_loop(
            control_plane,
            attempt_timeout,
            default_port,
        ));
        client
    }

    /// Renewals only, with no watch (tests set the cache's holder themselves).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn renewals_only(
        cache: Arc<RouteCache>,
        control_plane: Arc<dyn ControlPlane>,
        attempt_timeout: Duration,
        default_port: u16,
    ) -> Arc<Self> {
        let client = Arc::new(Self {
            router_id: "test-router".into(),
            cache,
            stop: CancellationToken::new(),
            tasks: TaskTracker::new(),
            up: AtomicBool::new(false),
        });
        client.tasks.spawn(Arc::clone(&client).renew_loop(
            control_plane,
            attempt_timeout,
            default_port,
        ));
        client
    }

    /// This router's id.
    pub fn router_id(&self) -> &str {
        &self.router_id
    }

    /// Whether the watch is open now.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Stops cleanly: the cache is emptied and no lease is asked for or taken any more,
    /// then the control plane is told every lease is released, and the tasks end.
    /// Emptied first: once the plane has the release it may move the actors.
    pub async fn shutdown(&self) {
        self.cache.stop_holding();
        self.cache.clear();
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        self.cache.clear();
    }

    async fn watch_loop(self: Arc<Self>, channel: Channel) {
        let mut backoff = Backoff::new(Duration::from_millis(100)).cap(Duration::from_secs(2));
        loop {
            let ended = self.watch_once(channel.clone()).await;
            // A watch that was open (welcomed) starts the back-off over.
            if self.up.swap(false, Ordering::Relaxed) {
                backoff.reset();
            }
            self.cache.set_holder(None);
            if matches!(ended, Watched::Lost(_)) {
                // The watch is a call too: the control plane did not answer it.
                self.cache.answered(false);
            }
            let wait = match ended {
                Watched::Stopped => return,
                Watched::Unsupported => {
                    // A plane that grants none revokes none: routes from leases an
                    // earlier plane granted (restarted with --route-lease 0, say) would
                    // be kept past a move no one tells this router of.
                    self.cache.clear();
                    tracing::info!(
                        "the control plane grants no route leases; one ResumeActor per request"
                    );
                    Duration::from_secs(30)
                }
                Watched::Lost(why) => {
                    tracing::debug!(error = %why, "lease watch lost; watching again");
                    backoff.next_delay()
                }
                // The control plane answered: it is reachable (no stale routing), the
                // watch just needs credentials again (a token that expired ends it).
                Watched::Refused(why) => {
                    self.cache.answered(true);
                    tracing::info!(error = %why, "lease watch refused; watching again with the token file's current token");
                    backoff.next_delay()
                }
                // Reachable too: no stale routing while it notices the earlier watch
                // gone (a reset that reached only this side, say).
                Watched::Answered(why) => {
                    self.cache.answered(true);
                    tracing::debug!(error = %why, "lease watch refused; watching again");
                    backoff.next_delay()
                }
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.stop.cancelled() => return,
            }
        }
    }

    async fn watch_once(&self, channel: Channel) -> Watched {
        let (tx, rx) = mpsc::channel(64);
        let hello = pb::RouterMessage {
            message: Some(pb::router_message::Message::Hello(pb::Hello {
                router_id: self.router_id.clone(),
            })),
        };
        if tx.send(hello).await.is_err() {
            return Watched::Lost("watch channel closed".into());
        }
        let mut client = pb::leases_client::LeasesClient::new(channel);
        let opened = tokio::select! {
            r = client.watch(ReceiverStream::new(rx)) => r,
            () = self.stop.cancelled() => return Watched::Stopped,
        };
        let mut inbound = match opened {
            Ok(r) => r.into_inner(),
            Err(s) => return Watched::from_status(&s),
        };
        loop {
            let msg = tokio::select! {
                m = inbound.message() => m,
                () = self.stop.cancelled() => {
                    let release = pb::RouterMessage {
                        message: Some(pb::router_message::Message::ReleaseAll(pb::ReleaseAll {})),
                    };
                    let _ = tx.send(release).await;
                    // Half-close, and wait (bounded) for the plane to end the watch: the
                    // release has then reached it, rather than being cut off with the
                    // stream as the process exits (the plane would wait the leases out).
                    drop(tx);
                    let _ = tokio::time::timeout(RELEASE_WAIT, async {
                        while let Ok(Some(_)) = inbound.message().await {}
                    })
                    .await;
                    return Watched::Stopped;
                }
            };
            match msg {
                Ok(Some(pb::PlaneMessage {
                    message: Some(pb::plane_message::Message::Welcome(w)),
                })) => {
                    let Some(lease) = crate::control::wire_lease(w.route_lease) else {
                        return Watched::Unsupported;
                    };
                    self.up.store(true, Ordering::Relaxed);
                    self.cache.set_holder(Some((self.router_id.clone(), lease)));
                    self.cache.answered(true);
                    tracing::info!(router = %self.router_id, ?lease, "watching route leases");
                }
                Ok(Some(pb::PlaneMessage {
                    message: Some(pb::plane_message::Message::Revoke(r)),
                })) => {
                    let Some(actor) = r.actor else { continue };
                    if let Ok(a) = format!("{}/{}", actor.atespace, actor.name).parse::<ActorRef>()
                    {
                        self.cache.revoke(&a, r.through);
                    }
                    let ack = pb::RouterMessage {
                        message: Some(pb::router_message::Message::Ack(pb::Ack {
                            actor: Some(actor),
                            through: r.through,
                        })),
                    };
                    if tx.send(ack).await.is_err() {
                        return Watched::Lost("watch channel closed".into());
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => return Watched::Lost("the control plane ended the watch".into()),
                Err(s) => return Watched::from_status(&s),
            }
        }
    }

    async fn renew_loop(
        self: Arc<Self>,
        control_plane: Arc<dyn ControlPlane>,
        timeout: Duration,
        default_port: u16,
    ) {
        let renewals = TaskTracker::new();
        let mut tick = tokio::time::interval(RENEWAL_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.stop.cancelled() => break,
            }
            let Some((holder, lease)) = self.cache.watching() else {
                continue;
            };
            for actor in self.cache.due(renewal_margin(lease)) {
                let (cache, cp, holder) = (
                    Arc::clone(&self.cache),
                    Arc::clone(&control_plane),
                    holder.clone(),
                );
                let request = ResumeRequest {
                    actor: actor.clone(),
                    wait_for_capacity: None,
                    timeout,
                    lease_holder: Some(holder),
                };
                let stop = self.stop.clone();
                renewals.spawn(async move {
                    let sent_at = Instant::now();
                    // A renewal is worth nothing once the router stops: its shutdown
                    // does not wait for the answer (up to the attempt timeout).
                    let answer = tokio::select! {
                        a = cp.resume_actor(request) => a,
                        () = stop.cancelled() => return,
                    };
                    cache.answered(
                        !matches!(&answer, Err(e) if e.code() == tonic::Code::Unavailable),
                    );
                    // Not renewed otherwise: the lease runs out (see `Entry::renewing`).
                    if let Ok(r) = answer
                        && let (Some(grant), Some(addr)) =
                            (r.grant, worker_addr(&r.actor, default_port))
                    {
                        cache.metrics.renewed();
                        cache.install(&actor, addr, grant, sent_at);
                    }
                });
            }
        }
        renewals.close();
        renewals.wait().await;
    }
}

/// How a watch ended.
enum Watched {
    Stopped,
    Unsupported,
    /// No answer from the control plane: a transport failure, or the stream cut.
    Lost(String),
    /// The control plane refused it: its credentials (a bearer token that expired).
    Refused(String),
    /// The control plane answered it with another refusal: it holds this router's
    /// earlier watch, whose end it has not noticed yet (`AlreadyExists`).
    Answered(String),
}

impl Watched {
    /// How a watch that ended with `status` ended.
    fn from_status(status: &tonic::Status) -> Self {
        match status.code() {
            tonic::Code::Unimplemented => Self::Unsupported,
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                Self::Refused(status.message().to_owned())
            }
            tonic::Code::AlreadyExists => Self::Answered(status.message().to_owned()),
            _ => Self::Lost(status.message().to_owned()),
        }
    }
}

/// The worker address of an actor as answered, if it is routable.
fn worker_addr(actor: &valet_proto::ateapi::Actor, default_port: u16) -> Option<SocketAddr> {
    match crate::retry::classify(Ok(actor.clone()), true, default_port) {
        crate::retry::Class::Route(addr) => Some(addr),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Duration = Duration::from_secs(5);

    fn cache() -> RouteCache {
        let cache = RouteCache::new(Duration::from_secs(30), Arc::new(Metrics::new()));
        cache.set_holder(Some(("r1".into(), L)));
        cache
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn grant(id: u64) -> Grant {
        Grant { lease: L, id }
    }

    /// A renewal answered before a revocation but installed after the answer of a
    /// request sent after it (the actor moved meanwhile) does not replace the newer
    /// lease: the route stays on the actor's new worker.
    #[test]
    fn an_older_grant_never_replaces_a_newer_one() {
        let cache = cache();
        let a: ActorRef = "demo/p1".parse().unwrap();
        let now = Instant::now();
        cache.revoke_at(&a, 9, now);
        cache.install_at(&a, addr(2), grant(12), now, now);
        cache.install_at(&a, addr(1), grant(9), now, now);
        assert_eq!(cache.route_at(&a, false, now), Some(Cached::Valid(addr(2))));
        // Neither does one the revocation did not cover but that was granted earlier.
        cache.install_at(&a, addr(1), grant(10), now, now);
        assert_eq!(cache.route_at(&a, false, now), Some(Cached::Valid(addr(2))));
    }

    /// Once the router stops holding leases, a watch welcomed late (its Welcome read
    /// just after the stop) sets no holder again, and no answer installs a lease.
    #[test]
    fn a_stopped_cache_takes_no_holder_and_no_lease() {
        let cache = cache();
        let a: ActorRef = "demo/p1".parse().unwrap();
        let now = Instant::now();
        cache.stop_holding();
        cache.set_holder(Some(("r1".into(), L)));
        assert_eq!(cache.holder(), None);
        cache.install_at(&a, addr(1), grant(1), now, now);
        assert_eq!(cache.len(), 0);
    }

    /// A revocation is remembered while an answer it covers could still grant a lease
    /// that has not ended, and forgotten after (renewals prune it).
    #[test]
    fn a_revocation_outlives_the_leases_it_covers_and_no_more() {
        let cache = cache();
        let a: ActorRef = "demo/p1".parse().unwrap();
        let b: ActorRef = "demo/p2".parse().unwrap();
        let t0 = Instant::now();
        cache.revoke_at(&a, 9, t0);
        // Another actor's lease, installed meanwhile, does not lift the revocation.
        cache.install_at(&b, addr(3), grant(11), t0, t0);
        let sent = t0 - Duration::from_secs(1);
        cache.install_at(&a, addr(1), grant(9), sent, t0 + Duration::from_secs(1));
        assert_eq!(cache.route_at(&a, false, t0 + Duration::from_secs(1)), None);
        // An answer arriving after its lease ended installs nothing.
        cache.install_at(&a, addr(1), grant(20), sent, sent + L);
        assert_eq!(cache.route_at(&a, false, sent + L), None);
        assert_eq!(cache.book().revoked.len(), 1);
        drop(cache.due_at(Duration::ZERO, t0 + L));
        assert!(cache.book().revoked.is_empty(), "forgotten after a lease");
    }

    /// An expired lease past the stale window leaves the cache when it is looked up,
    /// also while no renewal prunes the cache.
    #[test]
    fn a_lease_past_its_stale_window_leaves_the_cache() {
        let cache = cache();
        let a: ActorRef = "demo/p1".parse().unwrap();
        let t0 = Instant::now();
        cache.install_at(&a, addr(1), grant(1), t0, t0);
        assert_eq!(cache.len(), 1);
        assert_eq!(
            cache.route_at(&a, true, t0 + L + Duration::from_secs(30)),
            None
        );
        assert!(cache.is_empty());
    }
}
