//! Pool bookkeeping as plain data: which peers are connecting or linked, who waits for a dial,
//! which link of a pair is pooled, which idle peer to evict. The `PoolActor` is a thin shell
//! over this; it is tested here without actors or sockets.
//!
//! Rules (learned by iroh's own pool): concurrent requests for a new peer share one dial
//! (`Connecting { waiters }`); generation numbers make events from an old dial harmless;
//! dials in flight do not count toward the cap; only idle peers (no stream open on any of
//! their links, in either direction: served streams count as uses) are evicted, least
//! recently used first, and a link is closed by a compare-and-swap on its use count, so a
//! link that is being closed is never handed out and never serves another stream. A new
//! peer's link that finds the pool full of busy peers is refused (`Insert::Full`) before
//! anything is served on it.
//!
//! Links per peer: a peer may hold several links (both sides dialed at once, a restarted
//! process dialing again, a member that dials on purpose). One is pooled; the others are
//! *superseded*: still served while in use, closed by their actor once idle. Which one is
//! pooled is decided the same way on both sides, so a pair converges on one link: of two
//! links dialed by the same node the newer wins (a restarted peer's new link replaces its old
//! one), of two dialed by different nodes the one the lower node id dialed wins. A peer holds
//! at most [`MAX_LINKS_PER_PEER`] live links: a new one past that closes the peer's oldest
//! superseded links (idle ones first), so the excess is always the peer's own, never another
//! peer's, and an honest reconnect always gets in. The pool's cap (`LinkConfig::max_links`)
//! counts peers holding at least one live link, so a node holds at most `max_links x
//! MAX_LINKS_PER_PEER` links.

use std::{collections::HashMap, sync::Arc, time::Instant};

use iroh::EndpointId;

use super::{MAX_LINKS_PER_PEER, link::LinkShared};

/// A peer's pool slot: a dial in flight, or its pooled link.
#[derive(Debug)]
enum Slot<W, H> {
    Connecting {
        generation: u64,
        waiters: Vec<W>,
    },
    Ready {
        generation: u64,
        handle: H,
        link: Arc<LinkShared>,
        /// Whether this node dialed it (decides which of two links a pair keeps).
        ours: bool,
    },
}

/// A superseded link: kept, unpooled, until its actor closes it once idle.
#[derive(Debug)]
struct Extra<H> {
    generation: u64,
    handle: H,
    link: Arc<LinkShared>,
}

/// Where a new link came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Our dial of this generation.
    Dial(u64),
    /// The peer dialed us.
    Inbound,
}

/// What `acquire` decided.
#[derive(Debug)]
pub(crate) enum Acquire<W, H> {
    /// A ready link: reply to the waiter with a guard on it.
    Reuse { waiter: W, handle: H },
    /// A dial is already in flight; the waiter was queued on it.
    Queued,
    /// Start a dial with this generation; the waiter was queued on it.
    Dial { generation: u64 },
    /// The pool is full of busy peers.
    Full { waiter: W },
}

/// What to do with a finished dial or an adopted inbound link.
#[derive(Debug)]
pub(crate) enum Insert<W, H> {
    /// Pooled under `generation`: reply to `waiters`; close the `evicted` links (LRU, to make
    /// room); tell the link this one replaced (`superseded`) to close once idle; close the
    /// `over_cap` links (the peer's oldest, past [`MAX_LINKS_PER_PEER`]).
    Pooled {
        generation: u64,
        waiters: Vec<W>,
        evicted: Vec<(EndpointId, H)>,
        superseded: Option<H>,
        over_cap: Vec<H>,
    },
    /// Kept unpooled under `generation` (the peer's pooled link is preferred): served while
    /// in use, closed once idle; close the `over_cap` links.
    Superseded { generation: u64, over_cap: Vec<H> },
    /// A new peer while every pooled peer is busy: fail these waiters and close the link
    /// (and the `evicted` links, closed while looking for room).
    Full {
        waiters: Vec<W>,
        evicted: Vec<(EndpointId, H)>,
    },
}

