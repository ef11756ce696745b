//! [`BrokerConfig`]: every knob of the broker's decisions, with offline single-machine defaults.

use tb_proto::Expiry;

/// Default of [`BrokerConfig::forget_period_ms`]: a minute (rows' ages are counted in minutes
/// and days).
pub const DEFAULT_FORGET_PERIOD_MS: u64 = 60_000;

/// Default of [`BrokerConfig::max_sync_bytes`]: 256 MiB.
pub const DEFAULT_MAX_SYNC_BYTES: u64 = 256 << 20;

/// How a broker decides: version retention, liveness, fan-out, limits. `Default` is the
/// offline single-machine setup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Versions per name whose holder marks the registry keeps (the newest K; 0 counts as 1).
    /// Every broker of a cluster must use the same value, or their replicas never converge.
    pub keep_versions: u64,
    /// A worker or peer broker this broker hears heartbeats from is marked dead after this long
    /// without one.
    pub liveness_timeout_ms: u64,
    /// Most fetchers one source (a holder, or a node still receiving) is handed out to at a
    /// time, so that many fetches of one version form a pipeline or tree instead of a star
    /// (0 counts as 1).
    pub fanout: usize,
    /// Tensors of at least this many bytes are fanned out bandwidth first: fetchers arriving
    /// together form chains, each link carrying a node's whole upload. Smaller ones are fanned
    /// out latency first: a shallow tree, complete holders first.
    pub chain_min_bytes: u64,
    /// Longest chain of fetchers (hops from a complete copy) for large tensors before the next
    /// fetcher branches off (0 counts as 1).
    pub max_chain_depth: usize,
    /// Largest tensor the registry accepts metadata for, in bytes.
    pub max_tensor_bytes: u64,
    /// A fetch in flight, and the fan-out slot it holds at its source, is forgotten after this
    /// long without news (a `Fetching` refresh, its completion, or its end).
    pub fetch_timeout_ms: u64,
    /// Most bytes of anti-entropy messages (encoded) this broker holds at once, all
    /// conversations together: the names an asker sends before its last frame, and the rows
    /// and entries a peer sends back before they are merged. A conversation that would go
    /// over ends with `Busy` (`TooLarge` when it alone exceeds the budget), holding nothing,
    /// and the next round tries again. Default 256 MiB, enough for about a million names;
    /// raise it for larger registries, or anti-entropy cannot complete.
    pub max_sync_bytes: u64,
    /// When rows of nodes that are gone leave the registry: a row marked dead after
    /// `expiry.dead_after_ms` (default a day), with the holder marks of its node; a row of a
    /// node that left cleanly (closed its ctl connection saying it shuts down) after
    /// `expiry.left_after_ms` (default five minutes). Every broker of a cluster should use the
    /// same values.
    pub expiry: Expiry,
    /// How often the whole registry is walked for rows and holder marks past their `expiry`
    /// (a walk costs time in proportion to the number of holder marks; what merges and loads
    /// bring is checked at once whatever this says).
    pub forget_period_ms: u64,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            keep_versions: 2,
            liveness_timeout_ms: 10_000,
            fanout: 2,
            chain_min_bytes: 8 << 20,
            max_chain_depth: 16,
            max_tensor_bytes: 64 << 30,
            fetch_timeout_ms: 120_000,
            max_sync_bytes: DEFAULT_MAX_SYNC_BYTES,
            expiry: Expiry::default(),
            forget_period_ms: DEFAULT_FORGET_PERIOD_MS,
        }
    }
}
