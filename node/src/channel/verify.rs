//! Verifying a payload that arrives in pieces, each hashed on its own as its bytes land, whose
//! hashes combine into the tensor's BLAKE3 root (`meta.hash`) with no second pass.
//!
//! BLAKE3 is a tree: the root of `len` bytes has a left subtree of
//! [`left_subtree_len`]`(len)` bytes and a right one of the rest, down to 1 KiB chunks. So a
//! payload is cut along that tree ([`Pieces::split`]): each piece is a whole subtree, hashed by
//! a [`PieceHasher`] (any thread, any order, bytes fed in order within the piece), and
//! [`Pieces::root`] merges the pieces' chaining values pairwise up the same tree. A channel
//! hands each stream or socket a contiguous run of pieces ([`Pieces::group`]).

use std::ops::Range;

use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root,
};
use tb_proto::ContentHash;

/// Why pieces did not verify.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum VerifyError {
    /// A piece was not handed in, or not all of its bytes were hashed.
    #[error("piece {index} ({range:?}) is incomplete: {fed} bytes hashed")]
    Incomplete {
        /// The piece's index.
        index: usize,
        /// Its bytes in the payload.
        range: Range<u64>,
        /// Bytes hashed.
        fed: u64,
    },
    /// More bytes were fed to a piece than it has.
    #[error("piece {index} got {fed} bytes, it has {len}")]
    Overfed {
        /// The piece's index.
        index: usize,
        /// Its length.
        len: u64,
        /// Bytes fed.
        fed: u64,
    },
    /// The pieces hash to something other than what the sender announced.
    #[error("expected hash {expected}, got {got}")]
    Mismatch {
        /// The announced hash.
        expected: ContentHash,
        /// What the bytes hash to.
        got: ContentHash,
    },
}

/// Payloads at least this large are hashed on several threads (below it the hand-off costs
/// more than a second core wins). 2 MiB was tried: one thread alone copied and hashed 1 MiB
/// faster in a loop with idle pauses (114-119 against 130-137 µs p50), but between processes
/// 1 MiB by name from Rust fell from 4,422-5,422 to 3,530-4,350 MB/s (alternating runs).
const RAYON_MIN: usize = 512 << 10;

/// The BLAKE3 hash of `bytes`, on every core for large payloads ([`leaves_shared`]). It
/// blocks for as long as hashing takes: call it off the async threads, or on payloads whose
/// hashing the caller accounts for.
pub(crate) fn hash_all(bytes: &[u8]) -> ContentHash {
    if bytes.len() < RAYON_MIN {
        return ContentHash::of(bytes);
    }
    let Ok(hash) = leaves_shared(bytes.len(), |i| {
        Ok::<_, std::convert::Infallible>(leaf_cv(leaf_of(bytes, i), i))
    });
    hash
}

/// Bytes each thread of [`copy_and_hash`] copies and then hashes while they are still in its
/// core's cache: a power of two, so every leaf is a whole BLAKE3 subtree. Measured on the
/// 2-core development VM (a warm 256 MiB Python `put` against BLAKE3 alone on both cores, 10
/// passes each, leaf sizes alternating): 32 KiB 0.71-0.81x, 64 KiB 0.76-0.84x, 128 KiB
/// 0.81-0.86x, 256 KiB 0.79-0.85x, 512 KiB 0.75-0.80x.
const COPY_LEAF: usize = 128 << 10;

/// Copies `src` into `dst` (the same length) and returns the BLAKE3 hash of the copy, in one
/// pass over the bytes on every core: each leaf of [`COPY_LEAF`] bytes is copied, then hashed
/// from the copy while it is hot in cache ([`leaves_shared`]), and the leaves' chaining values
/// are merged up the tree. What is hashed is what was written, even if `src` changes
/// meanwhile. Blocks like [`hash_all`].
///
/// # Panics
/// If the lengths differ (a caller's bug).
pub(crate) fn copy_and_hash(src: &[u8], dst: &mut [u8]) -> ContentHash {
    assert_eq!(src.len(), dst.len(), "copy_and_hash: lengths differ");
    if src.len() < RAYON_MIN {
        dst.copy_from_slice(src);
        return ContentHash::of(dst);
    }
    // Each leaf's destination, taken by the one thread that claims the leaf.
    let dsts: Vec<std::sync::Mutex<&mut [u8]>> = dst
        .chunks_mut(COPY_LEAF)
        .map(std::sync::Mutex::new)
        .collect();
    let Ok(hash) = leaves_shared(src.len(), |i| {
        let mut dst = dsts[i].lock().unwrap_or_else(|p| p.into_inner());
        dst.copy_from_slice(leaf_of(src, i));
        Ok::<_, std::convert::Infallible>(leaf_cv(&dst, i))
    });
    hash
}

