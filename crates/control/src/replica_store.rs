//! [`ReplicaStore`]: the record in PostgreSQL for several control-plane replicas active
//! at once, with no leader (docs/scale-out.md, "Several active replicas").
//!
//! - A replica registers a row in `valet_replicas` as it joins; the row's id is its
//!   fencing token. Every write takes that row `FOR SHARE` first and is refused once
//!   the replica was declared dead; declaring it dead takes the row `FOR UPDATE`, so it
//!   waits for the replica's writes in progress, and none lands after it.
//! - Each replica heartbeats its row every [`HEARTBEAT`] with the database's `now()` on
//!   a session of its own. Any replica declares one silent for [`DEAD_AFTER`] dead. A
//!   replica whose heartbeat fails (or takes [`HEARTBEAT_TIMEOUT`]) steps down at once
//!   (`lost`), well before the others may declare it dead.
//! - Actor writes are compare-and-set on the version the replica read: a write built
//!   from a record another replica changed meanwhile is refused
//!   ([`StoreError::Conflict`]), never applied.
//! - Every change is announced by `NOTIFY valet` inside the transaction that makes it
//!   (delivered only if it commits), and heard on a dedicated session per replica (a
//!   pooled one may be recycled and lose notifications). After every (re)connect of
//!   that session the plane is told to read everything again ([`Event::Resync`]).
//! - The capacity queue is `valet_waiters`: a pool's oldest waiter is its smallest
//!   `seq`, whichever replica it waits on.
//!
//! A replica that holds the database alone (`--active-replicas one`,
//! [`crate::PostgresStore`]) takes the active advisory lock exclusively; replicas of
//! this kind take it shared, so the two kinds never write one database together.
//!
//! [`HEARTBEAT`]: crate::postgres::HEARTBEAT
//! [`HEARTBEAT_TIMEOUT`]: crate::postgres::HEARTBEAT_TIMEOUT

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client, Config, NoTls};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::model::{ActorKey, ActorStatus};
use crate::postgres::{
    ACTOR_COLUMNS, Db, Locking, SELECT_ACTOR, Session, TAKE_OVER_WITHIN, WRITE_WITHIN, actor_of,
    build_pool, migrate, spawn_heartbeat, store_error,
};
use crate::store::{ActorRow, Batch, Loaded, Store, StoreError, StoreFuture};

/// A replica whose heartbeat is older than this (by the database's clock) is dead.
pub const DEAD_AFTER: Duration = Duration::from_secs(5);
/// How long a replica may go without a session listening for the others'
/// announcements before it stops serving.
pub const DEAF_MAX: Duration = Duration::from_secs(10);
/// The channel every replica listens on.
const CHANNEL: &str = "valet";
/// How many announcements may wait for the plane; past it the plane reads everything
/// again instead.
const EVENTS: usize = 4096;
/// The fence every write of a replica starts with. The replica's row only `FOR KEY
/// SHARE`: its heartbeat (an update of another column) never waits for its own writes,
/// while declaring it dead (`FOR UPDATE`) does. The epoch row `FOR SHARE`, as a replica
/// with `--active-replicas one` taking over waits for writes too.
const FENCE: &str = "SELECT a.epoch, r.dead FROM valet_active a, valet_replicas r \
     WHERE a.id = 1 AND r.id = $1 FOR SHARE OF a FOR KEY SHARE OF r";
/// The longest a waiter, forward or worker line may be: announcements carry names
/// only (DNS labels, worker ids of at most 128 characters), far below PostgreSQL's
/// 8000-byte payload limit.
const PAYLOAD_MAX: usize = 7900;

/// What another replica (or this one) changed, as announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Event {
    /// The listening session (re)connected: announcements may have been missed, so
    /// the plane reads everything again.
    Resync,
    /// An actor was written (`record`: its uid and version now) or deleted, by
    /// replica `by`.
    Actor {
        key: ActorKey,
        by: i64,
        record: Option<(String, i64)>,
    },
    /// Atespaces were created or deleted.
    Atespaces,
    /// A worker attached, left, or changed (its row may be gone).
    Worker(String),
    /// A resume queued for capacity.
    Waiter(WaiterRow),
    /// A waiter left the queue: handed a worker by replica `handed_by`, or gone
    /// without one (`None`: it left, or its actor was no longer suspended).
    WaiterGone {
        seq: i64,
        actor: ActorKey,
        pool: String,
        handed_by: Option<i64>,
    },
    /// An eviction for a waiter was claimed (`by`) or given up (`None`).
    Evicting { seq: i64, by: Option<i64> },
    /// A replica joined, or was declared dead.
    Replica { id: i64, dead: bool },
    /// A suspend forwarded to replica `target`.
    Forward { id: i64, target: i64 },
    /// A forwarded suspend was answered, for replica `origin`.
    Answered { id: i64, origin: i64 },
}

/// A capacity waiter as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WaiterRow {
    pub(crate) seq: i64,
    pub(crate) actor: ActorKey,
    pub(crate) pool: String,
    pub(crate) replica: i64,
    /// The replica evicting an actor for it, if one is.
    pub(crate) evicting: Option<i64>,
}

/// A worker's attachment as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkerRow {
    pub(crate) id: String,
    pub(crate) pool: String,
    pub(crate) app_address: String,
    pub(crate) replica: i64,
    pub(crate) incarnation: i64,
    pub(crate) leaving: bool,
    /// Grows with every attachment of any worker: the later of two rows of one worker
    /// is the current one.
    pub(crate) attach: i64,
}

/// Everything besides actors and atespaces, read again after a reconnect.
#[derive(Debug, Default, Clone)]
pub(crate) struct View {
    /// Replicas not declared dead.
    pub(crate) live: Vec<i64>,
    pub(crate) workers: Vec<WorkerRow>,
    pub(crate) waiters: Vec<WaiterRow>,
}

/// What a hand-off of a free worker came to.
#[derive(Debug)]
pub(crate) enum HandOff<T> {
    /// Nobody this replica can serve waits in the pool: these are the `seq`s of the
    /// pool's waiters now (busy here, or being handed a worker by another replica).
    Nobody(Vec<i64>),
    /// The worker is not attached here any more, or it drains: it gets nobody.
    NotHere,
    /// The oldest waiter waits on this replica: its row is gone, the worker is its.
    Local(WaiterRow),
    /// The oldest waiter waits on another replica: its actor is claimed on the
    /// worker (RESUMING, held by this replica) with `taken`, for this replica to
    /// restore.
    Claimed(WaiterRow, Box<ActorRow>, T),
}

/// A change of this replica's waiters in the queue the replicas share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum QueueOp {
    Insert { actor: ActorKey, pool: String },
    Delete { seq: i64 },
}

/// A forwarded suspend's answer: the gRPC code, its message, and the actor (encoded)
/// when it succeeded.
pub(crate) type Answer = (i32, String, Option<Vec<u8>>);

