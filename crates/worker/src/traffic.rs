//! What the hosted actor is doing: requests in flight (an upgraded connection counts
//! for as long as it is open), an activity mark that changes whenever one starts or
//! ends, and the fence a checkpoint raises: from the fence on, no request gets in.

use std::sync::Arc;

use tokio::sync::watch;

/// The traffic of one hosted actor, at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Gauge {
    /// Requests in flight.
    pub(crate) in_flight: u32,
    /// Changes whenever a request starts or ends.
    pub(crate) mark: u64,
    /// A checkpoint has fenced the actor: new requests are turned away.
    pub(crate) fenced: bool,
    /// The hosting lease ran out (no renewal answered in time): new requests are
    /// turned away until the control plane keeps the actor here again.
    pub(crate) cut_off: bool,
    /// The actor left this worker (evicted, released, replaced): for good.
    pub(crate) gone: bool,
}

impl Gauge {
    /// Whether requests in flight must end now, streams and upgraded connections
    /// included: the control plane may place the actor elsewhere.
    pub(crate) fn stopped(&self) -> bool {
        self.cut_off || self.gone
    }
}

/// How a checkpoint fences the actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fence {
    /// Only if nothing is in flight and the mark is still this one.
    IdleSince(u64),
    /// Once the requests in flight have ended (an explicit suspend).
    WaitIdle,
}

/// The actor was not idle since the mark a policy's checkpoint named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy;

/// The traffic of one hosted actor.
#[derive(Debug, Default)]
pub(crate) struct Traffic {
    gauge: watch::Sender<Gauge>,
}

impl Traffic {
    /// Admits a request: `None` once the actor is fenced.
    pub(crate) fn enter(self: &Arc<Self>) -> Option<InFlight> {
        let mut admitted = false;
        self.gauge.send_if_modified(|g| {
            if g.fenced || g.stopped() {
                return false;
            }
            g.in_flight += 1;
            g.mark += 1;
            admitted = true;
            true
        });
        admitted.then(|| InFlight(Arc::clone(self)))
    }

    /// The traffic now.
    #[cfg(test)]
    pub(crate) fn gauge(&self) -> Gauge {
        *self.gauge.borrow()
    }

    /// Every change of the traffic.
    pub(crate) fn watch(&self) -> watch::Receiver<Gauge> {
        self.gauge.subscribe()
    }

    /// Raises the fence for a checkpoint. With [`Fence::IdleSince`], refuses with
    /// [`Busy`] unless the actor is idle since that mark; with [`Fence::WaitIdle`],
    /// waits (the caller bounds it) for the requests in flight to end.
    pub(crate) async fn fence(&self, how: Fence) -> Result<(), Busy> {
        let mut changes = self.gauge.subscribe();
        loop {
            let mut raised = false;
            let mut stopped = false;
            self.gauge.send_if_modified(|g| {
                // Cut off or gone: no checkpoint starts (it could land after the
                // control plane moved the actor).
                stopped = g.stopped();
                let idle = !stopped
                    && g.in_flight == 0
                    && match how {
                        Fence::IdleSince(mark) => g.mark == mark,
                        Fence::WaitIdle => true,
                    };
                if idle {
                    g.fenced = true;
                    raised = true;
                }
                idle
            });
            if raised {
                return Ok(());
            }
            if stopped || matches!(how, Fence::IdleSince(_)) {
                return Err(Busy);
            }
            if changes
                .wait_for(|g| g.in_flight == 0 || g.stopped())
                .await
                .is_err()
            {
                return Err(Busy);
            }
        }
    }

    /// The hosting lease ran out (`true`), or the control plane kept the actor here
    /// again (`false`).
    pub(crate) fn set_cut_off(&self, cut_off: bool) {
        self.gauge
            .send_if_modified(|g| std::mem::replace(&mut g.cut_off, cut_off) != cut_off);
    }

    /// The actor left this worker: nothing more gets in, and what is in flight ends.
    pub(crate) fn set_gone(&self) {
        self.gauge
            .send_if_modified(|g| !std::mem::replace(&mut g.gone, true));
    }

    /// Lowers the fence (the checkpoint did not happen after all).
    pub(crate) fn unfence(&self) {
        self.gauge
            .send_if_modified(|g| std::mem::replace(&mut g.fenced, false));
    }
}

/// A request in flight; it ends when dropped.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<Traffic>);

impl InFlight {
    /// Whether it must end now (see [`Gauge::stopped`]).
    pub(crate) fn is_stopped(&self) -> bool {
        self.0.gauge.borrow().stopped()
    }

    /// Every change of its actor's traffic.
    pub(crate) fn watch(&self) -> watch::Receiver<Gauge> {
        self.0.gauge.subscribe()
    }

    /// Resolves once it must end (see [`Gauge::stopped`]).
    pub(crate) async fn stopped(&self) {
        let mut changes = self.0.gauge.subscribe();
        let _ = changes.wait_for(Gauge::stopped).await;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.gauge.send_modify(|g| {
            g.in_flight -= 1;
            g.mark += 1;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint waiting for a stream to end is refused when the stream ends because
    /// the actor was cut off: a snapshot taken then could land after the control plane
    /// moved the actor.
    #[tokio::test(start_paused = true)]
    async fn no_checkpoint_of_an_actor_cut_off() {
        let t = Arc::new(Traffic::default());
        let stream = t.enter().unwrap();
        let fence = tokio::spawn({
            let t = Arc::clone(&t);
            async move { t.fence(Fence::WaitIdle).await }
        });
        tokio::task::yield_now().await;
        t.set_cut_off(true);
        drop(stream);
        assert_eq!(fence.await.unwrap(), Err(Busy));
        assert_eq!(t.fence(Fence::WaitIdle).await, Err(Busy), "nor a new one");
    }

    #[tokio::test(start_paused = true)]
    async fn fences_only_an_idle_actor_and_then_admits_nothing() {
        let t = Arc::new(Traffic::default());
        let first = t.enter().unwrap();
        let mark = t.gauge().mark;
        assert_eq!(
            t.fence(Fence::IdleSince(mark)).await,
            Err(Busy),
            "in flight"
        );
        drop(first);
        assert_eq!(
            t.fence(Fence::IdleSince(mark)).await,
            Err(Busy),
            "a request ended after the mark"
        );
        let idle = t.gauge().mark;
        assert_eq!(t.fence(Fence::IdleSince(idle)).await, Ok(()));
        assert!(t.enter().is_none(), "fenced: nothing gets in");
        t.unfence();
        assert!(t.enter().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn an_explicit_fence_waits_for_requests_in_flight() {
        let t = Arc::new(Traffic::default());
        let slow = t.enter().unwrap();
        let fence = {
            let t = Arc::clone(&t);
            tokio::spawn(async move { t.fence(Fence::WaitIdle).await })
        };
        tokio::task::yield_now().await;
        assert!(!fence.is_finished());
        assert!(
            t.enter().is_some_and(|late| {
                drop(late);
                true
            }),
            "not fenced while it waits"
        );
        drop(slow);
        assert_eq!(fence.await.unwrap(), Ok(()));
        assert!(t.enter().is_none());
    }
}
