//! [`PostgresStore`]: the control plane's record in PostgreSQL (`--database
//! postgres://…`), through `tokio-postgres` with a `deadpool-postgres` pool.
//!
//! One control plane is active on a database at a time (docs/scale-out.md): it holds a
//! session advisory lock on a dedicated connection, and writes under the epoch it
//! took when it became active. A replica started while another is active waits, as a
//! standby, for the lock (not listening meanwhile), then takes over with the next
//! epoch, as a restart would. A write whose transaction finds another epoch is
//! refused (fenced), and a replica that loses the lock's connection stops serving
//! (its workers detached at once) and waits as a standby again, so a replica that
//! was replaced never writes again.

use std::str::FromStr;
use std::time::Duration;

use deadpool_postgres::GenericClient;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::{Client, Config, NoTls};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::model::ActorStatus;
use crate::store::{ActorRow, Batch, Loaded, SCHEMA_VERSION, Store, StoreError, StoreFuture};

/// Advisory-lock key serializing migrations ("valet-mg").
const MIGRATION_LOCK: i64 = 0x7661_6c65_742d_6d67;
/// Advisory-lock key of the active control plane ("valet-cp").
const ACTIVE_LOCK: i64 = 0x7661_6c65_742d_6370;
/// The advisory-lock keys (migration, active) a replica holds, taken in this order.
/// Advisory locks are per database, and deployments in different schemas of one
/// database must not share them: a schema chosen in the URL (`search_path` in its
/// options) has keys of its own. Without a chosen schema, or with `public`, the keys
/// earlier versions used, so that replicas of both versions exclude each other during
/// an upgrade; and when the tables are nevertheless in another schema (the role's
/// own, through the default `"$user", public` path), that schema's keys as well, so
/// that a replica whose URL names that schema excludes this one too.
pub(crate) fn lock_keys(chosen: bool, schema: Option<&str>) -> Vec<(i64, i64)> {
    let legacy = (MIGRATION_LOCK, ACTIVE_LOCK);
    let of = |schema: &str| {
        // FNV-1a: stable across versions and platforms.
        let hash = schema.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let hash = i64::from_ne_bytes(hash.to_ne_bytes());
        (MIGRATION_LOCK ^ hash, ACTIVE_LOCK ^ hash)
    };
    match schema {
        None | Some("public") => vec![legacy],
        Some(s) if chosen => vec![of(s)],
        Some(s) => vec![legacy, of(s)],
    }
}

/// Connections in the pool.
const POOL_SIZE: usize = 8;
/// How long a write or a probe may wait for a pooled connection.
pub(crate) const POOL_WAIT: Duration = Duration::from_secs(5);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long taking over (migrating, bumping the epoch) may wait for the replaced
/// replica's writes in progress.
pub(crate) const TAKE_OVER_WITHIN: Duration = Duration::from_secs(60);
/// How long one write (from waiting for a connection to its COMMIT's answer) or one
/// load of the record may take: past the sessions' own statement timeout, for a
/// network that went silent and gives no answer at all.
pub(crate) const WRITE_WITHIN: Duration = Duration::from_secs(15);
/// How often the active replica checks it still holds the database (its epoch on the
/// lock's connection), and how long that check may take. A replica cut off from the
/// database stops within about `HEARTBEAT + HEARTBEAT_TIMEOUT`, before the server
/// notices the dead session (`SERVER_KEEPALIVE`) and a standby can take over.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(1);
pub(crate) const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
/// The lock session's TCP keepalives on the server: idle seconds, interval, count
/// (about 10 s to drop a vanished replica's session, and with it the lock).
/// With them, a server-side `tcp_user_timeout`: keepalives probe only an idle
/// connection, and data sent and never acknowledged (a reply to a host that died)
/// would otherwise hold the session, and the lock, for the OS's 15 minutes.
pub(crate) const SERVER_KEEPALIVE: &str = "SET tcp_keepalives_idle = 4; SET tcp_keepalives_interval = 2; \
     SET tcp_keepalives_count = 3; SET tcp_user_timeout = 10000";
/// Bounds on every pooled session: no statement, and no transaction left idle (a
/// replica cut off mid-write), holds the epoch row's lock against a takeover for long.
/// Commits are synchronous whatever the server's, database's or role's default: a
/// write is acknowledged only once it is durable. No `lock_timeout` from the role or
/// the database: the statement timeout bounds lock waits here, and the standby's
/// wait for the active lock and a takeover's wait for the epoch row have bounds of
/// their own (none, and 60 s).
const SESSION_LIMITS: &str = "-c statement_timeout=10000 -c idle_in_transaction_session_timeout=10000 \
     -c lock_timeout=0 -c synchronous_commit=on";
