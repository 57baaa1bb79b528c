//! The control plane's record: a [`Store`] writes every change of an operation step in
//! one transaction before the step is applied in memory, and loads it all at start.
//!
//! [`SqliteStore`] keeps it in an SQLite file in `--data-dir` (WAL, `synchronous =
//! FULL`), on the blocking pool so the async runtime never waits on a disk flush.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};

use crate::model::{ActorKey, ActorStatus};

/// The database file's name inside the data dir.
pub const DB_FILE: &str = "control-plane.sqlite3";
/// The file in the data directory whose exclusive lock the control plane using it holds
/// (with its process id inside, for the message a second one prints).
pub const LOCK_FILE: &str = "control-plane.lock";

/// A durable actor record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorRow {
    pub atespace: String,
    pub name: String,
    pub uid: String,
    pub template_namespace: String,
    pub template: String,
    pub pool: String,
    pub status: ActorStatus,
    pub version: i64,
    /// The worker hosting it (RUNNING) or claimed for it (RESUMING, SUSPENDING).
    pub worker: Option<String>,
    pub selector: Vec<(String, String)>,
    /// The next restore must first bring back the last good snapshot (after a revert).
    pub revert_pending: bool,
    /// The replica whose operation holds it RESUMING or SUSPENDING, when several
    /// replicas share a PostgreSQL database (its `valet_replicas` id); `None` for every
    /// other status, and always with one control plane. Written by the store, from the
    /// status ([`ActorRow::held_by`]).
    pub op_replica: Option<i64>,
    /// A program's last good snapshot (the id its worker's checkpoint named), which its
    /// next restore unpacks; empty until its first checkpoint (and for built-in apps,
    /// whose snapshot is their directory).
    pub snapshot: String,
    /// While CRASHED: why (a program's exit status, a failed restore or checkpoint,
    /// with its last output). Empty in every other status.
    pub reason: String,
}

impl ActorRow {
    /// Its key.
    pub fn key(&self) -> ActorKey {
        ActorKey::new(&self.atespace, &self.name).expect("stored names are valid")
    }

    /// The same actor moved to `status` on `worker`, one version on (a crash's reason
    /// goes: see [`ActorRow::crashed`]).
    pub fn moved(&self, status: ActorStatus, worker: Option<String>) -> Self {
        Self {
            status,
            worker,
            version: self.version + 1,
            reason: String::new(),
            ..self.clone()
        }
    }

    /// The same actor CRASHED on no worker, one version on, for `reason`.
    pub fn crashed(&self, reason: &str) -> Self {
        Self {
            reason: crate::model::bounded_reason(reason),
            ..self.moved(ActorStatus::Crashed, None)
        }
    }

    /// The replica that holds it when `replica` writes it: that one while it is
    /// RESUMING or SUSPENDING (its operation is in progress), none otherwise. The one
    /// rule for [`ActorRow::op_replica`].
    pub fn held_by(&self, replica: i64) -> Option<i64> {
        self.status.is_transitional().then_some(replica)
    }
}

/// Everything the store holds, as loaded at start-up.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub atespaces: Vec<String>,
    pub actors: Vec<ActorRow>,
    /// The longest route lease a run of the plane on this store may have granted that
    /// has not surely ended ([`Batch::route_lease`]); `None` when none was recorded (a
    /// new store, or one written before schema version 3).
    pub route_lease: Option<Duration>,
    /// The longest hosting lease a run may have told a worker that has not surely run
    /// out ([`Batch::hosting_lease`]); `None` when none was recorded (a new store, or
    /// one written before schema version 4).
    pub hosting_lease: Option<Duration>,
}

/// The changes of one operation step, written in one transaction.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Actors written (inserted or replaced).
    pub put_actors: Vec<ActorRow>,
    /// Actors forgotten.
    pub delete_actors: Vec<ActorKey>,
    /// Atespaces recorded.
    pub put_atespaces: Vec<String>,
    /// Atespaces forgotten.
    pub delete_atespaces: Vec<String>,
    /// Records the longest route lease granted leases may run for: written before a
    /// run grants longer ones than recorded, and lowered once the longer ones ended.
    pub route_lease: Option<Duration>,
    /// Records the longest hosting lease workers may hold, as `route_lease` does.
    pub hosting_lease: Option<Duration>,
}

