//! The PostgreSQL store against a real, throwaway PostgreSQL server: the record
//! survives a reopen, a batch is one transaction, no worker is recorded for two
//! actors, migrations run once and refuse a newer schema, and one replica is active
//! at a time (a standby takes over with the next epoch; the replaced one is fenced).

use std::time::Duration;

use valet_control::PostgresStore;
use valet_control::model::ActorStatus;
use valet_control::store::{ActorRow, Batch, SCHEMA_VERSION, Store, StoreError};
use valet_control::tempdb::TempPostgres;

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

fn on(name: &str, worker: &str) -> ActorRow {
    ActorRow {
        status: ActorStatus::Running,
        worker: Some(worker.into()),
        ..row(name)
    }
}

async fn sql(url: &str, statement: &str) {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    client.batch_execute(statement).await.unwrap();
    drop(client);
    let _ = task.await;
}

async fn count(url: &str, query: &str) -> i64 {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    let n: i64 = client.query_one(query, &[]).await.unwrap().get(0);
    drop(client);
    let _ = task.await;
    n
}

/// A session holding the epoch row locked (`lock`: `FOR SHARE`, as a write in
/// progress does, or `FOR UPDATE`) in a transaction it keeps open until told `COMMIT`.
async fn epoch_row_locked(
    url: &str,
    lock: &str,
) -> (
    tokio_postgres::Client,
    tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
) {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "SET idle_in_transaction_session_timeout = 0; BEGIN; \
             SELECT epoch FROM valet_active WHERE id = 1 {lock}"
        ))
        .await
        .unwrap();
    (client, conn)
}

/// Waits (bounded) until `query` counts at least `n`.
async fn until_count(url: &str, query: &str, n: i64, what: &str) {
    let reached = async {
        while count(url, query).await < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), reached)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within 30 s"));
}

