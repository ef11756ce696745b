//! [`Tensor`]: metadata plus immutable bytes (in host memory or on a CUDA device), hashed once
//! when it is made.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use tb_proto::{ContentHash, DType, TensorMeta};

use crate::{
    channel::{RegionAt, ShmCache},
    device::{Device, DeviceBuffer},
    error::{Error, Result},
};

/// What a device tensor answers for [`Tensor::data`]: its bytes are not in host memory.
static NO_HOST_BYTES: Bytes = Bytes::new();

/// A tensor: dtype, shape and C-contiguous bytes, with their BLAKE3 hash, in host memory or
/// on a CUDA device ([`Tensor::device`]).
///
/// The bytes are shared and immutable: cloning a `Tensor` or sending it to many peers never
/// copies them, and a new version never changes bytes a reader already holds.
#[derive(Clone)]
pub struct Tensor {
    meta: TensorMeta,
    data: Data,
    /// The bytes in a sealed memfd, for same-host peers: made on first need and shared by
    /// every clone (or given, when the bytes came from a peer's memfd).
    shm: ShmCache,
    /// The version's piece outline (see `tb_proto::piece`): made on first need, or given
    /// when the bytes were fetched in pieces; shared by every clone.
    outline: OutlineCache,
    /// The sealed region the bytes lie in and where, when they are part of one (a set's
    /// member, a payload at an offset of a peer's memfd): views map that part of it.
    region_at: Option<RegionAt>,
}

/// Each piece's BLAKE3 chaining value, in order.
pub(crate) type Outline = Arc<[[u8; 32]]>;

/// A tensor's outline once made.
type OutlineCache = Arc<OnceLock<Outline>>;

/// Where the bytes are.
#[derive(Clone)]
enum Data {
    Host(Bytes),
    Cuda(DeviceBuffer),
}

impl PartialEq for Tensor {
    /// Host tensors compare their bytes; a device tensor equals another tensor on the same
    /// device with the same metadata (the BLAKE3 hash in it stands for the bytes).
    fn eq(&self, other: &Self) -> bool {
        match (&self.data, &other.data) {
            (Data::Host(a), Data::Host(b)) => self.meta == other.meta && a == b,
            _ => self.meta == other.meta && self.device() == other.device(),
        }
    }
}

impl Eq for Tensor {}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.meta.dtype)
            .field("shape", &self.meta.shape)
            .field("byte_len", &self.meta.byte_len)
            .field("hash", &self.meta.hash)
            .field("device", &self.device())
            .finish()
    }
}

/// Checks that `len` bytes make a `dtype` tensor of `shape` (`InvalidTensor` if not).
pub(crate) fn check_len(dtype: DType, shape: &[u64], len: usize) -> Result<()> {
    let expected = tb_proto::byte_len_for(dtype, shape)?;
    if expected != len as u64 {
        return Err(Error::InvalidTensor(format!(
            "{dtype} tensor of shape {shape:?} needs {expected} bytes, got {len}"
        )));
    }
    Ok(())
}

impl Tensor {
    /// Makes a tensor, checking `data.len() == product(shape) * itemsize`, and hashes it.
    ///
    /// On Linux, payloads above 64 KiB are copied (hashed in the same pass) into a sealed
    /// memfd, the memory the node serves same-host peers from and lends readers: the node
    /// then holds one copy of the bytes (`data` is dropped once the caller drops it), not a
    /// heap copy plus a memfd made at the first same-host serve.
    pub fn new(dtype: DType, shape: Vec<u64>, data: impl Into<Bytes>) -> Result<Self> {
        let data = data.into();
        check_len(dtype, &shape, data.len())?;
        #[cfg(target_os = "linux")]
        if data.len() > crate::channel::PRIVATE_COPY_MAX && crate::channel::memfds_work() {
            return Tensor::copy_from(dtype, shape, &data);
        }
        let meta = TensorMeta::new(dtype, shape, ContentHash::of(&data))?;
        Ok(Tensor {
            meta,
            data: Data::Host(data),
            shm: ShmCache::default(),
            outline: OutlineCache::default(),
            region_at: None,
        })
    }

    /// Makes a tensor over bytes on a CUDA device, checking the length, and hashes them by
    /// streaming them through pinned host staging buffers (blocks while it does).
    pub fn from_device(dtype: DType, shape: Vec<u64>, buffer: DeviceBuffer) -> Result<Self> {
        check_device_len(dtype, &shape, &buffer)?;
        let hash = buffer.hash()?;
        let meta = TensorMeta::new(dtype, shape, hash)?;
        Ok(Tensor {
            meta,
            data: Data::Cuda(buffer),
            shm: ShmCache::default(),
            outline: OutlineCache::default(),
            region_at: None,
        })
    }

