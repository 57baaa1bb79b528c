//! The decision pipeline: host → actor → flight → (lot) → route or verdict.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::addr::{ActorRef, parse_host};
use crate::config::RouterConfig;
use crate::control::ControlPlane;
use crate::flight::{FlightState, FlightWatch, Registry};
use crate::lease::{Cached, LeaseClient, RouteCache};
use crate::lot::{ParkingLot, Slot};
use crate::metrics::{Metrics, ParkOutcome};
use crate::retry;
use crate::status::{RecentRequests, RouteRecord};
use crate::verdict::{CallerEnd, Denial, Verdict};

/// Where to send a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The actor the request is for.
    pub actor: ActorRef,
    /// Its worker's address.
    pub addr: SocketAddr,
    /// Whether the request parked on its way here (it waited on a flight that
    /// parked): sent through the pipeline again after a 421, it is never shed
    /// ([`Router::decide_replay`]).
    pub parked: bool,
    /// Whether it came from the route cache (a lease) rather than from a control-plane
    /// answer to this request: a worker that cannot be reached there may be one the
    /// actor has left, so the data plane asks again rather than answering 502.
    pub cached: bool,
}

/// The router's decision for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Forward to the actor's worker.
    Route(Route),
    /// Answer with this verdict.
    Deny(Denial, Verdict),
}

impl Decision {
    /// The HTTP status this decision answers with (200 for a route: the actor's own
    /// status is not the router's).
    pub fn status(&self) -> http::StatusCode {
        match self {
            Decision::Route(_) => http::StatusCode::OK,
            Decision::Deny(_, v) => v.status(),
        }
    }
}

/// The request-parking router: cheap to clone, shared by every data plane.
#[derive(Debug, Clone)]
pub struct Router {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: Arc<RouterConfig>,
    control_plane: Arc<dyn ControlPlane>,
    flights: Arc<Registry>,
    lot: ParkingLot,
    metrics: Arc<Metrics>,
    tasks: TaskTracker,
    cutoff: CancellationToken,
    /// The router stops: flights start no new attempt.
    wind_down: CancellationToken,
    /// The drain is over: flights abandon the attempts they still wait for.
    abandon: CancellationToken,
    cache: Arc<RouteCache>,
    leases: std::sync::Mutex<Option<Arc<LeaseClient>>>,
    recent: RecentRequests,
}

impl std::fmt::Debug for dyn ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlPlane")
    }
}

