//! An actor's life on a worker: resume (claim a worker, restore, RUNNING), suspend
//! (checkpoint, free the worker), revert, and settling an actor an earlier operation
//! left half-way (a write that failed after the worker acted).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tonic::Status;
use valet_proto::ateapi;
use valet_proto::worker::{self as wk, worker_command::Command};

use super::capacity::{Handed, Reservation, Ticket};
use super::replicas::Observed;

/// Whether a stop's [`Plane::checkpoint_all`] waits for a SUSPENDED actor held by
/// `op`: one about to run (a resume handed a worker, writing its claim), yes; one still
/// queued for capacity, no (it may never get a worker, and the plane's shutdown answers
/// it), nor one another operation holds that leaves it suspended.
fn stop_waits_for(st: &super::State, key: &ActorKey) -> bool {
    match st.busy(key) {
        Some(OpKind::Resuming {
            joinable: false, ..
        }) => true,
        // Handed a worker (reserved under the lock) before its task has run.
        Some(OpKind::Resuming { .. }) => st.workers.reserved_for(key),
        _ => false,
    }
}

/// How soon [`Plane::checkpoint_all`] tries a busy actor again.
pub(crate) const CHECKPOINT_ALL_RETRY: Duration = Duration::from_millis(100);
use super::op::CapacityWait;
use super::{
    Op, OpKind, OpTarget, Outcome, Plane, aborted, crashed, no_room, not_found, shutting_down,
    slot_of,
};
use crate::link::LinkError;
use crate::metrics::ResumeHow;
use crate::model::{ActorKey, ActorStatus, Template};
use crate::store::{ActorRow, Batch};

/// The longest capacity wait honoured (`wait_for_capacity` comes from any client).
const MAX_CAPACITY_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// How a resume gets its worker.
enum Start {
    Reserved(Reservation),
    Queued(Ticket),
}

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

