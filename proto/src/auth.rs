//! Cluster-secret authentication: the [`ClusterKey`] every member derives from the cluster
//! secret, the [`AuthProof`] a client presents in its [`Hello`], and the server's
//! [`HelloReply`].
//!
//! The first frame of every `tb/data/1` and `tb/ctl/1` connection, on the first bidirectional
//! stream the client opens, is a [`Hello`]. The server [`verify`](ClusterKey::verify)s its
//! proof and answers [`HelloReply::Welcome`]; a server that refuses does not answer, it closes
//! the connection with [`CloseCode::Unauthorized`](crate::CloseCode::Unauthorized) and reads
//! nothing else from it.
//!
//! No nonce or challenge is needed: iroh's TLS 1.3 handshake has already authenticated both
//! node ids and encrypts the stream, so a proof bound to `(alpn, client id, server id)` is only
//! ever sent, and can only ever be presented, by the holder of the client's private key, to
//! the holder of the server's. A recorded proof is useless to anyone else.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// Shortest accepted cluster secret, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest accepted cluster secret, in bytes.
pub const MAX_SECRET_LEN: usize = 4096;

/// BLAKE3 `derive_key` context that turns a cluster secret into a [`ClusterKey`].
const KEY_CONTEXT: &str = "tensor-broker cluster key v1";
/// The public "secret" of an open cluster: fixed and known to everyone.
const OPEN_SECRET: &[u8] = b"tensor-broker open cluster v1: no secret, anyone can join";
/// BLAKE3 `derive_key` context that turns a cluster key into its gossip topic.
const TOPIC_CONTEXT: &str = "tensor-broker gossip topic v1";
/// Domain separation for the bytes a [`ClusterKey::proof`] hashes.
const PROOF_DOMAIN: &[u8] = b"tensor-broker hello proof v1";

/// Context of the key that authenticates gossip messages.
const GOSSIP_MAC_CONTEXT: &str = "tensor-broker gossip mac v1";

/// Why a cluster secret was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The secret is empty.
    #[error(
        "the cluster secret is empty: set one of at least {MIN_SECRET_LEN} bytes (32 random \
         bytes, hex-encoded, are a good choice), or configure none to run an open cluster"
    )]
    EmptySecret,
    /// The secret is shorter than [`MIN_SECRET_LEN`].
    #[error(
        "the cluster secret is {len} bytes, under the minimum of {MIN_SECRET_LEN}: use a longer \
         one (32 random bytes, hex-encoded, are a good choice)"
    )]
    SecretTooShort {
        /// Its length in bytes.
        len: usize,
    },
    /// The secret is longer than [`MAX_SECRET_LEN`].
    #[error(
        "the cluster secret is {len} bytes, over the maximum of {MAX_SECRET_LEN}: use a shorter \
         one (32 random bytes, hex-encoded, are plenty)"
    )]
    SecretTooLong {
        /// Its length in bytes.
        len: usize,
    },
}

/// The 32-byte key every member of a cluster derives from the cluster secret; it signs
/// [`Hello`] proofs and names the gossip topic. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct ClusterKey {
    key: [u8; 32],
    open: bool,
}

impl ClusterKey {
    /// Derives the key of the cluster whose secret is `secret` (between [`MIN_SECRET_LEN`] and
    /// [`MAX_SECRET_LEN`] bytes).
    pub fn from_secret(secret: &[u8]) -> Result<ClusterKey, AuthError> {
        match secret.len() {
            0 => Err(AuthError::EmptySecret),
            len if len < MIN_SECRET_LEN => Err(AuthError::SecretTooShort { len }),
            len if len > MAX_SECRET_LEN => Err(AuthError::SecretTooLong { len }),
            _ => Ok(ClusterKey {
                key: blake3::derive_key(KEY_CONTEXT, secret),
                open: false,
            }),
        }
    }

    /// The key of an open cluster (no secret configured), derived from a fixed public string.
    ///
    /// Anyone can compute it, so anyone who can reach an open cluster's nodes can join it,
    /// read and publish tensors; use it only on a trusted network or one machine.
    pub fn open() -> ClusterKey {
        ClusterKey {
            key: blake3::derive_key(KEY_CONTEXT, OPEN_SECRET),
            open: true,
        }
    }