/// Leaf `index` of `bytes` ([`COPY_LEAF`] bytes, or what is left).
fn leaf_of(bytes: &[u8], index: usize) -> &[u8] {
    let rest = &bytes[index * COPY_LEAF..];
    &rest[..rest.len().min(COPY_LEAF)]
}

/// The chaining value of leaf `index` ([`COPY_LEAF`] bytes each) of a larger payload.
fn leaf_cv(leaf: &[u8], index: usize) -> ChainingValue {
    let mut hasher = blake3::Hasher::new();
    hasher.set_input_offset((index * COPY_LEAF) as u64);
    hasher.update(leaf);
    hasher.finalize_non_root()
}

/// How long the thread that hashes a payload spins at its end for helpers still on their
/// last leaf (a leaf takes ~10-15 µs on the development VM), before it sleeps until they end.
const HELPERS_SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// The BLAKE3 hash of a payload of `len` bytes (more than one [`COPY_LEAF`]) whose leaf `i`
/// has the chaining value `leaf(i)` (computed as the caller likes: copied on the way, written
/// to a file), the leaves shared between this thread and the pool's threads (the blake3
/// crate's rayon pool), then merged up the BLAKE3 tree.
///
/// This thread works from the first leaf on, while up to one fewer helpers than the pool has
/// threads join as they wake, each taking the next leaf nobody took. A `rayon_core::join`
/// from a thread outside the pool, as before, moved all of the work into the pool: this
/// thread slept while a pool thread woke, and was woken when the pool ended, two wake-ups on
/// the way of every put and receive of half a MiB or more (on a VM whose idle cores halt,
/// each one costs tens of µs: a 1 MiB Python `put` on the 2-core VM went from 177-183 to
/// 129-130 µs p50). At its end this thread spins briefly for helpers that started and are
/// still on a leaf, so that the scope's end rarely sleeps. Below [`RAYON_MIN`] every leaf
/// is done here, one after another. A leaf's error is returned once every claimed leaf
/// ended; few are claimed after it.
fn leaves_shared<E: Send + Sync>(
    len: usize,
    leaf: impl Fn(usize) -> Result<ChainingValue, E> + Sync,
) -> Result<ContentHash, E> {
    use std::sync::{
        OnceLock,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    };
    let leaves = Pieces::leaves(len as u64);
    let count = leaves.ranges.len();
    if len < RAYON_MIN {
        let values = (0..count).map(&leaf).collect::<Result<Vec<_>, E>>()?;
        return Ok(leaves.root_from(&values));
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let cvs: Vec<OnceLock<Result<ChainingValue, E>>> =
        (0..count).map(|_| OnceLock::new()).collect();
    // Bounded by `count`: each round claims a leaf or ends.
    let work = || {
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= count {
                return;
            }
            let cv = leaf(i);
            if cv.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            let _ = cvs[i].set(cv);
        }
    };
    // This thread takes the place of one of the pool's (none on one core).
    let helpers = rayon_core::current_num_threads()
        .saturating_sub(1)
        .min(count - 1);
    let (started, ended) = (AtomicUsize::new(0), AtomicUsize::new(0));
    rayon_core::in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| {
                started.fetch_add(1, Ordering::Relaxed);
                work();
                ended.fetch_add(1, Ordering::Release);
            });
        }
        work();
        // Only for helpers at work, and never on a pool thread (whose wait runs its own
        // queued helpers): one not started yet may wait behind other work for long.
        if rayon_core::current_thread_index().is_some() {
            return;
        }
        let until = std::time::Instant::now() + HELPERS_SPIN;
        // Bounded by HELPERS_SPIN.
        while started.load(Ordering::Relaxed) == helpers
            && ended.load(Ordering::Acquire) < helpers
            && std::time::Instant::now() < until
        {
            std::hint::spin_loop();
        }
    });
    // Leaves are claimed in order, so a failed one comes before any that nobody took; with
    // none failed, every leaf was taken and ended (the scope waited for its helpers), but one
    // missing would be done here rather than hashed wrong.
    let mut values = Vec::with_capacity(count);
    for (i, cv) in cvs.into_iter().enumerate() {
        values.push(match cv.into_inner() {
            Some(cv) => cv?,
            None => leaf(i)?,
        });
    }
    Ok(leaves.root_from(&values))
}

