//! Moving frames and payload bytes over one QUIC stream. The bytes' layout is defined in
//! `tb_proto::frame`; this file only reads and writes them, with limits checked before any
//! allocation and a stall timeout on every read and write.

use std::time::Duration;

use bytes::Bytes;
use iroh::endpoint::{ReadError, ReadExactError, RecvStream, SendStream};
use serde::{Serialize, de::DeserializeOwned};
use tb_dashboard::Meter;
use tb_proto::{CloseCode, ContentHash, ContentHasher, FrameError, frame};

use crate::{
    error::{Error, Result},
    progress::{self, TransferProgress},
};

/// Payload bytes handed to QUIC per write (a slice of the shared tensor bytes, not a copy).
const SEND_CHUNK: usize = 1 << 20;
/// Payloads up to this size are sent in one write with their header.
const COALESCE_MAX: usize = 64 << 10;
/// Received bytes are hashed in batches this large (BLAKE3 is fastest on big inputs).
pub(crate) const HASH_BATCH: usize = 256 << 10;

/// Why a frame could not be read.
#[derive(Debug)]
pub enum ReadFrameError {
    /// The stream ended (or was reset) before a whole frame arrived.
    Closed(String),
    /// The bytes are not a valid frame (too large, malformed): a protocol violation.
    Invalid(FrameError),
}

impl ReadFrameError {
    /// The node error for this failure, with `context` naming what was being read.
    pub fn into_error(self, context: &str) -> Error {
        match self {
            ReadFrameError::Closed(reason) => Error::Io(format!("{context}: {reason}")),
            ReadFrameError::Invalid(FrameError::TooLarge { len, max }) => Error::TooLarge(format!(
                "{context}: frame of {len} bytes, the limit is {max}"
            )),
            ReadFrameError::Invalid(e) => Error::Io(format!("{context}: {e}")),
        }
    }
}

/// Reads one length-prefixed frame. The length is checked against the control-frame cap
/// before the body is allocated.
pub async fn read_frame<T: DeserializeOwned>(recv: &mut RecvStream) -> Result<T, ReadFrameError> {
    read_frame_within(recv, frame::MAX_CONTROL_FRAME).await
}

/// Reads one length-prefixed frame of at most `max` body bytes (a cap below the control-frame
/// cap, such as the hello's), checked before the body is allocated.
pub async fn read_frame_within<T: DeserializeOwned>(
    recv: &mut RecvStream,
    max: u32,
) -> Result<T, ReadFrameError> {
    let mut prefix = [0u8; frame::LEN_PREFIX];
    recv.read_exact(&mut prefix).await.map_err(closed)?;
    let len = frame::body_len_within(prefix, max).map_err(ReadFrameError::Invalid)?;
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await.map_err(closed)?;
    frame::decode_body(&body).map_err(ReadFrameError::Invalid)
}

fn closed(err: ReadExactError) -> ReadFrameError {
    ReadFrameError::Closed(match err {
        ReadExactError::FinishedEarly(n) => format!("stream ended after {n} bytes of a frame"),
        ReadExactError::ReadError(e) => e.to_string(),
    })
}

/// Writes one length-prefixed frame.
pub async fn write_frame<T: Serialize>(send: &mut SendStream, msg: &T) -> Result<()> {
    let bytes = frame::encode(msg).map_err(|e| Error::io("encoding a frame", e))?;
    send.write_all(&bytes)
        .await
        .map_err(|e| Error::io("sending a frame", e))
}

/// Writes one frame, failing with `Timeout` if the peer does not take it within `stall`: a
/// server's every write is bounded, so a peer that grants a tiny stream window and stops
/// reading cannot keep a stream (and so its link) in use.
pub(crate) async fn write_frame_within<T: Serialize>(
    send: &mut SendStream,
    msg: &T,
    stall: Duration,
) -> Result<()> {
    match tokio::time::timeout(stall, write_frame(send, msg)).await {
        Ok(written) => written,
        Err(_) => Err(Error::timeout("a peer taking a frame", stall)),
    }
}

/// Writes `bytes` within `stall` (see [`write_frame_within`]).
async fn write_all_within(send: &mut SendStream, bytes: &[u8], stall: Duration) -> Result<()> {
    match tokio::time::timeout(stall, send.write_all(bytes)).await {
        Ok(written) => written.map_err(|e| Error::io("sending a frame", e)),
        Err(_) => Err(Error::timeout("a peer taking a frame", stall)),
    }
}

/// Writes a header frame and then the payload. Small payloads go out in the same write as
/// the header (one copy of at most `COALESCE_MAX` bytes saves a packet and a round of
/// wake-ups); large ones as slices of the shared buffer. The payload bytes handed to QUIC
/// so far go to `progress`.
pub(crate) async fn write_header_and_payload<T: Serialize>(
    send: &mut SendStream,
    header: &T,
    payload: &Bytes,
    watchdog: Watchdog,
    progress: Option<&TransferProgress>,
) -> Result<()> {
    let mut bytes = frame::encode(header).map_err(|e| Error::io("encoding a frame", e))?;
    if payload.len() <= COALESCE_MAX {
        bytes.extend_from_slice(payload);
        write_all_within(send, &bytes, watchdog.stall).await?;
        watchdog.moved(payload.len());
        progress::reached(progress, payload.len() as u64);
        return Ok(());
    }
    write_all_within(send, &bytes, watchdog.stall).await?;
    send_payload(send, payload, watchdog, progress).await
}

