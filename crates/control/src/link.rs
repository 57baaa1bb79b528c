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

    /// Sends `command` and waits up to `timeout` for the worker's reply.
    pub(crate) async fn call(
        &self,
        command: worker_command::Command,
        timeout: Duration,
    ) -> Result<(), LinkError> {
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
        let sent = tx
            .send(Ok(WorkerCommand {
                id,
                command: Some(command),
            }))
            .await;
        if sent.is_err() {
            self.forget(id);
            return Err(LinkError::Gone);
        }
        match tokio::time::timeout(timeout, reply_rx).await {
            Ok(Ok(reply)) if reply.ok => Ok(()),
            Ok(Ok(reply)) if reply.busy => Err(LinkError::Busy),
            Ok(Ok(reply)) if reply.not_hosting => Err(LinkError::NotHosting(reply.error)),
            Ok(Ok(reply)) => Err(LinkError::Failed(reply.error)),
            Ok(Err(_)) => Err(LinkError::Gone),
            Err(_) => {
                self.forget(id);
                Err(LinkError::Timeout(timeout))
            }
        }
    }

    /// Sends a command without waiting for its reply.
    pub(crate) fn notify(&self, command: worker_command::Command) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Some(tx) = self.sender() {
            let _ = tx.try_send(Ok(WorkerCommand {
                id,
                command: Some(command),
            }));
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