/// How long the active replica may fail to open any pooled connection (its role lost
/// LOGIN, its password was rotated, the server is full) before it steps down, so that
/// a replica that can connect takes over; its lock session alone kept it active.
const POOL_FAILING_MAX: Duration = Duration::from_secs(10);
/// Connect failures further apart than this start [`POOL_FAILING_MAX`] over (longer
/// than a readiness probe's period, so probes alone keep the count).
const POOL_FAILING_GAP: Duration = Duration::from_secs(30);
/// How long the readiness probe waits for a pooled connection (one being opened).
const PROBE_POOL_WAIT: Duration = Duration::from_millis(500);

/// PostgreSQL's migrations: `MIGRATIONS[v - 1]` brings version `v - 1` to `v` (see
/// [`SCHEMA_VERSION`]).
const MIGRATIONS: [&str; SCHEMA_VERSION as usize] = [
    "CREATE TABLE atespaces (
         name TEXT PRIMARY KEY
     );
     CREATE TABLE actors (
         atespace TEXT NOT NULL,
         name TEXT NOT NULL,
         uid TEXT NOT NULL,
         template_namespace TEXT NOT NULL,
         template TEXT NOT NULL,
         pool TEXT NOT NULL,
         status INTEGER NOT NULL,
         version BIGINT NOT NULL,
         worker TEXT,
         selector TEXT NOT NULL,
         revert_pending BOOLEAN NOT NULL DEFAULT FALSE,
         PRIMARY KEY (atespace, name)
     );
     CREATE TABLE valet_active (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         epoch BIGINT NOT NULL
     );
     INSERT INTO valet_active (id, epoch) VALUES (1, 0);",
    // Records that place one worker on several actors (older versions could write
    // them) go back to SUSPENDED (4) first, as a restart would release them.
    // Deferred: a batch that moves a worker between actors is checked at commit.
    "UPDATE actors SET status = 4, worker = NULL, version = version + 1
         WHERE worker IN (SELECT worker FROM actors WHERE worker IS NOT NULL
                          GROUP BY worker HAVING count(*) > 1);
     ALTER TABLE actors ADD CONSTRAINT actors_one_per_worker UNIQUE (worker)
         DEFERRABLE INITIALLY DEFERRED;",
    "CREATE TABLE route_lease_bound (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         longest_ms BIGINT NOT NULL CHECK (longest_ms >= 0)
     );",
    "CREATE TABLE hosting_lease_bound (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         longest_ms BIGINT NOT NULL CHECK (longest_ms >= 0)
     );",
    // Several replicas active at once (docs/scale-out.md). A replica's id is its
    // fencing token; `op_replica` names the replica whose operation holds a RESUMING
    // or SUSPENDING actor; a worker's row names the replica it is attached to; a
    // waiter's `seq` orders its pool's queue across replicas; a worker's `attach`
    // grows with each attachment, so that a late read or delete of an earlier one
    // is told from the current one.
    "ALTER TABLE actors ADD COLUMN op_replica BIGINT;
     CREATE TABLE valet_replicas (
         id BIGSERIAL PRIMARY KEY,
         name TEXT NOT NULL,
         started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
         heartbeat_at TIMESTAMPTZ NOT NULL DEFAULT now(),
         dead BOOLEAN NOT NULL DEFAULT FALSE
     );
     CREATE SEQUENCE valet_attach_seq;
     CREATE TABLE valet_workers (
         id TEXT PRIMARY KEY,
         pool TEXT NOT NULL,
         app_address TEXT NOT NULL,
         replica BIGINT NOT NULL,
         incarnation BIGINT NOT NULL,
         leaving BOOLEAN NOT NULL DEFAULT FALSE,
         attach BIGINT NOT NULL DEFAULT nextval('valet_attach_seq')
     );
     CREATE TABLE valet_waiters (
         seq BIGSERIAL PRIMARY KEY,
         atespace TEXT NOT NULL,
         name TEXT NOT NULL,
         pool TEXT NOT NULL,
         replica BIGINT NOT NULL,
         evicting BIGINT,
         UNIQUE (atespace, name)
     );
     CREATE INDEX valet_waiters_by_pool ON valet_waiters (pool, seq);
     CREATE TABLE valet_forwards (
         id BIGSERIAL PRIMARY KEY,
         target BIGINT NOT NULL,
         origin BIGINT NOT NULL,
         atespace TEXT NOT NULL,
         name TEXT NOT NULL,
         code INTEGER,
         message TEXT,
         actor BYTEA
     );",
    "ALTER TABLE actors ADD COLUMN IF NOT EXISTS snapshot TEXT NOT NULL DEFAULT '';
     ALTER TABLE actors ADD COLUMN IF NOT EXISTS reason TEXT NOT NULL DEFAULT '';",
];

/// The control plane's record in PostgreSQL, one replica active at a time. Cheap to
/// clone.
#[derive(Clone)]
pub struct PostgresStore {
    db: Db,
    epoch: i64,
    /// Keeps the advisory lock's connection (and so the lock) alive; the probes ask
    /// on it.
    active: std::sync::Arc<Client>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("database", &self.db.database)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// What both PostgreSQL stores share: the pool, the database as logs name it, and the
/// token cancelled once the replica must stop serving. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Db {
    pub(crate) pool: Pool,
    pub(crate) database: String,
    pub(crate) lost: CancellationToken,
    /// The store's own tasks: its session's connection, the heartbeat, the listener.
    pub(crate) tasks: TaskTracker,
    /// Since when, and until when, no pooled connection could be opened, while every
    /// try since has failed.
    pool_failing:
        std::sync::Arc<std::sync::Mutex<Option<(tokio::time::Instant, tokio::time::Instant)>>>,
}

