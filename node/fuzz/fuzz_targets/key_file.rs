//! Arbitrary bytes as a node's `node.key` file: loading it must give a key or an error, never
//! a panic (a non-ASCII key file used to panic while slicing it).
#![no_main]

use std::{path::PathBuf, sync::OnceLock};

use libfuzzer_sys::fuzz_target;
use tb_link::{KEY_FILE, load_or_create_key};

/// One data dir per fuzzing process, its key file rewritten for each input.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tb-node-fuzz-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fuzz data dir");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = dir();
    std::fs::write(dir.join(KEY_FILE), data).expect("write the key file");
    if let Ok(key) = load_or_create_key(dir) {
        // A key that loads loads again the same (the file is not rewritten).
        let again = load_or_create_key(dir).expect("a key that loaded once loads again");
        assert_eq!(again.to_bytes(), key.to_bytes());
    }
});
