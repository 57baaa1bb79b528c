//! Credentials rebuilt from their files without a restart: every certificate, key, CA
//! and verification-key file is re-read when its bytes change on disk (polled every
//! [`POLL_INTERVAL`]) and on SIGHUP ([`reload_all`]). A rebuild that fails keeps the
//! previous value, logs why (once per reason), and is tried again at every poll until
//! one succeeds: what failed may pass with the files unchanged. Whoever loads the value once per
//! connection gets "connections in progress keep their old credentials" for free.
//!
//! Polling the bytes rather than watching inodes sees every way files are replaced:
//! written in place, renamed over, or swapped behind a symlink (Kubernetes secret
//! volumes swap a `..data` symlink).

use std::fmt::Display;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;

/// How often watched files are compared with what was last built from.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Bumped by [`reload_all`]; every watcher rebuilds when it changes.
static HANGUPS: LazyLock<watch::Sender<u64>> = LazyLock::new(|| watch::channel(0).0);

/// Rebuilds every [`Reloading`] value in the process from its files now, changed or
/// not (what SIGHUP does).
pub fn reload_all() {
    HANGUPS.send_modify(|n| *n = n.wrapping_add(1));
}

type Build<T> = Box<dyn Fn() -> Result<T, String> + Send + Sync>;

/// The bytes of every watched file (`None`: unreadable).
type Snapshot = Vec<Option<Vec<u8>>>;

struct Inner<T> {
    what: &'static str,
    files: Vec<PathBuf>,
    build: Build<T>,
    current: ArcSwap<T>,
    /// What `current` was built from, until the watcher takes it over.
    seen: Mutex<Option<Snapshot>>,
    watching: AtomicBool,
    attempts: AtomicU64,
}

/// A value built from files, rebuilt when they change. Cloning shares it; the watcher
/// (started when it is made inside a tokio runtime, else by the first
/// [`Reloading::load`] inside one) ends once every clone is dropped.
pub struct Reloading<T>(Arc<Inner<T>>);

impl<T> Clone for Reloading<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> std::fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("what", &self.0.what)
            .field("files", &self.0.files)
            .finish_non_exhaustive()
    }
}

fn snapshot(files: &[PathBuf]) -> Snapshot {
    files.iter().map(|f| std::fs::read(f).ok()).collect()
}

impl<T: Send + Sync + 'static> Reloading<T> {
    /// Builds the value now (its error is a configuration error for the caller), and
    /// again from `files` whenever one of them changes. `what` names it in logs.
    ///
    /// # Errors
    /// The first build's error.
    pub fn new<E: Display>(
        what: &'static str,
        files: Vec<PathBuf>,
        build: impl Fn() -> Result<T, E> + Send + Sync + 'static,
    ) -> Result<Self, E> {
        // Read before building: a change in between is seen by the first poll.
        let seen = snapshot(&files);
        let first = build()?;
        let value = Self(Arc::new(Inner {
            what,
            files,
            build: Box::new(move || build().map_err(|e| e.to_string())),
            current: ArcSwap::from_pointee(first),
            seen: Mutex::new(Some(seen)),
            watching: AtomicBool::new(false),
            attempts: AtomicU64::new(0),
        }));
        // Watched from now on (inside a runtime): a value first used long after the
        // start (a standby's, at its takeover) is as fresh as its files.
        value.watch();
        Ok(value)
    }

    /// A value from no file: never rebuilt.
    pub fn fixed(what: &'static str, value: T) -> Self {
        Self(Arc::new(Inner {
            what,
            files: Vec::new(),
            build: Box::new(|| Err("built from no file".into())),
            current: ArcSwap::from_pointee(value),
            seen: Mutex::new(None),
            watching: AtomicBool::new(true),
            attempts: AtomicU64::new(0),
        }))
    }

    /// The current value. The first call inside a tokio runtime starts the watcher.
    pub fn load(&self) -> Arc<T> {
        self.watch();
        self.0.current.load_full()
    }

    /// How many rebuilds have been attempted since the start (successful or not).
    pub fn attempts(&self) -> u64 {
        self.0.attempts.load(Ordering::Acquire)
    }

    fn watch(&self) {
        if self.0.watching.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.0.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let seen = self
            .0
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .unwrap_or_default();
        runtime.spawn(watch_files(Arc::downgrade(&self.0), seen));
    }
}

