//! The requesting side of the shm channel: pulls and pushes on a same-host socket.
//!
//! A request whose socket fails before any answer (the peer restarted, the socket was idle
//! and closed) is sent once more on a fresh connection; when that fails too, the caller falls
//! back to QUIC ([`ChannelError::Fallback`]). Errors the peer answered (not found, refused) are
//! final, as on QUIC.

use std::os::fd::{AsFd, OwnedFd};

use iroh::EndpointId;
use tb_proto::{
    Access, ChannelKind, DataRequest, DataResponse, ErrorCode, ShmCopied, ShmHello, ShmPayload,
    TensorMeta, TensorName,
    frame::{self, MAX_CONTROL_FRAME},
};
use tokio::net::UnixStream;

use super::{INLINE_MAX, Region, socket::ShmStream, socket::within};
use crate::{
    channel::{Channel, ChannelError, ShmRoute, verify},
    client::{Pulled, remote_error_from},
    ctx::NodeCtx,
    error::{Error, Result},
    tensor::Tensor,
};

/// A pull whose header arrived on the socket, its payload announced.
pub(crate) struct ShmPull<'r> {
    /// The version sent.
    pub(crate) version: u64,
    /// Its metadata (for a memfd payload, as verified by its holder).
    pub(crate) meta: TensorMeta,
    payload: Payload,
    /// The route it came on (an inline payload's connection is pooled again once read).
    route: &'r ShmRoute,
    /// This transfer, as errors name it.
    what: String,
    /// Hash a memfd payload before handing its bytes out (the holder proved only read-only
    /// access). Inline payloads are hashed as `super::hash_inline` says.
    verify_memfd: bool,
}

enum Payload {
    /// Follows on this connection, its length checked against [`INLINE_MAX`]: read (and
    /// hashed) straight into the buffer it ends in.
    Inline(ShmStream),
    /// The holder's sealed memfd (checked), and where the payload starts in it.
    Memfd { fd: OwnedFd, offset: u64 },
    /// The holder's memfd to copy out of (not sealed; at most
    /// [`PULL_COPY_MAX`](super::PULL_COPY_MAX) bytes), where
    /// the payload starts in it, and the connection to say `ShmCopied` on: the holder keeps
    /// the version until then (and reuses the memfd after).
    Copy {
        fd: OwnedFd,
        offset: u64,
        conn: ShmStream,
    },
}

impl ShmPull<'_> {
    /// The payload as a tensor: the mapping of the holder's memfd (zero-copy), or the inline
    /// bytes read into a pooled memfd of this process (one copy). An inline payload whose
    /// socket fails is left to QUIC (nothing was handed out yet); one that does not hash to
    /// `meta.hash` is `Corrupt`.
    pub(crate) async fn into_tensor(self, ctx: &NodeCtx) -> Result<Tensor, ChannelError> {
        match self.payload {
            Payload::Inline(mut conn) => {
                let stall = ctx.config.stall_timeout;
                let holder = Some(self.route.access);
                let read = super::read_inline(&mut conn, &self.meta, &self.what, holder);
                match within(stall, &self.what, read).await {
                    Ok(tensor) => {
                        self.route.shm.put_idle(self.route.peer, conn);
                        Ok(tensor)
                    }
                    Err(err @ Error::Corrupt(_)) => Err(ChannelError::Final(err)),
                    Err(err) => Err(ChannelError::Fallback(err)),
                }
            }
            Payload::Memfd { fd, offset } => {
                let tensor =
                    super::tensor_from_memfd(fd, offset, self.meta).map_err(ChannelError::Final)?;
                if self.verify_memfd {
                    verify::check_all(tensor.data(), tensor.hash(), &self.what)
                        .map_err(ChannelError::Final)?;
                    super::region::release_resident(tensor.data());
                }
                Ok(tensor)
            }
            Payload::Copy { fd, offset, conn } => {
                let verify = self.verify_memfd;
                let copied =
                    super::tensor_copied_from_memfd(fd, offset, &self.meta, verify, &self.what);
                let tensor = copied.map_err(ChannelError::Final)?;
                self.route.copied(ctx, conn, self.version).await;
                Ok(tensor)
            }
        }
    }

    /// Copies the payload into `dest` (exactly `meta.byte_len` bytes): an inline one is read
    /// from the socket straight into it.
    pub(crate) async fn copy_into(self, ctx: &NodeCtx, dest: &mut [u8]) -> Result<()> {
        if dest.len() as u64 != self.meta.byte_len {
            return Err(Error::InvalidTensor(format!(
                "destination buffer has {} bytes, the tensor {}",
                dest.len(),
                self.meta.byte_len
            )));
        }
        match self.payload {
            Payload::Inline(mut conn) => {
                let stall = ctx.config.stall_timeout;
                let holder = Some(self.route.access);
                let read = super::read_inline_into(&mut conn, dest, &self.meta, &self.what, holder);
                within(stall, &self.what, read).await?;
                self.route.shm.put_idle(self.route.peer, conn);
                Ok(())
            }
            Payload::Memfd { fd, offset } => {
                let end = offset.checked_add(self.meta.byte_len).ok_or_else(|| {
                    Error::TooLarge(format!(
                        "a payload of {} bytes at {offset}",
                        self.meta.byte_len
                    ))
                })?;
                Region::check_peer_fd(&fd, end)?;
                super::region::pread_parallel(fd.as_fd(), dest, offset).await?;
                if self.verify_memfd {
                    verify::check_all(dest, self.meta.hash, &self.what)?;
                }
                Ok(())
            }
            Payload::Copy { fd, offset, conn } => {
                match super::peer_maps::copy_to(&fd, offset, dest) {
                    Some(copied) => copied?,
                    None => super::region::pread_all(fd.as_fd(), dest, offset)?,
                }
                drop(fd);
                if self.verify_memfd {
                    verify::check_all(dest, self.meta.hash, &self.what)?;
                }
                self.route.copied(ctx, conn, self.version).await;
                Ok(())
            }
        }
    }
}

