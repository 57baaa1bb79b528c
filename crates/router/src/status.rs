//! What `/statusz` shows: the last routed requests, kept without secrets.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// How many recent requests are kept.
pub const RECENT_REQUESTS: usize = 100;
/// Longest host or path kept in a record.
const MAX_FIELD: usize = 200;

/// One decided request, as the status page lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRecord {
    /// When it was decided.
    pub at: SystemTime,
    /// Which data plane decided it (`http`, `extproc`).
    pub data_plane: &'static str,
    /// The host it addressed (truncated).
    pub host: String,
    /// Its path, query string stripped (truncated).
    pub path: String,
    /// The decision's status (200 for a route).
    pub status: u16,
    /// The verdict's name (`routed`, `unavailable`, ...).
    pub verdict: &'static str,
    /// The worker it was routed to.
    pub target: Option<SocketAddr>,
    /// How long the decision took.
    pub took: Duration,
}

impl RouteRecord {
    /// A record with the host and path cleaned: the host's `user:password@` part and
    /// the path's query string (either may carry credentials) are dropped, and both
    /// are bounded.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        data_plane: &'static str,
        host: &str,
        path_and_query: &str,
        status: u16,
        verdict: &'static str,
        target: Option<SocketAddr>,
        took: Duration,
    ) -> Self {
        Self {
            at: SystemTime::now(),
            data_plane,
            host: bounded(crate::addr::without_userinfo(host)),
            path: bounded(redact_path(path_and_query)),
            status,
            verdict,
            target,
            took,
        }
    }
}

/// The path without its query string or fragment.
pub fn redact_path(path_and_query: &str) -> &str {
    let end = path_and_query
        .find(['?', '#'])
        .unwrap_or(path_and_query.len());
    &path_and_query[..end]
}

fn bounded(s: &str) -> String {
    if s.len() <= MAX_FIELD {
        return s.to_owned();
    }
    let mut end = MAX_FIELD;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// The last [`RECENT_REQUESTS`] records, newest last.
#[derive(Debug, Default)]
pub struct RecentRequests {
    ring: Mutex<VecDeque<RouteRecord>>,
}

impl RecentRequests {
    /// Keeps `record`, dropping the oldest beyond the limit.
    pub fn push(&self, record: RouteRecord) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECENT_REQUESTS {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    /// A copy, newest first.
    pub fn newest_first(&self) -> Vec<RouteRecord> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_are_stripped() {
        assert_eq!(redact_path("/a/b?token=secret"), "/a/b");
        assert_eq!(redact_path("/a#frag"), "/a");
        assert_eq!(redact_path("/plain"), "/plain");
        let r = RouteRecord::new(
            "http",
            "h",
            "/x?password=p",
            200,
            "routed",
            None,
            Duration::ZERO,
        );
        assert_eq!(r.path, "/x");
    }

    #[test]
    fn keeps_the_last_hundred() {
        let recent = RecentRequests::default();
        for i in 0..150 {
            recent.push(RouteRecord::new(
                "http",
                "h",
                &format!("/{i}"),
                200,
                "routed",
                None,
                Duration::ZERO,
            ));
        }
        let all = recent.newest_first();
        assert_eq!(all.len(), 100);
        assert_eq!(all[0].path, "/149");
        assert_eq!(all[99].path, "/50");
    }
}
