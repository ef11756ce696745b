//! The `shm` channel: same-host shared memory (Linux).
//!
//! Each node listens on a Unix socket in the abstract namespace under a random name, and
//! tells each peer, inside the authenticated QUIC link only, that name and a token for
//! exactly that peer (a keyed BLAKE3 MAC of its node id and the access it proved, under a
//! key that never leaves this process). A peer that can connect to the name is on this host
//! and in this network namespace — abstract sockets exist nowhere else — and it proves who it
//! is with the token; both sides also check that the other end runs as the same user
//! (`SO_PEERCRED`). Nothing is assumed from an IP address.
//!
//! Once connected, the pair's requests (`Pull`, `Push`, `Watch`) travel on the socket in the
//! same frames as on QUIC ([`socket`]); so do requests of a service kind (remote calls), whose
//! two directions are chunk-framed after the request ([`call`]). Pulled payloads up to [`PULL_INLINE_MAX`] (64 KiB),
//! and pushed ones and a watch's offers up to [`INLINE_MAX`] (4 MiB), follow inline: a
//! `pull_into` reads into the caller's buffer, the others into plain memory up to 64 KiB and
//! above that a memfd from this process's pool, 64 KiB at a time through a bounce buffer
//! (hashed there while in cache, written with `pwrite`: no writable mapping, and a pooled
//! memfd is read through the mapping it kept), which the tensor then owns and gives back to
//! the pool when dropped. The sender's memfd stays unsealed, so it too goes back to its pool:
//! neither side writes a version into fresh memory. Larger payloads are passed as the sealed
//! memfd that holds them ([`region`]): a `get` maps it read-only (zero-copy: the tensor
//! borrows the mapping, which stays valid while a reader holds it, even after the version is
//! evicted), a `pull_into` copies out of it with `pread` on two threads.
//!
//! A push of raw bytes (`Node::push_bytes`) up to 4 MiB is hashed as it is written, in the
//! same 64 KiB pieces, and its hash follows the bytes (`ShmPayload::InlineHashAfter`): the
//! sender's hash overlaps the transfer and the receiver's hash instead of preceding them.
//!
//! Integrity: inline payloads are hashed and checked as on QUIC as they are read (except a
//! pulled or offered one above 64 KiB from a read-write holder, trusted as its memfds are:
//! `hash_inline`); a push sent with its hash after the bytes is checked against that hash,
//! and the tensor's hash is what arrived. A memfd is accepted only
//! sealed against writes and resizes (checked with `F_GET_SEALS`), so its bytes cannot change
//! once its holder sealed it. Whether its bytes are hashed depends on who sent it:
//! - a pull from a holder that proved read-write access is not hashed again: the holder
//!   verified (or computed) the hash, and a member that could publish any bytes it likes
//!   gains nothing by lying here;
//! - a pull from a holder that proved only read-only access, and every push, is hashed on
//!   every core before anyone sees the bytes; a mismatch is `Corrupt`.
//!
mod call;
mod client;
pub(crate) mod ctl;
mod peer_maps;
mod pool;
mod region;
mod serve;
mod socket;
mod watch;

use std::{
    collections::HashMap,
    os::{fd::OwnedFd, linux::net::SocketAddrExt, unix::net::SocketAddr},
    sync::{Arc, Mutex, MutexGuard, OnceLock},
};

use bytes::Bytes;
use iroh::EndpointId;
use tb_proto::{Access, ChannelOffer, ContentHash, TensorMeta, channel::SHM_SOCKET_NAME_LEN};

pub(crate) use call::{CallRecv, CallSend, open_socket_request, reading_sockets};
pub use call::{ChunksRead, frame_chunks, read_chunks};
pub use region::force_map_failures_for_tests;
pub(crate) use region::{Region, RegionFill, RegionWriter};
pub(crate) use serve::spawn_listener;
pub(crate) use socket::ShmStream;
pub(crate) use watch::{ShmWatch, WatchOffer, copy_offer};

