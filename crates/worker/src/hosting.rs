//! The hosting lease (`docs/leases.md`): the worker renews its hosting every second
//! over its attach stream, and fences its actor (421 to every request, memory kept)
//! when no renewal has been answered for the lease, counted from when it sent the last
//! answered one. Only a new attachment in which the control plane keeps the actor
//! lowers that fence.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::app::{Hosted, Slot};
use crate::traffic::Traffic;

/// How often the worker renews its hosting.
pub(crate) const RENEW_EVERY: Duration = Duration::from_secs(1);
/// The shortest hosting lease that works with renewals every [`RENEW_EVERY`]: the
/// control plane routes to an actor only while its worker renewed within half the
/// lease, so half of it must cover two renewals (one may be late).
pub const MIN_HOSTING_LEASE: Duration = Duration::from_secs(4);
/// The hosting lease assumed until a control plane names one.
pub(crate) const DEFAULT_HOSTING_LEASE: Duration = Duration::from_secs(15);
/// The longest lease taken from a control plane (its flags allow a year): past
/// it, a deadline would overflow the clock.
const MAX_HOSTING_LEASE: Duration = Duration::from_secs(365 * 24 * 3600);

#[derive(Debug, Clone, Copy)]
struct Lease {
    /// The lease the control plane gave.
    lease: Duration,
    /// When the last answered renewal (or the attachment) was sent.
    answered: Instant,
    /// The lease ran out: the actor is fenced until the next attachment keeps it.
    cut_off: bool,
}

/// The worker's hosting lease.
#[derive(Debug)]
pub(crate) struct HostingLease {
    state: watch::Sender<Lease>,
}

impl HostingLease {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: watch::Sender::new(Lease {
                lease: DEFAULT_HOSTING_LEASE,
                answered: Instant::now(),
                cut_off: false,
            }),
        })
    }

    /// A control plane welcomed the attachment sent at `sent_at`, with `lease`, and
    /// kept the actor whose traffic is `kept`: its fence is lowered with the lease,
    /// in one step (unless the lease, counted from `sent_at`, has already run out).
    pub(crate) fn welcomed(&self, lease: Duration, sent_at: Instant, kept: Option<&Traffic>) {
        self.state.send_modify(|s| {
            s.lease = lease.min(MAX_HOSTING_LEASE);
            s.answered = s.answered.max(sent_at);
            s.cut_off = s.answered + s.lease <= Instant::now();
            if let Some(traffic) = kept
                && !s.cut_off
            {
                traffic.set_cut_off(false);
            }
        });
    }

    /// The renewal sent at `sent_at` was answered.
    pub(crate) fn answered(&self, sent_at: Instant) {
        self.state
            .send_modify(|s| s.answered = s.answered.max(sent_at));
    }

    /// Installs `next` in `slot` (a restore's actor), fenced at once when the lease is
    /// out: the control plane may have placed it elsewhere meanwhile. Decided under
    /// the lease's lock, so no request gets in between (the watchdog mirrors the lease
    /// onto it too, a moment later).
    pub(crate) fn install(&self, slot: &Slot, next: Arc<Hosted>) {
        self.state.send_if_modified(|s| {
            if s.cut_off {
                next.traffic.set_cut_off(true);
            }
            slot.send_replace(Some(next));
            false
        });
    }

    /// Whether the lease has run out (the attachment must be made anew).
    pub(crate) fn is_cut_off(&self) -> bool {
        self.state.borrow().cut_off
    }

    /// Resolves when the lease runs out.
    pub(crate) async fn cut_off(&self) {
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(|s| s.cut_off).await;
    }

    /// Fences the hosted actor whenever the lease runs out (and any actor installed
    /// while it is out), and ends the traffic of an actor that leaves the slot, until
    /// `stop`. The one place that decides when an actor's traffic stops.
    pub(crate) async fn watchdog(
        self: Arc<Self>,
        slot: Slot,
        worker: String,
        stop: CancellationToken,
    ) {
        let mut rx = self.state.subscribe();
        let mut hosted = slot.subscribe();
        let mut current = hosted.borrow_and_update().clone();
        loop {
            // A slot change first: the lease's state is never mirrored onto an actor
            // that already left.
            if hosted.has_changed().unwrap_or(false) {
                let next = hosted.borrow_and_update().clone();
                self.slot_changed(&worker, &mut current, next);
            }
            // The actor's fence follows the lease: raised when it runs out, lowered
            // when the control plane keeps the actor (a welcome).
            let s = *rx.borrow_and_update();
            if let Some(h) = &current {
                h.traffic.set_cut_off(s.cut_off);
            }
            let deadline = (!s.cut_off).then(|| s.answered + s.lease);
            let runs_out = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = runs_out => {
                    // Decided on the state itself: an answer that came meanwhile wins.
                    let ran_out = self.state.send_if_modified(|s| {
                        let out = !s.cut_off && s.answered + s.lease <= Instant::now();
                        s.cut_off |= out;
                        out
                    });
                    if ran_out && let Some(h) = &current {
                        tracing::warn!(%worker, actor = %h.actor, lease = ?s.lease, "no hosting renewal answered in time; the actor is fenced until the control plane keeps it here");
                    }
                }
                r = rx.changed() => if r.is_err() { return },
                r = hosted.changed() => {
                    if r.is_err() {
                        return;
                    }
                    let next = hosted.borrow_and_update().clone();
                    self.slot_changed(&worker, &mut current, next);
                }
                () = stop.cancelled() => return,
            }
        }
    }

    /// The slot changed to `next`: the actor that left has its streams and
    /// connections ended now; one installed while the lease is out (a restore that
    /// ran on after its stream ended) is fenced too (by the caller's mirror): the
    /// control plane may have placed it elsewhere meanwhile.
    fn slot_changed(
        &self,
        worker: &str,
        current: &mut Option<Arc<crate::app::Hosted>>,
        next: Option<Arc<crate::app::Hosted>>,
    ) {
        if let Some(old) = current.as_ref()
            && next.as_ref().is_none_or(|n| !Arc::ptr_eq(n, old))
        {
            old.left();
        }
        if let Some(h) = &next
            && self.is_cut_off()
        {
            tracing::warn!(%worker, actor = %h.actor, "actor restored while the hosting lease is out; fenced until the control plane keeps it here");
        }
        *current = next;
    }
}