impl ShmRoute {
    /// Tells the holder a `MemfdCopy` payload of `version` was copied out (it may reuse the
    /// memfd now) and pools the connection; one that fails is dropped (the copy stands).
    async fn copied(&self, ctx: &NodeCtx, mut conn: ShmStream, version: u64) {
        let receipt = ShmCopied { version };
        let said = conn.write_frame(&receipt);
        if within(ctx.config.stall_timeout, "a pull's receipt", said)
            .await
            .is_ok()
        {
            self.shm.put_idle(self.peer, conn);
        }
    }
}

impl Channel for ShmRoute {
    /// One copy out of the holder's sealed memfd (parallel for large tensors).
    async fn pull_into<B, F>(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
        alloc: F,
    ) -> Result<Pulled<B>, ChannelError>
    where
        B: AsMut<[u8]> + Send,
        F: FnOnce(&TensorMeta) -> Result<B> + Send,
    {
        let pulled = pull(ctx, self, name, version).await?;
        let (meta, version) = (pulled.meta.clone(), pulled.version);
        let mut buffer = alloc(&meta).map_err(ChannelError::Final)?;
        let copied = pulled.copy_into(ctx, buffer.as_mut()).await;
        copied.map_err(ChannelError::Final)?;
        count_in(ctx, meta.byte_len);
        Ok(Pulled {
            name: name.clone(),
            version,
            meta,
            buffer,
        })
    }

    /// The tensor maps the holder's sealed memfd (zero-copy), or owns a pooled memfd the
    /// inline payload was read into.
    async fn pull(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        version: Option<u64>,
    ) -> Result<Pulled<Tensor>, ChannelError> {
        let pulled = pull(ctx, self, name, version).await?;
        let (meta, version) = (pulled.meta.clone(), pulled.version);
        let tensor = pulled.into_tensor(ctx).await?;
        count_in(ctx, meta.byte_len);
        Ok(Pulled {
            name: name.clone(),
            version,
            meta,
            buffer: tensor,
        })
    }

    /// Hands the tensor's sealed memfd over (made once per tensor), or small payloads inline.
    async fn push(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        tensor: &Tensor,
    ) -> Result<(), ChannelError> {
        push(ctx, self, name, tensor).await?;
        count_out(ctx, tensor.byte_len());
        Ok(())
    }
}

