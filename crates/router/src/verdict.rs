//! Verdicts: the one place that turns every outcome that is not a route into an HTTP
//! status, a body and headers. Data planes only render a [`Verdict`].

use http::StatusCode;
use tonic::Code;

use crate::addr::{ActorRef, InvalidHost};
use crate::flight::FlightError;
use crate::metrics::ParkOutcome;

/// `content-type` of every verdict body.
pub const CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// `Retry-After` (seconds) on the 503s that waiting can cure.
pub const RETRY_AFTER_SECS: u32 = 1;

/// Why a request is answered by the router instead of its actor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// The host does not address an actor.
    InvalidHost(InvalidHost),
    /// The actor's flight ended without a worker.
    Flight(ActorRef, FlightError),
    /// The lot was full at the park transition.
    LotFull(ActorRef),
    /// The request's own deadline ended while it waited.
    CallerDeadline(ActorRef),
    /// The caller went away while it waited.
    CallerGone(ActorRef),
    /// The router's drain timeout ended while the request waited.
    ShuttingDown(ActorRef),
    /// The request has more header fields than the data plane accepts.
    TooManyHeaders {
        /// How many it has.
        count: usize,
        /// How many are accepted.
        limit: usize,
    },
    /// The request's header names and values are larger than the data plane accepts.
    HeadersTooLarge {
        /// Their size in bytes.
        bytes: usize,
        /// The accepted size.
        limit: usize,
    },
    /// The request's body is not valid HTTP framing (a bad chunk size, say).
    MalformedBody(ActorRef, String),
    /// The actor's worker could not be reached, or failed before answering.
    WorkerUnreachable(ActorRef),
    /// The actor's worker no longer hosts it (it answered 421), and the request cannot
    /// be sent again (its body was streamed, or it was replayed once already).
    ActorMoved(ActorRef),
}

/// Why a request's own side ended its wait while it was parked (reported by the data
/// plane, which reads the request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallerEnd {
    /// The client went away.
    Gone,
    /// The client's body is not valid HTTP framing.
    MalformedBody(String),
    /// The client sent nothing of its body for the data plane's idle timeout (a body
    /// being streamed to the worker): as a request's own deadline, 504.
    Stalled,
}

impl Denial {
    /// The `outcome` label of a parked request that ends this way.
    pub(crate) fn park_outcome(&self) -> ParkOutcome {
        match self {
            Denial::Flight(_, FlightError::BudgetExhausted(_)) => ParkOutcome::BudgetExhausted,
            Denial::Flight(..)
            | Denial::InvalidHost(_)
            | Denial::LotFull(_)
            | Denial::TooManyHeaders { .. }
            | Denial::HeadersTooLarge { .. }
            | Denial::MalformedBody(..)
            | Denial::WorkerUnreachable(_)
            | Denial::ActorMoved(_) => ParkOutcome::Error,
            Denial::CallerGone(_) => ParkOutcome::Canceled,
            Denial::CallerDeadline(_) | Denial::ShuttingDown(_) => ParkOutcome::Timeout,
        }
    }
}

/// An answer the router gives itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    status: StatusCode,
    body: String,
    retry_after: Option<u32>,
    reason: &'static str,
}

