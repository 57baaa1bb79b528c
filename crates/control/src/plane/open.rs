//! Opening the plane: the store loaded, what an unclean stop left half-way found, and
//! the plane's background chores started (the lease bound, the rejoin grace, the
//! settler, the policies, and with replicas the followers).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Inner, Plane, PlaneConfig, State, Stats, peers, records, release, replicas, settle};
use crate::metrics::PlaneMetrics;
use crate::model::{ActorKey, ActorStatus, Template};
use crate::store::{Batch, Store, StoreError};

impl Plane {
    /// Loads the store, resolves what an unclean stop left half-way, and returns the
    /// plane.
    ///
    /// Recovery: actors left RESUMING or SUSPENDING go back to SUSPENDED from their
    /// last snapshot once their worker must have fenced them (it re-attached, which
    /// evicts what it may still host, or a hosting lease passed since the start), as
    /// after any operation left half-way; RUNNING actors keep their worker for
    /// `rejoin_grace`, then go back to SUSPENDED if it has not re-attached.
    ///
    /// # Errors
    /// When the store cannot be read or written.
    pub async fn open(store: Arc<dyn Store>, config: PlaneConfig) -> Result<Self, StoreError> {
        Self::open_with(
            store,
            config,
            Box::new(peers::Alone),
            replicas::Known::default(),
        )
        .await
    }

    /// [`Self::open`] for one of several replicas active at once on one PostgreSQL
    /// database (docs/scale-out.md): the others' workers, waiters and changes are
    /// followed from the store's announcements, actors RESUMING or SUSPENDING under
    /// another live replica's operation are left to it, and what a replica that dies
    /// leaves is recovered as after a restart.
    ///
    /// # Errors
    /// When the store cannot be read or written.
    pub async fn open_replica(
        store: Arc<crate::replica_store::ReplicaStore>,
        config: PlaneConfig,
    ) -> Result<Self, StoreError> {
        let (replicas, known, following) = replicas::Replicas::open(Arc::clone(&store)).await?;
        let plane = Self::open_with(store, config, Box::new(replicas.clone()), known).await?;
        replicas.start(&plane, following);
        Ok(plane)
    }

    async fn open_with(
        store: Arc<dyn Store>,
        config: PlaneConfig,
        peers: Box<dyn peers::Peers>,
        // The others first: an actor another live replica holds is not half-way.
        known: replicas::Known,
    ) -> Result<Self, StoreError> {
        let loaded = store.load().await?;
        let mut templates: HashMap<String, Template> = config
            .templates
            .iter()
            .map(|t| (t.name().to_owned(), t.clone()))
            .collect();
        for builtin in [Template::counter(), Template::echo()] {
            templates
                .entry(builtin.name().to_owned())
                .or_insert(builtin);
        }
        let fresh = loaded.atespaces.is_empty() && loaded.actors.is_empty();
        // Route leases earlier runs granted end at most their `--route-lease` after
        // the start (a store from before that was recorded: this run's). The record
        // is raised before this run grants longer ones, and lowered once the earlier
        // ones ended (`spawn_lower_lease_bound`), so a crash in between only waits
        // longer.
        // The same for the hosting lease workers were told: one the restart cut off
        // fences its actor at most the earlier runs' lease after its last answered
        // renewal, which came before the start.
        let earlier_lease = loaded.route_lease.unwrap_or(config.route_lease);
        let earlier_hosting = loaded.hosting_lease.unwrap_or(config.hosting_lease);
        let longest = (
            earlier_lease.max(config.route_lease),
            earlier_hosting.max(config.hosting_lease),
        );
        let raise = Batch {
            route_lease: (loaded.route_lease != Some(longest.0)).then_some(longest.0),
            hosting_lease: (loaded.hosting_lease != Some(longest.1)).then_some(longest.1),
            ..Batch::default()
        };
        if !raise.is_empty() {
            store.write(raise).await?;
        }
        let (leases_unknown_until, workers_unknown_until) = if fresh {
            (tokio::time::Instant::now(), tokio::time::Instant::now())
        } else {
            let now = tokio::time::Instant::now();
            (now + earlier_lease, now + earlier_hosting)
        };
        let mut state = State {
            records: records::Records::loaded(loaded.atespaces),
            replicas: known,
            ..State::default()
        };
        let mut half_way = 0;
        for row in loaded.actors {
            if row.status.is_transitional() && !state.held_elsewhere(&row) {
                // Settled by the settler, like any operation left half-way: its worker
                // may still host the actor (a checkpoint given up, a restore that went
                // on), so it may run elsewhere only once that worker fenced it.
                tracing::warn!(
                    actor = %row.key(),
                    was = %row.status,
                    worker = ?row.worker,
                    "recovered actor left mid-operation; back to SUSPENDED once its worker cannot host it"
                );
                half_way += 1;
            }
            state.records.put(row);
        }
        let plane = Self {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                changed: watch::Sender::new(0),
                store,
                config,
                templates,
                stats: Stats::default(),
                metrics: PlaneMetrics::new(),
                tasks: TaskTracker::new(),
                chores: TaskTracker::new(),
                links: TaskTracker::new(),
                shutdown: CancellationToken::new(),
                policy: tokio::sync::Notify::new(),
                unsettled: tokio::sync::Notify::new(),
                leases_unknown_until,
                workers_unknown_until,
                peers,
            }),
        };
        let awaiting: Vec<ActorKey> = plane
            .lock()
            .records
            .iter()
            .filter(|(_, r)| r.status == ActorStatus::Running)
            .map(|(k, _)| k.clone())
            .collect();
        if longest.0 > plane.config().route_lease {
            plane.leases().spawn_lower_lease_bound(false);
        }
        if longest.1 > plane.config().hosting_lease {
            plane.leases().spawn_lower_lease_bound(true);
        }
        release::Release::after_rejoin_grace(&plane, awaiting);
        settle::Settle::spawn_settler(&plane);
        if half_way > 0 {
            plane.inner.unsettled.notify_one();
        }
        plane.policies().spawn_policies();
        Ok(plane)
    }
}
