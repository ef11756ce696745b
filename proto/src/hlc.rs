//! [`NodeId`] and the hybrid logical clock: [`Hlc`] hands out [`Stamp`]s that order registry
//! writes across nodes even when wall clocks disagree.
//!
//! A stamp is `(wall_ms, logical, node)`, compared in that order. The wall part keeps stamps
//! close to real time; the logical counter breaks ties within a millisecond and keeps the clock
//! monotonic when the wall clock steps back; the node id makes two nodes' stamps never equal.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How far ahead of the local wall clock a remote stamp may be before [`Hlc::observe`] refuses
/// it, in milliseconds. Without a bound, one node with a clock set to the year 3000 would drag
/// every clock in the cluster there for good.
pub const MAX_DRIFT_MS: u64 = 60_000;

/// A node's identity: its iroh public key, 32 bytes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct NodeId(pub [u8; 32]);

impl NodeId {
    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0[..5]))
    }
}

/// A hybrid logical clock reading: totally ordered by wall time, then logical counter, then
/// node id.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
pub struct Stamp {
    /// Milliseconds since the Unix epoch, as the issuing clock saw them (never decreasing).
    pub wall_ms: u64,
    /// Counter that orders stamps sharing one `wall_ms`.
    pub logical: u32,
    /// The node that issued the stamp.
    pub node: NodeId,
}

impl Stamp {
    /// The least stamp: below everything a clock issues.
    pub const ZERO: Stamp = Stamp {
        wall_ms: 0,
        logical: 0,
        node: NodeId([0; 32]),
    };
}

/// Why a remote stamp was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClockError {
    /// The stamp is more than [`MAX_DRIFT_MS`] ahead of the local wall clock.
    #[error(
        "stamp from {node} is at {remote_wall_ms} ms, {} ms ahead of the local clock at \
         {local_wall_ms} ms (limit {MAX_DRIFT_MS} ms)",
        remote_wall_ms.saturating_sub(*local_wall_ms)
    )]
    TooFarAhead {
        /// The node that issued the stamp.
        node: NodeId,
        /// The stamp's wall time.
        remote_wall_ms: u64,
        /// The local wall time it was compared with.
        local_wall_ms: u64,
    },
}

/// A hybrid logical clock for one node: every stamp it issues is greater than every stamp it
/// issued or observed before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hlc {
    node: NodeId,
    /// The greatest `(wall_ms, logical)` issued or observed.
    last: (u64, u32),
}

impl Hlc {
    /// A clock for `node` that has seen nothing yet.
    pub fn new(node: NodeId) -> Self {
        Hlc { node, last: (0, 0) }
    }

    /// The node this clock stamps for.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The greatest stamp issued or observed so far, as if this node had issued it.
    pub fn last(&self) -> Stamp {
        Stamp {
            wall_ms: self.last.0,
            logical: self.last.1,
            node: self.node,
        }
    }

    /// A new stamp, greater than every earlier one, given the wall clock now.
    pub fn now(&mut self, wall_ms: u64) -> Stamp {
        let (last_wall, last_logical) = self.last;
        self.last = if wall_ms > last_wall {
            (wall_ms, 0)
        } else {
            match last_logical.checked_add(1) {
                Some(logical) => (last_wall, logical),
                // 4 billion stamps in one millisecond: borrow the next millisecond rather than
                // wrap. `last_wall` cannot be u64::MAX: observe bounds it near real time.
                None => (last_wall.saturating_add(1), 0),
            }
        };
        self.last()
    }

