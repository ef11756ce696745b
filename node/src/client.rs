//! The requesting side of `tb/data/1`: pull a tensor into a caller-supplied buffer, push one.
//! Each call opens its own bi-stream on a pooled link, so a large transfer never blocks a
//! small one.
//!
//! A peer closes a link gracefully (idle or LRU eviction) only while no stream is open on it
//! in either direction, so a request that races with such a close was never served: it is
//! sent again, once, on a fresh link ([`after_failure`]) rather than failing the transfer.

use std::future::Future;

use iroh::endpoint::{RecvStream, SendStream};
use tb_dashboard::Direction;
use tb_dashboard::TransferKind;
use tb_proto::{
    CloseCode, ContentHash, DataRequest, DataResponse, ErrorCode, TensorMeta, TensorName,
};
use tracing::debug;

use crate::{
    LinkGuard,
    channel::quic,
    ctx::NodeCtx,
    device::{self, DeviceBuffer},
    error::{Error, Result},
    progress::TransferProgress,
    tensor::Tensor,
    wire,
};

/// How many times a request is sent again after the peer closed its link gracefully under
/// it. One: the fresh link was just dialed, so a second such race means something else.
pub(crate) const REDIALS: usize = 1;

/// What a pull delivered: the verified metadata, the version, and the caller's buffer.
#[derive(Debug)]
pub struct Pulled<B> {
    /// The tensor's name.
    pub name: TensorName,
    /// The version that was sent.
    pub version: u64,
    /// Verified metadata (the bytes in `buffer` hash to `meta.hash`).
    pub meta: TensorMeta,
    /// The destination buffer, filled.
    pub buffer: B,
}

impl Pulled<crate::channel::HostBuf> {
    /// The received (verified) bytes as a tensor that owns them.
    pub(crate) fn into_tensor(self) -> Result<Pulled<Tensor>> {
        let tensor = self.buffer.into_tensor(self.meta.clone())?;
        Ok(Pulled {
            name: self.name,
            version: self.version,
            meta: self.meta,
            buffer: tensor,
        })
    }
}

/// What to do after a request failed on a link.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The peer closed the link gracefully before serving the request: send it again on a
    /// fresh link.
    Redial(Error),
    /// Give up with this error.
    Final(Error),
}

/// Decides what a request that failed on `link` with `err`, before any answer to it arrived,
/// does next. A peer closes a link with `IdleEvicted` or `LruEvicted` only while no stream is
/// open on it in either direction (the streams it serves hold the link in use), so a request
/// that lost that race was never served: redial. `TooManyConnections`: the peer's pool is
/// full, and it refused the link before serving anything on it.
pub(crate) fn after_failure(link: &LinkGuard, err: Error) -> Failure {
    let transport = matches!(err, Error::Io(_) | Error::PeerUnreachable { .. });
    match link.peer_close() {
        Some(CloseCode::IdleEvicted | CloseCode::LruEvicted) if transport => Failure::Redial(err),
        Some(CloseCode::TooManyConnections) => Failure::Final(Error::TooManyConnections {
            peer: Some(link.peer().fmt_short().to_string()),
            max: None,
        }),
        _ => Failure::Final(err),
    }
}

/// Runs `attempt` on a link from `links`, and once more on a fresh link when the peer closed
/// the first gracefully before answering ([`after_failure`]). `attempt` gets the link and
/// hands it back with its error; it must fail only before any answer arrived, or be safe to
/// repeat.
pub(crate) async fn with_redial<T, L, LF, A, AF>(links: L, mut attempt: A) -> Result<T>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
    A: FnMut(LinkGuard) -> AF,
    AF: Future<Output = Result<T, (LinkGuard, Error)>>,
{
    let mut redials = 0;
    loop {
        let (link, err) = match attempt(links().await?).await {
            Ok(value) => return Ok(value),
            Err(failed) => failed,
        };
        match after_failure(&link, err) {
            Failure::Redial(err) if redials < REDIALS => {
                redials += 1;
                let peer = link.peer().fmt_short();
                debug!(%peer, %err, "the peer closed the link under a request: redialing");
            }
            Failure::Redial(err) | Failure::Final(err) => return Err(err),
        }
    }
}

