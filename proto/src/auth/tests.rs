use super::*;
use crate::{CTL_ALPN, DATA_ALPN};

const SECRET: &[u8] = b"correct horse battery staple, a long one";

fn key(secret: &[u8]) -> ClusterKey {
    ClusterKey::from_secret(secret).expect("valid secret")
}

fn ids() -> (NodeId, NodeId) {
    (NodeId([1; 32]), NodeId([2; 32]))
}

#[test]
fn proof_verifies_for_the_same_connection_only() {
    let (a, b) = ids();
    let k = key(SECRET);
    let proof = k.prove(CTL_ALPN, &a, &b);
    assert_eq!(k.verify(CTL_ALPN, &a, &b, &proof), Some(Access::ReadWrite));
    assert_eq!(
        key(SECRET).verify(CTL_ALPN, &a, &b, &proof),
        Some(Access::ReadWrite),
        "deterministic"
    );
    assert_eq!(k.verify(CTL_ALPN, &b, &a, &proof), None, "swapped ids");
    assert_eq!(k.verify(CTL_ALPN, &a, &a, &proof), None, "other server");
    assert_eq!(k.verify(DATA_ALPN, &a, &b, &proof), None, "other alpn");
    assert_eq!(k.verify(b"", &a, &b, &proof), None, "empty alpn");
    let other = key(b"correct horse battery staple, a long onf");
    assert_eq!(other.verify(CTL_ALPN, &a, &b, &proof), None, "other secret");
    assert_eq!(ClusterKey::open().verify(CTL_ALPN, &a, &b, &proof), None);
    let mut flipped = proof;
    flipped.read.0[31] ^= 1;
    assert_eq!(k.verify(CTL_ALPN, &a, &b, &flipped), None);
}

#[test]
fn a_false_write_claim_is_refused_not_downgraded() {
    let (a, b) = ids();
    let k = key(SECRET);
    let mut proof = k.prove(DATA_ALPN, &a, &b);
    let write = proof
        .write
        .as_mut()
        .expect("the secret proves write access");
    write.0[0] ^= 1;
    assert_eq!(k.verify(DATA_ALPN, &a, &b, &proof), None);
    // A read-only node that claims write access with the read proof it can make.
    let ro = k.read_only();
    let mut claim = ro.prove(DATA_ALPN, &a, &b);
    assert_eq!(claim.write, None);
    claim.write = Some(claim.read);
    assert_eq!(k.verify(DATA_ALPN, &a, &b, &claim), None);
}

#[test]
fn read_only_keys_prove_read_access_and_check_only_read_proofs() {
    let (a, b) = ids();
    let root = key(SECRET);
    let ro = root.read_only();
    assert_eq!(
        (root.access(), ro.access()),
        (Access::ReadWrite, Access::ReadOnly)
    );
    // Root verifies a read-only client as read-only; a read-only server grants a root client
    // read-only access (it cannot check the write claim).
    let from_ro = ro.prove(DATA_ALPN, &a, &b);
    assert_eq!(
        root.verify(DATA_ALPN, &a, &b, &from_ro),
        Some(Access::ReadOnly)
    );
    assert_eq!(
        ro.verify(DATA_ALPN, &a, &b, &from_ro),
        Some(Access::ReadOnly)
    );
    let from_root = root.prove(DATA_ALPN, &a, &b);
    assert_eq!(
        ro.verify(DATA_ALPN, &a, &b, &from_root),
        Some(Access::ReadOnly)
    );
    // Another cluster's read-only key proves nothing here.
    let stranger = key(b"another cluster's secret, 32 bytes+").read_only();
    let proof = stranger.prove(DATA_ALPN, &a, &b);
    assert_eq!(root.verify(DATA_ALPN, &a, &b, &proof), None);
}

