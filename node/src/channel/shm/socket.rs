//! [`ShmStream`]: length-prefixed frames on a Unix stream socket, any of which may carry one
//! file descriptor (SCM_RIGHTS) — the same frames as on QUIC streams (`tb_proto::frame`).
//!
//! Every read goes through `recvmsg`, so a descriptor is never lost by reading the bytes it
//! came with; descriptors queue up until the frame that announces them takes them, and at
//! most [`MAX_QUEUED_FDS`] may wait (a peer that sends more breaks the protocol).

use std::{
    collections::VecDeque,
    io::{IoSlice, IoSliceMut},
    mem::MaybeUninit,
    os::fd::{BorrowedFd, OwnedFd},
    time::Duration,
};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Serialize, de::DeserializeOwned};
use tb_proto::frame;
use tokio::{io::Interest, net::UnixStream};

use crate::error::{Error, Result};

/// Descriptors that may wait for the frame that takes them.
const MAX_QUEUED_FDS: usize = 2;
/// Bytes read per `recvmsg` into the frame buffer.
const READ_CHUNK: usize = 64 << 10;

/// Bytes read from a same-host socket and not yet consumed: `buf[start..end]`. The buffer
/// keeps its length (zeroed once, when it grows) and only `start` and `end` move, and it
/// passes whole between a connection's frames and its requests' chunk reader and back: a
/// fresh buffer per request was allocated and zeroed (64 KiB) twice per call on each side.
#[derive(Debug, Default)]
pub(crate) struct ReadBuf {
    pub(crate) buf: Vec<u8>,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

impl ReadBuf {
    /// The bytes read and not yet consumed.
    pub(crate) fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Moves the unconsumed bytes to the buffer's front (no allocation): the room after
    /// them is then all the buffer has past `end`.
    pub(crate) fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }
}

/// Most parts one [`ShmStream::write_parts`] takes.
pub(crate) const MAX_PARTS: usize = 4;

/// One same-host socket, with what was read from it but not yet consumed.
#[derive(Debug)]
pub(crate) struct ShmStream {
    stream: UnixStream,
    read: ReadBuf,
    fds: VecDeque<OwnedFd>,
}

impl ShmStream {
    pub(crate) fn new(stream: UnixStream) -> Self {
        ShmStream {
            stream,
            read: ReadBuf::default(),
            fds: VecDeque::new(),
        }
    }

    /// The socket and the bytes read from it but not yet consumed (a request's stream
    /// takes them over: `call`); descriptors waiting for a frame are dropped.
    pub(crate) fn into_parts(self) -> (UnixStream, ReadBuf) {
        (self.stream, self.read)
    }

    /// A connection over `stream` whose next bytes are those `read` holds (read before,
    /// not yet consumed).
    pub(crate) fn from_parts(stream: UnixStream, read: ReadBuf) -> Self {
        ShmStream {
            stream,
            read,
            fds: VecDeque::new(),
        }
    }

    /// The socket, for its peer credentials.
    pub(crate) fn socket(&self) -> &UnixStream {
        &self.stream
    }

    /// Writes one frame.
    pub(crate) async fn write_frame<T: Serialize>(&mut self, msg: &T) -> Result<()> {
        self.write_frame_and(msg, &[], None).await
    }

