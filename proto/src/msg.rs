//! The `tb/data/1` messages, ALPN constants, error codes, and QUIC close codes.
//!
//! A connection opens with the [`Hello`](crate::Hello) exchange on its first stream, then one
//! bidirectional stream per transfer:
//! - `Pull { name, version?, range? }` -> `Header { meta, version }` + payload, or `Error`.
//! - `Push { name, meta }` + payload -> `Ack` or `Error`.
//! - `Channels { offers }` -> `Channels { offers }`: the first request on a new link, the
//!   channels each side runs besides QUIC (see [`crate::channel`]).
//! - `Pieces { name, version }` -> `Outline { .. }` then `Have { .. }` frames as the server
//!   gets more pieces, or `Error`: the version's piece outline and which pieces the server
//!   can serve (see [`crate::piece`]); the pieces themselves are `Pull`s of their ranges.
//! - `Watch { name }` -> an `Offer { version, meta, bytes }` frame for each small version of
//!   `name` the server publishes from then on, until either side closes the stream, or
//!   `Error`: how a small version reaches a subscriber in one hop (see [`DataRequest::Watch`]).
//! - `Ctl`, then a [`CtlRequest`](crate::CtlRequest) frame -> its `CtlResponse` frames: a
//!   broker's answers on the same-host socket only (see [`DataRequest::Ctl`]).

use serde::{Deserialize, Serialize};

use crate::{
    MetaError, TensorMeta, TensorName,
    channel::{ChannelOffer, validate_offers},
};

/// ALPN of the node-to-node data protocol.
pub const DATA_ALPN: &[u8] = b"tb/data/1";
/// ALPN of the node-to-broker control protocol.
pub const CTL_ALPN: &[u8] = b"tb/ctl/1";

/// A byte range of a tensor's payload (to resume an interrupted pull).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteRange {
    /// First byte.
    pub offset: u64,
    /// Number of bytes.
    pub len: u64,
}

/// The largest [`DataRequest`] frame body a node reads (checked on the length prefix, before
/// anything is allocated). The largest valid request (a `Push` of a 256-byte name and a
/// rank-32 shape, or `Channels` with every offer) is under 1 KiB; the 1 MiB control-frame cap
/// is for answers and broker frames, so a peer cannot make a node hold a MiB per stream.
pub const MAX_DATA_REQUEST_FRAME: u32 = 4 << 10;

/// What a requester sends first on a `tb/data/1` stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataRequest {
    /// Send me this tensor (newest version unless one is given).
    Pull {
        /// The tensor.
        name: TensorName,
        /// A specific version, or the newest.
        version: Option<u64>,
        /// Only these bytes of the payload (the header still describes the whole tensor).
        range: Option<ByteRange>,
    },
    /// Here is a tensor; its `meta.byte_len` payload bytes follow this frame.
    Push {
        /// The name the receiver files it under.
        name: TensorName,
        /// What follows.
        meta: TensorMeta,
    },
    /// The channels I run besides QUIC, with what you need to open them; answered with yours
    /// ([`DataResponse::Channels`]). Sent once, first, on each new link.
    Channels {
        /// At most [`MAX_CHANNEL_OFFERS`](crate::channel::MAX_CHANNEL_OFFERS), one per kind.
        offers: Vec<ChannelOffer>,
    },
    /// Send me this tensor over the TCP channel on `sockets` connections: answered with a
    /// [`DataResponse::TcpTicket`] whose one-time token admits exactly that many sockets.
    TcpPull {
        /// The tensor.
        name: TensorName,
        /// A specific version, or the newest.
        version: Option<u64>,
        /// Sockets the puller will open, 1 to [`MAX_TCP_SOCKETS`](crate::channel::MAX_TCP_SOCKETS).
        sockets: u8,
    },
    /// Send me the outline of this version and the pieces you can serve
    /// ([`DataResponse::Outline`]), then, while you are still receiving it, each piece you
    /// get ([`DataResponse::Have`]), until you have them all. See [`crate::piece`].
    Pieces {
        /// The tensor.
        name: TensorName,
        /// The version.
        version: u64,
    },
    /// Send me each version of this tensor you publish from now on whose bytes ride inline
    /// (at most [`MAX_INLINE_BYTES`](crate::MAX_INLINE_BYTES)), as a
    /// [`DataResponse::Offer`] with its bytes, on this stream, as soon as you publish it
    /// (before your broker has answered). A subscriber sends it to a name's publisher: the
    /// broker's event still comes and is a duplicate; offers are a shortcut, never the only
    /// news. Either side ends the stream by closing it.
    Watch {
        /// The tensor.
        name: TensorName,
    },
    /// Call this function (see [`crate::call`]): answered with
    /// [`DataResponse::Accepted`] and [`CallFrame`](crate::call::CallFrame)s, or `Error`.
    Call {
        /// The function, by its served name.
        function: TensorName,
        /// The deadline, the arguments' size and whether a stream is expected.
        head: crate::call::CallHead,
    },
    /// A control request for the broker this node runs follows, as a
    /// [`CtlRequest`](crate::CtlRequest) frame of at most
    /// [`MAX_CONTROL_FRAME`](crate::MAX_CONTROL_FRAME) bytes; answered with its
    /// [`CtlResponse`](crate::CtlResponse) frames, up to the final one, exactly as on the
    /// broker's `tb/ctl/1` link. Sent only on the same-host socket (a node on the broker's
    /// host skips a QUIC round trip per publish and look-up); elsewhere, and by a node that
    /// runs no broker, answered `Unsupported`.
    Ctl,
    /// Export this tensor's device memory to me by CUDA IPC (see [`crate::ipc`]): answered
    /// with [`DataResponse::CudaIpc`] (a handle, or declined: use the network), or `Error`.
    /// Needs read-write access (the mapping is writable); sent only to a peer on this host.
    CudaIpc(crate::ipc::IpcRequest),
}

