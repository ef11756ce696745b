//! Node configuration. `Config::default()` is the offline single-machine setup.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
    time::Duration,
};

use tb_dashboard::Metrics;
use tb_proto::{AuthError, ChannelKind, ClusterKey, NamePattern};

use tb_link::{LinkConfig, PeerAddr};

use crate::device::{CudaConfig, Device};

/// Default maximum tensor size: 64 GiB.
pub const DEFAULT_MAX_TENSOR_BYTES: u64 = 64 << 30;

/// Default [`Config::min_source_rate`]: 1 MiB/s.
pub const DEFAULT_MIN_SOURCE_RATE: u64 = 1 << 20;

/// The share of the machine's memory that pushes may hold by default: a quarter.
pub const PUSH_MEMORY_SHARE: u64 = 4;
/// The push budget where the machine's memory cannot be read: 4 GiB.
pub const FALLBACK_PUSH_MEMORY: u64 = 4 << 30;
/// The share of a device's memory that pushes to it may hold by default: a half.
pub const PUSH_DEVICE_MEMORY_SHARE: u64 = 2;
/// The device push budget where the device's memory cannot be read: 4 GiB.
pub const FALLBACK_PUSH_DEVICE_MEMORY: u64 = 4 << 30;

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
    /// Most peers linked at once (each with at most [`crate::MAX_LINKS_PER_PEER`] links); at
    /// the cap the least recently used idle peer is evicted.
    pub max_links: usize,
    /// A dial that has not completed by then fails with `PeerUnreachable`.
    pub connect_timeout: Duration,
    /// Longest wait for a peer's first answer on a stream (a header, an ack).
    pub request_timeout: Duration,
    /// A payload read or write that makes no progress for this long fails with `Timeout`.
    pub stall_timeout: Duration,
    /// The slowest a source of a cluster get may deliver, in bytes per second, judged over
    /// each whole `stall_timeout` of its stream: a source (the first one included) that
    /// delivers less in one such period is dropped for the get with `Timeout`, and the get
    /// resumes from the next holder at the byte it reached. A stream that ends within one
    /// period is never judged, so small transfers never are. 0: no floor (only a period with
    /// no byte at all fails). [`DEFAULT_MIN_SOURCE_RATE`] (1 MiB/s) by default.
    ///
    /// Bound: each source costs a get at most `connect_timeout + request_timeout +
    /// stall_timeout` more than its bytes take at this rate; a get whose every source is
    /// slower fails with `NoHolder` (last error `Timeout`) after that much per holder tried.
    /// For a hard limit on a whole get, see [`Node::get_within`](crate::Node::get_within).
    pub min_source_rate: u64,
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
    /// The cluster credential's key: every connection proves it in its first frame, and peers
    /// that cannot are refused. From the cluster secret it allows everything; from a read-only
    /// credential (see [`read_secret_file`]) only gets, lists, watches and status, and the node
    /// takes no pushes.
    ///
    /// [`ClusterKey::open`] by default, which admits any open node with full rights: the
    /// library default suits tests and embedding on one machine, and the process reports it
    /// (`tb_insecure_open` = 1). The daemons never fall back to it: they need a secret, or an
    /// explicit `--insecure-open`.
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
    /// pre-auth window (see [`tb_link::endpoint`]).
    pub hello_timeout: Duration,
    /// Most inbound connections waiting for their hello at once, per protocol (`tb/data/1`,
    /// `tb/ctl/1`); beyond it a new connection is closed at once with
    /// [`CloseCode::TooManyHandshakes`](tb_proto::CloseCode::TooManyHandshakes) and counted
    /// as `too_many_pending` (0 counts as 1).
    pub max_pending_handshakes: usize,
    /// Most host bytes that pushes to this node may hold at once: those being received and
    /// those waiting in the inbox until `recv()` takes them. A push reserves its length when
    /// its header arrives, before anything is allocated; one that does not fit is refused at
    /// once, with `Busy` (or `TooLarge` when it exceeds the whole budget), and nothing of it is
    /// kept. Default: [`default_max_push_memory`], a quarter of the machine's memory.
    pub max_push_memory: u64,
    /// The same for pushes placed on a CUDA device (see `push_placement`), in device bytes.
    /// `None` (the default): half of that device's memory, read when the node starts, or
    /// [`FALLBACK_PUSH_DEVICE_MEMORY`] when it cannot be read.
    pub max_push_device_memory: Option<u64>,
    /// The data channels this node runs and prefers, best first (see [`tb_proto::channel`]):
    /// each transfer with a peer uses the first one both run. QUIC is always run (it is
    /// every channel's fallback) and is added at the end when missing.
    /// [`ChannelKind::DEFAULT`] (`shm,quic`) by default; `tcp` is opt-in, being unencrypted.
    pub channels: Vec<ChannelKind>,
    /// QUIC streams a large transfer is striped over. 0 (the default): the rule in
    /// `channel::quic` picks it from the tensor's size; 1: never striped.
    pub quic_stripes: usize,
}

