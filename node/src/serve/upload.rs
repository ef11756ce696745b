//! Sending payloads to pullers: under the node's upload limit ([`send_limited`]), from a
//! version still arriving ([`serve_inflight`], the serving half of cut-through; see
//! `inflight`), and the outline and pieces a puller in pieces may ask of this node
//! ([`serve_outline`], each tensor's outline hashed once however many ask: [`Outlines`]).

use std::{
    collections::HashMap,
    ops::Range,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use iroh::endpoint::{SendStream, VarInt};
use tb_proto::{CloseCode, ContentHash, DataResponse, ErrorCode, TensorName};
use tokio::sync::{OnceCell, watch};

use tracing::debug;

use crate::{
    ctx::NodeCtx,
    error::{Error, Result},
    inflight::{End, Incoming, Progress},
    serve::NotHeld,
    tensor::{Outline, Tensor},
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
    wire::write_frame_within(send, &header, ctx.config.stall_timeout)
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

/// Answers a `Pieces` request: the outline of `version` of `name` and the pieces this node
/// serves — all of them when it holds the version (the outline is hashed on first need, off
/// the async threads), else those its receive in pieces has verified, then each new one as
/// it is, until the receive completes (or fails: the stream is reset) or the puller stops
/// the stream. A version held on a device, or received here in one stream, has no pieces to
/// offer (`NotFound`: the puller fetches it in one stream).
pub(crate) async fn serve_outline(
    ctx: &NodeCtx,
    peer: &iroh::EndpointId,
    mut send: SendStream,
    name: &TensorName,
    version: u64,
) {
    let what = format!("pieces of tensor \"{name}\" v{version}");
    let held = match crate::serve::lookup(ctx, peer, name, Some(version)) {
        Ok((_, tensor)) => tensor,
        Err(NotHeld::Arriving(_, incoming)) => {
            match serve_outline_inflight(ctx, &mut send, incoming).await {
                Ok(()) => return,
                Err(OutlineRefused::Held(tensor)) => tensor,
                Err(OutlineRefused::No(reason)) => {
                    let message = format!("{what}: {reason}");
                    let _ = crate::serve::reply_error(
                        &mut send,
                        ctx.config.stall_timeout,
                        ErrorCode::NotFound,
                        message,
                    )
                    .await;
                    return;
                }
                Err(OutlineRefused::Aborted(e)) => {
                    debug!(%e, "{what}: not served");
                    let _ = send.reset(VarInt::from_u32(CloseCode::SourceAborted.code()));
                    return;
                }
            }
        }
        Err(NotHeld::Refused(code, message)) => {
            let message = format!("{what}: {message}");
            let _ =
                crate::serve::reply_error(&mut send, ctx.config.stall_timeout, code, message).await;
            return;
        }
    };
    let byte_len = held.byte_len();
    let frame = match ctx.outlines.of(&held).await {
        Ok(Some(values)) => DataResponse::Outline {
            piece_len: tb_proto::piece::piece_len(byte_len),
            values: values.to_vec(),
            complete: true,
            have: Vec::new(),
        },
        Ok(None) => DataResponse::Error {
            code: ErrorCode::NotFound,
            message: format!("{what}: held on a device, served in one stream only"),
        },
        Err(e) => DataResponse::Error {
            code: ErrorCode::Internal,
            message: format!("{what}: {e}"),
        },
    };
    if wire::write_frame_within(&mut send, &frame, ctx.config.stall_timeout)
        .await
        .is_ok()
    {
        let _ = send.finish();
    }
}

/// The outlines being hashed now, by content: however many `Pieces` requests ask for one
/// tensor's outline at once, one blocking task hashes it and the others wait for it without
/// a thread; the tensor keeps the result (shared by every clone, the store's included), so
/// later requests find it made.
#[derive(Debug, Default)]
pub(crate) struct Outlines {
    hashing: Mutex<HashMap<ContentHash, Arc<OnceCell<Option<Outline>>>>>,
    /// Blocking tasks started to make an outline.
    tasks: AtomicU64,
}

impl Outlines {
    /// `tensor`'s outline (`None` for a device tensor), made once however many ask.
    pub(crate) async fn of(&self, tensor: &Tensor) -> Result<Option<Outline>, Error> {
        let key = tensor.hash();
        let cell = self.lock().entry(key).or_default().clone();
        let made = cell
            .get_or_try_init(|| {
                self.tasks.fetch_add(1, Ordering::Relaxed);
                let held = tensor.clone();
                async move {
                    tokio::task::spawn_blocking(move || held.outline())
                        .await
                        .map_err(|e| Error::Io(format!("hashing the outline failed: {e}")))
                }
            })
            .await
            .cloned();
        // Whoever gets here first retires the entry: the tensor keeps the outline.
        let mut hashing = self.lock();
        if hashing.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
            hashing.remove(&key);
        }
        made
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<ContentHash, Arc<OnceCell<Option<Outline>>>>> {
        self.hashing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocking tasks started to make an outline so far.
    #[cfg(test)]
    fn tasks(&self) -> u64 {
        self.tasks.load(Ordering::Relaxed)
    }
}

/// Why a version still arriving here did not get its pieces served as such.
enum OutlineRefused {
    /// It completed before its outline was sent: answer from the tensor.
    Held(Tensor),
    /// It has no pieces to offer (received in one stream, or failed, or no outline in time).
    No(String),
    /// The stream broke after the outline was sent.
    Aborted(Error),
}

/// Serves the outline and pieces of a version this node receives in pieces, as above.
async fn serve_outline_inflight(
    ctx: &NodeCtx,
    send: &mut SendStream,
    incoming: Arc<Incoming>,
) -> Result<(), OutlineRefused> {
    let mut rx = incoming.watch();
    let stall = ctx.config.stall_timeout;
    let wait = ctx.config.request_timeout.min(stall);
    // The outline first: a receive that has not looked its version up yet has none.
    let (outline, have) = loop {
        let seen = {
            let p = rx.borrow_and_update();
            match (&p.end, &p.outline) {
                (Some(End::Done(t)), _) => Err(OutlineRefused::Held(t.clone())),
                (Some(End::Failed(reason)), _) => Err(OutlineRefused::No(reason.clone())),
                (None, Some(outline)) => Ok(Some((outline.clone(), p.have.clone()))),
                (None, None) if p.one_stream => Err(OutlineRefused::No(
                    "received here in one stream, no pieces to offer".into(),
                )),
                (None, None) => Ok(None),
            }
        };
        match seen? {
            Some(found) => break found,
            None => changed(&mut rx, wait)
                .await
                .map_err(|e| OutlineRefused::No(e.to_string()))?,
        }
    };
    let byte_len = rx.borrow().meta.as_ref().map_or(0, |m| m.byte_len);
    let mut sent = have.len();
    let first = DataResponse::Outline {
        piece_len: tb_proto::piece::piece_len(byte_len),
        values: outline.to_vec(),
        complete: false,
        have,
    };
    let write = |e| OutlineRefused::Aborted(e);
    wire::write_frame_within(send, &first, stall)
        .await
        .map_err(write)?;
    loop {
        let (pieces, complete) = {
            let p = rx.borrow_and_update();
            match &p.end {
                Some(End::Failed(reason)) => {
                    let e = Error::SourceAborted(reason.clone());
                    return Err(OutlineRefused::Aborted(e));
                }
                Some(End::Done(_)) => (Vec::new(), true),
                None => (p.have.get(sent..).unwrap_or_default().to_vec(), false),
            }
        };
        if complete || !pieces.is_empty() {
            sent += pieces.len();
            let frame = DataResponse::Have { pieces, complete };
            wire::write_frame_within(send, &frame, stall)
                .await
                .map_err(write)?;
        }
        if complete {
            return send
                .finish()
                .map_err(|e| write(Error::io("finishing stream", e)));
        }
        // Bounded by the receive (which ends within its own stall timeouts) and the puller
        // (which stops the stream when it is done with this source).
        tokio::select! {
            changed = rx.changed() => if changed.is_err() {
                let e = Error::SourceAborted("the receive is gone".into());
                return Err(OutlineRefused::Aborted(e));
            },
            _ = send.stopped() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: N concurrent `Pieces` requests for a tensor without an outline ran N
    /// blocking tasks (one hashing, the others each holding a blocking thread while waiting).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_outline_requests_hash_once() {
        const ASKING: usize = 16;
        let len = 32 << 20;
        let bytes = Bytes::from((0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
        let tensor = Tensor::new(tb_proto::DType::U8, vec![len as u64], bytes).expect("tensor");
        let outlines = Outlines::default();
        let asks = (0..ASKING).map(|_| outlines.of(&tensor));
        let made = futures_join_all(asks).await;
        let first = made[0]
            .as_ref()
            .expect("made")
            .clone()
            .expect("host outline");
        for outline in &made {
            let outline = outline
                .as_ref()
                .expect("made")
                .clone()
                .expect("host outline");
            assert!(Arc::ptr_eq(&outline, &first), "one outline shared");
        }
        assert_eq!(outlines.tasks(), 1, "{ASKING} requests, one hashing task");
        assert!(outlines.lock().is_empty(), "nothing kept once made");
        // Later requests find it on the tensor (a clone, as the store hands out).
        let again = outlines.of(&tensor.clone()).await.expect("made");
        assert!(Arc::ptr_eq(&again.expect("host outline"), &first));
    }

    /// Polls every future together (all start before any finishes), as concurrent requests.
    async fn futures_join_all<F: std::future::Future>(
        futures: impl Iterator<Item = F>,
    ) -> Vec<F::Output> {
        let mut set: Vec<_> = futures.map(Box::pin).collect();
        let mut done: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (f, out) in set.iter_mut().zip(done.iter_mut()) {
                if out.is_none() {
                    match f.as_mut().poll(cx) {
                        std::task::Poll::Ready(v) => *out = Some(v),
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        done.into_iter().flatten().collect()
    }
}
