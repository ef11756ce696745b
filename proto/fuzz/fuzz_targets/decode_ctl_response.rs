//! Arbitrary bytes as a `tb/ctl/1` response: as a frame (prefix + body) and as a bare body,
//! then `validate` and `is_final` on whatever decodes. Anything may be refused; nothing may
//! panic, and a response that validates must survive a re-encode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{CtlResponse, frame};

/// The design's default maximum tensor size.
const MAX_TENSOR: u64 = 64 << 30;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((resp, used))) = frame::decode_frame::<CtlResponse>(data) {
        assert!(used <= data.len());
        let _ = resp.is_final();
        let _ = resp.validate(0);
        let _ = resp.validate(MAX_TENSOR);
    }
    if let Ok(resp) = frame::decode_body::<CtlResponse>(data) {
        if resp.validate(MAX_TENSOR).is_ok() {
            let again = frame::encode(&resp).expect("a decoded response re-encodes");
            let back = frame::decode_frame::<CtlResponse>(&again);
            assert!(matches!(back, Ok(Some((ref r, _))) if *r == resp));
        }
    }
});
