//! A broker's control requests on the same-host socket ([`DataRequest::Ctl`]): a node on its
//! broker's host sends publishes, look-ups and the like down the shm channel's unix socket
//! instead of the QUIC `tb/ctl/1` link, which costs a fraction of a QUIC round trip (the
//! same trade as watches on the socket). The broker's node answers them through the
//! [`SocketCtl`](crate::SocketCtl) its broker registered
//! ([`Node::serve_ctl_on_socket`](crate::Node::serve_ctl_on_socket)); a node that runs no
//! broker answers `Unsupported`. The peer and its access are the socket's, proven by its
//! hello; the broker authorizes and validates each request as on its own link.

use tb_proto::{
    Access, CtlRequest, CtlResponse, DataRequest, ErrorCode, MAX_CONTROL_FRAME, NodeId,
};

use super::{ShmRoute, client::connection, socket::ShmStream, socket::within};
use crate::{
    channel::ChannelError,
    ctx::NodeCtx,
    error::{Error, Result},
};

/// Serves one `Ctl` request on a same-host connection: reads the control request and writes
/// its answers. `Err`: the connection must close.
pub(crate) async fn serve(
    ctx: &NodeCtx,
    conn: &mut ShmStream,
    peer: NodeId,
    access: Access,
) -> Result<()> {
    let limit = ctx.config.request_timeout;
    let request = within(limit, "a same-host control request", async {
        conn.read_frame::<CtlRequest>(MAX_CONTROL_FRAME).await
    })
    .await?;
    if let CtlRequest::Subscribe { pattern } = request {
        return serve_subscription(ctx, conn, peer, access, pattern).await;
    }
    let answers = match ctx.socket_ctl.get() {
        Some(handler) => handler.answer(peer, access, request).await,
        None => vec![CtlResponse::Error {
            code: ErrorCode::Unsupported,
            message: "this node runs no broker".into(),
        }],
    };
    let stall = ctx.config.stall_timeout;
    within(stall, "control answers", async {
        for answer in &answers {
            conn.write_frame(answer).await?;
        }
        Ok(())
    })
    .await
}

/// Serves a subscription on the socket for as long as the peer keeps it: writes the
/// broker's frames as they come. It ends when the broker ends it, when a frame cannot be
/// written within the stall timeout, or when the peer closes its end (it never writes after
/// its request); the connection is not used again (`Err`).
async fn serve_subscription(
    ctx: &NodeCtx,
    conn: &mut ShmStream,
    peer: NodeId,
    access: Access,
    pattern: tb_proto::NamePattern,
) -> Result<()> {
    use n0_future::StreamExt;

    let Some(handler) = ctx.socket_ctl.get() else {
        let refusal = CtlResponse::Error {
            code: ErrorCode::Unsupported,
            message: "this node runs no broker".into(),
        };
        let stall = ctx.config.stall_timeout;
        within(stall, "a refusal", conn.write_frame(&refusal)).await?;
        return Err(Error::Io("no subscription here".into()));
    };
    let mut frames = handler.subscribe(peer, access, pattern).await;
    let stall = ctx.config.stall_timeout;
    loop {
        let frame = tokio::select! {
            _ = ctx.cancel.cancelled() => return Err(Error::Shutdown),
            frame = frames.next() => frame,
            gone = peer_closed(conn) => return Err(gone),
        };
        let Some(frame) = frame else {
            return Err(Error::Io("the subscription ended".into()));
        };
        let last = matches!(frame, CtlResponse::Error { .. });
        within(stall, "a subscription's frame", conn.write_frame(&frame)).await?;
        if last {
            return Err(Error::Io("the subscription ended".into()));
        }
    }
}

