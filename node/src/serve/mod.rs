//! The serving side of `tb/data/1`: accept streams on a link and answer each on its own task,
//! through the node's table of request services ([`service`]).
//!
//! - `mod.rs` (this file): the protocol handler, the per-link accept loop and what every
//!   stream needs (read its first frame within the request timeout, admit it, dispatch it);
//! - [`service`]: the table, the [`Service`] trait and the built-ins registered in it;
//! - [`pull`] and [`push`]: the two transfers (the shm and TCP channels share their look-up
//!   and budget checks);
//! - [`upload`]: sending under the upload limit, cut-through from a version arriving, and
//!   outlines for pullers in pieces.
//!
//! A malformed or oversize request gets an `Error` frame and ends that stream only; the
//! connection keeps serving others. So does a request the peer's access (proved at the hello)
//! does not allow: a push needs read-write access, and a node with only the read-only
//! credential takes none.

mod pull;
mod push;
pub(crate) mod service;
pub(crate) mod upload;

use std::{sync::Arc, time::Duration};

use iroh::{
    endpoint::{Connection, RecvStream, SendStream, VarInt},
    protocol::{AcceptError, ProtocolHandler},
};
use tb_link::{Link, Pool, auth};
use tb_proto::{Access, CloseCode, DATA_ALPN, DataRequest, DataResponse, ErrorCode, FrameError};
use tracing::{Instrument, debug, debug_span};

pub(crate) use self::{
    pull::{NotHeld, byte_range, lookup, lookup_host},
    push::reserve_push,
    service::{ServeCtx, Services},
};
use crate::{
    ctx::NodeCtx,
    error::Error,
    wire::{self, ReadFrameError},
};

/// The `tb/data/1` protocol handler on the node's iroh `Router`.
#[derive(Debug, Clone)]
pub(crate) struct DataProtocol {
    pub(crate) ctx: Arc<NodeCtx>,
    pub(crate) pool: Pool,
}

impl ProtocolHandler for DataProtocol {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        let ctx = &self.ctx;
        let hello = auth::server_hello(
            &conn,
            ctx.endpoint.id(),
            &ctx.config.cluster_key,
            DATA_ALPN,
            &ctx.admission,
            ctx.config.max_tensor_bytes,
            |reason| ctx.metrics.auth_failures.inc(reason),
        );
        let access = match hello.await {
            Ok(access) => access,
            Err(err) => {
                debug!(%err, "hello failed");
                return Ok(());
            }
        };
        // Pool the inbound link (if we have none to this peer) so replies to it reuse it; a
        // pool full of links in use refuses it (closed with `TooManyConnections`) before any
        // request on it is read.
        if let Some(link) = self.pool.adopt(conn).await {
            serve_connection(self.ctx.clone(), link, access).await;
        }
        Ok(())
    }
}

/// Serves the streams a peer opens on a connection we dialed; `access` is what the peer
/// proved in its welcome.
pub(crate) fn spawn_serve(ctx: &Arc<NodeCtx>, link: Link, access: Access) {
    ctx.tracker
        .spawn(serve_connection(ctx.clone(), link, access));
}

/// How long a stream accepted on a link that is closing is held for the close to land, so
/// its peer reads the close code (idle: redial) rather than an empty answer.
const CLOSING_WAIT: Duration = Duration::from_secs(1);

/// Serves the streams the peer opens on `link`, each as far as the peer's `access` allows.
/// Each stream whose request arrived holds a guard on the link while it is served, so the
/// link counts as in use (never idle- or LRU-closed) while the peer has a request open on
/// it, as it does while we have one. A stream that sends no request holds nothing: a peer
/// cannot keep a link (and its pool slot) in use with streams it leaves silent.
async fn serve_connection(ctx: Arc<NodeCtx>, link: Link, access: Access) {
    let peer = link.connection().remote_id();
    loop {
        let accepted = tokio::select! {
            _ = ctx.cancel.cancelled() => break,
            accepted = link.connection().accept_bi() => accepted,
        };
        let Ok((send, recv)) = accepted else { break };
        if !link.is_usable() {
            // Closing (idle, evicted, shut down), which it does only with no stream open: this
            // one is not served. It dies with the connection, whose close code tells the peer.
            let _ = tokio::time::timeout(CLOSING_WAIT, link.connection().closed()).await;
            drop((send, recv));
            break;
        }
        let span = debug_span!(
            "serve",
            me = %ctx.endpoint.id().fmt_short(),
            peer = %peer.fmt_short(),
            tensor = tracing::field::Empty,
        );
        let node = ServeCtx::new(ctx.clone());
        let task_link = link.clone();
        ctx.tracker.spawn(
            async move {
                tokio::select! {
                    () = node.stopping() => {}
                    () = serve_stream(&node, &task_link, access, send, recv) => {}
                }
            }
            .instrument(span),
        );
    }
}

