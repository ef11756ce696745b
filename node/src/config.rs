//! Node configuration. `Config::default()` is the offline single-machine setup.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use tb_proto::ClusterKey;

use crate::device::{CudaConfig, Device};

/// Default maximum tensor size: 64 GiB.
pub const DEFAULT_MAX_TENSOR_BYTES: u64 = 64 << 30;

/// Everything a [`crate::Node`] can be tuned with.
#[derive(Debug, Clone)]
pub struct Config {
    /// UDP address the endpoint binds. `127.0.0.1:0` (any free port) by default; daemons use a
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
    /// Versions of each name kept by `publish_local` (older ones are evicted).
    pub keep_versions: usize,
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
            max_concurrent_streams: 1024,
            push_placement: Device::Host,
            cuda: CudaConfig::default(),
            cluster_key: ClusterKey::open(),
        }
    }
}
