//! [`BrokerState`]: everything a broker decides, as plain data fed explicit time.
//!
//! It owns the broker's replica of the [`Registry`], the [`Hlc`] that stamps what this broker
//! writes, and local bookkeeping that is never replicated: when it last heard each worker
//! (`liveness`), which fetches are in flight and who fetches from whom (`fanout`), and the
//! metadata of recent versions (for look-ups of a version that is no longer the newest).
//!
//! Every method that changes the registry returns [`Changes`]: the ops to gossip, the names
//! and members to persist, the events for subscribers. The actor carries them out; nothing
//! here does I/O or reads a clock.
//!
//! Where ops come from, and how each is trusted:
//! - [`announce`](BrokerState::announce): a node reports its own publishes, holdings and
//!   deletes over `tb/ctl/1`. The broker checks that the op is about the authenticated sender
//!   (workers cannot speak for others), restamps it with its own clock (a worker's clock is
//!   not trusted to order registry writes), applies it and gossips it.
//! - [`local_op`](BrokerState::local_op), [`publish`](BrokerState::publish),
//!   [`heartbeat`](BrokerState::heartbeat), [`leave`](BrokerState::leave),
//!   [`expire`](BrokerState::expire): ops this broker originates, stamped with its clock.
//! - [`remote_op`](BrokerState::remote_op) and [`merge_entries`](BrokerState::merge_entries):
//!   what other brokers wrote, from gossip and anti-entropy. Validated, their stamps observed
//!   (refused when too far in the future), merged; never re-gossiped.
//!
//! Rows of nodes that are gone are forgotten by the rule of [`Registry::forget`] (see
//! [`BrokerConfig::expiry`]): at load, after every apply and merge (for what it touched, so
//! nothing forgotten comes back from a peer or the disk), and in full every
//! [`forget_period_ms`](BrokerConfig::forget_period_ms) from [`expire`](BrokerState::expire).

mod liveness;
mod lookup;
mod meta_cache;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use tb_proto::{
    Access, AccessError, Entry, Event, Forgotten, Hlc, ListedEntry, Member, NodeId, Registry,
    RegistryOp, Stamp, TensorMeta, TensorName,
};

pub use self::lookup::Holders;
use self::{liveness::LastHeard, meta_cache::MetaCache};
use crate::{BrokerConfig, BrokerError, events::event_for, fanout::FanOut};

/// Furthest an announced publish may jump past the next version: a client bug announcing
/// `u64::MAX` would otherwise use up a name's versions for good.
pub const MAX_VERSION_SKIP: u64 = 1 << 20;

/// What applying something changed: what the actor gossips, persists and tells subscribers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Ops this broker originated, to broadcast to the other brokers.
    pub gossip: Vec<RegistryOp>,
    /// Names whose entries changed, to persist.
    pub names: Vec<TensorName>,
    /// Nodes whose membership rows changed, to persist (or went: to delete).
    pub members: Vec<NodeId>,
    /// Events for subscribers whose patterns match.
    pub events: Vec<Event>,
}

impl Changes {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.gossip.is_empty()
            && self.names.is_empty()
            && self.members.is_empty()
            && self.events.is_empty()
    }

    /// Appends `other`, keeping names and members unique.
    pub fn extend(&mut self, other: Changes) {
        self.gossip.extend(other.gossip);
        other.names.into_iter().for_each(|n| self.note_name(n));
        other.members.into_iter().for_each(|m| self.note_member(m));
        self.events.extend(other.events);
    }

    fn note_name(&mut self, name: TensorName) {
        if !self.names.contains(&name) {
            self.names.push(name);
        }
    }

    fn note_member(&mut self, node: NodeId) {
        if !self.members.contains(&node) {
            self.members.push(node);
        }
    }
}

