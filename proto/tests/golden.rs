//! Golden bytes: the exact wire form of every `tb/data/1` and `tb/ctl/1` message variant, of
//! the `Hello` exchange, and of the cluster-key derivations. If one of these fails, the wire
//! changed. Until the first release (0.x, no deployed clusters to stay compatible with) a
//! deliberate change updates the expected string in the same commit and says so; from the first
//! release on it needs a new ALPN version instead.
//!
//! Reading the hex: a frame is a little-endian `u32` body length, then postcard, which
//! writes enum variants and lengths as LEB128 varints, integers as varints, `Option` as
//! `00` / `01 value`, strings as length + UTF-8, and `[u8; 32]` as 32 raw bytes.

use std::collections::BTreeMap;

use tb_proto::{
    AccessProof, AuthProof, ByteRange, CTL_ALPN, ChannelKind, ClusterKey, ContentHash, CtlRequest,
    CtlResponse, DType, DataRequest, DataResponse, Entry, ErrorCode, Event, FunctionStats, Hello,
    HelloReply, HolderAddr, HolderMark, LastHeartbeat, LinkChannel, ListedEntry, Member,
    MemberStatus, NamePattern, NodeId, NodeStats, RegistryOp, Role, SYNC_BUCKETS, Stamp,
    TensorMeta, TensorName, frame,
};

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("name")
}

/// Encodes `msg`, checks the frame against `expected` (spaces ignored), and decodes it back.
fn golden<T>(msg: &T, expected: &str)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let bytes = frame::encode(msg).expect("encode");
    assert_eq!(hex::encode(&bytes), expected.replace(' ', ""), "{msg:?}");
    let (back, used) = frame::decode_frame::<T>(&bytes)
        .expect("decode")
        .expect("whole frame");
    assert_eq!((&back, used), (msg, bytes.len()));
}

const H_AB: &str = "abababababababababababababababababababababababababababababababab";
const H_11: &str = "1111111111111111111111111111111111111111111111111111111111111111";
const H_22: &str = "2222222222222222222222222222222222222222222222222222222222222222";
const H_33: &str = "3333333333333333333333333333333333333333333333333333333333333333";

fn id(b: u8) -> NodeId {
    NodeId([b; 32])
}

fn stamp(wall_ms: u64, logical: u32, node: u8) -> Stamp {
    Stamp {
        wall_ms,
        logical,
        node: id(node),
    }
}

#[test]
fn pull_newest_whole() {
    let msg = DataRequest::Pull {
        name: name("model/w"),
        version: None,
        range: None,
    };
    // len 11 | Pull=0 | "model/w" (7 bytes) | version None | range None
    golden(&msg, "0b000000 00 07 6d6f64656c2f77 00 00");
}

#[test]
fn pull_version_and_range() {
    let msg = DataRequest::Pull {
        name: name("a"),
        version: Some(7),
        range: Some(ByteRange {
            offset: 300,
            len: 1 << 20,
        }),
    };
    // len 11 | Pull=0 | "a" | Some(7) | Some { offset 300 = ac 02, len 2^20 = 80 80 40 }
    golden(&msg, "0b000000 00 01 61 01 07 01 ac02 808040");
}

#[test]
fn pull_max_version() {
    let msg = DataRequest::Pull {
        name: name("a"),
        version: Some(u64::MAX),
        range: None,
    };
    // u64::MAX is a 10-byte varint.
    golden(&msg, "0f000000 00 01 61 01 ffffffffffffffffff01 00");
}

#[test]
fn push() {
    let msg = DataRequest::Push {
        name: name("w"),
        meta: TensorMeta::new(DType::F32, vec![2, 3], ContentHash([0xab; 32])).expect("meta"),
    };
    // len 40 | Push=1 | "w" | F32=11 | shape [2, 3] | byte_len 24 | hash
    golden(&msg, &format!("28000000 01 01 77 0b 02 02 03 18 {H_AB}"));
}

#[test]
fn header() {
    let msg = DataResponse::Header {
        meta: TensorMeta::new(DType::BF16, vec![], ContentHash([0x11; 32])).expect("meta"),
        version: 300,
    };
    // len 38 | Header=0 | BF16=10 | shape [] | byte_len 2 | hash | version 300
    golden(&msg, &format!("26000000 00 0a 00 02 {H_11} ac02"));
}

#[test]
fn ack() {
    golden(&DataResponse::Ack, "01000000 01");
}