/// The kind of a [`DataRequest`]: what a node's table of request services is keyed by. A
/// node answers a kind it serves nothing for with [`ErrorCode::Unsupported`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RequestKind {
    /// [`DataRequest::Pull`].
    Pull,
    /// [`DataRequest::Push`].
    Push,
    /// [`DataRequest::Channels`].
    Channels,
    /// [`DataRequest::TcpPull`].
    TcpPull,
    /// [`DataRequest::Pieces`].
    Pieces,
    /// [`DataRequest::Watch`].
    Watch,
    /// [`DataRequest::Call`].
    Call,
    /// [`DataRequest::Ctl`].
    Ctl,
    /// [`DataRequest::CudaIpc`].
    CudaIpc,
}

impl RequestKind {
    /// Every kind.
    pub const ALL: [RequestKind; 9] = [
        RequestKind::Pull,
        RequestKind::Push,
        RequestKind::Channels,
        RequestKind::TcpPull,
        RequestKind::Pieces,
        RequestKind::Watch,
        RequestKind::Call,
        RequestKind::Ctl,
        RequestKind::CudaIpc,
    ];

    /// Its name in logs and refusals.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestKind::Pull => "pull",
            RequestKind::Push => "push",
            RequestKind::Channels => "channels",
            RequestKind::TcpPull => "tcp-pull",
            RequestKind::Pieces => "pieces",
            RequestKind::Watch => "watch",
            RequestKind::Call => "call",
            RequestKind::Ctl => "ctl",
            RequestKind::CudaIpc => "cuda-ipc",
        }
    }
}

impl std::fmt::Display for RequestKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl DataRequest {
    /// Which kind of request this is.
    pub fn kind(&self) -> RequestKind {
        match self {
            DataRequest::Pull { .. } => RequestKind::Pull,
            DataRequest::Push { .. } => RequestKind::Push,
            DataRequest::Channels { .. } => RequestKind::Channels,
            DataRequest::TcpPull { .. } => RequestKind::TcpPull,
            DataRequest::Pieces { .. } => RequestKind::Pieces,
            DataRequest::Watch { .. } => RequestKind::Watch,
            DataRequest::Call { .. } => RequestKind::Call,
            DataRequest::Ctl => RequestKind::Ctl,
            DataRequest::CudaIpc(_) => RequestKind::CudaIpc,
        }
    }

    /// The tensor the request is about, if it is about one.
    pub fn name(&self) -> Option<&TensorName> {
        match self {
            DataRequest::Pull { name, .. }
            | DataRequest::Push { name, .. }
            | DataRequest::TcpPull { name, .. }
            | DataRequest::Pieces { name, .. }
            | DataRequest::Watch { name }
            | DataRequest::CudaIpc(crate::ipc::IpcRequest::Open { name, .. }) => Some(name),
            DataRequest::Channels { .. } | DataRequest::Call { .. } | DataRequest::Ctl => None,
        }
    }

