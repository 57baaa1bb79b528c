//! Checkpoint: a RUNNING actor to SUSPENDED, its worker freed. [`Checkpoint::run`]
//! holds the order of the steps (route leases revoked, SUSPENDING recorded, the
//! worker's checkpoint fenced as asked, the outcome recorded); an explicit suspend
//! ([`Checkpoint::suspend`]) and the policies' checkpoints both go through it.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Status;
use valet_proto::ateapi;
use valet_proto::worker::{self as wk, worker_command::Command};

use super::settle::Settle;
use super::{Op, OpKind, OpTarget, Plane, aborted, not_found, shutting_down, slot_of};
use crate::link::LinkError;
use crate::model::{ActorKey, ActorStatus, Template};
use crate::store::{ActorRow, Batch};

/// How a checkpoint fences the actor on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fence {
    /// An explicit suspend: the worker waits for the requests in flight to end.
    WaitIdle,
    /// A policy's: only if the actor is idle since this activity mark.
    IdleSince(u64),
}

/// How a checkpoint ended.
#[derive(Debug)]
pub(crate) enum Checkpointed {
    /// The actor is SUSPENDED.
    Suspended(Box<ateapi::Actor>),
    /// A policy's checkpoint found it busy: it is RUNNING still.
    Busy,
    /// The checkpoint failed with the actor still served on its worker (its data
    /// over the limit, say): it is RUNNING still, and nothing was snapshotted.
    Refused(String),
    /// It failed (the actor is CRASHED, or a write failed).
    Failed(Status),
}

/// Whether a stop's [`Plane::checkpoint_all`] waits for a SUSPENDED actor held by
/// `op`: one about to run (a resume handed a worker, writing its claim), yes; one still
/// queued for capacity, no (it may never get a worker, and the plane's shutdown answers
/// it), nor one another operation holds that leaves it suspended.
pub(super) fn stop_waits_for(st: &super::State, key: &ActorKey) -> bool {
    match st.busy(key) {
        Some(OpKind::Resuming {
            joinable: false, ..
        }) => true,
        // Handed a worker (reserved under the lock) before its task has run.
        Some(OpKind::Resuming { .. }) => st.workers.reserved_for(key),
        _ => false,
    }
}

/// One checkpoint of a RUNNING actor under its operation lock.
pub(super) struct Checkpoint {
    pub(super) plane: Plane,
    pub(super) op: Op,
    pub(super) key: ActorKey,
    /// Its record, RUNNING.
    pub(super) row: ActorRow,
    pub(super) fence: Fence,
}

impl Checkpoint {
    /// `SuspendActor`: here, or on the replica its worker is attached to when that is
    /// another one (the request is forwarded, and its answer awaited).
    pub(super) async fn suspend_anywhere(
        plane: &Plane,
        key: ActorKey,
    ) -> Result<ateapi::Actor, Status> {
        let worker = {
            let st = plane.lock();
            st.records
                .get(&key)
                .filter(|r| r.status == ActorStatus::Running && st.busy(&key).is_none())
                .and_then(|r| r.worker.clone())
        };
        if let Some(w) = worker
            && let Some(done) = plane.inner.peers.suspend_elsewhere(plane, &key, &w).await
        {
            return done;
        }
        Self::suspend(plane, key).await
    }

