//! Arbitrary bytes as the first frame of a connection: a `Hello` (client side) and a
//! `HelloReply` (server side), as frames and as bare bodies; and as a secret file's content (a
//! cluster secret or a read-only credential). Anything may be refused; nothing may panic, and
//! what decodes must survive a re-encode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{ClusterKey, Hello, HelloReply, frame};

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((hello, used))) = frame::decode_frame::<Hello>(data) {
        assert!(used <= data.len());
        let again = frame::encode(&hello).expect("a decoded hello re-encodes");
        assert!(
            matches!(frame::decode_frame::<Hello>(&again), Ok(Some((ref h, _))) if *h == hello)
        );
    }
    if let Ok(Some((reply, _))) = frame::decode_frame::<HelloReply>(data) {
        let again = frame::encode(&reply).expect("a decoded reply re-encodes");
        let back = frame::decode_frame::<HelloReply>(&again);
        assert!(matches!(back, Ok(Some((ref r, _))) if *r == reply));
    }
    let _ = frame::decode_body::<Hello>(data);
    let _ = frame::decode_body::<HelloReply>(data);
    let _ = ClusterKey::parse(data);
});
