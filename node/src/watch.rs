//! [`Watchers`]: the subscribers watching this node's names, and serving a `Watch` stream.
//!
//! A subscriber that hears of a version of a name from a broker's event learns who published
//! it, and opens a `Watch { name }` stream to that publisher on their pooled link. From then
//! on, each small version (its bytes inline, at most [`MAX_INLINE_BYTES`]) the publisher
//! publishes goes down that stream as an `Offer` as soon as it is stored, beside the publish
//! to the broker rather than after it: one QUIC hop from publisher to subscriber instead of
//! two through the broker. A watcher on the same host (the watch came over the shm channel's
//! socket) is offered every host version, however large: a large one goes as a pull's
//! `Header` and, up to 4 MiB, its memfd for the watcher to copy from (a watcher that proved
//! read-write access) or its bytes on the socket, beyond that as its sealed memfd
//! (`ShmPayload::Memfd`), which the subscriber maps without a look-up or a pull; such an
//! offer is queued only to a watcher with none pending, so a slow watcher pins at most one
//! large version. The broker's event still comes and is a duplicate the subscription drops
//! (when the event wins the race, a same-host subscription waits a few milliseconds for the
//! offer instead of fetching the version a second time); offers are a shortcut, never the only
//! news, so an offer that is late, dropped (a watcher whose queue is full) or never sent (the
//! stream is down) costs latency, never a version.
//!
//! Bounded: at most [`MAX_WATCHERS`] streams per node and [`MAX_WATCHERS_PER_NAME`] per name
//! (beyond them a `Watch` is refused `Busy`), each with a queue of [`QUEUE`] offers whose
//! bytes all watchers of a version share.

