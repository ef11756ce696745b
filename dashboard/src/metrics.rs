//! [`Metrics`]: every metric family of a tensor-broker process, in the process's own
//! registry, plus the throughput window derived from them.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder, core::Metric,
};
use tokio_util::sync::CancellationToken;

use crate::{
    api,
    channel::{ChannelMetrics, Direction},
    window::{self, Rates, ThroughputWindow},
};

/// The version every process reports in `tb_build_info` and `/api/v1/status`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// How often the throughput window samples the byte counters.
pub const SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// Upper bounds of `tb_transfer_duration_seconds`: 0.5 ms (a small pull on loopback) to
/// 2 min (tens of GiB).
const DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
];

/// What a process is; decides which families it exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `tb-worker` (and embedded nodes): pool, transfers, store.
    Worker,
    /// `tb-broker`: pool, transfers, registry.
    Broker,
}

impl Role {
    /// `"worker"` or `"broker"`, as in labels and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Broker => "broker",
        }
    }
}

/// What a transfer is, from this node's side (the `kind` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// This node pushed a tensor to a peer.
    Push,
    /// This node pulled a tensor from a peer.
    Pull,
    /// This node answered a peer's stream: served a pull or accepted a push.
    Serve,
}

impl TransferKind {
    const ALL: [TransferKind; 3] = [TransferKind::Push, TransferKind::Pull, TransferKind::Serve];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferKind::Push => "push",
            TransferKind::Pull => "pull",
            TransferKind::Serve => "serve",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why a peer was refused before its hello was verified (the `reason` label of
/// `tb_auth_failures_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// Its hello did not prove the cluster secret.
    BadProof,
    /// No whole hello arrived within the hello timeout.
    Timeout,
    /// The first frame was not a hello, or its stream ended early.
    Malformed,
    /// The hello frame declared more bytes than a hello may have.
    TooLarge,
    /// Too many connections were already waiting to authenticate.
    TooManyPending,
}

impl AuthFailure {
    /// Every reason, in label order.
    pub const ALL: [AuthFailure; 5] = [
        AuthFailure::BadProof,
        AuthFailure::Timeout,
        AuthFailure::Malformed,
        AuthFailure::TooLarge,
        AuthFailure::TooManyPending,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthFailure::BadProof => "bad_proof",
            AuthFailure::Timeout => "timeout",
            AuthFailure::Malformed => "malformed",
            AuthFailure::TooLarge => "too_large",
            AuthFailure::TooManyPending => "too_many_pending",
        }
    }
}

/// `tb_auth_failures_total{reason}`: one counter per [`AuthFailure`]. Clones share the counts.
#[derive(Debug, Clone)]
pub struct AuthFailures([IntCounter; AuthFailure::ALL.len()]);

impl AuthFailures {
    /// Counts one refusal for `reason`.
    pub fn inc(&self, reason: AuthFailure) {
        self.0[reason as usize].inc();
    }

    /// Refusals counted for `reason`.
    pub fn get(&self, reason: AuthFailure) -> u64 {
        self.0[reason as usize].get()
    }

    /// Refusals counted, every reason together.
    pub fn total(&self) -> u64 {
        self.0.iter().map(IntCounter::get).sum()
    }
}

/// Could not create or register a metric (a bug: names and labels are fixed).
#[derive(Debug, thiserror::Error)]
#[error("metrics: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