#[test]
fn read_only_credentials_round_trip_and_never_derive_the_root() {
    let root = key(SECRET);
    let text = root.read_only_credential().expect("derive");
    assert!(text.starts_with(READ_ONLY_PREFIX) && text.len() == READ_ONLY_PREFIX.len() + 64);
    let parsed = ClusterKey::parse(format!("{text}\n").as_bytes()).expect("parse");
    assert_eq!(parsed.access(), Access::ReadOnly);
    let (a, b) = ids();
    assert_eq!(
        root.verify(CTL_ALPN, &a, &b, &parsed.prove(CTL_ALPN, &a, &b)),
        Some(Access::ReadOnly)
    );
    assert_eq!(
        parsed.read_only_credential(),
        Err(AuthError::NeedsSecret {
            what: "deriving a read-only credential"
        })
    );
    assert!(parsed.require_secret("acting as a broker").is_err());
    assert!(root.require_secret("acting as a broker").is_ok());
    assert_eq!(
        ClusterKey::open().read_only_credential(),
        Err(AuthError::OpenCluster)
    );
    // The credential is not the secret's key, nor its gossip topic.
    assert_ne!(parsed.gossip_topic(), root.gossip_topic());
    assert_eq!(
        text,
        format!(
            "{READ_ONLY_PREFIX}{}",
            hex::encode(blake3::derive_key(
                READ_ONLY_CONTEXT,
                &blake3::derive_key(KEY_CONTEXT, SECRET)
            ))
        )
    );
}

#[test]
fn malformed_credentials_are_refused_with_a_reason() {
    let good = key(SECRET).read_only_credential().expect("derive");
    let long = format!("{good}00");
    let cases: [(&[u8], &str); 4] = [
        (b"tbro1-abc", "64 hex digits"),
        (
            &[b't', b'b', b'r', b'o', b'1', b'-', 0xff, 0xfe],
            "not text",
        ),
        (
            b"tbro1-zz00000000000000000000000000000000000000000000000000000000000000",
            "non-hex",
        ),
        (long.as_bytes(), "64 hex digits"),
    ];
    for (input, why) in cases {
        let err = ClusterKey::parse(input).map(|_| ()).expect_err("refused");
        assert!(matches!(err, AuthError::BadCredential { .. }), "{err}");
        assert!(err.to_string().contains(why), "{err}");
        assert!(
            err.to_string().contains("tb secret derive --read-only"),
            "{err}"
        );
    }
}

#[test]
fn open_clusters_agree_with_each_other_only() {
    let (a, b) = ids();
    let open = ClusterKey::open();
    assert!(open.is_open() && !key(SECRET).is_open());
    assert_eq!(open.access(), Access::ReadWrite);
    let proof = open.prove(DATA_ALPN, &a, &b);
    assert_eq!(
        ClusterKey::open().verify(DATA_ALPN, &a, &b, &proof),
        Some(Access::ReadWrite)
    );
    assert_eq!(key(SECRET).verify(DATA_ALPN, &a, &b, &proof), None);
    assert_ne!(open.gossip_topic(), key(SECRET).gossip_topic());
}

#[test]
fn secret_lengths_are_checked() {
    assert_eq!(
        ClusterKey::from_secret(b"").map(|_| ()),
        Err(AuthError::EmptySecret)
    );
    let short = [7u8; MIN_SECRET_LEN - 1];
    assert_eq!(
        ClusterKey::from_secret(&short).map(|_| ()),
        Err(AuthError::SecretTooShort {
            len: MIN_SECRET_LEN - 1
        })
    );
    assert!(ClusterKey::from_secret(&[7; MIN_SECRET_LEN]).is_ok());
    assert!(ClusterKey::from_secret(&[7; MAX_SECRET_LEN]).is_ok());
    let long = vec![7u8; MAX_SECRET_LEN + 1];
    let err = ClusterKey::from_secret(&long)
        .map(|_| ())
        .expect_err("long");
    assert_eq!(
        err,
        AuthError::SecretTooLong {
            len: MAX_SECRET_LEN + 1
        }
    );
    for e in [
        AuthError::EmptySecret,
        AuthError::SecretTooShort { len: 3 },
        AuthError::ExampleSecret,
        err,
    ] {
        let shown = e.to_string();
        assert!(shown.contains("cluster secret"), "{shown}");
        assert!(
            shown.contains("head -c 32 /dev/urandom"),
            "says how: {shown}"
        );
    }
}