/// The record in PostgreSQL for several active replicas. Cheap to clone.
#[derive(Clone)]
pub struct ReplicaStore {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    /// This replica's row: its fencing token.
    me: i64,
    /// `valet_active`'s epoch when it joined: a replica that takes the database alone
    /// bumps it, and every write here checks it.
    epoch: i64,
    /// Holds the shared active lock; the heartbeat goes on it.
    session: Arc<Client>,
    events: Mutex<Option<mpsc::Receiver<Event>>>,
    /// Tells the listener the plane fell behind: read everything again.
    overflowed: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for ReplicaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaStore")
            .field("database", &self.inner.db.database)
            .field("replica", &self.inner.me)
            .finish_non_exhaustive()
    }
}

/// One announcement, as sent.
fn payload(event: &Event) -> String {
    use serde_json::json;
    let v = match event {
        Event::Resync => json!({"e": "resync"}),
        Event::Actor { key, by, record } => json!({"e": "actor", "a": key.atespace(),
            "n": key.name(), "by": by, "uid": record.as_ref().map(|r| &r.0),
            "v": record.as_ref().map(|r| r.1)}),
        Event::Atespaces => json!({"e": "atespaces"}),
        Event::Worker(id) => json!({"e": "worker", "id": id}),
        Event::Waiter(w) => json!({"e": "wait", "seq": w.seq, "a": w.actor.atespace(),
            "n": w.actor.name(), "pool": w.pool, "r": w.replica, "ev": w.evicting}),
        Event::WaiterGone {
            seq,
            actor,
            pool,
            handed_by,
        } => json!({"e": "unwait", "seq": seq, "a": actor.atespace(), "n": actor.name(),
            "pool": pool, "by": handed_by}),
        Event::Evicting { seq, by } => json!({"e": "evicting", "seq": seq, "by": by}),
        Event::Replica { id, dead } => json!({"e": "replica", "id": id, "dead": dead}),
        Event::Forward { id, target } => json!({"e": "fwd", "id": id, "to": target}),
        Event::Answered { id, origin } => json!({"e": "answered", "id": id, "to": origin}),
    };
    v.to_string()
}

/// An announcement as heard; `None` for one this version does not know (a newer
/// replica's), which is ignored.
fn parse(text: &str) -> Option<Event> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let s = |k: &str| v.get(k).and_then(serde_json::Value::as_str);
    let i = |k: &str| v.get(k).and_then(serde_json::Value::as_i64);
    let key = || ActorKey::new(s("a")?, s("n")?).ok();
    Some(match s("e")? {
        "resync" => Event::Resync,
        "actor" => Event::Actor {
            key: key()?,
            by: i("by")?,
            record: match (s("uid"), i("v")) {
                (Some(uid), Some(v)) => Some((uid.to_owned(), v)),
                _ => None,
            },
        },
        "atespaces" => Event::Atespaces,
        "worker" => Event::Worker(s("id")?.to_owned()),
        "wait" => Event::Waiter(WaiterRow {
            seq: i("seq")?,
            actor: key()?,
            pool: s("pool")?.to_owned(),
            replica: i("r")?,
            evicting: i("ev"),
        }),
        "unwait" => Event::WaiterGone {
            seq: i("seq")?,
            actor: key()?,
            pool: s("pool")?.to_owned(),
            handed_by: i("by"),
        },
        "evicting" => Event::Evicting {
            seq: i("seq")?,
            by: i("by"),
        },
        "replica" => Event::Replica {
            id: i("id")?,
            dead: v.get("dead")?.as_bool()?,
        },
        "fwd" => Event::Forward {
            id: i("id")?,
            target: i("to")?,
        },
        "answered" => Event::Answered {
            id: i("id")?,
            origin: i("to")?,
        },
        _ => return None,
    })
}

/// The announcement of `row` as `by` wrote it.
fn written(row: &ActorRow, by: i64) -> Event {
    Event::Actor {
        key: row.key(),
        by,
        record: Some((row.uid.clone(), row.version)),
    }
}

/// Announces `event` in the transaction of `c` (sent only if it commits).
async fn announce(
    c: &impl deadpool_postgres::GenericClient,
    event: &Event,
) -> Result<(), tokio_postgres::Error> {
    let text = payload(event);
    debug_assert!(text.len() <= PAYLOAD_MAX, "announcements carry names only");
    let notify = c.prepare_cached("SELECT pg_notify($1, $2)").await?;
    c.execute(&notify, &[&CHANNEL, &text]).await.map(drop)
}

fn waiter_of(r: &tokio_postgres::Row) -> Option<WaiterRow> {
    Some(WaiterRow {
        seq: r.get("seq"),
        actor: ActorKey::new(r.get("atespace"), r.get("name")).ok()?,
        pool: r.get("pool"),
        replica: r.get("replica"),
        evicting: r.get("evicting"),
    })
}

fn worker_of(r: &tokio_postgres::Row) -> WorkerRow {
    WorkerRow {
        id: r.get("id"),
        pool: r.get("pool"),
        app_address: r.get("app_address"),
        replica: r.get("replica"),
        incarnation: r.get("incarnation"),
        leaving: r.get("leaving"),
        attach: r.get("attach"),
    }
}

/// Replicas, workers and waiters as `c` sees them.
async fn read_view(
    c: &impl deadpool_postgres::GenericClient,
    database: &str,
) -> Result<View, StoreError> {
    let err = |e: tokio_postgres::Error| store_error(database, &e);
    let live = c
        .query("SELECT id FROM valet_replicas WHERE NOT dead", &[])
        .await
        .map_err(err)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let workers = c
        .query(SELECT_WORKER, &[])
        .await
        .map_err(err)?
        .iter()
        .map(worker_of)
        .collect();
    let waiters = c
        .query(&format!("{SELECT_WAITER} ORDER BY seq"), &[])
        .await
        .map_err(err)?
        .iter()
        .filter_map(waiter_of)
        .collect();
    Ok(View {
        live,
        workers,
        waiters,
    })
}

const WAITER_COLUMNS: &str = "seq, atespace, name, pool, replica, evicting";
const SELECT_WAITER: &str =
    "SELECT seq, atespace, name, pool, replica, evicting FROM valet_waiters";
const SELECT_WORKER: &str =
    "SELECT id, pool, app_address, replica, incarnation, leaving, attach FROM valet_workers";

