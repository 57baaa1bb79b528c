//! Workers joining and leaving their pools, and the rejoin grace after a restart.
//!
//! A worker that leaves (its stream ended) takes nothing with it: its actor goes back
//! to SUSPENDED from its last snapshot through an operation of its own, unless an
//! operation on that actor is in progress (which then sees the worker gone).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tonic::Status;
use valet_proto::ateapi;
use valet_proto::worker::{self as wk, worker_command::Command};

use super::checkpoint::Checkpoint;
use super::release::{Ending, Release};
use super::workers::Joined;
use super::{Op, OpTarget, Plane, Slot, State};
use crate::link::WorkerLink;
use crate::model::{self, ActorKey, ActorStatus, NAMESPACE};
use crate::store::ActorRow;

/// How many times a drain suspends (or waits for) the actor on its worker before it
/// tells the worker to stop all the same.
const DRAIN_ROUNDS: usize = 4;

/// The workers' side of the plane: their streams' joins, reports and departures,
/// and the list of workers. Obtained with [`Plane::membership`].
#[derive(Debug, Clone, Copy)]
pub struct Membership<'a> {
    plane: &'a Plane,
}

impl Plane {
    /// The workers' side of the plane.
    pub fn membership(&self) -> Membership<'_> {
        Membership { plane: self }
    }
}