/// Serves one stream: reads its request, then answers it under a guard on the link, held
/// until the peer has received the whole answer (within the stall timeout).
async fn serve_stream(
    node: &ServeCtx,
    link: &Link,
    access: Access,
    mut send: SendStream,
    mut recv: RecvStream,
) {
    let ctx = &node.ctx;
    let Some(request) = read_request(ctx, access, &mut send, &mut recv).await else {
        return;
    };
    if let Some(name) = request.name() {
        tracing::Span::current().record("tensor", name.as_str());
    }
    let Some(guard) = link.guard() else {
        // The link closed while the request arrived (closes happen only with no stream
        // held): not served; the close code tells the peer to send it again elsewhere.
        let _ = tokio::time::timeout(CLOSING_WAIT, link.connection().closed()).await;
        return;
    };
    let received = send.stopped();
    let peer = link.connection().remote_id();
    service::dispatch(node, link.id(), peer, access, request, (send, recv)).await;
    let _ = tokio::time::timeout(ctx.config.stall_timeout, received).await;
    drop(guard);
}

/// Reads a stream's request within the request timeout and admits it; a request that does
/// not come, is malformed or too large, or is not allowed is refused here (`None`).
async fn read_request(
    ctx: &NodeCtx,
    access: Access,
    send: &mut SendStream,
    recv: &mut RecvStream,
) -> Option<DataRequest> {
    let stall = ctx.config.stall_timeout;
    let request = tokio::time::timeout(
        ctx.config.request_timeout,
        wire::read_frame_within::<DataRequest>(recv, tb_proto::MAX_DATA_REQUEST_FRAME),
    )
    .await;
    let request = match request {
        Ok(Ok(request)) => request,
        Ok(Err(ReadFrameError::Invalid(err))) => {
            let code = match err {
                FrameError::TooLarge { .. } => ErrorCode::TooLarge,
                _ => ErrorCode::Malformed,
            };
            debug!(%err, "refusing a bad request frame");
            refuse(send, recv, stall, code, err.to_string()).await;
            return None;
        }
        Ok(Err(ReadFrameError::Closed(reason))) => {
            debug!(%reason, "stream closed before a request");
            return None;
        }
        Err(_) => {
            let msg = format!("no request within {:?}", ctx.config.request_timeout);
            refuse(send, recv, stall, ErrorCode::Malformed, msg).await;
            return None;
        }
    };
    if let Err((code, message)) = admit_request(ctx, access, &request) {
        debug!(%message, "refusing a request");
        refuse(send, recv, stall, code, message).await;
        return None;
    }
    Some(request)
}

/// Answers with an `Error` frame and stops reading the rest of the stream.
async fn refuse(
    send: &mut SendStream,
    recv: &mut RecvStream,
    stall: Duration,
    code: ErrorCode,
    message: String,
) {
    let _ = recv.stop(VarInt::from_u32(CloseCode::ProtocolError.code()));
    let answer = DataResponse::Error { code, message };
    let _ = wire::write_frame_within(send, &answer, stall).await;
    let _ = send.finish();
}

pub(crate) async fn reply_error(
    send: &mut SendStream,
    stall: Duration,
    code: ErrorCode,
    message: String,
) -> Result<(), Error> {
    wire::write_frame_within(send, &DataResponse::Error { code, message }, stall).await?;
    send.finish().map_err(|e| Error::io("finishing stream", e))
}

/// Admits one request from a peer that proved `access`, for every server path (QUIC and
/// shm): its access must allow what it asks (this node's own access bounds what it can do),
/// and what it names must be valid within this node's limits. `Err`: the refusal to answer.
pub(crate) fn admit_request(
    ctx: &NodeCtx,
    access: Access,
    request: &DataRequest,
) -> Result<(), (ErrorCode, String)> {
    let mine = ctx.config.cluster_key.access();
    tb_proto::authorize(mine, access, request.write_action())
        .map_err(|e| (ErrorCode::Unauthorized, e.to_string()))?;
    request.validate(ctx.config.max_tensor_bytes).map_err(|e| {
        let code = match e {
            tb_proto::MetaError::TooLarge { .. } => ErrorCode::TooLarge,
            _ => ErrorCode::InvalidTensor,
        };
        (code, e.to_string())
    })
}