use std::{
    collections::HashMap,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use iroh::endpoint::{RecvStream, SendStream};
use tb_proto::{DataResponse, ErrorCode, MAX_INLINE_BYTES, TensorName};
use tokio::sync::mpsc;
use tracing::debug;

use crate::{ctx::NodeCtx, tensor::Tensor, wire};

/// Most `Watch` streams one node serves at once.
pub(crate) const MAX_WATCHERS: usize = 1024;
/// Most `Watch` streams of one name.
pub(crate) const MAX_WATCHERS_PER_NAME: usize = 256;
/// Offers waiting to be written, per watcher: beyond it, a new offer is not queued for that
/// watcher (its subscription hears of the version from the broker).
const QUEUE: usize = 8;

/// One version offered to the watchers of its name (a clone of the stored tensor: its bytes
/// are shared, not copied).
#[derive(Debug, Clone)]
pub(crate) struct Offer {
    pub(crate) version: u64,
    pub(crate) tensor: Tensor,
    /// Written already, straight to a same-host watcher's socket for it to copy from the
    /// memfd ([`Watchers::offer`]): the watch's task only waits for the receipt.
    pub(crate) sent: bool,
}

impl Offer {
    /// Whether its bytes ride inline in an `Offer` frame (the only kind a QUIC watcher gets).
    pub(crate) fn inline(&self) -> bool {
        self.tensor.byte_len() <= MAX_INLINE_BYTES && self.tensor.host_data().is_some()
    }

    /// The `Offer` frame carrying its bytes (for an [`inline`](Self::inline) offer).
    pub(crate) fn frame(&self) -> DataResponse {
        DataResponse::Offer {
            version: self.version,
            meta: self.tensor.meta().clone(),
            bytes: self
                .tensor
                .host_data()
                .map(|b| b.to_vec())
                .unwrap_or_default(),
        }
    }
}

#[derive(Debug)]
struct Watcher {
    id: u64,
    tx: mpsc::Sender<Offer>,
    /// Watching over the same-host socket: offered large versions too.
    same_host: bool,
    /// Its socket, for small offers written straight from [`Watchers::offer`].
    direct: Option<std::sync::Arc<Direct>>,
}

/// A same-host watcher's socket, which [`Watchers::offer`] writes an offer to itself (one
/// non-blocking `send` on the publishing thread) when nothing else is on its way to that
/// watcher, instead of queueing it for the watch's task: the offer leaves without waking a
/// runtime worker first. A small offer goes whole; a larger one up to 4 MiB, to a watcher
/// that proved read-write access, as its header and the memfd to copy from, and is then
/// queued to the task marked sent, for the task to wait for its receipt. Offers stay in
/// order: one is written here only while no offer queued for the watcher is unwritten or
/// waits for its receipt (such offers are counted until the task is done with them), and
/// offers are made one at a time (under the watchers' lock).
#[derive(Debug)]
pub(crate) struct Direct {
    /// A duplicate of the watch connection's socket.
    fd: std::os::fd::OwnedFd,
    /// Offers queued for the watch's task that it is not done with yet.
    unwritten: AtomicU64,
    /// The watcher proved read-write access: it may be offered memfds to copy from.
    copies: bool,
}

impl Direct {
    /// A direct way to the watcher on `socket` (its duplicate); `None` if it cannot be made.
    pub(crate) fn new(
        socket: std::os::fd::BorrowedFd<'_>,
        copies: bool,
    ) -> Option<std::sync::Arc<Direct>> {
        let fd = socket.try_clone_to_owned().ok()?;
        Some(std::sync::Arc::new(Direct {
            fd,
            unwritten: AtomicU64::new(0),
            copies,
        }))
    }

    /// The watch's task wrote (or failed to write) one offer it was queued.
    pub(crate) fn written(&self) {
        self.unwritten.fetch_sub(1, Ordering::AcqRel);
    }

    /// Writes `frame` whole, without waiting; false if it did not go (a full or closed
    /// socket: the offer is queued instead, and the task finds out). A frame of an inline
    /// offer (at most ~16 KiB) is one skb of the unix socket, written whole or not at all;
    /// should one go in part anyway, the socket is shut down: the watch ends (the subscriber
    /// hears of its versions from the broker and watches again after a backoff) rather than
    /// carry a torn frame.
    fn write(&self, frame: &[u8]) -> bool {
        self.write_passing(frame, None)
    }

    /// [`write`](Self::write), passing `fd` with the frame's first byte when given (a memfd
    /// to copy from, after its header).
    fn write_passing(&self, frame: &[u8], fd: Option<std::os::fd::BorrowedFd<'_>>) -> bool {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, Shutdown};
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(fd) = fd {
            fds = [fd];
            control.push(SendAncillaryMessage::ScmRights(&fds));
        }
        let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        let iov = [std::io::IoSlice::new(frame)];
        match rustix::net::sendmsg(&self.fd, &iov, &mut control, flags) {
            Ok(n) if n == frame.len() => true,
            Ok(0) | Err(_) => false,
            Ok(_) => {
                let _ = rustix::net::shutdown(&self.fd, Shutdown::Both);
                false
            }
        }
    }
}

/// The watchers of each name this node publishes.
#[derive(Debug, Default)]
pub(crate) struct Watchers {
    by_name: Mutex<HashMap<TensorName, Vec<Watcher>>>,
    next_id: AtomicU64,
    /// Counts the offers [`Watchers::offer`] writes itself (the tasks count theirs).
    written_out: Option<tb_dashboard::IntCounter>,
}

/// One watcher: the offers of its name as frames to write, until it is dropped (which takes
/// it out of [`Watchers`]).
pub(crate) struct Watch<'a> {
    _registered: Registered<'a>,
    offers: mpsc::Receiver<Offer>,
}

impl Watch<'_> {
    /// The next offer; `None` if the watchers were dropped.
    pub(crate) async fn next(&mut self) -> Option<Offer> {
        self.offers.recv().await
    }

    /// The next offer queued already, if any (never waits).
    pub(crate) fn try_next(&mut self) -> Option<Offer> {
        self.offers.try_recv().ok()
    }
}

/// A watcher's place in [`Watchers`]: dropping it takes the watcher out.
struct Registered<'a> {
    watchers: &'a Watchers,
    name: TensorName,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut by_name = self.watchers.lock();
        if let Some(list) = by_name.get_mut(&self.name) {
            list.retain(|w| w.id != self.id);
            if list.is_empty() {
                by_name.remove(&self.name);
            }
        }
    }
}

