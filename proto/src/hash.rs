//! [`ContentHash`]: the BLAKE3 hash of a tensor's bytes, computed once at publish and checked
//! by every receiver.

use std::fmt;

use serde::{Deserialize, Serialize};

/// BLAKE3 hash of a tensor's bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    /// Hashes `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        blake3::hash(bytes).into()
    }

    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl From<blake3::Hash> for ContentHash {
    fn from(h: blake3::Hash) -> Self {
        ContentHash(*h.as_bytes())
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}…", hex::encode(&self.0[..5]))
    }
}

/// Incremental hashing, for bytes that arrive in pieces.
#[derive(Debug, Clone, Default)]
pub struct ContentHasher(blake3::Hasher);

impl ContentHasher {
    /// A fresh hasher.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the next piece.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The hash of everything added so far.
    pub fn finalize(&self) -> ContentHash {
        self.0.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_equals_one_shot() {
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut h = ContentHasher::new();
        for piece in data.chunks(7919) {
            h.update(piece);
        }
        assert_eq!(h.finalize(), ContentHash::of(&data));
        assert_eq!(ContentHash::of(&data).to_hex().len(), 64);
    }
}