impl Router {
    /// A router over `control_plane` with `config`, counting into `metrics`.
    pub fn new(
        config: Arc<RouterConfig>,
        control_plane: Arc<dyn ControlPlane>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                lot: ParkingLot::new(
                    config.parking().max_parked(),
                    config.parked_bytes_max(),
                    Arc::clone(&metrics),
                ),
                flights: Registry::new(Arc::clone(&metrics)),
                cache: Arc::new(RouteCache::new(
                    config.route_stale_max(),
                    Arc::clone(&metrics),
                )),
                config,
                control_plane,
                metrics,
                tasks: TaskTracker::new(),
                cutoff: CancellationToken::new(),
                wind_down: CancellationToken::new(),
                abandon: CancellationToken::new(),
                leases: std::sync::Mutex::new(None),
                recent: RecentRequests::default(),
            }),
        }
    }

    /// The resolved configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.inner.config
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The parking lot (for status pages).
    pub fn lot(&self) -> &ParkingLot {
        &self.inner.lot
    }

    /// Keeps a decided request for the status page.
    pub fn record(&self, record: RouteRecord) {
        self.inner.recent.push(record);
    }

    /// The last routed requests, newest first.
    pub fn recent_requests(&self) -> Vec<RouteRecord> {
        self.inner.recent.newest_first()
    }

    /// Resume flights in progress.
    pub fn flights_in_progress(&self) -> usize {
        self.inner.flights.len()
    }

    /// Decides a request for `host`, waiting at most until `deadline` (the request's own
    /// deadline). A request to an actor with a valid route lease is routed at once, with
    /// no control-plane call. Dropping the future means the caller went away: its
    /// parking slot is freed at once and `canceled` recorded; the flight goes on for
    /// the others. Never routes under an expired lease (for the Envoy data plane, which
    /// cannot replay a 421).
    pub async fn decide(&self, host: &str, deadline: Instant) -> Decision {
        self.decide_inner(host, deadline, std::future::pending(), false, false, true)
            .await
    }

    /// [`Self::decide`] for the built-in data plane: it has work to do while the request
    /// is parked (reading its body, so a client that leaves is noticed), and it replays
    /// a request its worker answers 421 for, so it may route under an expired lease
    /// while the control plane is unreachable (`--route-stale-max`). `while_parked` is
    /// polled only from the request's park transition until its decision, and dropped
    /// then; when it resolves, the request's own side has ended its wait (the client
    /// left, or sent a malformed body).
    pub async fn decide_holding<F>(
        &self,
        host: &str,
        deadline: Instant,
        while_parked: F,
    ) -> Decision
    where
        F: Future<Output = CallerEnd>,
    {
        self.decide_inner(host, deadline, while_parked, true, false, true)
            .await
    }

    /// [`Self::decide_holding`] for a request sent through the pipeline again (its
    /// worker answered 421, or its leased worker refused the connection). It was
    /// counted when it was first decided (routed), so this decision is not counted
    /// again: the data plane counts a denial as answered after the route. Should a
    /// request that parked once already (`parked_before`) park again, it is never shed
    /// for a full lot, and its wait is not sampled twice.
    pub async fn decide_replay<F>(
        &self,
        host: &str,
        deadline: Instant,
        while_parked: F,
        parked_before: bool,
    ) -> Decision
    where
        F: Future<Output = CallerEnd>,
    {
        self.decide_inner(host, deadline, while_parked, true, parked_before, false)
            .await
    }

    async fn decide_inner<F>(
        &self,
        host: &str,
        deadline: Instant,
        while_parked: F,
        stale_ok: bool,
        again: bool,
        counted: bool,
    ) -> Decision
    where
        F: Future<Output = CallerEnd>,
    {
        let mut record = Recording {
            metrics: &self.inner.metrics,
            started: Instant::now(),
            // A decision not counted is done with from the start.
            done: !counted,
        };
        let decision = match parse_host(host, self.inner.config.actor_domain()) {
            Err(e) => deny(Denial::InvalidHost(e)),
            Ok(actor) => match self.inner.cache.route_at(&actor, stale_ok, record.started) {
                Some(cached) => {
                    let (addr, stale) = match cached {
                        Cached::Valid(a) => (a, false),
                        Cached::Stale(a) => (a, true),
                    };
                    self.inner.metrics.routed_from_cache(stale);
                    Decision::Route(Route {
                        actor,
                        addr,
                        parked: false,
                        cached: true,
                    })
                }
                None => match self.resolve(&actor, deadline, while_parked, again).await {
                    Ok((addr, parked)) => Decision::Route(Route {
                        actor,
                        addr,
                        parked,
                        cached: false,
                    }),
                    Err(denial) => deny(denial),
                },
            },
        };
        if counted {
            record.finish(&decision);
        }
        decision
    }

    /// The route cache (leases this router holds).
    pub fn route_cache(&self) -> &Arc<RouteCache> {
        &self.inner.cache
    }

    /// `actor`'s worker at `addr` answered 421: the lease that sent the request there,
    /// if any, is dropped.
    pub fn forget_route(&self, actor: &ActorRef, addr: SocketAddr) {
        self.inner.cache.forget(actor, addr);
    }

    /// Starts the lease protocol over `channel` (the control plane's): the watch, and
    /// renewals of leases in use. Without it the router asks for no lease and calls
    /// `ResumeActor` for every request.
    pub fn start_leases(&self, channel: valet_proto::auth::CpChannel) -> Arc<LeaseClient> {
        let client = LeaseClient::spawn(
            channel,
            Arc::clone(&self.inner.cache),
            Arc::clone(&self.inner.control_plane),
            self.inner.config.parking().resume_attempt_timeout(),
            self.inner.config.worker_port(),
        );
        *self.inner.leases.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&client));
        client
    }

    /// Starts the renewal of leases in use without a watch: tests set the route cache's
    /// holder themselves.
    #[cfg(any(test, feature = "testing"))]
    pub fn start_renewals_only(&self) -> Arc<LeaseClient> {
        let client = LeaseClient::renewals_only(
            Arc::clone(&self.inner.cache),
            Arc::clone(&self.inner.control_plane),
            self.inner.config.parking().resume_attempt_timeout(),
            self.inner.config.worker_port(),
        );
        *self.inner.leases.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&client));
        client
    }

    /// Ends the lease protocol cleanly: every lease is released to the control plane.
    pub async fn stop_leases(&self) {
        let client = self
            .inner
            .leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(client) = client {
            client.shutdown().await;
        }
    }

    /// Makes every request still waiting answer `router shutting down` (the drain
    /// timeout has passed). Flights themselves run on to their own result.
    pub fn cut_off_waiting(&self) {
        self.inner.cutoff.cancel();
    }

    /// Waits for every flight task to end; call after the data planes stop accepting.
    pub async fn flights_finished(&self) {
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// Ends every flight still running and waits for them: the last step of a drain,
    /// once no request waits any more. No flight starts another attempt, but an attempt
    /// already sent is waited for until `until` (the end of the drain): the control
    /// plane may have committed a restore to it, which a cancelled call can strand
    /// (`parking.md`: an attempt in flight is never cancelled). Past `until`, those
    /// still in flight are abandoned.
    pub async fn stop_flights(&self, until: Instant) {
        self.inner.wind_down.cancel();
        self.inner.tasks.close();
        if tokio::time::timeout_at(until, self.inner.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                "resume attempts still in flight at the end of the drain: abandoning them"
            );
            self.inner.abandon.cancel();
            self.inner.tasks.wait().await;
        }
    }

    async fn resolve<F>(
        &self,
        actor: &ActorRef,
        deadline: Instant,
        while_parked: F,
        again: bool,
    ) -> Result<(SocketAddr, bool), Denial>
    where
        F: Future<Output = CallerEnd>,
    {
        let budget = self.inner.config.parking().flight_budget();
        let (watch, flight) = self.inner.flights.join(actor, budget);
        if let Some(flight) = flight {
            self.spawn_flight(flight);
        }
        let mut wait = Wait {
            actor,
            watch,
            slot: None,
            again,
        };
        tokio::select! {
            biased;
            result = wait.until_done(&self.inner.lot, while_parked) => result,
            () = tokio::time::sleep_until(deadline) => Err(wait.end(Denial::CallerDeadline(actor.clone()))),
            () = self.inner.cutoff.cancelled() => Err(wait.end(Denial::ShuttingDown(actor.clone()))),
        }
    }

    fn spawn_flight(&self, flight: crate::flight::Flight) {
        let inner = &self.inner;
        inner.tasks.spawn(retry::run(
            flight,
            Arc::clone(&inner.control_plane),
            inner.config.parking().clone(),
            inner.config.worker_port(),
            Arc::clone(&inner.metrics),
            Arc::clone(&inner.cache),
            inner.wind_down.clone(),
            inner.abandon.clone(),
        ));
    }
}

