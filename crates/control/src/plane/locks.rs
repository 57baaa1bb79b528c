//! The locks book: which operation holds each actor (or atespace) now. Only the
//! [`super::op::Op`] guard takes and releases a lock here.

use std::collections::HashMap;

use super::op::{OpKind, OpTarget};

/// The operation locks held now: the only place one is taken or released.
#[derive(Debug, Default)]
pub(crate) struct Ops {
    held: HashMap<OpTarget, (u64, OpKind)>,
}

impl Ops {
    /// What holds `target`'s lock, if anything.
    pub(crate) fn holder(&self, target: &OpTarget) -> Option<&OpKind> {
        self.held.get(target).map(|(_, kind)| kind)
    }

    /// The id of the operation holding `target`'s lock, if any.
    pub(crate) fn id_of(&self, target: &OpTarget) -> Option<u64> {
        self.held.get(target).map(|(id, _)| *id)
    }

    /// Whether an operation holds an actor of atespace `name`.
    pub(crate) fn inside(&self, name: &str) -> bool {
        self.held
            .keys()
            .any(|t| matches!(t, OpTarget::Actor(k) if k.atespace() == name))
    }

    /// Every lock held, and by what.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&OpTarget, &OpKind)> {
        self.held.iter().map(|(target, (_, kind))| (target, kind))
    }

    /// Locks `target` as operation `id` of `kind`; whether something held it before
    /// (never, when the caller checked first).
    pub(crate) fn lock(&mut self, target: OpTarget, id: u64, kind: OpKind) -> bool {
        self.held.insert(target, (id, kind)).is_some()
    }

    /// Operation `id`, a resume, is past its capacity wait: later resumes no longer
    /// join it.
    pub(crate) fn stop_joining(&mut self, target: &OpTarget, id: u64) {
        if let Some((held, OpKind::Resuming { joinable, .. })) = self.held.get_mut(target)
            && *held == id
        {
            *joinable = false;
        }
    }

    /// Operation `id` releases `target`'s lock (not a later operation's).
    pub(crate) fn unlock(&mut self, target: &OpTarget, id: u64) {
        if self.id_of(target) == Some(id) {
            self.held.remove(target);
        }
    }

    /// How many locks are held.
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }
}
