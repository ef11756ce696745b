//! [`NodeLinks`]: what this node does with the links its pool makes and loses, the
//! [`LinkEvents`] of tb-link's pool. The pool knows nothing of tensors; these hooks are where
//! a link meets the data plane:
//!
//! - a link we dialed opens with the channel exchange (its first request: the data channels
//!   each side runs, filed under the link's id), then its peer's streams are served like an
//!   inbound link's (`serve`);
//! - a link that goes takes what it taught of its peer with it, unless the peer's pooled link
//!   now is another (`Channels::link_gone`).

use std::sync::Arc;

use iroh::{EndpointId, endpoint::Connection};
use tb_link::{EventFuture, Link, LinkEvents};
use tb_proto::{Access, DataRequest, DataResponse};
use tracing::debug;

use crate::{ctx::NodeCtx, serve, wire};

/// The node's hooks on its pool.
#[derive(Debug)]
pub(crate) struct NodeLinks {
    ctx: Arc<NodeCtx>,
}

impl NodeLinks {
    pub(crate) fn new(ctx: &Arc<NodeCtx>) -> Self {
        NodeLinks { ctx: ctx.clone() }
    }
}

impl LinkEvents for NodeLinks {
    fn dialed<'a>(&'a self, conn: &'a Connection, access: Access, link_id: u64) -> EventFuture<'a> {
        Box::pin(channel_exchange(&self.ctx, conn, access, link_id))
    }

    fn serve(&self, link: Link, access: Access) {
        serve::spawn_serve(&self.ctx, link, access);
    }

    fn link_gone(&self, peer: EndpointId, link_id: u64, successor: Option<u64>) {
        self.ctx.channels.link_gone(&peer, link_id, successor);
    }
}

/// Tells the peer of a new link the channels this node runs and learns its own (the first
/// request on the link), filed under `link_id`. A peer that does not answer usefully keeps
/// to QUIC on this link (what another link of it learned stays): the exchange never fails
/// the dial. The pool bounds it by the request timeout.
async fn channel_exchange(ctx: &NodeCtx, conn: &Connection, access: Access, link_id: u64) {
    let peer = conn.remote_id();
    let offers = ctx.channels.offers_for(peer, access);
    let exchange = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let request = DataRequest::Channels { offers };
        wire::write_frame(&mut send, &request)
            .await
            .map_err(|e| e.to_string())?;
        let _ = send.finish();
        match wire::read_frame::<DataResponse>(&mut recv).await {
            Ok(DataResponse::Channels { offers }) => {
                tb_proto::channel::validate_offers(&offers).map_err(|e| e.to_string())?;
                Ok(offers)
            }
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(format!("{e:?}")),
        }
    };
    match exchange.await {
        Ok(offers) => ctx.channels.learn(peer, link_id, access, offers),
        Err(reason) => debug!(peer = %peer.fmt_short(), %reason, "no channel offers: QUIC only"),
    }
}