    /// Whether this is the [`open`](Self::open) cluster's key.
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// The proof that `client` knows this key, for a connection from `client` to `server` on
    /// `alpn`: a keyed BLAKE3 of the three, domain-separated and length-prefixed.
    ///
    /// Binding the proof to both node ids and the ALPN is what makes a nonce unnecessary: iroh's
    /// TLS has authenticated both ids and encrypts the stream, so only the holder of `client`'s
    /// private key can present this proof, only to `server`, and only on `alpn`.
    pub fn proof(&self, alpn: &[u8], client: &NodeId, server: &NodeId) -> AuthProof {
        AuthProof(*self.proof_hash(alpn, client, server).as_bytes())
    }

    /// Whether `proof` is [`proof`](Self::proof)`(alpn, client, server)`, compared in constant
    /// time.
    pub fn verify(&self, alpn: &[u8], client: &NodeId, server: &NodeId, proof: &AuthProof) -> bool {
        // `blake3::Hash`'s equality is constant-time.
        self.proof_hash(alpn, client, server) == blake3::Hash::from(proof.0)
    }

    /// The iroh-gossip topic id the cluster's brokers replicate the registry on.
    pub fn gossip_topic(&self) -> [u8; 32] {
        blake3::derive_key(TOPIC_CONTEXT, &self.key)
    }

    /// A MAC over one gossip message. Gossip connections are iroh-gossip's own protocol (no
    /// hello), so every message carries this and receivers drop those without a valid one.
    pub fn gossip_mac(&self, payload: &[u8]) -> [u8; 32] {
        let key = blake3::derive_key(GOSSIP_MAC_CONTEXT, &self.key);
        *blake3::keyed_hash(&key, payload).as_bytes()
    }

    /// Whether `mac` is [`gossip_mac`](Self::gossip_mac)`(payload)`, in constant time.
    pub fn verify_gossip_mac(&self, payload: &[u8], mac: &[u8; 32]) -> bool {
        blake3::Hash::from(self.gossip_mac(payload)) == blake3::Hash::from(*mac)
    }

    fn proof_hash(&self, alpn: &[u8], client: &NodeId, server: &NodeId) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        // Every variable-length field is length-prefixed, so no two inputs share an encoding.
        for field in [PROOF_DOMAIN, alpn, &client.0, &server.0] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field);
        }
        h.finalize()
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.open {
            true => f.write_str("ClusterKey(open)"),
            false => f.write_str("ClusterKey(..)"),
        }
    }
}

/// A client's proof of knowing the cluster key (see [`ClusterKey::proof`]). Equality is
/// constant-time.
#[derive(Clone, Copy, Eq, Serialize, Deserialize)]
pub struct AuthProof(pub [u8; 32]);

impl PartialEq for AuthProof {
    fn eq(&self, other: &Self) -> bool {
        blake3::Hash::from(self.0) == blake3::Hash::from(other.0)
    }
}

impl fmt::Debug for AuthProof {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AuthProof({}…)", hex::encode(&self.0[..4]))
    }
}

/// Largest [`Hello`] frame body a server reads, in bytes: checked on the length prefix before
/// anything is allocated, so a peer that has not authenticated yet makes the server hold at
/// most this much for its hello. Today's hello is 32 bytes; the rest is headroom for fields
/// later versions add (a role, a node's info).
pub const MAX_HELLO_FRAME: u32 = 512;

/// The first frame of every `tb/data/1` and `tb/ctl/1` connection, from the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`ClusterKey::proof`]`(alpn, client, server)`.
    pub proof: AuthProof,
}