    /// What the request does that needs read-write access, named for the refusal: a push
    /// (the receiver may publish it); a pull needs read-only access only.
    pub fn write_action(&self) -> Option<&'static str> {
        match self {
            DataRequest::Push { .. } => Some("pushing a tensor (a publish)"),
            DataRequest::Pull { .. }
            | DataRequest::Channels { .. }
            | DataRequest::TcpPull { .. }
            | DataRequest::Pieces { .. }
            | DataRequest::Watch { .. } => None,
            // Read-write by default, but a function may admit read-only callers: the call
            // service checks it per function.
            DataRequest::Call { .. } => None,
            // The broker authorizes the control request that follows, as on its own link.
            DataRequest::Ctl => None,
            // The exporter's memory is mapped writable by the requester.
            DataRequest::CudaIpc(_) => {
                Some("CUDA IPC (a writable mapping of this node's device memory)")
            }
        }
    }

    /// Checks what can be checked before acting on the request: a push's metadata (rank,
    /// byte length, size limit), that a pull's range end fits in 64 bits, that channel
    /// offers are few and one per kind, that a TCP pull asks for a bounded number of
    /// sockets, and that a CUDA IPC request's host id is bounded.
    pub fn validate(&self, max_tensor_bytes: u64) -> Result<(), MetaError> {
        match self {
            DataRequest::Channels { offers } => validate_offers(offers).map_err(MetaError::from),
            DataRequest::Push { meta, .. } => meta.validate(max_tensor_bytes),
            DataRequest::Pull { range: Some(r), .. } => r
                .offset
                .checked_add(r.len)
                .map(|_| ())
                .ok_or(MetaError::Overflow),
            DataRequest::Pull { .. } | DataRequest::Pieces { .. } | DataRequest::Watch { .. } => {
                Ok(())
            }
            DataRequest::TcpPull { sockets, .. } => {
                crate::channel::validate_tcp_sockets(*sockets).map_err(MetaError::from)
            }
            // The arguments' size is the function's to limit (`CallHead::validate`).
            DataRequest::Call { .. } => Ok(()),
            DataRequest::Ctl => Ok(()),
            DataRequest::CudaIpc(request) => {
                request.validate().map_err(|e| MetaError::Ipc(Box::new(e)))
            }
        }
    }
}

/// What the serving side answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataResponse {
    /// The tensor follows: `meta.byte_len` bytes (or the requested range).
    Header {
        /// Describes the whole tensor.
        meta: TensorMeta,
        /// The version being sent.
        version: u64,
    },
    /// A pushed tensor was verified and accepted.
    Ack,
    /// The request failed.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// A human-readable explanation naming the thing that failed.
        message: String,
    },
    /// The answer to [`DataRequest::Channels`]: the channels the serving side runs.
    Channels {
        /// At most [`MAX_CHANNEL_OFFERS`](crate::channel::MAX_CHANNEL_OFFERS), one per kind.
        offers: Vec<ChannelOffer>,
    },
    /// The answer to [`DataRequest::TcpPull`]: the version to expect and the one-time token
    /// that admits the puller's sockets to this node's TCP channel (valid for this transfer
    /// only, for the number of sockets asked, for a short time).
    TcpTicket {
        /// Describes the whole tensor.
        meta: TensorMeta,
        /// The version the sockets will carry.
        version: u64,
        /// Presented in each socket's [`TcpHello`](crate::channel::TcpHello).
        token: [u8; 32],
    },
    /// The answer to [`DataRequest::Pieces`]: the version's outline and the pieces the
    /// server can serve now. The puller checks the outline against the version's hash and the
    /// indexes against the piece count ([`crate::piece::check_outline`],
    /// [`crate::piece::check_indexes`]) before using either.
    Outline {
        /// The length of every piece but the last ([`crate::piece::piece_len`]).
        piece_len: u64,
        /// Each piece's BLAKE3 chaining value (its subtree's), in order, at most
        /// [`MAX_PIECES`](crate::piece::MAX_PIECES).
        values: Vec<[u8; 32]>,
        /// The server has the whole version: it serves every piece (`have` is empty).
        complete: bool,
        /// Pieces the server has verified and serves, when not `complete`.
        have: Vec<u32>,
    },
    /// More pieces a server still receiving the version has verified since its last frame.
    Have {
        /// Their indexes, at most [`MAX_PIECES`](crate::piece::MAX_PIECES).
        pieces: Vec<u32>,
        /// The server has the whole version now (this is its last frame).
        complete: bool,
    },
    /// On a [`DataRequest::Watch`] stream: the server published `version` of the watched
    /// name; its bytes follow in the frame. The watcher checks them with
    /// [`check_offer`](crate::check_offer) before using them.
    Offer {
        /// The version.
        version: u64,
        /// What its bytes are.
        meta: TensorMeta,
        /// The bytes: `meta.byte_len` of them, at most
        /// [`MAX_INLINE_BYTES`](crate::MAX_INLINE_BYTES), hashing to `meta.hash`.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
    /// The answer to [`DataRequest::Call`] once the server took the call (before it reads
    /// arguments that were not sent inline): [`CallFrame`](crate::call::CallFrame)s follow.
    Accepted {
        /// The function's load on this server, the call included.
        load: crate::call::Load,
        /// The function may run twice: a caller may retry it elsewhere after losing this
        /// server mid-call.
        idempotent: bool,
        /// A streaming function that restarts from any item index: a caller that loses this
        /// server mid-stream starts it again elsewhere from the next item.
        resumable: bool,
        /// A bidirectional function: it takes a stream of inputs
        /// ([`CallUp::Input`](crate::call::CallUp::Input)), granted by
        /// [`CallFrame::InputCredit`](crate::call::CallFrame::InputCredit).
        inputs: bool,
    },
    /// The answer to [`DataRequest::CudaIpc`]: a handle to map (the requester finishes its
    /// send side when done with it), or declined.
    CudaIpc(crate::ipc::IpcResponse),
}