impl ShmRoute {
    /// Pushes `data`, the bytes of a tensor of `meta` (whose hash is not looked at), as
    /// `name`, hashing them as they are written: in 64 KiB pieces, the hash after them
    /// (`ShmPayload::InlineHashAfter`), which the peer checks against what it hashed as the
    /// pieces arrived. So the sender's hash overlaps the transfer and the peer's own hash
    /// instead of preceding them, and the bytes are never copied into a tensor of this node.
    /// `ViaQuic` for payloads too large to go inline (the caller makes a tensor).
    pub(crate) async fn push_hashing(
        &self,
        ctx: &NodeCtx,
        name: &TensorName,
        meta: &TensorMeta,
        data: &[u8],
    ) -> Result<(), ChannelError> {
        if data.len() as u64 != meta.byte_len || data.len() > INLINE_MAX {
            return Err(ChannelError::ViaQuic);
        }
        push_body(ctx, self, name, meta, PushBody::Hashing(data)).await?;
        count_out(ctx, meta.byte_len);
        Ok(())
    }
}

/// Counts `len` payload bytes sent over shm.
fn count_out(ctx: &NodeCtx, len: u64) {
    ctx.metrics.bytes_out.inc_by(len);
    let out = tb_dashboard::Direction::Out;
    ctx.metrics.channels.transfer(ChannelKind::Shm, out, len);
}

/// Counts `len` payload bytes received over shm.
fn count_in(ctx: &NodeCtx, len: u64) {
    ctx.metrics.bytes_in.inc_by(len);
    let inbound = tb_dashboard::Direction::In;
    ctx.metrics
        .channels
        .transfer(ChannelKind::Shm, inbound, len);
}

/// Pulls `name` from the route's peer on the same-host socket up to the payload (a memfd
/// taken, or inline bytes announced and still on the socket).
async fn pull<'r>(
    ctx: &NodeCtx,
    route: &'r ShmRoute,
    name: &TensorName,
    version: Option<u64>,
) -> Result<ShmPull<'r>, ChannelError> {
    let peer = route.peer;
    let request = DataRequest::Pull {
        name: name.clone(),
        version,
        range: None,
    };
    let what = describe(name, version, &peer);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut conn = connection(ctx, route, peer).await?;
        match pull_on(ctx, &mut conn, peer, &request, &what).await {
            Ok(Header {
                version,
                meta,
                body,
            }) => {
                let payload = match body {
                    Body::Memfd(fd, offset) => {
                        route.shm.put_idle(peer, conn);
                        Payload::Memfd { fd, offset }
                    }
                    // Pooled again once the payload is read, or its copy said.
                    Body::Inline => Payload::Inline(conn),
                    Body::Copy(fd, offset) => Payload::Copy { fd, offset, conn },
                };
                return Ok(ShmPull {
                    version,
                    meta,
                    payload,
                    route,
                    what,
                    verify_memfd: route.access != Access::ReadWrite,
                });
            }
            Err(PullFailure::Answered(err)) => {
                route.shm.put_idle(peer, conn);
                return Err(match err {
                    Error::Remote {
                        code: ErrorCode::Busy,
                        ..
                    } => ChannelError::ViaQuic,
                    err => ChannelError::Final(err),
                });
            }
            Err(PullFailure::Broken(err)) if attempts >= 2 => {
                return Err(ChannelError::Fallback(err));
            }
            Err(PullFailure::Broken(_)) => {}
        }
    }
}

enum PullFailure {
    /// The socket failed: nothing was answered.
    Broken(Error),
    /// The peer answered with an error (the socket is still good).
    Answered(Error),
}

/// What a pull's answer announced: the version, its metadata (validated), and where the
/// payload is.
struct Header {
    version: u64,
    meta: TensorMeta,
    body: Body,
}

/// Where a pulled payload is.
enum Body {
    /// It follows on the socket.
    Inline,
    /// In the holder's sealed memfd (unchecked yet), at this offset.
    Memfd(OwnedFd, u64),
    /// In the holder's memfd, to copy out and answer `ShmCopied` for.
    Copy(OwnedFd, u64),
}

