//! [`LinkConfig`]: what the hello and the pool read, and nothing else. A node builds it from
//! its own `Config` (tb-node's `Config::link`), so the knobs stay documented in one place for
//! users; this crate keeps the defaults, which the node's `Config::default` takes from here.

use std::time::Duration;

use tb_proto::ClusterKey;

/// Default [`LinkConfig::hello_timeout`]: a member's hello arrives within a round trip or two.
/// A connection that has not proved the cluster secret by then is closed, so a peer that
/// connects and says nothing cannot hold a handshake slot (or its memory) for long.
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Default [`LinkConfig::max_pending_handshakes`].
pub const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 64;

/// The limits of links: dialing, authenticating and pooling them.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Most peers holding a pooled link at once (each may hold up to
    /// [`MAX_LINKS_PER_PEER`](crate::MAX_LINKS_PER_PEER) live links).
    pub max_links: usize,
    /// A link with no stream open in either direction for this long is closed.
    pub idle_timeout: Duration,
    /// Bound on a dial and its hello together.
    pub connect_timeout: Duration,
    /// Bound on a new link's first exchange ([`LinkEvents::dialed`](crate::LinkEvents::dialed)).
    pub request_timeout: Duration,
    /// The cluster secret both sides of a hello prove (or the open key).
    pub cluster_key: ClusterKey,
    /// Bidirectional streams an authenticated peer may open on one link at once.
    pub max_concurrent_streams: u32,
    /// How long a connection may take to deliver a hello that verifies.
    pub hello_timeout: Duration,
    /// Connections that may wait for their hello at once; more are refused.
    pub max_pending_handshakes: usize,
}

impl Default for LinkConfig {
    /// The offline single-machine setup: 64 peers, idle links closed after 5 minutes.
    fn default() -> Self {
        LinkConfig {
            max_links: 64,
            idle_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            cluster_key: ClusterKey::open(),
            max_concurrent_streams: 1024,
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            max_pending_handshakes: DEFAULT_MAX_PENDING_HANDSHAKES,
        }
    }
}
