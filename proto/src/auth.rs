//! Cluster credentials, what each allows ([`Access`]), and the [`Hello`] exchange that proves
//! them on every connection.
//!
//! Two credentials, one derived from the other:
//! - the **cluster secret** is the root credential. Its key `K = derive_key("tensor-broker
//!   cluster key v1", secret)` allows everything ([`Access::ReadWrite`]): publish, delete,
//!   push, allocate versions, act as a broker (the gossip topic and its MACs derive from `K`).
//! - the **read-only credential** is `R = derive_key("tensor-broker read-only key v1", K)`,
//!   written as [`READ_ONLY_PREFIX`] + 64 hex digits. An operator derives it offline
//!   ([`ClusterKey::read_only_credential`], `tb secret derive --read-only`); it allows get,
//!   list, watch and status ([`Access::ReadOnly`]). Holders of `K` compute `R`; holders of `R`
//!   cannot compute `K`.
//!
//! The first frame of every `tb/data/1` and `tb/ctl/1` connection, on the first bidirectional
//! stream the client opens, is a [`Hello`] carrying an [`AccessProof`]: a proof keyed by `R`,
//! which every member can make and check, and, from a client with the secret, a second one
//! keyed by `K` that claims read-write access. The server [`verify`](ClusterKey::verify)s it,
//! which yields the [`Access`] it grants the client, and answers [`HelloReply::Welcome`] with
//! its own proof the same way (so the client knows what the server may ask of it on the same
//! connection). A server that refuses does not answer: it closes the connection with
//! [`CloseCode::Unauthorized`](crate::CloseCode::Unauthorized) and reads nothing else from it.
//! A server with only `R` cannot check a write claim, so it grants at most read-only access.
//!
//! No nonce or challenge is needed: iroh's TLS 1.3 handshake has already authenticated both
//! node ids and encrypts the stream, so a proof bound to `(alpn, client id, server id)` is only
//! ever sent, and can only ever be presented, by the holder of the client's private key, to
//! the holder of the server's. A recorded proof is useless to anyone else.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// Shortest accepted cluster secret, in bytes.
pub const MIN_SECRET_LEN: usize = 32;
/// Longest accepted cluster secret, in bytes.
pub const MAX_SECRET_LEN: usize = 4096;
/// How a read-only credential's text starts (then 64 hex digits): a secret file whose content
/// starts with it holds a read-only credential, not a cluster secret.
pub const READ_ONLY_PREFIX: &str = "tbro1-";
/// Placeholder secrets that shipped in examples (deploy manifests, docs): refused, since
/// everyone who read the example knows them.
pub const EXAMPLE_SECRETS: &[&str] = &["REPLACE-ME-with-32-random-bytes-in-base64"];
/// How to make a cluster secret, for error messages.
pub const HOW_TO_MAKE_A_SECRET: &str = "make one with `head -c 32 /dev/urandom | base64 > secret \
     && chmod 600 secret` and pass --cluster-secret-file secret";

/// BLAKE3 `derive_key` context that turns a cluster secret into its root key `K`.
const KEY_CONTEXT: &str = "tensor-broker cluster key v1";
/// BLAKE3 `derive_key` context that turns `K` into the read-only key `R`.
const READ_ONLY_CONTEXT: &str = "tensor-broker read-only key v1";
/// The public "secret" of an open cluster: fixed and known to everyone.
const OPEN_SECRET: &[u8] = b"tensor-broker open cluster v1: no secret, anyone can join";
/// BLAKE3 `derive_key` context that turns a cluster key into its gossip topic.
const TOPIC_CONTEXT: &str = "tensor-broker gossip topic v1";
/// Domain separation for the bytes a read proof (keyed by `R`) hashes.
const READ_PROOF_DOMAIN: &[u8] = b"tensor-broker hello read proof v2";
/// Domain separation for the bytes a write proof (keyed by `K`) hashes.
const WRITE_PROOF_DOMAIN: &[u8] = b"tensor-broker hello write proof v2";
/// Context of the key that authenticates gossip messages.
const GOSSIP_MAC_CONTEXT: &str = "tensor-broker gossip mac v1";

