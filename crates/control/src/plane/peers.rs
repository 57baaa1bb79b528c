//! The one seam between the plane and the control planes it shares its records with,
//! chosen once at startup: [`Peers::Alone`] (the only writer of its store: SQLite, or
//! a single PostgreSQL writer) or [`Peers::Replicas`] (one of several replicas active
//! at once on one PostgreSQL database, [`super::replicas`]). The plane's logic asks
//! its peers; it never looks for a shared store itself.

use std::sync::Arc;

use tonic::Status;
use valet_proto::ateapi;
use valet_proto::worker as wk;

use super::Plane;
use super::replicas::{Replicas, Writing};
use crate::link::WorkerLink;
use crate::model::ActorKey;
use crate::store::{ActorRow, Batch};

/// Who else writes this plane's records.
#[derive(Debug)]
pub(crate) enum Peers {
    /// Nobody: memory is the record's only working copy.
    Alone,
    /// Other replicas on the same database, followed from its announcements.
    Replicas(Replicas),
}

/// An eviction's claim on a waiter of the queue the replicas share.
pub(super) enum Claim {
    /// The eviction serves this replica's own demand (one control plane, or routers
    /// refused here lately): nothing to claim.
    Own,
    /// It serves waiter `seq`, claimed so that no other replica evicts for it too;
    /// released once the eviction ends.
    Waiter(i64),
    /// Nobody waits any more, or the claim failed: no eviction.
    Nobody,
}

impl Peers {
    /// A worker's Join: recorded where the replicas share their workers (refused when
    /// another process holds its id on another live replica), then joined here.
    /// Returns whether it keeps the actor it reported.
    pub(super) async fn attach(
        &self,
        plane: &Plane,
        join: &wk::Join,
        link: Arc<WorkerLink>,
    ) -> Result<bool, Status> {
        match self {
            Peers::Alone => plane.membership().worker_joined(join, link),
            Peers::Replicas(r) => r.attach(plane, join, link).await,
        }
    }

    /// `worker` drains: recorded for the other replicas, in the background.
    pub(super) fn worker_draining(&self, worker: &str) {
        if let Peers::Replicas(r) = self {
            r.worker_draining(worker);
        }
    }

    /// `worker`'s attachment `attach` ended: recorded for the other replicas, in the
    /// background.
    pub(super) fn worker_left(&self, worker: &str, attach: i64) {
        if let Peers::Replicas(r) = self {
            r.worker_left(worker, attach);
        }
    }

    /// For releases of `rows` refused because a record changed: those to release
    /// again (see [`Replicas::releases_still_due`]); `None` alone (nobody else changes
    /// records).
    pub(super) async fn releases_still_due(
        &self,
        plane: &Plane,
        rows: &[ActorRow],
    ) -> Option<Vec<ActorRow>> {
        match self {
            Peers::Alone => None,
            Peers::Replicas(r) => r.releases_still_due(plane, rows).await,
        }
    }

    /// A waiter here (entry `id`) queued `actor` for a worker of `pool`: written into
    /// the queue the replicas share, in order of arrival.
    pub(super) fn queued(&self, pool: &str, actor: &ActorKey, id: u64) {
        if let Peers::Replicas(r) = self {
            r.queued(pool, actor, id);
        }
    }

    /// This replica's waiter `seq` no longer waits: its shared row goes.
    pub(super) fn dequeue(&self, plane: &Plane, seq: i64) {
        if let Peers::Replicas(r) = self {
            r.dequeue(plane, seq);
        }
    }

    /// Free `worker` goes to the oldest waiter of its pool: here, or of any replica.
    pub(super) fn hand_off(&self, plane: &Plane, worker: &str) {
        match self {
            Peers::Alone => plane.capacity().hand_off_here(worker),
            Peers::Replicas(r) => r.offer(plane, worker),
        }
    }

    /// Whom an eviction in `pool` serves.
    pub(super) async fn claim_eviction(&self, plane: &Plane, key: &ActorKey, pool: &str) -> Claim {
        match self {
            Peers::Alone => Claim::Own,
            Peers::Replicas(r) => r.claim_eviction(plane, key, pool).await,
        }
    }

    /// The eviction that claimed waiter `seq` ended.
    pub(super) async fn release_eviction(&self, plane: &Plane, seq: i64) {
        if let Peers::Replicas(r) = self {
            r.release_eviction(plane, seq).await;
        }
    }

    /// A write of `batch` is on its way (see [`Writing`]).
    pub(super) fn writing(&self, plane: &Plane, batch: &Batch) -> Option<Writing> {
        match self {
            Peers::Alone => None,
            Peers::Replicas(r) => Some(Writing::start(r, plane, batch)),
        }
    }

    /// Another replica changed a record `batch` wrote: those records are read again.
    pub(super) fn changed_elsewhere(&self, plane: &Plane, batch: &Batch) {
        if let Peers::Replicas(r) = self {
            r.refresh(plane, batch);
        }
    }

    /// Suspends `key`, RUNNING on `worker`, on the replica that worker is attached
    /// to when that is another one; `None` when it is this one's to suspend.
    pub(super) async fn suspend_elsewhere(
        &self,
        plane: &Plane,
        key: &ActorKey,
        worker: &str,
    ) -> Option<Result<ateapi::Actor, Status>> {
        match self {
            Peers::Alone => None,
            Peers::Replicas(r) => {
                let replica = r.replica_of(plane, worker)?;
                Some(r.forward_suspend(plane, replica, key).await)
            }
        }
    }

    /// Stops following the others, once nothing in progress needs it.
    pub(super) async fn unfollow(&self) {
        if let Peers::Replicas(r) = self {
            r.unfollow().await;
        }
    }
}
