//! Rules of look-ups: who is offered, which errors, and how fetches fan out.

use std::collections::BTreeMap;

use tb_proto::{RegistryOp, Role, Stamp};

use super::*;
use crate::{
    BrokerConfig,
    state::tests::{BROKER, broker_with, id, meta, name, stamp},
};

fn nodes(h: &Holders) -> Vec<(NodeId, bool)> {
    h.holders.iter().map(|h| (h.node, h.complete)).collect()
}

#[test]
fn lookup_offers_live_reachable_holders_but_never_the_asker() {
    let mut b = broker_with(&[1, 2, 3], 0);
    let w = name("m/w");
    b.publish(w.clone(), meta(1), id(1), 10);
    for n in [2, 3] {
        let hold = RegistryOp::AddHolder {
            name: w.clone(),
            version: 1,
            node: id(n),
            stamp: Stamp::ZERO,
        };
        b.announce(id(n), hold, 10).expect("hold");
    }
    let found = b.lookup(&w, None, id(2), 20).expect("found");
    assert_eq!(found.version, 1);
    assert_eq!(found.meta, meta(1));
    assert_eq!(nodes(&found), [(id(1), true), (id(3), true)]);
    assert_eq!(found.holders[0].addrs, ["10.0.0.1:4433"]);
    let CtlResponse::Holders { holders, .. } = CtlResponse::from(found) else {
        panic!("not a Holders answer");
    };
    assert_eq!(holders.len(), 2);

    // Worker 1 goes silent and is marked dead; worker 3 loses its addresses.
    for n in [2, 3] {
        b.heartbeat(
            id(n),
            Role::Worker,
            vec![format!("10.0.0.{n}:1")],
            1,
            15_000,
        )
        .expect("hb");
    }
    b.heartbeat(id(3), Role::Worker, vec![], 1, 15_000)
        .expect("hb");
    assert_eq!(b.expire(15_000).members, [id(1)]);
    let found = b.lookup(&w, None, id(9), 15_001).expect("found");
    assert_eq!(nodes(&found), [(id(2), true)]);
    // The only holder asks: nobody else has it.
    assert_eq!(
        b.lookup(&w, None, id(2), 15_002),
        Err(BrokerError::NoHolder {
            name: w.clone(),
            version: 1
        })
    );
}

#[test]
fn lookup_errors_say_what_is_missing() {
    let mut b = broker_with(&[1], 0);
    let w = name("m/w");
    let not_found = |version| BrokerError::NotFound {
        name: w.clone(),
        version,
    };
    assert_eq!(b.lookup(&w, None, id(9), 1), Err(not_found(None)));
    for v in 1..=3 {
        b.publish(w.clone(), meta(v), id(1), 10);
    }
    assert_eq!(b.lookup(&w, Some(4), id(9), 11), Err(not_found(Some(4))));
    assert_eq!(
        b.lookup(&w, Some(1), id(9), 11),
        Err(BrokerError::Evicted {
            name: w.clone(),
            version: 1,
            oldest: 2,
            newest: 3
        })
    );
    // The previous version is still kept, with its own metadata.
    let older = b.lookup(&w, Some(2), id(9), 11).expect("v2");
    assert_eq!((older.version, older.meta), (2, meta(2)));
    // Its holder dropped it: kept, but nobody has it.
    let drop = RegistryOp::RemoveHolder {
        name: w.clone(),
        version: 2,
        node: id(1),
        stamp: Stamp::ZERO,
    };
    b.announce(id(1), drop, 12).expect("drop");
    assert_eq!(
        b.lookup(&w, Some(2), id(8), 13),
        Err(BrokerError::NoHolder {
            name: w.clone(),
            version: 2
        })
    );
    let delete = RegistryOp::Delete {
        name: w.clone(),
        stamp: Stamp::ZERO,
    };
    b.announce(id(1), delete, 14).expect("delete");
    assert_eq!(b.lookup(&w, None, id(9), 15), Err(not_found(None)));
    assert_eq!(b.fetching(&w, 3, id(9), true, 15), Err(not_found(Some(3))));
}

#[test]
fn a_restarted_broker_knows_only_the_newest_metadata() {
    let mut b = broker_with(&[1], 0);
    let w = name("m/w");
    b.publish(w.clone(), meta(1), id(1), 10);
    b.publish(w.clone(), meta(2), id(1), 11);
    let registry = b.registry().clone();
    let mut after = BrokerState::new(BROKER, BrokerConfig::default(), registry, 20);
    assert_eq!(
        after.lookup(&w, Some(1), id(9), 21),
        Err(BrokerError::UnknownMeta {
            name: w.clone(),
            version: 1
        })
    );
    assert_eq!(
        after.lookup(&w, None, id(9), 21).map(|h| h.meta),
        Ok(meta(2))
    );
}

