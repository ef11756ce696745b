//! Worker and broker liveness: [`BrokerState::heartbeat`] and [`BrokerState::expire`].
//! Brokers heartbeat to each other (`beat`) as workers heartbeat to brokers, and are judged
//! by the same rules and timeout; a broker is never judged by itself, and writes itself alive
//! again when a peer marked it dead. A peer broker learned from gossip and never heard gets one
//! timeout to heartbeat, as after a restart.
//!
//! Who judges whom: a broker judges a worker only while it has heard that worker directly,
//! at the epoch the membership table holds. Other brokers learn the verdict from gossip. A
//! worker that heartbeats to several brokers is judged by each; when they disagree (a partial
//! partition), the one that still hears it writes it alive again with a later stamp, and the
//! one that marked it dead does not judge it again until it hears from it itself. So a row
//! flips at most once per broker that lost the worker, never back and forth.
//!
//! After a restart a broker has heard no one yet. It gives every worker the registry holds as
//! alive a grace period, as if heard at start-up: a worker that died while the broker was down
//! is marked dead one timeout later. A worker that heartbeats only to another broker is marked
//! dead once too, and that broker writes it alive again at its next heartbeat.
//!
//! A worker that shuts down cleanly closes its ctl connection saying so; the broker it
//! heartbeated to on that connection writes its row as left ([`BrokerState::leave`]: dead, no
//! addresses), which the registry forgets after `expiry.left_after_ms` instead of a day.

use std::collections::BTreeMap;

use tb_proto::{Member, NodeId, Registry, RegistryOp, Role, Stamp};

use super::{BrokerState, Changes};
use crate::BrokerError;

/// When this broker last heard each node directly, and at which epoch.
#[derive(Debug, Default)]
pub(super) struct LastHeard(BTreeMap<NodeId, Heard>);

#[derive(Debug, Clone, Copy)]
struct Heard {
    epoch: u64,
    at_ms: u64,
}

impl LastHeard {
    /// Whether this broker hears `node` directly.
    pub(super) fn knows(&self, node: &NodeId) -> bool {
        self.0.contains_key(node)
    }

    /// After a restart: every member `registry` holds as alive, except `me`, counts as heard
    /// at `now_ms`.
    pub(super) fn resumed(registry: &Registry, me: NodeId, now_ms: u64) -> Self {
        let alive = registry.members().filter(|m| m.alive && m.node != me);
        LastHeard(
            alive
                .map(|m| {
                    let heard = Heard {
                        epoch: m.epoch,
                        at_ms: now_ms,
                    };
                    (m.node, heard)
                })
                .collect(),
        )
    }
}

impl LastHeard {
    /// Starts the clock on every alive peer broker `registry` holds that this broker (`me`)
    /// has not heard yet (it learned of it from gossip): each gets one timeout from `now_ms`
    /// to heartbeat, as after a restart, so that a broker that died before it ever reached
    /// this one is judged too.
    fn watch_brokers(&mut self, registry: &Registry, me: NodeId, now_ms: u64) {
        let unheard = registry
            .members()
            .filter(|m| m.role == Role::Broker && m.alive && m.node != me);
        for m in unheard {
            let heard = Heard {
                epoch: m.epoch,
                at_ms: now_ms,
            };
            self.0.entry(m.node).or_insert(heard);
        }
    }
}

