//! Where a tensor's bytes live — host memory or a CUDA device — and how device bytes meet the
//! network.
//!
//! - [`Device`]: `Host` or `Cuda(ordinal)`; a [`crate::Tensor`] records its device.
//! - [`DeviceBuffer`]: bytes on one CUDA device. Cloning shares the allocation.
//! - [`CudaConfig`]: staging chunk size, staging buffers per device, copies in flight, IPC.
//!
//! How a pull into device memory travels (CUDA IPC from a same-host device holder, the pair's
//! channel then one copy up, or QUIC through pinned staging) is decided with every other
//! route, in the crate's `channel` module.
//!
//! With the `cuda` feature, `cuda/` drives the driver through cudarc with dynamic loading:
//! nothing CUDA is touched until a device is first used, and then a missing driver or device
//! is [`crate::Error::DeviceUnavailable`], never a panic. Without the feature, `stub.rs` offers
//! the same API, whose device calls all answer `DeviceUnavailable`, so code and tests written
//! against it build either way.
//!
//! ## Moving device bytes over the network
//! Sending: chunks of the device buffer are copied into pinned host staging buffers on a CUDA
//! stream owned by the transfer, `pipeline_depth` copies ahead of the network, and each staged
//! chunk is handed to QUIC without another copy (the buffer goes back to the pool when QUIC
//! drops it). Receiving: the payload is read straight into a pinned buffer, hashed as it lands,
//! and copied to the device asynchronously while the next chunk is read into another buffer.
//! Pinned buffers are allocated once per device and reused: pinning costs milliseconds.
//! A transfer holds at most `max_staging_per_transfer` of them (`quota.rs`), so one whose
//! peer reads slowly cannot take every buffer and stall the others.

use std::{fmt, ops::Range, str::FromStr};

use iroh::endpoint::SendStream;
use serde::Serialize;

use crate::{config::Config, error::Result, progress::TransferProgress, tensor::Tensor, wire};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod quota;
#[cfg(not(feature = "cuda"))]
mod stub;

#[cfg(feature = "cuda")]
pub use cuda::{DeviceBuffer, probe};
#[cfg(feature = "cuda")]
pub(crate) use cuda::{ensure, ipc_export, ipc_import, recv_payload, send_payload};
#[cfg(not(feature = "cuda"))]
pub use stub::{DeviceBuffer, probe};
#[cfg(not(feature = "cuda"))]
pub(crate) use stub::{ensure, ipc_export, ipc_import, recv_payload, send_payload};

/// Whether this build can drive CUDA devices (the `cuda` feature). Even then a device may be
/// unavailable at run time: [`probe`] says.
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

/// Where a tensor's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host (CPU) memory.
    #[default]
    Host,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// The CUDA ordinal, if this is a CUDA device.
    pub fn cuda_ordinal(self) -> Option<usize> {
        match self {
            Device::Host => None,
            Device::Cuda(ordinal) => Some(ordinal),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl FromStr for Device {
    type Err = String;

    /// Parses `host`, `cpu`, `cuda` (ordinal 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "host" | "cpu" => Ok(Device::Host),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {other:?} (expected host, cuda or cuda:N)")),
        }
    }
}

/// What [`probe`] found out about a CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device ordinal.
    pub ordinal: usize,
    /// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Total device memory in bytes.
    pub total_bytes: u64,
    /// Free device memory in bytes, when probed.
    pub free_bytes: u64,
}

/// Tuning of device transfers. `Default` suits one GPU on PCIe or NVLink hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaConfig {
    /// Bytes per pinned staging buffer, and so per device copy (4 MiB: large enough that a
    /// copy's fixed cost is noise, small enough that copy and network overlap finely).
    pub chunk_bytes: usize,
    /// Most pinned staging buffers per device, shared by all transfers of the process. They
    /// are pinned on first use and kept. The first node to use a device sizes its pool.
    pub staging_buffers: usize,
    /// Device-to-host copies a sending transfer keeps in flight ahead of the network (at
    /// most `max_staging_per_transfer` of them, counting chunks QUIC still holds).
    pub pipeline_depth: usize,
    /// Offer CUDA IPC to pullers on the same host (and try it when pulling to a device).
    pub ipc: bool,
    /// Tensors smaller than this always go over the network: opening an IPC mapping costs
    /// more than sending them.
    pub ipc_min_bytes: u64,
    /// Most staging buffers one transfer may hold at once (clamped to 1..=`staging_buffers`);
    /// a sent chunk counts until QUIC drops it, i.e. until the receiver acknowledged it.
    /// Default 2 of the 8: a transfer to a slow receiver holds at most 2, so the others keep
    /// moving unless four transfers are stuck at once.
    pub max_staging_per_transfer: usize,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            chunk_bytes: 4 << 20,
            staging_buffers: 8,
            pipeline_depth: 3,
            ipc: true,
            ipc_min_bytes: 1 << 20,
            max_staging_per_transfer: 2,
        }
    }
}

/// Writes `header` and then bytes `range` of `tensor`'s payload, from wherever they live: the
/// sending half of the channel choice (host bytes as slices of the shared buffer, device
/// bytes through pinned staging). The payload bytes handed to QUIC so far go to `progress`,
/// and are counted on `meter` as they go.
pub(crate) async fn write_header_and_tensor<T: Serialize>(
    send: &mut SendStream,
    header: &T,
    tensor: &Tensor,
    range: Range<usize>,
    config: &Config,
    meter: tb_dashboard::Meter,
    progress: Option<&TransferProgress>,
) -> Result<()> {
    let watchdog = wire::Watchdog::metered(config.stall_timeout, meter);
    match tensor.device_buffer() {
        None => {
            let payload = tensor.data().slice(range);
            wire::write_header_and_payload(send, header, &payload, watchdog, progress).await
        }
        Some(buf) => {
            wire::write_frame_within(send, header, config.stall_timeout).await?;
            send_payload(send, buf, range, watchdog, &config.cuda, progress).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip() {
        for d in [Device::Host, Device::Cuda(0), Device::Cuda(7)] {
            assert_eq!(d.to_string().parse::<Device>(), Ok(d));
        }
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Host));
        assert!("gpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
    }

    /// The promise CI checks on machines without CUDA: asking for a device is a typed error
    /// (built without the feature, or no driver), never a panic — and asking twice too
    /// (cudarc keeps panicking once its driver lookup failed, so the guard must hold).
    #[test]
    fn missing_device_is_a_typed_error_not_a_panic() {
        for _ in 0..2 {
            match probe(0) {
                Ok(info) => println!("CUDA device present: {info:?}"),
                Err(crate::Error::DeviceUnavailable(reason)) => println!("no device: {reason}"),
                Err(other) => panic!("expected DeviceUnavailable, got {other:?}"),
            }
            match DeviceBuffer::from_host(usize::MAX, &[1, 2, 3]) {
                Err(crate::Error::DeviceUnavailable(_)) => {}
                other => panic!("expected DeviceUnavailable for a bogus ordinal, got {other:?}"),
            }
        }
    }
}
