//! The `tb/ctl/1` messages: nodes to brokers, and brokers to brokers.
//!
//! A connection starts with the [`Hello`](crate::Hello) exchange. Then each request goes on a
//! bidirectional stream of its own: one [`CtlRequest`] frame, answered by one or more
//! [`CtlResponse`] frames ([`CtlResponse::is_final`] says when the answer is complete):
//!
//! | request | answer |
//! |---|---|
//! | `Heartbeat`, `Announce`, `Fetching`, `Publish` | `Ok` |
//! | `NextVersion` | `Version` |
//! | `Lookup` | `Holders` |
//! | `List` | `Listing` frames until `last` |
//! | `Subscribe` | `Ok` once the subscription is registered, then `Event` frames until either side closes the stream |
//! | `Members` | `Members` frames until `last` (member rows with their heartbeat stats) |
//! | `SyncBuckets`, then `SyncNames` frames until `last` | `SyncDiff` frames until `last`, then `SyncEntries` frames until `last` |
//!
//! Anti-entropy is the one conversation: on one stream, the asker sends `SyncBuckets`, reads
//! the `SyncDiff` frames, then always sends its `SyncNames` for the buckets they named (one
//! empty `last` frame when none differ), and reads the `SyncEntries` frames. The responder
//! answers step 2 for the buckets it named in step 1 (see the registry's `sync` helpers).
//!
//! Any request may instead be answered by one `Error`. Lists that can outgrow one control frame
//! are split with [`chunk_by_size`](crate::chunk_by_size) under [`MAX_CHUNK_BYTES`]. Every
//! decoded message is untrusted until its `validate` passes.

mod stats;
mod status;
mod validate;

use serde::{Deserialize, Serialize};

pub use self::{
    stats::{
        FunctionStats, LinkChannel, MAX_METRICS_URL_LEN, MAX_STATS_FUNCTIONS, MAX_STATS_LINKS,
        NodeStats,
    },
    status::{LastHeartbeat, MemberStatus},
    validate::{CtlError, check_offer, check_offered_meta},
};
use crate::{
    Entry, ErrorCode, MAX_CONTROL_FRAME, Member, NamePattern, NodeId, RegistryOp, Role, TensorMeta,
    TensorName,
};

/// Most registry ops one `Announce` carries.
pub const MAX_ANNOUNCE_OPS: usize = 256;
/// Largest tensor whose bytes ride with its publish and its subscribers' events
/// ([`CtlRequest::Publish`], [`Event::PublishedInline`]): a subscriber holds it when told,
/// with no look-up or pull. Brokers pass these bytes on and never keep or gossip them.
pub const MAX_INLINE_BYTES: u64 = 16 << 10;
/// Most entries one `List` may ask for (and one `Listing` frame may carry).
pub const MAX_LIST_LIMIT: u32 = 100_000;
/// Most holders one `Holders` answer names.
pub const MAX_HOLDERS_REPLY: usize = 64;
/// Most sources one `Lookup` may exclude (a reply names at most [`MAX_HOLDERS_REPLY`]).
pub const MAX_LOOKUP_EXCLUDE: usize = MAX_HOLDERS_REPLY;
/// Most member rows or member digests one frame carries; clusters beyond this many nodes
/// cannot sync membership by anti-entropy (gossip still carries it).
pub const MAX_SYNC_MEMBERS: usize = 4096;
/// A [`chunk_by_size`](crate::chunk_by_size) budget for the list in a `SyncNames`,
/// `SyncEntries`, `Listing`, `Members` or `SyncDiff` frame: the control-frame cap less room for
/// the message around the list.
pub const MAX_CHUNK_BYTES: usize = MAX_CONTROL_FRAME as usize - 1024;

