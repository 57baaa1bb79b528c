//! valet's Envoy data plane: an `envoy.service.ext_proc.v3.ExternalProcessor` server
//! over the same pipeline as the built-in HTTP data plane, and the Envoy bootstrap
//! that wires Envoy to it.
//!
//! ```text
//! Envoy ── one ext_proc stream per HTTP request ──▶ request_headers ─▶ Router::decide
//!   ◀── HeadersResponse (:authority = worker, x-actor-ref; raw_value)   on a route
//!   ◀── ImmediateResponse (status, body, content-type, Retry-After)     on a verdict
//! ```
//!
//! Nothing is sent while a request is parked; a stream that ends meanwhile is a caller
//! that went away.

#![forbid(unsafe_code)]

pub mod bootstrap;
mod server;
mod yaml;

pub use server::{ExtProcServer, HOST_HEADERS};
