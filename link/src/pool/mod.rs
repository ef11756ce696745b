//! The connection pool: one `PeerActor` per iroh QUIC link (pooled, or superseded and closed
//! once idle; at most [`MAX_LINKS_PER_PEER`] per peer), supervised by the `PoolActor`, with
//! guards that make "in use" a fact of the type system — for the streams we open and for
//! those we serve.
//!
//! - `book`: the bookkeeping as plain data (who is linked, who waits, what to evict), tested
//!   without actors or sockets;
//! - `actor`: the `PoolActor`, the shell over the book that dials, adopts and closes;
//! - `peer`: the `PeerActor` of one link (idle clock, close codes, loss);
//! - `link`: a link's shared use count and the [`LinkGuard`] that holds it;
//! - `events`: [`LinkEvents`], how the owner hears of links;
//! - this file: [`Pool`], the handle the owner holds, [`ReadyLinks`] and [`PoolStats`].

mod actor;
pub(crate) mod book;
mod events;
pub(crate) mod link;
pub(crate) mod peer;

use std::{
    collections::HashMap,
    sync::{
        Arc, RwLock,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use iroh::{EndpointId, endpoint::Connection};
use ractor::{Actor, ActorRef, rpc::CallResult};
use tb_dashboard::Metrics;
use tb_proto::CloseCode;
use tokio::task::JoinHandle;

pub use actor::PoolArgs;
use actor::{PoolActor, PoolMsg};
pub use events::{EventFuture, LinkEvents};
use link::LinkShared;
pub use link::{Link, LinkGuard};

use crate::{
    endpoint::PeerAddr,
    error::{Error, Result},
};

/// Most live links one peer may hold to a node, pooled and superseded together: a new link
/// past it closes that peer's oldest superseded ones (idle first), counted in
/// `tb_pool_evictions_total{reason="peer_cap"}`. Two nodes that dial each other at once hold
/// two for a moment, a restarted peer one more; the rest is room for races.
pub const MAX_LINKS_PER_PEER: usize = 4;

/// How long a superseded link (one a pair no longer pools) is kept once idle, at most (the
/// idle timeout when shorter): long enough for the peer's first request on a link it just
/// dialed to arrive, short enough that a peer's extra links do not linger.
pub(crate) const SUPERSEDED_IDLE: std::time::Duration = std::time::Duration::from_secs(2);

/// A read replica of the pool's ready links, written only by the `PoolActor`.
///
/// A request for a peer that already has a pooled link takes its guard here, without a
/// round trip through the actor's mailbox (that hop is a sizeable part of a 4 KiB pull).
/// Every other case — a miss, a closed or dead link — goes to the actor, which decides.
#[derive(Debug, Default)]
pub struct ReadyLinks(
    RwLock<HashMap<EndpointId, Link>>,
    /// Superseded links held now (live, unpooled), as the `PoolActor` last counted them.
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
    pub fn counts(&self) -> (usize, usize) {
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        map.values()
            .filter(|e| e.shared.is_usable())
            .fold((0, 0), |(active, idle), e| match e.shared.idle_since() {
                Some(_) => (active, idle + 1),
                None => (active + 1, idle),
            })
    }

    /// The peers with a usable pooled link, in id order.
    pub fn peers(&self) -> Vec<EndpointId> {
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
    pub fn try_guard(&self, peer: &EndpointId) -> Option<LinkGuard> {
        let map = self.0.read().unwrap_or_else(|p| p.into_inner());
        map.get(peer)?.guard()
    }
}

/// The pool of one node: the handle its owner holds on the `PoolActor`, and the read replica
/// of ready links that lets a request reuse a pooled link without a trip through the actor.
#[derive(Debug, Clone)]
pub struct Pool {
    actor: ActorRef<PoolMsg>,
    ready: Arc<ReadyLinks>,
    metrics: Arc<Metrics>,
    /// How long an adopt or an acquire may wait for the actor (an acquire one second more, for
    /// the dial it may wait on).
    connect_timeout: Duration,
}

impl Pool {
    /// Starts the pool's actor (unsupervised: its owner stops it). The handle to join it is
    /// the second value; the actor stops on [`Pool::stop`].
    pub async fn spawn(args: PoolArgs) -> Result<(Pool, JoinHandle<()>)> {
        let ready = args.ready.clone();
        let metrics = args.metrics.clone();
        let connect_timeout = args.config.connect_timeout;
        let (actor, handle) = Actor::spawn(None, PoolActor, args)
            .await
            .map_err(|e| Error::Io(format!("starting the pool actor: {e}")))?;
        let pool = Pool {
            actor,
            ready,
            metrics,
            connect_timeout,
        };
        Ok((pool, handle))
    }

    /// A guard on a pooled link to `addr`, dialing it if needed (one dial per peer at a time).
    pub async fn acquire(&self, addr: &PeerAddr) -> Result<LinkGuard> {
        if let Some(guard) = self.ready.try_guard(&addr.id) {
            self.metrics.pool_reuses.inc();
            return Ok(guard);
        }
        let bound = self.connect_timeout + Duration::from_secs(1);
        let asked = self.actor.call(
            |reply| PoolMsg::Acquire {
                peer: addr.clone(),
                reply,
            },
            Some(bound),
        );
        match asked.await {
            Ok(CallResult::Success(result)) => result,
            Ok(CallResult::Timeout) => Err(Error::timeout(
                format!("a link to {}", addr.id.fmt_short()),
                bound,
            )),
            Ok(CallResult::SenderError) | Err(_) => Err(Error::Shutdown),
        }
    }

    /// Pools a connection a peer opened to us once it passed the hello (or keeps it
    /// superseded, unpooled, until unused). Returns the link to serve its streams under, or
    /// `None` when it was refused (a new peer while the pool is full of peers in use, closed
    /// with `TooManyConnections` before anything is served on it) or the pool is gone (closed
    /// with `Shutdown`).
    pub async fn adopt(&self, conn: Connection) -> Option<Link> {
        let adopt = |reply| PoolMsg::Adopt {
            conn: conn.clone(),
            reply,
        };
        match self.actor.call(adopt, Some(self.connect_timeout)).await {
            Ok(CallResult::Success(link)) => link,
            _ => {
                peer::close(&conn, CloseCode::Shutdown);
                None
            }
        }
    }

    /// The pool's figures: link counts from the ready links, lifetime counts from the metrics.
    pub fn stats(&self) -> PoolStats {
        snapshot(&self.metrics, &self.ready)
    }

    /// Stops the actor: every link closes with `Shutdown`, waiters get `Shutdown`.
    pub fn stop(&self, reason: Option<String>) {
        self.actor.stop(reason);
    }
}

/// The pool's figures: link counts from `ready`, lifetime counts from the metrics.
fn snapshot(metrics: &Metrics, ready: &ReadyLinks) -> PoolStats {
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