/// Why a cluster secret or credential was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The secret is empty.
    #[error("the cluster secret is empty: {HOW_TO_MAKE_A_SECRET}")]
    EmptySecret,
    /// The secret is shorter than [`MIN_SECRET_LEN`].
    #[error(
        "the cluster secret is {len} bytes, under the minimum of {MIN_SECRET_LEN}: \
         {HOW_TO_MAKE_A_SECRET}"
    )]
    SecretTooShort {
        /// Its length in bytes.
        len: usize,
    },
    /// The secret is longer than [`MAX_SECRET_LEN`].
    #[error(
        "the cluster secret is {len} bytes, over the maximum of {MAX_SECRET_LEN}: \
         {HOW_TO_MAKE_A_SECRET}"
    )]
    SecretTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The secret is one of the [`EXAMPLE_SECRETS`].
    #[error(
        "the cluster secret is the example placeholder, which everyone knows: {HOW_TO_MAKE_A_SECRET}"
    )]
    ExampleSecret,
    /// Text that starts like a read-only credential but is not one.
    #[error(
        "not a read-only credential ({reason}): it is {READ_ONLY_PREFIX} and 64 hex digits, as \
         `tb secret derive --read-only` prints it"
    )]
    BadCredential {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Something only the cluster secret allows was asked of a read-only credential.
    #[error("{what} needs the cluster secret (read-write); this is a read-only credential")]
    NeedsSecret {
        /// What was asked.
        what: &'static str,
    },
    /// A read-only credential was asked of the open cluster's key.
    #[error("an open cluster has no secret to derive a read-only credential from")]
    OpenCluster,
}

/// What a credential allows. Ordered: `ReadOnly < ReadWrite`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Access {
    /// Get, list, watch, status; serve held copies and say what it holds. The read-only
    /// credential.
    ReadOnly,
    /// Everything, including publish, delete, push and acting as a broker. The cluster secret.
    ReadWrite,
}

impl Access {
    /// `"read-only"` or `"read-write"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Access::ReadOnly => "read-only",
            Access::ReadWrite => "read-write",
        }
    }
}

/// A request refused because it needs read-write access. The message names the role needed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// The requesting peer proved only the read-only credential.
    #[error(
        "{action} needs the cluster secret (read-write); the requesting node has a read-only \
         credential"
    )]
    PeerReadOnly {
        /// What was asked, e.g. `publishing`.
        action: &'static str,
    },
    /// This node holds only the read-only credential, so it takes no request that needs more.
    #[error(
        "{action} needs a node with the cluster secret (read-write); this node has a read-only \
         credential"
    )]
    ServerReadOnly {
        /// What was asked.
        action: &'static str,
    },
}

/// Whether a node with access `mine` serves `action` (which needs read-write access when
/// `action` is `Some`) to a peer granted `peer` at its hello.
pub fn authorize(
    mine: Access,
    peer: Access,
    action: Option<&'static str>,
) -> Result<(), AccessError> {
    match (action, mine, peer) {
        (None, _, _) | (Some(_), Access::ReadWrite, Access::ReadWrite) => Ok(()),
        (Some(action), Access::ReadOnly, _) => Err(AccessError::ServerReadOnly { action }),
        (Some(action), Access::ReadWrite, Access::ReadOnly) => {
            Err(AccessError::PeerReadOnly { action })
        }
    }
}

/// The keys a node derives from its credential: the read key every member has, and the root
/// key when it holds the cluster secret. They sign [`Hello`] proofs and name the gossip topic.
/// Its `Debug` never shows a key.
#[derive(Clone)]
pub struct ClusterKey {
    /// `K`: `None` for a read-only credential.
    root: Option<[u8; 32]>,
    /// `R`, derived from `K`.
    read: [u8; 32],
    open: bool,
}

impl ClusterKey {
    /// Derives the keys of the cluster whose secret is `secret` (between [`MIN_SECRET_LEN`] and
    /// [`MAX_SECRET_LEN`] bytes, not an [`EXAMPLE_SECRETS`] placeholder).
    pub fn from_secret(secret: &[u8]) -> Result<ClusterKey, AuthError> {
        match secret.len() {
            0 => return Err(AuthError::EmptySecret),
            len if len < MIN_SECRET_LEN => return Err(AuthError::SecretTooShort { len }),
            len if len > MAX_SECRET_LEN => return Err(AuthError::SecretTooLong { len }),
            _ => {}
        }
        if EXAMPLE_SECRETS
            .iter()
            .any(|e| e.as_bytes() == secret.trim_ascii())
        {
            return Err(AuthError::ExampleSecret);
        }
        Ok(ClusterKey::root(
            blake3::derive_key(KEY_CONTEXT, secret),
            false,
        ))
    }

