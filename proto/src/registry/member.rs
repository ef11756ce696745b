//! [`Member`]: one row of the membership table (a node's role, addresses, epoch, liveness),
//! last writer wins on `(epoch, stamp)`; [`Expiry`]: when rows of nodes that are gone are
//! dropped.

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

/// How long the registry keeps what nodes that are gone left behind. Every broker of a cluster
/// should use the same values (a broker with shorter ones drops rows sooner, and takes them
/// back from its peers until their rows expire there too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expiry {
    /// A row marked dead (its node fell silent) is dropped once it is older than this; so is a
    /// holder mark of a node the table has no row for.
    pub dead_after_ms: u64,
    /// A row of a node that [left](Member::has_left) is dropped once it is older than this.
    /// It must outlast the time the row takes to reach every broker (gossip, then the next
    /// anti-entropy round): a broker that drops it first could otherwise take the node's
    /// older alive row back from a peer that has not heard of the leave yet.
    pub left_after_ms: u64,
}

impl Expiry {
    /// Default of [`dead_after_ms`](Self::dead_after_ms): a day.
    pub const DEAD_AFTER_MS: u64 = 24 * 60 * 60 * 1000;
    /// Default of [`left_after_ms`](Self::left_after_ms): five minutes (sixty anti-entropy
    /// rounds at the default interval).
    pub const LEFT_AFTER_MS: u64 = 5 * 60 * 1000;

    /// Whether a holder mark stamped `stamp` of a node without a row is past keeping at
    /// `now_ms`.
    pub fn mark_expired(&self, stamp: &Stamp, now_ms: u64) -> bool {
        now_ms.saturating_sub(stamp.wall_ms) > self.dead_after_ms
    }
}

impl Default for Expiry {
    fn default() -> Self {
        Expiry {
            dead_after_ms: Self::DEAD_AFTER_MS,
            left_after_ms: Self::LEFT_AFTER_MS,
        }
    }
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

    /// Whether the node left: a broker writes this row (dead, no addresses) when the node
    /// closes its connection saying it shuts down, so that a short-lived client's row goes
    /// soon after it does ([`Expiry::left_after_ms`]) rather than after a day.
    pub fn has_left(&self) -> bool {
        !self.alive && self.addrs.is_empty()
    }

    /// Whether this row is past keeping at `now_ms` (by the local clock): dead, and older
    /// than `expiry` allows for a node that [left](Self::has_left) or one that fell silent.
    /// A pure function of the row and the clock, so every replica drops the same rows, and a
    /// row dropped once is dropped again wherever it comes back from (a peer, the disk).
    pub fn expired(&self, now_ms: u64, expiry: &Expiry) -> bool {
        let keep = match self.has_left() {
            true => expiry.left_after_ms,
            false => expiry.dead_after_ms,
        };
        !self.alive && now_ms.saturating_sub(self.stamp.wall_ms) > keep
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
    fn dead_rows_expire_after_their_age_and_alive_rows_never() {
        let expiry = Expiry {
            dead_after_ms: 1_000,
            left_after_ms: 100,
        };
        let dead = member(1, 5_000, false);
        assert!(!dead.expired(6_000, &expiry), "exactly the age: kept");
        assert!(dead.expired(6_001, &expiry));
        assert!(!member(1, 5_000, true).expired(u64::MAX, &expiry));
        let left = Member {
            addrs: Vec::new(),
            ..dead.clone()
        };
        assert!(left.has_left() && !dead.has_left());
        assert!(!left.expired(5_100, &expiry) && left.expired(5_101, &expiry));
        // A clock behind the row's stamp keeps it.
        assert!(!dead.expired(0, &expiry));
        assert!(!expiry.mark_expired(&dead.stamp, 6_000));
        assert!(expiry.mark_expired(&dead.stamp, 6_001));
        assert_eq!(Expiry::default().dead_after_ms, 86_400_000);
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
