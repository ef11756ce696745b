//! Moving payload bytes over one QUIC stream: a header frame and the tensor bytes after it,
//! hashed as they land, under a stall watchdog on every read and write. The frames themselves
//! are read and written by [`tb_link::framing`] (re-exported here, so the data path names one
//! module for both); the payload half stays here because it deals in tensors, hashes and
//! transfer progress, which the link layer knows nothing of.

use std::time::Duration;

use bytes::Bytes;
use iroh::endpoint::{ReadError, RecvStream, SendStream};
use serde::Serialize;
use tb_dashboard::Meter;
pub(crate) use tb_link::framing::{ReadFrameError, read_frame, read_frame_within};
use tb_proto::{CloseCode, ContentHash, ContentHasher, frame};

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

/// Writes one length-prefixed frame ([`tb_link::framing::write_frame`], with this crate's
/// error, which the data path's error enums carry).
pub(crate) async fn write_frame<T: Serialize>(send: &mut SendStream, msg: &T) -> Result<()> {
    Ok(tb_link::framing::write_frame(send, msg).await?)
}

/// Writes one frame within `stall` ([`tb_link::framing::write_frame_within`], with this
/// crate's error).
pub(crate) async fn write_frame_within<T: Serialize>(
    send: &mut SendStream,
    msg: &T,
    stall: Duration,
) -> Result<()> {
    Ok(tb_link::framing::write_frame_within(send, msg, stall).await?)
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
    mut watchdog: Watchdog,
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
/// hot — thousands per tensor). When it fires it judges the period that just ended: a stall
/// when nothing moved, or, with a floor ([`with_floor`](Self::with_floor)), too slow when
/// fewer bytes moved than the floor rate asks of a whole period; else it re-arms. A transfer
/// that ends within a period is never judged on it. It also counts the payload bytes it sees
/// move on its meter, if it has one (so metrics show rates during a long transfer, not only
/// when it ends).
pub(crate) struct Watchdog {
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    stall: Duration,
    progressed: bool,
    /// Bytes moved in the current period.
    period_bytes: u64,
    /// Least bytes per second over a period; 0: any progress will do.
    floor: u64,
    meter: Option<Meter>,
}

/// Why a stall period failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shortfall {
    /// Nothing moved.
    Stalled,
    /// `moved` bytes moved, under the floor.
    Slow { moved: u64 },
}

impl Shortfall {
    /// How a period went in which `moved` bytes came (`progressed`: any at all), against
    /// the `floor` bytes a period must move.
    fn of(progressed: bool, moved: u64, floor: u64) -> Option<Shortfall> {
        match (progressed, moved < floor) {
            (false, _) => Some(Shortfall::Stalled),
            (true, true) => Some(Shortfall::Slow { moved }),
            (true, false) => None,
        }
    }
}

impl Watchdog {
    pub(crate) fn new(stall: Duration) -> Self {
        Watchdog {
            timer: Box::pin(tokio::time::sleep(stall)),
            stall,
            progressed: false,
            period_bytes: 0,
            floor: 0,
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

    /// The same, also failing a period in which fewer than `rate` bytes per second moved
    /// (0: no floor). For one source's whole delivery to a get: a stream that is one of
    /// several from a source (stripes, pieces) carries only its share of the rate.
    pub(crate) fn with_floor(self, rate: u64) -> Self {
        Watchdog {
            floor: rate,
            ..self
        }
    }

    /// The stall period (the device pipeline paces its staging buffers by it).
    #[cfg(feature = "cuda")]
    pub(crate) fn stall(&self) -> Duration {
        self.stall
    }

    /// Counts `n` payload bytes moved.
    pub(crate) fn moved(&mut self, n: usize) {
        self.period_bytes = self.period_bytes.saturating_add(n as u64);
        if let Some(meter) = &self.meter {
            meter.add(n as u64);
        }
    }

    pub(crate) fn progress(&mut self) {
        self.progressed = true;
    }

    /// The least bytes a whole period must move.
    fn period_floor(&self) -> u64 {
        (self.floor as f64 * self.stall.as_secs_f64()) as u64
    }

    /// Resolves when a period ends: `Some` when it failed (see [`Shortfall`]).
    async fn fired(&mut self) -> Option<Shortfall> {
        (&mut self.timer).await;
        let moved = std::mem::take(&mut self.period_bytes);
        let shortfall = Shortfall::of(self.progressed, moved, self.period_floor());
        self.progressed = false;
        let next = tokio::time::Instant::now() + self.stall;
        self.timer.as_mut().reset(next);
        shortfall
    }

    /// The `Timeout` for a failed period of a transfer of `what`.
    fn error(&self, shortfall: Shortfall, what: String) -> Error {
        match shortfall {
            Shortfall::Stalled => Error::timeout(what, self.stall),
            Shortfall::Slow { moved } => Error::timeout(
                format!(
                    "{what} at {} bytes/s or more: only {moved} bytes came in the last {:?}",
                    self.floor, self.stall
                ),
                self.stall,
            ),
        }
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
            failed = watchdog.fired() => if let Some(shortfall) = failed {
                let what = format!("peer to accept tensor bytes (sent {sent} of {total})");
                return Err(watchdog.error(shortfall, what));
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
/// empty; returns how many. Fails when the stream ends early or `watchdog` fails a period
/// (nothing came, or less than its floor).
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
            failed = watchdog.fired() => if let Some(shortfall) = failed {
                let what = format!("tensor bytes (received {filled} of {total})");
                return Err(watchdog.error(shortfall, what));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_period_fails_with_no_byte_or_fewer_than_the_floor() {
        assert_eq!(Shortfall::of(false, 0, 0), Some(Shortfall::Stalled));
        assert_eq!(Shortfall::of(false, 0, 100), Some(Shortfall::Stalled));
        // No floor: one byte re-arms it (the old rule).
        assert_eq!(Shortfall::of(true, 1, 0), None);
        // A floor: one byte a period is a trickle.
        assert_eq!(
            Shortfall::of(true, 1, 100),
            Some(Shortfall::Slow { moved: 1 })
        );
        assert_eq!(
            Shortfall::of(true, 99, 100),
            Some(Shortfall::Slow { moved: 99 })
        );
        assert_eq!(Shortfall::of(true, 100, 100), None);
    }

    #[tokio::test]
    async fn the_floor_of_a_period_is_the_rate_times_the_period() {
        let dog = Watchdog::new(Duration::from_secs(30)).with_floor(1 << 20);
        assert_eq!(dog.period_floor(), 30 << 20);
        let dog = Watchdog::new(Duration::from_millis(500)).with_floor(1000);
        assert_eq!(dog.period_floor(), 500);
        assert_eq!(Watchdog::new(Duration::from_secs(30)).period_floor(), 0);
    }
}
