//! Property tests: every message (`tb/data/1`, `Hello`, `tb/ctl/1`) round-trips, and no
//! decoder or validator panics on anything, random bytes or valid frames with bit flips,
//! truncations and extensions.

use proptest::{
    collection::{btree_map, btree_set, vec},
    prelude::*,
};
use tb_proto::{
    AccessProof, AuthProof, ByteRange, ChannelKind, ContentHash, CtlRequest, CtlResponse, DType,
    DataRequest, DataResponse, Entry, ErrorCode, Event, FrameError, Hello, HelloReply, HolderAddr,
    HolderMark, LastHeartbeat, LinkChannel, ListedEntry, MAX_LIST_LIMIT, MAX_RANK, Member,
    MemberStatus, NamePattern, NodeId, NodeStats, RegistryOp, Role, SYNC_BUCKETS, Stamp,
    TensorMeta, TensorName,
    frame::{self, LEN_PREFIX, MAX_CONTROL_FRAME},
};

/// The limit the validators run with (the design's default maximum tensor size).
const MAX_TENSOR: u64 = 64 << 30;

fn dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    proptest::sample::select(ErrorCode::ALL.to_vec())
}

fn tensor_name() -> impl Strategy<Value = TensorName> {
    "[A-Za-z0-9._:-]{1,40}(/[A-Za-z0-9._:-]{1,40}){0,5}"
        .prop_map(|s| TensorName::new(s).expect("strategy makes valid names"))
}

fn pattern() -> impl Strategy<Value = NamePattern> {
    prop_oneof![
        tensor_name().prop_map(NamePattern::Exact),
        tensor_name().prop_map(|n| NamePattern::Prefix(format!("{n}/"))),
        Just(NamePattern::Prefix(String::new())),
    ]
}

fn hash() -> impl Strategy<Value = ContentHash> {
    any::<[u8; 32]>().prop_map(ContentHash)
}

/// Valid metadata: small dims at any rank up to the limit, or huge dims at low rank.
fn meta() -> impl Strategy<Value = TensorMeta> {
    let shape = prop_oneof![
        vec(0u64..5, 0..=MAX_RANK),
        vec(any::<u32>().prop_map(u64::from), 0..=2),
    ];
    (dtype(), shape, hash())
        .prop_filter_map("shape overflows", |(d, s, h)| TensorMeta::new(d, s, h).ok())
}

fn range() -> impl Strategy<Value = ByteRange> {
    (any::<u64>(), any::<u64>()).prop_map(|(offset, len)| ByteRange { offset, len })
}

fn request() -> impl Strategy<Value = DataRequest> {
    prop_oneof![
        (
            tensor_name(),
            any::<Option<u64>>(),
            proptest::option::of(range())
        )
            .prop_map(|(name, version, range)| DataRequest::Pull {
                name,
                version,
                range
            }),
        (tensor_name(), meta()).prop_map(|(name, meta)| DataRequest::Push { name, meta }),
        offers().prop_map(|offers| DataRequest::Channels { offers }),
        (
            tensor_name(),
            any::<Option<u64>>(),
            1..=tb_proto::channel::MAX_TCP_SOCKETS
        )
            .prop_map(|(name, version, sockets)| DataRequest::TcpPull {
                name,
                version,
                sockets
            }),
        (tensor_name(), any::<u64>())
            .prop_map(|(name, version)| DataRequest::Pieces { name, version }),
        tensor_name().prop_map(|name| DataRequest::Watch { name }),
    ]
}

fn offers() -> impl Strategy<Value = Vec<tb_proto::ChannelOffer>> {
    use tb_proto::ChannelOffer;
    let offer = prop_oneof![
        (any::<[u8; 16]>(), any::<[u8; 32]>())
            .prop_map(|(socket, token)| ChannelOffer::Shm { socket, token }),
        any::<u16>().prop_map(|port| ChannelOffer::Tcp { port }),
    ];
    proptest::collection::vec(offer, 0..4)
}

