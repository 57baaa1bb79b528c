//! valet's request-parking router: the decision pipeline, with no sockets.
//!
//! ```text
//! host ─ addr ─▶ ActorRef ─ flight ─▶ one ResumeActor loop per actor (retry)
//!                               │ first retryable answer: the flight parks
//!                               ▼
//!          callers wait; once parked each holds a lot slot (or is shed)
//!                               ▼
//!              Route(worker addr)  or  Verdict (status, body, Retry-After)
//! ```
//!
//! Data planes (the built-in HTTP proxy, the Envoy ext_proc server) call
//! [`Router::decide`] and render its [`Decision`]; they never decide a status.
//! The contract is `../shared/spec/parking.md`.

#![forbid(unsafe_code)]

pub mod addr;
pub mod config;
pub mod control;
mod flight;
pub mod lease;
pub mod lot;
pub mod metrics;
mod pipeline;
mod retry;
pub mod status;
pub mod verdict;

#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use addr::{ActorDomain, ActorRef, InvalidHost};
pub use config::{ConfigError, ParkingConfig, RouterArgs, RouterConfig};
pub use control::{ControlPlane, Grant, GrpcControlPlane, ResumeError, ResumeRequest, Resumed};
pub use flight::{FlightError, FlightResult};
pub use metrics::{Metrics, ParkOutcome};
pub use pipeline::{Decision, Route, Router};
pub use verdict::{CallerEnd, Denial, Verdict};