#[test]
fn channel_offers() {
    use tb_proto::ChannelOffer;
    let offers = vec![
        ChannelOffer::Shm {
            socket: [0x5a; 16],
            token: [0x11; 32],
        },
        ChannelOffer::Tcp { port: 7000 },
    ];
    let s = "5a".repeat(16);
    // len 54 | Channels=2 | 2 offers | Shm=0 socket token | Tcp=1 port 7000
    let offers_hex = format!("02 00 {s} {H_11} 01 d836");
    golden(
        &DataRequest::Channels {
            offers: offers.clone(),
        },
        &format!("36000000 02 {offers_hex}"),
    );
    // len 54 | Channels=3 | the same offers
    golden(
        &DataResponse::Channels { offers },
        &format!("36000000 03 {offers_hex}"),
    );
}

#[test]
fn shm_frames() {
    use tb_proto::{Access, ShmHello, ShmPayload};
    let hello = ShmHello {
        node: [0xab; 32],
        access: Access::ReadWrite,
        token: [0x11; 32],
    };
    // len 65 | node | ReadWrite=1 | token
    golden(&hello, &format!("41000000 {H_AB} 01 {H_11}"));
    golden(&ShmPayload::Inline, "01000000 00");
    // len 3 | Memfd=1 | offset 300
    golden(&ShmPayload::Memfd { offset: 300 }, "03000000 01 ac02");
    // len 3 | MemfdCopy=3 | offset 300
    golden(&ShmPayload::MemfdCopy { offset: 300 }, "03000000 03 ac02");
    // len 2 | version 300
    golden(&tb_proto::ShmCopied { version: 300 }, "02000000 ac02");
}

#[test]
fn tcp_frames() {
    use tb_proto::{TcpHello, channel::MAX_TCP_HELLO_FRAME, frame};
    let name = TensorName::new("w").expect("name");
    let pull = DataRequest::TcpPull {
        name,
        version: Some(300),
        sockets: 4,
    };
    // len 7 | TcpPull=3 | name "w" | Some(300) | 4 sockets
    golden(&pull, "07000000 03 0177 01ac02 04");
    let ticket = DataResponse::TcpTicket {
        meta: TensorMeta::new(DType::BF16, vec![], ContentHash([0x11; 32])).expect("meta"),
        version: 300,
        token: [0xab; 32],
    };
    // len 70 | TcpTicket=4 | BF16=10 | shape [] | byte_len 2 | hash | version 300 | token
    golden(&ticket, &format!("46000000 04 0a 00 02 {H_11} ac02 {H_AB}"));
    let pieces = DataRequest::Pieces {
        name: TensorName::new("w").expect("name"),
        version: 300,
    };
    // len 5 | Pieces=4 | name "w" | version 300
    golden(&pieces, "05000000 04 0177 ac02");
    let outline = DataResponse::Outline {
        piece_len: 4 << 20,
        values: vec![[0x11; 32], [0xab; 32]],
        complete: false,
        have: vec![1],
    };
    // len 73 | Outline=5 | piece_len 4 MiB | 2 values | not complete | have [1]
    golden(
        &outline,
        &format!("49000000 05 80808002 02 {H_11} {H_AB} 00 0101"),
    );
    let have = DataResponse::Have {
        pieces: vec![0, 300],
        complete: true,
    };
    // len 6 | Have=6 | [0, 300] | complete
    golden(&have, "06000000 06 02 00 ac02 01");
    let watch = DataRequest::Watch {
        name: TensorName::new("w").expect("name"),
    };
    // len 3 | Watch=5 | name "w"
    golden(&watch, "03000000 05 0177");
    // len 1 | Ctl=7: the control request follows as its own frame.
    golden(&DataRequest::Ctl, "01000000 07");
    let offer = DataResponse::Offer {
        version: 300,
        meta: TensorMeta::new(DType::U8, vec![2], ContentHash([0x11; 32])).expect("meta"),
        bytes: vec![0xab, 0xcd],
    };
    // len 42 | Offer=7 | version 300 | U8=1 | shape [2] | byte_len 2 | hash | bytes [ab cd]
    golden(
        &offer,
        &format!("2a000000 07 ac02 01 0102 02 {H_11} 02abcd"),
    );
    let hello = TcpHello {
        token: [0x11; 32],
        range: tb_proto::ByteRange {
            offset: 300,
            len: 1,
        },
    };
    // len 35 | token | offset 300 | len 1
    golden(&hello, &format!("23000000 {H_11} ac02 01"));
    let widest = TcpHello {
        token: [0xff; 32],
        range: tb_proto::ByteRange {
            offset: u64::MAX,
            len: u64::MAX,
        },
    };
    let body = frame::encode(&widest).expect("encodes").len() - 4;
    assert!(body as u32 <= MAX_TCP_HELLO_FRAME, "{body}");
}

