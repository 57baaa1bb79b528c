//! valet's load tool: an HTTP load generator (open and closed loop), per-request
//! records, summaries, CSV and SVG charts, and the seed's experiments as scenarios.
//!
//! ```text
//! gen (schedule → requests) ─▶ Record per request ─▶ stats (summaries) ─▶ CSV, chart (SVG)
//! scenario: system (embedded control plane + workers + router, a set of processes,
//!           or given URLs) + gen
//! ```

#![forbid(unsafe_code)]

/// `progress!` for progress lines that never panics: a closed stderr (the reader of
/// `valet load … 2>&1 | tee` gone) must not end a run and lose its results.
macro_rules! progress {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

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
