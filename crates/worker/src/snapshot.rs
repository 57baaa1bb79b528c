//! A program's snapshots: its data directory as a zstd-compressed tar archive, named
//! by the SHA-256 of its bytes (the snapshot's id), in `<actor's snapshot dir>/program/`.
//!
//! A checkpoint writes the archive under a temporary name, syncs it, renames it to
//! `<id>.tar.zst` and syncs the directory: only then is the id returned (and the
//! control plane records it). `index` names the newest two ids; older archives are
//! removed. A restore unpacks the archive its control plane names into a directory
//! beside the target, checks the archive's SHA-256 against the id over every byte,
//! and only then puts it in place: a missing or damaged snapshot fails the restore,
//! never starts the app on an empty directory.

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The directory of a program's snapshots inside the actor's snapshot directory.
pub(crate) const PROGRAM_DIR: &str = "program";
/// The zstd level: `zstd`'s own default.
const LEVEL: i32 = 3;

/// Why a snapshot could not be taken or restored.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SnapshotError {
    #[error(
        "its data directory holds {bytes} bytes, over --snapshot-max-bytes {max} ({} over)",
        bytes - max
    )]
    TooLarge { bytes: u64, max: u64 },
    #[error("snapshot {id} is missing ({}): the app is not started on an empty directory in its place", path.display())]
    Missing { id: String, path: PathBuf },
    #[error("snapshot {id} is damaged ({}): {why}", path.display())]
    Corrupt {
        id: String,
        path: PathBuf,
        why: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> SnapshotError {
    let what = what.into();
    move |source| SnapshotError::Io { what, source }
}

/// What a data directory holds: bytes of its files, and its entries.
pub(crate) fn measure(data: &Path) -> io::Result<(u64, u64)> {
    let mut bytes = 0u64;
    let mut entries = 0u64;
    walk(data, &mut |_, meta| {
        entries += 1;
        if meta.is_file() {
            bytes += meta.len();
        }
        Ok(())
    })?;
    Ok((bytes, entries))
}

/// Calls `f` for every entry under `dir` (not `dir` itself), parents first, in name
/// order; symbolic links are not followed.
fn walk(
    dir: &Path,
    f: &mut dyn FnMut(&Path, &std::fs::Metadata) -> io::Result<()>,
) -> io::Result<()> {
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for path in names {
        let meta = std::fs::symlink_metadata(&path)?;
        f(&path, &meta)?;
        if meta.is_dir() {
            walk(&path, f)?;
        }
    }
    Ok(())
}

/// Counts and hashes what passes through.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `id` can name a snapshot (a SHA-256 in hex): nothing else reaches a path.
fn valid_id(id: &str) -> bool {
    id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// What a snapshot taken holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) id: String,
    /// Bytes of the data directory's files.
    pub(crate) data_bytes: u64,
    /// Bytes of the archive.
    pub(crate) archive_bytes: u64,
}

/// Snapshots `data` into `actor_dir` (the actor's snapshot directory): durable once
/// this returns. A data directory whose files hold more than `max` bytes is refused.
/// On any failure the last snapshot stays as it was. Kept: the new snapshot, the one
/// taken before it, and `recorded` (the one the control plane names now: its record
/// may never learn of the newer ones, when their answers are lost).
///
/// # Errors
/// [`SnapshotError::TooLarge`], or the I/O error with what was being done.
pub(crate) fn take(
    data: &Path,
    actor_dir: &Path,
    max: u64,
    recorded: &str,
) -> Result<Taken, SnapshotError> {
    let (data_bytes, _) = measure(data).map_err(io_err(format!("reading {}", data.display())))?;
    if data_bytes > max {
        return Err(SnapshotError::TooLarge {
            bytes: data_bytes,
            max,
        });
    }
    let dir = actor_dir.join(PROGRAM_DIR);
    crate::app::create_dir_durably(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let tmp = dir.join(format!(".taking-{:016x}.tmp", rand::random::<u64>()));
    let written = write_archive(data, &tmp, max);
    let (id, archive_bytes) = match written {
        Ok(w) => w,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    let archive = dir.join(format!("{id}.tar.zst"));
    std::fs::rename(&tmp, &archive)
        .and_then(|()| crate::app::sync_dir_of(&archive))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            SnapshotError::Io {
                what: format!("writing {}", archive.display()),
                source: e,
            }
        })?;
    // The index names the newest two: the control plane may still hold the older id
    // (a checkpoint whose answer it never got).
    let previous = read_index(&dir).into_iter().find(|old| *old != id);
    let mut index = format!("{id}\n");
    if let Some(p) = &previous {
        index.push_str(p);
        index.push('\n');
    }
    crate::app::write_durably(&dir.join("index"), index.as_bytes())
        .map_err(io_err(format!("writing {}", dir.join("index").display())))?;
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let keep = name == "index"
                || name
                    .strip_suffix(".tar.zst")
                    .is_some_and(|n| n == id || Some(n) == previous.as_deref() || n == recorded);
            if !keep {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    Ok(Taken {
        id,
        data_bytes,
        archive_bytes,
    })
}

fn read_index(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("index"))
        .map(|s| {
            s.lines()
                .filter(|l| valid_id(l))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Writes `data` as an archive to `to`, synced; its id and size.
fn write_archive(data: &Path, to: &Path, max: u64) -> Result<(String, u64), SnapshotError> {
    let what = || format!("writing {}", to.display());
    let file = File::create(to).map_err(io_err(what()))?;
    let hashing = Hashing {
        inner: BufWriter::with_capacity(1 << 20, file),
        hash: Sha256::new(),
        bytes: 0,
    };
    let encoder = zstd::Encoder::new(hashing, LEVEL).map_err(io_err(what()))?;
    let mut tar = tar::Builder::new(encoder);
    tar.mode(tar::HeaderMode::Complete);
    tar.follow_symlinks(false);
    let mut copied = 0u64;
    walk(data, &mut |path, meta| {
        let name = path.strip_prefix(data).expect("walked from data");
        let ft = meta.file_type();
        if ft.is_dir() {
            tar.append_dir(name, path)
        } else if ft.is_file() || ft.is_symlink() {
            if ft.is_file() {
                copied += meta.len();
                if copied > max {
                    return Err(io::Error::other(format!(
                        "the data directory grew past --snapshot-max-bytes {max} while it was archived"
                    )));
                }
            }
            tar.append_path_with_name(path, name)
        } else {
            tracing::debug!(file = %path.display(), "not a file, directory or link: left out of the snapshot");
            Ok(())
        }
    })
    .map_err(io_err(format!("archiving {}", data.display())))?;
    let encoder = tar.into_inner().map_err(io_err(what()))?;
    let mut hashing = encoder.finish().map_err(io_err(what()))?;
    hashing.flush().map_err(io_err(what()))?;
    let file = hashing.inner.into_inner().map_err(|e| SnapshotError::Io {
        what: what(),
        source: e.into_error(),
    })?;
    file.sync_all().map_err(io_err(what()))?;
    Ok((hex(&hashing.hash.finalize()), hashing.bytes))
}

/// Restores snapshot `id` of the actor whose snapshot directory is `actor_dir` as
/// the directory `into` (replacing it); an empty `id` makes it an empty directory
/// (an actor never checkpointed).
///
/// # Errors
/// A snapshot missing or damaged, or the I/O error with what was being done; `into`
/// is then left absent.
pub(crate) fn restore(actor_dir: &Path, id: &str, into: &Path) -> Result<u64, SnapshotError> {
    remove_dir(into)?;
    if id.is_empty() {
        std::fs::create_dir_all(into).map_err(io_err(format!("creating {}", into.display())))?;
        return Ok(0);
    }
    let path = actor_dir.join(PROGRAM_DIR).join(format!("{id}.tar.zst"));
    if !valid_id(id) {
        return Err(SnapshotError::Corrupt {
            id: id.to_owned(),
            path,
            why: "not a snapshot id".into(),
        });
    }
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(SnapshotError::Missing {
                id: id.to_owned(),
                path,
            });
        }
        Err(e) => return Err(io_err(format!("reading {}", path.display()))(e)),
    };
    let mut staging = into.as_os_str().to_owned();
    staging.push(".restoring");
    let staging = PathBuf::from(staging);
    remove_dir(&staging)?;
    std::fs::create_dir_all(&staging).map_err(io_err(format!("creating {}", staging.display())))?;
    let corrupt = |why: String| SnapshotError::Corrupt {
        id: id.to_owned(),
        path: path.clone(),
        why,
    };
    let mut hashing = Hashing {
        inner: io::BufReader::with_capacity(1 << 20, file),
        hash: Sha256::new(),
        bytes: 0,
    };
    let unpacked = (|| -> io::Result<()> {
        let decoder = zstd::Decoder::new(&mut hashing)?;
        let mut archive = tar::Archive::new(decoder);
        archive.set_preserve_permissions(true);
        archive.set_preserve_mtime(true);
        archive.set_overwrite(true);
        archive.unpack(&staging)?;
        let mut decoder = archive.into_inner();
        io::copy(&mut decoder, &mut io::sink())?;
        Ok(())
    })();
    // Every byte of the file counts in its hash, what zstd did not read included.
    let rest = io::copy(&mut hashing, &mut io::sink());
    let result = match (unpacked, rest) {
        (Err(e), _) => Err(corrupt(e.to_string())),
        (_, Err(e)) => Err(io_err(format!("reading {}", path.display()))(e)),
        (Ok(()), Ok(_)) => {
            let got = hex(&hashing.hash.clone().finalize());
            if got == id {
                Ok(())
            } else {
                Err(corrupt(format!("its SHA-256 is {got}")))
            }
        }
    };
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    std::fs::rename(&staging, into).map_err(io_err(format!(
        "renaming {} to {}",
        staging.display(),
        into.display()
    )))?;
    Ok(hashing.bytes)
}

fn remove_dir(dir: &Path) -> Result<(), SnapshotError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(format!("removing {}", dir.display()))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(data: &Path) {
        std::fs::create_dir_all(data.join("sub/deeper")).unwrap();
        std::fs::write(data.join("notes.db"), b"hello").unwrap();
        std::fs::write(data.join("sub/deeper/big"), vec![7u8; 300_000]).unwrap();
        std::os::unix::fs::symlink("notes.db", data.join("link")).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(
            data.join("notes.db"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
    }

    #[test]
    fn a_snapshot_round_trips_and_keeps_the_newest_two() {
        let dir = tempfile::tempdir().unwrap();
        let (data, snaps, back) = (
            dir.path().join("data"),
            dir.path().join("snaps"),
            dir.path().join("back"),
        );
        fill(&data);
        let first = take(&data, &snaps, 1 << 30, "").unwrap();
        assert_eq!(first.data_bytes, 300_005);
        restore(&snaps, &first.id, &back).unwrap();
        assert_eq!(std::fs::read(back.join("notes.db")).unwrap(), b"hello");
        assert_eq!(
            std::fs::read(back.join("sub/deeper/big")).unwrap().len(),
            300_000
        );
        assert_eq!(
            std::fs::read_link(back.join("link")).unwrap(),
            Path::new("notes.db")
        );
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(back.join("notes.db"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o600
        );

        std::fs::write(data.join("notes.db"), b"second").unwrap();
        let second = take(&data, &snaps, 1 << 30, "").unwrap();
        // The control plane still names the first (the answer of the second was
        // lost): the third keeps it.
        std::fs::write(data.join("notes.db"), b"third").unwrap();
        let third = take(&data, &snaps, 1 << 30, &first.id).unwrap();
        assert_eq!(
            read_index(&snaps.join(PROGRAM_DIR)),
            [third.id.clone(), second.id.clone()]
        );
        restore(&snaps, &second.id, &back).unwrap();
        assert_eq!(std::fs::read(back.join("notes.db")).unwrap(), b"second");
        restore(&snaps, &first.id, &back).unwrap();
        assert_eq!(std::fs::read(back.join("notes.db")).unwrap(), b"hello");
        std::fs::write(data.join("notes.db"), b"fourth").unwrap();
        take(&data, &snaps, 1 << 30, "").unwrap();
        let e = restore(&snaps, &first.id, &back).unwrap_err();
        assert!(matches!(e, SnapshotError::Missing { .. }), "{e}");
        assert!(!back.exists(), "no directory in its place");
        restore(&snaps, "", &back).unwrap();
        assert_eq!(
            std::fs::read_dir(&back).unwrap().count(),
            0,
            "a new actor starts empty"
        );
    }

    #[test]
    fn a_damaged_snapshot_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (data, snaps, back) = (
            dir.path().join("data"),
            dir.path().join("snaps"),
            dir.path().join("back"),
        );
        fill(&data);
        let taken = take(&data, &snaps, 1 << 30, "").unwrap();
        let archive = snaps
            .join(PROGRAM_DIR)
            .join(format!("{}.tar.zst", taken.id));
        let mut bytes = std::fs::read(&archive).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&archive, &bytes).unwrap();
        let e = restore(&snaps, &taken.id, &back).unwrap_err();
        assert!(matches!(e, SnapshotError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("is damaged"), "{e}");
        assert!(!back.exists());
        std::fs::write(&archive, b"not zstd at all").unwrap();
        assert!(matches!(
            restore(&snaps, &taken.id, &back),
            Err(SnapshotError::Corrupt { .. })
        ));
        assert!(matches!(
            restore(&snaps, "../../etc", &back),
            Err(SnapshotError::Corrupt { .. })
        ));
    }

    #[test]
    fn an_oversized_directory_is_refused_and_the_last_snapshot_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (data, snaps) = (dir.path().join("data"), dir.path().join("snaps"));
        fill(&data);
        let good = take(&data, &snaps, 1 << 30, "").unwrap();
        std::fs::write(data.join("more"), vec![1u8; 1000]).unwrap();
        let e = take(&data, &snaps, 300_100, "").unwrap_err();
        assert_eq!(
            e.to_string(),
            "its data directory holds 301005 bytes, over --snapshot-max-bytes 300100 (905 over)"
        );
        assert_eq!(read_index(&snaps.join(PROGRAM_DIR)), [good.id]);
        let left: Vec<_> = std::fs::read_dir(snaps.join(PROGRAM_DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left.len(),
            2,
            "the archive and its index, no temporary: {left:?}"
        );
    }
}
