//! The broker's own counters (requests, refusals, gossip, anti-entropy), read without
//! messaging the actor, and the latest heartbeat stats of each worker.
//!
//! The counters the metrics contract names (auth failures, gossip in/out, sync rounds,
//! refusals) *are* the process's Prometheus counters (`IntCounter` handles share one value), so
//! nothing is counted twice; the others are plain atomics. The broker's own family,
//! `tb_broker_refused_total{reason}` ([`Refusals`]), is registered here in the process's
//! registry, every reason at zero from the start.

use std::{
    collections::HashMap,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use prometheus::{IntCounterVec, Opts};
use tb_dashboard::{AuthFailures, IntCounter, Metrics};
use tb_proto::{MAX_SYNC_MEMBERS, NodeId, NodeStats};

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a broker has done since it started.
#[derive(Debug)]
pub struct BrokerCounters {
    /// `tb/ctl/1` requests served (on the link or the same-host socket).
    pub requests: Counter,
    /// Of them, those that came on the same-host socket (`DataRequest::Ctl`).
    pub socket_requests: Counter,
    /// Subscriptions registered (on the link or the same-host socket).
    pub subscriptions: Counter,
    /// Of them, those served on the same-host socket.
    pub socket_subscriptions: Counter,
    /// Subscriptions that ended (unsubscribed, their subscriber gone, or cut off): those
    /// open are `subscriptions` less these.
    pub subscriptions_ended: Counter,
    /// Peers refused before authenticating, by reason (`tb_auth_failures_total{reason}`,
    /// shared with the broker's data plane).
    pub auth_failures: AuthFailures,
    /// Registry ops broadcast (`tb_gossip_messages_total{direction="out"}`).
    pub gossip_sent: IntCounter,
    /// Registry ops received from other brokers (`tb_gossip_messages_total{direction="in"}`).
    pub gossip_received: IntCounter,
    /// Gossip messages dropped (bad MAC, malformed, invalid).
    pub gossip_rejected: Counter,
    /// Anti-entropy pulls that completed (`tb_sync_rounds_total`).
    pub sync_rounds: IntCounter,
    /// Anti-entropy pulls that failed (peer down, timeout).
    pub sync_failures: Counter,
    /// What authenticated peers were refused or cut off, by reason
    /// (`tb_broker_refused_total{reason}`).
    pub refused: Refusals,
}

impl BrokerCounters {
    /// Counters backed by `metrics` where the contract names them; fails only if the broker's
    /// own family cannot be made (a bug: its name and label are fixed).
    pub fn new(metrics: &Metrics) -> Result<Self, prometheus::Error> {
        Ok(BrokerCounters {
            refused: Refusals::new(metrics)?,
            requests: Counter::default(),
            socket_requests: Counter::default(),
            subscriptions: Counter::default(),
            socket_subscriptions: Counter::default(),
            subscriptions_ended: Counter::default(),
            auth_failures: metrics.auth_failures.clone(),
            gossip_sent: metrics.gossip_out.clone(),
            gossip_received: metrics.gossip_in.clone(),
            gossip_rejected: Counter::default(),
            sync_rounds: metrics.sync_rounds.clone(),
            sync_failures: Counter::default(),
        })
    }
}

/// Why the broker refused an authenticated peer, or cut it off (the `reason` label of
/// `tb_broker_refused_total`). Peers refused before authenticating are counted in
/// `tb_auth_failures_total` instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A `tb/ctl/1` connection past `MAX_CTL_CONNECTIONS_PER_PEER` (closed with
    /// `TooManyConnections`).
    CtlConnections,
    /// A subscription past `MAX_SUBSCRIPTIONS_PER_PEER` (answered `Busy`).
    Subscriptions,
    /// A subscription ended for falling a whole buffer of events behind (`Busy`).
    LaggedSubscription,
    /// A request the peer's credential does not allow (a read-only member publishing, say).
    Unauthorized,
    /// A request that failed validation, or that could not be decoded.
    Malformed,
    /// An anti-entropy conversation that would have gone over the sync budget.
    SyncBudget,
}

