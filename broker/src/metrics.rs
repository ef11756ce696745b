//! The broker's own counters (requests, refusals, gossip, anti-entropy), read without
//! messaging the actor.

use std::sync::atomic::{AtomicU64, Ordering};

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
#[derive(Debug, Default)]
pub struct BrokerCounters {
    /// `tb/ctl/1` requests served.
    pub requests: Counter,
    /// Peers refused because they could not prove the cluster secret.
    pub auth_failures: Counter,
    /// Registry ops broadcast.
    pub gossip_sent: Counter,
    /// Registry ops received from other brokers.
    pub gossip_received: Counter,
    /// Gossip messages dropped (bad MAC, malformed, invalid).
    pub gossip_rejected: Counter,
    /// Anti-entropy pulls that completed.
    pub sync_rounds: Counter,
    /// Anti-entropy pulls that failed (peer down, timeout).
    pub sync_failures: Counter,
}
