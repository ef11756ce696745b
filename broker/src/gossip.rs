//! Registry replication over iroh-gossip: one topic per cluster (derived from the secret),
//! one MAC-authenticated op per message.
//!
//! Gossip is the fast path; anti-entropy (`sync`) is the safety net. So an op that cannot be
//! broadcast (too large for gossip, a full channel) is logged and left to the next sync round
//! instead of blocking the broker, and a lagging receiver or a new neighbour triggers a round.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use iroh_gossip::api::{Event as GossipEvent, GossipReceiver, GossipSender};
use n0_future::StreamExt;
use ractor::ActorRef;
use tb_proto::{ClusterKey, MAX_GOSSIP_OP_BYTES, NodeId, RegistryOp};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{actor::BrokerMsg, ctl::ask, metrics::BrokerCounters};

/// Longest a broadcast may take before the op is left to anti-entropy.
const BROADCAST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to wait for the actor's membership table when re-announcing this broker.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(2);

/// Bytes of the MAC in front of every message.
const MAC_LEN: usize = 32;

/// Seals an op: its MAC, then its postcard encoding. `None` if it is too large for gossip.
pub(crate) fn seal(key: &ClusterKey, op: &RegistryOp) -> Option<Bytes> {
    if op.encoded_len() > MAX_GOSSIP_OP_BYTES {
        return None;
    }
    let body = postcard::to_allocvec(op).ok()?;
    let mut msg = Vec::with_capacity(MAC_LEN + body.len());
    msg.extend_from_slice(&key.gossip_mac(&body));
    msg.extend_from_slice(&body);
    Some(Bytes::from(msg))
}

/// Opens a sealed message: the op, if the MAC is right and it decodes and validates.
pub(crate) fn open(key: &ClusterKey, msg: &[u8], max_tensor_bytes: u64) -> Option<RegistryOp> {
    if msg.len() < MAC_LEN {
        return None;
    }
    let (mac, body) = msg.split_at(MAC_LEN);
    let mac: &[u8; MAC_LEN] = mac.try_into().ok()?;
    if !key.verify_gossip_mac(body, mac) {
        return None;
    }
    let op: RegistryOp = postcard::from_bytes(body).ok()?;
    op.validate(max_tensor_bytes).ok()?;
    Some(op)
}

/// What the gossip loop needs.
pub(crate) struct GossipLoop {
    /// This broker (its membership row is re-announced to every new neighbour).
    pub(crate) me: NodeId,
    pub(crate) key: ClusterKey,
    pub(crate) sender: GossipSender,
    pub(crate) receiver: GossipReceiver,
    pub(crate) outbox: mpsc::UnboundedReceiver<RegistryOp>,
    pub(crate) actor: ActorRef<BrokerMsg>,
    pub(crate) max_tensor_bytes: u64,
    pub(crate) sync_now: Arc<Notify>,
    pub(crate) counters: Arc<BrokerCounters>,
    pub(crate) cancel: CancellationToken,
}

impl GossipLoop {
    /// Broadcasts the actor's ops and delivers other brokers' ops until shutdown.
    pub(crate) async fn run(mut self) {
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                op = self.outbox.recv() => {
                    let Some(op) = op else { break };
                    self.broadcast(&op).await;
                }
                event = self.receiver.next() => match event {
                    Some(Ok(event)) => {
                        if self.on_event(event) {
                            self.announce_self().await;
                        }
                    }
                    Some(Err(e)) => {
                        warn!(%e, "gossip receiver failed; relying on anti-entropy");
                        break;
                    }
                    None => break,
                },
            }
        }
    }

    async fn broadcast(&self, op: &RegistryOp) {
        let Some(msg) = seal(&self.key, op) else {
            warn!(
                bytes = op.encoded_len(),
                "op too large for gossip; anti-entropy will carry it"
            );
            return;
        };
        match tokio::time::timeout(BROADCAST_TIMEOUT, self.sender.broadcast(msg)).await {
            Ok(Ok(())) => self.counters.gossip_sent.inc(),
            Ok(Err(e)) => warn!(%e, "gossip broadcast failed; anti-entropy will carry it"),
            Err(_) => warn!("gossip broadcast stalled; anti-entropy will carry it"),
        }
    }

    /// Broadcasts this broker's own membership row again. Sent when a neighbour comes up: the
    /// row was gossiped once at start-up, maybe before any neighbour was there to hear it, and a
    /// peer that does not know this broker never pulls from it (anti-entropy is pull-only).
    async fn announce_self(&self) {
        let members = ask(&self.actor, ANNOUNCE_TIMEOUT, |reply| BrokerMsg::Members {
            reply,
        })
        .await;
        let Ok(members) = members else { return };
        if let Some(row) = members.into_iter().find(|m| m.node == self.me) {
            self.broadcast(&RegistryOp::Member(row)).await;
        }
    }

    /// Handles one gossip event; says whether a neighbour came up.
    fn on_event(&self, event: GossipEvent) -> bool {
        match event {
            GossipEvent::Received(msg) => {
                match open(&self.key, &msg.content, self.max_tensor_bytes) {
                    Some(op) => {
                        self.counters.gossip_received.inc();
                        let _ = self.actor.cast(BrokerMsg::Gossip(op));
                    }
                    None => {
                        self.counters.gossip_rejected.inc();
                        debug!(from = %msg.delivered_from.fmt_short(), "dropping an unauthenticated or malformed gossip message");
                    }
                }
            }
            GossipEvent::NeighborUp(peer) => {
                debug!(peer = %peer.fmt_short(), "gossip neighbour up");
                self.sync_now.notify_one();
                return true;
            }
            GossipEvent::NeighborDown(peer) => {
                debug!(peer = %peer.fmt_short(), "gossip neighbour down");
            }
            GossipEvent::Lagged => {
                warn!("gossip receiver lagged; running anti-entropy");
                self.sync_now.notify_one();
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use tb_proto::{NodeId, Stamp, TensorName};

    use super::*;

    fn op() -> RegistryOp {
        RegistryOp::Delete {
            name: TensorName::new("model/w").expect("name"),
            stamp: Stamp {
                wall_ms: 5,
                logical: 0,
                node: NodeId([7; 32]),
            },
        }
    }

    #[test]
    fn sealed_ops_open_only_with_the_same_secret() {
        let key = ClusterKey::from_secret(b"0123456789abcdef0123456789abcdef").expect("secret");
        let msg = seal(&key, &op()).expect("small op");
        assert_eq!(open(&key, &msg, 1 << 30), Some(op()));
        let other = ClusterKey::from_secret(b"another secret!!another secret!!").expect("secret");
        assert_eq!(open(&other, &msg, 1 << 30), None);
        let mut flipped = msg.to_vec();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(open(&key, &flipped, 1 << 30), None);
        assert_eq!(open(&key, &msg[..10], 1 << 30), None);
    }
}
