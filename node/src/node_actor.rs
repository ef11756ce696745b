//! `NodeActor`: one per process. Owns the pool — a map from peer node id to a `PeerActor` —
//! and hands out link guards.
//!
//! Its handlers never wait on a peer: dials run in spawned tasks that `cast` their result
//! back, and children report their end through supervision events. Bookkeeping is the pure
//! [`PoolBook`]; this actor is the shell that talks to sockets and actors.

use std::{sync::Arc, time::Instant};

use iroh::{EndpointId, endpoint::Connection};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tb_proto::{CloseCode, DATA_ALPN};
use tracing::{debug, warn};

use crate::{
    auth,
    ctx::NodeCtx,
    endpoint::PeerAddr,
    error::{Error, Result},
    pool::{
        LinkGuard,
        book::{Acquire, Insert, PoolBook},
        link::LinkShared,
        peer::{self, PeerActor, PeerArgs, PeerMsg},
    },
    serve,
};

type Waiter = RpcReplyPort<Result<LinkGuard>>;

/// What the pool keeps per ready link.
#[derive(Debug, Clone)]
pub(crate) struct LinkHandle {
    conn: Connection,
    actor: ActorRef<PeerMsg>,
}

/// Messages the `NodeActor` handles.
pub(crate) enum NodeMsg {
    /// A caller wants a link to `peer`.
    Acquire { peer: PeerAddr, reply: Waiter },
    /// A dial task finished.
    Dialed {
        peer: EndpointId,
        generation: u64,
        result: Result<Connection>,
    },
    /// A peer connected to us; pool the link if we have none to that peer.
    Adopt { conn: Connection },
}

pub(crate) struct NodeState {
    ctx: Arc<NodeCtx>,
    book: PoolBook<Waiter, LinkHandle>,
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
            NodeMsg::Adopt { conn } => on_adopt(&myself, state, conn).await,
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
        _myself: ActorRef<NodeMsg>,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        state.ctx.ready.clear();
        let (handles, waiters) = state.book.drain();
        for handle in handles {
            let _ = handle.actor.cast(PeerMsg::Close(CloseCode::Shutdown));
        }
        for waiter in waiters {
            let _ = waiter.send(Err(Error::Shutdown));
        }
        Ok(())
    }
}

fn on_acquire(myself: &ActorRef<NodeMsg>, state: &mut NodeState, peer: PeerAddr, reply: Waiter) {
    let ctx = &state.ctx;
    match state.book.acquire(peer.id, reply) {
        Acquire::Reuse {
            waiter,
            handle,
            link,
        } => {
            ctx.metrics.pool_reuses.inc();
            let _ = waiter.send(guard(&handle, &link, peer.id));
        }
        Acquire::Full { waiter } => {
            let _ = waiter.send(Err(Error::TooManyConnections {
                max: ctx.config.max_links,
            }));
        }
        Acquire::Queued => {}
        Acquire::Dial { generation } => {
            ctx.metrics.pool_dials.inc();
            spawn_dial(myself.clone(), ctx, peer, generation);
        }
    }
}