/// The decisions of one broker: its registry replica, clock and local bookkeeping.
#[derive(Debug)]
pub struct BrokerState {
    config: BrokerConfig,
    registry: Registry,
    hlc: Hlc,
    heard: LastHeard,
    fanout: FanOut,
    metas: MetaCache,
    /// What was forgotten but not yet handed out in [`Changes`] (at load).
    forgotten: Changes,
    /// When [`expire`](Self::expire) next walks the whole registry to forget.
    next_forget_ms: u64,
}

impl BrokerState {
    /// A broker for `node` resuming from `registry` (empty, or loaded from disk) at `now_ms`.
    ///
    /// The clock starts past every stamp in the registry, so new writes beat old ones even if
    /// the wall clock stepped back across the restart. Workers the registry holds as alive get
    /// a grace period: they count as heard at `now_ms` (see [`expire`](Self::expire)). Rows
    /// and marks past their [expiry](BrokerConfig::expiry) are forgotten at once; the first
    /// [`expire`](Self::expire) hands them out, so that they are deleted from the disk too.
    pub fn new(node: NodeId, config: BrokerConfig, mut registry: Registry, now_ms: u64) -> Self {
        registry.prune(config.keep_versions);
        let forgotten = changes_of(registry.forget(now_ms, &config.expiry));
        let next_forget_ms = now_ms.saturating_add(config.forget_period_ms);
        let mut hlc = Hlc::new(node);
        // A persisted stamp too far ahead was written under a wrong clock; ignoring it only
        // means this broker's next writes might lose to it, as they would have anyway.
        let _ = hlc.observe(&newest_stamp(&registry), now_ms);
        let heard = LastHeard::resumed(&registry, node, now_ms);
        let fanout = FanOut::new(
            config.fanout,
            config.fetch_timeout_ms,
            config.chain_min_bytes,
            config.max_chain_depth,
        );
        let metas = MetaCache::resumed(&registry);
        BrokerState {
            config,
            registry,
            hlc,
            heard,
            fanout,
            metas,
            forgotten,
            next_forget_ms,
        }
    }

    /// This broker's node id.
    pub fn node(&self) -> NodeId {
        self.hlc.node()
    }

    /// The configuration it decides by.
    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// Its replica of the registry (read-only: change it through the methods).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The version a publish of `name` would get now (answers `NextVersion`): one past the
    /// newest seen, deleted or not. Two askers before either publishes get the same number;
    /// the second to announce gets [`BrokerError::StaleVersion`] and asks again.
    pub fn next_version(&self, name: &TensorName) -> u64 {
        self.registry.next_version(name)
    }

    /// Applies an op this broker originates, trusted as is: restamps it with this broker's
    /// clock and returns it in `gossip` if it changed anything.
    pub fn local_op(&mut self, op: RegistryOp, now_ms: u64) -> Changes {
        let op = restamp(op, self.hlc.now(now_ms));
        let mut changes = Changes::default();
        if self.apply(&op, &mut changes, now_ms) {
            changes.gossip.push(op);
        }
        changes
    }

    /// Publishes a new version of `name` by `publisher` (this broker's own node, say) under the
    /// next version, with `publisher` as its first holder.
    pub fn publish(
        &mut self,
        name: TensorName,
        meta: TensorMeta,
        publisher: NodeId,
        now_ms: u64,
    ) -> (u64, Changes) {
        let version = self.next_version(&name);
        let changes = self.publish_as(name, version, meta, publisher, now_ms);
        (version, changes)
    }

    /// A publish and the publisher's holder mark: the publisher always holds what it made, so
    /// the broker writes the mark rather than trust every client to announce it.
    fn publish_as(
        &mut self,
        name: TensorName,
        version: u64,
        meta: TensorMeta,
        publisher: NodeId,
        now_ms: u64,
    ) -> Changes {
        let hold = RegistryOp::AddHolder {
            name: name.clone(),
            version,
            node: publisher,
            stamp: Stamp::ZERO,
        };
        let publish = RegistryOp::Publish {
            name,
            version,
            meta,
            publisher,
            stamp: Stamp::ZERO,
        };
        let mut changes = self.local_op(publish, now_ms);
        changes.extend(self.local_op(hold, now_ms));
        changes
    }

