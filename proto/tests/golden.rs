//! Golden bytes: the exact wire form of every `tb/data/1` message variant. If one of these
//! fails, the wire changed: that needs a new ALPN version, not a new expected string.
//!
//! Reading the hex: a frame is a little-endian `u32` body length, then postcard, which
//! writes enum variants and lengths as LEB128 varints, integers as varints, `Option` as
//! `00` / `01 value`, strings as length + UTF-8, and `[u8; 32]` as 32 raw bytes.

use tb_proto::{
    ByteRange, ContentHash, DType, DataRequest, DataResponse, ErrorCode, NamePattern, TensorMeta,
    TensorName, frame,
};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("name")
}

/// Encodes `msg`, checks the frame against `expected` (spaces ignored), and decodes it back.
fn golden<T>(msg: &T, expected: &str)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let bytes = frame::encode(msg).expect("encode");
    assert_eq!(hex(&bytes), expected.replace(' ', ""), "{msg:?}");
    let (back, used) = frame::decode_frame::<T>(&bytes)
        .expect("decode")
        .expect("whole frame");
    assert_eq!((&back, used), (msg, bytes.len()));
}

const H_AB: &str = "abababababababababababababababababababababababababababababababab";
const H_11: &str = "1111111111111111111111111111111111111111111111111111111111111111";

#[test]
fn pull_newest_whole() {
    let msg = DataRequest::Pull {
        name: name("model/w"),
        version: None,
        range: None,
    };
    // len 11 | Pull=0 | "model/w" (7 bytes) | version None | range None
    golden(&msg, "0b000000 00 07 6d6f64656c2f77 00 00");
}

#[test]
fn pull_version_and_range() {
    let msg = DataRequest::Pull {
        name: name("a"),
        version: Some(7),
        range: Some(ByteRange {
            offset: 300,
            len: 1 << 20,
        }),
    };
    // len 11 | Pull=0 | "a" | Some(7) | Some { offset 300 = ac 02, len 2^20 = 80 80 40 }
    golden(&msg, "0b000000 00 01 61 01 07 01 ac02 808040");
}

#[test]
fn pull_max_version() {
    let msg = DataRequest::Pull {
        name: name("a"),
        version: Some(u64::MAX),
        range: None,
    };
    // u64::MAX is a 10-byte varint.
    golden(&msg, "0f000000 00 01 61 01 ffffffffffffffffff01 00");
}

#[test]
fn push() {
    let msg = DataRequest::Push {
        name: name("w"),
        meta: TensorMeta::new(DType::F32, vec![2, 3], ContentHash([0xab; 32])).expect("meta"),
    };
    // len 40 | Push=1 | "w" | F32=11 | shape [2, 3] | byte_len 24 | hash
    golden(&msg, &format!("28000000 01 01 77 0b 02 02 03 18 {H_AB}"));
}

#[test]
fn header() {
    let msg = DataResponse::Header {
        meta: TensorMeta::new(DType::BF16, vec![], ContentHash([0x11; 32])).expect("meta"),
        version: 300,
    };
    // len 38 | Header=0 | BF16=10 | shape [] | byte_len 2 | hash | version 300
    golden(&msg, &format!("26000000 00 0a 00 02 {H_11} ac02"));
}

#[test]
fn ack() {
    golden(&DataResponse::Ack, "01000000 01");
}

#[test]
fn error() {
    let msg = DataResponse::Error {
        code: ErrorCode::Corrupt,
        message: "bad".into(),
    };
    // len 6 | Error=2 | Corrupt=3 | "bad"
    golden(&msg, "06000000 02 03 03 626164");
}

#[test]
fn error_codes_are_numbered_in_order() {
    for (i, code) in ErrorCode::ALL.into_iter().enumerate() {
        let msg = DataResponse::Error {
            code,
            message: String::new(),
        };
        golden(&msg, &format!("03000000 02 {i:02x} 00"));
    }
}

#[test]
fn dtypes_are_numbered_in_order() {
    for (i, d) in DType::ALL.into_iter().enumerate() {
        golden(&d, &format!("01000000 {i:02x}"));
    }
}

#[test]
fn patterns_are_strings() {
    let p: NamePattern = "model/*".parse().expect("pattern");
    golden(&p, "08000000 07 6d6f64656c2f2a");
    let all: NamePattern = "*".parse().expect("pattern");
    golden(&all, "02000000 01 2a");
}