impl Batch {
    /// A batch that writes `rows`.
    pub fn put(rows: impl IntoIterator<Item = ActorRow>) -> Self {
        Self {
            put_actors: rows.into_iter().collect(),
            ..Self::default()
        }
    }

    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.put_actors.is_empty()
            && self.delete_actors.is_empty()
            && self.put_atespaces.is_empty()
            && self.delete_atespaces.is_empty()
            && self.route_lease.is_none()
            && self.hosting_lease.is_none()
    }
}

/// An error of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database {path}: {source}")]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("database {0}: stored status {1} is not one this control plane writes")]
    Corrupt(String, i32),
    #[error("database task failed: {0}")]
    Join(String),
    #[error("database write refused: {0}")]
    Refused(String),
    /// Another replica changed the record since this one read it (several replicas
    /// on one database): nothing was written.
    #[error("database write refused: {0} changed since this replica read it")]
    Conflict(String),
    #[error(
        "database {database}: schema version {found} is newer than this binary's ({supported}); run a newer valet"
    )]
    NewerSchema {
        database: String,
        found: i64,
        supported: i64,
    },
    #[error("database {database}: {why}")]
    Postgres { database: String, why: String },
    /// No connection could be made (the server is down, unreachable, or refused the
    /// credentials).
    #[error("database {database}: cannot connect: {why}")]
    Unreachable { database: String, why: String },
    /// The connection ended under the request (the server restarted, the session was
    /// terminated, the network failed): not the server refusing it.
    #[error("database {database}: connection lost: {why}")]
    Lost { database: String, why: String },
    #[error(
        "data dir {} is in use by another control plane{holder}: stop it, or give this one another --data-dir",
        dir.display()
    )]
    InUse { dir: PathBuf, holder: String },
    #[error("data dir {}: cannot lock {LOCK_FILE}: {source}", dir.display())]
    Lock {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The future of a store call.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// Where the control plane's state is kept.
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Everything stored (start-up).
    fn load(&self) -> StoreFuture<'_, Loaded>;

    /// Writes `batch` in one transaction: all of it is durable when this returns `Ok`,
    /// none of it when it returns `Err`.
    fn write(&self, batch: Batch) -> StoreFuture<'_, ()>;

    /// What the store is, for logs (`sqlite /path/to/file`); never a password.
    fn describe(&self) -> String;

    /// Whether the database answers now (`/readyz`).
    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    /// Ends the store's own tasks (a database session, its heartbeat, its listener)
    /// and waits for them: the store serves no more. Bounded (each task ends at once,
    /// or after a statement's timeout).
    fn close(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
}

/// The schema version this binary writes. Both stores record theirs and upgrade an
/// older database at start, one numbered migration at a time; a newer one is refused.
///
/// 1. `atespaces` and `actors` (also what databases written before versions were
///    recorded hold).
/// 2. No worker hosts or is claimed for two actors: a unique constraint on
///    `actors.worker`.
/// 3. `route_lease_bound`: the longest route lease that may still be held, so that a
///    plane restarted with a shorter `--route-lease` waits out the longer one.
/// 4. `hosting_lease_bound`: the same for the hosting lease workers were told.
/// 5. PostgreSQL: several replicas active at once (`valet_replicas`, `valet_workers`,
///    `valet_waiters`, `valet_forwards`, `actors.op_replica`); SQLite: nothing.
/// 6. Programs as actors: `actors.snapshot` (a program's last good snapshot) and
///    `actors.reason` (why a CRASHED actor crashed).
pub const SCHEMA_VERSION: i64 = 6;

/// SQLite's migrations: `SQLITE_MIGRATIONS[v - 1]` brings version `v - 1` to `v`.
const SQLITE_MIGRATIONS: [&str; SCHEMA_VERSION as usize] = [
    "CREATE TABLE IF NOT EXISTS atespaces (
         name TEXT PRIMARY KEY
     ) STRICT;
     CREATE TABLE IF NOT EXISTS actors (
         atespace TEXT NOT NULL,
         name TEXT NOT NULL,
         uid TEXT NOT NULL,
         template_namespace TEXT NOT NULL,
         template TEXT NOT NULL,
         pool TEXT NOT NULL,
         status INTEGER NOT NULL,
         version INTEGER NOT NULL,
         worker TEXT,
         selector TEXT NOT NULL,
         revert_pending INTEGER NOT NULL DEFAULT 0,
         PRIMARY KEY (atespace, name)
     ) STRICT;",
    // Records that place one worker on several actors (older versions could write
    // them) go back to SUSPENDED (4) from their last snapshot, as a restart would
    // release them, before the constraint forbids it.
    "UPDATE actors SET status = 4, worker = NULL, version = version + 1
         WHERE worker IN (SELECT worker FROM actors WHERE worker IS NOT NULL
                          GROUP BY worker HAVING count(*) > 1);
     CREATE UNIQUE INDEX actors_one_per_worker ON actors (worker);",
    "CREATE TABLE route_lease_bound (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         longest_ms INTEGER NOT NULL CHECK (longest_ms >= 0)
     ) STRICT;",
    "CREATE TABLE hosting_lease_bound (
         id INTEGER PRIMARY KEY CHECK (id = 1),
         longest_ms INTEGER NOT NULL CHECK (longest_ms >= 0)
     ) STRICT;",
    // Replicas active together share PostgreSQL only: nothing changes here.
    "",
    "ALTER TABLE actors ADD COLUMN snapshot TEXT NOT NULL DEFAULT '';
     ALTER TABLE actors ADD COLUMN reason TEXT NOT NULL DEFAULT '';",
];

