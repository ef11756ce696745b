//! `PoolActor`: one per node. Owns the pool — a map from peer node id to a `PeerActor` —
//! and hands out link guards.
//!
//! Its handlers never wait on a peer: dials run in spawned tasks that `cast` their result
//! back, and children report their end through supervision events. Bookkeeping is the pure
//! [`PoolBook`]; this actor is the shell that talks to sockets and actors. What a link is used
//! for is the owner's business: it hears of links through [`LinkEvents`], and this file names
//! no protocol but the hello.

use std::{sync::Arc, time::Instant};

use iroh::{Endpoint, EndpointId, endpoint::Connection};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tb_dashboard::Metrics;
use tb_proto::{Access, CloseCode, DATA_ALPN};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, warn};

use crate::{
    auth,
    config::LinkConfig,
    endpoint::PeerAddr,
    error::{Error, Result},
    pool::{
        self, LinkEvents, LinkGuard, ReadyLinks,
        book::{Acquire, Insert, Origin, PoolBook},
        link::{Link, LinkShared},
        peer::{self, PeerActor, PeerArgs, PeerMsg},
    },
};

type Waiter = RpcReplyPort<Result<LinkGuard>>;

/// Messages the `PoolActor` handles.
pub(crate) enum PoolMsg {
    /// A caller wants a link to `peer`.
    Acquire { peer: PeerAddr, reply: Waiter },
    /// A dial task finished.
    Dialed {
        peer: EndpointId,
        generation: u64,
        /// The connection, the access its peer proved in its welcome, and its link id (what
        /// the owner learned in [`LinkEvents::dialed`] is filed under it).
        result: Result<(Connection, Access, u64)>,
    },
    /// A peer connected to us and passed the hello: pool the link (or keep it superseded,
    /// unpooled, until unused; see `pool::book`). The answer is the link its streams are
    /// served under, or `None` when it was refused: a new peer while the pool is full of
    /// peers in use, closed with `TooManyConnections` before anything is served on it.
    Adopt {
        conn: Connection,
        reply: RpcReplyPort<Option<Link>>,
    },
}

impl std::fmt::Debug for PoolMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PoolMsg::Acquire { .. } => "Acquire",
            PoolMsg::Dialed { .. } => "Dialed",
            PoolMsg::Adopt { .. } => "Adopt",
        })
    }
}

/// What the pool starts with: its endpoint and limits, where its figures go, and its owner's
/// hooks, task tracker and shutdown token.
pub struct PoolArgs {
    /// The endpoint links are dialed from (and accepted on, by the owner's protocol handler).
    pub endpoint: Endpoint,
    /// The pool's and the hello's limits.
    pub config: LinkConfig,
    /// The process's metrics: the pool's counters (the source of [`PoolStats`](super::PoolStats)).
    pub metrics: Arc<Metrics>,
    /// The read replica of ready links this actor keeps (the owner reads it too).
    pub ready: Arc<ReadyLinks>,
    /// What the owner does with new and lost links.
    pub events: Arc<dyn LinkEvents>,
    /// Owns the dial tasks, so the owner's shutdown joins them.
    pub tracker: TaskTracker,
    /// Cancelled at the owner's shutdown: dials in flight end with `Shutdown`.
    pub cancel: CancellationToken,
}

/// The `PoolActor`'s state: its arguments, the book and its children.
pub(crate) struct PoolState {
    args: PoolArgs,
    book: PoolBook<Waiter, Link>,
    /// Every link in the book (pooled or superseded) by actor id, to match a stopped child
    /// with its entry.
    children: std::collections::HashMap<ractor::ActorId, Child>,
}

/// What a link's actor stands for in the book.
struct Child {
    peer: EndpointId,
    generation: u64,
    link: Arc<LinkShared>,
    link_id: u64,
}

/// The per-node actor owning the connection pool.
pub(crate) struct PoolActor;

