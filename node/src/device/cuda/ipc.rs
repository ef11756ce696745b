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

use super::{DeviceBuffer, driver_error, gpu, transfer::transfer_stream};
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
/// unmaps it. `Ok(None)`: the handle did not open (another machine, a stale handle), or maps
/// less than `len` bytes: use the network; `Err`: what the network path would hit too (out of
/// device memory, no device).
///
/// The work runs on a blocking thread to its end, and calls `done` with whether it copied
/// (which lets the exporter
/// release its memory: the request's send side finishes) once the mapping is closed, so a
/// caller that gives up waiting (a timeout, a cancelled get) can neither unmap nor release
/// the memory under a copy still running on the device.
pub(crate) async fn import(
    cfg: &CudaConfig,
    ordinal: usize,
    handle: &[u8; HANDLE_LEN],
    len: u64,
    done: impl FnOnce(bool) + Send + 'static,
) -> Result<Option<DeviceBuffer>> {
    let len = usize::try_from(len).map_err(|_| Error::TooLarge(format!("{len} bytes")))?;
    let (cfg, handle) = (cfg.clone(), *handle);
    let work = tokio::task::spawn_blocking(move || {
        let copied = import_blocking(&cfg, ordinal, &handle, len);
        done(matches!(copied, Ok(Some(_))));
        copied
    });
    work.await
        .map_err(|e| Error::Io(format!("a CUDA IPC copy's thread: {e}")))?
}

fn import_blocking(
    cfg: &CudaConfig,
    ordinal: usize,
    handle: &[u8; HANDLE_LEN],
    len: usize,
) -> Result<Option<DeviceBuffer>> {
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
    // The exporter says how long the tensor is; the mapping says how much may be read. A
    // driver that cannot say leaves the exporter (a read-write member) trusted, as before.
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-parameters; `src` is a live mapping on the bound context.
    let range = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, mapping.ptr) };
    match range.result() {
        Ok(()) => {
            let end = base.saturating_add(size as sys::CUdeviceptr);
            let mapped_from_src = end.saturating_sub(mapping.ptr);
            if (mapped_from_src as u128) < len as u128 {
                debug!(
                    len,
                    mapped_from_src, "a CUDA IPC mapping shorter than the tensor"
                );
                return Ok(None);
            }
        }
        Err(e) => debug!(?e, "the size of a CUDA IPC mapping is unknown"),
    }
    let mut dest = DeviceBuffer::alloc(ordinal, len)?;
    let stream = transfer_stream(&gpu)?;
    {
        let slice = dest.slice_mut()?;
        let (dst, _record_write) = slice.device_ptr_mut(&stream);
        // SAFETY: `dst` is our fresh allocation of `len` bytes and `src` maps at least `len`
        // readable bytes of the exporter's allocation (checked above); the mapping stays open
        // until the copy is synchronized below.
        unsafe { result::memcpy_dtod_async(dst, mapping.ptr, len, stream.cu_stream()) }
            .map_err(|e| driver_error("copying from a CUDA IPC mapping", e))?;
    }
    stream
        .synchronize()
        .map_err(|e| driver_error("waiting for a CUDA IPC copy", e))?;
    drop(mapping);
    Ok(Some(dest))
}