impl ReplicaStore {
    /// Connects to `url` (refusing a schema newer than this binary's at once), takes
    /// the active lock shared (waiting while a replica that holds the database alone
    /// runs), brings the schema up to date under the migration lock, and registers
    /// this replica.
    ///
    /// # Errors
    /// An invalid URL, an unreachable database, a failed migration, or a schema newer
    /// than this binary's.
    pub async fn join(url: &str) -> Result<Self, StoreError> {
        let Session {
            config,
            database,
            client,
            lost,
            tasks,
            migration_locks,
        } = Session::open(
            url,
            Locking::Shared,
            "a control plane with --active-replicas one holds this database; waiting for it to stop",
        )
        .await?;
        let err = |e: tokio_postgres::Error| store_error(&database, &e);
        let joined = async {
            migrate(&client, &database, &migration_locks).await?;
            let epoch: i64 = client
                .query_one("SELECT epoch FROM valet_active WHERE id = 1", &[])
                .await
                .map_err(err)?
                .get(0);
            let name = format!(
                "{}:{}",
                std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()),
                std::process::id()
            );
            let me: i64 = client
                .query_one(
                    "INSERT INTO valet_replicas (name) VALUES ($1) RETURNING id",
                    &[&name],
                )
                .await
                .map_err(err)?
                .get(0);
            client
                .execute(
                    "SELECT pg_notify($1, $2)",
                    &[
                        &CHANNEL,
                        &payload(&Event::Replica {
                            id: me,
                            dead: false,
                        }),
                    ],
                )
                .await
                .map_err(err)?;
            Ok::<_, StoreError>((epoch, me))
        };
        let (epoch, me) = match tokio::time::timeout(TAKE_OVER_WITHIN, joined).await {
            Ok(Ok(joined)) => joined,
            Ok(Err(e)) => {
                lost.cancel();
                return Err(e);
            }
            Err(_) => {
                lost.cancel();
                return Err(StoreError::Lost {
                    database,
                    why: format!("could not join within {TAKE_OVER_WITHIN:?}"),
                });
            }
        };
        client
            .batch_execute("RESET statement_timeout")
            .await
            .map_err(err)?;
        tracing::info!(%database, replica = me, "joined the database's replicas");
        let session = Arc::new(client);
        let pool = build_pool(config.clone(), &database)?;
        let db = Db::new(pool, database.clone(), lost.clone(), tasks.clone());
        let (tx, rx) = mpsc::channel(EVENTS);
        let overflowed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Renews this replica's heartbeat with the database's clock, on its own session.
        spawn_heartbeat(
            &tasks,
            Arc::downgrade(&session),
            lost.clone(),
            database.clone(),
            "heartbeat failed: stopping serving",
            move |c| {
                Box::pin(async move {
                    let renewed = c
                        .execute(
                            "UPDATE valet_replicas SET heartbeat_at = now() WHERE id = $1 AND NOT dead",
                            &[&me],
                        )
                        .await?;
                    Ok((renewed != 1)
                        .then(|| format!("replica {me}: another replica declared this one dead")))
                })
            },
        );
        spawn_listen(&tasks, config, database, tx, Arc::clone(&overflowed), lost);
        Ok(Self {
            inner: Arc::new(Inner {
                db,
                me,
                epoch,
                session,
                events: Mutex::new(Some(rx)),
                overflowed,
            }),
        })
    }

    /// This replica's id (`valet_replicas.id`), its fencing token.
    pub fn replica(&self) -> i64 {
        self.inner.me
    }

    /// Cancelled once this replica must stop serving: its heartbeat failed, it was
    /// declared dead, or a commit got no answer.
    pub fn lost(&self) -> CancellationToken {
        self.inner.db.lost.clone()
    }

    /// The announcements, once (the plane's event loop takes them).
    pub(crate) fn events(&self) -> Option<mpsc::Receiver<Event>> {
        self.inner
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Whether announcements were dropped since the last call (the plane fell behind):
    /// it must read everything again.
    pub(crate) fn take_overflow(&self) -> bool {
        self.inner
            .overflowed
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    fn db(&self) -> &Db {
        &self.inner.db
    }

    /// Runs `f` in a transaction fenced by this replica's token, bounded by
    /// [`WRITE_WITHIN`]; a commit that got no answer steps the replica down (its
    /// records may no longer match the database's).
    async fn fenced<T>(
        &self,
        f: impl AsyncFnOnce(&deadpool_postgres::Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let committing = std::sync::atomic::AtomicBool::new(false);
        let run = async {
            self.db().still_active()?;
            let mut client = self.db().client().await?;
            let tx = client.transaction().await.map_err(self.db().err())?;
            let fence = tx.prepare_cached(FENCE).await.map_err(self.db().err())?;
            let row = tx
                .query_opt(&fence, &[&self.inner.me])
                .await
                .map_err(self.db().err())?;
            let refused = match row {
                None => Some("this replica's row is gone".to_owned()),
                Some(r) if r.get::<_, bool>(1) => {
                    Some("this replica was declared dead by another".to_owned())
                }
                Some(r) if r.get::<_, i64>(0) != self.inner.epoch => Some(format!(
                    "a control plane with --active-replicas one took the database over (epoch {})",
                    r.get::<_, i64>(0)
                )),
                Some(_) => None,
            };
            if let Some(why) = refused {
                self.db().lost.cancel();
                return Err(StoreError::Refused(format!(
                    "{}: {why}",
                    self.db().database
                )));
            }
            let out = f(&tx).await?;
            self.db().still_active()?;
            committing.store(true, std::sync::atomic::Ordering::Release);
            tx.commit().await.map_err(self.db().err())?;
            Ok(out)
        };
        let done = tokio::time::timeout(WRITE_WITHIN, run)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Lost {
                    database: self.db().database.clone(),
                    why: format!("no answer within {WRITE_WITHIN:?}"),
                })
            });
        if let Err(StoreError::Lost { why, .. }) = &done
            && committing.load(std::sync::atomic::Ordering::Acquire)
        {
            tracing::warn!(database = %self.db().database, %why, "a commit got no answer: stepping down to load the records again");
            self.db().lost.cancel();
        }
        done
    }

    /// A read, bounded by [`WRITE_WITHIN`].
    async fn read<T>(
        &self,
        f: impl AsyncFnOnce(&deadpool_postgres::Object) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let run = async {
            let client = self.db().client().await?;
            f(&client).await
        };
        tokio::time::timeout(WRITE_WITHIN, run)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Lost {
                    database: self.db().database.clone(),
                    why: format!("no answer within {WRITE_WITHIN:?}"),
                })
            })
    }

    /// The actors named, as recorded now (`None`: there is no such actor).
    pub(crate) async fn actors(
        &self,
        keys: &[ActorKey],
    ) -> Result<Vec<(ActorKey, Option<ActorRow>)>, StoreError> {
        let atespaces: Vec<&str> = keys.iter().map(ActorKey::atespace).collect();
        let names: Vec<&str> = keys.iter().map(ActorKey::name).collect();
        let database = self.db().database.clone();
        let found = self
            .read(async |c| {
                let err = |e: tokio_postgres::Error| store_error(&database, &e);
                let read = c
                    .prepare_cached(&format!(
                        "{SELECT_ACTOR} WHERE (atespace, name) IN \
                         (SELECT * FROM unnest($1::text[], $2::text[]))"
                    ))
                    .await
                    .map_err(err)?;
                let rows = c.query(&read, &[&atespaces, &names]).await.map_err(err)?;
                rows.iter()
                    .map(|r| actor_of(r, &database))
                    .collect::<Result<Vec<_>, _>>()
            })
            .await?;
        Ok(keys
            .iter()
            .map(|k| {
                let row = found.iter().find(|r| r.key() == *k).cloned();
                (k.clone(), row)
            })
            .collect())
    }

    /// The atespaces recorded now.
    pub(crate) async fn atespaces(&self) -> Result<Vec<String>, StoreError> {
        let database = self.db().database.clone();
        self.read(async |c| {
            Ok(c.query("SELECT name FROM atespaces ORDER BY name", &[])
                .await
                .map_err(|e| store_error(&database, &e))?
                .iter()
                .map(|r| r.get(0))
                .collect())
        })
        .await
    }

    /// Replicas, workers and waiters as recorded now.
    pub(crate) async fn view(&self) -> Result<View, StoreError> {
        let database = self.db().database.clone();
        self.read(async |c| read_view(c, &database).await).await
    }

    /// Everything, as of one moment: replicas, workers and waiters, then atespaces and
    /// actors, in one repeatable-read transaction (a claim that commits in between
    /// shows in both or in neither).
    pub(crate) async fn snapshot(&self) -> Result<(View, Vec<String>, Vec<ActorRow>), StoreError> {
        let database = self.db().database.clone();
        let run = async {
            let mut client = self.db().client().await?;
            let err = |e: tokio_postgres::Error| store_error(&database, &e);
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(err)?;
            let view = read_view(&tx, &database).await?;
            let atespaces = tx
                .query("SELECT name FROM atespaces ORDER BY name", &[])
                .await
                .map_err(err)?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let actors = tx
                .query(&format!("{SELECT_ACTOR} ORDER BY atespace, name"), &[])
                .await
                .map_err(err)?
                .iter()
                .map(|r| actor_of(r, &database))
                .collect::<Result<Vec<_>, _>>()?;
            tx.commit().await.map_err(err)?;
            Ok::<_, StoreError>((view, atespaces, actors))
        };
        tokio::time::timeout(WRITE_WITHIN, run)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Lost {
                    database: self.db().database.clone(),
                    why: format!("no answer within {WRITE_WITHIN:?}"),
                })
            })
    }

    /// One worker's attachment, as recorded now.
    pub(crate) async fn worker(&self, id: &str) -> Result<Option<WorkerRow>, StoreError> {
        let database = self.db().database.clone();
        self.read(async |c| {
            let err = |e: tokio_postgres::Error| store_error(&database, &e);
            let read = c
                .prepare_cached(&format!("{SELECT_WORKER} WHERE id = $1"))
                .await
                .map_err(err)?;
            Ok(c.query_opt(&read, &[&id])
                .await
                .map_err(err)?
                .map(|r| worker_of(&r)))
        })
        .await
    }

    /// Records that worker `w` is attached here: `None` when another process (another
    /// incarnation) holds that id on a live replica (two processes would take turns
    /// hosting its actor). A Join naming no incarnation (0) never replaces one that
    /// named its own; the same process moving here from another replica does.
    ///
    /// `keep`: the actor it reports hosting. If the record has it RUNNING on this
    /// worker, held by no operation, the same transaction moves it one version on, so
    /// that a release another replica built from an earlier version fails. Attached:
    /// its `attach` number, and the kept record (`None`: not RUNNING there, and not to
    /// be kept).
    pub(crate) async fn attach_worker(
        &self,
        w: &WorkerRow,
        keep: Option<&ActorKey>,
    ) -> Result<Option<(i64, Option<ActorRow>)>, StoreError> {
        let w = w.clone();
        self.fenced(async |tx| {
                let taken = tx
                    .query_opt(
                        "INSERT INTO valet_workers (id, pool, app_address, replica, incarnation, leaving) \
                         VALUES ($1, $2, $3, $4, $5, $6) \
                         ON CONFLICT (id) DO UPDATE SET pool = excluded.pool, \
                         app_address = excluded.app_address, replica = excluded.replica, \
                         incarnation = excluded.incarnation, leaving = excluded.leaving, \
                         attach = nextval('valet_attach_seq') \
                         WHERE valet_workers.replica = excluded.replica \
                            OR valet_workers.incarnation = 0 \
                            OR valet_workers.incarnation = excluded.incarnation \
                            OR NOT EXISTS (SELECT 1 FROM valet_replicas r \
                                           WHERE r.id = valet_workers.replica AND NOT r.dead) \
                         RETURNING attach",
                        &[&w.id, &w.pool, &w.app_address, &self.inner.me, &w.incarnation, &w.leaving],
                    )
                    .await
                    .map_err(self.db().err())?;
                let Some(attach) = taken.map(|r| r.get::<_, i64>(0)) else {
                    return Ok(None);
                };
                announce(tx, &Event::Worker(w.id.clone()))
                    .await
                    .map_err(self.db().err())?;
                let Some(actor) = keep else {
                    return Ok(Some((attach, None)));
                };
                // Decided by the record, not by this replica's memory of it (which
                // may lag another replica's keep of the same actor).
                let kept = tx
                    .query_opt(
                        &format!(
                            "UPDATE actors SET version = version + 1 \
                             WHERE atespace = $1 AND name = $2 AND status = $3 \
                             AND worker = $4 AND op_replica IS NULL RETURNING {}",
                            ACTOR_COLUMNS
                        ),
                        &[
                            &actor.atespace(),
                            &actor.name(),
                            &ActorStatus::Running.wire(),
                            &w.id,
                        ],
                    )
                    .await
                    .map_err(self.db().err())?
                    .map(|r| actor_of(&r, &self.db().database))
                    .transpose()?;
                if let Some(row) = &kept {
                    announce(tx, &written(row, self.inner.me))
                        .await
                        .map_err(self.db().err())?;
                }
                Ok(Some((attach, kept)))
            })
        .await
    }

    /// Marks worker `id` (attached here) as draining: it takes no new actor.
    pub(crate) async fn worker_leaving(&self, id: &str) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.fenced(async |tx| {
            tx.execute(
                "UPDATE valet_workers SET leaving = TRUE WHERE id = $1 AND replica = $2",
                &[&id, &self.inner.me],
            )
            .await
            .map_err(self.db().err())?;
            announce(tx, &Event::Worker(id.clone()))
                .await
                .map_err(self.db().err())
        })
        .await
    }

    /// Forgets worker `id`'s attachment number `attach` here, if it is still the
    /// current one (a later attachment, here or elsewhere, stays).
    pub(crate) async fn detach_worker(&self, id: &str, attach: i64) -> Result<(), StoreError> {
        self.fenced(async |tx| {
            let gone = tx
                .execute(
                    "DELETE FROM valet_workers WHERE id = $1 AND replica = $2 AND attach = $3",
                    &[&id, &self.inner.me, &attach],
                )
                .await
                .map_err(self.db().err())?;
            if gone > 0 {
                announce(tx, &Event::Worker(id.to_owned()))
                    .await
                    .map_err(self.db().err())?;
            }
            Ok(())
        })
        .await
    }

    /// Writes this replica's queue changes, in this order, in one transaction: an
    /// insert's result is the waiter's `seq`, or `None` for an actor queued already
    /// (on this replica or another); a delete's, whether the row was still there (if
    /// not, a hand-off took it).
    pub(crate) async fn queue(&self, ops: &[QueueOp]) -> Result<Vec<Option<i64>>, StoreError> {
        self.fenced(async |tx| {
            let err = self.db().err();
            let mut done = Vec::with_capacity(ops.len());
            for op in ops {
                match op {
                    QueueOp::Insert { actor, pool } => {
                        let seq: Option<i64> = tx
                            .query_opt(
                                "INSERT INTO valet_waiters (atespace, name, pool, replica) \
                                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING seq",
                                &[&actor.atespace(), &actor.name(), pool, &self.inner.me],
                            )
                            .await
                            .map_err(&err)?
                            .map(|r| r.get(0));
                        if let Some(seq) = seq {
                            let row = WaiterRow {
                                seq,
                                actor: actor.clone(),
                                pool: pool.clone(),
                                replica: self.inner.me,
                                evicting: None,
                            };
                            announce(tx, &Event::Waiter(row)).await.map_err(&err)?;
                        }
                        done.push(seq);
                    }
                    QueueOp::Delete { seq } => {
                        let gone = tx
                            .query_opt(
                                &format!(
                                    "DELETE FROM valet_waiters WHERE seq = $1 AND replica = $2 \
                                     RETURNING {WAITER_COLUMNS}"
                                ),
                                &[seq, &self.inner.me],
                            )
                            .await
                            .map_err(&err)?
                            .and_then(|r| waiter_of(&r));
                        if let Some(w) = &gone {
                            let event = Event::WaiterGone {
                                seq: *seq,
                                actor: w.actor.clone(),
                                pool: w.pool.clone(),
                                handed_by: None,
                            };
                            announce(tx, &event).await.map_err(&err)?;
                        }
                        done.push(gone.map(|w| w.seq));
                    }
                }
            }
            Ok(done)
        })
        .await
    }

    /// Hands free `worker` (attached here) to the oldest waiter of `pool`, in one
    /// transaction: the waiter's row goes; one waiting here gets the worker
    /// ([`HandOff::Local`]); for one waiting on another replica, `take` locks its
    /// actor here (`None`: busy here, so it stays queued and the next one is tried)
    /// and the actor is claimed on the worker, RESUMING and held by this replica,
    /// provided it is still SUSPENDED and held by no one ([`HandOff::Claimed`]). A
    /// waiter whose actor cannot be claimed leaves the queue, and the next one is
    /// tried.
    pub(crate) async fn hand_off<T: Send + 'static>(
        &self,
        pool: &str,
        worker: &str,
        take: impl Fn(&ActorKey) -> Option<T> + Send + Sync + 'static,
    ) -> Result<HandOff<T>, StoreError> {
        self.fenced(async |tx| {
            let me = self.inner.me;
            let err = self.db().err();
            // The worker is still this replica's and not draining: otherwise nobody
            // gets it here.
            let ours = tx
                .query_opt(
                    "SELECT 1 FROM valet_workers WHERE id = $1 AND replica = $2 \
                     AND NOT leaving FOR SHARE",
                    &[&worker, &me],
                )
                .await
                .map_err(&err)?
                .is_some();
            if !ours {
                return Ok(HandOff::NotHere);
            }
            // Waiters whose actor is busy here: left in the queue, the next one tried.
            let mut passed: Vec<i64> = Vec::new();
            loop {
                let Some(waiter) = tx
                    .query_opt(
                        &format!(
                            "{SELECT_WAITER} WHERE pool = $1 AND NOT (seq = ANY($2)) \
                             ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED"
                        ),
                        &[&pool, &passed],
                    )
                    .await
                    .map_err(&err)?
                else {
                    let present = tx
                        .query("SELECT seq FROM valet_waiters WHERE pool = $1", &[&pool])
                        .await
                        .map_err(&err)?
                        .iter()
                        .map(|r| r.get(0))
                        .collect();
                    return Ok(HandOff::Nobody(present));
                };
                let Some(waiter) = waiter_of(&waiter) else {
                    continue;
                };
                if waiter.replica == me {
                    tx.execute("DELETE FROM valet_waiters WHERE seq = $1", &[&waiter.seq])
                        .await
                        .map_err(&err)?;
                    let gone = Event::WaiterGone {
                        seq: waiter.seq,
                        actor: waiter.actor.clone(),
                        pool: pool.to_owned(),
                        handed_by: Some(me),
                    };
                    announce(tx, &gone).await.map_err(&err)?;
                    return Ok(HandOff::Local(waiter));
                }
                let Some(taken) = take(&waiter.actor) else {
                    // Busy here: it stays queued, unless its actor is no longer
                    // suspended (resumed some other way, deleted, crashed): then it
                    // leaves, and its replica answers from the record.
                    let suspended = tx
                        .query_opt(
                            "SELECT 1 FROM actors WHERE atespace = $1 AND name = $2 \
                             AND status = $3 AND op_replica IS NULL",
                            &[
                                &waiter.actor.atespace(),
                                &waiter.actor.name(),
                                &ActorStatus::Suspended.wire(),
                            ],
                        )
                        .await
                        .map_err(&err)?
                        .is_some();
                    if suspended {
                        passed.push(waiter.seq);
                    } else {
                        tx.execute("DELETE FROM valet_waiters WHERE seq = $1", &[&waiter.seq])
                            .await
                            .map_err(&err)?;
                        let gone = Event::WaiterGone {
                            seq: waiter.seq,
                            actor: waiter.actor.clone(),
                            pool: pool.to_owned(),
                            handed_by: None,
                        };
                        announce(tx, &gone).await.map_err(&err)?;
                    }
                    continue;
                };
                tx.execute("DELETE FROM valet_waiters WHERE seq = $1", &[&waiter.seq])
                    .await
                    .map_err(&err)?;
                let claimed = tx
                    .query_opt(
                        &format!(
                            "UPDATE actors SET status = $3, worker = $4, \
                             version = version + 1, op_replica = $5 \
                             WHERE atespace = $1 AND name = $2 AND status = $6 \
                             AND op_replica IS NULL \
                             RETURNING {}",
                            ACTOR_COLUMNS
                        ),
                        &[
                            &waiter.actor.atespace(),
                            &waiter.actor.name(),
                            &ActorStatus::Resuming.wire(),
                            &worker,
                            &me,
                            &ActorStatus::Suspended.wire(),
                        ],
                    )
                    .await
                    .map_err(&err)?
                    .map(|r| actor_of(&r, &self.db().database))
                    .transpose()?;
                // The actor's change is announced first: a replica reads it again before it
                // tells its waiter, which then finds it claimed.
                if let Some(row) = &claimed {
                    announce(tx, &written(row, me)).await.map_err(&err)?;
                }
                let gone = Event::WaiterGone {
                    seq: waiter.seq,
                    actor: waiter.actor.clone(),
                    pool: pool.to_owned(),
                    handed_by: claimed.as_ref().map(|_| me),
                };
                announce(tx, &gone).await.map_err(&err)?;
                // Its actor is no longer suspended (deleted, crashed, resumed some
                // other way): the waiter is gone, and the next one is tried.
                if let Some(row) = claimed {
                    return Ok(HandOff::Claimed(waiter, Box::new(row), taken));
                }
            }
        })
        .await
    }

    /// Claims the oldest waiter of `pool` that no eviction serves yet, for an eviction
    /// by this replica; its `seq`, or `None` when every waiter is served.
    pub(crate) async fn claim_eviction(&self, pool: &str) -> Result<Option<i64>, StoreError> {
        let pool = pool.to_owned();
        self.fenced(async |tx| {
            let seq: Option<i64> = tx
                .query_opt(
                    "UPDATE valet_waiters SET evicting = $2 WHERE seq = ( \
                             SELECT seq FROM valet_waiters WHERE pool = $1 AND evicting IS NULL \
                             ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED) \
                         RETURNING seq",
                    &[&pool, &self.inner.me],
                )
                .await
                .map_err(self.db().err())?
                .map(|r| r.get(0));
            if let Some(seq) = seq {
                announce(
                    tx,
                    &Event::Evicting {
                        seq,
                        by: Some(self.inner.me),
                    },
                )
                .await
                .map_err(self.db().err())?;
            }
            Ok(seq)
        })
        .await
    }

    /// Gives up this replica's eviction for waiter `seq` (it ended), so that another
    /// may serve the waiter if it still waits.
    pub(crate) async fn release_eviction(&self, seq: i64) -> Result<(), StoreError> {
        self.fenced(async |tx| {
            let n = tx
                .execute(
                    "UPDATE valet_waiters SET evicting = NULL WHERE seq = $1 AND evicting = $2",
                    &[&seq, &self.inner.me],
                )
                .await
                .map_err(self.db().err())?;
            if n > 0 {
                announce(tx, &Event::Evicting { seq, by: None })
                    .await
                    .map_err(self.db().err())?;
            }
            Ok(())
        })
        .await
    }

    /// Asks replica `target` to suspend `actor` (its worker is attached there); the
    /// request's id, whose answer [`Event::Answered`] announces.
    pub(crate) async fn forward_suspend(
        &self,
        target: i64,
        actor: &ActorKey,
    ) -> Result<i64, StoreError> {
        let actor = actor.clone();
        self.fenced(async |tx| {
            let id: i64 = tx
                .query_one(
                    "INSERT INTO valet_forwards (target, origin, atespace, name) \
                         VALUES ($1, $2, $3, $4) RETURNING id",
                    &[&target, &self.inner.me, &actor.atespace(), &actor.name()],
                )
                .await
                .map_err(self.db().err())?
                .get(0);
            announce(tx, &Event::Forward { id, target })
                .await
                .map_err(self.db().err())?;
            Ok(id)
        })
        .await
    }

    /// The forwarded suspends addressed to this replica not answered yet: (id, actor).
    pub(crate) async fn forwarded_to_me(&self) -> Result<Vec<(i64, ActorKey)>, StoreError> {
        let (database, me) = (self.db().database.clone(), self.inner.me);
        self.read(async |c| {
            Ok(c.query(
                "SELECT id, atespace, name FROM valet_forwards \
                 WHERE target = $1 AND code IS NULL ORDER BY id",
                &[&me],
            )
            .await
            .map_err(|e| store_error(&database, &e))?
            .iter()
            .filter_map(|r| Some((r.get(0), ActorKey::new(r.get(1), r.get(2)).ok()?)))
            .collect())
        })
        .await
    }

    /// Answers forwarded suspend `id`.
    pub(crate) async fn answer(&self, id: i64, answer: Answer) -> Result<(), StoreError> {
        let (code, message, actor) = answer;
        self.fenced(async |tx| {
            let origin: Option<i64> = tx
                .query_opt(
                    "UPDATE valet_forwards SET code = $2, message = $3, actor = $4 \
                         WHERE id = $1 AND target = $5 AND code IS NULL RETURNING origin",
                    &[&id, &code, &message, &actor, &self.inner.me],
                )
                .await
                .map_err(self.db().err())?
                .map(|r| r.get(0));
            if let Some(origin) = origin {
                announce(tx, &Event::Answered { id, origin })
                    .await
                    .map_err(self.db().err())?;
            }
            Ok(())
        })
        .await
    }

    /// Takes the answer of this replica's forwarded suspend `id`, if it has one (the
    /// request goes with it).
    pub(crate) async fn take_answer(&self, id: i64) -> Result<Option<Answer>, StoreError> {
        self.fenced(async |tx| {
            Ok(tx
                .query_opt(
                    "DELETE FROM valet_forwards WHERE id = $1 AND origin = $2 \
                         AND code IS NOT NULL RETURNING code, message, actor",
                    &[&id, &self.inner.me],
                )
                .await
                .map_err(self.db().err())?
                .map(|r| (r.get(0), r.get(1), r.get(2))))
        })
        .await
    }

    /// Withdraws this replica's forwarded suspend `id` (its caller gave up).
    pub(crate) async fn withdraw(&self, id: i64) -> Result<(), StoreError> {
        self.fenced(async |tx| {
            tx.execute(
                "DELETE FROM valet_forwards WHERE id = $1 AND origin = $2",
                &[&id, &self.inner.me],
            )
            .await
            .map_err(self.db().err())?;
            Ok(())
        })
        .await
    }

    /// Replicas silent for [`DEAD_AFTER`] by the database's clock, other than this one.
    pub(crate) async fn silent(&self) -> Result<Vec<i64>, StoreError> {
        let (database, me) = (self.db().database.clone(), self.inner.me);
        let after = DEAD_AFTER.as_secs_f64();
        self.read(async |c| {
            Ok(c.query(
                "SELECT id FROM valet_replicas WHERE NOT dead AND id <> $1 \
                 AND heartbeat_at < now() - make_interval(secs => $2)",
                &[&me, &after],
            )
            .await
            .map_err(|e| store_error(&database, &e))?
            .iter()
            .map(|r| r.get(0))
            .collect())
        })
        .await
    }

    /// Declares replica `id` dead if it is still silent (or `now`: it is leaving
    /// itself), in one transaction that waits for its writes in progress: its
    /// waiters, its workers' attachments and its forwarded suspends go, and the
    /// suspends forwarded to it are answered `Unavailable`. Whether this call did it.
    pub(crate) async fn declare_dead(&self, id: i64, now: bool) -> Result<bool, StoreError> {
        let after = if now { 0.0 } else { DEAD_AFTER.as_secs_f64() };
        let body = async |tx: &deadpool_postgres::Transaction<'_>| {
            let err = self.db().err();
            // Leaving (`now`): whatever its last heartbeat (one may commit after this
            // transaction's `now()`).
            let silent: Option<bool> = tx
                .query_opt(
                    "SELECT $3 OR heartbeat_at < now() - make_interval(secs => $2) \
                         FROM valet_replicas WHERE id = $1 AND NOT dead FOR UPDATE",
                    &[&id, &after, &now],
                )
                .await
                .map_err(&err)?
                .map(|r| r.get(0));
            if silent != Some(true) {
                return Ok(false);
            }
            tx.execute(
                "UPDATE valet_replicas SET dead = TRUE WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(&err)?;
            for w in tx
                .query(
                    "DELETE FROM valet_waiters WHERE replica = $1 \
                         RETURNING seq, atespace, name, pool, replica, evicting",
                    &[&id],
                )
                .await
                .map_err(&err)?
                .iter()
                .filter_map(waiter_of)
            {
                let gone = Event::WaiterGone {
                    seq: w.seq,
                    actor: w.actor,
                    pool: w.pool,
                    handed_by: None,
                };
                announce(tx, &gone).await.map_err(&err)?;
            }
            tx.execute(
                "UPDATE valet_waiters SET evicting = NULL WHERE evicting = $1",
                &[&id],
            )
            .await
            .map_err(&err)?;
            for r in tx
                .query(
                    "DELETE FROM valet_workers WHERE replica = $1 RETURNING id",
                    &[&id],
                )
                .await
                .map_err(&err)?
            {
                announce(tx, &Event::Worker(r.get(0))).await.map_err(&err)?;
            }
            let unavailable = tonic::Code::Unavailable as i32;
            for r in tx
                .query(
                    "UPDATE valet_forwards SET code = $2, message = $3 \
                         WHERE target = $1 AND code IS NULL RETURNING id, origin",
                    &[
                        &id,
                        &unavailable,
                        &"the replica the actor's worker is attached to stopped",
                    ],
                )
                .await
                .map_err(&err)?
            {
                let answered = Event::Answered {
                    id: r.get(0),
                    origin: r.get(1),
                };
                announce(tx, &answered).await.map_err(&err)?;
            }
            tx.execute("DELETE FROM valet_forwards WHERE origin = $1", &[&id])
                .await
                .map_err(&err)?;
            announce(tx, &Event::Replica { id, dead: true })
                .await
                .map_err(&err)?;
            Ok(true)
        };
        if id == self.inner.me {
            // Leaving: fenced by its own token, which this ends.
            self.fenced(body).await
        } else {
            self.unfenced(body).await
        }
    }

    /// [`Self::fenced`] without the token's check: declaring another replica dead is
    /// right whatever this one's state.
    async fn unfenced<T>(
        &self,
        f: impl AsyncFnOnce(&deadpool_postgres::Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let run = async {
            let mut client = self.db().client().await?;
            let tx = client.transaction().await.map_err(self.db().err())?;
            let out = f(&tx).await?;
            tx.commit().await.map_err(self.db().err())?;
            Ok(out)
        };
        tokio::time::timeout(WRITE_WITHIN, run)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Lost {
                    database: self.db().database.clone(),
                    why: format!("no answer within {WRITE_WITHIN:?}"),
                })
            })
    }

    /// This replica leaves cleanly: it declares itself dead (its waiters and workers'
    /// attachments go), so that the others recover what it leaves at once instead of
    /// after [`DEAD_AFTER`].
    pub async fn leave(&self) {
        match self.declare_dead(self.inner.me, true).await {
            Ok(_) => tracing::info!(replica = self.inner.me, "left the database's replicas"),
            Err(e) => {
                tracing::warn!(replica = self.inner.me, error = %e, "could not leave cleanly; the others declare this replica dead after its heartbeats stop")
            }
        }
        self.db().lost.cancel();
    }

    /// The session's own view of a setting, for tests: (pooled, heartbeat's session).
    ///
    /// # Errors
    /// The database's error.
    pub async fn settings(&self, name: &str) -> Result<(String, String), StoreError> {
        let ask = "SELECT current_setting($1)";
        let pooled: String = self
            .db()
            .client()
            .await?
            .query_one(ask, &[&name])
            .await
            .map_err(self.db().err())?
            .get(0);
        let session: String = self
            .inner
            .session
            .query_one(ask, &[&name])
            .await
            .map_err(self.db().err())?
            .get(0);
        Ok((pooled, session))
    }
}