    /// This tensor's bytes on `device`: itself when they are already there, else a copy
    /// (blocks while copying). The hash carries over: the bytes are the same.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        let data = match (&self.data, device) {
            (Data::Host(_), Device::Host) => return Ok(self.clone()),
            (Data::Cuda(buf), Device::Cuda(n)) if buf.ordinal() == n => return Ok(self.clone()),
            (Data::Host(bytes), Device::Cuda(n)) => Data::Cuda(DeviceBuffer::from_host(n, bytes)?),
            (Data::Cuda(buf), Device::Host) => Data::Host(Bytes::from(buf.to_host()?)),
            (Data::Cuda(buf), Device::Cuda(n)) => {
                Data::Cuda(DeviceBuffer::from_host(n, &buf.to_host()?)?)
            }
        };
        Ok(Tensor {
            meta: self.meta.clone(),
            data,
            shm: ShmCache::default(),
            outline: OutlineCache::default(),
            region_at: None,
        })
    }

    /// Makes a tensor of a copy of `src`, checking the length, and hashes the copy (on every
    /// core for large payloads). On Linux, payloads above 64 KiB are copied into a sealed memfd
    /// that the node then serves to same-host peers and lends to readers without another
    /// copy.
    pub fn copy_from(dtype: DType, shape: Vec<u64>, src: &[u8]) -> Result<Self> {
        check_len(dtype, &shape, src.len())?;
        // Large ones into a memfd written without a writable mapping (no page-table work).
        #[cfg(target_os = "linux")]
        if src.len() > crate::channel::PRIVATE_COPY_MAX && crate::channel::memfds_work() {
            match crate::channel::Region::copy_hashed(src) {
                Ok((region, hash)) => {
                    let meta = TensorMeta::new(dtype, shape, hash)?;
                    return Ok(Tensor::from_region(meta, region));
                }
                // Out of descriptors or memory: plain memory still holds the bytes.
                Err(err) => tracing::debug!(%err, "no memfd for a copy: plain memory"),
            }
        }
        let mut buf = crate::channel::HostBuf::new(src.len())?;
        // One pass, on every core: the hash of the copy, not of `src` (`src` may change
        // meanwhile: another thread writing the array; the copy cannot).
        let hash = crate::channel::verify::copy_and_hash(src, buf.as_mut());
        let meta = TensorMeta::new(dtype, shape, hash)?;
        buf.into_tensor(meta)
    }

    /// A 1-D `u8` tensor over `data` (copied into a memfd above 64 KiB, as [`new`](Self::new)
    /// does).
    pub fn from_bytes(data: impl Into<Bytes>) -> Self {
        let data = data.into();
        #[cfg(target_os = "linux")]
        if data.len() > crate::channel::PRIVATE_COPY_MAX && crate::channel::memfds_work() {
            let shape = vec![data.len() as u64];
            if let Ok(tensor) = Tensor::copy_from(DType::U8, shape, &data) {
                return tensor;
            }
        }
        let meta = TensorMeta {
            dtype: DType::U8,
            shape: vec![data.len() as u64],
            byte_len: data.len() as u64,
            hash: ContentHash::of(&data),
        };
        Tensor {
            meta,
            data: Data::Host(data),
            shm: ShmCache::default(),
            outline: OutlineCache::default(),
            region_at: None,
        }
    }

    /// Wraps bytes whose hash was already verified against `meta` (the receive path).
    pub(crate) fn from_verified(meta: TensorMeta, data: Bytes) -> Self {
        debug_assert_eq!(meta.byte_len, data.len() as u64);
        Tensor {
            meta,
            data: Data::Host(data),
            shm: ShmCache::default(),
            outline: OutlineCache::default(),
            region_at: None,
        }
    }

    /// Wraps a sealed region whose bytes were verified against `meta` (the receive path into
    /// a memfd): the tensor's bytes are the region's, served and lent without a copy.
    #[cfg(target_os = "linux")]
    pub(crate) fn from_region(meta: TensorMeta, region: crate::channel::Region) -> Self {
        let region = Arc::new(region);
        let data = region.slice(0..region.len());
        debug_assert_eq!(meta.byte_len, data.len() as u64);
        Tensor {
            meta,
            data: Data::Host(data),
            shm: ShmCache::of(region),
            outline: OutlineCache::default(),
            region_at: None,
        }
    }

    /// The bytes as a private, writable buffer of the caller's own (for code that may write
    /// into what it is given, such as a Python user's in-place op): a copy-on-write mapping
    /// of the tensor's sealed memfd (made, one copy, on first need for a tensor that has
    /// none), or a copy for tensors up to 4 MiB (cheaper than a mapping) and where memfds
    /// cannot be mapped. Nothing written into
    /// it changes this tensor, what the node serves, or another reader's bytes.
    pub fn private_view(&self) -> Result<crate::PrivateBytes> {
        let Data::Host(bytes) = &self.data else {
            return Err(Error::InvalidTensor(
                "a device tensor has no host bytes to view".into(),
            ));
        };
        #[cfg(target_os = "linux")]
        if bytes.len() > crate::channel::VIEW_COPY_MAX && crate::channel::memfds_work() {
            let len = bytes.len();
            return match &self.region_at {
                Some((region, at)) => region.private_view(*at..*at + len),
                None => self.shm_region()?.private_view(0..len),
            };
        }
        Ok(crate::PrivateBytes::copy_of(bytes))
    }

    /// Wraps bytes that a same-host holder verified, mapped from its sealed memfd (which can
    /// be passed on to other same-host peers as it is).
    #[cfg(target_os = "linux")]
    pub(crate) fn from_shared(
        meta: TensorMeta,
        data: Bytes,
        shm: ShmCache,
        region_at: Option<RegionAt>,
    ) -> Self {
        debug_assert_eq!(meta.byte_len, data.len() as u64);
        Tensor {
            meta,
            data: Data::Host(data),
            shm,
            outline: OutlineCache::default(),
            region_at,
        }
    }

    /// Bytes `range` of this host tensor as a tensor of `meta` (a set's member, verified
    /// with the set), keeping where they lie in this tensor's region for views.
    pub(crate) fn member(&self, meta: TensorMeta, range: std::ops::Range<usize>) -> Self {
        let data = self.data().slice(range.clone());
        #[cfg(target_os = "linux")]
        let region_at = match (&self.region_at, self.shm.get()) {
            (Some((region, at)), _) => Some((region.clone(), at + range.start)),
            (None, Some(region)) => Some((region, range.start)),
            (None, None) => None,
        };
        #[cfg(not(target_os = "linux"))]
        let region_at = None;
        Tensor {
            region_at,
            ..Tensor::from_verified(meta, data)
        }
    }

    /// The sealed memfd holding the bytes, made (one copy) on first need.
    #[cfg(target_os = "linux")]
    pub(crate) fn shm_region(&self) -> Result<std::sync::Arc<crate::channel::Region>> {
        match &self.data {
            Data::Host(bytes) => self.shm.get_or_copy(bytes),
            Data::Cuda(_) => Err(Error::Io(
                "a device tensor has no host bytes to share".into(),
            )),
        }
    }

    /// The memfd holding exactly these bytes, if one was made or given already (none is made
    /// here): a tensor of a peer's memfd, a put's copy, or one whose bytes were passed
    /// before.
    #[cfg(target_os = "linux")]
    pub(crate) fn made_region(&self) -> Option<std::sync::Arc<crate::channel::Region>> {
        let Data::Host(bytes) = &self.data else {
            return None;
        };
        let region = self.shm.get()?;
        (self.region_at.is_none() && region.len() == bytes.len()).then_some(region)
    }

    /// Wraps device bytes whose hash was already verified against `meta` (the receive path).
    /// A `dtype` tensor of `shape` in `buffer` whose metadata's hash is all zeros (not hashed
    /// yet: a BLAKE3 hash is never all zeros): for a device tensor lent to a peer that copies
    /// it by CUDA IPC, which checks no loan's hash. [`hashed`](Self::hashed) hashes it before
    /// anything that checks sees it (serving it over the network, publishing, pushing).
    pub(crate) fn unhashed_device(
        dtype: DType,
        shape: Vec<u64>,
        buffer: DeviceBuffer,
    ) -> Result<Self> {
        check_device_len(dtype, &shape, &buffer)?;
        let meta = TensorMeta::new(dtype, shape, ContentHash([0; 32]))?;
        Ok(Self::from_verified_device(meta, buffer))
    }

    /// This tensor with its hash in its metadata: itself, or for one not hashed yet (a device
    /// tensor made by [`unhashed_device`](Self::unhashed_device) or received as a loan by CUDA
    /// IPC, or a host copy of one) the same bytes with their hash (blocks while it hashes,
    /// through staging for device bytes).
    pub(crate) fn hashed(self) -> Result<Self> {
        if self.meta.hash != ContentHash([0; 32]) {
            return Ok(self);
        }
        let hash = match &self.data {
            Data::Cuda(buf) => buf.hash()?,
            // A copy to host memory of such a tensor (`to_device` keeps the hash it has).
            Data::Host(bytes) => crate::channel::verify::hash_all(bytes),
        };
        let meta = TensorMeta::new(self.meta.dtype, self.meta.shape.clone(), hash)?;
        // The piece outline, if one was made, is of the old metadata: made again on need.
        Ok(Tensor {
            meta,
            outline: OutlineCache::default(),
            ..self
        })
    }

    pub(crate) fn from_verified_device(meta: TensorMeta, buffer: DeviceBuffer) -> Self {
        debug_assert_eq!(meta.byte_len, buffer.len() as u64);
        Tensor {
            meta,
            data: Data::Cuda(buffer),
            shm: ShmCache::default(),
            outline: OutlineCache::default(),
            region_at: None,
        }
    }

    /// The metadata: dtype, shape, byte length, hash.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    /// The shape (C-contiguous).
    pub fn shape(&self) -> &[u64] {
        &self.meta.shape
    }

    /// The raw bytes in host memory. A tensor on a CUDA device has none here (this is empty):
    /// see [`Tensor::device`], [`Tensor::device_buffer`], or copy with [`Tensor::to_device`].
    pub fn data(&self) -> &Bytes {
        self.host_data().unwrap_or(&NO_HOST_BYTES)
    }

    /// The bytes, if they are in host memory.
    pub fn host_data(&self) -> Option<&Bytes> {
        match &self.data {
            Data::Host(bytes) => Some(bytes),
            Data::Cuda(_) => None,
        }
    }

    /// The device buffer, if the bytes are on a CUDA device.
    pub fn device_buffer(&self) -> Option<&DeviceBuffer> {
        match &self.data {
            Data::Host(_) => None,
            Data::Cuda(buf) => Some(buf),
        }
    }

    /// Where the bytes live.
    pub fn device(&self) -> Device {
        match &self.data {
            Data::Host(_) => Device::Host,
            Data::Cuda(buf) => Device::Cuda(buf.ordinal()),
        }
    }

    /// Size in bytes as an in-memory length.
    pub(crate) fn data_len(&self) -> Result<usize> {
        usize::try_from(self.meta.byte_len)
            .map_err(|_| Error::TooLarge(format!("{} bytes", self.meta.byte_len)))
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> u64 {
        self.meta.byte_len
    }

    /// The BLAKE3 hash of the bytes.
    pub fn hash(&self) -> ContentHash {
        self.meta.hash
    }

    /// The piece outline: each piece's chaining value, hashed on first need (a pass over the
    /// bytes on every core: run it off the async threads) and kept. `None` for a device
    /// tensor (its bytes are hashed through staging buffers, not in pieces).
    pub(crate) fn outline(&self) -> Option<Outline> {
        let Data::Host(bytes) = &self.data else {
            return None;
        };
        Some(
            self.outline
                .get_or_init(|| crate::channel::verify::outline(bytes).into())
                .clone(),
        )
    }

    /// Keeps an outline already checked against this tensor's hash (the pieces it was
    /// fetched in).
    pub(crate) fn with_outline(self, outline: Outline) -> Self {
        let _ = self.outline.set(outline);
        self
    }
}