impl Default for Config {
    fn default() -> Self {
        // The link layer's defaults are its own: one source for both crates.
        let link = LinkConfig::default();
        Config {
            bind_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir: None,
            idle_timeout: link.idle_timeout,
            max_links: link.max_links,
            connect_timeout: link.connect_timeout,
            request_timeout: link.request_timeout,
            stall_timeout: Duration::from_secs(30),
            min_source_rate: DEFAULT_MIN_SOURCE_RATE,
            max_tensor_bytes: DEFAULT_MAX_TENSOR_BYTES,
            inbox_capacity: 1024,
            keep_versions: 2,
            keep_versions_for: Vec::new(),
            version_ttl: None,
            max_concurrent_streams: link.max_concurrent_streams,
            push_placement: Device::Host,
            cuda: CudaConfig::default(),
            cluster_key: link.cluster_key,
            brokers: Vec::new(),
            heartbeat_interval: Duration::from_secs(2),
            heartbeats: true,
            advertise_addrs: Vec::new(),
            auto_fetch: true,
            metrics: None,
            metrics_url: None,
            max_upload_rate: 0,
            hello_timeout: link.hello_timeout,
            max_pending_handshakes: link.max_pending_handshakes,
            max_push_memory: default_max_push_memory(),
            max_push_device_memory: None,
            channels: ChannelKind::DEFAULT.to_vec(),
            quic_stripes: 0,
        }
    }
}

impl Config {
    /// What the link layer reads of this config: the hello's and the pool's limits.
    pub fn link(&self) -> LinkConfig {
        LinkConfig::from(self)
    }
}

impl From<&Config> for LinkConfig {
    fn from(config: &Config) -> Self {
        LinkConfig {
            max_links: config.max_links,
            idle_timeout: config.idle_timeout,
            connect_timeout: config.connect_timeout,
            request_timeout: config.request_timeout,
            cluster_key: config.cluster_key.clone(),
            max_concurrent_streams: config.max_concurrent_streams,
            hello_timeout: config.hello_timeout,
            max_pending_handshakes: config.max_pending_handshakes,
        }
    }
}

/// Why a secret file gave no cluster key.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// The file could not be read.
    #[error("reading the cluster secret from {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Its content is no usable secret or credential.
    #[error(transparent)]
    Invalid(#[from] AuthError),
}

/// The cluster key a secret file's content gives (one trailing newline ignored): a read-only
/// credential when it starts with [`tb_proto::READ_ONLY_PREFIX`] (what `tb secret derive
/// --read-only` prints), else the cluster secret.
pub fn parse_secret(content: &[u8]) -> Result<ClusterKey, AuthError> {
    let trimmed = content
        .strip_suffix(b"\n")
        .map(|b| b.strip_suffix(b"\r").unwrap_or(b))
        .unwrap_or(content);
    ClusterKey::parse(trimmed)
}

/// Reads a secret file as `--cluster-secret-file` does (see [`parse_secret`]), for
/// [`Config::cluster_key`].
pub fn read_secret_file(path: &Path) -> Result<ClusterKey, SecretFileError> {
    let content = std::fs::read(path).map_err(|source| SecretFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    Ok(parse_secret(&content)?)
}

impl Config {
    /// Whether this node runs `kind` (QUIC always).
    pub fn runs(&self, kind: ChannelKind) -> bool {
        kind == ChannelKind::Quic || self.channels.contains(&kind)
    }

    /// The device push budget in bytes: `max_push_device_memory`, else a share of the push
    /// device's memory (probing it opens the device, sizing its staging pool with `cuda`).
    pub(crate) fn push_device_budget(&self) -> u64 {
        if let Some(limit) = self.max_push_device_memory {
            return limit;
        }
        let probed = match self.push_placement {
            Device::Host => None,
            Device::Cuda(ordinal) => crate::device::ensure(ordinal, &self.cuda)
                .and_then(|()| crate::device::probe(ordinal))
                .ok(),
        };
        probed.map_or(FALLBACK_PUSH_DEVICE_MEMORY, |info| {
            info.total_bytes / PUSH_DEVICE_MEMORY_SHARE
        })
    }
}

/// The default push budget: a quarter of the memory this process may use — the machine's
/// (`MemTotal` in `/proc/meminfo`) or its cgroup's limit (`memory.max`), whichever is less —
/// or [`FALLBACK_PUSH_MEMORY`] where neither can be read. Read once per process.
pub fn default_max_push_memory() -> u64 {
    static DEFAULT: OnceLock<u64> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        let read = |path| std::fs::read_to_string(path).ok();
        let machine = read("/proc/meminfo").and_then(|s| meminfo_total(&s));
        let cgroup = read("/sys/fs/cgroup/memory.max").and_then(|s| cgroup_limit(&s));
        let memory = match (machine, cgroup) {
            (Some(m), Some(c)) => Some(m.min(c)),
            (m, c) => m.or(c),
        };
        memory.map_or(FALLBACK_PUSH_MEMORY, |m| m / PUSH_MEMORY_SHARE)
    })
}

/// `MemTotal` from the text of `/proc/meminfo`, in bytes.
fn meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => kib.checked_mul(1024),
        _ => None,
    }
}

/// A cgroup v2 `memory.max` in bytes; `None` for `max` (no limit) or anything unreadable.
fn cgroup_limit(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_memory_is_read_from_meminfo_and_cgroup_limits() {
        let meminfo = "MemTotal:       24567890 kB\nMemFree:         1234 kB\n";
        assert_eq!(meminfo_total(meminfo), Some(24_567_890 * 1024));
        assert_eq!(meminfo_total("MemFree: 12 kB\n"), None);
        assert_eq!(meminfo_total("MemTotal: lots kB\n"), None);
        assert_eq!(meminfo_total("MemTotal: 12 MB\n"), None);
        assert_eq!(meminfo_total(""), None);
        assert_eq!(cgroup_limit("max\n"), None);
        assert_eq!(cgroup_limit("2147483648\n"), Some(2 << 30));
        let default = default_max_push_memory();
        assert!(default > 0);
        assert_eq!(Config::default().max_push_memory, default);
    }
}
