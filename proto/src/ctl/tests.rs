use super::*;
use crate::{
    ChannelKind, ContentHash, DType, Entry, MAX_ADDR_LEN, MAX_MEMBER_ADDRS, MAX_NAME_LEN,
    MetaError, NameError, RegistryError, SYNC_BUCKETS, Stamp, chunk_by_size, frame,
};

const MAX: u64 = 1 << 20;

fn id(b: u8) -> NodeId {
    NodeId([b; 32])
}

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("name")
}

fn meta(len: u64) -> TensorMeta {
    TensorMeta::new(DType::U8, vec![len], ContentHash([1; 32])).expect("meta")
}

/// A member row at the address limits: the largest a valid row gets.
fn fat_member(b: u8) -> Member {
    Member {
        node: id(b),
        role: Role::Worker,
        addrs: vec!["a".repeat(MAX_ADDR_LEN); MAX_MEMBER_ADDRS],
        epoch: u64::MAX,
        alive: true,
        stamp: Stamp {
            wall_ms: u64::MAX,
            logical: u32::MAX,
            node: id(b),
        },
    }
}

fn too_many(what: &'static str, count: usize, max: usize) -> CtlError {
    CtlError::TooMany {
        what,
        count: count as u64,
        max: max as u64,
    }
}

#[test]
fn heartbeat_addresses_are_limited() {
    let hb = |addrs| CtlRequest::Heartbeat {
        role: Role::Worker,
        addrs,
        epoch: 1,
        stats: None,
    };
    let full = vec!["a".repeat(MAX_ADDR_LEN); MAX_MEMBER_ADDRS];
    assert_eq!(hb(full.clone()).validate(MAX), Ok(()));
    let mut more = full;
    more.push("x".into());
    assert_eq!(
        hb(more).validate(MAX),
        Err(too_many("heartbeat addresses", 9, MAX_MEMBER_ADDRS))
    );
    assert_eq!(
        hb(vec!["a".repeat(MAX_ADDR_LEN + 1)]).validate(MAX),
        Err(CtlError::AddrTooLong {
            len: MAX_ADDR_LEN + 1
        })
    );
}

#[test]
fn heartbeat_stats_must_be_finite_non_negative_and_short() {
    let hb = |stats: NodeStats| CtlRequest::Heartbeat {
        role: Role::Worker,
        addrs: vec!["127.0.0.1:1".into()],
        epoch: 1,
        stats: Some(stats),
    };
    let good = NodeStats {
        pool_links: 2,
        in_bytes_per_s: 10.5,
        latency_p50_s: Some(0.01),
        metrics_url: Some("x".repeat(MAX_METRICS_URL_LEN)),
        ..NodeStats::default()
    };
    assert_eq!(hb(good.clone()).validate(MAX), Ok(()));
    let bad = |field, stats| assert_eq!(hb(stats).validate(MAX), Err(CtlError::BadStat { field }));
    bad(
        "in_bytes_per_s",
        NodeStats {
            in_bytes_per_s: -1.0,
            ..good.clone()
        },
    );
    bad(
        "out_bytes_per_s",
        NodeStats {
            out_bytes_per_s: f64::NAN,
            ..good.clone()
        },
    );
    bad(
        "latency_p50_s",
        NodeStats {
            latency_p50_s: Some(f64::INFINITY),
            ..good.clone()
        },
    );
    bad(
        "latency_p99_s",
        NodeStats {
            latency_p99_s: Some(-0.5),
            ..good.clone()
        },
    );
    let long = NodeStats {
        metrics_url: Some("x".repeat(MAX_METRICS_URL_LEN + 1)),
        ..good
    };
    assert_eq!(
        hb(long).validate(MAX),
        Err(CtlError::UrlTooLong {
            len: MAX_METRICS_URL_LEN + 1
        })
    );
}

