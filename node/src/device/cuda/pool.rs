//! Freed `cuMemAlloc` allocations kept for reuse, per device and process: a transfer that
//! repeats (a get onto a device, a call with a CUDA tensor of the same size, over and over)
//! gets the same allocation back instead of a fresh one, and a lent one is exported by CUDA
//! IPC with the same handle again. On the H200 machine (`bench device`, one run, pool on
//! then off) a GPU-held get between two processes went from 0.66-0.72x to 1.02-1.12x
//! `torch.multiprocessing`'s time (256 MiB 0.93 -> 0.75 ms).
//!
//! Bounded: at most [`pool_bytes`] per device (`TB_CUDA_POOL_MIB`, default 1024; `0` keeps
//! nothing), oldest freed first beyond it; an allocation that runs out of device memory
//! frees the whole pool and tries once more. Only memory no transfer uses any more comes
//! here (`Mem::drop` waits for the buffer's stream first).

use std::sync::{Mutex, OnceLock, PoisonError};

use cudarc::driver::{result, sys};

/// Most bytes of freed allocations kept per device: `TB_CUDA_POOL_MIB` MiB, else 1 GiB.
pub(crate) fn pool_bytes() -> usize {
    static BYTES: OnceLock<usize> = OnceLock::new();
    *BYTES.get_or_init(|| {
        let mib = std::env::var("TB_CUDA_POOL_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1024);
        mib.saturating_mul(1 << 20)
    })
}

/// One device's freed allocations, oldest first.
#[derive(Default)]
pub(crate) struct Pool {
    free: Mutex<Vec<Free>>,
}

struct Free {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl Pool {
    fn free(&self) -> std::sync::MutexGuard<'_, Vec<Free>> {
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A freed allocation of at least `len` bytes and at most a quarter more (the smallest
    /// such): its address and its size.
    pub(crate) fn take(&self, len: usize) -> Option<(sys::CUdeviceptr, usize)> {
        let most = len.saturating_add(len / 4);
        let mut free = self.free();
        let (at, _) = (free.iter().enumerate())
            .filter(|(_, f)| f.len >= len && f.len <= most)
            .min_by_key(|(_, f)| f.len)?;
        let found = free.remove(at);
        Some((found.ptr, found.len))
    }

    /// Keeps the allocation at `ptr` (`len` bytes, unused now) for reuse, freeing the oldest
    /// kept ones beyond the bound. The caller has the device's context bound to this thread.
    pub(crate) fn give(&self, ptr: sys::CUdeviceptr, len: usize) {
        let cap = pool_bytes();
        let mut evicted = Vec::new();
        {
            let mut free = self.free();
            free.push(Free { ptr, len });
            let mut held: usize = free.iter().map(|f| f.len).sum();
            while held > cap && !free.is_empty() {
                let oldest = free.remove(0);
                held -= oldest.len;
                evicted.push(oldest);
            }
        }
        for f in evicted {
            // SAFETY: `f.ptr` came from `cuMemAlloc` on this device's context (bound by the
            // caller), nothing uses it (it was given back unused), and it left the pool above,
            // so it is freed once.
            let _ = unsafe { result::free_sync(f.ptr) };
        }
    }

    /// Frees every kept allocation (before trying an allocation again after running out of
    /// device memory). The caller has the device's context bound to this thread.
    pub(crate) fn drain(&self) {
        let all = std::mem::take(&mut *self.free());
        for f in all {
            // SAFETY: as in `give`: unused, out of the pool, freed once.
            let _ = unsafe { result::free_sync(f.ptr) };
        }
    }
}
