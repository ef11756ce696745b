//! Arbitrary bytes as a `tb/ctl/1` request: as a frame (prefix + body) and as a bare body, then
//! `validate` on whatever decodes. Anything may be refused; nothing may panic, and a request
//! that validates must survive a re-encode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{CtlRequest, frame};

/// The design's default maximum tensor size.
const MAX_TENSOR: u64 = 64 << 30;

fuzz_target!(|data: &[u8]| {
    if let Some(prefix) = data.first_chunk::<{ frame::LEN_PREFIX }>() {
        let _ = frame::body_len(*prefix);
    }
    if let Ok(Some((req, used))) = frame::decode_frame::<CtlRequest>(data) {
        assert!(used <= data.len());
        let _ = req.validate(0);
        let _ = req.validate(MAX_TENSOR);
    }
    if let Ok(req) = frame::decode_body::<CtlRequest>(data) {
        if req.validate(MAX_TENSOR).is_ok() {
            let again = frame::encode(&req).expect("a decoded request re-encodes");
            let back = frame::decode_frame::<CtlRequest>(&again);
            assert!(matches!(back, Ok(Some((ref r, _))) if *r == req));
        }
    }
});
