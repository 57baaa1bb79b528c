//! Settling: an actor an earlier operation left half-way (RESUMING or SUSPENDING with
//! no operation on it: a write failed after the worker acted) goes back to SUSPENDED
//! from its last snapshot, as a restart would do, once its worker has fenced it.

use tonic::Status;

use super::{Op, OpKind, OpTarget, Plane, shutting_down, store_backoff};
use crate::model::{ActorKey, ActorStatus};
use crate::store::{ActorRow, Batch};

/// Settling an actor an earlier operation left half-way (RESUMING or SUSPENDING with
/// no operation on it: a write failed after the worker acted), under an operation
/// lock of its own or of the operation that found it so.
pub(super) struct Settle<'a> {
    plane: &'a Plane,
    op: &'a Op,
    row: ActorRow,
}

impl Settle<'_> {
    /// Settles what failed writes leave half-way: an operation whose last write failed
    /// ends with its actor RESUMING or SUSPENDING and no operation on it (its worker's
    /// slot still taken). After each failed write, and again with a back-off (0.5 s
    /// doubling to 5 s) until every such actor is settled, each goes back to SUSPENDED
    /// from its last snapshot as a resume of it would do. Cancelled by shutdown (the
    /// next start settles them).
    pub(super) fn spawn_settler(plane: &Plane) {
        let chores = plane.inner.chores.clone();
        let plane = plane.clone();
        chores.spawn(async move {
            loop {
                tokio::select! {
                    () = plane.inner.unsettled.notified() => {}
                    () = plane.inner.shutdown.cancelled() => return,
                }
                let mut backoff = store_backoff();
                loop {
                    if !backoff.wait(&plane.inner.shutdown).await {
                        return;
                    }
                    if Settle::all(&plane).await {
                        break;
                    }
                }
            }
        });
    }
}

impl<'a> Settle<'a> {
    pub(super) fn new(plane: &'a Plane, op: &'a Op, row: ActorRow) -> Self {
        Self { plane, op, row }
    }

    /// Settles every actor left RESUMING or SUSPENDING with no operation on it (a
    /// failed write ended its operation); whether all are settled now.
    pub(super) async fn all(plane: &Plane) -> bool {
        let left: Vec<ActorKey> = plane
            .lock()
            .records
            .values()
            .filter(|r| r.status.is_transitional())
            .map(ActorRow::key)
            .collect();
        let mut settled = true;
        // One at a time, each under its own operation lock, taken only if no operation
        // holds the actor now.
        for key in left {
            let taken = {
                let mut st = plane.lock();
                match st.records.get(&key) {
                    Some(r)
                        if r.status.is_transitional()
                            && st.busy(&key).is_none()
                            && !st.held_elsewhere(r) =>
                    {
                        let row = r.clone();
                        let op = Op::take(
                            plane,
                            &mut st,
                            OpTarget::Actor(key.clone()),
                            OpKind::Busy("settling"),
                        );
                        Some((op, row))
                    }
                    _ => None,
                }
            };
            let Some((op, row)) = taken else { continue };
            let done = tokio::select! {
                r = Settle::new(plane, &op, row).run() => r.is_ok(),
                () = plane.inner.shutdown.cancelled() => return false,
            };
            settled &= done;
        }
        settled
    }

    /// An actor an earlier operation left half-way (RESUMING or SUSPENDING with no
    /// operation on it: a write failed after the worker acted) goes back to SUSPENDED
    /// from its last snapshot, as a restart would do, freeing its worker.
    pub(super) async fn run(self) -> Result<ActorRow, Status> {
        let Settle { plane, op, row } = self;
        let key = row.key();
        plane.leases().revoke_leases(&key).await;
        if let Some(worker) = &row.worker {
            plane.lock().workers.evict(worker, &key, &row);
            // A worker that is not attached is not told: not elsewhere before it has
            // fenced the actor.
            if !super::fencing::until_fenced(plane, worker).await {
                return Err(shutting_down());
            }
        }
        let back = row.moved(ActorStatus::Suspended, None);
        plane.ledger().step(op, Batch::put([back.clone()])).await?;
        tracing::warn!(actor = %key, was = %row.status, "actor left half-way by an earlier operation; back to SUSPENDED from its last snapshot");
        Ok(back)
    }
}
