//! Receiving one version from several holders in turn: the bytes already received stay, the
//! next holder is asked for the rest only (`Pull { range }`, which `serve` answers with that
//! slice), and the hash runs over the whole buffer in order, so a resumed transfer is verified
//! exactly like one that never broke.

use std::sync::atomic::{AtomicU64, Ordering};

use tb_proto::{ByteRange, ContentHash, ContentHasher, TensorMeta, TensorName};

use crate::{
    LinkGuard, client,
    ctx::NodeCtx,
    error::{Error, Result},
    inflight::Receiving,
    progress::{self, TransferProgress},
    wire::{self, HASH_BATCH},
};

/// How far the receiving of one version got: bytes in, bytes hashed.
#[derive(Debug, Default)]
pub(crate) struct Resume {
    filled: usize,
    hashed: usize,
    hasher: ContentHasher,
}

impl Resume {
    /// Bytes received so far.
    pub(crate) fn filled(&self) -> usize {
        self.filled
    }

    /// The range to ask the next holder for, out of `total` bytes: none when starting over.
    pub(crate) fn range(&self, total: usize) -> Option<ByteRange> {
        (self.filled > 0).then(|| ByteRange {
            offset: self.filled as u64,
            len: (total - self.filled) as u64,
        })
    }

    /// Notes that `n` more bytes landed in `dest` after those already in, hashing whole
    /// batches as they fill.
    pub(crate) fn advance(&mut self, dest: &[u8], n: usize) {
        self.filled += n;
        if self.filled - self.hashed >= HASH_BATCH {
            self.hasher.update(&dest[self.hashed..self.filled]);
            self.hashed = self.filled;
        }
    }

    /// The hash of all of `dest`, once every byte is in.
    pub(crate) fn finish(&mut self, dest: &[u8]) -> ContentHash {
        self.hasher.update(&dest[self.hashed..self.filled]);
        self.hashed = self.filled;
        self.hasher.finalize()
    }

    /// Starts over (the bytes received do not hash right: which holder sent bad ones is not
    /// known).
    pub(crate) fn reset(&mut self) {
        *self = Resume::default();
    }
}

/// Where one version is received: the buffer, how far it got, the cut-through feed that
/// publishes the bytes to this node's own pullers, the caller's progress, if any, and the
/// bytes received so far for whoever watches the pace while the pull runs.
pub(crate) struct Target<'a> {
    pub(crate) dest: &'a mut [u8],
    pub(crate) resume: &'a mut Resume,
    pub(crate) feed: &'a Receiving,
    pub(crate) progress: Option<&'a TransferProgress>,
    pub(crate) reached: &'a AtomicU64,
}

impl Target<'_> {
    /// The same destination, borrowed again for one more attempt.
    pub(crate) fn reborrow(&mut self) -> Target<'_> {
        Target {
            dest: &mut *self.dest,
            resume: &mut *self.resume,
            feed: self.feed,
            progress: self.progress,
            reached: self.reached,
        }
    }
}

/// Pulls the rest of `version` of `name` (described by `expected`) from the link's peer into
/// `into.dest`, from where `into.resume` got to, and checks the whole buffer's hash. On error,
/// the resume state says how far it got; a hash mismatch is `Corrupt` (start over), a holder
/// whose header differs from `expected` is `InvalidTensor`.
pub(crate) async fn pull_rest(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: &TensorName,
    version: u64,
    expected: &TensorMeta,
    into: Target<'_>,
) -> Result<()> {
    let Target {
        dest,
        resume,
        feed,
        progress,
        reached,
    } = into;
    let what = format!(
        "tensor \"{name}\" v{version} at {}",
        link.peer().fmt_short()
    );
    let total = dest.len();
    let range = resume.range(total);
    let opened = client::request_pull(ctx, link, name, Some(version), range, &what);
    let (_send, mut recv, meta, v) = opened.await?;
    if v != version || meta != *expected {
        return Err(Error::InvalidTensor(format!(
            "{what}: the holder has v{v} with hash {}, the registry says hash {}",
            meta.hash, expected.hash
        )));
    }
    // Counts the bytes as they land (two relaxed atomics per read, which is tens of KiB).
    // This stream is all the source sends this get: it must keep up with the floor rate.
    let mut watchdog = ctx
        .quic_watchdog(tb_dashboard::Direction::In)
        .with_floor(ctx.config.min_source_rate);
    let mut read = Ok(());
    while resume.filled < total {
        let at = resume.filled;
        match wire::read_some(&mut recv, &mut dest[at..], &mut watchdog, at, total).await {
            Ok(n) => {
                resume.advance(dest, n);
                reached.store(resume.filled as u64, Ordering::Relaxed);
                feed.advance(dest, resume.filled);
                // One relaxed atomic per read, and none without a caller watching.
                progress::reached(progress, resume.filled as u64);
            }
            Err(e) => {
                read = Err(e);
                break;
            }
        }
    }
    ctx.metrics.channels.finished(tb_proto::ChannelKind::Quic);
    read?;
    let hash = resume.finish(dest);
    if hash != expected.hash {
        return Err(Error::Corrupt(format!(
            "{what}: expected hash {}, got {hash}",
            expected.hash
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_resumed_anywhere_hashes_like_one_in_one_piece() {
        let data: Vec<u8> = (0..3 * HASH_BATCH + 1234).map(|i| (i * 7) as u8).collect();
        let whole = ContentHash::of(&data);
        for cuts in [
            vec![],
            vec![1],
            vec![HASH_BATCH - 1, HASH_BATCH + 5],
            vec![2 * HASH_BATCH],
        ] {
            let mut dest = vec![0u8; data.len()];
            let mut resume = Resume::default();
            assert_eq!(resume.range(dest.len()), None);
            let mut at = 0;
            for end in cuts.iter().copied().chain([data.len()]) {
                // Each piece arrives in chunks of odd sizes, as from a stream.
                while at < end {
                    let n = (end - at).min(70_001);
                    dest[at..at + n].copy_from_slice(&data[at..at + n]);
                    resume.advance(&dest, n);
                    at += n;
                }
                if at < data.len() {
                    let range = resume.range(dest.len()).expect("resuming");
                    assert_eq!(range.offset as usize, at);
                    assert_eq!((range.offset + range.len) as usize, data.len());
                }
            }
            assert_eq!(resume.filled(), data.len());
            assert_eq!(resume.finish(&dest), whole, "cuts {cuts:?}");
        }
    }

    #[test]
    fn reset_starts_over() {
        let mut resume = Resume::default();
        resume.advance(&[1, 2, 3], 3);
        resume.reset();
        assert_eq!(resume.filled(), 0);
        assert_eq!(resume.finish(&[]), ContentHash::of(&[]));
    }
}
