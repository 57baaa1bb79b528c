//! The ledger: the one place that orders every step of every operation. A step is
//! the durable write, then the change in memory, then (for the last step) the
//! operation's lock released, then the workers it freed handed to the oldest waiters.
//! Nothing is applied or handed off unless the write was durable.

use tonic::Status;

use super::{Op, Plane, db_error, store_backoff};
use crate::store::{Batch, StoreError};

/// The plane's write path. Obtained with [`Plane::ledger`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ledger<'a> {
    plane: &'a Plane,
}

impl Plane {
    /// The plane's write path.
    pub(crate) fn ledger(&self) -> Ledger<'_> {
        Ledger { plane: self }
    }
}

impl Ledger<'_> {
    /// One step of operation `op`, in the order every step follows: the durable write,
    /// then the change in memory, then any worker it freed handed to the oldest waiter
    /// of its pool. Nothing is applied or handed off unless the write was durable; on a
    /// failed write memory is as before and the caller gets `Internal`.
    pub(crate) async fn step(&self, op: &Op, batch: Batch) -> Result<(), Status> {
        let _ = op;
        let freed = self.write_and_apply(batch).await?;
        self.hand_off_all(freed);
        Ok(())
    }

    /// The last step of operation `op`: the durable write, then the change in memory,
    /// then the operation lock released, then any freed worker handed off. On a failed
    /// write the lock is released all the same and memory is as before.
    pub(crate) async fn finish(&self, op: Op, batch: Batch) -> Result<(), Status> {
        self.finish_all(vec![op], batch).await
    }

    /// [`Self::finish`] for one write that ends several operations at once.
    pub(crate) async fn finish_all(&self, ops: Vec<Op>, batch: Batch) -> Result<(), Status> {
        let freed = self.write_and_apply(batch).await;
        drop(ops);
        self.hand_off_all(freed?);
        Ok(())
    }

    /// Writes `batch` until it lands (0.5 s doubling to 5 s between tries), for a
    /// record that must not stay as it is (the caller holds the operation locks, so
    /// resumes of its actors answer `Aborted` and are retried); `None` once the plane
    /// stops first (the next start settles the record), or once another replica
    /// changed the record (it is that one's to settle).
    pub(crate) async fn write_until_landed(&self, batch: Batch) -> Option<Vec<String>> {
        let plane = self.plane;
        let mut backoff = store_backoff();
        loop {
            match self.write_and_apply(batch.clone()).await {
                Ok(freed) => return Some(freed),
                // Another replica changed the record meanwhile: it is that one's now.
                Err(e) if e.code() == tonic::Code::Aborted => {
                    tracing::info!(error = %e.message(), "the record changed on another replica; leaving it to that one");
                    return None;
                }
                Err(_) => {
                    if !backoff.wait(&plane.inner.shutdown).await {
                        return None;
                    }
                }
            }
        }
    }

    async fn write_and_apply(&self, batch: Batch) -> Result<Vec<String>, Status> {
        let plane = self.plane;
        // Several replicas: while this write is on its way, a read of the same records
        // (following another replica's announcement) does not apply them; this write's
        // result does.
        let _writing = plane.inner.peers.writing(plane, &batch);
        match plane.inner.store.write(batch.clone()).await {
            Ok(()) => {}
            // Another replica changed the record: nothing was written, and nothing is
            // half-way. The records in memory are read again.
            Err(StoreError::Conflict(what)) => {
                plane.inner.peers.changed_elsewhere(plane, &batch);
                // An actor this replica's operation held may be left RESUMING or
                // SUSPENDING (its worker moved): the settler looks (it settles only
                // what this replica holds).
                plane.inner.unsettled.notify_one();
                return Err(Status::aborted(format!(
                    "{what} changed on another control-plane replica; try again"
                )));
            }
            Err(e) => {
                plane.inner.unsettled.notify_one();
                return Err(db_error(&e));
            }
        }
        let mut st = plane.lock();
        // A deleted actor's count goes with it, under the same lock as its record
        // (resumes count under it too): an actor created again starts from zero.
        for key in &batch.delete_actors {
            plane.forget_resume_calls(key);
        }
        Ok(st.apply(&batch))
    }

    pub(crate) fn hand_off_all(&self, freed: Vec<String>) {
        let plane = self.plane;
        for worker in freed {
            plane.capacity().hand_off(&worker);
        }
        plane.wake_policies();
    }
}
