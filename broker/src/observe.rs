//! What a broker shows on its metrics server: [`BrokerSource`] implements the dashboard's
//! [`Source`] from the broker's node, the [`RegistryView`] its actor publishes, the heartbeat
//! stats book and, for the workers that heartbeat to other brokers, the figures
//! [`PeerStatsRelay`] asks those brokers for while someone watches. No HTTP request asks the
//! actor anything: a flood of them costs the registry nothing but CPU, which the server's
//! concurrency limit bounds.

use std::{
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use iroh::Endpoint;
use tb_dashboard::{
    Metrics, RefreshFuture, Source,
    api::{
        ClusterData, EntryView, FunctionView, MAX_FUNCTIONS_LISTED, MAX_SERVERS_LISTED,
        MemberStats, MemberView, Page, RegistryTotals,
    },
};
use tb_link::{PeerAddr, auth::node_id};
use tb_node::Node;
use tb_proto::{ClusterKey, NodeStats, Registry, Role};
use tokio::sync::watch;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::debug;

use crate::{
    broker::broker_addr,
    metrics::MemberStatsBook,
    sync::{PeerLinks, ask_members},
};

/// How often, at most, the dashboard's peer figures are asked for again.
const RELAY_INTERVAL: Duration = Duration::from_secs(1);
/// Longest wait for a link to a peer broker, and for each frame of its answer.
const RELAY_TIMEOUT: Duration = Duration::from_secs(2);

/// The registry as the broker actor last published it (at most every
/// [`SNAPSHOT_PERIOD`](crate::SNAPSHOT_PERIOD)), with its totals, counted once by the first
/// reader that needs them.
#[derive(Debug, Default)]
pub(crate) struct RegistryView {
    pub(crate) registry: Arc<Registry>,
    summary: OnceLock<Summary>,
}

/// What the gauges and the dashboard's summary show.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Summary {
    totals: RegistryTotals,
    alive: usize,
    dead: usize,
}

impl RegistryView {
    pub(crate) fn new(registry: Arc<Registry>) -> Self {
        RegistryView {
            registry,
            summary: OnceLock::new(),
        }
    }

    fn summary(&self) -> Summary {
        *self.summary.get_or_init(|| {
            let mut totals = RegistryTotals::default();
            for (_, e) in self.registry.list("") {
                totals.names += 1;
                totals.copies += e.holders_of(e.version).count() as u64;
                totals.bytes = totals.bytes.saturating_add(e.meta.byte_len);
            }
            let alive = self.registry.members().filter(|m| m.alive).count();
            let dead = self.registry.members().count() - alive;
            Summary {
                totals,
                alive,
                dead,
            }
        })
    }
}

/// The broker's side of the dashboard.
pub(crate) struct BrokerSource {
    pub(crate) node: Node,
    /// What the actor publishes.
    pub(crate) registry: watch::Receiver<Arc<RegistryView>>,
    pub(crate) stats: Arc<MemberStatsBook>,
    pub(crate) relay: Arc<PeerStatsRelay>,
}

/// The heartbeat figures of workers that heartbeat to other brokers (a broker knows only its
/// own workers' figures; they are not gossiped: they change every heartbeat and matter to
/// nobody in the data path). While someone watches the dashboard, each `/api/v1/cluster`
/// starts a refresh in the background, at most one a second and one at a time, that asks
/// every live peer broker for `Members`; the answer never waits on a peer.
pub(crate) struct PeerStatsRelay {
    links: tokio::sync::Mutex<PeerLinks>,
    /// Relayed figures, recorded at the time the worker sent them.
    book: MemberStatsBook,
    max_tensor_bytes: u64,
    /// When the last refresh started (`None`: never).
    started: std::sync::Mutex<Option<Instant>>,
    /// The broker's tasks and its shutdown signal: a refresh is one of them, and stops with it.
    tracker: TaskTracker,
    cancel: CancellationToken,
}

