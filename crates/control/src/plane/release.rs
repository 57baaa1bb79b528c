//! Release: actors that were RUNNING on a worker that can no longer serve them go
//! back to SUSPENDED from their last snapshot (or CRASHED, when their program exited),
//! once that worker has fenced them, under operation locks, detached. Releases follow
//! a worker's departure, a re-attach without the actor, a restart's rejoin grace, and
//! a program's exit.

use super::workers::Departure;
use super::{Op, OpKind, OpTarget, Plane, State};
use crate::model::{ActorKey, ActorStatus};
use crate::store::{ActorRow, Batch};

/// How many times a release refused because another replica changed its record is
/// built again from the record.
const RELEASE_ROUNDS: usize = 5;

/// How a release ends an actor that was RUNNING on a worker.
#[derive(Debug, Clone)]
pub(super) enum Ending {
    /// Back to SUSPENDED from its last snapshot, for this reason.
    Suspend(&'static str),
    /// CRASHED, for this reason (its program exited).
    Crash(String),
}

/// Releasing actors: the order of its steps lives in [`Release::start`] (leases
/// revoked, the records written until they land, the locks released, the freed
/// workers handed off).
pub(super) struct Release;

impl Release {
    /// Writes `rows` back to SUSPENDED, or CRASHED (worker released) under their
    /// operation locks, detached, once their route leases are revoked.
    pub(super) fn start(plane: &Plane, ops: Vec<Op>, rows: Vec<ActorRow>, how: Ending) {
        let released = {
            let how = how.clone();
            move |rows: &[ActorRow]| -> Vec<ActorRow> {
                rows.iter()
                    .map(|r| match &how {
                        Ending::Suspend(_) => r.moved(ActorStatus::Suspended, None),
                        Ending::Crash(reason) => r.crashed(reason),
                    })
                    .collect()
            }
        };
        let tasks = plane.inner.tasks.clone();
        let plane = plane.clone();
        tasks.spawn(async move {
            for row in &rows {
                plane.leases().revoke_leases(&row.key()).await;
            }
            let keys: Vec<String> = rows.iter().map(|r| r.key().to_string()).collect();
            // A failed write changed nothing: the actors would stay RUNNING on a worker
            // that is gone. Try again (under the same operation locks, so resumes of
            // them answer Aborted and are retried) until it lands or the plane stops
            // (the next start releases them). With several replicas, a release built
            // from a record another replica changed meanwhile is built again from the
            // record, as long as it still places the actor on that worker and the
            // worker is not attached to another replica.
            let mut rows = rows;
            let mut rounds = 0;
            let freed = loop {
                if let Some(freed) = plane.ledger().write_until_landed(Batch::put(released(&rows))).await {
                    break freed;
                }
                rounds += 1;
                match plane.inner.peers.releases_still_due(&plane, &rows).await {
                    Some(again) if !again.is_empty() && rounds < RELEASE_ROUNDS => rows = again,
                    _ => return,
                }
            };
            drop(ops);
            plane.ledger().hand_off_all(freed);
            for actor in keys {
                match &how {
                    Ending::Suspend(why) => {
                        tracing::warn!(%actor, why, "actor back to SUSPENDED from its last snapshot");
                    }
                    Ending::Crash(reason) => {
                        tracing::warn!(%actor, %reason, "actor CRASHED");
                    }
                }
            }
        });
    }

    /// Releases `key`, whose worker left, once the worker must have fenced it (see
    /// [`super::membership::Membership::worker_left`]), unless the worker came back meanwhile: attached now, or
    /// attached and left again (that later departure's release decides then).
    pub(super) fn orphan(plane: &Plane, worker: String, key: ActorKey, departure: Departure) {
        let tasks = plane.inner.tasks.clone();
        let plane = plane.clone();
        tasks.spawn(async move {
            if !super::fencing::until_fenced(&plane, &worker).await {
                return;
            }
            // Not if the worker came back (the plane decided what it hosts then), or
            // left again (that departure's release decides).
            let gone = |st: &State| {
                let back = st.workers.contains(&worker) || st.replicas.attached_elsewhere(&worker);
                let superseded = st
                    .workers
                    .departed(&worker)
                    .is_some_and(|d| !d.same(&departure));
                !back && !superseded
            };
            Release::once_idle(
                &plane,
                &key,
                &worker,
                gone,
                Ending::Suspend("its worker left"),
            )
            .await;
        });
    }

