//! What each RUNNING actor is doing, and the capacity that frees itself.
//!
//! Workers report their actor's activity (requests in flight, an activity mark that
//! changes at every start and end); a restore and a resume of a running actor count as
//! activity too. Two policies act on it, both off unless configured:
//!
//! - **idle suspension** (`--idle-suspend-after`): an actor idle that long is
//!   checkpointed and suspended;
//! - **demand eviction** (`--evict-idle-after`): while actors wait for a pool (capacity
//!   waiters, and actors refused `ResourceExhausted` in the last [`super::signals::REFUSED_FOR`]), the
//!   least recently active running actors of that pool idle at least that long are
//!   checkpointed, one per waiting actor not already covered by a free worker or one
//!   being freed, and each freed worker goes to the oldest waiter.
//!
//! Every policy checkpoint names the activity mark it was decided on; the worker
//! refuses it (busy) unless the actor has stayed idle since, so a policy never cuts a
//! request short or loses its effect.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;
use valet_proto::worker as wk;

use super::checkpoint::{Checkpoint, Checkpointed, Fence};
use super::peers::Claim;
use super::{Op, OpKind, OpTarget, Plane, Slot};
use crate::link::WorkerLink;
use crate::model::{ActorKey, ActorStatus};

/// Why a policy checkpoints an actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    Idle,
    Evict,
}

impl Why {
    fn op(self) -> &'static str {
        match self {
            Why::Idle => "idle-suspending",
            Why::Evict => "evicting",
        }
    }
}

/// The capacity that frees itself: idle suspension and demand eviction, fed by the
/// workers' activity reports. Obtained with [`Plane::policies`].
#[derive(Debug, Clone, Copy)]
pub struct Policies<'a> {
    plane: &'a Plane,
}

impl Plane {
    /// The plane's policies.
    pub fn policies(&self) -> Policies<'_> {
        Policies { plane: self }
    }
}

