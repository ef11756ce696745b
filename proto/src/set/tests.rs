use proptest::prelude::*;

use super::*;

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("name")
}

fn member(key: &str, dtype: DType, shape: &[u64]) -> SetMember {
    SetMember {
        key: key.into(),
        dtype,
        shape: shape.to_vec(),
        hash: ContentHash([7; 32]),
    }
}

fn manifest(members: Vec<SetMember>) -> SetManifest {
    SetManifest {
        members,
        metadata: BTreeMap::new(),
    }
}

/// The set's bytes: header, then each member filled with its index, zero padding between.
fn bytes_of(layout: &SetLayout) -> Vec<u8> {
    let mut out = layout.header.clone();
    for (i, (_, range)) in layout.members().enumerate() {
        out.resize(range.start as usize, 0);
        out.extend(std::iter::repeat_n(
            i as u8,
            (range.end - range.start) as usize,
        ));
    }
    out
}

#[test]
fn layout_is_aligned_and_decodes_back() {
    let prefix = name("ckpt");
    let mut m = manifest(vec![
        member("a", DType::F32, &[3]),
        member("layer.0/w", DType::BF16, &[2, 5]),
        member("empty", DType::I64, &[0]),
        member("scalar", DType::U8, &[]),
    ]);
    m.metadata.insert("format".into(), "pt".into());
    let layout = SetLayout::new(&prefix, m.clone(), u64::MAX).expect("layout");
    assert_eq!(layout.header.len() % 64, 0);
    let starts: Vec<u64> = layout.ranges.iter().map(|r| r.start).collect();
    let h = layout.header.len() as u64;
    // 12 bytes, then 20 (next 64), then 0 bytes and 1 byte at the next multiples of 64.
    assert_eq!(starts, vec![h, h + 64, h + 128, h + 128]);
    assert_eq!(layout.len, h + 129);
    let bytes = bytes_of(&layout);
    assert_eq!(bytes.len() as u64, layout.len);
    let back = SetLayout::decode(&prefix, &bytes).expect("decode");
    assert_eq!(back, layout);
    assert_eq!(back.manifest, m);
}

/// The format is frozen: this is the exact header of a one-member set.
#[test]
fn golden_header() {
    let layout = SetLayout::new(
        &name("p"),
        manifest(vec![member("w", DType::F32, &[2])]),
        1 << 20,
    )
    .expect("layout");
    let body = concat!(
        "01",   // one member
        "0177", // key "w"
        "0b",   // dtype F32 (variant 11)
        "0102", // shape [2]
    );
    let expected = format!(
        "5442534554000001{:02x}000000{body}{}00",
        body.len() / 2 + 32 + 1,
        "07".repeat(32),
    );
    let pad = 64 - expected.len() / 2;
    assert_eq!(
        hex::encode(&layout.header),
        format!("{expected}{}", "00".repeat(pad))
    );
    assert_eq!(layout.len, 64 + 8);
}

fn decode_err(prefix: &str, bytes: &[u8]) -> SetError {
    SetLayout::decode(&name(prefix), bytes).expect_err("invalid")
}

#[test]
fn malformed_sets_are_typed_errors() {
    let prefix = name("p");
    let layout = SetLayout::new(
        &prefix,
        manifest(vec![member("w", DType::F32, &[2])]),
        u64::MAX,
    )
    .expect("valid");
    let good = bytes_of(&layout);
    assert!(matches!(
        decode_err("p", &good[..5]),
        SetError::Truncated { .. }
    ));
    assert!(matches!(
        decode_err("p", &good[..good.len() - 1]),
        SetError::Truncated { .. }
    ));
    let mut long = good.clone();
    long.push(0);
    assert_eq!(decode_err("p", &long), SetError::Trailing { extra: 1 });
    let mut magic = good.clone();
    magic[0] = b'X';
    assert_eq!(decode_err("p", &magic), SetError::Magic);
    let mut huge = good.clone();
    huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode_err("p", &huge),
        SetError::ManifestTooLarge { .. }
    ));
    let mut garbled = good.clone();
    garbled[12] = 0xff; // member count: an unfinished varint
    assert!(matches!(decode_err("p", &garbled), SetError::Manifest(_)));
    // The member is valid under "p" but not under a prefix that makes the name too long.
    let long_prefix = "x".repeat(255);
    assert!(matches!(
        decode_err(&long_prefix, &good),
        SetError::Key { .. }
    ));
}

