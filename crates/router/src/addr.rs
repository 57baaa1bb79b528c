//! Actor addressing: `<name>.<atespace>.<actor-domain>` hosts into [`ActorRef`]s.
//!
//! Parsed once at the edge; everything downstream holds the typed value.

use std::fmt;
use std::str::FromStr;

/// The longest host the router looks at (the DNS limit for a full name).
pub const MAX_HOST_LEN: usize = 253;
/// The longest DNS label.
pub const MAX_LABEL_LEN: usize = 63;

/// An actor's address: `atespace/name`, both DNS labels.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActorRef {
    atespace: String,
    name: String,
}

impl ActorRef {
    /// Builds a reference from its two labels.
    ///
    /// # Errors
    /// When either part is not a DNS label (see [`LabelError`]).
    pub fn new(atespace: &str, name: &str) -> Result<Self, LabelError> {
        check_label(atespace)?;
        check_label(name)?;
        Ok(Self {
            atespace: atespace.to_owned(),
            name: name.to_owned(),
        })
    }

    /// The atespace the actor lives in.
    pub fn atespace(&self) -> &str {
        &self.atespace
    }

    /// The actor's name, unique inside its atespace.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host that addresses this actor under `domain`.
    pub fn host(&self, domain: &ActorDomain) -> String {
        format!("{}.{}.{}", self.name, self.atespace, domain.0)
    }
}

impl fmt::Display for ActorRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.atespace, self.name)
    }
}

impl fmt::Debug for ActorRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ActorRef({self})")
    }
}

/// Parses `atespace/name`.
impl FromStr for ActorRef {
    type Err = LabelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (atespace, name) = s.split_once('/').ok_or(LabelError::NotARef)?;
        Self::new(atespace, name)
    }
}

/// Why a string is not a DNS label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    /// Zero characters.
    #[error("empty label")]
    Empty,
    /// More than [`MAX_LABEL_LEN`] characters.
    #[error("label {0:?} is longer than 63 characters")]
    TooLong(String),
    /// A character outside `a-z`, `0-9` and `-`.
    #[error("label {0:?} may only contain a-z, 0-9 and '-'")]
    BadChar(String),
    /// Starts or ends with `-`.
    #[error("label {0:?} must not start or end with '-'")]
    Hyphen(String),
    /// Not of the form `atespace/name`.
    #[error("want <atespace>/<name>")]
    NotARef,
}

fn check_label(label: &str) -> Result<(), LabelError> {
    if label.is_empty() {
        return Err(LabelError::Empty);
    }
    if label.len() > MAX_LABEL_LEN {
        return Err(LabelError::TooLong(label.to_owned()));
    }
    if !label
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(LabelError::BadChar(label.to_owned()));
    }
    if label.starts_with('-') || label.ends_with('-') {
        return Err(LabelError::Hyphen(label.to_owned()));
    }
    Ok(())
}

/// The DNS suffix under which actors are addressed (`--actor-domain`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorDomain(String);

impl ActorDomain {
    /// The suffix, without a leading or trailing dot.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ActorDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses a domain of one or more DNS labels; one trailing dot is allowed and dropped.
impl FromStr for ActorDomain {
    type Err = LabelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
        for label in s.split('.') {
            check_label(label)?;
        }
        Ok(Self(s))
    }
}

/// A host that does not address an actor; renders as the 404 body of `parking.md`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid host {host:?}: {reason}")]
pub struct InvalidHost {
    host: String,
    reason: HostError,
}

impl InvalidHost {
    /// Why the host was refused.
    pub fn reason(&self) -> &HostError {
        &self.reason
    }
}

