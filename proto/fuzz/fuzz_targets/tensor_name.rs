//! Arbitrary bytes as a tensor name, from a string and from the wire. What is accepted must
//! obey the naming rule.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{MAX_NAME_LEN, TensorName, frame};

fn check(name: &TensorName) {
    let s = name.as_str();
    assert!(!s.is_empty() && s.len() <= MAX_NAME_LEN);
    assert!(!s.split('/').any(str::is_empty));
    assert!(
        s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:/-".contains(c))
    );
    assert_eq!(s.parse::<TensorName>().as_ref(), Ok(name));
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data)
        && let Ok(name) = TensorName::new(s)
    {
        check(&name);
    }
    if let Ok(name) = frame::decode_body::<TensorName>(data) {
        check(&name);
    }
});
