//! Cut-through: versions this node is still receiving, served to peers while they arrive.
//!
//! A cluster get registers the version it is about to receive in the node's [`Inflight`]
//! table and holds the [`Receiving`] handle while it pulls. A peer's `Pull` of exactly that
//! version, which the store cannot answer yet, is served from the [`Incoming`] entry: the
//! header at once, then the bytes received so far, then more as they land, until the whole
//! payload is out. The puller checks the BLAKE3 hash at the end, as for any pull.
//!
//! Memory safety without `unsafe`: the receiver owns its destination buffer (`&mut [u8]`)
//! and nobody else reads it while it is being written. Once a peer asks for the version
//! (`wanted`), the receiver publishes immutable copies of what it has (`Bytes`, in pieces of
//! at least [`PUBLISH_BYTES`]) as the bytes land; servers stream those pieces. So a version
//! nobody asks for costs no copy at all, and one that is served costs one copy of each byte,
//! made while receiving (no full-tensor copy at the end). When the receive completes, the
//! verified tensor replaces the pieces and servers send the rest from it.
//!
//! A receive that fetches the version in pieces from several sources (`cluster::get::pieces`)
//! publishes each piece once it is verified, in whatever order pieces land, and lists it in
//! [`Progress::have`] with the version's outline ([`Progress::outline`]): peers that fetch in
//! pieces too learn from it which pieces this node serves (a `Pieces` request), and pull each
//! one's range. A plain pull of the bytes in order is served as they become contiguous.
//!
//! Only complete, verified versions reach the store and local readers; this table is only
//! ever read by peers' pulls of an exact version. If the receive fails for good, or must
//! start over because the bytes did not hash right, every stream served from it is reset with
//! [`CloseCode::SourceAborted`] (its puller resumes elsewhere) and new pulls get `NotFound`.
//! Servers wait for new bytes at most the stall timeout.

use std::{
    collections::HashMap,
    ops::Range,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::Bytes;
use tb_proto::{TensorMeta, TensorName};
use tokio::sync::watch;

use crate::tensor::{Outline, Tensor};

/// Received bytes are published to servers in pieces of at least this size (a piece is
/// copied once; smaller ones would cost more wake-ups than they save latency).
pub(crate) const PUBLISH_BYTES: usize = 256 << 10;

type Key = (TensorName, u64);

/// The versions this node is receiving, by name and version.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    map: Arc<Mutex<HashMap<Key, Arc<Incoming>>>>,
}

impl Inflight {
    fn lock(
        map: &Mutex<HashMap<Key, Arc<Incoming>>>,
    ) -> MutexGuard<'_, HashMap<Key, Arc<Incoming>>> {
        // Plain map updates (insert/remove) cannot leave it inconsistent.
        map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers that this node is about to receive `version` of `name` (its metadata not
    /// known yet when `meta` is `None`). Pulls of it wait for the receive instead of getting
    /// `NotFound`. An earlier registration of the same version is failed and replaced.
    pub(crate) fn start(
        &self,
        name: &TensorName,
        version: u64,
        meta: Option<TensorMeta>,
    ) -> Receiving {
        let incoming = Arc::new(Incoming::new(meta));
        let key = (name.clone(), version);
        let old = Inflight::lock(&self.map).insert(key.clone(), incoming.clone());
        if let Some(old) = old {
            old.fail("replaced by a newer receive of the same version".into());
        }
        Receiving {
            map: self.map.clone(),
            key,
            incoming,
            ended: false,
            backlog: Vec::new(),
        }
    }

    /// The receive of `version` of `name` in progress, if any.
    pub(crate) fn get(&self, name: &TensorName, version: u64) -> Option<Arc<Incoming>> {
        Inflight::lock(&self.map)
            .get(&(name.clone(), version))
            .cloned()
    }

    /// Versions being received now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        Inflight::lock(&self.map).len()
    }

    /// Versions being received now whose metadata is known (their look-up answered).
    pub(crate) fn started(&self) -> usize {
        Inflight::lock(&self.map)
            .values()
            .filter(|i| i.progress.borrow().meta.is_some())
            .count()
    }
}

/// How a receive ended.
#[derive(Debug, Clone)]
pub(crate) enum End {
    /// Complete and verified: serve the rest from this tensor.
    Done(Tensor),
    /// Abandoned or restarted: streams served from it must end with an error.
    Failed(String),
}