#[test]
fn announce_counts_and_validates_its_ops() {
    let op = RegistryOp::Delete {
        name: name("a"),
        stamp: Stamp::ZERO,
    };
    let announce = |n| CtlRequest::Announce {
        ops: vec![op.clone(); n],
    };
    assert_eq!(announce(MAX_ANNOUNCE_OPS).validate(MAX), Ok(()));
    assert_eq!(
        announce(MAX_ANNOUNCE_OPS + 1).validate(MAX),
        Err(too_many("announced ops", 257, MAX_ANNOUNCE_OPS))
    );
    let big = RegistryOp::Publish {
        name: name("a"),
        version: 1,
        meta: meta(MAX + 1),
        publisher: id(1),
        stamp: Stamp::ZERO,
    };
    let err = CtlRequest::Announce { ops: vec![op, big] }.validate(MAX);
    assert!(
        matches!(
            err,
            Err(CtlError::Registry(RegistryError::Meta {
                source: MetaError::TooLarge { .. },
                ..
            }))
        ),
        "{err:?}"
    );
    // A valid frame of the most ops, each at the gossip size limit, fits one control frame.
    assert!(MAX_ANNOUNCE_OPS * crate::MAX_GOSSIP_OP_BYTES < MAX_CONTROL_FRAME as usize - 16);
}

#[test]
fn versions_start_at_one() {
    let zero = RegistryError::ZeroVersion { name: name("a") };
    let lookup = |version| CtlRequest::Lookup {
        name: name("a"),
        version,
        exclude: vec![],
    };
    assert_eq!(lookup(None).validate(MAX), Ok(()));
    let excluding = |count| CtlRequest::Lookup {
        name: name("a"),
        version: None,
        exclude: vec![id(1); count],
    };
    assert_eq!(excluding(MAX_LOOKUP_EXCLUDE).validate(MAX), Ok(()));
    assert!(matches!(
        excluding(MAX_LOOKUP_EXCLUDE + 1).validate(MAX),
        Err(CtlError::TooMany {
            what: "excluded sources",
            ..
        })
    ));
    assert_eq!(lookup(Some(1)).validate(MAX), Ok(()));
    assert_eq!(lookup(Some(0)).validate(MAX), Err(zero.clone().into()));
    let fetching = CtlRequest::Fetching {
        name: name("a"),
        version: 0,
        active: true,
    };
    assert_eq!(fetching.validate(MAX), Err(zero.clone().into()));
    assert_eq!(
        CtlResponse::Version { version: 0 }.validate(MAX),
        Err(CtlError::ZeroVersionAssigned)
    );
    let event = CtlResponse::Event(Event::Published {
        name: name("a"),
        version: 0,
        meta: meta(1),
        publisher: id(1),
    });
    assert_eq!(event.validate(MAX), Err(zero.into()));
}

#[test]
fn list_prefix_and_limit_are_checked() {
    let list = |prefix: &str, limit| CtlRequest::List {
        prefix: prefix.into(),
        limit,
    };
    assert_eq!(list("", MAX_LIST_LIMIT).validate(MAX), Ok(()));
    assert_eq!(list("model/la", 0).validate(MAX), Ok(()));
    assert_eq!(
        list("", MAX_LIST_LIMIT + 1).validate(MAX),
        Err(too_many(
            "entries asked of a listing",
            100_001,
            MAX_LIST_LIMIT as usize
        ))
    );
    assert_eq!(
        list(&"x".repeat(MAX_NAME_LEN + 1), 1).validate(MAX),
        Err(CtlError::Prefix(NameError::TooLong { len: 257 }))
    );
    assert_eq!(
        list("a b", 1).validate(MAX),
        Err(CtlError::Prefix(NameError::BadChar { ch: ' ', pos: 1 }))
    );
}

