//! The table of request services: what answers each kind of request on the pooled data link.
//!
//! Every stream a peer opens on a `tb/data/1` link starts with one [`DataRequest`]. The
//! serving loop (`serve_stream`) does only what every stream needs: read that frame within
//! the request timeout, admit it once (the peer's access allows it, it is valid within this
//! node's limits), and hand it to the [`Service`] registered for its [`RequestKind`]. A kind
//! nobody registered is answered [`ErrorCode::Unsupported`].
//!
//! The built-ins (pull, push, the channel exchange, TCP pulls, pieces, watches, CUDA IPC)
//! register in the table like any other service, at node start. A crate above tb-node adds a
//! kind with [`Node::add_service`](crate::Node::add_service): its messages are defined in
//! tb-proto (so the wire stays one sans-IO crate with golden bytes), its code lives in the
//! crate.
//!
//! The same-host shm channel is not a link: its socket answers pulls, pushes and watches
//! itself (`channel::shm::serve`), through the same admission and store look-ups.

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::{Arc, RwLock},
    time::Duration,
};

use iroh::{
    EndpointId,
    endpoint::{RecvStream, SendStream},
};
use tb_proto::{Access, DataRequest, DataResponse, ErrorCode, RequestKind};

use super::{pull, push, reply_error, upload};
use crate::{RequestRecv, RequestSend, channel, ctx::NodeCtx, error::Error, wire};

/// The future a [`Service`] answers one stream with.
pub type ServiceFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// What answers one kind of request on the pooled data link.
///
/// `serve` runs on a task of its own per stream, under a guard that keeps the link in use
/// until the answer is delivered; it is cancelled when the node shuts down. It writes its
/// answer frames (`DataResponse`) on `stream.send` and finishes it, or answers one
/// `DataResponse::Error`.
pub trait Service: Send + Sync + 'static {
    /// Answers one admitted request.
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a>;

    /// Answers one admitted request that came on the pair's same-host socket instead of the
    /// link ([`Node::open_request`](crate::Node::open_request) takes it when the pair runs
    /// shm): the future, as [`serve`](Self::serve)'s, or the stream handed back when this
    /// service answers on links only (the default), in which case the peer is told
    /// `Unsupported` there and sends the request on the link instead.
    fn serve_local<'a>(
        &'a self,
        node: &'a ServeCtx,
        stream: LocalStream,
    ) -> Result<ServiceFuture<'a>, Box<LocalStream>> {
        let _ = node;
        Err(Box::new(stream))
    }
}

/// One admitted request on a same-host connection, as [`Service::serve_local`] gets it: the
/// same frames and bytes as on a QUIC stream, on [`RequestSend`] and [`RequestRecv`] (the
/// connection goes back to serving the peer's next request once both directions ended, and
/// closes otherwise).
#[derive(Debug)]
pub struct LocalStream {
    /// The request: the peer's access allows it and it passed `DataRequest::validate`
    /// within this node's size limit.
    pub request: DataRequest,
    /// The peer whose connection it came on (admitted by its token and user).
    pub peer: EndpointId,
    /// What the peer proved on its link.
    pub access: Access,
    /// Where the answer goes.
    pub send: RequestSend,
    /// The rest of what the peer sends.
    pub recv: RequestRecv,
}

/// One admitted request and its stream, as a [`Service`] gets it.
#[derive(Debug)]
pub struct ServiceStream {
    /// The request: the peer's access allows it and it passed `DataRequest::validate`
    /// within this node's size limit.
    pub request: DataRequest,
    /// The peer that opened the stream (authenticated by the link's hello).
    pub peer: EndpointId,
    /// What the peer proved at the hello.
    pub access: Access,
    /// Where the answer goes.
    pub send: SendStream,
    /// The rest of what the peer sends (a push's payload, the end of a watch).
    pub recv: RecvStream,
    /// The link the stream came on (what the peer offered is learnt per link).
    link: u64,
}

