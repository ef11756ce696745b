//! Property tests for the registry CRDT: replicas that see the same ops, in any order, any
//! number of times, by op or by merged state, in any grouping, end identical; pruning converges
//! too. Plus regression tests named after the failures they guard.
//!
//! The universe is small on purpose (3 names, 4 nodes, versions 1..5, 32 stamps) so that
//! conflicts and exact stamp ties happen in most cases.

use std::collections::BTreeMap;

use proptest::{collection::vec, prelude::*, sample::select};
use serde::{Serialize, de::DeserializeOwned};
use tb_proto::{
    ContentHash, CtlRequest, CtlResponse, DType, Member, NodeId, Registry, RegistryOp, Role, Stamp,
    TensorMeta, TensorName, chunk_by_size, frame,
};

fn id(b: u8) -> NodeId {
    NodeId([b; 32])
}

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("valid name")
}

fn node() -> impl Strategy<Value = NodeId> {
    (1u8..=4).prop_map(id)
}

fn tensor_name() -> impl Strategy<Value = TensorName> {
    select(vec!["m/a", "m/b", "n/c"]).prop_map(name)
}

fn stamp() -> impl Strategy<Value = Stamp> {
    (0u64..4, 0u32..2, node()).prop_map(|(wall_ms, logical, node)| Stamp {
        wall_ms,
        logical,
        node,
    })
}

/// Metadata that differs by hash, by shape only, or by dtype only, to reach every tie-break.
fn meta() -> impl Strategy<Value = TensorMeta> {
    select(vec![
        (DType::F32, vec![2, 3], 1u8),
        (DType::F32, vec![3, 2], 1),
        (DType::I32, vec![2, 3], 1),
        (DType::F32, vec![2, 3], 2),
    ])
    .prop_map(|(d, s, h)| TensorMeta::new(d, s, ContentHash([h; 32])).expect("meta"))
}

/// Rows for 2 nodes with 2 epochs and 4 stamps, so that rows differing only in liveness, role
/// or addresses often tie on `(epoch, stamp)`.
fn member() -> impl Strategy<Value = Member> {
    let addrs = select(vec![
        vec![],
        vec!["10.0.0.1:1".to_string()],
        vec!["b".into()],
    ]);
    let role = select(vec![Role::Broker, Role::Worker]);
    let stamp = (0u64..2, 1u8..=2).prop_map(|(wall_ms, n)| Stamp {
        wall_ms,
        logical: 0,
        node: id(n),
    });
    let node = (1u8..=2).prop_map(id);
    (node, role, addrs, 0u64..2, any::<bool>(), stamp).prop_map(
        |(node, role, addrs, epoch, alive, stamp)| Member {
            node,
            role,
            addrs,
            epoch,
            alive,
            stamp,
        },
    )
}

fn op() -> impl Strategy<Value = RegistryOp> {
    prop_oneof![
        // The publisher is usually the stamp's issuer, as with honest nodes, which makes
        // exact ties on `(version, stamp, publisher)` common.
        3 => (tensor_name(), 1u64..5, meta(), proptest::option::of(node()), stamp()).prop_map(
            |(name, version, meta, publisher, stamp)| RegistryOp::Publish {
                name,
                version,
                meta,
                publisher: publisher.unwrap_or(stamp.node),
                stamp,
            }
        ),
        3 => (tensor_name(), 1u64..5, node(), stamp())
            .prop_map(|(name, version, node, stamp)| RegistryOp::AddHolder {
                name,
                version,
                node,
                stamp,
            }),
        2 => (tensor_name(), 1u64..5, node(), stamp())
            .prop_map(|(name, version, node, stamp)| RegistryOp::RemoveHolder {
                name,
                version,
                node,
                stamp,
            }),
        1 => (tensor_name(), stamp()).prop_map(|(name, stamp)| RegistryOp::Delete { name, stamp }),
        2 => member().prop_map(RegistryOp::Member),
    ]
}

fn ops() -> impl Strategy<Value = Vec<RegistryOp>> {
    vec(op(), 1..60)
}

/// Indices into `n` ops: each at least once, up to `n` repeats, shuffled.
fn schedule(n: usize) -> impl Strategy<Value = Vec<usize>> {
    vec(0..n, 0..=n).prop_flat_map(move |dups| {
        let all: Vec<usize> = (0..n).chain(dups).collect();
        Just(all).prop_shuffle()
    })
}

fn apply_all<'a>(ops: impl IntoIterator<Item = &'a RegistryOp>) -> Registry {
    let mut r = Registry::new();
    for op in ops {
        r.apply(op);
    }
    r
}