#[test]
fn error() {
    let msg = DataResponse::Error {
        code: ErrorCode::Corrupt,
        message: "bad".into(),
    };
    // len 6 | Error=2 | Corrupt=3 | "bad"
    golden(&msg, "06000000 02 03 03 626164");
}

#[test]
fn error_codes_are_numbered_in_order() {
    for (i, code) in ErrorCode::ALL.into_iter().enumerate() {
        let msg = DataResponse::Error {
            code,
            message: String::new(),
        };
        golden(&msg, &format!("03000000 02 {i:02x} 00"));
    }
}

#[test]
fn dtypes_are_numbered_in_order() {
    for (i, d) in DType::ALL.into_iter().enumerate() {
        golden(&d, &format!("01000000 {i:02x}"));
    }
}

#[test]
fn patterns_are_strings() {
    let p: NamePattern = "model/*".parse().expect("pattern");
    golden(&p, "08000000 07 6d6f64656c2f2a");
    let all: NamePattern = "*".parse().expect("pattern");
    golden(&all, "02000000 01 2a");
}

#[test]
fn hello() {
    let root = AccessProof {
        read: AuthProof([0xab; 32]),
        write: Some(AuthProof([0x11; 32])),
    };
    let read_only = AccessProof {
        read: AuthProof([0xab; 32]),
        write: None,
    };
    // len 65 | read proof (32 raw bytes) | Some | write proof (32 raw bytes)
    golden(
        &Hello { proof: root },
        &format!("41000000 {H_AB} 01 {H_11}"),
    );
    // len 33 | read proof | None
    golden(&Hello { proof: read_only }, &format!("21000000 {H_AB} 00"));
    // len 72 | Welcome=0 | 64 GiB = 2^36 as a varint | read proof | Some | write proof
    golden(
        &HelloReply::Welcome {
            max_tensor_bytes: 64 << 30,
            proof: root,
        },
        &format!("48000000 00 808080808002 {H_AB} 01 {H_11}"),
    );
}

#[test]
fn cluster_key_derivations() {
    // Pins the key derivations, the proofs' encoding and the gossip topic: nodes of two builds
    // must agree on all of them to form one cluster.
    let secret = b"0123456789abcdef0123456789abcdef";
    let key = ClusterKey::from_secret(secret).expect("secret");
    let proof = key.prove(CTL_ALPN, &id(1), &id(2));
    let write = proof.write.expect("the secret proves write access");
    assert_eq!(hex::encode(proof.read.0), READ_PROOF);
    assert_eq!(hex::encode(write.0), WRITE_PROOF);
    assert_eq!(hex::encode(key.gossip_topic()), TOPIC);
    assert_eq!(
        key.read_only_credential().expect("derive"),
        format!("tbro1-{READ_KEY}")
    );
    // The same, spelled out for other implementations: K from the secret, R from K, each proof
    // a keyed hash over its domain, the ALPN and both ids, each length-prefixed (u64 LE).
    let k = blake3::derive_key("tensor-broker cluster key v1", secret);
    let r = blake3::derive_key("tensor-broker read-only key v1", &k);
    assert_eq!(hex::encode(r), READ_KEY);
    let keyed = |key: &[u8; 32], domain: &[u8]| {
        let mut input = Vec::new();
        for field in [domain, CTL_ALPN, &[1; 32], &[2; 32]] {
            input.extend((field.len() as u64).to_le_bytes());
            input.extend(field);
        }
        *blake3::keyed_hash(key, &input).as_bytes()
    };
    assert_eq!(
        keyed(&r, b"tensor-broker hello read proof v2"),
        proof.read.0
    );
    assert_eq!(keyed(&k, b"tensor-broker hello write proof v2"), write.0);
    let topic = blake3::derive_key("tensor-broker gossip topic v1", &k);
    assert_eq!(topic, key.gossip_topic());
    let open = ClusterKey::open().prove(CTL_ALPN, &id(1), &id(2));
    assert_eq!(hex::encode(open.read.0), OPEN_READ_PROOF);
    // The read-only credential proves the same read proof, and no write proof.
    let ro = ClusterKey::parse(format!("tbro1-{READ_KEY}\n").as_bytes()).expect("credential");
    let ro_proof = ro.prove(CTL_ALPN, &id(1), &id(2));
    assert_eq!((ro_proof.read, ro_proof.write), (proof.read, None));
}

