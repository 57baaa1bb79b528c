//! Test doubles of the control plane, for unit tests and benchmarks of the pipeline
//! (integration tests use the real gRPC server instead).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};
use tonic::Code;
use valet_proto::ateapi;

use crate::addr::ActorRef;
use crate::control::{ControlPlane, Grant, ResumeError, ResumeFuture, ResumeRequest, Resumed};

/// A RUNNING actor on `ip:port`, as the control plane returns it.
pub fn running_actor(actor: &ActorRef, ip: &str, port: u16) -> ateapi::Actor {
    ateapi::Actor {
        actor_id: actor.name().to_owned(),
        atespace: actor.atespace().to_owned(),
        status: ateapi::actor::Status::Running as i32,
        ateom_pod_ip: ip.to_owned(),
        worker_port: u32::from(port),
        ..Default::default()
    }
}

/// Answers every resume at once with a RUNNING actor on `127.0.0.1:<port>`: the
/// router's fast path, for benchmarks.
#[derive(Debug, Clone)]
pub struct AlwaysRunning {
    /// The worker port it answers with.
    pub port: u16,
}

impl ControlPlane for AlwaysRunning {
    fn resume_actor(&self, req: ResumeRequest) -> ResumeFuture<'_> {
        let actor = running_actor(&req.actor, "127.0.0.1", self.port);
        Box::pin(async move { Ok(actor.into()) })
    }
}

/// Answers every resume at once with a RUNNING actor on `127.0.0.1:<port>` and a route
/// lease of `lease`: after the first request, the router's route cache.
#[derive(Debug, Clone)]
pub struct AlwaysLeased {
    /// The worker port it answers with.
    pub port: u16,
    /// The lease it grants.
    pub lease: std::time::Duration,
}

impl ControlPlane for AlwaysLeased {
    fn resume_actor(&self, req: ResumeRequest) -> ResumeFuture<'_> {
        let actor = running_actor(&req.actor, "127.0.0.1", self.port);
        let grant = req.lease_holder.map(|_| Grant {
            lease: self.lease,
            id: 1,
        });
        Box::pin(async move { Ok(Resumed { actor, grant }) })
    }
}

/// A control plane whose every answer the test gives: each `ResumeActor` call arrives
/// on [`Calls`] and waits until the test answers it.
#[derive(Debug)]
pub struct Scripted {
    calls: mpsc::UnboundedSender<Call>,
    in_flight: Mutex<HashMap<ActorRef, usize>>,
    max_in_flight: Mutex<usize>,
}

/// The calls of a [`Scripted`] control plane, in arrival order.
#[derive(Debug)]
pub struct Calls(mpsc::UnboundedReceiver<Call>);

impl Calls {
    /// The next call; panics when the control plane is gone.
    pub async fn next(&mut self) -> Call {
        self.0.recv().await.expect("control plane dropped")
    }

    /// A call that has already arrived, if any.
    pub fn try_next(&mut self) -> Option<Call> {
        self.0.try_recv().ok()
    }
}

/// One pending `ResumeActor` call.
#[derive(Debug)]
pub struct Call {
    /// What the router asked.
    pub request: ResumeRequest,
    /// When it asked.
    pub asked_at: tokio::time::Instant,
    reply: oneshot::Sender<Result<Resumed, ResumeError>>,
}

impl Call {
    /// Answers with `answer`.
    pub fn answer(self, answer: Result<ateapi::Actor, ResumeError>) {
        let _ = self.reply.send(answer.map(Resumed::from));
    }

    /// Answers RUNNING on `127.0.0.1:<port>` with a route lease of `lease`, number `id`.
    pub fn running_leased(self, port: u16, lease: std::time::Duration, id: u64) {
        let actor = running_actor(&self.request.actor, "127.0.0.1", port);
        let _ = self.reply.send(Ok(Resumed {
            actor,
            grant: Some(Grant { lease, id }),
        }));
    }

    /// Answers RUNNING on `127.0.0.1:<port>`.
    pub fn running(self, port: u16) {
        let actor = running_actor(&self.request.actor, "127.0.0.1", port);
        self.answer(Ok(actor));
    }

    /// Answers with an error status.
    pub fn fail(self, code: Code, message: &str) {
        self.answer(Err(ResumeError::new(code, message)));
    }

    /// Whether the router gave up on the call (it dropped its future).
    pub fn abandoned(&self) -> bool {
        self.reply.is_closed()
    }

    /// Answers the reference control plane's "no worker has room".
    pub fn no_room(self) {
        self.fail(Code::ResourceExhausted, "no worker has room for the actor");
    }
}

impl Scripted {
    /// A new scripted control plane and its call queue.
    pub fn new() -> (Arc<Self>, Calls) {
        let (tx, rx) = mpsc::unbounded_channel();
        let cp = Arc::new(Self {
            calls: tx,
            in_flight: Mutex::new(HashMap::new()),
            max_in_flight: Mutex::new(0),
        });
        (cp, Calls(rx))
    }

    /// The most `ResumeActor` calls ever in progress at once for one actor.
    pub fn max_concurrent_per_actor(&self) -> usize {
        *self.max_in_flight.lock().unwrap()
    }
}

impl ControlPlane for Scripted {
    fn resume_actor(&self, req: ResumeRequest) -> ResumeFuture<'_> {
        let actor = req.actor.clone();
        {
            let mut in_flight = self.in_flight.lock().unwrap();
            let n = in_flight.entry(actor.clone()).or_default();
            *n += 1;
            let mut max = self.max_in_flight.lock().unwrap();
            *max = (*max).max(*n);
        }
        let (reply, answer) = oneshot::channel();
        let sent = self.calls.send(Call {
            request: req,
            asked_at: tokio::time::Instant::now(),
            reply,
        });
        Box::pin(async move {
            let result = match sent {
                Ok(()) => answer
                    .await
                    .unwrap_or_else(|_| Err(ResumeError::new(Code::Internal, "call dropped"))),
                Err(_) => Err(ResumeError::new(Code::Unavailable, "script gone")),
            };
            *self.in_flight.lock().unwrap().get_mut(&actor).unwrap() -= 1;
            result
        })
    }
}
