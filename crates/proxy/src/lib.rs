//! valet's built-in HTTP data plane (hyper): request in → pipeline → forward to the
//! actor's worker, or render the pipeline's verdict.
//!
//! ```text
//! client ──HTTP/1.1 or h2c──▶ limits ─▶ Router::decide_holding ─┬─▶ forward (held bytes, then
//!                  (body held, bounded, while parked) ◀───┘      │   the rest streamed; upgrades
//!                                                                │   spliced) ─▶ worker
//!                                                                └─▶ verdict (status, body, Retry-After)
//! ```
//!
//! A request without a body (the first on a plaintext HTTP/1.1 connection, or the next
//! after a verdict) is decided before hyper reads it (`lean`): when it parks it holds
//! its head and its wait, not an HTTP/1 connection's buffers. A client that goes away
//! while its request is parked is noticed, body or not (its body is read into memory,
//! bounded, while it waits; without one, the socket reads end of file): the parking
//! slot is freed at once and `canceled` recorded. Every status the data plane answers
//! itself is a verdict of the pipeline's verdict module.

#![forbid(unsafe_code)]

mod answer;
mod body;
mod forward;
mod lean;
mod limits;
mod server;
pub mod tls;

pub use limits::Limits;
pub use server::HttpServer;