    /// Takes in a stamp seen on a remote write, so that later local stamps exceed it. A stamp
    /// more than [`MAX_DRIFT_MS`] ahead of `wall_ms` is refused and leaves the clock as it was;
    /// the caller decides whether to drop the write that carried it.
    pub fn observe(&mut self, remote: &Stamp, wall_ms: u64) -> Result<(), ClockError> {
        if remote.wall_ms > wall_ms.saturating_add(MAX_DRIFT_MS) {
            return Err(ClockError::TooFarAhead {
                node: remote.node,
                remote_wall_ms: remote.wall_ms,
                local_wall_ms: wall_ms,
            });
        }
        self.last = self.last.max((remote.wall_ms, remote.logical));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(b: u8) -> NodeId {
        NodeId([b; 32])
    }

    #[test]
    fn stamps_order_by_wall_then_logical_then_node() {
        let s = |wall_ms, logical, n| Stamp {
            wall_ms,
            logical,
            node: id(n),
        };
        assert!(s(1, 9, 9) < s(2, 0, 0));
        assert!(s(2, 0, 9) < s(2, 1, 0));
        assert!(s(2, 1, 0) < s(2, 1, 1));
        assert_eq!(Stamp::ZERO, Stamp::default());
        assert!(Stamp::ZERO <= s(0, 0, 0));
    }

    #[test]
    fn now_is_monotonic_when_the_wall_clock_steps_back() {
        let mut c = Hlc::new(id(1));
        let a = c.now(1000);
        let b = c.now(1000);
        let back = c.now(400);
        let ahead = c.now(2000);
        assert_eq!((a.wall_ms, a.logical), (1000, 0));
        assert_eq!((b.wall_ms, b.logical), (1000, 1));
        assert_eq!((back.wall_ms, back.logical), (1000, 2));
        assert_eq!((ahead.wall_ms, ahead.logical), (2000, 0));
        assert!(a < b && b < back && back < ahead);
        assert_eq!(ahead.node, id(1));
    }

    #[test]
    fn logical_overflow_borrows_the_next_millisecond() {
        let mut c = Hlc::new(id(1));
        c.observe(
            &Stamp {
                wall_ms: 5,
                logical: u32::MAX,
                node: id(2),
            },
            5,
        )
        .expect("in range");
        let s = c.now(5);
        assert_eq!((s.wall_ms, s.logical), (6, 0));
    }

    #[test]
    fn later_local_stamps_exceed_observed_ones() {
        let mut c = Hlc::new(id(1));
        c.now(1000);
        let remote = Stamp {
            wall_ms: 30_000,
            logical: 7,
            node: id(200),
        };
        c.observe(&remote, 1000).expect("within drift");
        let s = c.now(1000);
        assert!(s > remote, "{s:?} must exceed {remote:?}");
        assert_eq!((s.wall_ms, s.logical), (30_000, 8));
        // Observing something older changes nothing.
        c.observe(&Stamp::ZERO, 1000).expect("old is fine");
        assert!(c.now(1000) > s);
    }

    #[test]
    fn stamps_too_far_ahead_are_refused_and_not_adopted() {
        let mut c = Hlc::new(id(1));
        let before = c.now(1000);
        let edge = Stamp {
            wall_ms: 1000 + MAX_DRIFT_MS,
            logical: 0,
            node: id(2),
        };
        let over = Stamp {
            wall_ms: 1001 + MAX_DRIFT_MS,
            ..edge
        };
        assert_eq!(
            c.observe(&over, 1000),
            Err(ClockError::TooFarAhead {
                node: id(2),
                remote_wall_ms: 1001 + MAX_DRIFT_MS,
                local_wall_ms: 1000
            })
        );
        assert_eq!(c.last(), before);
        assert!(c.observe(&edge, 1000).is_ok());
        assert!(c.now(1000) > edge);
        // Far-future local time must not overflow the check.
        assert!(c.observe(&edge, u64::MAX).is_ok());
    }

    #[test]
    fn node_ids_print_as_hex() {
        let n = NodeId([0xab; 32]);
        assert_eq!(n.to_string(), "ab".repeat(32));
        assert_eq!(format!("{n:?}"), "ababababab");
        let e = ClockError::TooFarAhead {
            node: id(1),
            remote_wall_ms: 70_000,
            local_wall_ms: 0,
        };
        assert!(e.to_string().contains("70000 ms ahead"), "{e}");
    }
}