/// Polls the files of `inner` until it is dropped; rebuilds on a change or a hangup,
/// and at every poll while the last rebuild failed: a failure may pass with the files
/// unchanged (a certificate not valid yet becomes valid, a read failed for a moment),
/// and the previous value may be about to expire. A failure is logged when its reason
/// changes, not at every poll.
async fn watch_files<T: Send + Sync + 'static>(inner: Weak<Inner<T>>, mut seen: Snapshot) {
    // Why the last rebuild failed, until one succeeds.
    let mut failing: Option<String> = None;
    let mut hangups = HANGUPS.subscribe();
    let mut tick = tokio::time::interval(POLL_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let forced = tokio::select! {
            _ = tick.tick() => false,
            changed = hangups.changed() => changed.is_ok(),
        };
        let Some(files) = inner.upgrade().map(|i| i.files.clone()) else {
            return;
        };
        // Small local files, but file reads block: off the runtime's threads.
        let Ok(now) = tokio::task::spawn_blocking(move || snapshot(&files)).await else {
            continue;
        };
        if !forced && now == seen && failing.is_none() {
            continue;
        }
        let quiet = !forced && now == seen;
        seen = now;
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let what = strong.what;
        let built = tokio::task::spawn_blocking(move || {
            let built = (strong.build)().map(|v| strong.current.store(Arc::new(v)));
            strong.attempts.fetch_add(1, Ordering::AcqRel);
            built
        })
        .await;
        let why = match built {
            Ok(Ok(())) => {
                tracing::info!(what, "reloaded from its files");
                failing = None;
                continue;
            }
            Ok(Err(why)) => why,
            Err(e) => e.to_string(),
        };
        if !quiet || failing.as_ref() != Some(&why) {
            tracing::warn!(what, %why, "reload failed; keeping the previous ones, trying again every second");
        }
        failing = Some(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits (bounded) until `cond` holds, yielding between checks.
    async fn until(mut cond: impl FnMut() -> bool) {
        tokio::time::timeout(Duration::from_secs(20), async {
            while !cond() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("condition reached in time");
    }

    fn parse(path: &std::path::Path) -> Result<u32, String> {
        let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
        text.trim()
            .parse()
            .map_err(|_| format!("not a number: {text:?}"))
    }

    #[tokio::test]
    async fn a_changed_file_is_rebuilt_and_a_bad_one_keeps_the_old_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "1").unwrap();
        let p = path.clone();
        let value = Reloading::new("number", vec![path.clone()], move || parse(&p)).unwrap();
        assert_eq!(*value.load(), 1);

        std::fs::write(&path, "2").unwrap();
        until(|| *value.load() == 2).await;

        let before = value.attempts();
        std::fs::write(&path, "garbage").unwrap();
        until(|| value.attempts() > before).await;
        assert_eq!(*value.load(), 2, "a failed reload keeps the previous value");

        // Swapped behind a symlink, as Kubernetes does.
        let real = dir.path().join("real");
        std::fs::write(&real, "3").unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&real, &path).unwrap();
        until(|| *value.load() == 3).await;
    }

    #[tokio::test]
    async fn a_hangup_rebuilds_unchanged_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "7").unwrap();
        let p = path.clone();
        let value = Reloading::new("number", vec![path], move || parse(&p)).unwrap();
        assert_eq!(*value.load(), 7);
        let before = value.attempts();
        // The watcher may not have subscribed yet: keep asking until it rebuilds.
        until(|| {
            reload_all();
            value.attempts() > before
        })
        .await;
        assert_eq!(*value.load(), 7);
    }

    /// A value nobody has loaded yet follows its files all the same: its first use
    /// (a standby's, at takeover) gets what the files hold then.
    #[tokio::test]
    async fn a_value_never_loaded_follows_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "1").unwrap();
        let p = path.clone();
        let value = Reloading::new("number", vec![path.clone()], move || parse(&p)).unwrap();
        std::fs::write(&path, "2").unwrap();
        until(|| value.attempts() > 0).await;
        assert_eq!(*value.load(), 2);
    }

    /// A rebuild that failed for a reason outside the files (a certificate not valid
    /// yet, a read that failed for a moment) is tried again with the files unchanged:
    /// before, the previous value stayed until the files changed again, even past its
    /// expiry.
    #[tokio::test]
    async fn a_failed_rebuild_is_tried_again_with_the_files_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n");
        std::fs::write(&path, "1").unwrap();
        let valid = Arc::new(AtomicBool::new(true));
        let (p, v) = (path.clone(), Arc::clone(&valid));
        let value = Reloading::new("number", vec![path.clone()], move || {
            if v.load(Ordering::Acquire) {
                parse(&p)
            } else {
                Err("not valid yet".to_owned())
            }
        })
        .unwrap();
        valid.store(false, Ordering::Release);
        std::fs::write(&path, "2").unwrap();
        until(|| value.attempts() > 0).await;
        assert_eq!(
            *value.load(),
            1,
            "the failed rebuild kept the previous value"
        );
        valid.store(true, Ordering::Release);
        until(|| *value.load() == 2).await;
    }

    #[test]
    fn the_first_build_error_is_returned() {
        let e = Reloading::new("number", vec![], || Err::<u32, _>("bad")).unwrap_err();
        assert_eq!(e, "bad");
    }
}