/// Every metric family of the contract, registered in a registry of this process's own (not
/// the global default: tests run several nodes in one process).
///
/// Counters are plain atomics: incrementing one on the data path costs no lock. Gauges that
/// mirror state (pool links, store size, registry size, cluster nodes) are set by the process
/// just before each scrape (see [`Source::refresh`](crate::Source::refresh)).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    role: Role,
    started: Instant,
    /// `tb_pool_links{state="active"}`.
    pub pool_links_active: IntGauge,
    /// `tb_pool_links{state="idle"}`.
    pub pool_links_idle: IntGauge,
    /// `tb_pool_dials_total`.
    pub pool_dials: IntCounter,
    /// `tb_pool_reuses_total`.
    pub pool_reuses: IntCounter,
    /// `tb_pool_evictions_total{reason="idle"}`.
    pub pool_evictions_idle: IntCounter,
    /// `tb_pool_evictions_total{reason="lru"}`.
    pub pool_evictions_lru: IntCounter,
    /// `tb_pool_evictions_total{reason="superseded"}`: a peer's extra link closed once idle.
    pub pool_evictions_superseded: IntCounter,
    /// `tb_pool_evictions_total{reason="peer_cap"}`: a peer's oldest link closed past the
    /// per-peer cap.
    pub pool_evictions_peer_cap: IntCounter,
    /// `tb_pool_refused_total{reason="pool_full"}`: a new peer's link refused by a pool full
    /// of peers in use.
    pub pool_refused_full: IntCounter,
    /// `tb_pool_connect_failures_total`.
    pub pool_connect_failures: IntCounter,
    /// `tb_watch_offers_total{direction="out"}`: small versions this node offered straight to
    /// the subscribers watching it (one per watcher).
    pub watch_offers_out: IntCounter,
    /// `tb_watch_offers_total{direction="in"}`: offers a subscription took from a publisher
    /// (before, or instead of, its broker's event).
    pub watch_offers_in: IntCounter,
    /// `tb_watch_offers_total{direction="refused"}`: offers refused (bad metadata, or bytes
    /// whose length or hash is not the metadata's).
    pub watch_offers_refused: IntCounter,
    /// `tb_transfer_bytes_total{direction="in"}`.
    pub bytes_in: IntCounter,
    /// `tb_transfer_bytes_total{direction="out"}`.
    pub bytes_out: IntCounter,
    /// `tb_transfers_total{kind,result}`, `[kind][0 = ok, 1 = error]`.
    transfers: [[IntCounter; 2]; 3],
    /// `tb_transfer_duration_seconds{kind}`.
    durations: [Histogram; 3],
    /// `tb_transfers_in_flight`.
    pub transfers_in_flight: IntGauge,
    /// `tb_registry_names` (brokers).
    pub registry_names: IntGauge,
    /// `tb_registry_holders` (brokers).
    pub registry_holders: IntGauge,
    /// `tb_gossip_messages_total{direction="in"}` (brokers).
    pub gossip_in: IntCounter,
    /// `tb_gossip_messages_total{direction="out"}` (brokers).
    pub gossip_out: IntCounter,
    /// `tb_sync_rounds_total` (brokers).
    pub sync_rounds: IntCounter,
    /// `tb_cluster_nodes{state="alive"}` (brokers).
    pub cluster_alive: IntGauge,
    /// `tb_cluster_nodes{state="dead"}` (brokers).
    pub cluster_dead: IntGauge,
    /// `tb_store_bytes` (workers).
    pub store_bytes: IntGauge,
    /// `tb_store_tensors` (workers).
    pub store_tensors: IntGauge,
    /// `tb_auth_failures_total{reason}`.
    pub auth_failures: AuthFailures,
    /// `tb_insecure_open`: 1 while the process runs the open cluster's key (no secret).
    pub insecure_open: IntGauge,
    /// `tb_channel_*`: bytes, transfers and fallbacks by data channel.
    pub channels: ChannelMetrics,
    throughput: Mutex<ThroughputWindow>,
}