/// The database's address for logs: hosts, ports, database and user, never the
/// password.
pub(crate) fn describe(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .zip(config.get_ports().iter().chain(std::iter::repeat(&5432)))
        .map(|(h, p)| match h {
            tokio_postgres::config::Host::Tcp(h) => format!("{h}:{p}"),
            tokio_postgres::config::Host::Unix(path) => format!("{}:{p}", path.display()),
        })
        .collect();
    format!(
        "postgres {}/{} (user {})",
        hosts.join(","),
        config.get_dbname().unwrap_or("postgres"),
        config.get_user().unwrap_or("-"),
    )
}

/// The server's message for database errors, the error itself otherwise.
pub(crate) fn why(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => valet_proto::error_chain(e),
    }
}

/// The session settings both stores connect with, and the database as logs name it:
/// the URL's own options kept, with the control plane's limits after them.
///
/// # Errors
/// A URL that is not PostgreSQL's.
pub(crate) fn session_config(url: &str) -> Result<(Config, String), StoreError> {
    let mut config = Config::from_str(url).map_err(|e| StoreError::Postgres {
        database: "--database".into(),
        why: format!("not a PostgreSQL URL: {}", why(&e)),
    })?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    config.application_name("valet control-plane");
    // Every session writes: with several hosts in the URL, only a primary will do.
    config.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
    // The URL's own options (`-c search_path=…`, say) stay, with the limits after.
    let options = match config.get_options() {
        Some(own) if !own.trim().is_empty() => format!("{own} {SESSION_LIMITS}"),
        _ => SESSION_LIMITS.to_owned(),
    };
    config.options(&options);
    // Data sent and not acknowledged for this long ends the connection (keepalives
    // only probe an idle one).
    config.tcp_user_timeout(Duration::from_secs(10));
    // A session that waits for a lock with no statement timeout (a standby) is bounded
    // only by these: a silently dead connection (a dropped NAT entry, a failover
    // behind a virtual IP) goes unnoticed for about 10 s instead of the OS's 11
    // minutes.
    config.keepalives(true);
    config.keepalives_idle(Duration::from_secs(4));
    config.keepalives_interval(Duration::from_secs(2));
    config.keepalives_retries(3);
    let database = describe(&config);
    Ok((config, database))
}

/// A session of its own (not pooled), and the token cancelled when it ends. The
/// connection is owned by its task: it ends when the client is dropped, or once the
/// token is cancelled (the replica stepped down), so that the session (and any lock
/// it holds, should the server still count it held) does not outlive the replica's
/// serving, also while clones of the store linger.
///
/// # Errors
/// [`StoreError::Unreachable`] when no connection can be made.
pub(crate) async fn connect_session(
    config: &Config,
    database: &str,
) -> Result<(Client, CancellationToken, TaskTracker), StoreError> {
    let (client, connection) =
        config
            .connect(NoTls)
            .await
            .map_err(|e| StoreError::Unreachable {
                database: database.to_owned(),
                why: why(&e),
            })?;
    let lost = CancellationToken::new();
    let tasks = TaskTracker::new();
    {
        let lost = lost.clone();
        let database = database.to_owned();
        let held = lost.clone();
        tasks.spawn(async move {
            tokio::select! {
                ended = connection => {
                    if let Err(e) = ended {
                        tracing::error!(%database, why = %why(&e), "lost the database connection");
                    }
                }
                () = held.cancelled() => {}
            }
            lost.cancel();
        });
    }
    Ok((client, lost, tasks))
}

/// A replica's own session on the database, holding its active lock(s), with no
/// statement timeout (what it does next is bounded by its caller).
pub(crate) struct Session {
    pub(crate) config: Config,
    pub(crate) database: String,
    pub(crate) client: Client,
    pub(crate) lost: CancellationToken,
    /// Its connection's task, and the tasks the store adds (heartbeat, listener).
    pub(crate) tasks: TaskTracker,
    pub(crate) migration_locks: Vec<i64>,
}

