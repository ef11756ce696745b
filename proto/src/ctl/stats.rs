//! [`NodeStats`]: what a worker tells its broker about itself in each heartbeat, so the
//! broker's dashboard shows every worker without scraping it.

use serde::{Deserialize, Serialize};

use super::CtlError;
use crate::{ChannelKind, NodeId, TensorName};

/// Longest `metrics_url` a heartbeat may carry, in bytes.
pub const MAX_METRICS_URL_LEN: usize = 256;

/// Most pooled links one heartbeat lists (a node with more lists the first, by peer id): the
/// default pool cap, so a status row stays about 2 KiB.
pub const MAX_STATS_LINKS: usize = 64;

/// Most served functions one heartbeat lists (a node serving more lists the first, by name).
pub const MAX_STATS_FUNCTIONS: usize = 32;

/// One function a node serves, and how its calls went there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionStats {
    /// The function's name.
    pub name: TensorName,
    /// Calls this node admitted and ended since it started serving the function.
    pub calls_total: u64,
    /// Of those, the calls that failed (the handler raised, or the deadline passed).
    pub failed_total: u64,
    /// Calls ended per second since the node's previous heartbeat.
    pub calls_per_s: f64,
    /// Calls running or queued now.
    pub in_flight: u32,
}

/// One pooled link of a node: the peer, and the data channel its transfers with it use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkChannel {
    /// The peer.
    pub peer: NodeId,
    /// The channel negotiated with it.
    pub channel: ChannelKind,
}

/// A worker's live figures, as of the heartbeat that carries them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct NodeStats {
    /// Pooled links (active and idle).
    pub pool_links: u32,
    /// Tensor versions held.
    pub tensors: u64,
    /// Bytes held in the store.
    pub store_bytes: u64,
    /// Bytes received per second over the last few seconds.
    pub in_bytes_per_s: f64,
    /// Bytes sent per second over the last few seconds.
    pub out_bytes_per_s: f64,
    /// Bytes received since the process started.
    pub in_bytes_total: u64,
    /// Bytes sent since the process started.
    pub out_bytes_total: u64,
    /// Median transfer duration in seconds (`None` before the first transfer).
    pub latency_p50_s: Option<f64>,
    /// 99th percentile transfer duration in seconds.
    pub latency_p99_s: Option<f64>,
    /// Where the worker's own metrics server listens (`http://ip:port`), at most
    /// [`MAX_METRICS_URL_LEN`] bytes.
    pub metrics_url: Option<String>,
    /// Each pooled link's peer and data channel, at most [`MAX_STATS_LINKS`].
    pub links: Vec<LinkChannel>,
    /// The node's upload limit in bytes per second (0: unlimited). Brokers rank a source
    /// whose limit is far below the others' last for large tensors.
    pub upload_limit: u64,
    /// The functions the node serves and their call figures, at most
    /// [`MAX_STATS_FUNCTIONS`], by name.
    pub functions: Vec<FunctionStats>,
}

impl NodeStats {
    /// Checks stats that came from the network: every float finite and non-negative, the URL
    /// within [`MAX_METRICS_URL_LEN`], at most [`MAX_STATS_LINKS`] links and
    /// [`MAX_STATS_FUNCTIONS`] functions, each failed count within its total.
    pub fn validate(&self) -> Result<(), CtlError> {
        if self.links.len() > MAX_STATS_LINKS {
            return Err(CtlError::BadStat { field: "links" });
        }
        if self.functions.len() > MAX_STATS_FUNCTIONS {
            return Err(CtlError::BadStat { field: "functions" });
        }
        for f in &self.functions {
            if !(f.calls_per_s.is_finite() && f.calls_per_s >= 0.0) {
                return Err(CtlError::BadStat {
                    field: "functions.calls_per_s",
                });
            }
            if f.failed_total > f.calls_total {
                return Err(CtlError::BadStat {
                    field: "functions.failed_total",
                });
            }
        }
        let floats = [
            ("in_bytes_per_s", Some(self.in_bytes_per_s)),
            ("out_bytes_per_s", Some(self.out_bytes_per_s)),
            ("latency_p50_s", self.latency_p50_s),
            ("latency_p99_s", self.latency_p99_s),
        ];
        for (field, value) in floats {
            if value.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                return Err(CtlError::BadStat { field });
            }
        }
        match &self.metrics_url {
            Some(url) if url.len() > MAX_METRICS_URL_LEN => {
                Err(CtlError::UrlTooLong { len: url.len() })
            }
            _ => Ok(()),
        }
    }
}