/// The throwaway server's port is picked free and then given up; a port another
/// process took meanwhile is passed over for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throwaway_server_passes_over_a_taken_port() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let pg = tokio::task::spawn_blocking(move || TempPostgres::start_trying(port))
        .await
        .unwrap();
    assert_ne!(pg.port(), port);
    let store = PostgresStore::open(&pg.url()).await.unwrap();
    store.ping().await.unwrap();
    drop(taken);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_survives_a_reopen_and_batches_are_transactions() {
    let pg = TempPostgres::start_async().await;
    let store = PostgresStore::open(&pg.url()).await.unwrap();
    assert!(store.describe().contains("127.0.0.1"));
    store
        .write(Batch {
            put_atespaces: vec!["demo".into()],
            put_actors: vec![row("p1"), on("p2", "w1"), row("gone")],
            route_lease: Some(Duration::from_millis(7_500)),
            hosting_lease: Some(Duration::from_secs(20)),
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
    // Two actors on one worker: refused, and nothing of the batch is written.
    let mut p1 = row("p1");
    p1.version = 2;
    assert!(store.write(Batch::put([p1, on("p3", "w1")])).await.is_err());
    // A worker handed from one actor to another in one batch, in either order. A
    // row read from a database several replicas served may still name one's
    // operation: the one active replica writes none (else the replicas, once back,
    // would take it as held by that one forever).
    store
        .write(Batch::put([
            on("p1", "w1"),
            ActorRow {
                op_replica: Some(7),
                snapshot: String::new(),
                reason: String::new(),
                ..row("p2")
            },
        ]))
        .await
        .unwrap();
    drop(store);

    let store = PostgresStore::open(&pg.url()).await.unwrap();
    let loaded = store.load().await.unwrap();
    assert_eq!(loaded.atespaces, vec!["demo".to_owned()]);
    assert_eq!(loaded.actors, vec![on("p1", "w1"), row("p2")]);
    assert_eq!(loaded.route_lease, Some(Duration::from_millis(7_500)));
    assert_eq!(loaded.hosting_lease, Some(Duration::from_secs(20)));
    store.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_migrate_once_and_a_newer_schema_is_refused() {
    let pg = TempPostgres::start_async().await;
    // Started together: both migrate under the lock, one becomes active.
    let url = pg.url();
    let first = opening(&url);
    let second = opening(&url);
    let (mut first, mut second) = (first, second);
    let (active, standby) = tokio::select! {
        a = &mut first => (a, second),
        b = &mut second => (b, first),
    };
    let active = active.unwrap().unwrap();
    assert!(!standby.is_finished());
    standby.abort();
    drop(active);

    sql(
        &url,
        &format!("UPDATE valet_schema SET version = {}", SCHEMA_VERSION + 1),
    )
    .await;
    let e = PostgresStore::open(&url).await.unwrap_err();
    assert!(
        matches!(e, StoreError::NewerSchema { found, .. } if found == SCHEMA_VERSION + 1),
        "{e}"
    );
}

/// A replica opening on `url` (it waits as a standby while another is active).
fn opening(url: &str) -> tokio::task::JoinHandle<Result<PostgresStore, StoreError>> {
    let url = url.to_owned();
    tokio::spawn(async move { PostgresStore::open(&url).await })
}

/// The replica `opening` once it took over (bounded).
async fn took_over(
    opening: tokio::task::JoinHandle<Result<PostgresStore, StoreError>>,
) -> PostgresStore {
    tokio::time::timeout(Duration::from_secs(30), opening)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap()
}

/// Returns once one session waits for an advisory lock (a standby for the active lock).
async fn standby_waiting(url: &str) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while count(
            url,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        )
        .await
            != 1
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the standby waits for the lock");
}

/// A standby waits for the lock with no bound: not the sessions' 10 s statement
/// timeout, nor a `lock_timeout` the role has (before, it failed after that with
/// "canceling statement due to lock timeout" and, never having served, exited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_waits_past_the_sessions_statement_and_lock_timeouts() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    sql(&url, "ALTER ROLE postgres SET lock_timeout = '1s'").await;
    let active = PostgresStore::open(&url).await.unwrap();
    let mut standby = opening(&url);
    standby_waiting(&url).await;
    // Every session has a 10 s statement timeout; the standby's wait for the lock must
    // outlast it (it failed with "canceling statement due to statement timeout").
    let waited = tokio::time::timeout(Duration::from_secs(12), &mut standby).await;
    assert!(waited.is_err(), "the standby stopped waiting: {waited:?}");
    drop(active);
    let next = took_over(standby).await;
    next.write(Batch::put([row("p1")])).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_and_the_replaced_replica_is_fenced() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let active = PostgresStore::open(&url).await.unwrap();
    active.write(Batch::put([row("p1")])).await.unwrap();
    let standby = opening(&url);
    // Once the standby waits for the active lock (its migration lock released)...
    standby_waiting(&url).await;
    // ...the active replica's lock connection dies (a partition, a crash of its
    // host): the standby takes over with the next epoch.
    sql(
        &url,
        "SELECT pg_terminate_backend(pid) FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()",
    )
    .await;
    let next = took_over(standby).await;
    assert_eq!(next.epoch(), active.epoch() + 1);
    tokio::time::timeout(Duration::from_secs(30), active.lost().cancelled())
        .await
        .expect("the replaced replica learns it lost the lock");
    // Its pooled connections still work, but its writes are refused.
    let e = active.write(Batch::put([row("p2")])).await.unwrap_err();
    assert!(matches!(e, StoreError::Refused(_)), "{e}");
    assert!(active.ping().await.is_err());
    next.write(Batch::put([row("p3")])).await.unwrap();
    let names: Vec<String> = next
        .load()
        .await
        .unwrap()
        .actors
        .into_iter()
        .map(|a| a.name)
        .collect();
    assert_eq!(names, ["p1", "p3"]);
}

/// A closed store has ended its own tasks: its session (and with it the active lock)
/// is let go at once, so a standby takes over without waiting for the process to end
/// (before, the session's task had no owner and lived as long as its client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_store_lets_go_of_its_lock_at_once() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let active = PostgresStore::open(&url).await.unwrap();
    let standby = opening(&url);
    standby_waiting(&url).await;
    tokio::time::timeout(Duration::from_secs(5), active.close())
        .await
        .expect("closing is bounded");
    assert!(active.lost().is_cancelled(), "it serves no more");
    let next = took_over(standby).await;
    assert_eq!(next.epoch(), active.epoch() + 1);
    // The closed one is still held (its pool, its lock's client), yet fenced.
    let e = active.write(Batch::put([row("p1")])).await.unwrap_err();
    assert!(matches!(e, StoreError::Refused(_)), "{e}");
}