impl Session {
    /// Connects to `url`, refuses a schema newer than this binary's at once (before
    /// any wait), and takes the active lock `locking` (logging `waiting` while one of
    /// the other kind holds it). With `Locking::Exclusive` (one active replica),
    /// migrating waits for the active lock, so a new version never changes the schema
    /// under an older replica that holds it. With `Locking::Shared` (all active) it
    /// does not: a new version's replica migrates beside older ones still serving, so
    /// every migration must keep the previous version's reads and writes working
    /// (add, never rename or drop; deploy/README.md says so).
    pub(crate) async fn open(
        url: &str,
        locking: Locking,
        waiting: &str,
    ) -> Result<Self, StoreError> {
        let (config, database) = session_config(url)?;
        let err = |e: tokio_postgres::Error| store_error(&database, &e);
        let (client, lost, tasks) = connect_session(&config, &database).await?;
        check_version(&client, &database).await?;
        client.batch_execute(SERVER_KEEPALIVE).await.map_err(err)?;
        let keys = schema_keys(&client, &config, &database).await?;
        take_active_locks(&client, &keys, locking, &database, waiting).await?;
        client
            .batch_execute("SET statement_timeout = 0")
            .await
            .map_err(err)?;
        Ok(Self {
            migration_locks: keys.iter().map(|(m, _)| *m).collect(),
            config,
            database,
            client,
            lost,
            tasks,
        })
    }
}

/// How a replica takes the active advisory locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Locking {
    /// One replica alone (`--active-replicas one`).
    Exclusive,
    /// Beside the others of its kind (`--active-replicas all`).
    Shared,
}

/// Takes the active advisory lock of each of `keys` on `client`'s session, waiting
/// (with `waiting` logged once, and no statement timeout: as long as the holder
/// lives) while one of the other kind holds it.
///
/// # Errors
/// The database's error.
pub(crate) async fn take_active_locks(
    client: &Client,
    keys: &[(i64, i64)],
    locking: Locking,
    database: &str,
    waiting: &str,
) -> Result<(), StoreError> {
    let err = |e: tokio_postgres::Error| store_error(database, &e);
    let (try_lock, lock) = match locking {
        Locking::Exclusive => (
            "SELECT pg_try_advisory_lock($1)",
            "SELECT pg_advisory_lock($1)",
        ),
        Locking::Shared => (
            "SELECT pg_try_advisory_lock_shared($1)",
            "SELECT pg_advisory_lock_shared($1)",
        ),
    };
    let mut waited = false;
    for (_, active_lock) in keys {
        let held: bool = client
            .query_one(try_lock, &[active_lock])
            .await
            .map_err(err)?
            .get(0);
        if held {
            continue;
        }
        if !waited {
            waited = true;
            tracing::info!(%database, "{waiting}");
            client
                .batch_execute("SET statement_timeout = 0")
                .await
                .map_err(err)?;
        }
        client.execute(lock, &[active_lock]).await.map_err(err)?;
    }
    Ok(())
}

/// The advisory-lock keys of the schema `client`'s session works in (see
/// [`lock_keys`]).
///
/// # Errors
/// A `search_path` in the URL that names no schema that exists, or the database's
/// error.
pub(crate) async fn schema_keys(
    client: &Client,
    config: &Config,
    database: &str,
) -> Result<Vec<(i64, i64)>, StoreError> {
    let chosen = config
        .get_options()
        .is_some_and(|o| o.contains("search_path"));
    let schema: Option<String> = client
        .query_one("SELECT current_schema()", &[])
        .await
        .map_err(|e| store_error(database, &e))?
        .get(0);
    if chosen && schema.is_none() {
        return Err(StoreError::Postgres {
            database: database.to_owned(),
            why: "the URL's search_path names no schema that exists: create it first".into(),
        });
    }
    Ok(lock_keys(chosen, schema.as_deref()))
}