fn response() -> impl Strategy<Value = DataResponse> {
    prop_oneof![
        (meta(), any::<u64>()).prop_map(|(meta, version)| DataResponse::Header { meta, version }),
        Just(DataResponse::Ack),
        (error_code(), ".{0,80}").prop_map(|(code, message)| DataResponse::Error { code, message }),
        offers().prop_map(|offers| DataResponse::Channels { offers }),
        (meta(), any::<u64>(), any::<[u8; 32]>()).prop_map(|(meta, version, token)| {
            DataResponse::TcpTicket {
                meta,
                version,
                token,
            }
        }),
        (
            any::<u64>(),
            proptest::collection::vec(any::<[u8; 32]>(), 0..8),
            any::<bool>(),
            proptest::collection::vec(any::<u32>(), 0..8)
        )
            .prop_map(
                |(piece_len, values, complete, have)| DataResponse::Outline {
                    piece_len,
                    values,
                    complete,
                    have
                }
            ),
        (proptest::collection::vec(any::<u32>(), 0..8), any::<bool>())
            .prop_map(|(pieces, complete)| DataResponse::Have { pieces, complete }),
        (
            any::<u64>(),
            meta(),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(version, meta, bytes)| DataResponse::Offer {
                version,
                meta,
                bytes
            }),
    ]
}

fn node() -> impl Strategy<Value = NodeId> {
    any::<[u8; 32]>().prop_map(NodeId)
}

fn stamp() -> impl Strategy<Value = Stamp> {
    (any::<u64>(), any::<u32>(), node()).prop_map(|(wall_ms, logical, node)| Stamp {
        wall_ms,
        logical,
        node,
    })
}

fn version() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..10, 1..=u64::MAX]
}

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Broker), Just(Role::Worker)]
}

fn addrs() -> impl Strategy<Value = Vec<String>> {
    vec("[a-z0-9.:\\[\\]]{1,64}", 0..=3)
}

/// Valid heartbeat stats: finite, non-negative floats and a short URL.
fn node_stats() -> impl Strategy<Value = NodeStats> {
    let rate = 0.0..1e12f64;
    (
        (any::<u32>(), any::<u64>(), any::<u64>(), rate.clone(), rate),
        (any::<u64>(), any::<u64>()),
        (
            proptest::option::of(0.0..1e4f64),
            proptest::option::of(0.0..1e4f64),
            proptest::option::of("http://[a-z0-9.:]{1,40}"),
        ),
        (vec(link_channel(), 0..=3), any::<u64>()),
    )
        .prop_map(
            |(
                (links, tensors, bytes, rin, rout),
                (tin, tout),
                (p50, p99, url),
                (channels, cap),
            )| {
                NodeStats {
                    pool_links: links,
                    tensors,
                    store_bytes: bytes,
                    in_bytes_per_s: rin,
                    out_bytes_per_s: rout,
                    in_bytes_total: tin,
                    out_bytes_total: tout,
                    latency_p50_s: p50,
                    latency_p99_s: p99,
                    metrics_url: url,
                    links: channels,
                    upload_limit: cap,
                    functions: Vec::new(),
                }
            },
        )
}

/// One pooled link and its channel.
fn link_channel() -> impl Strategy<Value = LinkChannel> {
    (
        digest(),
        proptest::sample::select(ChannelKind::ALL.to_vec()),
    )
        .prop_map(|(peer, channel)| LinkChannel {
            peer: NodeId(peer),
            channel,
        })
}

fn digest() -> impl Strategy<Value = [u8; 32]> {
    any::<[u8; 32]>()
}

fn member() -> impl Strategy<Value = Member> {
    (
        node(),
        role(),
        addrs(),
        any::<u64>(),
        any::<bool>(),
        stamp(),
    )
        .prop_map(|(node, role, addrs, epoch, alive, stamp)| Member {
            node,
            role,
            addrs,
            epoch,
            alive,
            stamp,
        })
}

/// A `Members` row: a member, with or without its latest heartbeat stats.
fn member_status() -> impl Strategy<Value = MemberStatus> {
    (member(), proptest::option::of((node_stats(), any::<u64>()))).prop_map(|(member, heard)| {
        MemberStatus {
            member,
            heartbeat: heard.map(|(stats, age_ms)| LastHeartbeat { stats, age_ms }),
        }
    })
}

fn registry_op() -> impl Strategy<Value = RegistryOp> {
    prop_oneof![
        (tensor_name(), version(), meta(), node(), stamp()).prop_map(
            |(name, version, meta, publisher, stamp)| RegistryOp::Publish {
                name,
                version,
                meta,
                publisher,
                stamp,
            }
        ),
        (tensor_name(), version(), node(), stamp(), any::<bool>()).prop_map(
            |(name, version, node, stamp, add)| RegistryOp::holder(name, version, node, stamp, add)
        ),
        (tensor_name(), stamp()).prop_map(|(name, stamp)| RegistryOp::Delete { name, stamp }),
        member().prop_map(RegistryOp::Member),
    ]
}

