//! Requests of a service kind (a remote call: [`Node::open_request`](crate::Node::open_request))
//! on a same-host connection: the pair's socket instead of a QUIC stream, a fraction of a QUIC
//! round trip (no encryption, acknowledgements or endpoint task between the two processes).
//!
//! After the `DataRequest` frame, each direction is a sequence of chunks, `[u32 LE length]`
//! then that many bytes, up to [`MAX_CHUNK`]: a length of 0 ends the direction (a QUIC
//! stream's finish) and [`RESET`] aborts it. A connection is pooled again (the caller's) or
//! served again (the server's) only when both directions ended with their end chunk and
//! nothing was left half written; anything else (a cancelled call, a dropped half, a peer
//! gone) closes it, which the other side reads as the peer gone: the server's
//! [`stopped`](CallSend::stopped) completes, the caller's read fails.
//!
//! The reading state lives behind a lock that is never held across an await, so
//! [`CallSend::stopped`] can consume the peer's end chunk while nothing else reads (a unary
//! call's server reads the arguments, then only watches for the caller going).

use std::{
    io::IoSlice,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
};

use std::time::Duration;

use iroh::EndpointId;
use rustix::net::{RecvFlags, SendFlags};
use tb_proto::{DataRequest, DataResponse, ErrorCode, frame};
use tokio::{io::Interest, net::UnixStream, sync::oneshot};

use super::{
    Shm, ShmRoute,
    socket::{ReadBuf, ShmStream, within},
};
use crate::{
    RequestRecv, RequestStream,
    channel::ChannelError,
    ctx::NodeCtx,
    error::{Error, Result},
};

/// Most bytes one chunk carries (a larger length breaks the protocol).
pub(crate) const MAX_CHUNK: usize = 4 << 20;
/// The length that aborts a direction.
const RESET: u32 = u32::MAX;
/// Room the reading buffer has for each `recv`.
const READ_PIECE: usize = 64 << 10;
/// Reads at least this large go from the socket straight into the reader's buffer.
const DIRECT_MIN: usize = 16 << 10;

/// Where a connection goes once a request on it ended cleanly.
pub(crate) enum Back {
    /// The caller's: into the pool, for its next request to `peer`.
    Pool(Arc<Shm>, EndpointId),
    /// The server's: back to the loop that serves the connection.
    Serve(oneshot::Sender<ShmStream>),
}

/// The two halves of one request's connection.
pub(crate) fn halves(conn: ShmStream, back: Back) -> (CallSend, CallRecv) {
    let (stream, read) = conn.into_parts();
    let shared = Arc::new(Shared {
        stream: Some(stream),
        heard: Arc::new(AtomicU64::new(0)),
        reader: Mutex::new(Reader::new(read)),
        written: Mutex::new(Written::Open),
        back: Mutex::new(Some(back)),
    });
    let send = CallSend {
        shared: shared.clone(),
    };
    (send, CallRecv { shared })
}

struct Shared {
    /// `None` only while the last half drops (the connection is handed back then).
    stream: Option<UnixStream>,
    /// Bytes read from the peer (how a caller tells a quiet peer from a lost one).
    heard: Arc<AtomicU64>,
    reader: Mutex<Reader>,
    written: Mutex<Written>,
    back: Mutex<Option<Back>>,
}

/// How far this side's direction got.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Written {
    Open,
    /// A chunk went out in part (a write failed or was cancelled): the connection is done.
    Torn,
    /// The end chunk went out.
    Ended,
}

/// What was read of the peer's direction and not yet consumed, and where its chunks stand.
struct Reader {
    /// The connection's read buffer, taken over for the request and handed back after it.
    read: ReadBuf,
    /// Bytes left of the current chunk (0: a length comes next).
    left: usize,
    /// The peer's end chunk was consumed.
    end: bool,
    /// Why nothing more can be read (the peer closed, reset, or broke the protocol).
    gone: Option<String>,
}

impl Reader {
    fn new(read: ReadBuf) -> Self {
        Reader {
            read,
            left: 0,
            end: false,
            gone: None,
        }
    }

