//! [`NodeCtx`]: what the node's actors and transfer tasks share.

use std::sync::Arc;

use iroh::Endpoint;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    config::Config,
    inbox::Inbox,
    inflight::Inflight,
    pool::{Counter, PoolCounters, ReadyLinks},
    rate::RateLimiter,
    store::Store,
};

/// Byte and transfer counts of this node's data plane.
#[derive(Debug, Default)]
pub(crate) struct TransferCounters {
    pub(crate) bytes_sent: Counter,
    pub(crate) bytes_received: Counter,
    pub(crate) served: Counter,
    pub(crate) failed: Counter,
    /// Peers refused because they could not prove the cluster secret.
    pub(crate) auth_failures: Counter,
    /// Payload bytes sent of versions this node was still receiving (cut-through).
    pub(crate) inflight_bytes_sent: Counter,
}

/// Shared, immutable-after-start context of one node.
#[derive(Debug)]
pub(crate) struct NodeCtx {
    pub(crate) endpoint: Endpoint,
    pub(crate) config: Config,
    pub(crate) store: Store,
    /// Versions being received now, served to peers as they arrive (cut-through).
    pub(crate) inflight: Inflight,
    /// The upload limit every serving stream draws from; `None`: unlimited.
    pub(crate) upload: Option<RateLimiter>,
    pub(crate) inbox: Inbox,
    pub(crate) pool: Arc<PoolCounters>,
    /// Ready links, readable without asking the `NodeActor`.
    pub(crate) ready: ReadyLinks,
    pub(crate) transfers: TransferCounters,
    /// Cancelled once, at shutdown: every task and in-flight call watches it.
    pub(crate) cancel: CancellationToken,
    /// Owns every task the node spawns, so shutdown can wait for them.
    pub(crate) tracker: TaskTracker,
}