impl Store for ReplicaStore {
    fn close(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.db().close())
    }

    fn load(&self) -> StoreFuture<'_, Loaded> {
        Box::pin(async move {
            tokio::time::timeout(WRITE_WITHIN, self.db().load_all())
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::Lost {
                        database: self.db().database.clone(),
                        why: format!("no answer within {WRITE_WITHIN:?}"),
                    })
                })
        })
    }

    fn write(&self, batch: Batch) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            if batch.is_empty() {
                return Ok(());
            }
            self.fenced(async |tx| write_batch(tx, self, &batch).await)
                .await
        })
    }

    fn describe(&self) -> String {
        format!("{} (replica {})", self.db().database, self.inner.me)
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.db().still_active()?;
            let alive: Option<bool> = tokio::time::timeout(
                crate::postgres::POOL_WAIT,
                self.inner.session.query_opt(
                    "SELECT NOT dead FROM valet_replicas WHERE id = $1",
                    &[&self.inner.me],
                ),
            )
            .await
            .map_err(|_| StoreError::Postgres {
                database: self.db().database.clone(),
                why: "no answer".into(),
            })?
            .map_err(self.db().err())?
            .map(|r| r.get(0));
            if alive != Some(true) {
                return Err(StoreError::Refused(format!(
                    "{}: this replica was declared dead",
                    self.db().database
                )));
            }
            self.db().probe_pool().await
        })
    }
}