const READ_KEY: &str = "0f2830a9bfa486bb8f0ff6506cef3f4f534192a8c5c76893f6318e564c0098ad";
const READ_PROOF: &str = "dbf410e507ff3c0006bf2824feb06b79d129a22649193a9fca6cce5e747949e5";
const WRITE_PROOF: &str = "44da34954d4b8735a124366638b2099c39723d3d1b92e46b657e2f055ed15eab";
const TOPIC: &str = "b99967fdb16172d53fca09c15de520267aa0a3881cc4312d43a38d5e3a7983ad";
const OPEN_READ_PROOF: &str = "486a7f31cd4de1c6bf01f0d3d11d089d9fda40489462bf3e1c6406958f05b284";

#[test]
fn ctl_heartbeat_and_announce() {
    let msg = CtlRequest::Heartbeat {
        role: Role::Worker,
        addrs: vec!["10.0.0.1:4433".into()],
        epoch: 3,
        stats: None,
    };
    // len 19 | Heartbeat=0 | Worker=1 | 1 addr "10.0.0.1:4433" | epoch 3 | no stats
    golden(
        &msg,
        "13000000 00 01 01 0d 31302e302e302e313a34343333 03 00",
    );
    let msg = CtlRequest::Heartbeat {
        role: Role::Worker,
        addrs: vec![],
        epoch: 3,
        stats: Some(NodeStats {
            pool_links: 2,
            tensors: 3,
            store_bytes: 300,
            in_bytes_per_s: 1.5,
            out_bytes_per_s: 0.0,
            in_bytes_total: 5,
            out_bytes_total: 0,
            latency_p50_s: Some(0.25),
            latency_p99_s: None,
            metrics_url: Some("http://a".into()),
            links: vec![LinkChannel {
                peer: NodeId([0x11; 32]),
                channel: ChannelKind::Quic,
            }],
            upload_limit: 50_000_000,
            functions: vec![FunctionStats {
                name: name("f"),
                calls_total: 10,
                failed_total: 1,
                calls_per_s: 2.0,
                in_flight: 3,
            }],
        }),
    };
    // len 99 | Heartbeat | Worker | 0 addrs | epoch 3 | Some(stats): links 2 | tensors 3 |
    // bytes 300 (varint ac 02) | in 1.5 (f64 LE) | out 0.0 | in total 5 | out total 0 |
    // p50 Some(0.25) | p99 None | url Some("http://a") | 1 link { peer, Quic=1 } |
    // upload limit 50 MB/s (varint 80 e1 eb 17) | 1 function { "f" | 10 calls | 1 failed |
    // 2.0 calls/s | 3 in flight }
    golden(
        &msg,
        &format!(
            "63000000 00 01 00 03 01 02 03 ac02 000000000000f83f 0000000000000000 05 00 \
             01 000000000000d03f 00 01 08 687474703a2f2f61 01 {H_11} 01 80e1eb17 \
             01 0166 0a 01 0000000000000040 03"
        ),
    );
    let msg = CtlRequest::Announce {
        ops: vec![RegistryOp::Delete {
            name: name("a"),
            stamp: stamp(5, 0, 0x11),
        }],
    };
    // len 39 | Announce=1 | 1 op | Delete=3 | "a" | stamp { wall 5, logical 0, node }
    golden(&msg, &format!("27000000 01 01 03 0161 05 00 {H_11}"));
}

#[test]
fn ctl_versions_and_lookups() {
    let msg = CtlRequest::NextVersion {
        name: name("model/w"),
    };
    golden(&msg, "09000000 02 07 6d6f64656c2f77");
    let lookup = |version| CtlRequest::Lookup {
        name: name("a"),
        version,
        exclude: vec![],
    };
    // Lookup=3 | "a" | Some(7) / None | nothing excluded
    golden(&lookup(Some(7)), "06000000 03 0161 01 07 00");
    golden(&lookup(None), "05000000 03 0161 00 00");
    let msg = CtlRequest::Lookup {
        name: name("a"),
        version: Some(7),
        exclude: vec![NodeId([0x11; 32])],
    };
    // Lookup | "a" | Some(7) | 1 excluded source
    golden(&msg, &format!("26000000 03 0161 01 07 01 {H_11}"));
    let msg = CtlRequest::Fetching {
        name: name("a"),
        version: 2,
        active: true,
    };
    // Fetching=4 | "a" | version 2 | true
    golden(&msg, "05000000 04 0161 02 01");
}