/// Sends `request` on `conn` and reads the answer up to the payload.
async fn pull_on(
    ctx: &NodeCtx,
    conn: &mut ShmStream,
    peer: EndpointId,
    request: &DataRequest,
    what: &str,
) -> Result<Header, PullFailure> {
    let timeout = ctx.config.request_timeout;
    let peer_short = peer.fmt_short().to_string();
    let answer = within(timeout, what, async {
        conn.write_frame(request).await?;
        conn.read_frame::<DataResponse>(MAX_CONTROL_FRAME).await
    })
    .await
    .map_err(PullFailure::Broken)?;
    let (meta, version) = match answer {
        DataResponse::Header { meta, version } => (meta, version),
        DataResponse::Error { code, message } => {
            return Err(PullFailure::Answered(remote_error_from(
                peer_short, code, message,
            )));
        }
        other => {
            let err = Error::Io(format!("{what}: unexpected answer {other:?}"));
            return Err(PullFailure::Answered(err));
        }
    };
    meta.validate(ctx.config.max_tensor_bytes)
        .map_err(|e| PullFailure::Answered(e.into()))?;
    let stall = ctx.config.stall_timeout;
    let memfd = within(stall, what, async {
        match conn.read_frame::<ShmPayload>(MAX_CONTROL_FRAME).await? {
            // Refused before anything is allocated for it.
            ShmPayload::Inline => super::inline_len(&meta)
                .map(|_| Body::Inline)
                .map_err(|e| Error::Io(format!("{what}: {e}"))),
            ShmPayload::Memfd { offset } => Ok(Body::Memfd(conn.take_fd()?, offset)),
            // Refused above the limit before the fd is looked at.
            ShmPayload::MemfdCopy { offset } => match super::copy_len(&meta) {
                Ok(_) => Ok(Body::Copy(conn.take_fd()?, offset)),
                Err(e) => Err(Error::Io(format!("{what}: {e}"))),
            },
            // Only pushes are sent this way.
            ShmPayload::InlineHashAfter => Err(Error::Io(format!(
                "{what}: a pull answered with a push's payload"
            ))),
        }
    })
    .await
    .map_err(PullFailure::Broken)?;
    Ok(Header {
        version,
        meta,
        body: memfd,
    })
}

/// What a push sends after its request.
enum PushBody<'a> {
    /// The tensor's bytes, inline.
    Inline(&'a [u8]),
    /// The tensor's sealed memfd.
    Memfd(&'a Region),
    /// Bytes hashed as they are written, the hash after them (`ShmPayload::InlineHashAfter`).
    Hashing(&'a [u8]),
}

impl PushBody<'_> {
    /// Writes the push's `request` frame (encoded) and this body, the frames and the first
    /// payload bytes in one `sendmsg`, and a hashed body's hash with its last piece: a small
    /// push is one write (four before: a wake-up of the peer's reader each).
    async fn write(&self, conn: &mut ShmStream, request: &[u8]) -> Result<()> {
        let kind = |payload: &ShmPayload| {
            frame::encode(payload).map_err(|e| Error::io("encoding a frame", e))
        };
        match self {
            PushBody::Inline(data) => {
                let head = kind(&ShmPayload::Inline)?;
                conn.write_parts(&[request, &head, data], None).await
            }
            PushBody::Memfd(region) => {
                let head = kind(&ShmPayload::Memfd { offset: 0 })?;
                let fd = region.shared_fd()?;
                conn.write_parts(&[request, &head], Some(fd)).await
            }
            PushBody::Hashing(data) => {
                let head = kind(&ShmPayload::InlineHashAfter)?;
                // Each piece is copied into a buffer of this call's own, hashed there while
                // in cache and written from there: what is hashed is what was sent, even if
                // `data` changes meanwhile (another thread writing the array).
                let mut hasher = blake3::Hasher::new();
                let mut piece = vec![0u8; super::FILL_PIECE.min(data.len())];
                let count = data.len().div_ceil(super::FILL_PIECE);
                if count == 0 {
                    let hash = hasher.finalize();
                    return conn
                        .write_parts(&[request, &head, hash.as_bytes()], None)
                        .await;
                }
                for (i, from) in data.chunks(super::FILL_PIECE).enumerate() {
                    let piece = &mut piece[..from.len()];
                    piece.copy_from_slice(from);
                    hasher.update(piece);
                    let (first, last) = (i == 0, i + 1 == count);
                    let hash = last.then(|| hasher.finalize());
                    let hash = hash.as_ref().map_or(&[][..], |h| h.as_bytes());
                    let front: [&[u8]; 2] = if first { [request, &head] } else { [&[], &[]] };
                    conn.write_parts(&[front[0], front[1], piece, hash], None)
                        .await?;
                }
                Ok(())
            }
        }
    }
}

/// Pushes `tensor` as `name` to `peer` on the same-host socket and waits for its `Ack`.
async fn push(
    ctx: &NodeCtx,
    route: &ShmRoute,
    name: &TensorName,
    tensor: &Tensor,
) -> Result<(), ChannelError> {
    let data = tensor.host_data().ok_or_else(|| {
        ChannelError::Fallback(Error::Io("a device tensor goes over QUIC".into()))
    })?;
    // Above the inline limit, as the tensor's sealed memfd (made once per tensor, then
    // reused); below it inline, which leaves the tensor's memfd unsealed (poolable).
    let region;
    let body = if data.len() > INLINE_MAX {
        region = tensor.shm_region().map_err(ChannelError::Fallback)?;
        PushBody::Memfd(&region)
    } else {
        PushBody::Inline(data)
    };
    push_body(ctx, route, name, tensor.meta(), body).await
}

/// Sends a push's request and `body` and waits for its `Ack` (a broken pooled connection is
/// tried once more on a new one).
async fn push_body(
    ctx: &NodeCtx,
    route: &ShmRoute,
    name: &TensorName,
    meta: &TensorMeta,
    body: PushBody<'_>,
) -> Result<(), ChannelError> {
    let peer = route.peer;
    let request = DataRequest::Push {
        name: name.clone(),
        meta: meta.clone(),
    };
    let what = describe(name, None, &peer);
    let request = frame::encode(&request)
        .map_err(|e| ChannelError::Final(Error::io("encoding a frame", e)))?;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut conn = connection(ctx, route, peer).await?;
        let sent = within(
            ctx.config.stall_timeout,
            &what,
            body.write(&mut conn, &request),
        )
        .await;
        let answer = match sent {
            Ok(()) => {
                let timeout = ctx.config.request_timeout;
                within(
                    timeout,
                    &what,
                    conn.read_frame::<DataResponse>(MAX_CONTROL_FRAME),
                )
                .await
            }
            Err(e) => Err(e),
        };
        match answer {
            Ok(DataResponse::Ack) => {
                route.shm.put_idle(peer, conn);
                return Ok(());
            }
            Ok(DataResponse::Error { code, message }) => {
                // The peer may have closed the socket after refusing: not pooled.
                let short = peer.fmt_short().to_string();
                let err = match code {
                    ErrorCode::Busy => Error::Busy(format!("{what}: {message}")),
                    code => remote_error_from(short, code, message),
                };
                return Err(ChannelError::Final(err));
            }
            Ok(other) => {
                let err = Error::Io(format!("{what}: unexpected answer {other:?}"));
                return Err(ChannelError::Final(err));
            }
            Err(err) if attempts >= 2 => return Err(ChannelError::Fallback(err)),
            Err(_) => {}
        }
    }
}

