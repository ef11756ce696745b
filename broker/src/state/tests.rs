//! Rules of announcing, gossip, sync, listing and events.

use tb_proto::{
    ClockError, ContentHash, DType, MAX_DRIFT_MS, RegistryError, Role, Stamp, TensorMeta,
};

use super::*;

pub(crate) const BROKER: NodeId = NodeId([100; 32]);

pub(crate) fn id(b: u8) -> NodeId {
    NodeId([b; 32])
}

pub(crate) fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("name")
}

pub(crate) fn meta(tag: u8) -> TensorMeta {
    TensorMeta::new(DType::U8, vec![16], ContentHash([tag; 32])).expect("meta")
}

pub(crate) fn broker() -> BrokerState {
    BrokerState::new(BROKER, BrokerConfig::default(), Registry::new(), 0)
}

/// A broker that has heard workers `nodes` (alive, with one address each) at `now_ms`.
pub(crate) fn broker_with(nodes: &[u8], now_ms: u64) -> BrokerState {
    let mut b = broker();
    for &n in nodes {
        let addrs = vec![format!("10.0.0.{n}:4433")];
        b.heartbeat(id(n), Role::Worker, addrs, 1, now_ms)
            .expect("heartbeat");
    }
    b
}

pub(crate) fn stamp(wall_ms: u64, node: u8) -> Stamp {
    Stamp {
        wall_ms,
        logical: 0,
        node: id(node),
    }
}

fn publish_op(n: &str, version: u64, publisher: u8, stamp: Stamp) -> RegistryOp {
    RegistryOp::Publish {
        name: name(n),
        version,
        meta: meta(version as u8),
        publisher: id(publisher),
        stamp,
    }
}

fn add_holder(n: &str, version: u64, node: u8, stamp: Stamp) -> RegistryOp {
    RegistryOp::AddHolder {
        name: name(n),
        version,
        node: id(node),
        stamp,
    }
}

#[test]
fn versions_are_assigned_in_order_and_survive_deletes() {
    let mut b = broker_with(&[1], 0);
    let w = name("m/w");
    assert_eq!(b.next_version(&w), 1);
    for expected in 1..=3 {
        let (version, changes) = b.publish(w.clone(), meta(expected as u8), id(1), 10);
        assert_eq!(version, expected);
        assert_eq!(changes.names, std::slice::from_ref(&w));
        assert_eq!(b.next_version(&w), expected + 1);
    }
    let deleted = b.announce(
        id(1),
        RegistryOp::Delete {
            name: w.clone(),
            stamp: Stamp::ZERO,
        },
        20,
    );
    deleted.expect("delete");
    assert_eq!(
        b.next_version(&w),
        4,
        "versions keep increasing across a delete"
    );
    let (version, _) = b.publish(w.clone(), meta(4), id(1), 30);
    assert_eq!(version, 4);
    assert_eq!(b.registry().entry(&w).map(|e| e.version), Some(4));
}

#[test]
fn announced_ops_must_be_about_the_sender() {
    let mut b = broker_with(&[1, 2], 0);
    let not_yours = BrokerError::NotYours {
        sender: id(2),
        claimed: id(1),
    };
    let ops = [
        publish_op("m/w", 1, 1, Stamp::ZERO),
        add_holder("m/w", 1, 1, Stamp::ZERO),
        RegistryOp::RemoveHolder {
            name: name("m/w"),
            version: 1,
            node: id(1),
            stamp: Stamp::ZERO,
        },
    ];
    for op in ops {
        assert_eq!(b.announce(id(2), op, 10), Err(not_yours.clone()));
    }
    let row = b.members()[0].clone();
    assert_eq!(
        b.announce(id(1), RegistryOp::Member(row), 10),
        Err(BrokerError::MemberOp { sender: id(1) })
    );
    assert_eq!(b.registry().entry(&name("m/w")), None);
}

#[test]
fn announced_ops_are_restamped_with_the_brokers_clock() {
    let mut b = broker_with(&[1], 0);
    // The worker's clock is far ahead; the broker does not care.
    let op = publish_op("m/w", 1, 1, stamp(u64::MAX / 2, 1));
    let changes = b.announce(id(1), op, 5_000).expect("announce");
    assert_eq!(changes.gossip.len(), 2, "publish and the publisher's mark");
    for op in &changes.gossip {
        assert_eq!(op.stamp().node, BROKER);
        assert_eq!(op.stamp().wall_ms, 5_000);
    }
    assert!(matches!(
        &changes.gossip[0],
        RegistryOp::Publish { publisher, .. } if *publisher == id(1)
    ));
    let entry = b.registry().entry(&name("m/w")).expect("live");
    assert_eq!(entry.holders_of(1).collect::<Vec<_>>(), [id(1)]);
}