fn merged(a: &Registry, b: &Registry) -> Registry {
    let mut out = a.clone();
    out.merge(b);
    out
}

/// Sends `msg` through the wire: encoded, decoded, as a receiver sees it.
fn wire<T: Serialize + DeserializeOwned>(msg: &T) -> T {
    let bytes = frame::encode(msg).expect("encode");
    frame::decode_frame(&bytes)
        .expect("decode")
        .expect("whole frame")
        .0
}

/// The asker's side of reading a multi-frame answer: each frame through the wire, validated.
fn receive(frames: Vec<CtlResponse>) -> Vec<CtlResponse> {
    let n = frames.len();
    frames
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let got = wire(f);
            assert_eq!(got.validate(u64::MAX), Ok(()));
            assert_eq!(
                got.is_final(),
                i + 1 == n,
                "only the last frame ends the answer"
            );
            got
        })
        .collect()
}

/// One anti-entropy conversation: `asker` learns what `responder` has, through validated
/// frames whose lists are cut by `chunk_by_size` under `budget` bytes.
fn sync_from(asker: &mut Registry, responder: &Registry, budget: usize) {
    // Step 1: bucket and member digests, answered by the member rows and buckets that differ.
    let ask = wire(&CtlRequest::SyncBuckets {
        buckets: asker.bucket_digests(),
        members: asker.member_digest().into_iter().collect(),
    });
    assert_eq!(ask.validate(u64::MAX), Ok(()));
    let CtlRequest::SyncBuckets { buckets, members } = ask else {
        panic!("not SyncBuckets: {ask:?}");
    };
    let differ = responder.differing_buckets(&buckets);
    let rows = chunk_by_size(
        responder.members_to_send(&members.into_iter().collect()),
        budget,
    );
    let last = rows.len() - 1;
    let diff = rows
        .into_iter()
        .enumerate()
        .map(|(i, members)| CtlResponse::SyncDiff {
            members,
            buckets: if i == 0 { differ.clone() } else { vec![] },
            last: i == last,
        });
    let mut buckets = Vec::new();
    for frame in receive(diff.collect()) {
        let CtlResponse::SyncDiff {
            members,
            buckets: b,
            ..
        } = frame
        else {
            panic!("not SyncDiff: {frame:?}");
        };
        members.iter().for_each(|m| {
            asker.merge_member(m);
        });
        buckets.extend(b);
    }

    // Step 2: per-name digests of those buckets, answered by the entries that differ.
    let names = chunk_by_size(
        asker.names_in_buckets(&buckets).into_iter().collect(),
        budget,
    );
    let mut theirs = BTreeMap::new();
    let last = names.len() - 1;
    for (i, names) in names.into_iter().enumerate() {
        let ask = wire(&CtlRequest::SyncNames {
            names,
            last: i == last,
        });
        assert_eq!(ask.validate(u64::MAX), Ok(()));
        let CtlRequest::SyncNames { names, .. } = ask else {
            panic!("not SyncNames: {ask:?}");
        };
        theirs.extend(names);
    }
    let entries = chunk_by_size(responder.entries_to_send(&theirs, &differ), budget);
    let last = entries.len() - 1;
    let answer = entries
        .into_iter()
        .enumerate()
        .map(|(i, entries)| CtlResponse::SyncEntries {
            entries,
            last: i == last,
        });
    for frame in receive(answer.collect()) {
        let CtlResponse::SyncEntries { entries, .. } = frame else {
            panic!("not SyncEntries: {frame:?}");
        };
        for (name, entry) in &entries {
            asker.merge_entry(name, entry);
        }
    }
}

