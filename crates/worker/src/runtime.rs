//! A hosted program: the actor's live directory, its program's current run, its
//! output, and the order of every step of its life.
//!
//! ```text
//! restore:    take the directory ─▶ unpack the snapshot ─▶ start ─▶ ready ─▶ hosted
//! checkpoint: (fenced) ─▶ size ─▶ stop the group ─▶ snapshot ─▶ gone
//!                                                   └ failed ─▶ start again, serve on
//! exit:       the program exits by itself ─▶ gone, reported to the control plane
//! ```

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;
use valet_proto::worker as wk;
use valet_template::Program;

use crate::forward::Upstream;
use crate::limits::Cgroup;
use crate::output::{OUTPUT_FILE, Output};
use crate::program::{ActorDir, Launch, Running, TAIL_LINES, stop_signal};
use crate::snapshot::{self, SnapshotError};

/// What every hosted program of a worker shares.
#[derive(Debug)]
pub(crate) struct Context {
    /// Where live directories are (`--run-dir`).
    pub(crate) run_dir: PathBuf,
    /// The largest data directory a checkpoint snapshots (`--snapshot-max-bytes`).
    pub(crate) snapshot_max: u64,
    pub(crate) cgroup: Option<Cgroup>,
    /// Programs that exited by themselves, for the control plane.
    pub(crate) exits: mpsc::UnboundedSender<wk::Exited>,
    /// The worker's slot, to leave when a program exits.
    pub(crate) slot: Weak<tokio::sync::watch::Sender<Option<Arc<crate::app::Hosted>>>>,
    /// Kills of programs whose actors left (the worker's shutdown waits for them).
    pub(crate) kills: TaskTracker,
}

/// Why a program's checkpoint failed.
#[derive(Debug)]
pub(crate) enum CheckpointFailure {
    /// Nothing was snapshotted, and the actor is served here as before (its program
    /// was not stopped, or was started again from its data directory).
    StillRunning(String),
    /// Nothing was snapshotted, and the program is not running.
    Failed(String),
}

/// A program hosted for one actor.
#[derive(Debug)]
pub(crate) struct Host {
    actor: String,
    slot: wk::ActorSlot,
    spec: Arc<Program>,
    /// Shared with the blocking work on it (an unpack, a snapshot), so the lock lives
    /// as long as that work, even past a restore or checkpoint given up.
    dir: Arc<ActorDir>,
    /// The actor's snapshot directory.
    snapshots: PathBuf,
    output: Arc<Output>,
    current: Mutex<Option<Arc<Upstream>>>,
    /// Set while the worker stops the program on purpose: its exit is no crash.
    stopping: AtomicBool,
    /// Set once the actor is installed in the worker's slot: an exit before that fails
    /// the restore instead (see [`Host::installed`]).
    installed: AtomicBool,
    /// The Restore command (its id on the worker's current stream) that started the
    /// run: its exit report names it. 0 for an actor kept from an earlier stream.
    restore_id: std::sync::atomic::AtomicU64,
    ctx: Arc<Context>,
    tasks: TaskTracker,
}