impl DataResponse {
    /// Checks the lengths of an answer that came from the network (the outline's fit to
    /// the version is checked by the puller, which knows the version's size).
    pub fn validate(&self) -> Result<(), crate::piece::PieceError> {
        use crate::piece::{MAX_PIECES, PieceError};
        let too_many = |got: usize| PieceError::TooMany { got };
        match self {
            DataResponse::Outline { values, have, .. } => {
                if values.len() > MAX_PIECES || have.len() > MAX_PIECES {
                    return Err(too_many(values.len().max(have.len())));
                }
                crate::piece::check_indexes(have, values.len())
            }
            DataResponse::Have { pieces, .. } if pieces.len() > MAX_PIECES => {
                Err(too_many(pieces.len()))
            }
            _ => Ok(()),
        }
    }
}

/// Typed failure reasons on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// No such tensor or version.
    NotFound,
    /// Over a size limit.
    TooLarge,
    /// Metadata and data disagree.
    InvalidTensor,
    /// Bytes do not match their hash.
    Corrupt,
    /// The requester is not allowed.
    Unauthorized,
    /// The receiver cannot take it now (inbox full).
    Busy,
    /// The request could not be decoded.
    Malformed,
    /// A bug or unexpected state on the serving side.
    Internal,
    /// The serving node is stopping.
    ShuttingDown,
    /// The serving node serves nothing for this kind of request (a service it does not run).
    Unsupported,
}

impl ErrorCode {
    /// Every error code.
    pub const ALL: [ErrorCode; 10] = [
        ErrorCode::NotFound,
        ErrorCode::TooLarge,
        ErrorCode::InvalidTensor,
        ErrorCode::Corrupt,
        ErrorCode::Unauthorized,
        ErrorCode::Busy,
        ErrorCode::Malformed,
        ErrorCode::Internal,
        ErrorCode::ShuttingDown,
        ErrorCode::Unsupported,
    ];
}

/// QUIC application close codes: the one list of why tensor-broker closes a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum CloseCode {
    /// Normal close.
    Normal = 0,
    /// The node is shutting down.
    Shutdown = 1,
    /// The link was idle past the idle timeout. Sent only while no stream is open on the link
    /// in either direction: a request that raced with it was never served, so the peer
    /// redials and sends it again.
    IdleEvicted = 2,
    /// The link was evicted to make room in the pool. Like `IdleEvicted`, sent only while no
    /// stream is open on the link: the peer redials.
    LruEvicted = 3,
    /// The peer broke the protocol.
    ProtocolError = 4,
    /// The peer failed authentication.
    Unauthorized = 5,
    /// (A stream reset, not a connection close.) The node serving a version it was still
    /// receiving lost that receive: the puller should resume from another holder.
    SourceAborted = 6,
    /// The node is at its limit of connections waiting to authenticate: try again later.
    TooManyHandshakes = 7,
    /// The node's pool is full of links in use: it refuses this connection before serving
    /// any request on it (the dialer's request fails with `TooManyConnections`).
    TooManyConnections = 8,
}

