//! The calls on an actor's life: `ResumeActor` (through an [`Activation`]),
//! `SuspendActor` (a [`Checkpoint`], or forwarded to the replica its worker is attached
//! to), `RevertActor`, and the stop's checkpoint of every actor.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Status;
use valet_proto::ateapi;

use super::activation::Activation;
use super::checkpoint::{Checkpoint, stop_waits_for};
use super::{Op, OpKind, OpTarget, Plane, aborted, not_found};
use crate::metrics::ResumeHow;
use crate::model::{ActorKey, ActorStatus};
use crate::store::Batch;

/// How soon [`Plane::checkpoint_all`] tries a busy actor again.
pub(crate) const CHECKPOINT_ALL_RETRY: Duration = Duration::from_millis(100);

impl Plane {
    /// `ResumeActor`: see `control-plane.md`. Returns the actor and whether this call
    /// did the activation.
    pub async fn resume_actor(
        &self,
        key: ActorKey,
        wait_for_capacity: Option<Duration>,
    ) -> Result<(ateapi::Actor, bool), Status> {
        self.resume_leased(key, wait_for_capacity, None)
            .await
            .map(|(actor, resumed, _)| (actor, resumed))
    }

    /// [`Self::resume_actor`] for a router that asks for a route lease on the answer
    /// (`holder`: its router id): also returns the lease granted, if any.
    pub async fn resume_leased(
        &self,
        key: ActorKey,
        wait_for_capacity: Option<Duration>,
        holder: Option<&str>,
    ) -> Result<(ateapi::Actor, bool, Option<super::leases::Grant>), Status> {
        let started = Instant::now();
        let stats = &self.inner.stats;
        stats.resume_calls.fetch_add(1, Ordering::Relaxed);
        // Per actor only for actors that exist: a name anyone can send through a
        // router must not grow the plane's memory. Counted under the state's lock, so
        // a delete (which forgets the count after it) cannot land in between.
        {
            let st = self.lock();
            if st.records.contains(&key) {
                *stats
                    .per_actor
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(key.clone())
                    .or_default() += 1;
            }
        }
        self.inner.changed.send_modify(|v| *v += 1);
        let wait = wait_for_capacity.filter(|d| !d.is_zero() && self.config().capacity_wait);
        // A holder renewing its lease routed to the actor at some point in it, which
        // the worker's own reports already told: no activity of its own.
        let renewal = holder.is_some_and(|h| self.lock().holds_lease(&key, h));
        let result = Activation::resume(self, &key, wait, !renewal).await;
        self.metrics().resumed(&result, started.elapsed());
        let (actor, how) = result?;
        let resumed = how == ResumeHow::Activated;
        let grant = holder.and_then(|h| {
            let mut st = self.lock();
            // The answer must still be the record: a caller that joined an activation
            // wakes after its operation ended, and the actor may have moved since
            // (a lease on the old address would outlive every revocation).
            let leasable = st.busy(&key).is_none()
                && st.records.get(&key).is_some_and(|r| {
                    r.status == ActorStatus::Running
                        && r.worker.as_ref().is_some_and(|w| st.workers.contains(w))
                        && {
                            let now = st.to_proto(r);
                            (&now.ateom_pod_name, &now.ateom_pod_ip, now.worker_port)
                                == (
                                    &actor.ateom_pod_name,
                                    &actor.ateom_pod_ip,
                                    actor.worker_port,
                                )
                        }
                });
            if leasable {
                st.grant(&key, h, self.config().route_lease)
            } else {
                None
            }
        });
        Ok((actor, resumed, grant))
    }

    /// `SuspendActor`: RUNNING → SUSPENDING → checkpoint → SUSPENDED, freeing the worker
    /// (a capacity event). A suspended actor is left as it is. With several replicas,
    /// an actor whose worker is attached to another one is suspended there (the
    /// request is forwarded, and its answer awaited).
    pub async fn suspend_actor(&self, key: ActorKey) -> Result<ateapi::Actor, Status> {
        Checkpoint::suspend_anywhere(self, key).await
    }

