//! Version sets: many named tensors published as one version of one name.
//!
//! A set `P` is stored, announced, fetched and retained as one tensor of dtype
//! [`DType::Set`]: the registry has one entry for it, its version is the set's version, and
//! its content hash covers every member. So a reader gets all members of one version or none
//! (never layer 3 of step 100 beside layer 4 of step 99), retention keeps or evicts whole sets,
//! and a subscriber sees one event per set version, with no extra machinery.
//!
//! The bytes of a set:
//!
//! ```text
//! "TBSET\0\0\x01"  u32 LE manifest length  manifest (postcard)  zero pad to 64
//! member 0  zero pad to 64  member 1  ...  member n-1            (no trailing bytes)
//! ```
//!
//! The manifest lists the members in order (key, dtype, shape, hash) and the set's metadata
//! (string pairs, like safetensors' `__metadata__`). Each member starts at the next multiple
//! of 64 bytes after the one before, counted from the start of the set, so its offset follows
//! from the manifest and is never trusted from the wire, and every member is aligned for any
//! dtype (numpy, torch and SIMD views need no copy). A member `key` is addressable as the
//! name `P/key`, so `P/key` must be a valid [`TensorName`].
//!
//! A member's hash is its publisher's claim, covered by the set's hash: a reader that
//! verified the set has the manifest its publisher wrote.

use std::{collections::BTreeMap, ops::Range};

use serde::{Deserialize, Serialize};

use crate::{ContentHash, DType, MetaError, NameError, TensorMeta, TensorName, byte_len_for};

/// The first bytes of every set.
pub const SET_MAGIC: [u8; 8] = *b"TBSET\0\0\x01";
/// Alignment of the data section and of every member, in bytes.
pub const SET_ALIGN: u64 = 64;
/// Most members one set may have.
pub const MAX_SET_MEMBERS: usize = 65_536;
/// Most bytes the manifest may take.
pub const MAX_SET_MANIFEST_BYTES: usize = 16 << 20;
/// Most metadata pairs one set may carry.
pub const MAX_SET_METADATA: usize = 4_096;
/// Most bytes of one metadata key or value.
pub const MAX_SET_METADATA_LEN: usize = 64 << 10;

/// Bytes before the manifest: the magic and the manifest's length.
const PREAMBLE: usize = SET_MAGIC.len() + 4;

/// Why bytes are not a valid set, or members cannot make one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetError {
    /// Shorter than its preamble or than its manifest and members say.
    #[error("set is truncated: {len} bytes, needs {needed}")]
    Truncated {
        /// Bytes there are.
        len: u64,
        /// Bytes the layout needs.
        needed: u64,
    },
    /// Bytes after the last member.
    #[error("set has {extra} bytes after its last member")]
    Trailing {
        /// How many.
        extra: u64,
    },
    /// Does not start with [`SET_MAGIC`].
    #[error("not a tensor-broker set (bad magic)")]
    Magic,
    /// The manifest is over [`MAX_SET_MANIFEST_BYTES`].
    #[error("set manifest is {len} bytes, over the limit of {MAX_SET_MANIFEST_BYTES}")]
    ManifestTooLarge {
        /// Its length.
        len: u64,
    },
    /// The manifest does not decode.
    #[error("set manifest is malformed: {0}")]
    Manifest(String),
    /// No members.
    #[error("a set needs at least one member")]
    Empty,
    /// Over [`MAX_SET_MEMBERS`] members.
    #[error("set has {count} members, over the limit of {MAX_SET_MEMBERS}")]
    TooManyMembers {
        /// How many.
        count: usize,
    },
    /// Two members share a key.
    #[error("set has two members named {key:?}")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// `prefix/key` is not a valid name.
    #[error("member {key:?}: {source}")]
    Key {
        /// The key (at most 300 bytes of it).
        key: String,
        /// Why `prefix/key` is not a name.
        source: NameError,
    },
    /// A member's dtype and shape do not describe a tensor (or it is itself a set).
    #[error("member {key:?}: {reason}")]
    Member {
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// Over [`MAX_SET_METADATA`] pairs or a key or value over [`MAX_SET_METADATA_LEN`].
    #[error("set metadata: {0}")]
    Metadata(String),
    /// The whole set is over the size limit.
    #[error("set is {len} bytes, over the limit of {max}")]
    TooLarge {
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// One member as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetMember {
    /// Its key: the member is `prefix/key`.
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// BLAKE3 hash of its bytes.
    pub hash: ContentHash,
}

impl SetMember {
    /// The member's metadata (byte length from dtype and shape).
    pub fn meta(&self) -> Result<TensorMeta, MetaError> {
        TensorMeta::new(self.dtype, self.shape.clone(), self.hash)
    }
}

/// What a set's manifest says: its members in order and its metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetManifest {
    /// The members, in the order their bytes follow.
    pub members: Vec<SetMember>,
    /// Free-form string pairs (a safetensors file's `__metadata__`), in key order.
    pub metadata: BTreeMap<String, String>,
}