/// What servers of one version in flight see.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// The version's metadata, once the receiver knows it.
    pub(crate) meta: Option<TensorMeta>,
    /// Published pieces in offset order, not overlapping: `(offset, bytes)`. Contiguous from
    /// byte 0 for a receive in one stream; with gaps for one in pieces.
    pieces: Vec<(u64, Bytes)>,
    /// Bytes published contiguously from byte 0 (a receive in one stream).
    published: u64,
    /// The version's outline, once a receive in pieces checked it.
    pub(crate) outline: Option<Outline>,
    /// Pieces published so far (a receive in pieces), in the order they were.
    pub(crate) have: Vec<u32>,
    /// The receive takes the version in one stream: it has no pieces to offer.
    pub(crate) one_stream: bool,
    /// Set once, when the receive ends.
    pub(crate) end: Option<End>,
}

impl Progress {
    /// Slices of the published bytes in `from..to` that follow on from `from` without a gap
    /// (empty when byte `from` is not published yet).
    pub(crate) fn slices(&self, from: u64, to: u64) -> Vec<Bytes> {
        if from >= to {
            return Vec::new();
        }
        // The piece holding `from`: the last one starting at or before it.
        let first = self.pieces.partition_point(|(at, _)| *at <= from);
        let mut out = Vec::new();
        let mut next = from;
        for (at, bytes) in self.pieces.iter().skip(first.saturating_sub(1)) {
            let end_of_piece = at + bytes.len() as u64;
            if *at > next || next >= to {
                break;
            }
            if end_of_piece <= next {
                continue;
            }
            let start = next - at;
            let end = (to - at).min(bytes.len() as u64);
            // Both bounds lie inside this piece, whose length fits in usize.
            out.push(bytes.slice(start as usize..end as usize));
            next = at + end;
        }
        out
    }

    /// Bytes published so far.
    #[cfg(test)]
    pub(crate) fn published(&self) -> u64 {
        self.published
    }
}

/// One version being received, as its servers see it.
#[derive(Debug)]
pub(crate) struct Incoming {
    progress: watch::Sender<Progress>,
    /// Whether a server wants the bytes (until then nothing is copied).
    wanted: AtomicBool,
}

impl Incoming {
    fn new(meta: Option<TensorMeta>) -> Self {
        Incoming {
            progress: watch::Sender::new(Progress {
                meta,
                ..Progress::default()
            }),
            wanted: AtomicBool::new(false),
        }
    }

    /// A receiver of progress; asking for one marks the bytes wanted.
    pub(crate) fn watch(&self) -> watch::Receiver<Progress> {
        self.wanted.store(true, Ordering::Release);
        self.progress.subscribe()
    }

    fn fail(&self, reason: String) {
        self.progress.send_if_modified(|p| match p.end {
            Some(_) => false,
            None => {
                p.end = Some(End::Failed(reason));
                p.pieces.clear();
                true
            }
        });
    }
}

/// The receiving side of one entry of the table; the entry is failed and removed when this
/// is dropped before [`done`](Self::done).
#[derive(Debug)]
pub(crate) struct Receiving {
    map: Arc<Mutex<HashMap<Key, Arc<Incoming>>>>,
    key: Key,
    incoming: Arc<Incoming>,
    ended: bool,
    /// Pieces in but not published (nobody wanted them yet): index and bytes in the buffer.
    backlog: Vec<(u32, Range<usize>)>,
}

impl Receiving {
    /// Sets the metadata (a registration made before the look-up did not know it).
    pub(crate) fn set_meta(&self, meta: &TensorMeta) {
        self.incoming.progress.send_modify(|p| {
            p.meta = Some(meta.clone());
        });
    }

    /// Notes that `dest[..filled]` has been received: when a server wants the bytes, copies
    /// what is not published yet (at least [`PUBLISH_BYTES`] at a time, or all at the end)
    /// and wakes the servers.
    pub(crate) fn advance(&self, dest: &[u8], filled: usize) {
        if !self.incoming.wanted.load(Ordering::Acquire) {
            return;
        }
        let published = usize::try_from(self.incoming.progress.borrow().published).unwrap_or(0);
        if filled <= published || filled - published < PUBLISH_BYTES && filled < dest.len() {
            return;
        }
        let Some(new) = dest.get(published..filled) else {
            return;
        };
        let piece = Bytes::copy_from_slice(new);
        self.incoming.progress.send_modify(|p| {
            p.pieces.push((p.published, piece));
            p.published = filled as u64;
        });
    }

