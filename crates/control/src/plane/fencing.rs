//! Fencing: when a worker can no longer serve the actor the records place on it, so
//! that the actor may run elsewhere. A worker fences at its hosting lease after its
//! last answered renewal; one whose process is gone (its app port refuses
//! connections), or that attached again, has fenced at once.

use std::net::SocketAddr;

use super::{Plane, Slot};
use crate::model::ActorKey;

/// Whether nothing listens on `app` any more (its process is gone): the connection is
/// refused within a second.
async fn refuses(app: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(
            std::time::Duration::from_secs(1),
            tokio::net::TcpStream::connect(app)
        )
        .await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// When a worker whose last renewal the plane answered at `last_renewal` has surely
/// fenced its actor: `lease` after it, and never before the hosting lease earlier
/// runs told their workers has passed since the start. A worker that re-attached
/// but never read its Welcome (its stream ended first) still goes by that one.
pub(super) fn fenced_by(
    plane: &Plane,
    last_renewal: tokio::time::Instant,
    lease: std::time::Duration,
) -> tokio::time::Instant {
    (last_renewal + lease).max(plane.inner.workers_unknown_until)
}

/// Waits until `worker` can no longer serve the actor the records place on it: it is
/// attached (the plane decides what it hosts), its process is gone (its app port
/// refuses connections), or its hosting lease has run out since the last renewal
/// the plane heard (for a worker not seen since a restart: since the start). False
/// when the plane shuts down first.
pub(super) async fn until_fenced(plane: &Plane, worker: &str) -> bool {
    if plane.is_shutting_down() {
        return false;
    }
    let Some((app, deadline)) = unattached(plane, worker) else {
        return true;
    };
    if deadline <= tokio::time::Instant::now() {
        return true;
    }
    if let Some(app) = app
        && refuses(app).await
    {
        return true;
    }
    tracing::info!(
        worker,
        ?deadline,
        "waiting out the hosting lease before the actor may run elsewhere"
    );
    // Or until it attaches again: attaching, it reports what it hosts, and what the
    // records no longer place on it is evicted before any later command.
    let within = deadline.saturating_duration_since(tokio::time::Instant::now());
    tokio::select! {
        _ = plane.wait_until(within, |p| attached(p, worker)) => true,
        () = plane.inner.shutdown.cancelled() => false,
    }
}

/// For a `worker` not attached: its app address, if known, and when it has surely
/// fenced its actor (see [`until_fenced`]). `None` while it is attached.
fn unattached(plane: &Plane, worker: &str) -> Option<(Option<SocketAddr>, tokio::time::Instant)> {
    let st = plane.lock();
    // Attached to another replica: that one decides what it hosts (its attach
    // evicted what the records do not place on it).
    if st.replicas.attached_elsewhere(worker) {
        return None;
    }
    match (st.workers.get(worker), st.workers.departed(worker)) {
        (Some(w), _) if w.is_open() => None,
        // Its stream just ended (the plane has not heard of it yet).
        (Some(w), _) => Some((
            Some(w.app_addr()),
            fenced_by(plane, w.last_renewal(), plane.config().hosting_lease),
        )),
        (None, Some(d)) => Some((Some(d.app()), d.fenced_by())),
        (None, None) => Some((None, plane.inner.workers_unknown_until)),
    }
}

/// For a checkpoint of SUSPENDING `key` that found its `worker` gone: waits until
/// the worker attaches again still hosting it (kept for this checkpoint, which then
/// goes over the new stream), bounded by when the worker must have fenced it.
/// Whether it did. False at once when the worker's process is gone (its app port
/// refuses connections), and when the plane shuts down.
pub(super) async fn reattached_hosting(plane: &Plane, key: &ActorKey, worker: &str) -> bool {
    let hosting = |p: &Plane| {
        p.lock()
            .workers
            .get(worker)
            .is_some_and(|w| w.is_open() && *w.slot() == Slot::Hosting(key.clone()))
    };
    let Some((app, deadline)) = unattached(plane, worker) else {
        return hosting(plane);
    };
    if plane.is_shutting_down() || deadline <= tokio::time::Instant::now() {
        return false;
    }
    if let Some(app) = app
        && refuses(app).await
    {
        return false;
    }
    /// Takes `key` out of the waiting set however the wait ends.
    struct Awaiting<'a>(&'a Plane, ActorKey);
    impl Drop for Awaiting<'_> {
        fn drop(&mut self) {
            self.0.lock().workers.not_awaited(&self.1);
        }
    }
    plane.lock().workers.await_worker_of(key);
    let awaiting = Awaiting(plane, key.clone());
    tracing::info!(actor = %key, worker, ?deadline, "checkpoint waits for the worker to attach again");
    let within = deadline.saturating_duration_since(tokio::time::Instant::now());
    let attached = tokio::select! {
        _ = plane.wait_until(within, |p| attached(p, worker)) => attached(plane, worker),
        () = plane.inner.shutdown.cancelled() => false,
    };
    drop(awaiting);
    attached && hosting(plane)
}

/// Whether `worker` is attached, its stream open (or attached to another live
/// replica).
fn attached(plane: &Plane, worker: &str) -> bool {
    let st = plane.lock();
    st.workers.get(worker).is_some_and(|w| w.is_open()) || st.replicas.attached_elsewhere(worker)
}