#[test]
fn sync_buckets_carry_exactly_256_digests() {
    let sync = |buckets, members| CtlRequest::SyncBuckets {
        buckets: vec![[0; 32]; buckets],
        members: vec![(id(1), [0; 32]); members],
    };
    assert_eq!(sync(SYNC_BUCKETS, MAX_SYNC_MEMBERS).validate(MAX), Ok(()));
    for count in [0, 255, 257] {
        assert_eq!(
            sync(count, 0).validate(MAX),
            Err(CtlError::BucketCount { count })
        );
    }
    assert_eq!(
        sync(SYNC_BUCKETS, MAX_SYNC_MEMBERS + 1).validate(MAX),
        Err(too_many("member digests", 4097, MAX_SYNC_MEMBERS))
    );
    // The largest valid step-1 frame fits.
    assert!(frame::encode(&sync(SYNC_BUCKETS, MAX_SYNC_MEMBERS)).is_ok());
}

#[test]
fn holders_are_limited_and_checked() {
    let holders = |n, addrs: Vec<String>| CtlResponse::Holders {
        name: name("a"),
        version: 1,
        meta: meta(4),
        holders: (0..n)
            .map(|i| HolderAddr {
                node: id(i as u8),
                addrs: addrs.clone(),
                complete: i % 2 == 0,
            })
            .collect(),
        sources: n.min(1) as u8,
    };
    assert_eq!(
        holders(MAX_HOLDERS_REPLY, vec!["h:1".into()]).validate(MAX),
        Ok(())
    );
    let with_sources = |n: usize, sources| match holders(n, vec![]) {
        CtlResponse::Holders {
            name,
            version,
            meta,
            holders,
            ..
        } => CtlResponse::Holders {
            name,
            version,
            meta,
            holders,
            sources,
        },
        other => other,
    };
    assert_eq!(with_sources(8, 4).validate(MAX), Ok(()));
    assert_eq!(
        with_sources(8, 5).validate(MAX),
        Err(too_many("sources", 5, 4))
    );
    assert_eq!(
        with_sources(2, 3).validate(MAX),
        Err(too_many("sources", 3, 2))
    );
    assert_eq!(
        holders(MAX_HOLDERS_REPLY + 1, vec![]).validate(MAX),
        Err(too_many("holders", 65, MAX_HOLDERS_REPLY))
    );
    assert_eq!(
        holders(1, vec!["x".into(); MAX_MEMBER_ADDRS + 1]).validate(MAX),
        Err(RegistryError::TooManyAddrs {
            node: id(0),
            count: 9
        }
        .into())
    );
    assert_eq!(
        holders(1, vec!["x".repeat(MAX_ADDR_LEN + 1)]).validate(MAX),
        Err(RegistryError::AddrTooLong {
            node: id(0),
            len: 65
        }
        .into())
    );
    assert!(matches!(
        holders(1, vec![]).validate(3),
        Err(CtlError::Registry(RegistryError::Meta { .. }))
    ));
}

#[test]
fn listings_check_each_entry() {
    let listing = |version, len| CtlResponse::Listing {
        entries: vec![ListedEntry {
            name: name("a"),
            version,
            meta: meta(len),
            holders: 2,
        }],
        last: true,
    };
    assert_eq!(listing(3, 4).validate(MAX), Ok(()));
    assert!(matches!(
        listing(0, 4).validate(MAX),
        Err(CtlError::Registry(RegistryError::ZeroVersion { .. }))
    ));
    assert!(matches!(
        listing(1, MAX + 1).validate(MAX),
        Err(CtlError::Registry(RegistryError::Meta { .. }))
    ));
    let too_long = CtlResponse::Listing {
        entries: vec![
            ListedEntry {
                name: name("a"),
                version: 1,
                meta: meta(0),
                holders: 0
            };
            MAX_LIST_LIMIT as usize + 1
        ],
        last: false,
    };
    assert_eq!(
        too_long.validate(MAX),
        Err(too_many("listed entries", 100_001, MAX_LIST_LIMIT as usize))
    );
}