    fn buffered(&self) -> &[u8] {
        self.read.buffered()
    }

    /// Consumes the lengths buffered at chunk boundaries (empty chunks never come: a
    /// length of 0 is the end).
    fn parse(&mut self) {
        while self.left == 0 && !self.end && self.gone.is_none() {
            let Some(prefix) = self.buffered().first_chunk::<4>() else {
                return;
            };
            let len = u32::from_le_bytes(*prefix);
            self.read.start += 4;
            match len {
                0 => self.end = true,
                RESET => self.gone = Some("the peer abandoned the request".into()),
                n if n as usize > MAX_CHUNK => {
                    self.gone = Some(format!("a chunk of {n} bytes (the most is {MAX_CHUNK})"));
                }
                n => self.left = n as usize,
            }
        }
    }

    /// Copies buffered bytes of the current chunk into `dest`.
    fn take(&mut self, dest: &mut [u8]) -> usize {
        let n = dest.len().min(self.left).min(self.buffered().len());
        dest[..n].copy_from_slice(&self.buffered()[..n]);
        self.read.start += n;
        self.left -= n;
        n
    }

    /// Room for the next read at the buffer's end, the consumed bytes dropped first; `end`
    /// then advances by what was read into it.
    fn room(&mut self) -> &mut [u8] {
        let read = &mut self.read;
        read.compact();
        if read.buf.len() - read.end < READ_PIECE / 2 {
            read.buf.resize(read.end + READ_PIECE, 0);
        }
        &mut read.buf[read.end..]
    }

    /// One non-blocking `recv` of what the socket holds into the buffer: `true` when
    /// something happened (bytes came, or the peer is gone), `false` when nothing is there
    /// yet (the socket's readiness is cleared).
    fn fill(&mut self, stream: &UnixStream, heard: &AtomicU64) -> bool {
        let got = recv_polled(stream, self.room());
        match got {
            Ok(0) => self.gone = Some("the peer closed the connection".into()),
            Ok(n) => {
                self.read.end += n;
                heard.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) => self.gone = Some(format!("reading from a same-host peer: {e}")),
        }
        true
    }
}

impl Shared {
    fn stream(&self) -> Result<&UnixStream> {
        self.stream
            .as_ref()
            .ok_or_else(|| Error::Io("the same-host connection is gone".into()))
    }

    fn reader(&self) -> MutexGuard<'_, Reader> {
        self.reader.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn written(&self) -> MutexGuard<'_, Written> {
        self.written.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Shared {
    /// Hands the connection back when both directions ended cleanly (the peer's end chunk
    /// read, or waiting in the socket: read now without blocking); else it closes here.
    fn drop(&mut self) {
        let Some(stream) = self.stream.take() else {
            return;
        };
        let reader = self.reader.get_mut().unwrap_or_else(|p| p.into_inner());
        reader.parse();
        let unread_end = !reader.end && reader.left == 0 && reader.gone.is_none();
        if unread_end && reader.fill(&stream, &self.heard) {
            reader.parse();
        }
        let written = *self.written.get_mut().unwrap_or_else(|p| p.into_inner());
        let clean = reader.end && reader.gone.is_none() && written == Written::Ended;
        let back = self
            .back
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let (true, Some(back)) = (clean, back) else {
            return;
        };
        let conn = ShmStream::from_parts(stream, std::mem::take(&mut reader.read));
        match back {
            Back::Pool(shm, peer) => shm.put_idle(peer, conn),
            Back::Serve(tx) => {
                let _ = tx.send(conn);
            }
        }
    }
}

/// This side's direction of a request on a same-host connection.
pub(crate) struct CallSend {
    shared: Arc<Shared>,
}

impl CallSend {
    /// Writes `bytes` (nothing for none).
    pub(crate) async fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        self.write_parts(&[], &[bytes], false).await
    }

