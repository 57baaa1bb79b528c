//! valet's reference control plane: `ateapi.Control` on one machine.
//!
//! ```text
//! gRPC (grpc) ─▶ Plane: catalog · lifecycle · capacity · membership ─▶ Store (SQLite or PostgreSQL)
//!                   │ one Op per operation; each step: durable write → memory →
//!                   │ release → hand a freed worker to the oldest waiter
//!                   │ commands over each worker's Attach stream (link)
//!                   ▼
//!              reference workers (valet-worker)
//! ```
//!
//! The contract is `../shared/spec/control-plane.md`.

#![forbid(unsafe_code)]

pub mod admin;
pub mod auth;
pub mod grpc;
mod link;
mod metrics;
pub mod model;
pub mod plane;
pub mod postgres;
pub mod replica_store;
pub mod standby;
pub mod store;
#[cfg(any(test, feature = "tempdb"))]
pub mod tempdb;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use grpc::serve;
pub use model::{ActorKey, ActorStatus, Template};
pub use plane::{Plane, PlaneConfig, StatsSnapshot};
pub use postgres::PostgresStore;
pub use replica_store::ReplicaStore;
pub use store::{SqliteStore, Store};
