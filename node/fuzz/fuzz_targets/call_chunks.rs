//! Arbitrary bytes as the peer's direction of a same-host request connection (a remote call's
//! arguments or results after the request frame): `[u32 LE length]` chunks up to 4 MiB, a
//! length of 0 ending the direction, `u32::MAX` aborting it. The reader is fed the bytes in
//! pieces and read in slices of sizes the input picks. Nothing may panic; how the bytes
//! arrive and are read changes nothing that is read; and what was read, framed again as the
//! writer frames it, reads back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_node::fuzzing::{frame_chunks, read_chunks};

fuzz_target!(|data: &[u8]| {
    let Some((&[piece, take], input)) = data.split_first_chunk::<2>() else {
        return;
    };
    let whole = read_chunks(input, usize::MAX, usize::MAX);
    assert!(whole.consumed <= input.len());
    assert!(whole.payload.len() <= whole.consumed);
    // Pieces of 1 to 256 bytes, read 1 to 256 at a time: the same outcome.
    let sliced = read_chunks(input, piece as usize + 1, take as usize + 1);
    assert_eq!(sliced, whole);
    if whole.end {
        let again = frame_chunks(&[&whole.payload]);
        let back = read_chunks(&again, usize::MAX, usize::MAX);
        assert!(back.end && back.gone.is_none());
        assert_eq!(back.payload, whole.payload);
        assert_eq!(back.consumed, again.len());
    }
});