impl Metrics {
    /// Creates and registers every family `role` exports (at zero), the process collector and
    /// `tb_build_info`.
    pub fn new(role: Role) -> Result<Arc<Metrics>, MetricsError> {
        let registry = Registry::new();
        let r = &registry;
        let pool_links = gauge_vec(r, "tb_pool_links", "Pooled QUIC links, by state", "state")?;
        let evictions = counter_vec(
            r,
            "tb_pool_evictions_total",
            "Links closed, by reason (idle timeout, LRU at the pool cap, superseded link idle, \
             past the per-peer cap)",
            &["reason"],
        )?;
        let refused = counter_vec(
            r,
            "tb_pool_refused_total",
            "Links refused before serving anything on them, by reason",
            &["reason"],
        )?;
        let offers = counter_vec(
            r,
            "tb_watch_offers_total",
            "Small versions sent straight from publisher to subscriber, by direction (out, in, \
             refused)",
            &["direction"],
        )?;
        let bytes = counter_vec(
            r,
            "tb_transfer_bytes_total",
            "Tensor payload bytes moved, by direction",
            &["direction"],
        )?;
        let transfers_vec = counter_vec(
            r,
            "tb_transfers_total",
            "Transfers finished, by kind (push, pull, serve) and result (ok, error)",
            &["kind", "result"],
        )?;
        let durations_vec = HistogramVec::new(
            HistogramOpts::new(
                "tb_transfer_duration_seconds",
                "Transfer durations, by kind",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["kind"],
        )?;
        r.register(Box::new(durations_vec.clone()))?;
        let transfers = TransferKind::ALL.map(|k| {
            ["ok", "error"].map(|res| transfers_vec.with_label_values(&[k.as_str(), res]))
        });
        let durations = TransferKind::ALL.map(|k| durations_vec.with_label_values(&[k.as_str()]));
        let registry_family = role == Role::Broker;
        let store_family = role == Role::Worker;
        let gossip = counter_vec(
            registry_family.then_some(r),
            "tb_gossip_messages_total",
            "Registry gossip messages, by direction",
            &["direction"],
        )?;
        let nodes = gauge_vec(
            registry_family.then_some(r),
            "tb_cluster_nodes",
            "Cluster members this broker knows, by liveness",
            "state",
        )?;
        let auth_failures = counter_vec(
            r,
            "tb_auth_failures_total",
            "Peers refused before authenticating, by reason",
            &["reason"],
        )?;
        let build = gauge_vec_labels(
            r,
            "tb_build_info",
            "Always 1; the labels say which build and role this process is",
            &["version", "role"],
        )?;
        build.with_label_values(&[VERSION, role.as_str()]).set(1);
        register_process_collector(r);
        let metrics = Metrics {
            pool_links_active: pool_links.with_label_values(&["active"]),
            pool_links_idle: pool_links.with_label_values(&["idle"]),
            pool_dials: counter(Some(r), "tb_pool_dials_total", "Dials started")?,
            pool_reuses: counter(
                Some(r),
                "tb_pool_reuses_total",
                "Requests served by an already pooled link",
            )?,
            pool_evictions_idle: evictions.with_label_values(&["idle"]),
            pool_evictions_lru: evictions.with_label_values(&["lru"]),
            pool_evictions_superseded: evictions.with_label_values(&["superseded"]),
            pool_evictions_peer_cap: evictions.with_label_values(&["peer_cap"]),
            pool_refused_full: refused.with_label_values(&["pool_full"]),
            pool_connect_failures: counter(
                Some(r),
                "tb_pool_connect_failures_total",
                "Dials that failed or timed out",
            )?,
            watch_offers_out: offers.with_label_values(&["out"]),
            watch_offers_in: offers.with_label_values(&["in"]),
            watch_offers_refused: offers.with_label_values(&["refused"]),
            bytes_in: bytes.with_label_values(&["in"]),
            bytes_out: bytes.with_label_values(&["out"]),
            transfers,
            durations,
            transfers_in_flight: gauge(Some(r), "tb_transfers_in_flight", "Transfers under way")?,
            registry_names: gauge(
                registry_family.then_some(r),
                "tb_registry_names",
                "Live tensor names in the registry",
            )?,
            registry_holders: gauge(
                registry_family.then_some(r),
                "tb_registry_holders",
                "Holder marks of the newest versions in the registry",
            )?,
            gossip_in: gossip.with_label_values(&["in"]),
            gossip_out: gossip.with_label_values(&["out"]),
            sync_rounds: counter(
                registry_family.then_some(r),
                "tb_sync_rounds_total",
                "Anti-entropy rounds completed with peer brokers",
            )?,
            cluster_alive: nodes.with_label_values(&["alive"]),
            cluster_dead: nodes.with_label_values(&["dead"]),
            store_bytes: gauge(
                store_family.then_some(r),
                "tb_store_bytes",
                "Tensor bytes held in the store",
            )?,
            store_tensors: gauge(
                store_family.then_some(r),
                "tb_store_tensors",
                "Tensor versions held in the store",
            )?,
            auth_failures: AuthFailures(
                AuthFailure::ALL.map(|k| auth_failures.with_label_values(&[k.as_str()])),
            ),
            insecure_open: gauge(
                Some(r),
                "tb_insecure_open",
                "1 when this process runs without a cluster secret (--insecure-open): anyone \
                 who can reach it can join, read, publish and delete",
            )?,
            channels: ChannelMetrics::new(r)?,
            throughput: Mutex::new(ThroughputWindow::new(window::WINDOW)),
            registry,
            role,
            started: Instant::now(),
        };
        Ok(Arc::new(metrics))
    }

    /// What this process is.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Time since the metrics were created (the process start, near enough).
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// The process's registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Every family in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(%e, "encoding metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }

    /// A meter of payload bytes moving on `channel` in `direction`.
    pub fn meter(&self, channel: tb_proto::ChannelKind, direction: Direction) -> Meter {
        let total = match direction {
            Direction::In => self.bytes_in.clone(),
            Direction::Out => self.bytes_out.clone(),
        };
        let channel = self.channels.bytes_counter(channel, direction);
        Meter { total, channel }
    }

    /// Starts timing a transfer of `kind` (counted in flight until the timer is finished or
    /// dropped; a dropped timer counts as an error).
    pub fn start_transfer(&self, kind: TransferKind) -> TransferTimer<'_> {
        self.transfers_in_flight.inc();
        TransferTimer {
            metrics: self,
            kind,
            started: Instant::now(),
            done: false,
        }
    }

