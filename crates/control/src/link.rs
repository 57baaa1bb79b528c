//! A worker's link: the command half of its `Attach` stream, with replies matched to
//! commands by id. The link is closed when the stream ends; every call in progress
//! then fails with [`LinkError::Gone`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use valet_proto::worker::{Reply, WorkerCommand, worker_command};

/// Why a command to a worker did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LinkError {
    /// The worker went away (its stream ended) before answering.
    #[error("worker went away")]
    Gone,
    /// The worker did not answer in time.
    #[error("worker did not answer within {0:?}")]
    Timeout(Duration),
    /// The worker answered that the command failed.
    #[error("{0}")]
    Failed(String),
    /// A checkpoint found the actor busy: not idle since a policy's mark, or its
    /// requests in flight did not end within the idle wait.
    #[error("the actor is busy")]
    Busy,
    /// A checkpoint of an actor the worker does not host (it was told to drop it).
    #[error("{0}")]
    NotHosting(String),
    /// A checkpoint that failed with the actor still served on the worker (its data
    /// over the limit, a snapshot that could not be written).
    #[error("{0}")]
    StillRunning(String),
}

/// What the control plane sends on a worker's stream.
pub(crate) type Outbound = mpsc::Sender<Result<WorkerCommand, tonic::Status>>;

/// The control plane's end of one worker's stream.
#[derive(Debug)]
pub(crate) struct WorkerLink {
    /// `None` once the plane told the worker to detach: the stream then ends.
    tx: Mutex<Option<Outbound>>,
    pending: Mutex<Option<HashMap<u64, oneshot::Sender<Reply>>>>,
    next_id: AtomicU64,
}

impl WorkerLink {
    pub(crate) fn new(tx: Outbound) -> Self {
        Self {
            tx: Mutex::new(Some(tx)),
            pending: Mutex::new(Some(HashMap::new())),
            next_id: AtomicU64::new(1),
        }
    }

    fn sender(&self) -> Option<Outbound> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Tells the worker to detach, and ends the stream from this side.
    pub(crate) fn detach(&self) {
        self.notify(worker_command::Command::Detach(
            valet_proto::worker::Detach {},
        ));
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.close();
    }

    /// Ends the stream from this side with `status`, which the worker receives as the
    /// call's error.
    pub(crate) fn end(&self, status: tonic::Status) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.try_send(Err(status));
        }
        self.close();
    }

    /// Sends `command` and waits up to `timeout` for the worker's reply: the reply
    /// when it says the command succeeded.
    pub(crate) async fn call(
        &self,
        command: worker_command::Command,
        timeout: Duration,
    ) -> Result<Reply, LinkError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply_tx, reply_rx) = oneshot::channel();
        match self.lock().as_mut() {
            Some(pending) => pending.insert(id, reply_tx),
            None => return Err(LinkError::Gone),
        };
        let Some(tx) = self.sender() else {
            self.forget(id);
            return Err(LinkError::Gone);
        };
        // The send counts in the timeout: a worker that does not read its stream (a
        // full queue) holds no operation for longer.
        let deadline = tokio::time::Instant::now() + timeout;
        let sent = tokio::time::timeout_at(
            deadline,
            tx.send(Ok(WorkerCommand {
                id,
                command: Some(command),
            })),
        )
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                self.forget(id);
                return Err(LinkError::Gone);
            }
            Err(_) => {
                self.forget(id);
                return Err(LinkError::Timeout(timeout));
            }
        }
        match tokio::time::timeout_at(deadline, reply_rx).await {
            Ok(Ok(reply)) if reply.ok => Ok(reply),
            Ok(Ok(reply)) if reply.busy => Err(LinkError::Busy),
            Ok(Ok(reply)) if reply.still_running => Err(LinkError::StillRunning(reply.error)),
            Ok(Ok(reply)) if reply.not_hosting => Err(LinkError::NotHosting(reply.error)),
            Ok(Ok(reply)) => Err(LinkError::Failed(reply.error)),
            Ok(Err(_)) => Err(LinkError::Gone),
            Err(_) => {
                self.forget(id);
                Err(LinkError::Timeout(timeout))
            }
        }
    }

    /// Sends a command without waiting for its reply. A worker whose queue is full
    /// (it does not read its stream) would miss it, and an evict missed leaves an actor
    /// on a worker the records call free: its stream is ended instead, so the worker
    /// attaches again and reports what it hosts.
    pub(crate) fn notify(&self, command: worker_command::Command) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let Some(tx) = self.sender() else { return };
        let sent = tx.try_send(Ok(WorkerCommand {
            id,
            command: Some(command),
        }));
        if let Err(mpsc::error::TrySendError::Full(_)) = sent {
            tracing::warn!(
                "a worker does not read its commands (its queue is full): ending its stream, so it attaches again"
            );
            self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
            self.close();
        }
    }

    /// Hands a reply to the call waiting for it.
    pub(crate) fn deliver(&self, reply: Reply) {
        let waiter = self.lock().as_mut().and_then(|p| p.remove(&reply.id));
        if let Some(waiter) = waiter {
            let _ = waiter.send(reply);
        }
    }

    /// The stream ended: every call in progress fails with [`LinkError::Gone`].
    pub(crate) fn close(&self) {
        self.lock().take();
    }

    /// Whether the stream has ended (or the plane ended it).
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().is_none()
    }

    fn forget(&self, id: u64) {
        if let Some(p) = self.lock().as_mut() {
            p.remove(&id);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<HashMap<u64, oneshot::Sender<Reply>>>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use valet_proto::worker::{Detach, Evict};

    fn evict() -> worker_command::Command {
        worker_command::Command::Evict(Evict { actor: None })
    }

    /// A command that finds the worker's queue full is never dropped silently: the
    /// stream ends (what was queued is still delivered), and the worker attaches again.
    #[tokio::test]
    async fn a_full_queue_ends_the_stream() {
        let (tx, mut rx) = mpsc::channel(2);
        let link = WorkerLink::new(tx);
        for _ in 0..3 {
            link.notify(evict());
        }
        assert!(link.is_closed());
        assert!(rx.recv().await.is_some());
        assert!(rx.recv().await.is_some());
        assert!(rx.recv().await.is_none(), "the stream ended");
    }

    /// A call to a worker whose queue stays full ends at its timeout, counted from when
    /// it was made, not from when the worker took it.
    #[tokio::test(start_paused = true)]
    async fn a_call_to_a_worker_that_does_not_read_times_out() {
        let (tx, _rx) = mpsc::channel(1);
        let link = WorkerLink::new(tx);
        link.notify(worker_command::Command::Detach(Detach {}));
        let started = tokio::time::Instant::now();
        let answer = link.call(evict(), Duration::from_secs(5)).await;
        assert!(matches!(answer, Err(LinkError::Timeout(_))), "{answer:?}");
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }
}
