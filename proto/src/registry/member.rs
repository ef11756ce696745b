//! [`Member`]: one row of the membership table (a node's role, addresses, epoch, liveness),
//! last writer wins on `(epoch, stamp)`.

use serde::{Deserialize, Serialize};

use super::RegistryError;
use crate::{NodeId, Stamp};

/// Most addresses one member may advertise.
pub const MAX_MEMBER_ADDRS: usize = 8;

/// Longest address, in bytes (`[ipv6%scope]:port` and relay URLs fit).
pub const MAX_ADDR_LEN: usize = 64;

/// What a node does in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Keeps the registry and serves tensors.
    Broker,
    /// Publishes and reads tensors through a broker.
    Worker,
}

/// A node as the membership table knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Member {
    /// The node.
    pub node: NodeId,
    /// What it does.
    pub role: Role,
    /// Where to reach it, at most [`MAX_MEMBER_ADDRS`] of at most [`MAX_ADDR_LEN`] bytes each.
    pub addrs: Vec<String>,
    /// Bumped by the node on every restart, so news of its previous life never wins.
    pub epoch: u64,
    /// Whether it is up (another node may write `false` for it, at the same epoch).
    pub alive: bool,
    /// When this row was written.
    pub stamp: Stamp,
}

impl Member {
    /// Checks the address limits on a row that came from the network.
    pub fn validate(&self) -> Result<(), RegistryError> {
        check_addrs(&self.node, &self.addrs)
    }

    /// Whether this row replaces `other` (a row for the same node): the greater
    /// `(epoch, stamp)` wins. Stamps carry their issuer's id, so honest rows never tie; rows
    /// that do are ordered by their remaining fields so every replica keeps the same one.
    pub fn supersedes(&self, other: &Member) -> bool {
        fn key(m: &Member) -> (u64, Stamp, bool, Role, &[String]) {
            (m.epoch, m.stamp, m.alive, m.role, &m.addrs)
        }
        key(self) > key(other)
    }
}

/// Checks the address limits on the addresses `node` advertises.
pub(crate) fn check_addrs(node: &NodeId, addrs: &[String]) -> Result<(), RegistryError> {
    if addrs.len() > MAX_MEMBER_ADDRS {
        return Err(RegistryError::TooManyAddrs {
            node: *node,
            count: addrs.len(),
        });
    }
    match addrs.iter().find(|a| a.len() > MAX_ADDR_LEN) {
        Some(long) => Err(RegistryError::AddrTooLong {
            node: *node,
            len: long.len(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(epoch: u64, wall_ms: u64, alive: bool) -> Member {
        Member {
            node: NodeId([1; 32]),
            role: Role::Broker,
            addrs: vec!["10.0.0.1:4433".into()],
            epoch,
            alive,
            stamp: Stamp {
                wall_ms,
                logical: 0,
                node: NodeId([1; 32]),
            },
        }
    }

    #[test]
    fn newer_epoch_beats_a_later_stamp_from_the_previous_life() {
        let old_life_down = member(1, 9_000, false);
        let restarted = member(2, 5_000, true);
        assert!(restarted.supersedes(&old_life_down));
        assert!(!old_life_down.supersedes(&restarted));
        assert!(member(2, 6_000, false).supersedes(&restarted));
        assert!(!restarted.supersedes(&restarted));
    }

    #[test]
    fn rows_tied_on_epoch_and_stamp_resolve_the_same_everywhere() {
        let up = member(1, 5, true);
        let down = member(1, 5, false);
        assert!(up.supersedes(&down) != down.supersedes(&up));
        let moved = Member {
            addrs: vec!["10.0.0.2:4433".into()],
            ..up.clone()
        };
        assert!(up.supersedes(&moved) != moved.supersedes(&up));
    }

    #[test]
    fn address_limits_are_checked() {
        let mut m = member(1, 1, true);
        assert!(m.validate().is_ok());
        m.addrs = vec!["a".repeat(MAX_ADDR_LEN); MAX_MEMBER_ADDRS];
        assert!(m.validate().is_ok());
        m.addrs.push("x".into());
        assert_eq!(
            m.validate(),
            Err(RegistryError::TooManyAddrs {
                node: m.node,
                count: MAX_MEMBER_ADDRS + 1
            })
        );
        m.addrs = vec!["a".repeat(MAX_ADDR_LEN + 1)];
        let err = m.validate().expect_err("too long");
        assert_eq!(
            err,
            RegistryError::AddrTooLong {
                node: m.node,
                len: MAX_ADDR_LEN + 1
            }
        );
        assert!(err.to_string().contains("0101010101"), "{err}");
    }
}
