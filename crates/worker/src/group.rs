//! The processes of one program run: its process group, and any process that carries
//! the run's `VALET_RUN_ID` in its environment (a child that left the group with
//! `setsid` but kept its environment). Read from `/proc`; signalled by pid, after
//! checking the pid still belongs to the run (pids are reused).

use std::time::Duration;

use rustix::process::{Pid, Signal};

/// The environment variable that marks every process of one program run.
pub(crate) const RUN_ID_ENV: &str = "VALET_RUN_ID";

/// A process of a run, as `/proc` showed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Member {
    pub(crate) pid: i32,
    ppid: i32,
    zombie: bool,
}

/// One program run: its process group (the leader's pid) and its run id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) pgid: i32,
    pub(crate) id: String,
}

/// `(state, ppid, pgrp, starttime)` from `/proc/<pid>/stat`.
fn stat(pid: i32) -> Option<(char, i32, i32, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let ppid = fields.get(1)?.parse().ok()?;
    let pgrp = fields.get(2)?.parse().ok()?;
    // Field 22 of the whole line; the 20th after the command.
    let start = fields.get(19)?.parse().ok()?;
    Some((state, ppid, pgrp, start))
}

/// When process `pid` started (clock ticks since boot), if it exists: with its pid, it
/// names one process for good.
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    stat(pid).map(|(_, _, _, start)| start)
}

fn carries(pid: i32, marker: &[u8]) -> bool {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|env| env.split(|&b| b == 0).any(|kv| kv == marker))
        .unwrap_or(false)
}

impl Run {
    fn marker(&self) -> Vec<u8> {
        format!("{RUN_ID_ENV}={}", self.id).into_bytes()
    }

    /// Every process of the run now, zombies included. A group whose processes none
    /// carries the run id is another's (its pid was reused): not the run's.
    pub(crate) fn members(&self) -> Vec<Member> {
        let marker = self.marker();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut in_group = Vec::new();
        let mut marked = Vec::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            let Some((state, ppid, pgrp, _)) = stat(pid) else {
                continue;
            };
            let member = Member {
                pid,
                ppid,
                zombie: matches!(state, 'Z' | 'X' | 'x'),
            };
            let has_marker = !member.zombie && carries(pid, &marker);
            if pgrp == self.pgid {
                in_group.push((member, has_marker));
            } else if has_marker {
                marked.push(member);
            }
        }
        // A zombie's environment is gone: a group of zombies only is the run's if
        // its leader is (a zombie leader is the worker's own child, not reaped yet).
        let group_is_ours = in_group.iter().any(|(_, m)| *m)
            || in_group.iter().all(|(m, _)| {
                m.zombie && m.ppid == rustix::process::getpid().as_raw_nonzero().get()
            });
        if group_is_ours {
            marked.extend(in_group.into_iter().map(|(m, _)| m));
        }
        marked
    }

    /// The run's live processes (zombies cannot write: they do not count).
    pub(crate) fn live(&self) -> Vec<i32> {
        self.members()
            .into_iter()
            .filter(|m| !m.zombie)
            .map(|m| m.pid)
            .collect()
    }

    /// Sends `signal` to every live process of the run; the pids signalled.
    pub(crate) fn signal(&self, signal: Signal) -> Vec<i32> {
        let live = self.live();
        for &pid in &live {
            if let Some(pid) = Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, signal);
            }
        }
        live
    }

    /// Reaps the run's zombies that are this process's children, but its leader (a
    /// child the runtime waits for, and reaps, itself).
    fn reap(&self) {
        let me = rustix::process::getpid().as_raw_nonzero().get();
        for m in self.members() {
            if m.zombie
                && m.ppid == me
                && m.pid != self.pgid
                && let Some(pid) = Pid::from_raw(m.pid)
            {
                let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG);
            }
        }
    }

    /// SIGKILLs the run and waits, up to `within`, until none of its processes lives;
    /// the pids still alive then.
    ///
    /// # Errors
    /// The pids left (a process stuck in the kernel, say).
    pub(crate) async fn kill_all(&self, within: Duration) -> Result<(), Vec<i32>> {
        let until = tokio::time::Instant::now() + within;
        let mut pause =
            valet_net::Backoff::new(Duration::from_millis(1)).cap(Duration::from_millis(50));
        loop {
            let run = self.clone();
            let left = tokio::task::spawn_blocking(move || {
                let left = run.signal(Signal::KILL);
                run.reap();
                left
            })
            .await
            .unwrap_or_default();
            if left.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= until {
                return Err(left);
            }
            tokio::time::sleep(pause.next_delay()).await;
        }
    }
}

/// The leaders of the programs this process runs: its own children, which the runtime
/// waits for. [`reap_orphans`] never reaps them.
pub(crate) static LEADERS: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// Reaps this process's zombie children that are not program leaders: the orphans it
/// adopts as a container's PID 1 (a program's children whose parent exited). The number
/// reaped.
pub(crate) fn reap_orphans() -> usize {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut reaped = 0;
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Some((state, ppid, _, _)) = stat(pid) else {
            continue;
        };
        let leader = LEADERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&pid);
        if state == 'Z'
            && ppid == me
            && !leader
            && let Some(p) = Pid::from_raw(pid)
            && rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG).is_ok()
        {
            reaped += 1;
        }
    }
    reaped
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group with a child that left it (setsid) is found by its run id, and killed
    /// whole; a group without the run id is not the run's.
    #[tokio::test]
    async fn a_run_is_its_group_and_what_carries_its_id() {
        use std::os::unix::process::CommandExt as _;
        let id = format!("test-{:016x}", rand::random::<u64>());
        let mut child = std::process::Command::new("sh")
            .args(["-c", "setsid sleep 300 & sleep 300 & wait"])
            .env(RUN_ID_ENV, &id)
            .process_group(0)
            .spawn()
            .unwrap();
        let run = Run {
            pgid: child.id() as i32,
            id: id.clone(),
        };
        let mut found = Vec::new();
        for _ in 0..500 {
            found = run.live();
            if found.len() >= 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            found.len(),
            3,
            "sh, its sleep, and the one that left: {found:?}"
        );
        let other = Run {
            pgid: child.id() as i32,
            id: "another-run".into(),
        };
        assert!(other.live().is_empty(), "the pid is not the other run's");
        run.kill_all(Duration::from_secs(10)).await.unwrap();
        assert!(run.live().is_empty());
        let _ = child.wait();
    }
}