/// `batch` in `tx`: actors compare-and-set on their versions (a new actor's is 1, and
/// its atespace must exist), deletions only of what may be deleted now, every change
/// announced.
async fn write_batch(
    tx: &deadpool_postgres::Transaction<'_>,
    store: &ReplicaStore,
    batch: &Batch,
) -> Result<(), StoreError> {
    let err = store.db().err();
    let conflict = |what: String| StoreError::Conflict(what);
    let me = store.inner.me;
    let mut atespaces = false;
    for name in &batch.put_atespaces {
        let n = tx
            .execute(
                "INSERT INTO atespaces (name) VALUES ($1) ON CONFLICT DO NOTHING",
                &[name],
            )
            .await
            .map_err(&err)?;
        if n == 0 {
            return Err(conflict(format!("atespace {name}")));
        }
        atespaces = true;
    }
    for row in &batch.put_actors {
        let selector = crate::store::encode_selector(&row.selector);
        let held = row.held_by(me);
        let status = row.status.wire();
        // A worker is placed only by the replica it is attached to: a restore's claim
        // or its end on a worker that left (or attached elsewhere) meanwhile is refused.
        if let Some(worker) = &row.worker
            && matches!(
                row.status,
                ActorStatus::Resuming | ActorStatus::Running | ActorStatus::Suspending
            )
            && !attached_here(tx, worker, me).await.map_err(&err)?
        {
            return Err(conflict(format!(
                "actor {} (its worker {worker} is not attached to this replica)",
                row.key()
            )));
        }
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 14] = [
            &row.atespace,
            &row.name,
            &row.uid,
            &row.template_namespace,
            &row.template,
            &row.pool,
            &status,
            &row.version,
            &row.worker,
            &selector,
            &row.revert_pending,
            &held,
            &row.snapshot,
            &row.reason,
        ];
        let n = if row.version == 1 {
            tx.execute(
                &tx.prepare_cached("INSERT INTO actors (atespace, name, uid, template_namespace, template, pool, status, \
                 version, worker, selector, revert_pending, op_replica, snapshot, reason) \
                 SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::text, $7::integer, \
                 $8::bigint, $9::text, $10::text, $11::boolean, $12::bigint, $13::text, $14::text \
                 WHERE EXISTS (SELECT 1 FROM atespaces WHERE name = $1) \
                 ON CONFLICT (atespace, name) DO NOTHING").await.map_err(&err)?,
                &params,
            )
            .await
            .map_err(&err)?
        } else {
            tx.execute(
                &tx.prepare_cached("UPDATE actors SET uid = $3, template_namespace = $4, template = $5, pool = $6, \
                 status = $7, version = $8, worker = $9, selector = $10, revert_pending = $11, \
                 op_replica = $12, snapshot = $13, reason = $14 \
                 WHERE atespace = $1 AND name = $2 AND version = $8::bigint - 1 AND uid = $3").await.map_err(&err)?,
                &params,
            )
            .await
            .map_err(&err)?
        };
        if n == 0 {
            return Err(conflict(format!("actor {}", row.key())));
        }
        announce(tx, &written(row, me)).await.map_err(&err)?;
    }
    for key in &batch.delete_actors {
        let n = tx
            .execute(
                "DELETE FROM actors WHERE atespace = $1 AND name = $2 \
                 AND status IN ($3, $4) AND op_replica IS NULL \
                 AND NOT EXISTS (SELECT 1 FROM valet_waiters w \
                                 WHERE w.atespace = $1 AND w.name = $2)",
                &[
                    &key.atespace(),
                    &key.name(),
                    &ActorStatus::Suspended.wire(),
                    &ActorStatus::Crashed.wire(),
                ],
            )
            .await
            .map_err(&err)?;
        if n == 0 {
            return Err(conflict(format!("actor {key}")));
        }
        let deleted = Event::Actor {
            key: key.clone(),
            by: me,
            record: None,
        };
        announce(tx, &deleted).await.map_err(&err)?;
    }
    for name in &batch.delete_atespaces {
        let n = tx
            .execute(
                "DELETE FROM atespaces WHERE name = $1 \
                 AND NOT EXISTS (SELECT 1 FROM actors WHERE atespace = $1)",
                &[name],
            )
            .await
            .map_err(&err)?;
        if n == 0 {
            return Err(conflict(format!("atespace {name}")));
        }
        atespaces = true;
    }
    if atespaces {
        announce(tx, &Event::Atespaces).await.map_err(&err)?;
    }
    for (table, lease) in crate::store::lease_bounds(batch) {
        tx.execute(
            &format!(
                "INSERT INTO {table} (id, longest_ms) VALUES (1, $1)
                 ON CONFLICT (id) DO UPDATE SET longest_ms = excluded.longest_ms"
            ),
            &[&crate::store::lease_ms(lease)],
        )
        .await
        .map_err(&err)?;
    }
    Ok(())
}

