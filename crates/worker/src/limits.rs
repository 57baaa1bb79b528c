//! Whether a template's limits can be applied here, and the cgroup v2 a worker puts
//! its programs in when it is given one (`--cgroup`).
//!
//! Resource limits (`RLIMIT_AS`, `RLIMIT_CPU`, `RLIMIT_NOFILE`) work everywhere.
//! `memory.max` and `cpu.max` need a cgroup v2 directory delegated to the worker
//! (writable, with `memory` and `cpu` in its `cgroup.subtree_control`): the worker
//! makes one child cgroup per program in it. A CPU share (`limits.cpu`) has no
//! resource-limit equivalent: a template asking for one is refused where the worker
//! has no such cgroup.

use std::path::{Path, PathBuf};

use valet_template::{Limits, Template};

/// A cgroup v2 directory delegated to the worker.
#[derive(Debug, Clone)]
pub struct Cgroup {
    dir: PathBuf,
    /// The controllers enabled for its children.
    controllers: Vec<String>,
}

impl Cgroup {
    /// The delegated cgroup at `dir`.
    ///
    /// # Errors
    /// When `dir` is not a cgroup v2 directory, or enables neither `memory` nor `cpu`
    /// for its children, saying which.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let subtree = std::fs::read_to_string(dir.join("cgroup.subtree_control")).map_err(|e| {
            format!(
                "--cgroup {}: not a cgroup v2 directory ({}: {e})",
                dir.display(),
                dir.join("cgroup.subtree_control").display()
            )
        })?;
        let controllers: Vec<String> = subtree.split_whitespace().map(str::to_owned).collect();
        if !controllers.iter().any(|c| c == "memory" || c == "cpu") {
            return Err(format!(
                "--cgroup {}: its cgroup.subtree_control enables neither memory nor cpu (it has: {:?}); write \"+memory +cpu\" to it",
                dir.display(),
                subtree.trim()
            ));
        }
        Ok(Self {
            dir: dir.to_owned(),
            controllers,
        })
    }

    fn has(&self, controller: &str) -> bool {
        self.controllers.iter().any(|c| c == controller)
    }

    /// A child cgroup for `actor`'s program, with its limits written.
    ///
    /// # Errors
    /// When it cannot be made or written.
    pub(crate) fn for_program(
        &self,
        actor: &str,
        limits: &Limits,
    ) -> Result<ProgramCgroup, String> {
        let dir = self.dir.join(format!(
            "valet-{}-{:08x}",
            actor.replace('/', "."),
            rand::random::<u32>()
        ));
        let e =
            |what: &str, err: std::io::Error| format!("cgroup {}: {what}: {err}", dir.display());
        std::fs::create_dir(&dir).map_err(|x| e("creating", x))?;
        let mut cg = ProgramCgroup {
            procs: None,
            dir: dir.clone(),
        };
        if let Some(m) = limits.memory
            && self.has("memory")
        {
            std::fs::write(dir.join("memory.max"), m.to_string())
                .map_err(|x| e("memory.max", x))?;
            let _ = std::fs::write(dir.join("memory.swap.max"), "0");
        }
        if let Some(cpu) = limits.cpu {
            let period = 100_000u64;
            let quota = ((cpu * period as f64).round() as u64).max(1000);
            std::fs::write(dir.join("cpu.max"), format!("{quota} {period}"))
                .map_err(|x| e("cpu.max", x))?;
        }
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"))
            .map_err(|x| e("cgroup.procs", x))?;
        cg.procs = Some(procs);
        Ok(cg)
    }
}

/// One program's cgroup, removed when dropped (its processes are gone by then).
#[derive(Debug)]
pub(crate) struct ProgramCgroup {
    procs: Option<std::fs::File>,
    dir: PathBuf,
}

impl ProgramCgroup {
    pub(crate) fn procs(&self) -> &std::fs::File {
        self.procs.as_ref().expect("set once made")
    }

    /// Kills every process in it (`cgroup.kill`, Linux 5.14 and later; where it is
    /// missing, the run's own kill does the work).
    pub(crate) fn kill(&self) {
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
    }

    /// Whether the kernel killed its program for memory (`memory.events`).
    pub(crate) fn oom_killed(&self) -> bool {
        std::fs::read_to_string(self.dir.join("memory.events"))
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| {
                    l.strip_prefix("oom_kill ")
                        .and_then(|n| n.trim().parse::<u64>().ok())
                })
            })
            .is_some_and(|n| n > 0)
    }
}

impl Drop for ProgramCgroup {
    fn drop(&mut self) {
        self.procs = None;
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Whether this worker can run `template`: its program is there and executable, and
/// every limit it asks for can be applied here.
///
/// # Errors
/// Why not, naming the template.
pub fn check(template: &Template, cgroup: Option<&Cgroup>) -> Result<(), String> {
    let Some(program) = template.program() else {
        return Ok(());
    };
    let name = template.name();
    program
        .check_runnable()
        .map_err(|e| format!("template {name}: {e}"))?;
    let limits = &program.limits;
    if limits.cpu.is_some() {
        match cgroup {
            Some(c) if c.has("cpu") => {}
            Some(c) => {
                return Err(format!(
                    "template {name}: limits.cpu needs the cgroup v2 cpu controller, which --cgroup {} does not enable for its children",
                    c.dir.display()
                ));
            }
            None => {
                return Err(format!(
                    "template {name}: limits.cpu needs a cgroup v2 with the cpu controller delegated to the worker (--cgroup DIR), and this worker has none"
                ));
            }
        }
    }
    if let Some(n) = limits.open_files {
        let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
        if hard.is_some_and(|h| n > h) {
            return Err(format!(
                "template {name}: limits.open_files {n} is over this worker's own hard limit ({})",
                hard.unwrap_or_default()
            ));
        }
    }
    Ok(())
}
