//! valet's reference control plane: `ateapi.Control` on one machine.
//!
//! ```text
//! gRPC (grpc) ─▶ Plane (plane: state machine, locks, capacity queues) ─▶ Store (SQLite)
//!                   │ commands over each worker's Attach stream (link)
//!                   ▼
//!              reference workers (valet-worker)
//! ```
//!
//! The contract is `../shared/spec/control-plane.md`.

#![forbid(unsafe_code)]

pub mod grpc;
mod link;
pub mod model;
pub mod plane;
pub mod store;

pub use grpc::serve;
pub use model::{ActorKey, Template};
pub use plane::{Plane, PlaneConfig, StatsSnapshot};
pub use store::Store;