/// Copies `src` into the file `fd` from offset 0 with `pwrite` and returns the BLAKE3 hash of
/// what was written, in one pass on every core, split as [`copy_and_hash`] splits: each leaf
/// is copied into a cache-resident buffer of its thread, hashed there, and written from there,
/// so what is hashed is what was written even if `src` changes meanwhile. Nothing is mapped:
/// a memfd filled this way costs no page-table work in this process (mapping 64 MiB of a
/// memfd writable with its pages populated took ~25 ms on the development VM, and unmapping it
/// ~6 ms, more than the copy and the hash together).
#[cfg(target_os = "linux")]
pub(crate) fn copy_and_hash_to_fd(
    src: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<ContentHash> {
    if src.len() <= COPY_LEAF {
        return write_leaf(src, fd, 0, ContentHash::of);
    }
    leaves_shared(src.len(), |i| {
        let offset = (i * COPY_LEAF) as u64;
        write_leaf(leaf_of(src, i), fd, offset, |bytes| leaf_cv(bytes, i))
    })
}

/// Copies one leaf (at most [`COPY_LEAF`] bytes) into this thread's buffer, hashes it with
/// `hash` and writes it at `offset` of `fd`.
#[cfg(target_os = "linux")]
fn write_leaf<T>(
    src: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    hash: impl FnOnce(&[u8]) -> T,
) -> std::io::Result<T> {
    thread_local! {
        static LEAF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; COPY_LEAF]);
    }
    LEAF.with_borrow_mut(|buf| {
        let leaf = &mut buf[..src.len()];
        leaf.copy_from_slice(src);
        let hashed = hash(leaf);
        let mut written = 0;
        while written < leaf.len() {
            let at = offset + written as u64;
            match rustix::io::pwrite(fd, &leaf[written..], at) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => written += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(hashed)
    })
}

/// Runs `work` (a long hash) on this thread, telling a multi-thread tokio runtime first so
/// it moves its other tasks elsewhere meanwhile (`block_in_place`); elsewhere it just runs.
pub(crate) fn blocking<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) if rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// Checks that `bytes` hash to `expected` ([`hash_all`], off the async workers' queue):
/// `Corrupt` naming `what` if not.
pub(crate) fn check_all(bytes: &[u8], expected: ContentHash, what: &str) -> crate::Result<()> {
    let got = blocking(|| hash_all(bytes));
    if got != expected {
        return Err(crate::Error::Corrupt(format!(
            "{what}: expected hash {expected}, got {got}"
        )));
    }
    Ok(())
}

/// The most pieces a payload is cut into (bounds the split's work and the merge's recursion).
pub(crate) const MAX_PIECES: usize = 1024;

/// A payload's cut into subtree-aligned pieces, in order, covering `0..len` exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pieces {
    len: u64,
    ranges: Vec<Range<u64>>,
}

/// One piece's hashing state: feed its bytes in order with [`update`](Self::update).
#[derive(Debug, Clone)]
pub(crate) struct PieceHasher {
    index: usize,
    range: Range<u64>,
    /// The only piece of the payload: finalized as the root, not as a subtree.
    whole: bool,
    hasher: blake3::Hasher,
    fed: u64,
}

