//! Striped QUIC: a large pull split over several streams of the pooled link, each receiving
//! its own byte range straight into its slice of the destination and hashing it as it lands
//! ([`verify`](super::verify)), so neither one stream's receive window nor a second hashing
//! pass limits the transfer.
//!
//! The first stream is the pull's own (`Pull { range: None }`, sent before the size is known):
//! once its header says the tensor is worth striping, that stream keeps only the first share
//! and is stopped with [`STRIPE_DONE`] when it is in (at most one stream window of bytes sent
//! past it is dropped); every other share is a `Pull { version, range }` on a stream of its
//! own, answered by the same version.

use std::time::Duration;

use iroh::endpoint::{RecvStream, SendStream, VarInt};
use tb_dashboard::Direction::In;
use tb_link::endpoint::{LINK_PARALLEL_STREAMS, STREAM_RECEIVE_WINDOW};
use tb_proto::{ByteRange, CloseCode, ContentHash, TensorMeta, TensorName};

use super::verify::{PieceHash, Pieces, RunHasher, VerifyError};
use crate::{
    LinkGuard, client,
    ctx::NodeCtx,
    error::{Error, Result},
    wire::{self, HASH_BATCH, Watchdog},
};

/// The rate one striped transfer should be able to reach before flow control limits it, in
/// bytes per second (10 Gbit/s).
pub(crate) const TARGET_RATE: u64 = 1_250_000_000;

/// The smallest share of a striped pull under the automatic rule: below it the extra streams'
/// requests cost more than they win.
pub(crate) const MIN_STRIPE_BYTES: u64 = 4 << 20;

/// Pieces (hashed subtrees) per stripe: several, so the stripes' shares can be balanced.
const PIECES_PER_STRIPE: usize = 4;

/// The reset code that stops the first stream once its share is in; `serve` counts a pull
/// stopped with it as served.
pub(crate) const STRIPE_DONE: CloseCode = CloseCode::Normal;

/// How many streams a pull of `len` bytes over a link with round-trip time `rtt` uses.
///
/// One stream moves at most `STREAM_RECEIVE_WINDOW / rtt` (about 125 MB/s at 10 ms), so the
/// automatic rule (`configured` 0) takes
/// `stripes = ceil(TARGET_RATE * rtt / STREAM_RECEIVE_WINDOW)`, the fewest streams whose
/// windows together cover [`TARGET_RATE`] at that RTT, bounded by `LINK_PARALLEL_STREAMS` (the
/// connection window is sized for that many) and by `len / MIN_STRIPE_BYTES` (at least 1).
/// `configured` 1 never stripes; any other value is used as given, bounded by
/// `LINK_PARALLEL_STREAMS` and by the number of 1 KiB chunks (a share is at least one).
pub(crate) fn stripes(configured: usize, len: u64, rtt: Duration) -> usize {
    let most = LINK_PARALLEL_STREAMS as usize;
    match configured {
        0 => {
            let in_flight = TARGET_RATE as u128 * rtt.as_micros();
            let window = STREAM_RECEIVE_WINDOW as u128 * 1_000_000;
            let need = in_flight.div_ceil(window).max(1) as usize;
            let by_size = (len / MIN_STRIPE_BYTES).max(1) as usize;
            need.min(most).min(by_size)
        }
        1 => 1,
        n => {
            let chunks = len.div_ceil(blake3::CHUNK_LEN as u64).max(1) as usize;
            n.min(most).min(chunks)
        }
    }
}

/// The round-trip time of `link`'s selected path (zero when unknown).
pub(crate) fn rtt(link: &LinkGuard) -> Duration {
    let paths = link.connection().paths();
    let rtt = paths.iter().find(|p| p.is_selected()).map(|p| p.rtt());
    rtt.unwrap_or_default()
}

/// The stripes for a pull of `meta` over `link` under `ctx`'s config.
pub(crate) fn stripes_for(ctx: &NodeCtx, link: &LinkGuard, meta: &TensorMeta) -> usize {
    stripes(ctx.config.quic_stripes, meta.byte_len, rtt(link))
}

/// Whether the reader of `send` stopped it with [`STRIPE_DONE`]: a striped pull took the share
/// it wanted from this stream, which was served.
pub(crate) async fn stopped_for_stripe(send: &mut SendStream) -> bool {
    // Polled once: a stop that arrived is already recorded.
    let stopped = tokio::time::timeout(Duration::ZERO, send.stopped()).await;
    matches!(stopped, Ok(Ok(Some(code))) if code == VarInt::from_u32(STRIPE_DONE.code()))
}