/// What a node asks a broker (or a broker another broker) on a `tb/ctl/1` stream.
///
/// `PartialEq` only: heartbeat stats carry floats (validated finite).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CtlRequest {
    /// The asker is alive and listens at `addrs`; brokers record it in membership.
    Heartbeat {
        /// What the asker does.
        role: Role,
        /// Where it listens (at most [`MAX_MEMBER_ADDRS`](crate::MAX_MEMBER_ADDRS) of at most
        /// [`MAX_ADDR_LEN`](crate::MAX_ADDR_LEN) bytes).
        addrs: Vec<String>,
        /// Its epoch, bumped on every restart.
        epoch: u64,
        /// Its live figures for the broker's dashboard (workers send them; `None` from nodes
        /// that keep none).
        stats: Option<NodeStats>,
    },
    /// The asker reports registry changes it made: published its own tensors, gained or
    /// dropped holdings, deleted names.
    Announce {
        /// The changes, at most [`MAX_ANNOUNCE_OPS`].
        ops: Vec<RegistryOp>,
    },
    /// Assign the next version of `name` for a publish by the asker (answered by `Version`).
    NextVersion {
        /// The tensor about to be published.
        name: TensorName,
    },
    /// Where can the asker fetch `name` (answered by `Holders`)?
    Lookup {
        /// The tensor.
        name: TensorName,
        /// A specific version (at least 1), or the newest.
        version: Option<u64>,
        /// Sources not to offer: those the asker dropped during this fetch (too slow, or
        /// failed), at most [`MAX_LOOKUP_EXCLUDE`]. The broker ranks a source some fetcher
        /// dropped after the others for the rest of that version's fetches.
        exclude: Vec<NodeId>,
    },
    /// The asker started (or stopped) fetching a version and serves what it has so far
    /// (cut-through).
    Fetching {
        /// The tensor.
        name: TensorName,
        /// The version being fetched (at least 1).
        version: u64,
        /// True when the fetch starts, false when it ends or fails.
        active: bool,
    },
    /// Live entries whose name starts with `prefix` (answered by `Listing` frames).
    List {
        /// Name characters only, at most [`MAX_NAME_LEN`](crate::MAX_NAME_LEN) bytes; empty
        /// lists everything.
        prefix: String,
        /// Most entries to return, at most [`MAX_LIST_LIMIT`].
        limit: u32,
    },
    /// Stream every new version (and delete) of names matching `pattern` (answered by `Event`
    /// frames until either side closes the stream).
    Subscribe {
        /// The names to watch.
        pattern: NamePattern,
    },
    /// The cluster view for `tb status`: members with liveness and, for those that heartbeat
    /// to this broker, their latest stats (answered by `Members`).
    Members,
    /// Broker-to-broker anti-entropy, step 1: the asker's bucket and member digests (answered
    /// by `SyncDiff`).
    SyncBuckets {
        /// [`Registry::bucket_digests`](crate::Registry::bucket_digests): exactly
        /// [`SYNC_BUCKETS`](crate::SYNC_BUCKETS).
        buckets: Vec<[u8; 32]>,
        /// [`Registry::member_digest`](crate::Registry::member_digest), at most
        /// [`MAX_SYNC_MEMBERS`].
        members: Vec<(NodeId, [u8; 32])>,
    },
    /// Anti-entropy step 2: the asker's per-name digests for the buckets `SyncDiff` named
    /// (several frames, `last` ends them; answered by `SyncEntries`).
    SyncNames {
        /// [`Registry::names_in_buckets`](crate::Registry::names_in_buckets), or a piece of it.
        names: Vec<(TensorName, [u8; 32])>,
        /// Whether this is the last frame.
        last: bool,
    },
    /// An `Announce` whose first op is the asker's publish of a small tensor, with that
    /// version's bytes: the broker records the ops as `Announce` does and tells its
    /// subscribers with [`Event::PublishedInline`], bytes included (it neither keeps nor
    /// gossips them).
    Publish {
        /// The changes, at most [`MAX_ANNOUNCE_OPS`]; the first a `RegistryOp::Publish`.
        ops: Vec<RegistryOp>,
        /// The published version's bytes: at most [`MAX_INLINE_BYTES`], their length and
        /// BLAKE3 hash those of the publish's metadata.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
    /// Which live nodes serve `function` now (answered by `Servers`): the members whose
    /// current epoch holds a mark on the function's advertisement entry
    /// ([`crate::call::advertised_as`]).
    Servers {
        /// The function.
        function: TensorName,
    },
    /// The functions served now whose names start with `prefix`, with their server counts
    /// (answered by `Functions`).
    Functions {
        /// Name characters only, at most [`MAX_NAME_LEN`](crate::MAX_NAME_LEN) bytes; empty
        /// lists every function.
        prefix: String,
        /// Most functions to return, at most [`MAX_LIST_LIMIT`].
        limit: u32,
    },
}