pub(crate) async fn open(ctx: &NodeCtx, link: &LinkGuard) -> Result<(SendStream, RecvStream)> {
    let timeout = ctx.config.request_timeout;
    match tokio::time::timeout(timeout, link.connection().open_bi()).await {
        Ok(Ok(streams)) => Ok(streams),
        Ok(Err(e)) => Err(Error::PeerUnreachable {
            peer: link.peer().fmt_short().to_string(),
            reason: format!("opening a stream: {e}"),
        }),
        Err(_) => Err(Error::timeout("a stream to open", timeout)),
    }
}

pub(crate) async fn read_response(
    ctx: &NodeCtx,
    recv: &mut RecvStream,
    what: &str,
) -> Result<DataResponse> {
    let timeout = ctx.config.request_timeout;
    match tokio::time::timeout(timeout, wire::read_frame(recv)).await {
        Ok(Ok(resp)) => Ok(resp),
        Ok(Err(e)) => Err(e.into_error(&format!("answer for {what}")).into()),
        Err(_) => Err(Error::timeout(format!("answer for {what}"), timeout)),
    }
}

/// Pulls `name` from the peer of the links `links` gives into the buffer `alloc` returns
/// for the metadata.
pub(crate) async fn pull_into<B, F, L, LF>(
    ctx: &NodeCtx,
    links: L,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<B>>
where
    B: AsMut<[u8]>,
    F: FnOnce(&TensorMeta) -> Result<B>,
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let pull = pull_into_untimed(ctx, links, name, version, alloc);
    ctx.timed(TransferKind::Pull, pull).await
}

async fn pull_into_untimed<B, F, L, LF>(
    ctx: &NodeCtx,
    links: L,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<B>>
where
    B: AsMut<[u8]>,
    F: FnOnce(&TensorMeta) -> Result<B>,
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let mut started = start_pull(ctx, links, &name, version).await?;
    let mut buffer = alloc(&started.meta)?;
    let dest = buffer.as_mut();
    check_len(&started.what, dest.len(), &started.meta)?;
    // A loan is served once: its bytes come on this one stream.
    let stripes = match crate::is_lent_name(&name) {
        true => 1,
        false => quic::stripes_for(ctx, &started._link, &started.meta),
    };
    let hash = if stripes > 1 {
        let pull = quic::Striped {
            link: &started._link,
            name: &name,
            version: started.version,
            meta: &started.meta,
            what: &started.what,
        };
        quic::recv_striped(ctx, pull, &mut started.recv, dest, stripes).await?
    } else {
        let watchdog = ctx.quic_watchdog(Direction::In);
        wire::recv_payload(&mut started.recv, dest, watchdog).await?
    };
    verify(ctx, &started.what, &started.meta, hash)?;
    Ok(Pulled {
        name,
        version: started.version,
        meta: started.meta,
        buffer,
    })
}

/// Pulls `name` from the peer of the links `links` gives into the device buffer `alloc`
/// returns for the metadata, through pinned staging.
pub(crate) async fn pull_into_device<F, L, LF>(
    ctx: &NodeCtx,
    links: L,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<DeviceBuffer>>
where
    F: FnOnce(&TensorMeta) -> Result<DeviceBuffer>,
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let pull = pull_into_device_untimed(ctx, links, name, version, alloc);
    ctx.timed(TransferKind::Pull, pull).await
}

async fn pull_into_device_untimed<F, L, LF>(
    ctx: &NodeCtx,
    links: L,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<DeviceBuffer>>
where
    F: FnOnce(&TensorMeta) -> Result<DeviceBuffer>,
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let mut started = start_pull(ctx, links, &name, version).await?;
    let mut buffer = alloc(&started.meta)?;
    check_len(&started.what, buffer.len(), &started.meta)?;
    let cuda = &ctx.config.cuda;
    let watchdog = ctx.quic_watchdog(Direction::In);
    let hash = device::recv_payload(&mut started.recv, &mut buffer, watchdog, cuda).await?;
    verify(ctx, &started.what, &started.meta, hash)?;
    Ok(Pulled {
        name,
        version: started.version,
        meta: started.meta,
        buffer,
    })
}