/// The pool of sessions writes and reads go through.
///
/// # Errors
/// When the pool cannot be built.
pub(crate) fn build_pool(config: Config, database: &str) -> Result<Pool, StoreError> {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(POOL_SIZE)
        .wait_timeout(Some(POOL_WAIT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| StoreError::Postgres {
            database: database.to_owned(),
            why: e.to_string(),
        })
}

impl PostgresStore {
    /// Whether `url` is a PostgreSQL URL the store can use (checked with the other
    /// flags, before anything starts).
    ///
    /// # Errors
    /// Why it is not: not a PostgreSQL URL, or one that asks for TLS (the store
    /// connects without it).
    pub fn check_url(url: &str) -> Result<(), String> {
        let config =
            Config::from_str(url).map_err(|e| format!("not a PostgreSQL URL: {}", why(&e)))?;
        if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
            return Err(
                "sslmode=require: the store connects without TLS; put a TLS-terminating proxy beside the control plane".into(),
            );
        }
        Ok(())
    }

    /// Connects to `url` (refusing a schema newer than [`SCHEMA_VERSION`] at once),
    /// waits until no other control plane is active on the database, becomes the
    /// active one (the next epoch), and then brings the schema to [`SCHEMA_VERSION`]
    /// (under an advisory lock as well, so replicas never migrate twice).
    ///
    /// # Errors
    /// An invalid URL, an unreachable database, a failed migration, or a schema newer
    /// than this binary's.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        // Taking over waits for the replaced replica's writes in progress (their
        // share lock on the epoch row), which its sessions' own limits end within
        // about 10 s each: longer than this session's statement timeout, so bounded
        // here instead. Running out of it is a lost connection: waited out as a
        // standby again, never a configuration error.
        let Session {
            config,
            database,
            client,
            lost,
            tasks,
            migration_locks,
        } = Session::open(
            url,
            Locking::Exclusive,
            "standby: another control plane is active on this database; waiting to take over",
        )
        .await?;
        let err = |e: tokio_postgres::Error| store_error(&database, &e);
        // The epoch goes up before the schema changes (when there is an epoch yet):
        // the replaced replica's writes are fenced first, so it never writes into a
        // schema its version does not know.
        let take_over = async {
            let bump = async {
                client
                    .query_one(
                        "UPDATE valet_active SET epoch = epoch + 1 WHERE id = 1 RETURNING epoch",
                        &[],
                    )
                    .await
                    .map(|r| r.get::<_, i64>(0))
                    .map_err(err)
            };
            let fenced: bool = client
                .query_one("SELECT to_regclass('valet_active') IS NOT NULL", &[])
                .await
                .map_err(err)?
                .get(0);
            if fenced {
                let epoch = bump.await?;
                migrate(&client, &database, &migration_locks).await?;
                Ok::<_, StoreError>(epoch)
            } else {
                migrate(&client, &database, &migration_locks).await?;
                bump.await
            }
        };
        let epoch = tokio::time::timeout(TAKE_OVER_WITHIN, take_over)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Lost {
                    database: database.clone(),
                    why: format!("could not take over within {TAKE_OVER_WITHIN:?}"),
                })
            });
        let epoch = match epoch {
            Ok(epoch) => epoch,
            Err(e) => {
                // Ends the session: its lock is let go, and a statement still waiting
                // in it (an epoch bump with nobody to serve) ends with it.
                lost.cancel();
                return Err(e);
            }
        };
        client
            .batch_execute("RESET statement_timeout")
            .await
            .map_err(err)?;
        tracing::info!(%database, epoch, "active on the database");
        let client = std::sync::Arc::new(client);
        // On the lock's own connection: this replica's epoch is still the current one.
        spawn_heartbeat(
            &tasks,
            std::sync::Arc::downgrade(&client),
            lost.clone(),
            database.clone(),
            "no longer sure to be the active control plane",
            move |c| {
                Box::pin(async move {
                    let row = c
                        .query_one("SELECT epoch FROM valet_active WHERE id = 1", &[])
                        .await?;
                    let now: i64 = row.get(0);
                    Ok((now != epoch)
                        .then(|| format!("another control plane took over (epoch {now})")))
                })
            },
        );
        let pool = build_pool(config, &database)?;
        Ok(Self {
            db: Db::new(pool, database, lost, tasks),
            epoch,
            active: client,
        })
    }

    /// Cancelled when the connection holding the active lock is lost: another replica
    /// may take over, so this one must stop.
    pub fn lost(&self) -> CancellationToken {
        self.db.lost.clone()
    }

    /// The setting `name` as a pooled session and the lock's session see it, in that
    /// order (for tests and diagnostics).
    ///
    /// # Errors
    /// The database's error.
    pub async fn settings(&self, name: &str) -> Result<(String, String), StoreError> {
        let ask = "SELECT current_setting($1)";
        let pooled: String = self
            .db
            .client()
            .await?
            .query_one(ask, &[&name])
            .await
            .map_err(self.db.err())?
            .get(0);
        let lock: String = self
            .active
            .query_one(ask, &[&name])
            .await
            .map_err(self.db.err())?
            .get(0);
        Ok((pooled, lock))
    }

    /// The epoch this replica writes under.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// `batch` in one transaction, fenced by the epoch; `committing` is set once the
    /// COMMIT is on its way (from then on, a lost connection leaves the outcome
    /// unknown).
    async fn write_batch(
        &self,
        batch: &Batch,
        committing: &std::sync::atomic::AtomicBool,
    ) -> Result<(), StoreError> {
        self.db.still_active()?;
        let mut client = self.db.client().await?;
        let tx = client.transaction().await.map_err(self.db.err())?;
        // Fenced: only the replica of the current epoch writes. The row lock makes
        // a takeover wait for this transaction, and this one see a takeover.
        let epoch: i64 = tx
            .query_one("SELECT epoch FROM valet_active WHERE id = 1 FOR SHARE", &[])
            .await
            .map_err(self.db.err())?
            .get(0);
        if epoch != self.epoch {
            self.db.lost.cancel();
            return Err(StoreError::Refused(format!(
                "another control plane took over {} (epoch {epoch}, this one {})",
                self.db.database, self.epoch
            )));
        }
        for name in &batch.put_atespaces {
            tx.execute(
                "INSERT INTO atespaces (name) VALUES ($1) ON CONFLICT DO NOTHING",
                &[name],
            )
            .await
            .map_err(self.db.err())?;
        }
        for row in &batch.put_actors {
            put_actor(&tx, row).await.map_err(self.db.err())?;
        }
        for key in &batch.delete_actors {
            tx.execute(
                "DELETE FROM actors WHERE atespace = $1 AND name = $2",
                &[&key.atespace(), &key.name()],
            )
            .await
            .map_err(self.db.err())?;
        }
        for name in &batch.delete_atespaces {
            tx.execute("DELETE FROM atespaces WHERE name = $1", &[name])
                .await
                .map_err(self.db.err())?;
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
            .map_err(self.db.err())?;
        }
        // The replica may have stepped down meanwhile (an unanswered commit of another
        // write): the records this batch was built from are no longer trusted.
        self.db.still_active()?;
        committing.store(true, std::sync::atomic::Ordering::Release);
        tx.commit().await.map_err(self.db.err())
    }
}

