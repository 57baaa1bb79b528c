//! A program's output: each line of its stdout and stderr goes to the worker's log,
//! tagged with the actor, and to the actor's bounded output file (its last
//! [`OUTPUT_KEEP`] bytes), which `valet ctl actor logs` prints. The file lives beside
//! the actor's snapshots, so any worker sharing them can read it.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncRead, AsyncReadExt};

/// How much of an actor's output is kept.
pub(crate) const OUTPUT_KEEP: usize = 64 * 1024;
/// The longest line kept whole; a longer one is cut there.
pub(crate) const LINE_MAX: usize = 4096;
/// The output file's name in the actor's snapshot directory.
pub(crate) const OUTPUT_FILE: &str = "output.log";

/// Which stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn tag(self) -> &'static str {
        match self {
            Stream::Stdout => "out",
            Stream::Stderr => "err",
        }
    }
}

/// One actor's output.
#[derive(Debug)]
pub(crate) struct Output {
    actor: String,
    file: PathBuf,
    kept: Mutex<VecDeque<u8>>,
    dirty: AtomicBool,
}

impl Output {
    /// The output of `actor`, kept in `file`, starting from what the file holds.
    pub(crate) fn open(actor: &str, file: PathBuf) -> Self {
        let mut kept = VecDeque::new();
        if let Ok(old) = std::fs::read(&file) {
            let from = old.len().saturating_sub(OUTPUT_KEEP);
            kept.extend(&old[from..]);
        }
        Self {
            actor: actor.to_owned(),
            file,
            kept: Mutex::new(kept),
            dirty: AtomicBool::new(false),
        }
    }

    /// Records one line (without its newline).
    pub(crate) fn line(&self, stream: Stream, line: &[u8]) {
        let cut = line.len() > LINE_MAX;
        let text = String::from_utf8_lossy(&line[..line.len().min(LINE_MAX)]);
        let text = text.trim_end_matches('\r');
        tracing::info!(target: "valet::app", actor = %self.actor, stream = stream.tag(), "{text}{}", if cut { "…" } else { "" });
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.extend(format!("[{}] {text}{}\n", stream.tag(), if cut { "…" } else { "" }).bytes());
        let over = kept.len().saturating_sub(OUTPUT_KEEP);
        kept.drain(..over);
        self.dirty.store(true, Ordering::Release);
    }

    /// A line of the worker's own about the program (its start, its exit).
    pub(crate) fn note(&self, text: &str) {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.extend(format!("[valet] {text}\n").bytes());
        let over = kept.len().saturating_sub(OUTPUT_KEEP);
        kept.drain(..over);
        self.dirty.store(true, Ordering::Release);
    }

    /// Everything kept.
    pub(crate) fn contents(&self) -> Vec<u8> {
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.iter().copied().collect()
    }

    /// The last `n` lines of the program's own output (not the worker's notes).
    pub(crate) fn tail(&self, n: usize) -> String {
        let all = self.contents();
        let text = String::from_utf8_lossy(&all);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with("[valet] "))
            .collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Writes what is kept to the output file if it changed since the last write. Off
    /// the runtime: the file may be on a network volume.
    pub(crate) async fn flush(self: &std::sync::Arc<Self>) {
        if !self.dirty.swap(false, Ordering::AcqRel) {
            return;
        }
        let me = std::sync::Arc::clone(self);
        let written = tokio::task::spawn_blocking(move || {
            let content = me.contents();
            crate::app::write_atomically(&me.file, &content)
        })
        .await;
        if let Ok(Err(e)) = written {
            tracing::debug!(actor = %self.actor, file = %self.file.display(), error = %e, "could not write the actor's output file");
        }
    }
}

/// Reads the output file of an actor that is not hosted here.
pub(crate) fn read_file(dir: &Path) -> std::io::Result<Vec<u8>> {
    match std::fs::read(dir.join(OUTPUT_FILE)) {
        Ok(b) => Ok(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Reads `from` to its end, a line at a time (a line longer than [`LINE_MAX`] is cut
/// there, the rest of it dropped), into `output`.
pub(crate) async fn pump(mut from: impl AsyncRead + Unpin, stream: Stream, output: &Output) {
    let mut buf = vec![0u8; 8192];
    let mut line: Vec<u8> = Vec::new();
    let mut dropping = false;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for chunk in buf[..n].split_inclusive(|&b| b == b'\n') {
            let ends = chunk.last() == Some(&b'\n');
            let body = if ends {
                &chunk[..chunk.len() - 1]
            } else {
                chunk
            };
            if !dropping {
                let room = (LINE_MAX + 1).saturating_sub(line.len());
                line.extend_from_slice(&body[..body.len().min(room)]);
                if line.len() > LINE_MAX {
                    output.line(stream, &line);
                    line.clear();
                    dropping = true;
                }
            }
            if ends {
                if !dropping {
                    output.line(stream, &line);
                }
                line.clear();
                dropping = false;
            }
        }
    }
    if !line.is_empty() && !dropping {
        output.line(stream, &line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_kept_bounded_and_long_ones_cut() {
        let dir = tempfile::tempdir().unwrap();
        let out = std::sync::Arc::new(Output::open("demo/p1", dir.path().join(OUTPUT_FILE)));
        let long = vec![b'x'; LINE_MAX * 3];
        let mut input = b"first\r\nsecond\n".to_vec();
        input.extend_from_slice(&long);
        input.extend_from_slice(b"\nlast");
        pump(&input[..], Stream::Stderr, &out).await;
        let text = String::from_utf8(out.contents()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "[err] first");
        assert_eq!(lines[1], "[err] second");
        assert_eq!(lines[2].len(), "[err] ".len() + LINE_MAX + "…".len());
        assert_eq!(lines[3], "[err] last");
        assert_eq!(lines.len(), 4);
        assert_eq!(out.tail(2), format!("{}\n[err] last", lines[2]));

        for i in 0..10_000 {
            out.line(Stream::Stdout, format!("line {i}").as_bytes());
        }
        assert!(out.contents().len() <= OUTPUT_KEEP);
        out.flush().await;
        let again = Output::open("demo/p1", dir.path().join(OUTPUT_FILE));
        assert_eq!(
            again.contents(),
            out.contents(),
            "the file holds what is kept"
        );
        assert!(again.tail(1).ends_with("line 9999"));
    }
}