fn pruned(r: &Registry, keep: u64) -> Registry {
    let mut out = r.clone();
    out.prune(keep);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// (a) Three replicas see every op, in different orders, some more than once.
    #[test]
    fn any_order_with_duplicates_converges(
        (ops, orders) in ops().prop_flat_map(|ops| {
            let n = ops.len();
            (Just(ops), [schedule(n), schedule(n), schedule(n)])
        })
    ) {
        let replicas: Vec<Registry> = orders
            .iter()
            .map(|order| apply_all(order.iter().map(|&i| &ops[i])))
            .collect();
        prop_assert_eq!(&replicas[0], &replicas[1]);
        prop_assert_eq!(&replicas[1], &replicas[2]);
        prop_assert_eq!(replicas[0].digest(), replicas[2].digest());
        prop_assert_eq!(replicas[0].member_digest(), replicas[2].member_digest());
        prop_assert_eq!(&replicas[0], &apply_all(&ops));
    }

    /// (b) Ops split across three replicas; merging their states in any order or grouping
    /// gives the state that saw every op.
    #[test]
    fn merge_is_commutative_and_associative(
        (ops, owner) in ops().prop_flat_map(|ops| {
            let n = ops.len();
            (Just(ops), vec(0usize..3, n))
        })
    ) {
        let part = |k| apply_all(ops.iter().zip(&owner).filter(|(_, o)| **o == k).map(|(op, _)| op));
        let (a, b, c) = (part(0), part(1), part(2));
        let all = apply_all(&ops);
        prop_assert_eq!(&merged(&a, &b), &merged(&b, &a));
        prop_assert_eq!(&merged(&merged(&a, &b), &c), &all);
        prop_assert_eq!(&merged(&a, &merged(&b, &c)), &all);
        prop_assert_eq!(&merged(&merged(&c, &a), &b), &all);
        prop_assert_eq!(&merged(&b, &merged(&c, &a)), &all);
        // Equal digests mean equal entries, name by name.
        let (da, db) = (a.digest(), b.digest());
        for (n, d) in &da {
            let same = db.get(n) == Some(d);
            prop_assert_eq!(same, a.entries_for([n]) == b.entries_for([n]));
        }
    }

    /// (c) Merging a state into itself, or into a state that already has it, changes nothing.
    #[test]
    fn merge_is_idempotent(ops in ops(), cut in 0usize..60) {
        let a = apply_all(&ops);
        let mut twice = a.clone();
        prop_assert!(!twice.merge(&a));
        prop_assert_eq!(&twice, &a);
        let prefix = apply_all(ops.iter().take(cut));
        prop_assert!(!twice.merge(&prefix));
        prop_assert_eq!(&twice, &a);
    }

    /// (d) Applying ops equals merging one-op states, and `apply` reports changes truthfully.
    #[test]
    fn apply_equals_merging_singleton_states(ops in ops()) {
        let mut by_apply = Registry::new();
        let mut by_merge = Registry::new();
        for op in &ops {
            let before = by_apply.clone();
            let changed = by_apply.apply(op);
            prop_assert_eq!(changed, by_apply != before, "apply({:?}) misreported", op);
            let changed = by_merge.merge(&apply_all([op]));
            prop_assert_eq!(changed, by_merge != before);
        }
        prop_assert_eq!(by_apply, by_merge);
    }

    /// (e) Pruning commutes with merging up to a final prune:
    /// `prune(merge(prune(a), prune(b))) == prune(merge(a, b))`, and replicas that prune at
    /// arbitrary moments end equal once they have seen everything and pruned once more.
    #[test]
    fn pruning_converges(
        (ops, owner, orders) in ops().prop_flat_map(|ops| {
            let n = ops.len();
            (Just(ops), vec(0usize..2, n), [schedule(n), schedule(n)])
        }),
        keep in 1u64..4,
        prune_points in any::<u64>(),
    ) {
        let part = |k| apply_all(ops.iter().zip(&owner).filter(|(_, o)| **o == k).map(|(op, _)| op));
        let (a, b) = (part(0), part(1));
        let whole = pruned(&merged(&a, &b), keep);
        prop_assert_eq!(&pruned(&merged(&pruned(&a, keep), &pruned(&b, keep)), keep), &whole);
        prop_assert_eq!(&pruned(&apply_all(&ops), keep), &whole);

        let replicas: Vec<Registry> = orders
            .iter()
            .enumerate()
            .map(|(r, order)| {
                let mut reg = Registry::new();
                for (step, &i) in order.iter().enumerate() {
                    reg.apply(&ops[i]);
                    if prune_points >> ((r * 31 + step) % 64) & 1 == 1 {
                        reg.prune(keep);
                    }
                }
                reg.prune(keep);
                reg
            })
            .collect();
        prop_assert_eq!(&replicas[0], &whole);
        prop_assert_eq!(&replicas[1], &whole);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// (f) Bucketed anti-entropy, run both ways over the wire, makes two replicas equal: each
    /// ends with the merge of both, whatever ops they saw alone or together.
    #[test]
    fn two_way_sync_makes_replicas_equal(
        (ops, owner) in ops().prop_flat_map(|ops| {
            let n = ops.len();
            (Just(ops), vec(0usize..3, n))
        }),
        budget in prop_oneof![Just(1usize), 60usize..400, Just(tb_proto::MAX_CHUNK_BYTES)],
    ) {
        // Owner 0: only A saw the op, 1: only B, 2: both.
        let part = |k| apply_all(ops.iter().zip(&owner).filter(|(_, o)| **o == k || **o == 2).map(|(op, _)| op));
        let (mut a, mut b) = (part(0), part(1));
        let whole = merged(&a, &b);
        sync_from(&mut a, &b, budget);
        prop_assert_eq!(&a, &whole, "the asker holds everything after one conversation");
        sync_from(&mut b, &a, budget);
        prop_assert_eq!(&b, &whole);
        prop_assert_eq!(&a, &b);
        prop_assert!(a.differing_buckets(&b.bucket_digests()).is_empty());
    }
}

fn at(wall_ms: u64, node: u8) -> Stamp {
    Stamp {
        wall_ms,
        logical: 0,
        node: id(node),
    }
}

fn publish(version: u64, stamp: Stamp) -> RegistryOp {
    RegistryOp::Publish {
        name: name("m/w"),
        version,
        meta: TensorMeta::new(DType::F32, vec![4], ContentHash([version as u8; 32])).expect("meta"),
        publisher: stamp.node,
        stamp,
    }
}

fn add(version: u64, node: u8, stamp: Stamp) -> RegistryOp {
    RegistryOp::AddHolder {
        name: name("m/w"),
        version,
        node: id(node),
        stamp,
    }
}

fn remove(version: u64, node: u8, stamp: Stamp) -> RegistryOp {
    RegistryOp::RemoveHolder {
        name: name("m/w"),
        version,
        node: id(node),
        stamp,
    }
}

fn delete(stamp: Stamp) -> RegistryOp {
    RegistryOp::Delete {
        name: name("m/w"),
        stamp,
    }
}

/// Both orders of two ops, checked equal.
fn both_orders(x: RegistryOp, y: RegistryOp) -> Registry {
    let xy = apply_all([&x, &y]);
    assert_eq!(
        xy,
        apply_all([&y, &x]),
        "order mattered for {x:?} and {y:?}"
    );
    xy
}

#[test]
fn holder_added_before_publish_is_not_lost() {
    // The holder's gossip overtakes the publisher's.
    let mut r = Registry::new();
    assert!(r.apply(&add(1, 2, at(6, 2))));
    assert!(r.entry(&name("m/w")).is_none(), "not published yet");
    assert!(r.list("").next().is_none());
    assert!(r.apply(&publish(1, at(5, 1))));
    assert_eq!(r.live_holders(&name("m/w"), 1, |_| true), vec![id(2)]);
    assert_eq!(r, both_orders(add(1, 2, at(6, 2)), publish(1, at(5, 1))));
    // The same through anti-entropy: a state holding only the mark is merged first.
    let mut synced = apply_all([&add(1, 2, at(6, 2))]);
    synced.merge(&apply_all([&publish(1, at(5, 1))]));
    assert_eq!(synced, r);
}

#[test]
fn holder_removed_before_publish_is_not_lost() {
    let r = both_orders(remove(1, 2, at(7, 2)), publish(1, at(5, 1)));
    let r = {
        let mut r = r;
        r.apply(&add(1, 2, at(6, 2)));
        r
    };
    assert!(r.live_holders(&name("m/w"), 1, |_| true).is_empty());
}

#[test]
fn equal_stamp_add_and_remove_add_wins() {
    let s = at(5, 2);
    let r = both_orders(remove(1, 2, s), add(1, 2, s));
    let r = {
        let mut r = r;
        r.apply(&publish(1, at(1, 1)));
        r
    };
    assert_eq!(r.live_holders(&name("m/w"), 1, |_| true), vec![id(2)]);
}

#[test]
fn later_publish_revives_deleted_name() {
    let r = both_orders(publish(1, at(1, 1)), delete(at(2, 3)));
    assert!(r.entry(&name("m/w")).is_none());
    let mut r = r;
    r.apply(&publish(2, at(3, 1)));
    assert_eq!(r.entry(&name("m/w")).map(|e| e.version), Some(2));
    assert_eq!(
        r,
        apply_all([
            &publish(2, at(3, 1)),
            &delete(at(2, 3)),
            &publish(1, at(1, 1))
        ])
    );
}

#[test]
fn earlier_publish_does_not_revive_deleted_name() {
    // A delayed publish stamped before the delete stays deleted, whichever arrives first.
    let r = both_orders(delete(at(5, 3)), publish(2, at(4, 1)));
    assert!(r.entry(&name("m/w")).is_none());
}

#[test]
fn stale_death_notice_does_not_kill_a_restarted_node() {
    let row = |epoch, wall_ms, alive| {
        RegistryOp::Member(Member {
            node: id(1),
            role: Role::Broker,
            addrs: vec!["10.0.0.1:1".into()],
            epoch,
            alive,
            stamp: at(wall_ms, 2),
        })
    };
    let r = both_orders(row(2, 10, true), row(1, 20, false));
    assert_eq!(
        r.member(&id(1)).map(|m| (m.epoch, m.alive)),
        Some((2, true))
    );
}