/// Heartbeat stats at their limits: every varint at its widest, every option present, the
/// longest URL, the most links. The largest a valid `NodeStats` gets on the wire.
fn fat_stats() -> NodeStats {
    NodeStats {
        pool_links: u32::MAX,
        tensors: u64::MAX,
        store_bytes: u64::MAX,
        in_bytes_per_s: f64::MAX,
        out_bytes_per_s: f64::MAX,
        in_bytes_total: u64::MAX,
        out_bytes_total: u64::MAX,
        latency_p50_s: Some(f64::MAX),
        latency_p99_s: Some(f64::MAX),
        metrics_url: Some("u".repeat(MAX_METRICS_URL_LEN)),
        links: vec![
            LinkChannel {
                peer: NodeId([0xff; 32]),
                channel: ChannelKind::Tcp,
            };
            MAX_STATS_LINKS
        ],
        upload_limit: u64::MAX,
        functions: (0..MAX_STATS_FUNCTIONS)
            .map(|i| FunctionStats {
                name: TensorName::new(format!("{i:02}{}", "f".repeat(MAX_NAME_LEN - 2)))
                    .expect("name"),
                calls_total: u64::MAX,
                failed_total: u64::MAX,
                calls_per_s: f64::MAX,
                in_flight: u32::MAX,
            })
            .collect(),
    }
}

/// A `Members` row at every limit: the largest a valid status row gets.
fn fat_status(b: u8) -> MemberStatus {
    MemberStatus {
        member: fat_member(b),
        heartbeat: Some(LastHeartbeat {
            stats: fat_stats(),
            age_ms: u64::MAX,
        }),
    }
}

#[test]
fn member_rows_are_limited_and_checked() {
    let rows = vec![fat_member(1); MAX_SYNC_MEMBERS + 1];
    let members = CtlResponse::Members {
        members: vec![fat_status(1); MAX_SYNC_MEMBERS + 1],
        last: true,
    };
    assert_eq!(
        members.validate(MAX),
        Err(too_many("member rows", 4097, MAX_SYNC_MEMBERS))
    );
    let mut bad = fat_member(2);
    bad.addrs.push("x".into());
    let diff = CtlResponse::SyncDiff {
        members: vec![bad.clone()],
        buckets: vec![],
        last: true,
    };
    assert_eq!(
        diff.validate(MAX),
        Err(RegistryError::TooManyAddrs {
            node: id(2),
            count: 9
        }
        .into())
    );
    // Fat rows, chunked under the budget, always make frames that encode and validate.
    for chunk in chunk_by_size(rows, MAX_CHUNK_BYTES) {
        assert!(chunk.len() < MAX_SYNC_MEMBERS);
        let f = CtlResponse::SyncDiff {
            members: chunk,
            buckets: (0..=u8::MAX).collect(),
            last: false,
        };
        assert_eq!(f.validate(MAX), Ok(()));
        assert!(frame::encode(&f).is_ok());
    }
}

#[test]
fn member_status_rows_carry_validated_stats() {
    let row = |stats: NodeStats| CtlResponse::Members {
        members: vec![
            MemberStatus::without_stats(fat_member(1)),
            MemberStatus {
                member: fat_member(2),
                heartbeat: Some(LastHeartbeat { stats, age_ms: 7 }),
            },
        ],
        last: true,
    };
    assert_eq!(row(fat_stats()).validate(MAX), Ok(()));
    let nan = NodeStats {
        out_bytes_per_s: f64::NAN,
        ..fat_stats()
    };
    assert_eq!(
        row(nan).validate(MAX),
        Err(CtlError::BadStat {
            field: "out_bytes_per_s"
        })
    );
    let long = NodeStats {
        metrics_url: Some("u".repeat(MAX_METRICS_URL_LEN + 1)),
        ..fat_stats()
    };
    assert_eq!(
        row(long).validate(MAX),
        Err(CtlError::UrlTooLong {
            len: MAX_METRICS_URL_LEN + 1
        })
    );
    let mut crowded = fat_stats();
    crowded.links.push(crowded.links[0]);
    assert_eq!(
        row(crowded).validate(MAX),
        Err(CtlError::BadStat { field: "links" })
    );
    let mut crowded = fat_stats();
    crowded.functions.push(crowded.functions[0].clone());
    assert_eq!(
        row(crowded).validate(MAX),
        Err(CtlError::BadStat { field: "functions" })
    );
    let mut fast = fat_stats();
    fast.functions[3].calls_per_s = f64::INFINITY;
    assert_eq!(
        row(fast).validate(MAX),
        Err(CtlError::BadStat {
            field: "functions.calls_per_s"
        })
    );
    let mut odd = fat_stats();
    odd.functions[0].calls_total = 1;
    odd.functions[0].failed_total = 2;
    assert_eq!(
        row(odd).validate(MAX),
        Err(CtlError::BadStat {
            field: "functions.failed_total"
        })
    );
    let mut bad = MemberStatus::without_stats(fat_member(3));
    bad.member.addrs.push("x".into());
    let bad = CtlResponse::Members {
        members: vec![bad],
        last: true,
    };
    assert_eq!(
        bad.validate(MAX),
        Err(RegistryError::TooManyAddrs {
            node: id(3),
            count: 9
        }
        .into())
    );
}

