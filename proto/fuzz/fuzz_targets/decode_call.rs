//! Arbitrary bytes as remote-call messages: the frames a server sends after accepting a call
//! (`CallFrame`), the caller's credit (`CallUp`), and a body's skeleton (`Value`) read the way
//! a node reads one. Anything may be refused; nothing may panic, and what decodes and passes
//! validation re-encodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{
    call::{Body, CallFrame, CallUp, Value},
    frame,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((msg, used))) = frame::decode_frame::<CallFrame>(data) {
        assert!(used <= data.len());
        if let CallFrame::Failed(failure) = &msg {
            let _ = failure.validate();
        }
        let again = frame::encode(&msg).expect("a decoded frame re-encodes");
        assert!(matches!(frame::decode_frame::<CallFrame>(&again), Ok(Some((ref m, _))) if *m == msg));
    }
    if let Ok(up) = frame::decode_body::<CallUp>(data) {
        let again = frame::encode(&up).expect("a decoded credit re-encodes");
        assert!(matches!(frame::decode_frame::<CallUp>(&again), Ok(Some((ref u, _))) if *u == up));
    }
    // A body as a node reads it: the prefix, the skeleton under its limit, the tensors' size.
    if data.len() >= Body::PREFIX {
        let body_len = data.len() as u64;
        let prefix: [u8; 4] = data[..4].try_into().expect("4 bytes");
        if let Ok(len) = Body::skeleton_len(prefix, body_len) {
            if let Ok((value, shape)) = Body::skeleton(&data[4..4 + len], body_len) {
                assert_eq!(shape.tensors, value.tensors().len());
                let (head, again) = Body::head(&value).expect("a checked value re-encodes");
                assert_eq!(again, shape);
                let back: Value = postcard::from_bytes(&head[4..]).expect("decodes");
                // NaN floats compare unequal to themselves; compare the encodings instead.
                assert_eq!(postcard::to_allocvec(&back).ok(), postcard::to_allocvec(&value).ok());
            }
        }
    }
});
