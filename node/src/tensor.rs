//! [`Tensor`]: metadata plus immutable bytes, hashed once when it is made.

use bytes::Bytes;
use tb_proto::{ContentHash, DType, TensorMeta};

use crate::error::{Error, Result};

/// A tensor in host memory: dtype, shape and C-contiguous bytes, with their BLAKE3 hash.
///
/// The bytes are shared and immutable: cloning a `Tensor` or sending it to many peers never
/// copies them, and a new version never changes bytes a reader already holds.
#[derive(Clone, PartialEq, Eq)]
pub struct Tensor {
    meta: TensorMeta,
    data: Bytes,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.meta.dtype)
            .field("shape", &self.meta.shape)
            .field("byte_len", &self.meta.byte_len)
            .field("hash", &self.meta.hash)
            .finish()
    }
}

impl Tensor {
    /// Makes a tensor, checking `data.len() == product(shape) * itemsize`, and hashes it.
    pub fn new(dtype: DType, shape: Vec<u64>, data: impl Into<Bytes>) -> Result<Self> {
        let data = data.into();
        let expected = tb_proto::byte_len_for(dtype, &shape)?;
        if expected != data.len() as u64 {
            return Err(Error::InvalidTensor(format!(
                "{dtype} tensor of shape {shape:?} needs {expected} bytes, got {}",
                data.len()
            )));
        }
        let meta = TensorMeta::new(dtype, shape, ContentHash::of(&data))?;
        Ok(Tensor { meta, data })
    }

    /// A 1-D `u8` tensor over `data`.
    pub fn from_bytes(data: impl Into<Bytes>) -> Self {
        let data = data.into();
        let meta = TensorMeta {
            dtype: DType::U8,
            shape: vec![data.len() as u64],
            byte_len: data.len() as u64,
            hash: ContentHash::of(&data),
        };
        Tensor { meta, data }
    }

    /// Wraps bytes whose hash was already verified against `meta` (the receive path).
    pub(crate) fn from_verified(meta: TensorMeta, data: Bytes) -> Self {
        debug_assert_eq!(meta.byte_len, data.len() as u64);
        Tensor { meta, data }
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

    /// The raw bytes.
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> u64 {
        self.meta.byte_len
    }

    /// The BLAKE3 hash of the bytes.
    pub fn hash(&self) -> ContentHash {
        self.meta.hash
    }
}