    /// Applies an op that `sender` (an authenticated node) announced about itself.
    ///
    /// The op must be valid, must not be a membership row (those come from heartbeats), and
    /// must name the sender as publisher or holder. A publish must be newer than every version
    /// known (else [`BrokerError::StaleVersion`]: another publish won the version) and at most
    /// [`MAX_VERSION_SKIP`] past the next one; it also makes the sender a holder. A delete
    /// needs a live name. An op that would change nothing (a retry) is accepted and changes
    /// nothing. The op is restamped with this broker's clock, whatever stamp it came with.
    pub fn announce(
        &mut self,
        sender: NodeId,
        op: RegistryOp,
        now_ms: u64,
    ) -> Result<Changes, BrokerError> {
        op.validate(self.config.max_tensor_bytes)?;
        match op {
            RegistryOp::Member(_) => Err(BrokerError::MemberOp { sender }),
            RegistryOp::Publish {
                name,
                version,
                meta,
                publisher,
                ..
            } => {
                owned_by(sender, publisher)?;
                if self.is_head(&name, version, &meta, publisher) {
                    let hold = RegistryOp::AddHolder {
                        name,
                        version,
                        node: publisher,
                        stamp: Stamp::ZERO,
                    };
                    return self.announce(sender, hold, now_ms);
                }
                let next = self.next_version(&name);
                if version < next {
                    let newest = next.saturating_sub(1);
                    return Err(BrokerError::StaleVersion {
                        name,
                        version,
                        newest,
                    });
                }
                if version - next > MAX_VERSION_SKIP {
                    return Err(BrokerError::VersionSkip {
                        name,
                        version,
                        next,
                    });
                }
                Ok(self.publish_as(name, version, meta, publisher, now_ms))
            }
            RegistryOp::AddHolder {
                ref name,
                version,
                node,
                ..
            } => {
                owned_by(sender, node)?;
                match self.holds(name, version, node) {
                    true => Ok(Changes::default()),
                    false => Ok(self.local_op(op, now_ms)),
                }
            }
            RegistryOp::RemoveHolder {
                ref name,
                version,
                node,
                ..
            } => {
                owned_by(sender, node)?;
                match self.holds(name, version, node) {
                    true => Ok(self.local_op(op, now_ms)),
                    false => Ok(Changes::default()),
                }
            }
            RegistryOp::Delete { ref name, .. } => match self.registry.entry(name) {
                Some(_) => Ok(self.local_op(op, now_ms)),
                None => Err(BrokerError::NotFound {
                    name: name.clone(),
                    version: None,
                }),
            },
        }
    }

    /// [`announce`](Self::announce) for a sender whose credential allows `access`. A read-only
    /// sender may only mark what it holds: no publish, delete or membership row
    /// ([`BrokerError::Access`]), and holder marks only of versions whose holders the registry
    /// keeps ([`BrokerError::NotFound`] otherwise), so it cannot make up names or versions.
    pub fn announce_as(
        &mut self,
        sender: NodeId,
        access: Access,
        op: RegistryOp,
        now_ms: u64,
    ) -> Result<Changes, BrokerError> {
        if access == Access::ReadOnly {
            self.check_read_only(&op)?;
        }
        self.announce(sender, op, now_ms)
    }

    /// Refuses what a read-only sender may not announce.
    fn check_read_only(&self, op: &RegistryOp) -> Result<(), BrokerError> {
        if let Some(action) = op.write_action() {
            return Err(AccessError::PeerReadOnly { action }.into());
        }
        if let RegistryOp::AddHolder { name, version, .. } = op {
            let keep = self.config.keep_versions;
            let kept = self
                .registry
                .entry(name)
                .is_some_and(|e| (oldest_kept(e.version, keep)..=e.version).contains(version));
            if !kept {
                return Err(BrokerError::NotFound {
                    name: name.clone(),
                    version: Some(*version),
                });
            }
        }
        Ok(())
    }