#[test]
fn a_full_frame_of_worst_case_status_rows_fits() {
    // The most worst-case rows one frame can hold under the chunk budget...
    let row_bytes = postcard::to_allocvec(&fat_status(1)).expect("row").len();
    let per_frame = MAX_CHUNK_BYTES / row_bytes;
    assert!(per_frame > 0 && per_frame < MAX_SYNC_MEMBERS, "{per_frame}");
    let full = CtlResponse::Members {
        members: vec![fat_status(1); per_frame],
        last: true,
    };
    assert_eq!(full.validate(MAX), Ok(()));
    assert!(
        frame::encode(&full).is_ok(),
        "{per_frame} rows of {row_bytes} bytes"
    );
    // ...and the broker's chunking of a whole cluster of them makes frames that all fit.
    let rows = vec![fat_status(2); MAX_SYNC_MEMBERS];
    let chunks = chunk_by_size(rows, MAX_CHUNK_BYTES);
    assert!(chunks.len() > 1);
    assert_eq!(chunks.iter().map(Vec::len).sum::<usize>(), MAX_SYNC_MEMBERS);
    for members in chunks {
        let f = CtlResponse::Members {
            members,
            last: false,
        };
        assert_eq!(f.validate(MAX), Ok(()));
        assert!(frame::encode(&f).is_ok());
    }
}

#[test]
fn sync_diff_buckets_strictly_increase() {
    let diff = |buckets: Vec<u8>| CtlResponse::SyncDiff {
        members: vec![],
        buckets,
        last: true,
    };
    assert_eq!(diff(vec![]).validate(MAX), Ok(()));
    assert_eq!(diff((0..=u8::MAX).collect()).validate(MAX), Ok(()));
    assert_eq!(
        diff(vec![1, 5, 5]).validate(MAX),
        Err(CtlError::BucketOrder { prev: 5, index: 5 })
    );
    assert_eq!(
        diff(vec![9, 3]).validate(MAX),
        Err(CtlError::BucketOrder { prev: 9, index: 3 })
    );
}

#[test]
fn sync_entries_are_validated() {
    let mut e = Entry::placeholder();
    e.meta.byte_len = 1;
    let entries = CtlResponse::SyncEntries {
        entries: vec![(name("a"), Entry::placeholder()), (name("b"), e)],
        last: true,
    };
    assert!(matches!(
        entries.validate(MAX),
        Err(CtlError::Registry(RegistryError::Meta { .. }))
    ));
}

#[test]
fn chunked_lists_fit_one_frame() {
    let names: Vec<(TensorName, [u8; 32])> = (0..40_000)
        .map(|i| (name(&format!("n/{i:0>200}")), [7; 32]))
        .collect();
    let chunks = chunk_by_size(names, MAX_CHUNK_BYTES);
    assert!(chunks.len() > 1);
    for names in chunks {
        assert!(frame::encode(&CtlRequest::SyncNames { names, last: true }).is_ok());
    }
}

