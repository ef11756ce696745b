//! The membership table as several brokers see it, merged into one (`tb status`). Pure.
//!
//! Membership rows are replicated, so brokers differ only while gossip catches up: the row
//! that [`Member::supersedes`] the others wins, as it will on every broker. Heartbeat stats are
//! not replicated: each broker knows those of the workers that heartbeat to it, so the freshest
//! heartbeat any broker heard is the one shown.

use std::collections::BTreeMap;

use tb_proto::{MemberStatus, NodeId};

use crate::{PeerAddr, error::Error};

/// The cluster's members as every reachable broker told them, merged
/// ([`Node::members_with_stats`](crate::Node::members_with_stats)).
#[derive(Debug, Clone)]
pub struct MembersView {
    /// One row per member in node id order, each with the freshest heartbeat stats that any
    /// broker that answered had (`None`: no broker heard stats from it).
    pub members: Vec<MemberStatus>,
    /// The brokers that answered, in the order the node knows them.
    pub answered: Vec<PeerAddr>,
    /// The brokers that did not, with why.
    pub unanswered: Vec<(PeerAddr, Error)>,
}

/// Merges the tables several brokers sent: per node, the superseding membership row and the
/// youngest heartbeat.
pub(crate) fn merge(answers: impl IntoIterator<Item = Vec<MemberStatus>>) -> Vec<MemberStatus> {
    let mut merged: BTreeMap<NodeId, MemberStatus> = BTreeMap::new();
    for row in answers.into_iter().flatten() {
        let Some(have) = merged.get_mut(&row.member.node) else {
            merged.insert(row.member.node, row);
            continue;
        };
        if row.member.supersedes(&have.member) {
            have.member = row.member;
        }
        let younger = match (&row.heartbeat, &have.heartbeat) {
            (Some(new), Some(old)) => new.age_ms < old.age_ms,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if younger {
            have.heartbeat = row.heartbeat;
        }
    }
    merged.into_values().collect()
}

#[cfg(test)]
mod tests {
    use tb_proto::{LastHeartbeat, Member, NodeStats, Role, Stamp};

    use super::*;

    fn row(node: u8, epoch: u64, alive: bool, age_ms: Option<u64>) -> MemberStatus {
        MemberStatus {
            member: Member {
                node: NodeId([node; 32]),
                role: Role::Worker,
                addrs: vec![format!("127.0.0.1:{}", 4000 + u16::from(node))],
                epoch,
                alive,
                stamp: Stamp::ZERO,
            },
            heartbeat: age_ms.map(|age_ms| LastHeartbeat {
                stats: NodeStats {
                    tensors: age_ms,
                    ..NodeStats::default()
                },
                age_ms,
            }),
        }
    }

    #[test]
    fn each_node_gets_the_newest_row_and_the_youngest_heartbeat() {
        // Broker A: worker 1 heartbeats to it, worker 2 is a stale row (older epoch, dead).
        let a = vec![row(1, 1, true, Some(700)), row(2, 1, false, None)];
        // Broker B: worker 2 heartbeats to it in its new life; it heard worker 1 long ago.
        let b = vec![row(1, 1, true, Some(9_000)), row(2, 2, true, Some(300))];
        for answers in [vec![a.clone(), b.clone()], vec![b, a]] {
            let merged = merge(answers);
            assert_eq!(merged.len(), 2);
            assert_eq!(merged[0].member.node, NodeId([1; 32]));
            assert_eq!(merged[0].heartbeat.as_ref().map(|h| h.age_ms), Some(700));
            assert_eq!(
                merged[0].heartbeat.as_ref().map(|h| h.stats.tensors),
                Some(700)
            );
            assert_eq!((merged[1].member.epoch, merged[1].member.alive), (2, true));
            assert_eq!(merged[1].heartbeat.as_ref().map(|h| h.age_ms), Some(300));
        }
    }

    #[test]
    fn a_node_only_one_broker_knows_is_kept_and_none_is_invented() {
        let merged = merge([
            vec![row(3, 1, true, None)],
            vec![],
            vec![row(1, 1, true, None)],
        ]);
        let nodes: Vec<u8> = merged.iter().map(|r| r.member.node.0[0]).collect();
        assert_eq!(nodes, vec![1, 3], "node id order");
        assert!(merged.iter().all(|r| r.heartbeat.is_none()));
        assert!(merge(Vec::<Vec<MemberStatus>>::new()).is_empty());
    }
}