    /// `SuspendActor` on this replica (a suspend forwarded here too): detached, under
    /// an operation lock of its own. An actor whose worker is attached to another
    /// replica by now is `Aborted` (the caller asks again, and is forwarded there).
    pub(super) async fn suspend(plane: &Plane, key: ActorKey) -> Result<ateapi::Actor, Status> {
        let plane = plane.clone();
        plane.clone().detached(async move {
            let started = Instant::now();
            let (op, row) = {
                let mut st = plane.lock();
                let row = st.records.get(&key).ok_or_else(|| not_found(&key))?.clone();
                if st.held_elsewhere(&row)
                    || row
                        .worker
                        .as_ref()
                        .is_some_and(|w| st.replicas.attached_elsewhere(w))
                {
                    return Err(aborted());
                }
                // A no-op, also while a resume waits in its pool's queue for it; not
                // while one was handed a worker (about to run) or another operation
                // holds it: `Aborted` below, as for any busy actor.
                let at_most_queued = match st.busy(&key) {
                    None => true,
                    Some(OpKind::Resuming { .. }) => !stop_waits_for(&st, &key),
                    Some(OpKind::Busy(_)) => false,
                };
                if row.status == ActorStatus::Suspended && at_most_queued {
                    return Ok(st.to_proto(&row));
                }
                if st.busy(&key).is_some() {
                    return Err(aborted());
                }
                match row.status {
                    // SUSPENDED was answered above.
                    ActorStatus::Suspended
                    | ActorStatus::Running
                    | ActorStatus::Resuming
                    | ActorStatus::Suspending => {}
                    ActorStatus::Crashed => {
                        return Err(Status::failed_precondition(format!(
                            "actor {key} is {}; only RUNNING actors can be suspended",
                            row.status
                        )));
                    }
                }
                let op = Op::take(
                    &plane,
                    &mut st,
                    OpTarget::Actor(key.clone()),
                    OpKind::Busy("suspending"),
                );
                (op, row)
            };
            if row.status.is_transitional() {
                let back = Settle::new(&plane, &op, row).run().await?;
                drop(op);
                return Ok(plane.lock().to_proto(&back));
            }
            let ended = Checkpoint {
                plane: plane.clone(),
                op,
                key: key.clone(),
                row,
                fence: Fence::WaitIdle,
            }
            .run()
            .await;
            plane.metrics().operation("suspend", started.elapsed());
            match ended {
                Checkpointed::Suspended(actor) => Ok(*actor),
                Checkpointed::Failed(e) => Err(e),
                // Aborted: the caller may try again (a drain does, in its next round).
                Checkpointed::Busy => Err(Status::aborted(format!(
                    "actor {key} is busy: its requests in flight did not end within {}s; it keeps running",
                    idle_wait(&plane).as_secs_f64()
                ))),
                Checkpointed::Refused(why) => Err(Status::failed_precondition(why)),
            }
        })
        .await
    }

    /// In order: SUSPENDING, the worker's checkpoint fenced as asked, then SUSPENDED
    /// with its worker freed; CRASHED when the checkpoint fails; back to RUNNING when
    /// a policy's checkpoint finds the actor busy.
    pub(super) async fn run(self) -> Checkpointed {
        let Checkpoint {
            plane,
            op,
            key,
            row,
            fence,
        } = self;
        let key = &key;
        plane.leases().revoke_leases(key).await;
        let suspending = row.moved(ActorStatus::Suspending, row.worker.clone());
        if let Err(e) = plane
            .ledger()
            .step(&op, Batch::put([suspending.clone()]))
            .await
        {
            return Checkpointed::Failed(e);
        }
        let mut result = call(&plane, key, &suspending, fence).await;
        // Its worker's stream is gone (before or during the checkpoint): should it
        // attach again still hosting the actor, the checkpoint goes over the new stream
        // rather than the actor going back to its last snapshot.
        let worker = suspending.worker.clone().unwrap_or_default();
        if matches!(result, Err(LinkError::Gone))
            && super::fencing::reattached_hosting(&plane, key, &worker).await
        {
            result = call(&plane, key, &suspending, fence).await;
        }
        if matches!(result, Err(LinkError::Busy | LinkError::StillRunning(_))) {
            let back = suspending.moved(ActorStatus::Running, suspending.worker.clone());
            plane.lock().signals.touch(key);
            // The actor runs on: a failed write must not leave it SUSPENDING, which
            // the settler would take back to its last snapshot, evicting it with its
            // requests in flight and everything it did since.
            let Some(freed) = plane.ledger().write_until_landed(Batch::put([back])).await else {
                // The plane stops, or another replica changed the record (its to
                // settle now).
                return Checkpointed::Failed(if plane.is_shutting_down() {
                    shutting_down()
                } else {
                    Status::aborted(
                        "the actor's record changed on another control-plane replica; try again",
                    )
                });
            };
            drop(op);
            plane.ledger().hand_off_all(freed);
            return match result {
                Err(LinkError::StillRunning(why)) => {
                    tracing::warn!(actor = %key, worker, %why, "checkpoint failed; the actor keeps running");
                    Checkpointed::Refused(why)
                }
                _ => Checkpointed::Busy,
            };
        }
        match record(&plane, op, key, suspending, result).await {
            Ok(actor) => Checkpointed::Suspended(Box::new(actor)),
            Err(e) => Checkpointed::Failed(e),
        }
    }
}

