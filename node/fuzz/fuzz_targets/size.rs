//! Arbitrary bytes as the sizes, rates and devices of command-line flags and config
//! (`--max-upload-rate 200MB/s`, `--chain-min-size 8MiB`, `--device cuda:1`). What is accepted
//! must be in range and format without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_node::{
    Device,
    rate::{MAX_RATE, format_rate, parse_rate, parse_size},
};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(rate) = parse_rate(s) {
        assert!(rate <= MAX_RATE);
        let _ = format_rate(rate);
    }
    if let Ok(size) = parse_size(s) {
        assert!(size <= MAX_RATE);
    }
    if let Ok(device) = s.parse::<Device>() {
        assert_eq!(device.to_string().parse::<Device>(), Ok(device));
    }
});