/// Where everything of a set lies: the manifest, then each member's byte range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetLayout {
    /// The manifest.
    pub manifest: SetManifest,
    /// The bytes that precede the first member (preamble, manifest, padding).
    pub header: Vec<u8>,
    /// Each member's byte range in the set, in manifest order.
    pub ranges: Vec<Range<u64>>,
    /// The set's total length.
    pub len: u64,
}

const fn align_up(n: u64) -> u64 {
    n.div_ceil(SET_ALIGN) * SET_ALIGN
}

fn short(key: &str) -> String {
    key.chars().take(300).collect()
}

impl SetLayout {
    /// Lays out the set `prefix` with `manifest`: checks every limit and rule a reader checks,
    /// and computes the header bytes and member ranges. `max_bytes` bounds the whole set.
    pub fn new(
        prefix: &TensorName,
        manifest: SetManifest,
        max_bytes: u64,
    ) -> Result<SetLayout, SetError> {
        check_manifest(prefix, &manifest)?;
        let body = postcard::to_stdvec(&manifest).map_err(|e| SetError::Manifest(e.to_string()))?;
        if body.len() > MAX_SET_MANIFEST_BYTES {
            return Err(SetError::ManifestTooLarge {
                len: body.len() as u64,
            });
        }
        let mut header = Vec::with_capacity(align_up((PREAMBLE + body.len()) as u64) as usize);
        header.extend_from_slice(&SET_MAGIC);
        // Fits: at most MAX_SET_MANIFEST_BYTES.
        header.extend_from_slice(&(body.len() as u32).to_le_bytes());
        header.extend_from_slice(&body);
        header.resize(align_up(header.len() as u64) as usize, 0);
        let (ranges, len) = member_ranges(&manifest, header.len() as u64, max_bytes)?;
        Ok(SetLayout {
            manifest,
            header,
            ranges,
            len,
        })
    }

    /// Reads the layout of the set `prefix` from its bytes, checking everything: the magic,
    /// the manifest and its limits, each member's key, dtype and shape, and that the members
    /// end exactly where the bytes do. Padding is not checked (it carries nothing). The
    /// member bytes themselves are not hashed here: the set's own hash covers them.
    pub fn decode(prefix: &TensorName, bytes: &[u8]) -> Result<SetLayout, SetError> {
        let len = bytes.len() as u64;
        if bytes.len() < PREAMBLE {
            return Err(SetError::Truncated {
                len,
                needed: PREAMBLE as u64,
            });
        }
        if bytes[..SET_MAGIC.len()] != SET_MAGIC {
            return Err(SetError::Magic);
        }
        let mut n = [0; 4];
        n.copy_from_slice(&bytes[SET_MAGIC.len()..PREAMBLE]);
        let body_len = u32::from_le_bytes(n) as usize;
        if body_len > MAX_SET_MANIFEST_BYTES {
            return Err(SetError::ManifestTooLarge {
                len: body_len as u64,
            });
        }
        let header_len = align_up((PREAMBLE + body_len) as u64);
        if len < header_len {
            return Err(SetError::Truncated {
                len,
                needed: header_len,
            });
        }
        let body = &bytes[PREAMBLE..PREAMBLE + body_len];
        let manifest: SetManifest = match postcard::take_from_bytes(body) {
            Ok((manifest, [])) => manifest,
            Ok((_, rest)) => {
                return Err(SetError::Manifest(format!(
                    "{} bytes after the manifest",
                    rest.len()
                )));
            }
            Err(e) => return Err(SetError::Manifest(e.to_string())),
        };
        check_manifest(prefix, &manifest)?;
        let (ranges, needed) = member_ranges(&manifest, header_len, u64::MAX)?;
        match len.cmp(&needed) {
            std::cmp::Ordering::Less => Err(SetError::Truncated { len, needed }),
            std::cmp::Ordering::Greater => Err(SetError::Trailing {
                extra: len - needed,
            }),
            std::cmp::Ordering::Equal => Ok(SetLayout {
                manifest,
                header: bytes[..header_len as usize].to_vec(),
                ranges,
                len,
            }),
        }
    }