#[test]
fn announced_publishes_must_be_newer_than_every_known_version() {
    let mut b = broker_with(&[1, 2], 0);
    b.announce(id(1), publish_op("m/w", 1, 1, Stamp::ZERO), 10)
        .expect("v1");
    // Worker 2 asked for the next version at the same time and lost the race.
    assert_eq!(
        b.announce(id(2), publish_op("m/w", 1, 2, Stamp::ZERO), 11),
        Err(BrokerError::StaleVersion {
            name: name("m/w"),
            version: 1,
            newest: 1
        })
    );
    assert_eq!(
        b.registry().entry(&name("m/w")).map(|e| e.publisher),
        Some(id(1))
    );
    // A retry of the winning publish is accepted and changes nothing.
    let retry = b.announce(id(1), publish_op("m/w", 1, 1, Stamp::ZERO), 12);
    assert!(retry.expect("retry").is_empty());
    // A jump that would use up the name's versions is refused; a small one is fine.
    let far = 2 + MAX_VERSION_SKIP + 1;
    assert_eq!(
        b.announce(id(2), publish_op("m/w", far, 2, Stamp::ZERO), 13),
        Err(BrokerError::VersionSkip {
            name: name("m/w"),
            version: far,
            next: 2
        })
    );
    b.announce(id(2), publish_op("m/w", 5, 2, Stamp::ZERO), 14)
        .expect("v5");
    assert_eq!(b.next_version(&name("m/w")), 6);
}

#[test]
fn announced_ops_are_validated_and_redundant_ones_change_nothing() {
    let mut b = broker_with(&[1, 2], 0);
    let bad = publish_op("m/w", 0, 1, Stamp::ZERO);
    let err = b.announce(id(1), bad, 10).expect_err("version 0");
    assert!(matches!(
        err,
        BrokerError::Invalid(RegistryError::ZeroVersion { .. })
    ));
    b.publish(name("m/w"), meta(1), id(1), 10);
    let again = b.announce(id(1), add_holder("m/w", 1, 1, Stamp::ZERO), 11);
    assert!(again.expect("again").is_empty());
    let remove = |node| RegistryOp::RemoveHolder {
        name: name("m/w"),
        version: 1,
        node: id(node),
        stamp: Stamp::ZERO,
    };
    assert!(
        b.announce(id(2), remove(2), 12)
            .expect("not held")
            .is_empty()
    );
    let dropped = b.announce(id(1), remove(1), 13).expect("dropped");
    assert_eq!(dropped.gossip.len(), 1);
    assert!(dropped.events.is_empty(), "holder marks make no events");
    let unknown = RegistryOp::Delete {
        name: name("nope"),
        stamp: Stamp::ZERO,
    };
    assert_eq!(
        b.announce(id(1), unknown, 14),
        Err(BrokerError::NotFound {
            name: name("nope"),
            version: None
        })
    );
}

#[test]
fn publishes_and_deletes_produce_events() {
    let mut b = broker_with(&[1], 0);
    let (_, first) = b.publish(name("m/w"), meta(1), id(1), 10);
    assert_eq!(
        first.events,
        [Event::Published {
            name: name("m/w"),
            version: 1,
            meta: meta(1),
            publisher: id(1)
        }]
    );
    let (_, second) = b.publish(name("m/w"), meta(2), id(1), 11);
    assert!(matches!(
        &second.events[..],
        [Event::Published { version: 2, .. }]
    ));
    let delete = RegistryOp::Delete {
        name: name("m/w"),
        stamp: Stamp::ZERO,
    };
    let deleted = b.announce(id(1), delete, 12).expect("delete");
    assert_eq!(deleted.events, [Event::Deleted { name: name("m/w") }]);
    assert_eq!(deleted.names, [name("m/w")]);
    // A stale publish from gossip (stamped before the delete) brings nothing back.
    let stale = b.remote_op(&publish_op("m/w", 2, 1, stamp(5, 7)), 13);
    assert!(stale.expect("stale").is_empty());
}