fn entry() -> impl Strategy<Value = Entry> {
    let marks = btree_map(
        (node(), version()),
        (stamp(), any::<bool>()).prop_map(|(stamp, present)| HolderMark { stamp, present }),
        0..3,
    );
    (
        0u64..10,
        meta(),
        node(),
        stamp(),
        marks,
        proptest::option::of(stamp()),
    )
        .prop_map(
            |(version, meta, publisher, stamp, holders, deleted)| Entry {
                version,
                meta,
                publisher,
                stamp,
                holders,
                deleted,
            },
        )
}

/// A read proof, and a write proof or none.
fn access_proof() -> impl Strategy<Value = AccessProof> {
    (any::<[u8; 32]>(), proptest::option::of(any::<[u8; 32]>())).prop_map(|(read, write)| {
        AccessProof {
            read: AuthProof(read),
            write: write.map(AuthProof),
        }
    })
}

fn hello() -> impl Strategy<Value = Hello> {
    access_proof().prop_map(|proof| Hello { proof })
}

fn hello_reply() -> impl Strategy<Value = HelloReply> {
    (any::<u64>(), access_proof()).prop_map(|(max_tensor_bytes, proof)| HelloReply::Welcome {
        max_tensor_bytes,
        proof,
    })
}

/// Valid requests of every variant.
fn ctl_request() -> impl Strategy<Value = CtlRequest> {
    prop_oneof![
        (
            role(),
            addrs(),
            any::<u64>(),
            proptest::option::of(node_stats())
        )
            .prop_map(|(role, addrs, epoch, stats)| CtlRequest::Heartbeat {
                role,
                addrs,
                epoch,
                stats,
            }),
        vec(registry_op(), 0..4).prop_map(|ops| CtlRequest::Announce { ops }),
        tensor_name().prop_map(|name| CtlRequest::NextVersion { name }),
        (
            tensor_name(),
            proptest::option::of(version()),
            vec(node(), 0..=3)
        )
            .prop_map(|(name, version, exclude)| CtlRequest::Lookup {
                name,
                version,
                exclude
            }),
        (tensor_name(), version(), any::<bool>()).prop_map(|(name, version, active)| {
            CtlRequest::Fetching {
                name,
                version,
                active,
            }
        }),
        ("[A-Za-z0-9._:/-]{0,60}", 0..=MAX_LIST_LIMIT)
            .prop_map(|(prefix, limit)| CtlRequest::List { prefix, limit }),
        pattern().prop_map(|pattern| CtlRequest::Subscribe { pattern }),
        Just(CtlRequest::Members),
        (vec(digest(), SYNC_BUCKETS), vec((node(), digest()), 0..4))
            .prop_map(|(buckets, members)| CtlRequest::SyncBuckets { buckets, members }),
        (vec((tensor_name(), digest()), 0..4), any::<bool>())
            .prop_map(|(names, last)| CtlRequest::SyncNames { names, last }),
        (inline_publish(), vec(registry_op(), 0..3)).prop_map(|((op, bytes), rest)| {
            let ops = std::iter::once(op).chain(rest).collect();
            CtlRequest::Publish { ops, bytes }
        }),
    ]
}

/// A publish of a small `u8` tensor with its bytes (valid: length and hash match).
fn inline_publish() -> impl Strategy<Value = (RegistryOp, Vec<u8>)> {
    (
        tensor_name(),
        version(),
        node(),
        stamp(),
        vec(any::<u8>(), 0..64),
    )
        .prop_map(|(name, version, publisher, stamp, bytes)| {
            let meta =
                TensorMeta::new(DType::U8, vec![bytes.len() as u64], ContentHash::of(&bytes))
                    .expect("meta");
            let op = RegistryOp::Publish {
                name,
                version,
                meta,
                publisher,
                stamp,
            };
            (op, bytes)
        })
}

fn holder_addr() -> impl Strategy<Value = HolderAddr> {
    (node(), addrs(), any::<bool>()).prop_map(|(node, addrs, complete)| HolderAddr {
        node,
        addrs,
        complete,
    })
}

