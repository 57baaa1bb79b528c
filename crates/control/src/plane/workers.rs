//! The workers book: who is attached here, what each one's slot holds, and who left
//! and may still serve its actor. The only place a slot changes: every transition
//! (reserve, host, vacate, offer, drain) is a method here, and a slot becomes
//! vacant in one ([`WorkerRec::vacate`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::time::Instant;

use valet_proto::worker::{self as wk, worker_command::Command};

use crate::link::WorkerLink;
use crate::model::ActorKey;
use crate::store::ActorRow;

/// What a worker's slot holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Nothing: the worker has room.
    Free,
    /// Promised to an activation whose claim is not durable yet.
    Reserved(ActorKey),
    /// The actor the records place on it.
    Hosting(ActorKey),
    /// Nothing, and nothing ever again: the worker is draining (it is stopping).
    Leaving,
    /// Nothing yet: being offered to the capacity queue the replicas share (several
    /// replicas on one database), whose oldest waiter gets it, or it is free again.
    Offered,
}

impl Slot {
    /// Whether an actor is on it, or promised to it.
    pub(crate) fn has_actor(&self) -> bool {
        matches!(self, Slot::Reserved(_) | Slot::Hosting(_))
    }

    /// The actor on it, or promised to it.
    pub(crate) fn actor(&self) -> Option<&ActorKey> {
        match self {
            Slot::Reserved(k) | Slot::Hosting(k) => Some(k),
            Slot::Free | Slot::Leaving | Slot::Offered => None,
        }
    }
}

/// One attached worker.
#[derive(Debug)]
pub(crate) struct WorkerRec {
    pool: String,
    app_addr: SocketAddr,
    slot: Slot,
    link: Arc<WorkerLink>,
    /// When the plane last heard a hosting renewal from it (or it attached).
    last_renewal: Instant,
    /// It asked to drain: once vacated, its slot is [`Slot::Leaving`], never free.
    leaving: bool,
    /// The process attached as this worker (`Join.incarnation`; 0: unknown).
    incarnation: u64,
    /// Actors the records placed on it that an operation held when it attached on
    /// this stream, and that it did not keep, with that operation's id: that
    /// operation sends it nothing more here (the actor is released once it ends, if
    /// it ends RUNNING there). A later operation may use the worker as any other.
    not_kept: Vec<(ActorKey, u64)>,
    /// Its attachment's number in the record the replicas share (several replicas;
    /// 0 otherwise): a later one elsewhere supersedes it.
    attach: i64,
    /// The Restore command (its id on this stream) whose run it hosts, as the plane
    /// accepted its answer; 0 for none, or an actor kept from an earlier attachment. A
    /// program's exit it reports applies to that run only, never to one restored
    /// since.
    hosting_restore: u64,
}

/// What a worker's Join makes of it.
#[derive(Debug)]
pub(crate) struct Joined {
    pub(crate) pool: String,
    pub(crate) app_addr: SocketAddr,
    pub(crate) slot: Slot,
    pub(crate) link: Arc<WorkerLink>,
    pub(crate) leaving: bool,
    pub(crate) incarnation: u64,
    pub(crate) not_kept: Vec<(ActorKey, u64)>,
    pub(crate) attach: i64,
}

impl WorkerRec {
    /// Its pool.
    pub(crate) fn pool(&self) -> &str {
        &self.pool
    }

    /// Its app's address.
    pub(crate) fn app_addr(&self) -> SocketAddr {
        self.app_addr
    }

    /// What its slot holds.
    pub(crate) fn slot(&self) -> &Slot {
        &self.slot
    }

    /// Its stream.
    pub(crate) fn link(&self) -> &Arc<WorkerLink> {
        &self.link
    }

    /// Whether `link` is its current stream.
    pub(crate) fn on(&self, link: &Arc<WorkerLink>) -> bool {
        Arc::ptr_eq(&self.link, link)
    }

    /// Whether its stream is open.
    pub(crate) fn is_open(&self) -> bool {
        !self.link.is_closed()
    }

    /// When the plane last heard a hosting renewal from it.
    pub(crate) fn last_renewal(&self) -> Instant {
        self.last_renewal
    }

    /// Whether it drains.
    pub(crate) fn is_leaving(&self) -> bool {
        self.leaving
    }