/// What a striped pull is of: the version the first stream's header named.
pub(crate) struct Striped<'a> {
    /// The pooled link (held by the caller for the whole pull).
    pub(crate) link: &'a LinkGuard,
    /// The tensor's name.
    pub(crate) name: &'a TensorName,
    /// The version every stripe must answer with.
    pub(crate) version: u64,
    /// Its metadata (validated).
    pub(crate) meta: &'a TensorMeta,
    /// Names the pull in errors.
    pub(crate) what: &'a str,
}

/// Receives the pull's payload into `dest` over `stripes` streams, the first being `first`
/// (whose header has been read); returns the BLAKE3 root of what arrived, merged from the
/// stripes' own hashes (`Corrupt` when it is not `meta.hash`).
pub(crate) async fn recv_striped(
    ctx: &NodeCtx,
    pull: Striped<'_>,
    first: &mut RecvStream,
    dest: &mut [u8],
    stripes: usize,
) -> Result<ContentHash> {
    let pieces = Pieces::split(dest.len() as u64, stripes * PIECES_PER_STRIPE);
    let runs = pieces.group(stripes);
    let mut rest = dest;
    let mut first = Some(first);
    let mut jobs = Vec::with_capacity(runs.len());
    for (i, run) in runs.into_iter().enumerate() {
        let span = pieces.span(&run);
        let (mine, tail) = rest.split_at_mut((span.end - span.start) as usize);
        rest = tail;
        let hasher = RunHasher::new(&pieces, run);
        let (pull, first) = (&pull, if i == 0 { first.take() } else { None });
        jobs.push(async move {
            match first {
                Some(recv) => {
                    let hashes = recv_run(recv, mine, hasher, ctx.quic_watchdog(In)).await;
                    let _ = recv.stop(VarInt::from_u32(STRIPE_DONE.code()));
                    hashes
                }
                None => {
                    let range = ByteRange {
                        offset: span.start,
                        len: span.end - span.start,
                    };
                    let (_send, mut recv) = open_stripe(ctx, pull, range).await?;
                    recv_run(&mut recv, mine, hasher, ctx.quic_watchdog(In)).await
                }
            }
        });
    }
    let hashes: Vec<PieceHash> = n0_future::try_join_all(jobs)
        .await?
        .into_iter()
        .flatten()
        .collect();
    let expected = pull.meta.hash;
    let verified = pieces.verify(hashes, expected);
    verified.map_err(|e| verify_error(pull.what, e))?;
    Ok(expected)
}

/// The node error for pieces that did not verify.
pub(crate) fn verify_error(what: &str, err: VerifyError) -> Error {
    match err {
        VerifyError::Mismatch { .. } => Error::Corrupt(format!("{what}: {err}")),
        VerifyError::Incomplete { .. } | VerifyError::Overfed { .. } => {
            Error::Io(format!("{what}: {err}"))
        }
    }
}

/// Pulls `range` of the version `pull` names on a stream of its own into `dest` (exactly
/// the range's bytes), continuing `hasher`: how another channel that failed part-way
/// finishes its share over QUIC from the byte it reached.
pub(crate) async fn pull_range(
    ctx: &NodeCtx,
    pull: &Striped<'_>,
    range: ByteRange,
    dest: &mut [u8],
    hasher: RunHasher,
) -> Result<Vec<PieceHash>> {
    if range.len == 0 {
        return hasher.finish().map_err(|e| verify_error(pull.what, e));
    }
    let (_send, mut recv) = open_stripe(ctx, pull, range).await?;
    recv_run(&mut recv, dest, hasher, ctx.quic_watchdog(In)).await
}

/// Opens a stream for one stripe and reads its header, which must name the same version
/// with the same metadata.
async fn open_stripe(
    ctx: &NodeCtx,
    pull: &Striped<'_>,
    range: ByteRange,
) -> Result<(SendStream, RecvStream)> {
    let range = Some(range);
    let opened = client::request_pull(
        ctx,
        pull.link,
        pull.name,
        Some(pull.version),
        range,
        pull.what,
    );
    let (send, recv, meta, version) = opened.await?;
    if version != pull.version || meta != *pull.meta {
        return Err(Error::Io(format!(
            "{}: a stripe's header names v{version} with hash {}, not v{} with hash {}",
            pull.what, meta.hash, pull.version, pull.meta.hash
        )));
    }
    Ok((send, recv))
}

