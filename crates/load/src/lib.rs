//! valet's load tool: an HTTP load generator (open and closed loop), per-request
//! records, summaries, CSV and SVG charts, and the seed's experiments as scenarios.
//!
//! ```text
//! gen (schedule → requests) ─▶ Record per request ─▶ stats (summaries) ─▶ CSV, chart (SVG)
//! scenario: system (embedded control plane + workers + router, a cluster of processes,
//!           or given URLs) + gen
//! ```

#![forbid(unsafe_code)]

pub mod chart;
pub mod extproc;
pub mod generate;
pub mod nginx;
pub mod outage;
pub mod parked;
pub mod processes;
pub mod record;
pub mod scenario;
pub mod soak;
pub mod stats;
pub mod system;

pub use record::Record;
pub use stats::Summary;
