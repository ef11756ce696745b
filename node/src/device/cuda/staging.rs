//! Pinned (page-locked) host buffers that device bytes pass through on their way to or from
//! the network. Pinning costs milliseconds, so buffers are pinned once per device and reused:
//! a [`Lease`] hands one out and gives it back on drop. Each transfer leases through its own
//! [`TransferShare`], which caps how many buffers it holds at once (see `device/quota.rs`).
//!
//! Each buffer carries a fence event recorded after the last device copy that used it. A
//! buffer may go back to the pool with that copy still running; the next user either orders
//! its own copy after the fence on the GPU ([`Lease::stage_from_device`]), or waits for it
//! before touching the bytes from the CPU ([`StagingPool::acquire`], [`Lease::ready`]).

use std::{
    ptr::NonNull,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, PinnedHostSlice, sys,
};
use tokio::sync::Notify;

use super::{blocking_event, driver_error, wait_event};
use crate::{
    device::{
        CudaConfig,
        quota::{Permit, StagingQuota, TransferShare},
    },
    error::{Error, Result},
};

/// One pinned buffer and the fence of its last device copy.
pub(crate) struct Slot {
    /// Owns the page-locked allocation (freed on drop).
    _pinned: PinnedHostSlice<u8>,
    /// Start of the allocation, `len` bytes, zeroed when pinned.
    base: NonNull<u8>,
    len: usize,
    fence: Arc<CudaEvent>,
    /// A device copy was enqueued since the fence was last seen complete.
    pending: bool,
}

// SAFETY: `base` points into `_pinned`, which this slot owns and which lives as long as it;
// the bytes are only reached through `&Slot`/`&mut Slot` (via a `Lease`), so the usual
// borrow rules apply across threads. `PinnedHostSlice` and `CudaEvent` are Send and Sync.
unsafe impl Send for Slot {}
// SAFETY: as above; shared access only ever reads the bytes.
unsafe impl Sync for Slot {}

impl Slot {
    fn pin(ctx: &Arc<CudaContext>, len: usize) -> Result<Slot> {
        // SAFETY: the memory is uninitialized until the `write_bytes` below, and nothing reads
        // it before. PORTABLE (not cudarc's default WRITECOMBINED): the CPU reads these bytes
        // (hashing, QUIC), and reads of write-combined memory are very slow.
        let mut pinned =
            unsafe { ctx.alloc_pinned_with_flags::<u8>(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| driver_error(format!("pinning {len} bytes of host memory"), e))?;
        let ptr = pinned
            .as_mut_ptr()
            .map_err(|e| driver_error("reaching pinned memory", e))?;
        let base = NonNull::new(ptr)
            .ok_or_else(|| Error::Device("the driver returned a null pinned buffer".into()))?;
        // SAFETY: `base` is the start of a live allocation of `len` bytes that nothing else
        // uses yet; zeroing it makes every later `&[u8]` over it initialized.
        unsafe { std::ptr::write_bytes(base.as_ptr(), 0, len) };
        Ok(Slot {
            _pinned: pinned,
            base,
            len,
            fence: Arc::new(blocking_event(ctx)?),
            pending: false,
        })
    }

    /// Whether the CPU may touch the bytes now, without waiting.
    fn idle(&mut self) -> bool {
        if self.pending && self.fence.try_is_complete().unwrap_or(false) {
            self.pending = false;
        }
        !self.pending
    }
}

#[derive(Default)]
struct PoolState {
    free: Vec<Slot>,
    /// Slots pinned so far (free or leased).
    pinned: usize,
}

/// The pinned buffers of one device, shared by all its transfers.
pub(crate) struct StagingPool {
    ctx: Arc<CudaContext>,
    slot_bytes: usize,
    /// How many buffers there may be, and how many one transfer may hold.
    quota: Arc<StagingQuota>,
    state: Mutex<PoolState>,
    returned: Notify,
}

impl StagingPool {
    pub(crate) fn new(ctx: Arc<CudaContext>, cfg: &CudaConfig) -> Arc<StagingPool> {
        // Two at least: one filling while the other copies.
        let total = cfg.staging_buffers.max(2);
        Arc::new(StagingPool {
            ctx,
            slot_bytes: cfg.chunk_bytes.max(64 << 10),
            quota: StagingQuota::new(total, cfg.max_staging_per_transfer),
            state: Mutex::default(),
            returned: Notify::new(),
        })
    }