impl Membership<'_> {
    /// A worker attached (or re-attached) over its stream: recorded for the other
    /// replicas first and joined there, if any ([`super::peers::Peers::attach`]);
    /// else [`Self::worker_joined`].
    pub(crate) async fn worker_attached(
        &self,
        join: &wk::Join,
        link: Arc<WorkerLink>,
    ) -> Result<bool, Status> {
        let plane = self.plane;
        match plane
            .inner
            .peers
            .attach(plane, join, Arc::clone(&link))
            .await
        {
            Some(joined) => joined,
            None => self.worker_joined(join, link),
        }
    }

    /// A worker attached (or re-attached). Returns whether it keeps the actor it
    /// reported; one it may not keep is evicted.
    pub(crate) fn worker_joined(
        &self,
        join: &wk::Join,
        link: Arc<WorkerLink>,
    ) -> Result<bool, Status> {
        let plane = self.plane;
        Join {
            plane,
            join,
            link,
            veto: false,
            attach: 0,
        }
        .run()
    }

    /// `worker` (on its stream `link`) reports that the program of the actor it hosted
    /// exited by itself (it hosts it no more): the actor is CRASHED, with its exit
    /// status and last output, and the worker free, once no operation holds the
    /// actor. Not if the records place the actor elsewhere by then.
    pub(crate) fn actor_exited(&self, worker: &str, link: &Arc<WorkerLink>, exited: &wk::Exited) {
        let plane = self.plane;
        let Some(slot) = &exited.actor else { return };
        let Ok(key) = ActorKey::new(&slot.atespace, &slot.name) else {
            return;
        };
        let current = plane.lock().workers.get(worker).is_some_and(|w| w.on(link));
        if !current {
            return;
        }
        // The report is of the run the Restore it names started: not of another run of
        // the actor restored on this worker since (an operation may have freed the
        // worker before the report came). Decided once no operation holds the actor:
        // the restore that started the run may still be writing its answer.
        let run = exited.restore;
        let reason = if exited.output.trim().is_empty() {
            format!("its program {}", exited.status)
        } else {
            format!(
                "its program {}; its last output:\n{}",
                exited.status, exited.output
            )
        };
        tracing::warn!(actor = %key, worker, status = %exited.status, "the actor's program exited on its worker");
        let tasks = plane.inner.tasks.clone();
        let plane = plane.clone();
        let worker = worker.to_owned();
        let link = Arc::clone(link);
        tasks.spawn(async move {
            let still = |st: &State| {
                st.workers
                    .get(&worker)
                    .is_some_and(|w| w.on(&link) && w.hosting_restore() == run)
            };
            Release::once_idle(&plane, &key, &worker, still, Ending::Crash(reason)).await;
        });
    }

    /// `worker` (on its current stream `link`) is stopping and asked to drain: it gets
    /// no new actor from now on, the actor it hosts is checkpointed as `SuspendActor`
    /// does (its requests in flight end first; the actor is SUSPENDED from that fresh
    /// snapshot, not reverted to an older one), and then it is told `Drained`.
    pub(crate) fn worker_draining(&self, worker: &str, link: &Arc<WorkerLink>) {
        let plane = self.plane;
        {
            let mut st = plane.lock();
            let Some(pool) = st.workers.drain(worker, link) else {
                return;
            };
            tracing::info!(worker, %pool, "worker draining: checkpointing its actor, giving it no new one");
        }
        plane.inner.peers.worker_draining(worker);
        Drain::spawn(plane, worker, Arc::clone(link));
    }

    /// A hosting renewal from `worker` (on its current stream `link`).
    pub(crate) fn renewed(&self, worker: &str, link: &Arc<WorkerLink>) -> bool {
        let plane = self.plane;
        plane.lock().workers.renewed(worker, link)
    }

    /// A worker's stream ended: the pool shrinks. Its actor may still be served by the
    /// worker (only the stream may be cut), so it goes back to SUSPENDED from its last
    /// snapshot only once the worker has fenced it: `--hosting-lease` after the last
    /// renewal the plane received, or at once if the worker's port refuses connections
    /// (its process is gone). An operation in progress on the actor handles it instead;
    /// a worker told to detach at shutdown keeps its actor on the record.
    pub(crate) fn worker_left(&self, worker: &str, link: &Arc<WorkerLink>) {
        let plane = self.plane;
        let orphan = {
            let mut st = plane.lock();
            let current = st.workers.get(worker).is_some_and(|w| w.on(link));
            if !current {
                return;
            }
            let rec = st.workers.remove(worker).expect("checked above");
            plane.inner.peers.worker_left(worker, rec.attach());
            let id = st.id();
            let fenced_by =
                super::fencing::fenced_by(plane, rec.last_renewal(), plane.config().hosting_lease);
            let departure = st.workers.depart(worker, id, &rec, fenced_by);
            let left = st.workers.pool_size(rec.pool());
            // Scheduled for an actor in the middle of an operation too: should the
            // operation end with it RUNNING here (a checkpoint the actor was too busy
            // for), the release finds it so.
            let orphan = match rec.slot() {
                Slot::Hosting(key) if !plane.is_shutting_down() => st
                    .records
                    .get(key)
                    .filter(|r| r.status != ActorStatus::Suspended)
                    .map(|_| key.clone()),
                _ => None,
            };
            if plane.is_shutting_down() {
                // Expected: the plane told it to detach.
                tracing::info!(worker, pool = %rec.pool(), workers_left = left, "worker left its pool");
            } else {
                tracing::warn!(
                    worker,
                    pool = %rec.pool(),
                    workers_left = left,
                    actor = ?orphan.as_ref().map(ToString::to_string),
                    "worker left its pool"
                );
            }
            orphan.map(|k| (k, departure))
        };
        if let Some((key, departure)) = orphan {
            Release::orphan(plane, worker.to_owned(), key, departure);
        }
    }

    /// Tells every attached worker to detach: it keeps its actor running and attaches
    /// again when a control plane comes back.
    pub(super) fn detach_workers(&self) {
        let plane = self.plane;
        let links = plane.lock().workers.links();
        for link in links {
            link.detach();
        }
    }

    /// `ListWorkers`.
    pub fn list_workers(&self) -> Vec<ateapi::Worker> {
        let plane = self.plane;
        let st = plane.lock();
        let local = st.workers.iter().map(|(id, w)| {
            let actor = match w.slot() {
                Slot::Hosting(k) | Slot::Reserved(k) => st.records.get(k).map(|r| (k, r)),
                Slot::Free | Slot::Leaving | Slot::Offered => None,
            };
            (id, w.pool(), w.app_addr().to_string(), actor)
        });
        // Those attached to other replicas, with the actor the records place there.
        let remote = st.replicas.live_workers().map(|(id, w)| {
            let actor = st
                .records
                .iter()
                .find(|(_, r)| r.worker.as_deref() == Some(id.as_str()));
            (id, w.pool.as_str(), w.app_address.clone(), actor)
        });
        let mut all: Vec<_> = local.chain(remote).collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        all.into_iter()
            .map(|(id, pool, ip, actor)| ateapi::Worker {
                worker_namespace: NAMESPACE.into(),
                worker_pool: pool.to_owned(),
                worker_pod: id.clone(),
                actor_namespace: actor
                    .map(|(_, r)| r.template_namespace.clone())
                    .unwrap_or_default(),
                actor_template: actor.map(|(_, r)| r.template.clone()).unwrap_or_default(),
                actor_id: actor.map(|(k, _)| k.name().to_owned()).unwrap_or_default(),
                ip,
                version: actor.map(|(_, r)| r.version).unwrap_or_default(),
                worker_pod_uid: id.clone(),
                node_name: "localhost".into(),
                actor_atespace: actor
                    .map(|(k, _)| k.atespace().to_owned())
                    .unwrap_or_default(),
            })
            .collect()
    }
}