/// Brings the SQLite database to [`SCHEMA_VERSION`] (`PRAGMA user_version`), each
/// migration in its own transaction.
fn migrate_sqlite(conn: &mut Connection, database: &str) -> Result<(), StoreError> {
    let err = |source| StoreError::Sqlite {
        path: PathBuf::from(database),
        source,
    };
    let mut version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(err)?;
    if version == 0 {
        // Written before versions were recorded: its tables are version 1's.
        let legacy: bool = conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'actors')",
                [],
                |r| r.get(0),
            )
            .map_err(err)?;
        if legacy {
            version = 1;
        }
    }
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema {
            database: database.to_owned(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    for (i, sql) in SQLITE_MIGRATIONS.iter().enumerate().skip(version as usize) {
        let to = i as i64 + 1;
        let tx = conn.transaction().map_err(err)?;
        tx.execute_batch(sql).map_err(err)?;
        tx.pragma_update(None, "user_version", to).map_err(err)?;
        tx.commit().map_err(err)?;
        if to > 1 {
            tracing::info!(database, version = to, "database schema upgraded");
        }
    }
    Ok(())
}

/// Takes the exclusive lock of `data_dir` and writes this process's id into it.
fn lock_data_dir(data_dir: &Path) -> Result<std::fs::File, StoreError> {
    use std::io::{Read, Seek, Write};
    let dir = data_dir.to_owned();
    let failed = |source| StoreError::Lock {
        dir: dir.clone(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(data_dir.join(LOCK_FILE))
        .map_err(failed)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut held = String::new();
            let _ = file.read_to_string(&mut held);
            let holder = match held.trim().parse::<u32>() {
                Ok(pid) => format!(" (pid {pid})"),
                Err(_) => String::new(),
            };
            return Err(StoreError::InUse { dir, holder });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(failed(e)),
    }
    file.set_len(0).map_err(failed)?;
    file.rewind().map_err(failed)?;
    writeln!(file, "{}", std::process::id()).map_err(failed)?;
    Ok(file)
}

/// The embedded SQLite store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
    /// Held while any clone lives; the kernel releases it when the process dies.
    _lock: Arc<std::fs::File>,
}

impl SqliteStore {
    /// Opens (creating if needed) the database in `data_dir`, which it locks: two
    /// control planes on one SQLite file would each take its records for their own.
    ///
    /// # Errors
    /// When the directory or the database cannot be opened, or another control plane
    /// holds the directory.
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        let path = data_dir.join(DB_FILE);
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(data_dir).map_err(|e| StoreError::Sqlite {
            path: path.clone(),
            source: rusqlite::Error::ToSqlConversionFailure(Box::new(e)),
        })?;
        let lock = lock_data_dir(data_dir)?;
        let mut conn = Connection::open(&path).map_err(err)?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             PRAGMA synchronous = FULL;
             PRAGMA busy_timeout = 5000;",
        )
        .map_err(err)?;
        migrate_sqlite(&mut conn, &path.display().to_string())?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            path,
            _lock: Arc::new(lock),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes the connection refuse (or accept again) every write, as a database that
    /// turned read-only would: for tests of failed writes.
    ///
    /// # Errors
    /// The database's error.
    pub async fn set_read_only(&self, read_only: bool) -> Result<(), StoreError> {
        self.run(move |c| c.pragma_update(None, "query_only", read_only))
            .await
    }

    /// Runs `f` on the connection on the blocking pool.
    async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut conn).map_err(|source| StoreError::Sqlite { path, source })
        })
        .await
        .map_err(|e| StoreError::Join(e.to_string()))?
    }
}

