//! The records book: atespaces and actor records as the store has them, memory's
//! working copy. Changed only by [`Records::put`], [`Records::delete`] and the
//! atespace methods, which [`super::State::apply`] calls with a durable batch (or a
//! replica with what it read): memory never runs ahead of the store.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeBounds;

use crate::model::ActorKey;
use crate::store::ActorRow;

/// Every atespace and actor record.
#[derive(Debug, Default)]
pub(crate) struct Records {
    atespaces: BTreeSet<String>,
    actors: BTreeMap<ActorKey, ActorRow>,
}

impl Records {
    /// The records a store loaded.
    pub(crate) fn loaded(atespaces: impl IntoIterator<Item = String>) -> Self {
        Self {
            atespaces: atespaces.into_iter().collect(),
            actors: BTreeMap::new(),
        }
    }

    /// Actor `key`'s record.
    pub(crate) fn get(&self, key: &ActorKey) -> Option<&ActorRow> {
        self.actors.get(key)
    }

    /// Whether actor `key` exists.
    pub(crate) fn contains(&self, key: &ActorKey) -> bool {
        self.actors.contains_key(key)
    }

    /// Every actor record, by key.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&ActorKey, &ActorRow)> {
        self.actors.iter()
    }

    /// Every actor record.
    pub(crate) fn values(&self) -> impl Iterator<Item = &ActorRow> {
        self.actors.values()
    }

    /// Every actor's key.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &ActorKey> {
        self.actors.keys()
    }

    /// How many actors exist.
    pub(crate) fn len(&self) -> usize {
        self.actors.len()
    }

    /// The actor records whose keys are in `range`, in order.
    pub(crate) fn range<R: RangeBounds<ActorKey>>(
        &self,
        range: R,
    ) -> impl Iterator<Item = (&ActorKey, &ActorRow)> {
        self.actors.range(range)
    }

    /// The actors the records place on `worker`.
    pub(crate) fn on<'a>(&'a self, worker: &'a str) -> impl Iterator<Item = &'a ActorRow> + 'a {
        self.actors
            .values()
            .filter(move |r| r.worker.as_deref() == Some(worker))
    }

    /// Whether atespace `name` exists.
    pub(crate) fn has_atespace(&self, name: &str) -> bool {
        self.atespaces.contains(name)
    }

    /// Every atespace, in order.
    pub(crate) fn atespaces(&self) -> impl Iterator<Item = &String> {
        self.atespaces.iter()
    }

    /// Records `row`; the worker its previous record placed it on, if any.
    pub(super) fn put(&mut self, row: ActorRow) -> Option<String> {
        self.actors
            .insert(row.key(), row)
            .and_then(|previous| previous.worker)
    }

    /// Forgets actor `key`; the worker its record placed it on, if any.
    pub(super) fn delete(&mut self, key: &ActorKey) -> Option<String> {
        self.actors.remove(key).and_then(|r| r.worker)
    }

    /// Records atespace `name`.
    pub(super) fn put_atespace(&mut self, name: &str) {
        self.atespaces.insert(name.to_owned());
    }

    /// Forgets atespace `name`.
    pub(super) fn delete_atespace(&mut self, name: &str) {
        self.atespaces.remove(name);
    }

    /// The atespaces as read from the store (another replica's changes), and `kept`,
    /// written here since that read began.
    pub(super) fn read_atespaces(&mut self, names: Vec<String>, kept: Vec<String>) {
        self.atespaces = names.into_iter().chain(kept).collect();
    }
}
