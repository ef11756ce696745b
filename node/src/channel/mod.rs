//! Data channels: how the bytes of a transfer move between two peers whose iroh QUIC link has
//! authenticated them (the shape of TensorPipe's channels).
//!
//! The pooled QUIC link always carries the control frames, and QUIC itself is every
//! transfer's default and fallback. On each new link the dialer sends
//! [`DataRequest::Channels`](tb_proto::DataRequest::Channels) with its [`ChannelOffer`]s and
//! the other side answers with its own (`exchange` here, `serve` there); [`Channels`] keeps
//! what each peer offered, and [`Channels::pick`] names the channel a transfer with a peer
//! uses: the first in `Config::channels` that both run and that this node could open.
//!
//! Kinds (each in its own module, registered in [`Channels::new`]):
//! - `quic`: the link's own streams (striped over several for large tensors).
//! - `shm` (Linux): same-host shared memory, proven by reaching the peer's abstract Unix
//!   socket whose name only it was told.
//! - `tcp` (opt-in): verified plain TCP for trusted networks.

pub(crate) mod quic;
#[cfg(target_os = "linux")]
mod shm;
pub(crate) mod verify;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use iroh::EndpointId;
use tb_proto::{Access, ChannelKind, ChannelOffer, channel::SHM_SOCKET_NAME_LEN};
use tracing::warn;

#[cfg(target_os = "linux")]
pub(crate) use shm::{Region, Shm, ShmCache, ShmError, ShmPull};

use crate::{ctx::NodeCtx, error::Result};

/// Where shared memory is not built (not Linux): a tensor has no memfd to cache.
#[cfg(not(target_os = "linux"))]
#[derive(Debug, Clone, Default)]
pub(crate) struct ShmCache;

/// What a transfer to a peer needs to use the shm channel: this node's end, and the peer's
/// socket name and this node's token on it.
#[cfg(target_os = "linux")]
#[derive(Debug, Clone)]
pub(crate) struct ShmRoute {
    pub(crate) shm: Arc<Shm>,
    pub(crate) socket: [u8; SHM_SOCKET_NAME_LEN],
    pub(crate) token: [u8; 32],
}

/// What this node knows about its peers' channels, and the channels it runs itself.
#[derive(Debug)]
pub(crate) struct Channels {
    /// `Config::channels`: the kinds this node runs, best first.
    order: Vec<ChannelKind>,
    /// What each peer offered on its latest link (replaced when it offers again, e.g. after
    /// a restart).
    offered: Mutex<HashMap<EndpointId, Vec<ChannelOffer>>>,
    /// This node's end of the shm channel, when it runs it.
    #[cfg(target_os = "linux")]
    shm: Option<Arc<Shm>>,
}

impl Channels {
    /// The channels a node with `order` (`Config::channels`) runs.
    /// A channel that cannot start (no abstract sockets here) is left out, with a warning.
    pub(crate) fn new(order: Vec<ChannelKind>) -> Self {
        #[cfg(target_os = "linux")]
        let shm = order
            .contains(&ChannelKind::Shm)
            .then(Shm::bind)
            .and_then(|bound| match bound {
                Ok(shm) => Some(Arc::new(shm)),
                Err(err) => {
                    warn!(%err, "the shm channel could not start: same-host peers use QUIC");
                    None
                }
            });
        Channels {
            order,
            offered: Mutex::new(HashMap::new()),
            #[cfg(target_os = "linux")]
            shm,
        }
    }

    /// Starts the channels' listeners (with the node's context, once it exists).
    pub(crate) fn start(ctx: &Arc<NodeCtx>) -> Result<()> {
        #[cfg(target_os = "linux")]
        if let Some(shm) = &ctx.channels.shm {
            shm::spawn_listener(ctx, shm)?;
        }
        let _ = ctx;
        Ok(())
    }

    /// Whether this node runs `kind` now (QUIC always).
    fn runs(&self, kind: ChannelKind) -> bool {
        match kind {
            ChannelKind::Quic => true,
            #[cfg(target_os = "linux")]
            ChannelKind::Shm => self.shm.is_some(),
            _ => false,
        }
    }

    fn offered(&self) -> MutexGuard<'_, HashMap<EndpointId, Vec<ChannelOffer>>> {
        self.offered.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The offers this node makes to `peer`, which proved `access` on the link.
    pub(crate) fn offers_for(&self, peer: EndpointId, access: Access) -> Vec<ChannelOffer> {
        let mut offers = Vec::new();
        #[cfg(target_os = "linux")]
        if let Some(shm) = &self.shm {
            offers.push(shm.offer(peer, access));
        }
        let _ = (peer, access);
        offers
    }

    /// Records what `peer` offered (its offers were validated by the frame's reader). Idle
    /// same-host connections to it are dropped: the offer may come from a restarted process.
    pub(crate) fn learn(&self, peer: EndpointId, offers: Vec<ChannelOffer>) {
        self.offered().insert(peer, offers);
        #[cfg(target_os = "linux")]
        if let Some(shm) = &self.shm {
            shm.forget(&peer);
        }
    }

    /// Forgets `peer`'s offers (the exchange failed): it is back to QUIC only.
    pub(crate) fn forget(&self, peer: &EndpointId) {
        self.offered().remove(peer);
    }

