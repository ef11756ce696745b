//! [`DeviceBuffer`]: bytes on one CUDA device, shared by clones.

use std::{
    collections::VecDeque,
    mem::ManuallyDrop,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::Arc,
};

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, result, sys};
use tb_proto::{ContentHash, ContentHasher};

use super::{driver_error, gpu};
use crate::{
    device::CudaConfig,
    error::{Error, Result},
};

/// Bytes on a CUDA device. Cloning shares the allocation; it is freed when the last clone
/// (and every tensor holding one) is dropped.
///
/// Buffers this crate allocates ([`DeviceBuffer::alloc`], [`DeviceBuffer::from_host`], pulls
/// to a device) use `cuMemAlloc`, so they can be offered to same-host peers by CUDA IPC;
/// buffers wrapped with [`DeviceBuffer::from_cuda_slice`] travel by IPC only if their
/// allocator allows it (stream-ordered pool memory does not), and by the network otherwise.
#[derive(Clone)]
pub struct DeviceBuffer {
    mem: Arc<Mem>,
}

/// How an allocation is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alloc {
    /// cudarc made it; cudarc frees it.
    Cudarc,
    /// `cuMemAlloc`; freed with `cuMemFree`.
    MemAlloc,
}

struct Mem {
    /// Taken only in `drop`.
    slice: ManuallyDrop<CudaSlice<u8>>,
    alloc: Alloc,
    /// The allocation's size (at least the slice's: a reused one may be larger).
    alloc_len: usize,
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken exactly once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match self.alloc {
            Alloc::Cudarc => drop(slice),
            Alloc::MemAlloc => {
                let ctx = slice.context().clone();
                let stream = slice.stream().clone();
                // `leak` makes the slice's stream wait for every copy still reading or
                // writing it (cudarc's event tracking); once that stream is idle the memory is
                // unused and can go.
                let ordinal = ctx.ordinal();
                let ptr = slice.leak();
                if stream.synchronize().is_ok() && ctx.bind_to_thread().is_ok() {
                    // Work of other streams may still read it (a DLPack consumer's kernels:
                    // torch does not wait for them before it lets go), which `cuMemFree`
                    // would have waited for: the whole context is synchronized before the
                    // allocation is kept for reuse.
                    if ctx.synchronize().is_err() {
                        return;
                    }
                    // Unused now: kept for reuse (`pool.rs`), which frees what it cannot keep.
                    match gpu(ordinal, &CudaConfig::default()) {
                        Ok(gpu) => gpu.pool.give(ptr, self.alloc_len),
                        // SAFETY: `ptr` came from `cuMemAlloc` in `DeviceBuffer::alloc`, is
                        // freed only here, and no enqueued work uses it any more
                        // (synchronized above).
                        Err(_) => {
                            let _ = unsafe { result::free_sync(ptr) };
                        }
                    }
                }
            }
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &format_args!("cuda:{}", self.ordinal()))
            .field("len", &self.len())
            .finish()
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes on device `ordinal` (contents unspecified until written).
    /// `DeviceOutOfMemory` when they do not fit.
    pub fn alloc(ordinal: usize, len: usize) -> Result<Self> {
        let gpu = gpu(ordinal, &CudaConfig::default())?;
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the context", e))?;
        // A freed allocation of about this size first (`pool.rs`); else a new one, and when
        // the device is full, another try after freeing what the pool keeps.
        let want = len.max(1);
        let (ptr, alloc_len) = match gpu.pool.take(want) {
            Some(found) => found,
            None => {
                // SAFETY: a plain allocation; zero-length requests get one byte because
                // cuMemAlloc refuses zero.
                let mut made = unsafe { result::malloc_sync(want) };
                if matches!(&made, Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY) {
                    gpu.pool.drain();
                    // SAFETY: as above.
                    made = unsafe { result::malloc_sync(want) };
                }
                let ptr = made.map_err(|e| {
                    driver_error(format!("allocating {len} bytes on cuda:{ordinal}"), e)
                })?;
                (ptr, want)
            }
        };
        let stream = gpu.ctx.default_stream();
        // SAFETY: `ptr` is an allocation of at least `len` bytes on this context that nothing
        // else uses (new, or given back unused); the slice takes it over, and `Mem::drop`
        // hands it to the pool or frees it with `cuMemFree` (not cudarc).
        // cudarc unwraps event creation here, hence the unwind guard.
        let upgraded = catch_unwind(AssertUnwindSafe(|| unsafe {
            stream.upgrade_device_ptr::<u8>(ptr, len)
        }));
        match upgraded {
            Ok(slice) => Ok(DeviceBuffer {
                mem: Arc::new(Mem {
                    slice: ManuallyDrop::new(slice),
                    alloc: Alloc::MemAlloc,
                    alloc_len,
                }),
            }),
            Err(_) => {
                // SAFETY: nothing took `ptr` over; it is freed once, here.
                let _ = unsafe { result::free_sync(ptr) };
                Err(Error::Device(format!(
                    "cuda:{ordinal}: cannot track a new allocation"
                )))
            }
        }
    }

    /// Copies `bytes` to a new buffer on device `ordinal` (blocks until done).
    pub fn from_host(ordinal: usize, bytes: &[u8]) -> Result<Self> {
        let mut buf = DeviceBuffer::alloc(ordinal, bytes.len())?;
        let slice = buf.slice_mut()?;
        let stream = slice.stream().clone();
        stream
            .memcpy_htod(bytes, slice)
            .map_err(|e| driver_error("copying host bytes to the device", e))?;
        stream
            .synchronize()
            .map_err(|e| driver_error("copying host bytes to the device", e))?;
        Ok(buf)
    }

