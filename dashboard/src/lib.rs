//! tensor-broker's observability: what every process (`tb-broker`, `tb-worker`) reports about
//! itself and how it is served.
//!
//! - [`Metrics`] (`metrics.rs`): every Prometheus metric family, defined once and registered
//!   in a registry of the process's own (tests run several nodes in one process), labelled
//!   families initialised to zero, plus the process collector and
//!   `tb_build_info{version,role}`. Node and broker code increment its counters directly:
//!   they are atomics, so the data path takes no lock; a transfer is timed with a
//!   [`TransferTimer`].
//! - [`ChannelMetrics`] (`channel.rs`, the `channels` field of [`Metrics`]): bytes, transfers
//!   and fallbacks by data channel (`tb_channel_*_total`).
//! - [`ThroughputWindow`] and [`quantile`] (`window.rs`): pure figures derived from the
//!   counters — bytes per second over the last 10 s (the process samples once a second with
//!   [`Metrics::run_sampler`]) and latency quantiles estimated from the duration histogram's
//!   buckets.
//! - [`api`]: the JSON shapes of `/api/v1/status` and `/api/v1/cluster` (paged: [`api::Page`]).
//! - [`AppState`] and [`Source`] (`source.rs`): what a process hands its server, its metrics
//!   and the figures only it knows. Outside the `server` feature, so a library (the broker's
//!   `Broker::dashboard`) says what it would show without compiling axum.
//! - [`HttpOptions`] (`access.rs`, feature `server`): the server's guards: a bearer token
//!   ([`HttpToken`]) on `/api/v1/*`, and a concurrency limit beyond which requests are shed
//!   with 503.
//! - The server (`server.rs`, feature `server`, on by default): [`serve`] runs axum on a
//!   bound listener with the routes
//!   `/metrics` (text format), `/healthz`, `/readyz`, `/api/v1/status`, `/api/v1/cluster`
//!   (brokers; 404 elsewhere), and the web dashboard at `/` with its files under `/assets/`
//!   (embedded from `dashboard/assets/`, so the page works with no internet).
//!
//! Data flow: the process increments counters as it works; on each scrape or API call the
//! server asks the process's [`Source`] to [`refresh`](Source::refresh) the gauges that mirror
//! state (pool links, store size, registry size, cluster liveness), then encodes. A source
//! answers from what it already holds (a broker: the registry snapshot its actor publishes),
//! never by asking an actor per request. This crate
//! depends on neither `tb-node` nor `tb-broker`: they implement [`Source`].

#[cfg(feature = "server")]
mod access;
pub mod api;
#[cfg(feature = "server")]
mod assets;
mod channel;
mod metrics;
#[cfg(feature = "server")]
mod server;
mod source;
mod window;

#[cfg(feature = "server")]
pub use access::{
    DEFAULT_MAX_IN_FLIGHT, HttpOptions, HttpToken, MIN_TOKEN_LEN, TOKEN_RECIPE, TokenError,
};
pub use channel::{ChannelMetrics, Direction};
pub use metrics::{
    AuthFailure, AuthFailures, Meter, Metrics, MetricsError, Role, SAMPLE_PERIOD, TransferKind,
    TransferTimer, VERSION,
};
/// The counter and gauge types of [`Metrics`]' fields (processes keep clones of them).
pub use prometheus::{IntCounter, IntGauge};
#[cfg(feature = "server")]
pub use server::{bind, router, serve};
pub use source::{AppState, RefreshFuture, Source};
pub use window::{Rates, ThroughputWindow, WINDOW, quantile};

/// Default `--metrics-addr` of `tb-broker`.
pub const DEFAULT_BROKER_ADDR: &str = "127.0.0.1:9410";
/// Default `--metrics-addr` of `tb-worker`.
pub const DEFAULT_WORKER_ADDR: &str = "127.0.0.1:9420";
