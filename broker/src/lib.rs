//! # tb-broker: what a broker decides, and what it keeps on disk
//!
//! A broker keeps a replica of the registry (which versions of which names exist, who holds
//! them, which nodes are alive), answers look-ups, judges worker liveness and fans new versions
//! out to subscribers. This crate holds that logic as plain data, fed explicit time and tested
//! without actors or sockets; the `BrokerActor` (to come) is a thin shell that feeds it
//! requests, gossip and ticks, and carries out what it returns.
//!
//! - [`BrokerState`]: the decisions. It owns the [`Registry`](tb_proto::Registry) replica, the
//!   broker's [`Hlc`](tb_proto::Hlc) and local bookkeeping (when each worker was last heard,
//!   which fetches are in flight and from whom). Its methods map onto the `tb/ctl/1` requests
//!   and the gossip: [`announce`](BrokerState::announce), [`heartbeat`](BrokerState::heartbeat),
//!   [`next_version`](BrokerState::next_version), [`lookup`](BrokerState::lookup),
//!   [`fetching`](BrokerState::fetching), [`list`](BrokerState::list),
//!   [`members`](BrokerState::members), [`remote_op`](BrokerState::remote_op),
//!   [`merge_entries`](BrokerState::merge_entries), [`leave`](BrokerState::leave) (a node
//!   that closed its connection at shutdown), and the periodic
//!   [`expire`](BrokerState::expire) (liveness, and forgetting the rows of nodes gone).
//! - [`Changes`]: what one of those calls changed: ops to gossip, names and members to persist,
//!   [`Event`](tb_proto::Event)s for subscribers ([`matching`] picks the subscriptions).
//! - [`BrokerConfig`]: retention, liveness timeout, when rows of nodes gone are forgotten,
//!   fan-out width, size limit, anti-entropy byte budget.
//! - [`BrokerCounters`]: what the broker counted; [`Refusals`] are exported as
//!   `tb_broker_refused_total{reason}`.
//! - [`BrokerError`]: why a request or op was refused, with its wire code.
//! - [`RegistryStore`]: the replica in sled, reloaded on restart, and the broker's epoch.
//!
//! Data flow, for one request: the actor authenticates the peer, decodes and validates the
//! request, calls the matching [`BrokerState`] method with the sender's id and the wall clock,
//! answers the request, then carries out the [`Changes`]: [`RegistryStore::save_changed`],
//! broadcast each `gossip` op, send each event to the subscriptions it matches. Gossip from
//! other brokers goes through [`BrokerState::remote_op`], anti-entropy replies through
//! [`BrokerState::merge_entries`], and a timer calls [`BrokerState::expire`]; their
//! [`Changes`] are carried out the same way. On start, the actor opens the store, bumps the
//! epoch, loads the registry and builds [`BrokerState::new`] from it.
//!
//! The process around a broker (flags, logging, signals, the metrics HTTP server and the
//! `tb-broker` binary) is the `tb-daemon` crate's, so a program that embeds a broker (the
//! Python package's `LocalCluster`) compiles no clap, tracing-subscriber or axum, and this
//! crate has no `anyhow` of its own. [`Broker::dashboard`] only says what that server would
//! show, as a `tb_dashboard::AppState`.
//!
//! ```
//! use tb_broker::{BrokerConfig, BrokerState};
//! use tb_proto::{ContentHash, DType, NodeId, Registry, Role, TensorMeta, TensorName};
//!
//! let (broker, worker, reader) = (NodeId([1; 32]), NodeId([2; 32]), NodeId([3; 32]));
//! let mut state = BrokerState::new(broker, BrokerConfig::default(), Registry::new(), 1_000);
//! state.heartbeat(worker, Role::Worker, vec!["10.0.0.2:4433".into()], 1, 1_000)?;
//!
//! let name = TensorName::new("model/w")?;
//! let meta = TensorMeta::new(DType::F32, vec![2, 2], ContentHash([0; 32]))?;
//! let (version, changes) = state.publish(name.clone(), meta, worker, 1_001);
//! assert_eq!(version, 1);
//! assert_eq!(changes.gossip.len(), 2); // the publish and the publisher's holder mark
//!
//! let found = state.lookup(&name, None, reader, 1_002)?;
//! assert_eq!(found.holders[0].node, worker);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod actor;
mod beat;
mod broker;
mod config;
mod ctl;
mod error;
mod events;
mod fanout;
mod gossip;
mod metrics;
mod observe;
mod persist;
mod state;
mod sync;

pub use actor::SNAPSHOT_PERIOD;
pub use broker::{Broker, BrokerOptions, StartError};
pub use config::{BrokerConfig, DEFAULT_FORGET_PERIOD_MS, DEFAULT_MAX_SYNC_BYTES};
pub use ctl::{MAX_CTL_CONNECTIONS_PER_PEER, MAX_SUBSCRIPTIONS_PER_PEER};
pub use error::BrokerError;
pub use events::{event_for, matching};
pub use metrics::{BrokerCounters, Counter, MemberStatsBook, Refusal, Refusals};
pub use persist::{FORMAT_VERSION, LOCK_WAIT, PersistError, RegistryStore};
pub use state::{BrokerState, Changes, Holders, MAX_VERSION_SKIP};
pub use sync::SyncStats;
pub use tb_link::{Ticket, TicketError};
