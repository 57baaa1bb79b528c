//! Process signals.

use std::future::Future;

/// Resolves at the first SIGTERM or SIGINT; until then, every SIGHUP re-reads every
/// certificate, key, CA and verification-key file ([`valet_proto::reload::reload_all`]).
/// A second SIGTERM or SIGINT after it exits the process at once, with status 143 or
/// 130 (128 + the signal's number, as a shell reports a process the signal ended).
/// The handlers are installed when this is called, not when the future is first polled:
/// call it before printing the `listening` lines, so that a supervisor's SIGTERM (or a
/// rotation's SIGHUP) right after them is handled instead of killing the process.
pub(crate) fn terminated() -> impl Future<Output = ()> + Send + 'static {
    signals(true)
}

/// As [`terminated`], but a second signal does nothing: for a command that started
/// processes of its own (`valet load`), which only its clean stop stops.
pub(crate) fn terminated_without_force() -> impl Future<Output = ()> + Send + 'static {
    signals(false)
}

/// Set by a process that starts `valet` parts of its own (`valet load`) and gives each
/// a pipe on stdin that it never writes to: when that process is gone (even killed
/// with SIGKILL), the pipe ends, and the part stops as on SIGTERM instead of running on.
pub(crate) const STOP_WITH_PARENT: &str = "VALET_STOP_WITH_PARENT";

/// Whether [`STOP_WITH_PARENT`] asks for it: `1` or `true` (any case); `0`, `false`,
/// empty or unset do not, as with the boolean `VALET_…` flags.
fn stop_with_parent(value: Option<&std::ffi::OsStr>) -> bool {
    value
        .and_then(std::ffi::OsStr::to_str)
        .is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Resolves once stdin ends, when [`STOP_WITH_PARENT`] is set; never otherwise. Read on
/// a thread of its own, which never holds the process's exit.
fn parent_gone() -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if stop_with_parent(std::env::var_os(STOP_WITH_PARENT).as_deref()) {
        std::thread::spawn(move || {
            use std::io::Read as _;
            let mut stdin = std::io::stdin();
            let mut buf = [0u8; 64];
            while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
            let _ = tx.send(());
        });
    } else {
        // Kept, so the receiver waits for good.
        std::mem::forget(tx);
    }
    rx
}

fn signals(force_on_second: bool) -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    let hup = signal(SignalKind::hangup());
    let parent_gone = parent_gone();
    async move {
        // Completes only when the parent is gone, which ends the loop below.
        let parent_gone = async move {
            if parent_gone.await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::pin!(parent_gone);
        let (mut term, mut int, mut hup) = match (term, int, hup) {
            (Ok(t), Ok(i), Ok(h)) => (t, i, h),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM, SIGINT and SIGHUP");
                return std::future::pending().await;
            }
        };
        loop {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = int.recv() => tracing::info!("SIGINT received"),
                _ = hup.recv() => {
                    tracing::info!("SIGHUP received: re-reading credentials files");
                    valet_proto::reload::reload_all();
                    continue;
                }
                () = &mut parent_gone => {
                    tracing::warn!("the process that started this one is gone (its pipe on stdin ended): stopping");
                }
            }
            if !force_on_second {
                return;
            }
            // The handlers stay installed, so the default action (ending the process)
            // is gone: a second signal during the clean stop ends it at once. The
            // task lives as long as the process.
            tokio::spawn(async move {
                // As a shell reports a process a signal ended: 128 + its number.
                let code = tokio::select! {
                    _ = term.recv() => 128 + 15,
                    _ = int.recv() => 128 + 2,
                };
                say_err!("valet: second signal: stopping now, without finishing the clean stop");
                std::process::exit(code);
            });
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    /// `VALET_STOP_WITH_PARENT=0` (or empty) must not arm it: a part started so with
    /// stdin at /dev/null (systemd) stopped at once.
    #[test]
    fn stop_with_parent_takes_a_boolean() {
        use std::ffi::OsStr;
        let armed = |v: Option<&str>| super::stop_with_parent(v.map(OsStr::new));
        assert!(armed(Some("1")) && armed(Some("true")) && armed(Some("TRUE")));
        assert!(!armed(None) && !armed(Some("")) && !armed(Some("0")) && !armed(Some("false")));
    }
}