/// Six askers of a new version, one publisher, fan-out 2, each asking after the last.
fn six_askers() -> (BrokerState, Vec<Holders>) {
    let askers = [11, 12, 13, 14, 15, 16];
    let mut all = vec![1];
    all.extend(askers);
    let mut b = broker_with(&all, 0);
    let w = name("m/w");
    b.publish(w.clone(), meta(1), id(1), 10);
    let answers = askers
        .iter()
        .map(|&a| b.lookup(&w, None, id(a), 20).expect("found"))
        .collect();
    (b, answers)
}

/// Who each asker was pointed at first.
fn first_sources(answers: &[Holders]) -> Vec<NodeId> {
    answers.iter().map(|h| h.holders[0].node).collect()
}

#[test]
fn fetches_of_a_new_version_form_a_tree() {
    let (b, answers) = six_askers();
    let firsts = first_sources(&answers);
    assert_eq!(firsts, [id(1), id(1), id(11), id(12), id(13), id(14)]);
    // Nobody is pointed at more than `fanout` times, nobody at itself.
    let mut children: BTreeMap<NodeId, usize> = BTreeMap::new();
    for (i, source) in firsts.iter().enumerate() {
        *children.entry(*source).or_default() += 1;
        assert_ne!(*source, id(11 + i as u8));
    }
    assert!(children.values().all(|&c| c <= b.config().fanout));
    // Later askers learn the earlier ones as sources in flight; the full publisher comes last.
    let last = &answers[5];
    assert!(!last.holders[0].complete);
    assert_eq!(
        last.holders.last().map(|h| (h.node, h.complete)),
        Some((id(1), true))
    );
    assert_eq!(last.holders.len(), 6);
}

#[test]
fn completing_a_fetch_frees_its_slot() {
    let (mut b, _) = six_askers();
    let w = name("m/w");
    // 11 completes: it is a complete holder now, and the publisher has a free slot again.
    let hold = RegistryOp::AddHolder {
        name: w.clone(),
        version: 1,
        node: id(11),
        stamp: Stamp::ZERO,
    };
    b.announce(id(11), hold, 30).expect("hold");
    let next = b.lookup(&w, None, id(17), 31);
    let holders = nodes(&next.expect("found"));
    assert_eq!(&holders[..2], [(id(1), true), (id(11), true)]);

    // 12 gives up: its slot at the publisher frees too, and it is no longer offered.
    b.fetching(&w, 1, id(12), false, 32).expect("stopped");
    let next = b.lookup(&w, None, id(18), 33).expect("found");
    let holders = nodes(&next);
    assert!(!holders.iter().any(|(n, _)| *n == id(12)), "{holders:?}");
    assert_eq!(&holders[..2], [(id(1), true), (id(11), true)]);
}

#[test]
fn stale_fetches_time_out() {
    let (mut b, _) = six_askers();
    let w = name("m/w");
    // 13 refreshes its fetch; everyone else goes quiet past the fetch timeout.
    let timeout = b.config().fetch_timeout_ms;
    b.fetching(&w, 1, id(13), true, 20 + timeout)
        .expect("refresh");
    for n in [1, 13, 19] {
        let addrs = vec![format!("10.0.0.{n}:4433")];
        b.heartbeat(id(n), Role::Worker, addrs, 1, 20 + timeout)
            .expect("hb");
    }
    b.expire(21 + timeout);
    let next = b.lookup(&w, None, id(19), 22 + timeout).expect("found");
    assert_eq!(nodes(&next), [(id(1), true), (id(13), false)]);
    // The version's fetches are forgotten once it is no longer kept.
    b.publish(w.clone(), meta(2), id(1), 23 + timeout);
    b.publish(w.clone(), meta(3), id(1), 24 + timeout);
    assert_eq!(b.fanout.len(), 0);
}

#[test]
fn a_retry_is_never_pointed_at_its_own_fetchers() {
    let (mut b, answers) = six_askers();
    let w = name("m/w");
    // 11 feeds 13, which feeds 15. 11 retries: neither may be its source.
    assert_eq!(first_sources(&answers)[2..5], [id(11), id(12), id(13)]);
    let retry = b.lookup(&w, None, id(11), 40).expect("found");
    let offered: Vec<NodeId> = retry.holders.iter().map(|h| h.node).collect();
    assert!(
        !offered.contains(&id(13)) && !offered.contains(&id(15)),
        "{offered:?}"
    );
    assert!(!offered.contains(&id(11)));
    assert_eq!(
        offered[0],
        id(1),
        "its old slot at the publisher was freed first"
    );
}

