//! The HTTP server a daemon runs beside its node: bound before the node starts (a worker tells
//! brokers its URL in heartbeats), serving once the process is up, stopped with it. The routes
//! and guards are tb-dashboard's; this is only their lifecycle in a process.

use std::{net::SocketAddr, time::Duration};

use tb_dashboard::{AppState, HttpOptions};
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;

use crate::SetupError;

/// How long a stopping metrics server may finish the requests under way.
const METRICS_STOP_GRACE: Duration = Duration::from_secs(2);

/// A daemon's HTTP server for metrics, health, the JSON API and the dashboard (the routes are
/// `tb_dashboard`'s). Bound first, so a worker can tell brokers its URL; serving once the
/// process is up ([`MetricsServer::start`]); stopped with the process.
#[derive(Debug)]
pub struct MetricsServer {
    listener: Option<TcpListener>,
    addr: SocketAddr,
    options: HttpOptions,
    stop: CancellationToken,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0: any free port), with the default guards (no token).
    pub async fn bind(addr: SocketAddr) -> Result<MetricsServer, SetupError> {
        Self::bind_with(addr, HttpOptions::default()).await
    }

    /// Binds `addr`; the server will be guarded as `options` say (token, concurrency limit).
    pub async fn bind_with(
        addr: SocketAddr,
        options: HttpOptions,
    ) -> Result<MetricsServer, SetupError> {
        let bound = tb_dashboard::bind(addr)
            .await
            .and_then(|l| Ok((l.local_addr()?, l)));
        let (addr, listener) = bound.map_err(|source| SetupError::MetricsAddr { addr, source })?;
        Ok(MetricsServer {
            listener: Some(listener),
            addr,
            options,
            stop: CancellationToken::new(),
            task: None,
        })
    }

    /// `http://ip:port` as bound.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts serving `state` and prints `metrics: <url>` on stdout (scripts and tests wait
    /// for that line). A second call does nothing.
    pub fn start(&mut self, state: AppState) {
        let Some(listener) = self.listener.take() else {
            return;
        };
        self.task = Some(tokio::spawn(tb_dashboard::serve(
            listener,
            state,
            self.options.clone(),
            self.stop.clone(),
        )));
        println!("metrics: {}", self.url());
        tracing::info!(url = %self.url(), "metrics server listening");
    }

    /// Stops accepting, lets requests under way finish (briefly), and returns.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(METRICS_STOP_GRACE, task).await {
                Ok(Ok(Err(e))) => tracing::warn!(%e, "metrics server failed"),
                Ok(_) => {}
                Err(_) => tracing::debug!("metrics server still busy at shutdown"),
            }
        }
    }
}