    /// The receive takes the version in one stream: peers asking for its pieces are told at
    /// once that there are none.
    pub(crate) fn in_one_stream(&self) {
        self.incoming.progress.send_modify(|p| p.one_stream = true);
    }

    /// The receive goes in pieces with this outline (checked against the version's hash).
    pub(crate) fn set_outline(&self, outline: Outline) {
        self.incoming
            .progress
            .send_modify(|p| p.outline = Some(outline));
    }

    /// Notes that piece `index` (bytes `range` of `dest`, verified) is in: when a server
    /// wants the bytes, publishes it — `bytes` when given (its own buffer, no copy), else a
    /// copy from `dest` — with every piece that came in before anybody wanted them (copied
    /// from `dest`), and wakes the servers. Until then nothing is published or copied.
    pub(crate) fn piece(
        &mut self,
        dest: &[u8],
        index: u32,
        range: Range<usize>,
        bytes: Option<Bytes>,
    ) {
        self.backlog.push((index, range));
        if !self.wanted() {
            return;
        }
        let mut backlog = std::mem::take(&mut self.backlog);
        let own = backlog.pop().map(|(i, r)| {
            let b = bytes.unwrap_or_else(|| Bytes::copy_from_slice(&dest[r.clone()]));
            (i, r, b)
        });
        let copies = backlog
            .into_iter()
            .filter_map(|(i, r)| Some((i, r.clone(), Bytes::copy_from_slice(dest.get(r)?))));
        let new: Vec<(u32, Range<usize>, Bytes)> = copies.chain(own).collect();
        self.incoming.progress.send_modify(|p| {
            for (i, r, b) in new {
                let at = r.start as u64;
                let slot = p.pieces.partition_point(|(o, _)| *o < at);
                p.pieces.insert(slot, (at, b));
                p.have.push(i);
            }
        });
    }

    /// Whether a server asked for the bytes of this receive.
    pub(crate) fn wanted(&self) -> bool {
        self.incoming.wanted.load(Ordering::Acquire)
    }

    /// The bytes received so far turned out wrong (the hash did not match) and the receive
    /// starts over: streams served from them end with an error, and a fresh entry takes this
    /// one's place for pulls that come later.
    pub(crate) fn restart(&mut self) {
        let meta = self.incoming.progress.borrow().meta.clone();
        self.incoming
            .fail("the bytes received did not hash right; receiving again".into());
        let fresh = Arc::new(Incoming::new(meta));
        self.backlog.clear();
        let mut map = Inflight::lock(&self.map);
        map.insert(self.key.clone(), fresh.clone());
        self.incoming = fresh;
    }

    /// The receive completed and `tensor` is verified (and stored, when it will be): servers
    /// send the rest from it; the entry leaves the table.
    pub(crate) fn done(mut self, tensor: Tensor) {
        self.ended = true;
        self.incoming.progress.send_modify(|p| {
            p.end = Some(End::Done(tensor));
            p.pieces.clear();
        });
        self.remove();
    }