/// A pull whose header arrived: the payload follows on `recv`.
struct Started {
    /// Held until the payload is in: the stream is open on this link.
    _link: LinkGuard,
    _send: SendStream,
    recv: RecvStream,
    meta: TensorMeta,
    version: u64,
    what: String,
}

/// Sends a `Pull` and reads the answer up to the payload, redialing once if the peer closed
/// the link before answering.
async fn start_pull<L, LF>(
    ctx: &NodeCtx,
    links: L,
    name: &TensorName,
    version: Option<u64>,
) -> Result<Started>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    with_redial(links, |link| async move {
        let what = describe(name, version, &link);
        match request_pull(ctx, &link, name, version, None, &what).await {
            Ok((send, recv, meta, version)) => Ok(Started {
                _link: link,
                _send: send,
                recv,
                meta,
                version,
                what,
            }),
            Err(err) => Err((link, err)),
        }
    })
    .await
}

/// Sends a `Pull` (of `range` of the payload, or all of it) on a new stream of `link` and
/// reads the answer up to the payload: the streams, the validated metadata and the version.
/// The one way every QUIC pull starts (whole, striped, resumed); each checks the header
/// against what it expects.
pub(crate) async fn request_pull(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: &TensorName,
    version: Option<u64>,
    range: Option<tb_proto::ByteRange>,
    what: &str,
) -> Result<(SendStream, RecvStream, TensorMeta, u64)> {
    let (mut send, mut recv) = open(ctx, link).await?;
    let request = DataRequest::Pull {
        name: name.clone(),
        version,
        range,
    };
    wire::write_frame(&mut send, &request).await?;
    let _ = send.finish();
    let (meta, version) = match read_response(ctx, &mut recv, what).await? {
        DataResponse::Header { meta, version } => (meta, version),
        DataResponse::Error { code, message } => return Err(remote_error(link, code, message)),
        other => {
            let answer = format!("{what}: unexpected answer to a Pull: {other:?}");
            return Err(Error::Io(answer));
        }
    };
    meta.validate(ctx.config.max_tensor_bytes)?;
    Ok((send, recv, meta, version))
}

fn check_len(what: &str, len: usize, meta: &TensorMeta) -> Result<()> {
    if len as u64 != meta.byte_len {
        return Err(Error::InvalidTensor(format!(
            "{what}: destination buffer has {len} bytes, the tensor {}",
            meta.byte_len
        )));
    }
    Ok(())
}

/// Counts the finished receive (its bytes were counted as they moved) and checks they hash
/// to what the sender announced.
fn verify(ctx: &NodeCtx, what: &str, meta: &TensorMeta, hash: ContentHash) -> Result<()> {
    ctx.metrics.channels.finished(tb_proto::ChannelKind::Quic);
    if hash != meta.hash {
        return Err(Error::Corrupt(format!(
            "{what}: expected hash {}, got {hash}",
            meta.hash
        )));
    }
    Ok(())
}

/// Pushes `tensor` as `name` to the peer of the links `links` gives and waits for its `Ack`
/// (sent again on a fresh link if the peer closed the first before serving it); the payload
/// bytes handed to QUIC so far go to `progress`.
pub(crate) async fn push<L, LF>(
    ctx: &NodeCtx,
    links: L,
    name: TensorName,
    tensor: &Tensor,
    progress: Option<&TransferProgress>,
) -> Result<()>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let name = &name;
    let push = with_redial(links, |link| async move {
        match push_untimed(ctx, &link, name.clone(), tensor, progress).await {
            Ok(()) => Ok(()),
            Err(err) => Err((link, err)),
        }
    });
    ctx.timed(TransferKind::Push, push).await
}

