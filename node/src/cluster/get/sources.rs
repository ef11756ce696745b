//! What every way of getting a version shares: the holders' addresses, whether the pair's
//! channel hands the whole version over (then it is not fetched in pieces or streamed over
//! QUIC), where a get reports the bytes it receives, and how they came in.

use std::{net::SocketAddr, time::Duration};

use iroh::EndpointId;
use tb_dashboard::TransferKind;
use tb_proto::{HolderAddr, TensorMeta, TensorName};

use crate::{
    PeerAddr,
    channel::{self, Channel},
    cluster::{Cluster, calls::Holders},
    error::{Error, Result},
    inflight::Receiving,
    node::Node,
    progress::TransferProgress,
    tensor::{Outline, Tensor},
};

/// How often a pull in progress asks the broker again (in one stream and in pieces).
pub(super) const REFRESH: Duration = Duration::from_millis(500);

/// Where a get reports the bytes it receives: the cut-through feed for this node's own
/// pullers, and the caller's progress.
pub(crate) struct Reports<'a> {
    pub(crate) receiving: &'a mut Receiving,
    pub(crate) progress: Option<&'a TransferProgress>,
}

/// How a get's bytes came in.
pub(crate) enum Received {
    /// A holder handed the whole version over on the pair's channel.
    Whole(Tensor),
    /// Every byte is in the destination, verified: in pieces against this outline, or in
    /// one stream (`None`).
    Filled(Option<Outline>),
}

/// The addresses of `holder` to dial, in the broker's order (those that do not parse are
/// skipped); `PeerUnreachable` when its node id is not a valid key.
pub(crate) fn peers_of(holder: &HolderAddr) -> Result<Vec<PeerAddr>> {
    let id = EndpointId::from_bytes(&holder.node.0).map_err(|e| Error::PeerUnreachable {
        peer: format!("{:?}", holder.node),
        reason: format!("not a valid node id: {e}"),
    })?;
    let addrs = holder
        .addrs
        .iter()
        .filter_map(|a| a.parse::<SocketAddr>().ok());
    Ok(addrs.map(|addr| PeerAddr { id, addr }).collect())
}

/// Whether the first source of `holders` (not this node) would hand the whole version over
/// on a channel other than QUIC (same-host shared memory, TCP): then a large version is not
/// fetched in pieces.
pub(super) async fn whole_by_channel(node: &Node, cluster: &Cluster, holders: &Holders) -> bool {
    let Some(first) = holders.holders.iter().find(|h| h.node != cluster.me()) else {
        return false;
    };
    let Some(peer) = peers_of(first).ok().and_then(|p| p.into_iter().next()) else {
        return false;
    };
    let links = || node.link(&peer);
    matches!(
        channel::route(node.ctx(), &peer.id, links).await,
        Ok(Some(_))
    )
}

/// Gets the whole version from `peer` over the pair's channel when that is not QUIC: shm
/// maps the holder's sealed memfd (zero-copy; no hash pass, as the memfd cannot change after
/// its holder verified it), tcp receives it over verified sockets. `None`: pull it over QUIC
/// (the pair runs QUIC, the holder is still receiving the version, or the channel failed and
/// the pair fell back).
pub(super) async fn by_channel(
    node: &Node,
    peer: &PeerAddr,
    name: &TensorName,
    version: u64,
    expected: &TensorMeta,
    progress: Option<&TransferProgress>,
) -> Result<Option<Tensor>> {
    let ctx = node.ctx();
    let links = || node.link(peer);
    let pull = async |route: &channel::Route| route.pull(ctx, name, Some(version)).await;
    let Some(pulled) = channel::first(ctx, &peer.id, links, Some(TransferKind::Pull), pull).await?
    else {
        return Ok(None);
    };
    if pulled.version != version || pulled.meta != *expected {
        return Err(Error::InvalidTensor(format!(
            "tensor \"{name}\" v{version} at {}: the holder sent v{} with hash {}, the \
             registry says hash {}",
            peer.id.fmt_short(),
            pulled.version,
            pulled.meta.hash,
            expected.hash
        )));
    }
    crate::progress::reached(progress, pulled.meta.byte_len);
    Ok(Some(pulled.buffer))
}
