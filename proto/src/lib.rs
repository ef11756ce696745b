//! # tb-proto: what tensor-broker puts on the wire
//!
//! The sans-IO layer: no sockets, no async. Everything here is plain data and pure functions,
//! unit-, property- and fuzz-tested, and used by every other crate.
//!
//! - [`DType`], [`TensorMeta`], [`ContentHash`]: what a tensor is, validated with overflow
//!   checks (`byte_len == product(shape) * itemsize`, rank <= [`MAX_RANK`]).
//! - [`TensorName`], [`NamePattern`]: validated names (`model/layer1/w`) and patterns
//!   (`model/*`).
//! - [`channel`]: the data channels besides QUIC ([`ChannelKind`]: shm, tcp), the offers two
//!   peers exchange on first contact ([`ChannelOffer`]) and the rule that picks one per pair.
//! - [`msg`]: the `tb/data/1` messages ([`DataRequest`], [`DataResponse`], [`ErrorCode`]),
//!   ALPN constants, and the one enum of QUIC close codes ([`CloseCode`]).
//! - [`piece`]: how a large version is cut into pieces that several sources serve at once,
//!   each checked on its own against the version's BLAKE3 tree.
//! - [`ctl`]: the `tb/ctl/1` messages ([`CtlRequest`], [`CtlResponse`], [`Event`]) between
//!   nodes and brokers and between brokers, with their limits and [`CtlError`].
//! - [`ClusterKey`], [`Access`], [`Hello`], [`HelloReply`]: the cluster secret and the
//!   read-only credential derived from it, what each allows, the first frame exchange of every
//!   connection that proves them, and the gossip topic the secret names.
//! - [`frame`]: length-prefixed postcard framing with the control-frame cap checked before any
//!   allocation.
//! - [`Registry`]: the replicated registry CRDT (entries per name with LWW heads, add-wins
//!   holder marks and tombstones; a membership table), its gossip ops ([`RegistryOp`]), the
//!   bucketed anti-entropy helpers ([`Registry::bucket_digests`], [`bucket_of`],
//!   [`chunk_by_size`]) and the hybrid logical clock ([`Hlc`], [`Stamp`], [`NodeId`]) that
//!   orders its writes.
//!
//! Data flow: a client opens a connection, sends a [`Hello`] carrying its
//! [`ClusterKey::prove`] and waits for the [`HelloReply`]. Then, on a stream per request, a
//! sender builds a message, [`frame::encode`]s it and writes the bytes (then the raw payload,
//! for tensors); a receiver reads 4 bytes, asks [`frame::body_len`] whether to read on, reads
//! the body, [`frame::decode_body`]s it and `validate`s what it got before trusting any length
//! in it.
//!
//! ```
//! use tb_proto::{DataRequest, TensorName, frame};
//!
//! let req = DataRequest::Pull { name: TensorName::new("model/w")?, version: None, range: None };
//! let bytes = frame::encode(&req)?;
//! let len = frame::body_len([bytes[0], bytes[1], bytes[2], bytes[3]])?;
//! let got: DataRequest = frame::decode_body(&bytes[frame::LEN_PREFIX..][..len])?;
//! got.validate(64 << 30)?;
//! assert_eq!(got, req);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod auth;
pub mod call;
pub mod channel;
pub mod ctl;
mod dtype;
pub mod frame;
mod hash;
mod hlc;
pub mod ipc;
mod meta;
pub mod msg;
mod name;
pub mod piece;
mod registry;
pub mod set;

pub use auth::{
    Access, AccessError, AccessProof, AuthError, AuthProof, ClusterKey, EXAMPLE_SECRETS,
    HOW_TO_MAKE_A_SECRET, Hello, HelloReply, MAX_HELLO_FRAME, MAX_SECRET_LEN, MIN_SECRET_LEN,
    READ_ONLY_PREFIX, authorize,
};
pub use channel::{
    ChannelKind, ChannelListError, ChannelOffer, ShmCopied, ShmHello, ShmPayload, TcpHello,
};
pub use ctl::{
    CtlError, CtlRequest, CtlResponse, Event, FunctionStats, HolderAddr, LastHeartbeat,
    LinkChannel, ListedEntry, MAX_ANNOUNCE_OPS, MAX_CHUNK_BYTES, MAX_HOLDERS_REPLY,
    MAX_INLINE_BYTES, MAX_LIST_LIMIT, MAX_LOOKUP_EXCLUDE, MAX_METRICS_URL_LEN, MAX_STATS_FUNCTIONS,
    MAX_STATS_LINKS, MAX_SYNC_MEMBERS, MemberStatus, NodeStats, check_offer, check_offered_meta,
};
pub use dtype::{DType, UnknownDType};
pub use frame::{FrameError, LEN_PREFIX, MAX_CONTROL_FRAME};
pub use hash::{ContentHash, ContentHasher};
pub use hlc::{ClockError, Hlc, MAX_DRIFT_MS, NodeId, Stamp};
pub use meta::{MAX_RANK, MetaError, TensorMeta, byte_len_for};
pub use msg::{
    ByteRange, CTL_ALPN, CloseCode, DATA_ALPN, DataRequest, DataResponse, ErrorCode,
    MAX_DATA_REQUEST_FRAME, RequestKind,
};
pub use name::{LEND_PREFIX, MAX_NAME_LEN, NameError, NamePattern, TensorName};
pub use registry::{
    Entry, Expiry, Forgotten, HolderMark, MAX_ADDR_LEN, MAX_GOSSIP_OP_BYTES, MAX_MEMBER_ADDRS,
    Member, Registry, RegistryError, RegistryOp, Role, SYNC_BUCKETS, bucket_of, chunk_by_size,
};
pub use set::{MAX_SET_MEMBERS, SET_ALIGN, SET_MAGIC, SetError, SetLayout, SetManifest, SetMember};
