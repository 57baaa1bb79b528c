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

use crate::app::Slot;

/// How often the worker renews its hosting.
pub(crate) const RENEW_EVERY: Duration = Duration::from_secs(1);
/// The shortest hosting lease that works with renewals every [`RENEW_EVERY`]: the
/// control plane routes to an actor only while its worker renewed within half the
/// lease, so half of it must cover two renewals (one may be late).
pub const MIN_HOSTING_LEASE: Duration = Duration::from_secs(4);
/// The hosting lease assumed until a control plane names one.
pub(crate) const DEFAULT_HOSTING_LEASE: Duration = Duration::from_secs(15);

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

    /// A control plane welcomed the attachment sent at `sent_at`, with `lease`.
    pub(crate) fn welcomed(&self, lease: Duration, sent_at: Instant) {
        self.state.send_modify(|s| {
            s.lease = lease;
            s.answered = s.answered.max(sent_at);
            s.cut_off = false;
        });
    }

    /// The renewal sent at `sent_at` was answered.
    pub(crate) fn answered(&self, sent_at: Instant) {
        self.state
            .send_modify(|s| s.answered = s.answered.max(sent_at));
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

    /// Fences the hosted actor whenever the lease runs out, until `stop`.
    pub(crate) async fn watchdog(
        self: Arc<Self>,
        slot: Slot,
        worker: String,
        stop: CancellationToken,
    ) {
        let mut rx = self.state.subscribe();
        loop {
            let s = *rx.borrow_and_update();
            if !s.cut_off {
                let deadline = s.answered + s.lease;
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => {
                        if rx.has_changed().unwrap_or(false) {
                            continue;
                        }
                        self.state.send_modify(|s| s.cut_off = true);
                        if let Some(h) = slot.borrow().clone() {
                            tracing::warn!(%worker, actor = %h.actor, lease = ?s.lease, "no hosting renewal answered in time; the actor is fenced until the control plane keeps it here");
                            h.traffic.set_cut_off(true);
                        }
                        continue;
                    }
                    r = rx.changed() => if r.is_err() { return },
                    () = stop.cancelled() => return,
                }
            } else {
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    () = stop.cancelled() => return,
                }
            }
        }
    }
}
