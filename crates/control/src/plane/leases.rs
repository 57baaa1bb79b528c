//! Route leases (`docs/leases.md`): granted on `ResumeActor` answers to routers whose
//! watch is open, recorded as ending `--route-lease` after the answer, and revoked —
//! acked by each holder, or ended — before the plane changes where an actor runs.
//! Hosting leases: a worker's renewals, and the wait before its actor may run
//! elsewhere once its stream ends.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::Status;
use valet_proto::leases as pb;

use super::{Plane, State};
use crate::model::ActorKey;
use crate::store::Batch;

/// What the plane sends on a router's watch.
pub type WatchTx = mpsc::Sender<Result<pb::PlaneMessage, Status>>;

/// Every router's watch, and the leases of every actor.
#[derive(Debug)]
pub(crate) struct LeaseBook {
    routers: HashMap<String, Watcher>,
    actors: HashMap<ActorKey, ActorLeases>,
    /// The last lease number given. One counter for every actor, seeded from the wall
    /// clock: numbers never repeat, neither after an actor's leases are revoked nor
    /// after a restart, so a router's memory of `Revoke{through}` never refuses a
    /// later grant.
    last_id: u64,
}

impl Default for LeaseBook {
    fn default() -> Self {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2));
        Self {
            routers: HashMap::new(),
            actors: HashMap::new(),
            last_id: micros,
        }
    }
}

#[derive(Debug)]
struct Watcher {
    conn: u64,
    tx: WatchTx,
}

#[derive(Debug, Default)]
struct ActorLeases {
    /// The highest lease number granted on the actor.
    last_id: u64,
    held: HashMap<String, Held>,
}

#[derive(Debug)]
struct Held {
    id: u64,
    until: Instant,
    ack: Option<oneshot::Sender<()>>,
}

/// A lease granted: how long (counted by the router from its request) and its number.
pub(crate) type Grant = (Duration, u64);

fn actor_of(key: &ActorKey) -> pb::Actor {
    pb::Actor {
        atespace: key.atespace().to_owned(),
        name: key.name().to_owned(),
    }
}

impl State {
    /// Grants `holder` a lease on `key`, if its watch is open. The caller has checked,
    /// under this lock, that the actor is RUNNING on an attached worker with no
    /// operation on it (so no revocation is pending).
    pub(crate) fn grant(&mut self, key: &ActorKey, holder: &str, lease: Duration) -> Option<Grant> {
        if lease.is_zero() || !self.leases.routers.contains_key(holder) {
            return None;
        }
        self.leases.last_id += 1;
        let id = self.leases.last_id;
        let al = self.leases.actors.entry(key.clone()).or_default();
        al.last_id = id;
        // Router ids are new with every router process: ended leases go here, or the
        // map would keep one per router start for as long as the actor runs.
        let now = Instant::now();
        al.held.retain(|_, h| h.until > now);
        al.held.insert(
            holder.to_owned(),
            Held {
                id,
                until: Instant::now() + lease,
                ack: None,
            },
        );
        Some((lease, id))
    }

    /// Whether `holder` holds a lease on `key` that has not ended.
    pub(crate) fn holds_lease(&self, key: &ActorKey, holder: &str) -> bool {
        let now = Instant::now();
        self.leases
            .actors
            .get(key)
            .and_then(|al| al.held.get(holder))
            .is_some_and(|h| h.until > now)
    }

    /// Leases not yet ended, for tests and status.
    pub(crate) fn leases_held(&self, key: &ActorKey) -> usize {
        let now = Instant::now();
        self.leases
            .actors
            .get(key)
            .map_or(0, |al| al.held.values().filter(|h| h.until > now).count())
    }
}

/// The route leases of the plane: routers' watches, grants' acknowledgements, and
/// revocations before an actor moves (`docs/leases.md`). Obtained with
/// [`Plane::leases`].
#[derive(Debug, Clone, Copy)]
pub struct Leases<'a> {
    plane: &'a Plane,
}

