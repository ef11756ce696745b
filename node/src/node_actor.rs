//! `NodeActor`: one per process. Owns the pool — a map from peer node id to a `PeerActor` —
//! and hands out link guards.
//!
//! Its handlers never wait on a peer: dials run in spawned tasks that `cast` their result
//! back, and children report their end through supervision events. Bookkeeping is the pure
//! [`PoolBook`]; this actor is the shell that talks to sockets and actors.

use std::{sync::Arc, time::Instant};

use iroh::{EndpointId, endpoint::Connection};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tb_proto::{Access, CloseCode, DATA_ALPN, DataRequest, DataResponse};
use tracing::{debug, warn};

use crate::{
    auth,
    ctx::NodeCtx,
    endpoint::PeerAddr,
    error::{Error, Result},
    pool::{
        self, LinkGuard,
        book::{Acquire, Insert, PoolBook},
        link::{Link, LinkShared},
        peer::{self, PeerActor, PeerArgs, PeerMsg},
    },
    serve, wire,
};

type Waiter = RpcReplyPort<Result<LinkGuard>>;

/// Messages the `NodeActor` handles.
pub(crate) enum NodeMsg {
    /// A caller wants a link to `peer`.
    Acquire { peer: PeerAddr, reply: Waiter },
    /// A dial task finished.
    Dialed {
        peer: EndpointId,
        generation: u64,
        /// The connection, and the access its peer proved in its welcome.
        result: Result<(Connection, Access)>,
    },
    /// A peer connected to us and passed the hello: pool the link if we have none to that
    /// peer (else keep it, unpooled, until unused). The answer is the link its streams are
    /// served under, or `None` when it was refused: the pool is full of links in use, and
    /// the connection is closed with `TooManyConnections` before anything is served on it.
    Adopt {
        conn: Connection,
        reply: RpcReplyPort<Option<Link>>,
    },
}

pub(crate) struct NodeState {
    ctx: Arc<NodeCtx>,
    book: PoolBook<Waiter, Link>,
    /// Ready links by actor id, to match a stopped child with its pool slot.
    children: std::collections::HashMap<ractor::ActorId, (EndpointId, u64, Arc<LinkShared>)>,
}

/// The per-process actor owning the connection pool.
pub(crate) struct NodeActor;

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = Arc<NodeCtx>;

    async fn pre_start(
        &self,
        _myself: ActorRef<NodeMsg>,
        ctx: Arc<NodeCtx>,
    ) -> Result<NodeState, ActorProcessingErr> {
        let book = PoolBook::new(ctx.config.max_links);
        Ok(NodeState {
            ctx,
            book,
            children: Default::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Acquire { peer, reply } => on_acquire(&myself, state, peer, reply),
            NodeMsg::Dialed {
                peer,
                generation,
                result,
            } => on_dialed(&myself, state, peer, generation, result).await,
            NodeMsg::Adopt { conn, reply } => {
                let peer = conn.remote_id();
                let link = insert_link(&myself, state, peer, None, conn).await;
                let _ = reply.send(link);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<NodeMsg>,
        event: SupervisionEvent,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let cell = match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => cell,
            SupervisionEvent::ActorFailed(cell, err) => {
                warn!(%err, "peer actor failed");
                cell
            }
            _ => return Ok(()),
        };
        if let Some((peer, generation, link)) = state.children.remove(&cell.get_id()) {
            state.ctx.ready.remove(&peer, &link);
            state.book.link_gone(&peer, generation);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<NodeMsg>,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        state.ctx.ready.clear();
        let (links, waiters) = state.book.drain();
        for link in links {
            let _ = link.actor.cast(PeerMsg::Close(CloseCode::Shutdown));
        }
        for waiter in waiters {
            let _ = waiter.send(Err(Error::Shutdown));
        }
        // Superseded links are children outside the book: they close as they stop.
        myself.stop_children(Some("node shut down".into()));
        Ok(())
    }
}

fn on_acquire(myself: &ActorRef<NodeMsg>, state: &mut NodeState, peer: PeerAddr, reply: Waiter) {
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
    myself: &ActorRef<NodeMsg>,
    state: &NodeState,
    peer: &PeerAddr,
    acquired: Acquire<Waiter, Link>,
) -> Option<Waiter> {
    let ctx = &state.ctx;
    match acquired {
        Acquire::Reuse { waiter, handle, .. } => match handle.guard() {
            Some(guard) => {
                ctx.metrics.pool_reuses.inc();
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
                max: Some(ctx.config.max_links),
            }));
        }
        Acquire::Queued => {}
        Acquire::Dial { generation } => {
            ctx.metrics.pool_dials.inc();
            spawn_dial(myself.clone(), ctx, peer.clone(), generation);
        }
    }
    None
}