#[test]
fn reported_fetches_are_offered_in_flight() {
    let mut b = broker_with(&[1, 2, 3], 0);
    let w = name("m/w");
    b.publish(w.clone(), meta(1), id(1), 10);
    b.fetching(&w, 1, id(2), true, 11).expect("fetching");
    // A holder reporting a fetch is not in flight: it is complete.
    b.fetching(&w, 1, id(1), true, 11).expect("fetching");
    let found = b.lookup(&w, None, id(3), 12).expect("found");
    assert_eq!(nodes(&found), [(id(1), true), (id(2), false)]);
    // A remote holder mark (gossip from another broker) completes the fetch too.
    let hold = RegistryOp::AddHolder {
        name: w.clone(),
        version: 1,
        node: id(2),
        stamp: stamp(13, 7),
    };
    b.remote_op(&hold, 13).expect("applied");
    let found = b.lookup(&w, None, id(3), 14).expect("found");
    assert_eq!(nodes(&found), [(id(1), true), (id(2), true)]);
}

/// Metadata of a tensor large enough to be fanned out bandwidth first.
fn large_meta(tag: u8) -> TensorMeta {
    let len = BrokerConfig::default().chain_min_bytes;
    let hash = tb_proto::ContentHash([tag; 32]);
    TensorMeta::new(tb_proto::DType::U8, vec![len], hash).expect("meta")
}

/// Askers 11.. of a new large version published by 1, each asking after the last, on a
/// broker with `config`. Returns who each was pointed at first.
fn large_askers(config: BrokerConfig, askers: &[u8]) -> (BrokerState, Vec<NodeId>) {
    let mut b = BrokerState::new(BROKER, config, tb_proto::Registry::new(), 0);
    for &n in [1].iter().chain(askers) {
        let addrs = vec![format!("10.0.0.{n}:4433")];
        b.heartbeat(id(n), Role::Worker, addrs, 1, 0)
            .expect("heartbeat");
    }
    let w = name("m/big");
    b.publish(w.clone(), large_meta(1), id(1), 10);
    let firsts = askers
        .iter()
        .map(|&a| b.lookup(&w, None, id(a), 20).expect("found").holders[0].node)
        .collect();
    (b, firsts)
}

#[test]
fn fetches_of_a_large_version_form_a_chain() {
    let (_, firsts) = large_askers(BrokerConfig::default(), &[11, 12, 13, 14, 15, 16]);
    // Each new fetcher takes the one source nobody fetches from yet: the last fetcher.
    assert_eq!(firsts, [id(1), id(11), id(12), id(13), id(14), id(15)]);
}

#[test]
fn a_chain_at_its_longest_branches_off_the_shallowest_source() {
    let config = BrokerConfig {
        max_chain_depth: 3,
        ..BrokerConfig::default()
    };
    let (_, firsts) = large_askers(config, &[11, 12, 13, 14, 15, 16, 17, 18]);
    // 13 is 3 hops deep; 14 starts a second chain at the publisher, which is then full; 17
    // (the second chain is 3 deep too) branches off 11, the shallowest source with room.
    let chains = [id(1), id(11), id(12), id(1), id(14), id(15), id(11), id(17)];
    assert_eq!(firsts, chains);
}

#[test]
fn a_large_fetch_prefers_a_complete_source_with_room() {
    let (mut b, _) = large_askers(BrokerConfig::default(), &[11, 12]);
    let w = name("m/big");
    // 12 completes: like the publisher it has everything, and unlike it nobody fetches from
    // it, so it comes first; 11 (in flight, feeding nobody now) after it, the publisher last.
    let hold = RegistryOp::AddHolder {
        name: w.clone(),
        version: 1,
        node: id(12),
        stamp: Stamp::ZERO,
    };
    b.announce(id(12), hold, 30).expect("hold");
    b.heartbeat(id(13), Role::Worker, vec!["10.0.0.13:1".into()], 1, 30)
        .expect("hb");
    let found = b.lookup(&w, None, id(13), 31).expect("found");
    assert_eq!(
        nodes(&found),
        [(id(12), true), (id(11), false), (id(1), true)]
    );
}

