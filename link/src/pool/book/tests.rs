use std::time::{Duration, Instant};

use super::*;

type Book = PoolBook<u32, &'static str>;

fn peer(n: u8) -> EndpointId {
    iroh::SecretKey::from_bytes(&[n; 32]).public()
}

/// A book for a node whose id sorts below every `peer(n)`'s or above, as asked.
fn book(max_links: usize) -> Book {
    Book::new(peer(0), max_links)
}

fn shared(at: Instant) -> Arc<LinkShared> {
    Arc::new(LinkShared::new(at))
}

fn ready(book: &mut Book, p: EndpointId, at: Instant) -> Arc<LinkShared> {
    let Acquire::Dial { generation } = book.acquire(p, 0) else {
        panic!("expected a dial")
    };
    let link = shared(at);
    let Insert::Pooled { waiters, .. } =
        book.insert_ready(p, Origin::Dial(generation), "h", link.clone())
    else {
        panic!("expected insert")
    };
    assert_eq!(waiters, vec![0]);
    link
}

fn evicted_peers<H>(evicted: &[(EndpointId, H)]) -> Vec<EndpointId> {
    evicted.iter().map(|(p, _)| *p).collect()
}

#[test]
fn concurrent_requests_share_one_dial() {
    let mut book = book(4);
    let p = peer(1);
    let Acquire::Dial { generation } = book.acquire(p, 1) else {
        panic!()
    };
    for w in 2..=200 {
        assert!(matches!(book.acquire(p, w), Acquire::Queued));
    }
    let link = shared(Instant::now());
    let Insert::Pooled {
        waiters, evicted, ..
    } = book.insert_ready(p, Origin::Dial(generation), "h", link)
    else {
        panic!()
    };
    assert_eq!(waiters, (1..=200).collect::<Vec<_>>());
    assert!(evicted.is_empty());
    assert!(matches!(
        book.acquire(p, 201),
        Acquire::Reuse { waiter: 201, .. }
    ));
}

#[test]
fn stale_dial_results_are_ignored() {
    let mut book = book(4);
    let p = peer(1);
    let Acquire::Dial { generation } = book.acquire(p, 1) else {
        panic!()
    };
    assert_eq!(book.dial_failed(&p, generation), vec![1]);
    assert!(book.dial_failed(&p, generation).is_empty());
}

#[test]
fn lru_idle_link_is_evicted_at_the_cap() {
    let mut book = book(2);
    let t0 = Instant::now();
    let old = ready(&mut book, peer(1), t0);
    let _newer = ready(&mut book, peer(2), t0 + Duration::from_secs(1));
    let Acquire::Dial { generation } = book.acquire(peer(3), 7) else {
        panic!()
    };
    let Insert::Pooled { evicted, .. } =
        book.insert_ready(peer(3), Origin::Dial(generation), "h3", shared(t0))
    else {
        panic!()
    };
    assert_eq!(evicted_peers(&evicted), vec![peer(1)]);
    assert!(!old.is_usable(), "evicted link is closed");
}

