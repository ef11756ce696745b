//! The serving side of the shm channel: accept same-host connections, admit the peers whose
//! token and user check out, and answer their requests in order on each connection.

use std::{os::fd::AsFd, sync::Arc};

use iroh::EndpointId;
use tb_dashboard::TransferKind;
use tb_proto::{
    Access, AuthProof, ChannelKind, DataRequest, DataResponse, ErrorCode, ShmCopied, ShmHello,
    ShmPayload, TensorMeta, TensorName, channel::MAX_SHM_HELLO_FRAME, frame::MAX_CONTROL_FRAME,
};
use tokio::net::UnixListener;
use tracing::debug;

use super::{PULL_COPY_MAX, PULL_INLINE_MAX, Shm, socket::ShmStream, socket::within};
use crate::{
    ctx::NodeCtx,
    error::{Error, Result},
    inbox::Received,
    serve::{NotHeld, lookup_host},
    tensor::Tensor,
};

/// Starts accepting same-host connections on `shm`'s socket (once; later calls do nothing).
pub(crate) fn spawn_listener(ctx: &Arc<NodeCtx>, shm: &Arc<Shm>) -> Result<()> {
    let Some(std) = crate::channel::take_listener(&shm.listener) else {
        return Ok(());
    };
    let listener = UnixListener::from_std(std)
        .map_err(|e| Error::io("listening on the same-host socket", e))?;
    let ctx = ctx.clone();
    let shm = shm.clone();
    let tracker = ctx.tracker.clone();
    tracker.spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = ctx.cancel.cancelled() => break,
                accepted = listener.accept() => accepted,
            };
            let Ok((stream, _)) = accepted else {
                // Out of descriptors, typically: do not spin on the error.
                tokio::time::sleep(crate::channel::ACCEPT_BACKOFF).await;
                continue;
            };
            let (ctx2, shm2) = (ctx.clone(), shm.clone());
            ctx.tracker.spawn(async move {
                let conn = ShmStream::new(stream);
                tokio::select! {
                    _ = ctx2.cancel.cancelled() => {}
                    () = serve_connection(&ctx2, &shm2, conn) => {}
                }
            });
        }
    });
    Ok(())
}

/// Admits a connection (same user, valid token) and serves its requests until it closes or
/// stays idle past the idle timeout.
async fn serve_connection(ctx: &Arc<NodeCtx>, shm: &Shm, mut conn: ShmStream) {
    let (peer, access) = match admit(ctx, shm, &mut conn).await {
        Ok(admitted) => admitted,
        Err(err) => {
            debug!(%err, "same-host connection refused");
            return;
        }
    };
    // Bounded by the peer: each round serves one request or ends the connection.
    loop {
        let idle = ctx.config.idle_timeout;
        let read = within(idle, "a same-host request", async {
            conn.read_frame::<DataRequest>(tb_proto::MAX_DATA_REQUEST_FRAME)
                .await
        });
        let Ok(request) = read.await else { return };
        // A request of a service kind takes the connection over until it ends (one that
        // answers on links only tells the peer `Unsupported` there).
        if matches!(request, DataRequest::Call { .. } | DataRequest::CudaIpc(_)) {
            match serve_service(ctx, conn, peer, access, request).await {
                Some(back) => conn = back,
                None => return,
            }
            continue;
        }
        if let Err(err) = serve_request(ctx, &mut conn, peer, access, request).await {
            debug!(peer = %peer.fmt_short(), %err, "same-host connection closed");
            return;
        }
    }
}

/// Checks the peer's user and its hello's token: the connection belongs to that node with
/// that access.
async fn admit(ctx: &NodeCtx, shm: &Shm, conn: &mut ShmStream) -> Result<(EndpointId, Access)> {
    let cred = conn
        .socket()
        .peer_cred()
        .map_err(|e| Error::io("reading a same-host peer's credentials", e))?;
    if cred.uid() != shm.uid {
        ctx.metrics
            .auth_failures
            .inc(tb_dashboard::AuthFailure::BadProof);
        return Err(Error::Unauthorized(format!(
            "uid {} is not ours",
            cred.uid()
        )));
    }
    let limit = ctx.config.hello_timeout;
    let hello = within(limit, "a same-host hello", async {
        conn.read_frame::<ShmHello>(MAX_SHM_HELLO_FRAME).await
    })
    .await?;
    // The token names the access this node verified on the peer's link, which is not always
    // the access the peer holds (a read-only node cannot verify a read-write proof, so it
    // grants read-only): the hello's own claim is ignored, and the access whose token
    // matches is the one granted.
    let proof = AuthProof(hello.token);
    let granted = [Access::ReadWrite, Access::ReadOnly]
        .into_iter()
        .find(|&access| AuthProof(shm.token(&hello.node, access)) == proof);
    let Some(access) = granted else {
        ctx.metrics
            .auth_failures
            .inc(tb_dashboard::AuthFailure::BadProof);
        return Err(Error::Unauthorized(
            "a same-host hello with a bad token".into(),
        ));
    };
    let peer = EndpointId::from_bytes(&hello.node)
        .map_err(|e| Error::Unauthorized(format!("a same-host hello's node id: {e}")))?;
    Ok((peer, access))
}

