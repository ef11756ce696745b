//! Arbitrary bytes as the first frames of a channel socket: a same-host `ShmHello` and
//! `ShmPayload` and `ShmCopied`, and a TCP channel's `TcpHello`, as frames and as bare bodies. Anything may be
//! refused; nothing may panic, and what decodes must survive a re-encode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{ShmCopied, ShmHello, ShmPayload, TcpHello, frame};

/// Decodes `$data` as a `$t` frame and body; what decodes must re-encode to itself.
macro_rules! round_trip {
    ($t:ty, $data:expr) => {
        if let Ok(Some((msg, used))) = frame::decode_frame::<$t>($data) {
            assert!(used <= $data.len());
            let again = frame::encode(&msg).expect("a decoded frame re-encodes");
            let back = frame::decode_frame::<$t>(&again);
            assert!(matches!(back, Ok(Some((ref m, _))) if *m == msg));
        }
        let _ = frame::decode_body::<$t>($data);
    };
}

fuzz_target!(|data: &[u8]| {
    round_trip!(ShmHello, data);
    round_trip!(ShmPayload, data);
    round_trip!(ShmCopied, data);
    round_trip!(TcpHello, data);
});