impl PeerStatsRelay {
    pub(crate) fn new(
        endpoint: Endpoint,
        key: ClusterKey,
        max_tensor_bytes: u64,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Self {
        PeerStatsRelay {
            links: tokio::sync::Mutex::new(PeerLinks::new(endpoint, key, RELAY_TIMEOUT)),
            book: MemberStatsBook::default(),
            max_tensor_bytes,
            started: std::sync::Mutex::new(None),
            tracker,
            cancel,
        }
    }

    /// Starts asking `peers` in the background, unless a refresh started less than
    /// [`RELAY_INTERVAL`] before `now`.
    fn refresh(self: &Arc<Self>, peers: Vec<PeerAddr>, now: Instant) {
        {
            let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
            if started.is_some_and(|at| now.saturating_duration_since(at) < RELAY_INTERVAL) {
                return;
            }
            *started = Some(now);
        }
        if peers.is_empty() || self.cancel.is_cancelled() {
            return;
        }
        let relay = Arc::clone(self);
        self.tracker.spawn(async move {
            tokio::select! {
                _ = relay.cancel.cancelled() => {}
                _ = relay.ask_all(&peers) => {}
            }
        });
    }

    /// Asks each peer in turn (a refresh still running makes this one a no-op).
    async fn ask_all(&self, peers: &[PeerAddr]) {
        let Ok(mut links) = self.links.try_lock() else {
            return;
        };
        for peer in peers {
            let answer = match links.get(peer).await {
                Ok(conn) => ask_members(&conn, RELAY_TIMEOUT, self.max_tensor_bytes).await,
                Err(e) => Err(e),
            };
            let rows = match answer {
                Ok(rows) => rows,
                Err(e) => {
                    links.drop_link(&peer.id);
                    debug!(peer = %peer.id.fmt_short(), %e, "dashboard: no figures from peer");
                    continue;
                }
            };
            let at = Instant::now();
            for row in rows {
                let Some(h) = row.heartbeat else { continue };
                if let Some(sent) = at.checked_sub(Duration::from_millis(h.age_ms)) {
                    self.book.record_if_younger(row.member.node, h.stats, sent);
                }
            }
        }
    }
}

impl BrokerSource {
    /// The registry as last published.
    fn view(&self) -> Arc<RegistryView> {
        self.registry.borrow().clone()
    }
}

impl Source for BrokerSource {
    fn node_id(&self) -> String {
        node_id(&self.node.id()).to_string()
    }

    fn addrs(&self) -> Vec<String> {
        vec![self.node.addr().addr.to_string()]
    }

    /// A broker serves once its registry is loaded and it listens, which is before its
    /// metrics server starts.
    fn ready(&self) -> bool {
        !self.node.is_shut_down()
    }

    fn refresh<'a>(&'a self, metrics: &'a Metrics) -> RefreshFuture<'a> {
        self.node.refresh_metrics();
        set_registry_gauges(metrics, &self.view());
        Box::pin(async {})
    }

    fn links(&self) -> Vec<tb_dashboard::api::LinkView> {
        self.node.link_views()
    }

    fn cluster(&self, page: &Page) -> Option<ClusterData> {
        let view = self.view();
        let now = Instant::now();
        let me = node_id(&self.node.id());
        let peers = view
            .registry
            .members()
            .filter(|m| m.node != me)
            .filter_map(|m| broker_addr(m, true))
            .collect();
        self.relay.refresh(peers, now);
        Some(cluster_data(
            &view,
            page,
            &self.stats,
            &self.relay.book,
            now,
        ))
    }
}

fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// `tb_registry_names`, `tb_registry_holders` and `tb_cluster_nodes` from a published view.
pub(crate) fn set_registry_gauges(metrics: &Metrics, view: &RegistryView) {
    let summary = view.summary();
    let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    metrics.registry_names.set(count(summary.totals.names));
    metrics.registry_holders.set(count(summary.totals.copies));
    metrics.cluster_alive.set(gauge(summary.alive));
    metrics.cluster_dead.set(gauge(summary.dead));
}

/// Members (with the freshest stats of those that heartbeat here, in `book`, or to a peer
/// broker, in `relayed`), the registry's totals and one `page` of its live entries, for
/// `/api/v1/cluster`.
pub(crate) fn cluster_data(
    view: &RegistryView,
    page: &Page,
    book: &MemberStatsBook,
    relayed: &MemberStatsBook,
    now: Instant,
) -> ClusterData {
    let registry = &view.registry;
    let members = registry
        .members()
        .map(|m| MemberView {
            node_id: m.node.to_string(),
            role: match m.role {
                Role::Broker => "broker",
                Role::Worker => "worker",
            }
            .to_string(),
            addrs: m.addrs.clone(),
            epoch: m.epoch,
            alive: m.alive,
            stats: youngest(book.get(&m.node, now), relayed.get(&m.node, now))
                .map(|(s, age)| MemberStats::from_heartbeat(&s, age.as_secs_f64())),
        })
        .collect();
    let mut listed = registry.list_after(page.after.as_ref());
    let entries: Vec<EntryView> = listed
        .by_ref()
        .take(page.limit)
        .map(|(name, e)| EntryView {
            name: name.as_str().to_string(),
            version: e.version,
            dtype: e.meta.dtype.name().to_string(),
            shape: e.meta.shape.clone(),
            byte_len: e.meta.byte_len,
            holders: e.holders_of(e.version).map(|n| n.to_string()).collect(),
            publisher: e.publisher.to_string(),
        })
        .collect();
    let next = match listed.next() {
        Some(_) => entries.last().map(|e| e.name.clone()),
        None => None,
    };
    let functions = registry
        .advertised(tb_proto::call::FUNCTION_PREFIX)
        .take(MAX_FUNCTIONS_LISTED)
        .filter_map(|(entry, _)| {
            let name = tb_proto::call::function_of(entry)?;
            let servers: Vec<_> = registry
                .advertisers(entry)
                .into_iter()
                .take(MAX_SERVERS_LISTED)
                .collect();
            let mut view = FunctionView {
                name: name.as_str().to_string(),
                servers: servers.iter().map(|m| m.node.to_string()).collect(),
                ..FunctionView::default()
            };
            // The figures each server's freshest heartbeat gave for this function.
            for m in &servers {
                let Some((stats, _)) = youngest(book.get(&m.node, now), relayed.get(&m.node, now))
                else {
                    continue;
                };
                if let Some(f) = stats.functions.iter().find(|f| f.name == name) {
                    view.calls_per_s += f.calls_per_s;
                    view.calls_total = view.calls_total.saturating_add(f.calls_total);
                    view.failed_total = view.failed_total.saturating_add(f.failed_total);
                    view.in_flight = view.in_flight.saturating_add(u64::from(f.in_flight));
                    view.reporting += 1;
                }
            }
            Some(view)
        })
        .collect();
    ClusterData {
        members,
        entries,
        next,
        registry: view.summary().totals,
        functions,
    }
}

/// The younger of two figures.
fn youngest(
    a: Option<(NodeStats, Duration)>,
    b: Option<(NodeStats, Duration)>,
) -> Option<(NodeStats, Duration)> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.1 < a.1 { b } else { a }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use tb_proto::{
        ContentHash, DType, Member, NodeId, NodeStats, RegistryOp, Stamp, TensorMeta, TensorName,
    };