impl Watchers {
    /// Watchers counting the offers written straight to a socket in `written_out` (the
    /// node's `watch_offers_out`).
    pub(crate) fn new(written_out: tb_dashboard::IntCounter) -> Watchers {
        Watchers {
            written_out: Some(written_out),
            ..Watchers::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TensorName, Vec<Watcher>>> {
        self.by_name.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a watcher of `name` (`same_host`: over the same-host socket, which takes large
    /// versions too), or says why not (the limits).
    pub(crate) fn register(
        &self,
        name: &TensorName,
        same_host: bool,
    ) -> Result<Watch<'_>, DataResponse> {
        self.register_with(name, same_host, None)
    }

    /// [`register`](Self::register), with the watcher's socket for small offers written
    /// straight to it ([`Direct`]).
    pub(crate) fn register_with(
        &self,
        name: &TensorName,
        same_host: bool,
        direct: Option<std::sync::Arc<Direct>>,
    ) -> Result<Watch<'_>, DataResponse> {
        let busy = |message: String| {
            debug!(%message, "refusing a watch");
            DataResponse::Error {
                code: ErrorCode::Busy,
                message,
            }
        };
        let mut by_name = self.lock();
        let total: usize = by_name.values().map(Vec::len).sum();
        if total >= MAX_WATCHERS {
            let message = format!("this node serves {MAX_WATCHERS} watch streams already");
            return Err(busy(message));
        }
        let list = by_name.entry(name.clone()).or_default();
        if list.len() >= MAX_WATCHERS_PER_NAME {
            let message = format!("\"{name}\" has {MAX_WATCHERS_PER_NAME} watchers already");
            return Err(busy(message));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, offers) = mpsc::channel(QUEUE);
        list.push(Watcher {
            id,
            tx,
            same_host,
            direct,
        });
        let registered = Registered {
            watchers: self,
            name: name.clone(),
            id,
        };
        Ok(Watch {
            _registered: registered,
            offers,
        })
    }

    /// Offers `version` of `name` (`tensor`, as stored) to its watchers: a small host
    /// version to each (written straight to a same-host watcher's socket when nothing else
    /// is on its way to it, [`Direct`]), a larger one to same-host watchers with no offer
    /// pending; returns how many watchers it was written or queued for. Never waits.
    pub(crate) fn offer(&self, name: &TensorName, version: u64, tensor: &Tensor) -> usize {
        if tensor.host_data().is_none() {
            return 0;
        }
        let by_name = self.lock();
        let Some(list) = by_name.get(name) else {
            return 0;
        };
        let offer = Offer {
            version,
            tensor: tensor.clone(),
            sent: false,
        };
        let inline = offer.inline();
        // Encoded once, for the first watcher it is written to.
        let mut frame: Option<Option<Vec<u8>>> = None;
        #[cfg(target_os = "linux")]
        let mut to_copy: Option<Option<(Vec<u8>, std::os::fd::OwnedFd)>> = None;
        let mut offered = 0;
        for w in list {
            // A small version goes to each; a large one to same-host watchers with none
            // pending.
            let wanted = inline || (w.same_host && w.tx.capacity() == QUEUE);
            if !wanted {
                continue;
            }
            // A large one to copy, written here to a watcher that may copy it; the task is
            // handed it (its slot reserved first) to wait for the receipt.
            #[cfg(target_os = "linux")]
            if let Some(direct) = w
                .direct
                .as_ref()
                .filter(|d| !inline && d.copies && d.unwritten.load(Ordering::Acquire) == 0)
                && let Ok(permit) = w.tx.try_reserve()
            {
                let copy = to_copy
                    .get_or_insert_with(|| crate::channel::shm_copy_offer(&offer))
                    .as_ref();
                if let Some((frames, fd)) = copy {
                    use std::os::fd::AsFd;
                    direct.unwritten.fetch_add(1, Ordering::AcqRel);
                    if direct.write_passing(frames, Some(fd.as_fd())) {
                        permit.send(Offer {
                            sent: true,
                            ..offer.clone()
                        });
                        if let Some(out) = &self.written_out {
                            out.inc();
                        }
                        offered += 1;
                        continue;
                    }
                    direct.written();
                }
            }
            if let Some(direct) = w
                .direct
                .as_ref()
                .filter(|d| inline && d.unwritten.load(Ordering::Acquire) == 0)
            {
                let frame =
                    frame.get_or_insert_with(|| tb_proto::frame::encode(&offer.frame()).ok());
                if let Some(frame) = frame.as_deref()
                    && direct.write(frame)
                {
                    if let Some(out) = &self.written_out {
                        out.inc();
                    }
                    offered += 1;
                    continue;
                }
            }
            // Counted before it is queued: the task may write it before `try_send` returns.
            if let Some(direct) = &w.direct {
                direct.unwritten.fetch_add(1, Ordering::AcqRel);
            }
            if w.tx.try_send(offer.clone()).is_ok() {
                offered += 1;
            } else if let Some(direct) = &w.direct {
                direct.written();
            }
        }
        offered
    }

    /// Watchers now, of every name.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }
}

/// Serves a `Watch { name }` stream on QUIC: writes an `Offer` for each version offered
/// until the watcher closes the stream (or it stalls), or the node stops. Refused `Busy` past
/// the limits.
pub(crate) async fn serve(
    ctx: &NodeCtx,
    mut send: SendStream,
    mut recv: RecvStream,
    name: TensorName,
) {
    let stall = ctx.config.stall_timeout;
    let mut watch = match ctx.watchers.register(&name, false) {
        Ok(watch) => watch,
        Err(refusal) => {
            let _ = wire::write_frame_within(&mut send, &refusal, stall).await;
            let _ = send.finish();
            return;
        }
    };
    // The watcher sends nothing more: its side ending (a finish, a reset, the link) ends
    // the watch.
    let mut gone = Box::pin(async move {
        let mut buf = [0u8; 64];
        while let Ok(Some(_)) = recv.read(&mut buf).await {}
    });
    loop {
        let frame = tokio::select! {
            () = &mut gone => break,
            _ = ctx.cancel.cancelled() => break,
            offer = watch.next() => match offer {
                // Only inline offers are queued for a QUIC watcher.
                Some(offer) => offer.frame(),
                None => break,
            },
        };
        if let Err(e) = wire::write_frame_within(&mut send, &frame, stall).await {
            debug!(%e, %name, "a watch stream stalled or closed");
            break;
        }
        ctx.metrics.watch_offers_out.inc();
    }
    drop(watch);
    let _ = send.finish();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(bytes: &[u8]) -> Tensor {
        Tensor::from_bytes(bytes.to_vec())
    }

    #[tokio::test]
    async fn offers_reach_each_watcher_of_the_name_and_leave_with_it() {
        let watchers = Watchers::default();
        let w = TensorName::new("w").expect("name");
        let other = TensorName::new("other").expect("name");
        let mut one = watchers.register(&w, false).expect("first");
        let mut two = watchers.register(&w, true).expect("second");
        let bytes = [7u8; 100];
        assert_eq!(watchers.offer(&w, 3, &tensor(&bytes)), 2);
        assert_eq!(watchers.offer(&other, 1, &tensor(&bytes)), 0);
        for watch in [&mut one, &mut two] {
            let got = watch.next().await.expect("an offer").frame();
            let DataResponse::Offer {
                version,
                bytes: got,
                ..
            } = got
            else {
                panic!("not an offer: {got:?}");
            };
            assert_eq!((version, &got[..]), (3, &bytes[..]));
        }
        drop(one);
        assert_eq!(watchers.len(), 1);
        assert_eq!(watchers.offer(&w, 4, &tensor(&bytes)), 1);
    }

    #[tokio::test]
    async fn large_versions_go_to_same_host_watchers_one_at_a_time() {
        let watchers = Watchers::default();
        let w = TensorName::new("w").expect("name");
        let _quic = watchers.register(&w, false).expect("watch");
        let mut local = watchers.register(&w, true).expect("watch");
        let big = vec![3u8; MAX_INLINE_BYTES as usize + 1];
        assert_eq!(
            watchers.offer(&w, 1, &tensor(&big)),
            1,
            "the same-host watcher only"
        );
        // One pending already: the next large one waits for the broker's event.
        assert_eq!(watchers.offer(&w, 2, &tensor(&big)), 0);
        let got = local.next().await.expect("an offer");
        assert!(!got.inline());
        assert_eq!(got.version, 1);
        assert_eq!(got.tensor.host_data().map(|b| &b[..]), Some(&big[..]));
        assert_eq!(watchers.offer(&w, 3, &tensor(&big)), 1);
    }

    /// A non-blocking socket pair and a [`Direct`] to its first end (`copies`: the watcher
    /// proved read-write access).
    fn direct_pair(
        copies: bool,
    ) -> (
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
        std::sync::Arc<Direct>,
    ) {
        use std::os::fd::AsFd;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("pair");
        ours.set_nonblocking(true).expect("non-blocking");
        theirs.set_nonblocking(true).expect("non-blocking");
        let direct = Direct::new(ours.as_fd(), copies).expect("direct");
        (ours, theirs, direct)
    }

    /// The next frame on `sock` (non-blocking), decoded; `None` when nothing is there.
    fn frame_on(sock: &mut std::os::unix::net::UnixStream) -> Option<DataResponse> {
        use std::io::Read;
        let mut prefix = [0u8; tb_proto::frame::LEN_PREFIX];
        match sock.read_exact(&mut prefix) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return None,
            Err(e) => panic!("reading a frame: {e}"),
        }
        let mut body = vec![0u8; u32::from_le_bytes(prefix) as usize];
        sock.set_nonblocking(false).expect("blocking");
        sock.read_exact(&mut body).expect("the frame's body");
        sock.set_nonblocking(true).expect("non-blocking");
        Some(tb_proto::frame::decode_body(&body).expect("a frame"))
    }

    fn version_of(frame: Option<DataResponse>) -> u64 {
        match frame {
            Some(DataResponse::Offer { version, .. }) => version,
            other => panic!("not an offer: {other:?}"),
        }
    }

    #[tokio::test]
    async fn small_offers_go_straight_to_a_same_host_socket_in_order() {
        use std::io::Read;
        let written = tb_dashboard::IntCounter::new("w", "w").expect("counter");
        let watchers = Watchers::new(written.clone());
        let w = TensorName::new("w").expect("name");
        let (ours, mut theirs, direct) = direct_pair(true);
        let mut watch = watchers
            .register_with(&w, true, Some(direct.clone()))
            .expect("watch");
        let small = tensor(&[5u8; 100]);

        // Nothing on its way: written here, not queued.
        assert_eq!(watchers.offer(&w, 1, &small), 1);
        assert_eq!(version_of(frame_on(&mut theirs)), 1);
        assert_eq!(written.get(), 1);
        assert!(watch.offers.try_recv().is_err(), "nothing queued");

        // A full socket: the next offer is queued for the task...
        let junk = [0u8; 64 << 10];
        let mut filled = 0usize;
        while let Ok(n) = rustix::net::send(&ours, &junk, rustix::net::SendFlags::DONTWAIT) {
            filled += n;
            assert!(filled < 64 << 20, "the socket never filled");
        }
        assert_eq!(watchers.offer(&w, 2, &small), 1);
        let mut sink = vec![0u8; 64 << 10];
        while filled > 0 {
            filled -= theirs
                .read(&mut sink[..filled.min(64 << 10)])
                .expect("drain");
        }
        // ...and while it is unwritten, so is the one after (queued behind it), though the
        // socket has room again.
        assert_eq!(watchers.offer(&w, 3, &small), 1);
        assert!(frame_on(&mut theirs).is_none(), "nothing jumped the queue");
        for v in [2, 3] {
            assert_eq!(watch.next().await.expect("queued").version, v);
            direct.written();
        }
        // The task wrote them: the next one goes straight again.
        assert_eq!(watchers.offer(&w, 4, &small), 1);
        assert_eq!(version_of(frame_on(&mut theirs)), 4);
        assert_eq!(written.get(), 2);
    }

    /// A large version in a memfd goes straight to a same-host watcher that may copy: its
    /// header and the memfd on the socket, then queued marked sent (the task waits for the
    /// receipt), and nothing more goes until the task is done with it. A watcher that may
    /// not copy gets it queued for the task, unsent.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn large_offers_to_copy_go_straight_with_their_memfd() {
        let written = tb_dashboard::IntCounter::new("w", "w").expect("counter");
        let watchers = Watchers::new(written.clone());
        let w = TensorName::new("w").expect("name");
        let (_ours, theirs, direct) = direct_pair(true);
        let mut watch = watchers
            .register_with(&w, true, Some(direct.clone()))
            .expect("watch");
        let big: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
        let version = tensor(&big);
        assert!(version.made_region().is_some(), "1 MiB lies in a memfd");

        assert_eq!(watchers.offer(&w, 1, &version), 1);
        assert_eq!(written.get(), 1);
        // The header and the payload's frame, in one message with the memfd.
        let mut buf = vec![0u8; 4096];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let got = rustix::net::recvmsg(
            &theirs,
            &mut iov,
            &mut control,
            rustix::net::RecvFlags::empty(),
        )
        .expect("the offer");
        let mut fds = Vec::new();
        for message in control.drain() {
            if let rustix::net::RecvAncillaryMessage::ScmRights(passed) = message {
                fds.extend(passed);
            }
        }
        assert_eq!(fds.len(), 1, "the memfd came with it");
        let mut copied = vec![0u8; big.len()];
        rustix::io::pread(&fds[0], &mut copied, 0).expect("read through the passed fd");
        assert!(copied == big, "the memfd holds the version's bytes");
        let mut frames = &buf[..got.bytes];
        let mut next = || {
            let len = u32::from_le_bytes(frames[..4].try_into().expect("prefix")) as usize;
            let body = &frames[4..4 + len];
            frames = &frames[4 + len..];
            body.to_vec()
        };
        let header: DataResponse = tb_proto::frame::decode_body(&next()).expect("header");
        assert!(matches!(header, DataResponse::Header { version: 1, .. }));
        let payload: tb_proto::ShmPayload = tb_proto::frame::decode_body(&next()).expect("kind");
        assert!(matches!(
            payload,
            tb_proto::ShmPayload::MemfdCopy { offset: 0 }
        ));
        // Queued for its receipt; meanwhile no other offer jumps ahead or piles up.
        let queued = watch.next().await.expect("queued");
        assert!(queued.sent && queued.version == 1);
        assert_eq!(watchers.offer(&w, 2, &tensor(&[7u8; 100])), 1);
        assert!(
            !watch.next().await.expect("queued").sent,
            "queued behind the receipt"
        );
        direct.written();
        direct.written();

        // A watcher that may not copy: queued for the task to send.
        let (_ours, _theirs, reader) = direct_pair(false);
        let x = TensorName::new("x").expect("name");
        let mut only_reads = watchers
            .register_with(&x, true, Some(reader))
            .expect("watch");
        assert_eq!(watchers.offer(&x, 1, &version), 1);
        assert!(!only_reads.next().await.expect("queued").sent);
        assert_eq!(written.get(), 1, "not written straight");
    }

    #[test]
    fn full_queues_skip() {
        let watchers = Watchers::default();
        let w = TensorName::new("w").expect("name");
        let _watch = watchers.register(&w, false).expect("watch");
        let small = [1u8; 8];
        for v in 0..QUEUE as u64 {
            assert_eq!(watchers.offer(&w, v + 2, &tensor(&small)), 1);
        }
        // Nobody reads: the queue is full, the next offer is skipped, nothing blocks.
        assert_eq!(watchers.offer(&w, 100, &tensor(&small)), 0);
    }

    #[test]
    fn watchers_per_name_are_bounded() {
        let watchers = Watchers::default();
        let w = TensorName::new("w").expect("name");
        let held: Vec<_> = (0..MAX_WATCHERS_PER_NAME)
            .map(|_| watchers.register(&w, false).expect("under the cap"))
            .collect();
        assert!(watchers.register(&w, true).is_err());
        let other = TensorName::new("x").expect("name");
        assert!(watchers.register(&other, false).is_ok());
        drop(held);
        assert!(watchers.register(&w, false).is_ok());
    }
}