#[test]
fn remote_ops_far_in_the_future_are_refused_unapplied() {
    let mut b = broker_with(&[1], 0);
    let now = 1_000_000;
    let ahead = publish_op("m/w", 1, 1, stamp(now + MAX_DRIFT_MS + 1, 7));
    assert!(matches!(
        b.remote_op(&ahead, now),
        Err(BrokerError::Clock(ClockError::TooFarAhead { .. }))
    ));
    assert!(b.registry().entry(&name("m/w")).is_none());
    let zero = add_holder("m/w", 0, 1, stamp(now, 7));
    assert!(matches!(
        b.remote_op(&zero, now),
        Err(BrokerError::Invalid(_))
    ));

    // Within the drift: applied, observed, and never re-gossiped.
    let near = publish_op("m/w", 1, 1, stamp(now + MAX_DRIFT_MS, 7));
    let changes = b.remote_op(&near, now).expect("near");
    assert!(changes.gossip.is_empty());
    assert_eq!(changes.names, [name("m/w")]);
    assert_eq!(changes.events.len(), 1);
    assert!(b.remote_op(&near, now).expect("repeat").is_empty());
    // This broker's next write beats the observed stamp although its wall clock is behind.
    let del = RegistryOp::Delete {
        name: name("m/w"),
        stamp: Stamp::ZERO,
    };
    let deleted = b.announce(id(1), del, now).expect("delete");
    assert!(deleted.gossip[0].stamp() > near.stamp());
    assert!(b.registry().entry(&name("m/w")).is_none());
}

#[test]
fn holder_marks_of_old_versions_are_pruned() {
    let mut b = broker_with(&[1, 2], 0);
    for v in 1..=3 {
        b.publish(name("m/w"), meta(v), id(1), 10 + u64::from(v));
    }
    let e = b.registry().entry(&name("m/w")).expect("live");
    let versions: Vec<u64> = e.holders.keys().map(|(_, v)| *v).collect();
    assert_eq!(versions, [2, 3], "keep_versions = 2");
    // A mark for an evicted version from gossip lands and is pruned again.
    b.remote_op(&add_holder("m/w", 1, 2, stamp(20, 7)), 20)
        .expect("applied");
    let e = b.registry().entry(&name("m/w")).expect("live");
    assert_eq!(e.holders_of(1).count(), 0);
}

#[test]
fn synced_entries_are_checked_one_by_one() {
    let mut theirs = broker_with(&[1], 0);
    theirs.publish(name("m/a"), meta(1), id(1), 10);
    theirs.publish(name("m/b"), meta(2), id(1), 11);
    let mut entries = theirs.registry().entries_for([&name("m/a"), &name("m/b")]);
    // One entry comes with a stamp from the far future, one is invalid.
    entries[1].1.stamp = stamp(10 + MAX_DRIFT_MS + 1, 7);
    let mut bad = entries[0].1.clone();
    bad.meta.byte_len += 1;
    entries.push((name("m/c"), bad));
    // A name that comes twice makes one event.
    entries.push(entries[0].clone());
    let members = theirs.members();

    let mut mine = broker();
    let changes = mine.merge_entries(&entries, &members, 10);
    assert_eq!(changes.names, [name("m/a")]);
    assert_eq!(changes.members, [id(1)]);
    assert!(changes.gossip.is_empty());
    assert!(matches!(
        &changes.events[..],
        [Event::Published { version: 1, .. }]
    ));
    assert!(mine.registry().entry(&name("m/b")).is_none());
    assert!(mine.registry().entry(&name("m/c")).is_none());
    // A sync that brings nothing new changes nothing.
    assert!(mine.merge_entries(&entries, &members, 10).is_empty());
    // The observed stamps move this broker's clock.
    assert!(mine.hlc.last().wall_ms >= 10);
}

#[test]
fn listing_filters_by_prefix_limits_and_counts_live_holders() {
    let mut b = broker_with(&[1, 2], 0);
    for n in ["a/x", "m/a", "m/b", "m/c", "mm/a"] {
        b.publish(name(n), meta(1), id(1), 10);
    }
    b.announce(id(2), add_holder("m/a", 1, 2, Stamp::ZERO), 11)
        .expect("hold");
    let listed = b.list("m/", 2);
    let names: Vec<&str> = listed.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["m/a", "m/b"]);
    assert_eq!(listed[0].holders, 2);
    assert_eq!(b.list("", 100).len(), 5);
    assert_eq!(b.list("m", 100).len(), 4);

    // Worker 2 goes silent: its holdings no longer count.
    b.heartbeat(id(1), Role::Worker, vec!["10.0.0.1:4433".into()], 1, 20_000)
        .expect("hb");
    b.expire(20_000);
    assert_eq!(b.list("m/a", 1)[0].holders, 1);
}

