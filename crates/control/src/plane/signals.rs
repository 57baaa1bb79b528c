//! The signals book: what each RUNNING actor is doing, as its worker reports it, and
//! the actors refused `ResourceExhausted` lately. The policies ([`super::policy`])
//! read it; only its own methods change it.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::model::ActorKey;

/// How long a `ResourceExhausted` refusal counts as demand for eviction.
pub(crate) const REFUSED_FOR: Duration = Duration::from_secs(5);

/// What the policies read: what each RUNNING actor is doing, as its worker reports
/// it, and the actors refused `ResourceExhausted` lately (demand for eviction from
/// routers that poll instead of waiting). The only place either changes.
#[derive(Debug, Default)]
pub(crate) struct Signals {
    activity: HashMap<ActorKey, Activity>,
    refused: HashMap<ActorKey, (String, Instant)>,
}

impl Signals {
    /// What `key` is doing, if it runs.
    pub(crate) fn activity(&self, key: &ActorKey) -> Option<&Activity> {
        self.activity.get(key)
    }

    /// `key` was just restored: idle since now.
    pub(crate) fn restored(&mut self, key: &ActorKey) {
        self.activity.insert(key.clone(), Activity::restored());
    }

    /// `key` runs on, kept by its worker as it re-attached: idle since now unless
    /// known already.
    pub(crate) fn kept(&mut self, key: &ActorKey) {
        self.activity
            .entry(key.clone())
            .or_insert_with(Activity::restored);
    }

    /// Counts as activity of `key` now (a resume of the running actor, a refused
    /// checkpoint).
    pub(crate) fn touch(&mut self, key: &ActorKey) {
        if let Some(a) = self.activity.get_mut(key) {
            a.since = Instant::now();
        }
    }

    /// A worker's report of what `key` is doing; whether it is a new candidate for
    /// the policies (idle under a new mark).
    pub(super) fn report(&mut self, key: ActorKey, in_flight: u32, mark: u64) -> bool {
        let a = self.activity.entry(key).or_insert_with(Activity::restored);
        let was_idle = a.in_flight == 0;
        let changed = mark != a.mark;
        if in_flight > 0 || changed || !was_idle {
            a.since = Instant::now();
        }
        a.in_flight = in_flight;
        a.mark = mark;
        in_flight == 0 && (changed || !was_idle)
    }

    /// `key` runs no more (nor does anything about it count).
    pub(crate) fn stopped(&mut self, key: &ActorKey) {
        self.activity.remove(key);
    }

    /// `key` is gone.
    pub(crate) fn forget(&mut self, key: &ActorKey) {
        self.activity.remove(key);
        self.refused.remove(key);
    }

    /// A resume of `key` (of `pool`) was refused for want of a free worker.
    pub(crate) fn refused(&mut self, key: &ActorKey, pool: &str) {
        self.refused
            .insert(key.clone(), (pool.to_owned(), Instant::now()));
    }

    /// `key` got a worker: no demand any more.
    pub(crate) fn served(&mut self, key: &ActorKey) {
        self.refused.remove(key);
    }

    /// The actors refused lately, and their pools.
    pub(crate) fn refusals(&self) -> impl Iterator<Item = (&ActorKey, &str)> {
        self.refused
            .iter()
            .map(|(key, (pool, _))| (key, pool.as_str()))
    }

    /// Forgets refusals older than [`REFUSED_FOR`].
    pub(super) fn expire(&mut self, now: Instant) {
        self.refused
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < REFUSED_FOR);
    }
}

/// What one RUNNING actor is doing, as the plane knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Activity {
    /// Requests in flight at the last report.
    pub(crate) in_flight: u32,
    /// The worker's activity mark at the last report.
    pub(crate) mark: u64,
    /// The last activity: when it became idle, or its last busy report.
    pub(crate) since: Instant,
}

impl Activity {
    /// Just restored: idle since now, at the worker's first mark.
    fn restored() -> Self {
        Self {
            in_flight: 0,
            mark: 0,
            since: Instant::now(),
        }
    }

    /// How long it has been idle, if it is.
    pub(crate) fn idle_for(&self, now: Instant) -> Option<Duration> {
        (self.in_flight == 0).then(|| now.saturating_duration_since(self.since))
    }
}