    /// The key of a read-only credential's text ([`READ_ONLY_PREFIX`] and 64 hex digits,
    /// surrounding whitespace ignored).
    pub fn from_read_only_credential(text: &str) -> Result<ClusterKey, AuthError> {
        let bad = |reason| AuthError::BadCredential { reason };
        let digits = text
            .trim()
            .strip_prefix(READ_ONLY_PREFIX)
            .ok_or(bad("it lacks the prefix"))?;
        if digits.len() != 64 {
            return Err(bad("it does not have 64 hex digits"));
        }
        let mut read = [0u8; 32];
        hex::decode_to_slice(digits, &mut read).map_err(|_| bad("it has a non-hex digit"))?;
        Ok(ClusterKey {
            root: None,
            read,
            open: false,
        })
    }

    /// The key a secret file's content gives: a read-only credential if it starts with
    /// [`READ_ONLY_PREFIX`], else a cluster secret.
    pub fn parse(content: &[u8]) -> Result<ClusterKey, AuthError> {
        match content.starts_with(READ_ONLY_PREFIX.as_bytes()) {
            true => match std::str::from_utf8(content) {
                Ok(text) => ClusterKey::from_read_only_credential(text),
                Err(_) => Err(AuthError::BadCredential {
                    reason: "it is not text",
                }),
            },
            false => ClusterKey::from_secret(content),
        }
    }

    /// The key of an open cluster (no secret configured), derived from a fixed public string.
    ///
    /// Anyone can compute it, so anyone who can reach an open cluster's nodes can join it,
    /// read, publish and delete tensors; use it only on a trusted network or one machine.
    pub fn open() -> ClusterKey {
        ClusterKey::root(blake3::derive_key(KEY_CONTEXT, OPEN_SECRET), true)
    }

    fn root(root: [u8; 32], open: bool) -> ClusterKey {
        ClusterKey {
            read: blake3::derive_key(READ_ONLY_CONTEXT, &root),
            root: Some(root),
            open,
        }
    }

    /// Whether this is the [`open`](Self::open) cluster's key.
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// What this key allows: read-write with the cluster secret (or open), else read-only.
    pub fn access(&self) -> Access {
        match self.root {
            Some(_) => Access::ReadWrite,
            None => Access::ReadOnly,
        }
    }

    /// The read-only key of the same cluster (itself, for a read-only key).
    pub fn read_only(&self) -> ClusterKey {
        ClusterKey {
            root: None,
            read: self.read,
            open: self.open,
        }
    }

    /// The read-only credential's text: [`READ_ONLY_PREFIX`] and the read key in hex. Only the
    /// cluster secret derives it.
    pub fn read_only_credential(&self) -> Result<String, AuthError> {
        match (self.open, self.root) {
            (true, _) => Err(AuthError::OpenCluster),
            (false, None) => Err(AuthError::NeedsSecret {
                what: "deriving a read-only credential",
            }),
            (false, Some(_)) => Ok(format!("{READ_ONLY_PREFIX}{}", hex::encode(self.read))),
        }
    }

    /// Refuses a read-only key for `what` (acting as a broker, say).
    pub fn require_secret(&self, what: &'static str) -> Result<(), AuthError> {
        match self.root {
            Some(_) => Ok(()),
            None => Err(AuthError::NeedsSecret { what }),
        }
    }

    /// The proof of this key for a connection from `from` to `to` on `alpn`: the read proof,
    /// and the write proof when this key has the secret. Keyed BLAKE3 over the three,
    /// domain-separated and length-prefixed.
    ///
    /// Binding the proof to both node ids and the ALPN is what makes a nonce unnecessary: iroh's
    /// TLS has authenticated both ids and encrypts the stream, so only the holder of `from`'s
    /// private key can present this proof, only to `to`, and only on `alpn`.
    pub fn prove(&self, alpn: &[u8], from: &NodeId, to: &NodeId) -> AccessProof {
        AccessProof {
            read: proof(&self.read, READ_PROOF_DOMAIN, alpn, from, to),
            write: self
                .root
                .map(|root| proof(&root, WRITE_PROOF_DOMAIN, alpn, from, to)),
        }
    }

