//! The JSON of `/api/v1/status` and `/api/v1/cluster` (the shared contract: the web page,
//! tests and operators read these shapes).

use serde::{Deserialize, Serialize};

/// `GET /api/v1/status`: one process at a glance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// The node id (hex).
    pub node_id: String,
    /// `"worker"` or `"broker"`.
    pub role: String,
    /// The build's version.
    pub version: String,
    /// Seconds since the process started.
    pub uptime_s: f64,
    /// Whether `/readyz` answers 200.
    pub ready: bool,
    /// Whether the process runs without a cluster secret (`--insecure-open`): anyone who can
    /// reach it can join the cluster, read, publish and delete. The page shows a banner.
    #[serde(default)]
    pub insecure_open: bool,
    /// Where peers reach it (`ip:port`).
    pub addrs: Vec<String>,
    /// Each pooled link: the peer and the data channel its transfers use now.
    #[serde(default)]
    pub links: Vec<LinkView>,
    /// The connection pool.
    pub pool: PoolStatus,
    /// Tensors held.
    pub store: StoreStatus,
    /// Bytes moved, over the throughput window and in total.
    pub throughput: Throughput,
    /// Transfers finished and under way.
    pub transfers: Transfers,
}

/// One pooled link in `/api/v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkView {
    /// The peer's node id (hex).
    pub peer: String,
    /// The data channel negotiated with it (`shm`, `quic`, `tcp`).
    pub channel: String,
}

/// The pool's links and lifetime counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Links with a stream in use.
    pub links_active: u64,
    /// Links with none.
    pub links_idle: u64,
    /// Dials started.
    pub dials: u64,
    /// Requests served by an already pooled link.
    pub reuses: u64,
    /// Links closed after the idle timeout.
    pub evictions_idle: u64,
    /// Idle links closed at the pool cap.
    pub evictions_lru: u64,
    /// Dials that failed.
    pub connect_failures: u64,
}

/// What the store holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StoreStatus {
    /// Tensor versions.
    pub tensors: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Bytes in and out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    /// The window the rates are over, in seconds.
    pub window_s: u64,
    /// Received bytes per second over the window.
    pub in_bytes_per_s: f64,
    /// Sent bytes per second over the window.
    pub out_bytes_per_s: f64,
    /// Received bytes since start.
    pub in_bytes_total: u64,
    /// Sent bytes since start.
    pub out_bytes_total: u64,
}

/// Transfer counts and latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Transfers {
    /// Under way now.
    pub in_flight: u64,
    /// Finished successfully.
    pub ok: u64,
    /// Failed.
    pub errors: u64,
    /// Duration quantiles in seconds, estimated from the histogram (null before any transfer).
    pub latency_s: Latency,
}

/// Latency quantiles in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Median.
    pub p50: Option<f64>,
    /// 90th percentile.
    pub p90: Option<f64>,
    /// 99th percentile.
    pub p99: Option<f64>,
}

/// `GET /api/v1/cluster` (brokers): the broker, the members, the registry's totals and one
/// page of its entries. `?after=<name>` starts the page after that name (the previous page's
/// `next`), `?limit=<n>` sets its length (default [`DEFAULT_PAGE_LIMIT`], at most
/// [`MAX_PAGE_LIMIT`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// The broker's own status.
    pub broker: Status,
    /// Every member the broker knows, alive or dead.
    pub members: Vec<MemberView>,
    /// One page of the live registry entries (newest version of each name), in name order.
    pub entries: Vec<EntryView>,
    /// The cursor of the next page (its `after`), `null` on the last page.
    pub next: Option<String>,
    /// The whole registry's totals, whatever the page.
    pub registry: RegistryTotals,
    /// The remote functions served now, in name order (at most [`MAX_FUNCTIONS_LISTED`]).
    #[serde(default)]
    pub functions: Vec<FunctionView>,
}