    /// Copies the `len` bytes at device address `src` on device `ordinal` — memory another
    /// library of this process allocated, such as a torch CUDA tensor's `data_ptr()` — into
    /// a new buffer, device to device (blocks until done).
    ///
    /// # Safety
    ///
    /// `src..src + len` must be memory of this process that device `ordinal` can read (an
    /// allocation in its primary context, as torch's are), and nothing may write it while the
    /// copy runs: the caller finishes the work that produced the bytes first (for torch,
    /// `torch.cuda.current_stream().synchronize()`).
    pub unsafe fn copy_from_device_ptr(ordinal: usize, src: u64, len: usize) -> Result<Self> {
        let mut buf = DeviceBuffer::alloc(ordinal, len)?;
        if len == 0 {
            return Ok(buf);
        }
        let slice = buf.slice_mut()?;
        let stream = slice.stream().clone();
        {
            let (dst, _written) = slice.device_ptr_mut(&stream);
            // SAFETY: `dst` is this fresh buffer's `len` bytes; the caller vouches for `src`.
            unsafe { result::memcpy_dtod_async(dst, src, len, stream.cu_stream()) }
                .map_err(|e| driver_error(format!("copying {len} bytes on cuda:{ordinal}"), e))?;
        }
        stream
            .synchronize()
            .map_err(|e| driver_error(format!("copying {len} bytes on cuda:{ordinal}"), e))?;
        Ok(buf)
    }

    /// A copy of these bytes in a new buffer on the same device, device to device (blocks
    /// until done): what a reader that may write into what it got is given, so its writes
    /// never reach the buffer a node holds and serves.
    pub fn duplicate(&self) -> Result<Self> {
        // SAFETY: this buffer's `len` bytes are a live allocation of this process on its
        // device, written once before it was shared and never written again.
        unsafe { DeviceBuffer::copy_from_device_ptr(self.ordinal(), self.device_ptr(), self.len()) }
    }

    /// Whether this handle is the allocation's only one (no clone lives, so nothing else reads
    /// or serves these bytes): its holder may lend them writable instead of a
    /// [`duplicate`](Self::duplicate).
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.mem) == 1
    }

    /// The device address of the first byte, for C interfaces that share device memory
    /// (DLPack, `__cuda_array_interface__`). Valid while this buffer (or a clone) lives.
    pub fn device_ptr(&self) -> u64 {
        self.raw_ptr()
    }

    /// Wraps memory cudarc allocated (for example the output of a kernel).
    pub fn from_cuda_slice(slice: CudaSlice<u8>) -> Self {
        DeviceBuffer {
            mem: Arc::new(Mem {
                alloc_len: slice.len(),
                slice: ManuallyDrop::new(slice),
                alloc: Alloc::Cudarc,
            }),
        }
    }

    /// The bytes as a cudarc slice, to read them on the device (kernels, copies).
    pub fn cuda_slice(&self) -> &CudaSlice<u8> {
        &self.mem.slice
    }

    /// The bytes for writing; only while this handle is the only one.
    pub(crate) fn slice_mut(&mut self) -> Result<&mut CudaSlice<u8>> {
        match Arc::get_mut(&mut self.mem) {
            Some(mem) => Ok(&mut mem.slice),
            None => Err(Error::InvalidTensor(
                "the destination device buffer is shared (cloned); it must be the only handle"
                    .into(),
            )),
        }
    }

    /// The raw device address of the allocation's start (for CUDA IPC export).
    pub(crate) fn raw_ptr(&self) -> sys::CUdeviceptr {
        let slice = self.cuda_slice();
        let (ptr, _record_read) = slice.device_ptr(slice.stream());
        ptr
    }

    /// Copies the bytes to host memory (through pinned staging; blocks until done).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.len());
        self.for_each_chunk(|chunk| out.extend_from_slice(chunk))?;
        Ok(out)
    }

    /// BLAKE3 of the bytes, streamed through pinned staging (blocks until done).
    pub fn hash(&self) -> Result<ContentHash> {
        let mut hasher = ContentHasher::new();
        self.for_each_chunk(|chunk| hasher.update(chunk))?;
        Ok(hasher.finalize())
    }

    /// Hands the bytes to `f` in order, chunk by chunk, copying the next chunk to staging
    /// while `f` works on the current one. It blocks for as long as the copy takes (about 20
    /// ms per 256 MiB over PCIe), so a runtime worker that calls it (a call's device result
    /// written to a peer off this host, a device tensor hashed for a version) first hands its
    /// other tasks to the runtime's other workers.
    fn for_each_chunk(&self, f: impl FnMut(&[u8])) -> Result<()> {
        crate::channel::verify::blocking(|| self.for_each_chunk_here(f))
    }

    /// [`for_each_chunk`](Self::for_each_chunk) on this thread, whatever it is.
    fn for_each_chunk_here(&self, mut f: impl FnMut(&[u8])) -> Result<()> {
        let gpu = gpu(self.ordinal(), &CudaConfig::default())?;
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| driver_error("creating a stream", e))?;
        let slice = self.cuda_slice();
        let (total, chunk) = (slice.len(), gpu.staging.slot_bytes());
        let share = gpu.staging.share();
        let mut queued = VecDeque::with_capacity(2);
        let mut next = 0;
        loop {
            while next < total && queued.len() < 2 {
                let end = (next + chunk).min(total);
                let mut lease = gpu.staging.acquire_blocking(&share)?;
                let len = lease.stage_range(&stream, slice, next..end)?;
                queued.push_back((lease, len));
                next = end;
            }
            let Some((lease, len)) = queued.pop_front() else {
                break;
            };
            let lease = lease.ready_blocking()?;
            f(lease.bytes(len));
        }
        Ok(())
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.mem.slice.ordinal()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.slice.len()
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