fn listed_entry() -> impl Strategy<Value = ListedEntry> {
    (tensor_name(), version(), meta(), any::<u32>()).prop_map(|(name, version, meta, holders)| {
        ListedEntry {
            name,
            version,
            meta,
            holders,
        }
    })
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (tensor_name(), version(), meta(), node()).prop_map(|(name, version, meta, publisher)| {
            Event::Published {
                name,
                version,
                meta,
                publisher,
            }
        }),
        tensor_name().prop_map(|name| Event::Deleted { name }),
        inline_publish().prop_map(|(op, bytes)| match op {
            RegistryOp::Publish {
                name,
                version,
                meta,
                publisher,
                ..
            } => Event::PublishedInline {
                name,
                version,
                meta,
                publisher,
                bytes,
            },
            _ => unreachable!("inline_publish makes publishes"),
        }),
    ]
}

/// Valid responses of every variant.
fn ctl_response() -> impl Strategy<Value = CtlResponse> {
    prop_oneof![
        Just(CtlResponse::Ok),
        version().prop_map(|version| CtlResponse::Version { version }),
        (tensor_name(), version(), meta(), vec(holder_addr(), 0..4)).prop_map(
            |(name, version, meta, holders)| CtlResponse::Holders {
                name,
                version,
                meta,
                sources: holders.len().min(1) as u8,
                holders,
            }
        ),
        (vec(listed_entry(), 0..4), any::<bool>())
            .prop_map(|(entries, last)| CtlResponse::Listing { entries, last }),
        event().prop_map(CtlResponse::Event),
        (vec(member_status(), 0..4), any::<bool>())
            .prop_map(|(members, last)| CtlResponse::Members { members, last }),
        (
            vec(member(), 0..3),
            btree_set(any::<u8>(), 0..8),
            any::<bool>()
        )
            .prop_map(|(members, buckets, last)| CtlResponse::SyncDiff {
                members,
                buckets: buckets.into_iter().collect(),
                last,
            }),
        (vec((tensor_name(), entry()), 0..3), any::<bool>())
            .prop_map(|(entries, last)| CtlResponse::SyncEntries { entries, last }),
        (error_code(), ".{0,80}").prop_map(|(code, message)| CtlResponse::Error { code, message }),
    ]
}

/// A change to a valid frame.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize),
    Truncate(usize),
    Extend(Vec<u8>),
    SetByte(usize, u8),
}

fn mutations() -> impl Strategy<Value = Vec<Mutation>> {
    let one = prop_oneof![
        any::<usize>().prop_map(Mutation::FlipBit),
        any::<usize>().prop_map(Mutation::Truncate),
        vec(any::<u8>(), 1..16).prop_map(Mutation::Extend),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::SetByte(i, b)),
    ];
    vec(one, 1..4)
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        match m {
            Mutation::FlipBit(i) if !bytes.is_empty() => {
                let bit = i % (bytes.len() * 8);
                bytes[bit / 8] ^= 1 << (bit % 8);
            }
            Mutation::Truncate(n) => bytes.truncate(n % (bytes.len() + 1)),
            Mutation::Extend(more) => bytes.extend(more),
            Mutation::SetByte(i, b) if !bytes.is_empty() => {
                let at = i % bytes.len();
                bytes[at] = *b;
            }
            _ => {}
        }
    }
    bytes
}

/// Re-encodes what a decoder accepted and decodes it again: the value must survive. (Not the
/// bytes: postcard accepts overlong varints, so the wire form is not canonical.)
fn reencodes<T>(msg: &T)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let bytes = frame::encode(msg).expect("re-encode");
    let again = frame::decode_frame::<T>(&bytes)
        .expect("decode")
        .map(|(m, _)| m);
    assert_eq!(again.as_ref(), Some(msg));
}

/// Runs every decoder and validator on `bytes`, as a frame and as a bare body; they may
/// refuse it, but must not panic, and what they accept must survive re-encoding.
fn decode_everything(bytes: &[u8]) {
    if let Ok(Some((req, used))) = frame::decode_frame::<DataRequest>(bytes) {
        assert!(used <= bytes.len());
        let _ = req.validate(MAX_TENSOR);
        let _ = req.validate(0);
        reencodes(&req);
    }
    if let Ok(Some((resp, used))) = frame::decode_frame::<DataResponse>(bytes) {
        assert!(used <= bytes.len());
        if let DataResponse::Header { meta, .. } = &resp {
            let _ = meta.validate(MAX_TENSOR);
            let _ = meta.numel();
        }
        reencodes(&resp);
    }
    if let Ok(req) = frame::decode_body::<DataRequest>(bytes) {
        let _ = req.validate(MAX_TENSOR);
    }
    if let Ok(meta) = frame::decode_body::<TensorMeta>(bytes) {
        let _ = meta.validate(MAX_TENSOR);
    }
    let _ = frame::decode_body::<DataResponse>(bytes);
    let _ = frame::decode_body::<NamePattern>(bytes);
    decode_auth_and_ctl(bytes);
    if let Some(prefix) = bytes.first_chunk::<LEN_PREFIX>() {
        let _ = frame::body_len(*prefix);
    }
}