    /// Each member with its byte range, in order.
    pub fn members(&self) -> impl Iterator<Item = (&SetMember, Range<u64>)> {
        self.manifest
            .members
            .iter()
            .zip(self.ranges.iter().cloned())
    }
}

/// Checks the member count, keys and metadata limits of `manifest` for the set `prefix`.
fn check_manifest(prefix: &TensorName, manifest: &SetManifest) -> Result<(), SetError> {
    let count = manifest.members.len();
    if count == 0 {
        return Err(SetError::Empty);
    }
    if count > MAX_SET_MEMBERS {
        return Err(SetError::TooManyMembers { count });
    }
    if manifest.metadata.len() > MAX_SET_METADATA {
        return Err(SetError::Metadata(format!(
            "{} pairs, over the limit of {MAX_SET_METADATA}",
            manifest.metadata.len()
        )));
    }
    if let Some((k, v)) = manifest
        .metadata
        .iter()
        .find(|(k, v)| k.len() > MAX_SET_METADATA_LEN || v.len() > MAX_SET_METADATA_LEN)
    {
        return Err(SetError::Metadata(format!(
            "key {:?} or its value is over {MAX_SET_METADATA_LEN} bytes ({} and {})",
            short(k),
            k.len(),
            v.len()
        )));
    }
    let mut keys = std::collections::HashSet::with_capacity(count);
    for member in &manifest.members {
        let key = &member.key;
        // `prefix/key` is a name: this also bounds the key's length and characters.
        if let Err(source) = TensorName::new(format!("{prefix}/{key}")) {
            return Err(SetError::Key {
                key: short(key),
                source,
            });
        }
        if !keys.insert(key.as_str()) {
            return Err(SetError::DuplicateKey { key: key.clone() });
        }
        if member.dtype == DType::Set {
            return Err(SetError::Member {
                key: key.clone(),
                reason: "a member cannot itself be a set".into(),
            });
        }
    }
    Ok(())
}

/// The members' byte ranges when the first may start at `start`, and the set's total length;
/// fails when a member's shape is invalid or the total passes `max_bytes`.
fn member_ranges(
    manifest: &SetManifest,
    start: u64,
    max_bytes: u64,
) -> Result<(Vec<Range<u64>>, u64), SetError> {
    let mut ranges = Vec::with_capacity(manifest.members.len());
    let mut end = start;
    for member in &manifest.members {
        let len = byte_len_for(member.dtype, &member.shape).map_err(|e| SetError::Member {
            key: member.key.clone(),
            reason: e.to_string(),
        })?;
        let at = align_up(end);
        end = at
            .checked_add(len)
            .filter(|end| *end <= max_bytes)
            .ok_or(SetError::TooLarge {
                len: at.saturating_add(len),
                max: max_bytes,
            })?;
        ranges.push(at..end);
    }
    Ok((ranges, end))
}

#[cfg(test)]
mod tests;