    /// Writes `prefix` as it is (a frame before the chunks begin), then `parts` as chunks
    /// (one for all of them when they fit in one), then the end chunk when `end`: one
    /// `sendmsg` for all of it when it fits.
    pub(crate) async fn write_parts(
        &mut self,
        prefix: &[u8],
        parts: &[&[u8]],
        end: bool,
    ) -> Result<()> {
        if *self.shared.written() != Written::Open {
            return Err(Error::Io("writing a same-host request that ended".into()));
        }
        let mut lens = Vec::new();
        let pieces = framed(prefix, parts, end, &mut lens);
        *self.shared.written() = Written::Torn;
        send_all(self.shared.stream()?, &pieces).await?;
        *self.shared.written() = if end { Written::Ended } else { Written::Open };
        Ok(())
    }

    /// Ends this direction (the peer reads its end); again: nothing.
    pub(crate) async fn finish(&mut self) -> Result<()> {
        if *self.shared.written() == Written::Ended {
            return Ok(());
        }
        self.write_parts(&[], &[], true).await
    }

    /// Completes when the peer is gone (it closed the connection: a cancelled call) or broke
    /// the protocol; also consumes the peer's end chunk when nothing else reads.
    pub(crate) fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            // Bounded by the peer: each round reads what arrived or waits for more.
            loop {
                {
                    let Ok(stream) = shared.stream() else { return };
                    let mut reader = shared.reader();
                    reader.parse();
                    // Bytes after the peer's end, before this side's: the protocol broke.
                    let after_end = reader.end && !reader.buffered().is_empty();
                    if reader.gone.is_some() || after_end {
                        return;
                    }
                    // Mid-chunk bytes are the other half's to read; only a peer that ended
                    // its direction, or whose next length is due, is read here.
                    let idle = reader.end || reader.left == 0;
                    if idle && reader.fill(stream, &shared.heard) {
                        continue;
                    }
                }
                let Ok(stream) = shared.stream() else { return };
                match stream.ready(Interest::READABLE).await {
                    Ok(ready) if ready.is_read_closed() => return,
                    Ok(_) => {
                        // The other half reads these bytes; look again after it had a turn.
                        let read_now = shared.reader().left > 0;
                        if read_now {
                            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                        }
                    }
                    Err(_) => return,
                }
            }
        }
    }
}

/// The peer's direction of a request on a same-host connection.
pub(crate) struct CallRecv {
    shared: Arc<Shared>,
}

impl CallRecv {
    /// Reads into `dest`: `Some(n)` bytes, or `None` at the peer's end. Cancel-safe.
    pub(crate) async fn read(&mut self, dest: &mut [u8]) -> Result<Option<usize>> {
        if dest.is_empty() {
            return Ok(Some(0));
        }
        // Bounded by the peer: each round reads what arrived or waits for more.
        loop {
            {
                let stream = self.shared.stream()?;
                let mut reader = self.shared.reader();
                reader.parse();
                if reader.left > 0 && !reader.buffered().is_empty() {
                    return Ok(Some(reader.take(dest)));
                }
                if reader.end {
                    return Ok(None);
                }
                if let Some(why) = &reader.gone {
                    return Err(Error::Io(why.clone()));
                }
                if reader.left >= DIRECT_MIN && dest.len() >= DIRECT_MIN {
                    let n = dest.len().min(reader.left);
                    match read_direct(stream, &mut dest[..n], &self.shared.heard) {
                        Ok(Some(n)) => {
                            reader.left -= n;
                            return Ok(Some(n));
                        }
                        Ok(None) => {}
                        Err(why) => {
                            reader.gone = Some(why.clone());
                            return Err(Error::Io(why));
                        }
                    }
                } else if reader.fill(stream, &self.shared.heard) {
                    continue;
                }
            }
            let stream = self.shared.stream()?;
            // `poll_read_ready` keeps one waker for the socket's reads: only this half reads
            // with it (`stopped` waits with `ready`, which does not take that place).
            std::future::poll_fn(|cx| {
                if !outside_task() {
                    return stream.poll_read_ready(cx);
                }
                if bytes_waiting(stream) {
                    return std::task::Poll::Ready(Ok(()));
                }
                WAITED.set(true);
                stream.poll_read_ready(cx)
            })
            .await
            .map_err(|e| Error::io("reading from a same-host peer", e))?;
        }
    }

