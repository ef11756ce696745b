//! [`MemberStatus`]: one row of a `Members` answer — a membership row with the figures its
//! node last sent in a heartbeat to the answering broker, for `tb status`.

use serde::{Deserialize, Serialize};

use super::{CtlError, NodeStats};
use crate::Member;

/// A member as `tb status` shows it: its membership row, and its latest heartbeat stats
/// when it heartbeats to the broker that answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberStatus {
    /// The membership row (role, addresses, epoch, liveness).
    pub member: Member,
    /// What its last heartbeat to the answering broker said, and how long ago. `None` for
    /// brokers, nodes that send no stats, nodes that heartbeat to another broker, and stats
    /// too old to show.
    pub heartbeat: Option<LastHeartbeat>,
}

/// A member's latest heartbeat stats as one broker received them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LastHeartbeat {
    /// The figures the heartbeat carried.
    pub stats: NodeStats,
    /// Milliseconds between that heartbeat's arrival and the answer.
    pub age_ms: u64,
}

impl MemberStatus {
    /// A row without heartbeat stats.
    pub fn without_stats(member: Member) -> Self {
        MemberStatus {
            member,
            heartbeat: None,
        }
    }

    /// Checks a row that came from the network: the member's address limits and the
    /// stats, as a heartbeat's are checked.
    pub fn validate(&self) -> Result<(), CtlError> {
        self.member.validate()?;
        self.heartbeat
            .as_ref()
            .map_or(Ok(()), |h| h.stats.validate())
    }
}
