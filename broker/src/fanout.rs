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
//!
//! Slow sources (large tensors): a node whose upload limit (from its heartbeats) is below
//! 1/[`SLOW_SOURCE_FACTOR`] of the fastest candidate's would hold back every fetcher below
//! it in a chain. It comes after every other source with room, and as a child it takes no
//! slot: a fast fetcher takes its source's next link, and the slow child, which looks up
//! again while it fetches, moves on to a chain's tail, where it holds nobody back. A
//! look-up may exclude sources (the asker dropped them as slow or failed); they are not
//! offered to that asker.
//!
//! Sets of sources: a fetcher of a version of at least [`MULTI_SOURCE_MIN_BYTES`] pulls
//! pieces from up to [`MAX_SOURCES`] sources at once (smaller ones get a set of one). The
//! first source is its place in the chain or tree, as above; the others are *helpers*,
//! sources with capacity to spare, and each takes one of that source's slots, so that no
//! source is swamped. For a large tensor a helper must have no fast fetcher of this version
//! yet (its uplink is idle: a source already feeding a fetcher would only split its upload,
//! and a chain already runs every uplink at its rate); for a small one, room is enough. So a
//! broadcast still forms a chain whose publisher uplink carries one copy, while a fetcher
//! among several idle complete holders (a checkpoint replicated to a few nodes, or
//! receivers that finished) pulls from all of them.

use std::collections::{BTreeMap, BTreeSet};

use tb_proto::{
    Entry, HolderAddr, MAX_HOLDERS_REPLY, NodeId, TensorName,
    piece::{MAX_SOURCES, MULTI_SOURCE_MIN_BYTES},
};

use crate::state::oldest_kept;

/// A source is slow when its upload limit times this is below the fastest candidate's.
pub(crate) const SLOW_SOURCE_FACTOR: u64 = 4;

/// Fetches in flight per `(name, version)`.
#[derive(Debug)]
pub(crate) struct FanOut {
    limit: usize,
    timeout_ms: u64,
    chain_min_bytes: u64,
    max_depth: usize,
    transfers: BTreeMap<(TensorName, u64), Transfer>,
    /// Upload limits nodes reported in their heartbeats here (`u64::MAX`: unlimited; absent:
    /// unknown, never slow and not compared with).
    limits: BTreeMap<NodeId, u64>,
}

/// The fetches of one version.
#[derive(Debug, Default)]
struct Transfer {
    /// Nodes receiving the version, with when they were last heard about.
    fetchers: BTreeMap<NodeId, u64>,
    /// The source each fetcher was pointed at first. Every key is also in `fetchers`.
    sources: BTreeMap<NodeId, NodeId>,
    /// The helpers each fetcher was given besides its first source (each holds a slot there).
    /// Every key is also in `fetchers`.
    helpers: BTreeMap<NodeId, Vec<NodeId>>,
}

impl Transfer {
    /// Forgets `node`'s fetch and the slot it held at its source.
    fn release(&mut self, node: &NodeId) {
        self.fetchers.remove(node);
        self.sources.remove(node);
        self.helpers.remove(node);
    }

    /// Every `(fetcher, source)` slot: first sources and helpers.
    fn slots(&self) -> impl Iterator<Item = (&NodeId, &NodeId)> {
        let helpers = self
            .helpers
            .iter()
            .flat_map(|(child, hs)| hs.iter().map(move |h| (child, h)));
        self.sources.iter().chain(helpers)
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

/// Who asks, and which sources it does not want offered.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asker<'a> {
    /// The fetcher.
    pub(crate) node: NodeId,
    /// Sources it dropped during this fetch.
    pub(crate) exclude: &'a [NodeId],
}

/// The nodes of `nodes` that are slow next to the fastest of them, by their upload `limits`
/// (a node whose limit is unknown is neither slow nor compared with).
fn slow_among(limits: &BTreeMap<NodeId, u64>, nodes: &[NodeId]) -> BTreeSet<NodeId> {
    let fastest = nodes.iter().filter_map(|n| limits.get(n)).max().copied();
    let Some(fastest) = fastest else {
        return BTreeSet::new();
    };
    nodes
        .iter()
        .filter(|n| {
            limits
                .get(n)
                .is_some_and(|l| l.saturating_mul(SLOW_SOURCE_FACTOR) < fastest)
        })
        .copied()
        .collect()
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
    /// Fetchers pointed at it.
    children: usize,
    /// Those of them that are not slow.
    fast_children: usize,
    complete: bool,
    depth: usize,
    /// Its upload limit is far below the fastest candidate's.
    slow: bool,
    /// The asker's source until this look-up (a repeated look-up keeps it on a tie).
    current: bool,
}

/// A look-up's answer: sources best first, the first `sources` of them to pull from at once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) holders: Vec<HolderAddr>,
    pub(crate) sources: usize,
}

/// A [`Candidate`]'s sort key, smallest best.
type Rank = (bool, bool, bool, usize, bool, usize, bool);

impl Candidate {
    /// Whether a source ranked after the first may help the asker: not slow, with room, and
    /// for a large tensor with no fast fetcher of this version (its uplink is idle).
    fn spare(self, policy: Policy, limit: usize) -> bool {
        let room = self.fast_children < limit && !self.slow;
        match policy {
            Policy::Latency => room,
            Policy::Bandwidth { .. } => room && self.fast_children == 0,
        }
    }

