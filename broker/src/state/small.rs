//! [`SmallVersions`]: the bytes of the newest version of names published small through this
//! broker, so that a `Lookup` of the newest version can answer with them
//! (`CtlResponse::HoldersInline`) and a get by name costs one round trip, not a look-up and a
//! pull. Only versions whose bytes came with their publish (`CtlRequest::Publish`, at most
//! `MAX_INLINE_BYTES`) are kept; gossip carries no bytes, so another broker answers the usual
//! way. Nothing is persisted. Bounded: at most [`MAX_BYTES`] in all, the oldest kept first to
//! go.

use std::collections::{HashMap, VecDeque};

use tb_proto::{ContentHash, TensorName};

/// Most bytes kept, all names together (4096 versions of the largest inline size).
pub const MAX_BYTES: usize = 64 << 20;

#[derive(Debug)]
struct Small {
    version: u64,
    hash: ContentHash,
    bytes: Vec<u8>,
}

/// The newest small version's bytes per name, bounded in bytes.
#[derive(Debug, Default)]
pub struct SmallVersions {
    by_name: HashMap<TensorName, Small>,
    /// Names in the order their kept version came, oldest first (with the version, so that
    /// an entry replaced since is skipped when its turn comes).
    order: VecDeque<(TensorName, u64)>,
    bytes: usize,
}

impl SmallVersions {
    /// Keeps `bytes` (hashing to `hash`) as `version` of `name`, replacing an older one;
    /// the oldest kept go while over [`MAX_BYTES`].
    pub fn keep(&mut self, name: &TensorName, version: u64, hash: ContentHash, bytes: Vec<u8>) {
        if self.by_name.get(name).is_some_and(|s| s.version >= version) {
            return;
        }
        self.bytes += bytes.len();
        let old = self.by_name.insert(
            name.clone(),
            Small {
                version,
                hash,
                bytes,
            },
        );
        if let Some(old) = old {
            self.bytes -= old.bytes.len();
        }
        self.order.push_back((name.clone(), version));
        // Bounded: each turn pops one entry of `order`.
        while self.bytes > MAX_BYTES {
            let Some((oldest, v)) = self.order.pop_front() else {
                break;
            };
            if self.by_name.get(&oldest).is_some_and(|s| s.version == v)
                && let Some(gone) = self.by_name.remove(&oldest)
            {
                self.bytes -= gone.bytes.len();
            }
        }
        // Stale turns (names kept again since) would pile up under steady publishing.
        if self.order.len() > 2 * self.by_name.len() + 64 {
            let by_name = &self.by_name;
            self.order
                .retain(|(n, v)| by_name.get(n).is_some_and(|s| s.version == *v));
        }
    }

    /// The kept bytes of `name`, when they are `version`'s and hash to `hash`.
    pub fn get(&self, name: &TensorName, version: u64, hash: &ContentHash) -> Option<&[u8]> {
        self.by_name
            .get(name)
            .filter(|s| s.version == version && s.hash == *hash)
            .map(|s| s.bytes.as_slice())
    }

    /// Bytes kept now.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    #[test]
    fn the_newest_version_is_kept_and_answered_only_for_its_version_and_hash() {
        let mut small = SmallVersions::default();
        let w = name("w");
        let (one, two) = (vec![1u8; 10], vec![2u8; 20]);
        small.keep(&w, 1, ContentHash::of(&one), one.clone());
        small.keep(&w, 2, ContentHash::of(&two), two.clone());
        // An older version arriving late changes nothing.
        small.keep(&w, 1, ContentHash::of(&one), one.clone());
        assert_eq!(small.get(&w, 2, &ContentHash::of(&two)), Some(&two[..]));
        assert_eq!(small.get(&w, 1, &ContentHash::of(&one)), None);
        assert_eq!(
            small.get(&w, 2, &ContentHash::of(&one)),
            None,
            "other bytes"
        );
        assert_eq!(small.bytes(), 20);
    }

    #[test]
    fn bytes_stay_within_the_bound_the_oldest_going_first() {
        let mut small = SmallVersions::default();
        let size = 16 << 10;
        let count = MAX_BYTES / size + 10;
        let bytes = vec![7u8; size];
        let hash = ContentHash::of(&bytes);
        for i in 0..count {
            small.keep(&name(&format!("n/{i}")), 1, hash, bytes.clone());
            assert!(small.bytes() <= MAX_BYTES);
        }
        assert_eq!(small.get(&name("n/0"), 1, &hash), None, "the oldest went");
        let last = name(&format!("n/{}", count - 1));
        assert!(small.get(&last, 1, &hash).is_some());
        // Republishing one name many times keeps one entry and a short line.
        for v in 2..10_000 {
            small.keep(&last, v, hash, bytes.clone());
        }
        assert!(small.order.len() <= 2 * small.by_name.len() + 64);
        assert!(small.get(&last, 9_999, &hash).is_some());
    }
}