    /// The share of a new transfer: what it leases goes through it.
    pub(crate) fn share(&self) -> TransferShare {
        self.quota.share()
    }

    /// Bytes per buffer: the chunk size of every staged transfer.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free buffer for the transfer of `share`: one whose last copy is done, else a newly
    /// pinned one while under the cap, else one whose copy is still running. `None` when the
    /// transfer holds its share or all buffers are leased. The buffer may still be `pending`:
    /// use it for a device copy (ordered after its fence) or wait with [`Lease::ready`].
    pub(crate) fn try_acquire(self: &Arc<Self>, share: &TransferShare) -> Result<Option<Lease>> {
        // The permit first: leased buffers never outnumber permits, so with a permit in hand
        // a buffer is free or may be pinned.
        let Some(permit) = share.try_take() else {
            return Ok(None);
        };
        let mut state = self.lock();
        let slot = if let Some(i) = state.free.iter_mut().position(Slot::idle) {
            state.free.swap_remove(i)
        } else if state.pinned < self.quota.total() {
            state.pinned += 1;
            drop(state);
            match Slot::pin(&self.ctx, self.slot_bytes) {
                Ok(slot) => slot,
                Err(e) => {
                    self.lock().pinned -= 1;
                    return Err(e);
                }
            }
        } else if let Some(slot) = state.free.pop() {
            slot
        } else {
            return Ok(None);
        };
        Ok(Some(Lease {
            slot: Some(slot),
            pool: Some(self.clone()),
            permit: Some(permit),
        }))
    }

    /// A buffer the CPU may write now for the transfer of `share`, waiting up to `stall` for
    /// one to come back (to the pool, or to this transfer's share).
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        share: &TransferShare,
        stall: Duration,
    ) -> Result<Lease> {
        let deadline = tokio::time::Instant::now() + stall;
        loop {
            let returned = self.returned.notified();
            if let Some(lease) = self.try_acquire(share)? {
                return lease.ready().await;
            }
            if tokio::time::timeout_at(deadline, returned).await.is_err() {
                return Err(Error::timeout(
                    format!(
                        "a free pinned staging buffer on cuda:{} (this transfer holds {} of \
                         its {}, all transfers {} of {})",
                        self.ctx.ordinal(),
                        share.held(),
                        self.quota.per_transfer(),
                        self.quota.in_use(),
                        self.quota.total(),
                    ),
                    stall,
                ));
            }
        }
    }

    /// A buffer for blocking code: from the pool when one is free (and `share` is under its
    /// cap), else a temporary one (pinned now, freed after use) so blocking callers never
    /// wait on async transfers.
    pub(crate) fn acquire_blocking(self: &Arc<Self>, share: &TransferShare) -> Result<Lease> {
        let lease = match self.try_acquire(share)? {
            Some(lease) => lease,
            None => Lease {
                slot: Some(Slot::pin(&self.ctx, self.slot_bytes)?),
                pool: None,
                permit: None,
            },
        };
        lease.ready_blocking()
    }

    /// Puts `slot` back and then lets `permit` go, before waking the waiters: a waiter that
    /// wakes finds both the buffer and the count it needs.
    fn give_back(&self, slot: Slot, permit: Option<Permit>) {
        self.lock().free.push(slot);
        drop(permit);
        // Every waiter: the first one woken may be at its share and unable to use it.
        self.returned.notify_waiters();
    }
}

/// A leased staging buffer; back to its pool on drop.
pub(crate) struct Lease {
    /// Always `Some` until drop.
    slot: Option<Slot>,
    /// `None` for a temporary buffer, freed on drop.
    pool: Option<Arc<StagingPool>>,
    /// Counts the buffer against the pool and its transfer's share; `None` when temporary.
    permit: Option<Permit>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        match (self.slot.take(), self.pool.as_ref()) {
            (Some(slot), Some(pool)) => pool.give_back(slot, self.permit.take()),
            (Some(slot), None) if slot.pending => {
                // A temporary buffer is freed now: not under a copy still using it.
                let _ = slot.fence.synchronize();
            }
            _ => {}
        }
    }
}

impl Lease {
    fn slot_mut(&mut self) -> Result<&mut Slot> {
        self.slot
            .as_mut()
            .ok_or_else(|| Error::Device("staging lease used after release".into()))
    }

    /// Waits (without blocking the runtime) until the last device copy using the buffer is
    /// done, so the CPU may touch its bytes.
    pub(crate) async fn ready(mut self) -> Result<Lease> {
        let slot = self.slot_mut()?;
        if !slot.idle() {
            wait_event(slot.fence.clone()).await?;
            self.slot_mut()?.pending = false;
        }
        Ok(self)
    }