impl Refusal {
    /// Every reason, in label order.
    pub const ALL: [Refusal; 6] = [
        Refusal::CtlConnections,
        Refusal::Subscriptions,
        Refusal::LaggedSubscription,
        Refusal::Unauthorized,
        Refusal::Malformed,
        Refusal::SyncBudget,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::CtlConnections => "ctl_connections",
            Refusal::Subscriptions => "subscriptions",
            Refusal::LaggedSubscription => "lagged_subscription",
            Refusal::Unauthorized => "unauthorized",
            Refusal::Malformed => "malformed",
            Refusal::SyncBudget => "sync_budget",
        }
    }
}

/// `tb_broker_refused_total{reason}`: one counter per [`Refusal`].
#[derive(Debug)]
pub struct Refusals([IntCounter; Refusal::ALL.len()]);

impl Refusals {
    /// The family, registered in `metrics`' registry. A registry that has it already (a second
    /// broker given the same `Metrics`) keeps the first one's; this broker then counts
    /// without exporting, and says so once.
    fn new(metrics: &Metrics) -> Result<Self, prometheus::Error> {
        let opts = Opts::new(
            "tb_broker_refused_total",
            "Requests and connections the broker refused an authenticated peer, or subscriptions \
             it ended, by reason",
        );
        let family = IntCounterVec::new(opts, &["reason"])?;
        match metrics.registry().register(Box::new(family.clone())) {
            Ok(()) => {}
            Err(prometheus::Error::AlreadyReg) => {
                tracing::warn!(
                    "tb_broker_refused_total is exported by another broker of this process: this one's refusals are counted, not exported"
                );
            }
            Err(e) => return Err(e),
        }
        Ok(Refusals(
            Refusal::ALL.map(|r| family.with_label_values(&[r.as_str()])),
        ))
    }

    /// Counts one refusal for `reason`.
    pub fn inc(&self, reason: Refusal) {
        self.0[reason as usize].inc();
    }

    /// Refusals counted for `reason`.
    pub fn get(&self, reason: Refusal) -> u64 {
        self.0[reason as usize].get()
    }
}

/// Stats older than this are forgotten (the worker stopped heartbeating to this broker).
const STATS_MAX_AGE: Duration = Duration::from_secs(600);

/// The latest heartbeat stats of each node that heartbeats to this broker, in memory only.
/// Bounded: at most [`MAX_SYNC_MEMBERS`] nodes, stale rows dropped.
#[derive(Debug, Default)]
pub struct MemberStatsBook(Mutex<HashMap<NodeId, (Instant, NodeStats)>>);

impl MemberStatsBook {
    /// Records `stats` from `node`, received at `now`.
    pub fn record(&self, node: NodeId, stats: NodeStats, now: Instant) {
        self.record_unless(node, stats, now, |_| false);
    }

    /// Records `stats` that `node` sent (to another broker) at `sent_at`, unless the book
    /// already has stats it sent later: for figures relayed by peer brokers, which may arrive
    /// out of order and from more than one peer.
    pub fn record_if_younger(&self, node: NodeId, stats: NodeStats, sent_at: Instant) {
        self.record_unless(node, stats, sent_at, |known_at| known_at >= sent_at);
    }