/// Most functions one `/api/v1/cluster` answer lists.
pub const MAX_FUNCTIONS_LISTED: usize = 1_000;
/// Most servers listed for one function.
pub const MAX_SERVERS_LISTED: usize = 64;

/// A remote function, the live nodes serving it (the broker's `Servers` answer) and its call
/// figures, summed over the servers whose freshest heartbeat reported them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionView {
    /// The function's name.
    pub name: String,
    /// The nodes serving it now (hex ids, at most [`MAX_SERVERS_LISTED`]).
    pub servers: Vec<String>,
    /// Calls ended per second (each server's rate since its previous heartbeat).
    #[serde(default)]
    pub calls_per_s: f64,
    /// Calls ended since each server started serving it.
    #[serde(default)]
    pub calls_total: u64,
    /// Of those, the calls that failed (raised, or past their deadline).
    #[serde(default)]
    pub failed_total: u64,
    /// Calls running or queued now.
    #[serde(default)]
    pub in_flight: u64,
    /// How many of the servers reported these figures (a server not heard from yet: none).
    #[serde(default)]
    pub reporting: u32,
}

/// Entries per `/api/v1/cluster` page when the request names no `limit`.
pub const DEFAULT_PAGE_LIMIT: usize = 1_000;
/// Most entries one `/api/v1/cluster` page lists (a larger `limit` is cut to this).
pub const MAX_PAGE_LIMIT: usize = 10_000;

/// Which page of the registry a request wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// List names after this one (`None`: from the first).
    pub after: Option<tb_proto::TensorName>,
    /// At most this many entries (1..=[`MAX_PAGE_LIMIT`]).
    pub limit: usize,
}

/// The registry at a glance: what the dashboard's summary shows without every page.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryTotals {
    /// Live names.
    pub names: u64,
    /// Holders of the newest versions, all names together (copies in the cluster).
    pub copies: u64,
    /// Bytes of the newest versions, one copy each.
    pub bytes: u64,
}

/// One member of the cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberView {
    /// Its node id (hex).
    pub node_id: String,
    /// `"worker"` or `"broker"`.
    pub role: String,
    /// Where it listens.
    pub addrs: Vec<String>,
    /// Its epoch (bumped on every restart).
    pub epoch: u64,
    /// Whether the cluster thinks it is up.
    pub alive: bool,
    /// Its latest heartbeat figures, if it heartbeats to this broker.
    pub stats: Option<MemberStats>,
}

/// A worker's figures from its latest heartbeat to this broker: the heartbeat's own
/// [`NodeStats`](tb_proto::NodeStats) fields, flattened, and their age.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemberStats {
    /// What the heartbeat carried.
    #[serde(flatten)]
    pub stats: tb_proto::NodeStats,
    /// Seconds since the heartbeat that carried these.
    pub age_s: f64,
}

impl MemberStats {
    /// Heartbeat stats received `age_s` seconds ago.
    pub fn from_heartbeat(stats: &tb_proto::NodeStats, age_s: f64) -> Self {
        MemberStats {
            stats: stats.clone(),
            age_s,
        }
    }
}

/// One registry entry: the newest version of a name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EntryView {
    /// The tensor's name.
    pub name: String,
    /// Its newest version.
    pub version: u64,
    /// Element type (`"f32"`, ...).
    pub dtype: String,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// Payload size in bytes.
    pub byte_len: u64,
    /// Nodes holding that version (hex ids).
    pub holders: Vec<String>,
    /// Who published it (hex id).
    pub publisher: String,
}

/// What the process adds to its metrics for `/api/v1/cluster`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterData {
    /// Members.
    pub members: Vec<MemberView>,
    /// The page's registry entries.
    pub entries: Vec<EntryView>,
    /// The next page's cursor, if there are more entries.
    pub next: Option<String>,
    /// The whole registry's totals.
    pub registry: RegistryTotals,
    /// The functions served now.
    pub functions: Vec<FunctionView>,
}