    use super::*;

    #[test]
    fn the_cluster_view_lists_members_with_stats_and_live_entries() {
        let (w1, w2) = (NodeId([1; 32]), NodeId([2; 32]));
        let mut reg = Registry::new();
        let stamp = |wall| Stamp {
            wall_ms: wall,
            logical: 0,
            node: NodeId([9; 32]),
        };
        for (node, alive) in [(w1, true), (w2, false)] {
            reg.apply(&RegistryOp::Member(Member {
                node,
                role: Role::Worker,
                addrs: vec!["127.0.0.1:1".into()],
                epoch: 1,
                alive,
                stamp: stamp(1),
            }));
        }
        let name = TensorName::new("m/w").expect("name");
        let meta = TensorMeta::new(DType::F32, vec![2, 3], ContentHash([5; 32])).expect("meta");
        reg.apply(&RegistryOp::Publish {
            name: name.clone(),
            version: 1,
            meta,
            publisher: w1,
            stamp: stamp(2),
        });
        reg.apply(&RegistryOp::holder(name, 1, w1, stamp(3), true));
        let book = MemberStatsBook::default();
        let now = Instant::now();
        let stats = NodeStats {
            tensors: 1,
            ..NodeStats::default()
        };
        book.record(w1, stats, now);
        // w2 heartbeats to a peer broker, whose answer was relayed: 2 s old. w1's relayed
        // figures are older than this broker's own, so they are not shown.
        let relayed = MemberStatsBook::default();
        let relayed_stats = |tensors| NodeStats {
            tensors,
            ..NodeStats::default()
        };
        relayed.record(w2, relayed_stats(7), now - Duration::from_millis(1_500));
        relayed.record(w1, relayed_stats(9), now - Duration::from_secs(1));
        let reg = RegistryView::new(Arc::new(reg));
        let page = Page {
            after: None,
            limit: tb_dashboard::api::DEFAULT_PAGE_LIMIT,
        };
        let view = cluster_data(
            &reg,
            &page,
            &book,
            &relayed,
            now + Duration::from_millis(500),
        );
        assert_eq!(view.members.len(), 2);
        let m1 = &view.members[0];
        assert_eq!(
            (m1.node_id.as_str(), m1.alive),
            (w1.to_string().as_str(), true)
        );
        let s = m1.stats.as_ref().expect("w1 heartbeats here");
        assert_eq!(s.stats.tensors, 1);
        assert!((s.age_s - 0.5).abs() < 1e-9);
        // The JSON stays flat: the heartbeat's fields and `age_s` side by side.
        let json = serde_json::to_value(s).expect("stats as JSON");
        assert_eq!(json["tensors"], 1);
        assert_eq!(json["age_s"], 0.5);
        let s2 = view.members[1]
            .stats
            .as_ref()
            .expect("w2's relayed figures");
        assert_eq!(s2.stats.tensors, 7);
        assert!((s2.age_s - 2.0).abs() < 1e-9);
        let e = &view.entries[0];
        assert_eq!(
            (e.name.as_str(), e.version, e.dtype.as_str()),
            ("m/w", 1, "f32")
        );
        assert_eq!((e.shape.clone(), e.byte_len), (vec![2, 3], 24));
        assert_eq!(e.holders, vec![w1.to_string()]);
        assert_eq!(view.next, None);
        assert_eq!(
            view.registry,
            RegistryTotals {
                names: 1,
                copies: 1,
                bytes: 24
            }
        );

        let metrics = Metrics::new(tb_dashboard::Role::Broker).expect("metrics");
        set_registry_gauges(&metrics, &reg);
        assert_eq!(metrics.registry_names.get(), 1);
        assert_eq!(metrics.registry_holders.get(), 1);
        assert_eq!(
            (metrics.cluster_alive.get(), metrics.cluster_dead.get()),
            (1, 1)
        );
    }

