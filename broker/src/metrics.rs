//! The broker's own counters (requests, refusals, gossip, anti-entropy), read without
//! messaging the actor, and the latest heartbeat stats of each worker.
//!
//! The counters the metrics contract names (auth failures, gossip in/out, sync rounds) *are*
//! the process's Prometheus counters (`IntCounter` handles share one value), so nothing is
//! counted twice; the others are plain atomics.

use std::{
    collections::HashMap,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

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
    /// `tb/ctl/1` requests served.
    pub requests: Counter,
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
    /// `tb/ctl/1` connections refused: the peer held `MAX_CTL_CONNECTIONS_PER_PEER`.
    pub refused_connections: Counter,
    /// Subscriptions refused: the peer held `MAX_SUBSCRIPTIONS_PER_PEER`.
    pub refused_subscriptions: Counter,
    /// Subscriptions ended for falling a whole buffer behind.
    pub lagged_subscriptions: Counter,
}

impl BrokerCounters {
    /// Counters backed by `metrics` where the contract names them.
    pub fn new(metrics: &Metrics) -> Self {
        BrokerCounters {
            requests: Counter::default(),
            auth_failures: metrics.auth_failures.clone(),
            gossip_sent: metrics.gossip_out.clone(),
            gossip_received: metrics.gossip_in.clone(),
            gossip_rejected: Counter::default(),
            sync_rounds: metrics.sync_rounds.clone(),
            sync_failures: Counter::default(),
            refused_connections: Counter::default(),
            refused_subscriptions: Counter::default(),
            lagged_subscriptions: Counter::default(),
        }
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
