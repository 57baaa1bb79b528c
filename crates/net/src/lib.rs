//! What every valet server and retry loop shares, written once:
//!
//! - [`Listener`]: accepts TCP connections within a [`Budget`] (a connection holds its
//!   place until it closes), sets the socket options every server wants, backs off when
//!   `accept` fails (out of descriptors, say) instead of spinning, and ends on a stop;
//! - [`Connections`]: owns the task of every connection a server accepted, and drains
//!   them on shutdown (a grace to finish, then closed);
//! - [`FirstBytes`]: a deadline for a connection's first bytes (an HTTP/2 preface);
//! - [`Backoff`]: the waits between tries of every retry loop (initial, factor, cap,
//!   jitter, cancellation).

#![forbid(unsafe_code)]

mod backoff;
mod listener;

pub use backoff::Backoff;
pub use listener::{Accepted, Budget, Connections, FirstBytes, Keepalive, Listener, Place};