impl Store for SqliteStore {
    fn load(&self) -> StoreFuture<'_, Loaded> {
        let path = self.path.display().to_string();
        Box::pin(async move {
            let (atespaces, raw, (route_lease, hosting_lease)) = self.run(load).await?;
            let actors = raw
                .into_iter()
                .map(|(row, status)| {
                    ActorStatus::from_wire(status)
                        .map(|status| ActorRow { status, ..row })
                        .ok_or_else(|| StoreError::Corrupt(path.clone(), status))
                })
                .collect::<Result<_, _>>()?;
            Ok(Loaded {
                atespaces,
                actors,
                route_lease,
                hosting_lease,
            })
        })
    }

    fn write(&self, batch: Batch) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            if batch.is_empty() {
                return Ok(());
            }
            self.run(move |c| {
                let tx = c.transaction()?;
                for name in &batch.put_atespaces {
                    tx.execute("INSERT OR IGNORE INTO atespaces (name) VALUES (?1)", [name])?;
                }
                // A batch may move a worker from one actor to another: release every
                // written actor's worker first, so that the order of the rows never
                // trips the one-actor-per-worker constraint.
                for row in &batch.put_actors {
                    tx.execute(
                        "UPDATE actors SET worker = NULL WHERE atespace = ?1 AND name = ?2",
                        params![row.atespace, row.name],
                    )?;
                }
                for row in &batch.put_actors {
                    put_actor(&tx, row)?;
                }
                for key in &batch.delete_actors {
                    tx.execute(
                        "DELETE FROM actors WHERE atespace = ?1 AND name = ?2",
                        params![key.atespace(), key.name()],
                    )?;
                }
                for name in &batch.delete_atespaces {
                    tx.execute("DELETE FROM atespaces WHERE name = ?1", [name])?;
                }
                for (table, lease) in lease_bounds(&batch) {
                    tx.execute(
                        &format!(
                            "INSERT INTO {table} (id, longest_ms) VALUES (1, ?1)
                             ON CONFLICT (id) DO UPDATE SET longest_ms = excluded.longest_ms"
                        ),
                        [lease_ms(lease)],
                    )?;
                }
                tx.commit()
            })
            .await
        })
    }

    fn describe(&self) -> String {
        format!("sqlite {}", self.path.display())
    }
}

impl SqliteStore {
    /// Reads one actor straight from the database (tests and tools).
    ///
    /// # Errors
    /// The database's error.
    pub async fn get_actor(&self, key: &ActorKey) -> Result<Option<ActorRow>, StoreError> {
        let (a, n) = (key.atespace().to_owned(), key.name().to_owned());
        let found = self
            .run(move |c| {
                c.query_row(
                    &format!("{SELECT_ACTOR} WHERE atespace = ?1 AND name = ?2"),
                    params![a, n],
                    row_to_actor,
                )
                .optional()
            })
            .await?;
        Ok(found.and_then(|(row, status)| {
            ActorStatus::from_wire(status).map(|status| ActorRow { status, ..row })
        }))
    }
}

const SELECT_ACTOR: &str = "SELECT atespace, name, uid, template_namespace, template, pool, \
     status, version, worker, selector, revert_pending, snapshot, reason FROM actors";

fn put_actor(c: &Connection, row: &ActorRow) -> rusqlite::Result<()> {
    let selector = encode_selector(&row.selector);
    c.execute(
        "INSERT INTO actors (atespace, name, uid, template_namespace, template, \
         pool, status, version, worker, selector, revert_pending, snapshot, reason) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13) \
         ON CONFLICT (atespace, name) DO UPDATE SET uid = excluded.uid, \
         template_namespace = excluded.template_namespace, template = excluded.template, \
         pool = excluded.pool, status = excluded.status, version = excluded.version, \
         worker = excluded.worker, selector = excluded.selector, \
         revert_pending = excluded.revert_pending, snapshot = excluded.snapshot, \
         reason = excluded.reason",
        params![
            row.atespace,
            row.name,
            row.uid,
            row.template_namespace,
            row.template,
            row.pool,
            row.status.wire(),
            row.version,
            row.worker,
            selector,
            row.revert_pending,
            row.snapshot,
            row.reason,
        ],
    )
    .map(drop)
}