/// Dials in a task, with the connect timeout, and casts the result back.
fn spawn_dial(myself: ActorRef<NodeMsg>, ctx: &Arc<NodeCtx>, peer: PeerAddr, generation: u64) {
    let endpoint = ctx.endpoint.clone();
    let timeout = ctx.config.connect_timeout;
    let cancel = ctx.cancel.clone();
    let key = ctx.config.cluster_key.clone();
    let max_streams = ctx.config.max_concurrent_streams;
    let dial_ctx = ctx.clone();
    ctx.tracker.spawn(async move {
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
        // The link's first request, bounded like any request (a silent peer costs the
        // request timeout here, then its requests time out over QUIC).
        let dial = async {
            let (conn, access) = match tokio::time::timeout(timeout, dial).await {
                Ok(dialed) => dialed?,
                Err(_) => {
                    let why = format!("no connection within {timeout:?}");
                    return Err(unreachable(&peer, why));
                }
            };
            let limit = dial_ctx.config.request_timeout;
            let exchange = channel_exchange(&dial_ctx, &conn, access);
            if tokio::time::timeout(limit, exchange).await.is_err() {
                debug!(peer = %peer.id.fmt_short(), "no channel offers in time: QUIC only");
                dial_ctx.channels.forget(&peer.id);
            }
            Ok((conn, access))
        };
        let result = tokio::select! {
            _ = cancel.cancelled() => Err(Error::Shutdown),
            r = dial => r,
        };
        let sent = myself.cast(NodeMsg::Dialed {
            peer: peer.id,
            generation,
            result,
        });
        // If the node is gone, close what we opened.
        if let Err(ractor::MessagingErr::SendErr(NodeMsg::Dialed {
            result: Ok((c, _)), ..
        })) = sent
        {
            peer::close(&c, CloseCode::Shutdown);
        }
    });
}

/// Tells the peer of a new link the channels this node runs and learns its own (the first
/// request on the link). A peer that does not answer usefully keeps to QUIC: the exchange
/// never fails the dial.
async fn channel_exchange(ctx: &NodeCtx, conn: &Connection, access: Access) {
    let peer = conn.remote_id();
    let offers = ctx.channels.offers_for(peer, access);
    let exchange = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let request = DataRequest::Channels { offers };
        wire::write_frame(&mut send, &request)
            .await
            .map_err(|e| e.to_string())?;
        let _ = send.finish();
        match wire::read_frame::<DataResponse>(&mut recv).await {
            Ok(DataResponse::Channels { offers }) => {
                tb_proto::channel::validate_offers(&offers).map_err(|e| e.to_string())?;
                Ok(offers)
            }
            Ok(other) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(format!("{e:?}")),
        }
    };
    match exchange.await {
        Ok(offers) => ctx.channels.learn(peer, access, offers),
        Err(reason) => {
            debug!(peer = %peer.fmt_short(), %reason, "no channel offers: QUIC only");
            ctx.channels.forget(&peer);
        }
    }
}

fn unreachable(peer: &PeerAddr, reason: String) -> Error {
    Error::PeerUnreachable {
        peer: format!("{}@{}", peer.id.fmt_short(), peer.addr),
        reason,
    }
}

