//! The holding side of the TCP channel: tickets asked on the QUIC link, and the listener
//! that admits sockets by token and writes their ranges.

use std::{sync::Arc, time::Duration};

use iroh::{EndpointId, endpoint::SendStream};
use tb_dashboard::{Direction, Meter};
use tb_proto::{
    ChannelKind, DataResponse, ErrorCode, TcpHello, TensorName, channel::MAX_TCP_HELLO_FRAME, frame,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tracing::debug;

use super::{MAX_HELLOS, MAX_SERVING, TCP_MIN_BYTES, Tcp};
use crate::{
    ctx::NodeCtx,
    error::{Error, Result},
    serve::{NotHeld, lookup},
    wire,
};

/// Bytes per write: large, so the kernel gets big copies, and bounded, so a stalled reader
/// is noticed within one stall timeout per write.
const WRITE_CHUNK: usize = 4 << 20;

/// Answers a [`TcpPull`](tb_proto::DataRequest::TcpPull) on the QUIC stream `send` with a
/// ticket for `sockets` sockets to the version, or an error; `Err(send)` hands the stream
/// back to be served as a plain QUIC pull — a tensor under [`TCP_MIN_BYTES`] (a ticket and
/// a connection would cost more than they win), a version still arriving (served
/// cut-through), device bytes, an upload limit (it paces QUIC streams), or too many
/// tickets outstanding.
pub(crate) async fn serve_ticket(
    ctx: &NodeCtx,
    peer: &EndpointId,
    mut send: SendStream,
    name: &TensorName,
    version: Option<u64>,
    sockets: u8,
) -> Result<(), SendStream> {
    let Some(answer) = ticket(ctx, peer, name, version, sockets) else {
        return Err(send);
    };
    let _ = wire::write_frame_within(&mut send, &answer, ctx.config.stall_timeout).await;
    let _ = send.finish();
    Ok(())
}

/// The ticket (or the error) answering a TCP pull, or `None`: serve it over QUIC.
fn ticket(
    ctx: &NodeCtx,
    peer: &EndpointId,
    name: &TensorName,
    version: Option<u64>,
    sockets: u8,
) -> Option<DataResponse> {
    let tcp = ctx.channels.tcp()?;
    // A loan is served once, on the stream it is asked on (a ticket is redeemed apart).
    if ctx.upload.is_some() || crate::is_lent_name(name) {
        return None;
    }
    let (version, tensor) = match lookup(ctx, peer, name, version) {
        Ok(found) => found,
        Err(NotHeld::Arriving(..)) => return None,
        Err(NotHeld::Refused(code, message)) => return Some(DataResponse::Error { code, message }),
    };
    if tensor.host_data().is_none() || tensor.byte_len() < TCP_MIN_BYTES {
        return None;
    }
    let meta = tensor.meta().clone();
    match tcp.issue(tensor, sockets, ctx.config.request_timeout) {
        Ok(Some(token)) => Some(DataResponse::TcpTicket {
            meta,
            version,
            token,
        }),
        Ok(None) => None,
        Err(err) => Some(DataResponse::Error {
            code: ErrorCode::Internal,
            message: err.to_string(),
        }),
    }
}

/// Starts accepting sockets on `tcp`'s listener (once; later calls do nothing).
pub(crate) fn spawn_listener(ctx: &Arc<NodeCtx>, tcp: &Arc<Tcp>) -> Result<()> {
    let Some(std) = crate::channel::take_listener(&tcp.listener) else {
        return Ok(());
    };
    let listener =
        TcpListener::from_std(std).map_err(|e| Error::io("listening on the TCP channel", e))?;
    let (ctx, tcp) = (ctx.clone(), tcp.clone());
    let serving = Arc::new(Semaphore::new(MAX_SERVING));
    let hellos = Arc::new(Semaphore::new(MAX_HELLOS));
    let tracker = ctx.tracker.clone();
    tracker.spawn(async move {
        // Bounded by the node's life: ends when it is cancelled.
        loop {
            let accepted = tokio::select! {
                _ = ctx.cancel.cancelled() => break,
                accepted = listener.accept() => accepted,
            };
            let Ok((stream, from)) = accepted else {
                // Out of descriptors, typically: do not spin on the error.
                tokio::time::sleep(crate::channel::ACCEPT_BACKOFF).await;
                continue;
            };
            // A socket waiting for its hello holds only a hello slot; a serving slot is
            // taken once its token is admitted, so idle sockets cannot switch the channel off.
            let Ok(hello) = hellos.clone().try_acquire_owned() else {
                debug!(%from, "TCP channel at its limit of sockets awaiting a hello: closed");
                ctx.metrics.channels.refused(ChannelKind::Tcp);
                continue;
            };
            let (ctx2, tcp2, serving) = (ctx.clone(), tcp.clone(), serving.clone());
            ctx.tracker.spawn(async move {
                tokio::select! {
                    _ = ctx2.cancel.cancelled() => {}
                    () = serve_socket(&ctx2, &tcp2, stream, hello, &serving) => {}
                }
            });
        }
    });
    Ok(())
}

/// Admits one socket by its hello (token and range) and writes the range's bytes; a socket
/// refused (no valid token, or every serving slot taken) is closed before any tensor byte,
/// and counted. `hello` is the socket's slot among those awaiting a hello, given back once
/// the hello is read.
async fn serve_socket(
    ctx: &NodeCtx,
    tcp: &Tcp,
    mut stream: TcpStream,
    hello: OwnedSemaphorePermit,
    serving: &Arc<Semaphore>,
) {
    let awaiting = hello;
    let hello = tokio::time::timeout(ctx.config.hello_timeout, read_hello(&mut stream)).await;
    let admitted = match hello {
        Ok(Ok(hello)) => tcp
            .admit(&hello.token, hello.range)
            .map_err(|e| e.to_string()),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no hello within {:?}", ctx.config.hello_timeout)),
    };
    drop(awaiting);
    let permit = match admitted {
        Ok(bytes) => match serving.clone().try_acquire_owned() {
            Ok(permit) => Ok((bytes, permit)),
            Err(_) => Err("the TCP channel is at its limit of sockets served".to_owned()),
        },
        Err(why) => Err(why),
    };
    let (bytes, _permit) = match permit {
        Ok(bytes) => bytes,
        Err(why) => {
            debug!(%why, "TCP channel socket refused");
            ctx.metrics.channels.refused(ChannelKind::Tcp);
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let meter = ctx.metrics.meter(ChannelKind::Tcp, Direction::Out);
    if let Err(err) = write_all(&mut stream, &bytes, &meter, ctx.config.stall_timeout).await {
        debug!(%err, "TCP channel socket not served");
    }
    let _ = stream.shutdown().await;
}

/// Reads the socket's first frame: a [`TcpHello`] of at most [`MAX_TCP_HELLO_FRAME`] bytes.
async fn read_hello(stream: &mut TcpStream) -> Result<TcpHello> {
    let mut prefix = [0u8; 4];
    let io = |e| Error::io("reading a TCP channel hello", e);
    stream.read_exact(&mut prefix).await.map_err(io)?;
    let len = frame::body_len_within(prefix, MAX_TCP_HELLO_FRAME)
        .map_err(|e| Error::Io(format!("a TCP channel hello: {e}")))?;
    let mut body = [0u8; MAX_TCP_HELLO_FRAME as usize];
    stream.read_exact(&mut body[..len]).await.map_err(io)?;
    frame::decode_body(&body[..len]).map_err(|e| Error::Io(format!("a TCP channel hello: {e}")))
}

/// Writes `bytes` in [`WRITE_CHUNK`] writes, each within `stall`, counting them on `meter`.
async fn write_all(
    stream: &mut TcpStream,
    bytes: &[u8],
    meter: &Meter,
    stall: Duration,
) -> Result<()> {
    for chunk in bytes.chunks(WRITE_CHUNK) {
        match tokio::time::timeout(stall, stream.write_all(chunk)).await {
            Ok(Ok(())) => meter.add(chunk.len() as u64),
            Ok(Err(e)) => return Err(Error::io("writing on a TCP channel socket", e)),
            Err(_) => return Err(Error::timeout("a TCP channel reader", stall)),
        }
    }
    Ok(())
}