/// Askers of a new large version published by 1 (upload limit 50 MB/s), each asking after the
/// last; `limits` are the askers' upload limits from their heartbeats (absent: unlimited).
fn capped_askers(askers: &[u8], limits: &[(u8, u64)]) -> (BrokerState, Vec<NodeId>) {
    let mut b = BrokerState::new(
        BROKER,
        BrokerConfig::default(),
        tb_proto::Registry::new(),
        0,
    );
    for &n in [1].iter().chain(askers) {
        let addrs = vec![format!("10.0.0.{n}:4433")];
        b.heartbeat(id(n), Role::Worker, addrs, 1, 0)
            .expect("heartbeat");
    }
    b.upload_limit(id(1), 50_000_000);
    for &(n, limit) in limits {
        b.upload_limit(id(n), limit);
    }
    let w = name("m/big");
    b.publish(w.clone(), large_meta(1), id(1), 10);
    let firsts = askers
        .iter()
        .map(|&a| b.lookup(&w, None, id(a), 20).expect("found").holders[0].node)
        .collect();
    (b, firsts)
}

#[test]
fn a_source_with_a_far_lower_upload_limit_is_offered_after_the_others() {
    // 11 uploads at 5 MB/s, a tenth of everyone else: it asks first (so the old ranking made
    // it the chain's second link), but nobody is pointed at it, and as a child it takes no
    // slot from the fast: 12 shares the publisher with it, 13 chains off 12.
    let (b, firsts) = capped_askers(&[11, 12, 13, 14], &[(11, 5_000_000)]);
    assert_eq!(firsts, [id(1), id(1), id(12), id(13)]);
    // It is still offered, after every other source (the publisher feeds one fast fetcher:
    // it has room).
    let mut b = b;
    b.heartbeat(id(15), Role::Worker, vec!["10.0.0.15:1".into()], 1, 30)
        .expect("hb");
    let found = b.lookup(&name("m/big"), None, id(15), 31).expect("found");
    let order: Vec<NodeId> = found.holders.iter().map(|h| h.node).collect();
    assert_eq!(order, [id(14), id(1), id(12), id(13), id(11)]);
    // A quarter of the fastest is not slow: 12 chains off 11.
    let (_, firsts) = capped_askers(&[11, 12], &[(11, 12_500_000), (12, 50_000_000)]);
    assert_eq!(firsts, [id(1), id(11)]);
}

#[test]
fn a_slow_fetcher_looking_again_moves_to_a_chain_tail() {
    let (mut b, firsts) = capped_askers(&[11, 12, 13, 14], &[(11, 5_000_000)]);
    assert_eq!(firsts[0], id(1));
    // 11 asks again while it fetches: the tail of the chain (14, feeding nobody) comes first;
    // the publisher, now feeding 12 alone, after it.
    let again = b.lookup(&name("m/big"), None, id(11), 40).expect("found");
    assert_eq!(again.holders[0].node, id(14));
    // The fast ones asking again keep their sources.
    for (asker, source) in [(12, 1), (13, 12), (14, 13)] {
        let again = b
            .lookup(&name("m/big"), None, id(asker), 41)
            .expect("found");
        assert_eq!(again.holders[0].node, id(source), "asker {asker}");
    }
}

#[test]
fn excluded_sources_are_not_offered_to_the_asker() {
    let (mut b, firsts) = large_askers(BrokerConfig::default(), &[11, 12, 13]);
    assert_eq!(firsts, [id(1), id(11), id(12)]);
    let w = name("m/big");
    // 13 dropped 12 (too slow): it is pointed elsewhere, and 12 stays on offer to others.
    let found = b
        .lookup_excluding(&w, None, id(13), &[id(12)], 30)
        .expect("found");
    assert!(found.holders.iter().all(|h| h.node != id(12)));
    assert_eq!(found.holders[0].node, id(1));
    b.heartbeat(id(14), Role::Worker, vec!["10.0.0.14:1".into()], 1, 30)
        .expect("hb");
    let other = b.lookup(&w, None, id(14), 31).expect("found");
    assert!(other.holders.iter().any(|h| h.node == id(12)));
    // Excluding every source leaves none.
    assert_eq!(
        b.lookup_excluding(&w, None, id(13), &[id(1), id(11), id(12), id(14)], 32),
        Err(BrokerError::NoHolder {
            name: w.clone(),
            version: 1
        })
    );
}