async fn push_untimed(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: TensorName,
    tensor: &Tensor,
    progress: Option<&TransferProgress>,
) -> Result<()> {
    let what = describe(&name, None, link);
    let (mut send, mut recv) = open(ctx, link).await?;
    let request = DataRequest::Push {
        name,
        meta: tensor.meta().clone(),
    };
    // If the peer refuses early (too large, invalid) it stops our stream: its answer says why.
    let all = 0..tensor.data_len()?;
    let config = &ctx.config;
    let meter = ctx.quic_meter(Direction::Out);
    let sent =
        device::write_header_and_tensor(&mut send, &request, tensor, all, config, meter, progress);
    let sent = sent.await;
    let _ = send.finish();
    let answer = read_response(ctx, &mut recv, &what).await;
    match (answer, sent) {
        (Ok(DataResponse::Ack), Ok(())) => {
            ctx.metrics.channels.finished(tb_proto::ChannelKind::Quic);
            Ok(())
        }
        // A receiver whose push budget or inbox is full kept nothing: the caller may retry.
        (
            Ok(DataResponse::Error {
                code: ErrorCode::Busy,
                message,
            }),
            _,
        ) => Err(Error::Busy(format!("{what}: {message}"))),
        (Ok(DataResponse::Error { code, message }), _) => Err(remote_error(link, code, message)),
        (_, Err(e)) => Err(e),
        (Ok(other), Ok(())) => Err(Error::Io(format!("{what}: unexpected answer {other:?}"))),
        (Err(e), Ok(())) => Err(e),
    }
}

fn describe(name: &TensorName, version: Option<u64>, link: &LinkGuard) -> String {
    let peer = link.peer().fmt_short();
    match version {
        Some(v) => format!("tensor \"{name}\" v{v} at {peer}"),
        None => format!("tensor \"{name}\" at {peer}"),
    }
}

/// Maps a peer's error frame onto the variant a caller can act on.
pub(crate) fn remote_error(link: &LinkGuard, code: ErrorCode, message: String) -> Error {
    remote_error_from(link.peer().fmt_short().to_string(), code, message)
}

/// Maps an error frame from `peer` (a short node id) onto the variant a caller can act on.
pub(crate) fn remote_error_from(peer: String, code: ErrorCode, message: String) -> Error {
    match code {
        ErrorCode::NotFound => Error::NotFound {
            what: format!("{message} at {peer}"),
        },
        ErrorCode::TooLarge => Error::TooLarge(format!("refused by {peer}: {message}")),
        ErrorCode::InvalidTensor => Error::InvalidTensor(format!("refused by {peer}: {message}")),
        ErrorCode::Corrupt => Error::Corrupt(format!("reported by {peer}: {message}")),
        ErrorCode::Unauthorized => Error::Unauthorized(format!("{peer}: {message}")),
        code => Error::Remote {
            peer,
            code,
            message,
        },
    }
}

/// A request's stream with its request sent and the first answer read
/// ([`Node::open_request`](crate::Node::open_request)): a connection of the pair's
/// same-host socket, or a stream on the peer's pooled link (held in use while it lives).
#[derive(Debug)]
pub struct RequestStream {
    /// The rest of what the requester sends.
    pub send: crate::RequestSend,
    /// What the peer sends after its first answer.
    pub recv: crate::RequestRecv,
    /// The peer's first answer frame.
    pub answer: DataResponse,
    /// The link of a QUIC stream (held in use until the stream is dropped); `None` on a
    /// same-host connection.
    pub link: Option<LinkGuard>,
}

impl RequestStream {
    /// A counter that grows while the peer is heard from: the bytes its link received (a
    /// stream's frames can wait behind other streams' bytes on a busy link), or those its
    /// same-host connection received.
    pub fn heard(&self) -> impl Fn() -> u64 + Send + Sync + 'static {
        let link = self.link.as_ref().map(|l| l.connection().clone());
        let socket = self.recv.socket_heard();
        move || match (&link, &socket) {
            (Some(conn), _) => conn.stats().udp_rx.bytes,
            (None, Some(heard)) => heard.load(std::sync::atomic::Ordering::Relaxed),
            (None, None) => 0,
        }
    }
}