    /// The process attached as it.
    pub(crate) fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Its attachment's number in the record the replicas share.
    pub(crate) fn attach(&self) -> i64 {
        self.attach
    }

    /// The Restore whose run it hosts (0: none known).
    pub(crate) fn hosting_restore(&self) -> u64 {
        self.hosting_restore
    }

    /// Whether operation `op` may still send it commands for `key` (it did not
    /// attach again, without the actor, since `op` claimed it).
    pub(crate) fn serves_op(&self, key: &ActorKey, op: u64) -> bool {
        !self.not_kept.iter().any(|(k, id)| k == key && *id == op)
    }

    /// Nothing is on it any more: free, or [`Slot::Leaving`] when it drains. Whether it
    /// has room now (to hand to a waiter). The one place a slot becomes vacant.
    fn vacate(&mut self) -> bool {
        self.slot = if self.leaving {
            Slot::Leaving
        } else {
            Slot::Free
        };
        !self.leaving
    }
}

/// A worker whose stream ended, for as long as it may still serve its actor.
#[derive(Debug, Clone)]
pub(crate) struct Departure {
    /// Tells this departure from a later one of the same worker.
    id: u64,
    /// Its app's address: a port that refuses connections means its process is gone.
    app: SocketAddr,
    /// When it has fenced its actor at the latest: its hosting lease after the last
    /// renewal the plane heard from it.
    fenced_by: Instant,
    /// The process that left (`Join.incarnation`; 0: unknown).
    incarnation: u64,
    /// It had an actor (or one reserved): it may still serve it until `fenced_by`.
    hosting: bool,
    /// The actor whose activation it was reserved for, while that reservation lives:
    /// it stays that actor's if the worker comes back.
    reserved: Option<ActorKey>,
}

impl Departure {
    /// A worker this replica never saw attached that may still serve its actor until
    /// `fenced_by` (it was attached to a replica that died).
    pub(crate) fn unseen(id: u64, app: SocketAddr, fenced_by: Instant, incarnation: u64) -> Self {
        Self {
            id,
            app,
            fenced_by,
            incarnation,
            hosting: true,
            reserved: None,
        }
    }

    /// Its app's address.
    pub(crate) fn app(&self) -> SocketAddr {
        self.app
    }

    /// When it has fenced its actor at the latest.
    pub(crate) fn fenced_by(&self) -> Instant {
        self.fenced_by
    }

    /// Whether it may still serve an actor (until [`Self::fenced_by`]), and as which
    /// process.
    pub(crate) fn hosting(&self) -> Option<u64> {
        self.hosting.then_some(self.incarnation)
    }

    /// Whether this is departure `other` of the same worker, not a later one.
    pub(crate) fn same(&self, other: &Departure) -> bool {
        self.id == other.id
    }
}

/// Every worker attached here, and those departed that may still serve.
#[derive(Debug, Default)]
pub(crate) struct Workers {
    attached: BTreeMap<String, WorkerRec>,
    departed: HashMap<String, Departure>,
    /// SUSPENDING actors whose checkpoint waits for their worker to attach again: a
    /// re-attach that reports one keeps it (the checkpoint then goes over the new
    /// stream) instead of evicting it with everything it did since its last snapshot.
    awaiting: HashSet<ActorKey>,
}

impl Workers {
    /// Attached worker `id`.
    pub(crate) fn get(&self, id: &str) -> Option<&WorkerRec> {
        self.attached.get(id)
    }

    /// Attached worker `id`, if `link` is its current stream.
    pub(crate) fn on(&self, id: &str, link: &Arc<WorkerLink>) -> Option<&WorkerRec> {
        self.attached.get(id).filter(|w| w.on(link))
    }

