use super::*;
use crate::{ContentHash, DType, MAX_NAME_LEN, MAX_RANK};

fn id(b: u8) -> NodeId {
    NodeId([b; 32])
}

fn at(wall_ms: u64, node: u8) -> Stamp {
    Stamp {
        wall_ms,
        logical: 0,
        node: id(node),
    }
}

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("valid name")
}

fn meta(hash: u8) -> TensorMeta {
    TensorMeta::new(DType::F32, vec![2, 3], ContentHash([hash; 32])).expect("meta")
}

fn publish(n: &str, version: u64, hash: u8, stamp: Stamp) -> RegistryOp {
    RegistryOp::Publish {
        name: name(n),
        version,
        meta: meta(hash),
        publisher: stamp.node,
        stamp,
    }
}

fn holder(n: &str, version: u64, node: u8, stamp: Stamp, present: bool) -> RegistryOp {
    RegistryOp::holder(name(n), version, id(node), stamp, present)
}

fn delete(n: &str, stamp: Stamp) -> RegistryOp {
    RegistryOp::Delete {
        name: name(n),
        stamp,
    }
}

fn registry(ops: &[RegistryOp]) -> Registry {
    let mut r = Registry::new();
    for op in ops {
        r.apply(op);
    }
    r
}

#[test]
fn newest_version_wins_over_a_later_stamp() {
    let ops = [
        publish("m/w", 2, 2, at(10, 1)),
        publish("m/w", 1, 1, at(99, 2)),
    ];
    for r in [registry(&ops), registry(&[ops[1].clone(), ops[0].clone()])] {
        let e = r.entry(&name("m/w")).expect("live");
        assert_eq!(
            (e.version, e.meta.hash, e.publisher),
            (2, ContentHash([2; 32]), id(1))
        );
    }
}

#[test]
fn same_stamp_conflicting_publishes_resolve_the_same_everywhere() {
    let s = at(5, 1);
    let (a, b) = (publish("m/w", 1, 1, s), publish("m/w", 1, 2, s));
    let ab = registry(&[a.clone(), b.clone()]);
    assert_eq!(ab, registry(&[b, a]));
    assert_eq!(
        ab.entry(&name("m/w")).map(|e| e.meta.hash),
        Some(ContentHash([2; 32]))
    );
}

#[test]
fn apply_reports_changes_and_repeats_are_no_ops() {
    let mut r = Registry::new();
    let p = publish("m/w", 1, 1, at(1, 1));
    assert!(r.apply(&p));
    assert!(!r.apply(&p));
    assert!(!r.apply(&publish("m/w", 1, 1, at(0, 1))), "older loses");
    let add = holder("m/w", 1, 2, at(2, 2), true);
    assert!(r.apply(&add));
    assert!(!r.apply(&add));
    assert!(
        !r.apply(&holder("m/w", 1, 2, at(1, 2), false)),
        "older remove"
    );
    assert!(r.apply(&delete("m/w", at(3, 1))));
    assert!(!r.apply(&delete("m/w", at(2, 1))));
    assert!(r.entry(&name("m/w")).is_none());
}

#[test]
fn delete_before_publish_hides_an_earlier_publish_in_any_order() {
    let ops = [delete("m/w", at(5, 3)), publish("m/w", 1, 1, at(4, 1))];
    let (a, b) = (registry(&ops), registry(&[ops[1].clone(), ops[0].clone()]));
    assert_eq!(a, b);
    assert!(a.entry(&name("m/w")).is_none());
    assert_eq!(
        a.next_version(&name("m/w")),
        2,
        "versions go on after a delete"
    );
    assert_eq!(a.next_version(&name("other")), 1);
}

