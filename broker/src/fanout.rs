//! [`FanOut`]: who is fetching which version, and from whom, so that many fetches of one new
//! version form a pipeline (or a tree) instead of all pulling from the publisher.
//!
//! Each look-up hands the asker its sources best first and records it as a fetcher (it serves
//! what it has so far: cut-through) and as a child of the first source. A source with
//! `limit` children is full: it is still listed, after every source with room. A child frees
//! its slot when its fetch ends, when it becomes a complete holder, or after `timeout_ms`
//! without news. Local bookkeeping only: not replicated, not persisted.
//!
//! How sources with room are ranked depends on the tensor's size, as in collective libraries
//! that pick rings for large messages and trees for small ones (NCCL):
//!
//! - **Large** (at least `chain_min_bytes`): bandwidth first. A child shares its source's
//!   upload with the source's other children, so a source with fewer children comes first,
//!   even one still receiving (it forwards at the rate it receives). Fetchers arriving
//!   together form a chain: every link carries a node's whole upload, and a broadcast to N
//!   takes about one transfer plus N pipeline hops, where a tree of width 2 halves every
//!   link's rate (about twice one transfer). A chain is at most `max_depth` fetchers long;
//!   the next fetcher branches off the shallowest source with room, starting a new chain.
//! - **Small**: latency first. Complete holders come before fetchers in flight, so each
//!   fetcher is as few hops from a complete copy as the fan-out allows.

use std::collections::{BTreeMap, BTreeSet};

use tb_proto::{Entry, HolderAddr, MAX_HOLDERS_REPLY, NodeId, TensorName};

use crate::state::oldest_kept;

/// Fetches in flight per `(name, version)`.
#[derive(Debug)]
pub(crate) struct FanOut {
    limit: usize,
    timeout_ms: u64,
    chain_min_bytes: u64,
    max_depth: usize,
    transfers: BTreeMap<(TensorName, u64), Transfer>,
}

/// The fetches of one version.
#[derive(Debug, Default)]
struct Transfer {
    /// Nodes receiving the version, with when they were last heard about.
    fetchers: BTreeMap<NodeId, u64>,
    /// The source each fetcher was pointed at first. Every key is also in `fetchers`.
    sources: BTreeMap<NodeId, NodeId>,
}

impl Transfer {
    /// Forgets `node`'s fetch and the slot it held at its source.
    fn release(&mut self, node: &NodeId) {
        self.fetchers.remove(node);
        self.sources.remove(node);
    }

    fn is_empty(&self) -> bool {
        self.fetchers.is_empty()
    }

    /// Nodes whose chain of sources leads to `node`: pointing `node` at one would make a
    /// cycle of fetchers waiting on each other.
    fn below(&self, node: NodeId) -> BTreeSet<NodeId> {
        let leads_to_node = |mut cur: NodeId| {
            // A chain is at most as long as the number of fetchers; the bound only guards
            // against a cycle, which `plan` never creates.
            for _ in 0..=self.sources.len() {
                match self.sources.get(&cur) {
                    Some(&up) if up == node => return true,
                    Some(&up) => cur = up,
                    None => return false,
                }
            }
            false
        };
        self.sources
            .keys()
            .copied()
            .filter(|&n| leads_to_node(n))
            .collect()
    }

    /// Hops from `node` up to a complete copy: 0 for a complete holder, 1 for a fetcher
    /// pointed at one (or at nobody this broker knows), and so on up its chain of sources.
    fn depth(&self, node: NodeId, complete: &[NodeId]) -> usize {
        let mut cur = node;
        // Bounded like `below`: a chain is at most as long as the number of fetchers.
        for hops in 0..=self.sources.len() {
            if complete.contains(&cur) {
                return hops;
            }
            match self.sources.get(&cur) {
                Some(&up) => cur = up,
                None => return hops + 1,
            }
        }
        self.sources.len() + 1
    }
}

/// The version a look-up wants.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wanted<'a> {
    /// The tensor.
    pub(crate) name: &'a TensorName,
    /// Its version.
    pub(crate) version: u64,
    /// The version's size, which picks the [`Policy`].
    pub(crate) byte_len: u64,
}

/// How a look-up ranks the sources with room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    /// Small tensors: complete holders first, then fewest children (a shallow tree).
    Latency,
    /// Large tensors: fewest children first (a chain), at most `max_depth` deep.
    Bandwidth { max_depth: usize },
}

/// What [`Policy`] ranks a source by.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    children: usize,
    complete: bool,
    depth: usize,
}

impl Candidate {
    /// Sort key, smallest best: full sources last whatever the policy.
    fn rank(self, policy: Policy, limit: usize) -> (bool, bool, usize, bool, usize) {
        let full = self.children >= limit;
        match policy {
            Policy::Latency => (full, false, 0, !self.complete, self.children),
            Policy::Bandwidth { max_depth } => (
                full,
                // A child of this source would be more than `max_depth` hops deep.
                self.depth >= max_depth,
                self.children,
                !self.complete,
                self.depth,
            ),
        }
    }
}

