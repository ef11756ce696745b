//! [`Entry`]: everything the registry knows about one name, and how two replicas' views of it
//! join.
//!
//! An entry is three independent CRDTs side by side, each merged by taking a maximum:
//! - the head (`version`, `meta`, `publisher`, `stamp`): last writer wins on
//!   `(version, stamp, publisher)`, then on the metadata itself so that even two conflicting
//!   publishes under one stamp (a buggy or hostile node) resolve the same way everywhere;
//! - the holder marks: a last-writer-wins map keyed by `(node, version)`, a higher stamp wins
//!   and at equal stamps "present" wins (add-wins);
//! - the tombstone: the greatest delete stamp seen.

use std::{
    cmp::Ordering,
    collections::{BTreeMap, btree_map},
};

use serde::{Deserialize, Serialize};

use super::RegistryError;
use crate::{ContentHash, DType, NodeId, Stamp, TensorMeta, TensorName};

/// One node's claim about holding one version: LWW on `stamp`, add-wins on ties.
///
/// Field order matters: the derived `Ord` compares `stamp`, then `present` (`false < true`), and
/// merging keeps the greater mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct HolderMark {
    /// When the holder announced it gained or dropped the version.
    pub stamp: Stamp,
    /// Whether it holds the version.
    pub present: bool,
}

/// The replicated state of one name.
///
/// An entry may exist before any publish reached this replica (a holder mark or a delete
/// arrived first): then `version` is 0 and the head is [`Entry::placeholder`]'s. Such an entry
/// is not [published](Self::is_published) and [`Registry::entry`](super::Registry::entry) hides
/// it, but it is merged and synced like any other, so nothing it carries is lost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The newest version (0: no publish seen yet).
    pub version: u64,
    /// Metadata of the newest version.
    pub meta: TensorMeta,
    /// The node that published the newest version.
    pub publisher: NodeId,
    /// The stamp of that publish.
    pub stamp: Stamp,
    /// Who holds which version, keyed by `(node, version)`.
    pub holders: BTreeMap<(NodeId, u64), HolderMark>,
    /// The greatest delete stamp seen; the name is deleted while it exceeds `stamp`.
    pub deleted: Option<Stamp>,
}

/// Orders heads for last-writer-wins: `(version, stamp, publisher)`, then the metadata field by
/// field, so that the order is total and every replica picks the same winner.
fn head_order(a: &Entry, b: &Entry) -> Ordering {
    let key = |e: &Entry| {
        (
            e.version,
            e.stamp,
            e.publisher,
            e.meta.hash.0,
            e.meta.byte_len,
            // `DType` has no `Ord`; its canonical name is unique per dtype.
            e.meta.dtype.name(),
        )
    };
    key(a)
        .cmp(&key(b))
        .then_with(|| a.meta.shape.cmp(&b.meta.shape))
}

impl Entry {
    /// The entry of a name no publish has reached yet: version 0, an empty `u8[0]` tensor, the
    /// zero publisher and [`Stamp::ZERO`]. Every real publish beats it.
    pub fn placeholder() -> Self {
        Entry {
            version: 0,
            meta: TensorMeta {
                dtype: DType::U8,
                shape: vec![0],
                byte_len: 0,
                hash: ContentHash([0; 32]),
            },
            publisher: NodeId([0; 32]),
            stamp: Stamp::ZERO,
            holders: BTreeMap::new(),
            deleted: None,
        }
    }

    /// Whether a publish has reached this entry.
    pub fn is_published(&self) -> bool {
        self.version >= 1
    }

    /// Whether the newest delete is later than the newest publish.
    pub fn is_deleted(&self) -> bool {
        self.deleted.is_some_and(|d| d > self.stamp)
    }

    /// Published and not deleted: what readers see.
    pub fn is_live(&self) -> bool {
        self.is_published() && !self.is_deleted()
    }

