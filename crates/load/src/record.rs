//! One record per request, and their CSV form.

use std::io::Write;
use std::time::Duration;

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Which part of a run it belongs to (a scenario phase, or `load`).
    pub label: String,
    /// The actor it addressed (`atespace/name`).
    pub actor: String,
    /// When it left, from the start of the run.
    pub start: Duration,
    /// When its answer was complete, from the start of the run.
    pub end: Duration,
    /// The HTTP status; 0 when no answer came (connection error).
    pub status: u16,
    /// The first characters of the body (or of the error).
    pub body: String,
}

/// How much of each body a record keeps.
pub const BODY_PREFIX: usize = 100;

impl Record {
    /// The request's latency.
    pub fn latency(&self) -> Duration {
        self.end.saturating_sub(self.start)
    }

    /// Keeps the first [`BODY_PREFIX`] characters of `body`, on one line.
    pub fn prefix(body: &str) -> String {
        body.chars()
            .take(BODY_PREFIX)
            .collect::<String>()
            .replace(['\n', '\r'], " ")
            .trim_end()
            .to_owned()
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// Writes records as CSV: `label,actor,start_s,end_s,latency_s,status,body`.
///
/// # Errors
/// The writer's.
pub fn write_csv(records: &[Record], mut w: impl Write) -> std::io::Result<()> {
    writeln!(w, "label,actor,start_s,end_s,latency_s,status,body")?;
    for r in records {
        writeln!(
            w,
            "{},{},{:.6},{:.6},{:.6},{},{}",
            csv_field(&r.label),
            csv_field(&r.actor),
            r.start.as_secs_f64(),
            r.end.as_secs_f64(),
            r.latency().as_secs_f64(),
            r.status,
            csv_field(&r.body)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_what_needs_it() {
        let r = Record {
            label: "t".into(),
            actor: "demo/p1".into(),
            start: Duration::from_millis(1500),
            end: Duration::from_millis(2000),
            status: 503,
            body: Record::prefix("actor demo/p1 unavailable: a, \"b\"\n"),
        };
        let mut out = Vec::new();
        write_csv(&[r], &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "label,actor,start_s,end_s,latency_s,status,body\nt,demo/p1,1.500000,2.000000,0.500000,503,\"actor demo/p1 unavailable: a, \"\"b\"\"\"\n"
        );
    }

    #[test]
    fn prefix_is_bounded() {
        assert_eq!(Record::prefix(&"x".repeat(500)).len(), BODY_PREFIX);
    }
}