impl Verdict {
    /// The verdict table of `parking.md`.
    pub fn of(denial: &Denial) -> Self {
        match denial {
            Denial::InvalidHost(e) => {
                Self::new(StatusCode::NOT_FOUND, e.to_string(), "invalid_host")
            }
            Denial::Flight(actor, FlightError::BudgetExhausted(e)) => {
                unavailable(actor, e.code(), e.message()).retry_after()
            }
            Denial::Flight(actor, FlightError::Failed(e)) => {
                if e.is_crashed() {
                    return Self::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        with_description(actor, e.message()),
                        "crashed",
                    );
                }
                match e.code() {
                    Code::NotFound => Self::new(
                        StatusCode::NOT_FOUND,
                        format!("actor {actor} not found"),
                        "not_found",
                    ),
                    Code::ResourceExhausted
                    | Code::FailedPrecondition
                    | Code::Unavailable
                    | Code::Aborted => unavailable(actor, e.code(), e.message()).retry_after(),
                    Code::DeadlineExceeded => timed_out(actor),
                    Code::PermissionDenied => Self::new(
                        StatusCode::FORBIDDEN,
                        format!("actor {actor} access denied"),
                        "forbidden",
                    ),
                    Code::Unauthenticated => Self::new(
                        StatusCode::UNAUTHORIZED,
                        format!("actor {actor} authentication required"),
                        "unauthenticated",
                    ),
                    _ => internal(actor),
                }
            }
            Denial::Flight(actor, FlightError::Unroutable(_) | FlightError::Lost) => {
                internal(actor)
            }
            Denial::LotFull(actor) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("actor {actor} unavailable: router at capacity"),
                "router_at_capacity",
            )
            .retry_after(),
            Denial::CallerDeadline(actor) => timed_out(actor),
            Denial::CallerGone(_) => {
                Self::new(StatusCode::REQUEST_TIMEOUT, String::new(), "canceled")
            }
            Denial::ShuttingDown(actor) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("actor {actor} unavailable: router shutting down"),
                "shutting_down",
            )
            .retry_after(),
            Denial::TooManyHeaders { count, limit } => Self::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("too many request header fields: {count} (limit {limit})"),
                "headers_too_large",
            ),
            Denial::HeadersTooLarge { bytes, limit } => Self::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("request header fields too large: {bytes} bytes (limit {limit})"),
                "headers_too_large",
            ),
            Denial::MalformedBody(actor, reason) => Self::new(
                StatusCode::BAD_REQUEST,
                format!("actor {actor}: malformed request body: {reason}"),
                "malformed_body",
            ),
            Denial::WorkerUnreachable(actor) => Self::new(
                StatusCode::BAD_GATEWAY,
                format!("actor {actor} unreachable"),
                "worker_unreachable",
            ),
            Denial::ActorMoved(actor) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("actor {actor} unavailable: actor moved"),
                "actor_moved",
            )
            .retry_after(),
        }
    }

    fn new(status: StatusCode, body: String, reason: &'static str) -> Self {
        Self {
            status,
            body,
            retry_after: None,
            reason,
        }
    }

    fn retry_after(mut self) -> Self {
        self.retry_after = Some(RETRY_AFTER_SECS);
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body, `text/plain; charset=utf-8`.
    pub fn body(&self) -> &str {
        &self.body
    }

    /// The `content-type` header value.
    pub fn content_type(&self) -> &'static str {
        CONTENT_TYPE
    }

    /// `Retry-After` in whole seconds, where waiting can cure the condition.
    pub fn retry_after_secs(&self) -> Option<u32> {
        self.retry_after
    }

    /// A short machine name of the verdict, for logs and metric labels.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

fn unavailable(actor: &ActorRef, code: Code, description: &str) -> Verdict {
    let body = if code == Code::Unavailable {
        format!("actor {actor} unavailable")
    } else {
        with_description(actor, description)
    };
    Verdict::new(StatusCode::SERVICE_UNAVAILABLE, body, "unavailable")
}

fn with_description(actor: &ActorRef, description: &str) -> String {
    if description.is_empty() {
        format!("actor {actor} unavailable")
    } else {
        format!("actor {actor} unavailable: {description}")
    }
}

fn timed_out(actor: &ActorRef) -> Verdict {
    Verdict::new(
        StatusCode::GATEWAY_TIMEOUT,
        format!("actor {actor} request timed out"),
        "timeout",
    )
}

