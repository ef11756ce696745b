//! The node side of the cluster: a client of the brokers' `tb/ctl/1` and the cluster API on
//! [`Node`](crate::Node) (`publish`, `get`, `get_version`, `delete`, `list`, `members`,
//! `subscribe`).
//!
//! - `ctl_client`: one reused ctl connection per broker, requests with failover (`failover`
//!   holds the pure order and error rules, `race` the staggered race across brokers); `calls`: one typed method per request;
//!   `members` merges the membership tables of several brokers (`tb status`).
//! - [`Cluster`]: what the API needs besides the data plane: the client, this node's id,
//!   epoch, advertised addresses and the clock that stamps the registry ops it announces.
//! - `get` (`get/{mod,sources,pieces,one_stream}.rs`) and `resume`: a get of a version of at
//!   least 16 MiB takes it in pieces from the broker's set of sources at once, each piece
//!   checked against the version's outline (`get::pieces`); a smaller one (or one no source
//!   offers in pieces) is pulled in one stream (`get::one_stream`) from the holders a broker
//!   names, best first, resuming at the byte it reached when a holder fails
//!   (`Pull { range }`), verified by hash; while it pulls it asks the broker again now and
//!   then, and moves to the source the broker names or away from one that `pace` judges
//!   slow. `get_into` does the same into the caller's buffer (`Node::get_into`). Every get
//!   starts at `held` (this node's copy is returned only when its hash is the registry's),
//!   keeps its holders' record in `tries` (who is dropped, who is asked for the whole
//!   version again after bytes from several sources did not hash right), and hands its
//!   fan-out slot back through `slot` however it ends.
//! - `subscribe`: a [`Subscription`] reads a broker's events, keeps per-name order, reports
//!   gaps as [`SubEvent::Skipped`], fetches the newest pending version of each name, and moves
//!   to the next broker when its broker goes away.
//! - `background`: heartbeats, announcing versions retention evicted, the TTL sweep; tasks
//!   owned by the node's `TaskTracker`, stopped at shutdown.
//!
//! Registry ops carry this node's id as publisher or holder and a stamp of its own clock; the
//! broker checks the id and restamps them with its clock.

mod api;
mod background;
mod calls;
mod ctl_client;
mod failover;
mod functions;
mod get;
mod get_into;
mod get_to;
mod held;
mod members;
mod pace;
mod race;
mod resume;
#[cfg(target_os = "linux")]
mod same_host;
mod slot;
mod subscribe;
#[cfg(test)]
mod tests;
mod tries;

