//! # tb-daemon: the processes around a node and a broker
//!
//! tensor-broker's libraries (`tb-node`, `tb-broker`) are the data plane, the cluster client
//! and the registry; this crate is what turns them into long-running processes, and holds
//! both daemon binaries:
//!
//! - `tb-worker` (`src/bin/tb-worker.rs`): one worker, a [`tb_node::Node`] that holds tensors,
//!   serves them to peers and heartbeats to the brokers;
//! - `tb-broker` (`src/bin/tb-broker.rs`): one broker, a [`tb_broker::Broker`] that keeps the
//!   replicated registry.
//!
//! The `tb` command (tb-cli) uses the same pieces for `tb up`, which runs brokers and workers
//! in one process, and waits for Ctrl-C with [`wait_for_signal`] in `tb watch`.
//!
//! ## Why a crate of its own
//! Flag parsing (clap), installing a log subscriber (tracing-subscriber), an HTTP server
//! (axum, through tb-dashboard's `server` feature), signals and `anyhow` in `main` are process
//! concerns. A program that embeds a node, and the Python wheel (which embeds a node, and a
//! broker for `LocalCluster`), compile none of them: they depend on tb-node and tb-broker,
//! which know nothing of processes, and CI checks both dependency trees. As a crate rather
//! than a feature of tb-node, the layering is held by the compiler, not by convention.
//!
//! ## What is here
//! - `setup.rs`: from flags to what a daemon starts with: the flags every daemon takes
//!   ([`SecretArgs`], [`HttpArgs`]), the data dir ([`data_dir`]), the cluster key
//!   ([`cluster_key`]; no secret is refused unless `--insecure-open`), every failure a
//!   [`SetupError`] that names the flag or file, printed by [`exit_with`].
//! - [`init_logging`] and [`LogFormat`] (`logging.rs`): logs on stderr, text or JSON lines.
//! - [`MetricsServer`] (`metrics_server.rs`): the HTTP server's lifecycle in a process (bound
//!   first, started once the node is up, stopped at shutdown); routes are tb-dashboard's.
//! - [`node_dashboard`] (`observe.rs`): what a worker's server shows (a broker's is
//!   `Broker::dashboard`, in tb-broker, which reads the broker's internals).
//! - [`wait_for_signal`] (`signal.rs`): SIGINT or SIGTERM.
//! - [`publish_pushes`] (`worker.rs`): a worker publishes what is pushed to it.
//!
//! ## How a daemon runs
//! Each `main` is thin, flags mapped onto a `Config` and nothing more: parse the flags,
//! [`init_logging`], read the cluster key first ([`SecretArgs::key_or_exit`]: without a secret
//! nothing starts), make the [`data_dir`], bind the [`MetricsServer`] (a worker puts its URL in
//! its `Config`), spawn the node or broker, print the lines scripts wait for (`worker: ...`,
//! `ticket: ...`, `metrics: ...`), start serving its dashboard, then [`wait_for_signal`] and
//! stop the server and the node in that order.

mod logging;
mod metrics_server;
mod observe;
mod setup;
mod signal;
mod worker;

pub use logging::{LogFormat, init_logging};
pub use metrics_server::MetricsServer;
pub use observe::node_dashboard;
pub use setup::{HttpArgs, SecretArgs, SetupError, cluster_key, data_dir, exit_with};
pub use signal::wait_for_signal;
pub use worker::publish_pushes;
