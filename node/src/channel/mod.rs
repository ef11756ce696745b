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
pub(crate) mod verify;

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard},
};

use iroh::EndpointId;
use tb_proto::{Access, ChannelKind, ChannelOffer};

/// What this node knows about its peers' channels, and the channels it runs itself.
#[derive(Debug)]
pub(crate) struct Channels {
    /// `Config::channels`: the kinds this node runs, best first.
    #[allow(dead_code)]
    order: Vec<ChannelKind>,
    /// What each peer offered on its latest link (replaced when it offers again, e.g. after
    /// a restart).
    offered: Mutex<HashMap<EndpointId, Vec<ChannelOffer>>>,
}

impl Channels {
    /// The channels a node with `order` (`Config::channels`) runs.
    pub(crate) fn new(order: Vec<ChannelKind>) -> Self {
        Channels {
            order,
            offered: Mutex::new(HashMap::new()),
        }
    }

    fn offered(&self) -> MutexGuard<'_, HashMap<EndpointId, Vec<ChannelOffer>>> {
        self.offered.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The offers this node makes to `peer`, which proved `access` on the link.
    pub(crate) fn offers_for(&self, _peer: EndpointId, _access: Access) -> Vec<ChannelOffer> {
        Vec::new()
    }

    /// Records what `peer` offered (its offers were validated by the frame's reader).
    pub(crate) fn learn(&self, peer: EndpointId, offers: Vec<ChannelOffer>) {
        self.offered().insert(peer, offers);
    }

    /// Forgets `peer`'s offers (its channels failed, or it is gone).
    pub(crate) fn forget(&self, peer: &EndpointId) {
        self.offered().remove(peer);
    }

    /// The channel a transfer with `peer` uses now.
    #[allow(dead_code)] // the transfer engine calls it once the shm and tcp channels land
    pub(crate) fn pick(&self, peer: &EndpointId) -> ChannelKind {
        let offered = self.offered();
        let offers = offered.get(peer).map(Vec::as_slice).unwrap_or_default();
        tb_proto::channel::pick(&self.order, offers, |_| true)
    }
}
