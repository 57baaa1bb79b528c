//! A program that runs as an actor: started in a process group of its own in the
//! actor's live directory, ready once its probe answers, stopped with its group, and
//! never outliving a worker that died where it could still write.
//!
//! ```text
//! <run-dir>/<atespace>/<name>/
//!   lock   held (flock) by the worker hosting the actor and inherited by its program:
//!          free only once neither lives
//!   run    the run holding it: process group, run id, owner worker's pid and start
//!   data/  the data directory (VALET_DATA_DIR), restored from the snapshot
//! ```
//!
//! A restore takes the lock first; whatever still holds it (a program a SIGKILLed
//! worker left, one of a worker cut off from the control plane) is killed, and the
//! restore waits until the lock is free. A worker sweeps, when it starts, the runs
//! whose owner is dead.

use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustix::process::Signal;
use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use valet_template::{Probe, Program, Protocol, StopSignal};

use crate::group::{RUN_ID_ENV, Run};
use crate::limits::{Cgroup, ProgramCgroup};
use crate::output::{Output, Stream, pump};

/// How long a restore waits for a stale holder of an actor's directory to die.
const TAKE_WITHIN: Duration = Duration::from_secs(5);
/// How long the processes of a run may take to die after SIGKILL.
const KILL_WITHIN: Duration = Duration::from_secs(5);
/// The pause between two readiness probes in a program's first [`PROBE_EAGER`]: a
/// refused connection costs tens of microseconds, and a program ready a pause before
/// it is noticed costs its whole restore that much.
const PROBE_PAUSE_EAGER: Duration = Duration::from_millis(2);
/// How long readiness is probed every [`PROBE_PAUSE_EAGER`].
const PROBE_EAGER: Duration = Duration::from_secs(2);
/// The longest pause between two readiness probes after that.
const PROBE_PAUSE_MAX: Duration = Duration::from_millis(20);
/// How long one readiness probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Lines of output an error about a program quotes.
pub(crate) const TAIL_LINES: usize = 10;

/// Environment variables a program inherits from the worker; every other one it gets
/// from its template (the worker's own, its credentials' paths among them, stay out).
const PASSED_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TMPDIR",
];

/// How a program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exit(pub(crate) std::process::ExitStatus);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::os::unix::process::ExitStatusExt as _;
        match (self.0.code(), self.0.signal()) {
            (Some(code), _) => write!(f, "exited with status {code}"),
            (None, Some(sig)) => {
                let name = Signal::from_named_raw(sig)
                    .map(|s| format!(" ({})", signal_name(s)))
                    .unwrap_or_default();
                write!(f, "killed by signal {sig}{name}")
            }
            (None, None) => write!(f, "ended ({})", self.0),
        }
    }
}

fn signal_name(s: Signal) -> &'static str {
    match s {
        Signal::KILL => "SIGKILL",
        Signal::TERM => "SIGTERM",
        Signal::INT => "SIGINT",
        Signal::SEGV => "SIGSEGV",
        Signal::ABORT => "SIGABRT",
        Signal::XCPU => "SIGXCPU: over limits.cpu_time",
        Signal::BUS => "SIGBUS",
        Signal::HUP => "SIGHUP",
        Signal::QUIT => "SIGQUIT",
        Signal::PIPE => "SIGPIPE",
        _ => "signal",
    }
}

pub(crate) fn stop_signal(s: StopSignal) -> Signal {
    match s {
        StopSignal::Term => Signal::TERM,
        StopSignal::Int => Signal::INT,
        StopSignal::Quit => Signal::QUIT,
        StopSignal::Hup => Signal::HUP,
        StopSignal::Usr1 => Signal::USR1,
        StopSignal::Usr2 => Signal::USR2,
    }
}

/// An actor's live directory, locked for as long as this lives (and by the program
/// started in it, which inherits the lock).
#[derive(Debug)]
pub(crate) struct ActorDir {
    path: PathBuf,
    lock: File,
}

/// The record of the run holding an actor's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RunRecord {
    run: Run,
    owner_pid: i32,
    owner_start: u64,
}