    #[test]
    fn a_functions_figures_are_summed_over_its_servers_heartbeats() {
        let (w1, w2, w3) = (NodeId([1; 32]), NodeId([2; 32]), NodeId([3; 32]));
        let stamp = |wall| Stamp {
            wall_ms: wall,
            logical: 0,
            node: NodeId([9; 32]),
        };
        let echo = TensorName::new("fn/echo").expect("name");
        let entry = tb_proto::call::advertised_as(&echo).expect("entry");
        let mut reg = Registry::new();
        for node in [w1, w2, w3] {
            reg.apply(&RegistryOp::Member(Member {
                node,
                role: Role::Worker,
                addrs: vec!["127.0.0.1:1".into()],
                epoch: 1,
                alive: true,
                stamp: stamp(1),
            }));
            reg.apply(&RegistryOp::holder(entry.clone(), 1, node, stamp(2), true));
        }
        let figures = |calls, failed, rate, in_flight| NodeStats {
            functions: vec![tb_proto::FunctionStats {
                name: echo.clone(),
                calls_total: calls,
                failed_total: failed,
                calls_per_s: rate,
                in_flight,
            }],
            ..NodeStats::default()
        };
        let now = Instant::now();
        // w1 heartbeats here, w3 to a peer broker (relayed); w2 was not heard from yet.
        let book = MemberStatsBook::default();
        book.record(w1, figures(10, 1, 2.5, 1), now);
        let relayed = MemberStatsBook::default();
        relayed.record(w3, figures(5, 0, 1.5, 2), now);
        let page = Page {
            after: None,
            limit: tb_dashboard::api::DEFAULT_PAGE_LIMIT,
        };
        let view = cluster_data(
            &RegistryView::new(Arc::new(reg)),
            &page,
            &book,
            &relayed,
            now,
        );
        assert_eq!(view.functions.len(), 1);
        let f = &view.functions[0];
        assert_eq!((f.name.as_str(), f.servers.len()), ("fn/echo", 3));
        assert_eq!(
            (f.calls_total, f.failed_total, f.in_flight, f.reporting),
            (15, 1, 3, 2)
        );
        assert!((f.calls_per_s - 4.0).abs() < 1e-9, "{}", f.calls_per_s);
    }

    #[test]
    fn paging_the_cluster_view_lists_every_live_name_exactly_once() {
        let stamp = |wall| Stamp {
            wall_ms: wall,
            logical: 0,
            node: NodeId([9; 32]),
        };
        let mut reg = Registry::new();
        let mut live = Vec::new();
        for i in 0..95u32 {
            let name = TensorName::new(format!("m/{i:03}")).expect("name");
            let meta = TensorMeta::new(DType::U8, vec![u64::from(i) + 1], ContentHash([1; 32]))
                .expect("meta");
            reg.apply(&RegistryOp::Publish {
                name: name.clone(),
                version: 1,
                meta,
                publisher: NodeId([1; 32]),
                stamp: stamp(1),
            });
            // Every seventh name is deleted again: never listed, never a page's end.
            if i % 7 == 3 {
                reg.apply(&RegistryOp::Delete {
                    name,
                    stamp: stamp(2),
                });
            } else {
                live.push(name.as_str().to_string());
            }
        }
        let view = RegistryView::new(Arc::new(reg));
        let (book, relayed) = (MemberStatsBook::default(), MemberStatsBook::default());
        for limit in [1, 10, live.len(), live.len() + 1] {
            let mut page = Page { after: None, limit };
            let mut seen = Vec::new();
            for _ in 0..=live.len() {
                let data = cluster_data(&view, &page, &book, &relayed, Instant::now());
                assert!(data.entries.len() <= limit);
                assert_eq!(data.registry.names, live.len() as u64);
                seen.extend(data.entries.into_iter().map(|e| e.name));
                match data.next {
                    Some(next) => {
                        assert_eq!(
                            seen.last(),
                            Some(&next),
                            "the cursor is the page's last name"
                        );
                        page.after = Some(TensorName::new(next).expect("cursor"));
                    }
                    None => break,
                }
            }
            assert_eq!(seen, live, "limit {limit}");
        }
    }
}