impl BrokerState {
    /// Takes a heartbeat from `node` (this broker's own included, to announce itself).
    ///
    /// Records when it was heard, and writes an alive membership row (in `gossip`) only when
    /// the row is new or differs: a new epoch, other addresses or role, or a row marked dead.
    /// A steady heartbeat changes nothing. A heartbeat from an epoch older than the table's is
    /// refused ([`BrokerError::StaleEpoch`]) and not counted.
    pub fn heartbeat(
        &mut self,
        node: NodeId,
        role: Role,
        addrs: Vec<String>,
        epoch: u64,
        now_ms: u64,
    ) -> Result<Changes, BrokerError> {
        let row = Member {
            node,
            role,
            addrs,
            epoch,
            alive: true,
            stamp: Stamp::ZERO,
        };
        row.validate()?;
        let known = self.registry.member(&node);
        // A node that left at this epoch does not come back in it: a heartbeat it sent just
        // before closing can reach the actor after the leave, and would otherwise make the
        // row alive again, to be marked dead (not left) and kept for a day.
        if let Some(known) = known.filter(|k| k.epoch > epoch || (k.epoch == epoch && k.has_left()))
        {
            return Err(BrokerError::StaleEpoch {
                node,
                epoch,
                known: known.epoch,
            });
        }
        self.heard.0.insert(
            node,
            Heard {
                epoch,
                at_ms: now_ms,
            },
        );
        let same = known
            .is_some_and(|k| k.epoch == epoch && k.alive && k.role == role && k.addrs == row.addrs);
        match same {
            true => Ok(Changes::default()),
            false => Ok(self.local_op(RegistryOp::Member(row), now_ms)),
        }
    }

    /// Takes a clean leave: `node`, which heartbeated at `epoch` on a ctl connection it then
    /// closed saying it shuts down. Writes its row as left (dead, no addresses) when the row
    /// is a worker's, alive, and of that life: a leave from a previous life (a restart whose
    /// first heartbeat came first) or a broker's changes nothing (a broker's row keeps its
    /// addresses, which peers find it back by). This broker stops judging the node.
    pub fn leave(&mut self, node: NodeId, epoch: u64, now_ms: u64) -> Changes {
        let Some(row) = self.registry.member(&node) else {
            return Changes::default();
        };
        if !row.alive || row.epoch != epoch || row.role != Role::Worker || node == self.node() {
            return Changes::default();
        }
        let left = Member {
            alive: false,
            addrs: Vec::new(),
            ..row.clone()
        };
        self.heard.0.remove(&node);
        tracing::info!(node = %node, epoch, "left: the node closed its connection at shutdown");
        self.local_op(RegistryOp::Member(left), now_ms)
    }

    /// Marks dead the workers this broker heard from but not for longer than
    /// `liveness_timeout_ms`, forgets them until they are heard again, and drops fetches
    /// in flight that went without news for `fetch_timeout_ms`. Forgets rows and marks past
    /// their [expiry](crate::BrokerConfig::expiry), at most once every
    /// [`forget_period_ms`](crate::BrokerConfig::forget_period_ms). Call it periodically.
    pub fn expire(&mut self, now_ms: u64) -> Changes {
        let (timeout, me) = (self.config.liveness_timeout_ms, self.node());
        self.heard.watch_brokers(&self.registry, me, now_ms);
        let silent = |h: &Heard| now_ms.saturating_sub(h.at_ms) > timeout;
        let dead: Vec<Member> = self
            .heard
            .0
            .iter()
            .filter(|(_, h)| silent(h))
            .filter_map(|(node, h)| {
                let row = self.registry.member(node)?;
                // A broker never judges itself (it heard its own start-up heartbeat only).
                let judge = row.alive && *node != me && row.epoch == h.epoch;
                judge.then(|| Member {
                    alive: false,
                    ..row.clone()
                })
            })
            .collect();
        self.heard.0.retain(|_, h| !silent(h));
        let heard = &self.heard;
        self.fanout.retain_limits(|n| heard.knows(n));
        self.fanout.expire(now_ms);
        let mut changes = Changes::default();
        for row in dead {
            tracing::info!(node = %row.node, role = ?row.role, epoch = row.epoch, "silent: marked dead");
            changes.extend(self.local_op(RegistryOp::Member(row), now_ms));
        }
        changes.extend(self.refute_own_death(now_ms));
        changes.extend(self.forget_expired(now_ms));
        changes
    }

    /// Writes this broker alive again if a peer marked it dead (it lost this broker's
    /// heartbeats in a partition, say): a broker is the authority on its own life.
    fn refute_own_death(&mut self, now_ms: u64) -> Changes {
        let me = self.node();
        let Some(row) = self.registry.member(&me).filter(|m| !m.alive) else {
            return Changes::default();
        };
        let row = Member {
            alive: true,
            ..row.clone()
        };
        tracing::info!(
            epoch = row.epoch,
            "marked dead by a peer: writing this broker alive"
        );
        self.local_op(RegistryOp::Member(row), now_ms)
    }
}

