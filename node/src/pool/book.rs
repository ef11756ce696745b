//! Pool bookkeeping as plain data: which peers are connecting or ready, who waits for a dial,
//! which idle link to evict. The `NodeActor` is a thin shell over this; it is tested here
//! without actors or sockets.
//!
//! Rules (learned by iroh's own pool): concurrent requests for a new peer share one dial
//! (`Connecting { waiters }`); generation numbers make events from an old dial harmless;
//! dials in flight do not count toward the cap; only idle links (no stream open in either
//! direction: served streams count as uses) are evicted, least recently used first, and a
//! link is closed by a compare-and-swap on its use count, so a link that is being closed is
//! never handed out and never serves another stream. An inbound link that finds the pool
//! full of busy links is refused (`Insert::Full`) before anything is served on it.

use std::{collections::HashMap, sync::Arc};

use iroh::EndpointId;

use super::link::LinkShared;

/// A peer's entry in the pool.
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
    },
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
    /// The pool is full of busy links.
    Full { waiter: W },
}

/// What to do with a finished dial or an adopted inbound link.
#[derive(Debug)]
pub(crate) enum Insert<W, H> {
    /// Inserted; reply to these waiters, and close the evicted link if any.
    Inserted {
        waiters: Vec<W>,
        evicted: Option<(EndpointId, H)>,
    },
    /// The dial was superseded (or the peer already has a link): keep the connection unpooled.
    Stale,
    /// At the cap with every link busy: fail these waiters and drop the connection.
    Full { waiters: Vec<W> },
}

/// The pool's state: one slot per peer.
#[derive(Debug)]
pub(crate) struct PoolBook<W, H> {
    slots: HashMap<EndpointId, Slot<W, H>>,
    next_generation: u64,
    max_links: usize,
}

