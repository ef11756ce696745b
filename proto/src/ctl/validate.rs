//! [`CtlRequest::validate`] and [`CtlResponse::validate`]: every limit a decoded control
//! message must respect before anyone acts on it.

use super::{
    CtlRequest, CtlResponse, Event, HolderAddr, ListedEntry, MAX_ANNOUNCE_OPS, MAX_HOLDERS_REPLY,
    MAX_INLINE_BYTES, MAX_LIST_LIMIT, MAX_LOOKUP_EXCLUDE, MAX_SYNC_MEMBERS, MemberStatus,
};
use crate::{
    ContentHash, MAX_ADDR_LEN, MAX_MEMBER_ADDRS, Member, NameError, RegistryError, RegistryOp,
    SYNC_BUCKETS, TensorMeta, TensorName,
    registry::{check_addrs, check_meta, check_version},
};

/// What is wrong with a control message that came from the network.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CtlError {
    /// A list is longer than its limit.
    #[error("too many {what}: {count}, the limit is {max}")]
    TooMany {
        /// What the list holds.
        what: &'static str,
        /// How many it holds.
        count: u64,
        /// The limit.
        max: u64,
    },
    /// A heartbeat address is over [`MAX_ADDR_LEN`] bytes.
    #[error("heartbeat advertises a {len}-byte address, over the limit of {MAX_ADDR_LEN}")]
    AddrTooLong {
        /// The address's length in bytes.
        len: usize,
    },
    /// A `List` prefix is too long or has characters no name can have.
    #[error("list prefix: {0}")]
    Prefix(NameError),
    /// A `SyncBuckets` does not carry exactly [`SYNC_BUCKETS`] digests.
    #[error("sync carries {count} bucket digests; it must carry exactly {SYNC_BUCKETS}")]
    BucketCount {
        /// How many it carries.
        count: usize,
    },
    /// A `SyncDiff`'s bucket indices repeat or go backwards.
    #[error("sync bucket {index} follows bucket {prev}; indices must strictly increase")]
    BucketOrder {
        /// The index before.
        prev: u8,
        /// The index that does not exceed it.
        index: u8,
    },
    /// A heartbeat stat is negative, infinite or NaN.
    #[error("heartbeat stat {field} is not a finite non-negative number")]
    BadStat {
        /// The field.
        field: &'static str,
    },
    /// A heartbeat's metrics URL is over [`MAX_METRICS_URL_LEN`](super::MAX_METRICS_URL_LEN)
    /// bytes.
    #[error(
        "heartbeat metrics URL has {len} bytes, over the limit of {}",
        super::MAX_METRICS_URL_LEN
    )]
    UrlTooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// A `Version` answer assigns version 0 (versions start at 1).
    #[error("broker assigned version 0; versions start at 1")]
    ZeroVersionAssigned,
    /// Inline bytes over [`MAX_INLINE_BYTES`].
    #[error("inline payload of {len} bytes, over the limit of {MAX_INLINE_BYTES}")]
    InlineTooLarge {
        /// Their length.
        len: u64,
    },
    /// Inline bytes whose length or BLAKE3 hash is not the published metadata's.
    #[error(
        "inline payload of {len} bytes does not match its metadata ({expected} bytes and their \
         hash): refused"
    )]
    InlineMismatch {
        /// Their length.
        len: u64,
        /// The metadata's byte length.
        expected: u64,
    },
    /// A `Publish` whose first op is not a publish.
    #[error("a Publish request must start with a publish op")]
    InlineWithoutPublish,
    /// A registry op, entry, member row, version or tensor metadata in the message is invalid.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// Refuses a list of `count` over `max`.
fn at_most(what: &'static str, count: usize, max: usize) -> Result<(), CtlError> {
    match count > max {
        true => Err(CtlError::TooMany {
            what,
            count: count as u64,
            max: max as u64,
        }),
        false => Ok(()),
    }
}

