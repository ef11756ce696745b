//! Node configuration. `Config::default()` is the offline single-machine setup.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tb_dashboard::Metrics;
use tb_proto::{ClusterKey, NamePattern};

use crate::{
    device::{CudaConfig, Device},
    endpoint::PeerAddr,
};

/// Default maximum tensor size: 64 GiB.
pub const DEFAULT_MAX_TENSOR_BYTES: u64 = 64 << 30;

/// Default [`Config::hello_timeout`]: a member's hello arrives within a round trip or two.
pub const DEFAULT_HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Default [`Config::max_pending_handshakes`].
pub const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 64;

/// Everything a [`crate::Node`] can be tuned with.
#[derive(Debug, Clone)]
pub struct Config {
    /// UDP address the endpoint binds, and the only one it listens on (no IPv6 socket unless
    /// this is an IPv6 address). `127.0.0.1:0` (any free port) by default; daemons use a
    /// fixed port so their address survives restarts.
    pub bind_addr: SocketAddr,
    /// Where the identity key (`node.key`, mode 0600) is kept. `None`: a fresh key per run.
    pub data_dir: Option<PathBuf>,
    /// Close a pooled link after it has been unused this long.
    pub idle_timeout: Duration,
    /// Most pooled links at once; at the cap the least recently used idle link is evicted.
    pub max_links: usize,
    /// A dial that has not completed by then fails with `PeerUnreachable`.
    pub connect_timeout: Duration,
    /// Longest wait for a peer's first answer on a stream (a header, an ack).
    pub request_timeout: Duration,
    /// A payload read or write that makes no progress for this long fails with `Timeout`.
    pub stall_timeout: Duration,
    /// Largest tensor this node sends or accepts.
    pub max_tensor_bytes: u64,
    /// Pushed tensors held for `recv()` before new pushes wait (back-pressure to senders).
    pub inbox_capacity: usize,
    /// Versions of each name the store keeps (older ones are evicted, and a node in a cluster
    /// tells its broker it no longer holds them).
    pub keep_versions: usize,
    /// Per-name overrides of `keep_versions`: the first pattern that matches a name decides.
    /// Empty by default.
    pub keep_versions_for: Vec<(NamePattern, usize)>,
    /// Versions held longer than this are evicted, the newest included. `None` (the default):
    /// versions leave only when newer ones push them out.
    pub version_ttl: Option<Duration>,
    /// Concurrent streams a peer may open on one link.
    pub max_concurrent_streams: u32,
    /// Where tensors pushed to this node are placed: host memory (the default) or a CUDA
    /// device, received straight into it through pinned staging.
    pub push_placement: Device,
    /// Device transfers: staging chunk size and buffers, copies in flight, CUDA IPC.
    pub cuda: CudaConfig,
    /// The cluster secret's key: every connection proves it in its first frame, and peers that
    /// cannot are refused. [`ClusterKey::open`] (the default) admits any open node.
    pub cluster_key: ClusterKey,
    /// The brokers of the cluster this node joins, tried in order when one is unreachable.
    /// Empty (the default): a standalone node, whose cluster calls fail with
    /// [`Error::Standalone`](crate::Error::Standalone).
    pub brokers: Vec<PeerAddr>,
    /// How often a node with brokers tells the current broker it is alive (brokers mark a
    /// worker dead after 10 s of silence).
    pub heartbeat_interval: Duration,
    /// Whether this node heartbeats (is a member brokers list and offer as a holder). True by
    /// default; false for short-lived clients such as the `tb` CLI, which read and write
    /// through the cluster but should not show up as workers (nor be offered as holders of
    /// what they fetch).
    pub heartbeats: bool,
    /// Addresses (`ip:port`) this node tells brokers to give its peers. Empty (the default):
    /// the address it is bound to, with an unspecified IP read as loopback; set it when the
    /// node binds `0.0.0.0` on a machine that others reach over the network.
    pub advertise_addrs: Vec<SocketAddr>,
    /// Whether subscriptions fetch each new version they report (`SubEvent::Version` then
    /// carries the tensor). True by default.
    pub auto_fetch: bool,
    /// The process's metrics. `None` (the default): the node makes its own, as a worker's. A
    /// broker passes its own so node and broker families share one registry.
    pub metrics: Option<Arc<Metrics>>,
    /// Where this node's metrics server listens (`http://ip:port`), told to brokers in
    /// heartbeats so the dashboard can link to it. `None` by default.
    pub metrics_url: Option<String>,
    /// Most payload bytes per second this node sends to pullers, all streams together (a
    /// token bucket; see [`crate::rate`]). 0 (the default): unlimited. Useful to leave room
    /// for other traffic in production, and to measure broadcast trees on one machine.
    pub max_upload_rate: u64,
    /// A peer whose hello has not arrived and been verified this long after its connection
    /// opened is refused (closed, counted as `timeout`). Until then it holds at most the
    /// pre-auth window (see [`crate::endpoint`]).
    pub hello_timeout: Duration,
    /// Most inbound connections waiting for their hello at once, per protocol (`tb/data/1`,
    /// `tb/ctl/1`); beyond it a new connection is closed at once with
    /// [`CloseCode::TooManyHandshakes`](tb_proto::CloseCode::TooManyHandshakes) and counted
    /// as `too_many_pending` (0 counts as 1).
    pub max_pending_handshakes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            bind_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir: None,
            idle_timeout: Duration::from_secs(300),
            max_links: 64,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(30),
            max_tensor_bytes: DEFAULT_MAX_TENSOR_BYTES,
            inbox_capacity: 1024,
            keep_versions: 2,
            keep_versions_for: Vec::new(),
            version_ttl: None,
            max_concurrent_streams: 1024,
            push_placement: Device::Host,
            cuda: CudaConfig::default(),
            cluster_key: ClusterKey::open(),
            brokers: Vec::new(),
            heartbeat_interval: Duration::from_secs(2),
            heartbeats: true,
            advertise_addrs: Vec::new(),
            auto_fetch: true,
            metrics: None,
            metrics_url: None,
            max_upload_rate: 0,
            hello_timeout: DEFAULT_HELLO_TIMEOUT,
            max_pending_handshakes: DEFAULT_MAX_PENDING_HANDSHAKES,
        }
    }
}