/// A TCP relay to `upstream` that, once `armed`, swallows the first client message
/// holding `COMMIT` and forwards nothing more on that connection, either way: a commit
/// whose answer never comes (a network that went silent at the worst moment).
async fn relay_stalling_commits(
    upstream: u16,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let server = tokio::net::TcpStream::connect(("127.0.0.1", upstream))
                .await
                .unwrap();
            let (mut client_rx, mut client_tx) = client.into_split();
            let (mut server_rx, mut server_tx) = server.into_split();
            let armed = std::sync::Arc::clone(&armed);
            // Once the COMMIT is swallowed, nothing comes back either (not even the
            // server ending the idle transaction): the connection is silent.
            let stalled = tokio_util::sync::CancellationToken::new();
            let silent = stalled.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = tokio::select! {
                        read = server_rx.read(&mut buf) => match read {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        },
                        () = silent.cancelled() => std::future::pending().await,
                    };
                    if silent.is_cancelled() {
                        std::future::pending::<()>().await;
                    }
                    if client_tx.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match client_rx.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let chunk = &buf[..n];
                    if armed.load(std::sync::atomic::Ordering::Acquire)
                        && chunk.windows(6).any(|w| w == b"COMMIT")
                    {
                        stalled.cancel();
                        std::future::pending::<()>().await;
                    }
                    if server_tx.write_all(chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A commit that gets no answer may have landed or not, so the records in memory can
/// no longer be trusted: the write fails `Lost` within its bound (the network gives no
/// answer at all, so the session's statement timeout cannot) and the replica steps
/// down (`lost`) to load the records again. Before, it failed the write, kept serving
/// from memory, and went on as if nothing had been written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_without_an_answer_steps_the_replica_down() {
    let pg = TempPostgres::start_async().await;
    let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let relay = relay_stalling_commits(pg.port(), std::sync::Arc::clone(&armed)).await;
    let url = format!("postgres://postgres@127.0.0.1:{relay}/postgres");
    let store = PostgresStore::open(&url).await.unwrap();
    store
        .write(Batch {
            put_atespaces: vec!["demo".into()],
            ..Batch::default()
        })
        .await
        .unwrap();
    let lost = store.lost();
    assert!(!lost.is_cancelled());

    armed.store(true, std::sync::atomic::Ordering::Release);
    let written = tokio::time::timeout(
        Duration::from_secs(60),
        store.write(Batch::put([row("p1")])),
    )
    .await
    .expect("the write is bounded");
    assert!(
        matches!(written, Err(StoreError::Lost { .. })),
        "{written:?}"
    );
    assert!(lost.is_cancelled(), "the replica steps down");
    // Nothing it decides from its records in memory is written any more.
    let after = store.write(Batch::put([row("p2")])).await;
    assert!(matches!(after, Err(StoreError::Refused(_))), "{after:?}");
}

/// Options given in the URL (a schema of its own, say) are kept beside the control
/// plane's session limits: before, the limits replaced them and the tables went to
/// the default schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_in_the_url_are_kept() {
    let pg = TempPostgres::start_async().await;
    sql(&pg.url(), "CREATE SCHEMA valet").await;
    let url = format!("{}?options=-c%20search_path%3Dvalet", pg.url());
    let store = PostgresStore::open(&url).await.unwrap();
    store.write(Batch::put([row("p1")])).await.unwrap();
    let in_schema = "SELECT count(*) FROM information_schema.tables \
         WHERE table_schema = 'valet' AND table_name = 'actors'";
    assert_eq!(count(&pg.url(), in_schema).await, 1);
    assert_eq!(
        count(&pg.url(), "SELECT count(*) FROM valet.actors").await,
        1
    );
}