impl Policies<'_> {
    /// A worker reported its actor's activity.
    pub(crate) fn activity(
        &self,
        worker: &str,
        link: &std::sync::Arc<WorkerLink>,
        report: &wk::Activity,
    ) {
        let plane = self.plane;
        let Some(slot) = &report.actor else { return };
        let Ok(key) = ActorKey::new(&slot.atespace, &slot.name) else {
            return;
        };
        let wake = {
            let mut st = plane.lock();
            let current = st
                .workers
                .on(worker, link)
                .is_some_and(|w| *w.slot() == Slot::Hosting(key.clone()));
            if !current {
                return;
            }
            // An actor idle under a new mark is a new candidate for the policies.
            st.signals.report(key, report.in_flight, report.mark)
        };
        if wake {
            plane.wake_policies();
        }
    }

    /// Runs the policies, if any is configured, until shutdown.
    pub(super) fn spawn_policies(&self) {
        let plane = self.plane;
        let c = plane.config();
        if c.idle_suspend_after.is_zero() && c.evict_idle_after.is_zero() {
            return;
        }
        let chores = plane.inner.chores.clone();
        let plane = plane.clone();
        chores.spawn(async move {
            loop {
                let next = plane.policies().policy_pass(Instant::now());
                let sleep = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = sleep => {}
                    () = plane.inner.policy.notified() => {}
                    () = plane.inner.shutdown.cancelled() => return,
                }
            }
        });
    }

    /// Starts the checkpoints the policies call for now; returns when the next actor
    /// crosses a threshold, if one will.
    fn policy_pass(&self, now: Instant) -> Option<Instant> {
        let plane = self.plane;
        let idle_after = plane.config().idle_suspend_after;
        let evict_after = plane.config().evict_idle_after;
        let mut starts: Vec<(Op, ActorKey, Why, u64, std::time::Duration)> = Vec::new();
        let mut next: Option<Instant> = None;
        let mut soonest = |at: Instant| next = Some(next.map_or(at, |n: Instant| n.min(at)));
        {
            let mut st = plane.lock();
            st.signals.expire(now);
            // Running, unlocked actors by pool, least recently active first.
            let mut idle: BTreeMap<String, Vec<(Instant, ActorKey, u64, Duration)>> =
                BTreeMap::new();
            for (key, row) in st.records.iter() {
                if row.status != ActorStatus::Running || st.busy(key).is_some() {
                    continue;
                }
                // Several replicas: only actors on workers attached here (another
                // replica's are its own to checkpoint).
                let here = row
                    .worker
                    .as_ref()
                    .and_then(|w| st.workers.get(w))
                    .is_some_and(|w| w.is_open());
                if st.replicas.is_shared() && !here {
                    continue;
                }
                let Some(a) = st.signals.activity(key) else {
                    continue;
                };
                let Some(for_) = a.idle_for(now) else {
                    continue;
                };
                idle.entry(row.pool.clone()).or_default().push((
                    a.since,
                    key.clone(),
                    a.mark,
                    for_,
                ));
            }
            for list in idle.values_mut() {
                list.sort();
            }
            if !evict_after.is_zero() {
                for (pool, list) in &idle {
                    let wanted = st.eviction_demand(pool);
                    let mut taken = 0;
                    for (since, key, mark, for_) in list {
                        if *for_ < evict_after {
                            if wanted > 0 {
                                soonest(*since + evict_after);
                            }
                            continue;
                        }
                        if taken == wanted {
                            break;
                        }
                        taken += 1;
                        let op = Op::take(
                            plane,
                            &mut st,
                            OpTarget::Actor(key.clone()),
                            OpKind::Busy(Why::Evict.op()),
                        );
                        starts.push((op, key.clone(), Why::Evict, *mark, *for_));
                    }
                }
            }
            if !idle_after.is_zero() {
                for (since, key, mark, for_) in idle.values().flatten() {
                    if st.busy(key).is_some() {
                        continue;
                    }
                    if *for_ < idle_after {
                        soonest(*since + idle_after);
                        continue;
                    }
                    let op = Op::take(
                        plane,
                        &mut st,
                        OpTarget::Actor(key.clone()),
                        OpKind::Busy(Why::Idle.op()),
                    );
                    starts.push((op, key.clone(), Why::Idle, *mark, *for_));
                }
            }
        }
        for (op, key, why, mark, idle_for) in starts {
            plane
                .policies()
                .spawn_policy_checkpoint(op, key, why, mark, idle_for);
        }
        next
    }

    fn spawn_policy_checkpoint(
        &self,
        op: Op,
        key: ActorKey,
        why: Why,
        mark: u64,
        idle_for: Duration,
    ) {
        let plane = self.plane;
        let checkpoint = PolicyCheckpoint {
            plane: plane.clone(),
            op,
            key,
            why,
            mark,
            idle_for,
        };
        plane.inner.tasks.spawn(checkpoint.run());
    }
}

impl super::State {
    /// How many more actors of `pool` to evict now: the distinct actors waiting for it
    /// (queued, or refused lately), less its free workers and the workers being freed.
    fn eviction_demand(&self, pool: &str) -> usize {
        if self.replicas.is_shared() {
            return self.shared_eviction_demand(pool);
        }
        let mut waiting: BTreeSet<&ActorKey> = self.waiters.live_actors(pool).collect();
        waiting.extend(self.refused_in(pool));
        let free = self.workers.count_in(pool, |s| *s == Slot::Free);
        // A checkpoint in progress frees a worker for the pool, unless that worker is
        // leaving (a drain's): it never comes back free.
        let freeing = self
            .ops
            .iter()
            .filter(|(target, kind)| {
                matches!(
                    kind,
                    OpKind::Busy("evicting" | "idle-suspending" | "suspending")
                ) && matches!(target, OpTarget::Actor(k) if self.records.get(k).is_some_and(|r| {
                    r.pool == pool
                        && r.worker
                            .as_ref()
                            .and_then(|w| self.workers.get(w))
                            .is_some_and(|w| !w.is_leaving())
                }))
            })
            .count();
        waiting.len().saturating_sub(free + freeing)
    }