/// Dials in a task, with the connect timeout, and casts the result back.
fn spawn_dial(myself: ActorRef<NodeMsg>, ctx: &Arc<NodeCtx>, peer: PeerAddr, generation: u64) {
    let endpoint = ctx.endpoint.clone();
    let timeout = ctx.config.connect_timeout;
    let cancel = ctx.cancel.clone();
    let key = ctx.config.cluster_key.clone();
    let serve_ctx = ctx.clone();
    ctx.tracker.spawn(async move {
        // The connect timeout bounds the dial and the hello together: a peer that accepts but
        // never answers is as unreachable as one that never accepts.
        let dial = tokio::time::timeout(timeout, async {
            let conn = endpoint
                .connect(peer.to_endpoint_addr(), DATA_ALPN)
                .await
                .map_err(|e| unreachable(&peer, e.to_string()))?;
            let welcomed =
                auth::client_hello(&conn, endpoint.id(), &key, DATA_ALPN, timeout).await?;
            // Either way the peer may open streams on this connection: serve them, as far as
            // the access it proved in its welcome allows.
            serve::spawn_serve(&serve_ctx, conn.clone(), welcomed.peer);
            Ok(conn)
        });
        let result = tokio::select! {
            _ = cancel.cancelled() => Err(Error::Shutdown),
            r = dial => match r {
                Ok(result) => result,
                Err(_) => Err(unreachable(&peer, format!("no connection within {timeout:?}"))),
            },
        };
        let sent = myself.cast(NodeMsg::Dialed {
            peer: peer.id,
            generation,
            result,
        });
        // If the node is gone, close what we opened.
        if let Err(ractor::MessagingErr::SendErr(NodeMsg::Dialed { result: Ok(c), .. })) = sent {
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
    myself: &ActorRef<NodeMsg>,
    state: &mut NodeState,
    peer: EndpointId,
    generation: u64,
    result: Result<Connection>,
) {
    let conn = match result {
        Ok(conn) => conn,
        Err(err) => {
            state.ctx.metrics.pool_connect_failures.inc();
            for waiter in state.book.dial_failed(&peer, generation) {
                let _ = waiter.send(Err(err.clone()));
            }
            return;
        }
    };
    insert_link(myself, state, peer, Some(generation), conn).await;
}

async fn on_adopt(myself: &ActorRef<NodeMsg>, state: &mut NodeState, conn: Connection) {
    let peer = conn.remote_id();
    if state.book.wants_inbound(&peer) {
        insert_link(myself, state, peer, None, conn).await;
    }
}

/// Puts a connection in the pool under a new `PeerActor` and answers whoever waited for it.
async fn insert_link(
    myself: &ActorRef<NodeMsg>,
    state: &mut NodeState,
    peer: EndpointId,
    generation: Option<u64>,
    conn: Connection,
) {
    let current = match generation {
        Some(g) => state.book.is_current_dial(&peer, g),
        None => state.book.wants_inbound(&peer),
    };
    if !current {
        return; // superseded: the connection stays open, unpooled, while the peer uses it
    }
    let link = Arc::new(LinkShared::new(Instant::now()));
    let args = PeerArgs {
        peer,
        conn: conn.clone(),
        link: link.clone(),
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
            return;
        }
    };
    let handle = LinkHandle {
        conn,
        actor: actor.clone(),
    };
    match state
        .book
        .insert_ready(peer, generation, handle.clone(), link.clone())
    {
        Insert::Inserted { waiters, evicted } => {
            if let Some(g) = state.book.ready_generation(&peer) {
                state
                    .children
                    .insert(actor.get_id(), (peer, g, link.clone()));
            }
            state.ctx.ready.insert(peer, &handle.conn, &link, &actor);
            if let Some((old_peer, old)) = evicted {
                debug!(peer = %old_peer.fmt_short(), "evicting least recently used idle link");
                state.ctx.metrics.pool_evictions_lru.inc();
                let _ = old.actor.cast(PeerMsg::Close(CloseCode::LruEvicted));
            }
            for waiter in waiters {
                let _ = waiter.send(guard(&handle, &link, peer));
            }
        }
        Insert::Full { waiters } => {
            let _ = actor.cast(PeerMsg::Close(CloseCode::Normal));
            for waiter in waiters {
                let _ = waiter.send(Err(Error::TooManyConnections {
                    max: state.ctx.config.max_links,
                }));
            }
        }
        Insert::Stale => actor.stop(None),
    }
}

fn guard(handle: &LinkHandle, link: &Arc<LinkShared>, peer: EndpointId) -> Result<LinkGuard> {
    LinkGuard::try_new(&handle.conn, link, &handle.actor).ok_or_else(|| Error::PeerUnreachable {
        peer: peer.fmt_short().to_string(),
        reason: "link closed while being handed out".into(),
    })
}