/// The server's answer to a [`Hello`] it accepted (one it refuses gets no answer: the
/// connection is closed with [`CloseCode::Unauthorized`](crate::CloseCode::Unauthorized)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HelloReply {
    /// The client is in; requests may follow on new streams.
    Welcome {
        /// Largest tensor the server accepts or serves, in bytes.
        max_tensor_bytes: u64,
        /// The server's own proof, [`ClusterKey::proof`]`(alpn, server, client)` (the ids in
        /// the reverse order), so the client knows the server is of the cluster too before it
        /// serves the server's requests on this connection.
        proof: AuthProof,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CTL_ALPN, DATA_ALPN};

    const SECRET: &[u8] = b"correct horse battery staple";

    fn key(secret: &[u8]) -> ClusterKey {
        ClusterKey::from_secret(secret).expect("valid secret")
    }

    fn hex(bytes: &[u8]) -> String {
        hex::encode(bytes)
    }

    #[test]
    fn proof_verifies_for_the_same_connection_only() {
        let (a, b) = (NodeId([1; 32]), NodeId([2; 32]));
        let k = key(SECRET);
        let proof = k.proof(CTL_ALPN, &a, &b);
        assert!(k.verify(CTL_ALPN, &a, &b, &proof));
        assert!(
            key(SECRET).verify(CTL_ALPN, &a, &b, &proof),
            "deterministic"
        );
        assert!(!k.verify(CTL_ALPN, &b, &a, &proof), "swapped ids");
        assert!(!k.verify(CTL_ALPN, &a, &a, &proof), "other server");
        assert!(!k.verify(DATA_ALPN, &a, &b, &proof), "other alpn");
        assert!(!k.verify(b"", &a, &b, &proof), "empty alpn");
        let other = key(b"correct horse battery staplf");
        assert!(!other.verify(CTL_ALPN, &a, &b, &proof), "other secret");
        assert!(!ClusterKey::open().verify(CTL_ALPN, &a, &b, &proof), "open");
        let mut flipped = proof;
        flipped.0[31] ^= 1;
        assert!(!k.verify(CTL_ALPN, &a, &b, &flipped));
    }

    #[test]
    fn open_clusters_agree_with_each_other_only() {
        let (a, b) = (NodeId([1; 32]), NodeId([2; 32]));
        let open = ClusterKey::open();
        assert!(open.is_open() && !key(SECRET).is_open());
        let proof = open.proof(DATA_ALPN, &a, &b);
        assert!(ClusterKey::open().verify(DATA_ALPN, &a, &b, &proof));
        assert!(!key(SECRET).verify(DATA_ALPN, &a, &b, &proof));
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
            err,
        ] {
            assert!(e.to_string().contains("cluster secret"), "{e}");
        }
    }

    #[test]
    fn debug_never_shows_the_key() {
        let k = key(SECRET);
        let shown = format!("{k:?} {:?}", ClusterKey::open());
        assert_eq!(shown, "ClusterKey(..) ClusterKey(open)");
        for key in [&k.key, &ClusterKey::open().key] {
            assert!(!shown.contains(&hex(&key[..4])), "{shown}");
        }
        let proof = k.proof(CTL_ALPN, &NodeId([1; 32]), &NodeId([2; 32]));
        let shown = format!("{proof:?}");
        assert_eq!(shown, format!("AuthProof({}…)", hex(&proof.0[..4])));
    }

    #[test]
    fn topic_and_proofs_use_separate_derivations() {
        let k = key(SECRET);
        assert_ne!(k.gossip_topic(), k.key);
        assert_eq!(k.key, blake3::derive_key(KEY_CONTEXT, SECRET));
        assert_eq!(k.gossip_topic(), key(SECRET).gossip_topic());
        assert_ne!(k.gossip_topic(), key(&[7; 16]).gossip_topic());
    }

    #[test]
    fn a_hello_fits_its_frame_cap() {
        let hello = Hello {
            proof: key(SECRET).proof(DATA_ALPN, &NodeId([1; 32]), &NodeId([2; 32])),
        };
        let frame = crate::frame::encode(&hello).expect("encode");
        let body = frame.len() - crate::LEN_PREFIX;
        assert!(
            body <= MAX_HELLO_FRAME as usize / 4,
            "{body} bytes: keep headroom"
        );
    }

    #[test]
    fn gossip_macs_bind_the_payload_and_the_secret() {
        let key = ClusterKey::from_secret(b"0123456789abcdef").expect("secret");
        let other = ClusterKey::from_secret(b"fedcba9876543210").expect("secret");
        let mac = key.gossip_mac(b"op");
        assert!(key.verify_gossip_mac(b"op", &mac));
        assert!(!key.verify_gossip_mac(b"oq", &mac));
        assert!(!other.verify_gossip_mac(b"op", &mac));
        assert!(!ClusterKey::open().verify_gossip_mac(b"op", &mac));
    }
}