/// Reads exactly `dest.len()` bytes of one stripe into `dest`, hashing them in batches as
/// they land (and counting them on `watchdog`'s meter).
async fn recv_run(
    recv: &mut RecvStream,
    dest: &mut [u8],
    mut hasher: RunHasher,
    mut watchdog: Watchdog,
) -> Result<Vec<PieceHash>> {
    let total = dest.len();
    let (mut filled, mut hashed) = (0, 0);
    while filled < total {
        filled += wire::read_some(recv, &mut dest[filled..], &mut watchdog, filled, total).await?;
        if filled - hashed >= HASH_BATCH || filled == total {
            let batch = &dest[hashed..filled];
            hasher
                .update(batch)
                .map_err(|e| verify_error("stripe", e))?;
            hashed = filled;
        }
    }
    hasher.finish().map_err(|e| verify_error("stripe", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_rule_covers_the_rate_at_the_links_rtt() {
        let big = 1 << 30;
        // Loopback: one window covers 10 Gbit/s at 100 us.
        assert_eq!(stripes(0, big, Duration::from_micros(100)), 1);
        // 10 ms: 12.5 MB in flight needs 10 windows, bounded by the link's 8.
        assert_eq!(stripes(0, big, 10 * MS), 8);
        assert_eq!(stripes(0, big, 3 * MS), 3);
        // Small tensors are not striped, whatever the RTT.
        assert_eq!(stripes(0, 5 << 20, 10 * MS), 1);
        assert_eq!(stripes(0, 0, 10 * MS), 1);
    }

    #[test]
    fn configured_stripes_are_bounded() {
        assert_eq!(stripes(1, 1 << 30, 10 * MS), 1);
        assert_eq!(stripes(3, 1 << 30, Duration::ZERO), 3);
        assert_eq!(stripes(100, 1 << 30, Duration::ZERO), 8);
        assert_eq!(stripes(8, 2048, Duration::ZERO), 2);
        assert_eq!(stripes(8, 1, Duration::ZERO), 1);
        assert_eq!(stripes(8, 0, Duration::ZERO), 1);
    }

    #[test]
    fn a_corrupted_stripe_is_corrupt() {
        let bytes: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
        let want = ContentHash::of(&bytes);
        let pieces = Pieces::split(bytes.len() as u64, 3 * PIECES_PER_STRIPE);
        let mut hashes = Vec::new();
        for (i, run) in pieces.group(3).into_iter().enumerate() {
            let span = pieces.span(&run);
            let mut mine = bytes[span.start as usize..span.end as usize].to_vec();
            if i == 1 {
                mine[7] ^= 0x40;
            }
            let mut h = RunHasher::new(&pieces, run);
            h.update(&mine).expect("fits");
            hashes.extend(h.finish().expect("finish"));
        }
        let err = pieces.verify(hashes, want).expect_err("corrupt");
        assert!(matches!(verify_error("t", err), Error::Corrupt(_)));
    }

    use tb_dashboard::TransferKind;

    /// QUIC alone: two nodes of one host would otherwise use shm, which is never striped.
    fn config(stripes: usize) -> crate::Config {
        crate::Config {
            channels: vec![tb_proto::ChannelKind::Quic],
            quic_stripes: stripes,
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(10),
            ..crate::Config::default()
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 10) as u8)
            .collect()
    }

    /// Every dtype, at element counts whose byte lengths are not multiples of a chunk or a
    /// piece, plus 0- and 1-byte tensors, pulled striped over 3 and 8 streams.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn striped_pulls_are_byte_identical() {
        use tb_proto::DType;
        for stripes in [3, 8] {
            let a = crate::Node::spawn(config(stripes)).await.expect("a");
            let b = crate::Node::spawn(config(stripes)).await.expect("b");
            let mut cases: Vec<(DType, usize)> = DType::ALL
                .iter()
                .map(|&d| (d, 3 * 1024 * 1024 / 7 + 13))
                .collect();
            cases.extend([
                (DType::U8, 0),
                (DType::U8, 1),
                (DType::U8, 1025),
                (DType::U8, 9000),
            ]);
            let pulls = cases.len() as u64;
            for (i, (dtype, elems)) in cases.into_iter().enumerate() {
                let bytes = pattern(elems * dtype.itemsize() as usize, i as u8);
                let shape = vec![elems as u64];
                let tensor = crate::Tensor::new(dtype, shape, bytes.clone()).expect("t");
                let name = format!("striped/{i}");
                b.publish_local(&name, tensor.clone()).expect("publish");
                let pull = a.pull(b.addr(), &name, None);
                let got = tokio::time::timeout(Duration::from_secs(30), pull)
                    .await
                    .expect("in time")
                    .expect("pull");
                assert_eq!(got.buffer.data().as_ref(), &bytes[..], "{dtype:?} x{elems}");
                assert_eq!(got.meta, *tensor.meta());
            }
            // Striped: most pulls were served on several streams, and the first streams,
            // stopped once their share was in, count as served, not failed.
            let serves = |ok| b.metrics().transfers(TransferKind::Serve, ok);
            for _ in 0..100 {
                if serves(true) >= 2 * pulls {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(serves(true) >= 2 * pulls, "{} served", serves(true));
            assert_eq!(serves(false), 0);
            a.shutdown().await;
            b.shutdown().await;
        }
    }
}
