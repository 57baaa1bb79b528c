//! A throwaway PostgreSQL server for tests and load scenarios (feature `tempdb`): `initdb` and `pg_ctl`
//! in a temporary directory, on a free loopback port, stopped and removed on drop.
//! Run as root (CI containers), the server runs as the `postgres` user, since
//! PostgreSQL refuses to run as root.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A running throwaway server.
#[derive(Debug)]
pub struct TempPostgres {
    ctl: PgCtl,
}

/// Where a server lives and how its tools run; [`TempPostgres`] removes it on drop.
#[derive(Debug, Clone)]
struct PgCtl {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    as_postgres: bool,
}

/// Where `initdb` and `pg_ctl` are: `VALET_PG_BIN`, else the newest
/// `/usr/lib/postgresql/*/bin` (Debian), else `PATH`.
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("VALET_PG_BIN") {
        return dir.into();
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    versions.retain(|p| p.join("initdb").exists());
    // By version number (`9.6` < `15`), not by name.
    versions.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .map(|v| {
                v.split('.')
                    .map(|n| n.parse::<u32>().unwrap_or(0))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    });
    versions.pop().unwrap_or_default()
}

/// Whether `initdb` can be found where [`TempPostgres::start`] looks; the error says
/// how to install it.
///
/// # Errors
/// When it cannot be found.
pub fn installed() -> Result<(), String> {
    let bin = bin_dir();
    let found = if bin.as_os_str().is_empty() {
        std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("initdb").is_file()))
    } else {
        bin.join("initdb").is_file()
    };
    if found {
        Ok(())
    } else {
        Err("PostgreSQL's initdb was not found (VALET_PG_BIN, /usr/lib/postgresql/*/bin, PATH); install it (Debian: apt-get install postgresql-15)".into())
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

impl TempPostgres {
    /// Starts a server (blocking: call it on the blocking pool, see
    /// [`TempPostgres::start_async`]).
    ///
    /// # Panics
    /// When PostgreSQL is not installed or does not start (the message says which
    /// step failed and how to install it).
    pub fn start() -> Self {
        Self::start_trying(free_port())
    }

    /// [`TempPostgres::start`], trying `port` first: a port another process has
    /// taken is passed over for a free one.
    ///
    /// # Panics
    /// As [`TempPostgres::start`].
    pub fn start_trying(port: u16) -> Self {
        let bin = bin_dir();
        let as_postgres = is_root();
        reap_orphans(&bin, as_postgres);
        let dir = std::env::temp_dir().join(format!(
            "valet-pg-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).expect("a temporary directory for PostgreSQL");
        // Owned from here on: a panic below (a failed initdb, a start that timed out)
        // still stops whatever started and removes the directory.
        let mut this = Self {
            ctl: PgCtl {
                dir,
                bin,
                port,
                as_postgres,
            },
        };
        let server = &mut this.ctl;
        if as_postgres {
            let ok = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&server.dir)
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok,
                "chown postgres {}: is PostgreSQL installed?",
                server.dir.display()
            );
        }
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                path(&data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            ],
        );
        // The port was free when `free_port` let go of it; another process may take
        // it before the server binds it: then another port, a few times.
        let log = server.log();
        for attempt in 1.. {
            match server.pg_start() {
                Ok(()) => break,
                Err(e) => {
                    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
                    let taken = log_text.contains("already in use");
                    // The log goes with the directory: quote it.
                    assert!(
                        taken && attempt < PORT_ATTEMPTS,
                        "{e}\nserver log:\n{log_text}"
                    );
                    let _ = std::fs::remove_file(&log);
                    server.port = free_port();
                }
            }
        }
        this
    }

    /// Stops the server as for a restart: every session is ended, what was committed
    /// is written out (the server runs without `fsync` and synchronous commits, so an
    /// immediate stop would lose the last commits, which a real one would not).
    ///
    /// # Panics
    /// When it does not stop.
    pub async fn stop(&self) {
        let ctl = self.ctl.clone();
        tokio::task::spawn_blocking(move || {
            let data = ctl.data();
            ctl.run("pg_ctl", &["-D", path(&data), "-m", "fast", "-w", "stop"]);
        })
        .await
        .expect("PostgreSQL stops");
    }

    /// Starts the server again after [`Self::stop`], on the same port.
    ///
    /// # Panics
    /// When it does not start (the port was taken meanwhile).
    pub async fn start_again(&self) {
        let ctl = self.ctl.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = ctl.pg_start() {
                panic!("PostgreSQL did not start again: {e}");
            }
        })
        .await
        .expect("PostgreSQL starts");
    }

    /// [`TempPostgres::start`] on the blocking pool.
    pub async fn start_async() -> Self {
        tokio::task::spawn_blocking(Self::start)
            .await
            .expect("PostgreSQL starts")
    }

    /// A URL of database `postgres` as user `postgres` (trust authentication).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.ctl.port)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.ctl.port
    }
}

impl PgCtl {
    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn run(&self, tool: &str, args: &[&str]) {
        if let Err(e) = self.try_run(tool, args) {
            panic!("{e}");
        }
    }

    fn try_run(&self, tool: &str, args: &[&str]) -> Result<(), String> {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        let out = cmd.args(args).output().unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}): install PostgreSQL (Debian: apt-get install postgresql-15) or set VALET_PG_BIN",
                exe.display()
            )
        });
        if out.status.success() {
            return Ok(());
        }
        Err(format!(
            "{tool} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }

    fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// Starts the server on its data directory and port.
    fn pg_start(&self) -> Result<(), String> {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200",
            self.port,
            self.dir.display()
        );
        let (data, log) = (self.data(), self.log());
        self.try_run(
            "pg_ctl",
            &[
                "-D",
                path(&data),
                "-l",
                path(&log),
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        )
    }
}

/// How many ports [`TempPostgres::start`] tries before it gives up.
const PORT_ATTEMPTS: u32 = 5;

/// Servers left by test processes that were killed before dropping theirs (a
/// timed-out test): stopped, their directories removed.
fn reap_orphans(bin: &Path, as_postgres: bool) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("valet-pg-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let orphan = TempPostgres {
            ctl: PgCtl {
                dir: entry.path(),
                bin: bin.to_owned(),
                port: 0,
                as_postgres,
            },
        };
        drop(orphan);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("temporary paths are UTF-8")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        let data = self.ctl.data();
        let stop = ["-D", path(&data), "-m", "immediate", "-w", "stop"];
        let exe = self.ctl.bin.join("pg_ctl");
        let _ = if self.ctl.as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(stop)
                .output()
        } else {
            Command::new(&exe).args(stop).output()
        };
        let _ = std::fs::remove_dir_all(&self.ctl.dir);
    }
}
