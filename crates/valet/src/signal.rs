//! Process signals.

use std::future::Future;

/// Resolves at the first SIGTERM or SIGINT. The handlers are installed when this is
/// called, not when the future is first polled: call it before printing the
/// `listening` lines, so that a supervisor's SIGTERM right after them drains instead
/// of killing the process.
pub(crate) fn terminated() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let (mut term, mut int) = match (term, int) {
            (Ok(t), Ok(i)) => (t, i),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM and SIGINT");
                return std::future::pending().await;
            }
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    }
}
