//! The connection pool: one `PeerActor` per iroh QUIC link (pooled, or superseded and closed
//! once idle; at most [`MAX_LINKS_PER_PEER`] per peer), supervised by the `NodeActor`, with
//! guards that make "in use" a fact of the type system — for the streams we open and for
//! those we serve.

pub(crate) mod book;
pub(crate) mod link;
pub(crate) mod peer;

use std::{
    collections::HashMap,
    sync::{
        Arc, RwLock,
        atomic::{AtomicUsize, Ordering},
    },
};

use iroh::EndpointId;
use tb_dashboard::Metrics;

pub use link::LinkGuard;
use link::{Link, LinkShared};

/// Most live links one peer may hold to a node, pooled and superseded together: a new link
/// past it closes that peer's oldest superseded ones (idle first), counted in
/// `tb_pool_evictions_total{reason="peer_cap"}`. Two nodes that dial each other at once hold
/// two for a moment, a restarted peer one more; the rest is room for races.
pub const MAX_LINKS_PER_PEER: usize = 4;

/// How long a superseded link (one a pair no longer pools) is kept once idle, at most (the
/// idle timeout when shorter): long enough for the peer's first request on a link it just
/// dialed to arrive, short enough that a peer's extra links do not linger.
pub const SUPERSEDED_IDLE: std::time::Duration = std::time::Duration::from_secs(2);

/// A read replica of the pool's ready links, written only by the `NodeActor`.
///
/// A request for a peer that already has a pooled link takes its guard here, without a
/// round trip through the actor's mailbox (that hop is a sizeable part of a 4 KiB pull).
/// Every other case — a miss, a closed or dead link — goes to the actor, which decides.
#[derive(Debug, Default)]
pub(crate) struct ReadyLinks(
    RwLock<HashMap<EndpointId, Link>>,
    /// Superseded links held now (live, unpooled), as the `NodeActor` last counted them.
    AtomicUsize,
);

impl ReadyLinks {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<EndpointId, Link>> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Records how many superseded links the pool holds now.
    pub(crate) fn set_superseded(&self, count: usize) {
        self.1.store(count, Ordering::Relaxed);
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
        links_superseded: ready.1.load(Ordering::Relaxed),
        dials: metrics.pool_dials.get(),
        reuses: metrics.pool_reuses.get(),
        evictions_idle: metrics.pool_evictions_idle.get(),
        evictions_lru: metrics.pool_evictions_lru.get(),
        evictions_superseded: metrics.pool_evictions_superseded.get(),
        evictions_peer_cap: metrics.pool_evictions_peer_cap.get(),
        refused_full: metrics.pool_refused_full.get(),
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
    /// Superseded links: a peer's extra links (not pooled), served while in use and closed
    /// once idle.
    pub links_superseded: usize,
    /// Dials started (concurrent requests for one new peer share one).
    pub dials: u64,
    /// Requests served by an already pooled link.
    pub reuses: u64,
    /// Links closed after the idle timeout with no stream open in either direction (pooled
    /// ones, and superseded ones kept until unused).
    pub evictions_idle: u64,
    /// Idle links closed to make room at the maximum pool size.
    pub evictions_lru: u64,
    /// Superseded links closed once idle.
    pub evictions_superseded: u64,
    /// A peer's oldest links closed when it opened more than [`MAX_LINKS_PER_PEER`].
    pub evictions_peer_cap: u64,
    /// New peers' links refused (`TooManyConnections`) by a pool full of peers in use.
    pub refused_full: u64,
    /// Dials that failed or timed out.
    pub connect_failures: u64,
}

impl PoolStats {
    /// Pooled links, active and idle.
    pub fn links(&self) -> usize {
        self.links_active + self.links_idle
    }
}
