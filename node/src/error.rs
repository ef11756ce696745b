//! The node's error type: one variant per thing a caller can act on.

use std::time::Duration;

use tb_proto::{ErrorCode, MetaError, NameError};

/// Result alias for node operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a node operation.
///
/// Variants are what a caller can act on (retry, pick another peer, fix the input); the
/// message names the thing that failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The peer does not hold the tensor (or that version of it).
    #[error("not found: {what}")]
    NotFound {
        /// What was looked for, e.g. `tensor "model/w" v7 at 3f2a…`.
        what: String,
    },
    /// An operation did not finish within its time limit.
    #[error("timed out after {after:?}: {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// The limit that expired.
        after: Duration,
    },
    /// The peer could not be reached (dial failed, connection lost before any answer).
    #[error("peer {peer} unreachable: {reason}")]
    PeerUnreachable {
        /// Short form of the peer's node id.
        peer: String,
        /// Why, as the transport reported it.
        reason: String,
    },
    /// A node address string could not be parsed.
    #[error("bad node address {input:?}: {reason} (expected <node-id>@<ip:port>)")]
    BadAddress {
        /// What the user gave.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor name broke the naming rules.
    #[error("invalid tensor name: {0}")]
    InvalidName(#[from] NameError),
    /// The tensor (or a frame) is larger than the configured or the peer's maximum.
    #[error("too large: {0}")]
    TooLarge(String),
    /// The peer cannot take it now (its push budget or inbox is full): nothing was kept.
    /// Retry later, or send to another peer.
    #[error("busy: {0}")]
    Busy(String),
    /// Tensor metadata and data disagree (shape, dtype, byte length, rank).
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),
    /// Received bytes do not hash to the hash the sender announced.
    #[error("corrupt transfer: {0}")]
    Corrupt(String),
    /// The peer refused us (reserved for cluster auth).
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// A pool is at its maximum size with every link in use: this node's, or the peer's,
    /// which refused our connection before serving any request on it. Retry later.
    #[error("too many connections: {}", too_many(peer.as_deref(), *max))]
    TooManyConnections {
        /// The short id of the peer whose pool is full; `None` when it is this node's.
        peer: Option<String>,
        /// The full pool's maximum number of links, when known (a peer does not say).
        max: Option<usize>,
    },
    /// The peer answered with an error this node has no more specific variant for.
    #[error("peer {peer} refused: {code:?}: {message}")]
    Remote {
        /// Short form of the peer's node id.
        peer: String,
        /// The wire error code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// No usable CUDA device: the node was built without the `cuda` feature, the driver
    /// library is missing, or the device ordinal does not exist.
    #[error("device unavailable: {0}")]
    DeviceUnavailable(String),
    /// A CUDA device (or its pinned host staging memory) ran out of memory.
    #[error("device out of memory: {0}")]
    DeviceOutOfMemory(String),
    /// A CUDA driver call failed for another reason.
    #[error("device error: {0}")]
    Device(String),
    /// A cluster call on a node with no brokers configured (`Config::brokers` is empty).
    #[error("standalone node: no brokers configured (set Config::brokers to join a cluster)")]
    Standalone,
    /// No broker could be reached: each of the `tried` brokers failed (dial, hello, timeout,
    /// connection lost, or it is shutting down). Retry later, or check the broker list.
    #[error("no broker reachable: tried {tried}: {}", failures_text(failures))]
    NoBroker {
        /// How many brokers were tried.
        tried: usize,
        /// Each broker tried and why it failed, in the order they failed.
        failures: Vec<BrokerFailure>,
    },
    /// The broker named holders of a tensor, but none of them could serve it (unreachable,
    /// lost it, or sent corrupt bytes), even after a second look-up. Retry later.
    #[error("no holder could serve {what}: tried {tried}, last error: {last}")]
    NoHolder {
        /// The tensor, e.g. `tensor "model/w" v7`.
        what: String,
        /// How many holders were tried.
        tried: usize,
        /// Why the last one failed.
        last: String,
    },
    /// The node serving a version it was still receiving (cut-through) lost that receive, or
    /// had to start it over: the bytes stop. Pull the rest from another holder.
    #[error("source aborted: {0}")]
    SourceAborted(String),
    /// The node is shutting down or has shut down.
    #[error("node is shut down")]
    Shutdown,
    /// What was to be registered is registered already (a second service for one request
    /// kind): take the first out before adding another.
    #[error("in use: {0}")]
    InUse(String),
    /// A transport or file-system error.
    #[error("i/o error: {0}")]
    Io(String),
}

impl Error {
    pub(crate) fn io(context: &str, err: impl std::fmt::Display) -> Self {
        Error::Io(format!("{context}: {err}"))
    }

    pub(crate) fn timeout(what: impl Into<String>, after: Duration) -> Self {
        Error::Timeout {
            what: what.into(),
            after,
        }
    }
}

/// Why one broker failed a call: an item of [`Error::NoBroker`].
#[derive(Debug, Clone)]
pub struct BrokerFailure {
    /// The broker, as `<short id>@<ip:port>`.
    pub broker: String,
    /// What went wrong with it.
    pub error: Error,
}

impl std::fmt::Display for BrokerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.broker, self.error)
    }
}

/// The failures of [`Error::NoBroker`], one per broker, `; `-separated.
fn failures_text(failures: &[BrokerFailure]) -> String {
    match failures.is_empty() {
        true => "no brokers configured".into(),
        false => {
            let each: Vec<String> = failures.iter().map(ToString::to_string).collect();
            each.join("; ")
        }
    }
}

/// The message of [`Error::TooManyConnections`].
fn too_many(peer: Option<&str>, max: Option<usize>) -> String {
    match (peer, max) {
        (Some(peer), _) => format!("{peer} refused the connection: its pool is full"),
        (None, Some(max)) => format!("all {max} pooled links are in use"),
        (None, None) => "all pooled links are in use".into(),
    }
}

impl From<tb_link::Error> for Error {
    /// The link layer's failures keep their variant: a caller acts on `PeerUnreachable`,
    /// `Timeout`, `TooManyConnections` or `Unauthorized` alike whichever layer failed.
    fn from(err: tb_link::Error) -> Self {
        use tb_link::Error as Link;
        match err {
            Link::Timeout { what, after } => Error::Timeout { what, after },
            Link::PeerUnreachable { peer, reason } => Error::PeerUnreachable { peer, reason },
            Link::BadAddress { input, reason } => Error::BadAddress { input, reason },
            Link::TooLarge(what) => Error::TooLarge(what),
            Link::Unauthorized(why) => Error::Unauthorized(why),
            Link::TooManyConnections { peer, max } => Error::TooManyConnections { peer, max },
            Link::Shutdown => Error::Shutdown,
            Link::Io(what) => Error::Io(what),
            // `tb_link::Error` is non-exhaustive: a variant added there reads as I/O here
            // until it gets its own.
            other => Error::Io(other.to_string()),
        }
    }
}

impl From<MetaError> for Error {
    fn from(err: MetaError) -> Self {
        match err {
            MetaError::TooLarge { len, max } => {
                Error::TooLarge(format!("{len} bytes, the limit is {max}"))
            }
            other => Error::InvalidTensor(other.to_string()),
        }
    }
}