impl<W, H: Clone> PoolBook<W, H> {
    pub(crate) fn new(max_links: usize) -> Self {
        PoolBook {
            slots: HashMap::new(),
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
        if self.ready_count() >= self.max_links && self.lru_idle().is_none() {
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

    /// Whether an inbound link from `peer` should be adopted (no usable link to it yet).
    pub(crate) fn wants_inbound(&self, peer: &EndpointId) -> bool {
        match self.slots.get(peer) {
            None | Some(Slot::Connecting { .. }) => true,
            Some(Slot::Ready { link, .. }) => !link.is_usable(),
        }
    }

    /// Makes room for one more ready link, evicting the least recently used idle one.
    /// `Err(())` when the pool is full of busy links.
    pub(crate) fn make_room(&mut self) -> Result<Option<(EndpointId, H)>, ()> {
        if self.ready_count() < self.max_links {
            return Ok(None);
        }
        // Closing can race with a guard being taken elsewhere; try the next oldest then.
        for _ in 0..self.max_links {
            let Some(peer) = self.lru_idle() else { break };
            let Some(Slot::Ready { handle, link, .. }) = self.slots.get(&peer) else {
                break;
            };
            let handle = handle.clone();
            if link.try_close() {
                self.slots.remove(&peer);
                return Ok(Some((peer, handle)));
            }
        }
        Err(())
    }

    /// Inserts a ready link for `peer` (a finished dial of `generation`, or an adopted inbound
    /// link when `generation` is `None`) and returns who was waiting for it.
    pub(crate) fn insert_ready(
        &mut self,
        peer: EndpointId,
        generation: Option<u64>,
        handle: H,
        link: Arc<LinkShared>,
    ) -> Insert<W, H> {
        let current = match generation {
            Some(g) => self.is_current_dial(&peer, g),
            None => self.wants_inbound(&peer),
        };
        if !current {
            return Insert::Stale;
        }
        let evicted = match self.make_room() {
            Ok(evicted) => evicted,
            Err(()) => {
                let waiters = match self.slots.remove(&peer) {
                    Some(Slot::Connecting { waiters, .. }) => waiters,
                    _ => Vec::new(),
                };
                return Insert::Full { waiters };
            }
        };
        let generation = self.bump();
        let previous = self.slots.insert(
            peer,
            Slot::Ready {
                generation,
                handle,
                link,
            },
        );
        let waiters = match previous {
            Some(Slot::Connecting { waiters, .. }) => waiters,
            _ => Vec::new(),
        };
        Insert::Inserted { waiters, evicted }
    }

    /// The generation a ready link of `peer` was given (to match its actor's later stop).
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

    /// A link's actor stopped: drop the slot if it still is that link.
    pub(crate) fn link_gone(&mut self, peer: &EndpointId, generation: u64) -> bool {
        if self.ready_generation(peer) == Some(generation) {
            self.slots.remove(peer);
            return true;
        }
        false
    }

    /// Removes everything: ready handles (to close) and waiters (to fail).
    pub(crate) fn drain(&mut self) -> (Vec<H>, Vec<W>) {
        let mut handles = Vec::new();
        let mut waiters = Vec::new();
        for (_, slot) in self.slots.drain() {
            match slot {
                Slot::Ready { handle, .. } => handles.push(handle),
                Slot::Connecting { waiters: w, .. } => waiters.extend(w),
            }
        }
        (handles, waiters)
    }

    fn ready_count(&self) -> usize {
        self.slots
            .values()
            .filter(|s| matches!(s, Slot::Ready { .. }))
            .count()
    }

    fn lru_idle(&self) -> Option<EndpointId> {
        self.slots
            .iter()
            .filter_map(|(peer, slot)| match slot {
                Slot::Ready { link, .. } => link.idle_since().map(|t| (t, *peer)),
                Slot::Connecting { .. } => None,
            })
            .min_by_key(|(t, _)| *t)
            .map(|(_, peer)| peer)
    }

    fn bump(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    type Book = PoolBook<u32, &'static str>;

    fn peer(n: u8) -> EndpointId {
        iroh::SecretKey::from_bytes(&[n; 32]).public()
    }

    fn ready(book: &mut Book, p: EndpointId, at: Instant) -> Arc<LinkShared> {
        let Acquire::Dial { generation } = book.acquire(p, 0) else {
            panic!("expected a dial")
        };
        let link = Arc::new(LinkShared::new(at));
        let Insert::Inserted { waiters, .. } =
            book.insert_ready(p, Some(generation), "h", link.clone())
        else {
            panic!("expected insert")
        };
        assert_eq!(waiters, vec![0]);
        link
    }

    #[test]
    fn concurrent_requests_share_one_dial() {
        let mut book = Book::new(4);
        let p = peer(1);
        let Acquire::Dial { generation } = book.acquire(p, 1) else {
            panic!()
        };
        for w in 2..=200 {
            assert!(matches!(book.acquire(p, w), Acquire::Queued));
        }
        let link = Arc::new(LinkShared::new(Instant::now()));
        let Insert::Inserted { waiters, evicted } =
            book.insert_ready(p, Some(generation), "h", link)
        else {
            panic!()
        };
        assert_eq!(waiters, (1..=200).collect::<Vec<_>>());
        assert!(evicted.is_none());
        assert!(matches!(
            book.acquire(p, 201),
            Acquire::Reuse { waiter: 201, .. }
        ));
    }

    #[test]
    fn stale_dial_results_are_ignored() {
        let mut book = Book::new(4);
        let p = peer(1);
        let Acquire::Dial { generation } = book.acquire(p, 1) else {
            panic!()
        };
        assert_eq!(book.dial_failed(&p, generation), vec![1]);
        assert!(book.dial_failed(&p, generation).is_empty());
        let link = Arc::new(LinkShared::new(Instant::now()));
        assert!(matches!(
            book.insert_ready(p, Some(generation), "h", link),
            Insert::Stale
        ));
    }

    #[test]
    fn lru_idle_link_is_evicted_at_the_cap() {
        let mut book = Book::new(2);
        let t0 = Instant::now();
        let old = ready(&mut book, peer(1), t0);
        let _newer = ready(&mut book, peer(2), t0 + Duration::from_secs(1));
        let Acquire::Dial { generation } = book.acquire(peer(3), 7) else {
            panic!()
        };
        let link = Arc::new(LinkShared::new(t0));
        let Insert::Inserted { evicted, .. } =
            book.insert_ready(peer(3), Some(generation), "h3", link)
        else {
            panic!()
        };
        assert_eq!(evicted.map(|(p, _)| p), Some(peer(1)));
        assert!(!old.is_usable(), "evicted link is closed");
    }

    #[test]
    fn busy_pool_is_full() {
        let mut book = Book::new(1);
        let link = ready(&mut book, peer(1), Instant::now());
        assert!(link.try_acquire());
        assert!(matches!(
            book.acquire(peer(2), 9),
            Acquire::Full { waiter: 9 }
        ));
        assert!(link.release(Instant::now()));
        assert!(matches!(book.acquire(peer(2), 9), Acquire::Dial { .. }));
    }

    #[test]
    fn a_link_being_used_at_dial_completion_makes_the_pool_full() {
        let mut book = Book::new(1);
        let link = ready(&mut book, peer(1), Instant::now());
        let Acquire::Dial { generation } = book.acquire(peer(2), 5) else {
            panic!()
        };
        assert!(link.try_acquire(), "became busy while dialing");
        let new = Arc::new(LinkShared::new(Instant::now()));
        match book.insert_ready(peer(2), Some(generation), "h2", new) {
            Insert::Full { waiters } => assert_eq!(waiters, vec![5]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn gone_links_are_removed_only_for_their_generation() {
        let mut book = Book::new(2);
        let p = peer(1);
        ready(&mut book, p, Instant::now());
        let generation = book.ready_generation(&p).expect("ready");
        assert!(!book.link_gone(&p, generation + 100));
        assert!(book.link_gone(&p, generation));
        assert!(matches!(book.acquire(p, 1), Acquire::Dial { .. }));
    }

    #[test]
    fn closed_link_is_never_handed_out() {
        let mut book = Book::new(2);
        let p = peer(1);
        let link = ready(&mut book, p, Instant::now());
        assert!(link.try_close());
        assert!(matches!(book.acquire(p, 1), Acquire::Dial { .. }));
    }

    /// Regression: streams a node *serves* took no use of the link, so a link the peer was
    /// pulling through looked idle and was evicted under it.
    #[test]
    fn a_link_with_served_streams_is_not_evictable() {
        let mut book = Book::new(1);
        let link = ready(&mut book, peer(1), Instant::now());
        // The serving side takes a use per stream it serves, as our own requests do.
        assert!(link.try_acquire(), "a served stream holds the link");
        assert!(book.make_room().is_err(), "nothing to evict");
        assert!(matches!(
            book.acquire(peer(2), 9),
            Acquire::Full { waiter: 9 }
        ));
        assert!(!link.try_close(), "the idle close fails too");
        assert!(link.release(Instant::now()));
        assert!(matches!(book.make_room(), Ok(Some((p, _))) if p == peer(1)));
        assert!(!link.is_usable(), "evicted once the stream ended");
    }

    #[test]
    fn lru_skips_links_in_use_by_either_side() {
        let mut book = Book::new(3);
        let t0 = Instant::now();
        let ours = ready(&mut book, peer(1), t0);
        let theirs = ready(&mut book, peer(2), t0 + Duration::from_secs(1));
        let idle = ready(&mut book, peer(3), t0 + Duration::from_secs(2));
        assert!(ours.try_acquire(), "a request of ours");
        assert!(
            theirs.try_acquire(),
            "a stream the peer opened, being served"
        );
        let Acquire::Dial { generation } = book.acquire(peer(4), 7) else {
            panic!("an idle link makes room")
        };
        let new = Arc::new(LinkShared::new(t0));
        let Insert::Inserted { evicted, waiters } =
            book.insert_ready(peer(4), Some(generation), "h4", new)
        else {
            panic!("expected insert")
        };
        assert_eq!(waiters, vec![7]);
        assert_eq!(
            evicted.map(|(p, _)| p),
            Some(peer(3)),
            "the newest but only idle link goes, not the older busy ones"
        );
        assert!(ours.is_usable() && theirs.is_usable());
        assert!(!idle.is_usable());
    }

    #[test]
    fn a_full_pool_refuses_an_inbound_link() {
        let mut book = Book::new(1);
        let busy = ready(&mut book, peer(1), Instant::now());
        assert!(busy.try_acquire());
        let inbound = Arc::new(LinkShared::new(Instant::now()));
        match book.insert_ready(peer(2), None, "in", inbound) {
            Insert::Full { waiters } => assert!(waiters.is_empty()),
            other => panic!("expected Full, got {other:?}"),
        }
        assert_eq!(book.ready_count(), 1, "the busy link stays, alone");
        assert!(busy.is_usable());
    }

    #[test]
    fn inbound_links_are_adopted_only_without_a_usable_link() {
        let mut book = Book::new(2);
        let p = peer(1);
        let link = Arc::new(LinkShared::new(Instant::now()));
        assert!(matches!(
            book.insert_ready(p, None, "in", link),
            Insert::Inserted { .. }
        ));
        let second = Arc::new(LinkShared::new(Instant::now()));
        assert!(matches!(
            book.insert_ready(p, None, "in2", second),
            Insert::Stale
        ));
        assert_eq!(
            book.ready_count(),
            1,
            "the second inbound link is not pooled"
        );
    }
}
