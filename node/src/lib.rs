//! # tb-node: the tensor-broker data plane
//!
//! A [`Node`] holds tensors and moves them peer to peer over pooled, encrypted iroh QUIC
//! connections. One node per process (several in tests). The links themselves — the offline
//! endpoint, the cluster-secret hello, byte budgets, tickets, framing and the pool — are the
//! [`tb_link`] crate below this one, which knows nothing of tensors; this crate re-exports
//! what its users name of it ([`PeerAddr`], [`Ticket`], [`auth`], [`budget`], [`framing`],
//! [`LinkGuard`], [`PoolStats`]).
//!
//! ## Main types
//! - [`Node`]: the handle users hold — `push`, `publish_local`, `pull`, `pull_into`, `recv`,
//!   `wait_for`, `shutdown`, pool statistics; and, with brokers configured, the cluster API:
//!   `publish`, `get`, `get_version`, `get_into`, `delete`, `list`, `members`, `subscribe`.
//! - [`TransferProgress`]: the bytes a `push_with_progress` or `get_with_progress` has moved
//!   so far, for progress bars (one relaxed atomic per chunk on the data path).
//! - [`Subscription`] and [`SubEvent`]: the versions (and deletes) of names matching a pattern,
//!   in order per name, fetched when `Config::auto_fetch` is on, gaps reported as `Skipped`.
//! - [`Tensor`]: dtype, shape and shared immutable bytes, BLAKE3-hashed when made; the bytes
//!   live in host memory or on a CUDA device ([`Device`], [`DeviceBuffer`]).
//! - [`PeerAddr`]: a peer's `<node-id>@<ip:port>`, the string users copy around.
//! - [`Config`]: every knob; `Config::default()` is the offline single-machine setup.
//! - [`Error`]: one variant per thing a caller can act on.
//! - [`budget::ByteBudget`]: the bytes peers may make a node hold (pushes being received or
//!   waiting in the inbox), reserved before anything is allocated.
//!
//! ## Supervision tree
//! ```text
//! Node (handle) ── tb_link::Pool        the pool's actor and one PeerActor per link (its
//!                                       tree is drawn in tb-link); it hears of links
//!                                       through `links::NodeLinks` (channel exchange on a
//!                                       dialed link, serving it, forgetting a gone one)
//! iroh Router ──── DataProtocol         accepts tb/data/1 connections, runs the hello and
//!                                       asks the pool to adopt them (or it refuses a new
//!                                       peer's when the pool is full of busy peers)
//! TaskTracker ──── dial / serve tasks   every spawned task, joined at shutdown
//!              ├── heartbeats           to the current broker, every `heartbeat_interval`
//!              ├── eviction announcer   `RemoveHolder` for versions retention dropped
//!              ├── TTL sweep            with `Config::version_ttl`
//!              └── per subscription     a reader (broker events) and a deliverer (fetches)
//! ```
//! Actors decide; tasks move bytes. The pool's actor never waits on a child or on this
//! crate: dials run in tasks that `cast` back, a [`LinkGuard`]'s `Drop` only casts, and the
//! node's link hooks return at once (the channel exchange runs in the dial's task).
//!
//! ## How a pull flows
//! `Node::pull` asks the pool for a link guard (reusing a pooled link, joining a dial in
//! flight, or starting one), opens a bi-stream, writes a `Pull` frame, reads the `Header`
//! frame, lets the caller supply the destination buffer, reads the payload straight into it
//! while hashing, and checks the BLAKE3 hash before returning. The serving side
//! (`serve`) reads each stream's first frame, admits it once (the peer's access, the node's
//! limits) and hands it to the [`Service`] its request kind is registered to in the node's
//! table; the built-in pull service answers from the [`Store`] with slices of the shared
//! bytes, no copies. A crate above this one serves a new kind with [`Node::add_service`]; a
//! kind nobody serves is answered `Unsupported`. To move a large value beside its own
//! stream, it lends the tensor to the one peer ([`Node::lend`]: a private name, one pull,
//! never in the store) and that peer pulls it with [`Node::pull_lent`] (the pair's channel
//! first: on one host, the lender's sealed memfd).
//!
//! ## How a cluster get flows
//! `Node::get` asks the current broker (`tb/ctl/1`, one reused connection per broker, failing
//! over to the next broker in `Config::brokers`) where the newest version is, pulls it from the
//! holders it names, best first, over the same pooled `tb/data/1` links (a holder that fails
//! mid-transfer is replaced by the next one, which sends only the missing bytes), verifies the
//! hash, stores the version and announces that this node holds it. `Node::publish` asks the
//! broker for the next version, stores the tensor under it and announces it. When retention
//! evicts a version, a task tells the broker.
//!
//! On one host, three shortcuts take the shm channel's unix socket instead of QUIC:
//! - a broker on this node's host is asked on the socket (`DataRequest::Ctl`; the broker
//!   registers a [`SocketCtl`] on its node with [`Node::serve_ctl_on_socket`]), learnt in the
//!   background, with QUIC whenever the socket fails; a subscription streams the broker's
//!   events on a connection of its own, and one opened on QUIC moves there once the broker
//!   is known to be local;
//! - a subscriber watches a version's publisher (`Watch`): small versions ride inline beside
//!   the publish, and larger ones come as the publisher's sealed memfd, mapped without a
//!   look-up or a pull;
//! - a pull of a memfd-backed version passes the fd, with no copy.
//!
//! ## GPU tensors (feature `cuda`, on by default)
//! A tensor may live on a CUDA device ([`Tensor::from_device`], [`Tensor::to_device`]). It is
//! published, pushed and served like any other; [`Node::pull_to`] and
//! [`Node::pull_into_device`] receive into device memory. Device bytes cross the network
//! through pinned host staging buffers, copies overlapping the network; between two nodes on
//! one host a device-to-device pull uses CUDA IPC instead, and a host-held version comes over
//! the pair's channel and is copied up once (one route decision, in `channel`). The
//! driver is loaded at run time: a build with the feature runs everywhere, and a missing
//! driver or device is [`Error::DeviceUnavailable`]. Freed device allocations are kept for
//! reuse, per device and process, up to `TB_CUDA_POOL_MIB` MiB (default 1024; `0` keeps
//! none), so a transfer that repeats exports the same allocation by CUDA IPC again. See
//! [`device`] for the details.
//!
//! CUDA IPC is a channel beside shm and tcp: a request kind (`DataRequest::CudaIpc`, its
//! messages in `tb_proto::ipc`) served through the table on the pooled `tb/data/1` link.
//! A device tensor lent to one peer ([`Node::lend_device`], unhashed) is pulled onto a
//! device with [`Node::pull_lent_to`]: by CUDA IPC on one host (never between nodes of one
//! process: the driver cannot map memory into the process that exported it).
//!
//! ## The process around a node: tb-daemon
//! Flags, logging set-up, signals, the metrics HTTP server, the worker's dashboard source and
//! the `tb-worker` binary are process concerns, and live in the `tb-daemon` crate above this
//! one. This crate is the data plane and the cluster client only, for a program that embeds a
//! node (the Python package): no clap, tracing-subscriber, axum or anyhow is compiled (CI
//! checks the dependency tree). [`rate`]'s size and rate parsers, which the daemons' flags
//! use, are here because they are pure and need nothing; so is [`Node::link_views`], which
//! both the worker's and the broker's dashboards show.