impl CloseCode {
    /// Every close code.
    pub const ALL: [CloseCode; 9] = [
        CloseCode::Normal,
        CloseCode::Shutdown,
        CloseCode::IdleEvicted,
        CloseCode::LruEvicted,
        CloseCode::ProtocolError,
        CloseCode::Unauthorized,
        CloseCode::SourceAborted,
        CloseCode::TooManyHandshakes,
        CloseCode::TooManyConnections,
    ];

    /// The numeric code.
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// Parses a numeric code; `None` for codes this version does not know.
    pub const fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => CloseCode::Normal,
            1 => CloseCode::Shutdown,
            2 => CloseCode::IdleEvicted,
            3 => CloseCode::LruEvicted,
            4 => CloseCode::ProtocolError,
            5 => CloseCode::Unauthorized,
            6 => CloseCode::SourceAborted,
            7 => CloseCode::TooManyHandshakes,
            8 => CloseCode::TooManyConnections,
            _ => return None,
        })
    }

    /// The reason phrase sent with the close.
    pub const fn reason(self) -> &'static [u8] {
        match self {
            CloseCode::Normal => b"normal",
            CloseCode::Shutdown => b"shutdown",
            CloseCode::IdleEvicted => b"idle",
            CloseCode::LruEvicted => b"evicted",
            CloseCode::ProtocolError => b"protocol error",
            CloseCode::Unauthorized => b"unauthorized",
            CloseCode::SourceAborted => b"source aborted",
            CloseCode::TooManyHandshakes => b"too many handshakes",
            CloseCode::TooManyConnections => b"too many connections",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ContentHash, DType};

    fn name(s: &str) -> TensorName {
        TensorName::new(s).expect("name")
    }

    #[test]
    fn close_codes_round_trip() {
        for (i, c) in CloseCode::ALL.into_iter().enumerate() {
            assert_eq!(c.code() as usize, i);
            assert_eq!(CloseCode::from_code(c.code()), Some(c));
            assert!(!c.reason().is_empty());
        }
        assert_eq!(CloseCode::from_code(CloseCode::ALL.len() as u32), None);
        assert_eq!(CloseCode::from_code(u32::MAX), None);
    }

    #[test]
    fn validate_checks_push_meta_and_pull_range() {
        let pull = |range| DataRequest::Pull {
            name: name("a"),
            version: None,
            range,
        };
        assert_eq!(pull(None).validate(0), Ok(()));
        let fits = ByteRange {
            offset: u64::MAX - 1,
            len: 1,
        };
        assert_eq!(pull(Some(fits)).validate(0), Ok(()));
        let wraps = ByteRange {
            offset: u64::MAX,
            len: 1,
        };
        assert_eq!(pull(Some(wraps)).validate(0), Err(MetaError::Overflow));

        let meta = TensorMeta::new(DType::F32, vec![4], ContentHash::of(&[0; 16])).expect("meta");
        let push = DataRequest::Push {
            name: name("b"),
            meta: meta.clone(),
        };
        assert_eq!(push.validate(16), Ok(()));
        assert_eq!(
            push.validate(15),
            Err(MetaError::TooLarge { len: 16, max: 15 })
        );
        assert_eq!(push.name().map(TensorName::as_str), Some("b"));
        assert_eq!(push.write_action(), Some("pushing a tensor (a publish)"));
        assert_eq!(pull(None).write_action(), None);
        let lie = DataRequest::Push {
            name: name("b"),
            meta: TensorMeta {
                byte_len: 17,
                ..meta
            },
        };
        assert_eq!(
            lie.validate(1 << 20),
            Err(MetaError::ByteLenMismatch {
                expected: 16,
                actual: 17
            })
        );
    }

    #[test]
    fn alpns_are_versioned() {
        assert!(DATA_ALPN.ends_with(b"/1") && CTL_ALPN.ends_with(b"/1"));
        assert_ne!(DATA_ALPN, CTL_ALPN);
    }
}
