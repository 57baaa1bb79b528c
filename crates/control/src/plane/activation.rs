//! Activation: a resume of a suspended actor, from its callers' wait to RUNNING on a
//! worker. [`Activation::resume`] joins the activation in progress or starts one;
//! [`Activation::run`] holds the order of its steps (settle what an earlier operation
//! left half-way, get a worker, claim it durably, restore); [`Restore`] holds the
//! order of the last two (tell the worker, record what came of it).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tonic::Status;
use valet_proto::ateapi;
use valet_proto::worker::{self as wk, worker_command::Command};

use super::capacity::{Handed, Reservation, Ticket};
use super::peers::Observed;
use super::settle::Settle;
use super::wait::CapacityWait;
use super::{
    Op, OpKind, OpTarget, Outcome, Plane, aborted, crashed, no_room, not_found, shutting_down,
    slot_of,
};
use crate::link::LinkError;
use crate::metrics::ResumeHow;
use crate::model::{ActorKey, ActorStatus};
use crate::store::{ActorRow, Batch};

/// The longest capacity wait honoured (`wait_for_capacity` comes from any client).
const MAX_CAPACITY_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// How a resume gets its worker.
enum Start {
    Reserved(Reservation),
    Queued(Ticket),
}

/// Why a resume's activation produced no outcome.
enum NoOutcome {
    /// Every caller left while it waited for capacity.
    CallersLeft,
}

/// One activation of a suspended actor, shared by the resumes that join it while it
/// waits for capacity.
pub(super) struct Activation {
    plane: Plane,
    /// The actor's operation lock, `Resuming`.
    op: Op,
    key: ActorKey,
    /// How long its callers wait for capacity.
    capacity: Arc<watch::Sender<CapacityWait>>,
    /// Its outcome, for every caller.
    tx: Arc<watch::Sender<Option<Outcome>>>,
}

impl Activation {
    /// Resumes `key`; a running actor's idle clock restarts when `activity`.
    pub(super) async fn resume(
        plane: &Plane,
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
                let mut st = plane.lock();
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
                            if !st.serving(row, plane.config().hosting_lease) {
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
                            if plane.is_shutting_down() {
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
                                    && st.replicas.free_elsewhere(&row.pool, &st.records))
                                .then(|| Instant::now() + super::replicas::known::HAND_OVER_WAIT)
                            });
                            let tx = Arc::new(watch::Sender::new(None));
                            let rx = tx.subscribe();
                            let capacity = Arc::new(watch::Sender::new(CapacityWait {
                                until: mine,
                                ..CapacityWait::default()
                            }));
                            let op = Op::take(
                                plane,
                                &mut st,
                                OpTarget::Actor(key.clone()),
                                OpKind::Resuming {
                                    outcome: Arc::clone(&tx),
                                    joinable: true,
                                    capacity: Arc::clone(&capacity),
                                },
                            );
                            drop(st);
                            Activation {
                                plane: plane.clone(),
                                op,
                                key: key.clone(),
                                capacity: Arc::clone(&capacity),
                                tx,
                            }
                            .spawn();
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

    /// Runs on the plane's task tracker. The operation lock is released inside,
    /// before the outcome is published, so a caller that sees it can operate on the
    /// actor at once.
    fn spawn(self) {
        let tx = Arc::clone(&self.tx);
        self.plane.inner.tasks.clone().spawn(async move {
            if let Ok(outcome) = self.run().await {
                tx.send_replace(Some(outcome));
            }
        });
    }

