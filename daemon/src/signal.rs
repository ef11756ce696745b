//! How a daemon learns to stop: SIGINT (Ctrl-C) or SIGTERM (systemd, Kubernetes, `docker
//! stop`, tini). Its `main` then shuts down in order, so the node leaves the cluster cleanly
//! and a broker flushes its registry.

/// Waits for SIGINT (Ctrl-C) or SIGTERM.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