/// A worker's Join on a new stream, checked and applied under one state lock: what it
/// may keep of what it reports hosting, its slot, the Welcome, and the releases of
/// what the records place on it that it no longer hosts.
pub(super) struct Join<'a> {
    pub(super) plane: &'a Plane,
    pub(super) join: &'a wk::Join,
    pub(super) link: Arc<WorkerLink>,
    /// It may keep nothing it reports (the record another replica holds says no).
    pub(super) veto: bool,
    /// Its attachment's number in the record the replicas share (0: one plane).
    pub(super) attach: i64,
}

impl Join<'_> {
    /// A Join's addresses, read and checked: its app's, and the actor it reports.
    pub(super) fn read(join: &wk::Join) -> Result<(SocketAddr, Option<ActorKey>), Status> {
        if join.worker_id.is_empty() || join.worker_id.len() > 128 {
            return Err(Status::invalid_argument(
                "worker_id must be 1-128 characters",
            ));
        }
        model::check_name("pool", &join.pool)?;
        let app_addr: SocketAddr = join.app_address.parse().map_err(|_| {
            Status::invalid_argument(format!(
                "app_address {:?} is not ip:port",
                model::shown(&join.app_address)
            ))
        })?;
        let hosting = match &join.hosting {
            Some(h) if !h.name.is_empty() => Some(ActorKey::new(&h.atespace, &h.name)?),
            _ => None,
        };
        Ok((app_addr, hosting))
    }

    /// Refuses a Join under an id another process attached here while it may still
    /// serve (its stream open and renewing; or, if it had an actor, its stream ended
    /// less than a hosting lease after its last renewal): two processes would take
    /// turns hosting its actor. One that had nothing (drained, idle) may be replaced
    /// at once once its stream ended.
    pub(super) fn refuse_duplicate(
        plane: &Plane,
        st: &State,
        join: &wk::Join,
    ) -> Result<(), Status> {
        let id = &join.worker_id;
        let now = tokio::time::Instant::now();
        let lease = plane.config().hosting_lease;
        let other = match (st.workers.get(id), st.workers.departed(id)) {
            (Some(w), _) if w.is_open() || w.slot().has_actor() => Some((
                w.incarnation(),
                super::fencing::fenced_by(plane, w.last_renewal(), lease),
            )),
            (None, Some(d)) => d.hosting().map(|incarnation| (incarnation, d.fenced_by())),
            _ => None,
        };
        // A Join naming no incarnation (0) does not replace one that named its own:
        // an older worker binary never made such a record, and a client that leaves
        // it out must not take over a live worker's id (and its actor's traffic). A
        // record of 0 (an older worker) is replaced as before.
        if let Some((incarnation, serving_until)) = other
            && incarnation != 0
            && incarnation != join.incarnation
            && serving_until > now
        {
            return Err(Status::already_exists(format!(
                "worker id {} is attached by another live process; give each worker its own --worker-id",
                model::shown(id)
            )));
        }
        Ok(())
    }

    /// Applies the Join; whether the worker keeps the actor it reported.
    pub(super) fn run(self) -> Result<bool, Status> {
        let Join {
            plane,
            join,
            link,
            veto,
            attach,
        } = self;
        if plane.is_shutting_down() {
            return Err(super::shutting_down());
        }
        let (app_addr, hosting) = Join::read(join)?;
        let id = join.worker_id.clone();
        let draining = join.draining.then(|| Arc::clone(&link));
        let stream = Arc::clone(&link);
        let (kept, stale, free, held) = {
            let mut st = plane.lock();
            Join::refuse_duplicate(plane, &st, join)?;
            // Attached here now (several replicas): not another replica's any more.
            st.replicas.attached_here(&id);
            let previous = st.workers.remove(&id);
            // Back: what it hosts is decided below, not by a lease running out.
            let reserved = st.workers.back(&id);
            if let Some(old) = &previous {
                // This worker's earlier stream (it re-attached): ended from this side.
                old.link().end(Status::aborted(
                    "the worker attached again on another stream",
                ));
            }
            // What it reports hosting, if the records place it there: RUNNING with no
            // operation on it, or SUSPENDING with its checkpoint waiting for this attach.
            let kept = hosting.filter(|_| !veto).filter(|k| {
                st.records.get(k).is_some_and(|r| {
                    r.worker.as_deref() == Some(id.as_str())
                        && match r.status {
                            ActorStatus::Running => st.busy(k).is_none(),
                            ActorStatus::Suspending => st.workers.awaited(k),
                            _ => false,
                        }
                })
            });
            if let (Some(h), None) = (&join.hosting, &kept)
                && !h.name.is_empty()
            {
                link.notify(Command::Evict(wk::Evict {
                    actor: Some(h.clone()),
                }));
            }
            // A reservation made on the previous stream stays with its activation.
            // An actor the records still place on it (released below, once its
            // leases ran out) keeps it until that release is recorded: only then is
            // it free (`apply` frees it and hands it off), so the records never place
            // two actors on one worker.
            let recorded = st
                .records
                .iter()
                .find(|(k, r)| {
                    r.worker.as_deref() == Some(id.as_str()) && kept.as_ref() != Some(*k)
                })
                .map(|(k, _)| k.clone());
            let leaving = join.draining;
            // So does one made before its stream ended, while it lives.
            let slot = match (&kept, previous.map(|p| p.slot().clone()), recorded) {
                (Some(k), _, _) => Slot::Hosting(k.clone()),
                (None, Some(Slot::Reserved(k)), _) => Slot::Reserved(k),
                // Its offer to the shared queue goes on: that offer decides the slot.
                (None, Some(Slot::Offered), None) => Slot::Offered,
                (None, _, Some(k)) => Slot::Hosting(k),
                _ if let Some(k) = reserved => Slot::Reserved(k),
                _ if leaving => Slot::Leaving,
                _ => Slot::Free,
            };
            let free = slot == Slot::Free;
            if let Some(k) = &kept {
                // Idle since it re-attached, until its worker reports otherwise.
                st.signals.kept(k);
            }
            // Those an operation holds now may end RUNNING here all the same (their
            // last write was landing): released once it ends, unless the worker
            // attached again meanwhile (that attach decides).
            let held: Vec<ActorKey> = st
                .records
                .iter()
                .filter(|(k, r)| {
                    r.worker.as_deref() == Some(id.as_str())
                        && kept.as_ref() != Some(*k)
                        && st.busy(k).is_some()
                })
                .map(|(k, _)| k.clone())
                .collect();
            let not_kept: Vec<(ActorKey, u64)> = held
                .iter()
                .filter_map(|k| {
                    st.ops
                        .id_of(&OpTarget::Actor(k.clone()))
                        .map(|id| (k.clone(), id))
                })
                .collect();
            // The Welcome goes first (after an Evict of what it may not keep), under
            // the lock that makes the worker visible: no Restore can be queued before
            // it (a worker that read a Welcome keeping nothing after a Restore would
            // drop the actor it had just restored).
            link.notify(Command::Welcome(wk::Welcome {
                hosting_kept: kept.is_some(),
                hosting_lease: plane.config().hosting_lease.try_into().ok(),
            }));
            st.workers.join(
                &id,
                Joined {
                    pool: join.pool.clone(),
                    app_addr,
                    slot,
                    link,
                    leaving,
                    incarnation: join.incarnation,
                    not_kept,
                    attach,
                },
            );
            plane
                .inner
                .stats
                .attachments
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                worker = %id,
                pool = %join.pool,
                app = %app_addr,
                hosting = ?kept.as_ref().map(ToString::to_string),
                workers = st.workers.pool_size(&join.pool),
                "worker joined pool"
            );
            // Actors the records place on this worker that it no longer hosts (it
            // restarted) go back to SUSPENDED from their last snapshot.
            let stale: Vec<ActorRow> = st
                .records
                .iter()
                .filter(|(k, r)| {
                    r.status == ActorStatus::Running
                        && r.worker.as_deref() == Some(id.as_str())
                        && kept.as_ref() != Some(*k)
                        && st.busy(k).is_none()
                })
                .map(|(_, r)| r.clone())
                .collect();
            let ops = Op::take_each(plane, &mut st, &stale, "releasing");
            (kept, (ops, stale), free, held)
        };
        let (ops, rows) = stale;
        if !rows.is_empty() {
            Release::start(
                plane,
                ops,
                rows,
                Ending::Suspend("worker re-attached without it"),
            );
        }
        for key in held {
            let (id, link) = (id.clone(), Arc::clone(&stream));
            let tasks = plane.inner.tasks.clone();
            let plane = plane.clone();
            tasks.spawn(async move {
                let same = |st: &State| st.workers.get(&id).is_some_and(|w| w.on(&link));
                Release::once_idle(
                    &plane,
                    &key,
                    &id,
                    same,
                    Ending::Suspend("worker re-attached without it"),
                )
                .await;
            });
        }
        if free {
            plane.capacity().hand_off(&id);
        }
        if let Some(link) = draining {
            tracing::info!(worker = %id, "worker re-attached draining: its drain goes on");
            Drain::spawn(plane, &id, link);
        }
        Ok(kept.is_some())
    }
}

