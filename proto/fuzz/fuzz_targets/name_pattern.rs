//! Arbitrary bytes as a subscription pattern, from a string and from the wire. What is
//! accepted must print back to itself and match consistently.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{NamePattern, TensorName, frame};

fn check(pat: &NamePattern) {
    let printed = pat.to_string();
    assert_eq!(printed.parse::<NamePattern>().as_ref(), Ok(pat));
    match pat {
        NamePattern::Exact(name) => assert!(pat.matches(name)),
        NamePattern::Prefix(prefix) => {
            assert!(prefix.is_empty() || prefix.ends_with('/'));
            if let Ok(below) = TensorName::new(format!("{prefix}x")) {
                assert!(pat.matches(&below));
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data)
        && let Ok(pat) = s.parse::<NamePattern>()
    {
        check(&pat);
    }
    if let Ok(pat) = frame::decode_body::<NamePattern>(data) {
        check(&pat);
    }
});
