//! What a node shows on its metrics server: [`Node::dashboard`] pairs the node's metrics with a
//! [`Source`] that reads its id, addresses, readiness and state gauges.

use std::sync::Arc;

use tb_dashboard::{AppState, Metrics, RefreshFuture, Source, api::LinkView};

use crate::{Node, auth::node_id};

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

impl Node {
    /// This node's pooled links as `/api/v1/status` shows them: peer id (hex) and channel.
    pub fn link_views(&self) -> Vec<LinkView> {
        self.links()
            .into_iter()
            .map(|(peer, channel)| LinkView {
                peer: node_id(&peer).to_string(),
                channel: channel.to_string(),
            })
            .collect()
    }

    /// What this node's metrics server serves (`/metrics`, `/healthz`, `/readyz`,
    /// `/api/v1/status`; no cluster view: that is the brokers').
    pub fn dashboard(&self) -> AppState {
        AppState {
            metrics: self.metrics().clone(),
            source: Arc::new(NodeSource { node: self.clone() }),
        }
    }
}