/// A hashed piece, ready for [`Pieces::root`].
#[derive(Debug, Clone)]
pub(crate) struct PieceHash {
    index: usize,
    fed: u64,
    value: PieceValue,
}

#[derive(Debug, Clone)]
enum PieceValue {
    Root(ContentHash),
    Subtree(ChainingValue),
}

impl Pieces {
    /// Cuts `len` bytes into at most `n` (and at most [`MAX_PIECES`]) pieces, each a whole
    /// BLAKE3 subtree: the largest piece of more than one chunk is split along the tree until
    /// there are `n` (pieces are then within a factor of two of each other in size). Zero
    /// bytes, or `n` of 0 or 1, give one piece.
    pub(crate) fn split(len: u64, n: usize) -> Pieces {
        let n = n.clamp(1, MAX_PIECES);
        let mut ranges: Vec<std::ops::Range<u64>> = std::iter::once(0..len).collect();
        while ranges.len() < n {
            let widest = (0..ranges.len())
                .filter(|&i| ranges[i].end - ranges[i].start > blake3::CHUNK_LEN as u64)
                .max_by_key(|&i| (ranges[i].end - ranges[i].start, usize::MAX - i));
            let Some(i) = widest else { break };
            let Range { start, end } = ranges[i].clone();
            let mid = start + left_subtree_len(end - start);
            ranges[i] = start..mid;
            ranges.insert(i + 1, mid..end);
        }
        Pieces { len, ranges }
    }

    /// The fixed cut every node makes of a `len`-byte version for fetching from several
    /// sources (`tb_proto::piece`): pieces of `piece_len(len)` bytes, each a whole subtree
    /// (a power of two of chunks at a multiple of its size, or the tail after the last such).
    pub(crate) fn fixed(len: u64) -> Pieces {
        let ranges = (0..tb_proto::piece::piece_count(len))
            .map(|i| tb_proto::piece::piece_range(len, i))
            .collect::<Vec<_>>();
        let ranges = if ranges.is_empty() {
            // An empty version is one (empty) piece: its value is the root hash.
            std::iter::once(0..0).collect()
        } else {
            ranges
        };
        Pieces { len, ranges }
    }

    /// The cut of a payload of more than one [`COPY_LEAF`] into its leaves, as
    /// [`leaves_shared`] hashes them: each a whole subtree (a power of two of chunks at a
    /// multiple of its size), the last one shorter.
    fn leaves(len: u64) -> Pieces {
        let leaf = COPY_LEAF as u64;
        let ranges = (0..len.div_ceil(leaf))
            .map(|i| i * leaf..((i + 1) * leaf).min(len))
            .collect();
        Pieces { len, ranges }
    }

    /// The root hash that pieces with these chaining values (one per piece, in order) make;
    /// `None` when the count does not match.
    pub(crate) fn root_of_values(&self, values: &[[u8; 32]]) -> Option<ContentHash> {
        (values.len() == self.ranges.len()).then(|| self.root_from(values))
    }

    /// [`root_of_values`](Self::root_of_values) for values made one per piece of this cut.
    fn root_from(&self, values: &[[u8; 32]]) -> ContentHash {
        if let [only] = values {
            // A single piece is the root itself.
            return ContentHash(*only);
        }
        let (left, right) = self.children(0..self.len, 0..self.ranges.len(), values);
        merge_subtrees_root(&left, &right, Mode::Hash).into()
    }

    /// The pieces' byte ranges, in order.
    #[allow(dead_code)] // tests, and channels that send pieces one by one (tcp)
    pub(crate) fn ranges(&self) -> &[Range<u64>] {
        &self.ranges
    }

    /// Groups the pieces into at most `n` contiguous runs of about equal bytes (one per stream
    /// or socket): the piece indexes of each run, none empty.
    pub(crate) fn group(&self, n: usize) -> Vec<Range<usize>> {
        let n = n.clamp(1, self.ranges.len()) as u64;
        let mut runs: Vec<Range<usize>> = Vec::new();
        let mut first = 0;
        for (i, piece) in self.ranges.iter().enumerate() {
            let run = runs.len() as u64;
            let left = self.ranges.len() - i - 1;
            // Close the run once it reaches its share, keeping a piece for each run after it.
            let share_end = self.len.saturating_mul(run + 1) / n;
            let last_run = run + 1 == n;
            if !last_run && (piece.end >= share_end || left <= (n - run - 1) as usize) {
                runs.push(first..i + 1);
                first = i + 1;
            }
        }
        if first < self.ranges.len() {
            runs.push(first..self.ranges.len());
        }
        runs
    }

