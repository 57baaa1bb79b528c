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
    // A worker handed from one actor to another in one batch, in either order.
    store
        .write(Batch::put([on("p1", "w1"), row("p2")]))
        .await
        .unwrap();
    drop(store);

    let store = PostgresStore::open(&pg.url()).await.unwrap();
    let loaded = store.load().await.unwrap();
    assert_eq!(loaded.atespaces, vec!["demo".to_owned()]);
    assert_eq!(loaded.actors, vec![on("p1", "w1"), row("p2")]);
    store.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_migrate_once_and_a_newer_schema_is_refused() {
    let pg = TempPostgres::start_async().await;
    // Started together: both migrate under the lock, one becomes active.
    let url = pg.url();
    let first = tokio::spawn({
        let url = url.clone();
        async move { PostgresStore::open(&url).await }
    });
    let second = tokio::spawn({
        let url = url.clone();
        async move { PostgresStore::open(&url).await }
    });
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_waits_past_the_sessions_statement_timeout() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let active = PostgresStore::open(&url).await.unwrap();
    let mut standby = tokio::spawn({
        let url = url.clone();
        async move { PostgresStore::open(&url).await }
    });
    standby_waiting(&url).await;
    // Every session has a 10 s statement timeout; the standby's wait for the lock must
    // outlast it (it failed with "canceling statement due to statement timeout").
    let waited = tokio::time::timeout(Duration::from_secs(12), &mut standby).await;
    assert!(waited.is_err(), "the standby stopped waiting: {waited:?}");
    drop(active);
    let next = tokio::time::timeout(Duration::from_secs(30), standby)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap();
    next.write(Batch::put([row("p1")])).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_and_the_replaced_replica_is_fenced() {
    let pg = TempPostgres::start_async().await;
    let url = pg.url();
    let active = PostgresStore::open(&url).await.unwrap();
    active.write(Batch::put([row("p1")])).await.unwrap();
    let standby = tokio::spawn({
        let url = url.clone();
        async move { PostgresStore::open(&url).await }
    });
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
    let next = tokio::time::timeout(Duration::from_secs(30), standby)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap();
    assert_eq!(next.epoch(), active.epoch() + 1);
    tokio::time::timeout(Duration::from_secs(30), active.lost().cancelled())
        .await
        .expect("the replaced replica learns it lost the lock");
    // Its pooled connections still work, but its writes are fenced.
    let e = active.write(Batch::put([row("p2")])).await.unwrap_err();
    assert!(e.to_string().contains("took over"), "{e}");
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
