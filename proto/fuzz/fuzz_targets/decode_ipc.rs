//! Arbitrary bytes as a CUDA IPC request and answer (inside `DataRequest::CudaIpc` and
//! `DataResponse::CudaIpc`): as frames and as bare bodies, then `validate` on whatever
//! decodes. Anything may be refused; nothing may panic, and what decodes re-encodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{
    frame,
    ipc::{IpcRequest, IpcResponse},
};

/// The design's default maximum tensor size.
const MAX_TENSOR: u64 = 64 << 30;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((req, used))) = frame::decode_frame::<IpcRequest>(data) {
        assert!(used <= data.len());
        let _ = req.validate();
    }
    if let Ok(req) = frame::decode_body::<IpcRequest>(data) {
        let _ = req.validate();
        let again = frame::encode(&req).expect("a decoded request re-encodes");
        assert!(
            matches!(frame::decode_frame::<IpcRequest>(&again), Ok(Some((ref r, _))) if *r == req)
        );
    }
    if let Ok(answer) = frame::decode_body::<IpcResponse>(data) {
        let _ = answer.validate(MAX_TENSOR);
        let again = frame::encode(&answer).expect("a decoded answer re-encodes");
        assert!(
            matches!(frame::decode_frame::<IpcResponse>(&again), Ok(Some((ref a, _))) if *a == answer)
        );
    }
});