/// The pool's state: one slot per peer, and the superseded links each peer still holds.
#[derive(Debug)]
pub(crate) struct PoolBook<W, H> {
    me: EndpointId,
    slots: HashMap<EndpointId, Slot<W, H>>,
    /// Oldest first; a peer's entry goes with its last superseded link.
    superseded: HashMap<EndpointId, Vec<Extra<H>>>,
    next_generation: u64,
    max_links: usize,
}

impl<W, H: Clone> PoolBook<W, H> {
    /// An empty book for the node `me` (its id breaks ties between a pair's links), pooling
    /// at most `max_links` peers.
    pub(crate) fn new(me: EndpointId, max_links: usize) -> Self {
        PoolBook {
            me,
            slots: HashMap::new(),
            superseded: HashMap::new(),
            next_generation: 0,
            max_links: max_links.max(1),
        }
    }

    /// Decides how to serve a request for a link to `peer`.
    pub(crate) fn acquire(&mut self, peer: EndpointId, waiter: W) -> Acquire<W, H> {
        match self.slots.get_mut(&peer) {
            Some(Slot::Ready { handle, link, .. }) if link.is_usable() => {
                return Acquire::Reuse {
                    waiter,
                    handle: handle.clone(),
                };
            }
            Some(Slot::Connecting { waiters, .. }) => {
                waiters.push(waiter);
                return Acquire::Queued;
            }
            Some(Slot::Ready { .. }) => {
                // Closed or dead: its actor's stop will be ignored by generation. Redial.
                self.slots.remove(&peer);
            }
            None => {}
        }
        if !self.occupies(&peer) && self.occupancy() >= self.max_links && self.lru_idle().is_none()
        {
            return Acquire::Full { waiter };
        }
        let generation = self.bump();
        self.slots.insert(
            peer,
            Slot::Connecting {
                generation,
                waiters: vec![waiter],
            },
        );
        Acquire::Dial { generation }
    }

    /// Whether a finished dial of `generation` is still the one `peer` waits for.
    pub(crate) fn is_current_dial(&self, peer: &EndpointId, generation: u64) -> bool {
        matches!(self.slots.get(peer), Some(Slot::Connecting { generation: g, .. }) if *g == generation)
    }

    /// Makes room for one more peer, evicting the least recently used idle ones (all their
    /// links). Returns the links closed, and whether there is room now.
    fn make_room(&mut self) -> (Vec<(EndpointId, H)>, bool) {
        let mut evicted = Vec::new();
        // Closing can race with a guard being taken elsewhere; try the next oldest then.
        for _ in 0..=self.max_links {
            if self.occupancy() < self.max_links {
                return (evicted, true);
            }
            let Some(peer) = self.lru_idle() else { break };
            evicted.extend(self.close_idle_links(&peer).into_iter().map(|h| (peer, h)));
        }
        (evicted, self.occupancy() < self.max_links)
    }

    /// Closes every idle link of `peer` (forgetting dead ones) and returns their handles.
    fn close_idle_links(&mut self, peer: &EndpointId) -> Vec<H> {
        let mut closed = Vec::new();
        if let Some(Slot::Ready { handle, link, .. }) = self.slots.get(peer) {
            let (handle, usable) = (handle.clone(), link.is_usable());
            if link.try_close() {
                closed.push(handle);
                self.slots.remove(peer);
            } else if !usable {
                self.slots.remove(peer);
            }
        }
        if let Some(extras) = self.superseded.get_mut(peer) {
            extras.retain(|e| {
                if e.link.try_close() {
                    closed.push(e.handle.clone());
                    return false;
                }
                e.link.is_usable()
            });
        }
        self.drop_empty(peer);
        closed
    }