/// Taking over waits for the replaced replica's writes still in progress (here one
/// holding its share lock on the epoch row for 12 s, past the sessions' 10 s statement
/// timeout), and then succeeds. Before, the epoch bump ran under that timeout: the
/// replica that was taking over failed with a database error and, never having served,
/// exited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_for_writes_in_progress_past_the_statement_timeout() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let first = PostgresStore::open(&url).await.unwrap();
    let epoch = first.epoch();
    drop(first);
    // A write of the replaced replica, in progress: the epoch row share-locked.
    let (client, conn) = epoch_row_locked(&url, "FOR SHARE").await;
    let opening = opening(&url);
    // Once its epoch bump waits for the write, the write goes on 12 s more: past the
    // sessions' 10 s statement timeout.
    let bump_waits = "SELECT count(*) FROM pg_stat_activity          WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE valet_active%'";
    until_count(&url, bump_waits, 1, "the takeover reaches the epoch bump").await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    client.batch_execute("COMMIT").await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(60), opening)
        .await
        .expect("bounded")
        .unwrap()
        .expect("the takeover waits for the write, then succeeds");
    assert_eq!(next.epoch(), epoch + 1);
    conn.abort();
}

/// The readiness probe of the active replica does not queue for a pooled connection:
/// with every one of them taken by writes waiting on a lock, it still answers at once.
/// Before, it waited 5 s for a connection and failed, and the only active replica
/// looked not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_does_not_wait_for_a_pooled_connection() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let store = std::sync::Arc::new(PostgresStore::open(&url).await.unwrap());
    // Every write waits: the epoch row is locked for update by another session.
    let (client, conn) = epoch_row_locked(&url, "FOR UPDATE").await;
    let writes: Vec<_> = (0..8)
        .map(|i| {
            let store = std::sync::Arc::clone(&store);
            tokio::spawn(async move { store.write(Batch::put([row(&format!("p{i}"))])).await })
        })
        .collect();
    // All eight pooled connections wait on the lock.
    let waiting = "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' AND application_name = 'valet control-plane'";
    until_count(&url, waiting, 8, "the writes take every pooled connection").await;
    tokio::time::timeout(Duration::from_secs(2), store.ping())
        .await
        .expect("the probe does not queue for a connection")
        .expect("ready");
    client.batch_execute("COMMIT").await.unwrap();
    for w in writes {
        w.await.unwrap().unwrap();
    }
    conn.abort();
}

/// An active replica that can no longer open pooled connections (its role lost LOGIN)
/// steps down, and a standby that can connect takes over: before, its lock session
/// kept it active and ready while every write failed, and the standby waited forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_active_replica_that_cannot_connect_any_more_steps_down() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    sql(&url, "CREATE ROLE valet LOGIN SUPERUSER").await;
    let as_valet = url.replacen("postgres://postgres@", "postgres://valet@", 1);
    let active = PostgresStore::open(&as_valet).await.unwrap();
    active.write(Batch::put([row("p1")])).await.unwrap();
    let standby = opening(&url);
    standby_waiting(&url).await;
    // Its pooled sessions end and no new one may open; its lock session lives on.
    sql(
        &url,
        "ALTER ROLE valet NOLOGIN; \
         SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a \
         WHERE a.usename = 'valet' AND NOT EXISTS (SELECT 1 FROM pg_locks l \
         WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted)",
    )
    .await;
    // Its probes (readiness) see it, and within POOL_FAILING_MAX it steps down.
    let mut not_ready = 0;
    let stepped_down = async {
        while !active.lost().is_cancelled() {
            not_ready += usize::from(active.ping().await.is_err());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), stepped_down)
        .await
        .expect("the replica steps down");
    assert!(not_ready > 0, "not ready while it cannot connect");
    let next = took_over(standby).await;
    assert_eq!(next.epoch(), active.epoch() + 1);
    next.write(Batch::put([row("p2")])).await.unwrap();
}