    /// Nodes whose latest mark says they hold `version`, in node id order.
    pub fn holders_of(&self, version: u64) -> impl Iterator<Item = NodeId> + '_ {
        self.holders
            .iter()
            .filter(move |((_, v), mark)| *v == version && mark.present)
            .map(|((node, _), _)| *node)
    }

    /// Checks an entry that came from the network (a sync reply) before merging it.
    pub fn validate(&self, name: &TensorName, max_tensor_bytes: u64) -> Result<(), RegistryError> {
        super::check_meta(name, self.version, &self.meta, max_tensor_bytes)?;
        match self.holders.keys().find(|(_, v)| *v == 0) {
            Some(_) => Err(RegistryError::ZeroVersion { name: name.clone() }),
            None => Ok(()),
        }
    }

    /// Takes a publish if it beats the current head; true if it did.
    pub(crate) fn publish(
        &mut self,
        version: u64,
        meta: &TensorMeta,
        publisher: NodeId,
        stamp: Stamp,
    ) -> bool {
        let candidate = Entry {
            version,
            meta: meta.clone(),
            publisher,
            stamp,
            holders: BTreeMap::new(),
            deleted: None,
        };
        self.take_head(&candidate)
    }

    fn take_head(&mut self, other: &Entry) -> bool {
        if head_order(other, self) != Ordering::Greater {
            return false;
        }
        self.version = other.version;
        self.meta.clone_from(&other.meta);
        self.publisher = other.publisher;
        self.stamp = other.stamp;
        true
    }

    /// Records `mark` for `(node, version)` if it beats the mark there; true if it did.
    pub(crate) fn mark(&mut self, node: NodeId, version: u64, mark: HolderMark) -> bool {
        match self.holders.entry((node, version)) {
            btree_map::Entry::Vacant(slot) => {
                slot.insert(mark);
                true
            }
            btree_map::Entry::Occupied(mut slot) if mark > *slot.get() => {
                slot.insert(mark);
                true
            }
            btree_map::Entry::Occupied(_) => false,
        }
    }

    /// Records a delete at `stamp` if it is the latest; true if it was.
    pub(crate) fn delete(&mut self, stamp: Stamp) -> bool {
        if self.deleted.is_some_and(|d| d >= stamp) {
            return false;
        }
        self.deleted = Some(stamp);
        true
    }

    /// Joins `other` into `self` (the least upper bound of the two); true if `self` changed.
    pub fn merge(&mut self, other: &Entry) -> bool {
        let mut changed = self.take_head(other);
        for (&(node, version), &mark) in &other.holders {
            changed |= self.mark(node, version, mark);
        }
        if let Some(stamp) = other.deleted {
            changed |= self.delete(stamp);
        }
        changed
    }

    /// Drops holder marks for versions older than the newest `keep_versions` (at least 1, so
    /// the newest version's holders always stay); true if any were dropped.
    ///
    /// Depends only on `self.version`, which merging only raises, so a dropped mark could only
    /// ever come back below the cut-off, where the next prune drops it again.
    pub fn prune(&mut self, keep_versions: u64) -> bool {
        let oldest_kept = self
            .version
            .saturating_sub(keep_versions.max(1).saturating_sub(1));
        let before = self.holders.len();
        self.holders.retain(|&(_, v), _| v >= oldest_kept);
        self.holders.len() != before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(wall_ms: u64, node: u8) -> Stamp {
        Stamp {
            wall_ms,
            logical: 0,
            node: NodeId([node; 32]),
        }
    }

    fn published(meta: TensorMeta) -> Entry {
        let mut e = Entry::placeholder();
        assert!(e.publish(1, &meta, NodeId([1; 32]), at(1, 1)));
        e
    }

    #[test]
    fn head_ties_are_broken_by_every_meta_field() {
        let base = TensorMeta::new(DType::U8, vec![2, 2], ContentHash([1; 32])).expect("meta");
        let shape = TensorMeta::new(DType::U8, vec![4, 1], ContentHash([1; 32])).expect("meta");
        let dtype = TensorMeta::new(DType::I8, vec![2, 2], ContentHash([1; 32])).expect("meta");
        for other in [shape, dtype] {
            let (a, b) = (published(base.clone()), published(other));
            let (mut ab, mut ba) = (a.clone(), b.clone());
            ab.merge(&b);
            ba.merge(&a);
            assert_eq!(ab, ba);
            assert_ne!(head_order(&a, &b), Ordering::Equal);
        }
    }

    #[test]
    fn equal_stamp_marks_add_wins_and_later_stamps_win() {
        let n = NodeId([2; 32]);
        let mut e = Entry::placeholder();
        assert!(e.mark(
            n,
            1,
            HolderMark {
                stamp: at(5, 2),
                present: false
            }
        ));
        assert!(e.mark(
            n,
            1,
            HolderMark {
                stamp: at(5, 2),
                present: true
            }
        ));
        assert!(!e.mark(
            n,
            1,
            HolderMark {
                stamp: at(5, 2),
                present: false
            }
        ));
        assert!(e.mark(
            n,
            1,
            HolderMark {
                stamp: at(6, 2),
                present: false
            }
        ));
        assert_eq!(e.holders_of(1).count(), 0);
    }

    #[test]
    fn placeholder_is_unpublished_and_loses_to_any_publish() {
        let p = Entry::placeholder();
        assert!(!p.is_published() && !p.is_deleted() && !p.is_live());
        assert!(p.meta.validate(0).is_ok());
        let mut e = p.clone();
        assert!(e.publish(1, &p.meta, NodeId([0; 32]), Stamp::ZERO));
        assert!(e.is_live());
    }

    #[test]
    fn zero_version_holder_marks_are_refused_from_the_network() {
        let mut e = Entry::placeholder();
        e.mark(
            NodeId([1; 32]),
            0,
            HolderMark {
                stamp: at(1, 1),
                present: true,
            },
        );
        let name = TensorName::new("m/w").expect("name");
        assert_eq!(
            e.validate(&name, 0),
            Err(RegistryError::ZeroVersion { name })
        );
    }
}
