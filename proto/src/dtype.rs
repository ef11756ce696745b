//! [`DType`]: the element types a tensor can have, and their sizes.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// Boolean, one byte per element.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// 8-bit float, 4 exponent and 3 mantissa bits.
    F8E4M3,
    /// 8-bit float, 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// Not an element type: the bytes of a version set (see [`crate::set`]), one byte per
    /// element. Only a set's own registry entry has it; a set's members never do.
    Set,
}

/// A dtype name that is not one of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown dtype {0:?} (expected one of bool, u8, u16, u32, u64, i8, i16, i32, i64, f16, bf16, f32, f64, f8e4m3, f8e5m2)"
)]
pub struct UnknownDType(pub String);

impl DType {
    /// Every element type (all but [`DType::Set`]).
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Bytes per element.
    pub const fn itemsize(self) -> u64 {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 | DType::Set => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// Whether this is an element type (every dtype but [`DType::Set`]).
    pub const fn is_element(self) -> bool {
        !matches!(self, DType::Set)
    }

    /// The canonical lower-case name (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::Set => "set",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = UnknownDType;

    /// Accepts the canonical names (any case) and numpy/torch aliases (`float32`, `int64`, ...).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        if let Some(d) = DType::ALL.into_iter().find(|d| d.name() == lower) {
            return Ok(d);
        }
        Ok(match lower.as_str() {
            "bool_" | "boolean" => DType::Bool,
            "uint8" => DType::U8,
            "uint16" => DType::U16,
            "uint32" => DType::U32,
            "uint64" => DType::U64,
            "int8" => DType::I8,
            "int16" => DType::I16,
            "int32" => DType::I32,
            "int64" => DType::I64,
            "float16" | "half" => DType::F16,
            "bfloat16" => DType::BF16,
            "float32" | "float" => DType::F32,
            "float64" | "double" => DType::F64,
            "float8_e4m3fn" | "float8_e4m3" => DType::F8E4M3,
            "float8_e5m2" => DType::F8E5M2,
            "set" => DType::Set,
            _ => return Err(UnknownDType(s.chars().take(64).collect())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.name().to_uppercase().parse::<DType>(), Ok(d));
        }
        assert_eq!("float32".parse::<DType>(), Ok(DType::F32));
        assert_eq!("bfloat16".parse::<DType>(), Ok(DType::BF16));
        assert!("f33".parse::<DType>().is_err());
    }

    #[test]
    fn numpy_aliases_parse() {
        let cases = [
            ("float16", DType::F16),
            ("float64", DType::F64),
            ("int8", DType::I8),
            ("int16", DType::I16),
            ("int32", DType::I32),
            ("Int64", DType::I64),
            ("uint8", DType::U8),
            ("uint16", DType::U16),
            ("uint32", DType::U32),
            ("UINT64", DType::U64),
            ("float8_e4m3fn", DType::F8E4M3),
        ];
        for (s, d) in cases {
            assert_eq!(s.parse::<DType>(), Ok(d), "{s}");
        }
        assert_eq!(DType::F8E4M3.to_string(), "f8e4m3");
        let err = "complex64".parse::<DType>().expect_err("unknown");
        assert!(err.to_string().contains("\"complex64\""), "{err}");
    }

    #[test]
    fn itemsizes() {
        assert_eq!(DType::Bool.itemsize(), 1);
        assert_eq!(DType::BF16.itemsize(), 2);
        assert_eq!(DType::F32.itemsize(), 4);
        assert_eq!(DType::I64.itemsize(), 8);
        assert_eq!(DType::F8E5M2.itemsize(), 1);
    }
}