impl Db {
    /// Ends the store's tasks (cancelling `lost` ends each) and waits for them.
    pub(crate) async fn close(&self) {
        self.lost.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }

    pub(crate) fn new(
        pool: Pool,
        database: String,
        lost: CancellationToken,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            pool,
            database,
            lost,
            tasks,
            pool_failing: std::sync::Arc::default(),
        }
    }

    /// The whole record, unbounded (see [`Store::load`]).
    pub(crate) async fn load_all(&self) -> Result<Loaded, StoreError> {
        let client = self.client().await?;
        let atespaces = client
            .query("SELECT name FROM atespaces ORDER BY name", &[])
            .await
            .map_err(self.err())?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut actors = Vec::new();
        for r in client
            .query(&format!("{SELECT_ACTOR} ORDER BY atespace, name"), &[])
            .await
            .map_err(self.err())?
        {
            actors.push(actor_of(&r, &self.database)?);
        }
        let mut bounds = [None, None];
        for (bound, table) in bounds
            .iter_mut()
            .zip(["route_lease_bound", "hosting_lease_bound"])
        {
            *bound = client
                .query_opt(&format!("SELECT longest_ms FROM {table} WHERE id = 1"), &[])
                .await
                .map_err(self.err())?
                .map(|r| crate::store::lease_of_ms(r.get(0)));
        }
        let [route_lease, hosting_lease] = bounds;
        Ok(Loaded {
            atespaces,
            actors,
            route_lease,
            hosting_lease,
        })
    }

    /// Refuses once the replica stepped down (`lost`): from then on nothing it decided
    /// from its records in memory is written.
    pub(crate) fn still_active(&self) -> Result<(), StoreError> {
        if self.lost.is_cancelled() {
            return Err(StoreError::Refused(format!(
                "{}: no longer the active control plane",
                self.database
            )));
        }
        Ok(())
    }

    /// Notes whether a pooled connection could be had; after [`POOL_FAILING_MAX`] of
    /// failed connects (each within [`POOL_FAILING_GAP`] of the one before) and no
    /// success, steps down (`lost`). A pool busy with writes (a wait that timed out)
    /// says nothing about connecting.
    pub(crate) fn note_pool<T>(&self, got: &Result<T, deadpool_postgres::PoolError>) {
        use deadpool_postgres::{PoolError, TimeoutType};
        let mut failing = self
            .pool_failing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let why = match got {
            Ok(_) => {
                *failing = None;
                return;
            }
            Err(PoolError::Backend(e)) => why(e),
            Err(e @ PoolError::Timeout(TimeoutType::Create)) => e.to_string(),
            Err(_) => return,
        };
        let now = tokio::time::Instant::now();
        let first = match *failing {
            Some((first, last)) if now.duration_since(last) < POOL_FAILING_GAP => first,
            // Isolated failures far apart are no outage.
            _ => now,
        };
        *failing = Some((first, now));
        if now.duration_since(first) >= POOL_FAILING_MAX && !self.lost.is_cancelled() {
            tracing::error!(database = %self.database, %why, "no new database connection for {POOL_FAILING_MAX:?}: stepping down so that a replica that can connect serves");
            self.lost.cancel();
        }
    }

    pub(crate) fn err(&self) -> impl Fn(tokio_postgres::Error) -> StoreError + '_ {
        |e| store_error(&self.database, &e)
    }

    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        use deadpool_postgres::PoolError;
        let got = self.pool.get().await;
        self.note_pool(&got);
        got.map_err(|e| match e {
            PoolError::Backend(e) => store_error(&self.database, &e),
            PoolError::Timeout(_) => StoreError::Lost {
                database: self.database.clone(),
                why: format!("no connection: {e}"),
            },
            e => StoreError::Postgres {
                database: self.database.clone(),
                why: format!("no connection: {e}"),
            },
        })
    }

    /// Whether a pooled connection can still be had (an idle one, or a new one), for
    /// the readiness probe. Never waits for a pool busy with writes: that is no failure.
    pub(crate) async fn probe_pool(&self) -> Result<(), StoreError> {
        let pool = self.pool.status();
        if (pool.available > 0 || pool.size < pool.max_size)
            && let Ok(got) = tokio::time::timeout(PROBE_POOL_WAIT, self.pool.get()).await
        {
            self.note_pool(&got);
            if let Err(deadpool_postgres::PoolError::Backend(e)) = got {
                return Err(store_error(&self.database, &e));
            }
        }
        self.still_active()
    }
}