use super::{HostBuf, verify};
use crate::{
    error::{Error, Result},
    tensor::Tensor,
};

/// Pushes up to this size travel inline on the socket, into a buffer the receiver takes from
/// its memfd pool, and a reader takes no larger inline payload (it also bounds what a reader
/// allocates before a byte of it is verified). A push is hashed by its receiver whichever
/// way it comes, so inline it costs one copy more and saves the pusher's memfd: a passed
/// memfd is sealed for good and never recycled, so every later version of that size would be
/// written into fresh pages (about 1.1-1.5 GB/s on a VM, against 10-40 GB/s into recycled
/// ones). Measured on the 2-core VM: a 1 MiB push 0.8 -> 1.3 GB/s. Pulls inline only up to
/// [`PULL_INLINE_MAX`].
pub(crate) const INLINE_MAX: usize = 4 << 20;
/// Pulls up to this size travel inline; larger ones pass the holder's sealed memfd, which the
/// reader maps (zero-copy). Inline up to 4 MiB was tried and measured worse between
/// processes: by name at 1 MiB 245 MB/s against 390-540 with the memfd passed (the holder
/// reads its region page by page through its mapping, and two copies with socket hand-offs
/// cost more than a mapping the reader faults in).
pub(crate) const PULL_INLINE_MAX: usize = 64 << 10;

/// Largest pulled payload passed as the holder's memfd to copy out of
/// ([`ShmPayload::MemfdCopy`](tb_proto::ShmPayload), to a read-write reader); larger ones
/// pass the sealed memfd, which the reader maps.
pub(crate) const PULL_COPY_MAX: usize = 16 << 20;
/// Inline payloads up to this size are hashed on the runtime's thread (a few microseconds);
/// larger ones on every core, with the runtime told first ([`verify::check_all`]).
const HASH_IN_PLACE_MAX: usize = 64 << 10;
/// Idle client connections kept per peer: as many as calls in flight to one server commonly
/// are (each call takes a connection of its own while it runs; one found idle saves a
/// connect, a hello and the peer's admission).
const MAX_IDLE_PER_PEER: usize = 64;
/// Idle client connections kept over all peers (each holds a descriptor here and a serving
/// task at the peer, until its idle timeout).
const MAX_IDLE: usize = 512;
/// Peers with idle client connections, at most: a peer's entry is dropped with its link, but a
/// transfer that ends after that may pool its connection again, so the table is bounded too.
const MAX_IDLE_PEERS: usize = 256;
/// Domain separation of the admission token MAC.
const TOKEN_CONTEXT: &[u8] = b"tensor-broker shm admission v1";

/// The sealed memfd of a tensor's bytes, shared by the tensor's clones: made on first need,
/// or given when the bytes came from a peer's memfd.
#[derive(Clone, Default)]
pub(crate) struct ShmCache(Arc<OnceLock<Arc<Region>>>);

impl std::fmt::Debug for ShmCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "ShmCache(made)"
        } else {
            "ShmCache(-)"
        })
    }
}

impl ShmCache {
    /// A cache holding `region` already.
    pub(crate) fn of(region: Arc<Region>) -> Self {
        let cell = OnceLock::new();
        let _ = cell.set(region);
        ShmCache(Arc::new(cell))
    }

    /// The region, if made or given.
    pub(crate) fn get(&self) -> Option<Arc<Region>> {
        self.0.get().cloned()
    }

    /// The region, copied from `bytes` on first call (racing callers may both copy; one wins).
    pub(crate) fn get_or_copy(&self, bytes: &Bytes) -> Result<Arc<Region>> {
        if let Some(region) = self.0.get() {
            return Ok(region.clone());
        }
        let made = Arc::new(Region::copy_of(bytes)?);
        Ok(self.0.get_or_init(|| made).clone())
    }
}

/// Whether this kernel makes, seals and maps memfds as the channel and the memfd store do
/// (checked once per process).
pub(crate) fn memfds_work() -> bool {
    region::probe().is_ok()
}