    /// Finished transfers (all kinds) as (ok, errors).
    pub fn transfer_counts(&self) -> (u64, u64) {
        self.transfers
            .iter()
            .fold((0, 0), |(ok, err), [o, e]| (ok + o.get(), err + e.get()))
    }

    /// Finished transfers of `kind` with the given result.
    pub fn transfers(&self, kind: TransferKind, ok: bool) -> u64 {
        self.transfers[kind.index()][usize::from(!ok)].get()
    }

    /// The `q` quantile of transfer durations over every kind, in seconds.
    pub fn latency_quantile(&self, q: f64) -> Option<f64> {
        let mut merged: Vec<(f64, u64)> = DURATION_BUCKETS.iter().map(|&b| (b, 0)).collect();
        let mut total = 0;
        for h in &self.durations {
            let m = h.metric();
            let hist = m.get_histogram();
            total += hist.get_sample_count();
            for (slot, bucket) in merged.iter_mut().zip(hist.get_bucket()) {
                slot.1 += bucket.cumulative_count();
            }
        }
        window::quantile(&merged, total, q)
    }

    /// Samples the byte counters into the throughput window.
    pub fn sample_throughput(&self) {
        let mut w = self.throughput.lock().unwrap_or_else(|p| p.into_inner());
        w.record(Instant::now(), self.bytes_in.get(), self.bytes_out.get());
    }

    /// Byte rates over the last [`WINDOW`](crate::WINDOW).
    pub fn rates(&self) -> Rates {
        self.throughput
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rates()
    }