    /// The access `proof` (from `from`, to `to`, on `alpn`) earns, or `None` when it fails:
    /// a wrong read proof, or a write claim this key can check and finds wrong. A write claim
    /// that a read-only key cannot check earns read-only access. Compared in constant time.
    pub fn verify(
        &self,
        alpn: &[u8],
        from: &NodeId,
        to: &NodeId,
        proof: &AccessProof,
    ) -> Option<Access> {
        if proof.read != self::proof(&self.read, READ_PROOF_DOMAIN, alpn, from, to) {
            return None;
        }
        match (&self.root, &proof.write) {
            (_, None) | (None, Some(_)) => Some(Access::ReadOnly),
            (Some(root), Some(write)) => (*write
                == self::proof(root, WRITE_PROOF_DOMAIN, alpn, from, to))
            .then_some(Access::ReadWrite),
        }
    }

    /// The key gossip is derived from: the root key (a read-only key's gossip matches no
    /// root member's, and brokers refuse read-only keys).
    fn gossip_base(&self) -> &[u8; 32] {
        self.root.as_ref().unwrap_or(&self.read)
    }

    /// The iroh-gossip topic id the cluster's brokers replicate the registry on.
    pub fn gossip_topic(&self) -> [u8; 32] {
        blake3::derive_key(TOPIC_CONTEXT, self.gossip_base())
    }

    /// A MAC over one gossip message. Gossip connections are iroh-gossip's own protocol (no
    /// hello), so every message carries this and receivers drop those without a valid one.
    pub fn gossip_mac(&self, payload: &[u8]) -> [u8; 32] {
        let key = blake3::derive_key(GOSSIP_MAC_CONTEXT, self.gossip_base());
        *blake3::keyed_hash(&key, payload).as_bytes()
    }

    /// Whether `mac` is [`gossip_mac`](Self::gossip_mac)`(payload)`, in constant time.
    pub fn verify_gossip_mac(&self, payload: &[u8], mac: &[u8; 32]) -> bool {
        blake3::Hash::from(self.gossip_mac(payload)) == blake3::Hash::from(*mac)
    }
}

/// Keyed BLAKE3 of `domain`, `alpn` and both ids, each length-prefixed so no two inputs share
/// an encoding.
fn proof(key: &[u8; 32], domain: &[u8], alpn: &[u8], from: &NodeId, to: &NodeId) -> AuthProof {
    let mut h = blake3::Hasher::new_keyed(key);
    for field in [domain, alpn, &from.0, &to.0] {
        h.update(&(field.len() as u64).to_le_bytes());
        h.update(field);
    }
    AuthProof(*h.finalize().as_bytes())
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.open, self.root) {
            (true, _) => f.write_str("ClusterKey(open)"),
            (false, Some(_)) => f.write_str("ClusterKey(..)"),
            (false, None) => f.write_str("ClusterKey(read-only, ..)"),
        }
    }
}

/// One keyed proof (see [`ClusterKey::prove`]). Equality is constant-time.
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

/// What one side of a connection presents: the read proof every member can make, and the
/// write proof that claims read-write access (only from a holder of the cluster secret).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessProof {
    /// Keyed by the read-only key `R`.
    pub read: AuthProof,
    /// Keyed by the root key `K`; `None` from a read-only node.
    pub write: Option<AuthProof>,
}

/// The first frame of every `tb/data/1` and `tb/ctl/1` connection, from the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`ClusterKey::prove`]`(alpn, client, server)`: the client's access claim and its proof.
    pub proof: AccessProof,
}

/// The server's answer to a [`Hello`] it accepted (one it refuses gets no answer: the
/// connection is closed with [`CloseCode::Unauthorized`](crate::CloseCode::Unauthorized)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HelloReply {
    /// The client is in; requests may follow on new streams.
    Welcome {
        /// Largest tensor the server accepts or serves, in bytes.
        max_tensor_bytes: u64,
        /// The server's own proof, [`ClusterKey::prove`]`(alpn, server, client)` (the ids in
        /// the reverse order), so the client knows the server is of the cluster, and what it
        /// may ask, before it serves the server's requests on this connection.
        proof: AccessProof,
    },
}

#[cfg(test)]
mod tests;