mod channel;
mod client;
mod cluster;
mod config;
mod ctx;
pub mod device;
pub mod discover;
mod error;
mod inbox;
mod inflight;
mod lend;
mod links;
mod node;
mod observe;
mod private;
mod progress;
pub mod rate;
mod request;
pub mod runtime;
mod serve;
mod set;
mod socket_ctl;
mod store;
mod tensor;
mod watch;
mod wire;

/// Test hook: makes every later mapping of a sealed memfd in this process fail, as on a
/// kernel that refuses it (the shm channel then switches itself off).
#[cfg(target_os = "linux")]
#[doc(hidden)]
pub use channel::{VIEW_COPY_MAX, force_map_failures_for_tests};
/// Fuzzing hooks (`node/fuzz`): the same-host request connection's chunk reader and writer.
#[cfg(target_os = "linux")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::channel::{ChunksRead, frame_chunks, read_chunks};
}
pub use client::{Pulled, RequestStream};
pub use cluster::{MembersView, SubEvent, Subscription};
pub use config::{
    Config, DEFAULT_MAX_TENSOR_BYTES, DEFAULT_MIN_SOURCE_RATE, FALLBACK_PUSH_DEVICE_MEMORY,
    FALLBACK_PUSH_MEMORY, PUSH_DEVICE_MEMORY_SHARE, PUSH_MEMORY_SHARE, SecretFileError,
    default_max_push_memory, parse_secret, read_secret_file,
};
/// The cudarc this crate is built against: [`DeviceBuffer::from_cuda_slice`] and
/// [`DeviceBuffer::cuda_slice`] take and give its `CudaSlice`, so an embedder that hands
/// device memory in or out names these types through this re-export (same version, no
/// second copy of cudarc).
#[cfg(feature = "cuda")]
pub use cudarc;
pub use device::{CUDA_COMPILED, CudaConfig, Device, DeviceBuffer, DeviceInfo};
pub use error::{BrokerFailure, Error, Result};
pub use inbox::Received;
pub use lend::{LEND_PREFIX, LENT_VERSION, Lent, MAX_LOANS, is_lent_name};
pub use node::{Node, PUSH_BYTES_STREAMED_MAX, WeakNode, bind_endpoint};

/// What [`Node::add_stats_hook`] takes: adds to the stats of a heartbeat.
pub type StatsHook = std::sync::Arc<dyn Fn(&mut tb_proto::NodeStats) + Send + Sync>;
pub use private::PrivateBytes;
pub use progress::TransferProgress;
pub use request::{RequestRecv, RequestSend, Stopped};
pub use serve::service::{LocalStream, ServeCtx, Service, ServiceFuture, ServiceStream};
pub use set::TensorSet;
pub use socket_ctl::{CtlAnswer, CtlFrames, CtlSubscribed, SocketCtl};
pub use store::{Inserted, Lookup, Retention, Store};
/// Why a peer was refused before authenticating (what `auth::server_hello` reports).
pub use tb_dashboard::AuthFailure;
/// The link layer this crate sits on, as its users name it: the hello and roles
/// ([`auth`]), byte budgets ([`budget`]), frames on QUIC streams ([`framing`], for protocols
/// served beside `tb/data/1`, such as the broker's `tb/ctl/1`), peer addresses, keys,
/// tickets and the pool's guard and figures. The rest of it (flow-control constants, the
/// ticket format's limits) is [`tb_link`]'s own.
pub use tb_link::{
    DEFAULT_HELLO_TIMEOUT, LinkConfig, LinkGuard, MAX_LINKS_PER_PEER, PeerAddr, PoolStats, Ticket,
    TicketError, auth, budget, framing, load_or_create_key, open_link,
};
pub use tb_proto as proto;
pub use tb_proto::{
    ContentHash, DType, ListedEntry, Member, NamePattern, Role, TensorMeta, TensorName,
};
pub use tensor::Tensor;
