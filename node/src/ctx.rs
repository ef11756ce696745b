//! [`NodeCtx`]: what the node's actors and transfer tasks share.

use std::sync::{Arc, atomic::AtomicU64};

use std::future::Future;

use iroh::Endpoint;
use tb_dashboard::{Metrics, TransferKind};
use tb_link::ReadyLinks;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    auth::Admission, budget::ByteBudget, channel::Channels, config::Config, error::Result,
    inbox::Inbox, inflight::Inflight, rate::RateLimiter, store::Store,
};

/// Shared, immutable-after-start context of one node.
#[derive(Debug)]
pub(crate) struct NodeCtx {
    pub(crate) endpoint: Endpoint,
    pub(crate) config: Config,
    pub(crate) store: Store,
    /// Versions being received now, served to peers as they arrive (cut-through).
    pub(crate) inflight: Inflight,
    /// The upload limit every serving stream draws from; `None`: unlimited.
    pub(crate) upload: Option<RateLimiter>,
    /// Pushed tensors waiting for `recv()`; it also keeps the host push budget.
    pub(crate) inbox: Inbox,
    /// Device bytes of pushes received to a device (`Config::push_placement`) or queued.
    pub(crate) device_pushes: ByteBudget,
    /// The process's metrics: pool, transfer and auth counters are its counters (the one
    /// source of truth; `Node::pool_stats` reads them).
    pub(crate) metrics: Arc<Metrics>,
    /// The pool's ready links, readable without asking its actor (which writes them).
    pub(crate) ready: Arc<ReadyLinks>,
    /// Payload bytes sent of versions this node was still receiving (cut-through).
    pub(crate) inflight_bytes_sent: AtomicU64,
    /// Cancelled once, at shutdown: every task and in-flight call watches it.
    pub(crate) cancel: CancellationToken,
    /// Owns every task the node spawns, so shutdown can wait for them.
    pub(crate) tracker: TaskTracker,
    /// What `tb/data/1` (and CUDA IPC) connections get before their hello is verified.
    pub(crate) admission: Admission,
    /// The data channels this node runs and what its peers offered.
    pub(crate) channels: Channels,
    /// Piece outlines being hashed, shared by concurrent requests for one tensor.
    pub(crate) outlines: crate::serve::upload::Outlines,
    /// The subscribers watching names this node publishes (small versions go to them
    /// straight, see [`crate::watch`]).
    pub(crate) watchers: crate::watch::Watchers,
    /// What answers each kind of request on `tb/data/1` (see [`crate::serve::service`]).
    pub(crate) services: crate::serve::Services,
    /// What answers control requests on the same-host socket: a broker's (see
    /// [`crate::SocketCtl`]); none on a node that runs no broker.
    pub(crate) socket_ctl: crate::socket_ctl::SocketCtlSlot,
    /// Tensors lent to one peer each under private names ([`crate::Node::lend`]).
    pub(crate) loans: crate::lend::Loans,
    /// What adds to each heartbeat's stats ([`crate::Node::add_stats_hook`]).
    pub(crate) stats_hooks: StatsHooks,
}

/// The hooks [`crate::Node::add_stats_hook`] added, in order.
#[derive(Default)]
pub(crate) struct StatsHooks(std::sync::Mutex<Vec<crate::StatsHook>>);

impl std::fmt::Debug for StatsHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StatsHooks({})", self.hooks().len())
    }
}

impl StatsHooks {
    fn hooks(&self) -> std::sync::MutexGuard<'_, Vec<crate::StatsHook>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn add(&self, hook: crate::StatsHook) {
        self.hooks().push(hook);
    }

    /// Runs every hook on `stats` (outside the lock: a hook may add another).
    pub(crate) fn apply(&self, stats: &mut tb_proto::NodeStats) {
        let hooks = self.hooks().clone();
        for hook in hooks {
            hook(stats);
        }
    }
}

impl NodeCtx {
    /// Runs one transfer of `kind`, counted in flight while it runs and then by result and
    /// duration.
    pub(crate) async fn timed<T>(
        &self,
        kind: TransferKind,
        transfer: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let timer = self.metrics.start_transfer(kind);
        let result = transfer.await;
        timer.result(result.is_ok());
        result
    }

    /// A stall watchdog for payload bytes moving over QUIC in `direction`, counting them as
    /// they move.
    pub(crate) fn quic_watchdog(
        &self,
        direction: tb_dashboard::Direction,
    ) -> crate::wire::Watchdog {
        let meter = self.metrics.meter(tb_proto::ChannelKind::Quic, direction);
        crate::wire::Watchdog::metered(self.config.stall_timeout, meter)
    }

    /// The meter of payload bytes moving over QUIC in `direction`.
    pub(crate) fn quic_meter(&self, direction: tb_dashboard::Direction) -> tb_dashboard::Meter {
        self.metrics.meter(tb_proto::ChannelKind::Quic, direction)
    }

    /// Each peer with a usable pooled link and the data channel a transfer with it uses now.
    pub(crate) fn links(&self) -> Vec<(iroh::EndpointId, tb_proto::ChannelKind)> {
        let peers = self.ready.peers();
        peers
            .into_iter()
            .map(|p| (p, self.channels.pick(&p)))
            .collect()
    }

    /// Sets the gauges that mirror state: pooled links and the store.
    pub(crate) fn refresh_metrics(&self) {
        let (active, idle) = self.ready.counts();
        let (tensors, bytes) = self.store.usage();
        let m = &self.metrics;
        m.pool_links_active.set(gauge(active as u64));
        m.pool_links_idle.set(gauge(idle as u64));
        m.store_tensors.set(gauge(tensors as u64));
        m.store_bytes.set(gauge(bytes));
    }
}

/// A count as a gauge value (saturating).
pub(crate) fn gauge(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