    /// Samples the throughput every [`SAMPLE_PERIOD`] until `cancel` fires (spawn it once per
    /// process, on the task tracker that owns the process's tasks).
    pub async fn run_sampler(self: Arc<Self>, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(SAMPLE_PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => self.sample_throughput(),
            }
        }
    }

    /// The `/api/v1/status` object, with what only the process knows filled in.
    pub fn status(&self, node_id: String, addrs: Vec<String>, ready: bool) -> api::Status {
        let rates = self.rates();
        let (ok, errors) = self.transfer_counts();
        api::Status {
            node_id,
            role: self.role.as_str().to_string(),
            version: VERSION.to_string(),
            uptime_s: self.uptime().as_secs_f64(),
            ready,
            insecure_open: self.insecure_open.get() > 0,
            addrs,
            links: Vec::new(),
            pool: api::PoolStatus {
                links_active: non_negative(self.pool_links_active.get()),
                links_idle: non_negative(self.pool_links_idle.get()),
                dials: self.pool_dials.get(),
                reuses: self.pool_reuses.get(),
                evictions_idle: self.pool_evictions_idle.get(),
                evictions_lru: self.pool_evictions_lru.get(),
                connect_failures: self.pool_connect_failures.get(),
            },
            store: api::StoreStatus {
                tensors: non_negative(self.store_tensors.get()),
                bytes: non_negative(self.store_bytes.get()),
            },
            throughput: api::Throughput {
                window_s: window::WINDOW.as_secs(),
                in_bytes_per_s: rates.in_per_s,
                out_bytes_per_s: rates.out_per_s,
                in_bytes_total: self.bytes_in.get(),
                out_bytes_total: self.bytes_out.get(),
            },
            transfers: api::Transfers {
                in_flight: non_negative(self.transfers_in_flight.get()),
                ok,
                errors,
                latency_s: api::Latency {
                    p50: self.latency_quantile(0.5),
                    p90: self.latency_quantile(0.9),
                    p99: self.latency_quantile(0.99),
                },
            },
        }
    }

    /// What a worker tells its broker in a heartbeat (gauges as last refreshed).
    pub fn node_stats(&self, metrics_url: Option<String>) -> tb_proto::NodeStats {
        let rates = self.rates();
        let links = self.pool_links_active.get() + self.pool_links_idle.get();
        tb_proto::NodeStats {
            pool_links: u32::try_from(links.max(0)).unwrap_or(u32::MAX),
            tensors: non_negative(self.store_tensors.get()),
            store_bytes: non_negative(self.store_bytes.get()),
            in_bytes_per_s: finite(rates.in_per_s),
            out_bytes_per_s: finite(rates.out_per_s),
            in_bytes_total: self.bytes_in.get(),
            out_bytes_total: self.bytes_out.get(),
            latency_p50_s: self.latency_quantile(0.5),
            latency_p99_s: self.latency_quantile(0.99),
            metrics_url,
            // The node fills in its links, upload limit and served functions (this crate
            // knows none of them).
            links: Vec::new(),
            upload_limit: 0,
            functions: Vec::new(),
        }
    }
}

/// Times one transfer; finish it with [`ok`](TransferTimer::ok) or
/// [`error`](TransferTimer::error). Dropping it unfinished (a cancelled transfer) counts an
/// error.
#[derive(Debug)]
#[must_use = "a dropped timer counts the transfer as failed"]
pub struct TransferTimer<'a> {
    metrics: &'a Metrics,
    kind: TransferKind,
    started: Instant,
    done: bool,
}

/// Counts payload bytes as they move (so rates show during a long transfer): the node's
/// `tb_bytes_total{direction}` and the channel's `tb_channel_bytes_total`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Meter {
    total: IntCounter,
    channel: IntCounter,
}

impl Meter {
    /// Counts `n` more bytes.
    pub fn add(&self, n: u64) {
        self.total.inc_by(n);
        self.channel.inc_by(n);
    }
}

impl TransferTimer<'_> {
    /// The transfer succeeded.
    pub fn ok(mut self) {
        self.finish(true);
    }

    /// The transfer failed.
    pub fn error(mut self) {
        self.finish(false);
    }

    /// It was no transfer after all (refused before any byte moved): counted nowhere.
    pub fn discard(mut self) {
        if !std::mem::replace(&mut self.done, true) {
            self.metrics.transfers_in_flight.dec();
        }
    }

    /// Finishes with `ok`'s result.
    pub fn result(self, ok: bool) {
        if ok { self.ok() } else { self.error() }
    }

    fn finish(&mut self, ok: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let k = self.kind.index();
        self.metrics.transfers[k][usize::from(!ok)].inc();
        self.metrics.durations[k].observe(self.started.elapsed().as_secs_f64());
        self.metrics.transfers_in_flight.dec();
    }
}

