//! One record per request, and their CSV form.

use std::io::Write;
use std::path::Path;
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

/// Writes a results file whole or not at all: into a temporary file beside `path`,
/// flushed and synced, then renamed over it. A full disk or a crash leaves the last
/// complete file (or none), never a cut one, and the error names the file.
///
/// # Errors
/// When the directory, the temporary file, a write, the sync or the rename fails.
pub fn write_file_atomically(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), String> {
    let named = |e: std::io::Error| format!("{}: {e}", path.display());
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let tmp = tempfile::NamedTempFile::new_in(dir).map_err(named)?;
    let mut w = std::io::BufWriter::new(tmp);
    write(&mut w).map_err(named)?;
    let tmp = w.into_inner().map_err(|e| named(e.into_error()))?;
    // Results are for reading (a temporary file is made owner-only).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(named)?;
    }
    tmp.as_file().sync_all().map_err(named)?;
    tmp.persist(path).map_err(|e| named(e.error))?;
    Ok(())
}

/// Writes `records` as CSV to `path` (see [`write_file_atomically`]).
///
/// # Errors
/// When the file cannot be written whole.
pub fn write_csv_file(path: &Path, records: &[Record]) -> Result<(), String> {
    write_file_atomically(path, |w| write_csv(records, w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_keeps_the_last_complete_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results").join("run.csv");
        let one = Record {
            label: "t".into(),
            actor: "demo/p1".into(),
            start: Duration::ZERO,
            end: Duration::from_millis(5),
            status: 200,
            body: String::new(),
        };
        write_csv_file(&path, std::slice::from_ref(&one)).unwrap();
        let complete = std::fs::read_to_string(&path).unwrap();
        assert_eq!(complete.lines().count(), 2, "{complete}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o644, "results are readable by others");
        }

        let err = write_file_atomically(&path, |w| {
            w.write_all(&[b'x'; 20_000])?;
            Err(std::io::Error::other("disk full"))
        })
        .unwrap_err();
        assert!(
            err.contains("run.csv") && err.contains("disk full"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), complete);
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            [std::ffi::OsString::from("run.csv")],
            "no temporary file stays"
        );
    }

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