/// What a transfer to a peer needs to use the shm channel: this node's end, the peer (and
/// the access it proved), and the peer's socket name and this node's token on it.
#[derive(Debug, Clone)]
pub(crate) struct ShmRoute {
    pub(crate) shm: Arc<Shm>,
    pub(crate) peer: EndpointId,
    /// What the peer proved on its link: a memfd from a read-only holder is hashed before
    /// anyone sees its bytes (a read-write member could as well publish other bytes).
    pub(crate) access: Access,
    pub(crate) socket: [u8; SHM_SOCKET_NAME_LEN],
    pub(crate) token: [u8; 32],
}

impl ShmRoute {
    /// The route to `peer`, which proved `access`, whose offer named `socket` and gave this
    /// node `token`.
    pub(crate) fn new(
        shm: Arc<Shm>,
        peer: EndpointId,
        access: Access,
        socket: [u8; SHM_SOCKET_NAME_LEN],
        token: [u8; 32],
    ) -> Self {
        ShmRoute {
            shm,
            peer,
            access,
            socket,
            token,
        }
    }
}

/// This node's end of the shm channel: its socket's name, the token key, and idle client
/// connections per peer.
#[derive(Debug)]
pub(crate) struct Shm {
    name: [u8; SHM_SOCKET_NAME_LEN],
    key: [u8; 32],
    uid: u32,
    listener: Mutex<Option<std::os::unix::net::UnixListener>>,
    idle: Mutex<HashMap<EndpointId, Vec<ShmStream>>>,
    /// Client connections this node opened (a new socket and hello; not one from the pool).
    opened: std::sync::atomic::AtomicU64,
}