/// The serving node, as a [`Service`] sees it: its id, its limits and its shutdown. Opaque
/// outside tb-node; built-ins reach the node's internals through it.
#[derive(Debug, Clone)]
pub struct ServeCtx {
    pub(crate) ctx: Arc<NodeCtx>,
}

impl ServeCtx {
    pub(crate) fn new(ctx: Arc<NodeCtx>) -> Self {
        ServeCtx { ctx }
    }

    /// The serving node's id.
    pub fn node_id(&self) -> EndpointId {
        self.ctx.endpoint.id()
    }

    /// How long a write may wait for the peer to make room before the stream is given up.
    pub fn stall_timeout(&self) -> Duration {
        self.ctx.config.stall_timeout
    }

    /// The largest tensor this node takes (what a service bounds what it reads by).
    pub fn max_tensor_bytes(&self) -> u64 {
        self.ctx.config.max_tensor_bytes
    }

    /// How long a request may wait for its first answer (and a read for its next frame).
    pub fn request_timeout(&self) -> Duration {
        self.ctx.config.request_timeout
    }

    /// Whether the node is shutting down (a service stops taking new work).
    pub fn is_stopping(&self) -> bool {
        self.ctx.cancel.is_cancelled()
    }

    /// Completes when the node starts shutting down.
    pub async fn stopping(&self) {
        self.ctx.cancel.cancelled().await
    }
}

/// The node's table: one service per request kind.
pub(crate) struct Services {
    table: RwLock<HashMap<RequestKind, Arc<dyn Service>>>,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut kinds: Vec<_> = self.read().keys().copied().collect();
        kinds.sort();
        f.debug_struct("Services").field("kinds", &kinds).finish()
    }
}

impl Services {
    /// The table every node starts with: the built-ins, one per kind tb-node serves.
    pub(crate) fn builtin() -> Self {
        let services = Services {
            table: RwLock::new(HashMap::new()),
        };
        let builtins: [(RequestKind, Arc<dyn Service>); 7] = [
            (RequestKind::Pull, Arc::new(Pull)),
            (RequestKind::Push, Arc::new(Push)),
            (RequestKind::Channels, Arc::new(Channels)),
            (RequestKind::TcpPull, Arc::new(TcpPull)),
            (RequestKind::Pieces, Arc::new(Pieces)),
            (RequestKind::Watch, Arc::new(Watch)),
            (RequestKind::CudaIpc, channel::cuda_ipc_service()),
        ];
        for (kind, service) in builtins {
            // An empty table takes each kind once.
            let _ = services.add(kind, service);
        }
        services
    }

    /// Registers `service` for `kind`; a kind served already is refused (`Error::InUse`):
    /// take the old one out with [`Services::remove`] first.
    pub(crate) fn add(&self, kind: RequestKind, service: Arc<dyn Service>) -> Result<(), Error> {
        let mut table = self.table.write().unwrap_or_else(|e| e.into_inner());
        if table.contains_key(&kind) {
            return Err(Error::InUse(format!("{kind} requests are served already")));
        }
        table.insert(kind, service);
        Ok(())
    }

    /// Takes the service for `kind` out: later requests of that kind are answered
    /// `Unsupported` (streams being served finish).
    pub(crate) fn remove(&self, kind: RequestKind) -> Option<Arc<dyn Service>> {
        let mut table = self.table.write().unwrap_or_else(|e| e.into_inner());
        table.remove(&kind)
    }