#[test]
fn sixteen_byte_secrets_are_refused() {
    // Accepted before the minimum went up to 32.
    assert_eq!(
        ClusterKey::from_secret(b"0123456789abcdef").map(|_| ()),
        Err(AuthError::SecretTooShort { len: 16 })
    );
}

#[test]
fn the_shipped_example_secret_is_refused() {
    for example in EXAMPLE_SECRETS {
        assert!(example.len() >= MIN_SECRET_LEN);
        assert_eq!(
            ClusterKey::parse(example.as_bytes()).map(|_| ()),
            Err(AuthError::ExampleSecret)
        );
        let padded = format!(" {example}\n");
        assert_eq!(
            ClusterKey::from_secret(padded.as_bytes()).map(|_| ()),
            Err(AuthError::ExampleSecret)
        );
    }
}

#[test]
fn authorize_names_the_role_needed() {
    use Access::*;
    assert_eq!(authorize(ReadWrite, ReadOnly, None), Ok(()));
    assert_eq!(authorize(ReadOnly, ReadOnly, None), Ok(()));
    assert_eq!(authorize(ReadWrite, ReadWrite, Some("publishing")), Ok(()));
    let peer = authorize(ReadWrite, ReadOnly, Some("publishing")).expect_err("refused");
    assert_eq!(
        peer.to_string(),
        "publishing needs the cluster secret (read-write); the requesting node has a \
         read-only credential"
    );
    let server = authorize(ReadOnly, ReadWrite, Some("pushing a tensor")).expect_err("refused");
    assert!(
        server
            .to_string()
            .contains("this node has a read-only credential"),
        "{server}"
    );
}

#[test]
fn debug_never_shows_a_key() {
    let k = key(SECRET);
    let ro = k.read_only();
    let shown = format!("{k:?} {ro:?} {:?}", ClusterKey::open());
    assert_eq!(
        shown,
        "ClusterKey(..) ClusterKey(read-only, ..) ClusterKey(open)"
    );
    for bytes in [k.read, k.root.expect("root"), ClusterKey::open().read] {
        assert!(!shown.contains(&hex::encode(&bytes[..4])), "{shown}");
    }
    let proof = k.prove(CTL_ALPN, &NodeId([1; 32]), &NodeId([2; 32]));
    let shown = format!("{:?}", proof.read);
    assert_eq!(
        shown,
        format!("AuthProof({}…)", hex::encode(&proof.read.0[..4]))
    );
}

#[test]
fn topic_and_proofs_use_separate_derivations() {
    let k = key(SECRET);
    let root = k.root.expect("root");
    assert_ne!(k.gossip_topic(), root);
    assert_eq!(root, blake3::derive_key(KEY_CONTEXT, SECRET));
    assert_eq!(k.read, blake3::derive_key(READ_ONLY_CONTEXT, &root));
    assert_eq!(k.gossip_topic(), key(SECRET).gossip_topic());
    assert_ne!(k.gossip_topic(), key(&[7; 32]).gossip_topic());
}

#[test]
fn gossip_macs_bind_the_payload_and_the_secret() {
    let key = key(b"0123456789abcdef0123456789abcdef");
    let other = ClusterKey::from_secret(b"fedcba9876543210fedcba9876543210").expect("secret");
    let mac = key.gossip_mac(b"op");
    assert!(key.verify_gossip_mac(b"op", &mac));
    assert!(!key.verify_gossip_mac(b"oq", &mac));
    assert!(!other.verify_gossip_mac(b"op", &mac));
    assert!(!ClusterKey::open().verify_gossip_mac(b"op", &mac));
    assert!(!key.read_only().verify_gossip_mac(b"op", &mac), "read-only");
}