/// How long an explicit suspend's checkpoint waits for the actor's requests in
/// flight to end before the worker answers busy: half `--checkpoint-timeout`, so that
/// the answer comes well within it.
fn idle_wait(plane: &Plane) -> Duration {
    plane.config().checkpoint_timeout / 2
}

/// Tells the worker to checkpoint `row`, fenced as `fence`.
async fn call(
    plane: &Plane,
    key: &ActorKey,
    row: &ActorRow,
    fence: Fence,
) -> Result<wk::Reply, LinkError> {
    let worker = row.worker.clone().unwrap_or_default();
    let Some(link) = plane
        .lock()
        .workers
        .get(&worker)
        .map(|w| Arc::clone(w.link()))
    else {
        return Err(LinkError::Gone);
    };
    let full = plane
        .template(&row.template)
        .is_some_and(Template::full_snapshot);
    let (fence, idle_wait) = match fence {
        Fence::WaitIdle => (
            wk::checkpoint::Fence::WaitIdle(true),
            idle_wait(plane).try_into().ok(),
        ),
        Fence::IdleSince(mark) => (wk::checkpoint::Fence::IdleSince(mark), None),
    };
    let cmd = Command::Checkpoint(wk::Checkpoint {
        actor: Some(slot_of(key, row)),
        full,
        fence: Some(fence),
        idle_wait,
        snapshot: row.snapshot.clone(),
    });
    link.call(cmd, plane.config().checkpoint_timeout).await
}

/// Records what the worker's checkpoint came to, releasing `op`.
async fn record(
    plane: &Plane,
    op: Op,
    key: &ActorKey,
    suspending: ActorRow,
    result: Result<wk::Reply, LinkError>,
) -> Result<ateapi::Actor, Status> {
    let worker = suspending.worker.clone().unwrap_or_default();
    match result {
        // The worker no longer hosts it (it was told to drop it, as when it
        // re-attached during this operation): nothing of it runs there, and it
        // goes back to its last snapshot.
        Err(LinkError::NotHosting(why)) => {
            tracing::warn!(actor = %key, worker, %why, "the worker no longer hosts the actor; back to its last snapshot");
            let done = suspending.moved(ActorStatus::Suspended, None);
            plane
                .ledger()
                .finish(op, Batch::put([done.clone()]))
                .await?;
            Ok(plane.lock().to_proto(&done))
        }
        Ok(_) | Err(LinkError::Gone) => {
            if result.is_err() {
                tracing::warn!(actor = %key, worker, "worker went away during checkpoint; actor back to its last snapshot");
                // It may still serve the actor (only its stream may be cut): not
                // elsewhere before it has fenced it. At shutdown the record stays
                // SUSPENDING, which the next start settles.
                if !super::fencing::until_fenced(plane, &worker).await {
                    return Err(shutting_down());
                }
            }
            let mut done = suspending.moved(ActorStatus::Suspended, None);
            // A program's checkpoint names its snapshot: the next restore's.
            if let Ok(reply) = &result
                && !reply.snapshot.is_empty()
            {
                done.snapshot = reply.snapshot.clone();
            }
            plane
                .ledger()
                .finish(op, Batch::put([done.clone()]))
                .await?;
            tracing::info!(actor = %key, worker, snapshot = %done.snapshot, "actor SUSPENDED");
            Ok(plane.lock().to_proto(&done))
        }
        Err(e) => {
            tracing::warn!(actor = %key, worker, error = %e, "checkpoint failed; actor CRASHED");
            plane.lock().workers.evict(&worker, key, &suspending);
            let done = suspending.crashed(&e.to_string());
            plane.ledger().finish(op, Batch::put([done])).await?;
            Err(Status::internal(format!(
                "checkpoint of actor {key} failed: {e}"
            )))
        }
    }
}