impl CtlRequest {
    /// The variant's name, for logs and spans.
    pub fn kind(&self) -> &'static str {
        match self {
            CtlRequest::Heartbeat { .. } => "heartbeat",
            CtlRequest::Announce { .. } => "announce",
            CtlRequest::NextVersion { .. } => "next_version",
            CtlRequest::Lookup { .. } => "lookup",
            CtlRequest::Fetching { .. } => "fetching",
            CtlRequest::List { .. } => "list",
            CtlRequest::Subscribe { .. } => "subscribe",
            CtlRequest::Members => "members",
            CtlRequest::SyncBuckets { .. } => "sync_buckets",
            CtlRequest::SyncNames { .. } => "sync_names",
            CtlRequest::Publish { .. } => "publish",
            CtlRequest::Servers { .. } => "servers",
            CtlRequest::Functions { .. } => "functions",
        }
    }

    /// What the request does that needs read-write access (the cluster secret), named for the
    /// refusal; `None` when read-only access is enough. Read-only: `Lookup`, `Fetching`,
    /// `List`, `Subscribe`, `Members`, a worker's `Heartbeat`, an `Announce` of holder marks.
    /// Read-write: `NextVersion`, a broker's `Heartbeat`, anti-entropy, and an `Announce` of a
    /// publish, a delete or a membership row.
    pub fn write_action(&self) -> Option<&'static str> {
        match self {
            CtlRequest::NextVersion { .. } => Some("publishing (allocating a version)"),
            CtlRequest::Heartbeat {
                role: Role::Broker, ..
            } => Some("joining as a broker"),
            CtlRequest::Announce { ops } | CtlRequest::Publish { ops, .. } => {
                ops.iter().find_map(RegistryOp::write_action)
            }
            CtlRequest::SyncBuckets { .. } | CtlRequest::SyncNames { .. } => {
                Some("anti-entropy between brokers")
            }
            CtlRequest::Heartbeat {
                role: Role::Worker, ..
            }
            | CtlRequest::Lookup { .. }
            | CtlRequest::Fetching { .. }
            | CtlRequest::List { .. }
            | CtlRequest::Subscribe { .. }
            | CtlRequest::Members
            | CtlRequest::Servers { .. }
            | CtlRequest::Functions { .. } => None,
        }
    }

    /// The one tensor the request is about, if it names one.
    pub fn tensor(&self) -> Option<&TensorName> {
        match self {
            CtlRequest::NextVersion { name }
            | CtlRequest::Lookup { name, .. }
            | CtlRequest::Fetching { name, .. } => Some(name),
            _ => None,
        }
    }
}

/// What the asked side answers on a `tb/ctl/1` stream.
///
/// `PartialEq` only: member stats carry floats (validated finite).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CtlResponse {
    /// The request was carried out.
    Ok,
    /// The version assigned to the asker's next publish.
    Version {
        /// At least 1.
        version: u64,
    },
    /// Where to fetch a tensor.
    Holders {
        /// The tensor.
        name: TensorName,
        /// The version the holders have (the newest, unless a version was asked for).
        version: u64,
        /// What that version's bytes are.
        meta: TensorMeta,
        /// Nodes that hold it or are fetching it, at most [`MAX_HOLDERS_REPLY`].
        holders: Vec<HolderAddr>,
        /// How many of the first holders the asker may pull pieces from at once: the broker
        /// counted the asker at each of them (1 when there are holders and only the first has
        /// room to spare; at most [`MAX_SOURCES`](crate::piece::MAX_SOURCES)).
        sources: u8,
    },
    /// A piece of a listing.
    Listing {
        /// Entries in name order, at most [`MAX_LIST_LIMIT`].
        entries: Vec<ListedEntry>,
        /// Whether this is the last frame.
        last: bool,
    },
    /// Something happened to a subscribed name.
    Event(Event),
    /// A piece of the membership table, with each member's latest heartbeat stats.
    Members {
        /// Rows in node id order, at most [`MAX_SYNC_MEMBERS`].
        members: Vec<MemberStatus>,
        /// Whether this is the last frame.
        last: bool,
    },
    /// Anti-entropy step 1's answer (the asker gathers every frame's rows and buckets).
    SyncDiff {
        /// The responder's member rows the asker lacks or holds otherwise, at most
        /// [`MAX_SYNC_MEMBERS`].
        members: Vec<Member>,
        /// The buckets whose digests differ, strictly increasing.
        buckets: Vec<u8>,
        /// Whether this is the last frame.
        last: bool,
    },
    /// Anti-entropy step 2's answer: the responder's entries for names the asker lacks or
    /// holds otherwise.
    SyncEntries {
        /// Raw entries, tombstones and placeholders included.
        entries: Vec<(TensorName, Entry)>,
        /// Whether this is the last frame.
        last: bool,
    },
    /// The request failed.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// A human-readable explanation naming the thing that failed.
        message: String,
    },
    /// The answer to `Servers`: the live nodes serving the function now (possibly none).
    Servers {
        /// The function.
        function: TensorName,
        /// At most [`MAX_HOLDERS_REPLY`] servers, with their addresses.
        servers: Vec<HolderAddr>,
    },
    /// The answer to `Functions`: each function served now, with how many live servers.
    Functions {
        /// At most [`MAX_LIST_LIMIT`] functions, in name order.
        functions: Vec<(TensorName, u32)>,
    },
}