/// `e` as a store error: [`StoreError::Lost`] when the connection ended under it,
/// otherwise the database refusing the statement.
pub(crate) fn store_error(database: &str, e: &tokio_postgres::Error) -> StoreError {
    let (database, why) = (database.to_owned(), why(e));
    if connection_failed(e) {
        StoreError::Lost { database, why }
    } else {
        StoreError::Postgres { database, why }
    }
}

/// Whether `e` says the connection ended (the server restarted or shut down, the
/// session was terminated, the network failed), rather than that the server refused
/// the statement.
fn connection_failed(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        Some(state) => {
            let code = state.code();
            code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03")
        }
        // Not the server's answer: an I/O error on the way counts; anything else
        // (an answer without the row asked for, say) does not.
        None => {
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                if s.is::<std::io::Error>() {
                    return true;
                }
                source = s.source();
            }
            false
        }
    }
}

/// One liveness check of a replica on its own session: `Ok(None)` while it may go on
/// serving, `Ok(Some(why))` once it may not.
pub(crate) type Check =
    std::pin::Pin<Box<dyn Future<Output = Result<Option<String>, tokio_postgres::Error>> + Send>>;

/// Runs `check` on `client` every [`HEARTBEAT`]; when it says why the replica must
/// stop, fails, or takes longer than [`HEARTBEAT_TIMEOUT`], logs `stopping` with the
/// reason and cancels `lost` (the replica stops). Ends with the store (its client
/// dropped) or once `lost` is cancelled.
pub(crate) fn spawn_heartbeat(
    tasks: &TaskTracker,
    client: std::sync::Weak<Client>,
    lost: CancellationToken,
    database: String,
    stopping: &'static str,
    check: impl Fn(std::sync::Arc<Client>) -> Check + Send + 'static,
) {
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = lost.cancelled() => return,
                _ = tick.tick() => {}
            }
            let Some(c) = client.upgrade() else { return };
            let why = match tokio::time::timeout(HEARTBEAT_TIMEOUT, check(c)).await {
                Ok(Ok(None)) => continue,
                Ok(Ok(Some(why))) => why,
                Ok(Err(e)) => why(&e),
                Err(_) => format!("no answer within {HEARTBEAT_TIMEOUT:?}"),
            };
            tracing::error!(%database, %why, "{stopping}");
            lost.cancel();
            return;
        }
    });
}

/// Refuses a schema newer than this binary's (read without a lock).
pub(crate) async fn check_version(client: &Client, database: &str) -> Result<(), StoreError> {
    let exists: bool = client
        .query_one("SELECT to_regclass('valet_schema') IS NOT NULL", &[])
        .await
        .map_err(|e| store_error(database, &e))?
        .get(0);
    if !exists {
        return Ok(());
    }
    let found: Option<i64> = client
        .query_one("SELECT max(version) FROM valet_schema", &[])
        .await
        .map_err(|e| store_error(database, &e))?
        .get(0);
    match found {
        Some(found) if found > SCHEMA_VERSION => Err(StoreError::NewerSchema {
            database: database.to_owned(),
            found,
            supported: SCHEMA_VERSION,
        }),
        _ => Ok(()),
    }
}