/// Whether `worker` is attached to replica `me` (locking its row `FOR SHARE` until the
/// transaction ends: an attachment elsewhere waits for it).
async fn attached_here(
    tx: &deadpool_postgres::Transaction<'_>,
    worker: &str,
    me: i64,
) -> Result<bool, tokio_postgres::Error> {
    let attached = tx
        .prepare_cached("SELECT 1 FROM valet_workers WHERE id = $1 AND replica = $2 FOR SHARE")
        .await?;
    Ok(tx.query_opt(&attached, &[&worker, &me]).await?.is_some())
}

/// Listens for announcements on a session of its own, connecting again (0.5 s
/// doubling to 5 s between tries) whenever it ends, and sends [`Event::Resync`] after
/// every connect. Ends once `lost` is cancelled or the plane stops taking events.
fn spawn_listen(
    tasks: &TaskTracker,
    config: Config,
    database: String,
    tx: mpsc::Sender<Event>,
    overflowed: Arc<std::sync::atomic::AtomicBool>,
    lost: CancellationToken,
) {
    tasks.spawn(async move {
        let mut backoff = crate::plane::store_backoff();
        // Since when no session listens (set once one was lost).
        let mut deaf_since: Option<tokio::time::Instant> = None;
        loop {
            let heard = std::sync::atomic::AtomicBool::new(false);
            let ended = tokio::select! {
                ended = listen_once(&config, &tx, &overflowed, &heard) => ended,
                () = lost.cancelled() => return,
            };
            if tx.is_closed() {
                return;
            }
            if heard.load(std::sync::atomic::Ordering::Acquire) {
                deaf_since = None;
                backoff.reset();
            }
            let deaf = *deaf_since.get_or_insert_with(tokio::time::Instant::now);
            // A replica that cannot follow the others decides from a record it no
            // longer knows: it stops serving (and joins again once it can listen).
            if deaf.elapsed() >= DEAF_MAX {
                tracing::error!(%database, after = ?DEAF_MAX, "no session to hear the other replicas on: stopping serving");
                lost.cancel();
                return;
            }
            if let Err(e) = ended {
                tracing::warn!(%database, error = %e, retry_in = ?backoff.peek(), "lost the session announcements come on; connecting again");
            }
            if !backoff.wait(&lost).await {
                return;
            }
        }
    });
}