    /// Applies an op another broker gossiped: validates it, observes its stamp (refusing one
    /// too far in the future, without applying it) and merges it. Nothing to re-gossip: the
    /// gossip layer already floods it.
    pub fn remote_op(&mut self, op: &RegistryOp, now_ms: u64) -> Result<Changes, BrokerError> {
        op.validate(self.config.max_tensor_bytes)?;
        self.hlc.observe(op.stamp(), now_ms)?;
        let mut changes = Changes::default();
        self.apply(op, &mut changes, now_ms);
        Ok(changes)
    }

    /// Merges what an anti-entropy exchange brought. Each entry and row is checked on its own
    /// (validity, stamps not too far ahead); one that fails is skipped with a warning, the
    /// rest are merged.
    pub fn merge_entries(
        &mut self,
        entries: &[(TensorName, Entry)],
        members: &[Member],
        now_ms: u64,
    ) -> Changes {
        let mut changes = Changes::default();
        let expiry = self.config.expiry;
        // Rows first: whether a merged holder mark is kept depends on its node's row.
        for member in members {
            let checked = member.validate().map_err(BrokerError::from).and_then(|()| {
                self.hlc
                    .observe(&member.stamp, now_ms)
                    .map_err(BrokerError::from)
            });
            if let Err(error) = checked {
                tracing::warn!(node = %member.node, %error, "sync: refused a member row");
            } else if self.merge_member(member, now_ms) {
                changes.note_member(member.node);
            }
        }
        // Each changed name with its live version before the first change to it, so a name
        // that comes twice still makes one event.
        let mut merged = BTreeMap::new();
        for (name, entry) in entries {
            if let Err(error) = self.check_entry(name, entry, now_ms) {
                tracing::warn!(%name, %error, "sync: refused an entry");
                continue;
            }
            let before = self.live_version(name);
            if self.registry.merge_entry(name, entry) {
                merged.entry(name).or_insert(before);
            }
        }
        // Every other entry was pruned and forgotten already; only the merged ones can need it.
        for name in merged.keys() {
            self.registry.prune_name(name, self.config.keep_versions);
            self.registry.forget_marks(name, now_ms, &expiry);
        }
        for (name, before) in merged {
            self.entry_changed(name, before, &mut changes);
        }
        changes
    }

    /// Checks a synced entry and observes its newest stamp; the clock is left as it was when
    /// the entry is refused.
    fn check_entry(
        &mut self,
        name: &TensorName,
        entry: &Entry,
        now_ms: u64,
    ) -> Result<(), BrokerError> {
        entry.validate(name, self.config.max_tensor_bytes)?;
        let newest = entry
            .holders
            .values()
            .map(|mark| mark.stamp)
            .chain(entry.deleted)
            .fold(entry.stamp, Stamp::max);
        Ok(self.hlc.observe(&newest, now_ms)?)
    }

    /// Live entries whose names start with `prefix` (`""`: all), in name order, at most
    /// `limit`, each with the number of live, reachable holders of its newest version.
    pub fn list(&self, prefix: &str, limit: usize) -> Vec<ListedEntry> {
        self.registry
            .list(prefix)
            .take(limit)
            .map(|(name, e)| ListedEntry {
                name: name.clone(),
                version: e.version,
                meta: e.meta.clone(),
                holders: e
                    .holders_of(e.version)
                    .filter(|n| reachable(&self.registry, n).is_some())
                    .count()
                    .try_into()
                    .unwrap_or(u32::MAX),
            })
            .collect()
    }