impl Host {
    /// Restores `slot`'s actor: its live directory taken (whatever still holds it
    /// killed), snapshot `id` unpacked into it (empty for none), its program started and
    /// ready.
    ///
    /// # Errors
    /// Why not, with the program's last output when it ran.
    pub(crate) async fn restore(
        ctx: &Arc<Context>,
        slot: wk::ActorSlot,
        snapshots: PathBuf,
        spec: Arc<Program>,
        id: &str,
    ) -> Result<Arc<Self>, String> {
        let actor = format!("{}/{}", slot.atespace, slot.name);
        let dir = Arc::new(ActorDir::take(&ctx.run_dir, &slot.atespace, &slot.name).await?);
        let output = {
            let (snapshots, dir, id, actor) = (
                snapshots.clone(),
                Arc::clone(&dir),
                id.to_owned(),
                actor.clone(),
            );
            tokio::task::spawn_blocking(move || {
                crate::app::create_dir_durably(&snapshots)
                    .map_err(|e| SnapshotError::Io {
                        what: format!("creating {}", snapshots.display()),
                        source: e,
                    })
                    .and_then(|()| snapshot::restore(&snapshots, &id, &dir.data()))
                    .map(|_| Output::open(&actor, snapshots.join(OUTPUT_FILE)))
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?
        };
        let output = Arc::new(output);
        let host = Arc::new(Self {
            actor,
            slot,
            spec,
            dir,
            snapshots,
            output,
            current: Mutex::new(None),
            stopping: AtomicBool::new(false),
            installed: AtomicBool::new(false),
            restore_id: std::sync::atomic::AtomicU64::new(0),
            ctx: Arc::clone(ctx),
            tasks: TaskTracker::new(),
        });
        host.start().await?;
        Ok(host)
    }

    /// Starts a run of the program on the data directory as it is, and waits until it
    /// is ready; then requests reach it.
    async fn start(self: &Arc<Self>) -> Result<(), String> {
        self.stopping.store(false, Ordering::Release);
        let running = Running::spawn(
            &self.spec,
            &Launch {
                actor: &self.actor,
                dir: &self.dir,
                output: &self.output,
                cgroup: self.ctx.cgroup.as_ref(),
            },
        )
        .await?;
        let started = tokio::time::Instant::now();
        if let Err(e) = running.until_ready(&self.spec).await {
            self.stopping.store(true, Ordering::Release);
            // Killed with its group; what it printed until then is kept.
            let _ = running
                .stop(rustix::process::Signal::KILL, std::time::Duration::ZERO)
                .await;
            self.output.note(&format!("not ready: {e}"));
            self.output.flush().await;
            return Err(self.with_tail(&e));
        }
        tracing::info!(actor = %self.actor, pid = running.pid(), addr = %running.addr(), ready_after = ?started.elapsed(), "program ready");
        let mut exit = running.exit_watch();
        let upstream = Arc::new(Upstream::new(running, self.spec.protocol));
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&upstream));
        // The watcher holds neither the run nor the host: dropping or killing them is
        // never held up by it.
        let (me, run) = (Arc::downgrade(self), Arc::downgrade(&upstream));
        self.tasks.spawn(async move {
            if exit.wait_for(Option::is_some).await.is_err() {
                return;
            }
            if let (Some(host), Some(upstream)) = (me.upgrade(), run.upgrade()) {
                let exit = upstream.running.exited().await;
                host.exited(&upstream, exit).await;
            }
        });
        let me = Arc::downgrade(self);
        self.tasks.spawn(async move {
            // The output file follows the output, a second behind at most.
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tick.tick().await;
                let Some(host) = me.upgrade() else { return };
                if host.upstream().is_none() {
                    return;
                }
                host.output.flush().await;
            }
        });
        Ok(())
    }

    /// `e`, with the program's last lines of output.
    fn with_tail(&self, e: &str) -> String {
        let tail = self.output.tail(TAIL_LINES);
        if tail.is_empty() {
            format!("{e} (it printed nothing)")
        } else {
            format!("{e}; its last output:\n{tail}")
        }
    }

    /// `upstream`'s program exited by itself: unless the worker stopped it, the actor
    /// leaves this worker and the control plane is told.
    async fn exited(self: &Arc<Self>, upstream: &Arc<Upstream>, exit: crate::program::Exit) {
        let current = self.upstream().is_some_and(|u| Arc::ptr_eq(&u, upstream));
        // Not installed yet: [`Host::installed`] fails the restore instead.
        if self.stopping.load(Ordering::Acquire)
            || !current
            || !self.installed.load(Ordering::Acquire)
        {
            return;
        }
        let oom = if upstream.running.oom_killed() {
            " (over its memory limit)"
        } else {
            ""
        };
        let status = format!("{exit}{oom}");
        self.output.note(&format!("its program {status}"));
        self.output.flush().await;
        let tail = self.output.tail(TAIL_LINES);
        tracing::warn!(actor = %self.actor, %status, output = %tail, "the actor's program exited while hosted; the actor leaves this worker");
        if let Some(slot) = self.ctx.slot.upgrade() {
            crate::hosting::vacate_if(
                &slot,
                |h| matches!(&h.app, crate::app::Served::Program(p) if std::ptr::eq(&**p, &**self)),
            );
        }
        let _ = self.ctx.exits.send(wk::Exited {
            actor: Some(self.slot.clone()),
            status,
            output: tail,
            restore: self.restore_id.load(Ordering::Acquire),
        });
    }

    /// The program's current run, while it serves.
    pub(crate) fn upstream(&self) -> Option<Arc<Upstream>> {
        self.current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn output(&self) -> &Arc<Output> {
        &self.output
    }

    /// Stops the program as its template says: its stop signal to its group, SIGKILL
    /// after its grace, until no process of it is left.
    ///
    /// # Errors
    /// When processes of it survive SIGKILL.
    pub(crate) async fn stop(&self) -> Result<(), String> {
        self.stopping.store(true, Ordering::Release);
        let Some(upstream) = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Ok(());
        };
        let result = upstream
            .running
            .stop(stop_signal(self.spec.stop_signal), self.spec.stop_grace)
            .await;
        match &result {
            Ok(exit) => self.output.note(&format!("stopped: its program {exit}")),
            Err(e) => self.output.note(&format!("stop failed: {e}")),
        }
        self.output.flush().await;
        result.map(drop)
    }

    /// The actor is in the worker's slot now: from here on its program's exit is a
    /// crash to report.
    ///
    /// # Errors
    /// When its program exited in between (the restore then fails).
    pub(crate) fn installed(&self, restore_id: u64) -> Result<(), String> {
        self.restore_id.store(restore_id, Ordering::Release);
        self.installed.store(true, Ordering::Release);
        match self.upstream().and_then(|u| u.running.exit()) {
            Some(exit) => Err(self.with_tail(&format!("its program {exit} as it was installed"))),
            None => Ok(()),
        }
    }

    /// The worker attached anew, and the control plane kept the actor: the Restore that
    /// started it was on another stream.
    pub(crate) fn kept(&self) {
        self.restore_id.store(0, Ordering::Release);
    }

    /// Kills the program at once, with every process of it (the actor left this
    /// worker; nothing of it is kept). Returns at once; the kill is owned by the
    /// worker, whose shutdown waits for it.
    pub(crate) fn kill(&self) {
        self.stopping.store(true, Ordering::Release);
        let Some(upstream) = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        let actor = self.actor.clone();
        self.ctx.kills.spawn(async move {
            if let Err(left) = upstream.running.kill().await {
                tracing::warn!(%actor, ?left, "processes of the actor's program survive SIGKILL");
            }
        });
    }

    /// Checkpoints the fenced actor: refused while it keeps running when its data is
    /// over the limit; else its program stopped, then its data directory snapshotted.
    /// A snapshot that fails starts the program again, so the actor serves on. The
    /// snapshot's id.
    ///
    /// # Errors
    /// Why, and whether the actor still runs here.
    pub(crate) async fn checkpoint(
        self: &Arc<Self>,
        recorded: &str,
    ) -> Result<snapshot::Taken, CheckpointFailure> {
        let max = self.ctx.snapshot_max;
        let measured = {
            let dir = Arc::clone(&self.dir);
            tokio::task::spawn_blocking(move || snapshot::measure(&dir.data())).await
        };
        if let Ok(Ok((bytes, _))) = measured
            && bytes > max
        {
            let e = SnapshotError::TooLarge { bytes, max };
            return Err(CheckpointFailure::StillRunning(format!(
                "checkpoint of actor {} refused: {e}; it keeps running here and its last snapshot stays",
                self.actor
            )));
        }
        if let Err(e) = self.stop().await {
            return Err(CheckpointFailure::Failed(format!(
                "checkpoint of actor {} failed: {e}",
                self.actor
            )));
        }
        let taken = {
            let (snapshots, dir, recorded) = (
                self.snapshots.clone(),
                Arc::clone(&self.dir),
                recorded.to_owned(),
            );
            tokio::task::spawn_blocking(move || {
                snapshot::take(&dir.data(), &snapshots, max, &recorded)
            })
            .await
        };
        let e = match taken {
            Ok(Ok(taken)) => {
                self.output.note(&format!(
                    "snapshot {} taken: {} bytes of data, {} archived",
                    taken.id, taken.data_bytes, taken.archive_bytes
                ));
                self.output.flush().await;
                return Ok(taken);
            }
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        let failed = format!(
            "checkpoint of actor {} failed: {e}; its last snapshot stays",
            self.actor
        );
        tracing::warn!(actor = %self.actor, error = %failed, "starting the program again");
        match self.start().await {
            Ok(()) => Err(CheckpointFailure::StillRunning(format!(
                "{failed}; it keeps running here"
            ))),
            Err(again) => Err(CheckpointFailure::Failed(format!(
                "{failed}, and starting it again failed: {again}"
            ))),
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill();
        self.tasks.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::app::{Hosted, Served, Slot};
    use std::time::Duration;

    fn context(
        dir: &std::path::Path,
        slot: &Slot,
    ) -> (Arc<Context>, mpsc::UnboundedReceiver<wk::Exited>) {
        let (exits, rx) = mpsc::unbounded_channel();
        let ctx = Arc::new(Context {
            run_dir: dir.join("run"),
            snapshot_max: 1 << 30,
            cgroup: None,
            exits,
            slot: Arc::downgrade(slot),
            kills: TaskTracker::new(),
        });
        (ctx, rx)
    }

    fn actor() -> wk::ActorSlot {
        wk::ActorSlot {
            atespace: "demo".into(),
            name: "p1".into(),
            snapshot_key: "demo/p1/u1".into(),
        }
    }

    async fn hosted(
        ctx: &Arc<Context>,
        slot: &Slot,
        dir: &std::path::Path,
        program: Program,
    ) -> Arc<Host> {
        let host = Host::restore(
            ctx,
            actor(),
            dir.join("snapshots/demo/p1/u1"),
            Arc::new(program),
            "",
        )
        .await
        .unwrap();
        slot.send_replace(Some(Arc::new(Hosted::new(
            "demo/p1".into(),
            Served::Program(Arc::clone(&host)),
            "demo/p1/u1".into(),
        ))));
        host.installed(7).unwrap();
        host
    }

    /// An actor that leaves its worker (evicted, not kept) takes its program with it,
    /// also while a request still holds its run. Before, the program was killed only
    /// when the last holder of its run let go, and its exit watcher held one for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_actor_that_leaves_takes_its_program_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let slot: Slot = Arc::new(tokio::sync::watch::Sender::new(None));
        let (ctx, _exits) = context(dir.path(), &slot);
        let program = Program::from_command_line(
            "python3 -m http.server {port} --bind 127.0.0.1 --directory {data}",
            None,
        )
        .unwrap();
        let host = hosted(&ctx, &slot, dir.path(), program).await;
        let held = host.upstream().unwrap();
        assert!(held.running.exit().is_none());
        assert!(crate::hosting::vacate(&slot, None));
        let exit = tokio::time::timeout(Duration::from_secs(10), held.running.exited())
            .await
            .expect("the program is killed as its actor leaves");
        assert_eq!(exit.to_string(), "killed by signal 9 (SIGKILL)");
        ctx.kills.close();
        ctx.kills.wait().await;
    }

    /// A program that exits by itself leaves the slot and is reported, naming the
    /// Restore that started it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_program_that_exits_is_reported_with_its_restore() {
        let dir = tempfile::tempdir().unwrap();
        let slot: Slot = Arc::new(tokio::sync::watch::Sender::new(None));
        let (ctx, mut exits) = context(dir.path(), &slot);
        let mut program = Program::from_command_line(
            "python3 -c \"import os,socket,time; s=socket.socket(); s.bind(('127.0.0.1', int(os.environ['PORT']))); s.listen(); print('up', flush=True); time.sleep(0.5); os._exit(7)\"",
            None,
        )
        .unwrap();
        program.ready = valet_template::Probe::Tcp;
        let _host = hosted(&ctx, &slot, dir.path(), program).await;
        // It exits half a second after it listens.
        let exited = tokio::time::timeout(Duration::from_secs(10), exits.recv())
            .await
            .expect("reported")
            .unwrap();
        assert_eq!(exited.status, "exited with status 7");
        assert_eq!(exited.restore, 7);
        assert_eq!(exited.output, "[out] up");
        assert!(slot.borrow().is_none(), "the actor left the slot");
    }
}