/// Brings the schema to [`SCHEMA_VERSION`], one migration per transaction, under the
/// migration lock; refuses a newer schema.
pub(crate) async fn migrate(
    client: &Client,
    database: &str,
    locks: &[i64],
) -> Result<(), StoreError> {
    let err = |e: tokio_postgres::Error| match store_error(database, &e) {
        StoreError::Postgres { database, why } => StoreError::Postgres {
            database,
            why: format!("migrating the schema: {why}"),
        },
        lost => lost,
    };
    for lock in locks {
        client
            .execute("SELECT pg_advisory_lock($1)", &[lock])
            .await
            .map_err(err)?;
    }
    let result = async {
        client
            .batch_execute("CREATE TABLE IF NOT EXISTS valet_schema (version BIGINT NOT NULL)")
            .await
            .map_err(err)?;
        let found: Option<i64> = client
            .query_opt("SELECT max(version) FROM valet_schema", &[])
            .await
            .map_err(err)?
            .and_then(|r| r.get(0));
        let found = found.unwrap_or(0);
        if found > SCHEMA_VERSION {
            return Err(StoreError::NewerSchema {
                database: database.to_owned(),
                found,
                supported: SCHEMA_VERSION,
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
            let to = i as i64 + 1;
            // `Client::transaction` needs `&mut`; the lock's client is shared.
            client.batch_execute("BEGIN").await.map_err(err)?;
            let step = async {
                client.batch_execute(sql).await?;
                client.execute("DELETE FROM valet_schema", &[]).await?;
                client
                    .execute("INSERT INTO valet_schema (version) VALUES ($1)", &[&to])
                    .await?;
                client.batch_execute("COMMIT").await
            }
            .await;
            if let Err(e) = step {
                let _ = client.batch_execute("ROLLBACK").await;
                return Err(err(e));
            }
            tracing::info!(database, version = to, "database schema migrated");
        }
        Ok(())
    }
    .await;
    let mut unlocked = Ok(());
    for lock in locks.iter().rev() {
        let done = client
            .execute("SELECT pg_advisory_unlock($1)", &[lock])
            .await
            .map_err(err);
        unlocked = unlocked.and(done.map(drop));
    }
    result.and(unlocked)
}

/// The columns of an actor row, in [`actor_of`]'s order.
macro_rules! actor_columns {
    () => {
        "atespace, name, uid, template_namespace, template, pool, status, version, worker, \
         selector, revert_pending, op_replica, snapshot, reason"
    };
}

/// An actor row's columns, for `RETURNING`.
pub(crate) const ACTOR_COLUMNS: &str = actor_columns!();
pub(crate) const SELECT_ACTOR: &str = concat!("SELECT ", actor_columns!(), " FROM actors");

/// An actor row as [`SELECT_ACTOR`] reads it.
///
/// # Errors
/// A status this control plane never writes.
pub(crate) fn actor_of(r: &tokio_postgres::Row, database: &str) -> Result<ActorRow, StoreError> {
    let status: i32 = r.get(6);
    let status = ActorStatus::from_wire(status)
        .ok_or_else(|| StoreError::Corrupt(database.to_owned(), status))?;
    Ok(ActorRow {
        atespace: r.get(0),
        name: r.get(1),
        uid: r.get(2),
        template_namespace: r.get(3),
        template: r.get(4),
        pool: r.get(5),
        status,
        version: r.get(7),
        worker: r.get(8),
        selector: crate::store::decode_selector(r.get(9)),
        revert_pending: r.get(10),
        op_replica: r.get(11),
        snapshot: r.get(12),
        reason: r.get(13),
    })
}

impl Store for PostgresStore {
    fn close(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.db.close())
    }

    fn load(&self) -> StoreFuture<'_, Loaded> {
        Box::pin(async move {
            tokio::time::timeout(WRITE_WITHIN, self.db.load_all())
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::Lost {
                        database: self.db.database.clone(),
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
            let committing = std::sync::atomic::AtomicBool::new(false);
            let written = tokio::time::timeout(WRITE_WITHIN, self.write_batch(&batch, &committing))
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::Lost {
                        database: self.db.database.clone(),
                        why: format!("no answer within {WRITE_WITHIN:?}"),
                    })
                });
            // A commit that got no answer may have landed or not: the records in
            // memory can no longer be trusted to match the database's. The replica
            // steps down and loads them again when it is active again.
            if let Err(StoreError::Lost { why, .. }) = &written
                && committing.load(std::sync::atomic::Ordering::Acquire)
            {
                tracing::warn!(database = %self.db.database, %why, "a commit got no answer: stepping down to load the records again");
                self.db.lost.cancel();
            }
            written
        })
    }

    fn describe(&self) -> String {
        self.db.database.clone()
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.db.still_active()?;
            // On the lock's own connection, never the pool's: a burst of writes that
            // takes every pooled connection must not make the active replica look
            // not ready (a Service would then route to no replica at all).
            let epoch: i64 = tokio::time::timeout(
                POOL_WAIT,
                self.active
                    .query_one("SELECT epoch FROM valet_active WHERE id = 1", &[]),
            )
            .await
            .map_err(|_| StoreError::Postgres {
                database: self.db.database.clone(),
                why: "no answer".into(),
            })?
            .map_err(self.db.err())?
            .get(0);
            if epoch != self.epoch {
                return Err(StoreError::Refused(format!(
                    "{}: another control plane took over (epoch {epoch})",
                    self.db.database
                )));
            }
            self.db.probe_pool().await
        })
    }
}

/// Writes `row` as the one active control plane: with no other replica, no
/// operation of one holds it (`op_replica` NULL, whatever a row read from a database
/// that several replicas served still carried).
pub(crate) async fn put_actor(
    c: &impl GenericClient,
    row: &ActorRow,
) -> Result<(), tokio_postgres::Error> {
    let selector = crate::store::encode_selector(&row.selector);
    c.execute(
        "INSERT INTO actors (atespace, name, uid, template_namespace, template, pool, status, \
         version, worker, selector, revert_pending, op_replica, snapshot, reason) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, NULL, $12, $13) \
         ON CONFLICT (atespace, name) DO UPDATE SET uid = excluded.uid, \
         template_namespace = excluded.template_namespace, template = excluded.template, \
         pool = excluded.pool, status = excluded.status, version = excluded.version, \
         worker = excluded.worker, selector = excluded.selector, \
         revert_pending = excluded.revert_pending, op_replica = excluded.op_replica, \
         snapshot = excluded.snapshot, reason = excluded.reason",
        &[
            &row.atespace,
            &row.name,
            &row.uid,
            &row.template_namespace,
            &row.template,
            &row.pool,
            &row.status.wire(),
            &row.version,
            &row.worker,
            &selector,
            &row.revert_pending,
            &row.snapshot,
            &row.reason,
        ],
    )
    .await
    .map(drop)
}