/// Hands a request of a service kind (admitted as on a link) to the service for its kind
/// with the connection as its stream ([`Service::serve_local`](crate::Service)); a refusal
/// is its first answer. Returns the connection once both directions ended cleanly, `None`
/// when it must close.
async fn serve_service(
    ctx: &Arc<NodeCtx>,
    conn: ShmStream,
    peer: EndpointId,
    access: Access,
    request: DataRequest,
) -> Option<ShmStream> {
    let (back, returned) = tokio::sync::oneshot::channel();
    let (send, recv) = super::call::halves(conn, super::call::Back::Serve(back));
    let (mut send, recv) = (
        crate::RequestSend::from(send),
        crate::RequestRecv::from(recv),
    );
    let kind = request.kind();
    let refusal = match crate::serve::admit_request(ctx, access, &request) {
        Err(refused) => Some(refused),
        Ok(()) => match ctx.services.get(kind) {
            None => Some((
                ErrorCode::Unsupported,
                format!("this node serves no {kind} requests"),
            )),
            Some(service) => {
                let node = crate::ServeCtx::new(ctx.clone());
                let stream = crate::LocalStream {
                    request,
                    peer,
                    access,
                    send,
                    recv,
                };
                match service.serve_local(&node, stream) {
                    Ok(serving) => {
                        serving.await;
                        return returned.await.ok();
                    }
                    // Served on links only: the peer sends it there.
                    Err(stream) => {
                        let stream = *stream;
                        send = stream.send;
                        drop(stream.recv);
                        Some((
                            ErrorCode::Unsupported,
                            format!("{kind} requests are served on the link only"),
                        ))
                    }
                }
            }
        },
    };
    if let Some((code, message)) = refusal {
        let stall = ctx.config.stall_timeout;
        let refused = DataResponse::Error { code, message };
        if send.write_frame_within(&refused, stall).await.is_ok() {
            let _ = within(stall, "a refusal", send.finish()).await;
        }
    }
    drop(send);
    // The peer's unread request bytes keep the connection from being served again.
    None
}

/// Serves one request. `Err`: the connection must close (the protocol broke, or bytes of a
/// refused push are still on it).
async fn serve_request(
    ctx: &NodeCtx,
    conn: &mut ShmStream,
    peer: EndpointId,
    access: Access,
    request: DataRequest,
) -> Result<()> {
    if let Err((code, message)) = crate::serve::admit_request(ctx, access, &request) {
        conn.write_frame(&DataResponse::Error { code, message })
            .await?;
        // A refused push's payload frame is still coming: close rather than skip it.
        return match request {
            DataRequest::Push { .. } => Err(Error::Io("refused a push".into())),
            _ => Ok(()),
        };
    }
    match request {
        DataRequest::Pull {
            name,
            version,
            range: None,
        } => serve_pull(ctx, conn, &peer, access, &name, version).await,
        DataRequest::Pull { .. } => {
            let message = "ranges are pulled over QUIC".to_owned();
            let code = ErrorCode::InvalidTensor;
            conn.write_frame(&DataResponse::Error { code, message })
                .await
        }
        DataRequest::Push { name, meta } => serve_push(ctx, conn, peer, name, meta).await,
        DataRequest::Watch { name } => {
            super::watch::serve(ctx, conn, &name, access).await;
            Err(Error::Io("the watch ended".into()))
        }
        DataRequest::Channels { .. } | DataRequest::TcpPull { .. } | DataRequest::Pieces { .. } => {
            Err(Error::Io("a channel request on a same-host socket".into()))
        }
        // Taken by `serve_service` before this.
        DataRequest::Call { .. } | DataRequest::CudaIpc(_) => {
            Err(Error::Io("a service request on a same-host socket".into()))
        }
        DataRequest::Ctl => {
            let node = crate::auth::node_id(&peer);
            super::ctl::serve(ctx, conn, node, access).await
        }
    }
}

/// A same-host push, as errors name it.
const PUSH: &str = "a same-host push";