#[test]
fn a_restarted_broker_stamps_past_what_it_loaded() {
    let mut before = broker_with(&[1], 0);
    before.publish(name("m/w"), meta(1), id(1), 90_000);
    let registry = before.registry().clone();
    // The wall clock stepped back across the restart.
    let mut after = BrokerState::new(BROKER, BrokerConfig::default(), registry, 50_000);
    let del = RegistryOp::Delete {
        name: name("m/w"),
        stamp: Stamp::ZERO,
    };
    let changes = after.announce(id(1), del, 50_000).expect("delete");
    assert!(changes.gossip[0].stamp().wall_ms >= 90_000);
    assert!(after.registry().entry(&name("m/w")).is_none());
}

#[test]
fn read_only_senders_only_mark_versions_the_registry_keeps() {
    use tb_proto::{Access, AccessError};
    let mut b = broker_with(&[1, 2], 0);
    // keep_versions is 2 by default: v2 and v3 are kept once v3 is out.
    for v in 1..=3 {
        b.publish(name("m/w"), meta(v), id(1), 10);
    }
    let ro = Access::ReadOnly;
    for (v, kept) in [(1, false), (2, true), (3, true), (4, false)] {
        let got = b.announce_as(id(2), ro, add_holder("m/w", v, 2, Stamp::ZERO), 20);
        match kept {
            true => assert!(got.is_ok(), "v{v}: {got:?}"),
            false => assert_eq!(
                got,
                Err(BrokerError::NotFound {
                    name: name("m/w"),
                    version: Some(v)
                })
            ),
        }
    }
    let made_up = b.announce_as(id(2), ro, add_holder("made/up", 1, 2, Stamp::ZERO), 20);
    assert!(matches!(made_up, Err(BrokerError::NotFound { .. })));
    assert!(
        b.registry().entry(&name("made/up")).is_none(),
        "no placeholder"
    );
    let dropped = RegistryOp::RemoveHolder {
        name: name("m/w"),
        version: 3,
        node: id(2),
        stamp: Stamp::ZERO,
    };
    assert!(b.announce_as(id(2), ro, dropped, 30).is_ok());
    let writes = [
        (publish_op("m/w", 4, 2, Stamp::ZERO), "publishing"),
        (
            RegistryOp::Delete {
                name: name("m/w"),
                stamp: Stamp::ZERO,
            },
            "deleting",
        ),
    ];
    for (op, action) in writes {
        let refused = b.announce_as(id(2), ro, op.clone(), 40);
        let expected = BrokerError::Access(AccessError::PeerReadOnly { action });
        assert_eq!(refused, Err(expected.clone()));
        assert_eq!(expected.code(), tb_proto::ErrorCode::Unauthorized);
        // The same op from a read-write sender goes through the usual checks only.
        let op = match op {
            RegistryOp::Publish { .. } => publish_op("m/w", 4, 2, Stamp::ZERO),
            other => other,
        };
        assert!(b.announce_as(id(2), Access::ReadWrite, op, 50).is_ok());
    }
}

/// A broker whose rows of nodes gone expire fast: dead rows after 100 s, left ones after 10 s.
fn forgetful_broker(now_ms: u64) -> BrokerState {
    let config = BrokerConfig {
        expiry: tb_proto::Expiry {
            dead_after_ms: 100_000,
            left_after_ms: 10_000,
        },
        ..BrokerConfig::default()
    };
    BrokerState::new(BROKER, config, Registry::new(), now_ms)
}

fn heartbeat(b: &mut BrokerState, n: u8, epoch: u64, now_ms: u64) {
    let addrs = vec![format!("10.0.0.{n}:4433")];
    b.heartbeat(id(n), Role::Worker, addrs, epoch, now_ms)
        .expect("heartbeat");
}

fn member_nodes(b: &BrokerState) -> Vec<NodeId> {
    b.members().iter().map(|m| m.node).collect()
}