impl Drop for TransferTimer<'_> {
    fn drop(&mut self) {
        self.finish(false);
    }
}

fn non_negative(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn finite(v: f64) -> f64 {
    if v.is_finite() && v >= 0.0 { v } else { 0.0 }
}

/// Registers `c` in `registry` if given (families a role does not export stay unregistered:
/// updating them is harmless, and they never show up).
fn register<C>(registry: Option<&Registry>, c: &C) -> Result<(), MetricsError>
where
    C: prometheus::core::Collector + Clone + 'static,
{
    if let Some(r) = registry {
        r.register(Box::new(c.clone()))?;
    }
    Ok(())
}

fn counter(r: Option<&Registry>, name: &str, help: &str) -> Result<IntCounter, MetricsError> {
    let c = IntCounter::new(name, help)?;
    register(r, &c)?;
    Ok(c)
}

fn gauge(r: Option<&Registry>, name: &str, help: &str) -> Result<IntGauge, MetricsError> {
    let g = IntGauge::new(name, help)?;
    register(r, &g)?;
    Ok(g)
}

fn counter_vec<'a>(
    r: impl Into<Option<&'a Registry>>,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, MetricsError> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    register(r.into(), &c)?;
    Ok(c)
}

fn gauge_vec<'a>(
    r: impl Into<Option<&'a Registry>>,
    name: &str,
    help: &str,
    label: &str,
) -> Result<IntGaugeVec, MetricsError> {
    gauge_vec_labels(r, name, help, &[label])
}

fn gauge_vec_labels<'a>(
    r: impl Into<Option<&'a Registry>>,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, MetricsError> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    register(r.into(), &g)?;
    Ok(g)
}

