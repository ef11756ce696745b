//! [`Registry`]: the replicated state of the cluster, a state-based CRDT with op-based helpers.
//!
//! It holds one [`Entry`] per name (newest version, metadata, publisher, stamp, holder marks,
//! tombstone) and one [`Member`] per node. Every part merges by taking a maximum under a total
//! order, so [`Registry::merge`] is commutative, associative and idempotent, and
//! [`Registry::apply`] of an op equals merging the one-op state that op describes: replicas that
//! have seen the same ops, in any order, any number of times, hold equal registries.
//!
//! Data flow: a writer stamps an op with its [`Hlc`](crate::Hlc), applies it locally, checks
//! [`RegistryOp::encoded_len`] against [`MAX_GOSSIP_OP_BYTES`] and broadcasts it. A receiver
//! [`validate`](RegistryOp::validate)s it, [`observe`](crate::Hlc::observe)s its
//! [`stamp`](RegistryOp::stamp) (dropping ops stamped too far in the future) and
//! [`apply`](Registry::apply)s it. Anti-entropy compares digests bucket by bucket
//! ([`Registry::bucket_digests`], then [`Registry::names_in_buckets`]) and ships
//! [`Registry::entries_to_send`] for the names that differ, which the receiver
//! [`validate`](Entry::validate)s and [`merge_entry`](Registry::merge_entry)s; see the `sync`
//! module's doc for the exchange.
//!
//! An op can arrive before the publish it refers to (a holder mark, a delete): it lands in a
//! placeholder entry (version 0) that readers do not see and that the publish later fills, so
//! the op is never lost and the result does not depend on arrival order.
//!
//! Holder marks of old versions are dropped by [`Registry::prune`], which every replica must run
//! with the same `keep_versions` after each apply or merge; see there for why that converges.
//! Rows of nodes that are gone, and the marks of nodes without a row, are dropped by
//! [`Registry::forget`] once they are older than an [`Expiry`]; see there for why that
//! converges and why nothing dropped comes back.

mod entry;
mod member;
mod sync;

use std::collections::{BTreeMap, btree_map};

use serde::{Deserialize, Serialize};

pub(crate) use self::member::check_addrs;
pub use self::{
    entry::{Entry, HolderMark},
    member::{Expiry, MAX_ADDR_LEN, MAX_MEMBER_ADDRS, Member, Role},
    sync::{SYNC_BUCKETS, bucket_of, chunk_by_size},
};
use crate::{MetaError, NodeId, Stamp, TensorMeta, TensorName};

/// Largest encoded [`RegistryOp`] a node broadcasts: iroh-gossip silently drops messages over
/// about 4057 bytes, and this leaves room for an envelope around the op.
pub const MAX_GOSSIP_OP_BYTES: usize = 4000;

/// What is wrong with a registry op or entry that came from the network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// The metadata is invalid or over the size limit.
    #[error("tensor \"{name}\" v{version}: {source}")]
    Meta {
        /// The tensor.
        name: TensorName,
        /// The version it was published as.
        version: u64,
        /// What is wrong with it.
        source: MetaError,
    },
    /// A publish or holder mark for version 0 (versions start at 1).
    #[error("tensor \"{name}\": version 0 is reserved, versions start at 1")]
    ZeroVersion {
        /// The tensor.
        name: TensorName,
    },
    /// A member advertises more than [`MAX_MEMBER_ADDRS`] addresses.
    #[error("member {node:?} advertises {count} addresses, over the limit of {MAX_MEMBER_ADDRS}")]
    TooManyAddrs {
        /// The member.
        node: NodeId,
        /// How many it advertises.
        count: usize,
    },
    /// A member address is over [`MAX_ADDR_LEN`] bytes.
    #[error("member {node:?} advertises a {len}-byte address, over the limit of {MAX_ADDR_LEN}")]
    AddrTooLong {
        /// The member.
        node: NodeId,
        /// The address's length in bytes.
        len: usize,
    },
}