    /// Writes one frame, then `payload` right behind it (one `sendmsg` when it fits), with
    /// `fd` attached to the frame's first byte when given.
    pub(crate) async fn write_frame_and(
        &mut self,
        msg: &impl Serialize,
        payload: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<()> {
        let head = frame::encode(msg).map_err(|e| Error::io("encoding a frame", e))?;
        self.write_parts(&[&head, payload], fd).await
    }

    /// Writes two frames, then `payload` right behind them (one `sendmsg` when they fit),
    /// with `fd` attached to the first frame's first byte when given: a header and what
    /// follows it in one write, a wake-up of the peer's reader fewer.
    pub(crate) async fn write_frames_and(
        &mut self,
        first: &impl Serialize,
        second: &impl Serialize,
        payload: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<()> {
        let first = frame::encode(first).map_err(|e| Error::io("encoding a frame", e))?;
        let second = frame::encode(second).map_err(|e| Error::io("encoding a frame", e))?;
        self.write_parts(&[&first, &second, payload], fd).await
    }

    /// Writes `parts` one after another, in one `sendmsg` when they fit: frames encoded
    /// already and the payload bytes behind them (at most [`MAX_PARTS`]), with `fd` attached
    /// to the first byte when given. Each `sendmsg`
    /// wakes the peer's reader (and this side's writer, when the peer drains the socket):
    /// a small push sent as one write instead of four costs either side fewer wake-ups.
    pub(crate) async fn write_parts(
        &mut self,
        parts: &[&[u8]],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<()> {
        if parts.len() > MAX_PARTS {
            return Err(Error::Io(format!(
                "a same-host write of {} parts (at most {MAX_PARTS})",
                parts.len()
            )));
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let fds;
        let mut control = SendAncillaryBuffer::new(&mut space);
        if let Some(fd) = fd {
            fds = [fd];
            control.push(SendAncillaryMessage::ScmRights(&fds));
        }
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut done = 0;
        let mut first = true;
        // Bounded: each round sends at least one byte or fails.
        while done < total {
            let mut iov = [IoSlice::new(&[]); MAX_PARTS];
            let (mut used, mut skip) = (0, done);
            for part in parts {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                iov[used] = IoSlice::new(&part[skip..]);
                skip = 0;
                used += 1;
            }
            let iov = &iov[..used];
            let sent = self
                .stream
                .async_io(Interest::WRITABLE, || {
                    let mut none = SendAncillaryBuffer::default();
                    let control = if first { &mut control } else { &mut none };
                    rustix::net::sendmsg(&self.stream, iov, control, SendFlags::NOSIGNAL)
                        .map_err(std::io::Error::from)
                })
                .await
                .map_err(|e| Error::io("writing to a same-host peer", e))?;
            if sent == 0 {
                return Err(Error::Io("same-host peer: socket closed".into()));
            }
            first = false;
            done += sent;
        }
        Ok(())
    }

    /// Reads one frame of at most `max` body bytes, checked before the body is buffered.
    pub(crate) async fn read_frame<T: DeserializeOwned>(&mut self, max: u32) -> Result<T> {
        self.fill(frame::LEN_PREFIX).await?;
        let prefix: [u8; frame::LEN_PREFIX] = self.read.buffered()[..frame::LEN_PREFIX]
            .try_into()
            .map_err(|_| Error::Io("frame prefix".into()))?;
        let len = frame::body_len_within(prefix, max)
            .map_err(|e| Error::Io(format!("a same-host peer's frame: {e}")))?;
        self.fill(frame::LEN_PREFIX + len).await?;
        let body = &self.read.buffered()[frame::LEN_PREFIX..][..len];
        let msg = frame::decode_body(body)
            .map_err(|e| Error::Io(format!("a same-host peer's frame: {e}")))?;
        self.read.start += frame::LEN_PREFIX + len;
        Ok(msg)
    }

    /// The descriptor that came with the frame just read.
    pub(crate) fn take_fd(&mut self) -> Result<OwnedFd> {
        self.fds
            .pop_front()
            .ok_or_else(|| Error::Io("a same-host peer announced a memfd it did not pass".into()))
    }

    /// Reads exactly `dest.len()` payload bytes (those already buffered first).
    pub(crate) async fn read_exact(&mut self, dest: &mut [u8]) -> Result<()> {
        let buffered = self.read.buffered().len().min(dest.len());
        dest[..buffered].copy_from_slice(&self.read.buffered()[..buffered]);
        self.read.start += buffered;
        let mut filled = buffered;
        // Bounded: each round reads at least one byte or fails.
        while filled < dest.len() {
            let n = recv_into(&self.stream, &mut self.fds, &mut dest[filled..]).await?;
            filled += n;
        }
        Ok(())
    }

    /// Makes at least `want` unconsumed bytes buffered.
    async fn fill(&mut self, want: usize) -> Result<()> {
        let read = &mut self.read;
        if read.end - read.start >= want {
            return Ok(());
        }
        read.compact();
        let room = READ_CHUNK.max(want);
        if read.buf.len() < room {
            read.buf.resize(room, 0);
        }
        // Bounded: each round reads at least one byte or fails.
        while read.end - read.start < want {
            read.end += recv_into(&self.stream, &mut self.fds, &mut read.buf[read.end..]).await?;
        }
        Ok(())
    }
}

/// One `recvmsg` into `dest`, keeping any descriptor that came with the bytes.
async fn recv_into(
    stream: &UnixStream,
    fds: &mut VecDeque<OwnedFd>,
    dest: &mut [u8],
) -> Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_QUEUED_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = stream
        .async_io(Interest::READABLE, || {
            let mut iov = [IoSliceMut::new(dest)];
            rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
                .map_err(std::io::Error::from)
        })
        .await
        .map_err(|e| Error::io("reading from a same-host peer", e))?;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(passed) = msg {
            fds.extend(passed);
        }
    }
    if fds.len() > MAX_QUEUED_FDS {
        return Err(Error::Io(
            "a same-host peer passed too many descriptors".into(),
        ));
    }
    if got.bytes == 0 {
        return Err(Error::Io("a same-host peer closed the socket".into()));
    }
    Ok(got.bytes)
}

/// Runs `io` with a deadline, naming what timed out.
pub(crate) async fn within<T>(
    limit: Duration,
    what: &str,
    io: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, io)
        .await
        .unwrap_or_else(|_| Err(Error::timeout(what.to_owned(), limit)))
}
