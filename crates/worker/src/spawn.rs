//! What a program's process does between `fork` and `exec`: the one place of the
//! worker that needs `unsafe`.
//!
//! Why not without: resource limits must hold from the program's first instruction
//! (set after `exec`, a program could allocate past its memory limit first), the
//! actor directory's lock must be inherited by the program alone (cleared
//! close-on-exec in the parent, any program started at the same moment would inherit
//! it too), and the program must enter its cgroup before it runs. `pre_exec` is the
//! standard library's hook for exactly this; what runs in it is async-signal-safe:
//! raw system calls through rustix, on values prepared before the fork, with no
//! allocation.

#![allow(unsafe_code)]

use std::os::fd::{AsRawFd as _, BorrowedFd, RawFd};

use rustix::process::{Resource, Rlimit, Signal};
use valet_template::Limits;

/// Prepares `cmd` to start with `limits` applied, `lock` inherited, in the cgroup whose
/// `cgroup.procs` is open as `procs`, and killed should its worker die (its parent
/// thread: the runtime's, which lives as long as the worker).
pub(crate) fn prepare(
    cmd: &mut tokio::process::Command,
    limits: &Limits,
    lock: &std::fs::File,
    procs: Option<&std::fs::File>,
) {
    // (resource, soft, hard).
    let mut rlimits: Vec<(Resource, u64, u64)> = Vec::with_capacity(3);
    if let Some(m) = limits.memory {
        rlimits.push((Resource::As, m, m));
    }
    if let Some(t) = limits.cpu_time {
        // SIGXCPU at the limit (the program sees why), SIGKILL a second later.
        let secs = t.as_secs() + u64::from(t.subsec_nanos() > 0);
        rlimits.push((Resource::Cpu, secs, secs + 1));
    }
    if let Some(n) = limits.open_files {
        rlimits.push((Resource::Nofile, n, n));
    }
    let lock: RawFd = lock.as_raw_fd();
    let procs: Option<RawFd> = procs.map(std::os::fd::AsRawFd::as_raw_fd);
    let hook = move || -> std::io::Result<()> {
        // SAFETY: both descriptors are open in the parent for as long as the spawn
        // runs (the caller holds the files), so open in the child until exec.
        let lock = unsafe { BorrowedFd::borrow_raw(lock) };
        rustix::io::fcntl_setfd(lock, rustix::io::FdFlags::empty())?;
        if let Some(procs) = procs {
            // SAFETY: as above.
            let procs = unsafe { BorrowedFd::borrow_raw(procs) };
            rustix::io::write(procs, b"0")?;
        }
        for &(resource, soft, hard) in &rlimits {
            rustix::process::setrlimit(
                resource,
                Rlimit {
                    current: Some(soft),
                    maximum: Some(hard),
                },
            )?;
        }
        rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
        Ok(())
    };
    // SAFETY: the hook makes only async-signal-safe system calls, allocates nothing
    // and touches no lock (see the module's documentation).
    unsafe {
        cmd.pre_exec(hook);
    }
}
