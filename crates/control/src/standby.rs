//! A control-plane replica's life on its PostgreSQL database (`valet control-plane
//! --database`, docs/scale-out.md): open the store, serving once it may (the active
//! lock with `--active-replicas one`, a join with `all`). While it may not, or while
//! the database is away, wait as a standby. After serving, decide what comes next:
//! join again, wait as a standby, or exit.
//!
//! [`Replica`] is that state machine. The binary owns the sockets and the serving; this
//! type decides which failures are waited out, how long each wait is, and what follows
//! a stop.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use valet_net::Backoff;

use crate::PostgresStore;
use crate::plane::store_backoff;
use crate::replica_store::ReplicaStore;
use crate::store::{Store, StoreError};

/// How many replicas on one database serve at once (`--active-replicas`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Active {
    /// Every replica serves, with no leader ([`ReplicaStore`]).
    All,
    /// One serves and holds the database's active lock; the others wait as standbys
    /// ([`PostgresStore`]).
    One,
}

/// A store opened for serving, and what ends its serving.
#[derive(Debug)]
pub struct Opened {
    /// The record.
    pub store: Arc<dyn Store>,
    /// Cancelled when this replica may no longer serve: its active lock or its
    /// heartbeat is lost.
    pub lost: CancellationToken,
    /// With [`Active::All`]: the store the replicas share, for the plane.
    pub replicas: Option<Arc<ReplicaStore>>,
}

/// What a replica does after serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// It may have been declared dead (its heartbeat or a commit failed): join again,
    /// as a new replica.
    JoinAgain,
    /// It lost the active lock: another replica may take over; wait as a standby.
    Standby,
    /// SIGTERM, or a stop not caused by the database: exit.
    Exit,
}

/// A replica's history with its database, which decides whether a failure is waited
/// out or ends the process.
#[derive(Debug)]
pub struct Replica {
    url: String,
    active: Active,
    /// It connected once: the URL, host and credentials are right.
    reached: bool,
    /// It served once: the database and its schema work for this binary.
    served: bool,
    /// The waits before trying again (0.5 s doubling to 5 s).
    backoff: Backoff,
}

impl Replica {
    /// A replica of the database at `url` that has not connected yet.
    pub fn new(url: impl Into<String>, active: Active) -> Self {
        Self {
            url: url.into(),
            active,
            reached: false,
            served: false,
            backoff: store_backoff(),
        }
    }

    /// Opens its store, waiting as a standby while the database is away or another
    /// replica holds the active lock; `None` when `stopping` ends the wait. Failures
    /// that [`Self::waits_out`] are waited out; the others are returned.
    ///
    /// # Errors
    /// The store's error when it is not one to wait out.
    pub async fn open(
        &mut self,
        stopping: &CancellationToken,
    ) -> Result<Option<Opened>, StoreError> {
        match self.active {
            Active::One => {
                let opened = self
                    .open_with(stopping, async |u| PostgresStore::open(u).await)
                    .await?;
                Ok(opened.map(|s| {
                    let lost = s.lost();
                    Opened {
                        store: Arc::new(s),
                        lost,
                        replicas: None,
                    }
                }))
            }
            Active::All => {
                let opened = self
                    .open_with(stopping, async |u| ReplicaStore::join(u).await)
                    .await?;
                Ok(opened.map(|s| {
                    let s = Arc::new(s);
                    Opened {
                        store: Arc::clone(&s) as Arc<dyn Store>,
                        lost: s.lost(),
                        replicas: Some(s),
                    }
                }))
            }
        }
    }