#[test]
fn ctl_list_subscribe_members() {
    let msg = CtlRequest::List {
        prefix: "model/".into(),
        limit: 1000,
    };
    // len 10 | List=5 | "model/" | limit 1000 = e8 07
    golden(&msg, "0a000000 05 06 6d6f64656c2f e807");
    let msg = CtlRequest::Subscribe {
        pattern: "model/*".parse().expect("pattern"),
    };
    // Subscribe=6 | the pattern as its string
    golden(&msg, "09000000 06 07 6d6f64656c2f2a");
    golden(&CtlRequest::Members, "01000000 07");
}

#[test]
fn ctl_sync_requests() {
    let msg = CtlRequest::SyncBuckets {
        buckets: vec![[0; 32]; SYNC_BUCKETS],
        members: vec![(id(0x11), [0xab; 32])],
    };
    // len 8260 | SyncBuckets=8 | 256 digests (80 02) | 1 member digest (node, digest)
    let zeros = "00".repeat(32 * SYNC_BUCKETS);
    golden(&msg, &format!("44200000 08 8002 {zeros} 01 {H_11} {H_AB}"));
    let msg = CtlRequest::SyncNames {
        names: vec![(name("a"), [0xab; 32])],
        last: true,
    };
    // len 37 | SyncNames=9 | 1 pair ("a", digest) | last
    golden(&msg, &format!("25000000 09 01 0161 {H_AB} 01"));
}

#[test]
fn ctl_ok_version_error() {
    golden(&CtlResponse::Ok, "01000000 00");
    golden(&CtlResponse::Version { version: 300 }, "03000000 01 ac02");
    let msg = CtlResponse::Error {
        code: ErrorCode::NotFound,
        message: "no".into(),
    };
    // Error=8 | NotFound=0 | "no"
    golden(&msg, "05000000 08 00 02 6e6f");
}

#[test]
fn ctl_holders_and_listing() {
    let msg = CtlResponse::Holders {
        name: name("w"),
        version: 1,
        meta: TensorMeta::new(DType::F32, vec![2, 3], ContentHash([0xab; 32])).expect("meta"),
        holders: vec![HolderAddr {
            node: id(0x11),
            addrs: vec!["h:1".into()],
            complete: false,
        }],
        sources: 1,
    };
    // len 81 | Holders=2 | "w" | v1 | meta | 1 holder { node, ["h:1"], incomplete } | 1 source
    golden(
        &msg,
        &format!("51000000 02 0177 01 0b 02 02 03 18 {H_AB} 01 {H_11} 01 03 683a31 00 01"),
    );
    let msg = CtlResponse::Listing {
        entries: vec![ListedEntry {
            name: name("w"),
            version: 2,
            meta: TensorMeta::new(DType::BF16, vec![], ContentHash([0x11; 32])).expect("meta"),
            holders: 3,
        }],
        last: true,
    };
    // len 42 | Listing=3 | 1 entry { "w", v2, BF16 scalar, 3 holders } | last
    golden(
        &msg,
        &format!("2a000000 03 01 0177 02 0a 00 02 {H_11} 03 01"),
    );
}

#[test]
fn ctl_events() {
    let msg = CtlResponse::Event(Event::Published {
        name: name("w"),
        version: 1,
        meta: TensorMeta::new(DType::U8, vec![4], ContentHash([0xab; 32])).expect("meta"),
        publisher: id(0x11),
    });
    // len 73 | Event=4 | Published=0 | "w" | v1 | U8 [4], 4 bytes | publisher
    golden(
        &msg,
        &format!("49000000 04 00 0177 01 01 01 04 04 {H_AB} {H_11}"),
    );
    let msg = CtlResponse::Event(Event::Deleted { name: name("w") });
    golden(&msg, "04000000 04 01 0177");
}