/// Every session of the store commits synchronously whatever the server's default
/// (the throwaway server runs with `synchronous_commit=off`), and the lock's session
/// gives up on unacknowledged data after 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_sessions_commit_synchronously() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let store = PostgresStore::open(&url).await.unwrap();
    store.write(Batch::put([row("p1")])).await.unwrap();
    let (pooled, _) = store.settings("synchronous_commit").await.unwrap();
    assert_eq!(pooled, "on");
    let (_, lock) = store.settings("tcp_user_timeout").await.unwrap();
    assert_eq!(lock, "10000", "milliseconds");
}

/// Undoes every migration after the first on the database at `url`.
async fn back_to_version_1(url: &str) {
    sql(
        url,
        "ALTER TABLE actors DROP CONSTRAINT actors_one_per_worker; \
         DROP TABLE route_lease_bound; DROP TABLE hosting_lease_bound; \
         ALTER TABLE actors DROP COLUMN op_replica; \
         DROP TABLE valet_replicas, valet_workers, valet_waiters, valet_forwards; \
         DROP SEQUENCE valet_attach_seq; \
         UPDATE valet_schema SET version = 1",
    )
    .await;
}

/// A database at schema version 1 whose records place one worker on two actors (older
/// versions could write that) is upgraded: those actors go back to SUSPENDED, not a
/// reason to refuse every start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_schema_with_a_worker_on_two_actors_is_upgraded() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    drop(PostgresStore::open(&url).await.unwrap());
    back_to_version_1(&url).await;
    for (name, worker) in [("a", "w1"), ("b", "w1"), ("c", "w2")] {
        sql(
            &url,
            &format!(
                "INSERT INTO atespaces (name) VALUES ('demo') ON CONFLICT DO NOTHING; \
                 INSERT INTO actors (atespace, name, uid, template_namespace, template, pool, \
                 status, version, worker, selector, revert_pending) VALUES ('demo', '{name}', \
                 'u', 'default', 'counter', 'counter', 2, 1, '{worker}', '', false)"
            ),
        )
        .await;
    }
    let store = PostgresStore::open(&url).await.unwrap();
    let loaded = store.load().await.unwrap();
    assert_eq!(
        loaded.route_lease, None,
        "no route lease recorded before version 3"
    );
    assert_eq!(
        loaded.hosting_lease, None,
        "no hosting lease recorded before version 4"
    );
    let placed: Vec<(String, ActorStatus, Option<String>)> = loaded
        .actors
        .into_iter()
        .map(|a| (a.name, a.status, a.worker))
        .collect();
    assert_eq!(
        placed,
        [
            ("a".into(), ActorStatus::Suspended, None),
            ("b".into(), ActorStatus::Suspended, None),
            ("c".into(), ActorStatus::Running, Some("w2".into())),
        ]
    );
}

