//! # tb-link: authenticated, pooled links
//!
//! What a tensor-broker process needs to talk to its peers, and nothing of what it says:
//! the offline iroh endpoint, the cluster-secret hello that opens every `tb/` connection, the
//! byte budgets that bound what a peer can make a node hold, cluster tickets, frames on QUIC
//! streams, and the pool of links to peers. tb-node (the tensor data plane) and the broker's
//! control protocol sit on it; it knows nothing of tensors, requests or data channels.
//!
//! ## Parts
//! - [`endpoint`]: binding the offline endpoint ([`bind_endpoint`]), identity keys
//!   ([`load_or_create_key`]), the address users copy around ([`PeerAddr`],
//!   `<node-id>@<ip:port>`), and QUIC flow control: the pre-auth limits every connection
//!   starts with, which [`open_link`] raises once the hello is verified.
//! - [`auth`]: the hello (`client_hello`, `server_hello`), what a server grants connections
//!   before it (`Admission`), and the [`Access`](tb_proto::Access) each side proved.
//! - [`budget`]: [`ByteBudget`](budget::ByteBudget), bytes reserved before they are allocated.
//! - [`Ticket`]: the brokers of a cluster, as one string (`tbc1:...`).
//! - [`framing`]: reading and writing length-prefixed frames, limits checked before
//!   allocating, every server write bounded.
//! - [`Pool`]: the pool of links, its guards ([`LinkGuard`]), its figures ([`PoolStats`]),
//!   and [`LinkEvents`], through which its owner hears of new and lost links.
//! - [`LinkConfig`] (the limits all of these read) and [`Error`] (what a caller can act on).
//!
//! ## Supervision tree
//! ```text
//! owner (tb-node's Node) ── PoolActor   owns the pool: peer id -> PeerActor
//!                            ├── PeerActor   one per QUIC link: pooled (dialed or adopted),
//!                            │               or superseded by another and closed once idle;
//!                            │               at most `MAX_LINKS_PER_PEER` per peer (a new
//!                            │               one closes the peer's oldest)
//!                            └── PeerActor   stops on idle timeout, eviction, or link loss
//! owner's TaskTracker ───── dial tasks      one per dial: connect, hello, the owner's
//!                                           `LinkEvents::dialed`, then cast back
//! ```
//! Actors decide; tasks move bytes. The `PoolActor` never waits on a child: dials run in
//! tasks that `cast` back, a [`LinkGuard`]'s `Drop` only casts, and the owner's hooks return
//! at once (or, for `dialed`, run in the dial's task). Every link is adopted or refused: a
//! connection that reaches the pool is pooled, kept superseded until unused, or closed with
//! `TooManyConnections` before anything is served on it. The bookkeeping is plain data
//! (`pool::book`), tested without actors or sockets.
//!
//! ## How a link is made
//! A caller asks [`Pool::acquire`] for a link to a [`PeerAddr`]: a usable pooled link is
//! guarded straight from a read replica, without a trip through the actor; otherwise the
//! actor joins a dial in flight or starts one. The dial task connects on `tb/data/1`, runs the
//! hello, lets the owner make its first exchange, and casts the link back; the actor puts it
//! under a new `PeerActor`, answers the waiters and hands it to the owner to serve. A peer
//! that dials us is met by the owner's protocol handler, which runs `auth::server_hello` and
//! asks [`Pool::adopt`] for the link to serve.

pub mod auth;
pub mod budget;
mod config;
pub mod endpoint;
mod error;
pub mod framing;
mod pool;
mod ticket;

pub use config::{DEFAULT_HELLO_TIMEOUT, DEFAULT_MAX_PENDING_HANDSHAKES, LinkConfig};
pub use endpoint::{
    KEY_FILE, PeerAddr, bind_endpoint, load_or_create_key, local_peer_addr, open_link,
};
pub use error::{Error, Result};
pub use pool::{
    EventFuture, Link, LinkEvents, LinkGuard, MAX_LINKS_PER_PEER, Pool, PoolArgs, PoolStats,
    ReadyLinks,
};
pub use ticket::{MAX_TICKET_BROKERS, TICKET_PREFIX, Ticket, TicketError};