/// Opens a request to `peer`: on the pair's same-host socket when the pair runs shm and the
/// peer serves the kind there, else on a stream of a link from `links`; writes `request`
/// then `preamble` (then finishes the send side when `finish`), and reads the first answer
/// within `timeout` (on a link that keeps receiving meanwhile, up to the request timeout).
/// Redials once when the peer closed the link (or a pooled connection) gracefully before
/// answering.
pub(crate) async fn open_request<L, LF>(
    ctx: &NodeCtx,
    peer: &iroh::EndpointId,
    links: L,
    request: &DataRequest,
    preamble: &[&[u8]],
    finish: bool,
    timeout: std::time::Duration,
) -> Result<RequestStream>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    #[cfg(target_os = "linux")]
    {
        let on_socket = async |route: &crate::channel::Route| match route {
            crate::channel::Route::Shm(route) => {
                crate::channel::open_socket_request(ctx, route, request, preamble, finish, timeout)
                    .await
            }
            _ => Err(crate::channel::ChannelError::ViaQuic),
        };
        // Not a transfer: untimed (the service counts its own).
        if let Some(stream) = crate::channel::first(ctx, peer, &links, None, on_socket).await? {
            return Ok(stream);
        }
    }
    open_quic_request(ctx, links, request, preamble, finish, timeout).await
}

/// [`open_request`] on a stream of a link from `links`.
async fn open_quic_request<L, LF>(
    ctx: &NodeCtx,
    links: L,
    request: &DataRequest,
    preamble: &[&[u8]],
    finish: bool,
    timeout: std::time::Duration,
) -> Result<RequestStream>
where
    L: Fn() -> LF,
    LF: Future<Output = Result<LinkGuard>>,
{
    let what = format!("a {} request", request.kind());
    with_redial(links, |link| {
        let what = &what;
        async move {
            let sent = async {
                let (mut send, mut recv) = open(ctx, &link).await?;
                wire::write_frame(&mut send, request).await?;
                // A service may refuse at once and stop reading: the refusal is still the
                // answer, so a failed write is reported only if no answer comes.
                let mut unwritten = None;
                for part in preamble {
                    if let Err(e) = send.write_all(part).await {
                        unwritten = Some(Error::Io(format!("{what}: writing: {e}")));
                        break;
                    }
                }
                // The end of the stream goes out in the request's last packet, not in one of
                // its own (which the peer would acknowledge in one more).
                if finish && unwritten.is_none() {
                    let _ = send.finish();
                }
                // The answer can wait behind other streams' bytes on a busy link (many large
                // calls at once): past `timeout` it is waited for while the link as a whole
                // still receives, up to the node's request timeout; a quiet link fails it.
                let conn = link.connection().clone();
                let heard = || conn.stats().udp_rx.bytes;
                let longest = timeout.max(ctx.config.request_timeout);
                let started = tokio::time::Instant::now();
                let read = {
                    let read = wire::read_frame(&mut recv);
                    tokio::pin!(read);
                    let mut seen = heard();
                    loop {
                        match tokio::time::timeout(timeout, &mut read).await {
                            Ok(read) => break read,
                            Err(_) if heard() != seen && started.elapsed() < longest => {
                                seen = heard();
                            }
                            Err(_) => {
                                let waited = started.elapsed();
                                return Err(Error::timeout(format!("answer for {what}"), waited));
                            }
                        }
                    }
                };
                let answer = match read {
                    Ok(answer) => answer,
                    Err(e) => {
                        let unread = e.into_error(&format!("answer for {what}")).into();
                        return Err(unwritten.unwrap_or(unread));
                    }
                };
                Ok::<_, Error>((send, recv, answer))
            };
            match sent.await {
                Ok((send, recv, answer)) => Ok(RequestStream {
                    send: send.into(),
                    recv: recv.into(),
                    answer,
                    link: Some(link),
                }),
                Err(err) => Err((link, err)),
            }
        }
    })
    .await
}
