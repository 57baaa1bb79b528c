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
    dir: ActorDir,
    /// The actor's snapshot directory.
    snapshots: PathBuf,
    output: Arc<Output>,
    current: Mutex<Option<Arc<Upstream>>>,
    /// Set while the worker stops the program on purpose: its exit is no crash.
    stopping: AtomicBool,
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
        let dir = ActorDir::take(&ctx.run_dir, &slot.atespace, &slot.name).await?;
        {
            let (snapshots, data, id) = (snapshots.clone(), dir.data(), id.to_owned());
            tokio::task::spawn_blocking(move || {
                crate::app::create_dir_durably(&snapshots)
                    .map_err(|e| SnapshotError::Io {
                        what: format!("creating {}", snapshots.display()),
                        source: e,
                    })
                    .and_then(|()| snapshot::restore(&snapshots, &id, &data))
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        }
        let output = Arc::new(Output::open(&actor, snapshots.join(OUTPUT_FILE)));
        let host = Arc::new(Self {
            actor,
            slot,
            spec,
            dir,
            snapshots,
            output,
            current: Mutex::new(None),
            stopping: AtomicBool::new(false),
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
        )?;
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
        let upstream = Arc::new(Upstream::new(running, self.spec.protocol));
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&upstream));
        let me = Arc::downgrade(self);
        self.tasks.spawn(async move {
            let exit = upstream.running.exited().await;
            if let Some(host) = me.upgrade() {
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
        if self.stopping.load(Ordering::Acquire) || !current {
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

    /// Kills the program at once (the actor left this worker; nothing of it is kept).
    pub(crate) fn kill(&self) {
        self.stopping.store(true, Ordering::Release);
        // Dropping the run kills its group.
        drop(
            self.current
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }

    /// Checkpoints the fenced actor: refused while it keeps running when its data is
    /// over the limit; else its program stopped, then its data directory snapshotted.
    /// A snapshot that fails starts the program again, so the actor serves on. The
    /// snapshot's id.
    ///
    /// # Errors
    /// Why, and whether the actor still runs here.
    pub(crate) async fn checkpoint(self: &Arc<Self>) -> Result<snapshot::Taken, CheckpointFailure> {
        let max = self.ctx.snapshot_max;
        let data = self.dir.data();
        let measured = {
            let data = data.clone();
            tokio::task::spawn_blocking(move || snapshot::measure(&data)).await
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
            let snapshots = self.snapshots.clone();
            tokio::task::spawn_blocking(move || snapshot::take(&data, &snapshots, max)).await
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