impl Plane {
    /// The route leases of the plane.
    pub fn leases(&self) -> Leases<'_> {
        Leases { plane: self }
    }
}

impl Leases<'_> {
    /// A router opened its watch as `router`; `AlreadyExists` while another watch with
    /// that id is open.
    pub fn router_watching(&self, router: &str, tx: WatchTx) -> Result<u64, Status> {
        let plane = self.plane;
        if router.is_empty() || router.len() > 128 {
            return Err(Status::invalid_argument(
                "router_id must be 1-128 characters",
            ));
        }
        let mut st = plane.lock();
        if st
            .leases
            .routers
            .get(router)
            .is_some_and(|w| !w.tx.is_closed())
        {
            return Err(Status::already_exists(format!(
                "router {router} already has a watch open"
            )));
        }
        let conn = st.id();
        st.leases
            .routers
            .insert(router.to_owned(), Watcher { conn, tx });
        tracing::info!(router, "router watching its leases");
        Ok(conn)
    }

    /// `router`'s watch `conn` ended: it gets no new lease; those it holds end by
    /// themselves.
    pub(crate) fn router_detached(&self, router: &str, conn: u64) {
        let plane = self.plane;
        let mut st = plane.lock();
        if st
            .leases
            .routers
            .get(router)
            .is_some_and(|w| w.conn == conn)
        {
            st.leases.routers.remove(router);
            tracing::info!(router, "router's lease watch ended");
        }
    }

    /// `router` acked the revocation of its leases on `actor` up to `through`.
    pub fn lease_acked(&self, router: &str, actor: &pb::Actor, through: u64) {
        let plane = self.plane;
        let Ok(key) = ActorKey::new(&actor.atespace, &actor.name) else {
            return;
        };
        let ack = {
            let mut st = plane.lock();
            let Some(al) = st.leases.actors.get_mut(&key) else {
                return;
            };
            match al.held.get(router) {
                Some(h) if h.id <= through => al.held.remove(router).and_then(|h| h.ack),
                _ => None,
            }
        };
        if let Some(ack) = ack {
            let _ = ack.send(());
        }
    }

    /// `router` stopped cleanly: every lease it held ends now.
    pub fn leases_released(&self, router: &str) {
        let plane = self.plane;
        let acks: Vec<oneshot::Sender<()>> = {
            let mut st = plane.lock();
            st.leases
                .actors
                .values_mut()
                .filter_map(|al| al.held.remove(router).and_then(|h| h.ack))
                .collect()
        };
        for ack in acks {
            let _ = ack.send(());
        }
        tracing::info!(router, "router released its leases");
    }

    /// Ends every router's watch (shutdown): routers watch again when a plane returns.
    pub(crate) fn close_watches(&self) {
        let plane = self.plane;
        plane.lock().leases.routers.clear();
    }

    /// Revokes the route leases on `key`: each holder with a lease not yet ended is
    /// told, and this waits until it acks or its lease ends. Called under the actor's
    /// operation lock (so `ResumeActor` answers `Aborted` and grants nothing meanwhile).
    /// For the previous run's recorded route lease after the plane started it waits
    /// first, also with `--route-lease 0`: leases that run granted may still be held.
    pub(crate) async fn revoke_leases(&self, key: &ActorKey) {
        let plane = self.plane;
        // Also with `--route-lease 0`: the previous run may have granted some.
        tokio::time::sleep_until(plane.inner.leases_unknown_until).await;
        if plane.config().route_lease.is_zero() {
            return;
        }
        type Wait = (
            oneshot::Receiver<()>,
            Instant,
            Option<mpsc::WeakSender<Result<pb::PlaneMessage, Status>>>,
        );
        let (mut waits, through): (Vec<Wait>, u64) = {
            let mut st = plane.lock();
            let now = Instant::now();
            let State { leases, .. } = &mut *st;
            let Some(al) = leases.actors.get_mut(key) else {
                return;
            };
            al.held.retain(|_, h| h.until > now);
            if al.held.is_empty() {
                // Nothing outstanding: the actor's entry goes, or every actor ever
                // leased would keep one.
                leases.actors.remove(key);
                return;
            }
            let through = al.last_id;
            let waits = al
                .held
                .iter_mut()
                .map(|(router, h)| {
                    let (tx, rx) = oneshot::channel();
                    h.ack = Some(tx);
                    // Weak: a watch the plane ends meanwhile (shutdown, its router
                    // gone) is not held open by a revocation waiting for its ack.
                    (
                        rx,
                        h.until,
                        leases.routers.get(router).map(|w| w.tx.downgrade()),
                    )
                })
                .collect();
            (waits, through)
        };
        let started = Instant::now();
        // Sent with the lock released. A watch whose queue is full (a router behind on
        // many revocations at once, as at shutdown) gets its Revoke when there is room,
        // not never: after every other holder got theirs, each send waiting at most
        // until that lease ends anyway.
        let revoke = || {
            Ok(pb::PlaneMessage {
                message: Some(pb::plane_message::Message::Revoke(pb::Revoke {
                    actor: Some(actor_of(key)),
                    through,
                })),
            })
        };
        let mut behind = Vec::new();
        for (_, until, tx) in &mut waits {
            if let Some(tx) = tx.take().and_then(|w| w.upgrade())
                && let Err(mpsc::error::TrySendError::Full(m)) = tx.try_send(revoke())
            {
                behind.push((tx, m, *until));
            }
        }
        for (tx, m, until) in behind {
            let _ = tokio::time::timeout_at(until, tx.send(m)).await;
        }
        for (rx, until, _) in waits {
            tokio::select! {
                _ = rx => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
        plane.lock().leases.actors.remove(key);
        plane.metrics().revoked(started.elapsed());
        tracing::debug!(actor = %key, took = ?started.elapsed(), "route leases revoked");
    }

    /// Once the route leases (`hosting` false) or the hosting leases (true) of earlier
    /// runs have ended, records this run's `--route-lease` or `--hosting-lease` as the
    /// longest that may be held, so that the next start waits out no more than that.
    /// A failed write leaves the longer one recorded: the next start waits longer than
    /// it needs to, never shorter. Cancelled by shutdown.
    pub(super) fn spawn_lower_lease_bound(&self, hosting: bool) {
        let plane = self.plane;
        let chores = plane.inner.chores.clone();
        let plane = plane.clone();
        chores.spawn(async move {
            let (ended, lease) = if hosting {
                (plane.inner.workers_unknown_until, plane.config().hosting_lease)
            } else {
                (plane.inner.leases_unknown_until, plane.config().route_lease)
            };
            tokio::select! {
                () = tokio::time::sleep_until(ended) => {}
                () = plane.inner.shutdown.cancelled() => return,
            }
            let batch = Batch {
                route_lease: (!hosting).then_some(lease),
                hosting_lease: hosting.then_some(lease),
                ..Batch::default()
            };
            let which = if hosting { "hosting" } else { "route" };
            match plane.inner.store.write(batch).await {
                Ok(()) => tracing::info!(
                    ?lease,
                    "the previous run's longer {which} leases have ended"
                ),
                Err(e) => tracing::warn!(
                    error = %e,
                    "could not record the shorter {which} lease; the next start waits out the longer one"
                ),
            }
        });
    }

    /// How many actors the lease book keeps records of, and how many holders those
    /// records name, ended or not (tests: the book does not grow without bound).
    pub fn lease_records(&self) -> (usize, usize) {
        let plane = self.plane;
        let st = plane.lock();
        let actors = &st.leases.actors;
        (actors.len(), actors.values().map(|al| al.held.len()).sum())
    }

    /// Route leases outstanding on `atespace/name` now.
    pub fn leases_held(&self, atespace: &str, name: &str) -> usize {
        let plane = self.plane;
        ActorKey::new(atespace, name).map_or(0, |k| plane.lock().leases_held(&k))
    }
}
