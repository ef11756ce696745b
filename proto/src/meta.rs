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
    /// A peer's channel offers are malformed (too many, a kind twice).
    #[error(transparent)]
    Offers(#[from] crate::channel::OfferError),
    /// A CUDA IPC request out of bounds (a host id too long).
    #[error(transparent)]
    Ipc(Box<crate::ipc::IpcError>),
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
///
/// A decoded `TensorMeta` is untrusted until [`validate`](Self::validate) passes. Decoding
/// itself is bounded: postcard decodes from a slice already capped by
/// [`MAX_CONTROL_FRAME`](crate::frame::MAX_CONTROL_FRAME), and it hints serde to preallocate
/// a sequence only when that many bytes remain, so a shape claiming 2^40 dimensions fails as
/// a decode error instead of allocating.
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

    /// Number of elements: `product(shape)`, saturating at `u64::MAX` for metadata that
    /// [`validate`](Self::validate) would refuse.
    pub fn numel(&self) -> u64 {
        self.shape.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }
}

#[cfg(test)]
mod tests {
    use std::fmt;

    use serde::{
        Deserializer,
        de::{SeqAccess, Visitor},
    };

    use super::*;
    use crate::{DataRequest, FrameError, frame};

    fn h() -> ContentHash {
        ContentHash([7; 32])
    }

    #[test]
    fn byte_len_is_checked() {
        assert_eq!(byte_len_for(DType::F32, &[2, 3]), Ok(24));
        assert_eq!(byte_len_for(DType::F64, &[]), Ok(8));
        assert_eq!(byte_len_for(DType::U8, &[0, 5]), Ok(0));
        assert_eq!(
            byte_len_for(DType::F32, &[u64::MAX, 2]),
            Err(MetaError::Overflow)
        );
        assert_eq!(
            byte_len_for(DType::F32, &[1 << 62]),
            Err(MetaError::Overflow)
        );
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
        assert_eq!(
            good.validate(31),
            Err(MetaError::TooLarge { len: 32, max: 31 })
        );
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

    /// LEB128 varint, as postcard writes lengths and integers.
    fn varint(mut v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(byte);
                return out;
            }
            out.push(byte | 0x80);
        }
    }

    #[test]
    fn huge_shape_claim_is_a_decode_error_not_an_allocation() {
        // Push { name: "w", meta: { dtype: F32, shape: <2^40 dims>, ...
        let mut body = vec![0x01, 0x01, b'w', 0x0b];
        body.extend(varint(1 << 40));
        body.resize(20, 0x05);
        assert!(matches!(
            frame::decode_body::<DataRequest>(&body),
            Err(FrameError::Decode(_))
        ));
        assert!(matches!(
            frame::decode_body::<TensorMeta>(&body[3..]),
            Err(FrameError::Decode(_))
        ));
    }

    /// Records the length hint a sequence deserializer gives serde; `Vec`'s visitor
    /// preallocates from exactly this hint.
    struct HintProbe(Option<usize>);

    impl<'de> Deserialize<'de> for HintProbe {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = HintProbe;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a sequence")
                }
                fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<HintProbe, A::Error> {
                    Ok(HintProbe(seq.size_hint()))
                }
            }
            d.deserialize_seq(V)
        }
    }

    #[test]
    fn postcard_never_hints_more_elements_than_bytes_remain() {
        let mut huge = varint(1 << 40);
        huge.extend([5; 14]);
        let probe: HintProbe = postcard::from_bytes(&huge).expect("probe");
        assert_eq!(
            probe.0, None,
            "a 2^40 claim in 20 bytes must not become a size hint"
        );
        let mut honest = varint(3);
        honest.extend([5; 3]);
        let probe: HintProbe = postcard::from_bytes(&honest).expect("probe");
        assert_eq!(probe.0, Some(3));
    }

    #[test]
    fn numel_saturates_on_lies() {
        let lie = TensorMeta {
            dtype: DType::U8,
            shape: vec![u64::MAX, 2],
            byte_len: 0,
            hash: h(),
        };
        assert_eq!(lie.numel(), u64::MAX);
        assert_eq!(lie.validate(u64::MAX), Err(MetaError::Overflow));
        let scalar = TensorMeta::new(DType::F64, vec![], h()).expect("meta");
        assert_eq!((scalar.numel(), scalar.byte_len), (1, 8));
    }

    #[test]
    fn rank_is_checked_before_anything_else() {
        let deep = TensorMeta {
            dtype: DType::U8,
            shape: vec![1; MAX_RANK + 1],
            byte_len: 1,
            hash: h(),
        };
        assert_eq!(
            deep.validate(u64::MAX),
            Err(MetaError::RankTooLarge { rank: MAX_RANK + 1 })
        );
        let max = TensorMeta::new(DType::U8, vec![1; MAX_RANK], h()).expect("meta");
        assert!(max.validate(1).is_ok());
    }

    #[test]
    fn errors_read_well() {
        assert_eq!(
            MetaError::TooLarge { len: 10, max: 5 }.to_string(),
            "tensor of 10 bytes is over the limit of 5 bytes"
        );
        assert!(
            MetaError::RankTooLarge { rank: 40 }
                .to_string()
                .contains("limit of 32")
        );
    }
}