    /// Reads exactly `dest.len()` bytes; the peer's end before them is an error.
    pub(crate) async fn read_exact(&mut self, dest: &mut [u8]) -> Result<()> {
        let mut at = 0;
        // Bounded: each round reads at least one byte or fails.
        while at < dest.len() {
            match self.read(&mut dest[at..]).await? {
                Some(n) => at += n,
                None => {
                    return Err(Error::Io(format!(
                        "the peer ended its side after {at} of {} bytes",
                        dest.len()
                    )));
                }
            }
        }
        Ok(())
    }

    /// A counter of the bytes read from the peer.
    pub(crate) fn heard(&self) -> Arc<AtomicU64> {
        self.shared.heard.clone()
    }
}

/// What [`CallSend::write_parts`] sends, in order: `prefix` as it is, then `parts` as chunks
/// (one for all of them when they fit in one, else each part split at [`MAX_CHUNK`]), then
/// the end chunk when `end`. `lens` holds the chunks' lengths the pieces borrow.
fn framed<'a>(
    prefix: &'a [u8],
    parts: &[&'a [u8]],
    end: bool,
    lens: &'a mut Vec<[u8; 4]>,
) -> Vec<&'a [u8]> {
    const END: [u8; 4] = 0u32.to_le_bytes();
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let one = total <= MAX_CHUNK;
    let chunks: Vec<&[u8]> = match one {
        true => parts.iter().copied().filter(|p| !p.is_empty()).collect(),
        false => parts.iter().flat_map(|p| p.chunks(MAX_CHUNK)).collect(),
    };
    // One length for one chunk made of every part (none for no bytes: a length of 0 is the
    // end), else one per chunk.
    match one {
        true if total > 0 => lens.push((total as u32).to_le_bytes()),
        true => {}
        false => lens.extend(chunks.iter().map(|c| (c.len() as u32).to_le_bytes())),
    }
    let lens: &'a [[u8; 4]] = lens;
    let mut pieces: Vec<&[u8]> = Vec::with_capacity(chunks.len() * 2 + 2);
    pieces.push(prefix);
    match one {
        true => {
            pieces.extend(lens.iter().map(|l| &l[..]));
            pieces.extend(chunks.iter().copied());
        }
        false => {
            for (len, chunk) in lens.iter().zip(&chunks) {
                pieces.push(len);
                pieces.push(chunk);
            }
        }
    }
    if end {
        pieces.push(&END);
    }
    pieces
}

/// What [`read_chunks`] read of a same-host request's direction.
#[doc(hidden)]
#[derive(Debug, PartialEq, Eq)]
pub struct ChunksRead {
    /// The chunks' bytes, in order.
    pub payload: Vec<u8>,
    /// Bytes of the input parsed (lengths and payload).
    pub consumed: usize,
    /// The end chunk was read.
    pub end: bool,
    /// Why reading stopped before the end (an abort or a chunk over [`MAX_CHUNK`]).
    pub gone: Option<String>,
}

/// Fuzzing hook: `input` as the peer's direction of a same-host request (after its request
/// frame), arriving `piece` bytes at a time and read `take` bytes at a time by the reader a
/// request's [`CallRecv`] reads with. Reading stops at the end chunk, an abort, a chunk over
/// the limit, or the input's end.
#[doc(hidden)]
pub fn read_chunks(input: &[u8], piece: usize, take: usize) -> ChunksRead {
    let mut reader = Reader::new(ReadBuf::default());
    let (mut fed, mut payload) = (0, Vec::new());
    let mut dest = vec![0u8; take.min(input.len()).clamp(1, MAX_CHUNK)];
    // Bounded: each round takes at least one byte, feeds at least one, or stops.
    loop {
        reader.parse();
        if reader.left > 0 && !reader.buffered().is_empty() {
            let n = reader.take(&mut dest);
            payload.extend_from_slice(&dest[..n]);
            continue;
        }
        if reader.end || reader.gone.is_some() || fed == input.len() {
            break;
        }
        let room = reader.room();
        let n = room.len().min(piece.max(1)).min(input.len() - fed);
        room[..n].copy_from_slice(&input[fed..fed + n]);
        reader.read.end += n;
        fed += n;
    }
    ChunksRead {
        payload,
        consumed: fed - reader.buffered().len(),
        end: reader.end,
        gone: reader.gone,
    }
}

