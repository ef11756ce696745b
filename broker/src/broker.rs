//! [`Broker`]: a running broker process — a tb-node [`Node`] plus the [`BrokerActor`], the
//! `tb/ctl/1` protocol, gossip replication and anti-entropy, all on one iroh endpoint.

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Duration};

use iroh::{EndpointId, address_lookup::MemoryLookup};
use iroh_gossip::{Gossip, TopicId, api::GossipSender};
use ractor::{Actor, ActorRef};
use tb_dashboard::{AppState, Metrics, Role as MetricsRole};
use tb_link::{
    PeerAddr, Ticket,
    auth::{self, node_id},
    budget::ByteBudget,
};
use tb_node::Node;
use tb_proto::{CTL_ALPN, Member, Role};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, info, warn};

use crate::{
    BrokerConfig, BrokerState, RegistryStore,
    actor::{BrokerActor, BrokerArgs, BrokerMsg, SNAPSHOT_PERIOD, now_ms},
    beat::PeerBeats,
    ctl::{CtlProtocol, ask},
    gossip::GossipLoop,
    metrics::{BrokerCounters, MemberStatsBook},
    observe::{BrokerSource, PeerStatsRelay, RegistryView},
    sync::{PeerLinks, pull_from},
};

/// Everything a broker can be tuned with. `data_dir` is required: the registry lives there.
#[derive(Debug, Clone)]
pub struct BrokerOptions {
    /// The broker's node: bind address, identity key (in `node.data_dir`), cluster key, limits.
    pub node: tb_node::Config,
    /// Where the registry (sled) and the identity key are kept.
    pub data_dir: PathBuf,
    /// Retention, liveness timeout, fan-out width.
    pub state: BrokerConfig,
    /// Other brokers to join (from a ticket); empty for the first broker of a cluster.
    pub join: Vec<PeerAddr>,
    /// How often to pull from every peer broker (anti-entropy).
    pub sync_interval: Duration,
    /// How often to expire silent workers and flush the store.
    pub tick: Duration,
    /// How often, at most, the registry is published for the metrics server (it answers
    /// from that copy, never by asking the broker's actor). Default [`SNAPSHOT_PERIOD`].
    pub snapshot_period: Duration,
}

impl BrokerOptions {
    /// Defaults for a broker keeping its state in `data_dir`.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        BrokerOptions {
            node: tb_node::Config::default(),
            data_dir: data_dir.into(),
            state: BrokerConfig::default(),
            join: Vec::new(),
            sync_interval: Duration::from_secs(5),
            tick: Duration::from_secs(1),
            snapshot_period: SNAPSHOT_PERIOD,
        }
    }
}