/// A stall watchdog: one timer per `stall` period rather than per read or write (those are
/// hot — thousands per tensor). It re-arms when it fires and sees progress since last time.
/// It also counts the payload bytes it sees move on its meter, if it has one (so metrics show
/// rates during a long transfer, not only when it ends).
pub(crate) struct Watchdog {
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    stall: Duration,
    progressed: bool,
    meter: Option<Meter>,
}

impl Watchdog {
    pub(crate) fn new(stall: Duration) -> Self {
        Watchdog {
            timer: Box::pin(tokio::time::sleep(stall)),
            stall,
            progressed: false,
            meter: None,
        }
    }

    /// The same, counting the bytes that move on `meter`.
    pub(crate) fn metered(stall: Duration, meter: Meter) -> Self {
        Watchdog {
            meter: Some(meter),
            ..Watchdog::new(stall)
        }
    }

    /// The stall period (the device pipeline paces its staging buffers by it).
    #[cfg(feature = "cuda")]
    pub(crate) fn stall(&self) -> Duration {
        self.stall
    }

    /// Counts `n` payload bytes moved.
    pub(crate) fn moved(&self, n: usize) {
        if let Some(meter) = &self.meter {
            meter.add(n as u64);
        }
    }

    pub(crate) fn progress(&mut self) {
        self.progressed = true;
    }

    /// Resolves to `true` when a whole period passed without progress (a stall).
    async fn fired(&mut self) -> bool {
        (&mut self.timer).await;
        let stalled = !self.progressed;
        self.progressed = false;
        let next = tokio::time::Instant::now() + self.stall;
        self.timer.as_mut().reset(next);
        stalled
    }
}

/// Sends payload bytes as slices of the shared buffer (no copies), noting each chunk handed
/// to QUIC on `progress` (one relaxed atomic per chunk).
pub(crate) async fn send_payload(
    send: &mut SendStream,
    data: &Bytes,
    mut watchdog: Watchdog,
    progress: Option<&TransferProgress>,
) -> Result<()> {
    let mut offset = 0;
    while offset < data.len() {
        let end = (offset + SEND_CHUNK).min(data.len());
        let chunk = data.slice(offset..end);
        write_chunk(send, chunk, &mut watchdog, offset, data.len()).await?;
        offset = end;
        progress::reached(progress, offset as u64);
    }
    Ok(())
}

/// Hands one chunk of payload (`sent` of `total` bytes already out) to QUIC, failing with
/// `Timeout` when `watchdog` sees a whole stall period without progress.
pub(crate) async fn write_chunk(
    send: &mut SendStream,
    chunk: Bytes,
    watchdog: &mut Watchdog,
    sent: usize,
    total: usize,
) -> Result<()> {
    let len = chunk.len();
    // `write_chunk` is not cancel-safe: keep the same future alive across watchdog ticks.
    let mut write = std::pin::pin!(send.write_chunk(chunk));
    loop {
        tokio::select! {
            biased;
            written = &mut write => {
                written.map_err(|e| Error::io("sending tensor bytes", e))?;
                break;
            }
            stalled = watchdog.fired() => if stalled {
                return Err(Error::timeout(
                    format!("peer to accept tensor bytes (sent {sent} of {total})"),
                    watchdog.stall,
                ));
            }
        }
    }
    watchdog.progress();
    watchdog.moved(len);
    Ok(())
}

/// Reads exactly `dest.len()` payload bytes straight into `dest`, hashing them as they land.
pub(crate) async fn recv_payload(
    recv: &mut RecvStream,
    dest: &mut [u8],
    mut watchdog: Watchdog,
) -> Result<ContentHash> {
    let total = dest.len();
    let mut hasher = ContentHasher::new();
    let (mut filled, mut hashed) = (0, 0);
    while filled < total {
        filled += read_some(recv, &mut dest[filled..], &mut watchdog, filled, total).await?;
        if filled - hashed >= HASH_BATCH || filled == total {
            hasher.update(&dest[hashed..filled]);
            hashed = filled;
        }
    }
    Ok(hasher.finalize())
}

/// The error for a failed payload read: a reset with [`CloseCode::SourceAborted`] (the
/// serving node lost the version it was still receiving) is [`Error::SourceAborted`].
fn read_error(err: ReadError, filled: usize, total: usize) -> Error {
    match err {
        ReadError::Reset(code)
            if code.into_inner() == u64::from(CloseCode::SourceAborted.code()) =>
        {
            Error::SourceAborted(format!(
                "the serving node lost its own receive (after {filled} of {total} tensor bytes)"
            ))
        }
        e => Error::io("receiving tensor bytes", e),
    }
}

/// Reads some payload bytes (`filled` of `total` already in) into `dest`, which must not be
/// empty; returns how many. Fails when the stream ends early or `watchdog` sees a stall.
pub(crate) async fn read_some(
    recv: &mut RecvStream,
    dest: &mut [u8],
    watchdog: &mut Watchdog,
    filled: usize,
    total: usize,
) -> Result<usize> {
    loop {
        tokio::select! {
            biased;
            read = recv.read(dest) => {
                return match read {
                    Ok(Some(n)) => {
                        watchdog.progress();
                        watchdog.moved(n);
                        Ok(n)
                    }
                    Ok(None) => Err(Error::Io(format!(
                        "stream ended after {filled} of {total} tensor bytes"
                    ))),
                    Err(e) => Err(read_error(e, filled, total)),
                };
            }
            stalled = watchdog.fired() => if stalled {
                return Err(Error::timeout(
                    format!("tensor bytes (received {filled} of {total})"),
                    watchdog.stall,
                ));
            }
        }
    }
}
