//! Arbitrary bytes as a `tb/data/1` response: as a frame (prefix + body) and as a bare body,
//! then the header's metadata is validated. Anything may be refused; nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{DataResponse, frame};

/// The design's default maximum tensor size.
const MAX_TENSOR: u64 = 64 << 30;

fn check(resp: &DataResponse) {
    if let DataResponse::Header { meta, .. } = resp {
        let _ = meta.validate(MAX_TENSOR);
        let _ = meta.numel();
    }
    if resp.validate().is_ok()
        && let DataResponse::Outline {
            piece_len, values, ..
        } = resp
    {
        // An outline that passed is checked against every size a puller might hold.
        for len in [0, 1, *piece_len, piece_len.saturating_mul(values.len() as u64)] {
            let _ = tb_proto::piece::check_outline(len, *piece_len, values.len());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((resp, used))) = frame::decode_frame::<DataResponse>(data) {
        assert!(used <= data.len());
        check(&resp);
    }
    if let Ok(resp) = frame::decode_body::<DataResponse>(data) {
        check(&resp);
        let again = frame::encode(&resp).expect("a decoded response re-encodes");
        let back = frame::decode_frame::<DataResponse>(&again);
        assert!(matches!(back, Ok(Some((ref r, _))) if *r == resp));
    }
});