    /// Sort key, smallest best: full sources last whatever the policy. Slow children take
    /// no slot (they move on to a chain's tail when they look up again).
    fn rank(self, policy: Policy, limit: usize) -> Rank {
        let full = self.fast_children >= limit;
        match policy {
            Policy::Latency => (
                full,
                false,
                false,
                0,
                !self.complete,
                self.children,
                !self.current,
            ),
            Policy::Bandwidth { max_depth } => (
                full,
                self.slow,
                // A child of this source would be more than `max_depth` hops deep.
                self.depth >= max_depth,
                self.fast_children,
                !self.complete,
                self.depth,
                !self.current,
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
            limits: BTreeMap::new(),
        }
    }

    /// Notes `node`'s upload limit in bytes per second, from its heartbeat (0: unlimited).
    pub(crate) fn upload_limit(&mut self, node: NodeId, limit: u64) {
        let limit = if limit == 0 { u64::MAX } else { limit };
        self.limits.insert(node, limit);
    }

    /// Forgets the upload limits of nodes for which `keep` is false (no longer heard).
    pub(crate) fn retain_limits(&mut self, keep: impl Fn(&NodeId) -> bool) {
        self.limits.retain(|n, _| keep(n));
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
    /// the first source, helped by the next `sources - 1`). `complete` are the holders by the
    /// registry; `addrs_of` gives a node's addresses if it is alive and reachable. The asker
    /// itself, nodes fetching through it and the sources it excludes are never offered.
    /// Empty (and nothing recorded) if there is no source.
    pub(crate) fn plan(
        &mut self,
        want: Wanted<'_>,
        asker: Asker<'_>,
        complete: &[NodeId],
        addrs_of: impl Fn(&NodeId) -> Option<Vec<String>>,
        now_ms: u64,
    ) -> Plan {
        let key = (want.name.clone(), want.version);
        let (policy, limit) = (self.policy(want.byte_len), self.limit);
        let t = self.transfers.entry(key.clone()).or_default();
        // A repeated look-up (a retry, or a fetcher checking for a better source) gives up
        // the asker's previous slot.
        let current = t.sources.remove(&asker.node);
        t.helpers.remove(&asker.node);
        let below = t.below(asker.node);
        let in_flight = t.fetchers.keys().filter(|n| !complete.contains(n));
        let sources: Vec<(NodeId, bool, Vec<String>)> = complete
            .iter()
            .map(|n| (*n, true))
            .chain(in_flight.map(|n| (*n, false)))
            .filter(|(n, _)| *n != asker.node && !below.contains(n))
            .filter(|(n, _)| !asker.exclude.contains(n))
            .filter_map(|(n, is_complete)| Some((n, is_complete, addrs_of(&n)?)))
            .collect();
        let nodes: Vec<NodeId> = sources.iter().map(|(n, ..)| *n).collect();
        let slow = match policy {
            Policy::Bandwidth { .. } => slow_among(&self.limits, &nodes),
            Policy::Latency => BTreeSet::new(),
        };
        let mut children: BTreeMap<NodeId, (usize, usize)> = BTreeMap::new();
        for (child, source) in t.slots() {
            // A dead child frees its slot at once.
            if addrs_of(child).is_some() {
                let c = children.entry(*source).or_default();
                c.0 += 1;
                c.1 += usize::from(!slow.contains(child));
            }
        }
        let mut offered: Vec<(Candidate, HolderAddr)> = sources
            .into_iter()
            .map(|(node, is_complete, addrs)| {
                let (all, fast) = children.get(&node).copied().unwrap_or((0, 0));
                let candidate = Candidate {
                    children: all,
                    fast_children: fast,
                    complete: is_complete,
                    depth: t.depth(node, complete),
                    slow: slow.contains(&node),
                    current: current == Some(node),
                };
                let holder = HolderAddr {
                    node,
                    addrs,
                    complete: is_complete,
                };
                (candidate, holder)
            })
            .collect();
        offered.sort_by_key(|(c, h)| (c.rank(policy, limit), h.node));
        // Helpers move up behind the first source, in rank order.
        // Smaller versions are fetched in one stream: one source at a time.
        let most = match want.byte_len >= MULTI_SOURCE_MIN_BYTES {
            true => MAX_SOURCES,
            false => 1,
        };
        let mut in_set = 0;
        let (set, rest): (Vec<_>, Vec<_>) =
            offered.into_iter().enumerate().partition(|(i, (c, _))| {
                let takes = in_set < most && (*i == 0 || c.spare(policy, limit));
                in_set += usize::from(takes);
                takes
            });
        let sources = set.len();
        let mut offered: Vec<HolderAddr> =
            set.into_iter().chain(rest).map(|(_, (_, h))| h).collect();
        offered.truncate(MAX_HOLDERS_REPLY);
        match offered.first() {
            Some(first) if !complete.contains(&asker.node) => {
                t.fetchers.insert(asker.node, now_ms);
                t.sources.insert(asker.node, first.node);
                let helpers = offered[1..sources].iter().map(|h| h.node).collect();
                t.helpers.insert(asker.node, helpers);
            }
            _ if t.is_empty() => {
                self.transfers.remove(&key);
            }
            _ => {}
        }
        Plan {
            holders: offered,
            sources,
        }
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
            t.helpers.retain(|child, _| fetchers.contains_key(child));
            !t.is_empty()
        });
    }

    /// Number of versions with fetches in flight.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.transfers.len()
    }
}