    /// [`Lease::ready`] for blocking code.
    pub(crate) fn ready_blocking(mut self) -> Result<Lease> {
        let slot = self.slot_mut()?;
        if slot.pending {
            slot.fence
                .synchronize()
                .map_err(|e| driver_error("a device copy", e))?;
            slot.pending = false;
        }
        Ok(self)
    }

    /// The first `len` bytes (at most the buffer's size). Only meaningful once `ready`.
    pub(crate) fn bytes(&self, len: usize) -> &[u8] {
        match &self.slot {
            // SAFETY: `base` is a live, initialized allocation of `slot.len` bytes owned by
            // the slot, borrowed here for no longer than `&self`.
            Some(slot) => unsafe {
                std::slice::from_raw_parts(slot.base.as_ptr(), len.min(slot.len))
            },
            None => &[],
        }
    }

    /// The first `len` bytes, writable. Only meaningful once `ready`.
    pub(crate) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        match &mut self.slot {
            // SAFETY: as in `bytes`, and `&mut self` makes this the only reference.
            Some(slot) => unsafe {
                std::slice::from_raw_parts_mut(slot.base.as_ptr(), len.min(slot.len))
            },
            None => &mut [],
        }
    }

    /// Stages bytes `range` of `src` (see `stage_from_device`); returns how many.
    pub(crate) fn stage_range(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<u8>,
        range: std::ops::Range<usize>,
    ) -> Result<usize> {
        let (start, end) = (range.start, range.end);
        let view = src
            .try_slice(range)
            .ok_or_else(|| Error::Device(format!("bytes {start}..{end} out of range")))?;
        self.stage_from_device(stream, &view)?;
        Ok(end - start)
    }

    /// Enqueues a copy of `src` into the buffer on `stream`, after any copy still using it,
    /// and records the fence. The bytes are valid once the lease is `ready` again.
    pub(crate) fn stage_from_device(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, u8>,
    ) -> Result<()> {
        let len = src.len();
        let slot = self.slot_mut()?;
        if len > slot.len {
            return Err(Error::Device(format!(
                "a {len}-byte chunk does not fit a {}-byte staging buffer",
                slot.len
            )));
        }
        stream
            .wait(&slot.fence)
            .map_err(|e| driver_error("ordering a device copy", e))?;
        // SAFETY: `base` holds `slot.len >= len` bytes. The DMA writes them after this call
        // returns; the slot is not read by the CPU until `ready` has waited on the fence
        // recorded below, and not reused by the GPU without ordering after that fence.
        let dst = unsafe { std::slice::from_raw_parts_mut(slot.base.as_ptr(), len) };
        stream
            .memcpy_dtoh(src, dst)
            .map_err(|e| driver_error("copying device bytes to staging", e))?;
        slot.fence
            .record(stream)
            .map_err(|e| driver_error("recording a copy fence", e))?;
        slot.pending = true;
        Ok(())
    }

    /// Enqueues a copy of the buffer's first `dst.len()` bytes to `dst` on `stream` and
    /// records the fence; the buffer goes back to the pool busy until the copy is done.
    pub(crate) fn unstage_to_device(
        &mut self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let len = dst.len();
        let slot = self.slot_mut()?;
        if len > slot.len {
            return Err(Error::Device(format!(
                "a {len}-byte chunk does not fit a {}-byte staging buffer",
                slot.len
            )));
        }
        // SAFETY: `base` holds `slot.len >= len` initialized bytes; the DMA reads them after
        // this call returns, and the fence recorded below keeps the CPU and later copies off
        // the slot until it is done.
        let src = unsafe { std::slice::from_raw_parts(slot.base.as_ptr(), len) };
        stream
            .memcpy_htod(src, dst)
            .map_err(|e| driver_error("copying staged bytes to the device", e))?;
        slot.fence
            .record(stream)
            .map_err(|e| driver_error("recording a copy fence", e))?;
        slot.pending = true;
        Ok(())
    }
}

/// A staged chunk handed to QUIC as `Bytes` without a copy: the buffer returns to its pool
/// when QUIC drops the last reference (once the bytes are acknowledged).
pub(crate) struct Staged {
    pub(crate) lease: Lease,
    pub(crate) len: usize,
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        self.lease.bytes(self.len)
    }
}
