//! The same-host path: CUDA IPC. A puller on the same machine asks for a tensor's IPC handle,
//! maps the sender's device memory, copies it device to device into its own buffer, unmaps
//! it, and finishes its side of the stream; the server keeps the tensor alive until then.
//!
//! It runs on its own ALPN, `tb/cuda-ipc/1`, with its two messages in `tb_proto::ipc` (golden
//! bytes, bounds checked before use); serving it on the pooled `tb/data/1` link as a channel
//! beside shm and tcp is what is left (see the crate docs). Anything short of a mapped copy — a peer without the feature, a
//! declined request, a handle that does not open — makes the caller fall back to the network.
//! The bytes never leave device memory. From a server that proved read-write access no hash
//! is checked on this path: the metadata (hash included) comes from the server, whose bytes
//! were hashed when it published them, and it could as well have published others. From a
//! server that proved only read-only access the copy is hashed (through staging buffers)
//! before it is returned: a mismatch is `Corrupt`.
//! An IPC handle maps the server's memory writable, so it is exported only to peers that
//! proved read-write access (the cluster secret); read-only peers use the network.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, DevicePtrMut, result, sys};
use iroh::{
    endpoint::{Connection, RecvStream, SendStream},
    protocol::{AcceptError, ProtocolHandler},
};
use tb_proto::{
    Access, TensorMeta, TensorName,
    ipc::{IPC_HANDLE_LEN, IpcRequest, IpcResponse, MAX_IPC_REQUEST_FRAME},
};
use tracing::debug;

use super::{
    DeviceBuffer, driver_error, gpu,
    transfer::{drain, transfer_stream},
};
use crate::{
    PeerAddr,
    client::Pulled,
    ctx::NodeCtx,
    device::route,
    error::{Error, Result},
    store::Lookup,
    tensor::Tensor,
    wire,
};

/// ALPN of the same-host CUDA IPC handle exchange.
pub const IPC_ALPN: &[u8] = b"tb/cuda-ipc/1";

/// Bytes in a CUDA IPC memory handle.
const HANDLE_LEN: usize = IPC_HANDLE_LEN;

fn my_host() -> Option<&'static str> {
    static HOST: OnceLock<Option<String>> = OnceLock::new();
    HOST.get_or_init(route::host_id).as_deref()
}

/// The `tb/cuda-ipc/1` handler on the node's router.
#[derive(Debug, Clone)]
pub(crate) struct IpcProtocol {
    pub(crate) ctx: Arc<NodeCtx>,
}

impl ProtocolHandler for IpcProtocol {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        // The same cluster-secret hello as tb/data/1: device memory is exported to members only.
        let ctx = &self.ctx;
        let hello = crate::auth::server_hello(
            &conn,
            ctx.endpoint.id(),
            &ctx.config.cluster_key,
            IPC_ALPN,
            &ctx.admission,
            ctx.config.max_tensor_bytes,
            |reason| ctx.metrics.auth_failures.inc(reason),
        );
        let access = match hello.await {
            Ok(access) => access,
            Err(e) => {
                debug!(%e, "CUDA IPC hello failed");
                return Ok(());
            }
        };
        loop {
            let accepted = tokio::select! {
                _ = self.ctx.cancel.cancelled() => break,
                accepted = conn.accept_bi() => accepted,
            };
            let Ok((send, recv)) = accepted else { break };
            let ctx = self.ctx.clone();
            self.ctx.tracker.spawn(async move {
                tokio::select! {
                    _ = ctx.cancel.cancelled() => {}
                    () = serve(&ctx, access, send, recv) => {}
                }
            });
        }
        Ok(())
    }
}

/// What CUDA IPC does that needs read-write access.
const IPC_ACTION: &str = "CUDA IPC (a writable mapping of this node's device memory)";

