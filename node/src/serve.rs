//! The serving side of `tb/data/1`: accept streams on a connection and answer each
//! `Pull` (header + payload from the store) or `Push` (payload into the inbox) on its own task.
//!
//! A malformed or oversize request gets an `Error` frame and ends that stream only; the
//! connection keeps serving others. So does a request the peer's access (proved at the hello)
//! does not allow: a push needs read-write access, and a node with only the read-only
//! credential takes none.

use std::{ops::Range, sync::Arc, time::Duration};

use iroh::{
    EndpointId,
    endpoint::{Connection, RecvStream, SendStream, VarInt},
    protocol::{AcceptError, ProtocolHandler},
};
use ractor::{ActorRef, rpc::CallResult};
use tb_dashboard::TransferKind;
use tb_proto::{
    Access, ByteRange, CloseCode, ContentHash, DATA_ALPN, DataRequest, DataResponse, ErrorCode,
    FrameError, TensorMeta, TensorName,
};
use tracing::{Instrument, debug, debug_span};

use crate::{
    auth,
    budget::{BudgetError, Reservation},
    channel::{self, HostBuf},
    ctx::NodeCtx,
    device::{self, Device, DeviceBuffer},
    error::Error,
    inbox::Received,
    inflight::Incoming,
    node_actor::NodeMsg,
    pool::{self, link::Link},
    store::Lookup,
    tensor::Tensor,
    upload::{self, InflightError},
    wire::{self, ReadFrameError},
};

/// The `tb/data/1` protocol handler on the node's iroh `Router`.
#[derive(Debug, Clone)]
pub(crate) struct DataProtocol {
    pub(crate) ctx: Arc<NodeCtx>,
    pub(crate) node: ActorRef<NodeMsg>,
}

impl std::fmt::Debug for NodeMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NodeMsg::Acquire { .. } => "Acquire",
            NodeMsg::Dialed { .. } => "Dialed",
            NodeMsg::Adopt { .. } => "Adopt",
        })
    }
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
        let bound = ctx.config.connect_timeout;
        let adopt = |reply| NodeMsg::Adopt {
            conn: conn.clone(),
            reply,
        };
        match self.node.call(adopt, Some(bound)).await {
            Ok(CallResult::Success(Some(link))) => {
                serve_connection(self.ctx.clone(), link, access).await
            }
            Ok(CallResult::Success(None)) => {}
            _ => pool::peer::close(&conn, CloseCode::Shutdown),
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
    let peer = link.conn.remote_id();
    loop {
        let accepted = tokio::select! {
            _ = ctx.cancel.cancelled() => break,
            accepted = link.conn.accept_bi() => accepted,
        };
        let Ok((send, recv)) = accepted else { break };
        if !link.shared.is_usable() {
            // Closing (idle, evicted, shut down), which it does only with no stream open: this
            // one is not served. It dies with the connection, whose close code tells the peer.
            let _ = tokio::time::timeout(CLOSING_WAIT, link.conn.closed()).await;
            drop((send, recv));
            break;
        }
        let span = debug_span!(
            "serve",
            me = %ctx.endpoint.id().fmt_short(),
            peer = %peer.fmt_short(),
            tensor = tracing::field::Empty,
        );
        let task_ctx = ctx.clone();
        let task_link = link.clone();
        ctx.tracker.spawn(
            async move {
                tokio::select! {
                    _ = task_ctx.cancel.cancelled() => {}
                    () = serve_stream(&task_ctx, &task_link, access, send, recv) => {}
                }
            }
            .instrument(span),
        );
    }
}