fn internal(actor: &ActorRef) -> Verdict {
    Verdict::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("error resuming actor {actor}"),
        "internal",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::{ActorDomain, parse_host};
    use crate::control::ResumeError;

    fn actor() -> ActorRef {
        "demo/p3".parse().unwrap()
    }

    fn flight(e: FlightError) -> Verdict {
        Verdict::of(&Denial::Flight(actor(), e))
    }

    fn check(v: &Verdict, status: u16, body: &str, retry_after: bool) {
        assert_eq!(v.status().as_u16(), status, "{v:?}");
        assert_eq!(v.body(), body, "{v:?}");
        assert_eq!(v.content_type(), "text/plain; charset=utf-8");
        assert_eq!(v.retry_after_secs().is_some(), retry_after, "{v:?}");
        if let Some(secs) = v.retry_after_secs() {
            assert!(secs >= 1);
        }
    }

    #[test]
    fn every_row_of_the_table() {
        let domain: ActorDomain = "actors.example".parse().unwrap();
        let bad = parse_host("nope", &domain).unwrap_err();
        check(
            &Verdict::of(&Denial::InvalidHost(bad)),
            404,
            "invalid host \"nope\": not under the actor domain actors.example",
            false,
        );
        check(
            &flight(FlightError::Failed(ResumeError::new(
                Code::NotFound,
                "actor demo/p3 not found",
            ))),
            404,
            "actor demo/p3 not found",
            false,
        );
        let no_room = ResumeError::new(Code::ResourceExhausted, "no worker has room for the actor");
        check(
            &flight(FlightError::BudgetExhausted(no_room.clone())),
            503,
            "actor demo/p3 unavailable: no worker has room for the actor",
            true,
        );
        check(
            &flight(FlightError::BudgetExhausted(ResumeError::new(
                Code::FailedPrecondition,
                "actor is SUSPENDING",
            ))),
            503,
            "actor demo/p3 unavailable: actor is SUSPENDING",
            true,
        );
        check(
            &flight(FlightError::BudgetExhausted(ResumeError::new(
                Code::Unavailable,
                "tcp connect error: connection refused",
            ))),
            503,
            "actor demo/p3 unavailable",
            true,
        );
        check(
            &flight(FlightError::BudgetExhausted(ResumeError::new(
                Code::Aborted,
                "another operation is in progress for this actor",
            ))),
            503,
            "actor demo/p3 unavailable: another operation is in progress for this actor",
            true,
        );
        // Parking disabled: the same conditions fail at once, same bodies.
        check(
            &flight(FlightError::Failed(no_room)),
            503,
            "actor demo/p3 unavailable: no worker has room for the actor",
            true,
        );
        check(
            &flight(FlightError::Failed(ResumeError::new(
                Code::FailedPrecondition,
                "busy",
            ))),
            503,
            "actor demo/p3 unavailable: busy",
            true,
        );
        check(
            &flight(FlightError::Failed(ResumeError::new(
                Code::Unavailable,
                "down",
            ))),
            503,
            "actor demo/p3 unavailable",
            true,
        );
        check(
            &flight(FlightError::Failed(ResumeError::crashed(
                "AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)",
            ))),
            503,
            "actor demo/p3 unavailable: AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)",
            false,
        );
        check(
            &Verdict::of(&Denial::LotFull(actor())),
            503,
            "actor demo/p3 unavailable: router at capacity",
            true,
        );
        check(
            &flight(FlightError::Failed(ResumeError::new(
                Code::DeadlineExceeded,
                "slow",
            ))),
            504,
            "actor demo/p3 request timed out",
            false,
        );
        check(
            &flight(FlightError::Failed(ResumeError::new(
                Code::PermissionDenied,
                "no",
            ))),
            403,
            "actor demo/p3 access denied",
            false,
        );
        check(
            &flight(FlightError::Failed(ResumeError::new(
                Code::Unauthenticated,
                "who",
            ))),
            401,
            "actor demo/p3 authentication required",
            false,
        );
        check(
            &Verdict::of(&Denial::CallerDeadline(actor())),
            504,
            "actor demo/p3 request timed out",
            false,
        );
        check(&Verdict::of(&Denial::CallerGone(actor())), 408, "", false);
        check(
            &Verdict::of(&Denial::TooManyHeaders {
                count: 101,
                limit: 100,
            }),
            431,
            "too many request header fields: 101 (limit 100)",
            false,
        );
        check(
            &Verdict::of(&Denial::HeadersTooLarge {
                bytes: 70000,
                limit: 65536,
            }),
            431,
            "request header fields too large: 70000 bytes (limit 65536)",
            false,
        );
        check(
            &Verdict::of(&Denial::MalformedBody(
                actor(),
                "invalid chunk size line".into(),
            )),
            400,
            "actor demo/p3: malformed request body: invalid chunk size line",
            false,
        );
        check(
            &Verdict::of(&Denial::WorkerUnreachable(actor())),
            502,
            "actor demo/p3 unreachable",
            false,
        );
        check(
            &Verdict::of(&Denial::ActorMoved(actor())),
            503,
            "actor demo/p3 unavailable: actor moved",
            true,
        );
        check(
            &Verdict::of(&Denial::ShuttingDown(actor())),
            503,
            "actor demo/p3 unavailable: router shutting down",
            true,
        );
        for e in [
            FlightError::Failed(ResumeError::new(Code::Internal, "db: secret detail")),
            FlightError::Failed(ResumeError::new(Code::InvalidArgument, "x")),
            FlightError::Failed(ResumeError::new(Code::Unknown, "x")),
            FlightError::Unroutable("no ip".into()),
            FlightError::Lost,
        ] {
            check(&flight(e), 500, "error resuming actor demo/p3", false);
        }
    }

    #[test]
    fn description_is_the_status_message_itself() {
        let e = ResumeError::from(tonic::Status::resource_exhausted(
            "no worker has room for the actor",
        ));
        let v = flight(FlightError::BudgetExhausted(e));
        assert!(!v.body().contains("rpc error"));
        assert!(!v.body().contains("code"));
        assert_eq!(
            v.body(),
            "actor demo/p3 unavailable: no worker has room for the actor"
        );
    }
}