    /// The live nodes serving `function` now, with their addresses (at most
    /// [`MAX_HOLDERS_REPLY`](tb_proto::MAX_HOLDERS_REPLY)).
    pub fn servers(&self, function: &TensorName) -> Vec<tb_proto::HolderAddr> {
        let Some(entry) = tb_proto::call::advertised_as(function) else {
            return Vec::new();
        };
        self.registry
            .advertisers(&entry)
            .into_iter()
            .take(tb_proto::MAX_HOLDERS_REPLY)
            .map(|m| tb_proto::HolderAddr {
                node: m.node,
                addrs: m.addrs.clone(),
                complete: true,
            })
            .collect()
    }

    /// The functions served now whose names start with `prefix`, with their server counts,
    /// in name order.
    pub fn functions(&self, prefix: &str, limit: usize) -> Vec<(TensorName, u32)> {
        let prefix = format!("{}{prefix}", tb_proto::call::FUNCTION_PREFIX);
        self.registry
            .advertised(&prefix)
            .filter_map(|(entry, count)| {
                let function = tb_proto::call::function_of(entry)?;
                Some((function, u32::try_from(count).unwrap_or(u32::MAX)))
            })
            .take(limit)
            .collect()
    }

    /// Every membership row, in node id order.
    pub fn members(&self) -> Vec<Member> {
        self.registry.members().cloned().collect()
    }

    /// Applies a validated op at `now_ms` and notes what it changed; true if it changed
    /// anything. A membership row goes through [`merge_member`](Self::merge_member).
    fn apply(&mut self, op: &RegistryOp, changes: &mut Changes, now_ms: u64) -> bool {
        if let RegistryOp::Member(member) = op {
            let changed = self.merge_member(member, now_ms);
            if changed {
                changes.note_member(member.node);
            }
            return changed;
        }
        let name = op_name(op);
        let before = name.and_then(|n| self.live_version(n));
        if !self.registry.apply(op) {
            return false;
        }
        // Every replica prunes after every apply, or replicas would not converge. An op changes
        // only its own name's entry, and every entry was pruned before (at load, and after
        // every apply and merge), so pruning that one entry prunes the whole registry. So for
        // forgetting: what the op brought is forgotten at once if it is past its expiry.
        if let Some(name) = name {
            self.registry.prune_name(name, self.config.keep_versions);
            self.registry
                .forget_marks(name, now_ms, &self.config.expiry);
            self.entry_changed(name, before, changes);
        }
        true
    }

    /// Merges one membership row at `now_ms`; true if the table changed. A row past its
    /// [expiry](BrokerConfig::expiry) replaces the row it supersedes and then goes, so that
    /// neither it nor an older row of the same node stays; one that finds no row changes
    /// nothing.
    fn merge_member(&mut self, member: &Member, now_ms: u64) -> bool {
        let had = self.registry.member(&member.node).is_some();
        if !self.registry.merge_member(member) {
            return false;
        }
        let forgot = self
            .registry
            .forget_member(&member.node, now_ms, &self.config.expiry);
        had || !forgot
    }

    /// Forgets what is past its [expiry](BrokerConfig::expiry) in the whole registry, at most
    /// once every [`forget_period_ms`](BrokerConfig::forget_period_ms), and hands out what was
    /// forgotten at load.
    fn forget_expired(&mut self, now_ms: u64) -> Changes {
        let mut changes = std::mem::take(&mut self.forgotten);
        if now_ms < self.next_forget_ms {
            return changes;
        }
        self.next_forget_ms = now_ms.saturating_add(self.config.forget_period_ms);
        let forgotten = self.registry.forget(now_ms, &self.config.expiry);
        if !forgotten.members.is_empty() {
            tracing::info!(rows = forgotten.members.len(), "forgot rows of nodes gone");
        }
        changes.extend(changes_of(forgotten));
        changes
    }

