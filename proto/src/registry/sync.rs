//! Bucketed anti-entropy: the pure half of the two-step `tb/ctl/1` sync between brokers.
//!
//! Names fall into [`SYNC_BUCKETS`] buckets by [`bucket_of`]. One exchange, asker A and
//! responder B:
//! 1. A sends its [`Registry::bucket_digests`] and [`Registry::member_digest`]
//!    (`CtlRequest::SyncBuckets`); B answers with its [`Registry::members_to_send`] and its
//!    [`Registry::differing_buckets`] (`CtlResponse::SyncDiff`).
//! 2. A sends its [`Registry::names_in_buckets`] for those buckets (`CtlRequest::SyncNames`);
//!    B answers with its [`Registry::entries_to_send`] (`CtlResponse::SyncEntries`).
//!
//! A validates and merges what it got, and then holds everything B held. Running the exchange
//! the other way too makes the two replicas equal. Lists that can outgrow one control frame go
//! out in pieces cut by [`chunk_by_size`].

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Entry, Member, Registry, digest_of, encoded_len};
use crate::{NodeId, TensorName};

/// Number of name buckets anti-entropy compares in its first step.
pub const SYNC_BUCKETS: usize = 256;

/// The anti-entropy bucket of `name`: the first byte of BLAKE3 of its bytes.
pub fn bucket_of(name: &TensorName) -> u8 {
    blake3::hash(name.as_str().as_bytes()).as_bytes()[0]
}

/// One flag per bucket, set for the buckets listed.
fn bucket_mask(buckets: &[u8]) -> [bool; SYNC_BUCKETS] {
    let mut mask = [false; SYNC_BUCKETS];
    for &b in buckets {
        mask[usize::from(b)] = true;
    }
    mask
}

impl Registry {
    /// One digest per bucket ([`SYNC_BUCKETS`] of them, in bucket order): BLAKE3 over the
    /// bucket's `(name, entry digest)` pairs in name order, all zeros for an empty bucket. Two
    /// replicas with equal digests for a bucket hold equal entries for its names.
    pub fn bucket_digests(&self) -> Vec<[u8; 32]> {
        let mut hashers: [Option<blake3::Hasher>; SYNC_BUCKETS] = [const { None }; SYNC_BUCKETS];
        // `entries` iterates in name order, so every bucket sees its pairs sorted.
        for (name, entry) in &self.entries {
            let h = hashers[usize::from(bucket_of(name))].get_or_insert_with(blake3::Hasher::new);
            // Writing into a hasher cannot fail; a failure would only make this digest differ
            // from a healthy replica's, which costs one extra sync round.
            let _ = postcard::to_io(&(name, digest_of(entry)), h);
        }
        hashers
            .iter()
            .map(|h| h.as_ref().map_or([0; 32], |h| *h.finalize().as_bytes()))
            .collect()
    }

    /// The buckets whose digest in `theirs` (another replica's [`bucket_digests`]) differs
    /// from this replica's, in increasing order; a digest missing from `theirs` differs.
    ///
    /// [`bucket_digests`]: Self::bucket_digests
    pub fn differing_buckets(&self, theirs: &[[u8; 32]]) -> Vec<u8> {
        (0..=u8::MAX)
            .zip(self.bucket_digests())
            .filter(|(i, mine)| theirs.get(usize::from(*i)) != Some(mine))
            .map(|(i, _)| i)
            .collect()
    }

    /// This replica's per-name digests (see [`digest`](Self::digest)) for the names in
    /// `buckets`.
    pub fn names_in_buckets(&self, buckets: &[u8]) -> BTreeMap<TensorName, [u8; 32]> {
        let mask = bucket_mask(buckets);
        self.entries
            .iter()
            .filter(|(name, _)| mask[usize::from(bucket_of(name))])
            .map(|(name, e)| (name.clone(), digest_of(e)))
            .collect()
    }

    /// This replica's entries (tombstones and placeholders included) in `buckets` that
    /// `theirs` (the other replica's [`names_in_buckets`]) lacks or holds with another digest,
    /// in name order.
    ///
    /// [`names_in_buckets`]: Self::names_in_buckets
    pub fn entries_to_send(
        &self,
        theirs: &BTreeMap<TensorName, [u8; 32]>,
        buckets: &[u8],
    ) -> Vec<(TensorName, Entry)> {
        let mask = bucket_mask(buckets);
        self.entries
            .iter()
            .filter(|(name, _)| mask[usize::from(bucket_of(name))])
            .filter(|(name, e)| theirs.get(*name) != Some(&digest_of(*e)))
            .map(|(name, e)| (name.clone(), e.clone()))
            .collect()
    }

    /// This replica's membership rows that `theirs` (the other replica's
    /// [`member_digest`](Self::member_digest)) lacks or holds with another digest, in node id
    /// order.
    pub fn members_to_send(&self, theirs: &BTreeMap<NodeId, [u8; 32]>) -> Vec<Member> {
        self.members
            .iter()
            .filter(|(node, m)| theirs.get(*node) != Some(&digest_of(*m)))
            .map(|(_, m)| m.clone())
            .collect()
    }
}