async fn serve(ctx: &NodeCtx, access: Access, mut send: SendStream, mut recv: RecvStream) {
    let timeout = ctx.config.request_timeout;
    let read = wire::read_frame_within::<IpcRequest>(&mut recv, MAX_IPC_REQUEST_FRAME);
    let Ok(Ok(request)) = tokio::time::timeout(timeout, read).await else {
        return;
    };
    if let Err(e) = request.validate() {
        debug!(%e, "refusing a CUDA IPC request");
        return;
    }
    let IpcRequest::Open {
        name,
        version,
        host,
        min_bytes,
    } = request;
    let allowed = tb_proto::authorize(ctx.config.cluster_key.access(), access, Some(IPC_ACTION));
    let (answer, hold) = match (allowed, ctx.store.get(&name, version)) {
        (Err(e), _) => (
            IpcResponse::Declined {
                reason: e.to_string(),
            },
            None,
        ),
        (Ok(()), Lookup::Found(version, tensor)) => match export(ctx, &host, &tensor, min_bytes) {
            Ok(handle) => {
                let meta = tensor.meta().clone();
                (
                    IpcResponse::Handle {
                        meta,
                        version,
                        handle,
                    },
                    Some(tensor),
                )
            }
            Err(reason) => (IpcResponse::Declined { reason }, None),
        },
        _ => (
            IpcResponse::Declined {
                reason: format!("\"{name}\" is not held here"),
            },
            None,
        ),
    };
    if let IpcResponse::Declined { reason } = &answer {
        debug!(%name, %reason, "CUDA IPC declined");
    }
    let stall = ctx.config.stall_timeout;
    if wire::write_frame_within(&mut send, &answer, stall)
        .await
        .is_err()
    {
        return;
    }
    let _ = send.finish();
    if hold.is_some() {
        // The requester has our memory mapped until it finishes its side: keep the tensor
        // (and so the allocation) alive until then, or until the time limit.
        let _ = tokio::time::timeout(timeout, recv.read_to_end(HANDLE_LEN)).await;
    }
    drop(hold);
}

/// The IPC handle of `tensor`'s device memory, or why not.
fn export(ctx: &NodeCtx, host: &str, tensor: &Tensor, min_bytes: u64) -> Result<Vec<u8>, String> {
    let cfg = &ctx.config.cuda;
    let refusal = route::ipc_refusal(
        cfg,
        host,
        my_host(),
        tensor.device(),
        tensor.byte_len(),
        min_bytes,
    );
    if let Some(reason) = refusal {
        return Err(reason);
    }
    let buf = tensor
        .device_buffer()
        .ok_or_else(|| "the tensor is in host memory".to_string())?;
    let gpu = gpu(buf.ordinal(), cfg).map_err(|e| e.to_string())?;
    gpu.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut handle = sys::CUipcMemHandle {
        reserved: [0; HANDLE_LEN],
    };
    // SAFETY: `handle` is a valid out-parameter and the pointer is the start of a live
    // allocation on the bound context (the tensor holds it). The driver refuses, with an
    // error, memory it cannot export (stream-ordered pool memory).
    unsafe { sys::cuIpcGetMemHandle(&mut handle, buf.raw_ptr()) }
        .result()
        .map_err(|e| format!("cuIpcGetMemHandle: {e:?}"))?;
    Ok(handle.reserved.iter().map(|&b| b as u8).collect())
}

/// Tries to pull `name` from `peer` by CUDA IPC into a new buffer on device `ordinal`.
/// `Ok(None)`: not possible this way (the caller uses the network); `Err`: a failure the
/// network path would hit too (out of device memory, no device).
pub(crate) async fn ipc_pull(
    ctx: &NodeCtx,
    peer: &PeerAddr,
    name: &TensorName,
    version: Option<u64>,
    ordinal: usize,
) -> Result<Option<Pulled<DeviceBuffer>>> {
    // A read-only node is never exported to: go straight to the network.
    let Some(host) = my_host().filter(|_| ctx.config.cluster_key.access() == Access::ReadWrite)
    else {
        return Ok(None);
    };
    let connect = ctx.endpoint.connect(peer.to_endpoint_addr(), IPC_ALPN);
    let conn = match tokio::time::timeout(ctx.config.connect_timeout, connect).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            debug!(%e, "no CUDA IPC with this peer");
            return Ok(None);
        }
        Err(_) => return Ok(None),
    };
    let key = &ctx.config.cluster_key;
    let hello = crate::auth::client_hello(
        &conn,
        ctx.endpoint.id(),
        key,
        IPC_ALPN,
        ctx.config.connect_timeout,
        0,
    );
    let exporter = match hello.await {
        Ok(welcomed) => welcomed.peer,
        Err(e) => {
            // The network path will report a refusal as `Unauthorized`.
            debug!(%e, "no CUDA IPC with this peer");
            return Ok(None);
        }
    };
    let request = IpcRequest::Open {
        name: name.clone(),
        version,
        host: host.to_string(),
        min_bytes: ctx.config.cuda.ipc_min_bytes,
    };
    let pulled = exchange(ctx, &conn, request, ordinal).await;
    conn.close(iroh::endpoint::VarInt::from_u32(0), b"done");
    // An exporter that proved only read-only access may not publish: its bytes are hashed
    // (through staging buffers) before anyone sees them.
    if exporter != Access::ReadWrite
        && let Ok(Some((version, meta, buffer))) = &pulled
    {
        let got = match crate::channel::verify::blocking(|| buffer.hash()) {
            Ok(got) => got,
            Err(e) => {
                // The network path hashes as it receives: use it.
                debug!(%e, "hashing a CUDA IPC copy failed: the network path instead");
                return Ok(None);
            }
        };
        if got != meta.hash {
            return Err(Error::Corrupt(format!(
                "tensor \"{name}\" v{version} by CUDA IPC from {}: expected hash {}, got {got}",
                peer.id.fmt_short(),
                meta.hash
            )));
        }
    }
    pulled.map(|got| {
        got.map(|(version, meta, buffer)| Pulled {
            name: name.clone(),
            version,
            meta,
            buffer,
        })
    })
}

