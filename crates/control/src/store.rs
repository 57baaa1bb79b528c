//! The embedded database: SQLite in `--data-dir`, written before any RPC that changed
//! state returns (WAL, `synchronous = FULL`).
//!
//! The store is synchronous; callers run it on the blocking pool ([`Store::run`]) so the
//! async runtime never waits on a disk flush.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension, params};

/// The database file's name inside the data dir.
pub const DB_FILE: &str = "control-plane.sqlite3";

/// A durable actor record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorRow {
    pub atespace: String,
    pub name: String,
    pub uid: String,
    pub template_namespace: String,
    pub template: String,
    pub pool: String,
    /// `ateapi.Actor.Status` as its number.
    pub status: i32,
    pub version: i64,
    /// The worker hosting it (RUNNING) or claimed for it (RESUMING, SUSPENDING).
    pub worker: Option<String>,
    pub selector: Vec<(String, String)>,
    /// The next restore must first bring back the last good snapshot (after a revert).
    pub revert_pending: bool,
}

/// Everything the store holds, as loaded at start-up.
#[derive(Debug, Default)]
pub struct Loaded {
    pub atespaces: Vec<String>,
    pub actors: Vec<ActorRow>,
}

/// An error of the embedded database.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database {path}: {source}")]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("database task failed: {0}")]
    Join(String),
}

/// The control plane's database. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
}

impl Store {
    /// Opens (creating if needed) the database in `data_dir`.
    ///
    /// # Errors
    /// When the directory or the database cannot be opened.
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
        let conn = Connection::open(&path).map_err(err)?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             PRAGMA synchronous = FULL;
             PRAGMA busy_timeout = 5000;
             CREATE TABLE IF NOT EXISTS atespaces (
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
        )
        .map_err(err)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            path,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the connection on the blocking pool.
    ///
    /// # Errors
    /// The database's error, or the task's if it panicked.
    pub async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
            f(&conn).map_err(|source| StoreError::Sqlite { path, source })
        })
        .await
        .map_err(|e| StoreError::Join(e.to_string()))?
    }

    /// Loads everything (start-up only; blocking).
    ///
    /// # Errors
    /// The database's error.
    pub fn load(&self) -> Result<Loaded, StoreError> {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        load(&conn).map_err(|source| StoreError::Sqlite {
            path: self.path.clone(),
            source,
        })
    }

    /// Records an atespace.
    pub async fn put_atespace(&self, name: String) -> Result<(), StoreError> {
        self.run(move |c| {
            c.execute("INSERT OR IGNORE INTO atespaces (name) VALUES (?1)", [name])
                .map(drop)
        })
        .await
    }

    /// Forgets an atespace.
    pub async fn delete_atespace(&self, name: String) -> Result<(), StoreError> {
        self.run(move |c| {
            c.execute("DELETE FROM atespaces WHERE name = ?1", [name])
                .map(drop)
        })
        .await
    }

    /// Writes an actor (insert or replace).
    pub async fn put_actor(&self, row: ActorRow) -> Result<(), StoreError> {
        self.run(move |c| put_actor(c, &row)).await
    }

    /// Writes several actors in one transaction.
    pub async fn put_actors(&self, rows: Vec<ActorRow>) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        self.run(move |c| {
            c.execute_batch("BEGIN IMMEDIATE")?;
            for row in &rows {
                if let Err(e) = put_actor(c, row) {
                    let _ = c.execute_batch("ROLLBACK");
                    return Err(e);
                }
            }
            c.execute_batch("COMMIT")
        })
        .await
    }

    /// Forgets an actor.
    pub async fn delete_actor(&self, atespace: String, name: String) -> Result<(), StoreError> {
        self.run(move |c| {
            c.execute(
                "DELETE FROM actors WHERE atespace = ?1 AND name = ?2",
                params![atespace, name],
            )
            .map(drop)
        })
        .await
    }

    /// Reads one actor straight from the database (tests and tools).
    pub async fn get_actor(
        &self,
        atespace: String,
        name: String,
    ) -> Result<Option<ActorRow>, StoreError> {
        self.run(move |c| {
            c.query_row(
                &format!("{SELECT_ACTOR} WHERE atespace = ?1 AND name = ?2"),
                params![atespace, name],
                row_to_actor,
            )
            .optional()
        })
        .await
    }
}

const SELECT_ACTOR: &str = "SELECT atespace, name, uid, template_namespace, template, pool, \
     status, version, worker, selector, revert_pending FROM actors";

fn put_actor(c: &Connection, row: &ActorRow) -> rusqlite::Result<()> {
    let selector = encode_selector(&row.selector);
    c.execute(
        "INSERT OR REPLACE INTO actors (atespace, name, uid, template_namespace, template, \
         pool, status, version, worker, selector, revert_pending) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        params![
            row.atespace,
            row.name,
            row.uid,
            row.template_namespace,
            row.template,
            row.pool,
            row.status,
            row.version,
            row.worker,
            selector,
            row.revert_pending,
        ],
    )
    .map(drop)
}

fn load(c: &Connection) -> rusqlite::Result<Loaded> {
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
    Ok(Loaded { atespaces, actors })
}

fn row_to_actor(r: &rusqlite::Row<'_>) -> rusqlite::Result<ActorRow> {
    Ok(ActorRow {
        atespace: r.get(0)?,
        name: r.get(1)?,
        uid: r.get(2)?,
        template_namespace: r.get(3)?,
        template: r.get(4)?,
        pool: r.get(5)?,
        status: r.get(6)?,
        version: r.get(7)?,
        worker: r.get(8)?,
        selector: decode_selector(&r.get::<_, String>(9)?),
        revert_pending: r.get(10)?,
    })
}

/// Labels as `k=v` lines; keys and values are label-like and never contain newlines.
fn encode_selector(labels: &[(String, String)]) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{}={}", k.replace('\n', " "), v.replace('\n', " ")))
        .collect::<Vec<_>>()
        .join("\n")
}

fn decode_selector(s: &str) -> Vec<(String, String)> {
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
            status: 4,
            version: 1,
            worker: None,
            selector: vec![("workload".into(), "counter".into())],
            revert_pending: false,
        }
    }

    #[tokio::test]
    async fn survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.put_atespace("demo".into()).await.unwrap();
        store.put_actor(row("p1")).await.unwrap();
        let mut p2 = row("p2");
        p2.worker = Some("w1".into());
        p2.status = 2;
        store.put_actors(vec![p2.clone()]).await.unwrap();
        store.put_actor(row("gone")).await.unwrap();
        store
            .delete_actor("demo".into(), "gone".into())
            .await
            .unwrap();
        drop(store);

        let store = Store::open(dir.path()).unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded.atespaces, vec!["demo".to_owned()]);
        assert_eq!(loaded.actors, vec![row("p1"), p2]);
    }
}