/// Fuzzing hook: `parts` framed as a same-host request's direction ending with its end
/// chunk, the bytes [`CallSend::write_parts`] writes.
#[doc(hidden)]
pub fn frame_chunks(parts: &[&[u8]]) -> Vec<u8> {
    let mut lens = Vec::new();
    framed(&[], parts, true, &mut lens).concat()
}

/// One non-blocking `recv` straight into `dest`: `Ok(None)` when nothing is there yet.
fn read_direct(
    stream: &UnixStream,
    dest: &mut [u8],
    heard: &AtomicU64,
) -> std::result::Result<Option<usize>, String> {
    match recv_polled(stream, dest) {
        Ok(0) => Err("the peer closed the connection".into()),
        Ok(n) => {
            heard.fetch_add(n as u64, Ordering::Relaxed);
            Ok(Some(n))
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(format!("reading from a same-host peer: {e}")),
    }
}

thread_local! {
    /// Set while [`reading_sockets`] polls on this thread.
    static READING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set when a read polled by [`reading_sockets`] was left waiting on its socket.
    static WAITED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `poll` (one poll of a future) with this thread reading same-host sockets itself
/// ([`outside_task`]): what it returns, and whether a read was left waiting on a socket
/// (see `tb_node::runtime::poll_reading_sockets`).
pub(crate) fn reading_sockets<T>(poll: impl FnOnce() -> T) -> (T, bool) {
    READING.set(true);
    WAITED.set(false);
    let out = poll();
    READING.set(false);
    (out, WAITED.replace(false))
}

/// Whether this poll comes from a thread that reads sockets itself ([`reading_sockets`]: a
/// Python thread polling its own call while it spins for the answer). The runtime's I/O
/// driver learns of the answer's bytes only when a runtime thread wakes for them, so such a
/// poller looks at the socket itself ([`recv_polled`], [`bytes_waiting`]): the answer is
/// read the moment it lands, on the thread that waits for it. The runtime thread the
/// driver wakes for the same bytes still runs, but off the call's way. Every other poll
/// relies on the I/O driver's readiness alone.
fn outside_task() -> bool {
    READING.get()
}

/// A non-blocking `recv` into `dest`. For a poller that reads sockets itself
/// ([`outside_task`]) the socket is read whatever the I/O driver has seen; where it holds
/// nothing, and for every other poll, the read
/// goes through `try_io`, which skips the system call while the driver saw nothing and
/// clears the readiness it cached when the socket turns out empty (so that waiting for
/// readiness waits).
fn recv_polled(stream: &UnixStream, dest: &mut [u8]) -> std::io::Result<usize> {
    let recv = |dest: &mut [u8]| {
        rustix::net::recv(stream, dest, RecvFlags::DONTWAIT)
            .map(|(n, _)| n)
            .map_err(std::io::Error::from)
    };
    if outside_task() {
        match recv(&mut *dest) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            done => return done,
        }
    }
    stream.try_io(Interest::READABLE, || recv(&mut *dest))
}

/// Whether the socket holds bytes to read, or an end or error to report (a `MSG_PEEK` of one
/// byte, without blocking).
fn bytes_waiting(stream: &UnixStream) -> bool {
    let mut byte = [0u8; 1];
    match rustix::net::recv(stream, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT) {
        Ok(_) => true,
        Err(e) => e != rustix::io::Errno::AGAIN,
    }
}

/// Writes every piece in order (`sendmsg` with as many as one call takes).
async fn send_all(stream: &UnixStream, pieces: &[&[u8]]) -> Result<()> {
    let (mut piece, mut at) = (0, 0);
    // Bounded: each round sends at least one byte or fails.
    while piece < pieces.len() {
        if at == pieces[piece].len() {
            piece += 1;
            at = 0;
            continue;
        }
        let iov: Vec<IoSlice<'_>> = std::iter::once(IoSlice::new(&pieces[piece][at..]))
            .chain(pieces[piece + 1..].iter().map(|p| IoSlice::new(p)))
            .take(64)
            .collect();
        let sent = stream
            .async_io(Interest::WRITABLE, || {
                rustix::net::sendmsg(stream, &iov, &mut Default::default(), SendFlags::NOSIGNAL)
                    .map_err(std::io::Error::from)
            })
            .await
            .map_err(|e| Error::io("writing to a same-host peer", e))?;
        if sent == 0 {
            return Err(Error::Io("same-host peer: socket closed".into()));
        }
        let mut left = sent;
        while left > 0 && piece < pieces.len() {
            let here = (pieces[piece].len() - at).min(left);
            at += here;
            left -= here;
            if at == pieces[piece].len() {
                piece += 1;
                at = 0;
            }
        }
    }
    Ok(())
}

/// Opens a request of a service kind on a same-host connection to `route`'s peer: writes
/// `request`, then `preamble` as one chunk (then the end chunk when `finish`) in one
/// `sendmsg`, and reads the first answer within `timeout`. A pooled connection that the peer
/// closed while it was idle (nothing read back, not even an answer) is tried once more on a
/// new one. `ViaQuic` when the peer serves the kind on its link only (`Unsupported`);
/// `Fallback` when the socket failed.
pub(crate) async fn open_socket_request(
    ctx: &NodeCtx,
    route: &ShmRoute,
    request: &DataRequest,
    preamble: &[&[u8]],
    finish: bool,
    timeout: Duration,
) -> std::result::Result<RequestStream, ChannelError> {
    let peer = route.peer;
    let what = format!("a {} request to {} (shm)", request.kind(), peer.fmt_short());
    let head = frame::encode(request)
        .map_err(|e| ChannelError::Final(Error::io("encoding a frame", e)))?;
    let stall = ctx.config.stall_timeout;
    for attempt in 0..2 {
        let pooled = route.shm.take_idle(&peer);
        let retry = pooled.is_some() && attempt == 0;
        let conn = match pooled {
            Some(conn) => conn,
            None => super::client::connection(ctx, route, peer).await?,
        };
        let (mut send, recv) = halves(conn, Back::Pool(route.shm.clone(), peer));
        let heard = recv.heard();
        let written = within(stall, &what, send.write_parts(&head, preamble, finish)).await;
        let mut recv = RequestRecv::from(recv);
        let answer = match written {
            Err(_) if retry => continue,
            Err(e) => return Err(ChannelError::Fallback(e)),
            Ok(()) => tokio::time::timeout(timeout, recv.read_frame::<DataResponse>()).await,
        };
        match answer {
            Err(_) => {
                let e = Error::timeout(format!("answer for {what}"), timeout);
                return Err(ChannelError::Final(e));
            }
            Ok(Err(_)) if retry && heard.load(Ordering::Relaxed) == 0 => continue,
            Ok(Err(e)) => return Err(ChannelError::Fallback(e.into_error(&what).into())),
            Ok(Ok(DataResponse::Error {
                code: ErrorCode::Unsupported,
                ..
            })) => return Err(ChannelError::ViaQuic),
            Ok(Ok(answer)) => {
                return Ok(RequestStream {
                    send: send.into(),
                    recv,
                    answer,
                    link: None,
                });
            }
        }
    }
    Err(ChannelError::Fallback(Error::Io(format!(
        "{what}: the pooled connection and a new one both failed"
    ))))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// This side's halves over one end of a socket pair (handed back on `rx` when clean),
    /// and the raw other end.
    fn pair() -> (CallSend, CallRecv, oneshot::Receiver<ShmStream>, UnixStream) {
        let (ours, theirs) = UnixStream::pair().expect("socket pair");
        let (tx, rx) = oneshot::channel();
        let (send, recv) = halves(ShmStream::new(ours), Back::Serve(tx));
        (send, recv, rx, theirs)
    }

    fn chunk(bytes: &[u8]) -> Vec<u8> {
        let mut out = (bytes.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(bytes);
        out
    }

    async fn read_all(recv: &mut CallRecv) -> Result<Vec<u8>> {
        let mut got = Vec::new();
        let mut buf = [0u8; 7];
        // Bounded by the bytes written in each test.
        while let Some(n) = recv.read(&mut buf).await? {
            got.extend_from_slice(&buf[..n]);
        }
        Ok(got)
    }

    /// A read polled by a thread that reads sockets itself (a Python thread spinning for its
    /// call's answer) takes the bytes the socket holds though no thread has run the I/O
    /// driver since they came; any other poll waits for a runtime thread to wake for them.
    #[test]
    fn a_read_polled_by_a_spinning_thread_takes_bytes_the_driver_has_not_seen() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let _entered = rt.enter();
        let (_send, mut recv, _rx, theirs) = pair();
        let mut theirs = theirs.into_std().expect("std socket");
        theirs.set_nonblocking(false).expect("blocking");
        std::io::Write::write_all(&mut theirs, &chunk(b"answer")).expect("write");
        let mut buf = [0u8; 16];
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Polled as any task is, the read waits for the I/O driver, which a current-thread
        // runtime runs only inside `block_on`: nothing ran it.
        {
            let mut read = std::pin::pin!(recv.read(&mut buf));
            let polled = read.as_mut().poll(&mut cx);
            assert!(polled.is_pending(), "{polled:?}");
            // Polled by a thread that reads sockets itself, it takes the bytes.
            let (polled, waited) = reading_sockets(|| read.as_mut().poll(&mut cx));
            assert!(
                matches!(polled, std::task::Poll::Ready(Ok(Some(6)))),
                "{polled:?}"
            );
            assert!(!waited);
        }
        assert_eq!(&buf[..6], b"answer");
        // Nothing more: the next read waits, and says it waits on its socket.
        let mut read = std::pin::pin!(recv.read(&mut buf));
        let (polled, waited) = reading_sockets(|| read.as_mut().poll(&mut cx));
        assert!(polled.is_pending(), "{polled:?}");
        assert!(waited, "a read left waiting on its socket says so");
    }

    #[tokio::test]
    async fn both_directions_ended_hand_the_connection_back_with_the_bytes_after_them() {
        let (mut send, mut recv, back, mut theirs) = pair();
        send.write_parts(b"head", &[b"abc", b"defgh"], true)
            .await
            .expect("written");
        let mut wire = vec![0u8; 4 + 4 + 8 + 4];
        theirs.read_exact(&mut wire).await.expect("read");
        let mut want = b"head".to_vec();
        want.extend(chunk(b"abcdefgh"));
        want.extend(0u32.to_le_bytes());
        assert_eq!(wire, want, "the prefix, one chunk for both parts, the end");
        // Theirs: two chunks, the end, then the next request's first bytes.
        let mut theirs_out = chunk(b"hello ");
        theirs_out.extend(chunk(b"world"));
        theirs_out.extend(0u32.to_le_bytes());
        theirs_out.extend(b"next");
        theirs.write_all(&theirs_out).await.expect("write");
        assert_eq!(read_all(&mut recv).await.expect("read"), b"hello world");
        drop((send, recv));
        let mut conn = back.await.expect("handed back: both ends clean");
        let mut next = [0u8; 4];
        conn.read_exact(&mut next).await.expect("buffered");
        assert_eq!(
            &next, b"next",
            "what came after the end is the next request's"
        );
    }

    #[tokio::test]
    async fn an_unended_direction_closes_the_connection() {
        let (mut send, recv, back, mut theirs) = pair();
        send.write_all(b"partial").await.expect("written");
        theirs.write_all(&0u32.to_le_bytes()).await.expect("write");
        drop((send, recv));
        assert!(back.await.is_err(), "not handed back");
        let mut sent = vec![0u8; chunk(b"partial").len()];
        theirs.read_exact(&mut sent).await.expect("read");
        assert_eq!(sent, chunk(b"partial"));
        let mut more = [0u8; 1];
        let after = theirs.read(&mut more).await;
        assert!(matches!(after, Ok(0) | Err(_)), "then closed: {after:?}");
    }

    #[tokio::test]
    async fn a_chunk_over_the_limit_a_reset_or_a_close_mid_chunk_fail_the_read() {
        let too_long = (MAX_CHUNK as u32 + 1).to_le_bytes().to_vec();
        let reset = RESET.to_le_bytes().to_vec();
        let mut cut = 10u32.to_le_bytes().to_vec();
        cut.extend(b"abc");
        for (wire, why) in [
            (too_long, "a chunk of"),
            (reset, "abandoned"),
            (cut, "closed"),
        ] {
            let (send, mut recv, back, mut theirs) = pair();
            theirs.write_all(&wire).await.expect("write");
            drop(theirs);
            let err = read_all(&mut recv).await.expect_err("refused");
            assert!(err.to_string().contains(why), "{why}: {err}");
            drop((send, recv));
            assert!(back.await.is_err(), "{why}: not handed back");
        }
    }

    #[tokio::test]
    async fn stopped_takes_the_peers_end_and_completes_when_it_closes() {
        let (send, recv, _back, mut theirs) = pair();
        theirs.write_all(&chunk(b"args")).await.expect("write");
        theirs.write_all(&0u32.to_le_bytes()).await.expect("write");
        let stopped = send.stopped();
        tokio::pin!(stopped);
        let early = tokio::time::timeout(std::time::Duration::from_millis(50), &mut stopped).await;
        assert!(early.is_err(), "a peer that ended its side still listens");
        drop(theirs);
        let done = tokio::time::timeout(std::time::Duration::from_secs(10), stopped).await;
        assert!(done.is_ok(), "a closed peer stopped listening");
        drop((send, recv));
    }

    /// What the fuzz target `call_chunks` checks, on inputs it would take long to find: a
    /// payload over one chunk, an abort, a length over the limit, bytes after the end.
    #[test]
    fn the_chunk_reader_reads_the_same_however_the_bytes_arrive() {
        let big: Vec<u8> = (0..MAX_CHUNK + 5).map(|i| (i % 251) as u8).collect();
        let framed = frame_chunks(&[&b""[..], &big[..7], &big[7..]]);
        assert_eq!(framed.len(), big.len() + 4 * 3, "two chunks and the end");
        let mut after_end = frame_chunks(&[b"abc"]);
        after_end.extend(b"next");
        let mut aborted = frame_chunks(&[b"abc"]);
        aborted.truncate(7);
        aborted.extend(RESET.to_le_bytes());
        let over = (MAX_CHUNK as u32 + 1).to_le_bytes().to_vec();
        for (input, payload, end, gone) in [
            (&framed, &big[..], true, None),
            (&after_end, &b"abc"[..], true, None),
            (&aborted, &b"abc"[..], false, Some("abandoned")),
            (&over, &b""[..], false, Some("the most is")),
        ] {
            let whole = read_chunks(input, usize::MAX, usize::MAX);
            assert_eq!(whole.payload, payload);
            assert_eq!(whole.end, end);
            match gone {
                Some(why) => assert!(whole.gone.as_deref().is_some_and(|g| g.contains(why))),
                None => assert_eq!(whole.gone, None),
            }
            for (piece, take) in [(1, 1), (3, 1000), (65_536, 7)] {
                if input.len() > 1 << 20 && piece < 1000 {
                    continue;
                }
                assert_eq!(read_chunks(input, piece, take), whole, "{piece}/{take}");
            }
        }
        assert_eq!(read_chunks(&after_end, 5, 2).consumed, after_end.len() - 4);
    }
}
