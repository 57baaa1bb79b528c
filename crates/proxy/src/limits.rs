//! The data plane's explicit input limits.

use std::time::Duration;

/// Explicit input limits of the data plane.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most request header fields.
    pub max_headers: usize,
    /// Most bytes of request header names and values together.
    pub max_header_bytes: usize,
    /// Longest a connection may wait without a request: for its TLS handshake and
    /// first request head, for the next head after an answer, and over HTTP/2 while
    /// it has no request open. Then it is closed (HTTP/2: GOAWAY). Over HTTP/2 it is
    /// also the interval of keep-alive pings (each may go unanswered 20 s).
    pub idle_timeout: Duration,
    /// Longest a small request body (read whole, so a 421 can replay it) may take to
    /// arrive in all, however steadily it trickles.
    pub small_body_within: Duration,
    /// Most client connections one listener serves at once: past it none is accepted
    /// (they wait in the listen backlog) until one closes, so that a flood of them
    /// cannot take every file descriptor the router needs for its workers and its
    /// control plane. (A connection upgraded to a tunnel no longer counts.)
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_headers: 100,
            max_header_bytes: 64 * 1024,
            idle_timeout: Duration::from_secs(30),
            small_body_within: Duration::from_secs(120),
            max_connections: valet_net::Budget::half_the_file_limit().size(),
        }
    }
}