    /// The service for `kind`, if any.
    pub(crate) fn get(&self, kind: RequestKind) -> Option<Arc<dyn Service>> {
        self.read().get(&kind).cloned()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<RequestKind, Arc<dyn Service>>> {
        self.table.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// Hands an admitted request to the service for its kind, or answers `Unsupported`.
pub(super) async fn dispatch(
    node: &ServeCtx,
    link: u64,
    peer: EndpointId,
    access: Access,
    request: DataRequest,
    (mut send, recv): (SendStream, RecvStream),
) {
    let kind = request.kind();
    let Some(service) = node.ctx.services.get(kind) else {
        let message = format!("this node serves no {kind} requests");
        let _ = reply_error(
            &mut send,
            node.stall_timeout(),
            ErrorCode::Unsupported,
            message,
        )
        .await;
        return;
    };
    let stream = ServiceStream {
        request,
        peer,
        access,
        send,
        recv,
        link,
    };
    service.serve(node, stream).await;
}

/// A built-in handed a request of another kind: the table is keyed by kind, so this is a
/// bug; the peer is told so rather than left waiting.
pub(crate) async fn mismatched(
    node: &ServeCtx,
    send: &mut SendStream,
    got: RequestKind,
    served: RequestKind,
) {
    let message = format!("a {got} request was given to the {served} service");
    let _ = reply_error(send, node.stall_timeout(), ErrorCode::Internal, message).await;
}

/// A version's bytes from the store, or cut-through from a version arriving.
struct Pull;

impl Service for Pull {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let (got, mut send) = (stream.request.kind(), stream.send);
            let DataRequest::Pull {
                name,
                version,
                range,
            } = stream.request
            else {
                return mismatched(node, &mut send, got, RequestKind::Pull).await;
            };
            pull::serve_pull(&node.ctx, &stream.peer, send, &name, version, range).await
        })
    }
}

/// A peer's tensor into this node's inbox.
struct Push;

impl Service for Push {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let (got, mut send) = (stream.request.kind(), stream.send);
            let DataRequest::Push { name, meta } = stream.request else {
                return mismatched(node, &mut send, got, RequestKind::Push).await;
            };
            push::serve_push(&node.ctx, stream.peer, send, stream.recv, name, meta).await
        })
    }
}

/// The channel exchange: learn what the peer offers on this link, answer with ours.
struct Channels;

impl Service for Channels {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let (got, mut send) = (stream.request.kind(), stream.send);
            let DataRequest::Channels { offers } = stream.request else {
                return mismatched(node, &mut send, got, RequestKind::Channels).await;
            };
            let (ctx, peer, access) = (&node.ctx, stream.peer, stream.access);
            ctx.channels.learn(peer, stream.link, access, offers);
            let offers = ctx.channels.offers_for(peer, access);
            let answer = DataResponse::Channels { offers };
            let _ = wire::write_frame_within(&mut send, &answer, node.stall_timeout()).await;
            let _ = send.finish();
        })
    }
}

/// A pull over the TCP channel: a ticket for the sockets, or (channel off) the bytes on this
/// stream as a plain pull.
struct TcpPull;

impl Service for TcpPull {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let (got, mut send) = (stream.request.kind(), stream.send);
            let DataRequest::TcpPull {
                name,
                version,
                sockets,
            } = stream.request
            else {
                return mismatched(node, &mut send, got, RequestKind::TcpPull).await;
            };
            let ctx = &node.ctx;
            let peer = &stream.peer;
            let ticket = channel::serve_ticket(ctx, peer, send, &name, version, sockets);
            if let Err(send) = ticket.await {
                pull::serve_pull(ctx, peer, send, &name, version, None).await;
            }
        })
    }
}

/// A version's outline and the pieces this node can serve of it.
struct Pieces;

impl Service for Pieces {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let (got, mut send) = (stream.request.kind(), stream.send);
            let DataRequest::Pieces { name, version } = stream.request else {
                return mismatched(node, &mut send, got, RequestKind::Pieces).await;
            };
            upload::serve_outline(&node.ctx, &stream.peer, send, &name, version).await
        })
    }
}

/// A subscriber's watch on a name this node publishes (small versions in one hop).
struct Watch;

impl Service for Watch {
    fn serve<'a>(&'a self, node: &'a ServeCtx, stream: ServiceStream) -> ServiceFuture<'a> {
        Box::pin(async move {
            let (got, mut send) = (stream.request.kind(), stream.send);
            let DataRequest::Watch { name } = stream.request else {
                return mismatched(node, &mut send, got, RequestKind::Watch).await;
            };
            crate::watch::serve(&node.ctx, send, stream.recv, name).await
        })
    }
}
