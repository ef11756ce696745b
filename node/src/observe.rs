//! A node's links as observers see them: [`Node::link_views`], the rows of `/api/v1/status`.
//!
//! Kept in tb-node (the HTTP server and the worker's dashboard source are tb-daemon's) because
//! both dashboard sources show them, the worker's and the broker's, and tb-broker sits below
//! tb-daemon. It is pure and needs only tb-dashboard's JSON shapes, not its server.

use tb_dashboard::api::LinkView;

use crate::{Node, auth::node_id};

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
}