    /// Actors of `pool` refused `ResourceExhausted` lately and still suspended.
    fn refused_in<'a>(&'a self, pool: &'a str) -> impl Iterator<Item = &'a ActorKey> + 'a {
        self.signals.refusals().filter_map(move |(key, p)| {
            let idle_again = self.records.get(key).is_some_and(|r| {
                matches!(r.status, ActorStatus::Suspended) && self.busy(key).is_none()
            });
            (p == pool && idle_again).then_some(key)
        })
    }

    /// How many actors refused lately this replica evicts for (several replicas).
    pub(super) fn refused_demand(&self, pool: &str) -> usize {
        self.refused_in(pool).count()
    }

    /// [`Self::eviction_demand`] with several replicas: the waiters of every replica
    /// that no eviction serves yet (each eviction claims one), and this replica's
    /// refused actors, less its free workers and the workers its other checkpoints
    /// free.
    fn shared_eviction_demand(&self, pool: &str) -> usize {
        let mut waiting: BTreeSet<&ActorKey> = self.replicas.unclaimed(pool).collect();
        // Queued here, its row not written yet.
        waiting.extend(self.waiters.unwritten_actors(pool));
        waiting.extend(self.refused_in(pool));
        // Free here, or free on another replica (which hands it to a waiter at once).
        let free = self
            .workers
            .count_in(pool, |s| matches!(s, Slot::Free | Slot::Offered))
            + self.replicas.free_elsewhere_count(pool, &self.records);
        let freeing = self
            .ops
            .iter()
            .filter(|(target, kind)| {
                matches!(kind, OpKind::Busy("idle-suspending" | "suspending"))
                    && matches!(target, OpTarget::Actor(k) if self.records.get(k).is_some_and(|r| {
                        r.pool == pool
                            && r.worker
                                .as_ref()
                                .and_then(|w| self.workers.get(w))
                                .is_some_and(|w| !w.is_leaving())
                    }))
            })
            .count();
        waiting.len().saturating_sub(free + freeing)
    }
}

/// A policy's checkpoint of an idle actor (idle suspension, or an eviction for a
/// waiting one), under the operation lock the pass took.
struct PolicyCheckpoint {
    plane: Plane,
    op: Op,
    key: ActorKey,
    why: Why,
    /// The activity mark it was decided on: the worker refuses it unless the actor
    /// stayed idle since.
    mark: u64,
    idle_for: Duration,
}

impl PolicyCheckpoint {
    /// In order: the waiter an eviction serves claimed (several replicas), the
    /// checkpoint fenced on the mark, the outcome counted, the claim released, the
    /// policies woken.
    async fn run(self) {
        let PolicyCheckpoint {
            plane,
            op,
            key,
            why,
            mark,
            idle_for,
        } = self;
        let Some(row) = plane.lock().records.get(&key).cloned() else {
            return;
        };
        let pool = row.pool.clone();
        let claimed = match why {
            Why::Evict => match plane.inner.peers.claim_eviction(&plane, &key, &pool).await {
                Claim::Own => None,
                Claim::Waiter(seq) => Some(seq),
                Claim::Nobody => return,
            },
            Why::Idle => None,
        };
        match why {
            Why::Evict => {
                tracing::info!(actor = %key, %pool, ?idle_for, "evicting the least recently active actor for a waiting one")
            }
            Why::Idle => tracing::info!(actor = %key, %pool, ?idle_for, "suspending an idle actor"),
        }
        let checkpoint = Checkpoint {
            plane: plane.clone(),
            op,
            key: key.clone(),
            row,
            fence: Fence::IdleSince(mark),
        };
        match checkpoint.run().await {
            Checkpointed::Suspended(_) => match why {
                Why::Evict => plane.metrics().evicted(&pool),
                Why::Idle => plane.metrics().idle_suspended(&pool),
            },
            Checkpointed::Busy => {
                tracing::debug!(actor = %key, "the actor turned busy; left running");
            }
            Checkpointed::Refused(why) => {
                tracing::warn!(actor = %key, %why, "policy checkpoint refused; the actor keeps running");
            }
            Checkpointed::Failed(e) => {
                tracing::warn!(actor = %key, error = %e.message(), "policy checkpoint failed");
            }
        }
        if let Some(seq) = claimed {
            plane.inner.peers.release_eviction(&plane, seq).await;
        }
        plane.wake_policies();
    }
}