impl CtlResponse {
    /// Whether this frame completes its answer: false for `Event`s and for pieces of
    /// multi-frame answers that are not `last`.
    pub fn is_final(&self) -> bool {
        match self {
            CtlResponse::Listing { last, .. }
            | CtlResponse::Members { last, .. }
            | CtlResponse::SyncDiff { last, .. }
            | CtlResponse::SyncEntries { last, .. } => *last,
            CtlResponse::Event(_) => false,
            CtlResponse::Ok
            | CtlResponse::Version { .. }
            | CtlResponse::Holders { .. }
            | CtlResponse::Servers { .. }
            | CtlResponse::Functions { .. }
            | CtlResponse::Error { .. } => true,
        }
    }
}

/// A node that holds (or is fetching) a tensor, and where to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderAddr {
    /// The holder.
    pub node: NodeId,
    /// Its addresses, from membership.
    pub addrs: Vec<String>,
    /// False while it is still fetching: it serves what it has so far (cut-through).
    pub complete: bool,
}

/// One line of a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedEntry {
    /// The tensor.
    pub name: TensorName,
    /// Its newest version.
    pub version: u64,
    /// What that version's bytes are.
    pub meta: TensorMeta,
    /// How many nodes hold that version.
    pub holders: u32,
}

/// What a subscriber is told about a matching name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// A new version of a matching name was published.
    Published {
        /// The tensor.
        name: TensorName,
        /// The new version.
        version: u64,
        /// What its bytes are.
        meta: TensorMeta,
        /// Who published it (and holds it).
        publisher: NodeId,
    },
    /// A matching name was deleted.
    Deleted {
        /// The tensor.
        name: TensorName,
    },
    /// `Published`, with the version's bytes (a tensor of at most [`MAX_INLINE_BYTES`]
    /// published with [`CtlRequest::Publish`]): checked against `meta` when decoded.
    PublishedInline {
        /// The tensor.
        name: TensorName,
        /// The new version.
        version: u64,
        /// What its bytes are.
        meta: TensorMeta,
        /// Who published it (and holds it).
        publisher: NodeId,
        /// The bytes, `meta.byte_len` of them, hashing to `meta.hash`.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
}

impl Event {
    /// The name the event is about.
    pub fn name(&self) -> &TensorName {
        match self {
            Event::Published { name, .. }
            | Event::Deleted { name }
            | Event::PublishedInline { name, .. } => name,
        }
    }

    /// `Published` with `bytes` when it announces `version` of `name`; otherwise unchanged.
    pub fn with_inline(self, of: (&TensorName, u64), bytes: &[u8]) -> Event {
        match self {
            Event::Published {
                name,
                version,
                meta,
                publisher,
            } if (&name, version) == of => Event::PublishedInline {
                name,
                version,
                meta,
                publisher,
                bytes: bytes.to_vec(),
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests;