    /// Puts a new link to `peer` in the book: pooled (replacing a pooled link it wins over,
    /// which becomes superseded), or superseded, or refused when it is a new peer and the
    /// pool is full of busy peers; then holds the peer to [`MAX_LINKS_PER_PEER`].
    pub(crate) fn insert_ready(
        &mut self,
        peer: EndpointId,
        origin: Origin,
        handle: H,
        link: Arc<LinkShared>,
    ) -> Insert<W, H> {
        let ours = matches!(origin, Origin::Dial(_));
        let current = matches!(origin, Origin::Dial(g) if self.is_current_dial(&peer, g));
        let pool_it = current
            || match self.slots.get(&peer) {
                Some(Slot::Ready {
                    link: pooled,
                    ours: pooled_ours,
                    ..
                }) if pooled.is_usable() => self.new_wins(&peer, ours, *pooled_ours),
                _ => true,
            };
        if !pool_it {
            let generation = self.bump();
            self.superseded.entry(peer).or_default().push(Extra {
                generation,
                handle,
                link,
            });
            let over_cap = self.enforce_cap(&peer);
            return Insert::Superseded {
                generation,
                over_cap,
            };
        }
        let mut evicted = Vec::new();
        if !self.occupies(&peer) {
            let (closed, room) = self.make_room();
            evicted = closed;
            if !room {
                let connecting = matches!(self.slots.get(&peer), Some(Slot::Connecting { .. }));
                let waiters = match connecting.then(|| self.slots.remove(&peer)).flatten() {
                    Some(Slot::Connecting { waiters, .. }) => waiters,
                    _ => Vec::new(),
                };
                return Insert::Full { waiters, evicted };
            }
        }
        let generation = self.bump();
        let slot = Slot::Ready {
            generation,
            handle,
            link,
            ours,
        };
        let (waiters, superseded) = match self.slots.insert(peer, slot) {
            Some(Slot::Connecting { waiters, .. }) => (waiters, None),
            Some(Slot::Ready {
                generation,
                handle,
                link,
                ..
            }) if link.is_usable() => {
                let old = handle.clone();
                let extra = Extra {
                    generation,
                    handle,
                    link,
                };
                self.superseded.entry(peer).or_default().push(extra);
                (Vec::new(), Some(old))
            }
            _ => (Vec::new(), None),
        };
        let over_cap = self.enforce_cap(&peer);
        Insert::Pooled {
            generation,
            waiters,
            evicted,
            superseded,
            over_cap,
        }
    }

    /// Whether a new link (`ours`: we dialed it) wins the pool slot over a usable pooled one
    /// (`pooled_ours`). Both sides of a pair decide alike: of two links one node dialed, the
    /// newer; else the one the lower node id dialed.
    fn new_wins(&self, peer: &EndpointId, ours: bool, pooled_ours: bool) -> bool {
        if ours == pooled_ours {
            return true;
        }
        let i_am_lower = self.me < *peer;
        ours == i_am_lower
    }

    /// Holds `peer` to [`MAX_LINKS_PER_PEER`] live links: closes its oldest superseded links
    /// past the cap, idle ones first, and returns them (marked unusable already).
    fn enforce_cap(&mut self, peer: &EndpointId) -> Vec<H> {
        let pooled = usize::from(matches!(
            self.slots.get(peer),
            Some(Slot::Ready { link, .. }) if link.is_usable()
        ));
        let Some(extras) = self.superseded.get_mut(peer) else {
            return Vec::new();
        };
        extras.retain(|e| e.link.is_usable());
        let mut excess = (pooled + extras.len()).saturating_sub(MAX_LINKS_PER_PEER);
        let mut closed = Vec::new();
        // Idle ones first (oldest first), then the oldest busy ones: the peer's own streams.
        extras.retain(|e| {
            if excess > 0 && e.link.try_close() {
                excess -= 1;
                closed.push(e.handle.clone());
                return false;
            }
            true
        });
        extras.retain(|e| {
            if excess > 0 {
                excess -= 1;
                e.link.mark_dead();
                closed.push(e.handle.clone());
                return false;
            }
            true
        });
        self.drop_empty(peer);
        closed
    }

    /// The generation a pooled link of `peer` was given.
    #[cfg(test)]
    pub(crate) fn ready_generation(&self, peer: &EndpointId) -> Option<u64> {
        match self.slots.get(peer) {
            Some(Slot::Ready { generation, .. }) => Some(*generation),
            _ => None,
        }
    }

    /// A dial failed: forget it and return its waiters (if it was still current).
    pub(crate) fn dial_failed(&mut self, peer: &EndpointId, generation: u64) -> Vec<W> {
        if !self.is_current_dial(peer, generation) {
            return Vec::new();
        }
        match self.slots.remove(peer) {
            Some(Slot::Connecting { waiters, .. }) => waiters,
            _ => Vec::new(),
        }
    }