    /// Follows up a change to `name`'s entry: persistence, the event, the recent-metadata
    /// cache, and the fan-out bookkeeping (completed fetches, evicted versions).
    fn entry_changed(&mut self, name: &TensorName, before: Option<u64>, changes: &mut Changes) {
        let after = self.registry.entry(name);
        changes.note_name(name.clone());
        changes.events.extend(event_for(name, before, after));
        self.metas.update(name, after, self.config.keep_versions);
        self.fanout.settle(name, after, self.config.keep_versions);
    }

    /// The newest version of `name` if it is live.
    fn live_version(&self, name: &TensorName) -> Option<u64> {
        self.registry.entry(name).map(|e| e.version)
    }

    /// Whether `(version, meta, publisher)` is `name`'s live head already.
    fn is_head(&self, name: &TensorName, version: u64, meta: &TensorMeta, by: NodeId) -> bool {
        self.registry
            .entry(name)
            .is_some_and(|e| e.version == version && e.publisher == by && e.meta == *meta)
    }

    /// Whether `node`'s mark says it holds `version` of live `name`.
    fn holds(&self, name: &TensorName, version: u64, node: NodeId) -> bool {
        // A function's advertisement entry is never published: its marks count all the same.
        if tb_proto::call::function_of(name).is_some() {
            return self.registry.marked(name, version, node);
        }
        self.registry
            .entry(name)
            .is_some_and(|e| e.holders_of(version).any(|n| n == node))
    }
}

/// What [`Registry::forget`] dropped, as changes to persist (names to write again, rows to
/// delete).
fn changes_of(forgotten: Forgotten) -> Changes {
    Changes {
        names: forgotten.names,
        members: forgotten.members,
        ..Changes::default()
    }
}

/// The membership row of `node` if it is alive and has addresses to reach it at.
fn reachable<'a>(registry: &'a Registry, node: &NodeId) -> Option<&'a Member> {
    registry
        .member(node)
        .filter(|m| m.alive && !m.addrs.is_empty())
}

/// The oldest version whose holders the registry keeps when `newest` is the newest.
pub(crate) fn oldest_kept(newest: u64, keep_versions: u64) -> u64 {
    newest.saturating_sub(keep_versions.max(1) - 1).max(1)
}

/// Refuses an op naming `claimed` as publisher or holder unless the sender is `claimed`.
fn owned_by(sender: NodeId, claimed: NodeId) -> Result<(), BrokerError> {
    match sender == claimed {
        true => Ok(()),
        false => Err(BrokerError::NotYours { sender, claimed }),
    }
}

/// The name an op is about (none for a membership row).
fn op_name(op: &RegistryOp) -> Option<&TensorName> {
    match op {
        RegistryOp::Publish { name, .. }
        | RegistryOp::AddHolder { name, .. }
        | RegistryOp::RemoveHolder { name, .. }
        | RegistryOp::Delete { name, .. } => Some(name),
        RegistryOp::Member(_) => None,
    }
}

/// `op` with its stamp replaced by `new`.
fn restamp(mut op: RegistryOp, new: Stamp) -> RegistryOp {
    match &mut op {
        RegistryOp::Publish { stamp, .. }
        | RegistryOp::AddHolder { stamp, .. }
        | RegistryOp::RemoveHolder { stamp, .. }
        | RegistryOp::Delete { stamp, .. } => *stamp = new,
        RegistryOp::Member(member) => member.stamp = new,
    }
    op
}

/// The greatest stamp anywhere in `registry` (heads, marks, tombstones, members).
fn newest_stamp(registry: &Registry) -> Stamp {
    let names = registry.digest();
    let entries = registry.entries_for(names.keys());
    let entry_stamps = entries.iter().flat_map(|(_, e)| {
        e.holders
            .values()
            .map(|mark| mark.stamp)
            .chain(e.deleted)
            .chain([e.stamp])
    });
    registry
        .members()
        .map(|m| m.stamp)
        .chain(entry_stamps)
        .max()
        .unwrap_or(Stamp::ZERO)
}