    /// The bytes of a run of pieces (from [`group`](Self::group)).
    pub(crate) fn span(&self, run: &Range<usize>) -> Range<u64> {
        self.ranges[run.start].start..self.ranges[run.end - 1].end
    }

    /// A hasher for piece `index`.
    pub(crate) fn hasher(&self, index: usize) -> PieceHasher {
        let range = self.ranges[index].clone();
        let mut hasher = blake3::Hasher::new();
        let whole = self.ranges.len() == 1;
        if !whole {
            hasher.set_input_offset(range.start);
        }
        PieceHasher {
            index,
            range,
            whole,
            hasher,
            fed: 0,
        }
    }

    /// The payload's root hash from every piece's hash (in any order).
    pub(crate) fn root(&self, hashes: Vec<PieceHash>) -> Result<ContentHash, VerifyError> {
        let mut slots: Vec<Option<PieceHash>> = vec![None; self.ranges.len()];
        for h in hashes {
            if let Some(slot) = slots.get_mut(h.index) {
                *slot = Some(h);
            }
        }
        let mut cvs = Vec::with_capacity(slots.len());
        for (index, slot) in slots.into_iter().enumerate() {
            let range = self.ranges[index].clone();
            let want = range.end - range.start;
            match slot {
                Some(h) if h.fed == want => cvs.push(h.value),
                other => {
                    let fed = other.map_or(0, |h| h.fed);
                    return Err(VerifyError::Incomplete { index, range, fed });
                }
            }
        }
        if let [PieceValue::Root(root)] = cvs.as_slice() {
            return Ok(*root);
        }
        let subtree = |v: &PieceValue| match v {
            PieceValue::Subtree(cv) => *cv,
            // Only a payload of one piece has a root piece, handled above.
            PieceValue::Root(h) => h.0,
        };
        let cvs: Vec<ChainingValue> = cvs.iter().map(subtree).collect();
        let (left, right) = self.children(0..self.len, 0..self.ranges.len(), &cvs);
        Ok(merge_subtrees_root(&left, &right, Mode::Hash).into())
    }

    /// Checks the pieces hash to `expected`.
    pub(crate) fn verify(
        &self,
        hashes: Vec<PieceHash>,
        expected: ContentHash,
    ) -> Result<(), VerifyError> {
        let got = self.root(hashes)?;
        if got != expected {
            return Err(VerifyError::Mismatch { expected, got });
        }
        Ok(())
    }

    /// The chaining values of the two children of the subtree `span`, made of `pieces`
    /// (more than one), merging up from the pieces' values `cvs`.
    fn children(
        &self,
        span: Range<u64>,
        pieces: Range<usize>,
        cvs: &[ChainingValue],
    ) -> (ChainingValue, ChainingValue) {
        let mid = span.start + left_subtree_len(span.end - span.start);
        // The split made every piece a node of the tree: the left child's pieces end at `mid`.
        let cut = pieces.start + self.ranges[pieces.clone()].partition_point(|r| r.end <= mid);
        let left = self.node(span.start..mid, pieces.start..cut, cvs);
        let right = self.node(mid..span.end, cut..pieces.end, cvs);
        (left, right)
    }

    fn node(&self, span: Range<u64>, pieces: Range<usize>, cvs: &[ChainingValue]) -> ChainingValue {
        if pieces.len() == 1 {
            return cvs[pieces.start];
        }
        let (left, right) = self.children(span, pieces, cvs);
        merge_subtrees_non_root(&left, &right, Mode::Hash)
    }
}

