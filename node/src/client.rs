//! The requesting side of `tb/data/1`: pull a tensor into a caller-supplied buffer, push one.
//! Each call opens its own bi-stream on a pooled link, so a large transfer never blocks a
//! small one.

use iroh::endpoint::{RecvStream, SendStream};
use tb_dashboard::TransferKind;
use tb_proto::{ContentHash, DataRequest, DataResponse, ErrorCode, TensorMeta, TensorName};

use crate::{
    ctx::NodeCtx,
    device::{self, DeviceBuffer},
    error::{Error, Result},
    pool::LinkGuard,
    progress::TransferProgress,
    tensor::Tensor,
    wire,
};

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
        Ok(Err(e)) => Err(e.into_error(&format!("answer for {what}"))),
        Err(_) => Err(Error::timeout(format!("answer for {what}"), timeout)),
    }
}

/// Pulls `name` from the link's peer into the buffer `alloc` returns for the metadata.
pub(crate) async fn pull_into<B, F>(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<B>>
where
    B: AsMut<[u8]>,
    F: FnOnce(&TensorMeta) -> Result<B>,
{
    let pull = pull_into_untimed(ctx, link, name, version, alloc);
    ctx.timed(TransferKind::Pull, pull).await
}

async fn pull_into_untimed<B, F>(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<B>>
where
    B: AsMut<[u8]>,
    F: FnOnce(&TensorMeta) -> Result<B>,
{
    let what = describe(&name, version, link);
    let (_send, mut recv, meta, version) = start_pull(ctx, link, &name, version, &what).await?;
    let mut buffer = alloc(&meta)?;
    let dest = buffer.as_mut();
    check_len(&what, dest.len(), &meta)?;
    let hash = wire::recv_payload(&mut recv, dest, ctx.config.stall_timeout).await?;
    verify(ctx, &what, &meta, hash)?;
    Ok(Pulled {
        name,
        version,
        meta,
        buffer,
    })
}

/// Pulls `name` from the link's peer into the device buffer `alloc` returns for the
/// metadata, through pinned staging.
pub(crate) async fn pull_into_device<F>(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<DeviceBuffer>>
where
    F: FnOnce(&TensorMeta) -> Result<DeviceBuffer>,
{
    let pull = pull_into_device_untimed(ctx, link, name, version, alloc);
    ctx.timed(TransferKind::Pull, pull).await
}

async fn pull_into_device_untimed<F>(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: TensorName,
    version: Option<u64>,
    alloc: F,
) -> Result<Pulled<DeviceBuffer>>
where
    F: FnOnce(&TensorMeta) -> Result<DeviceBuffer>,
{
    let what = describe(&name, version, link);
    let (_send, mut recv, meta, version) = start_pull(ctx, link, &name, version, &what).await?;
    let mut buffer = alloc(&meta)?;
    check_len(&what, buffer.len(), &meta)?;
    let stall = ctx.config.stall_timeout;
    let hash = device::recv_payload(&mut recv, &mut buffer, stall, &ctx.config.cuda).await?;
    verify(ctx, &what, &meta, hash)?;
    Ok(Pulled {
        name,
        version,
        meta,
        buffer,
    })
}

/// Sends a `Pull` and reads the answer up to the payload: the streams, the validated
/// metadata and the version.
async fn start_pull(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: &TensorName,
    version: Option<u64>,
    what: &str,
) -> Result<(SendStream, RecvStream, TensorMeta, u64)> {
    let (mut send, mut recv) = open(ctx, link).await?;
    let request = DataRequest::Pull {
        name: name.clone(),
        version,
        range: None,
    };
    wire::write_frame(&mut send, &request).await?;
    let _ = send.finish();
    let (meta, version) = match read_response(ctx, &mut recv, what).await? {
        DataResponse::Header { meta, version } => (meta, version),
        DataResponse::Error { code, message } => return Err(remote_error(link, code, message)),
        DataResponse::Ack => return Err(Error::Io(format!("{what}: peer sent Ack to a Pull"))),
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

/// Counts the received bytes and checks they hash to what the sender announced.
fn verify(ctx: &NodeCtx, what: &str, meta: &TensorMeta, hash: ContentHash) -> Result<()> {
    ctx.metrics.bytes_in.inc_by(meta.byte_len);
    if hash != meta.hash {
        return Err(Error::Corrupt(format!(
            "{what}: expected hash {}, got {hash}",
            meta.hash
        )));
    }
    Ok(())
}

/// Pushes `tensor` to the link's peer as `name` and waits for its `Ack`; the payload bytes
/// handed to QUIC so far go to `progress`.
pub(crate) async fn push(
    ctx: &NodeCtx,
    link: &LinkGuard,
    name: TensorName,
    tensor: &Tensor,
    progress: Option<&TransferProgress>,
) -> Result<()> {
    let push = push_untimed(ctx, link, name, tensor, progress);
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
    let sent = device::write_header_and_tensor(&mut send, &request, tensor, all, config, progress);
    let sent = sent.await;
    let _ = send.finish();
    let answer = read_response(ctx, &mut recv, &what).await;
    match (answer, sent) {
        (Ok(DataResponse::Ack), Ok(())) => {
            ctx.metrics.bytes_out.inc_by(tensor.byte_len());
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
