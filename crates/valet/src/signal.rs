//! Process signals.

use std::future::Future;

/// Resolves at the first SIGTERM or SIGINT; until then, every SIGHUP re-reads every
/// certificate, key, CA and verification-key file ([`valet_proto::reload::reload_all`]).
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
                _ = term.recv() => return tracing::info!("SIGTERM received"),
                _ = int.recv() => return tracing::info!("SIGINT received"),
                _ = hup.recv() => {
                    tracing::info!("SIGHUP received: re-reading credentials files");
                    valet_proto::reload::reload_all();
                }
            }
        }
    }
}