#[test]
fn only_last_pieces_and_single_answers_are_final() {
    let finals = [
        CtlResponse::Ok,
        CtlResponse::Version { version: 1 },
        CtlResponse::Listing {
            entries: vec![],
            last: true,
        },
        CtlResponse::SyncEntries {
            entries: vec![],
            last: true,
        },
        CtlResponse::Error {
            code: ErrorCode::Busy,
            message: String::new(),
        },
    ];
    assert!(finals.iter().all(CtlResponse::is_final));
    let pieces = [
        CtlResponse::Event(Event::Deleted { name: name("a") }),
        CtlResponse::Members {
            members: vec![],
            last: false,
        },
        CtlResponse::SyncDiff {
            members: vec![],
            buckets: vec![],
            last: false,
        },
    ];
    assert!(!pieces.iter().any(CtlResponse::is_final));
}

#[test]
fn errors_name_what_failed() {
    let e = too_many("announced ops", 300, 256);
    assert_eq!(
        e.to_string(),
        "too many announced ops: 300, the limit is 256"
    );
    let e = CtlError::from(RegistryError::ZeroVersion { name: name("m/w") });
    assert!(e.to_string().contains("\"m/w\""), "{e}");
}

#[test]
fn every_request_names_the_access_it_needs() {
    let stamp = Stamp::ZERO;
    let n = || name("m/w");
    let hb = |role| CtlRequest::Heartbeat {
        role,
        addrs: vec![],
        epoch: 1,
        stats: None,
    };
    let announce = |ops| CtlRequest::Announce { ops };
    let holder = RegistryOp::AddHolder {
        name: n(),
        version: 1,
        node: id(1),
        stamp,
    };
    let dropped = RegistryOp::RemoveHolder {
        name: n(),
        version: 1,
        node: id(1),
        stamp,
    };
    let publish = RegistryOp::Publish {
        name: n(),
        version: 1,
        meta: meta(4),
        publisher: id(1),
        stamp,
    };
    let delete = RegistryOp::Delete { name: n(), stamp };
    let read_only = [
        hb(Role::Worker),
        announce(vec![holder.clone(), dropped.clone()]),
        announce(vec![]),
        CtlRequest::Lookup {
            name: n(),
            version: None,
            exclude: vec![NodeId([1; 32])],
        },
        CtlRequest::Fetching {
            name: n(),
            version: 1,
            active: true,
        },
        CtlRequest::List {
            prefix: String::new(),
            limit: 1,
        },
        CtlRequest::Subscribe {
            pattern: "m/*".parse().expect("pattern"),
        },
        CtlRequest::Members,
    ];
    for request in read_only {
        assert_eq!(request.write_action(), None, "{request:?}");
    }
    let read_write = [
        (hb(Role::Broker), "joining as a broker"),
        (
            CtlRequest::NextVersion { name: n() },
            "publishing (allocating a version)",
        ),
        (announce(vec![holder.clone(), publish]), "publishing"),
        (announce(vec![dropped, delete]), "deleting"),
        (
            announce(vec![RegistryOp::Member(fat_member(1))]),
            "writing membership",
        ),
        (
            CtlRequest::SyncBuckets {
                buckets: vec![],
                members: vec![],
            },
            "anti-entropy between brokers",
        ),
        (
            CtlRequest::SyncNames {
                names: vec![],
                last: true,
            },
            "anti-entropy between brokers",
        ),
    ];
    for (request, action) in read_write {
        assert_eq!(request.write_action(), Some(action), "{request:?}");
    }
}

