//! [`FetchSlot`]: the broker's note that this node is fetching a version (a look-up takes one
//! of its source's fan-out slots), handed back when the get ends however it ends: done,
//! failed, or dropped part-way by a deadline or a caller that stopped waiting.

use std::sync::Arc;

use tb_proto::TensorName;
use tracing::debug;

use super::Cluster;
use crate::{ctx::NodeCtx, node::Node};

/// Tells the broker, when dropped, that this node stopped fetching `version` of `name`
/// (frees its fan-out slot, from a task: a drop never waits).
pub(super) struct FetchSlot {
    ctx: Arc<NodeCtx>,
    cluster: Arc<Cluster>,
    name: TensorName,
    version: u64,
    /// The task telling the broker the fetch started, if one was sent: the end waits for it,
    /// so the broker hears the two in order.
    started: Option<tokio::task::JoinHandle<()>>,
    /// This node announced that it holds the version, which ends the fetch at the broker and
    /// frees the slot: the drop tells it nothing more.
    held: bool,
}

/// Versions smaller than this are not announced as fetches in flight. The look-up recorded
/// the asker as fetching already, and a version this small is in before another fetcher
/// could be pointed at it (look-ups of small versions name complete holders first): the
/// message would be broker work per get for nothing.
const IN_FLIGHT_FROM: u64 = 1 << 20;

impl FetchSlot {
    /// The slot a look-up of `version` of `name` took.
    pub(super) fn taken(
        node: &Node,
        cluster: &Arc<Cluster>,
        name: &TensorName,
        version: u64,
    ) -> Self {
        FetchSlot {
            ctx: node.ctx().clone(),
            cluster: cluster.clone(),
            name: name.clone(),
            version,
            started: None,
            held: false,
        }
    }

    /// This node announced that it holds the version (which ends its fetch at the broker).
    pub(super) fn ended_by_holding(&mut self) {
        self.held = true;
    }

    /// Tells the broker, from a task, that this node is now receiving the version (so it can
    /// name this node as a source that is still receiving): the transfer does not wait for
    /// the broker's answer. Only for versions of at least [`IN_FLIGHT_FROM`] bytes.
    pub(super) fn announce_start(&mut self, byte_len: u64) {
        if byte_len < IN_FLIGHT_FROM {
            return;
        }
        let (cluster, name, version) = (self.cluster.clone(), self.name.clone(), self.version);
        let cancel = self.ctx.cancel.clone();
        self.started = Some(self.ctx.tracker.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                started = cluster.fetching(&name, version, true) => if let Err(e) = started {
                    debug!(%name, version, %e, "broker did not take the fetch start");
                }
            }
        }));
    }
}

impl Drop for FetchSlot {
    fn drop(&mut self) {
        // A get dropped outside the runtime (its runtime is gone) has no broker to tell.
        if self.held || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let (cluster, name, version) = (self.cluster.clone(), self.name.clone(), self.version);
        let cancel = self.ctx.cancel.clone();
        let started = self.started.take();
        self.ctx.tracker.spawn(async move {
            if let Some(started) = started {
                let _ = started.await;
            }
            tokio::select! {
                _ = cancel.cancelled() => {}
                ended = cluster.fetching(&name, version, false) => if let Err(e) = ended {
                    debug!(%name, version, %e, "broker did not take the fetch end");
                }
            }
        });
    }
}