#[test]
fn ctl_members_and_sync_diff() {
    let row = Member {
        node: id(0x11),
        role: Role::Broker,
        addrs: vec![],
        epoch: 1,
        alive: true,
        stamp: stamp(2, 0, 0x11),
    };
    let msg = CtlResponse::Members {
        members: vec![MemberStatus::without_stats(row.clone())],
        last: true,
    };
    // len 74 | Members=5 | 1 row { member { node, Broker, no addrs, epoch 1, alive, stamp },
    // no heartbeat } | last
    golden(
        &msg,
        &format!("4a000000 05 01 {H_11} 00 00 01 01 02 00 {H_11} 00 01"),
    );
    let msg = CtlResponse::Members {
        members: vec![MemberStatus {
            member: Member {
                role: Role::Worker,
                ..row
            },
            heartbeat: Some(LastHeartbeat {
                stats: NodeStats {
                    pool_links: 1,
                    tensors: 2,
                    ..NodeStats::default()
                },
                age_ms: 1500,
            }),
        }],
        last: false,
    };
    // len 103 | Members | 1 row { member { node, Worker, ... }, Some(heartbeat { stats
    // { links 1 | tensors 2 | bytes 0 | in 0.0 | out 0.0 | totals 0 0 | no p50, p99, url |
    // no links | unlimited upload | no functions }, age 1500 ms (dc 0b) }) } | not last
    golden(
        &msg,
        &format!(
            "67000000 05 01 {H_11} 01 00 01 01 02 00 {H_11} 01 01 02 00 \
             0000000000000000 0000000000000000 00 00 00 00 00 00 00 00 dc0b 00"
        ),
    );
    let msg = CtlResponse::SyncDiff {
        members: vec![],
        buckets: vec![3, 200],
        last: true,
    };
    // SyncDiff=6 | no rows | buckets [3, 200] | last
    golden(&msg, "06000000 06 00 02 03c8 01");
}

#[test]
fn ctl_sync_entries() {
    let entry = Entry {
        version: 2,
        meta: TensorMeta::new(DType::U8, vec![4], ContentHash([0xab; 32])).expect("meta"),
        publisher: id(0x11),
        stamp: stamp(1, 0, 0x11),
        holders: BTreeMap::from([(
            (id(0x22), 2),
            HolderMark {
                stamp: stamp(3, 1, 0x22),
                present: true,
            },
        )]),
        deleted: Some(stamp(4, 0, 0x33)),
    };
    let msg = CtlResponse::SyncEntries {
        entries: vec![(name("a"), entry)],
        last: true,
    };
    // len 212 | SyncEntries=7 | 1 pair: "a", entry { v2, meta, publisher, stamp,
    // 1 holder mark { (node, v2): { stamp, present } }, deleted Some(stamp) } | last
    golden(
        &msg,
        &format!(
            "d4000000 07 01 0161 02 01 01 04 04 {H_AB} {H_11} 01 00 {H_11} \
             01 {H_22} 02 03 01 {H_22} 01 01 04 00 {H_33} 01"
        ),
    );
}

/// The largest valid data requests fit the data-request frame cap with room to spare, so the
/// cap refuses only what no honest node sends.
#[test]
fn the_largest_data_requests_fit_the_request_frame_cap() {
    let longest = name(&"n".repeat(tb_proto::MAX_NAME_LEN));
    let push = DataRequest::Push {
        name: longest.clone(),
        meta: TensorMeta {
            dtype: DType::F64,
            shape: vec![u64::MAX; tb_proto::MAX_RANK],
            byte_len: u64::MAX,
            hash: ContentHash::of(b"x"),
        },
    };
    let offers = (0..tb_proto::channel::MAX_CHANNEL_OFFERS)
        .map(|_| tb_proto::ChannelOffer::Shm {
            socket: [0xff; tb_proto::channel::SHM_SOCKET_NAME_LEN],
            token: [0xff; 32],
        })
        .collect();
    let channels = DataRequest::Channels { offers };
    let pull = DataRequest::Pull {
        name: longest,
        version: Some(u64::MAX),
        range: Some(ByteRange {
            offset: u64::MAX,
            len: u64::MAX,
        }),
    };
    for request in [push, channels, pull] {
        let body = frame::encode(&request).expect("encode").len() - frame::LEN_PREFIX;
        assert!(
            (body as u32) * 2 < tb_proto::MAX_DATA_REQUEST_FRAME,
            "{body} bytes: {request:?}"
        );
    }
}