fn deny(denial: Denial) -> Decision {
    let verdict = Verdict::of(&denial);
    Decision::Deny(denial, verdict)
}

/// One caller's wait on its flight, holding a slot once the flight parks.
struct Wait<'a> {
    actor: &'a ActorRef,
    watch: FlightWatch,
    slot: Option<Slot>,
    /// It parked once already (see [`Router::decide_replay`]).
    again: bool,
}

impl Wait<'_> {
    /// The flight's route, and whether this caller parked on its way (see
    /// [`Route::parked`]); or its denial.
    async fn until_done<F>(
        &mut self,
        lot: &ParkingLot,
        while_parked: F,
    ) -> Result<(SocketAddr, bool), Denial>
    where
        F: Future<Output = CallerEnd>,
    {
        tokio::pin!(while_parked);
        loop {
            let state = self.watch.borrow_and_update().clone();
            match state {
                FlightState::Resolving => {}
                FlightState::Parked => self.park(lot)?,
                FlightState::Done { result, parked } => {
                    if parked {
                        if result.is_ok() && self.slot.is_none() && !self.again {
                            // Served either way: counted as parked if the lot has room
                            // for the instant, never shed for a route already known.
                            self.slot = lot.take();
                        } else {
                            self.park(lot)?;
                        }
                    }
                    let parked = parked || self.slot.is_some();
                    return match result {
                        Ok(addr) => {
                            if let Some(slot) = self.slot.take() {
                                slot.finish(ParkOutcome::Served);
                            }
                            Ok((addr, parked))
                        }
                        Err(e) => Err(self.end(Denial::Flight(self.actor.clone(), e))),
                    };
                }
            }
            let parked = self.slot.is_some();
            tokio::select! {
                changed = self.watch.changed() => {
                    if changed.is_err() {
                        // The flight always publishes before its sender goes; this is a
                        // flight whose task was dropped mid-publish.
                        let lost = crate::flight::FlightError::Lost;
                        return Err(self.end(Denial::Flight(self.actor.clone(), lost)));
                    }
                }
                end = &mut while_parked, if parked => {
                    let denial = match end {
                        CallerEnd::Gone => Denial::CallerGone(self.actor.clone()),
                        CallerEnd::MalformedBody(why) => Denial::MalformedBody(self.actor.clone(), why),
                        CallerEnd::Stalled => Denial::CallerDeadline(self.actor.clone()),
                    };
                    return Err(self.end(denial));
                }
            }
        }
    }

    /// The park transition of this caller: take a slot once, or be shed (never a
    /// caller that parked once already).
    fn park(&mut self, lot: &ParkingLot) -> Result<(), Denial> {
        if self.slot.is_none() {
            if self.again {
                self.slot = Some(lot.park_again());
                return Ok(());
            }
            match lot.try_park() {
                Some(slot) => self.slot = Some(slot),
                None => return Err(Denial::LotFull(self.actor.clone())),
            }
        }
        Ok(())
    }

    /// Ends the wait with `denial`, recording the parked outcome if a slot was held.
    fn end(&mut self, denial: Denial) -> Denial {
        if let Some(slot) = self.slot.take() {
            slot.finish(denial.park_outcome());
        }
        denial
    }
}