/// Checks that `buffer` holds exactly a `dtype` tensor of `shape`.
fn check_device_len(dtype: DType, shape: &[u64], buffer: &DeviceBuffer) -> Result<()> {
    let expected = tb_proto::byte_len_for(dtype, shape)?;
    if expected != buffer.len() as u64 {
        return Err(Error::InvalidTensor(format!(
            "{dtype} tensor of shape {shape:?} needs {expected} bytes, the cuda:{} buffer has {}",
            buffer.ordinal(),
            buffer.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use tb_proto::{ContentHash, DType, TensorMeta};

    use super::*;

    #[test]
    fn a_tensor_without_its_hash_is_hashed_before_it_is_trusted() {
        let bytes = Bytes::from(vec![3u8; 4096]);
        let zero = TensorMeta::new(DType::U8, vec![4096], ContentHash([0; 32])).expect("meta");
        let unhashed = Tensor::from_verified(zero, bytes.clone());
        let hashed = unhashed.hashed().expect("hashes");
        assert_eq!(hashed.hash(), ContentHash::of(&bytes));
        assert_eq!(hashed.data(), &bytes);
        // One with its hash is left as it is.
        let known = Tensor::from_bytes(bytes.clone());
        assert_eq!(
            known.clone().hashed().expect("as it is").hash(),
            known.hash()
        );
    }
}