#[test]
fn cuda_ipc_messages() {
    use tb_proto::ipc::{IPC_HANDLE_LEN, IpcRequest, IpcResponse};
    // Open (variant 0): "w", no version, host "h", min_bytes 1.
    let open = IpcRequest::Open {
        name: TensorName::new("w").expect("name"),
        version: None,
        host: "h".into(),
        min_bytes: 1,
    };
    golden(&open, "07000000 00 0177 00 0168 01");
    // Declined (variant 1): "no".
    let declined = IpcResponse::Declined {
        reason: "no".into(),
    };
    golden(&declined, "04000000 01 026e6f");
    // Handle (variant 0): meta, version 2, then the 64-byte handle with its length 0x40.
    let meta = TensorMeta::new(DType::BF16, vec![], ContentHash([0x11; 32])).expect("meta");
    let handle = IpcResponse::Handle {
        meta: meta.clone(),
        version: 2,
        handle: vec![0x22; IPC_HANDLE_LEN],
    };
    let meta_body = hex::encode(postcard::to_stdvec(&meta).expect("meta encodes"));
    let body = format!("00{meta_body}0240{}", "22".repeat(IPC_HANDLE_LEN));
    let len = hex::encode(u32::try_from(body.len() / 2).expect("small").to_le_bytes());
    golden(&handle, &format!("{len}{body}"));
    // On the data link: DataRequest::CudaIpc = 8 wraps the request, DataResponse::CudaIpc = 9
    // the answer.
    golden(
        &DataRequest::CudaIpc(open),
        "08000000 08 00 0177 00 0168 01",
    );
    golden(&DataResponse::CudaIpc(declined), "05000000 09 01 026e6f");
}

