//! Process signals.

use std::future::Future;

/// Resolves at the first SIGTERM or SIGINT; until then, every SIGHUP re-reads every
/// certificate, key, CA and verification-key file ([`valet_proto::reload::reload_all`]).
/// A second SIGTERM or SIGINT after it exits the process at once ([`EXIT_FORCED`]).
/// The handlers are installed when this is called, not when the future is first polled:
/// call it before printing the `listening` lines, so that a supervisor's SIGTERM (or a
/// rotation's SIGHUP) right after them is handled instead of killing the process.
pub(crate) fn terminated() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    let hup = signal(SignalKind::hangup());
    async move {
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
            }
            // The handlers stay installed, so the default action (ending the process)
            // is gone: a second signal during the clean stop ends it at once. The
            // task lives as long as the process.
            tokio::spawn(async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                eprintln!("valet: second signal: stopping now, without finishing the clean stop");
                std::process::exit(EXIT_FORCED);
            });
            return;
        }
    }
}

/// The exit code after a second SIGTERM or SIGINT cut the clean stop short.
pub(crate) const EXIT_FORCED: i32 = 130;