#[test]
fn live_holders_filters_version_liveness_and_deletes() {
    let mut r = registry(&[
        publish("m/w", 2, 1, at(1, 1)),
        holder("m/w", 2, 1, at(2, 1), true),
        holder("m/w", 2, 2, at(2, 2), true),
        holder("m/w", 2, 3, at(2, 3), true),
        holder("m/w", 2, 3, at(3, 3), false),
        holder("m/w", 1, 4, at(2, 4), true),
    ]);
    let w = name("m/w");
    assert_eq!(r.live_holders(&w, 2, |_| true), vec![id(1), id(2)]);
    assert_eq!(r.live_holders(&w, 2, |n| *n != id(1)), vec![id(2)]);
    assert_eq!(r.live_holders(&w, 1, |_| true), vec![id(4)]);
    assert!(r.live_holders(&name("nope"), 2, |_| true).is_empty());
    r.apply(&delete("m/w", at(9, 1)));
    assert!(r.live_holders(&w, 2, |_| true).is_empty());
}

#[test]
fn list_respects_level_boundaries_and_hides_dead_names() {
    let r = registry(&[
        publish("model/a", 1, 1, at(1, 1)),
        publish("model/b/c", 1, 1, at(1, 1)),
        publish("modelx/a", 1, 1, at(1, 1)),
        publish("model/gone", 1, 1, at(1, 1)),
        delete("model/gone", at(2, 1)),
        holder("model/pending", 1, 1, at(1, 1), true),
        publish("a", 1, 1, at(1, 1)),
    ]);
    let names = |p| r.list(p).map(|(n, _)| n.as_str()).collect::<Vec<_>>();
    assert_eq!(names("model/"), ["model/a", "model/b/c"]);
    assert_eq!(names("model/b/"), ["model/b/c"]);
    assert_eq!(names(""), ["a", "model/a", "model/b/c", "modelx/a"]);
    assert!(names("zzz").is_empty());
}

