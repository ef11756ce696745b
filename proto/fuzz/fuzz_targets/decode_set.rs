//! Arbitrary bytes as a version set's bytes (what a reader decodes after the set's hash
//! verified, but written by any publisher). Anything may be refused; nothing may panic; what
//! decodes must describe members that lie inside the bytes, aligned, in order, ending at the
//! end, with the sizes their dtypes and shapes need; and its manifest must lay out again.
//! (Not to the same offsets: postcard accepts over-long varints, so a publisher may write a
//! longer manifest than ours; readers take offsets from the bytes they got.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_proto::{SET_ALIGN, SetLayout, TensorName};

fuzz_target!(|data: &[u8]| {
    let prefix = TensorName::new("fuzz/set").expect("name");
    if let Ok(layout) = SetLayout::decode(&prefix, data) {
        assert_eq!(layout.len, data.len() as u64);
        assert_eq!(layout.header[..], data[..layout.header.len()]);
        let mut end = layout.header.len() as u64;
        for (member, range) in layout.members() {
            assert!(range.start >= end && range.start % SET_ALIGN == 0);
            let meta = member.meta().expect("a decoded member has valid metadata");
            assert_eq!(range.end - range.start, meta.byte_len);
            end = range.end;
        }
        assert_eq!(end, layout.len);
        let again = SetLayout::new(&prefix, layout.manifest.clone(), u64::MAX)
            .expect("a decoded manifest lays out again");
        assert_eq!(again.ranges.len(), layout.ranges.len());
    }
});