/// One change to the registry, as gossip carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegistryOp {
    /// `publisher` made `version` of `name`, described by `meta`.
    Publish {
        /// The tensor.
        name: TensorName,
        /// Its new version (at least 1).
        version: u64,
        /// What the version's bytes are.
        meta: TensorMeta,
        /// Who published it.
        publisher: NodeId,
        /// When.
        stamp: Stamp,
    },
    /// `node` now holds `version` of `name`.
    AddHolder {
        /// The tensor.
        name: TensorName,
        /// The version held.
        version: u64,
        /// The holder.
        node: NodeId,
        /// When.
        stamp: Stamp,
    },
    /// `node` no longer holds `version` of `name`.
    RemoveHolder {
        /// The tensor.
        name: TensorName,
        /// The version dropped.
        version: u64,
        /// The former holder.
        node: NodeId,
        /// When.
        stamp: Stamp,
    },
    /// `name` is deleted, until a publish with a later stamp.
    Delete {
        /// The tensor.
        name: TensorName,
        /// When.
        stamp: Stamp,
    },
    /// A membership row.
    Member(Member),
}

impl RegistryOp {
    /// What the op does that needs read-write access, named for the refusal: a publish, a
    /// delete, a membership row. Holder marks (a node saying what it holds) need read-only
    /// access only: readers verify every byte against the registered hash.
    pub fn write_action(&self) -> Option<&'static str> {
        match self {
            RegistryOp::Publish { .. } => Some("publishing"),
            RegistryOp::Delete { .. } => Some("deleting"),
            RegistryOp::Member(_) => Some("writing membership"),
            RegistryOp::AddHolder { .. } | RegistryOp::RemoveHolder { .. } => None,
        }
    }

    /// Checks an op that came from the network before applying it: metadata (against
    /// `max_tensor_bytes`), versions at least 1, member address limits. Names are checked when
    /// they are decoded.
    pub fn validate(&self, max_tensor_bytes: u64) -> Result<(), RegistryError> {
        match self {
            RegistryOp::Publish {
                name,
                version,
                meta,
                ..
            } => {
                check_version(name, *version)?;
                check_meta(name, *version, meta, max_tensor_bytes)
            }
            RegistryOp::AddHolder { name, version, .. }
            | RegistryOp::RemoveHolder { name, version, .. } => check_version(name, *version),
            RegistryOp::Delete { .. } => Ok(()),
            RegistryOp::Member(member) => member.validate(),
        }
    }

    /// `AddHolder` (`present`) or `RemoveHolder`: `node` gained or dropped `version` of `name`.
    pub fn holder(
        name: TensorName,
        version: u64,
        node: NodeId,
        stamp: Stamp,
        present: bool,
    ) -> Self {
        match present {
            true => RegistryOp::AddHolder {
                name,
                version,
                node,
                stamp,
            },
            false => RegistryOp::RemoveHolder {
                name,
                version,
                node,
                stamp,
            },
        }
    }

    /// Bytes of the op's postcard encoding; compare with [`MAX_GOSSIP_OP_BYTES`] before
    /// broadcasting.
    pub fn encoded_len(&self) -> usize {
        encoded_len(self)
    }

    /// The stamp the op carries, for [`Hlc::observe`](crate::Hlc::observe).
    pub fn stamp(&self) -> &Stamp {
        match self {
            RegistryOp::Publish { stamp, .. }
            | RegistryOp::AddHolder { stamp, .. }
            | RegistryOp::RemoveHolder { stamp, .. }
            | RegistryOp::Delete { stamp, .. } => stamp,
            RegistryOp::Member(member) => &member.stamp,
        }
    }
}

/// Refuses version 0, which is reserved (versions start at 1).
pub(crate) fn check_version(name: &TensorName, version: u64) -> Result<(), RegistryError> {
    match version {
        0 => Err(RegistryError::ZeroVersion { name: name.clone() }),
        _ => Ok(()),
    }
}

/// Checks `meta` of `version` of `name` against `max_tensor_bytes`.
pub(crate) fn check_meta(
    name: &TensorName,
    version: u64,
    meta: &TensorMeta,
    max_tensor_bytes: u64,
) -> Result<(), RegistryError> {
    meta.validate(max_tensor_bytes)
        .map_err(|source| RegistryError::Meta {
            name: name.clone(),
            version,
            source,
        })
}

/// Bytes of a value's postcard encoding.
pub(crate) fn encoded_len<T: Serialize + ?Sized>(value: &T) -> usize {
    // Measuring cannot fail for plain data; if it ever did, "too large" is the safe answer.
    postcard::serialize_with_flavor(value, postcard::ser_flavors::Size::default())
        .unwrap_or(usize::MAX)
}