async fn serve_pull(
    ctx: &NodeCtx,
    conn: &mut ShmStream,
    peer: &EndpointId,
    access: Access,
    name: &TensorName,
    version: Option<u64>,
) -> Result<()> {
    let (version, tensor) = match lookup_host(ctx, peer, name, version) {
        Ok(found) => found,
        Err(NotHeld::Refused(code, message)) => {
            return conn
                .write_frame(&DataResponse::Error { code, message })
                .await;
        }
        Err(NotHeld::Arriving(v, _)) => {
            // Cut-through serving lives on QUIC.
            let message = format!("tensor \"{name}\" v{v} is still arriving: pull it over QUIC");
            let code = ErrorCode::Busy;
            return conn
                .write_frame(&DataResponse::Error { code, message })
                .await;
        }
    };
    let header = DataResponse::Header {
        meta: tensor.meta().clone(),
        version,
    };
    let Some(data) = tensor.host_data() else {
        // Device bytes: staged over QUIC (or CUDA IPC), not through host shared memory.
        let message = format!("tensor \"{name}\" v{version} is on a device: pull it over QUIC");
        let code = ErrorCode::Busy;
        return conn
            .write_frame(&DataResponse::Error { code, message })
            .await;
    };
    let timer = ctx.metrics.start_transfer(TransferKind::Serve);
    let stall = ctx.config.stall_timeout;
    let sent = within(stall, "a same-host pull", async {
        // Inline when small (a memfd costs more than the copy); larger ones pass the memfd.
        // The header and what follows it go in one write.
        if data.len() <= PULL_INLINE_MAX {
            let inline = ShmPayload::Inline;
            return conn.write_frames_and(&header, &inline, data, None).await;
        }
        // Up to 16 MiB, to a peer that proved read-write access, the memfd the version is in
        // as it is (reopened read-only, not sealed: it goes back to this node's pool when the
        // version is evicted), for the peer to copy out; the version is held until it says
        // it did. Sealing it instead would make every version of that size land in fresh
        // pages on both sides.
        let copyable = (data.len() <= PULL_COPY_MAX && access == Access::ReadWrite)
            .then(|| tensor.made_region())
            .flatten()
            .and_then(|region| region.read_only_fd().ok())
            .and_then(|fd| COPYING.admit(data.len()).map(|held| (fd, held)));
        if let Some((fd, _held)) = copyable {
            let memfd = ShmPayload::MemfdCopy { offset: 0 };
            conn.write_frames_and(&header, &memfd, &[], Some(fd.as_fd()))
                .await?;
            drop(fd);
            let copied: ShmCopied = conn.read_frame(MAX_CONTROL_FRAME).await?;
            if copied.version != version {
                return Err(Error::Io(format!(
                    "a same-host pull of \"{name}\" v{version}: the peer copied v{}",
                    copied.version
                )));
            }
            return Ok(());
        }
        let region = tensor.shm_region()?;
        let memfd = ShmPayload::Memfd { offset: 0 };
        conn.write_frames_and(&header, &memfd, &[], Some(region.shared_fd()?))
            .await
    })
    .await;
    timer.result(sent.is_ok());
    if sent.is_ok() {
        ctx.metrics.bytes_out.inc_by(tensor.byte_len());
        let out = tb_dashboard::Direction::Out;
        ctx.metrics
            .channels
            .transfer(ChannelKind::Shm, out, tensor.byte_len());
    }
    sent
}

/// Most bytes of pulls this process serves to be copied out of its memfds at once. Each
/// such pull keeps its version (and the reader fills a buffer of its own) until the reader
/// says it copied; with many large pulls in flight the buffers outgrow both pools and the
/// copies land in fresh pages anyway, so beyond this the sealed memfd is passed and mapped
/// (64 concurrent 16 MiB echo calls from Rust between two processes: 43-56/s with every pull
/// copied, 99-102/s with this budget, the same sitting; 95/s in an earlier run, every pull
/// mapped).
const COPYING_MAX: usize = 64 << 20;

/// The bytes of pulls being copied out of this process's memfds now (see [`COPYING_MAX`]).
static COPYING: CopyBudget = CopyBudget::new(COPYING_MAX);

/// Bytes of pulls in flight, up to a most.
struct CopyBudget {
    held: std::sync::atomic::AtomicUsize,
    max: usize,
}

/// A pull's share of a [`CopyBudget`], given back on drop.
struct Copying<'a> {
    budget: &'a CopyBudget,
    len: usize,
}

impl CopyBudget {
    const fn new(max: usize) -> CopyBudget {
        CopyBudget {
            held: std::sync::atomic::AtomicUsize::new(0),
            max,
        }
    }

    /// Takes `len` bytes of the budget, or `None` when it would go over its most.
    fn admit(&self, len: usize) -> Option<Copying<'_>> {
        use std::sync::atomic::Ordering;
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(len).filter(|total| *total <= self.max)
            })
            .ok()
            .map(|_| Copying { budget: self, len })
    }
}