use std::{
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tb_proto::{Hlc, NodeId, RegistryOp, Stamp, TensorMeta, TensorName};
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tracing::debug;

use self::{calls::Holders, ctl_client::CtlClient};
pub use self::{
    members::MembersView,
    subscribe::{SubEvent, Subscription},
};
use crate::{
    PeerAddr, auth,
    config::Config,
    ctx::NodeCtx,
    error::{Error, Result},
    store::{Evicted, Retention, Store},
};

/// Milliseconds since the Unix epoch by the wall clock (0 if it is before 1970).
pub(crate) fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The store a node with `config` runs, and the receiver of its eviction reports when the node
/// has brokers to tell.
pub(crate) fn store_for(config: &Config) -> (Store, Option<UnboundedReceiver<Evicted>>) {
    let retention = Retention {
        keep_versions: config.keep_versions,
        keep_versions_for: config.keep_versions_for.clone(),
        ttl: config.version_ttl,
    };
    if config.brokers.is_empty() {
        return (Store::with_retention(retention), None);
    }
    let (tx, rx) = mpsc::unbounded_channel();
    (Store::with_eviction_sink(retention, tx), Some(rx))
}

/// Starts the cluster side of a node: the client and the heartbeat and retention tasks when
/// `config.brokers` is not empty (else `None`), and the TTL sweep when there is a TTL.
pub(crate) fn start(
    ctx: &Arc<NodeCtx>,
    addr: &PeerAddr,
    evictions: Option<UnboundedReceiver<Evicted>>,
) -> Option<Arc<Cluster>> {
    let cluster = match ctx.config.brokers.is_empty() {
        true => None,
        false => Some(Arc::new(Cluster::new(ctx, addr))),
    };
    background::start(ctx, cluster.as_ref(), evictions);
    cluster
}

/// The cluster client of one node.
#[derive(Debug)]
pub(crate) struct Cluster {
    pub(crate) ctl: CtlClient,
    me: NodeId,
    /// This process's life: the wall clock in ms at start, so it grows across restarts.
    epoch: u64,
    /// `ip:port` strings peers reach this node at.
    addrs: Vec<String>,
    hlc: Mutex<Hlc>,
    /// Whether a heartbeat got through since start.
    joined: AtomicBool,
    /// Whether this node is a member that serves what it holds (it heartbeats). A node that
    /// does not (a short-lived client such as the `tb` CLI) never announces that it holds or
    /// is fetching a version: it would leave a holder behind that no broker can ever judge dead.
    serves: bool,
    request_timeout: Duration,
    heartbeat_timeout: Duration,
    /// The node's context, for the stats heartbeats carry (weak: the node owns the cluster).
    ctx: Weak<NodeCtx>,
}

impl Cluster {
    fn new(ctx: &Arc<NodeCtx>, addr: &PeerAddr) -> Self {
        let config = &ctx.config;
        let me = auth::node_id(&addr.id);
        let addrs = match config.advertise_addrs.is_empty() {
            true => vec![addr.addr.to_string()],
            false => config
                .advertise_addrs
                .iter()
                .map(|a| a.to_string())
                .collect(),
        };
        // A heartbeat that takes longer than two periods is as good as lost: try another broker
        // before the broker's liveness timeout runs out.
        let heartbeat_timeout = config
            .request_timeout
            .min(config.heartbeat_interval.max(Duration::from_millis(500)) * 2);
        Cluster {
            ctl: CtlClient::new(ctx),
            me,
            epoch: wall_ms(),
            addrs,
            hlc: Mutex::new(Hlc::new(me)),
            // A node that does not heartbeat never joins: nothing to wait for.
            joined: AtomicBool::new(!config.heartbeats),
            serves: config.heartbeats,
            request_timeout: config.request_timeout,
            heartbeat_timeout,
            ctx: Arc::downgrade(ctx),
        }
    }

    /// Whether a heartbeat got through since start (always, for nodes that do not heartbeat).
    pub(crate) fn joined(&self) -> bool {
        self.joined.load(Ordering::Relaxed)
    }

    /// This node's id as the registry spells it.
    pub(crate) fn me(&self) -> NodeId {
        self.me
    }

    /// A fresh stamp of this node's clock.
    fn stamp(&self) -> Stamp {
        let mut hlc = self.hlc.lock().unwrap_or_else(|p| p.into_inner());
        hlc.now(wall_ms())
    }

    /// The ops announcing that this node published `version` of `name` and holds it.
    fn publish_ops(&self, name: &TensorName, version: u64, meta: &TensorMeta) -> Vec<RegistryOp> {
        vec![
            RegistryOp::Publish {
                name: name.clone(),
                version,
                meta: meta.clone(),
                publisher: self.me,
                stamp: self.stamp(),
            },
            self.holder_op(name, version, true),
        ]
    }

    /// The op announcing that this node holds (`present`) or dropped `version` of `name`.
    fn holder_op(&self, name: &TensorName, version: u64, present: bool) -> RegistryOp {
        RegistryOp::holder(name.clone(), version, self.me, self.stamp(), present)
    }

    /// The op announcing that this node deletes `name`.
    fn delete_op(&self, name: &TensorName) -> RegistryOp {
        RegistryOp::Delete {
            name: name.clone(),
            stamp: self.stamp(),
        }
    }

    /// Tells the current broker (failing over) that this node is alive and where.
    async fn heartbeat(&self) -> Result<()> {
        let addrs = self.addrs.clone();
        let stats = self.ctx.upgrade().map(|ctx| {
            ctx.refresh_metrics();
            let mut stats = ctx.metrics.node_stats(ctx.config.metrics_url.clone());
            stats.links = crate::cluster::stats_links(&ctx.links());
            stats.upload_limit = ctx.config.max_upload_rate;
            ctx.stats_hooks.apply(&mut stats);
            stats
        });
        let sent = self
            .ctl
            .heartbeat(addrs, self.epoch, stats, self.heartbeat_timeout)
            .await;
        if sent.is_ok() {
            self.joined.store(true, Ordering::Relaxed);
        }
        sent
    }

    /// Sends a heartbeat now unless one got through already, so that a broker knows this
    /// node's address before it names the node as a holder. Only "no broker" is an error here;
    /// anything else shows again in the call that follows.
    async fn ensure_joined(&self) -> Result<()> {
        if self.joined.load(Ordering::Relaxed) {
            return Ok(());
        }
        match self.heartbeat().await {
            Err(e @ Error::NoBroker { .. }) => Err(e),
            Err(e) => {
                debug!(%e, "first heartbeat refused");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    async fn announce(&self, ops: Vec<RegistryOp>) -> Result<()> {
        self.ctl.announce(ops, self.request_timeout).await
    }

    /// [`announce`](Self::announce) of a publish (`ops[0]`) with its bytes.
    async fn announce_inline(&self, ops: Vec<RegistryOp>, bytes: Vec<u8>) -> Result<()> {
        self.ctl
            .publish_inline(ops, bytes, self.request_timeout)
            .await
    }

    async fn next_version(&self, name: &TensorName) -> Result<u64> {
        self.ctl.next_version(name, self.request_timeout).await
    }

    async fn lookup(&self, name: &TensorName, version: Option<u64>) -> Result<Holders> {
        self.lookup_excluding(name, version, &[]).await
    }

    /// [`lookup`](Self::lookup), the broker offering none of `exclude`.
    async fn lookup_excluding(
        &self,
        name: &TensorName,
        version: Option<u64>,
        exclude: &[NodeId],
    ) -> Result<Holders> {
        let timeout = self.request_timeout;
        self.ctl.lookup(name, version, exclude, timeout).await
    }

    async fn fetching(&self, name: &TensorName, version: u64, active: bool) -> Result<()> {
        if !self.serves {
            return Ok(());
        }
        let timeout = self.request_timeout;
        self.ctl.fetching(name, version, active, timeout).await
    }
}

/// `links` as a heartbeat lists them: at most [`tb_proto::MAX_STATS_LINKS`], by peer id.
fn stats_links(links: &[(iroh::EndpointId, tb_proto::ChannelKind)]) -> Vec<tb_proto::LinkChannel> {
    links
        .iter()
        .take(tb_proto::MAX_STATS_LINKS)
        .map(|(peer, channel)| tb_proto::LinkChannel {
            peer: crate::auth::node_id(peer),
            channel: *channel,
        })
        .collect()
}