/// Taking over fences the replaced replica (the epoch goes up, waiting for its writes
/// in progress) before the schema changes: it never writes into a schema it does not
/// know.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_fences_the_replaced_replica_before_it_migrates() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    drop(PostgresStore::open(&url).await.unwrap());
    back_to_version_1(&url).await;
    // A write of the replaced replica in progress.
    let (held, conn) = epoch_row_locked(&url, "FOR SHARE").await;
    let opening = opening(&url);
    let waiting = "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' AND application_name = 'valet control-plane'";
    until_count(
        &url,
        waiting,
        1,
        "the takeover waits for the write in progress",
    )
    .await;
    let constraint = "SELECT count(*) FROM pg_constraint WHERE conname = 'actors_one_per_worker'";
    assert_eq!(
        count(&url, constraint).await,
        0,
        "not migrated before the fence"
    );
    held.batch_execute("COMMIT").await.unwrap();
    let store = tokio::time::timeout(Duration::from_secs(30), opening)
        .await
        .expect("the takeover ends")
        .unwrap()
        .unwrap();
    assert_eq!(count(&url, constraint).await, 1, "migrated after it");
    drop(store);
    conn.abort();
}

/// Two deployments in two schemas of one database are active each on its own: the
/// advisory locks are per schema (before, the second waited as a standby forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_in_two_schemas_of_one_database_are_both_active() {
    let pg = TempPostgres::start_async().await;
    sql(&pg.url(), "CREATE SCHEMA a; CREATE SCHEMA b").await;
    let in_schema = |s: &str| format!("{}?options=-c%20search_path%3D{s}", pg.url());
    let a = PostgresStore::open(&in_schema("a")).await.unwrap();
    let b = tokio::time::timeout(
        Duration::from_secs(10),
        PostgresStore::open(&in_schema("b")),
    )
    .await
    .expect("not a standby of the other schema's replica")
    .unwrap();
    assert_eq!((a.epoch(), b.epoch()), (1, 1));
    b.write(Batch::put([row("p1")])).await.unwrap();
    assert_eq!(count(&pg.url(), "SELECT count(*) FROM b.actors").await, 1);
    assert_eq!(count(&pg.url(), "SELECT count(*) FROM a.actors").await, 0);
    // In one schema, one replica is active at a time as before.
    let standby = opening(&in_schema("a"));
    standby_waiting(&pg.url()).await;
    assert!(!standby.is_finished());
    standby.abort();
}

/// Without a schema chosen in the URL (the default `"$user", public` path, here
/// resolving to the role's own schema), a replica takes the advisory lock earlier
/// versions took: it waits behind one of them during an upgrade instead of being
/// active beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_chosen_schema_the_earlier_lock_keys_are_kept() {
    let pg = TempPostgres::start_async().await;
    sql(
        &pg.url(),
        "CREATE ROLE valet LOGIN SUPERUSER; CREATE SCHEMA valet AUTHORIZATION valet",
    )
    .await;
    // An earlier version's active replica: its lock ("valet-cp").
    let (held, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    held.execute("SELECT pg_advisory_lock($1)", &[&0x7661_6c65_742d_6370_i64])
        .await
        .unwrap();
    let as_valet = pg
        .url()
        .replacen("postgres://postgres@", "postgres://valet@", 1);
    let first = opening(&as_valet);
    standby_waiting(&pg.url()).await;
    assert!(!first.is_finished());
    drop(held);
    let store = took_over(first).await;
    store.write(Batch::put([row("p1")])).await.unwrap();
    assert_eq!(
        count(&pg.url(), "SELECT count(*) FROM valet.actors").await,
        1
    );
    conn.abort();
    // A replica whose URL names that same schema waits behind it too (before, each
    // took keys of its own, and the two took turns fencing each other), and the other
    // way round.
    let named = format!("{as_valet}?options=-c%20search_path%3Dvalet");
    let opening_named = opening(&named);
    standby_waiting(&pg.url()).await;
    assert!(!opening_named.is_finished());
    drop(store);
    let named_store = took_over(opening_named).await;
    let opening_default = opening(&as_valet);
    standby_waiting(&pg.url()).await;
    assert!(!opening_default.is_finished());
    assert!(
        !named_store.lost().is_cancelled(),
        "not fenced by the other"
    );
    opening_default.abort();
}