#[test]
fn rows_of_dead_nodes_are_forgotten_with_what_they_held() {
    let mut b = forgetful_broker(0);
    heartbeat(&mut b, 1, 1, 0);
    heartbeat(&mut b, 2, 1, 0);
    let w = name("m/w");
    b.announce(id(1), publish_op("m/w", 1, 1, Stamp::ZERO), 0)
        .expect("published");
    b.announce(id(2), add_holder("m/w", 1, 2, Stamp::ZERO), 0)
        .expect("held");
    // Node 2 keeps heartbeating; node 1 falls silent and is marked dead at 10 s.
    heartbeat(&mut b, 2, 1, 9_000);
    let dead = b.expire(10_001);
    assert_eq!(dead.members, [id(1)]);
    heartbeat(&mut b, 2, 1, 15_000);
    assert!(b.expire(15_001).members.is_empty());
    assert_eq!(member_nodes(&b), [id(1), id(2)], "dead, not forgotten yet");

    // A day's worth (here 100 s) after it was marked dead, its row and marks go; node 2,
    // alive however long ago its row was written, stays with its mark.
    heartbeat(&mut b, 2, 1, 110_000);
    let before = b.expire(110_001);
    assert!(before.members.is_empty(), "exactly the age: kept");
    heartbeat(
        &mut b,
        2,
        1,
        110_000 + crate::config::DEFAULT_FORGET_PERIOD_MS,
    );
    let gone = b.expire(110_001 + crate::config::DEFAULT_FORGET_PERIOD_MS);
    assert_eq!(gone.members, [id(1)]);
    assert_eq!(gone.names, std::slice::from_ref(&w));
    assert!(gone.gossip.is_empty(), "every replica forgets on its own");
    assert_eq!(member_nodes(&b), [id(2)]);
    let e = b.registry().entry(&w).expect("still published");
    assert_eq!(e.holders_of(1).collect::<Vec<_>>(), [id(2)]);
    assert_eq!(
        b.list("", 10)[0].holders,
        1,
        "the publisher stays the publisher, not a holder"
    );
}

#[test]
fn a_clean_leave_writes_the_row_left_and_it_goes_soon() {
    let mut b = forgetful_broker(0);
    heartbeat(&mut b, 1, 7, 0);
    b.heartbeat(id(9), Role::Broker, vec!["10.0.0.9:1".into()], 1, 0)
        .expect("a peer broker");
    // A leave from a previous life, a broker's, or an unknown node's changes nothing.
    assert!(b.leave(id(1), 6, 1_000).is_empty());
    assert!(b.leave(id(9), 1, 1_000).is_empty());
    assert!(b.leave(id(3), 1, 1_000).is_empty());
    assert!(b.leave(BROKER, 1, 1_000).is_empty());

    let left = b.leave(id(1), 7, 1_000);
    assert_eq!(left.members, [id(1)]);
    match &left.gossip[..] {
        [RegistryOp::Member(row)] => {
            assert!(row.has_left() && row.epoch == 7 && row.stamp.node == BROKER);
        }
        other => panic!("expected one member op, got {other:?}"),
    }
    assert!(b.leave(id(1), 7, 1_100).is_empty(), "once");
    // A heartbeat of the life that left, arriving after the leave, does not revive the row.
    let late = b.heartbeat(id(1), Role::Worker, vec!["10.0.0.1:4433".into()], 7, 1_200);
    assert!(
        matches!(
            late,
            Err(BrokerError::StaleEpoch {
                epoch: 7,
                known: 7,
                ..
            })
        ),
        "{late:?}"
    );
    assert!(b.registry().member(&id(1)).is_some_and(|m| m.has_left()));
    // Not judged again: no dead row on top of the left one.
    let judged = b.expire(20_000);
    assert!(!judged.members.contains(&id(1)), "{judged:?}");

    // Soon after (10 s here, not the dead rows' 100 s) the row goes.
    let gone = b.expire(11_001 + crate::config::DEFAULT_FORGET_PERIOD_MS);
    assert_eq!(gone.members, [id(1)]);
    assert_eq!(member_nodes(&b), [id(9)]);

    // The same life heartbeating again (a leave raced by a late heartbeat) is a member again.
    heartbeat(&mut b, 1, 7, 80_000);
    assert!(b.registry().member(&id(1)).is_some_and(|m| m.alive));
}

