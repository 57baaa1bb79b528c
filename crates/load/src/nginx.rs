//! nginx as a reference proxy (`proxy_pass` to one worker), when it is on PATH: the
//! scenario writes its own config into a temporary directory and runs it there.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

/// A running nginx, in a process group of its own; [`Nginx::stop`] stops it, and a
/// drop (an error, a panic, Ctrl-C) kills the group: the master and its workers.
#[derive(Debug)]
pub struct Nginx {
    /// Where it listens.
    pub addr: SocketAddr,
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Nginx {
    /// Starts nginx proxying every request to `worker` with `x-actor-ref: actor`;
    /// `None` when there is no nginx on PATH.
    ///
    /// # Errors
    /// When nginx is there but does not start.
    pub async fn start(worker: SocketAddr, actor: &str) -> Result<Option<Self>, String> {
        let Some(exe) = which("nginx") else {
            return Ok(None);
        };
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let conf = format!(
            "worker_processes auto;\ndaemon off;\nerror_log stderr error;\npid {pid};\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n  access_log off;\n  upstream worker {{ server {worker}; keepalive 128; }}\n\
               server {{\n    listen {addr};\n    location / {{\n      proxy_pass http://worker;\n\
                 proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n\
                 proxy_set_header x-actor-ref {actor};\n    }}\n  }}\n}}\n",
            pid = dir.path().join("nginx.pid").display(),
        );
        std::fs::write(dir.path().join("nginx.conf"), conf).map_err(|e| e.to_string())?;
        let child = tokio::process::Command::new(exe)
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(dir.path().join("nginx.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("nginx: {e}"))?;
        // Owned from here on: failing to start below kills the whole group too.
        let nginx = Self {
            addr,
            child,
            _dir: dir,
        };
        let up = async {
            loop {
                if tokio::net::TcpStream::connect(addr).await.is_ok() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), up)
            .await
            .map_err(|_| "nginx did not start listening".to_owned())?;
        Ok(Some(nginx))
    }
}

impl Nginx {
    /// Stops nginx and its workers (SIGTERM to the master, then waits, bounded).
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = tokio::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            self.kill_group();
            let _ = self.child.wait().await;
        }
    }
}

impl Nginx {
    /// SIGKILL to the master and its workers.
    fn kill_group(&self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // `kill_on_drop` alone would leave the workers running, holding the port.
        if let Ok(None) = self.child.try_wait() {
            self.kill_group();
        }
    }
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dropping a running nginx ends its whole process group, workers included.
    #[tokio::test]
    async fn a_dropped_nginx_leaves_no_process_behind() {
        let worker: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let Some(nginx) = Nginx::start(worker, "demo/p1").await.unwrap() else {
            progress!("no nginx on PATH: nothing to check");
            return;
        };
        let group = format!("-{}", nginx.child.id().unwrap());
        let alive = |group: &str| {
            std::process::Command::new("kill")
                .args(["-0", "--", group])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        assert!(alive(&group), "nginx runs in its own group");
        drop(nginx);
        let gone = async {
            while alive(&group) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .expect("no process of the group is left");
    }
}