impl Shm {
    /// Binds a fresh abstract socket (the accept loop starts with [`spawn_listener`]).
    pub(crate) fn bind() -> Result<Shm> {
        // Before anything is offered or copied: a kernel that refuses the mappings switches
        // the channel off for the process (the caller warns once and counts it).
        region::probe().map_err(|e| Error::Io(format!("this kernel refuses shm: {e}")))?;
        let mut name = [0u8; SHM_SOCKET_NAME_LEN];
        let mut key = [0u8; 32];
        super::fill_random(&mut name)?;
        super::fill_random(&mut key)?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&socket_addr(&name)?)
            .map_err(|e| Error::io("binding the same-host socket", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("binding the same-host socket", e))?;
        Ok(Shm {
            name,
            key,
            uid: rustix::process::getuid().as_raw(),
            listener: Mutex::new(Some(listener)),
            idle: Mutex::new(HashMap::new()),
            opened: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The offer for `peer`, which proved `access`.
    pub(crate) fn offer(&self, peer: EndpointId, access: Access) -> ChannelOffer {
        ChannelOffer::Shm {
            socket: self.name,
            token: self.token(peer.as_bytes(), access),
        }
    }

    /// The admission token of `node` with `access` on this node's socket.
    fn token(&self, node: &[u8; 32], access: Access) -> [u8; 32] {
        let mut mac = blake3::Hasher::new_keyed(&self.key);
        mac.update(TOKEN_CONTEXT);
        mac.update(node);
        mac.update(&[access as u8]);
        *mac.finalize().as_bytes()
    }

    fn idle(&self) -> MutexGuard<'_, HashMap<EndpointId, Vec<ShmStream>>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Client connections opened so far (each a connect and a hello).
    pub(crate) fn opened(&self) -> u64 {
        self.opened.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// An idle connection to `peer`, if one is pooled.
    fn take_idle(&self, peer: &EndpointId) -> Option<ShmStream> {
        self.idle().get_mut(peer).and_then(Vec::pop)
    }

    /// Pools a connection whose last exchange completed cleanly.
    fn put_idle(&self, peer: EndpointId, conn: ShmStream) {
        let mut idle = self.idle();
        if idle.len() >= MAX_IDLE_PEERS && !idle.contains_key(&peer) {
            return;
        }
        let total: usize = idle.values().map(Vec::len).sum();
        let conns = idle.entry(peer).or_default();
        if conns.len() < MAX_IDLE_PER_PEER && total < MAX_IDLE {
            conns.push(conn);
        }
    }

    /// Drops the idle connections to `peer` (its channel failed, or it offered a new one).
    pub(crate) fn forget(&self, peer: &EndpointId) {
        self.idle().remove(peer);
    }
}

/// A tensor over the payload at `offset` of a peer's memfd (checked as
/// [`Region::from_peer`] checks it), borrowing the mapping: zero-copy. A tensor that is the
/// whole memfd keeps it, to pass on to other same-host peers without a copy.
fn tensor_from_memfd(fd: OwnedFd, offset: u64, meta: TensorMeta) -> Result<Tensor> {
    let too_large = || Error::TooLarge(format!("a payload of {} bytes at {offset}", meta.byte_len));
    let end = offset.checked_add(meta.byte_len).ok_or_else(too_large)?;
    let start = usize::try_from(offset).map_err(|_| too_large())?;
    let stop = usize::try_from(end).map_err(|_| too_large())?;
    let (region, whole) = Region::from_peer(fd, end)?;
    let region = Arc::new(region);
    let bytes = region.slice(start..stop);
    // The whole file can be passed on as it is; a payload inside it is still viewed from it.
    Ok(if start == 0 && whole {
        Tensor::from_shared(meta, bytes, ShmCache::of(region), None)
    } else {
        Tensor::from_shared(meta, bytes, ShmCache::default(), Some((region, start)))
    })
}

/// A tensor of `meta` made of a copy of the payload at `offset` of a peer's memfd (sent as
/// [`ShmPayload::MemfdCopy`](tb_proto::ShmPayload)), in a memfd of this process's pool: one
/// copy, nothing on the socket, through the mapping of the peer's buffer kept from its
/// previous offer ([`peer_maps`]) or, where the buffer cannot be kept mapped, by the kernel;
/// the peer's fd is closed before this returns. Hashed, naming `what` when it does not match, when `verify` (the peer
/// proved only read-only access). At most [`INLINE_MAX`] bytes.
fn tensor_copied_from_memfd(
    fd: OwnedFd,
    offset: u64,
    meta: &TensorMeta,
    verify: bool,
    what: &str,
) -> Result<Tensor> {
    let len = copy_len(meta)?;
    if len == 0 {
        return Err(Error::Io(format!(
            "{what}: an empty payload sent as a memfd"
        )));
    }
    let mut fill = region::RegionFill::new(len)?;
    match peer_maps::copy(&fd, offset, &mut fill) {
        Some(copied) => copied?,
        None => fill.copy_from(&fd, offset)?,
    }
    drop(fd);
    let tensor = Tensor::from_region(meta.clone(), fill.finish()?);
    if verify {
        verify::check_all(tensor.data(), meta.hash, what)?;
    }
    Ok(tensor)
}

/// The length of an inline payload of `meta`, refused unless it is within [`INLINE_MAX`]:
/// checked before anything is allocated for it (`meta` comes from a peer, validated against
/// the tensor size limit only).
fn inline_len(meta: &TensorMeta) -> Result<usize> {
    len_within(meta, INLINE_MAX, "an inline payload")
}

/// The length of a payload of `meta` passed to copy out of, refused unless it is within
/// [`PULL_COPY_MAX`] (watches pass at most [`INLINE_MAX`]): checked before anything is
/// allocated for it.
fn copy_len(meta: &TensorMeta) -> Result<usize> {
    len_within(meta, PULL_COPY_MAX, "a payload to copy out of a memfd")
}

/// `meta`'s length, or an error naming `what` when it is above `max`.
fn len_within(meta: &TensorMeta, max: usize, what: &str) -> Result<usize> {
    match usize::try_from(meta.byte_len) {
        Ok(len) if len <= max => Ok(len),
        _ => Err(Error::Io(format!(
            "{what} of {} bytes (the limit is {max})",
            meta.byte_len
        ))),
    }
}

/// Whether an inline payload of `len` bytes is hashed by its reader: always for a push and
/// from a holder that proved only read-only access, and when small (it costs less than
/// deciding not to); not from a read-write holder above that, the trust its memfds get (a
/// read-write member could as well publish other bytes; the holder hashed them when it
/// wrote them, and its region never changes).
fn hash_inline(len: usize, holder: Option<Access>) -> bool {
    len <= HASH_IN_PLACE_MAX || holder != Some(Access::ReadWrite)
}

/// Reads an inline payload of `meta` into a buffer of its own, hash-checked unless
/// [`hash_inline`] says not (`holder`: the access of the holder it was pulled from, `None`
/// for a push): a host tensor in a pooled memfd (plain memory up to 64 KiB), one copy from
/// the socket.
async fn read_inline(
    conn: &mut ShmStream,
    meta: &TensorMeta,
    what: &str,
    holder: Option<Access>,
) -> Result<Tensor> {
    let len = inline_len(meta)?;
    if len > super::PRIVATE_COPY_MAX && memfds_work() {
        let mut sink = Sink::new(len)?;
        let check = hash_inline(len, holder);
        let mut hasher = blake3::Hasher::new();
        read_pieces(conn, &mut sink, len, check.then_some(&mut hasher)).await?;
        if check {
            check_hash(hasher.finalize().into(), meta, what)?;
        }
        return sink.into_tensor(meta.clone());
    }
    let mut buf = HostBuf::new(len)?;
    read_inline_into(conn, buf.as_mut(), meta, what, holder).await?;
    buf.into_tensor(meta.clone())
}

/// Reads a payload sent as [`ShmPayload::InlineHashAfter`](tb_proto::ShmPayload): the bytes
/// of a tensor of `meta` (whose hash is not looked at), hashed as they arrive, then the
/// sender's hash of them. They must agree (else `Corrupt`, naming `what`); the tensor's hash
/// is that one.
async fn read_hashed_after(conn: &mut ShmStream, meta: &TensorMeta, what: &str) -> Result<Tensor> {
    let len = inline_len(meta)?;
    let mut sink = Sink::new(len)?;
    let mut hasher = blake3::Hasher::new();
    read_pieces(conn, &mut sink, len, Some(&mut hasher)).await?;
    let mut sent = [0u8; 32];
    conn.read_exact(&mut sent).await?;
    let (hash, sent): (ContentHash, _) = (hasher.finalize().into(), ContentHash(sent));
    if hash != sent {
        return Err(Error::Corrupt(format!(
            "{what}: the bytes hash to {hash}, the sender's hash after them is {sent}"
        )));
    }
    let meta = TensorMeta {
        hash,
        ..meta.clone()
    };
    sink.into_tensor(meta)
}

/// Bytes of an inline payload read, hashed and written at a time by [`read_pieces`]: small
/// enough to stay in a core's cache between the three.
const FILL_PIECE: usize = 64 << 10;

/// Where [`read_pieces`] puts a payload.
enum Sink {
    /// A memfd of this process's pool, filled with `pwrite` (above 64 KiB).
    Memfd(RegionFill),
    /// Plain memory.
    Heap(Vec<u8>),
}

impl Sink {
    /// A sink for `len` bytes: a memfd above [`PRIVATE_COPY_MAX`](super::PRIVATE_COPY_MAX)
    /// where memfds work (plain memory when none can be made), else plain memory.
    fn new(len: usize) -> Result<Sink> {
        if len > super::PRIVATE_COPY_MAX && memfds_work() {
            match RegionFill::new(len) {
                Ok(fill) => return Ok(Sink::Memfd(fill)),
                // Out of descriptors or memory: plain memory still holds the bytes.
                Err(err) => {
                    tracing::debug!(%err, len, "no memfd for an inline payload: plain memory")
                }
            }
        }
        Ok(Sink::Heap(vec![0u8; len]))
    }

    fn write(&mut self, piece: &[u8], at: usize) -> Result<()> {
        match self {
            Sink::Memfd(fill) => fill.write_at(piece, at),
            Sink::Heap(vec) => {
                let dest = (vec.get_mut(at..at + piece.len()))
                    .ok_or_else(|| Error::Io(format!("a piece at {at} past a payload's end")))?;
                dest.copy_from_slice(piece);
                Ok(())
            }
        }
    }

    /// The filled sink as a tensor of `meta` (whose hash its bytes were checked against).
    fn into_tensor(self, meta: TensorMeta) -> Result<Tensor> {
        match self {
            Sink::Memfd(fill) => Ok(Tensor::from_region(meta, fill.finish()?)),
            Sink::Heap(vec) => Ok(Tensor::from_verified(meta, Bytes::from(vec))),
        }
    }
}

/// Reads `len` payload bytes into `sink` through a bounce buffer of [`FILL_PIECE`] bytes,
/// each piece hashed into `hasher` (when given) while it is in cache, then written. So the
/// hash runs while the sender is still writing the next pieces, and a memfd is never mapped
/// writable: a pooled one is read through the mapping it kept, with no page-table work on
/// either side (mapping 1 MiB writable, then read-only, cost ~240 us on the development VM,
/// as much as moving it).
async fn read_pieces(
    conn: &mut ShmStream,
    sink: &mut Sink,
    len: usize,
    mut hasher: Option<&mut blake3::Hasher>,
) -> Result<()> {
    let mut bounce = vec![0u8; FILL_PIECE.min(len)];
    let mut at = 0;
    // Bounded: each round reads a piece of at least one byte, or fails.
    while at < len {
        let piece = &mut bounce[..FILL_PIECE.min(len - at)];
        conn.read_exact(piece).await?;
        if let Some(hasher) = hasher.as_mut() {
            hasher.update(piece);
        }
        sink.write(piece, at)?;
        at += piece.len();
    }
    Ok(())
}

/// Reads an inline payload of `meta` into `dest` (exactly its length, at most
/// [`INLINE_MAX`]) and checks it against `meta`'s hash unless [`hash_inline`] says not: a
/// mismatch is `Corrupt`, naming `what`.
async fn read_inline_into(
    conn: &mut ShmStream,
    dest: &mut [u8],
    meta: &TensorMeta,
    what: &str,
    holder: Option<Access>,
) -> Result<()> {
    if dest.len() != inline_len(meta)? {
        return Err(Error::InvalidTensor(format!(
            "{what}: destination buffer has {} bytes, the tensor {}",
            dest.len(),
            meta.byte_len
        )));
    }
    conn.read_exact(dest).await?;
    if !hash_inline(dest.len(), holder) {
        return Ok(());
    }
    // Hashed right after: on every core (the runtime told first) unless the payload is small.
    if dest.len() > HASH_IN_PLACE_MAX {
        return verify::check_all(dest, meta.hash, what);
    }
    check_hash(ContentHash::of(dest), meta, what)
}

/// `Corrupt`, naming `what`, unless `hash` is `meta`'s.
fn check_hash(hash: ContentHash, meta: &TensorMeta, what: &str) -> Result<()> {
    if hash != meta.hash {
        return Err(Error::Corrupt(format!(
            "{what}: expected hash {}, got {hash}",
            meta.hash
        )));
    }
    Ok(())
}

/// The abstract address for a socket name.
fn socket_addr(name: &[u8; SHM_SOCKET_NAME_LEN]) -> Result<SocketAddr> {
    let text = format!("tensor-broker/{}", hex::encode(name));
    SocketAddr::from_abstract_name(text.as_bytes())
        .map_err(|e| Error::io("naming the same-host socket", e))
}

#[cfg(test)]
mod tests;