    /// The activation, in order: settle what an earlier operation left half-way, get
    /// a worker (free, or handed over from the queue), claim it durably, restore, and
    /// record the result.
    async fn run(self) -> Result<Outcome, NoOutcome> {
        let Activation {
            plane,
            op,
            key,
            capacity,
            tx,
        } = self;
        let (key, capacity, tx) = (&key, &*capacity, &*tx);
        let Some(row) = plane.lock().records.get(key).cloned() else {
            return Ok(Err(not_found(key)));
        };
        let row = if row.status.is_transitional() {
            match Settle::new(&plane, &op, row).run().await {
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
                let mut st = plane.lock();
                // Copied out: a borrow held into the arm would deadlock its `send_modify`.
                let until = capacity.borrow().until;
                match st.free_worker(&row.pool) {
                    Some(w) => Start::Reserved(plane.capacity().reserve(&mut st, &w, key)),
                    None => match until {
                        Some(_) => {
                            capacity.send_modify(|c| c.queued = true);
                            Start::Queued(plane.capacity().enqueue(&mut st, &row.pool, key))
                        }
                        None => {
                            st.signals.refused(key, &row.pool);
                            drop(st);
                            plane.wake_policies();
                            return Ok(Err(no_room()));
                        }
                    },
                }
            };
            if matches!(start, Start::Queued(..)) {
                plane.wake_policies();
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
                    () = plane.inner.shutdown.cancelled() => return Ok(Err(shutting_down())),
                }
            };
            capacity.send_modify(|c| c.queued = false);
            match handed {
                Some(Handed::Worker(r)) => break r,
                Some(Handed::Failed(e)) => return Ok(Err(e)),
                Some(Handed::Elsewhere { queued, on }) => {
                    drop(ticket);
                    // The operation is another replica's (it restores the actor, or
                    // queued it first): the lock goes, so that this replica's
                    // hand-offs may claim the actor for that replica's waiter.
                    let kind = plane.lock().busy(key).cloned();
                    drop(op);
                    match on.observe(&plane, key, queued, capacity, tx).await {
                        Observed::Done(outcome) => return Ok(*outcome),
                        Observed::Again => {
                            let mut st = plane.lock();
                            let (Some(kind), None) = (kind, st.busy(key)) else {
                                return Ok(Err(aborted()));
                            };
                            op = Op::take(&plane, &mut st, OpTarget::Actor(key.clone()), kind);
                            continue;
                        }
                    }
                }
                None => return Ok(Err(no_room())),
            }
        };
        op.stop_joining();
        let claimed = row.moved(ActorStatus::Resuming, Some(reservation.worker().to_owned()));
        if let Err(e) = plane
            .ledger()
            .step(&op, Batch::put([claimed.clone()]))
            .await
        {
            // The reservation passes the worker on as it drops.
            return Ok(Err(e));
        }
        plane
            .inner
            .stats
            .activations
            .fetch_add(1, Ordering::Relaxed);
        reservation.claimed();
        plane.lock().signals.served(key);
        let started = Instant::now();
        let restore = Restore {
            plane: plane.clone(),
            op,
            key: key.clone(),
            claimed,
        };
        Ok(restore.run(tx, started).await)
    }
}

/// Restoring an actor whose claim on its worker is durable (RESUMING there), under its
/// operation lock: the worker is told, then what came of it is recorded.
pub(super) struct Restore {
    pub(super) plane: Plane,
    pub(super) op: Op,
    pub(super) key: ActorKey,
    /// Its record, RESUMING on the worker.
    pub(super) claimed: ActorRow,
}

impl Restore {
    /// Restores, then records the outcome (`started`: when, for the metrics); `tx`
    /// hears an early answer when the worker went away.
    pub(super) async fn run(
        self,
        tx: &watch::Sender<Option<Outcome>>,
        started: Instant,
    ) -> Outcome {
        let result = self.call().await;
        self.plane.metrics().operation("restore", started.elapsed());
        self.record(result, tx).await
    }

    /// Tells the worker to restore: not if it attached again, without the actor,
    /// since this operation claimed it (see `WorkerRec::serves_op`).
    async fn call(&self) -> Result<u64, LinkError> {
        let (plane, key, row, op) = (&self.plane, &self.key, &self.claimed, self.op.id());
        let worker = row.worker.clone().unwrap_or_default();
        let Some(link) = plane
            .lock()
            .workers
            .get(&worker)
            .filter(|w| w.serves_op(key, op))
            .map(|w| Arc::clone(w.link()))
        else {
            return Err(LinkError::Gone);
        };
        let app = plane
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
        link.call(cmd, plane.config().restore_timeout)
            .await
            .map(|reply| reply.id)
    }

    /// Records what the worker's answer comes to: RUNNING; back to SUSPENDED once a
    /// worker that went away has fenced the actor; or CRASHED.
    async fn record(
        self,
        result: Result<u64, LinkError>,
        tx: &watch::Sender<Option<Outcome>>,
    ) -> Outcome {
        let Restore {
            plane,
            op,
            key,
            claimed,
        } = self;
        let key = &key;
        let worker = claimed.worker.clone().unwrap_or_default();
        match result {
            Ok(restore_id) => {
                let mut running = claimed.moved(ActorStatus::Running, claimed.worker.clone());
                running.revert_pending = false;
                plane.lock().signals.restored(key);
                plane
                    .ledger()
                    .finish(op, Batch::put([running.clone()]))
                    .await?;
                tracing::info!(actor = %key, worker, "actor RUNNING");
                // Its worker may have left while that was written: there is no
                // address to answer; its departure releases the actor, and the
                // caller asks again.
                let mut st = plane.lock();
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
                if !super::fencing::until_fenced(&plane, &worker).await {
                    return Err(shutting_down());
                }
                let back = claimed.moved(ActorStatus::Suspended, None);
                plane.ledger().finish(op, Batch::put([back])).await?;
                Err(gone)
            }
            Err(e) => {
                tracing::warn!(actor = %key, worker, error = %e, "restore failed; actor CRASHED");
                plane.lock().workers.evict(&worker, key, &claimed);
                let crashed_row = claimed.crashed(&e.to_string());
                plane.ledger().finish(op, Batch::put([crashed_row])).await?;
                Err(crashed())
            }
        }
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