    /// Whether worker `id` is attached here.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.attached.contains_key(id)
    }

    /// Every attached worker, by id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&String, &WorkerRec)> {
        self.attached.iter()
    }

    /// How many workers of `pool` are attached.
    pub(crate) fn pool_size(&self, pool: &str) -> usize {
        self.attached.values().filter(|w| w.pool == pool).count()
    }

    /// A free worker of `pool` whose stream is open.
    pub(crate) fn free_in(&self, pool: &str) -> Option<String> {
        self.attached
            .iter()
            .find(|(_, w)| w.pool == pool && w.slot == Slot::Free && w.is_open())
            .map(|(id, _)| id.clone())
    }

    /// Every free worker of `pool`.
    pub(crate) fn all_free_in(&self, pool: &str) -> Vec<String> {
        self.attached
            .iter()
            .filter(|(_, w)| w.pool == pool && w.slot == Slot::Free)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// How many workers of `pool` have a slot `which` takes.
    pub(crate) fn count_in(&self, pool: &str, which: impl Fn(&Slot) -> bool) -> usize {
        self.attached
            .values()
            .filter(|w| w.pool == pool && which(&w.slot))
            .count()
    }

    /// Whether a worker is reserved for `key`.
    pub(crate) fn reserved_for(&self, key: &ActorKey) -> bool {
        self.attached
            .values()
            .any(|w| matches!(&w.slot, Slot::Reserved(k) if k == key))
    }

    /// Worker `id` joined on a new stream; its earlier attachment, if any, ends here.
    pub(crate) fn join(&mut self, id: &str, joined: Joined) -> Option<WorkerRec> {
        let Joined {
            pool,
            app_addr,
            slot,
            link,
            leaving,
            incarnation,
            not_kept,
            attach,
        } = joined;
        self.attached.insert(
            id.to_owned(),
            WorkerRec {
                pool,
                app_addr,
                slot,
                link,
                last_renewal: Instant::now(),
                leaving,
                incarnation,
                not_kept,
                attach,
                hosting_restore: 0,
            },
        )
    }

    /// Worker `id` is attached here no more (it left, or attached to another replica).
    pub(crate) fn remove(&mut self, id: &str) -> Option<WorkerRec> {
        self.attached.remove(id)
    }

    /// Free worker `id` is promised to `actor`'s activation.
    pub(crate) fn reserve(&mut self, id: &str, actor: &ActorKey) {
        if let Some(w) = self.attached.get_mut(id) {
            w.slot = Slot::Reserved(actor.clone());
        }
    }

    /// The records place `actor` on worker `id`.
    pub(crate) fn host(&mut self, id: &str, actor: &ActorKey) {
        if let Some(w) = self.attached.get_mut(id) {
            w.slot = Slot::Hosting(actor.clone());
        }
    }

    /// `key` is on worker `id` no more (hosted or promised): its slot is vacant.
    /// Whether it has room now.
    pub(crate) fn release(&mut self, id: &str, key: &ActorKey) -> bool {
        match self.attached.get_mut(id) {
            Some(w) if w.slot.actor() == Some(key) => w.vacate(),
            _ => false,
        }
    }

    /// Worker `id`'s reservation for `actor` went unused: its slot is vacant. Whether
    /// it has room now.
    pub(crate) fn unreserve(&mut self, id: &str, actor: &ActorKey) -> bool {
        self.forget_reservation(id, actor);
        match self.attached.get_mut(id) {
            Some(w) if matches!(&w.slot, Slot::Reserved(k) if k == actor) => w.vacate(),
            _ => false,
        }
    }

    /// Free worker `id`, its stream open, is offered to the queue the replicas share;
    /// its pool, if it was free.
    pub(crate) fn offer(&mut self, id: &str) -> Option<String> {
        let w = self.attached.get_mut(id)?;
        if w.slot != Slot::Free || !w.is_open() {
            return None;
        }
        w.slot = Slot::Offered;
        Some(w.pool.clone())
    }

    /// Whether worker `id` is being offered.
    pub(crate) fn is_offered(&self, id: &str) -> bool {
        self.attached
            .get(id)
            .is_some_and(|w| w.slot == Slot::Offered)
    }

    /// Worker `id`'s offer found nobody: it is vacant again.
    pub(crate) fn withdraw(&mut self, id: &str) {
        if let Some(w) = self.attached.get_mut(id)
            && w.slot == Slot::Offered
        {
            w.vacate();
        }
    }

    /// Worker `id` (on its stream `link`) drains: no new actor from now on. Its pool,
    /// unless it drained already.
    pub(crate) fn drain(&mut self, id: &str, link: &Arc<WorkerLink>) -> Option<String> {
        let w = self
            .attached
            .get_mut(id)
            .filter(|w| w.on(link) && !w.leaving)?;
        w.leaving = true;
        if w.slot == Slot::Free {
            w.vacate();
        }
        Some(w.pool.clone())
    }

    /// A hosting renewal from worker `id` on stream `link`; whether it is current.
    pub(crate) fn renewed(&mut self, id: &str, link: &Arc<WorkerLink>) -> bool {
        match self.attached.get_mut(id) {
            Some(w) if w.on(link) => {
                w.last_renewal = Instant::now();
                true
            }
            _ => false,
        }
    }

    /// Worker `id` hosts the run Restore `restore` started; whether it is attached.
    pub(crate) fn runs(&mut self, id: &str, restore: u64) -> bool {
        match self.attached.get_mut(id) {
            Some(w) => {
                w.hosting_restore = restore;
                true
            }
            None => false,
        }
    }

    /// Tells worker `id` to drop `key` (recorded as `row`), if it is attached; no
    /// answer awaited.
    pub(crate) fn evict(&self, id: &str, key: &ActorKey, row: &ActorRow) {
        if let Some(w) = self.attached.get(id) {
            w.link.notify(Command::Evict(wk::Evict {
                actor: Some(slot_of(key, row)),
            }));
        }
    }

    /// Every attached worker's stream.
    pub(crate) fn links(&self) -> Vec<Arc<WorkerLink>> {
        self.attached
            .values()
            .map(|w| Arc::clone(&w.link))
            .collect()
    }

    /// `key`'s checkpoint waits for its worker to attach again (see
    /// [`Self::awaited`]); until [`Self::not_awaited`].
    pub(crate) fn await_worker_of(&mut self, key: &ActorKey) {
        self.awaiting.insert(key.clone());
    }

    /// `key`'s checkpoint waits no more.
    pub(crate) fn not_awaited(&mut self, key: &ActorKey) {
        self.awaiting.remove(key);
    }

    /// Whether `key`'s checkpoint waits for its worker to attach again: a re-attach
    /// that reports it keeps it.
    pub(crate) fn awaited(&self, key: &ActorKey) -> bool {
        self.awaiting.contains(key)
    }

    /// Departed worker `id`, while it may still serve.
    pub(crate) fn departed(&self, id: &str) -> Option<&Departure> {
        self.departed.get(id)
    }

    /// Worker `id`'s stream ended (record `rec`): it may serve its actor until
    /// `fenced_by`. Departures whose workers have fenced by now are forgotten.
    pub(crate) fn depart(
        &mut self,
        id: &str,
        departure_id: u64,
        rec: &WorkerRec,
        fenced_by: Instant,
    ) -> Departure {
        let now = Instant::now();
        self.departed.retain(|_, d| d.fenced_by >= now);
        let departure = Departure {
            id: departure_id,
            app: rec.app_addr,
            fenced_by,
            incarnation: rec.incarnation,
            hosting: rec.slot.has_actor(),
            reserved: match &rec.slot {
                Slot::Reserved(k) => Some(k.clone()),
                _ => None,
            },
        };
        self.departed.insert(id.to_owned(), departure.clone());
        departure
    }

    /// A worker attached to a replica that died may serve its actor until its
    /// departure's `fenced_by`.
    pub(crate) fn orphaned(&mut self, id: &str, departure: Departure) {
        self.departed.insert(id.to_owned(), departure);
    }

    /// Departed worker `id` is back: the actor it was reserved for, if that
    /// reservation lives.
    pub(crate) fn back(&mut self, id: &str) -> Option<ActorKey> {
        self.departed.remove(id).and_then(|d| d.reserved)
    }

    /// The reservation of worker `id` for `actor` ended (claimed or dropped): should
    /// the worker come back after a departure, it is not reserved any more.
    pub(crate) fn forget_reservation(&mut self, id: &str, actor: &ActorKey) {
        if let Some(d) = self.departed.get_mut(id)
            && d.reserved.as_ref() == Some(actor)
        {
            d.reserved = None;
        }
    }
}

/// The actor as a worker names it in its commands.
pub(crate) fn slot_of(key: &ActorKey, row: &ActorRow) -> wk::ActorSlot {
    wk::ActorSlot {
        atespace: key.atespace().to_owned(),
        name: key.name().to_owned(),
        snapshot_key: format!("{}/{}/{}", key.atespace(), key.name(), row.uid),
    }
}