    /// [`Self::open`] with the store's own `open`.
    async fn open_with<S>(
        &mut self,
        stopping: &CancellationToken,
        open: impl AsyncFn(&str) -> Result<S, StoreError>,
    ) -> Result<Option<S>, StoreError> {
        loop {
            let opened = tokio::select! {
                opened = open(&self.url) => opened,
                () = stopping.cancelled() => return Ok(None),
            };
            match opened {
                Ok(s) => {
                    self.reached = true;
                    return Ok(Some(s));
                }
                Err(e) if self.waits_out(&e) => {
                    tracing::warn!(error = %e, retry_in = ?self.backoff.peek(), "database unavailable; waiting for it as a standby");
                    if !self.pause(stopping).await {
                        return Ok(None);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether to wait for the database and try again rather than exit:
    /// - a schema newer than this binary always ends it (a newer version took the
    ///   database over);
    /// - a database never reached ends it (a wrong host, port or password shows at
    ///   once);
    /// - a lost connection never does (a database restart ends no replica);
    /// - anything else (a refused statement) ends it until it has served once.
    pub fn waits_out(&mut self, e: &StoreError) -> bool {
        match e {
            StoreError::NewerSchema { .. } => false,
            StoreError::Unreachable { .. } => self.reached,
            // Another replica took over (its epoch is newer): wait as its standby.
            StoreError::Lost { .. } | StoreError::Refused(_) => {
                self.reached = true;
                true
            }
            _ => {
                self.reached = true;
                self.served
            }
        }
    }

    /// Waits before the next try; false (at once) when `stopping` came first.
    pub async fn pause(&mut self, stopping: &CancellationToken) -> bool {
        self.backoff.wait(stopping).await
    }

    /// Its records are loaded and it serves: from now on, what a restart would fix
    /// is waited out, and the next wait starts short.
    pub fn serving(&mut self) {
        self.served = true;
        self.backoff.reset();
    }

    /// What follows the end of serving `opened`. With [`Active::All`], a replica that
    /// stops for good first leaves the replicas: the others take its waiters and its
    /// workers' attachments over at once, instead of after its heartbeats stop.
    pub async fn after_serving(&mut self, opened: &Opened, stopping: bool) -> Next {
        let lost = opened.lost.is_cancelled() && !stopping;
        if let Some(replicas) = &opened.replicas {
            if lost {
                tracing::warn!(
                    database = %opened.store.describe(),
                    "this replica may have been declared dead (its heartbeat or a commit failed): stopped serving; joining again as a new replica"
                );
                return Next::JoinAgain;
            }
            replicas.leave().await;
        }
        if lost {
            tracing::warn!(
                database = %opened.store.describe(),
                "lost the database lock: another replica may take over; stopped serving, waiting as a standby"
            );
            return Next::Standby;
        }
        Next::Exit
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    fn errors() -> [StoreError; 5] {
        let (database, why) = (String::from("db"), String::from("x"));
        [
            StoreError::NewerSchema {
                database: database.clone(),
                found: 9,
                supported: 3,
            },
            StoreError::Unreachable {
                database: database.clone(),
                why: why.clone(),
            },
            StoreError::Lost {
                database: database.clone(),
                why: why.clone(),
            },
            StoreError::Refused("epoch 3 is no longer current".into()),
            StoreError::Postgres { database, why },
        ]
    }

    fn replica(reached: bool, served: bool) -> Replica {
        Replica {
            reached,
            served,
            ..Replica::new("postgres://db", Active::All)
        }
    }

    /// What a replica waits out, by what it has done: a fresh one exits on what may be
    /// a configuration mistake, one that served waits out everything but a newer schema,
    /// and a lost connection is waited out always (and counts as reached).
    #[test]
    fn a_replica_waits_out_only_what_a_restart_would_fix() {
        let cases = [
            // (reached, served) → newer, unreachable, lost, taken over, refused
            ((false, false), [false, false, true, true, false]),
            ((true, false), [false, true, true, true, false]),
            ((true, true), [false, true, true, true, true]),
        ];
        for ((reached, served), expected) in cases {
            for (e, wait) in errors().iter().zip(expected) {
                let mut r = replica(reached, served);
                assert_eq!(
                    r.waits_out(e),
                    wait,
                    "{e} after reached={reached} served={served}"
                );
            }
        }
        let mut fresh = replica(false, false);
        assert!(fresh.waits_out(&errors()[2]));
        assert!(fresh.reached, "a lost connection was a connection");
    }

    /// When each try was made.
    type Tries = Arc<Mutex<Vec<tokio::time::Instant>>>;

    /// An opener that fails with `failures` in turn, then opens.
    fn opener(
        failures: Vec<StoreError>,
    ) -> (
        Tries,
        impl AsyncFn(&str) -> Result<&'static str, StoreError>,
    ) {
        let tries = Arc::new(Mutex::new(Vec::new()));
        let left = Arc::new(Mutex::new(failures.into_iter()));
        let seen = Arc::clone(&tries);
        (tries, async move |_: &str| {
            seen.lock().unwrap().push(tokio::time::Instant::now());
            match left.lock().unwrap().next() {
                Some(e) => Err(e),
                None => Ok("store"),
            }
        })
    }

    /// A standby waits out a database that restarts, backing off 0.5 s, 1 s, 2 s …
    /// between tries, and opens once it is back.
    #[tokio::test(start_paused = true)]
    async fn a_standby_waits_for_its_database_backing_off() {
        let [_, _, lost, taken, _] = errors();
        let (tries, open) = opener(vec![lost, taken]);
        let mut r = replica(false, false);
        let stopping = CancellationToken::new();
        let opened = r.open_with(&stopping, open).await.unwrap();
        assert_eq!(opened, Some("store"));
        let tries = tries.lock().unwrap();
        let gaps: Vec<Duration> = tries.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(gaps, [Duration::from_millis(500), Duration::from_secs(1)]);
        assert!(r.reached);
    }

    /// A first connection that fails (a wrong host, say) ends the process at once, and
    /// a newer schema always does.
    #[tokio::test(start_paused = true)]
    async fn a_mistake_is_returned_not_waited_out() {
        let [newer, unreachable, ..] = errors();
        let (_, open) = opener(vec![unreachable]);
        let mut r = replica(false, false);
        let stopping = CancellationToken::new();
        let e = r.open_with(&stopping, open).await.unwrap_err();
        assert!(matches!(e, StoreError::Unreachable { .. }), "{e}");
        let (_, open) = opener(vec![newer]);
        let mut r = replica(true, true);
        let e = r.open_with(&stopping, open).await.unwrap_err();
        assert!(matches!(e, StoreError::NewerSchema { .. }), "{e}");
    }

    /// SIGTERM during a standby's wait ends it with nothing opened.
    #[tokio::test(start_paused = true)]
    async fn sigterm_ends_a_standbys_wait() {
        let [_, _, lost, ..] = errors();
        let (tries, open) = opener(vec![lost]);
        let mut r = replica(true, true);
        let stopping = CancellationToken::new();
        let waiting = async {
            let opened = r.open_with(&stopping, open).await;
            (opened, tokio::time::Instant::now())
        };
        let start = tokio::time::Instant::now();
        let stop = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            stopping.cancel();
        };
        let ((opened, at), ()) = tokio::join!(waiting, stop);
        assert_eq!(opened.unwrap(), None);
        assert_eq!(at - start, Duration::from_millis(100), "at once");
        assert_eq!(tries.lock().unwrap().len(), 1);
    }

    /// After serving: the waits start short again, and what follows depends on why it
    /// stopped.
    #[tokio::test(start_paused = true)]
    async fn after_serving_it_joins_again_waits_or_exits() {
        let mut r = replica(true, false);
        let _ = r.backoff.next_delay();
        let _ = r.backoff.next_delay();
        r.serving();
        assert!(r.served);
        assert_eq!(r.backoff.next_delay(), Duration::from_millis(500));

        let opened = |lost: bool| {
            let token = CancellationToken::new();
            if lost {
                token.cancel();
            }
            Opened {
                store: Arc::new(crate::testing::MemoryStore::default()) as Arc<dyn Store>,
                lost: token,
                replicas: None,
            }
        };
        // One active replica (no ReplicaStore): a lost lock → standby.
        assert_eq!(r.after_serving(&opened(true), false).await, Next::Standby);
        assert_eq!(r.after_serving(&opened(false), false).await, Next::Exit);
        // SIGTERM wins over a lock lost on the way out.
        assert_eq!(r.after_serving(&opened(true), true).await, Next::Exit);
    }
}
