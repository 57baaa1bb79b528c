//! Stopping the plane: a clean shutdown, a step down when its store was lost, and
//! the wait for every background task (tests).

use std::time::Duration;

use super::{Plane, UNFOLLOW_GRACE};

impl Plane {
    /// The clean shutdown: capacity waiters are answered `Unavailable` at once (the
    /// router parks and retries); restores and checkpoints in progress get up to
    /// `timeout`; then every attached worker is told to detach (it keeps its actor
    /// running and re-attaches when a control plane comes back on the same data dir).
    pub async fn shutdown(&self, timeout: Duration) {
        let until = tokio::time::Instant::now() + timeout;
        self.inner.shutdown.cancel();
        self.inner.chores.close();
        self.inner.chores.wait().await;
        self.inner.tasks.close();
        let in_progress: Vec<String> = self
            .lock()
            .ops
            .iter()
            .map(|(target, kind)| format!("{target} {}", kind.name()))
            .collect();
        if !in_progress.is_empty() {
            tracing::info!(
                operations = ?in_progress,
                timeout = ?timeout,
                "waiting for operations in progress"
            );
        }
        if tokio::time::timeout(timeout, self.inner.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                operations = self.inner.tasks.len(),
                "operations still in progress after the shutdown timeout; the next start resolves them"
            );
        }
        self.membership().detach_workers();
        self.leases().close_watches();
        // Forwarded suspends carried out here still write their answers: within what
        // is left of the timeout (at least a second), never past it for long.
        let left = until
            .saturating_duration_since(tokio::time::Instant::now())
            .max(UNFOLLOW_GRACE);
        if tokio::time::timeout(left, self.unfollow()).await.is_err() {
            tracing::warn!(
                "work for the other replicas still in progress after the shutdown timeout; stopping anyway"
            );
        }
    }

    /// Stops following the other replicas, once nothing in progress needs it.
    async fn unfollow(&self) {
        self.inner.peers.unfollow().await;
    }

    /// The store was lost (another replica may be active already): every attached
    /// worker is detached now, and joins are refused from now on, so that no worker
    /// keeps hosting on this replica's renewals while its operations in progress get
    /// their shutdown time ([`Self::shutdown`] follows). Before, workers were
    /// detached last, and renewals answered meanwhile could outlast the rejoin grace
    /// of the replica that took over.
    pub fn step_down(&self) {
        self.inner.shutdown.cancel();
        self.membership().detach_workers();
    }

    /// Waits until every background task has ended (tests).
    pub async fn close(&self) {
        self.inner.shutdown.cancel();
        self.inner.chores.close();
        self.inner.chores.wait().await;
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
        self.unfollow().await;
    }
}
