//! What a worker shows on its metrics server: [`node_dashboard`] pairs the node's metrics with
//! a [`Source`] that reads its id, addresses, readiness, links and state gauges.
//!
//! It lives here, not in tb-node, because only a process that serves HTTP needs it; everything
//! it reads is tb-node's public API. (The broker's source stays in tb-broker: it reads the
//! broker actor's internals.)

use std::sync::Arc;

use tb_dashboard::{AppState, Metrics, RefreshFuture, Source, api::LinkView};
use tb_node::{Node, auth::node_id};

/// A node (a worker's) as the dashboard sees it.
struct NodeSource {
    node: Node,
}

impl Source for NodeSource {
    fn node_id(&self) -> String {
        node_id(&self.node.id()).to_string()
    }

    fn addrs(&self) -> Vec<String> {
        let advertised = &self.node.config().advertise_addrs;
        match advertised.is_empty() {
            true => vec![self.node.addr().addr.to_string()],
            false => advertised.iter().map(|a| a.to_string()).collect(),
        }
    }

    /// Joined: a broker accepted a heartbeat, or the node runs without brokers.
    fn ready(&self) -> bool {
        self.node.is_joined() && !self.node.is_shut_down()
    }

    fn refresh<'a>(&'a self, _metrics: &'a Metrics) -> RefreshFuture<'a> {
        self.node.refresh_metrics();
        Box::pin(async {})
    }

    fn links(&self) -> Vec<LinkView> {
        self.node.link_views()
    }
}

/// What a worker's metrics server serves for `node` (`/metrics`, `/healthz`, `/readyz`,
/// `/api/v1/status`; no cluster view: that is the brokers').
pub fn node_dashboard(node: &Node) -> AppState {
    AppState {
        metrics: node.metrics().clone(),
        source: Arc::new(NodeSource { node: node.clone() }),
    }
}