async fn exchange(
    ctx: &NodeCtx,
    conn: &Connection,
    request: IpcRequest,
    ordinal: usize,
) -> Result<Option<(u64, TensorMeta, DeviceBuffer)>> {
    let Ok((mut send, mut recv)) = conn.open_bi().await else {
        return Ok(None);
    };
    if wire::write_frame(&mut send, &request).await.is_err() {
        return Ok(None);
    }
    let timeout = ctx.config.request_timeout;
    let answer = tokio::time::timeout(timeout, wire::read_frame::<IpcResponse>(&mut recv)).await;
    let Ok(Ok(answer)) = answer else {
        return Ok(None);
    };
    answer
        .validate(ctx.config.max_tensor_bytes)
        .map_err(|e| Error::InvalidTensor(format!("a CUDA IPC answer: {e}")))?;
    let (meta, version, handle) = match answer {
        IpcResponse::Handle {
            meta,
            version,
            handle,
        } => (meta, version, handle),
        IpcResponse::Declined { reason } => {
            debug!(%reason, "CUDA IPC declined by the peer");
            return Ok(None);
        }
    };
    let buffer = import(ctx, ordinal, &handle, &meta).await?;
    let _ = send.finish();
    Ok(buffer.map(|b| (version, meta, b)))
}

/// An opened IPC mapping, closed on drop.
struct Mapping {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was returned by `cuIpcOpenMemHandle` on this context and is
            // closed once, here, after the copies reading it were waited for.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Maps `handle`, copies the tensor into a new buffer on `ordinal`, and unmaps it.
async fn import(
    ctx: &NodeCtx,
    ordinal: usize,
    handle: &[u8],
    meta: &TensorMeta,
) -> Result<Option<DeviceBuffer>> {
    let Ok(reserved) = <[u8; HANDLE_LEN]>::try_from(handle) else {
        return Ok(None);
    };
    let len = usize::try_from(meta.byte_len)
        .map_err(|_| Error::TooLarge(format!("{} bytes", meta.byte_len)))?;
    let gpu = gpu(ordinal, &ctx.config.cuda)?;
    gpu.ctx
        .bind_to_thread()
        .map_err(|e| driver_error("binding the context", e))?;
    let handle = sys::CUipcMemHandle {
        reserved: reserved.map(|b| b as std::ffi::c_char),
    };
    let mut src: sys::CUdeviceptr = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: `src` is a valid out-parameter; the driver validates the handle and fails with
    // an error (same process, other machine, stale handle) rather than mapping garbage.
    if let Err(e) = unsafe { sys::cuIpcOpenMemHandle_v2(&mut src, handle, flags) }.result() {
        debug!(?e, "CUDA IPC handle did not open");
        return Ok(None);
    }
    let mapping = Mapping {
        ctx: gpu.ctx.clone(),
        ptr: src,
    };
    let mut dest = DeviceBuffer::alloc(ordinal, len)?;
    let stream = transfer_stream(&gpu)?;
    {
        let slice = dest.slice_mut()?;
        let (dst, _record_write) = slice.device_ptr_mut(&stream);
        // SAFETY: `dst` is our fresh allocation of `len` bytes and `src` maps the exporter's
        // allocation holding the tensor's `len` bytes; the mapping stays open until the copy
        // is drained below.
        unsafe { result::memcpy_dtod_async(dst, mapping.ptr, len, stream.cu_stream()) }
            .map_err(|e| driver_error("copying from a CUDA IPC mapping", e))?;
    }
    drain(&stream).await?;
    drop(mapping);
    Ok(Some(dest))
}

#[cfg(test)]
mod tests {
    /// The IPC exchange opens with the hello, so its connections must keep the pre-auth
    /// limits until it is verified: the endpoint tells hello protocols by this prefix.
    #[test]
    fn ipc_keeps_the_pre_auth_limits() {
        assert!(super::IPC_ALPN.starts_with(tb_link::endpoint::HELLO_ALPN_PREFIX));
    }
}