    fn remove(&self) {
        let mut map = Inflight::lock(&self.map);
        if map
            .get(&self.key)
            .is_some_and(|i| Arc::ptr_eq(i, &self.incoming))
        {
            map.remove(&self.key);
        }
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        if !self.ended {
            self.incoming.fail("the receive was abandoned".into());
            self.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name() -> TensorName {
        TensorName::new("m/w").expect("name")
    }

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 13 % 251) as u8).collect()
    }

    fn joined(progress: &Progress, from: u64, to: u64) -> Vec<u8> {
        progress
            .slices(from, to)
            .iter()
            .flatten()
            .copied()
            .collect()
    }

    #[test]
    fn nothing_is_copied_until_a_server_wants_the_bytes() {
        let table = Inflight::default();
        let receiving = table.start(&name(), 3, None);
        let src = data(3 * PUBLISH_BYTES);
        receiving.advance(&src, 2 * PUBLISH_BYTES);
        let incoming = table.get(&name(), 3).expect("registered");
        assert_eq!(incoming.progress.borrow().published(), 0);
        let rx = incoming.watch();
        // Below one piece nothing is published; then everything received so far is.
        receiving.advance(&src, 2 * PUBLISH_BYTES + 10);
        let at = (2 * PUBLISH_BYTES + 10) as u64;
        assert_eq!(rx.borrow().published(), at);
        receiving.advance(&src, 2 * PUBLISH_BYTES + 20);
        assert_eq!(rx.borrow().published(), at, "a small step waits for more");
        // The end of the payload is published however small the step.
        receiving.advance(&src, src.len());
        assert_eq!(rx.borrow().published(), src.len() as u64);
        let p = rx.borrow();
        assert_eq!(joined(&p, 0, src.len() as u64), src);
        assert_eq!(joined(&p, 5, 7), src[5..7]);
        let mid = PUBLISH_BYTES as u64 * 2 + 3;
        assert_eq!(
            joined(&p, mid - 10, mid + 10),
            src[mid as usize - 10..mid as usize + 10]
        );
        assert!(p.slices(src.len() as u64, u64::MAX).is_empty());
    }

    #[test]
    fn pieces_are_published_in_any_order_and_served_where_contiguous() {
        let table = Inflight::default();
        let mut receiving = table.start(&name(), 4, None);
        let src = data(4000);
        let piece = |i: usize| i * 1000..(i + 1) * 1000;
        // Nobody wants the bytes yet: piece 2 is kept in mind, not copied.
        receiving.piece(&src, 2, piece(2), None);
        let rx = table.get(&name(), 4).expect("registered").watch();
        assert!(rx.borrow().have.is_empty());
        // Once a server wants them, the next piece publishes the earlier one too.
        let own = Bytes::copy_from_slice(&src[piece(0)]);
        receiving.piece(&src, 0, piece(0), Some(own));
        {
            let p = rx.borrow();
            assert_eq!(p.have, vec![2, 0]);
            // Bytes 0..1000 follow on from 0; nothing follows on from 1000 yet.
            assert_eq!(joined(&p, 0, 4000), src[..1000]);
            assert_eq!(joined(&p, 500, 4000), src[500..1000]);
            assert!(p.slices(1000, 4000).is_empty());
            assert_eq!(joined(&p, 2100, 2200), src[2100..2200]);
        }
        receiving.piece(&src, 1, piece(1), None);
        let p = rx.borrow();
        assert_eq!(p.have, vec![2, 0, 1]);
        assert_eq!(joined(&p, 0, 4000), src[..3000]);
        assert!(p.slices(3000, 4000).is_empty());
    }

    #[test]
    fn a_receive_in_one_stream_says_so() {
        let table = Inflight::default();
        let receiving = table.start(&name(), 1, None);
        let rx = table.get(&name(), 1).expect("registered").watch();
        assert!(!rx.borrow().one_stream);
        receiving.in_one_stream();
        assert!(rx.borrow().one_stream);
        assert!(rx.borrow().outline.is_none());
    }

    #[test]
    fn done_hands_over_the_tensor_and_leaves_the_table() {
        let table = Inflight::default();
        let receiving = table.start(&name(), 1, None);
        let incoming = table.get(&name(), 1).expect("registered");
        let rx = incoming.watch();
        let tensor = Tensor::from_bytes(data(1000));
        receiving.done(tensor.clone());
        assert_eq!(table.len(), 0);
        assert!(matches!(&rx.borrow().end, Some(End::Done(t)) if *t == tensor));
    }

    #[test]
    fn an_abandoned_receive_fails_its_servers_and_leaves_the_table() {
        let table = Inflight::default();
        let receiving = table.start(&name(), 1, None);
        let rx = table.get(&name(), 1).expect("registered").watch();
        drop(receiving);
        assert!(table.get(&name(), 1).is_none());
        assert!(matches!(&rx.borrow().end, Some(End::Failed(r)) if r.contains("abandoned")));
    }

    #[test]
    fn a_restart_fails_the_old_servers_and_serves_new_ones_afresh() {
        let table = Inflight::default();
        let mut receiving = table.start(&name(), 1, None);
        let old = table.get(&name(), 1).expect("registered").watch();
        let src = data(PUBLISH_BYTES * 2);
        receiving.advance(&src, src.len());
        receiving.restart();
        assert!(matches!(&old.borrow().end, Some(End::Failed(_))));
        let fresh = table.get(&name(), 1).expect("re-registered").watch();
        assert_eq!(fresh.borrow().published(), 0);
        assert!(fresh.borrow().end.is_none());
        drop(receiving);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn a_second_registration_replaces_the_first() {
        let table = Inflight::default();
        let first = table.start(&name(), 1, None);
        let rx = table.get(&name(), 1).expect("registered").watch();
        let second = table.start(&name(), 1, None);
        assert!(matches!(&rx.borrow().end, Some(End::Failed(_))));
        // The first one's end does not remove the second's entry.
        drop(first);
        assert!(table.get(&name(), 1).is_some());
        drop(second);
        assert_eq!(table.len(), 0);
    }
}