/// Counts a decision once: as decided, or as `canceled` (408) when the caller's future
/// is dropped first.
struct Recording<'a> {
    metrics: &'a Metrics,
    started: Instant,
    done: bool,
}

impl Recording<'_> {
    fn finish(&mut self, decision: &Decision) {
        self.done = true;
        let verdict = match decision {
            Decision::Route(_) => "routed",
            Decision::Deny(_, v) => v.reason(),
        };
        self.metrics
            .decided(decision.status().as_u16(), verdict, self.started.elapsed());
    }
}

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.metrics
                .decided(408, "canceled", self.started.elapsed());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flight::{FlightError, FlightState};

    /// A caller that first sees its flight already routed (the flight's `Parked` was
    /// overwritten before the caller looked) is served even when the lot is full, and
    /// counted as parked when it has room; one that sees it failed is shed as before.
    #[tokio::test]
    async fn a_routed_flight_is_never_shed() {
        let metrics = Arc::new(Metrics::new());
        let lot = ParkingLot::new(1, 0, Arc::clone(&metrics));
        let actor: ActorRef = "demo/p1".parse().unwrap();
        let addr: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let wait = |result| {
            let (_tx, watch) = tokio::sync::watch::channel(FlightState::Done {
                result,
                parked: true,
            });
            Wait {
                actor: &actor,
                watch,
                slot: None,
                again: false,
            }
        };
        let full = lot.try_park().unwrap();
        let routed = wait(Ok(addr))
            .until_done(&lot, std::future::pending())
            .await;
        // It parked (its flight did) though the lot had no room to count it: sent
        // again after a 421, it must not be shed.
        assert_eq!(routed, Ok((addr, true)));
        assert_eq!(lot.rejected_total(), 0);
        let failed = wait(Err(FlightError::Lost))
            .until_done(&lot, std::future::pending())
            .await;
        assert!(matches!(failed, Err(Denial::LotFull(_))), "{failed:?}");
        drop(full);

        let routed = wait(Ok(addr))
            .until_done(&lot, std::future::pending())
            .await;
        assert_eq!(routed, Ok((addr, true)));
        assert_eq!((lot.admitted_total(), lot.active()), (2, 0));
    }
}
