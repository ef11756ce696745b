//! The device API of a build without the `cuda` feature: every device call answers
//! `DeviceUnavailable`, and [`DeviceBuffer`] has no values, so the code paths that carry one
//! compile to nothing.

use std::{convert::Infallible, ops::Range};

use iroh::endpoint::{RecvStream, SendStream};
use tb_proto::ContentHash;

use super::{CudaConfig, DeviceInfo};
use crate::error::{Error, Result};

fn unavailable() -> Error {
    Error::DeviceUnavailable("this build has no CUDA support (enable the `cuda` feature)".into())
}

/// Bytes on a CUDA device. This build has no CUDA support, so there are none.
#[derive(Debug, Clone)]
pub struct DeviceBuffer {
    never: Infallible,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on device `ordinal`: `DeviceUnavailable` in this build.
    pub fn alloc(_ordinal: usize, _len: usize) -> Result<Self> {
        Err(unavailable())
    }

    /// Copies `bytes` to device `ordinal`: `DeviceUnavailable` in this build.
    pub fn from_host(_ordinal: usize, _bytes: &[u8]) -> Result<Self> {
        Err(unavailable())
    }

    /// Copies device memory to a new buffer: `DeviceUnavailable` in this build.
    ///
    /// # Safety
    ///
    /// None needed here (nothing is read); the CUDA build's contract is in its docs.
    #[allow(unsafe_code)]
    pub unsafe fn copy_from_device_ptr(_ordinal: usize, _src: u64, _len: usize) -> Result<Self> {
        Err(unavailable())
    }

    /// A copy of these bytes on the same device.
    pub fn duplicate(&self) -> Result<Self> {
        match self.never {}
    }

    /// Whether this handle is the allocation's only one.
    pub fn is_unique(&self) -> bool {
        match self.never {}
    }

    /// The device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        match self.never {}
    }

    /// Copies the bytes to host memory.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        match self.never {}
    }

    /// BLAKE3 of the bytes.
    pub fn hash(&self) -> Result<ContentHash> {
        match self.never {}
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

/// Looks up CUDA device `ordinal`: `DeviceUnavailable` in this build.
pub fn probe(_ordinal: usize) -> Result<DeviceInfo> {
    Err(unavailable())
}

/// Fails: there is no device to open in this build.
pub(crate) fn ensure(_ordinal: usize, _cfg: &CudaConfig) -> Result<()> {
    Err(unavailable())
}

/// There is no device memory to export in this build.
pub(crate) fn ipc_export(buf: &DeviceBuffer, _cfg: &CudaConfig) -> Result<[u8; 64], String> {
    match buf.never {}
}

/// There is no device to copy to in this build.
pub(crate) async fn ipc_import(
    _cfg: &CudaConfig,
    _ordinal: usize,
    _handle: &[u8; 64],
    _len: u64,
    done: impl FnOnce(bool) + Send + 'static,
) -> Result<Option<DeviceBuffer>> {
    done(false);
    Err(unavailable())
}

pub(crate) async fn send_payload(
    _send: &mut SendStream,
    src: &DeviceBuffer,
    _range: Range<usize>,
    _watchdog: crate::wire::Watchdog,
    _cfg: &CudaConfig,
    _progress: Option<&crate::progress::TransferProgress>,
) -> Result<()> {
    match src.never {}
}

pub(crate) async fn recv_payload(
    _recv: &mut RecvStream,
    dest: &mut DeviceBuffer,
    _watchdog: crate::wire::Watchdog,
    _cfg: &CudaConfig,
) -> Result<ContentHash> {
    match dest.never {}
}