#[test]
fn call_messages() {
    use tb_proto::call::{
        Body, CallFrame, CallHead, CallUp, FailureKind, Load, RemoteFailure, TensorSlot, Value,
    };
    // len 9 | Call=6 | function "f" | deadline Some(300) | body_len 5 | unary | start 0
    let call = DataRequest::Call {
        function: name("f"),
        head: CallHead {
            deadline_ms: Some(300),
            body_len: 5,
            stream: false,
            start: 0,
        },
    };
    golden(&call, "09000000 06 0166 01ac02 05 00 00");
    let load = Load {
        running: 1,
        queued: 0,
        concurrency: 4,
    };
    // len 7 | Accepted=8 | running 1, queued 0, concurrency 4 | idempotent | not resumable |
    // takes inputs
    let accepted = DataResponse::Accepted {
        load,
        idempotent: true,
        resumable: false,
        inputs: true,
    };
    golden(&accepted, "07000000 08 01 00 04 01 00 01");
    // Item=0 | index 0 | body_len 300
    let item = CallFrame::Item {
        index: 0,
        body_len: 300,
    };
    golden(&item, "04000000 00 00 ac02");
    let done = CallFrame::Done {
        load: Load {
            running: 2,
            queued: 1,
            concurrency: 4,
        },
    };
    golden(&done, "04000000 01 020104");
    // Failed=2 | Raised=0 | type "E" | message "m" | traceback ""
    let failed = CallFrame::Failed(RemoteFailure::new(FailureKind::Raised, "E", "m", ""));
    golden(&failed, "07000000 02 00 0145 016d 00");
    golden(&CallUp::Credit(2), "02000000 0002");
    golden(&CallFrame::Alive, "01000000 03");
    // Input=1 | body_len 300 (varint ac02) ; InputEnd=2 ; InputCredit=4 | 2
    golden(&CallUp::Input { body_len: 300 }, "03000000 01ac02");
    golden(&CallUp::InputEnd, "01000000 02");
    golden(&CallFrame::InputCredit(2), "02000000 0402");
    // Named=9 | name "w" | version Some(2)
    let named = Value::Named {
        name: name("w"),
        version: Some(2),
    };
    golden(&named, "05000000 09 0177 0102");
    // Lent=10 | U8=1 shape [3] | name ".tb/lend/ab" (11 bytes)
    let lent = Value::Lent {
        slot: TensorSlot {
            dtype: DType::U8,
            shape: vec![3],
        },
        name: name(".tb/lend/ab"),
    };
    golden(&lent, "10000000 0a 010103 0b2e74622f6c656e642f6162");
    assert_eq!(
        lent.validate().map(|s| (s.tensors, s.tensor_bytes)),
        Ok((1, 0))
    );
    // Pulled, not read off the body: listed by `lent()`, not `tensors()`, in tree order.
    let one_byte = Value::Tensor(TensorSlot {
        dtype: DType::U8,
        shape: vec![1],
    });
    let both = Value::List(vec![Value::Map(vec![("a".into(), lent.clone())]), one_byte]);
    assert_eq!(both.tensors().len(), 1);
    let names: Vec<_> = (both.lent().into_iter())
        .map(|l| (l.name.as_str().to_owned(), l.device))
        .collect();
    assert_eq!(names, [(".tb/lend/ab".to_owned(), None)]);
    // LentDevice=11 | U8=1 shape [3] | name ".tb/lend/ab" | device 1
    let on_device = Value::LentDevice {
        slot: TensorSlot {
            dtype: DType::U8,
            shape: vec![3],
        },
        name: name(".tb/lend/ab"),
        device: 1,
    };
    golden(&on_device, "11000000 0b 010103 0b2e74622f6c656e642f6162 01");
    assert_eq!(
        on_device.validate().map(|s| (s.tensors, s.tensor_bytes)),
        Ok((1, 0))
    );
    let device_lent: Vec<_> = (Value::List(vec![lent.clone(), on_device.clone()]).lent())
        .into_iter()
        .map(|l| l.device)
        .collect();
    assert_eq!(device_lent, [None, Some(1)]);
    let not_lent_device = Value::LentDevice {
        slot: TensorSlot {
            dtype: DType::U8,
            shape: vec![3],
        },
        name: name("w"),
        device: 0,
    };
    assert!(not_lent_device.validate().is_err());
    let not_lent = Value::Lent {
        slot: TensorSlot {
            dtype: DType::U8,
            shape: vec![3],
        },
        name: name("w"),
    };
    assert!(
        not_lent.validate().is_err(),
        "a lent slot names a lent name"
    );
    // List=6 of 3: Int=2 -1 (zigzag 01) | Tensor=8 U8=1 shape [2] | Map=7 of 1: "k" Str=4 "v"
    let value = Value::List(vec![
        Value::Int(-1),
        Value::Tensor(TensorSlot {
            dtype: DType::U8,
            shape: vec![2],
        }),
        Value::Map(vec![("k".into(), Value::Str("v".into()))]),
    ]);
    golden(&value, "0f000000 0603 0201 08010102 0701016b040176");
    // Bytes=5 | 2 bytes ab cd (one slice, as a sequence of u8 would be)
    golden(&Value::Bytes(vec![0xab, 0xcd]), "04000000 05 02abcd");
    // A body: the skeleton's u32 LE length, the skeleton, then the tensors' bytes.
    let (head, shape) = Body::head(&value).expect("a small value");
    assert_eq!(
        hex::encode(&head),
        "0f0000000603020108010102070101 6b040176".replace(' ', "")
    );
    assert_eq!((shape.nodes, shape.tensors, shape.tensor_bytes), (5, 1, 2));
    let body_len = head.len() as u64 + 2;
    let skeleton_len = Body::skeleton_len(head[..4].try_into().expect("4"), body_len);
    assert_eq!(skeleton_len, Ok(15));
    let (back, _) = Body::skeleton(&head[4..], body_len).expect("decodes");
    assert_eq!(back, value);
    // Servers=11 | "f"; Functions=12 | prefix "a" | limit 2
    golden(
        &CtlRequest::Servers {
            function: name("f"),
        },
        "03000000 0b 0166",
    );
    golden(
        &CtlRequest::Functions {
            prefix: "a".into(),
            limit: 2,
        },
        "04000000 0c 0161 02",
    );
    // Servers=9 | "f" | [node 01.., addrs ["a"], complete]; Functions=10 | [("f", 3)]
    let servers = CtlResponse::Servers {
        function: name("f"),
        servers: vec![HolderAddr {
            node: id(1),
            addrs: vec!["a".into()],
            complete: true,
        }],
    };
    golden(
        &servers,
        &format!("28000000 09 0166 01 {} 01 0161 01", "01".repeat(32)),
    );
    let functions = CtlResponse::Functions {
        functions: vec![(name("f"), 3)],
    };
    golden(&functions, "05000000 0a 01 0166 03");
}

#[test]
fn call_values_are_checked_before_any_tensor_byte_is_read() {
    use tb_proto::call::{Body, CallError, MAX_VALUE_DEPTH, TensorSlot, Value};
    let mut deep = Value::None;
    for _ in 0..MAX_VALUE_DEPTH {
        deep = Value::List(vec![deep]);
    }
    assert_eq!(deep.validate(), Err(CallError::TooDeep));
    let huge = Value::Tensor(TensorSlot {
        dtype: DType::F64,
        shape: vec![u64::MAX, 2],
    });
    assert!(matches!(huge.validate(), Err(CallError::Meta(_))));
    // A skeleton whose tensors need more bytes than the body has left is refused.
    let value = Value::Tensor(TensorSlot {
        dtype: DType::U8,
        shape: vec![8],
    });
    let (head, _) = Body::head(&value).expect("encodes");
    let short = head.len() as u64 + 7;
    assert!(matches!(
        Body::skeleton(&head[4..], short),
        Err(CallError::Malformed(_))
    ));
    // A prefix claiming more than the body holds is refused on the prefix.
    assert!(Body::skeleton_len(100u32.to_le_bytes(), 50).is_err());
}
