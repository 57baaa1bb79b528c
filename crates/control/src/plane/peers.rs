//! The one seam between the plane and the control planes it shares its records with,
//! chosen once at startup: [`Alone`] (the only writer of its store: SQLite, or a
//! single PostgreSQL writer) or [`super::replicas::Replicas`] (one of several
//! replicas active at once on one PostgreSQL database). The plane's logic asks its
//! [`Peers`]; it never looks for a shared store itself, and nothing in it depends on
//! the replicas' module.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::watch;
use tonic::Status;
use valet_proto::ateapi;
use valet_proto::worker as wk;

use super::wait::CapacityWait;
use super::{Outcome, Plane};
use crate::link::WorkerLink;
use crate::model::ActorKey;
use crate::store::{ActorRow, Batch};

/// A future the seam returns.
pub(crate) type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Who else writes this plane's records. Every method's default is what a plane
/// alone does (nothing, or "not here").
pub(crate) trait Peers: Send + Sync + std::fmt::Debug {
    /// A worker's Join, with other replicas: recorded where they share their workers
    /// (refused when another process holds its id on another live replica), then
    /// joined here; whether it keeps the actor it reported. `None`: the caller joins
    /// it.
    fn attach<'a>(
        &'a self,
        _plane: &'a Plane,
        _join: &'a wk::Join,
        _link: Arc<WorkerLink>,
    ) -> Boxed<'a, Option<Result<bool, Status>>> {
        Box::pin(async { None })
    }

    /// `worker` drains: recorded for the others, in the background.
    fn worker_draining(&self, _worker: &str) {}

    /// `worker`'s attachment `attach` ended: recorded for the others, in the
    /// background.
    fn worker_left(&self, _worker: &str, _attach: i64) {}

    /// For releases of `rows` refused because a record changed: those to release
    /// again; `None` when nobody else changes records.
    fn releases_still_due<'a>(
        &'a self,
        _plane: &'a Plane,
        _rows: &'a [ActorRow],
    ) -> Boxed<'a, Option<Vec<ActorRow>>> {
        Box::pin(async { None })
    }

    /// A waiter here (entry `id`) queued `actor` for a worker of `pool`: written into
    /// the queue the replicas share, in order of arrival.
    fn queued(&self, _pool: &str, _actor: &ActorKey, _id: u64) {}

    /// This replica's waiter `seq` no longer waits: its shared row goes.
    fn dequeue(&self, _plane: &Plane, _seq: i64) {}

    /// Free `worker` goes to the oldest waiter of its pool on any replica; whether the
    /// replicas took it in hand (if not, the caller hands it off here).
    fn offer(&self, _plane: &Plane, _worker: &str) -> bool {
        false
    }

    /// Whom an eviction of `key` in `pool` serves.
    fn claim_eviction<'a>(
        &'a self,
        _plane: &'a Plane,
        _key: &'a ActorKey,
        _pool: &'a str,
    ) -> Boxed<'a, Claim> {
        Box::pin(async { Claim::Own })
    }

    /// The eviction that claimed waiter `seq` ended.
    fn release_eviction<'a>(&'a self, _plane: &'a Plane, _seq: i64) -> Boxed<'a, ()> {
        Box::pin(async {})
    }

    /// A write of `batch` is on its way: a guard held until it landed or failed (a
    /// read of the same records meanwhile is not applied).
    fn writing(&self, _plane: &Plane, _batch: &Batch) -> Option<Box<dyn Send>> {
        None
    }

    /// Another control plane changed a record `batch` wrote: those records are read
    /// again.
    fn changed_elsewhere(&self, _plane: &Plane, _batch: &Batch) {}

    /// Suspends `key`, RUNNING on `worker`, on the replica that worker is attached
    /// to when that is another one; `None` when it is this one's to suspend.
    fn suspend_elsewhere<'a>(
        &'a self,
        _plane: &'a Plane,
        _key: &'a ActorKey,
        _worker: &'a str,
    ) -> Boxed<'a, Option<Result<ateapi::Actor, Status>>> {
        Box::pin(async { None })
    }

    /// Stops following the others, once nothing in progress needs it.
    fn unfollow(&self) -> Boxed<'_, ()> {
        Box::pin(async {})
    }
}

/// The only writer of its store: every question of the seam has the answer "here".
#[derive(Debug)]
pub(crate) struct Alone;

impl Peers for Alone {}

/// An actor's resume that goes on on another replica (it restores the actor for a
/// waiter here, or the actor waits in its queue), watched from here.
pub(crate) trait Elsewhere: Send + Sync + std::fmt::Debug {
    /// The resume's outcome once the record shows it (see [`Observed`]).
    fn observe<'a>(
        &'a self,
        plane: &'a Plane,
        key: &'a ActorKey,
        queued: bool,
        capacity: &'a watch::Sender<CapacityWait>,
        tx: &'a watch::Sender<Option<Outcome>>,
    ) -> Boxed<'a, Observed>;
}

/// How watching another replica's resume ended.
pub(crate) enum Observed {
    /// With this outcome.
    Done(Box<Outcome>),
    /// The actor is suspended and queued nowhere, and its callers still wait: queue
    /// it again.
    Again,
}

/// An eviction's claim on a waiter of the queue the replicas share.
pub(crate) enum Claim {
    /// The eviction serves this replica's own demand (one control plane, or routers
    /// refused here lately): nothing to claim.
    Own,
    /// It serves waiter `seq`, claimed so that no other replica evicts for it too;
    /// released once the eviction ends.
    Waiter(i64),
    /// Nobody waits any more, or the claim failed: no eviction.
    Nobody,
}