/// Serves one stream: reads its request, then answers it under a guard on the link, held
/// until the peer has received the whole answer (within the stall timeout).
async fn serve_stream(
    ctx: &NodeCtx,
    link: &Link,
    access: Access,
    mut send: SendStream,
    mut recv: RecvStream,
) {
    let Some(request) = read_request(ctx, access, &mut send, &mut recv).await else {
        return;
    };
    let Some(guard) = link.guard() else {
        // The link closed while the request arrived (closes happen only with no stream
        // held): not served; the close code tells the peer to send it again elsewhere.
        let _ = tokio::time::timeout(CLOSING_WAIT, link.conn.closed()).await;
        return;
    };
    let received = send.stopped();
    answer(ctx, link, access, request, send, recv).await;
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

/// Answers an admitted request.
async fn answer(
    ctx: &NodeCtx,
    link: &Link,
    access: Access,
    request: DataRequest,
    mut send: SendStream,
    recv: RecvStream,
) {
    let peer = link.conn.remote_id();
    if let Some(name) = request.name() {
        tracing::Span::current().record("tensor", name.as_str());
    }
    match request {
        DataRequest::Pull {
            name,
            version,
            range,
        } => serve_pull(ctx, send, &name, version, range).await,
        DataRequest::Push { name, meta } => serve_push(ctx, peer, send, recv, name, meta).await,
        DataRequest::TcpPull {
            name,
            version,
            sockets,
        } => {
            if let Err(send) = channel::serve_ticket(ctx, send, &name, version, sockets).await {
                serve_pull(ctx, send, &name, version, None).await;
            }
        }
        DataRequest::Pieces { name, version } => {
            upload::serve_outline(ctx, send, &name, version).await;
        }
        DataRequest::Watch { name } => crate::watch::serve(ctx, send, recv, name).await,
        DataRequest::Channels { offers } => {
            ctx.channels.learn(peer, link.id, access, offers);
            let offers = ctx.channels.offers_for(peer, access);
            let answer = DataResponse::Channels { offers };
            let _ = wire::write_frame_within(&mut send, &answer, ctx.config.stall_timeout).await;
            let _ = send.finish();
        }
    }
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

async fn serve_pull(
    ctx: &NodeCtx,
    mut send: SendStream,
    name: &TensorName,
    version: Option<u64>,
    range: Option<ByteRange>,
) {
    let (version, tensor) = match lookup(ctx, name, version) {
        Ok(found) => found,
        // A version not held (yet) may be arriving: served as it does (cut-through).
        Err(NotHeld::Arriving(v, incoming)) => {
            serve_pull_inflight(ctx, send, name, v, range, incoming).await;
            return;
        }
        Err(NotHeld::Refused(code, what)) => {
            let _ = reply_error(&mut send, ctx.config.stall_timeout, code, what).await;
            return;
        }
    };
    let Some(payload) = byte_range(tensor.byte_len(), range) else {
        let msg = format!("range {range:?} is outside the {} bytes", tensor.byte_len());
        let _ = reply_error(
            &mut send,
            ctx.config.stall_timeout,
            ErrorCode::InvalidTensor,
            msg,
        )
        .await;
        return;
    };
    let timer = ctx.metrics.start_transfer(TransferKind::Serve);
    let header = DataResponse::Header {
        meta: tensor.meta().clone(),
        version,
    };
    let sent = async {
        match (&ctx.upload, tensor.device_buffer()) {
            // Under an upload limit, host bytes go out chunk by chunk as the bucket allows.
            (Some(_), None) => {
                wire::write_frame_within(&mut send, &header, ctx.config.stall_timeout).await?;
                let data = tensor.data().slice(payload);
                let mut watchdog = ctx.quic_watchdog(tb_dashboard::Direction::Out);
                let total = data.len();
                upload::send_limited(ctx, &mut send, &data, &mut watchdog, 0, total).await?;
            }
            // Device tensors are not paced (their staging pipeline sends as fast as it can).
            _ => {
                let (config, meter) = (&ctx.config, ctx.quic_meter(tb_dashboard::Direction::Out));
                let write = device::write_header_and_tensor;
                write(&mut send, &header, &tensor, payload, config, meter, None).await?
            }
        }
        send.finish().map_err(|e| Error::io("finishing stream", e))
    };
    match sent.await {
        Ok(()) => {
            ctx.metrics.channels.finished(tb_proto::ChannelKind::Quic);
            timer.ok();
        }
        Err(_) if channel::quic::stopped_for_stripe(&mut send).await => timer.ok(),
        Err(err) => {
            timer.error();
            debug!(%err, %name, "pull not served");
        }
    }
}

/// Why a pull cannot be answered from the store.
pub(crate) enum NotHeld {
    /// The version is still arriving (serve it cut-through).
    Arriving(u64, Arc<Incoming>),
    /// Not here: the error to answer.
    Refused(ErrorCode, String),
}

/// The version of `name` a pull asks for (the newest unless `version`), from the store.
pub(crate) fn lookup(
    ctx: &NodeCtx,
    name: &TensorName,
    version: Option<u64>,
) -> Result<(u64, Tensor), NotHeld> {
    let found = ctx.store.get(name, version);
    if let (Lookup::Missing, Some(v)) = (&found, version)
        && let Some(incoming) = ctx.inflight.get(name, v)
    {
        return Err(NotHeld::Arriving(v, incoming));
    }
    match found {
        Lookup::Found(v, t) => Ok((v, t)),
        Lookup::Missing => {
            let what = match version {
                Some(v) => format!("tensor \"{name}\" v{v}"),
                None => format!("tensor \"{name}\""),
            };
            Err(NotHeld::Refused(ErrorCode::NotFound, what))
        }
        Lookup::Evicted { oldest } => {
            let what = format!(
                "tensor \"{name}\" v{} was evicted (oldest held: v{oldest})",
                version.unwrap_or(0)
            );
            Err(NotHeld::Refused(ErrorCode::NotFound, what))
        }
    }
}

/// Serves a pull of a version this node is still receiving (cut-through).
async fn serve_pull_inflight(
    ctx: &NodeCtx,
    mut send: SendStream,
    name: &TensorName,
    version: u64,
    range: Option<ByteRange>,
    incoming: Arc<Incoming>,
) {
    let timer = ctx.metrics.start_transfer(TransferKind::Serve);
    match upload::serve_inflight(ctx, &mut send, name, version, range, incoming).await {
        Ok(_) => {
            ctx.metrics.channels.finished(tb_proto::ChannelKind::Quic);
            timer.ok();
        }
        Err(InflightError::Refused(code, message)) => {
            // Nothing was sent: not a transfer.
            timer.discard();
            let _ = reply_error(&mut send, ctx.config.stall_timeout, code, message).await;
        }
        // Like a striped pull's stream: a puller that moved on had no complaint.
        Err(InflightError::Left) => timer.ok(),
        Err(InflightError::Aborted(err)) => {
            timer.error();
            debug!(%err, %name, version, "pull of a version in flight not served");
        }
    }
}

/// The payload bytes a pull asked for: all of them, or `range` if it lies inside.
pub(crate) fn byte_range(byte_len: u64, range: Option<ByteRange>) -> Option<Range<usize>> {
    let (offset, len) = match range {
        None => (0, byte_len),
        Some(ByteRange { offset, len }) => (offset, len),
    };
    let end = offset.checked_add(len)?;
    if end > byte_len {
        return None;
    }
    Some(usize::try_from(offset).ok()?..usize::try_from(end).ok()?)
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

/// Reserves a push of `bytes` against the budget of where this node places pushes
/// (`Config::push_placement`), for every server path (QUIC and shm): the bytes are reserved
/// before any is allocated and stay reserved until `recv()` takes the tensor, so a push that
/// does not fit now is refused at once, not queued (a waiting stream would hold its window
/// and its peer for nothing while the inbox may never drain). `Err`: the refusal to answer.
pub(crate) fn reserve_push(
    ctx: &NodeCtx,
    name: &TensorName,
    bytes: u64,
) -> Result<Reservation, (ErrorCode, String)> {
    let placement = ctx.config.push_placement;
    let reserved = match placement {
        Device::Host => ctx.inbox.reserve(bytes),
        Device::Cuda(_) => ctx.device_pushes.try_reserve(bytes),
    };
    reserved.map_err(|err| {
        let (code, hint) = match err {
            BudgetError::TooLarge { .. } => (ErrorCode::TooLarge, "never fits"),
            BudgetError::Busy { .. } => (ErrorCode::Busy, "retry later"),
        };
        let message =
            format!("push of \"{name}\" refused by the {placement} push budget: {err}; {hint}");
        (code, message)
    })
}

async fn serve_push(
    ctx: &NodeCtx,
    peer: EndpointId,
    mut send: SendStream,
    mut recv: RecvStream,
    name: TensorName,
    meta: TensorMeta,
) {
    // Every early return below is a failed transfer: the timer counts it so when dropped.
    let timer = ctx.metrics.start_transfer(TransferKind::Serve);
    let Ok(len) = usize::try_from(meta.byte_len) else {
        refuse(
            &mut send,
            &mut recv,
            ctx.config.stall_timeout,
            ErrorCode::TooLarge,
            "does not fit in memory".into(),
        )
        .await;
        return;
    };
    let placement = ctx.config.push_placement;
    let held = match reserve_push(ctx, &name, meta.byte_len) {
        Ok(held) => held,
        Err((code, msg)) => {
            refuse(&mut send, &mut recv, ctx.config.stall_timeout, code, msg).await;
            return;
        }
    };
    let received = match placement {
        Device::Host => recv_push_to_host(ctx, &mut recv, len).await,
        Device::Cuda(ordinal) => match DeviceBuffer::alloc(ordinal, len) {
            Ok(buf) => recv_push_to_device(ctx, &mut recv, buf).await,
            Err(err) => {
                // Out of device memory (or no device): say so before any payload is read.
                let code = match err {
                    Error::DeviceOutOfMemory(_) => ErrorCode::TooLarge,
                    _ => ErrorCode::Internal,
                };
                refuse(
                    &mut send,
                    &mut recv,
                    ctx.config.stall_timeout,
                    code,
                    format!("push of \"{name}\": {err}"),
                )
                .await;
                return;
            }
        },
    };
    let (hash, data) = match received {
        Ok(got) => got,
        Err(err) => {
            debug!(%err, %name, "push payload not received");
            return;
        }
    };
    ctx.metrics.channels.finished(tb_proto::ChannelKind::Quic);
    if hash != meta.hash {
        let msg = format!(
            "push of \"{name}\": expected hash {}, got {hash}",
            meta.hash
        );
        let _ = reply_error(&mut send, ctx.config.stall_timeout, ErrorCode::Corrupt, msg).await;
        return;
    }
    let tensor = match data {
        Pushed::Host(buf) => match buf.into_tensor(meta) {
            Ok(tensor) => tensor,
            Err(err) => {
                let msg = format!("push of \"{name}\": {err}");
                let stall = ctx.config.stall_timeout;
                let _ = reply_error(&mut send, stall, ErrorCode::Internal, msg).await;
                return;
            }
        },
        Pushed::Cuda(buf) => Tensor::from_verified_device(meta, buf),
    };
    let item = Received {
        from: peer,
        name,
        tensor,
    };
    let queued = ctx.inbox.deliver(item, held, ctx.config.request_timeout);
    let (reply, delivered) = match queued.await {
        Ok(()) => (DataResponse::Ack, true),
        Err(err) => {
            let busy = DataResponse::Error {
                code: ErrorCode::Busy,
                message: err.to_string(),
            };
            (busy, false)
        }
    };
    let stall = ctx.config.stall_timeout;
    let answered = wire::write_frame_within(&mut send, &reply, stall)
        .await
        .is_ok();
    if answered {
        let _ = send.finish();
    }
    timer.result(delivered && answered);
}

/// A pushed payload, received but not yet verified.
enum Pushed {
    Host(HostBuf),
    Cuda(DeviceBuffer),
}

async fn recv_push_to_host(
    ctx: &NodeCtx,
    recv: &mut RecvStream,
    len: usize,
) -> Result<(ContentHash, Pushed), Error> {
    let mut buf = HostBuf::new(len)?;
    let watchdog = ctx.quic_watchdog(tb_dashboard::Direction::In);
    let hash = wire::recv_payload(recv, buf.as_mut(), watchdog).await?;
    Ok((hash, Pushed::Host(buf)))
}

async fn recv_push_to_device(
    ctx: &NodeCtx,
    recv: &mut RecvStream,
    mut buf: DeviceBuffer,
) -> Result<(ContentHash, Pushed), Error> {
    let watchdog = ctx.quic_watchdog(tb_dashboard::Direction::In);
    let hash = device::recv_payload(recv, &mut buf, watchdog, &ctx.config.cuda).await?;
    Ok((hash, Pushed::Cuda(buf)))
}