/// Why a host does not address an actor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// No host at all.
    #[error("empty host")]
    Empty,
    /// Longer than [`MAX_HOST_LEN`].
    #[error("host is longer than 253 characters")]
    TooLong,
    /// The part after the last `:` is not a port.
    #[error("bad port {0:?}")]
    BadPort(String),
    /// Not below the configured actor domain.
    #[error("not under the actor domain {0}")]
    OutsideDomain(String),
    /// Not exactly two labels before the actor domain.
    #[error("want <name>.<atespace>.{0}")]
    Shape(String),
    /// A `user:password@` part (RFC 9110, 4.2.4: an error in a request target).
    #[error("credentials (user@) are not part of a host")]
    UserInfo,
    /// A label breaks the DNS rules.
    #[error(transparent)]
    Label(#[from] LabelError),
}

/// Reads the actor a request is for from its host (`Host` or `:authority`).
///
/// Accepts an optional `:port` and one trailing dot; compares case-insensitively, as DNS
/// does.
///
/// # Errors
/// [`InvalidHost`] when the host is not `<name>.<atespace>.<domain>`.
pub fn parse_host(host: &str, domain: &ActorDomain) -> Result<ActorRef, InvalidHost> {
    // Refused, and never repeated: the error shows the host without them.
    if host.contains('@') {
        return Err(InvalidHost {
            host: truncate_for_display(without_userinfo(host)),
            reason: HostError::UserInfo,
        });
    }
    parse_host_inner(host, domain).map_err(|reason| InvalidHost {
        host: truncate_for_display(host),
        reason,
    })
}

fn parse_host_inner(host: &str, domain: &ActorDomain) -> Result<ActorRef, HostError> {
    if host.is_empty() {
        return Err(HostError::Empty);
    }
    // A port and a trailing dot add at most 7 characters to a full-length name.
    if host.len() > MAX_HOST_LEN + 7 {
        return Err(HostError::TooLong);
    }
    let name_part = match host.rsplit_once(':') {
        Some((name, port)) => {
            if port.is_empty() || port.len() > 5 || port.parse::<u16>().is_err() {
                return Err(HostError::BadPort(port.to_owned()));
            }
            name
        }
        None => host,
    };
    let name_part = name_part.strip_suffix('.').unwrap_or(name_part);
    if name_part.len() > MAX_HOST_LEN {
        return Err(HostError::TooLong);
    }
    let lower = name_part.to_ascii_lowercase();
    let prefix = lower
        .strip_suffix(domain.as_str())
        .and_then(|p| p.strip_suffix('.'))
        .ok_or_else(|| HostError::OutsideDomain(domain.to_string()))?;
    let (name, atespace) = prefix
        .split_once('.')
        .filter(|(_, atespace)| !atespace.contains('.'))
        .ok_or_else(|| HostError::Shape(domain.to_string()))?;
    Ok(ActorRef::new(atespace, name)?)
}

/// Hosts come from clients; keep what we echo back bounded.
/// `host` without a `user:password@` part, for display: an absolute-form request URI
/// may carry one (RFC 9110, 4.2.4: an error, never to be shown or logged), and a client
/// may put one in `Host`.
pub fn without_userinfo(host: &str) -> &str {
    host.rsplit_once('@').map_or(host, |(_, rest)| rest)
}