    /// Whether `peer`'s offers are known (its link exchanged them).
    pub(crate) fn knows(&self, peer: &EndpointId) -> bool {
        self.offered().contains_key(peer)
    }

    /// Withdraws `kind` for `peer` after it failed (e.g. its shm socket cannot be reached
    /// from here: another network namespace): its transfers use the next channel.
    pub(crate) fn failed(&self, peer: &EndpointId, kind: ChannelKind) {
        if let Some(offers) = self.offered().get_mut(peer) {
            offers.retain(|o| o.kind() != kind);
        }
        #[cfg(target_os = "linux")]
        if let (ChannelKind::Shm, Some(shm)) = (kind, &self.shm) {
            shm.forget(peer);
        }
    }

    /// The shm route to `peer`, when the pair's channel is shm.
    #[cfg(target_os = "linux")]
    pub(crate) fn shm_route(&self, peer: &EndpointId) -> Option<ShmRoute> {
        let shm = self.shm.as_ref()?;
        if self.pick(peer) != ChannelKind::Shm {
            return None;
        }
        let offered = self.offered();
        offered.get(peer)?.iter().find_map(|offer| match offer {
            ChannelOffer::Shm { socket, token } => Some(ShmRoute {
                shm: shm.clone(),
                socket: *socket,
                token: *token,
            }),
            _ => None,
        })
    }

    /// Whether this node could use shm with anyone (so first contact is worth a dial).
    pub(crate) fn may_use_shm(&self) -> bool {
        self.runs(ChannelKind::Shm)
    }

    /// The channel a transfer with `peer` uses now.
    pub(crate) fn pick(&self, peer: &EndpointId) -> ChannelKind {
        let offered = self.offered();
        let offers = offered.get(peer).map(Vec::as_slice).unwrap_or_default();
        tb_proto::channel::pick(&self.order, offers, |kind| self.runs(kind))
    }
}

/// The shm route to `peer`, dialing first (`dial`: the link's first request exchanges
/// channel offers) when this is first contact and shm could be used at all.
#[cfg(target_os = "linux")]
async fn shm_route<D>(ctx: &NodeCtx, peer: &EndpointId, dial: D) -> Result<Option<ShmRoute>>
where
    D: std::future::Future<Output = Result<()>>,
{
    let channels = &ctx.channels;
    if !channels.may_use_shm() {
        return Ok(None);
    }
    if !channels.knows(peer) {
        dial.await?;
    }
    Ok(channels.shm_route(peer))
}

/// What an shm attempt left to QUIC.
#[cfg(target_os = "linux")]
fn shm_result<T>(
    ctx: &NodeCtx,
    peer: &EndpointId,
    result: Result<T, ShmError>,
) -> Result<Option<T>> {
    match result {
        Ok(done) => Ok(Some(done)),
        Err(ShmError::Final(err)) => Err(err),
        Err(ShmError::ViaQuic) => Ok(None),
        Err(ShmError::Fallback(err)) => {
            tracing::debug!(peer = %peer.fmt_short(), %err, "shm failed: falling back to QUIC");
            ctx.channels.failed(peer, ChannelKind::Shm);
            ctx.metrics.channels.fallback(ChannelKind::Shm);
            Ok(None)
        }
    }
}

/// Pulls `name` from `peer` over shm up to the payload when the pair uses shm; `Ok(None)`:
/// pull it over QUIC (no shm, or shm failed before answering: the fallback).
#[cfg(target_os = "linux")]
pub(crate) async fn shm_pull<D>(
    ctx: &NodeCtx,
    peer: &EndpointId,
    dial: D,
    name: &tb_proto::TensorName,
    version: Option<u64>,
) -> Result<Option<ShmPull>>
where
    D: std::future::Future<Output = Result<()>>,
{
    let Some(route) = shm_route(ctx, peer, dial).await? else {
        return Ok(None);
    };
    let pulled = shm::pull(ctx, &route, *peer, name, version).await;
    let pulled = shm_result(ctx, peer, pulled)?;
    if let Some(p) = &pulled {
        let inbound = tb_dashboard::Direction::In;
        ctx.metrics
            .channels
            .transfer(ChannelKind::Shm, inbound, p.meta.byte_len);
    }
    Ok(pulled)
}

/// Pushes over shm when the pair uses shm; `Ok(false)`: push it over QUIC.
#[cfg(target_os = "linux")]
pub(crate) async fn shm_push<D>(
    ctx: &NodeCtx,
    peer: &EndpointId,
    dial: D,
    name: &tb_proto::TensorName,
    tensor: &crate::tensor::Tensor,
) -> Result<bool>
where
    D: std::future::Future<Output = Result<()>>,
{
    let Some(route) = shm_route(ctx, peer, dial).await? else {
        return Ok(false);
    };
    let pushed = shm::push(ctx, &route, *peer, name, tensor).await;
    let pushed = shm_result(ctx, peer, pushed)?.is_some();
    if pushed {
        let out = tb_dashboard::Direction::Out;
        ctx.metrics
            .channels
            .transfer(ChannelKind::Shm, out, tensor.byte_len());
    }
    Ok(pushed)
}
