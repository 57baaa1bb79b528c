//! valet's built-in HTTP data plane (hyper): request in → pipeline → forward to the
//! actor's worker, or render the pipeline's verdict.
//!
//! ```text
//! client ──HTTP/1.1 or h2c──▶ limits ─▶ Router::decide_request ─┬─▶ forward (bodies streamed,
//!                                                              │   upgrades spliced) ─▶ worker
//!                                                              └─▶ verdict (status, body, Retry-After)
//! ```
//!
//! A client that goes away while its request is parked drops the decision future: the
//! parking slot is freed at once and `canceled` recorded.

#![forbid(unsafe_code)]

mod forward;
mod server;

pub use server::{HttpServer, Limits};