fn truncate_for_display(host: &str) -> String {
    const MAX_ECHO: usize = 300;
    if host.len() <= MAX_ECHO {
        return host.to_owned();
    }
    let mut end = MAX_ECHO;
    while !host.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &host[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain() -> ActorDomain {
        "actors.resources.substrate.ate.dev".parse().unwrap()
    }

    #[test]
    fn parses_name_then_atespace() {
        let a = parse_host("p1.demo.actors.resources.substrate.ate.dev", &domain()).unwrap();
        assert_eq!(a.atespace(), "demo");
        assert_eq!(a.name(), "p1");
        assert_eq!(a.to_string(), "demo/p1");
    }

    #[test]
    fn accepts_port_trailing_dot_and_case() {
        for host in [
            "p1.demo.actors.resources.substrate.ate.dev:8080",
            "p1.demo.actors.resources.substrate.ate.dev.",
            "p1.demo.actors.resources.substrate.ate.dev.:80",
            "P1.Demo.Actors.Resources.Substrate.Ate.Dev",
        ] {
            let a = parse_host(host, &domain()).unwrap_or_else(|e| panic!("{host}: {e}"));
            assert_eq!(a.to_string(), "demo/p1", "{host}");
        }
    }

    #[test]
    fn refuses_with_exact_texts() {
        let cases = [
            ("", "invalid host \"\": empty host"),
            (
                "p1.demo.example.com",
                "invalid host \"p1.demo.example.com\": not under the actor domain actors.resources.substrate.ate.dev",
            ),
            (
                "p1.actors.resources.substrate.ate.dev",
                "invalid host \"p1.actors.resources.substrate.ate.dev\": want <name>.<atespace>.actors.resources.substrate.ate.dev",
            ),
            (
                "a.b.c.actors.resources.substrate.ate.dev",
                "invalid host \"a.b.c.actors.resources.substrate.ate.dev\": want <name>.<atespace>.actors.resources.substrate.ate.dev",
            ),
            (
                "p_1.demo.actors.resources.substrate.ate.dev",
                "invalid host \"p_1.demo.actors.resources.substrate.ate.dev\": label \"p_1\" may only contain a-z, 0-9 and '-'",
            ),
            (
                "-p.demo.actors.resources.substrate.ate.dev",
                "invalid host \"-p.demo.actors.resources.substrate.ate.dev\": label \"-p\" must not start or end with '-'",
            ),
            (
                "p1..actors.resources.substrate.ate.dev",
                "invalid host \"p1..actors.resources.substrate.ate.dev\": empty label",
            ),
            (
                "p1.demo.actors.resources.substrate.ate.dev:http",
                "invalid host \"p1.demo.actors.resources.substrate.ate.dev:http\": bad port \"http\"",
            ),
            (
                "p1.demo.actors.resources.substrate.ate.dev:",
                "invalid host \"p1.demo.actors.resources.substrate.ate.dev:\": bad port \"\"",
            ),
            (
                "[::1]:80",
                "invalid host \"[::1]:80\": not under the actor domain actors.resources.substrate.ate.dev",
            ),
        ];
        for (host, want) in cases {
            let err = parse_host(host, &domain()).unwrap_err();
            assert_eq!(err.to_string(), want);
        }
    }

    #[test]
    fn label_length_limit() {
        let ok = "a".repeat(63);
        let long = "a".repeat(64);
        assert!(parse_host(&format!("{ok}.demo.{}", domain()), &domain()).is_ok());
        let err = parse_host(&format!("{long}.demo.{}", domain()), &domain()).unwrap_err();
        assert!(matches!(
            err.reason(),
            HostError::Label(LabelError::TooLong(_))
        ));
        let huge = format!("{}.{}", "a.".repeat(200), domain());
        assert_eq!(
            parse_host(&huge, &domain()).unwrap_err().reason(),
            &HostError::TooLong
        );
    }

    #[test]
    fn echoed_host_is_bounded() {
        let huge = "x".repeat(10_000);
        let err = parse_host(&huge, &domain()).unwrap_err();
        assert!(err.to_string().len() < 400);
    }

    #[test]
    fn actor_ref_round_trips() {
        let a: ActorRef = "demo/p1".parse().unwrap();
        assert_eq!(
            a.host(&domain()),
            "p1.demo.actors.resources.substrate.ate.dev"
        );
        assert_eq!(parse_host(&a.host(&domain()), &domain()).unwrap(), a);
        assert_eq!("demo".parse::<ActorRef>(), Err(LabelError::NotARef));
        assert!("Demo/p1".parse::<ActorRef>().is_err());
    }

    #[test]
    fn domain_parsing() {
        let d: ActorDomain = "Example.COM.".parse().unwrap();
        assert_eq!(d.as_str(), "example.com");
        assert!("".parse::<ActorDomain>().is_err());
        assert!("a..b".parse::<ActorDomain>().is_err());
    }
}
