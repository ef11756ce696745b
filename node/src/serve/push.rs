//! The `Push` service: a peer's tensor into this node's inbox (or straight to a device with
//! `Config::push_placement`), its bytes reserved against the push budget before any is
//! allocated and verified against the pushed hash before `recv()` can take it. The shm
//! channel reserves its pushes through the same [`reserve_push`].

use iroh::{
    EndpointId,
    endpoint::{RecvStream, SendStream},
};
use tb_dashboard::TransferKind;
use tb_proto::{ContentHash, DataResponse, ErrorCode, TensorMeta, TensorName};
use tracing::debug;

use super::{refuse, reply_error};
use crate::{
    budget::{BudgetError, Reservation},
    channel::HostBuf,
    ctx::NodeCtx,
    device::{self, Device, DeviceBuffer},
    error::Error,
    inbox::Received,
    tensor::Tensor,
    wire,
};

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

/// Serves one push: reserve, receive, verify, hand to the inbox, answer `Ack` once queued
/// (or `Busy` when `recv()` did not make room in time).
pub(super) async fn serve_push(
    ctx: &NodeCtx,
    peer: EndpointId,
    mut send: SendStream,
    mut recv: RecvStream,
    name: TensorName,
    meta: TensorMeta,
) {
    // Every early return below is a failed transfer: the timer counts it so when dropped.
    let timer = ctx.metrics.start_transfer(TransferKind::Serve);
    let stall = ctx.config.stall_timeout;
    let held = match usize::try_from(meta.byte_len) {
        Err(_) => Err((ErrorCode::TooLarge, "does not fit in memory".to_string())),
        Ok(_) => reserve_push(ctx, &name, meta.byte_len),
    };
    let held = match held {
        Ok(held) => held,
        Err((code, msg)) => return refuse(&mut send, &mut recv, stall, code, msg).await,
    };
    let Some(tensor) = receive_push(ctx, &mut send, &mut recv, &name, meta).await else {
        return;
    };
    let item = Received {
        from: peer,
        name,
        tensor,
        seq: 0,
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
    let answered = wire::write_frame_within(&mut send, &reply, stall)
        .await
        .is_ok();
    if answered {
        let _ = send.finish();
    }
    timer.result(delivered && answered);
}

/// Receives a reserved push's payload where this node places pushes and verifies it; `None`
/// when it did not arrive whole or did not match its hash (the peer was told why, where a
/// stream was left to tell it on).
async fn receive_push(
    ctx: &NodeCtx,
    send: &mut SendStream,
    recv: &mut RecvStream,
    name: &TensorName,
    meta: TensorMeta,
) -> Option<Tensor> {
    let stall = ctx.config.stall_timeout;
    // Checked by the caller before reserving.
    let len = usize::try_from(meta.byte_len).ok()?;
    let received = match ctx.config.push_placement {
        Device::Host => recv_push_to_host(ctx, recv, len).await,
        Device::Cuda(ordinal) => match DeviceBuffer::alloc(ordinal, len) {
            Ok(buf) => recv_push_to_device(ctx, recv, buf).await,
            Err(err) => {
                // Out of device memory (or no device): say so before any payload is read.
                let code = match err {
                    Error::DeviceOutOfMemory(_) => ErrorCode::TooLarge,
                    _ => ErrorCode::Internal,
                };
                let msg = format!("push of \"{name}\": {err}");
                refuse(send, recv, stall, code, msg).await;
                return None;
            }
        },
    };
    let (hash, data) = match received {
        Ok(got) => got,
        Err(err) => {
            debug!(%err, %name, "push payload not received");
            return None;
        }
    };
    ctx.metrics.channels.finished(tb_proto::ChannelKind::Quic);
    if hash != meta.hash {
        let msg = format!(
            "push of \"{name}\": expected hash {}, got {hash}",
            meta.hash
        );
        let _ = reply_error(send, stall, ErrorCode::Corrupt, msg).await;
        return None;
    }
    match data {
        Pushed::Host(buf) => match buf.into_tensor(meta) {
            Ok(tensor) => Some(tensor),
            Err(err) => {
                let msg = format!("push of \"{name}\": {err}");
                let _ = reply_error(send, stall, ErrorCode::Internal, msg).await;
                None
            }
        },
        Pushed::Cuda(buf) => Some(Tensor::from_verified_device(meta, buf)),
    }
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