#[test]
fn upload_limits_are_forgotten_with_the_nodes_that_went_silent() {
    let (mut b, firsts) = capped_askers(&[11, 12], &[(11, 1_000_000)]);
    assert_eq!(firsts, [id(1), id(1)]);
    // 11 goes silent, is marked dead and forgotten; it comes back without a limit.
    for n in [1, 12] {
        let addrs = vec![format!("10.0.0.{n}:4433")];
        b.heartbeat(id(n), Role::Worker, addrs, 1, 15_000)
            .expect("hb");
    }
    b.expire(15_000);
    b.heartbeat(
        id(11),
        Role::Worker,
        vec!["10.0.0.11:4433".into()],
        1,
        15_001,
    )
    .expect("hb");
    b.heartbeat(
        id(13),
        Role::Worker,
        vec!["10.0.0.13:4433".into()],
        1,
        15_001,
    )
    .expect("hb");
    // Its fetch is still in flight and no longer known as slow: it ties with 12 and comes
    // first by id.
    let found = b
        .lookup(&name("m/big"), None, id(13), 15_002)
        .expect("found");
    assert_eq!(found.holders[0].node, id(11));
    // A limit from a node never heard here is not taken.
    b.upload_limit(id(99), 1);
    let found = b
        .lookup(&name("m/big"), None, id(13), 15_003)
        .expect("found");
    assert_eq!(found.holders[0].node, id(11));
}

/// A broker whose workers 1 (the publisher), 2 and 3 hold version 1 of `m/set`, of `byte_len`
/// bytes, and whose workers 11.. are alive to ask.
fn three_holders(byte_len: u64) -> BrokerState {
    let mut b = broker_with(&[1, 2, 3, 11, 12, 13], 0);
    let w = name("m/set");
    let hash = tb_proto::ContentHash([7; 32]);
    let meta = TensorMeta::new(tb_proto::DType::U8, vec![byte_len], hash).expect("meta");
    b.publish(w.clone(), meta, id(1), 10);
    for n in [2, 3] {
        let hold = RegistryOp::AddHolder {
            name: w.clone(),
            version: 1,
            node: id(n),
            stamp: Stamp::ZERO,
        };
        b.announce(id(n), hold, 10).expect("hold");
    }
    b
}

const MULTI: u64 = tb_proto::piece::MULTI_SOURCE_MIN_BYTES;

#[test]
fn idle_complete_holders_make_one_fetchers_set_of_sources() {
    let mut b = three_holders(4 * MULTI);
    let w = name("m/set");
    let first = b.lookup(&w, None, id(11), 20).expect("found");
    assert_eq!(first.sources, 3);
    let mut set: Vec<NodeId> = first.holders[..3].iter().map(|h| h.node).collect();
    set.sort();
    assert_eq!(set, [id(1), id(2), id(3)]);
    assert_eq!(CtlResponse::from(first.clone()).validate(u64::MAX), Ok(()));
    // Each holder now feeds 11: none has its upload to spare, so the next fetcher gets one
    // source — the fetcher in flight that feeds nobody (a chain), not a busy holder.
    let second = b.lookup(&w, None, id(12), 21).expect("found");
    assert_eq!(second.sources, 1);
    assert_eq!(second.holders[0].node, id(11));
    // Asking again gives up the slots held: 11 gets the three holders back.
    let again = b.lookup(&w, None, id(11), 22).expect("found");
    assert_eq!(again.sources, 3);
    // When 11 is done, the holders it used are free for the next one.
    b.fetching(&w, 1, id(11), false, 23).expect("ended");
    let third = b.lookup(&w, None, id(13), 24).expect("found");
    assert!(third.sources >= 2, "{third:?}");
}

#[test]
fn small_versions_get_one_source_at_a_time() {
    let mut b = three_holders(MULTI - 1);
    let found = b.lookup(&name("m/set"), None, id(11), 20).expect("found");
    assert_eq!(found.sources, 1);
    assert_eq!(found.holders.len(), 3);
}

#[test]
fn a_broadcast_of_a_large_version_still_forms_a_chain() {
    let mut b = broker_with(&[1, 11, 12, 13, 14], 0);
    let w = name("m/big");
    let hash = tb_proto::ContentHash([9; 32]);
    let meta = TensorMeta::new(tb_proto::DType::U8, vec![4 * MULTI], hash).expect("meta");
    b.publish(w.clone(), meta, id(1), 10);
    let answers: Vec<Holders> = [11, 12, 13, 14]
        .iter()
        .map(|&a| b.lookup(&w, None, id(a), 20).expect("found"))
        .collect();
    // Every source already feeds the next fetcher: nobody gets a helper, and the publisher's
    // upload carries one copy.
    assert_eq!(first_sources(&answers), [id(1), id(11), id(12), id(13)]);
    assert!(answers.iter().all(|a| a.sources == 1), "{answers:?}");
}