#[test]
fn listing_after_a_name_resumes_past_it_and_hides_dead_names() {
    let r = registry(&[
        publish("a", 1, 1, at(1, 1)),
        publish("b/gone", 1, 1, at(1, 1)),
        delete("b/gone", at(2, 1)),
        publish("b/x", 1, 1, at(1, 1)),
        holder("b/y", 1, 1, at(1, 1), true),
        publish("c", 1, 1, at(1, 1)),
    ]);
    let after = |a: Option<&str>| {
        let a = a.map(name);
        r.list_after(a.as_ref())
            .map(|(n, _)| n.as_str().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(after(None), ["a", "b/x", "c"]);
    assert_eq!(after(Some("a")), ["b/x", "c"]);
    // A cursor need not be a live name (it may have been deleted since).
    assert_eq!(after(Some("b/gone")), ["b/x", "c"]);
    assert_eq!(after(Some("b")), ["b/x", "c"]);
    assert!(after(Some("c")).is_empty());
}

#[test]
fn prune_keeps_the_newest_versions_holders() {
    let mut r = registry(&[
        publish("m/w", 3, 1, at(1, 1)),
        holder("m/w", 1, 1, at(1, 1), true),
        holder("m/w", 2, 1, at(1, 1), true),
        holder("m/w", 3, 1, at(1, 1), false),
        holder("m/w", 4, 1, at(1, 1), true),
        holder("pending", 1, 1, at(1, 1), true),
    ]);
    assert!(r.prune(2));
    assert!(!r.prune(2));
    let keys = |r: &Registry| {
        r.entries[&name("m/w")]
            .holders
            .keys()
            .map(|k| k.1)
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&r), [2, 3, 4], "versions ahead of the newest stay");
    assert!(r.prune(0), "0 keeps only the newest");
    assert_eq!(keys(&r), [3, 4]);
    assert_eq!(r.entries[&name("pending")].holders.len(), 1);
}

#[test]
fn pruning_one_name_touches_only_that_entry_and_matches_a_whole_prune_of_it() {
    let ops = [
        publish("m/w", 3, 1, at(1, 1)),
        holder("m/w", 1, 1, at(1, 1), true),
        holder("m/w", 3, 1, at(1, 1), true),
        publish("m/v", 2, 1, at(1, 1)),
        holder("m/v", 1, 1, at(1, 1), true),
    ];
    let mut one = registry(&ops);
    assert!(one.prune_name(&name("m/w"), 1));
    assert!(!one.prune_name(&name("m/w"), 1));
    assert!(!one.prune_name(&name("absent"), 1));
    assert_eq!(
        one.entries[&name("m/v")].holders.len(),
        1,
        "other names untouched"
    );
    let mut whole = registry(&ops);
    whole.prune(1);
    assert_eq!(one.entries[&name("m/w")], whole.entries[&name("m/w")]);
    assert!(one.prune_name(&name("m/v"), 1));
    assert_eq!(one, whole);
}

#[test]
fn pruned_marks_can_return_by_merge_but_the_next_prune_drops_them() {
    // `a` has not seen v3 yet, so its prune keeps the v1 mark; `b` pruned it.
    let mut a = registry(&[
        publish("m/w", 1, 1, at(1, 1)),
        holder("m/w", 1, 2, at(2, 2), true),
    ]);
    let mut b = a.clone();
    b.apply(&publish("m/w", 3, 3, at(3, 1)));
    let mut whole = a.clone();
    whole.merge(&b);
    whole.prune(1);
    a.prune(1);
    b.prune(1);
    a.merge(&b);
    assert_ne!(a, whole, "merging an unpruned replica brings the mark back");
    a.prune(1);
    assert_eq!(a, whole);
}

#[test]
fn sync_by_digest_makes_replicas_equal() {
    let mut a = registry(&[
        publish("m/a", 1, 1, at(1, 1)),
        publish("m/b", 1, 1, at(1, 1)),
        delete("m/d", at(4, 2)),
    ]);
    let mut b = registry(&[
        publish("m/a", 1, 1, at(1, 1)),
        publish("m/b", 2, 2, at(2, 2)),
        holder("m/c", 1, 3, at(3, 3), true),
    ]);
    let (da, db) = (a.digest(), b.digest());
    assert_eq!(da[&name("m/a")], db[&name("m/a")]);
    assert_ne!(da[&name("m/b")], db[&name("m/b")]);
    let differ = |x: &BTreeMap<TensorName, [u8; 32]>, y: &BTreeMap<TensorName, [u8; 32]>| {
        x.iter()
            .filter(|(n, d)| y.get(*n) != Some(*d))
            .map(|(n, _)| n.clone())
            .collect::<Vec<_>>()
    };
    for (n, e) in b.entries_for(&differ(&db, &da)) {
        e.validate(&n, 1 << 20).expect("valid");
        a.merge_entry(&n, &e);
    }
    for (n, e) in a.entries_for(&differ(&a.digest(), &db)) {
        b.merge_entry(&n, &e);
    }
    assert_eq!(a, b);
    assert_eq!(a.digest(), b.digest());
}

#[test]
fn members_sync_and_restart_epochs_win() {
    let row = |epoch, wall_ms, alive| Member {
        node: id(1),
        role: Role::Worker,
        addrs: vec!["127.0.0.1:1".into()],
        epoch,
        alive,
        stamp: at(wall_ms, 2),
    };
    let mut a = Registry::new();
    assert!(a.apply(&RegistryOp::Member(row(2, 1, true))));
    assert!(
        !a.apply(&RegistryOp::Member(row(1, 50, false))),
        "old epoch"
    );
    let mut b = Registry::new();
    b.merge_member(&row(1, 50, false));
    assert_ne!(a.member_digest(), b.member_digest());
    for m in a.members_for(a.member_digest().keys()) {
        b.merge_member(&m);
    }
    assert_eq!(
        b.member(&id(1)).map(|m| (m.epoch, m.alive)),
        Some((2, true))
    );
    assert_eq!(a.member_digest(), b.member_digest());
    assert_eq!(b.members().count(), 1);
}

#[test]
fn validate_refuses_bad_ops_and_names_the_tensor() {
    let ok = publish("m/w", 1, 1, at(1, 1));
    assert!(ok.validate(24).is_ok());
    let err = ok.validate(23).expect_err("too large");
    assert!(
        matches!(
            &err,
            RegistryError::Meta {
                source: MetaError::TooLarge { .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().starts_with("tensor \"m/w\" v1: "), "{err}");
    assert_eq!(
        publish("m/w", 0, 1, at(1, 1)).validate(24),
        Err(RegistryError::ZeroVersion { name: name("m/w") })
    );
    assert!(holder("m/w", 0, 1, at(1, 1), false).validate(24).is_err());
    assert!(holder("m/w", 1, 1, at(1, 1), true).validate(24).is_ok());
    assert!(delete("m/w", at(1, 1)).validate(0).is_ok());
    let mut lie = meta(1);
    lie.byte_len = 7;
    let op = RegistryOp::Publish {
        name: name("m/w"),
        version: 1,
        meta: lie.clone(),
        publisher: id(1),
        stamp: at(1, 1),
    };
    assert!(op.validate(1 << 20).is_err());
    let mut entry = Entry::placeholder();
    assert!(entry.validate(&name("m/w"), 0).is_ok());
    entry.meta = lie;
    assert!(entry.validate(&name("m/w"), 1 << 20).is_err());
}

#[test]
fn largest_ops_fit_one_gossip_message() {
    let top = Stamp {
        wall_ms: u64::MAX,
        logical: u32::MAX,
        node: id(0xff),
    };
    // Worst case for postcard's varints: every integer at its maximum.
    let publish = RegistryOp::Publish {
        name: name(&"n".repeat(MAX_NAME_LEN)),
        version: u64::MAX,
        meta: TensorMeta {
            dtype: DType::F64,
            shape: vec![u64::MAX; MAX_RANK],
            byte_len: u64::MAX,
            hash: ContentHash([0xff; 32]),
        },
        publisher: id(0xff),
        stamp: top,
    };
    let member = RegistryOp::Member(Member {
        node: id(0xff),
        role: Role::Worker,
        addrs: vec!["a".repeat(MAX_ADDR_LEN); MAX_MEMBER_ADDRS],
        epoch: u64::MAX,
        alive: true,
        stamp: top,
    });
    for op in [publish, member] {
        let len = op.encoded_len();
        assert_eq!(Ok(len), postcard::to_stdvec(&op).map(|v| v.len()));
        assert!(len <= MAX_GOSSIP_OP_BYTES, "{len} bytes: {op:?}");
    }
    assert_eq!(delete("m/w", top).stamp(), &top);
}

/// Golden bytes of every op variant: gossip carries the bare postcard body (no frame prefix).
/// If one of these fails, the gossip wire changed, and old and new nodes no longer understand
/// each other.
#[test]
fn ops_have_golden_bytes() {
    let n7 = "07".repeat(32);
    let stamp = Stamp {
        wall_ms: 300,
        logical: 1,
        node: id(7),
    };
    // wall_ms 300 is the varint ac 02, then logical, then the issuer's 32 bytes.
    let s = format!("ac02 01 {n7}");
    let cases = [
        (
            RegistryOp::Publish {
                name: name("a"),
                version: 2,
                meta: meta(0x11),
                publisher: id(7),
                stamp,
            },
            // variant, name, version, meta (f32 = 0b, shape [2, 3], 24 bytes, hash), publisher
            format!("00 0161 02 0b 020203 18 {} {n7} {s}", "11".repeat(32)),
        ),
        (
            RegistryOp::AddHolder {
                name: name("a"),
                version: 2,
                node: id(9),
                stamp,
            },
            format!("01 0161 02 {} {s}", "09".repeat(32)),
        ),
        (
            RegistryOp::RemoveHolder {
                name: name("a"),
                version: 2,
                node: id(9),
                stamp,
            },
            format!("02 0161 02 {} {s}", "09".repeat(32)),
        ),
        (
            RegistryOp::Delete {
                name: name("a"),
                stamp,
            },
            format!("03 0161 {s}"),
        ),
        (
            RegistryOp::Member(Member {
                node: id(7),
                role: Role::Worker,
                addrs: vec!["a:1".into()],
                epoch: 5,
                alive: true,
                stamp,
            }),
            // node, role, one 3-byte address, epoch, alive
            format!("04 {n7} 01 01 03613a31 05 01 {s}"),
        ),
    ];
    for (op, expected) in cases {
        let bytes = postcard::to_stdvec(&op).expect("encode");
        let hex = hex::encode(&bytes);
        assert_eq!(hex, expected.replace(' ', ""), "{op:?}");
        assert_eq!(op.encoded_len(), bytes.len());
        let back: RegistryOp = crate::frame::decode_body(&bytes).expect("decode");
        assert_eq!(back, op);
    }
}

fn row(node: u8, epoch: u64, alive: bool, addrs: &[&str], stamp: Stamp) -> Member {
    Member {
        node: id(node),
        role: Role::Worker,
        addrs: addrs.iter().map(|a| a.to_string()).collect(),
        epoch,
        alive,
        stamp,
    }
}

const EXPIRY: Expiry = Expiry {
    dead_after_ms: 1_000,
    left_after_ms: 100,
};

#[test]
fn forget_drops_expired_rows_and_the_old_marks_of_nodes_without_a_row() {
    let mut r = registry(&[
        publish("m/w", 1, 1, at(10, 1)),
        holder("m/w", 1, 1, at(10, 9), true),
        holder("m/w", 1, 2, at(10, 9), true),
        holder("m/w", 1, 3, at(10, 9), true),
        // A mark of a node whose row never came: young, so kept until it is old.
        holder("m/w", 1, 4, at(900, 9), true),
    ]);
    for m in [
        row(1, 1, true, &["a:1"], at(10, 9)),
        row(2, 1, false, &["a:2"], at(20, 9)),
        row(3, 1, false, &[], at(30, 9)),
    ] {
        r.merge_member(&m);
    }
    let before = r.clone();
    assert_eq!(r.forget(130, &EXPIRY), Forgotten::default(), "all young");
    assert_eq!(r, before);

    // Node 3 left: its row goes after `left_after_ms`, its marks after `dead_after_ms`.
    let gone = r.forget(131, &EXPIRY);
    assert_eq!(gone.members, [id(3)]);
    assert!(gone.names.is_empty());
    assert!(r.member(&id(3)).is_none());
    assert_eq!(r.live_holders(&name("m/w"), 1, |_| true).len(), 4);

    // Node 2 fell silent: its row and its marks go after `dead_after_ms`; so do node 3's
    // marks. Node 1 is alive: its old mark stays. Node 4's mark is still young.
    let gone = r.forget(1_021, &EXPIRY);
    assert_eq!(gone.members, [id(2)]);
    assert_eq!(gone.names, [name("m/w")]);
    assert_eq!(
        r.live_holders(&name("m/w"), 1, |_| true),
        [id(1), id(4)],
        "alive node 1's old mark and node 4's young one"
    );
    assert_eq!(
        r.members().map(|m| m.node).collect::<Vec<_>>(),
        [id(1)],
        "the alive row stays however old"
    );
    assert_eq!(r.forget(1_901, &EXPIRY).names, [name("m/w")]);
    assert_eq!(r.live_holders(&name("m/w"), 1, |_| true), [id(1)]);
    assert_eq!(r.forget(1_000_000, &EXPIRY), Forgotten::default());
}

#[test]
fn a_merge_does_not_bring_back_a_forgotten_row_or_leave_an_older_alive_one() {
    let alive = row(2, 1, true, &["a:2"], at(10, 9));
    let dead = row(2, 1, false, &["a:2"], at(20, 9));
    let now = 2_000;
    // A forgot node 2; B, whose clock is behind, still has the dead row and sends it.
    let mut a = Registry::new();
    a.merge_member(&dead);
    assert_eq!(a.forget(now, &EXPIRY).members, [id(2)]);
    let mut b = Registry::new();
    b.merge_member(&dead);
    assert!(b.forget(500, &EXPIRY).members.is_empty());
    for m in b.members_to_send(&a.member_digest()) {
        a.merge_member(&m);
        a.forget_member(&m.node, now, &EXPIRY);
    }
    assert!(a.member(&id(2)).is_none(), "the dead row came back");

    // C still has the alive row: the expired dead row replaces it, then goes.
    let mut c = Registry::new();
    c.merge_member(&alive);
    assert!(c.merge_member(&dead));
    assert!(c.forget_member(&id(2), now, &EXPIRY));
    assert!(c.member(&id(2)).is_none(), "the alive row was left behind");
    // Merged in after that, the alive row is older than the forgotten one only by its stamp:
    // it cannot be told apart from news, which is why a row must reach every replica
    // before it expires (see `Registry::forget`).
    assert!(!c.forget_member(&id(2), now, &EXPIRY));

    // Old marks of the forgotten node, merged from a replica that kept them, go with them.
    let marks = registry(&[
        publish("m/w", 1, 1, at(10, 1)),
        holder("m/w", 1, 2, at(10, 9), true),
    ]);
    for (n, e) in marks.entries_for([&name("m/w")]) {
        a.merge_entry(&n, &e);
        assert!(a.forget_marks(&n, now, &EXPIRY));
    }
    assert!(a.live_holders(&name("m/w"), 1, |_| true).is_empty());
    assert_eq!(a.digest(), {
        let mut m = marks.clone();
        m.forget(now, &EXPIRY);
        m.digest()
    });
}

#[test]
fn replicas_that_forget_end_equal_in_any_order() {
    let rows = [
        row(1, 1, true, &["a:1"], at(10, 9)),
        row(1, 1, false, &["a:1"], at(20, 9)),
        row(2, 1, false, &[], at(30, 9)),
        row(3, 2, true, &["a:3"], at(40, 9)),
        row(3, 1, false, &["a:3"], at(50, 9)),
    ];
    let ops: Vec<RegistryOp> = rows
        .iter()
        .cloned()
        .map(RegistryOp::Member)
        .chain([
            publish("m/w", 1, 1, at(5, 1)),
            holder("m/w", 1, 1, at(6, 9), true),
            holder("m/w", 1, 2, at(7, 9), true),
            // Young: a mark that arrives before its node's row must not be forgotten.
            holder("m/w", 1, 3, at(4_500, 9), true),
        ])
        .collect();
    let (early, late) = (60, 5_000);
    let mut want: Option<Registry> = None;
    for rotate in 0..ops.len() {
        let mut order = ops.clone();
        order.rotate_left(rotate);
        // Half the ops reach one replica, half the other, each forgetting after every op
        // while the rows are young; they merge each other's state both ways.
        let (mut x, mut y) = (Registry::new(), Registry::new());
        for (i, op) in order.iter().enumerate() {
            let r = if i % 2 == 0 { &mut x } else { &mut y };
            r.apply(op);
            r.forget(early, &EXPIRY);
        }
        let (x0, y0) = (x.clone(), y.clone());
        x.merge(&y0);
        y.merge(&x0);
        // Later, x forgets first (its clock is ahead), and y sends it everything it still
        // holds before forgetting too: nothing forgotten comes back.
        x.forget(late, &EXPIRY);
        let y1 = y.clone();
        x.merge(&y1);
        x.forget(late, &EXPIRY);
        y.forget(late, &EXPIRY);
        assert_eq!(x, y, "rotation {rotate}");
        assert_eq!(
            x.members().map(|m| m.node).collect::<Vec<_>>(),
            [id(3)],
            "only node 3's alive second life stays"
        );
        assert_eq!(x.live_holders(&name("m/w"), 1, |_| true), [id(3)]);
        match &want {
            Some(w) => assert_eq!(&x, w, "rotation {rotate}"),
            None => want = Some(x),
        }
    }
}
