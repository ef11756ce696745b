//! The connection pool: one `PeerActor` per iroh QUIC link (pooled, or superseded and kept
//! until unused), supervised by the `NodeActor`, with guards that make "in use" a fact of the
//! type system — for the streams we open and for those we serve.

pub(crate) mod book;
pub(crate) mod link;
pub(crate) mod peer;

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
};

use iroh::EndpointId;
use tb_dashboard::Metrics;

pub use link::LinkGuard;
use link::{Link, LinkShared};

/// A read replica of the pool's ready links, written only by the `NodeActor`.
///
/// A request for a peer that already has a pooled link takes its guard here, without a
/// round trip through the actor's mailbox (that hop is a sizeable part of a 4 KiB pull).
/// Every other case — a miss, a closed or dead link — goes to the actor, which decides.
#[derive(Debug, Default)]
pub(crate) struct ReadyLinks(RwLock<HashMap<EndpointId, Link>>);

impl ReadyLinks {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<EndpointId, Link>> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn insert(&self, peer: EndpointId, link: &Link) {
        self.write().insert(peer, link.clone());
    }

    /// Forgets `peer`'s entry if it still is `link`.
    pub(crate) fn remove(&self, peer: &EndpointId, link: &Arc<LinkShared>) {
        let mut map = self.write();
        if map.get(peer).is_some_and(|e| Arc::ptr_eq(&e.shared, link)) {
            map.remove(peer);
        }
    }

    pub(crate) fn clear(&self) {
        self.write().clear();
    }

    /// Usable pooled links as (active, idle), read straight from the links' use counts, so
    /// it is exact the moment a guard is handed out or dropped.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        map.values()
            .filter(|e| e.shared.is_usable())
            .fold((0, 0), |(active, idle), e| match e.shared.idle_since() {
                Some(_) => (active, idle + 1),
                None => (active + 1, idle),
            })
    }

    /// The peers with a usable pooled link, in id order.
    pub(crate) fn peers(&self) -> Vec<EndpointId> {
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        let mut peers: Vec<EndpointId> = map
            .iter()
            .filter(|(_, e)| e.shared.is_usable())
            .map(|(id, _)| *id)
            .collect();
        peers.sort();
        peers
    }

    /// A guard on `peer`'s pooled link, if it has a usable one.
    pub(crate) fn try_guard(&self, peer: &EndpointId) -> Option<LinkGuard> {
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        map.get(peer)?.guard()
    }
}

/// The pool's figures: link counts from `ready`, lifetime counts from the metrics.
pub(crate) fn snapshot(metrics: &Metrics, ready: &ReadyLinks) -> PoolStats {
    let (links_active, links_idle) = ready.counts();
    PoolStats {
        links_active,
        links_idle,
        dials: metrics.pool_dials.get(),
        reuses: metrics.pool_reuses.get(),
        evictions_idle: metrics.pool_evictions_idle.get(),
        evictions_lru: metrics.pool_evictions_lru.get(),
        connect_failures: metrics.pool_connect_failures.get(),
    }
}

/// A snapshot of the pool's state and lifetime counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pooled links with at least one stream open, ours or the peer's.
    pub links_active: usize,
    /// Pooled links with no stream open in either direction.
    pub links_idle: usize,
    /// Dials started (concurrent requests for one new peer share one).
    pub dials: u64,
    /// Requests served by an already pooled link.
    pub reuses: u64,
    /// Links closed after the idle timeout with no stream open in either direction (pooled
    /// ones, and superseded ones kept until unused).
    pub evictions_idle: u64,
    /// Idle links closed to make room at the maximum pool size.
    pub evictions_lru: u64,
    /// Dials that failed or timed out.
    pub connect_failures: u64,
}

impl PoolStats {
    /// Pooled links, active and idle.
    pub fn links(&self) -> usize {
        self.links_active + self.links_idle
    }
}