/// Why a broker could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The node (endpoint, identity key) could not start.
    #[error("starting the broker's node: {0}")]
    Node(#[from] tb_node::Error),
    /// The registry store could not be opened or loaded.
    #[error("opening the registry in {dir}: {source}")]
    Store {
        /// The store's folder.
        dir: PathBuf,
        /// What failed.
        source: crate::PersistError,
    },
    /// Something else failed while starting (actor, gossip).
    #[error("starting the broker: {0}")]
    Start(String),
    /// The node's key is a read-only credential: brokers need the cluster secret.
    #[error(transparent)]
    ReadOnly(#[from] tb_proto::AuthError),
}

/// A running broker. Cloning is not offered: keep one and call [`Broker::shutdown`].
pub struct Broker {
    node: Node,
    actor: ActorRef<BrokerMsg>,
    actor_done: tokio::task::JoinHandle<()>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    counters: Arc<BrokerCounters>,
    stats: Arc<MemberStatsBook>,
    /// The dashboard's figures of workers that heartbeat to other brokers.
    relay: Arc<PeerStatsRelay>,
    /// The registry as the actor last published it.
    registry_view: watch::Receiver<Arc<RegistryView>>,
    join: Vec<PeerAddr>,
    /// What anti-entropy conversations hold (`BrokerConfig::max_sync_bytes`).
    sync_budget: ByteBudget,
}

impl Broker {
    /// Starts a broker: loads its registry, joins the cluster's gossip topic and starts
    /// serving `tb/ctl/1` and `tb/data/1`.
    pub async fn spawn(mut opts: BrokerOptions) -> Result<Broker, StartError> {
        opts.node.cluster_key.require_secret("acting as a broker")?;
        opts.node.data_dir = Some(opts.data_dir.clone());
        let metrics = match &opts.node.metrics {
            Some(metrics) => metrics.clone(),
            None => {
                Metrics::new(MetricsRole::Broker).map_err(|e| StartError::Start(e.to_string()))?
            }
        };
        opts.node.metrics = Some(metrics.clone());
        let endpoint = Node::bind(&opts.node).await?;
        let me = endpoint.id();
        let lookup = MemoryLookup::new();
        endpoint
            .address_lookup()
            .map_err(|e| StartError::Start(format!("address lookup: {e}")))?
            .add(lookup.clone());
        let (store, registry, epoch) = open_store(&opts).await?;
        // After a restart, the brokers this one knew are as good a way back into the cluster as
        // the join list: without them a first broker (started with no --join) would come back
        // alone and never catch up.
        let mut peers = opts.join.clone();
        for known in registry.members().filter_map(|m| broker_addr(m, false)) {
            if known.id != me && !peers.iter().any(|p| p.id == known.id) {
                peers.push(known);
            }
        }
        for peer in &peers {
            lookup.add_endpoint_info(peer.to_endpoint_addr());
        }
        let state = BrokerState::new(node_id(&me), opts.state.clone(), registry, now_ms());
        let (gossip_out, outbox) = mpsc::unbounded_channel();
        let (published, registry_view) = watch::channel(Arc::new(RegistryView::default()));
        let (actor, actor_done) = Actor::spawn(
            None,
            BrokerActor,
            BrokerArgs {
                state,
                store,
                gossip_out,
                tick: opts.tick,
                published,
                snapshot_period: opts.snapshot_period.max(Duration::from_millis(1)),
            },
        )
        .await
        .map_err(|e| StartError::Start(format!("broker actor: {e}")))?;

        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        let counters = Arc::new(
            BrokerCounters::new(&metrics)
                .map_err(|e| StartError::Start(format!("metrics: {e}")))?,
        );
        let stats = Arc::new(MemberStatsBook::default());
        let gossip = Gossip::builder()
            .broadcast_config(gossip_broadcast_config())
            .spawn(endpoint.clone());
        // One budget for every anti-entropy conversation, asked or answered.
        let sync_budget = ByteBudget::new(opts.state.max_sync_bytes);
        let ctl = CtlProtocol {
            actor: actor.clone(),
            key: opts.node.cluster_key.clone(),
            me,
            request_timeout: opts.node.request_timeout,
            admission: auth::Admission::new(&opts.node),
            max_tensor_bytes: opts.node.max_tensor_bytes,
            sync_budget: sync_budget.clone(),
            cancel: cancel.clone(),
            tracker: tracker.clone(),
            counters: counters.clone(),
            stats: stats.clone(),
            per_peer: Default::default(),
        };
        let on_socket = Arc::new(ctl.clone());
        let extra: Vec<(&'static [u8], Box<dyn iroh::protocol::DynProtocolHandler>)> = vec![
            (CTL_ALPN, Box::new(ctl)),
            (iroh_gossip::ALPN, Box::new(gossip.clone())),
        ];
        let node = Node::spawn_on(opts.node.clone(), endpoint.clone(), extra).await?;
        // Nodes on this host send most requests on the same-host socket instead.
        node.serve_ctl_on_socket(on_socket)?;

        let topic = TopicId::from_bytes(opts.node.cluster_key.gossip_topic());
        let bootstrap: Vec<EndpointId> = peers.iter().map(|p| p.id).collect();
        let (sender, receiver) = gossip
            .subscribe(topic, bootstrap)
            .await
            .map_err(|e| StartError::Start(format!("joining the gossip topic: {e}")))?
            .split();
        let sync_now = Arc::new(Notify::new());
        tracker.spawn(
            GossipLoop {
                me: node_id(&me),
                key: opts.node.cluster_key.clone(),
                sender: sender.clone(),
                receiver,
                outbox,
                actor: actor.clone(),
                max_tensor_bytes: opts.node.max_tensor_bytes,
                sync_now: sync_now.clone(),
                counters: counters.clone(),
                cancel: cancel.clone(),
            }
            .run(),
        );

        let broker = Broker {
            node,
            actor,
            actor_done,
            cancel: cancel.clone(),
            tracker: tracker.clone(),
            counters,
            stats,
            relay: Arc::new(PeerStatsRelay::new(
                endpoint.clone(),
                opts.node.cluster_key.clone(),
                opts.node.max_tensor_bytes,
                tracker,
                cancel,
            )),
            join: opts.join.clone(),
            sync_budget: sync_budget.clone(),
            registry_view,
        };
        broker.announce_self(epoch, &opts).await?;
        let peers_to_beat = peers.clone();
        let sync = SyncLoop {
            actor: broker.actor.clone(),
            links: PeerLinks::new(
                endpoint,
                opts.node.cluster_key.clone(),
                opts.node.connect_timeout,
            ),
            lookup,
            sender,
            registry: broker.registry_view.clone(),
            join: peers,
            me,
            interval: opts.sync_interval,
            request_timeout: opts.node.request_timeout,
            max_tensor_bytes: opts.node.max_tensor_bytes,
            sync_budget,
            sync_now,
            counters: broker.counters.clone(),
            cancel: broker.cancel.clone(),
        };
        broker.tracker.spawn(sync.run());
        let beats = PeerBeats {
            actor: broker.actor.clone(),
            endpoint: broker.node.endpoint().clone(),
            key: opts.node.cluster_key.clone(),
            join: peers_to_beat,
            addrs: vec![broker.addr().addr.to_string()],
            epoch,
            interval: beat_interval(&opts),
            connect_timeout: opts.node.connect_timeout,
            request_timeout: opts.node.request_timeout,
            cancel: broker.cancel.clone(),
        };
        broker.tracker.spawn(beats.run());
        info!(broker = %broker.addr(), epoch, "broker started");
        Ok(broker)
    }

    /// Writes this broker's membership row (alive, at its new epoch) and gossips it.
    async fn announce_self(&self, epoch: u64, opts: &BrokerOptions) -> Result<(), StartError> {
        let from = node_id(&self.node.id());
        let addrs = vec![self.node.addr().addr.to_string()];
        let asked = ask(&self.actor, opts.node.request_timeout, |reply| {
            BrokerMsg::Heartbeat {
                from,
                role: Role::Broker,
                addrs,
                epoch,
                upload_limit: None,
                reply,
            }
        })
        .await;
        match asked {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StartError::Start(format!("announcing this broker: {e}"))),
            Err(e) => Err(StartError::Start(format!("announcing this broker: {e:?}"))),
        }
    }

    /// The broker's node (its data plane and identity).
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// Where nodes reach this broker: `<node-id>@<ip:port>`.
    pub fn addr(&self) -> &PeerAddr {
        self.node.addr()
    }

    /// A ticket naming this broker, the brokers it joined and every broker it has heard of.
    pub async fn ticket(&self) -> Ticket {
        let mut brokers = vec![self.addr().clone()];
        brokers.extend(self.join.iter().filter(|b| b.id != self.addr().id).cloned());
        let members = ask(&self.actor, Duration::from_secs(5), |reply| {
            BrokerMsg::Members { reply }
        })
        .await
        .unwrap_or_default();
        for peer in members.iter().filter_map(|m| broker_addr(m, true)) {
            if !brokers.iter().any(|b| b.id == peer.id) {
                brokers.push(peer);
            }
        }
        Ticket { brokers }
    }

    /// Bytes of anti-entropy messages held now, all conversations together (at most
    /// `BrokerConfig::max_sync_bytes`).
    pub fn sync_bytes_held(&self) -> u64 {
        self.sync_budget.in_use()
    }

    /// The broker's counters.
    pub fn counters(&self) -> &BrokerCounters {
        &self.counters
    }

    /// The process's metrics (the broker's node shares them).
    pub fn metrics(&self) -> &Arc<Metrics> {
        self.node.metrics()
    }

    /// What the broker's metrics server serves: its metrics, status, and the cluster view
    /// (members with their heartbeat stats, registry entries).
    pub fn dashboard(&self) -> AppState {
        let source = BrokerSource {
            node: self.node.clone(),
            registry: self.registry_view.clone(),
            stats: self.stats.clone(),
            relay: self.relay.clone(),
        };
        AppState {
            metrics: self.metrics().clone(),
            source: Arc::new(source),
        }
    }

    /// Stops serving, stops gossip and anti-entropy, flushes the registry, closes the node.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.close();
        if tokio::time::timeout(Duration::from_secs(5), self.tracker.wait())
            .await
            .is_err()
        {
            warn!("broker tasks did not stop within 5 s");
        }
        // Gossip itself stops with the node's router (which shuts every protocol down); stopping
        // it here as well makes the router's attempt fail noisily.
        self.actor.stop(Some("shutdown".into()));
        let _ = tokio::time::timeout(Duration::from_secs(5), self.actor_done).await;
        self.node.shutdown().await;
    }
}