impl RunRecord {
    fn encode(&self) -> String {
        format!(
            "pgid {}\nrun {}\nowner {} {}\n",
            self.run.pgid, self.run.id, self.owner_pid, self.owner_start
        )
    }

    fn decode(text: &str) -> Option<Self> {
        let mut pgid = None;
        let mut id = None;
        let mut owner = None;
        for line in text.lines() {
            match line.split_once(' ') {
                Some(("pgid", v)) => pgid = v.parse().ok(),
                Some(("run", v)) => id = Some(v.to_owned()),
                Some(("owner", v)) => {
                    let (p, s) = v.split_once(' ')?;
                    owner = Some((p.parse().ok()?, s.parse().ok()?));
                }
                _ => {}
            }
        }
        let (owner_pid, owner_start) = owner?;
        Some(Self {
            run: Run {
                pgid: pgid?,
                id: id?,
            },
            owner_pid,
            owner_start,
        })
    }

    /// Whether the worker process that started the run still lives.
    fn owner_alive(&self) -> bool {
        crate::group::start_time(self.owner_pid) == Some(self.owner_start)
    }
}

fn read_record(dir: &Path) -> Option<RunRecord> {
    RunRecord::decode(&std::fs::read_to_string(dir.join("run")).ok()?)
}

impl ActorDir {
    /// Takes the live directory of `atespace/name` under `root`, killing whatever
    /// still holds it and waiting (up to [`TAKE_WITHIN`]) until it is free.
    ///
    /// # Errors
    /// When it cannot be created, or stays held.
    pub(crate) async fn take(root: &Path, atespace: &str, name: &str) -> Result<Self, String> {
        let path = root.join(atespace).join(name);
        let actor = format!("{atespace}/{name}");
        let lock = {
            let dir = path.clone();
            tokio::task::spawn_blocking(move || {
                let path = dir;
                crate::app::create_dir_durably(&path)?;
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(path.join("lock"))
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("{}: {e}", path.display()))?
        };
        let until = tokio::time::Instant::now() + TAKE_WITHIN;
        let mut warned = false;
        loop {
            match lock.try_lock() {
                Ok(()) => {
                    // Free: no worker hosts the actor here. But processes of an earlier
                    // run that closed their copy of the lock may live on (their worker
                    // died, or their leader crashed): they are killed all the same.
                    if let Some(rec) = read_record(&path)
                        && let Err(left) = rec.run.kill_all(KILL_WITHIN).await
                    {
                        return Err(format!(
                            "processes {left:?} of an earlier run of actor {actor} survive SIGKILL"
                        ));
                    }
                    return Ok(Self { path, lock });
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(format!("locking {}: {e}", path.display()));
                }
                Err(std::fs::TryLockError::WouldBlock) => {}
            }
            let record = read_record(&path);
            if let Some(rec) = &record {
                if !warned {
                    warned = true;
                    tracing::warn!(
                        %actor,
                        pgid = rec.run.pgid,
                        owner_pid = rec.owner_pid,
                        owner_alive = rec.owner_alive(),
                        "the actor's directory is held by an earlier run of its program; killing it"
                    );
                }
                let _ = rec.run.kill_all(Duration::ZERO).await;
            }
            if tokio::time::Instant::now() >= until {
                let who = record
                    .map(|r| format!(" (process group {}, left: {:?})", r.run.pgid, r.run.live()))
                    .unwrap_or_default();
                return Err(format!(
                    "the directory of actor {actor} ({}) is still locked by another process{who}",
                    path.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The program's data directory.
    pub(crate) fn data(&self) -> PathBuf {
        self.path.join("data")
    }

    fn record(&self, run: &Run) -> io::Result<()> {
        let me = rustix::process::getpid().as_raw_nonzero().get();
        let rec = RunRecord {
            run: run.clone(),
            owner_pid: me,
            owner_start: crate::group::start_time(me).unwrap_or(0),
        };
        crate::app::write_atomically(&self.path.join("run"), rec.encode().as_bytes())
    }
}

/// Kills, under `root`, the runs whose worker died (SIGKILL, a crash): a worker calls
/// it when it starts, before it attaches. Runs of live workers are left alone. The
/// number of runs killed.
pub(crate) async fn sweep(root: &Path) -> usize {
    let root = root.to_owned();
    let stale = tokio::task::spawn_blocking(move || {
        let mut stale = Vec::new();
        let Ok(spaces) = std::fs::read_dir(&root) else {
            return stale;
        };
        for space in spaces.flatten() {
            let Ok(actors) = std::fs::read_dir(space.path()) else {
                continue;
            };
            for actor in actors.flatten() {
                if let Some(rec) = read_record(&actor.path())
                    && !rec.owner_alive()
                    && !rec.run.live().is_empty()
                {
                    stale.push((actor.path(), rec));
                }
            }
        }
        stale
    })
    .await
    .unwrap_or_default();
    let n = stale.len();
    for (dir, rec) in stale {
        tracing::warn!(dir = %dir.display(), pgid = rec.run.pgid, "killing a program left running by a worker that died");
        if let Err(left) = rec.run.kill_all(KILL_WITHIN).await {
            tracing::warn!(dir = %dir.display(), ?left, "processes of a program left by a dead worker survive SIGKILL");
        }
    }
    n
}

/// A free loopback port for a program (it binds it moments later).
fn free_port() -> io::Result<u16> {
    std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()
        .map(|a| a.port())
}

/// One run of a program.
#[derive(Debug)]
pub(crate) struct Running {
    run: Run,
    leader: i32,
    addr: SocketAddr,
    exit: watch::Receiver<Option<Exit>>,
    tasks: TaskTracker,
    _cgroup: Option<ProgramCgroup>,
}

/// What a program's start needs besides its template.
pub(crate) struct Launch<'a> {
    pub(crate) actor: &'a str,
    pub(crate) dir: &'a Arc<ActorDir>,
    pub(crate) output: &'a Arc<Output>,
    pub(crate) cgroup: Option<&'a Cgroup>,
}

impl Running {
    /// Starts `spec` for `launch.actor` in its own process group, its output pumped into
    /// the actor's output.
    ///
    /// # Errors
    /// When it cannot be started, saying why.
    pub(crate) async fn spawn(spec: &Program, launch: &Launch<'_>) -> Result<Self, String> {
        // What touches the disk (PATH, the cgroup) off the runtime; the spawn itself on
        // it: the program's death signal follows the thread that starts it, and the
        // runtime's threads live as long as the worker.
        let (exe, port, cgroup) = {
            let (program, actor) = (spec.clone(), launch.actor.to_owned());
            let cgroup = launch.cgroup.cloned();
            tokio::task::spawn_blocking(move || {
                let exe = program.executable()?;
                let port = free_port().map_err(|e| format!("no free loopback port: {e}"))?;
                let cgroup = match cgroup {
                    Some(c) => Some(c.for_program(&actor, &program.limits)?),
                    None => None,
                };
                Ok::<_, String>((exe, port, cgroup))
            })
            .await
            .map_err(|e| e.to_string())??
        };
        let data = launch.dir.data();
        let argv = spec.argv(port, &data);
        let run_id = format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg0(&argv[0]).args(&argv[1..]);
        if let Some(dir) = &spec.dir {
            cmd.current_dir(dir);
        }
        cmd.env_clear();
        for key in PASSED_ENV {
            if let Some(v) = std::env::var_os(key) {
                cmd.env(key, v);
            }
        }
        cmd.envs(&spec.env)
            .env("PORT", port.to_string())
            .env("VALET_DATA_DIR", &data)
            .env("VALET_ACTOR", launch.actor)
            .env(RUN_ID_ENV, &run_id)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        crate::spawn::prepare(
            &mut cmd,
            &spec.limits,
            &launch.dir.lock,
            cgroup.as_ref().map(ProgramCgroup::procs),
        );
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
        let leader = child.id().map_or(0, |id| id as i32);
        crate::group::LEADERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(leader);
        let run = Run {
            pgid: leader,
            id: run_id,
        };
        let recorded = {
            let (dir, run) = (Arc::clone(launch.dir), run.clone());
            tokio::task::spawn_blocking(move || dir.record(&run)).await
        };
        if let Ok(Err(e)) = recorded {
            tracing::warn!(actor = %launch.actor, error = %e, "could not record the program's run in its directory");
        }
        let tasks = TaskTracker::new();
        if let Some(out) = child.stdout.take() {
            let output = Arc::clone(launch.output);
            tasks.spawn(async move { pump(out, Stream::Stdout, &output).await });
        }
        if let Some(err) = child.stderr.take() {
            let output = Arc::clone(launch.output);
            tasks.spawn(async move { pump(err, Stream::Stderr, &output).await });
        }
        let (exit_tx, exit) = watch::channel(None);
        tasks.spawn(async move {
            let status = child.wait().await;
            crate::group::LEADERS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|&p| p != leader);
            let exit = match status {
                Ok(s) => Exit(s),
                Err(e) => {
                    tracing::warn!(error = %e, "could not wait for a program");
                    use std::os::unix::process::ExitStatusExt as _;
                    Exit(std::process::ExitStatus::from_raw(255 << 8))
                }
            };
            exit_tx.send_replace(Some(exit));
        });
        tasks.close();
        launch.output.note(&format!(
            "started {} (pid {leader}, port {port})",
            argv.join(" ")
        ));
        Ok(Self {
            run,
            leader,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            exit,
            tasks,
            _cgroup: cgroup,
        })
    }

    /// Where it should answer.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its leader's pid (its process group).
    pub(crate) fn pid(&self) -> i32 {
        self.leader
    }

    /// Whether the kernel killed it for going over its cgroup's `memory.max`.
    pub(crate) fn oom_killed(&self) -> bool {
        self._cgroup.as_ref().is_some_and(ProgramCgroup::oom_killed)
    }

    /// How it ended, once it has.
    pub(crate) fn exit(&self) -> Option<Exit> {
        *self.exit.borrow()
    }

    /// Resolves when its leader has exited (and its output has been read to its end,
    /// so that an error quoting it quotes its last words).
    pub(crate) async fn exited(&self) -> Exit {
        let mut rx = self.exit.clone();
        let exit = match rx.wait_for(Option::is_some).await {
            Ok(e) => e.expect("waited for"),
            Err(_) => return Exit(std::os::unix::process::ExitStatusExt::from_raw(255 << 8)),
        };
        // Its output pipes end with it, unless a child of it holds them: bounded.
        let _ = tokio::time::timeout(Duration::from_millis(200), self.tasks.wait()).await;
        exit
    }

    /// Probes it until it is ready, it exits, or `spec.start_timeout` passes.
    ///
    /// # Errors
    /// Why it is not ready.
    pub(crate) async fn until_ready(&self, spec: &Program) -> Result<(), String> {
        let started = tokio::time::Instant::now();
        let deadline = started + spec.start_timeout;
        let mut pause = Duration::from_millis(1);
        let mut last: Option<String> = None;
        loop {
            let within =
                PROBE_TIMEOUT.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            let attempt =
                tokio::time::timeout(within, probe(self.addr, &spec.ready, spec.protocol));
            tokio::select! {
                exit = self.exited() => return Err(format!("its program {exit} before it was ready")),
                r = attempt => match r {
                    Ok(Ok(())) => return Ok(()),
                    Ok(Err(why)) => last = Some(why),
                    // Cut by the deadline, an attempt says less than the one before.
                    Err(_) if within < PROBE_TIMEOUT && last.is_some() => {}
                    Err(_) => last = Some(format!("{} did not answer within {within:?}", spec.ready)),
                },
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "its program was not ready within {:?} (start_timeout): {} (does it listen on 127.0.0.1:$PORT, {}?)",
                    spec.start_timeout,
                    last.as_deref().unwrap_or("no probe was answered"),
                    self.addr.port()
                ));
            }
            tokio::select! {
                exit = self.exited() => return Err(format!("its program {exit} before it was ready")),
                () = tokio::time::sleep(pause.min(deadline.saturating_duration_since(tokio::time::Instant::now()))) => {}
            }
            let cap = if started.elapsed() < PROBE_EAGER {
                PROBE_PAUSE_EAGER
            } else {
                PROBE_PAUSE_MAX
            };
            pause = (pause * 3 / 2).min(cap);
        }
    }

    /// Stops the run: `signal` to every process of it, SIGKILL to those left after
    /// `grace`, and waits until none is left. How its leader ended.
    ///
    /// # Errors
    /// When processes of it survive SIGKILL.
    pub(crate) async fn stop(&self, signal: Signal, grace: Duration) -> Result<Exit, String> {
        let run = self.run.clone();
        let _ = tokio::task::spawn_blocking(move || run.signal(signal)).await;
        let ended = tokio::time::timeout(grace, async {
            self.exited().await;
            // Then the rest of its group (children that got the signal too).
            let mut pause =
                valet_net::Backoff::new(Duration::from_millis(1)).cap(Duration::from_millis(50));
            loop {
                let run = self.run.clone();
                let left = tokio::task::spawn_blocking(move || run.live())
                    .await
                    .unwrap_or_default();
                if left.is_empty() {
                    return;
                }
                tokio::time::sleep(pause.next_delay()).await;
            }
        })
        .await;
        if ended.is_err() {
            if let Some(c) = &self._cgroup {
                c.kill();
            }
            tracing::warn!(
                pgid = self.run.pgid,
                ?grace,
                signal = signal_name(signal),
                "the program did not stop within its stop_grace; killing its processes"
            );
        }
        self.run
            .kill_all(KILL_WITHIN)
            .await
            .map_err(|left| format!("processes {left:?} of its program are alive after SIGKILL"))?;
        Ok(self.exited().await)
    }
}

impl Running {
    /// Kills the run at once, whole (its cgroup too, with one), and waits until none
    /// of its processes is left.
    ///
    /// # Errors
    /// The processes that survive SIGKILL.
    pub(crate) async fn kill(&self) -> Result<(), Vec<i32>> {
        if let Some(c) = &self._cgroup {
            c.kill();
        }
        self.run.kill_all(KILL_WITHIN).await
    }

    /// Its exit, as it is published.
    pub(crate) fn exit_watch(&self) -> watch::Receiver<Option<Exit>> {
        self.exit.clone()
    }
}

impl Drop for Running {
    /// The last resort for a run given up without a stop or a kill (a restore whose
    /// future was dropped): SIGKILL to what is left of it, off the runtime.
    fn drop(&mut self) {
        if let Some(c) = &self._cgroup {
            c.kill();
        }
        let run = self.run.clone();
        let signal = move || {
            run.signal(Signal::KILL);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(signal)),
            Err(_) => signal(),
        }
    }
}

/// One readiness probe of a program at `addr`.
async fn probe(addr: SocketAddr, probe: &Probe, protocol: Protocol) -> Result<(), String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let path = match probe {
        Probe::Tcp => return Ok(()),
        Probe::Http { path, .. } => path,
    };
    let _ = stream.set_nodelay(true);
    let io = hyper_util::rt::TokioIo::new(stream);
    let req = http::Request::get(path.as_str())
        .header(http::header::HOST, addr.to_string())
        .header(http::header::USER_AGENT, "valet-probe")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let status = match protocol {
        Protocol::Http1 => {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| format!("{probe}: {e}"))?;
            let conn = tokio::spawn(conn);
            let r = send.send_request(req).await;
            conn.abort();
            r
        }
        Protocol::H2c => {
            let (mut send, conn) =
                hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                    .await
                    .map_err(|e| format!("{probe} (h2c): {e}"))?;
            let conn = tokio::spawn(conn);
            let mut req = req;
            *req.uri_mut() = format!("http://{addr}{path}")
                .parse()
                .map_err(|e| format!("{e}"))?;
            let r = send.send_request(req).await;
            conn.abort();
            r
        }
    }
    .map_err(|e| format!("{probe}: {e}"))?
    .status();
    if probe.ready_with(status.as_u16()) {
        Ok(())
    } else {
        Err(format!("{probe} answered {status}"))
    }
}
