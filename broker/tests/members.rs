//! A broker and nodes in one process, on loopback: what a short-lived client leaves in the
//! membership table, and the refusals `/metrics` shows. Every wait is bounded.

use std::{future::Future, path::Path, time::Duration};

use tb_broker::{Broker, BrokerOptions, Refusal};
use tb_node::{Config, Node, Tensor, auth::node_id};
use tb_proto::{ClusterKey, DType, NodeId};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"broker member tests share this secret, 32+ bytes";

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET).expect("secret")
}

fn node_config() -> Config {
    Config {
        cluster_key: key(),
        connect_timeout: Duration::from_secs(3),
        request_timeout: Duration::from_secs(10),
        stall_timeout: Duration::from_secs(10),
        ..Config::default()
    }
}

/// A broker that forgets the row of a node that left at the first tick after the leave.
async fn broker(dir: &Path) -> Broker {
    let mut opts = BrokerOptions::new(dir);
    opts.node = node_config();
    opts.tick = Duration::from_millis(100);
    opts.state.liveness_timeout_ms = 2_000;
    opts.state.expiry.left_after_ms = 0;
    opts.state.forget_period_ms = 0;
    within("broker start", Broker::spawn(opts))
        .await
        .expect("broker starts")
}

/// A node of `broker`'s cluster; `heartbeats`: a member (a Python client, a worker), or not
/// (the `tb` CLI).
async fn node(broker: &Broker, heartbeats: bool) -> Node {
    let config = Config {
        brokers: vec![broker.addr().clone()],
        heartbeats,
        heartbeat_interval: Duration::from_millis(200),
        ..node_config()
    };
    within("node start", Node::spawn(config))
        .await
        .expect("node starts")
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {LIMIT:?}"),
    }
}

/// The membership table as `observer` reads it: (node, alive).
async fn rows(observer: &Node) -> Vec<(NodeId, bool)> {
    let members = within("members", observer.members()).await;
    members
        .expect("members")
        .into_iter()
        .map(|m| (m.node, m.alive))
        .collect()
}

/// Polls `observer`'s table every 50 ms until `check` accepts it or [`LIMIT`] passes.
async fn table_becomes(observer: &Node, check: impl Fn(&[(NodeId, bool)]) -> bool) -> bool {
    let start = tokio::time::Instant::now();
    while start.elapsed() < LIMIT {
        if check(&rows(observer).await) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check(&rows(observer).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lived_client_leaves_no_row_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    // `tb status`: a node that does not heartbeat, and so has no row.
    let observer = node(&broker, false).await;
    let worker = node(&broker, true).await;
    let worker_id = node_id(&worker.id());
    let me = node_id(&broker.node().id());
    // A Python `connect()`: joins with a fresh id, puts a tensor, closes.
    for round in 0..3u8 {
        let client = node(&broker, true).await;
        let client_id = node_id(&client.id());
        let bytes = vec![round; 64];
        let tensor = Tensor::new(DType::U8, vec![64], bytes).expect("tensor");
        within("publish", client.publish(&format!("c/{round}"), tensor))
            .await
            .expect("publish");
        let joined = table_becomes(&observer, |t| t.contains(&(client_id, true))).await;
        assert!(
            joined,
            "round {round}: the client is a member while it runs"
        );
        within("client shutdown", client.shutdown()).await;
        let gone = table_becomes(&observer, |t| t.iter().all(|(n, _)| *n != client_id)).await;
        assert!(
            gone,
            "round {round}: the client's row stayed: {:?}",
            rows(&observer).await
        );
    }
    // The worker that stays, and the broker, keep their rows; nothing else is left.
    let table = rows(&observer).await;
    let mut want = vec![(me, true), (worker_id, true)];
    want.sort();
    assert_eq!(table, want);
    for n in [observer, worker] {
        within("node shutdown", n.shutdown()).await;
    }
    within("broker shutdown", broker.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_subscription_is_counted_on_metrics_by_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let series =
        |reason: Refusal| format!("tb_broker_refused_total{{reason=\"{}\"}} ", reason.as_str());
    let page = broker.metrics().encode();
    for reason in Refusal::ALL {
        assert!(page.contains(&format!("{}0", series(reason))), "{page}");
    }
    let greedy = node(&broker, false).await;
    let mut held = Vec::new();
    for i in 0..tb_broker::MAX_SUBSCRIPTIONS_PER_PEER {
        let sub = within("subscribe", greedy.subscribe(&format!("s/{i}"))).await;
        held.push(sub.unwrap_or_else(|e| panic!("subscription {i}: {e}")));
    }
    // Refused before `subscribe` returns (the broker answers `Busy` instead of `Ok`).
    match within("subscribe", greedy.subscribe("s/over")).await {
        Err(e) => assert!(e.to_string().contains("subscriptions"), "{e}"),
        Ok(_) => panic!("expected the refusal, got a subscription"),
    }
    assert_eq!(broker.counters().refused.get(Refusal::Subscriptions), 1);
    let page = broker.metrics().encode();
    assert!(
        page.contains(&format!("{}1", series(Refusal::Subscriptions))),
        "{page}"
    );
    assert!(page.contains(&format!("{}0", series(Refusal::CtlConnections))));
    drop(held);
    within("node shutdown", greedy.shutdown()).await;
    within("broker shutdown", broker.shutdown()).await;
}