/// One listening session, until it ends.
async fn listen_once(
    config: &Config,
    tx: &mpsc::Sender<Event>,
    overflowed: &std::sync::atomic::AtomicBool,
    listening: &std::sync::atomic::AtomicBool,
) -> Result<(), tokio_postgres::Error> {
    let (client, mut connection) = config.connect(NoTls).await?;
    let (heard_tx, mut heard) = mpsc::unbounded_channel::<String>();
    let driver = async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    if heard_tx.send(n.payload().to_owned()).is_err() {
                        return Ok(());
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            }
        }
    };
    let forward = async {
        client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
        listening.store(true, std::sync::atomic::Ordering::Release);
        let _ = tx.send(Event::Resync).await;
        while let Some(text) = heard.recv().await {
            let Some(event) = parse(&text) else { continue };
            if tx.try_send(event).is_err() {
                if tx.is_closed() {
                    return Ok(());
                }
                // Fell behind: everything is read again once it catches up.
                overflowed.store(true, std::sync::atomic::Ordering::Release);
                let _ = tx.send(Event::Resync).await;
            }
        }
        Ok::<(), tokio_postgres::Error>(())
    };
    tokio::select! {
        r = driver => r,
        r = forward => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every announcement reads back as sent; unknown ones are ignored.
    #[test]
    fn announcements_round_trip() {
        let key = ActorKey::new("demo", "p1").unwrap();
        let events = [
            Event::Resync,
            Event::Actor {
                key: key.clone(),
                by: 2,
                record: Some(("00ff".into(), 7)),
            },
            Event::Actor {
                key: key.clone(),
                by: 3,
                record: None,
            },
            Event::Atespaces,
            Event::Worker("w 1".into()),
            Event::Waiter(WaiterRow {
                seq: 7,
                actor: key.clone(),
                pool: "counter".into(),
                replica: 3,
                evicting: Some(2),
            }),
            Event::WaiterGone {
                seq: 7,
                actor: key.clone(),
                pool: "counter".into(),
                handed_by: None,
            },
            Event::WaiterGone {
                seq: 8,
                actor: key.clone(),
                pool: "counter".into(),
                handed_by: Some(4),
            },
            Event::Evicting { seq: 7, by: None },
            Event::Replica { id: 2, dead: true },
            Event::Forward { id: 9, target: 2 },
            Event::Answered { id: 9, origin: 1 },
        ];
        for e in events {
            assert_eq!(parse(&payload(&e)), Some(e.clone()), "{e:?}");
        }
        assert_eq!(parse(r#"{"e":"from-a-newer-version"}"#), None);
        assert_eq!(parse("not json"), None);
    }
}