impl FanOut {
    /// Bookkeeping that hands each source to at most `limit` fetchers at a time, chains
    /// fetchers of tensors of at least `chain_min_bytes` at most `max_depth` deep, and forgets
    /// fetches after `timeout_ms` without news.
    pub(crate) fn new(
        limit: usize,
        timeout_ms: u64,
        chain_min_bytes: u64,
        max_depth: usize,
    ) -> Self {
        FanOut {
            limit: limit.max(1),
            timeout_ms,
            chain_min_bytes,
            max_depth: max_depth.max(1),
            transfers: BTreeMap::new(),
        }
    }

    fn policy(&self, byte_len: u64) -> Policy {
        match byte_len >= self.chain_min_bytes {
            true => Policy::Bandwidth {
                max_depth: self.max_depth,
            },
            false => Policy::Latency,
        }
    }

    /// The sources for `asker` fetching `want`, best first, and records the fetch (pointed at
    /// the first source). `complete` are the holders by the registry;
    /// `addrs_of` gives a node's addresses if it is alive and reachable. The asker itself and
    /// nodes fetching through it are never offered. Empty (and nothing recorded) if there is no
    /// source.
    pub(crate) fn plan(
        &mut self,
        want: Wanted<'_>,
        asker: NodeId,
        complete: &[NodeId],
        addrs_of: impl Fn(&NodeId) -> Option<Vec<String>>,
        now_ms: u64,
    ) -> Vec<HolderAddr> {
        let key = (want.name.clone(), want.version);
        let (policy, limit) = (self.policy(want.byte_len), self.limit);
        let t = self.transfers.entry(key.clone()).or_default();
        // A repeated look-up (a retry) gives up the asker's previous slot.
        t.sources.remove(&asker);
        let below = t.below(asker);
        let mut children: BTreeMap<NodeId, usize> = BTreeMap::new();
        for (child, source) in &t.sources {
            // A dead child frees its slot at once.
            if addrs_of(child).is_some() {
                *children.entry(*source).or_default() += 1;
            }
        }
        let in_flight = t.fetchers.keys().filter(|n| !complete.contains(n));
        let candidates = complete.iter().map(|n| (n, true));
        let mut offered: Vec<(Candidate, HolderAddr)> = candidates
            .chain(in_flight.map(|n| (n, false)))
            .filter(|(n, _)| **n != asker && !below.contains(n))
            .filter_map(|(&node, is_complete)| {
                let addrs = addrs_of(&node)?;
                let candidate = Candidate {
                    children: children.get(&node).copied().unwrap_or(0),
                    complete: is_complete,
                    depth: t.depth(node, complete),
                };
                let holder = HolderAddr {
                    node,
                    addrs,
                    complete: is_complete,
                };
                Some((candidate, holder))
            })
            .collect();
        offered.sort_by_key(|(c, h)| (c.rank(policy, limit), h.node));
        offered.truncate(MAX_HOLDERS_REPLY);
        match offered.first() {
            Some((_, first)) if !complete.contains(&asker) => {
                t.fetchers.insert(asker, now_ms);
                t.sources.insert(asker, first.node);
            }
            _ if t.is_empty() => {
                self.transfers.remove(&key);
            }
            _ => {}
        }
        offered.into_iter().map(|(_, h)| h).collect()
    }

    /// Records (or refreshes) that `node` is fetching `version` of `name`.
    pub(crate) fn start(&mut self, name: &TensorName, version: u64, node: NodeId, now_ms: u64) {
        let t = self.transfers.entry((name.clone(), version)).or_default();
        t.fetchers.insert(node, now_ms);
    }

    /// Forgets `node`'s fetch of `version` of `name` and the slot it held at its source.
    pub(crate) fn finish(&mut self, name: &TensorName, version: u64, node: NodeId) {
        let key = (name.clone(), version);
        if let Some(t) = self.transfers.get_mut(&key) {
            t.release(&node);
            if t.is_empty() {
                self.transfers.remove(&key);
            }
        }
    }

    /// Brings `name`'s fetches in line with its entry after a change (`None`: no longer live):
    /// fetchers that became holders are done, versions no longer kept are dropped.
    pub(crate) fn settle(&mut self, name: &TensorName, entry: Option<&Entry>, keep_versions: u64) {
        let range = (name.clone(), 0)..=(name.clone(), u64::MAX);
        let mut emptied = Vec::new();
        for ((n, version), t) in self.transfers.range_mut(range) {
            let kept = entry.filter(|e| *version >= oldest_kept(e.version, keep_versions));
            match kept {
                Some(e) => e.holders_of(*version).for_each(|h| t.release(&h)),
                None => t.fetchers.clear(),
            }
            if t.is_empty() {
                emptied.push((n.clone(), *version));
            }
        }
        for key in emptied {
            self.transfers.remove(&key);
        }
    }

    /// Forgets fetches without news for longer than the timeout.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        let timeout = self.timeout_ms;
        self.transfers.retain(|_, t| {
            t.fetchers
                .retain(|_, at| now_ms.saturating_sub(*at) <= timeout);
            let fetchers = &t.fetchers;
            t.sources.retain(|child, _| fetchers.contains_key(child));
            !t.is_empty()
        });
    }

    /// Number of versions with fetches in flight.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.transfers.len()
    }
}