async fn open_store(
    opts: &BrokerOptions,
) -> Result<(RegistryStore, tb_proto::Registry, u64), StartError> {
    let dir = opts.data_dir.join("registry");
    let max = opts.node.max_tensor_bytes;
    let opened = {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || {
            let store = RegistryStore::open(&dir)?;
            let epoch = store.bump_epoch()?;
            let registry = store.load(max)?;
            Ok::<_, crate::PersistError>((store, registry, epoch))
        })
        .await
        .map_err(|e| StartError::Start(format!("opening the store: {e}")))?
    };
    opened.map_err(|source| StartError::Store { dir, source })
}

/// How often a broker heartbeats its peers: the node's heartbeat interval, but at least four
/// times per liveness timeout, so that a peer with a short timeout never judges it dead
/// between two heartbeats.
fn beat_interval(opts: &BrokerOptions) -> Duration {
    let quarter = Duration::from_millis(opts.state.liveness_timeout_ms / 4);
    opts.node
        .heartbeat_interval
        .min(quarter)
        .max(Duration::from_millis(50))
}

/// Plumtree tuned for a broker cluster (a few brokers, one network, round trips of a
/// millisecond or less). An op that reaches a broker only by the lazy path (an `IHave`, then a
/// `Graft` when the payload does not follow on an eager link) waited iroh-gossip's default
/// 80 ms before grafting: that wait alone set the registry's publish-to-visible p99 (90 ms on a
/// 16-core host). A graft sent too early costs one duplicate message, which merging ignores.
fn gossip_broadcast_config() -> iroh_gossip::proto::PlumtreeConfig {
    iroh_gossip::proto::PlumtreeConfig {
        graft_timeout_1: Duration::from_millis(20),
        graft_timeout_2: Duration::from_millis(10),
        ..Default::default()
    }
}

