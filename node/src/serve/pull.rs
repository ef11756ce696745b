//! The `Pull` service: a version's bytes from the store (slices of its shared bytes, no
//! copies), under the node's upload limit when it has one, or cut-through from a version
//! still arriving ([`upload::serve_inflight`]). The shm and TCP channels answer their pulls
//! from the same [`lookup`].

use std::{ops::Range, sync::Arc};

use iroh::{EndpointId, endpoint::SendStream};
use tb_dashboard::TransferKind;
use tb_proto::{ByteRange, DataResponse, ErrorCode, TensorName};
use tracing::debug;

use super::{
    reply_error,
    upload::{self, InflightError},
};
use crate::{
    channel, ctx::NodeCtx, device, error::Error, inflight::Incoming, lend::LENT_VERSION,
    store::Lookup, tensor::Tensor, wire,
};

pub(super) async fn serve_pull(
    ctx: &NodeCtx,
    peer: &EndpointId,
    mut send: SendStream,
    name: &TensorName,
    version: Option<u64>,
    range: Option<ByteRange>,
) {
    let (version, tensor) = match lookup(ctx, peer, name, version) {
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
    peer: &EndpointId,
    name: &TensorName,
    version: Option<u64>,
) -> Result<(u64, Tensor), NotHeld> {
    lookup_for(ctx, peer, name, version, false)
}

/// [`lookup`] for a path that serves host bytes only (the same-host channel): a lent device
/// tensor is left lent for the path that can serve it, and refused `Busy` here.
pub(crate) fn lookup_host(
    ctx: &NodeCtx,
    peer: &EndpointId,
    name: &TensorName,
    version: Option<u64>,
) -> Result<(u64, Tensor), NotHeld> {
    lookup_for(ctx, peer, name, version, true)
}

fn lookup_for(
    ctx: &NodeCtx,
    peer: &EndpointId,
    name: &TensorName,
    version: Option<u64>,
    host_only: bool,
) -> Result<(u64, Tensor), NotHeld> {
    // A tensor lent to one peer ([`crate::Node::lend`]): to that peer only, once, while it lasts.
    let host = |t: &Tensor| match host_only && t.host_data().is_none() {
        true => Err(()),
        false => Ok(()),
    };
    if let Some(lent) = ctx.loans.take_if(peer, name, host) {
        let gone = || {
            let what = format!("tensor \"{name}\" (not lent to this peer, or no longer)");
            NotHeld::Refused(ErrorCode::NotFound, what)
        };
        return match (lent, version) {
            (Ok(taken), None | Some(LENT_VERSION)) => {
                // A device tensor lent unhashed is hashed now: this path's reader checks.
                match channel::verify::blocking(|| taken.tensor.hashed()) {
                    Ok(tensor) => Ok((LENT_VERSION, tensor)),
                    Err(e) => Err(NotHeld::Refused(
                        ErrorCode::Internal,
                        format!("tensor \"{name}\": hashing it to serve it: {e}"),
                    )),
                }
            }
            (Err(Some(())), _) => Err(NotHeld::Refused(
                ErrorCode::Busy,
                format!("tensor \"{name}\" is on a device: pull it over QUIC"),
            )),
            _ => Err(gone()),
        };
    }
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