async fn on_dialed(
    myself: &ActorRef<NodeMsg>,
    state: &mut NodeState,
    peer: EndpointId,
    generation: u64,
    result: Result<(Connection, Access)>,
) {
    let (conn, access) = match result {
        Ok(dialed) => dialed,
        Err(err) => {
            state.ctx.metrics.pool_connect_failures.inc();
            for waiter in state.book.dial_failed(&peer, generation) {
                let _ = waiter.send(Err(err.clone()));
            }
            return;
        }
    };
    // Pooled or superseded, the peer may open streams on this link too: serve them, as far
    // as the access it proved in its welcome allows.
    if let Some(link) = insert_link(myself, state, peer, Some(generation), conn).await {
        serve::spawn_serve(&state.ctx, link, access);
    }
}

/// Puts a connection (a finished dial of `generation`, or an inbound one when `None`) under a
/// new `PeerActor`: pooled, or superseded (the peer has a usable link already; kept unpooled
/// until unused), and answers whoever waited for it. Returns the link to serve the peer's
/// streams under, or `None` when the connection was refused (a pool full of links in use) or
/// could not be set up — closed before anything was served on it.
async fn insert_link(
    myself: &ActorRef<NodeMsg>,
    state: &mut NodeState,
    peer: EndpointId,
    generation: Option<u64>,
    conn: Connection,
) -> Option<Link> {
    let shared = Arc::new(LinkShared::new(Instant::now()));
    let args = PeerArgs {
        peer,
        conn: conn.clone(),
        link: shared.clone(),
        idle_timeout: state.ctx.config.idle_timeout,
        metrics: state.ctx.metrics.clone(),
    };
    let actor = match Actor::spawn_linked(None, PeerActor, args, myself.get_cell()).await {
        Ok((actor, _)) => actor,
        Err(e) => {
            let err = Error::Io(format!("starting the link actor: {e}"));
            if let Some(g) = generation {
                for waiter in state.book.dial_failed(&peer, g) {
                    let _ = waiter.send(Err(err.clone()));
                }
            }
            peer::close(&conn, CloseCode::Normal);
            return None;
        }
    };
    let link = Link {
        conn,
        shared,
        actor,
    };
    // A dial nobody waits for any more (its slot was dropped) is offered to the pool like an
    // inbound link; only one that a usable link supersedes is kept unpooled.
    let generation = generation
        .filter(|&g| state.book.is_current_dial(&peer, g) || !state.book.wants_inbound(&peer));
    match state
        .book
        .insert_ready(peer, generation, link.clone(), link.shared.clone())
    {
        Insert::Inserted { waiters, evicted } => {
            if let Some(g) = state.book.ready_generation(&peer) {
                let entry = (peer, g, link.shared.clone());
                state.children.insert(link.actor.get_id(), entry);
            }
            state.ctx.ready.insert(peer, &link);
            if let Some((old_peer, old)) = evicted {
                debug!(peer = %old_peer.fmt_short(), "evicting least recently used idle link");
                state.ctx.metrics.pool_evictions_lru.inc();
                let _ = old.actor.cast(PeerMsg::Close(CloseCode::LruEvicted));
            }
            for waiter in waiters {
                let _ = waiter.send(guard(&link, peer));
            }
            Some(link)
        }
        Insert::Full { waiters } => {
            let max = state.ctx.config.max_links;
            debug!(peer = %peer.fmt_short(), max, "pool full of links in use: refusing a link");
            let _ = link
                .actor
                .cast(PeerMsg::Close(CloseCode::TooManyConnections));
            for waiter in waiters {
                let _ = waiter.send(Err(Error::TooManyConnections {
                    peer: None,
                    max: Some(max),
                }));
            }
            None
        }
        // Superseded: kept, unpooled, while the peer uses it; its actor closes it once idle.
        Insert::Stale => Some(link),
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