    /// The link of `generation` to `peer` stopped: forget it (stale generations change
    /// nothing). Returns whether `peer` holds no link any more.
    pub(crate) fn link_gone(&mut self, peer: &EndpointId, generation: u64) -> bool {
        if matches!(self.slots.get(peer), Some(Slot::Ready { generation: g, .. }) if *g == generation)
        {
            self.slots.remove(peer);
        }
        if let Some(extras) = self.superseded.get_mut(peer) {
            extras.retain(|e| e.generation != generation);
        }
        self.drop_empty(peer);
        self.link_of(peer).is_none()
    }

    /// A live link of `peer`: the pooled one, else its newest superseded one.
    pub(crate) fn link_of(&self, peer: &EndpointId) -> Option<&H> {
        if let Some(Slot::Ready { handle, link, .. }) = self.slots.get(peer)
            && link.is_usable()
        {
            return Some(handle);
        }
        let extras = self.superseded.get(peer)?;
        extras
            .iter()
            .rev()
            .find(|e| e.link.is_usable())
            .map(|e| &e.handle)
    }

    /// Superseded links held now, over every peer.
    pub(crate) fn superseded_count(&self) -> usize {
        self.superseded.values().map(Vec::len).sum()
    }

    /// Removes everything: link handles (to close) and waiters (to fail).
    pub(crate) fn drain(&mut self) -> (Vec<H>, Vec<W>) {
        let mut handles = Vec::new();
        let mut waiters = Vec::new();
        for (_, slot) in self.slots.drain() {
            match slot {
                Slot::Ready { handle, .. } => handles.push(handle),
                Slot::Connecting { waiters: w, .. } => waiters.extend(w),
            }
        }
        for (_, extras) in self.superseded.drain() {
            handles.extend(extras.into_iter().map(|e| e.handle));
        }
        (handles, waiters)
    }

    /// Whether `peer` holds a live link (and so counts toward the cap already).
    fn occupies(&self, peer: &EndpointId) -> bool {
        self.link_of(peer).is_some()
    }

    /// Peers holding at least one live link: what the cap counts.
    fn occupancy(&self) -> usize {
        let pooled = self.slots.iter().filter(|(peer, slot)| {
            matches!(slot, Slot::Ready { link, .. } if link.is_usable())
                || self.has_live_extra(peer)
        });
        let only_superseded = self
            .superseded
            .keys()
            .filter(|peer| !self.slots.contains_key(*peer) && self.has_live_extra(peer));
        pooled.count() + only_superseded.count()
    }

    fn has_live_extra(&self, peer: &EndpointId) -> bool {
        self.superseded
            .get(peer)
            .is_some_and(|extras| extras.iter().any(|e| e.link.is_usable()))
    }

    /// The least recently used peer none of whose live links is in use.
    fn lru_idle(&self) -> Option<EndpointId> {
        let peers = self.slots.keys().chain(self.superseded.keys());
        peers
            .filter_map(|peer| self.idle_since(peer).map(|t| (t, *peer)))
            .min_by_key(|(t, _)| *t)
            .map(|(_, peer)| peer)
    }

    /// When `peer` last used any of its live links, if it uses none now (`None` also when it
    /// holds no live link).
    fn idle_since(&self, peer: &EndpointId) -> Option<Instant> {
        let pooled = match self.slots.get(peer) {
            Some(Slot::Ready { link, .. }) => Some(link),
            _ => None,
        };
        let extras = self.superseded.get(peer).into_iter().flatten();
        let links = pooled.into_iter().chain(extras.map(|e| &e.link));
        let mut latest = None;
        for link in links.filter(|l| l.is_usable()) {
            let since = link.idle_since()?;
            latest = latest.max(Some(since));
        }
        latest
    }

    fn drop_empty(&mut self, peer: &EndpointId) {
        if self.superseded.get(peer).is_some_and(Vec::is_empty) {
            self.superseded.remove(peer);
        }
    }

    fn bump(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }
}

#[cfg(test)]
mod tests;