impl CtlRequest {
    /// Checks a request that came from the network: list lengths, addresses, versions (at
    /// least 1), the list prefix, tensor metadata and registry ops (against
    /// `max_tensor_bytes`). Names and patterns are checked when they are decoded.
    pub fn validate(&self, max_tensor_bytes: u64) -> Result<(), CtlError> {
        match self {
            CtlRequest::Heartbeat { addrs, stats, .. } => {
                at_most("heartbeat addresses", addrs.len(), MAX_MEMBER_ADDRS)?;
                if let Some(long) = addrs.iter().find(|a| a.len() > MAX_ADDR_LEN) {
                    return Err(CtlError::AddrTooLong { len: long.len() });
                }
                stats.as_ref().map_or(Ok(()), |s| s.validate())
            }
            CtlRequest::Announce { ops } => {
                at_most("announced ops", ops.len(), MAX_ANNOUNCE_OPS)?;
                for op in ops {
                    op.validate(max_tensor_bytes)?;
                }
                Ok(())
            }
            CtlRequest::Publish { ops, bytes } => {
                at_most("announced ops", ops.len(), MAX_ANNOUNCE_OPS)?;
                for op in ops {
                    op.validate(max_tensor_bytes)?;
                }
                match ops.first() {
                    Some(RegistryOp::Publish { meta, .. }) => check_inline(meta, bytes),
                    _ => Err(CtlError::InlineWithoutPublish),
                }
            }
            CtlRequest::Lookup {
                name,
                version,
                exclude,
            } => {
                at_most("excluded sources", exclude.len(), MAX_LOOKUP_EXCLUDE)?;
                match version {
                    Some(version) => Ok(check_version(name, *version)?),
                    None => Ok(()),
                }
            }
            CtlRequest::Fetching { name, version, .. } => Ok(check_version(name, *version)?),
            CtlRequest::List { prefix, limit } | CtlRequest::Functions { prefix, limit } => {
                TensorName::validate_prefix(prefix).map_err(CtlError::Prefix)?;
                at_most(
                    "entries asked of a listing",
                    *limit as usize,
                    MAX_LIST_LIMIT as usize,
                )
            }
            CtlRequest::SyncBuckets { buckets, members } => {
                if buckets.len() != SYNC_BUCKETS {
                    return Err(CtlError::BucketCount {
                        count: buckets.len(),
                    });
                }
                at_most("member digests", members.len(), MAX_SYNC_MEMBERS)
            }
            CtlRequest::NextVersion { .. }
            | CtlRequest::Subscribe { .. }
            | CtlRequest::Members
            | CtlRequest::SyncNames { .. }
            | CtlRequest::Servers { .. } => Ok(()),
        }
    }
}