impl PieceHasher {
    /// Hashes the piece's next bytes (large batches on several cores).
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        if bytes.len() >= RAYON_MIN {
            self.hasher.update_rayon(bytes);
        } else {
            self.hasher.update(bytes);
        }
        self.fed += bytes.len() as u64;
    }

    /// The piece's bytes in the payload.
    pub(crate) fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// The piece's hash (or an error when more bytes than it has were fed).
    pub(crate) fn finish(self) -> Result<PieceHash, VerifyError> {
        let len = self.range.end - self.range.start;
        if self.fed > len {
            let (index, fed) = (self.index, self.fed);
            return Err(VerifyError::Overfed { index, len, fed });
        }
        let value = if self.whole {
            PieceValue::Root(self.hasher.finalize().into())
        } else {
            PieceValue::Subtree(self.hasher.finalize_non_root())
        };
        Ok(PieceHash {
            index: self.index,
            fed: self.fed,
            value,
        })
    }
}

impl PieceHash {
    /// The chaining value (the root hash, for a payload of one piece).
    pub(crate) fn value(&self) -> [u8; 32] {
        match &self.value {
            PieceValue::Root(h) => h.0,
            PieceValue::Subtree(cv) => *cv,
        }
    }
}

/// The outline of `bytes` (each [`Pieces::fixed`] piece's chaining value, in order; for one
/// piece, its root hash), each piece hashed on every core.
pub(crate) fn outline(bytes: &[u8]) -> Vec<[u8; 32]> {
    let pieces = Pieces::fixed(bytes.len() as u64);
    let mut values = Vec::with_capacity(pieces.ranges.len());
    for (i, r) in pieces.ranges.iter().enumerate() {
        let mut h = pieces.hasher(i);
        // Ranges lie inside `bytes`: the cut was made from its length.
        h.update(&bytes[r.start as usize..r.end as usize]);
        let value = match h.finish() {
            Ok(done) => done.value(),
            Err(e) => unreachable!("a piece fed exactly its bytes: {e}"),
        };
        values.push(value);
    }
    values
}

/// Hashes a contiguous run of pieces as its bytes arrive in order (one stream's share).
#[derive(Debug)]
pub(crate) struct RunHasher {
    current: Option<PieceHasher>,
    next: Range<usize>,
    done: Vec<PieceHash>,
    pieces: Pieces,
}

impl RunHasher {
    /// A hasher for the pieces `run` of `pieces` (a clone of the plan is kept).
    pub(crate) fn new(pieces: &Pieces, run: Range<usize>) -> Self {
        let mut next = run;
        let current = next.next().map(|i| pieces.hasher(i));
        RunHasher {
            current,
            next,
            done: Vec::new(),
            pieces: pieces.clone(),
        }
    }

    /// Hashes the run's next bytes, crossing into the next pieces as each fills.
    pub(crate) fn update(&mut self, mut bytes: &[u8]) -> Result<(), VerifyError> {
        while let Some(piece) = self.current.as_mut() {
            let r = piece.range();
            let room = (r.end - r.start - piece.fed) as usize;
            let take = room.min(bytes.len());
            piece.update(&bytes[..take]);
            bytes = &bytes[take..];
            if take < room {
                return Ok(());
            }
            let full = self.current.take();
            self.current = self.next.next().map(|i| self.pieces.hasher(i));
            if let Some(full) = full {
                self.done.push(full.finish()?);
            }
            if bytes.is_empty() && self.current.is_some() {
                return Ok(());
            }
        }
        if bytes.is_empty() {
            Ok(())
        } else {
            let index = self.next.end.saturating_sub(1);
            let len = self.pieces.ranges[index].end - self.pieces.ranges[index].start;
            let fed = len + bytes.len() as u64;
            Err(VerifyError::Overfed { index, len, fed })
        }
    }