#[test]
fn bad_manifests_are_refused_on_both_sides() {
    let prefix = name("p");
    let cases: Vec<(SetManifest, &str)> = vec![
        (manifest(vec![]), "at least one member"),
        (
            manifest(vec![
                member("a", DType::U8, &[1]),
                member("a", DType::U8, &[2]),
            ]),
            "two members named \"a\"",
        ),
        (
            manifest(vec![member("a b", DType::U8, &[1])]),
            "member \"a b\"",
        ),
        (manifest(vec![member("", DType::U8, &[1])]), "empty level"),
        (
            manifest(vec![member("s", DType::Set, &[4])]),
            "cannot itself be a set",
        ),
        (
            manifest(vec![member("big", DType::F64, &[u64::MAX / 4])]),
            "member \"big\"",
        ),
    ];
    for (m, says) in cases {
        let err = SetLayout::new(&prefix, m.clone(), u64::MAX).expect_err(says);
        assert!(err.to_string().contains(says), "{err} (wanted {says:?})");
        // A peer that wrote such a manifest anyway is refused when it is read.
        let body = postcard::to_stdvec(&m).expect("valid");
        let mut bytes = SET_MAGIC.to_vec();
        bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&body);
        bytes.resize(align_up(bytes.len() as u64) as usize, 0);
        let err = SetLayout::decode(&prefix, &bytes).expect_err(says);
        assert!(err.to_string().contains(says), "{err} (wanted {says:?})");
    }
}

#[test]
fn limits_hold() {
    let prefix = name("p");
    let many: Vec<SetMember> = (0..=MAX_SET_MEMBERS)
        .map(|i| member(&format!("k{i}"), DType::U8, &[0]))
        .collect();
    assert_eq!(
        SetLayout::new(&prefix, manifest(many), u64::MAX),
        Err(SetError::TooManyMembers {
            count: MAX_SET_MEMBERS + 1
        })
    );
    let mut m = manifest(vec![member("a", DType::U8, &[1])]);
    m.metadata
        .insert("k".into(), "v".repeat(MAX_SET_METADATA_LEN + 1));
    assert!(matches!(
        SetLayout::new(&prefix, m, u64::MAX),
        Err(SetError::Metadata(_))
    ));
    let mut m = manifest(vec![member("a", DType::U8, &[1])]);
    m.metadata = (0..=MAX_SET_METADATA)
        .map(|i| (i.to_string(), String::new()))
        .collect();
    assert!(matches!(
        SetLayout::new(&prefix, m, u64::MAX),
        Err(SetError::Metadata(_))
    ));
    let m = manifest(vec![member("a", DType::U8, &[100])]);
    assert!(matches!(
        SetLayout::new(&prefix, m, 150),
        Err(SetError::TooLarge { max: 150, .. })
    ));
}

fn arb_member() -> impl Strategy<Value = SetMember> {
    (
        "[a-z0-9._-]{1,12}",
        prop::sample::select(DType::ALL.to_vec()),
        prop::collection::vec(0u64..5, 0..4),
        any::<[u8; 32]>(),
    )
        .prop_map(|(key, dtype, shape, hash)| SetMember {
            key,
            dtype,
            shape,
            hash: ContentHash(hash),
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = SetLayout::decode(&name("p"), &bytes);
        let mut framed = SET_MAGIC.to_vec();
        framed.extend_from_slice(&bytes);
        let _ = SetLayout::decode(&name("p"), &framed);
    }

    #[test]
    fn well_formed_sets_round_trip(
        members in prop::collection::vec(arb_member(), 1..12),
        metadata in prop::collection::btree_map("[a-z]{1,6}", ".{0,20}", 0..4),
    ) {
        let mut seen = std::collections::HashSet::new();
        let members: Vec<SetMember> =
            members.into_iter().filter(|m| seen.insert(m.key.clone())).collect();
        let m = SetManifest { members, metadata };
        let layout = SetLayout::new(&name("ck/pt"), m, u64::MAX).expect("layout");
        let bytes = bytes_of(&layout);
        prop_assert_eq!(SetLayout::decode(&name("ck/pt"), &bytes), Ok(layout.clone()));
        for (i, r) in layout.ranges.iter().enumerate() {
            prop_assert_eq!(r.start % SET_ALIGN, 0);
            if i > 0 {
                prop_assert!(r.start >= layout.ranges[i - 1].end);
            }
        }
    }
}