impl Actor for PoolActor {
    type Msg = PoolMsg;
    type State = PoolState;
    type Arguments = PoolArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<PoolMsg>,
        args: PoolArgs,
    ) -> Result<PoolState, ActorProcessingErr> {
        let book = PoolBook::new(args.endpoint.id(), args.config.max_links);
        Ok(PoolState {
            args,
            book,
            children: Default::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PoolMsg>,
        msg: PoolMsg,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PoolMsg::Acquire { peer, reply } => on_acquire(&myself, state, peer, reply),
            PoolMsg::Dialed {
                peer,
                generation,
                result,
            } => on_dialed(&myself, state, peer, generation, result).await,
            PoolMsg::Adopt { conn, reply } => {
                let peer = conn.remote_id();
                let id = pool::link::next_link_id();
                let link = insert_link(&myself, state, peer, Origin::Inbound, conn, id).await;
                let _ = reply.send(link);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<PoolMsg>,
        event: SupervisionEvent,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        let cell = match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => cell,
            SupervisionEvent::ActorFailed(cell, err) => {
                warn!(%err, "peer actor failed");
                cell
            }
            _ => return Ok(()),
        };
        if let Some(child) = state.children.remove(&cell.get_id()) {
            let peer = child.peer;
            state.args.ready.remove(&peer, &child.link);
            state.book.link_gone(&peer, child.generation);
            link_gone(state, peer, child.link_id);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<PoolMsg>,
        state: &mut PoolState,
    ) -> Result<(), ActorProcessingErr> {
        state.args.ready.clear();
        let (links, waiters) = state.book.drain();
        for link in links {
            let _ = link.actor.cast(PeerMsg::Close(CloseCode::Shutdown));
        }
        for waiter in waiters {
            let _ = waiter.send(Err(Error::Shutdown));
        }
        // Superseded links are children outside the book: they close as they stop.
        myself.stop_children(Some("pool shut down".into()));
        Ok(())
    }
}

fn on_acquire(myself: &ActorRef<PoolMsg>, state: &mut PoolState, peer: PeerAddr, reply: Waiter) {
    let acquired = state.book.acquire(peer.id, reply);
    let Some(waiter) = answer_acquire(myself, state, &peer, acquired) else {
        return;
    };
    // The ready link was closed by the peer (an idle close racing with this request) before
    // its actor heard of it; `answer_acquire` marked it dead, so asking again dials.
    let acquired = state.book.acquire(peer.id, waiter);
    if let Some(waiter) = answer_acquire(myself, state, &peer, acquired) {
        let _ = waiter.send(Err(closed_link_error(peer.id, None)));
    }
}

/// Acts on what the book decided; gives the waiter back when the ready link it was to reuse
/// turned out closed (and marks that link dead).
fn answer_acquire(
    myself: &ActorRef<PoolMsg>,
    state: &PoolState,
    peer: &PeerAddr,
    acquired: Acquire<Waiter, Link>,
) -> Option<Waiter> {
    let args = &state.args;
    match acquired {
        Acquire::Reuse { waiter, handle, .. } => match handle.guard() {
            Some(guard) => {
                args.metrics.pool_reuses.inc();
                let _ = waiter.send(Ok(guard));
            }
            None => {
                handle.shared.mark_dead();
                return Some(waiter);
            }
        },
        Acquire::Full { waiter } => {
            let _ = waiter.send(Err(Error::TooManyConnections {
                peer: None,
                max: Some(args.config.max_links),
            }));
        }
        Acquire::Queued => {}
        Acquire::Dial { generation } => {
            args.metrics.pool_dials.inc();
            spawn_dial(myself.clone(), args, peer.clone(), generation);
        }
    }
    None
}

/// Dials in a task, with the connect timeout, lets the owner set the new link up
/// ([`LinkEvents::dialed`], within the request timeout), and casts the result back.
fn spawn_dial(myself: ActorRef<PoolMsg>, args: &PoolArgs, peer: PeerAddr, generation: u64) {
    let endpoint = args.endpoint.clone();
    let timeout = args.config.connect_timeout;
    let limit = args.config.request_timeout;
    let cancel = args.cancel.clone();
    let key = args.config.cluster_key.clone();
    let max_streams = args.config.max_concurrent_streams;
    let events = args.events.clone();
    args.tracker.spawn(async move {
        // The connect timeout bounds the dial and the hello together: a peer that accepts but
        // never answers is as unreachable as one that never accepts.
        let dial = async {
            let conn = endpoint
                .connect(peer.to_endpoint_addr(), DATA_ALPN)
                .await
                .map_err(|e| unreachable(&peer, e.to_string()))?;
            let welcomed =
                auth::client_hello(&conn, endpoint.id(), &key, DATA_ALPN, timeout, max_streams)
                    .await
                    .map_err(|err| match pool::link::peer_close(&conn) {
                        // Refused by a full pool, perhaps before its welcome was read.
                        Some(code @ CloseCode::TooManyConnections) => {
                            closed_link_error(peer.id, Some(code))
                        }
                        _ => err,
                    })?;
            Ok::<_, Error>((conn, welcomed.peer))
        };
        // The link's first request (the owner's), bounded like any request (a silent peer
        // costs the request timeout here, then its requests time out over QUIC). It never
        // fails the dial: the link is pooled whatever it learned.
        let dial = async {
            let link_id = pool::link::next_link_id();
            let (conn, access) = match tokio::time::timeout(timeout, dial).await {
                Ok(dialed) => dialed?,
                Err(_) => {
                    let why = format!("no connection within {timeout:?}");
                    return Err(unreachable(&peer, why));
                }
            };
            let first = events.dialed(&conn, access, link_id);
            if tokio::time::timeout(limit, first).await.is_err() {
                debug!(peer = %peer.id.fmt_short(), ?limit, "a new link's set-up did not finish in time");
            }
            Ok((conn, access, link_id))
        };
        let result = tokio::select! {
            _ = cancel.cancelled() => Err(Error::Shutdown),
            r = dial => r,
        };
        let sent = myself.cast(PoolMsg::Dialed {
            peer: peer.id,
            generation,
            result,
        });
        // If the pool is gone, close what we opened.
        if let Err(ractor::MessagingErr::SendErr(PoolMsg::Dialed {
            result: Ok((c, _, _)),
            ..
        })) = sent
        {
            peer::close(&c, CloseCode::Shutdown);
        }
    });
}

fn unreachable(peer: &PeerAddr, reason: String) -> Error {
    Error::PeerUnreachable {
        peer: format!("{}@{}", peer.id.fmt_short(), peer.addr),
        reason,
    }
}

async fn on_dialed(
    myself: &ActorRef<PoolMsg>,
    state: &mut PoolState,
    peer: EndpointId,
    generation: u64,
    result: Result<(Connection, Access, u64)>,
) {
    let (conn, access, link_id) = match result {
        Ok(dialed) => dialed,
        Err(err) => {
            state.args.metrics.pool_connect_failures.inc();
            for waiter in state.book.dial_failed(&peer, generation) {
                let _ = waiter.send(Err(err.clone()));
            }
            return;
        }
    };
    // Pooled or superseded, the peer may open streams on this link too: serve them, as far
    // as the access it proved in its welcome allows.
    let origin = Origin::Dial(generation);
    if let Some(link) = insert_link(myself, state, peer, origin, conn, link_id).await {
        state.args.events.serve(link, access);
    }
}

/// One link of `peer` (`link_id`) is gone: the owner hears of it with the peer's pooled link
/// now, if any (what the gone link taught it may stay with that one).
fn link_gone(state: &PoolState, peer: EndpointId, link_id: u64) {
    let successor = state.book.link_of(&peer).map(|link| link.id);
    state.args.events.link_gone(peer, link_id, successor);
    state
        .args
        .ready
        .set_superseded(state.book.superseded_count());
}

/// Puts a connection (a finished dial, or an inbound one) under a new `PeerActor`: pooled
/// or superseded (see `pool::book`), and answers whoever waited for it. Returns the link to
/// serve the peer's streams under, or `None` when the connection was refused (a new peer
/// while the pool is full of peers in use) or could not be set up — closed before anything
/// was served on it.
async fn insert_link(
    myself: &ActorRef<PoolMsg>,
    state: &mut PoolState,
    peer: EndpointId,
    origin: Origin,
    conn: Connection,
    link_id: u64,
) -> Option<Link> {
    let shared = Arc::new(LinkShared::new(Instant::now()));
    let args = PeerArgs {
        peer,
        conn: conn.clone(),
        link: shared.clone(),
        idle_timeout: state.args.config.idle_timeout,
        metrics: state.args.metrics.clone(),
    };
    let actor = match Actor::spawn_linked(None, PeerActor, args, myself.get_cell()).await {
        Ok((actor, _)) => actor,
        Err(e) => {
            let err = Error::Io(format!("starting the link actor: {e}"));
            if let Origin::Dial(g) = origin {
                for waiter in state.book.dial_failed(&peer, g) {
                    let _ = waiter.send(Err(err.clone()));
                }
            }
            peer::close(&conn, CloseCode::Normal);
            link_gone(state, peer, link_id);
            return None;
        }
    };
    let link = Link {
        id: link_id,
        conn,
        shared,
        actor,
    };
    let inserted = state
        .book
        .insert_ready(peer, origin, link.clone(), link.shared.clone());
    let link = file_link(state, peer, link_id, link, inserted);
    state
        .args
        .ready
        .set_superseded(state.book.superseded_count());
    link
}

/// Acts on where the book put a new link: pooled (it answers the waiters, and the links it
/// displaced are closed), superseded (kept, unpooled, until unused), or refused (a full pool
/// of peers in use: closed with `TooManyConnections`, the waiters told so).
fn file_link(
    state: &mut PoolState,
    peer: EndpointId,
    link_id: u64,
    link: Link,
    inserted: Insert<Waiter, Link>,
) -> Option<Link> {
    match inserted {
        Insert::Pooled {
            generation,
            waiters,
            evicted,
            superseded,
            over_cap,
        } => {
            adopt_child(state, peer, generation, &link);
            state.args.ready.insert(peer, &link);
            close_evicted(state, evicted);
            if let Some(old) = superseded {
                let _ = old.actor.cast(PeerMsg::Supersede);
            }
            close_over_cap(state, peer, over_cap);
            for waiter in waiters {
                let _ = waiter.send(guard(&link, peer));
            }
            Some(link)
        }
        Insert::Superseded {
            generation,
            over_cap,
        } => {
            adopt_child(state, peer, generation, &link);
            let _ = link.actor.cast(PeerMsg::Supersede);
            close_over_cap(state, peer, over_cap);
            Some(link)
        }
        Insert::Full { waiters, evicted } => {
            let max = state.args.config.max_links;
            debug!(peer = %peer.fmt_short(), max, "pool full of peers in use: refusing a link");
            state.args.metrics.pool_refused_full.inc();
            close_evicted(state, evicted);
            let _ = link
                .actor
                .cast(PeerMsg::Close(CloseCode::TooManyConnections));
            for waiter in waiters {
                let _ = waiter.send(Err(Error::TooManyConnections {
                    peer: None,
                    max: Some(max),
                }));
            }
            link_gone(state, peer, link_id);
            None
        }
    }
}

/// Files a link's actor under its place in the book, to forget it when it stops.
fn adopt_child(state: &mut PoolState, peer: EndpointId, generation: u64, link: &Link) {
    let child = Child {
        peer,
        generation,
        link: link.shared.clone(),
        link_id: link.id,
    };
    state.children.insert(link.actor.get_id(), child);
}

/// Closes the links the LRU evicted to make room (idle ones, already closed for guards).
fn close_evicted(state: &PoolState, evicted: Vec<(EndpointId, Link)>) {
    for (old_peer, old) in evicted {
        debug!(peer = %old_peer.fmt_short(), "evicting least recently used idle link");
        state.args.metrics.pool_evictions_lru.inc();
        let _ = old.actor.cast(PeerMsg::Close(CloseCode::LruEvicted));
    }
}

/// Closes `peer`'s oldest links past [`pool::MAX_LINKS_PER_PEER`], counted.
fn close_over_cap(state: &PoolState, peer: EndpointId, over_cap: Vec<Link>) {
    for old in over_cap {
        let max = pool::MAX_LINKS_PER_PEER;
        debug!(peer = %peer.fmt_short(), max, "too many links from one peer: closing its oldest");
        state.args.metrics.pool_evictions_peer_cap.inc();
        let _ = old
            .actor
            .cast(PeerMsg::Close(CloseCode::TooManyConnections));
    }
}

fn guard(link: &Link, peer: EndpointId) -> Result<LinkGuard> {
    link.guard()
        .ok_or_else(|| closed_link_error(peer, pool::link::peer_close(&link.conn)))
}

/// The error for a link that closed while being handed out: the peer refused it for a full
/// pool, or it is gone.
fn closed_link_error(peer: EndpointId, code: Option<CloseCode>) -> Error {
    let peer = peer.fmt_short().to_string();
    match code {
        Some(CloseCode::TooManyConnections) => Error::TooManyConnections {
            peer: Some(peer),
            max: None,
        },
        _ => Error::PeerUnreachable {
            peer,
            reason: "link closed while being handed out".into(),
        },
    }
}
