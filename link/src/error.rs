//! The link layer's error type: the failures of dialing, authenticating, pooling and framing
//! that a caller can act on. tb-node's `Error` has a variant for each (it converts them one to
//! one), so a caller above sees the same variant whichever layer failed.

use std::time::Duration;

/// Result alias for link operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong with a link: reaching a peer, its hello, the pool, a frame.
///
/// Variants are what a caller can act on (retry, pick another peer, fix the address); the
/// message names the thing that failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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
    /// A frame is larger than its limit.
    #[error("too large: {0}")]
    TooLarge(String),
    /// The peer refused our cluster secret, or could not prove it knows it.
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
    /// The pool is shutting down or has shut down.
    #[error("node is shut down")]
    Shutdown,
    /// A transport or file-system error.
    #[error("i/o error: {0}")]
    Io(String),
}

impl Error {
    /// An `Io` error: `context` names what was being done.
    pub fn io(context: &str, err: impl std::fmt::Display) -> Self {
        Error::Io(format!("{context}: {err}"))
    }

    /// A `Timeout` waiting for `what` after `after`.
    pub fn timeout(what: impl Into<String>, after: Duration) -> Self {
        Error::Timeout {
            what: what.into(),
            after,
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