/// A broker member's dialable address, if it advertises one (and is alive, if `live_only`).
pub(crate) fn broker_addr(member: &Member, live_only: bool) -> Option<PeerAddr> {
    if member.role != Role::Broker || (live_only && !member.alive) {
        return None;
    }
    let id = EndpointId::from_bytes(&member.node.0).ok()?;
    let addr = member.addrs.iter().find_map(|a| a.parse().ok())?;
    Some(PeerAddr { id, addr })
}

/// Pulls from every peer broker every `interval`, and at once when gossip says so.
struct SyncLoop {
    actor: ActorRef<BrokerMsg>,
    links: PeerLinks,
    lookup: MemoryLookup,
    sender: GossipSender,
    /// The registry as the actor publishes it: watched for peer brokers that restarted.
    registry: watch::Receiver<Arc<RegistryView>>,
    join: Vec<PeerAddr>,
    me: EndpointId,
    interval: Duration,
    request_timeout: Duration,
    max_tensor_bytes: u64,
    sync_budget: ByteBudget,
    sync_now: Arc<Notify>,
    counters: Arc<BrokerCounters>,
    cancel: CancellationToken,
}

impl SyncLoop {
    async fn run(mut self) {
        let mut known: Vec<EndpointId> = self.join.iter().map(|p| p.id).collect();
        let mut lives = HashMap::new();
        self.rejoin_restarted(&mut lives).await;
        // The first round runs at once: a broker that starts late catches up before its
        // first interval.
        'rounds: loop {
            let peers = self.peers().await;
            for peer in &peers {
                if !known.contains(&peer.id) {
                    known.push(peer.id);
                    self.lookup.add_endpoint_info(peer.to_endpoint_addr());
                    self.join(vec![peer.id]).await;
                }
                if self.cancel.is_cancelled() {
                    break;
                }
                self.pull(peer).await;
            }
            let next_round = tokio::time::sleep(self.interval);
            tokio::pin!(next_round);
            loop {
                tokio::select! {
                    _ = self.cancel.cancelled() => break 'rounds,
                    _ = &mut next_round => break,
                    _ = self.sync_now.notified() => break,
                    Ok(()) = self.registry.changed() => self.rejoin_restarted(&mut lives).await,
                }
            }
        }
        self.links.close_all();
    }

    /// Joins the gossip topic again through each live peer broker seen at an epoch it was not
    /// joined at (a restart, or a first sighting), as soon as the registry shows it; `lives`
    /// holds the epoch last seen of each. iroh-gossip's membership (HyParView) keeps the old
    /// process of a peer that restarted with the same id in its active view, and when that peer
    /// joined this one first, a stale pending `Neighbor` request too: the restarted peer's
    /// `Join` is then never answered, and it has no gossip neighbour (its ops reach no one until
    /// anti-entropy pulls them, while this broker's still reach it). A `Join` from this side
    /// makes the restarted peer take this broker as a neighbour, and its `Neighbor` answer
    /// clears the stale request. A first sighting counts: the registry is published at most
    /// every [`SNAPSHOT_PERIOD`], and a peer that restarts within one shows only at its new
    /// epoch. A `Join` to a peer that is a neighbour already is harmless (it is what joining
    /// does, once per broker life).
    async fn rejoin_restarted(&mut self, lives: &mut HashMap<EndpointId, u64>) {
        let me = self.me;
        let restarted: Vec<PeerAddr> = {
            let view = self.registry.borrow_and_update();
            view.registry
                .members()
                .filter_map(|m| Some((broker_addr(m, true)?, m.epoch)))
                .filter(|(peer, epoch)| {
                    let new = peer.id != me && lives.get(&peer.id).is_none_or(|was| was < epoch);
                    if new {
                        lives.insert(peer.id, *epoch);
                    }
                    new
                })
                .map(|(peer, _)| peer)
                .collect()
        };
        if restarted.is_empty() {
            return;
        }
        debug!(
            peers = restarted.len(),
            "joining peer brokers seen at a new epoch"
        );
        // Where they are now: a restarted broker may listen at a new address.
        for peer in &restarted {
            self.lookup.add_endpoint_info(peer.to_endpoint_addr());
        }
        self.join(restarted.into_iter().map(|p| p.id).collect())
            .await;
    }

    /// Asks gossip to join `peers`, for at most one request timeout (the gossip actor's
    /// command queue can stall, as broadcasts can).
    async fn join(&self, peers: Vec<EndpointId>) {
        let asked = tokio::time::timeout(self.request_timeout, self.sender.join_peers(peers));
        match asked.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => debug!(%e, "gossip: joining peer brokers failed"),
            Err(_) => debug!("gossip: joining peer brokers took longer than the request timeout"),
        }
    }

    async fn pull(&mut self, peer: &PeerAddr) {
        let conn = match self.links.get(peer).await {
            Ok(conn) => conn,
            Err(e) => {
                self.counters.sync_failures.inc();
                debug!(peer = %peer.id.fmt_short(), %e, "anti-entropy: peer unreachable");
                return;
            }
        };
        let pulled = tokio::select! {
            _ = self.cancel.cancelled() => return,
            r = pull_from(
                &conn,
                &self.actor,
                self.request_timeout,
                self.max_tensor_bytes,
                &self.sync_budget,
            ) => r,
        };
        match pulled {
            Ok(stats) => {
                self.counters.sync_rounds.inc();
                if stats.entries + stats.members > 0 {
                    debug!(peer = %peer.id.fmt_short(), ?stats, "anti-entropy brought news");
                }
            }
            Err(e) => {
                self.counters.sync_failures.inc();
                self.links.drop_link(&peer.id);
                debug!(peer = %peer.id.fmt_short(), %e, "anti-entropy round failed");
            }
        }
    }

    /// The join list plus every live broker the membership table knows, except this one.
    async fn peers(&self) -> Vec<PeerAddr> {
        peer_brokers(&self.actor, &self.join, self.me, self.request_timeout).await
    }
}

/// The brokers of `join` plus every live broker the membership table knows, except `me`.
pub(crate) async fn peer_brokers(
    actor: &ActorRef<BrokerMsg>,
    join: &[PeerAddr],
    me: EndpointId,
    timeout: Duration,
) -> Vec<PeerAddr> {
    let mut peers: Vec<PeerAddr> = join.to_vec();
    let members = ask(actor, timeout, |reply| BrokerMsg::Members { reply })
        .await
        .unwrap_or_default();
    for peer in members.iter().filter_map(|m| broker_addr(m, true)) {
        if !peers.iter().any(|p| p.id == peer.id) {
            peers.push(peer);
        }
    }
    peers.retain(|p| p.id != me);
    peers
}
