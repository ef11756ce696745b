//! Sending payloads to pullers: under the node's upload limit ([`send_limited`]), and from a
//! version still arriving ([`serve_inflight`], the serving half of cut-through; see
//! `inflight`).

use std::{ops::Range, sync::Arc, time::Duration};

use bytes::Bytes;
use iroh::endpoint::{SendStream, VarInt};
use tb_proto::{CloseCode, DataResponse, TensorName};
use tokio::sync::watch;

use crate::{
    ctx::NodeCtx,
    error::{Error, Result},
    inflight::{End, Incoming, Progress},
    wire::{self, Watchdog},
};

/// Payload bytes drawn from the upload limit and handed to QUIC at a time.
const UPLOAD_CHUNK: usize = 1 << 20;

/// Sends `data` (bytes `sent..` of a `total`-byte payload) as slices, each paid for from the
/// node's upload limit first when it has one.
pub(crate) async fn send_limited(
    ctx: &NodeCtx,
    send: &mut SendStream,
    data: &Bytes,
    watchdog: &mut Watchdog,
    sent: usize,
    total: usize,
) -> Result<()> {
    let mut offset = 0;
    while offset < data.len() {
        let end = (offset + UPLOAD_CHUNK).min(data.len());
        if let Some(limiter) = &ctx.upload {
            limiter.acquire((end - offset) as u64).await;
        }
        let chunk = data.slice(offset..end);
        wire::write_chunk(send, chunk, watchdog, sent + offset, total).await?;
        offset = end;
    }
    Ok(())
}

/// Why serving a version in flight stopped.
#[derive(Debug)]
pub(crate) enum InflightError {
    /// Before the header: answer with this error frame (`NotFound` or invalid range).
    Refused(tb_proto::ErrorCode, String),
    /// After the header: the stream is reset so the puller resumes elsewhere.
    Aborted(Error),
    /// The puller stopped the stream as finished: it took what it wanted from here (it moved
    /// to another source).
    Left,
}

/// Serves bytes `range` (all of them when `None`) of `version` of `name`, which this node is
/// still receiving: the header as soon as the metadata is known, then the bytes as they are
/// published, then the rest from the verified tensor. Returns the payload bytes sent.
pub(crate) async fn serve_inflight(
    ctx: &NodeCtx,
    send: &mut SendStream,
    name: &TensorName,
    version: u64,
    range: Option<tb_proto::ByteRange>,
    incoming: Arc<Incoming>,
) -> Result<u64, InflightError> {
    let what = format!("tensor \"{name}\" v{version} (still arriving here)");
    let mut rx = incoming.watch();
    // The receive may have been registered before its look-up answered: wait for the metadata.
    let wait = ctx.config.request_timeout.min(ctx.config.stall_timeout);
    let meta = loop {
        let seen = {
            let p = rx.borrow_and_update();
            match (&p.meta, &p.end) {
                (_, Some(End::Failed(reason))) => Err(reason.clone()),
                (Some(meta), _) => Ok(Some(meta.clone())),
                (None, _) => Ok(None),
            }
        };
        match seen {
            Ok(Some(meta)) => break meta,
            Err(reason) => return Err(not_found(&what, &reason)),
            Ok(None) => changed(&mut rx, wait)
                .await
                .map_err(|e| not_found(&what, &e.to_string()))?,
        }
    };
    let Some(Range { start, end }) = crate::serve::byte_range(meta.byte_len, range) else {
        let msg = format!("range {range:?} is outside the {} bytes", meta.byte_len);
        return Err(InflightError::Refused(
            tb_proto::ErrorCode::InvalidTensor,
            msg,
        ));
    };
    let header = DataResponse::Header { meta, version };
    wire::write_frame(send, &header)
        .await
        .map_err(InflightError::Aborted)?;
    let (start, end) = (start as u64, end as u64);
    let total = usize::try_from(end).unwrap_or(usize::MAX);
    let sent = stream_pieces(ctx, send, &mut rx, start, end, total, &what).await;
    match sent {
        Ok(()) => Ok(end - start),
        Err(_) if crate::channel::quic::stopped_for_stripe(send).await => Err(InflightError::Left),
        Err(e) => {
            let _ = send.reset(VarInt::from_u32(CloseCode::SourceAborted.code()));
            Err(InflightError::Aborted(e))
        }
    }
}

/// Sends bytes `from..to` as they become available, in order.
async fn stream_pieces(
    ctx: &NodeCtx,
    send: &mut SendStream,
    rx: &mut watch::Receiver<Progress>,
    from: u64,
    to: u64,
    total: usize,
    what: &str,
) -> Result<()> {
    let stall = ctx.config.stall_timeout;
    let mut watchdog = ctx.quic_watchdog(tb_dashboard::Direction::Out);
    let mut at = from;
    while at < to {
        let next = {
            let p = rx.borrow_and_update();
            match &p.end {
                Some(End::Failed(reason)) => Next::Fail(reason.clone()),
                Some(End::Done(tensor)) => Next::Rest(tensor.data().clone()),
                None => Next::Pieces(p.slices(at, to)),
            }
        };
        // Bytes sent while the version is still arriving count as cut-through.
        let arriving = matches!(next, Next::Pieces(_));
        let pieces = match next {
            Next::Fail(reason) => return Err(Error::SourceAborted(format!("{what}: {reason}"))),
            Next::Rest(data) => {
                let (a, b) = (usize::try_from(at), usize::try_from(to));
                let rest = match (a, b) {
                    (Ok(a), Ok(b)) if b <= data.len() => data.slice(a..b),
                    _ => {
                        return Err(Error::SourceAborted(format!(
                            "{what}: the received tensor is not in host memory"
                        )));
                    }
                };
                vec![rest]
            }
            Next::Pieces(pieces) if pieces.is_empty() => {
                changed(rx, stall).await.map_err(|e| match e {
                    Waited::Timeout => Error::timeout(format!("{what}: more bytes"), stall),
                    Waited::Gone => Error::SourceAborted(format!("{what}: the receive ended")),
                })?;
                continue;
            }
            Next::Pieces(pieces) => pieces,
        };
        for piece in pieces {
            let len = piece.len() as u64;
            let done = usize::try_from(at).unwrap_or(usize::MAX);
            send_limited(ctx, send, &piece, &mut watchdog, done, total).await?;
            if arriving {
                ctx.inflight_bytes_sent
                    .fetch_add(len, std::sync::atomic::Ordering::Relaxed);
            }
            at += len;
        }
    }
    send.finish().map_err(|e| Error::io("finishing stream", e))
}

enum Next {
    Fail(String),
    Rest(Bytes),
    Pieces(Vec<Bytes>),
}

/// Why a wait for progress ended without any.
#[derive(Debug, thiserror::Error)]
enum Waited {
    #[error("no progress within the stall timeout")]
    Timeout,
    #[error("the receive is gone")]
    Gone,
}

/// Waits for the next change of the progress, at most `limit`.
async fn changed(rx: &mut watch::Receiver<Progress>, limit: Duration) -> Result<(), Waited> {
    match tokio::time::timeout(limit, rx.changed()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(Waited::Gone),
        Err(_) => Err(Waited::Timeout),
    }
}

fn not_found(what: &str, reason: &str) -> InflightError {
    InflightError::Refused(tb_proto::ErrorCode::NotFound, format!("{what}: {reason}"))
}