/// [`decode_everything`]'s half for the `Hello` exchange and `tb/ctl/1`.
fn decode_auth_and_ctl(bytes: &[u8]) {
    if let Ok(Some((hello, _))) = frame::decode_frame::<Hello>(bytes) {
        reencodes(&hello);
    }
    if let Ok(Some((reply, _))) = frame::decode_frame::<HelloReply>(bytes) {
        reencodes(&reply);
    }
    if let Ok(Some((req, used))) = frame::decode_frame::<CtlRequest>(bytes) {
        assert!(used <= bytes.len());
        let _ = req.validate(0);
        if req.validate(MAX_TENSOR).is_ok() {
            reencodes(&req);
        }
    }
    if let Ok(Some((resp, used))) = frame::decode_frame::<CtlResponse>(bytes) {
        assert!(used <= bytes.len());
        let _ = resp.is_final();
        let _ = resp.validate(0);
        if resp.validate(MAX_TENSOR).is_ok() {
            reencodes(&resp);
        }
    }
    let _ = frame::decode_body::<Hello>(bytes);
    let _ = frame::decode_body::<HelloReply>(bytes);
    if let Ok(req) = frame::decode_body::<CtlRequest>(bytes) {
        let _ = req.validate(MAX_TENSOR);
    }
    if let Ok(resp) = frame::decode_body::<CtlResponse>(bytes) {
        let _ = resp.validate(MAX_TENSOR);
    }
}

