//! Device bytes to and from a QUIC stream, pipelined through pinned staging buffers.
//!
//! Each transfer gets its own CUDA stream, so its copies overlap with other transfers' and
//! with kernels on other streams. Sending keeps `pipeline_depth` device-to-host copies in
//! flight ahead of the network; receiving copies chunk k to the device while chunk k+1 is
//! read from the network into another buffer.

use std::{collections::VecDeque, ops::Range, sync::Arc};

use bytes::Bytes;
use cudarc::driver::{CudaStream, sys};
use iroh::endpoint::{RecvStream, SendStream};
use tb_proto::{ContentHash, ContentHasher};

use super::{
    DeviceBuffer, Gpu, driver_error, gpu,
    staging::{Lease, Staged},
    wait_event,
};
use crate::{
    device::CudaConfig,
    error::{Error, Result},
    progress::{self, TransferProgress},
    wire::{self, Watchdog},
};

/// A CUDA stream for one transfer on `gpu`.
pub(super) fn transfer_stream(gpu: &Gpu) -> Result<Arc<CudaStream>> {
    gpu.ctx
        .new_stream()
        .map_err(|e| driver_error("creating a transfer stream", e))
}

/// Waits, without blocking the runtime, for everything enqueued on `stream` so far.
pub(super) async fn drain(stream: &Arc<CudaStream>) -> Result<()> {
    let done = stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
        .map_err(|e| driver_error("recording the end of a transfer", e))?;
    wait_event(Arc::new(done)).await
}

/// Sends bytes `range` of `src` on `send`: chunks are copied to pinned staging ahead of the
/// network and handed to QUIC without another copy.
pub(crate) async fn send_payload(
    send: &mut SendStream,
    src: &DeviceBuffer,
    range: Range<usize>,
    mut watchdog: Watchdog,
    cfg: &CudaConfig,
    progress: Option<&TransferProgress>,
) -> Result<()> {
    let stall = watchdog.stall();
    let gpu = gpu(src.ordinal(), cfg)?;
    let stream = transfer_stream(&gpu)?;
    // Chunks handed to QUIC keep counting against the share until they are acknowledged:
    // a slow receiver slows this transfer only, not the others on the device.
    let share = gpu.staging.share();
    let slice = src.cuda_slice();
    let (chunk, depth) = (gpu.staging.slot_bytes(), cfg.pipeline_depth.max(1));
    let total = range.len();
    let mut queued: VecDeque<(Lease, usize)> = VecDeque::with_capacity(depth);
    let (mut next, mut sent) = (range.start, 0);
    loop {
        // Keep copies in flight: wait for a buffer only when nothing is queued, so a transfer
        // never holds idle buffers while waiting for more.
        while next < range.end && queued.len() < depth {
            let mut lease = if queued.is_empty() {
                gpu.staging.acquire(&share, stall).await?
            } else {
                match gpu.staging.try_acquire(&share)? {
                    Some(lease) => lease,
                    None => break,
                }
            };
            let end = (next + chunk).min(range.end);
            let len = lease.stage_range(&stream, slice, next..end)?;
            queued.push_back((lease, len));
            next = end;
        }
        let Some((lease, len)) = queued.pop_front() else {
            break;
        };
        let lease = lease.ready().await?;
        let bytes = Bytes::from_owner(Staged { lease, len });
        wire::write_chunk(send, bytes, &mut watchdog, sent, total).await?;
        sent += len;
        progress::reached(progress, sent as u64);
    }
    Ok(())
}

/// Receives `dest.len()` bytes from `recv` into `dest`, hashing them on the host as they
/// pass; returns the hash once every byte is on the device.
pub(crate) async fn recv_payload(
    recv: &mut RecvStream,
    dest: &mut DeviceBuffer,
    mut watchdog: Watchdog,
    cfg: &CudaConfig,
) -> Result<ContentHash> {
    let stall = watchdog.stall();
    let gpu = gpu(dest.ordinal(), cfg)?;
    let stream = transfer_stream(&gpu)?;
    let share = gpu.staging.share();
    let chunk = gpu.staging.slot_bytes();
    let slice = dest.slice_mut()?;
    let total = slice.len();
    let mut hasher = ContentHasher::new();
    let mut offset = 0;
    while offset < total {
        let len = chunk.min(total - offset);
        // A buffer whose copy to the device is done: the previous chunk's copy is usually
        // still running in another one.
        let mut lease = gpu.staging.acquire(&share, stall).await?;
        let buf = lease.bytes_mut(len);
        let (mut filled, mut hashed) = (0, 0);
        while filled < len {
            let at = offset + filled;
            filled += wire::read_some(recv, &mut buf[filled..], &mut watchdog, at, total).await?;
            if filled - hashed >= wire::HASH_BATCH || filled == len {
                hasher.update(&buf[hashed..filled]);
                hashed = filled;
            }
        }
        let mut view = slice.try_slice_mut(offset..offset + len).ok_or_else(|| {
            Error::Device(format!("bytes {offset}..{} out of range", offset + len))
        })?;
        lease.unstage_to_device(&stream, &mut view)?;
        offset += len;
    }
    drain(&stream).await?;
    Ok(hasher.finalize())
}