/// Adds `process_*` (CPU, memory, fds, start time) where the platform has them.
fn register_process_collector(registry: &Registry) {
    #[cfg(target_os = "linux")]
    {
        let pc = prometheus::process_collector::ProcessCollector::for_self();
        if let Err(e) = registry.register(Box::new(pc)) {
            tracing::debug!(%e, "process metrics unavailable");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = registry;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family of the contract, by role.
    const COMMON: &[&str] = &[
        "tb_pool_links",
        "tb_pool_dials_total",
        "tb_pool_reuses_total",
        "tb_pool_evictions_total",
        "tb_pool_refused_total",
        "tb_pool_connect_failures_total",
        "tb_watch_offers_total",
        "tb_transfer_bytes_total",
        "tb_transfers_total",
        "tb_transfer_duration_seconds",
        "tb_transfers_in_flight",
        "tb_auth_failures_total",
        "tb_insecure_open",
        "tb_build_info",
        "tb_channel_bytes_total",
        "tb_channel_transfers_total",
        "tb_channel_fallbacks_total",
    ];
    const BROKER: &[&str] = &[
        "tb_registry_names",
        "tb_registry_holders",
        "tb_gossip_messages_total",
        "tb_sync_rounds_total",
        "tb_cluster_nodes",
    ];
    const WORKER: &[&str] = &["tb_store_bytes", "tb_store_tensors"];

    fn families(m: &Metrics) -> Vec<String> {
        m.registry()
            .gather()
            .iter()
            .map(|f| f.name().to_string())
            .collect()
    }

    #[test]
    fn each_role_exports_its_families_at_zero() {
        let worker = Metrics::new(Role::Worker).expect("worker");
        let broker = Metrics::new(Role::Broker).expect("broker");
        let (w, b) = (families(&worker), families(&broker));
        for name in COMMON.iter().chain(WORKER) {
            assert!(w.iter().any(|f| f == name), "worker lacks {name}");
        }
        for name in COMMON.iter().chain(BROKER) {
            assert!(b.iter().any(|f| f == name), "broker lacks {name}");
        }
        assert!(!w.iter().any(|f| f == "tb_registry_names"));
        assert!(!b.iter().any(|f| f == "tb_store_bytes"));
        let text = broker.encode();
        for series in [
            "tb_pool_links{state=\"idle\"} 0",
            "tb_pool_evictions_total{reason=\"lru\"} 0",
            "tb_transfers_total{kind=\"serve\",result=\"error\"} 0",
            "tb_transfer_duration_seconds_count{kind=\"push\"} 0",
            "tb_gossip_messages_total{direction=\"out\"} 0",
            "tb_cluster_nodes{state=\"dead\"} 0",
            "tb_auth_failures_total{reason=\"too_many_pending\"} 0",
            "tb_build_info{role=\"broker\",version=\"0.1.0\"} 1",
            "tb_insecure_open 0",
        ] {
            assert!(text.contains(series), "missing {series} in\n{text}");
        }
    }

    #[test]
    fn two_processes_in_one_address_space_do_not_collide() {
        let a = Metrics::new(Role::Worker).expect("a");
        let b = Metrics::new(Role::Worker).expect("b");
        a.pool_dials.inc();
        assert_eq!((a.pool_dials.get(), b.pool_dials.get()), (1, 0));
    }

    #[test]
    fn auth_failures_are_counted_by_reason() {
        let m = Metrics::new(Role::Worker).expect("metrics");
        let shared = m.auth_failures.clone();
        shared.inc(AuthFailure::Timeout);
        m.auth_failures.inc(AuthFailure::Timeout);
        m.auth_failures.inc(AuthFailure::BadProof);
        assert_eq!(m.auth_failures.get(AuthFailure::Timeout), 2);
        assert_eq!(m.auth_failures.get(AuthFailure::Malformed), 0);
        assert_eq!(m.auth_failures.total(), 3);
        let text = m.encode();
        for series in [
            "tb_auth_failures_total{reason=\"timeout\"} 2",
            "tb_auth_failures_total{reason=\"bad_proof\"} 1",
            "tb_auth_failures_total{reason=\"too_large\"} 0",
        ] {
            assert!(text.contains(series), "missing {series} in\n{text}");
        }
    }

    #[test]
    fn timers_count_results_durations_and_in_flight() {
        let m = Metrics::new(Role::Worker).expect("metrics");
        let t = m.start_transfer(TransferKind::Pull);
        assert_eq!(m.transfers_in_flight.get(), 1);
        t.ok();
        m.start_transfer(TransferKind::Serve).error();
        drop(m.start_transfer(TransferKind::Push));
        assert_eq!(m.transfers_in_flight.get(), 0);
        assert_eq!(m.transfers(TransferKind::Pull, true), 1);
        assert_eq!(m.transfers(TransferKind::Serve, false), 1);
        assert_eq!(
            m.transfers(TransferKind::Push, false),
            1,
            "dropped = failed"
        );
        assert_eq!(m.transfer_counts(), (1, 2));
        let p50 = m.latency_quantile(0.5).expect("three samples");
        assert!((0.0..=0.0005).contains(&p50), "instant transfers: {p50}");
        let text = m.encode();
        assert!(text.contains("tb_transfer_duration_seconds_count{kind=\"pull\"} 1"));
    }

    #[test]
    fn status_and_stats_reflect_the_counters() {
        let m = Metrics::new(Role::Worker).expect("metrics");
        assert_eq!(m.latency_quantile(0.5), None);
        m.bytes_in.inc_by(4096);
        m.pool_links_idle.set(2);
        m.store_tensors.set(3);
        let s = m.status("ab".into(), vec!["127.0.0.1:1".into()], true);
        assert_eq!(s.role, "worker");
        assert_eq!(s.throughput.in_bytes_total, 4096);
        assert_eq!(s.pool.links_idle, 2);
        assert_eq!(s.store.tensors, 3);
        assert_eq!(s.transfers.latency_s.p50, None);
        assert!(!s.insecure_open);
        m.insecure_open.set(1);
        let s = m.status("ab".into(), vec![], true);
        assert!(s.insecure_open, "the status says a process runs open");
        let stats = m.node_stats(Some("http://127.0.0.1:9420".into()));
        assert_eq!(
            (stats.pool_links, stats.tensors, stats.in_bytes_total),
            (2, 3, 4096)
        );
        assert_eq!(stats.validate(), Ok(()));
    }
}
