//! Arbitrary bytes as a dtype, from a string and from the wire. What is accepted must have a
//! sane item size and a name that parses back to it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{DType, frame};

fn check(d: DType) {
    assert!(matches!(d.itemsize(), 1 | 2 | 4 | 8));
    assert_eq!(d.name().parse::<DType>(), Ok(d));
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data)
        && let Ok(d) = s.parse::<DType>()
    {
        check(d);
    }
    if let Ok(d) = frame::decode_body::<DType>(data) {
        check(d);
    }
});