/// Splits `items`, in order, into chunks whose postcard encoding as a sequence (its length
/// prefix included) is at most `max_bytes`, so that each fits one control frame once the
/// message around it is added (leave room for that: see `ctl::MAX_CHUNK_BYTES`).
///
/// An item that alone is over `max_bytes` goes into a chunk of its own, which is then over the
/// budget: the caller decides whether to skip it or fail. Always returns at least one chunk
/// (empty for empty input), so a sender that marks its last frame always has one to mark.
pub fn chunk_by_size<T: Serialize>(items: Vec<T>, max_bytes: usize) -> Vec<Vec<T>> {
    let mut chunks = Vec::new();
    let mut chunk = Vec::new();
    let mut used = 0usize;
    for item in items {
        let size = encoded_len(&item);
        let grown = seq_len(chunk.len() + 1, used.saturating_add(size));
        if !chunk.is_empty() && grown > max_bytes {
            chunks.push(std::mem::take(&mut chunk));
            used = 0;
        }
        used = used.saturating_add(size);
        chunk.push(item);
    }
    if !chunk.is_empty() || chunks.is_empty() {
        chunks.push(chunk);
    }
    chunks
}

/// Encoded length of a sequence of `count` items taking `items_bytes`: postcard writes the
/// count as a LEB128 varint first.
fn seq_len(count: usize, items_bytes: usize) -> usize {
    let varint = (usize::BITS - count.leading_zeros()).div_ceil(7).max(1) as usize;
    items_bytes.saturating_add(varint)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ContentHash, DType, RegistryOp, Stamp, TensorMeta};

    fn publish(n: usize) -> RegistryOp {
        RegistryOp::Publish {
            name: TensorName::new(format!("m/{n}")).expect("name"),
            version: 1,
            meta: TensorMeta::new(DType::U8, vec![1], ContentHash([n as u8; 32])).expect("meta"),
            publisher: NodeId([1; 32]),
            stamp: Stamp {
                wall_ms: n as u64,
                logical: 0,
                node: NodeId([1; 32]),
            },
        }
    }

    #[test]
    fn chunks_fit_their_budget_and_keep_order() {
        let items: Vec<Vec<u8>> = (0..200).map(|n| vec![0u8; n % 37]).collect();
        for budget in [1, 40, 64, 127, 128, 129, 1000, 100_000] {
            let chunks = chunk_by_size(items.clone(), budget);
            assert_eq!(chunks.concat(), items, "budget {budget}");
            for c in &chunks {
                assert!(
                    encoded_len(c) <= budget || c.len() == 1,
                    "budget {budget}: {}",
                    encoded_len(c)
                );
                assert!(!c.is_empty());
            }
            // A chunk is only cut when the next item would not fit.
            for pair in chunks.windows(2) {
                let mut grown = pair[0].clone();
                grown.push(pair[1][0].clone());
                assert!(encoded_len(&grown) > budget, "budget {budget}");
            }
        }
    }

    #[test]
    fn varint_prefixes_are_counted() {
        // 128 one-byte items need a 2-byte count: 130 bytes.
        let items = vec![0u8; 128];
        assert_eq!(encoded_len(&items), 130);
        assert_eq!(chunk_by_size(items.clone(), 130).len(), 1);
        assert_eq!(chunk_by_size(items, 129).len(), 2);
    }

    #[test]
    fn oversized_items_go_alone_and_empty_input_gives_one_empty_chunk() {
        let chunks = chunk_by_size(vec![vec![1u8; 2], vec![2; 50], vec![3; 2]], 10);
        assert_eq!(chunks.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1]);
        assert_eq!(chunk_by_size(Vec::<u8>::new(), 10), vec![Vec::<u8>::new()]);
        assert_eq!(chunk_by_size(Vec::<u8>::new(), 0).len(), 1);
    }

    #[test]
    fn bucket_digests_name_the_buckets_that_differ() {
        let mut a = Registry::new();
        for n in 0..1000 {
            a.apply(&publish(n));
        }
        let digests = a.bucket_digests();
        assert_eq!(digests.len(), SYNC_BUCKETS);
        assert_eq!(
            Registry::new().bucket_digests(),
            vec![[0; 32]; SYNC_BUCKETS]
        );
        assert!(a.differing_buckets(&digests).is_empty());
        assert_eq!(a.differing_buckets(&[]).len(), SYNC_BUCKETS);

        let mut b = a.clone();
        b.apply(&publish(1000));
        let changed = bucket_of(&TensorName::new("m/1000").expect("name"));
        assert_eq!(a.differing_buckets(&b.bucket_digests()), vec![changed]);
        let theirs = a.names_in_buckets(&[changed]);
        assert!(theirs.keys().all(|n| bucket_of(n) == changed));
        assert_eq!(theirs.len() + 1, b.names_in_buckets(&[changed]).len());
        let sent = b.entries_to_send(&theirs, &[changed]);
        assert_eq!(
            sent.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            ["m/1000"]
        );
        assert!(b.entries_to_send(&theirs, &[]).is_empty());
        for (n, e) in &sent {
            a.merge_entry(n, e);
        }
        assert_eq!(a, b);
    }

    #[test]
    fn buckets_spread_names() {
        let mut seen = [false; SYNC_BUCKETS];
        for n in 0..4000 {
            seen[usize::from(bucket_of(&TensorName::new(format!("m/{n}")).expect("name")))] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
