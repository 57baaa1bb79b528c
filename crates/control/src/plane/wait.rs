//! How long a resume's activation may wait for capacity: a value its callers share.

/// How long a resume's activation may wait for capacity, shared by its callers: the
/// latest of the deadlines of the callers that wait, so a caller that joins keeps
/// the activation's place in its pool's queue for as long as it waits itself.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CapacityWait {
    /// `None`: no caller waits (the activation takes a free worker or is refused).
    pub(crate) until: Option<tokio::time::Instant>,
    /// In its pool's queue now: a caller past its own deadline leaves with
    /// `ResourceExhausted`.
    pub(crate) queued: bool,
    /// The call that started the activation left so: the first joined call answered
    /// with its outcome says it did the activation (`resumed`), so exactly one does.
    pub(crate) handed_over: bool,
}

impl CapacityWait {
    /// Waits until `deadline` at least.
    pub(crate) fn extend(&mut self, deadline: tokio::time::Instant) {
        self.until = Some(self.until.map_or(deadline, |u| u.max(deadline)));
    }
}