#[cfg(test)]
mod tests {
    use tb_proto::{MAX_ADDR_LEN, RegistryError};

    use super::*;
    use crate::BrokerConfig;

    fn id(b: u8) -> NodeId {
        NodeId([b; 32])
    }

    fn broker() -> BrokerState {
        BrokerState::new(id(100), BrokerConfig::default(), Registry::new(), 0)
    }

    fn addrs(a: &str) -> Vec<String> {
        vec![a.to_string()]
    }

    fn member_ops(changes: &Changes) -> Vec<&Member> {
        changes
            .gossip
            .iter()
            .filter_map(|op| match op {
                RegistryOp::Member(m) => Some(m),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn heartbeat_writes_a_row_only_when_something_changed() {
        let mut b = broker();
        let w = id(1);
        let first = b.heartbeat(w, Role::Worker, addrs("a:1"), 1, 1_000);
        let first = first.expect("first");
        assert_eq!(first.members, [w]);
        let row = member_ops(&first)[0].clone();
        assert!(row.alive && row.epoch == 1 && row.stamp.node == id(100));

        let steady = b.heartbeat(w, Role::Worker, addrs("a:1"), 1, 2_000);
        assert!(steady.expect("steady").is_empty());

        let moved = b.heartbeat(w, Role::Worker, addrs("a:2"), 1, 3_000);
        assert_eq!(member_ops(&moved.expect("moved"))[0].addrs, addrs("a:2"));
        let restarted = b.heartbeat(w, Role::Worker, addrs("a:2"), 2, 4_000);
        assert_eq!(member_ops(&restarted.expect("restart"))[0].epoch, 2);
        assert_eq!(b.registry.member(&w).map(|m| m.epoch), Some(2));

        // A heartbeat from the previous life is refused and does not count as news.
        let stale = b.heartbeat(w, Role::Worker, addrs("a:1"), 1, 5_000);
        assert_eq!(
            stale,
            Err(BrokerError::StaleEpoch {
                node: w,
                epoch: 1,
                known: 2
            })
        );
        assert!(b.expire(4_000 + 10_001).members.contains(&w));
    }

    #[test]
    fn heartbeat_addresses_are_checked() {
        let mut b = broker();
        let long = vec!["a".repeat(MAX_ADDR_LEN + 1)];
        assert!(matches!(
            b.heartbeat(id(1), Role::Worker, long, 1, 0),
            Err(BrokerError::Invalid(RegistryError::AddrTooLong { .. }))
        ));
        assert!(b.members().is_empty());
    }

    #[test]
    fn silent_workers_expire_once_and_a_heartbeat_revives_them() {
        let mut b = broker();
        let w = id(1);
        b.heartbeat(w, Role::Worker, addrs("a:1"), 1, 1_000)
            .expect("hb");
        assert!(b.expire(11_000).is_empty(), "exactly at the timeout: alive");
        let expired = b.expire(11_001);
        let rows = member_ops(&expired);
        assert_eq!(rows.len(), 1);
        assert!(rows[0].node == w && !rows[0].alive && rows[0].epoch == 1);
        assert_eq!(b.registry.member(&w).map(|m| m.alive), Some(false));
        assert!(b.expire(50_000).is_empty(), "judged once, then forgotten");

        let back = b.heartbeat(w, Role::Worker, addrs("a:1"), 1, 60_000);
        let rows = back.expect("revived");
        assert!(member_ops(&rows)[0].alive);
        assert_eq!(b.registry.member(&w).map(|m| m.alive), Some(true));
    }

    #[test]
    fn peer_brokers_are_judged_like_workers_and_a_broker_never_judges_itself() {
        let mut b = broker();
        let me = b.node();
        b.heartbeat(me, Role::Broker, addrs("b:0"), 1, 1_000)
            .expect("own start-up heartbeat");
        b.heartbeat(id(2), Role::Broker, addrs("b:2"), 1, 1_000)
            .expect("a peer's heartbeat");
        let expired = b.expire(11_001);
        let rows = member_ops(&expired);
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert!(rows[0].node == id(2) && rows[0].role == Role::Broker && !rows[0].alive);
        assert_eq!(b.registry.member(&me).map(|m| m.alive), Some(true));

        // A peer that lost this broker's heartbeats marked it dead: it writes itself alive.
        let mut dead = b.registry.member(&me).expect("own row").clone();
        dead.alive = false;
        dead.stamp = Stamp {
            wall_ms: 20_000,
            logical: 0,
            node: id(2),
        };
        b.remote_op(&RegistryOp::Member(dead), 20_000)
            .expect("applied");
        assert_eq!(b.registry.member(&me).map(|m| m.alive), Some(false));
        let refuted = b.expire(21_000);
        let rows = member_ops(&refuted);
        assert!(
            rows.len() == 1 && rows[0].node == me && rows[0].alive,
            "{rows:?}"
        );
        assert_eq!(b.registry.member(&me).map(|m| m.alive), Some(true));
    }

    #[test]
    fn a_peer_broker_never_heard_is_judged_one_timeout_after_it_was_learned() {
        let mut b = broker();
        let row = Member {
            node: id(7),
            role: Role::Broker,
            addrs: addrs("b:7"),
            epoch: 1,
            alive: true,
            stamp: Stamp {
                wall_ms: 1_000,
                logical: 0,
                node: id(7),
            },
        };
        b.remote_op(&RegistryOp::Member(row), 1_000)
            .expect("applied");
        assert!(b.expire(2_000).is_empty(), "the clock starts now");
        assert!(
            b.expire(12_000).is_empty(),
            "exactly one timeout later: alive"
        );
        let expired = b.expire(12_001);
        let rows = member_ops(&expired);
        assert!(
            rows.len() == 1 && rows[0].node == id(7) && !rows[0].alive,
            "{rows:?}"
        );
        assert!(b.expire(100_000).is_empty(), "judged once");
    }

    #[test]
    fn workers_judged_only_by_brokers_that_heard_them() {
        // Another broker's gossip tells this one about a worker it never heard.
        let mut b = broker();
        let row = Member {
            node: id(1),
            role: Role::Worker,
            addrs: addrs("a:1"),
            epoch: 1,
            alive: true,
            stamp: Stamp {
                wall_ms: 1_000,
                logical: 0,
                node: id(101),
            },
        };
        let applied = b.remote_op(&RegistryOp::Member(row.clone()), 1_000);
        assert_eq!(applied.expect("applied").members, [id(1)]);
        assert!(b.expire(1_000_000).is_empty());

        // Heard at epoch 1, restarted at epoch 2 talking to another broker: not ours to judge.
        b.heartbeat(id(1), Role::Worker, addrs("a:1"), 1, 2_000)
            .expect("hb");
        let restarted = Member {
            epoch: 2,
            stamp: Stamp {
                wall_ms: 3_000,
                ..row.stamp
            },
            ..row
        };
        b.remote_op(&RegistryOp::Member(restarted), 3_000)
            .expect("applied");
        assert!(b.expire(100_000).is_empty());
    }

    #[test]
    fn restarted_broker_gives_loaded_workers_a_grace_period() {
        let mut before = broker();
        before
            .heartbeat(id(1), Role::Worker, addrs("a:1"), 1, 1_000)
            .expect("hb");
        before
            .heartbeat(id(2), Role::Worker, addrs("a:2"), 1, 1_000)
            .expect("hb");
        let registry = before.registry().clone();

        // Restarted long after: nobody is judged before a full timeout from the restart.
        let mut after = BrokerState::new(id(100), BrokerConfig::default(), registry, 500_000);
        assert!(after.expire(510_000).is_empty());
        after
            .heartbeat(id(2), Role::Worker, addrs("a:2"), 1, 505_000)
            .expect("hb");
        let expired = after.expire(510_001);
        let rows = member_ops(&expired);
        assert_eq!(rows.len(), 1);
        assert!(rows[0].node == id(1) && !rows[0].alive);
        // The dead row beats the alive one the restarted broker loaded.
        assert!(rows[0].stamp.wall_ms >= 510_001);
    }
}