/// A pooled connection to `peer`, or a new one (connected, credentials checked, hello sent).
pub(super) async fn connection(
    ctx: &NodeCtx,
    route: &ShmRoute,
    peer: EndpointId,
) -> Result<ShmStream, ChannelError> {
    let (shm, socket, token) = (&route.shm, route.socket, route.token);
    if let Some(conn) = shm.take_idle(&peer) {
        return Ok(conn);
    }
    let connect = async {
        let addr = super::socket_addr(&socket)?;
        // A local connect never blocks for long: the listener's backlog answers at once.
        let std = std::os::unix::net::UnixStream::connect_addr(&addr)
            .map_err(|e| Error::io("connecting to a same-host peer", e))?;
        std.set_nonblocking(true)
            .map_err(|e| Error::io("connecting to a same-host peer", e))?;
        let stream = UnixStream::from_std(std)
            .map_err(|e| Error::io("connecting to a same-host peer", e))?;
        let cred = stream
            .peer_cred()
            .map_err(|e| Error::io("reading a same-host peer's credentials", e))?;
        if cred.uid() != shm.uid {
            return Err(Error::Unauthorized(format!(
                "the same-host socket of {} runs as uid {}, not {}",
                peer.fmt_short(),
                cred.uid(),
                shm.uid
            )));
        }
        shm.opened
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut conn = ShmStream::new(stream);
        let hello = ShmHello {
            node: *ctx.endpoint.id().as_bytes(),
            access: ctx.config.cluster_key.access(),
            token,
        };
        conn.write_frame(&hello).await?;
        Ok(conn)
    };
    within(
        ctx.config.connect_timeout,
        "a same-host connection",
        connect,
    )
    .await
    .map_err(ChannelError::Fallback)
}

fn describe(name: &TensorName, version: Option<u64>, peer: &EndpointId) -> String {
    let peer = peer.fmt_short();
    match version {
        Some(v) => format!("tensor \"{name}\" v{v} at {peer} (shm)"),
        None => format!("tensor \"{name}\" at {peer} (shm)"),
    }
}