#[test]
fn rows_and_marks_past_their_age_are_not_taken_back_from_peers() {
    let now = 500_000;
    let mut b = forgetful_broker(now);
    // Another broker told this one about worker 1, alive, and that it holds m/w v1.
    let alive = Member {
        node: id(1),
        role: Role::Worker,
        addrs: vec!["10.0.0.1:4433".into()],
        epoch: 1,
        alive: true,
        stamp: stamp(1_000, 101),
    };
    b.merge_entries(&[], std::slice::from_ref(&alive), now);
    assert_eq!(member_nodes(&b), [id(1)]);

    // A peer that has not forgotten it yet sends its dead row from long ago: it replaces the
    // alive one, then goes, leaving no row behind.
    let dead = Member {
        alive: false,
        stamp: stamp(2_000, 101),
        ..alive.clone()
    };
    let merged = b.merge_entries(&[], std::slice::from_ref(&dead), now);
    assert_eq!(merged.members, [id(1)], "to delete from disk");
    assert!(member_nodes(&b).is_empty());
    // Sent again, by sync or by a late gossip, it stays gone.
    assert!(
        b.merge_entries(&[], std::slice::from_ref(&dead), now)
            .is_empty()
    );
    let again = b.remote_op(&RegistryOp::Member(dead.clone()), now);
    assert!(again.expect("valid").is_empty());
    assert!(member_nodes(&b).is_empty());

    // Its old holder marks, merged from a peer that kept them, go as well; a young mark of a
    // node whose row has not arrived yet stays.
    let mut peer = Registry::new();
    peer.apply(&publish_op("m/w", 1, 2, stamp(1_000, 101)));
    peer.apply(&add_holder("m/w", 1, 1, stamp(1_500, 101)));
    peer.apply(&add_holder("m/w", 1, 3, stamp(now - 10, 101)));
    let entries = peer.entries_for([&name("m/w")]);
    b.merge_entries(&entries, &[], now);
    let e = b.registry().entry(&name("m/w")).expect("published");
    assert_eq!(
        e.holders.keys().map(|(n, _)| *n).collect::<Vec<_>>(),
        [id(3)]
    );
}

#[test]
fn a_reloaded_registry_has_no_forgotten_rows_on_disk_either() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = crate::RegistryStore::open(dir.path()).expect("store");
    let save = |b: &BrokerState, changes: &Changes| {
        store
            .save_changed(b.registry(), &changes.names, &changes.members)
            .expect("save");
    };
    let mut b = forgetful_broker(0);
    for n in [1, 2, 3] {
        heartbeat(&mut b, n, 1, 0);
        let nodes = [id(n)];
        save(
            &b,
            &Changes {
                members: nodes.to_vec(),
                ..Changes::default()
            },
        );
    }
    let held = b
        .announce(id(1), publish_op("m/w", 1, 1, Stamp::ZERO), 0)
        .expect("published");
    save(&b, &held);
    heartbeat(&mut b, 2, 1, 9_000);
    heartbeat(&mut b, 3, 1, 9_000);
    let dead = b.expire(10_001);
    save(&b, &dead);
    let left = b.leave(id(3), 1, 10_500);
    save(&b, &left);
    store.flush().expect("flush");
    assert_eq!(store.load(u64::MAX).expect("load").members().count(), 3);

    // Restarted two minutes on: node 3 (left) is forgotten, node 1 (dead 110 s) too, node 2
    // (alive as far as this broker knew) stays.
    let later = 130_000;
    let loaded = store.load(u64::MAX).expect("load");
    let mut b = BrokerState::new(BROKER, forgetful_broker(0).config().clone(), loaded, later);
    assert_eq!(member_nodes(&b), [id(2)]);
    assert!(
        b.registry()
            .entry(&name("m/w"))
            .is_some_and(|e| e.holders.is_empty()),
        "node 1's mark went with its row"
    );
    // The first tick hands out what the load forgot, so the disk forgets it too.
    let first = b.expire(later + 1);
    assert_eq!(first.members, [id(1), id(3)]);
    save(&b, &first);
    store.flush().expect("flush");
    let reloaded = store.load(u64::MAX).expect("load");
    assert_eq!(
        reloaded.members().map(|m| m.node).collect::<Vec<_>>(),
        [id(2)]
    );
    assert!(
        reloaded
            .entry(&name("m/w"))
            .is_some_and(|e| e.holders.is_empty())
    );
    assert!(b.expire(later + 2).is_empty(), "handed out once");
}