    /// Records `stats` from `node` dated `at`, unless the row the book has for `node` was
    /// dated at a time `keep` approves of. Evicts stale rows, then the oldest, when full.
    fn record_unless(
        &self,
        node: NodeId,
        stats: NodeStats,
        at: Instant,
        keep: impl Fn(Instant) -> bool,
    ) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(&node) {
            Some((known_at, _)) if keep(*known_at) => return,
            Some(_) => {}
            None if map.len() >= MAX_SYNC_MEMBERS => {
                map.retain(|_, (t, _)| at.saturating_duration_since(*t) < STATS_MAX_AGE);
                if map.len() >= MAX_SYNC_MEMBERS {
                    let oldest = map.iter().min_by_key(|(_, (t, _))| *t).map(|(n, _)| *n);
                    if let Some(oldest) = oldest {
                        map.remove(&oldest);
                    }
                }
            }
            None => {}
        }
        map.insert(node, (at, stats));
    }

    /// `node`'s latest stats and their age at `now`, unless too old.
    pub fn get(&self, node: &NodeId, now: Instant) -> Option<(NodeStats, Duration)> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (at, stats) = map.get(node)?;
        let age = now.saturating_duration_since(*at);
        (age < STATS_MAX_AGE).then(|| (stats.clone(), age))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(tensors: u64) -> NodeStats {
        NodeStats {
            tensors,
            ..NodeStats::default()
        }
    }

    #[test]
    fn refusals_are_exported_by_reason_from_zero() {
        let metrics = Metrics::new(tb_dashboard::Role::Broker).expect("metrics");
        let counters = BrokerCounters::new(&metrics).expect("counters");
        for reason in Refusal::ALL {
            let series = format!(
                "tb_broker_refused_total{{reason=\"{}\"}} 0",
                reason.as_str()
            );
            assert!(metrics.encode().contains(&series), "{series}");
        }
        counters.refused.inc(Refusal::Subscriptions);
        counters.refused.inc(Refusal::Subscriptions);
        assert_eq!(counters.refused.get(Refusal::Subscriptions), 2);
        let page = metrics.encode();
        assert!(page.contains("tb_broker_refused_total{reason=\"subscriptions\"} 2"));
        assert!(page.contains("tb_broker_refused_total{reason=\"ctl_connections\"} 0"));
        // A second broker on the same metrics still counts, and the first one's stay.
        let second = BrokerCounters::new(&metrics).expect("counters");
        second.refused.inc(Refusal::Malformed);
        assert_eq!(second.refused.get(Refusal::Malformed), 1);
        assert!(
            metrics
                .encode()
                .contains("tb_broker_refused_total{reason=\"subscriptions\"} 2")
        );
    }

    #[test]
    fn the_book_keeps_the_latest_stats_and_forgets_stale_ones() {
        let book = MemberStatsBook::default();
        let t0 = Instant::now();
        let node = NodeId([1; 32]);
        book.record(node, stats(1), t0);
        book.record(node, stats(2), t0 + Duration::from_secs(1));
        let (got, age) = book.get(&node, t0 + Duration::from_secs(3)).expect("stats");
        assert_eq!((got.tensors, age), (2, Duration::from_secs(2)));
        assert!(book.get(&NodeId([2; 32]), t0).is_none());
        assert!(book.get(&node, t0 + STATS_MAX_AGE * 2).is_none(), "stale");
    }

    #[test]
    fn relayed_stats_never_replace_younger_ones() {
        let book = MemberStatsBook::default();
        let t0 = Instant::now();
        let node = NodeId([1; 32]);
        book.record_if_younger(node, stats(2), t0 + Duration::from_secs(2));
        book.record_if_younger(node, stats(1), t0 + Duration::from_secs(1));
        let (got, age) = book.get(&node, t0 + Duration::from_secs(3)).expect("stats");
        assert_eq!((got.tensors, age), (2, Duration::from_secs(1)));
        book.record_if_younger(node, stats(3), t0 + Duration::from_secs(3));
        assert_eq!(
            book.get(&node, t0 + Duration::from_secs(3))
                .map(|s| s.0.tensors),
            Some(3)
        );
    }

    #[test]
    fn the_book_is_bounded() {
        let book = MemberStatsBook::default();
        let t0 = Instant::now();
        for i in 0..MAX_SYNC_MEMBERS + 10 {
            let mut id = [0u8; 32];
            id[..8].copy_from_slice(&(i as u64).to_le_bytes());
            book.record(
                NodeId(id),
                NodeStats::default(),
                t0 + Duration::from_millis(i as u64),
            );
        }
        let len = book.0.lock().expect("lock").len();
        assert_eq!(len, MAX_SYNC_MEMBERS);
    }
}