fn check_round_trip<T>(msg: &T) -> Result<(), TestCaseError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let bytes = frame::encode(msg).expect("encode");
    let (back, used) = frame::decode_frame::<T>(&bytes)
        .expect("decode")
        .expect("whole frame");
    prop_assert_eq!(&back, msg);
    prop_assert_eq!(used, bytes.len());
    let body: T = frame::decode_body(&bytes[LEN_PREFIX..]).expect("body");
    prop_assert_eq!(&body, msg);
    // Every strict prefix is an incomplete frame, never an error or a message.
    let cut = bytes.len() / 2;
    prop_assert!(matches!(frame::decode_frame::<T>(&bytes[..cut]), Ok(None)));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn requests_round_trip(req in request()) {
        prop_assert_eq!(req.validate(u64::MAX).is_ok(), match &req {
            DataRequest::Pull { range: Some(r), .. } => r.offset.checked_add(r.len).is_some(),
            DataRequest::Channels { offers } => tb_proto::channel::validate_offers(offers).is_ok(),
            _ => true,
        });
        check_round_trip(&req)?;
    }

    #[test]
    fn responses_round_trip(resp in response()) {
        check_round_trip(&resp)?;
    }

    #[test]
    fn metas_round_trip_and_validate(meta in meta()) {
        prop_assert!(meta.validate(u64::MAX).is_ok());
        check_round_trip(&meta)?;
    }

    #[test]
    fn names_and_patterns_round_trip(name in tensor_name(), pat in pattern()) {
        prop_assert_eq!(TensorName::new(name.to_string()), Ok(name.clone()));
        prop_assert_eq!(pat.to_string().parse::<NamePattern>(), Ok(pat.clone()));
        check_round_trip(&name)?;
        check_round_trip(&pat)?;
    }

    /// Names, patterns and dtypes typed by users (`tb get`, `tb watch`, `--dtype`): any
    /// string is accepted or refused, never a panic; what is accepted prints back to itself.
    #[test]
    fn arbitrary_names_patterns_and_dtypes_never_panic(
        s in prop_oneof![
            any::<String>(),
            "[a-z/.*:_é -]{0,12}",
            vec(prop_oneof![Just("a"), Just("/"), Just("*"), Just("é"), Just("."), Just("")], 0..300)
                .prop_map(|v| v.concat()),
        ]
    ) {
        if let Ok(name) = TensorName::new(s.clone()) {
            prop_assert_eq!(name.as_str(), s.as_str());
        }
        if let Ok(pat) = s.parse::<NamePattern>() {
            prop_assert_eq!(pat.to_string().parse::<NamePattern>(), Ok(pat));
        }
        if let Ok(d) = s.parse::<DType>() {
            prop_assert_eq!(d.name().parse::<DType>(), Ok(d));
        }
    }

    #[test]
    fn dtypes_and_codes_round_trip(d in dtype(), code in error_code()) {
        prop_assert_eq!(d.name().parse::<DType>(), Ok(d));
        check_round_trip(&d)?;
        check_round_trip(&code)?;
    }

    #[test]
    fn prefix_patterns_match_exactly_the_names_below(prefix in tensor_name(), name in tensor_name()) {
        let pat: NamePattern = format!("{prefix}/*").parse().expect("pattern");
        let below = name.as_str().starts_with(&format!("{prefix}/"));
        prop_assert_eq!(pat.matches(&name), below);
        prop_assert!(!pat.matches(&prefix));
        prop_assert!("*".parse::<NamePattern>().expect("all").matches(&name));
    }

    #[test]
    fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..256)) {
        decode_everything(&bytes);
        // The same bytes behind an honest length prefix reach the body decoders.
        let mut framed = (bytes.len() as u32).to_le_bytes().to_vec();
        framed.extend(&bytes);
        decode_everything(&framed);
    }

    #[test]
    fn mutated_requests_never_panic(req in request(), muts in mutations()) {
        let bytes = mutate(frame::encode(&req).expect("encode"), &muts);
        decode_everything(&bytes);
        decode_everything(bytes.get(LEN_PREFIX..).unwrap_or_default());
    }

    #[test]
    fn mutated_responses_never_panic(resp in response(), muts in mutations()) {
        let bytes = mutate(frame::encode(&resp).expect("encode"), &muts);
        decode_everything(&bytes);
        decode_everything(bytes.get(LEN_PREFIX..).unwrap_or_default());
    }

    #[test]
    fn hellos_round_trip(h in hello(), r in hello_reply()) {
        check_round_trip(&h)?;
        check_round_trip(&r)?;
    }

    #[test]
    fn ctl_requests_round_trip_and_validate(req in ctl_request()) {
        prop_assert_eq!(req.validate(u64::MAX), Ok(()));
        check_round_trip(&req)?;
    }

    #[test]
    fn ctl_responses_round_trip_and_validate(resp in ctl_response()) {
        prop_assert_eq!(resp.validate(u64::MAX), Ok(()));
        check_round_trip(&resp)?;
    }

    #[test]
    fn mutated_hellos_never_panic(h in hello(), r in hello_reply(), muts in mutations()) {
        for bytes in [frame::encode(&h), frame::encode(&r)] {
            let bytes = mutate(bytes.expect("encode"), &muts);
            decode_everything(&bytes);
            decode_everything(bytes.get(LEN_PREFIX..).unwrap_or_default());
        }
    }

    #[test]
    fn mutated_ctl_requests_never_panic(req in ctl_request(), muts in mutations()) {
        let bytes = mutate(frame::encode(&req).expect("encode"), &muts);
        decode_everything(&bytes);
        decode_everything(bytes.get(LEN_PREFIX..).unwrap_or_default());
    }

    #[test]
    fn mutated_ctl_responses_never_panic(resp in ctl_response(), muts in mutations()) {
        let bytes = mutate(frame::encode(&resp).expect("encode"), &muts);
        decode_everything(&bytes);
        decode_everything(bytes.get(LEN_PREFIX..).unwrap_or_default());
    }

    #[test]
    fn body_len_enforces_the_cap(prefix in any::<[u8; 4]>()) {
        let declared = u32::from_le_bytes(prefix);
        match frame::body_len(prefix) {
            Ok(len) => prop_assert!(declared <= MAX_CONTROL_FRAME && len == declared as usize),
            Err(FrameError::TooLarge { len, .. }) => {
                prop_assert!(declared > MAX_CONTROL_FRAME && len == u64::from(declared));
            }
            Err(e) => prop_assert!(false, "unexpected {e}"),
        }
    }

    #[test]
    fn string_parsers_never_panic(
        s in prop_oneof![".{0,300}", "[A-Za-z0-9._:/*é -]{0,300}"]
    ) {
        if let Ok(name) = TensorName::new(s.as_str()) {
            prop_assert!(!name.as_str().is_empty() && name.as_str().len() <= 256);
            prop_assert!(!name.as_str().split('/').any(str::is_empty));
        }
        if let Ok(pat) = s.parse::<NamePattern>() {
            prop_assert_eq!(pat.to_string(), s.clone());
        }
        if let Ok(d) = s.parse::<DType>() {
            prop_assert_eq!(d.to_string().parse::<DType>(), Ok(d));
        }
    }
}