/// Why a resume's activation produced no outcome.
enum NoOutcome {
    /// Every caller left while it waited for capacity.
    CallersLeft,
}

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
        let result = self.resume(&key, wait, !renewal).await;
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

    /// Resumes `key`; a running actor's idle clock restarts when `activity`.
    async fn resume(
        &self,
        key: &ActorKey,
        wait: Option<Duration>,
        activity: bool,
    ) -> Result<(ateapi::Actor, ResumeHow), Status> {
        // This call's own deadline for capacity, kept across joins: "up to the given
        // duration" from its arrival.
        // A wait from the wire may be past what the clock holds: a year is as good.
        let mine = wait.map(|d| Instant::now() + d.min(MAX_CAPACITY_WAIT));
        // A resume that joined a wait whose callers all left just before it joined
        // finds no outcome: it starts over (once more at most).
        let mut abandoned = 0;
        loop {
            // Only the call that started the activation did it (`resumed`); one that
            // joined it shares its outcome otherwise.
            let (mut outcome, capacity, deadline, joined) = {
                let mut st = self.lock();
                let row = st.records.get(key).ok_or_else(|| not_found(key))?;
                match st.busy(key) {
                    Some(OpKind::Resuming {
                        outcome,
                        joinable: true,
                        capacity,
                    }) => {
                        // A call that waits keeps the activation in the queue as long
                        // as it waits itself; one that does not joins the wait as it is.
                        let deadline = match mine {
                            Some(m) => {
                                capacity.send_modify(|c| c.extend(m));
                                Some(m)
                            }
                            None => capacity.borrow().until,
                        };
                        (outcome.subscribe(), Arc::clone(capacity), deadline, true)
                    }
                    Some(_) => return Err(aborted()),
                    None => match row.status {
                        ActorStatus::Running => {
                            if !st.serving(row, self.config().hosting_lease) {
                                return Err(Status::unavailable(format!(
                                    "the worker of actor {key} is not attached, or not renewing its hosting"
                                )));
                            }
                            let actor = st.to_proto(row);
                            if activity {
                                st.signals.touch(key);
                            }
                            return Ok((actor, ResumeHow::Running));
                        }
                        ActorStatus::Crashed => return Err(crashed()),
                        ActorStatus::Suspended
                        | ActorStatus::Resuming
                        | ActorStatus::Suspending => {
                            if self.is_shutting_down() {
                                return Err(shutting_down());
                            }
                            // Another replica's operation holds it (several replicas).
                            if st.held_elsewhere(row) {
                                return Err(aborted());
                            }
                            // A call that may not wait queues briefly all the same when
                            // only another replica has a free worker: that one hands it
                            // over.
                            let mine = mine.or_else(|| {
                                (st.free_worker(&row.pool).is_none()
                                    && st.free_elsewhere(&row.pool))
                                .then(|| Instant::now() + super::replicas::HAND_OVER_WAIT)
                            });
                            let tx = Arc::new(watch::Sender::new(None));
                            let rx = tx.subscribe();
                            let capacity = Arc::new(watch::Sender::new(CapacityWait {
                                until: mine,
                                ..CapacityWait::default()
                            }));
                            let op = Op::take(
                                self,
                                &mut st,
                                OpTarget::Actor(key.clone()),
                                OpKind::Resuming {
                                    outcome: Arc::clone(&tx),
                                    joinable: true,
                                    capacity: Arc::clone(&capacity),
                                },
                            );
                            drop(st);
                            self.spawn_activation(op, key.clone(), Arc::clone(&capacity), tx);
                            (rx, capacity, mine, false)
                        }
                    },
                }
            };
            if let Some(o) = outcome_within(&mut outcome, &capacity, deadline, !joined).await {
                if !joined {
                    return o.map(|(actor, _)| (actor, ResumeHow::Activated));
                }
                if o.is_ok() && capacity.send_if_modified(|c| std::mem::take(&mut c.handed_over)) {
                    return o.map(|(actor, _)| (actor, ResumeHow::Activated));
                }
                // A call that may wait for capacity and joined an activation that was
                // refused just before (no caller waited then) asks again, within its
                // own deadline, and waits in the queue itself.
                if mine.is_some_and(|m| m > Instant::now())
                    && o.as_ref()
                        .is_err_and(|e| e.code() == tonic::Code::ResourceExhausted)
                {
                    continue;
                }
                return o.map(|(actor, _)| (actor, ResumeHow::Joined));
            }
            abandoned += 1;
            if abandoned == 2 {
                return Err(Status::unavailable(format!(
                    "the resume of actor {key} was abandoned; try again"
                )));
            }
        }
    }

    fn spawn_activation(
        &self,
        op: Op,
        key: ActorKey,
        capacity: Arc<watch::Sender<CapacityWait>>,
        tx: Arc<watch::Sender<Option<Outcome>>>,
    ) {
        let plane = self.clone();
        self.inner.tasks.spawn(async move {
            // The operation lock is released inside, before the outcome is published,
            // so a caller that sees it can operate on the actor at once.
            if let Ok(outcome) = plane.activate(op, &key, &capacity, &tx).await {
                tx.send_replace(Some(outcome));
            }
        });
    }

    /// One activation: settle what an earlier operation left half-way, get a worker
    /// (free, or handed over from the queue), claim it durably, restore, and record the
    /// result.
    async fn activate(
        &self,
        op: Op,
        key: &ActorKey,
        capacity: &watch::Sender<CapacityWait>,
        tx: &watch::Sender<Option<Outcome>>,
    ) -> Result<Outcome, NoOutcome> {
        let Some(row) = self.lock().records.get(key).cloned() else {
            return Ok(Err(not_found(key)));
        };
        let row = if row.status.is_transitional() {
            match self.settle(&op, row).await {
                Ok(r) => r,
                Err(e) => return Ok(Err(e)),
            }
        } else {
            row
        };
        // Again when the actor's resume on another replica ended while its callers
        // here still wait (several replicas).
        let mut op = op;
        let reservation = loop {
            let start = {
                let mut st = self.lock();
                // Copied out: a borrow held into the arm would deadlock its `send_modify`.
                let until = capacity.borrow().until;
                match st.free_worker(&row.pool) {
                    Some(w) => Start::Reserved(self.reserve(&mut st, &w, key)),
                    None => match until {
                        Some(_) => {
                            capacity.send_modify(|c| c.queued = true);
                            Start::Queued(self.enqueue(&mut st, &row.pool, key))
                        }
                        None => {
                            st.signals.refused(key, &row.pool);
                            drop(st);
                            self.wake_policies();
                            return Ok(Err(no_room()));
                        }
                    },
                }
            };
            if matches!(start, Start::Queued(..)) {
                self.wake_policies();
            }
            let mut ticket = match start {
                Start::Reserved(r) => break r,
                Start::Queued(ticket) => ticket,
            };
            // Until the latest deadline of the callers that wait (a caller that
            // joins later may extend it).
            let mut until = capacity.subscribe();
            let handed = loop {
                let Some(deadline) = until.borrow_and_update().until else {
                    break None;
                };
                tokio::select! {
                    r = ticket.handed() => break r,
                    () = tokio::time::sleep_until(deadline) => {
                        if capacity.borrow().until.is_none_or(|u| u <= deadline) {
                            break None;
                        }
                    }
                    _ = until.changed() => {}
                    () = tx.closed() => return Err(NoOutcome::CallersLeft),
                    () = self.inner.shutdown.cancelled() => return Ok(Err(shutting_down())),
                }
            };
            capacity.send_modify(|c| c.queued = false);
            match handed {
                Some(Handed::Worker(r)) => break r,
                Some(Handed::Failed(e)) => return Ok(Err(e)),
                Some(Handed::Elsewhere { queued, replicas }) => {
                    drop(ticket);
                    // The operation is another replica's (it restores the actor, or
                    // queued it first): the lock goes, so that this replica's
                    // hand-offs may claim the actor for that replica's waiter.
                    let kind = self.lock().busy(key).cloned();
                    drop(op);
                    match replicas.observe(self, key, queued, capacity, tx).await {
                        Observed::Done(outcome) => return Ok(*outcome),
                        Observed::Again => {
                            let mut st = self.lock();
                            let (Some(kind), None) = (kind, st.busy(key)) else {
                                return Ok(Err(aborted()));
                            };
                            op = Op::take(self, &mut st, OpTarget::Actor(key.clone()), kind);
                            continue;
                        }
                    }
                }
                None => return Ok(Err(no_room())),
            }
        };
        op.stop_joining();
        let claimed = row.moved(ActorStatus::Resuming, Some(reservation.worker().to_owned()));
        if let Err(e) = self.step(&op, Batch::put([claimed.clone()])).await {
            // The reservation passes the worker on as it drops.
            return Ok(Err(e));
        }
        self.inner.stats.activations.fetch_add(1, Ordering::Relaxed);
        reservation.claimed();
        self.lock().signals.served(key);
        let started = Instant::now();
        let result = self.restore(key, &claimed, op.id()).await;
        self.metrics().operation("restore", started.elapsed());
        Ok(self.after_restore(op, key, claimed, result, tx).await)
    }

    /// Restores `key` on its worker for operation `op`: not if the worker attached
    /// again, without the actor, since `op` claimed it (see `WorkerRec::not_kept`).
    pub(super) async fn restore(
        &self,
        key: &ActorKey,
        row: &ActorRow,
        op: u64,
    ) -> Result<u64, LinkError> {
        let worker = row.worker.clone().unwrap_or_default();
        let Some(link) = self
            .lock()
            .workers
            .get(&worker)
            .filter(|w| w.serves_op(key, op))
            .map(|w| Arc::clone(w.link()))
        else {
            return Err(LinkError::Gone);
        };
        let app = self
            .template(&row.template)
            .map_or("counter", |t| t.builtin().map_or("", |b| b.name()))
            .to_owned();
        let cmd = Command::Restore(wk::Restore {
            actor: Some(slot_of(key, row)),
            revert: row.revert_pending,
            app,
            template: row.template.clone(),
            snapshot: row.snapshot.clone(),
        });
        link.call(cmd, self.config().restore_timeout)
            .await
            .map(|reply| reply.id)
    }

    pub(super) async fn after_restore(
        &self,
        op: Op,
        key: &ActorKey,
        claimed: ActorRow,
        result: Result<u64, LinkError>,
        tx: &watch::Sender<Option<Outcome>>,
    ) -> Outcome {
        let worker = claimed.worker.clone().unwrap_or_default();
        match result {
            Ok(restore_id) => {
                let mut running = claimed.moved(ActorStatus::Running, claimed.worker.clone());
                running.revert_pending = false;
                self.lock().signals.restored(key);
                self.finish(op, Batch::put([running.clone()])).await?;
                tracing::info!(actor = %key, worker, "actor RUNNING");
                // Its worker may have left while that was written: there is no
                // address to answer; its departure releases the actor, and the
                // caller asks again.
                let mut st = self.lock();
                if !st.workers.runs(&worker, restore_id) {
                    return Err(Status::unavailable(format!(
                        "the worker of actor {key} went away as it was restored"
                    )));
                }
                Ok((st.to_proto(&running), true))
            }
            Err(LinkError::Gone) => {
                tracing::warn!(actor = %key, worker, "worker went away during restore");
                let gone =
                    Status::unavailable(format!("the worker restoring actor {key} went away"));
                // It may have installed the actor before its stream ended: not
                // elsewhere before it has fenced it (at once when its process is gone
                // or it attaches again; else a hosting lease after its last renewal).
                // The callers are answered now and ask again; the operation holds the
                // actor meanwhile. At shutdown the record stays RESUMING, which the
                // next start settles.
                tx.send_replace(Some(Err(gone.clone())));
                if !self.until_fenced(&worker).await {
                    return Err(shutting_down());
                }
                let back = claimed.moved(ActorStatus::Suspended, None);
                self.finish(op, Batch::put([back])).await?;
                Err(gone)
            }
            Err(e) => {
                tracing::warn!(actor = %key, worker, error = %e, "restore failed; actor CRASHED");
                self.evict(&worker, key, &claimed);
                let crashed_row = claimed.crashed(&e.to_string());
                self.finish(op, Batch::put([crashed_row])).await?;
                Err(crashed())
            }
        }
    }

    /// Tells `worker` to drop `key`, if it is attached (no answer awaited).
    pub(super) fn evict(&self, worker: &str, key: &ActorKey, row: &ActorRow) {
        if let Some(w) = self.lock().workers.get(worker) {
            w.link().notify(Command::Evict(wk::Evict {
                actor: Some(slot_of(key, row)),
            }));
        }
    }

    /// Settles every actor left RESUMING or SUSPENDING with no operation on it (a
    /// failed write ended its operation); whether all are settled now.
    pub(super) async fn settle_half_way(&self) -> bool {
        let left: Vec<ActorKey> = self
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
                let mut st = self.lock();
                match st.records.get(&key) {
                    Some(r)
                        if r.status.is_transitional()
                            && st.busy(&key).is_none()
                            && !st.held_elsewhere(r) =>
                    {
                        let row = r.clone();
                        let op = Op::take(
                            self,
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
                r = self.settle(&op, row) => r.is_ok(),
                () = self.inner.shutdown.cancelled() => return false,
            };
            settled &= done;
        }
        settled
    }

    /// An actor an earlier operation left half-way (RESUMING or SUSPENDING with no
    /// operation on it: a write failed after the worker acted) goes back to SUSPENDED
    /// from its last snapshot, as a restart would do, freeing its worker.
    async fn settle(&self, op: &Op, row: ActorRow) -> Result<ActorRow, Status> {
        let key = row.key();
        self.revoke_leases(&key).await;
        if let Some(worker) = &row.worker {
            self.evict(worker, &key, &row);
            // A worker that is not attached is not told: not elsewhere before it has
            // fenced the actor.
            if !self.until_fenced(worker).await {
                return Err(shutting_down());
            }
        }
        let back = row.moved(ActorStatus::Suspended, None);
        self.step(op, Batch::put([back.clone()])).await?;
        tracing::warn!(actor = %key, was = %row.status, "actor left half-way by an earlier operation; back to SUSPENDED from its last snapshot");
        Ok(back)
    }

    /// `SuspendActor`: RUNNING → SUSPENDING → checkpoint → SUSPENDED, freeing the worker
    /// (a capacity event). A suspended actor is left as it is. With several replicas,
    /// an actor whose worker is attached to another one is suspended there (the
    /// request is forwarded, and its answer awaited).
    pub async fn suspend_actor(&self, key: ActorKey) -> Result<ateapi::Actor, Status> {
        let worker = {
            let st = self.lock();
            st.records
                .get(&key)
                .filter(|r| r.status == ActorStatus::Running && st.busy(&key).is_none())
                .and_then(|r| r.worker.clone())
        };
        if let Some(w) = worker
            && let Some(done) = self.inner.peers.suspend_elsewhere(self, &key, &w).await
        {
            return done;
        }
        self.suspend_here(key).await
    }

    /// [`Self::suspend_actor`] on this replica: a suspend forwarded here. An actor whose
    /// worker is attached to another replica by now is `Aborted` (the caller asks
    /// again, and is forwarded there).
    pub(super) async fn suspend_here(&self, key: ActorKey) -> Result<ateapi::Actor, Status> {
        let plane = self.clone();
        self.detached(async move {
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
                let back = plane.settle(&op, row).await?;
                drop(op);
                return Ok(plane.lock().to_proto(&back));
            }
            let ended = plane.checkpoint_actor(op, &key, row, Fence::WaitIdle).await;
            plane.metrics().operation("suspend", started.elapsed());
            match ended {
                Checkpointed::Suspended(actor) => Ok(*actor),
                Checkpointed::Failed(e) => Err(e),
                // Aborted: the caller may try again (a drain does, in its next round).
                Checkpointed::Busy => Err(Status::aborted(format!(
                    "actor {key} is busy: its requests in flight did not end within {}s; it keeps running",
                    plane.idle_wait().as_secs_f64()
                ))),
                Checkpointed::Refused(why) => Err(Status::failed_precondition(why)),
            }
        })
        .await
    }

    /// Checkpoints RUNNING `row` under `op`: SUSPENDING, the worker's checkpoint fenced
    /// as `fence`, then SUSPENDED with its worker freed; CRASHED when the checkpoint
    /// fails; back to RUNNING when a policy's checkpoint finds the actor busy.
    pub(super) async fn checkpoint_actor(
        &self,
        op: Op,
        key: &ActorKey,
        row: ActorRow,
        fence: Fence,
    ) -> Checkpointed {
        self.revoke_leases(key).await;
        let suspending = row.moved(ActorStatus::Suspending, row.worker.clone());
        if let Err(e) = self.step(&op, Batch::put([suspending.clone()])).await {
            return Checkpointed::Failed(e);
        }
        let mut result = self.checkpoint(key, &suspending, fence).await;
        // Its worker's stream is gone (before or during the checkpoint): should it
        // attach again still hosting the actor, the checkpoint goes over the new stream
        // rather than the actor going back to its last snapshot.
        let worker = suspending.worker.clone().unwrap_or_default();
        if matches!(result, Err(LinkError::Gone)) && self.reattached_hosting(key, &worker).await {
            result = self.checkpoint(key, &suspending, fence).await;
        }
        if matches!(result, Err(LinkError::Busy | LinkError::StillRunning(_))) {
            let back = suspending.moved(ActorStatus::Running, suspending.worker.clone());
            self.lock().signals.touch(key);
            // The actor runs on: a failed write must not leave it SUSPENDING, which
            // the settler would take back to its last snapshot, evicting it with its
            // requests in flight and everything it did since.
            let Some(freed) = self.write_until_landed(Batch::put([back])).await else {
                // The plane stops, or another replica changed the record (its to
                // settle now).
                return Checkpointed::Failed(if self.is_shutting_down() {
                    shutting_down()
                } else {
                    Status::aborted(
                        "the actor's record changed on another control-plane replica; try again",
                    )
                });
            };
            drop(op);
            self.hand_off_all(freed);
            return match result {
                Err(LinkError::StillRunning(why)) => {
                    tracing::warn!(actor = %key, worker, %why, "checkpoint failed; the actor keeps running");
                    Checkpointed::Refused(why)
                }
                _ => Checkpointed::Busy,
            };
        }
        match self.after_checkpoint(op, key, suspending, result).await {
            Ok(actor) => Checkpointed::Suspended(Box::new(actor)),
            Err(e) => Checkpointed::Failed(e),
        }
    }

    /// How long an explicit suspend's checkpoint waits for the actor's requests in
    /// flight to end before the worker answers busy: half `--checkpoint-timeout`, so
    /// that the answer comes well within it.
    pub(super) fn idle_wait(&self) -> Duration {
        self.config().checkpoint_timeout / 2
    }

    async fn checkpoint(
        &self,
        key: &ActorKey,
        row: &ActorRow,
        fence: Fence,
    ) -> Result<wk::Reply, LinkError> {
        let worker = row.worker.clone().unwrap_or_default();
        let Some(link) = self
            .lock()
            .workers
            .get(&worker)
            .map(|w| Arc::clone(w.link()))
        else {
            return Err(LinkError::Gone);
        };
        let full = self
            .template(&row.template)
            .is_some_and(Template::full_snapshot);
        let (fence, idle_wait) = match fence {
            Fence::WaitIdle => (
                wk::checkpoint::Fence::WaitIdle(true),
                self.idle_wait().try_into().ok(),
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
        link.call(cmd, self.config().checkpoint_timeout).await
    }

    async fn after_checkpoint(
        &self,
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
                self.finish(op, Batch::put([done.clone()])).await?;
                Ok(self.lock().to_proto(&done))
            }
            Ok(_) | Err(LinkError::Gone) => {
                if result.is_err() {
                    tracing::warn!(actor = %key, worker, "worker went away during checkpoint; actor back to its last snapshot");
                    // It may still serve the actor (only its stream may be cut): not
                    // elsewhere before it has fenced it. At shutdown the record stays
                    // SUSPENDING, which the next start settles.
                    if !self.until_fenced(&worker).await {
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
                self.finish(op, Batch::put([done.clone()])).await?;
                tracing::info!(actor = %key, worker, snapshot = %done.snapshot, "actor SUSPENDED");
                Ok(self.lock().to_proto(&done))
            }
            Err(e) => {
                tracing::warn!(actor = %key, worker, error = %e, "checkpoint failed; actor CRASHED");
                self.evict(&worker, key, &suspending);
                let done = suspending.crashed(&e.to_string());
                self.finish(op, Batch::put([done])).await?;
                Err(Status::internal(format!(
                    "checkpoint of actor {key} failed: {e}"
                )))
            }
        }
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
        let plane = self.clone();
        self.detached(async move {
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
            plane.finish(op, Batch::put([reverted.clone()])).await?;
            Ok(plane.lock().to_proto(&reverted))
        })
        .await
    }
}

/// Waits for an activation's outcome. Past `deadline` (`None`: the caller does not
/// wait), while the activation waits in its pool's queue, the caller leaves with
/// `ResourceExhausted`: the activation goes on for callers that wait longer (the one
/// that `started` it hands that over to them). `None` when every caller left before
/// it ended.
async fn outcome_within(
    outcome: &mut watch::Receiver<Option<Outcome>>,
    capacity: &watch::Sender<CapacityWait>,
    deadline: Option<Instant>,
    started: bool,
) -> Option<Outcome> {
    let mut seen = capacity.subscribe();
    let expired = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now));
    tokio::pin!(expired);
    let mut past = false;
    loop {
        if past && seen.borrow_and_update().queued {
            if started {
                capacity.send_modify(|c| c.handed_over = true);
            }
            return Some(Err(no_room()));
        }
        tokio::select! {
            biased;
            o = outcome.wait_for(Option::is_some) => {
                return o.ok().map(|o| o.clone().expect("waited for Some"));
            }
            () = &mut expired, if !past => past = true,
            // Never closed: this caller holds the sender too.
            _ = seen.changed(), if past => {}
        }
    }
}