impl CtlResponse {
    /// Checks a response that came from the network: list lengths, addresses, versions (at
    /// least 1), bucket order, tensor metadata, member rows (and their stats, as in a
    /// heartbeat) and entries (against `max_tensor_bytes`). Names are checked when they are
    /// decoded.
    pub fn validate(&self, max_tensor_bytes: u64) -> Result<(), CtlError> {
        match self {
            CtlResponse::Version { version: 0 } => Err(CtlError::ZeroVersionAssigned),
            CtlResponse::Holders {
                name,
                version,
                meta,
                holders,
                sources,
            } => {
                check_version(name, *version)?;
                check_meta(name, *version, meta, max_tensor_bytes)?;
                at_most("holders", holders.len(), MAX_HOLDERS_REPLY)?;
                let most = holders.len().min(crate::piece::MAX_SOURCES);
                at_most("sources", usize::from(*sources), most)?;
                for HolderAddr { node, addrs, .. } in holders {
                    check_addrs(node, addrs)?;
                }
                Ok(())
            }
            CtlResponse::Servers { servers, .. } => {
                at_most("servers", servers.len(), MAX_HOLDERS_REPLY)?;
                for HolderAddr { node, addrs, .. } in servers {
                    check_addrs(node, addrs)?;
                }
                Ok(())
            }
            CtlResponse::Functions { functions } => {
                at_most("listed functions", functions.len(), MAX_LIST_LIMIT as usize)
            }
            CtlResponse::Listing { entries, .. } => {
                at_most("listed entries", entries.len(), MAX_LIST_LIMIT as usize)?;
                for ListedEntry {
                    name,
                    version,
                    meta,
                    ..
                } in entries
                {
                    check_version(name, *version)?;
                    check_meta(name, *version, meta, max_tensor_bytes)?;
                }
                Ok(())
            }
            CtlResponse::Event(Event::Published {
                name,
                version,
                meta,
                ..
            }) => {
                check_version(name, *version)?;
                Ok(check_meta(name, *version, meta, max_tensor_bytes)?)
            }
            CtlResponse::Event(Event::PublishedInline {
                name,
                version,
                meta,
                bytes,
                ..
            }) => {
                check_version(name, *version)?;
                check_meta(name, *version, meta, max_tensor_bytes)?;
                check_inline(meta, bytes)
            }
            CtlResponse::Members { members, .. } => {
                at_most("member rows", members.len(), MAX_SYNC_MEMBERS)?;
                members.iter().try_for_each(MemberStatus::validate)
            }
            CtlResponse::SyncDiff {
                members, buckets, ..
            } => {
                check_members(members)?;
                match buckets.windows(2).find(|w| w[0] >= w[1]) {
                    Some(&[prev, index]) => Err(CtlError::BucketOrder { prev, index }),
                    _ => Ok(()),
                }
            }
            CtlResponse::SyncEntries { entries, .. } => {
                for (name, entry) in entries {
                    entry.validate(name, max_tensor_bytes)?;
                }
                Ok(())
            }
            CtlResponse::Ok
            | CtlResponse::Version { .. }
            | CtlResponse::Event(Event::Deleted { .. })
            | CtlResponse::Error { .. } => Ok(()),
        }
    }
}

/// Refuses inline bytes over [`MAX_INLINE_BYTES`] or other than `meta` says (length and
/// BLAKE3 hash): a tampered inline payload is never taken.
/// Checks a [`DataResponse::Offer`](crate::DataResponse::Offer) of `version` of `name` as a
/// watcher receives it: a valid version and metadata (within `max_tensor_bytes`), and bytes
/// of at most [`MAX_INLINE_BYTES`] whose length and BLAKE3 hash are the metadata's. An offer
/// that fails is refused, never a tensor.
pub fn check_offer(
    name: &TensorName,
    version: u64,
    meta: &TensorMeta,
    bytes: &[u8],
    max_tensor_bytes: u64,
) -> Result<(), CtlError> {
    check_offered_meta(name, version, meta, max_tensor_bytes)?;
    check_inline(meta, bytes)
}

/// Checks the version and metadata of an offer whose bytes do not ride inline (a same-host
/// watch passes a large version's sealed memfd): a valid version and metadata within
/// `max_tensor_bytes`. Whoever maps the bytes checks them against `meta`.
pub fn check_offered_meta(
    name: &TensorName,
    version: u64,
    meta: &TensorMeta,
    max_tensor_bytes: u64,
) -> Result<(), CtlError> {
    check_version(name, version)?;
    Ok(check_meta(name, version, meta, max_tensor_bytes)?)
}

fn check_inline(meta: &TensorMeta, bytes: &[u8]) -> Result<(), CtlError> {
    let len = bytes.len() as u64;
    if len > MAX_INLINE_BYTES {
        return Err(CtlError::InlineTooLarge { len });
    }
    if len != meta.byte_len || ContentHash::of(bytes) != meta.hash {
        return Err(CtlError::InlineMismatch {
            len,
            expected: meta.byte_len,
        });
    }
    Ok(())
}

/// Refuses more than [`MAX_SYNC_MEMBERS`] rows, or a row over the address limits.
fn check_members(members: &[Member]) -> Result<(), CtlError> {
    at_most("member rows", members.len(), MAX_SYNC_MEMBERS)?;
    members
        .iter()
        .try_for_each(Member::validate)
        .map_err(CtlError::from)
}