    /// Releases `key` if the records place it, RUNNING, on `worker` and `still` holds,
    /// once no operation holds it: an operation in progress (a restore whose last write
    /// is landing, a checkpoint the actor was too busy for) may end with it RUNNING
    /// there, after the worker left or was told to evict it. Ends at shutdown (the next
    /// start releases it).
    pub(super) async fn once_idle(
        plane: &Plane,
        key: &ActorKey,
        worker: &str,
        still: impl Fn(&State) -> bool,
        how: Ending,
    ) {
        loop {
            let released = {
                let mut st = plane.lock();
                if st.busy(key).is_some() {
                    None
                } else {
                    let row = st
                        .records
                        .get(key)
                        .filter(|r| {
                            r.status == ActorStatus::Running && r.worker.as_deref() == Some(worker)
                        })
                        .cloned();
                    match row {
                        Some(row) if still(&st) => {
                            let op = Op::take(
                                plane,
                                &mut st,
                                OpTarget::Actor(key.clone()),
                                OpKind::Busy("releasing"),
                            );
                            Some((op, row))
                        }
                        _ => return,
                    }
                }
            };
            if let Some((op, row)) = released {
                Release::start(plane, vec![op], vec![row], how);
                return;
            }
            // Operations are bounded (their worker calls and writes time out).
            let idle = plane.wait_until(plane.config().restore_timeout, |p| {
                p.lock().busy(key).is_none()
            });
            tokio::select! {
                _ = idle => {}
                () = plane.inner.shutdown.cancelled() => return,
            }
        }
    }

    /// After `rejoin_grace`, RUNNING actors whose worker has not re-attached go back to
    /// SUSPENDED. Cancelled by shutdown.
    ///
    /// The wait is at least the hosting lease the earlier runs told their workers
    /// (recorded in the store), and this run's: a worker cut off from the plane by the
    /// restart fences its actor at its own deadline, which came before (its last
    /// answered renewal was before the restart). Only actors recorded RUNNING at the
    /// start whose worker never re-attached are released here; a worker that attached
    /// and left is [`super::membership::Membership::worker_left`]'s (its lease counts from its last renewal).
    pub(super) fn after_rejoin_grace(plane: &Plane, awaiting: Vec<ActorKey>) {
        let plane = plane.clone();
        // The earlier runs' hosting lease (recorded), which workers that do not
        // re-attach still go by; at least this run's.
        let grace = plane.config().rejoin_grace.max(
            plane
                .inner
                .workers_unknown_until
                .saturating_duration_since(tokio::time::Instant::now())
                .max(plane.config().hosting_lease),
        );
        let chores = plane.inner.chores.clone();
        chores.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(grace) => {}
                () = plane.inner.shutdown.cancelled() => return,
            }
            let (ops, rows) = {
                let mut st = plane.lock();
                let stale: Vec<ActorRow> = awaiting
                    .iter()
                    .filter_map(|k| st.records.get(k).map(|r| (k, r)))
                    .filter(|(k, r)| {
                        r.status == ActorStatus::Running
                            && st.busy(k).is_none()
                            && !r.worker.as_ref().is_some_and(|w| {
                                st.workers.contains(w)
                                    || st.workers.departed(w).is_some()
                                    || st.replicas.attached_elsewhere(w)
                            })
                    })
                    .map(|(_, r)| r.clone())
                    .collect();
                let ops = Op::take_each(&plane, &mut st, &stale, "releasing");
                (ops, stale)
            };
            if !rows.is_empty() {
                Release::start(
                    &plane,
                    ops,
                    rows,
                    Ending::Suspend("its worker did not re-attach after the restart"),
                );
            }
        });
    }
}