#[test]
fn offers_must_match_their_metadata() {
    let bytes = vec![7u8; 100];
    let good = TensorMeta::new(DType::U8, vec![100], ContentHash::of(&bytes)).expect("meta");
    let w = name("m/a");
    assert_eq!(crate::check_offer(&w, 3, &good, &bytes, MAX), Ok(()));
    // One byte changed, one byte short: refused.
    let mut tampered = bytes.clone();
    tampered[42] ^= 1;
    assert_eq!(
        crate::check_offer(&w, 3, &good, &tampered, MAX),
        Err(CtlError::InlineMismatch {
            len: 100,
            expected: 100
        })
    );
    assert!(crate::check_offer(&w, 3, &good, &bytes[..99], MAX).is_err());
    // Version 0 is never published; over the inline limit is refused before hashing.
    assert!(crate::check_offer(&w, 0, &good, &bytes, MAX).is_err());
    let big = vec![0u8; MAX_INLINE_BYTES as usize + 1];
    let big_meta =
        TensorMeta::new(DType::U8, vec![big.len() as u64], ContentHash::of(&big)).expect("meta");
    assert_eq!(
        crate::check_offer(&w, 3, &big_meta, &big, MAX),
        Err(CtlError::InlineTooLarge {
            len: MAX_INLINE_BYTES + 1
        })
    );
}

#[test]
fn inline_bytes_must_match_their_publish() {
    let bytes = vec![7u8; 100];
    let good = TensorMeta::new(DType::U8, vec![100], ContentHash::of(&bytes)).expect("meta");
    let publish = |meta: TensorMeta| RegistryOp::Publish {
        name: name("m/a"),
        version: 3,
        meta,
        publisher: id(1),
        stamp: Stamp::default(),
    };
    let request = |meta, bytes| CtlRequest::Publish {
        ops: vec![publish(meta)],
        bytes,
    };
    assert_eq!(request(good.clone(), bytes.clone()).validate(MAX), Ok(()));
    assert_eq!(
        request(good.clone(), bytes.clone()).write_action(),
        Some("publishing")
    );
    // One byte changed: refused, whoever carries it.
    let mut tampered = bytes.clone();
    tampered[42] ^= 1;
    let mismatch = Err(CtlError::InlineMismatch {
        len: 100,
        expected: 100,
    });
    assert_eq!(
        request(good.clone(), tampered.clone()).validate(MAX),
        mismatch
    );
    let event = |bytes| {
        CtlResponse::Event(Event::PublishedInline {
            name: name("m/a"),
            version: 3,
            meta: good.clone(),
            publisher: id(1),
            bytes,
        })
    };
    assert_eq!(event(bytes.clone()).validate(MAX), Ok(()));
    assert_eq!(event(tampered).validate(MAX), mismatch);
    assert_eq!(
        event(bytes[..99].to_vec()).validate(MAX),
        Err(CtlError::InlineMismatch {
            len: 99,
            expected: 100
        })
    );
    // Over the inline limit: refused before hashing.
    let big = vec![0u8; MAX_INLINE_BYTES as usize + 1];
    let big_meta =
        TensorMeta::new(DType::U8, vec![big.len() as u64], ContentHash::of(&big)).expect("meta");
    assert_eq!(
        request(big_meta, big).validate(MAX),
        Err(CtlError::InlineTooLarge {
            len: MAX_INLINE_BYTES + 1
        })
    );
    // The first op must be the publish the bytes belong to.
    let hold = RegistryOp::holder(name("m/a"), 3, id(1), Stamp::default(), true);
    assert_eq!(
        CtlRequest::Publish {
            ops: vec![hold],
            bytes
        }
        .validate(MAX),
        Err(CtlError::InlineWithoutPublish)
    );
}

#[test]
fn a_published_event_takes_its_bytes_only_for_its_own_version() {
    let m = meta(4);
    let published = |version| Event::Published {
        name: name("m/a"),
        version,
        meta: m.clone(),
        publisher: id(1),
    };
    let bytes = [1u8, 2, 3, 4];
    assert!(matches!(
        published(5).with_inline((&name("m/a"), 5), &bytes),
        Event::PublishedInline { version: 5, ref bytes, .. } if bytes == &[1, 2, 3, 4]
    ));
    assert_eq!(
        published(4).with_inline((&name("m/a"), 5), &bytes),
        published(4)
    );
    assert_eq!(
        published(5).with_inline((&name("m/b"), 5), &bytes),
        published(5)
    );
    let deleted = Event::Deleted { name: name("m/a") };
    assert_eq!(
        deleted.clone().with_inline((&name("m/a"), 5), &bytes),
        deleted
    );
}