/// Emptying a draining worker, then telling it `Drained`.
struct Drain;

impl Drain {
    /// Runs [`Self::run`] for `worker`, marked leaving, on the plane's task tracker.
    fn spawn(plane: &Plane, worker: &str, link: Arc<WorkerLink>) {
        let tasks = plane.inner.tasks.clone();
        let plane = plane.clone();
        let worker = worker.to_owned();
        tasks.spawn(async move {
            Drain::run(&plane, &worker, &link).await;
        });
    }

    /// Empties a draining worker, then tells it `Drained`. Ends without a word when its
    /// stream ends first (then [`Membership::worker_left`] handles its actor). Each round
    /// suspends the actor on it or waits (bounded) for the operation on that actor to
    /// end; a worker still not empty after a few rounds is told all the same.
    async fn run(plane: &Plane, worker: &str, link: &Arc<WorkerLink>) {
        let wait = plane
            .config()
            .restore_timeout
            .max(plane.config().checkpoint_timeout);
        for round in 0..=DRAIN_ROUNDS {
            let (on_it, offered) = {
                let st = plane.lock();
                match st.workers.get(worker) {
                    Some(w) if w.on(link) => match w.slot() {
                        Slot::Hosting(k) | Slot::Reserved(k) => (Some(k.clone()), false),
                        Slot::Offered => (None, true),
                        Slot::Free | Slot::Leaving => (None, false),
                    },
                    _ => return,
                }
            };
            // Being offered to the shared queue: it may get an actor yet (its offer
            // ends within a write's bound), which this drain then suspends.
            if offered {
                let settled = |p: &Plane| {
                    p.lock()
                        .workers
                        .get(worker)
                        .is_none_or(|w| *w.slot() != Slot::Offered)
                };
                tokio::select! {
                    _ = plane.wait_until(wait, settled) => {}
                    () = plane.inner.shutdown.cancelled() => return,
                }
                continue;
            }
            let Some(key) = on_it else {
                tracing::info!(worker, "worker drained");
                link.notify(Command::Drained(wk::Drained {}));
                return;
            };
            if round == DRAIN_ROUNDS {
                break;
            }
            // The plane is shutting down: it tells the worker to detach, and the worker
            // goes on with its drain on the next control plane it attaches to.
            if plane.is_shutting_down() {
                return;
            }
            match Checkpoint::suspend_anywhere(plane, key.clone()).await {
                // Suspended: the slot is vacant now. Or another operation on the actor
                // (the restore that put it there, a suspend in progress): wait for it
                // to end (or the plane to shut down), then look again.
                Ok(_) => {}
                Err(e) if e.code() == tonic::Code::Aborted => {
                    let ended = tokio::select! {
                        ended = plane.wait_until(wait, |p| p.lock().busy(&key).is_none()) => ended,
                        () = plane.inner.shutdown.cancelled() => return,
                    };
                    if !ended {
                        break;
                    }
                }
                // The checkpoint failed (the actor is CRASHED, or its record could not
                // be written): the worker may stop all the same; its actor is then
                // released as for any worker that leaves.
                Err(_) if plane.is_shutting_down() => return,
                Err(e) => {
                    tracing::warn!(worker, actor = %key, error = %e.message(), "drain could not checkpoint the actor; the worker stops all the same");
                    link.notify(Command::Drained(wk::Drained {}));
                    return;
                }
            }
        }
        tracing::warn!(
            worker,
            "drain could not empty the worker; it stops all the same"
        );
        link.notify(Command::Drained(wk::Drained {}));
    }
}
