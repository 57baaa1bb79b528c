//! Process signals.

/// Resolves at the first SIGTERM or SIGINT.
pub(crate) async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        r = tokio::signal::ctrl_c() => match r {
            Ok(()) => tracing::info!("SIGINT received"),
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGINT");
                std::future::pending::<()>().await;
            }
        },
    }
}