/// BLAKE3 of a value's postcard encoding.
fn digest_of<T: Serialize>(value: &T) -> [u8; 32] {
    // Writing plain data into a hasher cannot fail; a failure would only make digests differ
    // from a healthy replica's, which costs one extra sync round.
    postcard::to_io(value, blake3::Hasher::new())
        .map(|h| *h.finalize().as_bytes())
        .unwrap_or_default()
}

/// The replicated registry: one [`Entry`] per name, one [`Member`] per node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    entries: BTreeMap<TensorName, Entry>,
    members: BTreeMap<NodeId, Member>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one op; true if the state changed. Equivalent to merging the state that holds
    /// only this op, so ops commute and repeats are harmless. Validate network ops first.
    pub fn apply(&mut self, op: &RegistryOp) -> bool {
        match op {
            RegistryOp::Publish {
                name,
                version,
                meta,
                publisher,
                stamp,
            } => {
                let (entry, new) = self.slot(name);
                entry.publish(*version, meta, *publisher, *stamp) | new
            }
            RegistryOp::AddHolder {
                name,
                version,
                node,
                stamp,
            } => {
                let (entry, new) = self.slot(name);
                entry.mark(*node, *version, mark(*stamp, true)) | new
            }
            RegistryOp::RemoveHolder {
                name,
                version,
                node,
                stamp,
            } => {
                let (entry, new) = self.slot(name);
                entry.mark(*node, *version, mark(*stamp, false)) | new
            }
            RegistryOp::Delete { name, stamp } => {
                let (entry, new) = self.slot(name);
                entry.delete(*stamp) | new
            }
            RegistryOp::Member(member) => self.merge_member(member),
        }
    }

    /// The entry for `name`, created as a placeholder if missing (then the flag is true): an op
    /// that arrives before its publish lands there, and the publish later fills it in.
    fn slot(&mut self, name: &TensorName) -> (&mut Entry, bool) {
        match self.entries.entry(name.clone()) {
            btree_map::Entry::Vacant(slot) => (slot.insert(Entry::placeholder()), true),
            btree_map::Entry::Occupied(slot) => (slot.into_mut(), false),
        }
    }

    /// Joins `other` into `self`; true if `self` changed.
    pub fn merge(&mut self, other: &Registry) -> bool {
        let mut changed = false;
        for (name, entry) in &other.entries {
            changed |= self.merge_entry(name, entry);
        }
        for member in other.members.values() {
            changed |= self.merge_member(member);
        }
        changed
    }

    /// Joins one entry (from a sync reply: [`Entry::validate`] it first); true if it changed
    /// anything.
    pub fn merge_entry(&mut self, name: &TensorName, entry: &Entry) -> bool {
        match self.entries.get_mut(name) {
            Some(mine) => mine.merge(entry),
            None => {
                self.entries.insert(name.clone(), entry.clone());
                true
            }
        }
    }

    /// Joins one membership row; true if it replaced what was known.
    pub fn merge_member(&mut self, member: &Member) -> bool {
        match self.members.get_mut(&member.node) {
            Some(mine) if member.supersedes(mine) => mine.clone_from(member),
            Some(_) => return false,
            None => {
                self.members.insert(member.node, member.clone());
            }
        }
        true
    }

    /// Drops holder marks for versions older than each name's newest `keep_versions` (0 counts
    /// as 1); true if any were dropped.
    ///
    /// Pruning is not a CRDT operation, but it converges: it depends only on each entry's
    /// newest version, which merging never lowers, so for any states `a` and `b`
    /// `prune(merge(prune(a), prune(b))) == prune(merge(a, b))`. A merge can bring a pruned
    /// mark back (from a replica that has not pruned yet), but only below the cut-off, where
    /// the next prune drops it again. Replicas that prune with the same `keep_versions` after
    /// every apply and merge therefore end equal, and so do their digests. Tombstones and
    /// placeholders are never pruned: forgetting them would let a stale op resurrect a name.
    pub fn prune(&mut self, keep_versions: u64) -> bool {
        self.entries
            .values_mut()
            .fold(false, |changed, e| e.prune(keep_versions) | changed)
    }

    /// [`prune`](Self::prune) for one entry: enough after an op or a merge that touched only
    /// `name`, when every other entry was pruned already (a whole-registry prune per op costs
    /// time in proportion to the number of names). True if it dropped a mark.
    pub fn prune_name(&mut self, name: &TensorName, keep_versions: u64) -> bool {
        self.entries
            .get_mut(name)
            .is_some_and(|e| e.prune(keep_versions))
    }

    /// Drops what nodes that are gone left behind, as of `now_ms` by the local clock: every
    /// membership row [`Member::expired`] says is past keeping, then every holder mark of a
    /// node without a row that is older than [`Expiry::dead_after_ms`]. Returns the nodes
    /// whose rows went and the names whose entries lost marks.
    ///
    /// Like [`prune`](Self::prune), forgetting is not a CRDT operation but converges, and
    /// nothing it drops comes back:
    /// - whether a row or mark goes depends only on itself, the membership table and the
    ///   clock, which only moves forward: once past keeping, always past keeping;
    /// - a row merged in ([`forget_member`](Self::forget_member) after the merge) or loaded
    ///   from disk that is past keeping goes at once, after replacing the row it supersedes,
    ///   so a peer that has not forgotten yet cannot bring it back, and an older alive row of
    ///   the same life is not left in its place;
    /// - a mark merged in is checked the same way ([`forget_marks`](Self::forget_marks)).
    ///
    /// Replicas whose clocks differ drop a row at different moments; in between, the one that
    /// dropped it refuses it again at every merge. What this cannot undo: a replica cut off
    /// from the others for longer than a row's age (a partition) may keep an older alive row
    /// of a node whose death or leave it never heard, and bring it back when the partition
    /// heals, as a row that never expires. Restarting that broker judges it again.
    pub fn forget(&mut self, now_ms: u64, expiry: &Expiry) -> Forgotten {
        let members: Vec<NodeId> = self
            .members
            .values()
            .filter(|m| m.expired(now_ms, expiry))
            .map(|m| m.node)
            .collect();
        for node in &members {
            self.members.remove(node);
        }
        let names = self
            .entries
            .iter_mut()
            .filter_map(|(name, e)| {
                forget_marks_of(e, &self.members, now_ms, expiry).then(|| name.clone())
            })
            .collect();
        Forgotten { members, names }
    }

    /// [`forget`](Self::forget) for `node`'s row alone (after merging or applying it): true if
    /// the row was past keeping and went.
    pub fn forget_member(&mut self, node: &NodeId, now_ms: u64, expiry: &Expiry) -> bool {
        let expired = self
            .members
            .get(node)
            .is_some_and(|m| m.expired(now_ms, expiry));
        if expired {
            self.members.remove(node);
        }
        expired
    }

    /// [`forget`](Self::forget) for the marks of `name` alone (after merging or applying an op
    /// on it): true if any went.
    pub fn forget_marks(&mut self, name: &TensorName, now_ms: u64, expiry: &Expiry) -> bool {
        self.entries
            .get_mut(name)
            .is_some_and(|e| forget_marks_of(e, &self.members, now_ms, expiry))
    }

    /// The entry for `name`, if it is published and not deleted.
    pub fn entry(&self, name: &TensorName) -> Option<&Entry> {
        self.entries.get(name).filter(|e| e.is_live())
    }

    /// The version the next publish of `name` should use: one past the newest seen, deleted or
    /// not, so versions keep increasing across a delete.
    pub fn next_version(&self, name: &TensorName) -> u64 {
        self.entries
            .get(name)
            .map_or(1, |e| e.version.saturating_add(1))
    }

    /// Nodes that hold `version` of `name` and that `is_alive` accepts, in node id order;
    /// empty if the name is not live.
    pub fn live_holders(
        &self,
        name: &TensorName,
        version: u64,
        is_alive: impl Fn(&NodeId) -> bool,
    ) -> Vec<NodeId> {
        self.entry(name)
            .map(|e| e.holders_of(version).filter(|n| is_alive(n)).collect())
            .unwrap_or_default()
    }

    /// Live entries whose names start with `prefix` (`""`: all), in name order.
    pub fn list<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a TensorName, &'a Entry)> + 'a {
        // Names sharing a prefix are contiguous in byte order, starting at the prefix itself.
        self.entries
            .iter()
            .skip_while(move |(n, _)| n.as_str() < prefix)
            .take_while(move |(n, _)| n.as_str().starts_with(prefix))
            .filter(|(_, e)| e.is_live())
    }

    /// Live entries whose names come after `after` (`None`: from the first), in name order:
    /// a page of a listing resumes where the previous one stopped, found in O(log n).
    pub fn list_after<'a>(
        &'a self,
        after: Option<&TensorName>,
    ) -> impl Iterator<Item = (&'a TensorName, &'a Entry)> + 'a {
        use std::ops::Bound;
        let start = after.map_or(Bound::Unbounded, |name| Bound::Excluded(name.clone()));
        self.entries
            .range((start, Bound::Unbounded))
            .filter(|(_, e)| e.is_live())
    }

    /// Whether `node` has a present mark on `version` of `name`, published or not: function
    /// advertisements are marks on entries nobody publishes (see [`crate::call`]).
    pub fn marked(&self, name: &TensorName, version: u64, node: NodeId) -> bool {
        self.entries
            .get(name)
            .is_some_and(|e| e.holders_of(version).any(|n| n == node))
    }

    /// The members that advertise under `name` now, in node id order: alive, reachable, and
    /// holding a present mark at their current epoch. A node that died is not alive; one
    /// that restarted has a new epoch, so its old marks stop counting with no message.
    pub fn advertisers(&self, name: &TensorName) -> Vec<&Member> {
        let Some(entry) = self.entries.get(name) else {
            return Vec::new();
        };
        entry
            .holders
            .iter()
            .filter(|(_, mark)| mark.present)
            .filter_map(|((node, version), _)| {
                self.members
                    .get(node)
                    .filter(|m| m.alive && !m.addrs.is_empty() && m.epoch == *version)
            })
            .collect()
    }

    /// Entries under `prefix` (published or not) with at least one
    /// [advertiser](Self::advertisers), with how many, in name order.
    pub fn advertised<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a TensorName, usize)> + 'a {
        self.entries
            .iter()
            .skip_while(move |(n, _)| n.as_str() < prefix)
            .take_while(move |(n, _)| n.as_str().starts_with(prefix))
            .map(|(name, _)| (name, self.advertisers(name).len()))
            .filter(|(_, count)| *count > 0)
    }

    /// The membership row for `node`.
    pub fn member(&self, node: &NodeId) -> Option<&Member> {
        self.members.get(node)
    }

    /// Every membership row, in node id order.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// BLAKE3 of each entry's postcard encoding (tombstones and placeholders included), for
    /// anti-entropy: two replicas with equal digests for a name hold equal entries for it.
    pub fn digest(&self) -> BTreeMap<TensorName, [u8; 32]> {
        self.entries
            .iter()
            .map(|(name, e)| (name.clone(), digest_of(e)))
            .collect()
    }

    /// BLAKE3 of each membership row's postcard encoding, like [`digest`](Self::digest).
    pub fn member_digest(&self) -> BTreeMap<NodeId, [u8; 32]> {
        self.members
            .iter()
            .map(|(node, m)| (*node, digest_of(m)))
            .collect()
    }

    /// The raw entries (tombstones and placeholders included) for `names` this replica has,
    /// for a sync reply.
    pub fn entries_for<'a>(
        &self,
        names: impl IntoIterator<Item = &'a TensorName>,
    ) -> Vec<(TensorName, Entry)> {
        names
            .into_iter()
            .filter_map(|n| self.entries.get(n).map(|e| (n.clone(), e.clone())))
            .collect()
    }

    /// The membership rows for `nodes` this replica has, for a sync reply.
    pub fn members_for<'a>(&self, nodes: impl IntoIterator<Item = &'a NodeId>) -> Vec<Member> {
        nodes
            .into_iter()
            .filter_map(|n| self.members.get(n).cloned())
            .collect()
    }
}

/// What [`Registry::forget`] dropped: rows to delete from disk, entries to write again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Forgotten {
    /// Nodes whose membership rows went.
    pub members: Vec<NodeId>,
    /// Names whose entries lost holder marks.
    pub names: Vec<TensorName>,
}

/// Drops `entry`'s marks of nodes without a row in `members` that are older than
/// [`Expiry::dead_after_ms`]; true if any went. A node's marks are all older than the row that
/// said it was gone, so they go no sooner than its row did.
fn forget_marks_of(
    entry: &mut Entry,
    members: &BTreeMap<NodeId, Member>,
    now_ms: u64,
    expiry: &Expiry,
) -> bool {
    let before = entry.holders.len();
    entry.holders.retain(|(node, _), mark| {
        members.contains_key(node) || !expiry.mark_expired(&mark.stamp, now_ms)
    });
    entry.holders.len() != before
}

fn mark(stamp: Stamp, present: bool) -> HolderMark {
    HolderMark { stamp, present }
}

#[cfg(test)]
mod tests;