    /// Suspends every RUNNING actor at once, each waiting for its requests in flight,
    /// until none is left or `timeout` passes; returns the actors still not suspended.
    /// One that another operation holds (an eviction, a restore a parked request
    /// started) or whose requests did not end in time (`Aborted`) is tried again
    /// [`CHECKPOINT_ALL_RETRY`] later; one being restored (or handed a worker) is
    /// suspended once it runs. A resume still queued for capacity is not waited for. A
    /// checkpoint that failed otherwise is not repeated.
    pub async fn checkpoint_all(&self, timeout: Duration) -> Vec<String> {
        use std::collections::{BTreeMap, BTreeSet};
        let deadline = Instant::now() + timeout;
        let mut changes = self.inner.changed.subscribe();
        let mut suspends = tokio::task::JoinSet::new();
        // Actors that needed a checkpoint; those with one under way; when to try one
        // that answered `Aborted` again; those whose checkpoint failed for good.
        let mut seen = BTreeSet::new();
        let mut under_way = BTreeSet::new();
        let mut retry_at: BTreeMap<ActorKey, Instant> = BTreeMap::new();
        let mut failed = BTreeSet::new();
        loop {
            changes.mark_unchanged();
            let todo: Vec<ActorKey> = {
                let st = self.lock();
                st.records
                    .iter()
                    .filter(|(k, r)| {
                        (r.status != ActorStatus::Suspended && r.status != ActorStatus::Crashed)
                            || stop_waits_for(&st, k)
                    })
                    .map(|(k, _)| k.clone())
                    .collect()
            };
            seen.extend(todo.iter().cloned());
            // One that is done by now (suspended by another call) is not tried again.
            retry_at.retain(|k, _| todo.contains(k));
            let now = Instant::now();
            for key in todo {
                if failed.contains(&key)
                    || under_way.contains(&key)
                    || retry_at.get(&key).is_some_and(|at| now < *at)
                {
                    continue;
                }
                retry_at.remove(&key);
                under_way.insert(key.clone());
                let plane = self.clone();
                suspends.spawn(async move {
                    let r = plane.suspend_actor(key.clone()).await;
                    (key, r)
                });
            }
            let next_retry = retry_at.values().min().copied();
            if suspends.is_empty() && next_retry.is_none() {
                break;
            }
            tokio::select! {
                Some(done) = suspends.join_next() => {
                    if let Ok((key, r)) = done {
                        under_way.remove(&key);
                        match r {
                            Ok(_) => {}
                            Err(e) if e.code() == tonic::Code::Aborted => {
                                retry_at.insert(key, Instant::now() + CHECKPOINT_ALL_RETRY);
                            }
                            Err(_) => {
                                failed.insert(key);
                            }
                        }
                    }
                }
                // A change may bring an actor to checkpoint (one restored meanwhile).
                r = changes.changed() => {
                    if r.is_err() {
                        break;
                    }
                }
                () = tokio::time::sleep_until(next_retry.unwrap_or(deadline)), if next_retry.is_some() => {}
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        let st = self.lock();
        seen.iter()
            .filter(|k| {
                st.records
                    .get(k)
                    .is_some_and(|r| r.status != ActorStatus::Suspended || stop_waits_for(&st, k))
            })
            .map(ToString::to_string)
            .collect()
    }

    /// `RevertActor`: CRASHED → SUSPENDED; its next restore starts from the last good
    /// snapshot.
    pub async fn revert_actor(&self, key: ActorKey) -> Result<ateapi::Actor, Status> {
        let revert = Revert {
            plane: self.clone(),
            key,
        };
        self.detached(revert.run()).await
    }
}

/// Reverting a CRASHED actor: SUSPENDED, its next restore from the last good snapshot.
struct Revert {
    plane: Plane,
    key: ActorKey,
}

impl Revert {
    /// In order: the actor checked CRASHED and locked, then recorded SUSPENDED with
    /// its revert pending, the lock released.
    async fn run(self) -> Result<ateapi::Actor, Status> {
        let Revert { plane, key } = self;
        let (op, row) = {
            let mut st = plane.lock();
            let row = st.records.get(&key).ok_or_else(|| not_found(&key))?.clone();
            match st.busy(&key) {
                Some(OpKind::Resuming { .. }) => {
                    return Err(Status::failed_precondition(format!(
                        "actor {key} is STATUS_RESUMING; wait for the resume to finish"
                    )));
                }
                Some(OpKind::Busy(_)) => return Err(aborted()),
                None => {}
            }
            if row.status != ActorStatus::Crashed {
                return Err(Status::failed_precondition(format!(
                    "actor {key} is {}; only CRASHED actors can be reverted",
                    row.status
                )));
            }
            let op = Op::take(
                &plane,
                &mut st,
                OpTarget::Actor(key.clone()),
                OpKind::Busy("reverting"),
            );
            (op, row)
        };
        let mut reverted = row.moved(ActorStatus::Suspended, None);
        reverted.revert_pending = true;
        plane
            .ledger()
            .finish(op, Batch::put([reverted.clone()]))
            .await?;
        Ok(plane.lock().to_proto(&reverted))
    }
}