/// Empties `slot` if it holds `actor` (whatever it holds, when `None`); whether it
/// did. The actor's traffic ends in the same step (nothing more gets in, what is in
/// flight ends): the watchdog would end it too, a moment later.
pub(crate) fn vacate(slot: &Slot, actor: Option<&str>) -> bool {
    vacate_if(slot, |h| actor.is_none_or(|a| h.actor == a))
}

/// Empties `slot` if what it holds matches `ours`; whether it did. The actor leaves
/// in the same step ([`Hosted::left`]).
pub(crate) fn vacate_if(slot: &Slot, ours: impl FnOnce(&Hosted) -> bool) -> bool {
    slot.send_if_modified(|h| {
        let ours = h.as_deref().is_some_and(ours);
        if ours && let Some(old) = h.take() {
            old.left();
        }
        ours
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::{Counter, Hosted, Served};

    fn hosted(actor: &str) -> Arc<Hosted> {
        Arc::new(Hosted::new(
            actor.into(),
            Served::Counter(Counter::new(
                0,
                std::path::PathBuf::from("/nonexistent/counter"),
            )),
            actor.into(),
        ))
    }

    /// Returns once `lease` has run out (no renewal answered; paused clock).
    async fn ran_out(lease: &HostingLease) {
        let mut state = lease.state.subscribe();
        tokio::time::timeout(DEFAULT_HOSTING_LEASE * 2, state.wait_for(|s| s.cut_off))
            .await
            .expect("the lease runs out")
            .expect("lease alive");
    }

    /// A hosting lease and its watchdog over a slot holding `actor`.
    fn watched(
        actor: Option<Arc<Hosted>>,
    ) -> (
        Arc<HostingLease>,
        Slot,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let lease = HostingLease::new();
        let slot: Slot = Arc::new(watch::Sender::new(actor));
        let stop = CancellationToken::new();
        let dog =
            tokio::spawn(Arc::clone(&lease).watchdog(Arc::clone(&slot), "w1".into(), stop.clone()));
        (lease, slot, stop, dog)
    }

    /// A lease past what the clock can hold (a control plane's bad Welcome) is
    /// taken as the longest one: before, its deadline overflowed and the worker's
    /// attach loop panicked.
    #[tokio::test(start_paused = true)]
    async fn a_lease_too_long_for_the_clock_is_bounded() {
        let (lease, _slot, stop, dog) = watched(None);
        lease.welcomed(Duration::MAX, Instant::now(), None);
        assert!(!lease.is_cut_off());
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(!lease.is_cut_off());
        lease.answered(Instant::now());
        stop.cancel();
        dog.await.expect("the watchdog did not panic");
    }

    #[tokio::test(start_paused = true)]
    async fn an_actor_installed_after_the_lease_ran_out_is_fenced() {
        let (lease, slot, stop, dog) = watched(None);
        ran_out(&lease).await;
        // A restore that ran on after the stream ended installs its actor now.
        let late = hosted("demo/p1");
        slot.send_replace(Some(Arc::clone(&late)));
        let mut gauge = late.traffic.watch();
        tokio::time::timeout(Duration::from_secs(1), gauge.wait_for(|g| g.cut_off))
            .await
            .expect("the late actor is fenced")
            .expect("traffic alive");
        assert!(
            late.traffic.enter().is_none(),
            "a fenced actor takes no request"
        );

        // A welcome that keeps it lowers the lease's fence; a later actor is not fenced.
        lease.welcomed(DEFAULT_HOSTING_LEASE, Instant::now(), None);
        let next = hosted("demo/p2");
        slot.send_replace(Some(Arc::clone(&next)));
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert!(next.traffic.enter().is_some());
        stop.cancel();
        dog.await.expect("watchdog ends");
    }

    /// An actor a restore installs while the lease is out is fenced in the same step,
    /// and one that leaves the slot takes nothing more in the same step: no request
    /// gets in before the watchdog runs. Before, both waited for the watchdog, and a
    /// request arriving in between was served.
    #[tokio::test(start_paused = true)]
    async fn installing_and_vacating_fence_at_once() {
        let (lease, slot, stop, dog) = watched(None);
        ran_out(&lease).await;
        let late = hosted("demo/p1");
        lease.install(&slot, Arc::clone(&late));
        assert!(late.traffic.enter().is_none(), "fenced as it is installed");

        lease.welcomed(DEFAULT_HOSTING_LEASE, Instant::now(), Some(&late.traffic));
        let entered = late.traffic.enter();
        assert!(entered.is_some(), "kept: served again");
        drop(entered);
        assert!(!vacate(&slot, Some("demo/other")), "another actor's evict");
        assert!(vacate(&slot, Some("demo/p1")));
        assert!(late.traffic.enter().is_none(), "gone as it leaves the slot");
        assert!(slot.borrow().is_none());
        stop.cancel();
        dog.await.expect("watchdog ends");
    }

    /// A welcome that lands as the lease runs out leaves the actor served: the fence
    /// follows the lease's state, decided in one place.
    #[tokio::test(start_paused = true)]
    async fn a_welcome_after_the_lease_ran_out_lowers_the_actors_fence() {
        let actor = hosted("demo/p1");
        let (lease, _slot, stop, dog) = watched(Some(Arc::clone(&actor)));
        ran_out(&lease).await;
        let mut gauge = actor.traffic.watch();
        tokio::time::timeout(Duration::from_secs(1), gauge.wait_for(|g| g.cut_off))
            .await
            .unwrap()
            .unwrap();
        lease.welcomed(DEFAULT_HOSTING_LEASE, Instant::now(), None);
        tokio::time::timeout(Duration::from_secs(1), gauge.wait_for(|g| !g.cut_off))
            .await
            .expect("the fence is lowered with the lease")
            .unwrap();
        assert!(actor.traffic.enter().is_some());
        stop.cancel();
        dog.await.unwrap();
    }

    /// A welcome lowers the kept actor's fence in the same step as the lease's, and
    /// never for a lease already run out (counted from the attachment it answers).
    #[tokio::test(start_paused = true)]
    async fn a_welcome_lowers_the_fence_only_with_a_live_lease() {
        let actor = hosted("demo/p1");
        let (lease, _slot, stop, dog) = watched(Some(Arc::clone(&actor)));
        let mut gauge = actor.traffic.watch();
        tokio::time::timeout(DEFAULT_HOSTING_LEASE * 2, gauge.wait_for(|g| g.cut_off))
            .await
            .unwrap()
            .unwrap();
        let stale = Instant::now() - DEFAULT_HOSTING_LEASE;
        lease.welcomed(DEFAULT_HOSTING_LEASE, stale, Some(&actor.traffic));
        assert!(lease.is_cut_off());
        assert!(actor.traffic.enter().is_none(), "still fenced");
        lease.welcomed(DEFAULT_HOSTING_LEASE, Instant::now(), Some(&actor.traffic));
        assert!(!lease.is_cut_off());
        assert!(actor.traffic.enter().is_some(), "lowered at once");
        stop.cancel();
        dog.await.unwrap();
    }

    /// What is in flight for an actor (a stream, an upgraded connection) ends when the
    /// actor leaves the slot, and when the lease runs out: the control plane may place
    /// it elsewhere from then on.
    #[tokio::test(start_paused = true)]
    async fn traffic_in_flight_stops_when_the_actor_leaves_or_the_lease_runs_out() {
        let first = hosted("demo/p1");
        let (_lease, slot, stop, dog) = watched(Some(Arc::clone(&first)));
        tokio::task::yield_now().await;
        let streaming = first.traffic.enter().expect("admitted");
        assert!(!streaming.is_stopped());
        // Evicted: the slot empties.
        slot.send_replace(None);
        tokio::time::timeout(Duration::from_secs(1), streaming.stopped())
            .await
            .expect("the evicted actor's stream stops");
        assert!(first.traffic.enter().is_none());

        let second = hosted("demo/p2");
        slot.send_replace(Some(Arc::clone(&second)));
        tokio::task::yield_now().await;
        let streaming = second.traffic.enter().expect("admitted");
        tokio::time::timeout(DEFAULT_HOSTING_LEASE * 2, streaming.stopped())
            .await
            .expect("the stream stops when the lease runs out");
        stop.cancel();
        dog.await.expect("watchdog ends");
    }
}