/// Waits until the peer of a connection it never writes to again closes it (or writes,
/// which breaks the protocol): why the connection ends. Cancel-safe.
async fn peer_closed(conn: &ShmStream) -> Error {
    let socket = conn.socket();
    loop {
        if let Err(e) = socket.readable().await {
            return Error::io("waiting on a subscriber's socket", e);
        }
        let mut byte = [0u8; 1];
        match socket.try_read(&mut byte) {
            Ok(0) => return Error::Io("the subscriber closed its socket".into()),
            Ok(_) => return Error::Io("a subscriber wrote on its subscription".into()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Error::io("reading a subscriber's socket", e),
        }
    }
}

/// Opens a subscription (`request`, a `Subscribe`) to the broker at the route's peer on a
/// connection of its own and reads the broker's first answer within `timeout`, validated:
/// the connection, for [`read_event`], and that answer (`Ok`, or why not). `Fallback`: the
/// socket failed before an answer (tried once more on a fresh connection first, as a pooled
/// one may be stale) or the answer is late.
pub(crate) async fn open_subscription(
    ctx: &NodeCtx,
    route: &ShmRoute,
    request: &CtlRequest,
    timeout: std::time::Duration,
) -> Result<(ShmStream, CtlResponse), ChannelError> {
    let max = ctx.config.max_tensor_bytes;
    let broker = route.peer.fmt_short().to_string();
    for attempt in 0..2 {
        let mut conn = connection(ctx, route, route.peer).await?;
        let opened = async {
            within(timeout, "a same-host subscription", async {
                conn.write_frames_and(&DataRequest::Ctl, request, &[], None)
                    .await
            })
            .await?;
            read_answer(&mut conn, &broker, timeout, max).await
        };
        match opened.await {
            Ok(first) => return Ok((conn, first)),
            Err(e @ Error::Timeout { .. }) => return Err(ChannelError::Fallback(e)),
            Err(e) if attempt == 1 => return Err(ChannelError::Fallback(e)),
            Err(_) => continue,
        }
    }
    Err(ChannelError::Fallback(Error::Io(
        "a same-host subscription".into(),
    )))
}

/// The next frame of a subscription opened with [`open_subscription`], validated; it waits
/// as long as the broker has nothing to tell. Not cancel-safe.
pub(crate) async fn read_event(
    conn: &mut ShmStream,
    broker: &str,
    max_tensor_bytes: u64,
) -> Result<CtlResponse> {
    let frame = conn.read_frame::<CtlResponse>(MAX_CONTROL_FRAME).await?;
    frame
        .validate(max_tensor_bytes)
        .map_err(|e| Error::Io(format!("broker {broker} sent an invalid event: {e}")))?;
    Ok(frame)
}

/// Sends `request` to the broker at the route's peer on the same-host socket and reads its
/// answer frames up to the final one (each validated): the first within `first_within`, each
/// later one within `timeout`. `Fallback` when the socket failed before any answer (sent once
/// more on a fresh connection first) or the first answer is late (a frozen or overloaded
/// broker: the caller's QUIC race then tries the others): send it on the QUIC link instead.
/// An `Error` answer is the last frame returned, for the caller to judge as on QUIC.
pub(crate) async fn exchange(
    ctx: &NodeCtx,
    route: &ShmRoute,
    request: &CtlRequest,
    first_within: std::time::Duration,
    timeout: std::time::Duration,
) -> Result<Vec<CtlResponse>, ChannelError> {
    let max = ctx.config.max_tensor_bytes;
    let broker = route.peer.fmt_short().to_string();
    for attempt in 0..2 {
        let mut conn = connection(ctx, route, route.peer).await?;
        let sent = within(timeout, "a same-host control request", async {
            conn.write_frames_and(&DataRequest::Ctl, request, &[], None)
                .await
        })
        .await;
        let first = match sent {
            Ok(()) => read_answer(&mut conn, &broker, first_within, max).await,
            Err(e) => Err(e),
        };
        let first = match first {
            Ok(first) => first,
            Err(e @ Error::Timeout { .. }) => return Err(ChannelError::Fallback(e)),
            Err(e) if attempt == 1 => return Err(ChannelError::Fallback(e)),
            Err(_) => continue,
        };
        // Answered: what follows is final either way (no resend: it may have been applied).
        let mut frames = Vec::new();
        let mut next = first;
        loop {
            let done = next.is_final() || matches!(next, CtlResponse::Error { .. });
            frames.push(next);
            if done {
                break;
            }
            if frames.len() >= MAX_ANSWER_FRAMES {
                return Err(ChannelError::Final(Error::Io(format!(
                    "broker {broker} sent over {MAX_ANSWER_FRAMES} frames without a final one"
                ))));
            }
            let read = read_answer(&mut conn, &broker, timeout, max).await;
            next = read.map_err(ChannelError::Final)?;
        }
        route.shm.put_idle(route.peer, conn);
        return Ok(frames);
    }
    Err(ChannelError::Fallback(Error::Io(
        "a same-host control request".into(),
    )))
}

/// Most answer frames one request may bring before its final one (as on the QUIC link).
const MAX_ANSWER_FRAMES: usize = 4096;

/// One answer frame, validated.
async fn read_answer(
    conn: &mut ShmStream,
    broker: &str,
    timeout: std::time::Duration,
    max_tensor_bytes: u64,
) -> Result<CtlResponse> {
    let what = format!("an answer from broker {broker}");
    let frame = within(timeout, &what, async {
        conn.read_frame::<CtlResponse>(MAX_CONTROL_FRAME).await
    })
    .await?;
    frame
        .validate(max_tensor_bytes)
        .map_err(|e| Error::Io(format!("broker {broker} sent an invalid answer: {e}")))?;
    Ok(frame)
}