    /// The hashes of the run's pieces (a piece not filled is reported by [`Pieces::root`]).
    pub(crate) fn finish(mut self) -> Result<Vec<PieceHash>, VerifyError> {
        if let Some(piece) = self.current.take() {
            self.done.push(piece.finish()?);
        }
        Ok(self.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 9) as u8)
            .collect()
    }

    fn root_of(bytes: &[u8], n: usize, runs: usize) -> ContentHash {
        let pieces = Pieces::split(bytes.len() as u64, n);
        let groups = pieces.group(runs);
        let mut hashes = Vec::new();
        // Runs hashed in reverse order, each fed in odd-sized slices.
        for run in groups.iter().rev() {
            let span = pieces.span(run);
            let mut h = RunHasher::new(&pieces, run.clone());
            for part in bytes[span.start as usize..span.end as usize].chunks(777) {
                h.update(part).expect("fits");
            }
            hashes.extend(h.finish().expect("finish"));
        }
        pieces.root(hashes).expect("root")
    }

    const SIZES: [usize; 12] = [
        0,
        1,
        1023,
        1024,
        1025,
        2048,
        3 * 1024 + 5,
        65_536,
        100_000,
        (1 << 20) - 1,
        1 << 20,
        (1 << 20) + 1,
    ];

    #[test]
    fn merged_root_equals_the_one_shot_hash() {
        for len in SIZES {
            let bytes = data(len);
            let want = ContentHash::of(&bytes);
            for n in [1, 2, 3, 5, 7, 8, 13, 64] {
                for runs in [1, 2, 3, n] {
                    assert_eq!(
                        root_of(&bytes, n, runs),
                        want,
                        "len {len} n {n} runs {runs}"
                    );
                }
            }
        }
    }

    #[test]
    fn pieces_cover_the_payload_on_chunk_boundaries() {
        for len in SIZES.iter().map(|&l| l as u64).chain([5 << 20, 256 << 20]) {
            for n in [1, 3, 8, 100] {
                let p = Pieces::split(len, n);
                assert!(p.ranges().len() <= n.max(1));
                assert_eq!(p.ranges().first().map(|r| r.start), Some(0));
                assert_eq!(p.ranges().last().map(|r| r.end), Some(len));
                for w in p.ranges().windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert_eq!(w[1].start % 1024, 0);
                }
                let groups = p.group(3);
                assert!(!groups.is_empty() && groups.len() <= 3);
                assert!(groups.iter().all(|g| !g.is_empty()));
                assert_eq!(groups.last().map(|g| g.end), Some(p.ranges().len()));
            }
        }
    }

    #[test]
    fn big_payloads_split_into_as_many_pieces_as_asked() {
        let p = Pieces::split(256 << 20, 24);
        assert_eq!(p.ranges().len(), 24);
        let groups = p.group(3);
        assert_eq!(groups.len(), 3);
        let spans: Vec<u64> = groups
            .iter()
            .map(|g| p.span(g))
            .map(|s| s.end - s.start)
            .collect();
        let (min, max) = (spans.iter().min(), spans.iter().max());
        assert!(max.zip(min).is_some_and(|(a, b)| *a <= 2 * *b), "{spans:?}");
    }

    #[test]
    fn a_fixed_cuts_outline_merges_into_the_hash() {
        let piece = tb_proto::piece::MIN_PIECE_LEN as usize;
        for len in [
            0,
            1,
            piece - 1,
            piece,
            piece + 5,
            4 * piece,
            4 * piece + 1023,
            5 * piece + 1,
        ] {
            let bytes = data(len);
            let pieces = Pieces::fixed(len as u64);
            let values = outline(&bytes);
            assert_eq!(values.len(), pieces.ranges().len(), "len {len}");
            assert_eq!(
                values.len(),
                tb_proto::piece::piece_count(len as u64).max(1),
                "len {len}"
            );
            let want = ContentHash::of(&bytes);
            assert_eq!(pieces.root_of_values(&values), Some(want), "len {len}");
            // Each piece hashed on its own, as a puller does, gives its value.
            for (i, r) in pieces.ranges().iter().enumerate() {
                let mut h = pieces.hasher(i);
                h.update(&bytes[r.start as usize..r.end as usize]);
                assert_eq!(
                    h.finish().expect("finish").value(),
                    values[i],
                    "len {len} piece {i}"
                );
            }
            assert_eq!(pieces.root_of_values(&values[1..]), None);
        }
    }

    #[test]
    fn a_flipped_byte_changes_its_pieces_value_only() {
        let piece = tb_proto::piece::MIN_PIECE_LEN as usize;
        let mut bytes = data(4 * piece + 77);
        let before = outline(&bytes);
        bytes[2 * piece + 5] ^= 1;
        let after = outline(&bytes);
        let changed: Vec<usize> = (0..before.len())
            .filter(|&i| before[i] != after[i])
            .collect();
        assert_eq!(changed, vec![2]);
        // The outline of the changed bytes does not merge into the old hash.
        let pieces = Pieces::fixed(bytes.len() as u64);
        assert_ne!(
            pieces.root_of_values(&after),
            pieces.root_of_values(&before)
        );
    }

    #[test]
    fn a_flipped_byte_is_a_mismatch() {
        let mut bytes = data(300_000);
        let want = ContentHash::of(&bytes);
        bytes[123_456] ^= 1;
        let pieces = Pieces::split(bytes.len() as u64, 4);
        let mut hashes = Vec::new();
        for i in 0..pieces.ranges().len() {
            let r = pieces.ranges()[i].clone();
            let mut h = pieces.hasher(i);
            h.update(&bytes[r.start as usize..r.end as usize]);
            hashes.push(h.finish().expect("finish"));
        }
        assert!(matches!(
            pieces.verify(hashes, want),
            Err(VerifyError::Mismatch { .. })
        ));
    }

    #[test]
    fn a_missing_or_short_piece_is_incomplete() {
        let bytes = data(10_000);
        let pieces = Pieces::split(bytes.len() as u64, 3);
        let mut h = pieces.hasher(0);
        h.update(&bytes[..10]);
        let short = vec![h.finish().expect("finish")];
        assert!(matches!(
            pieces.root(short),
            Err(VerifyError::Incomplete {
                index: 0,
                fed: 10,
                ..
            })
        ));
        let mut run = RunHasher::new(&pieces, 0..1);
        assert!(matches!(
            run.update(&bytes),
            Err(VerifyError::Overfed { .. })
        ));
    }

    #[test]
    fn copy_and_hash_copies_every_byte_and_hashes_as_blake3_does() {
        let chunk = blake3::CHUNK_LEN;
        let lens = [
            0,
            1,
            chunk - 1,
            chunk,
            chunk + 1,
            RAYON_MIN - 1,
            RAYON_MIN,
            RAYON_MIN + 1,
            RAYON_MIN + COPY_LEAF + 3,
            3 * COPY_LEAF * 7 + 1,
            (4 << 20) + 5 * chunk + 17,
            9 << 20,
        ];
        for len in lens {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 + i / 1021) as u8).collect();
            let mut dst = vec![0xAAu8; len];
            let hash = copy_and_hash(&src, &mut dst);
            assert!(dst == src, "len {len}: copy differs");
            assert_eq!(hash, ContentHash::of(&src), "len {len}: hash differs");
            assert_eq!(hash_all(&src), hash, "len {len}: hash_all differs");
            #[cfg(target_os = "linux")]
            {
                // The same into a file, written with pwrite: the file holds `src`, hashed.
                let fd =
                    rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
                rustix::fs::ftruncate(&fd, len as u64).expect("size");
                let hash =
                    copy_and_hash_to_fd(&src, std::os::fd::AsFd::as_fd(&fd)).expect("written");
                assert_eq!(hash, ContentHash::of(&src), "len {len}: file hash differs");
                let mut back = vec![0u8; len];
                let read = rustix::io::pread(&fd, &mut back, 0).expect("read back");
                assert_eq!(read, len, "len {len}: file length");
                assert!(back == src, "len {len}: file bytes differ");
            }
        }
    }

    /// A leaf that fails (here: `pwrite` to a socket) fails the whole copy with its error, on
    /// whichever thread it ran, after the other leaves ended; nothing panics.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_failed_leaf_fails_the_copy_with_its_error() {
        let (writer, _reader) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        for len in [RAYON_MIN, 9 << 20] {
            let src = vec![5u8; len];
            let err = copy_and_hash_to_fd(&src, std::os::fd::AsFd::as_fd(&writer))
                .expect_err("a socket has no offsets");
            assert_eq!(
                err.raw_os_error(),
                Some(rustix::io::Errno::SPIPE.raw_os_error())
            );
        }
    }
}
