//! CUDA IPC, the driver's half: export a device allocation's IPC handle, and open a peer's
//! handle, copy device to device out of the mapping and close it.
//!
//! The exchange around it (who may ask, the same-host check, the fallback to the network) is
//! the `cuda-ipc` channel, `channel::cuda_ipc`: a request kind on the pooled data link. An
//! IPC handle maps the exporter's memory writable, which is why that channel exports only to
//! peers that proved read-write access.

use std::sync::Arc;

use cudarc::driver::{CudaContext, DevicePtrMut, result, sys};
use tb_proto::ipc::IPC_HANDLE_LEN;
use tracing::debug;

use super::{
    DeviceBuffer, driver_error, gpu,
    transfer::{drain, transfer_stream},
};
use crate::{
    device::CudaConfig,
    error::{Error, Result},
};

/// Bytes in a CUDA IPC memory handle.
const HANDLE_LEN: usize = IPC_HANDLE_LEN;

/// The IPC handle of `buf`'s device memory (the start of its allocation), or why not.
pub(crate) fn export_handle(
    buf: &DeviceBuffer,
    cfg: &CudaConfig,
) -> Result<[u8; HANDLE_LEN], String> {
    let gpu = gpu(buf.ordinal(), cfg).map_err(|e| e.to_string())?;
    gpu.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let mut handle = sys::CUipcMemHandle {
        reserved: [0; HANDLE_LEN],
    };
    // SAFETY: `handle` is a valid out-parameter and the pointer is the start of a live
    // allocation on the bound context (the caller holds the buffer). The driver refuses, with
    // an error, memory it cannot export (stream-ordered pool memory).
    unsafe { sys::cuIpcGetMemHandle(&mut handle, buf.raw_ptr()) }
        .result()
        .map_err(|e| format!("cuIpcGetMemHandle: {e:?}"))?;
    Ok(handle.reserved.map(|b| b as u8))
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

/// Maps `handle`, copies the `len` bytes it starts with into a new buffer on `ordinal`, and
/// unmaps it. `Ok(None)`: the handle did not open (another machine, a stale handle: use the
/// network); `Err`: what the network path would hit too (out of device memory, no device).
pub(crate) async fn import(
    cfg: &CudaConfig,
    ordinal: usize,
    handle: &[u8; HANDLE_LEN],
    len: u64,
) -> Result<Option<DeviceBuffer>> {
    let len = usize::try_from(len).map_err(|_| Error::TooLarge(format!("{len} bytes")))?;
    let gpu = gpu(ordinal, cfg)?;
    gpu.ctx
        .bind_to_thread()
        .map_err(|e| driver_error("binding the context", e))?;
    let handle = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
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
