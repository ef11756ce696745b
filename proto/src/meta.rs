//! [`TensorMeta`]: dtype, shape, byte length and hash, validated with overflow checks.

use serde::{Deserialize, Serialize};

use crate::{ContentHash, DType};

/// Most dimensions a tensor may have.
pub const MAX_RANK: usize = 32;

/// What is wrong with tensor metadata.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// More dimensions than [`MAX_RANK`].
    #[error("rank {rank} is over the limit of {MAX_RANK} dimensions")]
    RankTooLarge {
        /// The rank given.
        rank: usize,
    },
    /// The element count or byte length does not fit in 64 bits.
    #[error("shape overflows: the element count or byte length does not fit in 64 bits")]
    Overflow,
    /// The byte length disagrees with dtype and shape.
    #[error("byte length {actual} does not match dtype and shape, which need {expected}")]
    ByteLenMismatch {
        /// `product(shape) * itemsize`.
        expected: u64,
        /// The length given.
        actual: u64,
    },
    /// The tensor is larger than the configured maximum.
    #[error("tensor of {len} bytes is over the limit of {max} bytes")]
    TooLarge {
        /// Its byte length.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// `product(shape) * itemsize`, overflow-checked; rank 0 is a scalar of one element.
pub fn byte_len_for(dtype: DType, shape: &[u64]) -> Result<u64, MetaError> {
    if shape.len() > MAX_RANK {
        return Err(MetaError::RankTooLarge { rank: shape.len() });
    }
    shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.itemsize()))
        .ok_or(MetaError::Overflow)
}

/// Describes a tensor's bytes: dtype, C-contiguous shape, length and BLAKE3 hash.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// `product(shape) * dtype.itemsize()`.
    pub byte_len: u64,
    /// BLAKE3 of the bytes.
    pub hash: ContentHash,
}

impl TensorMeta {
    /// Metadata with the byte length computed from dtype and shape.
    pub fn new(dtype: DType, shape: Vec<u64>, hash: ContentHash) -> Result<Self, MetaError> {
        let byte_len = byte_len_for(dtype, &shape)?;
        Ok(TensorMeta {
            dtype,
            shape,
            byte_len,
            hash,
        })
    }

    /// Checks rank, byte length against dtype and shape, and size against `max_tensor_bytes`.
    /// Run on every metadata that came from the network before trusting it.
    pub fn validate(&self, max_tensor_bytes: u64) -> Result<(), MetaError> {
        let expected = byte_len_for(self.dtype, &self.shape)?;
        if expected != self.byte_len {
            return Err(MetaError::ByteLenMismatch {
                expected,
                actual: self.byte_len,
            });
        }
        if self.byte_len > max_tensor_bytes {
            return Err(MetaError::TooLarge {
                len: self.byte_len,
                max: max_tensor_bytes,
            });
        }
        Ok(())
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.byte_len / self.dtype.itemsize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h() -> ContentHash {
        ContentHash([7; 32])
    }

    #[test]
    fn byte_len_is_checked() {
        assert_eq!(byte_len_for(DType::F32, &[2, 3]), Ok(24));
        assert_eq!(byte_len_for(DType::F64, &[]), Ok(8));
        assert_eq!(byte_len_for(DType::U8, &[0, 5]), Ok(0));
        assert_eq!(byte_len_for(DType::F32, &[u64::MAX, 2]), Err(MetaError::Overflow));
        assert_eq!(byte_len_for(DType::F32, &[1 << 62]), Err(MetaError::Overflow));
        assert_eq!(
            byte_len_for(DType::U8, &[1; 33]),
            Err(MetaError::RankTooLarge { rank: 33 })
        );
    }

    #[test]
    fn validate_catches_lies() {
        let good = TensorMeta::new(DType::BF16, vec![4, 4], h()).expect("meta");
        assert_eq!(good.byte_len, 32);
        assert_eq!(good.numel(), 16);
        assert!(good.validate(32).is_ok());
        assert_eq!(good.validate(31), Err(MetaError::TooLarge { len: 32, max: 31 }));
        let lie = TensorMeta {
            byte_len: 33,
            ..good
        };
        assert_eq!(
            lie.validate(1 << 20),
            Err(MetaError::ByteLenMismatch {
                expected: 32,
                actual: 33
            })
        );
    }
}