type RawActor = (ActorRow, i32);

/// A route lease as stored: whole milliseconds, rounded up so it never shrinks.
pub(crate) fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_micros().div_ceil(1000)).unwrap_or(i64::MAX)
}

/// A stored route lease (never negative: the schema checks it).
pub(crate) fn lease_of_ms(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// The lease records a batch writes: (table, lease).
pub(crate) fn lease_bounds(batch: &Batch) -> impl Iterator<Item = (&'static str, Duration)> {
    [
        ("route_lease_bound", batch.route_lease),
        ("hosting_lease_bound", batch.hosting_lease),
    ]
    .into_iter()
    .filter_map(|(table, lease)| lease.map(|l| (table, l)))
}

type LoadedRows = (
    Vec<String>,
    Vec<RawActor>,
    (Option<Duration>, Option<Duration>),
);

fn load(c: &mut Connection) -> rusqlite::Result<LoadedRows> {
    let mut atespaces = Vec::new();
    let mut stmt = c.prepare("SELECT name FROM atespaces ORDER BY name")?;
    for name in stmt.query_map([], |r| r.get::<_, String>(0))? {
        atespaces.push(name?);
    }
    let mut actors = Vec::new();
    let mut stmt = c.prepare(&format!("{SELECT_ACTOR} ORDER BY atespace, name"))?;
    for row in stmt.query_map([], row_to_actor)? {
        actors.push(row?);
    }
    let bound = |table: &str| {
        c.query_row(
            &format!("SELECT longest_ms FROM {table} WHERE id = 1"),
            [],
            |r| r.get(0),
        )
        .optional()
        .map(|ms| ms.map(lease_of_ms))
    };
    let leases = (bound("route_lease_bound")?, bound("hosting_lease_bound")?);
    Ok((atespaces, actors, leases))
}

/// The row, with its status as stored (checked by the caller).
fn row_to_actor(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawActor> {
    Ok((
        ActorRow {
            atespace: r.get(0)?,
            name: r.get(1)?,
            uid: r.get(2)?,
            template_namespace: r.get(3)?,
            template: r.get(4)?,
            pool: r.get(5)?,
            status: ActorStatus::Suspended,
            version: r.get(7)?,
            worker: r.get(8)?,
            selector: decode_selector(&r.get::<_, String>(9)?),
            revert_pending: r.get(10)?,
            op_replica: None,
            snapshot: r.get(11)?,
            reason: r.get(12)?,
        },
        r.get(6)?,
    ))
}

/// Labels as `k=v` lines; keys and values are label-like and never contain newlines.
pub(crate) fn encode_selector(labels: &[(String, String)]) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{}={}", k.replace('\n', " "), v.replace('\n', " ")))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn decode_selector(s: &str) -> Vec<(String, String)> {
    s.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str) -> ActorRow {
        ActorRow {
            atespace: "demo".into(),
            name: name.into(),
            uid: "u1".into(),
            template_namespace: "default".into(),
            template: "counter".into(),
            pool: "counter".into(),
            status: ActorStatus::Suspended,
            version: 1,
            worker: None,
            selector: vec![("workload".into(), "counter".into())],
            revert_pending: false,
            op_replica: None,
            snapshot: String::new(),
            reason: String::new(),
        }
    }

    #[tokio::test]
    async fn survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let mut p2 = row("p2");
        p2.worker = Some("w1".into());
        p2.status = ActorStatus::Running;
        store
            .write(Batch {
                put_atespaces: vec!["demo".into()],
                put_actors: vec![row("p1"), p2.clone(), row("gone")],
                route_lease: Some(Duration::from_secs(5)),
                hosting_lease: Some(Duration::from_secs(60)),
                ..Batch::default()
            })
            .await
            .unwrap();
        store
            .write(Batch {
                delete_actors: vec![row("gone").key()],
                ..Batch::default()
            })
            .await
            .unwrap();
        drop(store);

        let store = SqliteStore::open(dir.path()).unwrap();
        let loaded = store.load().await.unwrap();
        assert_eq!(loaded.atespaces, vec!["demo".to_owned()]);
        assert_eq!(loaded.actors, vec![row("p1"), p2]);
        assert_eq!(loaded.route_lease, Some(Duration::from_secs(5)));
        assert_eq!(loaded.hosting_lease, Some(Duration::from_secs(60)));
        // Lowered as well as raised, and a part of a millisecond is never lost.
        store
            .write(Batch {
                route_lease: Some(Duration::from_micros(1_001)),
                ..Batch::default()
            })
            .await
            .unwrap();
        let lease = store.load().await.unwrap().route_lease;
        assert_eq!(lease, Some(Duration::from_millis(2)));
    }

    #[tokio::test]
    async fn a_batch_is_one_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        store.write(Batch::put([row("p1")])).await.unwrap();
        store.set_read_only(true).await.unwrap();
        let mut p1 = row("p1");
        p1.version = 2;
        assert!(
            store
                .write(Batch::put([p1.clone(), row("p2")]))
                .await
                .is_err()
        );
        store.set_read_only(false).await.unwrap();
        assert_eq!(store.load().await.unwrap().actors, vec![row("p1")]);
        store.write(Batch::put([p1.clone()])).await.unwrap();
        assert_eq!(store.get_actor(&p1.key()).await.unwrap(), Some(p1));
    }

    #[tokio::test]
    async fn a_database_from_before_schema_versions_is_upgraded() {
        let dir = tempfile::tempdir().unwrap();
        {
            // What the first wave wrote: version 1's tables, no version recorded.
            let c = Connection::open(dir.path().join(DB_FILE)).unwrap();
            c.execute_batch(SQLITE_MIGRATIONS[0]).unwrap();
            c.execute("INSERT INTO atespaces (name) VALUES ('demo')", [])
                .unwrap();
            // Older versions could record one worker for two actors: such records
            // are released, not a reason to refuse the upgrade.
            for (name, worker) in [("a", "w1"), ("b", "w1"), ("c", "w2")] {
                c.execute(
                    "INSERT INTO actors VALUES ('demo', ?1, 'u', 'default', 'counter', 'counter', 2, 1, ?2, '', 0)",
                    [name, worker],
                )
                .unwrap();
            }
        }
        let store = SqliteStore::open(dir.path()).unwrap();
        let loaded = store.load().await.unwrap();
        assert_eq!(loaded.atespaces, vec!["demo".to_owned()]);
        assert_eq!(loaded.route_lease, None, "not recorded before version 3");
        assert_eq!(loaded.hosting_lease, None, "not recorded before version 4");
        let placed: Vec<(String, ActorStatus, Option<String>)> = loaded
            .actors
            .iter()
            .map(|a| (a.name.clone(), a.status, a.worker.clone()))
            .collect();
        assert_eq!(
            placed,
            [
                ("a".into(), ActorStatus::Suspended, None),
                ("b".into(), ActorStatus::Suspended, None),
                ("c".into(), ActorStatus::Running, Some("w2".into())),
            ]
        );
        let version: i64 = store
            .run(|c| c.pragma_query_value(None, "user_version", |r| r.get(0)))
            .await
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }

    #[test]
    fn a_data_dir_serves_one_control_plane_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let first = SqliteStore::open(dir.path()).unwrap();
        let held = first.clone();
        drop(first);
        let e = SqliteStore::open(dir.path()).unwrap_err();
        assert!(matches!(e, StoreError::InUse { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            format!(
                "data dir {} is in use by another control plane (pid {}): stop it, or give this one another --data-dir",
                dir.path().display(),
                std::process::id()
            )
        );
        // Free once the last clone is gone.
        drop(held);
        drop(SqliteStore::open(dir.path()).unwrap());
    }

    #[tokio::test]
    async fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(SqliteStore::open(dir.path()).unwrap());
        Connection::open(dir.path().join(DB_FILE))
            .unwrap()
            .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        let e = SqliteStore::open(dir.path()).unwrap_err();
        assert!(
            matches!(e, StoreError::NewerSchema { found, .. } if found == SCHEMA_VERSION + 1),
            "{e}"
        );
    }

    #[tokio::test]
    async fn no_worker_is_recorded_for_two_actors() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let on = |name: &str, worker: &str| ActorRow {
            status: ActorStatus::Running,
            worker: Some(worker.into()),
            ..row(name)
        };
        store.write(Batch::put([on("p1", "w1")])).await.unwrap();
        assert!(store.write(Batch::put([on("p2", "w1")])).await.is_err());
        // Handed over in one batch, in either order: allowed.
        store
            .write(Batch::put([on("p2", "w1"), row("p1")]))
            .await
            .unwrap();
        let loaded = store.load().await.unwrap().actors;
        assert_eq!(loaded, vec![row("p1"), on("p2", "w1")]);
    }
}
