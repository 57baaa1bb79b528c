//! The operation lock of one actor (or atespace): taken for an operation's whole life,
//! released when its [`Op`] is dropped, on every path including a panic or a cancelled
//! future. The order of an operation's steps lives in [`super::ledger::Ledger::step`]
//! and [`super::ledger::Ledger::finish`].

use std::sync::Arc;

use tokio::sync::watch;

use super::wait::CapacityWait;
use super::{Inner, Outcome, Plane, State};
use crate::model::ActorKey;

/// What an operation locks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum OpTarget {
    Actor(ActorKey),
    Atespace(String),
}

impl std::fmt::Display for OpTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpTarget::Actor(k) => write!(f, "actor {k}"),
            OpTarget::Atespace(a) => write!(f, "atespace {a}"),
        }
    }
}

/// What holds a lock, as other callers see it.
#[derive(Debug, Clone)]
pub(crate) enum OpKind {
    /// Refuses other operations with `Aborted`.
    Busy(&'static str),
    /// A resume: waiting in its pool's queue while `joinable`, when later resumes join
    /// it and get its outcome; restoring after that.
    Resuming {
        outcome: Arc<watch::Sender<Option<Outcome>>>,
        joinable: bool,
        capacity: Arc<watch::Sender<CapacityWait>>,
    },
}

impl OpKind {
    /// What the operation is doing, for logs.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            OpKind::Busy(what) => what,
            OpKind::Resuming { joinable: true, .. } => "waiting for capacity",
            OpKind::Resuming {
                joinable: false, ..
            } => "resuming",
        }
    }
}

/// A held operation lock.
#[derive(Debug)]
pub(crate) struct Op {
    inner: Arc<Inner>,
    target: OpTarget,
    id: u64,
}

impl Op {
    /// Locks `target` for an operation of `kind`. The caller has checked, under the same
    /// state lock, that nothing holds it.
    pub(crate) fn take(plane: &Plane, st: &mut State, target: OpTarget, kind: OpKind) -> Self {
        let id = st.id();
        let previous = st.ops.lock(target.clone(), id, kind);
        debug_assert!(!previous, "{target:?} was already locked");
        Self {
            inner: Arc::clone(&plane.inner),
            target,
            id,
        }
    }

    /// Locks each actor of `rows` for a `Busy(what)` operation. The caller has
    /// checked, under the same state lock, that nothing holds them.
    pub(crate) fn take_each(
        plane: &Plane,
        st: &mut State,
        rows: &[crate::store::ActorRow],
        what: &'static str,
    ) -> Vec<Self> {
        rows.iter()
            .map(|r| Self::take(plane, st, OpTarget::Actor(r.key()), OpKind::Busy(what)))
            .collect()
    }

    /// Tells this operation from a later one on the same target.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The resume is past its capacity wait: later resumes no longer join it.
    pub(crate) fn stop_joining(&self) {
        let plane = Plane {
            inner: Arc::clone(&self.inner),
        };
        let mut st = plane.lock();
        st.ops.stop_joining(&self.target, self.id);
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        let plane = Plane {
            inner: Arc::clone(&self.inner),
        };
        let queued_in = {
            let mut st = plane.lock();
            st.ops.unlock(&self.target, self.id);
            // Several replicas: a hand-off here passed over this actor's waiter (on
            // another replica) while this operation held it; a free worker here is
            // offered again.
            match &self.target {
                OpTarget::Actor(k) if st.replicas.queued(k) => {
                    st.replicas.passed_over();
                    st.records.get(k).map(|r| r.pool.clone())
                }
                _ => None,
            }
        };
        if let Some(pool) = queued_in {
            plane.capacity().offer_free(&pool);
        }
    }
}
