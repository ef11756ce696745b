//! What a process hands its metrics server: [`AppState`], the process's [`Metrics`] and its
//! [`Source`] of figures only it knows (node id, addresses, readiness, links, a broker's
//! cluster view).
//!
//! These live outside the `server` feature on purpose: a library that describes what it would
//! show (`tb_broker::Broker::dashboard`) builds its `AppState` without compiling axum, and only
//! the process that actually serves HTTP (tb-daemon's binaries, `tb up`) enables the server.

use std::{future::Future, pin::Pin, sync::Arc};

use crate::{
    api::{ClusterData, LinkView, Page, Status},
    metrics::Metrics,
};

/// The future [`Source::refresh`] returns.
pub type RefreshFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// What only the process knows (the dashboard crate depends on neither node nor broker).
/// Every answer comes from what the process already holds (a broker: the registry snapshot its
/// actor publishes), never from a request to an actor: an HTTP request must not compete with
/// the process's own work.
pub trait Source: Send + Sync + 'static {
    /// The node id in hex.
    fn node_id(&self) -> String;
    /// Where peers reach it.
    fn addrs(&self) -> Vec<String>;
    /// Whether it has joined (see `/readyz`).
    fn ready(&self) -> bool;
    /// Sets the gauges that mirror state (pool links, store, registry, cluster nodes); awaited
    /// before every scrape and status answer.
    fn refresh<'a>(&'a self, metrics: &'a Metrics) -> RefreshFuture<'a>;
    /// Each pooled link's peer and negotiated data channel (none by default).
    fn links(&self) -> Vec<LinkView> {
        Vec::new()
    }
    /// Members, registry totals and one `page` of registry entries: brokers only. `None` (the
    /// default) answers 404.
    fn cluster(&self, _page: &Page) -> Option<ClusterData> {
        None
    }
}

/// What the server's handlers share: the process's metrics and its source of figures.
#[derive(Clone)]
pub struct AppState {
    /// The process's metrics.
    pub metrics: Arc<Metrics>,
    /// The process's own figures.
    pub source: Arc<dyn Source>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("role", &self.metrics.role())
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// The `/api/v1/status` object, gauges refreshed.
    pub async fn status(&self) -> Status {
        self.source.refresh(&self.metrics).await;
        let mut status = self.metrics.status(
            self.source.node_id(),
            self.source.addrs(),
            self.source.ready(),
        );
        status.links = self.source.links();
        status
    }
}
