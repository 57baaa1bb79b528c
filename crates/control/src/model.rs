//! Names, templates and the protobuf views of the control plane's records.

use std::fmt;

use tonic::Status;
use tonic_types::{ErrorDetails, StatusExt};
use valet_proto::ateapi;
use valet_proto::ateapi::actor::Status as WireStatus;

/// The `ErrorInfo.reason` of a crashed actor.
pub const ACTOR_CRASHED: &str = "ACTOR_CRASHED";
/// The `ErrorInfo.domain` of this control plane's errors.
pub const ERROR_DOMAIN: &str = "ateapi";
/// The namespace reported for workers and templates.
pub const NAMESPACE: &str = "valet";

/// An actor's identity: `(atespace, name)`. Every lock and lookup uses both.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActorKey {
    atespace: String,
    name: String,
}

impl ActorKey {
    /// Validates both parts as names.
    ///
    /// # Errors
    /// `InvalidArgument` naming the bad part.
    pub fn new(atespace: &str, name: &str) -> Result<Self, Status> {
        check_name("atespace", atespace)?;
        check_name("name", name)?;
        Ok(Self {
            atespace: atespace.to_owned(),
            name: name.to_owned(),
        })
    }

    /// From a request's `actor_ref`.
    ///
    /// # Errors
    /// `InvalidArgument` when missing or invalid.
    pub fn from_ref(r: Option<&ateapi::ActorRef>) -> Result<Self, Status> {
        let r = r.ok_or_else(|| Status::invalid_argument("actor_ref is required"))?;
        Self::new(&r.atespace, &r.name)
    }

    pub fn atespace(&self) -> &str {
        &self.atespace
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for ActorKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.atespace, self.name)
    }
}

/// Names of atespaces, actors and pools: DNS labels (1–63 of `a-z0-9-`, no `-` at the
/// ends), so every actor is addressable by host.
///
/// # Errors
/// `InvalidArgument` naming `what`, the value and the rule.
pub fn check_name(what: &str, value: &str) -> Result<(), Status> {
    let rule = valet_template::LABEL_RULE;
    if valet_template::is_label(value) {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "{what} {:?} {rule}",
            shown(value)
        )))
    }
}

/// The longest crash reason kept on an actor's record.
pub const REASON_MAX: usize = 4096;

/// `reason` cut to at most [`REASON_MAX`] bytes (at a character boundary, keeping its
/// end, where a program's last words are).
pub fn bounded_reason(reason: &str) -> String {
    if reason.len() <= REASON_MAX {
        return reason.to_owned();
    }
    let mut from = reason.len() - (REASON_MAX - 3);
    while !reason.is_char_boundary(from) {
        from += 1;
    }
    format!("…{}", &reason[from..])
}

/// A client's value as an error message may repeat it: at most 64 characters, so that
/// no answer grows with what a client sent.
pub(crate) fn shown(value: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 64;
    match value.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &value[..cut]).into(),
        None => value.into(),
    }
}

pub use valet_template::Template;

/// An actor's status as the plane keeps it. The number (`ateapi.Actor.Status`) exists
/// only on the wire and in the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActorStatus {
    /// Being restored on a worker claimed for it.
    Resuming,
    /// Serving on its worker.
    Running,
    /// Being checkpointed on its worker.
    Suspending,
    /// In its last snapshot, on no worker.
    Suspended,
    /// A restore or checkpoint failed; only a revert brings it back.
    Crashed,
}

impl ActorStatus {
    /// The wire and database number.
    pub fn wire(self) -> i32 {
        self.proto() as i32
    }

    /// From the wire and database number; `None` for one this plane never writes.
    pub fn from_wire(value: i32) -> Option<Self> {
        match WireStatus::try_from(value).ok()? {
            WireStatus::Resuming => Some(Self::Resuming),
            WireStatus::Running => Some(Self::Running),
            WireStatus::Suspending => Some(Self::Suspending),
            WireStatus::Suspended => Some(Self::Suspended),
            WireStatus::Crashed => Some(Self::Crashed),
            _ => None,
        }
    }

    fn proto(self) -> WireStatus {
        match self {
            Self::Resuming => WireStatus::Resuming,
            Self::Running => WireStatus::Running,
            Self::Suspending => WireStatus::Suspending,
            Self::Suspended => WireStatus::Suspended,
            Self::Crashed => WireStatus::Crashed,
        }
    }

    /// `STATUS_RUNNING` and so on, as upstream names them in messages.
    pub fn name(self) -> &'static str {
        self.proto().as_str_name()
    }

    /// Whether an operation left the actor half-way (a failed write, or a crash): the
    /// next operation settles it first.
    pub fn is_transitional(self) -> bool {
        matches!(self, Self::Resuming | Self::Suspending)
    }
}

impl fmt::Display for ActorStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub fn not_found(key: &ActorKey) -> Status {
    Status::not_found(format!("actor {key} not found"))
}

pub fn aborted() -> Status {
    Status::aborted("another operation is in progress for this actor")
}

pub fn no_room() -> Status {
    Status::resource_exhausted("no worker has room for the actor")
}

pub fn crashed() -> Status {
    Status::with_error_details(
        tonic::Code::FailedPrecondition,
        "AssignWorker prerequisite not met (got STATUS_CRASHED, want SUSPENDED or PAUSED)",
        ErrorDetails::with_error_info(ACTOR_CRASHED, ERROR_DOMAIN, []),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(ActorKey::new("demo", "p1").is_ok());
        for (a, n) in [
            ("", "p1"),
            ("demo", ""),
            ("Demo", "p1"),
            ("demo", "p_1"),
            ("-d", "p"),
        ] {
            let e = ActorKey::new(a, n).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{a}/{n}");
        }
        assert!(ActorKey::new(&"a".repeat(64), "p").is_err());
    }

    #[test]
    fn statuses_round_trip_the_wire() {
        for s in [
            ActorStatus::Resuming,
            ActorStatus::Running,
            ActorStatus::Suspending,
            ActorStatus::Suspended,
            ActorStatus::Crashed,
        ] {
            assert_eq!(ActorStatus::from_wire(s.wire()), Some(s));
        }
        assert_eq!(ActorStatus::Crashed.wire(), 1001);
        assert_eq!(ActorStatus::Running.name(), "STATUS_RUNNING");
        assert_eq!(ActorStatus::from_wire(0), None);
        assert_eq!(
            ActorStatus::from_wire(5),
            None,
            "PAUSING is never written here"
        );
    }
}