#[test]
fn busy_pool_is_full() {
    let mut book = book(1);
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
    let mut book = book(1);
    let link = ready(&mut book, peer(1), Instant::now());
    let Acquire::Dial { generation } = book.acquire(peer(2), 5) else {
        panic!()
    };
    assert!(link.try_acquire(), "became busy while dialing");
    let new = shared(Instant::now());
    match book.insert_ready(peer(2), Origin::Dial(generation), "h2", new) {
        Insert::Full { waiters, evicted } => {
            assert_eq!(waiters, vec![5]);
            assert!(evicted.is_empty());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn gone_links_are_removed_only_for_their_generation() {
    let mut book = book(2);
    let p = peer(1);
    ready(&mut book, p, Instant::now());
    let generation = book.ready_generation(&p).expect("ready");
    assert!(!book.link_gone(&p, generation + 100), "still linked");
    assert!(book.link_gone(&p, generation), "its last link went");
    assert!(matches!(book.acquire(p, 1), Acquire::Dial { .. }));
}

#[test]
fn closed_link_is_never_handed_out() {
    let mut book = book(2);
    let p = peer(1);
    let link = ready(&mut book, p, Instant::now());
    assert!(link.try_close());
    assert!(matches!(book.acquire(p, 1), Acquire::Dial { .. }));
}

/// Regression: streams a node *serves* took no use of the link, so a link the peer was
/// pulling through looked idle and was evicted under it.
#[test]
fn a_link_with_served_streams_is_not_evictable() {
    let mut book = book(1);
    let link = ready(&mut book, peer(1), Instant::now());
    // The serving side takes a use per stream it serves, as our own requests do.
    assert!(link.try_acquire(), "a served stream holds the link");
    assert!(!book.make_room().1, "nothing to evict");
    assert!(matches!(
        book.acquire(peer(2), 9),
        Acquire::Full { waiter: 9 }
    ));
    assert!(!link.try_close(), "the idle close fails too");
    assert!(link.release(Instant::now()));
    let (evicted, room) = book.make_room();
    assert!(room);
    assert_eq!(evicted_peers(&evicted), vec![peer(1)]);
    assert!(!link.is_usable(), "evicted once the stream ended");
}

#[test]
fn lru_skips_links_in_use_by_either_side() {
    let mut book = book(3);
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
    let Insert::Pooled {
        evicted, waiters, ..
    } = book.insert_ready(peer(4), Origin::Dial(generation), "h4", shared(t0))
    else {
        panic!("expected insert")
    };
    assert_eq!(waiters, vec![7]);
    assert_eq!(
        evicted_peers(&evicted),
        vec![peer(3)],
        "the newest but only idle link goes, not the older busy ones"
    );
    assert!(ours.is_usable() && theirs.is_usable());
    assert!(!idle.is_usable());
}

#[test]
fn a_full_pool_refuses_an_inbound_link() {
    let mut book = book(1);
    let busy = ready(&mut book, peer(1), Instant::now());
    assert!(busy.try_acquire());
    let inbound = shared(Instant::now());
    match book.insert_ready(peer(2), Origin::Inbound, "in", inbound) {
        Insert::Full { waiters, .. } => assert!(waiters.is_empty()),
        other => panic!("expected Full, got {other:?}"),
    }
    assert_eq!(book.occupancy(), 1, "the busy link stays, alone");
    assert!(busy.is_usable());
}

/// Both sides dial at once: each keeps pooled the link the lower node id dialed, so the
/// pair converges on one link and the other is only superseded (closed once idle).
#[test]
fn a_pair_that_dialed_each_other_pools_the_same_link() {
    let (low, high) = (peer(1).min(peer(2)), peer(1).max(peer(2)));
    // On `low`: its own dial is pooled first, then `high`'s arrives.
    let mut on_low = Book::new(low, 4);
    let Acquire::Dial { generation } = on_low.acquire(high, 1) else {
        panic!()
    };
    let own = shared(Instant::now());
    let pooled = on_low.insert_ready(high, Origin::Dial(generation), "low's", own.clone());
    assert!(matches!(pooled, Insert::Pooled { .. }));
    let theirs = shared(Instant::now());
    let kept = on_low.insert_ready(high, Origin::Inbound, "high's", theirs);
    assert!(matches!(kept, Insert::Superseded { .. }), "{kept:?}");
    assert!(matches!(
        on_low.acquire(high, 2),
        Acquire::Reuse {
            handle: "low's",
            ..
        }
    ));
    // On `high`: its own dial is pooled first, then `low`'s arrives and wins.
    let mut on_high = Book::new(high, 4);
    let Acquire::Dial { generation } = on_high.acquire(low, 1) else {
        panic!()
    };
    let own = shared(Instant::now());
    let pooled = on_high.insert_ready(low, Origin::Dial(generation), "high's", own.clone());
    assert!(matches!(pooled, Insert::Pooled { .. }));
    let theirs = shared(Instant::now());
    match on_high.insert_ready(low, Origin::Inbound, "low's", theirs) {
        Insert::Pooled { superseded, .. } => assert_eq!(superseded, Some("high's")),
        other => panic!("expected the lower id's link pooled, got {other:?}"),
    }
    assert!(matches!(
        on_high.acquire(low, 2),
        Acquire::Reuse {
            handle: "low's",
            ..
        }
    ));
    assert!(
        own.is_usable(),
        "superseded, still usable by what runs on it"
    );
}

/// A restarted peer dials again while its old link still looks usable here: the new
/// link is pooled and the old one superseded.
#[test]
fn a_reconnecting_peer_s_new_link_replaces_its_old_one() {
    let mut book = book(4);
    let p = peer(1);
    let old = shared(Instant::now());
    let first = book.insert_ready(p, Origin::Inbound, "old", old.clone());
    assert!(matches!(first, Insert::Pooled { .. }));
    assert!(old.try_acquire(), "a stream of the old process, stuck");
    match book.insert_ready(p, Origin::Inbound, "new", shared(Instant::now())) {
        Insert::Pooled {
            superseded,
            over_cap,
            ..
        } => {
            assert_eq!(superseded, Some("old"));
            assert!(over_cap.is_empty());
        }
        other => panic!("expected the new link pooled, got {other:?}"),
    }
    assert!(matches!(
        book.acquire(p, 1),
        Acquire::Reuse { handle: "new", .. }
    ));
}

/// A peer that opens link after link holds at most `MAX_LINKS_PER_PEER`: each one past
/// the cap closes its oldest superseded link, an idle one first, a busy one if none is.
#[test]
fn a_peer_holds_at_most_the_per_peer_cap_of_links() {
    let mut book = book(64);
    let p = peer(1);
    let names = ["l0", "l1", "l2", "l3", "l4", "l5", "l6", "l7", "l8", "l9"];
    let mut links = Vec::new();
    let mut closed = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let link = shared(Instant::now());
        // All busy but l1, which the peer left idle.
        if i != 1 {
            assert!(link.try_acquire());
        }
        links.push(link.clone());
        match book.insert_ready(p, Origin::Inbound, name, link) {
            Insert::Pooled { over_cap, .. } => closed.extend(over_cap),
            other => panic!("{other:?}"),
        }
        let live = links.iter().filter(|l| l.is_usable()).count();
        assert!(live <= MAX_LINKS_PER_PEER, "{live} live after {name}");
    }
    assert_eq!(closed.len(), names.len() - MAX_LINKS_PER_PEER);
    assert_eq!(closed[0], "l1", "the idle one went first");
    assert_eq!(
        &closed[1..],
        &["l0", "l2", "l3", "l4", "l5"],
        "then the oldest"
    );
    assert!(matches!(
        book.acquire(p, 1),
        Acquire::Reuse { handle: "l9", .. }
    ));
    assert_eq!(book.superseded_count(), MAX_LINKS_PER_PEER - 1);
    assert_eq!(book.occupancy(), 1, "one peer, however many links");
}

/// A peer's superseded links keep it linked after its pooled link goes, and count
/// toward the pool's cap; it is evicted only when all of them are idle.
#[test]
fn superseded_links_count_toward_the_cap_until_the_last_goes() {
    let mut book = book(1);
    let p = peer(1);
    let t0 = Instant::now();
    book.insert_ready(p, Origin::Inbound, "a", shared(t0));
    let Insert::Pooled { generation, .. } = book.insert_ready(p, Origin::Inbound, "b", shared(t0))
    else {
        panic!()
    };
    let older = book.superseded[&p][0].generation;
    let busy = book.superseded[&p][0].link.clone();
    assert!(busy.try_acquire(), "the superseded link is in use");
    assert!(
        !book.link_gone(&p, generation),
        "the superseded link is left"
    );
    assert!(
        matches!(book.acquire(peer(2), 1), Acquire::Full { .. }),
        "the peer still holds the one slot, busy"
    );
    assert!(busy.release(Instant::now()));
    assert!(matches!(book.acquire(peer(2), 1), Acquire::Dial { .. }));
    assert!(book.link_gone(&p, older), "its last link went");
    assert!(
        book.superseded.is_empty(),
        "nothing kept for a peer with no link"
    );
}

#[test]
fn evicting_a_peer_closes_all_its_idle_links() {
    let mut book = book(1);
    let p = peer(1);
    let (a, b) = (shared(Instant::now()), shared(Instant::now()));
    book.insert_ready(p, Origin::Inbound, "a", a.clone());
    book.insert_ready(p, Origin::Inbound, "b", b.clone());
    let Insert::Pooled { evicted, .. } =
        book.insert_ready(peer(2), Origin::Inbound, "c", shared(Instant::now()))
    else {
        panic!("room made")
    };
    let mut handles: Vec<_> = evicted.iter().map(|(_, h)| *h).collect();
    handles.sort();
    assert_eq!(handles, vec!["a", "b"]);
    assert!(!a.is_usable() && !b.is_usable());
    assert_eq!(book.occupancy(), 1);
}
