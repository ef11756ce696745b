//! CUDA through cudarc (driver API, dynamic loading).
//!
//! - `Gpu`: one per device ordinal and process: the primary context and the pinned staging
//!   pool, made on first use and kept.
//! - [`DeviceBuffer`] (`buffer.rs`): bytes on one device.
//! - `staging.rs`: the pinned host buffers device bytes pass through.
//! - `pool.rs`: freed allocations kept for reuse (bounded).
//! - `transfer.rs`: the pipelined copies between a QUIC stream and a device.
//! - `ipc.rs`: CUDA IPC's driver half (export a handle; open one and copy out of it), which
//!   the `cuda-ipc` channel uses.
//!
//! cudarc panics (and keeps panicking) when the driver library is missing, so nothing here
//! calls it before [`driver`] has checked that the library loads; calls that can fail to find
//! a symbol on an old driver run under `catch_unwind` as a second guard.
#![allow(unsafe_code)]

mod buffer;
mod ipc;
mod pool;
mod staging;
mod transfer;

use std::{
    collections::HashMap,
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{Arc, Mutex, OnceLock},
};

pub use buffer::DeviceBuffer;
use cudarc::driver::{CudaContext, CudaEvent, DriverError, sys};
pub(crate) use ipc::{export_handle as ipc_export, import as ipc_import};
pub(crate) use transfer::{recv_payload, send_payload};

use self::staging::StagingPool;
use super::{CudaConfig, DeviceInfo};
use crate::error::{Error, Result};

/// One CUDA device as this process uses it.
pub(crate) struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) staging: Arc<StagingPool>,
    /// Freed allocations kept for reuse (`pool.rs`).
    pub(crate) pool: pool::Pool,
}

/// Checks once per process that the driver library loads and initializes.
fn driver() -> Result<()> {
    static DRIVER: OnceLock<Result<(), String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the driver library by its usual names; it runs no
            // code of the library beyond its initializers and keeps no handle.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err("no CUDA driver (libcuda could not be loaded)".into());
            }
            guarded("cuInit", cudarc::driver::result::init)
                .map_err(|e| format!("the CUDA driver did not initialize: {e}"))
        })
        .clone()
        .map_err(Error::DeviceUnavailable)
}

/// Runs a driver call, turning a cudarc panic (a symbol missing from an old driver) into an
/// error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, DriverError>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e:?}")),
        Err(_) => Err(format!(
            "{what}: the CUDA driver library lacks a needed function"
        )),
    }
}

/// The device `ordinal`, opened on first use. `cfg` sizes its staging pool if this call
/// opens it.
pub(crate) fn gpu(ordinal: usize, cfg: &CudaConfig) -> Result<Arc<Gpu>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    driver()?;
    let gpus = GPUS.get_or_init(Mutex::default);
    let mut gpus = gpus.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(gpu) = gpus.get(&ordinal) {
        return Ok(gpu.clone());
    }
    let count =
        guarded("cuDeviceGetCount", CudaContext::device_count).map_err(Error::DeviceUnavailable)?;
    if ordinal >= usize::try_from(count).unwrap_or(0) {
        return Err(Error::DeviceUnavailable(format!(
            "cuda:{ordinal} does not exist ({count} CUDA devices)"
        )));
    }
    let ctx = guarded("opening the device", || CudaContext::new(ordinal))
        .map_err(|e| Error::DeviceUnavailable(format!("cuda:{ordinal}: {e}")))?;
    let staging = StagingPool::new(ctx.clone(), cfg);
    let gpu = Arc::new(Gpu {
        ctx,
        staging,
        pool: pool::Pool::default(),
    });
    gpus.insert(ordinal, gpu.clone());
    Ok(gpu)
}

/// Maps a driver error onto the variant a caller can act on.
pub(crate) fn driver_error(what: impl std::fmt::Display, err: DriverError) -> Error {
    use sys::CUresult as R;
    let msg = format!("{what}: {err:?}");
    match err.0 {
        R::CUDA_ERROR_OUT_OF_MEMORY => Error::DeviceOutOfMemory(msg),
        R::CUDA_ERROR_NO_DEVICE
        | R::CUDA_ERROR_INVALID_DEVICE
        | R::CUDA_ERROR_NOT_INITIALIZED
        | R::CUDA_ERROR_DEINITIALIZED
        | R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => Error::DeviceUnavailable(msg),
        _ => Error::Device(msg),
    }
}

/// A new event whose `synchronize` sleeps instead of spinning a core.
pub(crate) fn blocking_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
        .map_err(|e| driver_error("creating an event", e))
}

/// Waits for `event` without blocking the async runtime: a cheap query first (the usual case
/// is that the work is done), else a blocking-pool thread sleeps on it.
pub(crate) async fn wait_event(event: Arc<CudaEvent>) -> Result<()> {
    if event
        .try_is_complete()
        .map_err(|e| driver_error("a device copy", e))?
    {
        return Ok(());
    }
    tokio::task::spawn_blocking(move || event.synchronize())
        .await
        .map_err(|e| Error::Device(format!("waiting for a device copy: {e}")))?
        .map_err(|e| driver_error("a device copy", e))
}

/// Opens device `ordinal` now (sizing its staging pool with `cfg` if this is the first use),
/// so a transfer fails fast, before any network traffic, when there is no such device.
pub(crate) fn ensure(ordinal: usize, cfg: &CudaConfig) -> Result<()> {
    gpu(ordinal, cfg).map(|_| ())
}

/// Looks up CUDA device `ordinal`: its name and memory. `DeviceUnavailable` when there is
/// no driver or no such device.
pub fn probe(ordinal: usize) -> Result<DeviceInfo> {
    let gpu = gpu(ordinal, &CudaConfig::default())?;
    let name = gpu
        .ctx
        .name()
        .map_err(|e| driver_error("reading the device name", e))?;
    gpu.ctx
        .bind_to_thread()
        .map_err(|e| driver_error("binding the context", e))?;
    let (free, total) =
        cudarc::driver::result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
    Ok(DeviceInfo {
        ordinal,
        name,
        total_bytes: total as u64,
        free_bytes: free as u64,
    })
}
