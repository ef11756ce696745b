//! [`BrokerError`]: why the broker refused a request or an op, with the wire code it answers.

use tb_proto::{AccessError, ClockError, ErrorCode, MetaError, NodeId, RegistryError, TensorName};

/// Why the broker refused a request or an op. Every variant names what failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BrokerError {
    /// The name is unknown or deleted, or the version asked for is newer than the newest.
    #[error("tensor \"{name}\"{} not found", version.map(|v| format!(" v{v}")).unwrap_or_default())]
    NotFound {
        /// The tensor.
        name: TensorName,
        /// The version asked for, if one was.
        version: Option<u64>,
    },
    /// The version is older than the versions the registry keeps holders for.
    #[error("tensor \"{name}\" v{version} was evicted: the registry keeps v{oldest}..=v{newest}")]
    Evicted {
        /// The tensor.
        name: TensorName,
        /// The version asked for.
        version: u64,
        /// The oldest version kept.
        oldest: u64,
        /// The newest version.
        newest: u64,
    },
    /// The version is kept, but no live node with known addresses holds or fetches it.
    #[error("no live node holds tensor \"{name}\" v{version}")]
    NoHolder {
        /// The tensor.
        name: TensorName,
        /// The version.
        version: u64,
    },
    /// The version is kept, but this broker never saw its metadata (it was already superseded
    /// when this broker started or synced); ask for the newest version, or another broker.
    #[error("this broker does not know the metadata of tensor \"{name}\" v{version}")]
    UnknownMeta {
        /// The tensor.
        name: TensorName,
        /// The version.
        version: u64,
    },
    /// An op, entry or membership row failed validation.
    #[error(transparent)]
    Invalid(#[from] RegistryError),
    /// An op or entry carries a stamp too far in the future.
    #[error(transparent)]
    Clock(#[from] ClockError),
    /// A node announced an op on another node's behalf (publisher or holder is not the sender).
    #[error("node {sender:?} announced an op on behalf of node {claimed:?}")]
    NotYours {
        /// The authenticated sender.
        sender: NodeId,
        /// The node the op names.
        claimed: NodeId,
    },
    /// A node announced a membership row; rows come from heartbeats only.
    #[error("node {sender:?} announced a membership row; membership comes from heartbeats")]
    MemberOp {
        /// The authenticated sender.
        sender: NodeId,
    },
    /// An announced publish is not newer than the newest version known: another publish won
    /// the version. Ask for the next version again and publish under it.
    #[error("tensor \"{name}\" v{version} is not newer than v{newest}: ask for the next version")]
    StaleVersion {
        /// The tensor.
        name: TensorName,
        /// The version announced.
        version: u64,
        /// The newest version known (deleted or not).
        newest: u64,
    },
    /// An announced publish jumps more than [`MAX_VERSION_SKIP`](crate::MAX_VERSION_SKIP)
    /// past the next version, which would use up the name's versions.
    #[error("tensor \"{name}\" v{version} skips too far past the next version v{next}")]
    VersionSkip {
        /// The tensor.
        name: TensorName,
        /// The version announced.
        version: u64,
        /// The version the broker would assign.
        next: u64,
    },
    /// The sender proved only the read-only credential, and the request needs the cluster
    /// secret; the message names what needs it.
    #[error(transparent)]
    Access(#[from] AccessError),
    /// A heartbeat from an earlier life of a node than the membership table knows, or from
    /// the life it left (a heartbeat sent just before it closed, arriving after the leave).
    #[error(
        "heartbeat from node {node:?} at epoch {epoch}, before its known epoch {known} or of a life that left"
    )]
    StaleEpoch {
        /// The node.
        node: NodeId,
        /// The epoch it sent.
        epoch: u64,
        /// The epoch the membership table holds.
        known: u64,
    },
}

impl BrokerError {
    /// The code to answer on the wire.
    pub fn code(&self) -> ErrorCode {
        match self {
            BrokerError::NotFound { .. }
            | BrokerError::Evicted { .. }
            | BrokerError::NoHolder { .. }
            | BrokerError::UnknownMeta { .. } => ErrorCode::NotFound,
            BrokerError::Invalid(RegistryError::Meta {
                source: MetaError::TooLarge { .. },
                ..
            }) => ErrorCode::TooLarge,
            BrokerError::Invalid(RegistryError::Meta { .. }) => ErrorCode::InvalidTensor,
            BrokerError::NotYours { .. } | BrokerError::Access(_) => ErrorCode::Unauthorized,
            // The asker lost a race for the version; retrying with a fresh one succeeds.
            BrokerError::StaleVersion { .. } => ErrorCode::Busy,
            BrokerError::Invalid(_)
            | BrokerError::Clock(_)
            | BrokerError::MemberOp { .. }
            | BrokerError::VersionSkip { .. }
            | BrokerError::StaleEpoch { .. } => ErrorCode::Malformed,
        }
    }
}