impl Drop for Copying<'_> {
    fn drop(&mut self) {
        let held = &self.budget.held;
        held.fetch_sub(self.len, std::sync::atomic::Ordering::AcqRel);
    }
}

async fn serve_push(
    ctx: &NodeCtx,
    conn: &mut ShmStream,
    peer: EndpointId,
    name: TensorName,
    meta: TensorMeta,
) -> Result<()> {
    let timer = ctx.metrics.start_transfer(TransferKind::Serve);
    let held = match crate::serve::reserve_push(ctx, &name, meta.byte_len) {
        Ok(held) => held,
        Err((code, message)) => {
            conn.write_frame(&DataResponse::Error { code, message })
                .await?;
            return Err(Error::Io("refused a push".into()));
        }
    };
    let stall = ctx.config.stall_timeout;
    let tensor = within(stall, "a same-host push", receive(conn, &meta)).await;
    // Placed where this node places pushes (a device: copied there, as over QUIC).
    let tensor = tensor.and_then(|t| t.to_device(ctx.config.push_placement));
    let tensor = match tensor {
        Ok(tensor) => tensor,
        Err(err @ Error::Corrupt(_)) => {
            let message = format!("push of \"{name}\": {err}");
            let code = ErrorCode::Corrupt;
            conn.write_frame(&DataResponse::Error { code, message })
                .await?;
            return Ok(());
        }
        Err(err @ (Error::DeviceOutOfMemory(_) | Error::DeviceUnavailable(_))) => {
            let message = format!("push of \"{name}\": {err}");
            let code = ErrorCode::TooLarge;
            conn.write_frame(&DataResponse::Error { code, message })
                .await?;
            return Ok(());
        }
        Err(err) => return Err(err),
    };
    ctx.metrics.bytes_in.inc_by(meta.byte_len);
    let inbound = tb_dashboard::Direction::In;
    ctx.metrics
        .channels
        .transfer(ChannelKind::Shm, inbound, meta.byte_len);
    let item = Received {
        from: peer,
        name,
        tensor,
        seq: 0,
    };
    let reply = match ctx
        .inbox
        .deliver(item, held, ctx.config.request_timeout)
        .await
    {
        Ok(()) => DataResponse::Ack,
        Err(err) => DataResponse::Error {
            code: ErrorCode::Busy,
            message: err.to_string(),
        },
    };
    let delivered = matches!(reply, DataResponse::Ack);
    let answered = conn.write_frame(&reply).await;
    timer.result(delivered && answered.is_ok());
    answered
}

/// Receives a pushed payload, hash-checked either way: inline bytes, read into a pooled
/// memfd of this process (plain memory up to 64 KiB), or the pusher's sealed memfd.
async fn receive(conn: &mut ShmStream, meta: &TensorMeta) -> Result<Tensor> {
    let len = usize::try_from(meta.byte_len)
        .map_err(|_| Error::TooLarge(format!("{} bytes", meta.byte_len)))?;
    match conn.read_frame::<ShmPayload>(MAX_CONTROL_FRAME).await? {
        // At most `INLINE_MAX` bytes are allocated, checked first (`inline_len`).
        ShmPayload::Inline => super::read_inline(conn, meta, PUSH, None).await,
        // Checked against the hash that follows, computed here as the bytes arrive.
        ShmPayload::InlineHashAfter => super::read_hashed_after(conn, meta, PUSH).await,
        ShmPayload::Memfd { offset } if len > 0 => {
            // Every push is verified: its hash is what arrived, never the sender's claim.
            let tensor = super::tensor_from_memfd(conn.take_fd()?, offset, meta.clone())?;
            crate::channel::verify::check_all(tensor.data(), meta.hash, PUSH)?;
            super::region::release_resident(tensor.data());
            Ok(tensor)
        }
        other => Err(Error::Io(format!(
            "a same-host push of {len} bytes sent as {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_budget_admits_pulls_up_to_its_most_and_takes_back_what_ends() {
        const MIB: usize = 1 << 20;
        let budget = CopyBudget::new(64 * MIB);
        let mut held: Vec<Copying<'_>> = (0..4)
            .map(|_| budget.admit(16 * MIB).expect("within the budget"))
            .collect();
        assert!(
            budget.admit(1).is_none(),
            "a full budget refuses a byte more"
        );
        assert!(budget.admit(usize::MAX).is_none(), "no overflow");
        held.pop();
        assert!(budget.admit(16 * MIB + 1).is_none());
        let again = budget
            .admit(16 * MIB)
            .expect("an ended pull's bytes come back");
        drop((held, again));
        let none = std::sync::atomic::Ordering::Acquire;
        assert_eq!(budget.held.load(none), 0, "every share given back");
        assert!(budget.admit(64 * MIB).is_some());
        assert!(budget.admit(64 * MIB + 1).is_none());
    }
}
