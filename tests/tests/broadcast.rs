//! Broadcast: a node serves a version it is still receiving (cut-through), so the broker's
//! fan-out turns many fetches into a tree. The origins here are upload-limited, so a receive
//! takes seconds and the overlap the tests rely on is certain; every wait is bounded and no
//! assertion is about time.

use std::{path::Path, time::Duration};

use tb_broker::{Broker, BrokerOptions};
use tb_node::{Config, Node, PeerAddr, Tensor, proto::ChannelKind};
use tb_tests::{eventually, node, pattern, test_config, within};

const LIMIT: Duration = Duration::from_secs(90);
const NAME: &str = "bcast/w";
/// 6 MiB at 2 MB/s: about 3 s from a limited origin.
const SIZE: usize = 6 << 20;
const SLOW: u64 = 2_000_000;

/// A broker whose sources each serve one fetcher at a time (a chain), so a second fetcher is
/// pointed at the first one while it is still receiving.
async fn broker(dir: &Path) -> Broker {
    let mut opts = BrokerOptions::new(dir);
    opts.node = test_config();
    opts.state.fanout = 1;
    opts.tick = Duration::from_millis(200);
    within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts")
}

/// A node on QUIC alone: the nodes share this host, where shm would hand each receiver the
/// whole version at once, and cut-through is for transfers over the network.
fn config(broker: &PeerAddr, max_upload_rate: u64) -> Config {
    Config {
        brokers: vec![broker.clone()],
        channels: vec![ChannelKind::Quic],
        heartbeat_interval: Duration::from_millis(300),
        max_upload_rate,
        ..test_config()
    }
}

/// Starts `get_version` on `node` in a task.
fn get(node: &Node, version: u64) -> tokio::task::JoinHandle<tb_node::Result<Tensor>> {
    let node = node.clone();
    tokio::spawn(async move { Ok(node.get_version(NAME, version).await?.buffer) })
}

/// Waits until `node` is receiving a version (its look-up answered, so the broker counts it
/// as a source in flight).
async fn receiving(node: &Node, what: &str) {
    let started = eventually(LIMIT, || node.versions_receiving() > 0).await;
    assert!(started, "{what} never started receiving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_is_served_by_a_holder_still_receiving() {
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let origin = node(config(broker.addr(), SLOW)).await;
    let middle = node(config(broker.addr(), 0)).await;
    let last = node(config(broker.addr(), 0)).await;
    let tensor = Tensor::from_bytes(pattern(SIZE, 7));
    let v = within(LIMIT, "publish", origin.publish(NAME, tensor.clone()))
        .await
        .expect("publish");

    let first = get(&middle, v);
    receiving(&middle, "the first receiver").await;
    // The origin's one slot is taken: the broker points the second receiver at the first.
    let second = get(&last, v);
    let from_middle = within(LIMIT, "second get", second)
        .await
        .expect("task")
        .expect("second get");
    let from_origin = within(LIMIT, "first get", first)
        .await
        .expect("task")
        .expect("first get");

    assert_eq!(from_origin.data(), tensor.data(), "first receiver's bytes");
    assert_eq!(from_middle.data(), tensor.data(), "second receiver's bytes");
    assert_eq!(from_middle.hash(), tensor.hash());
    // The second receiver got (at least part of) its bytes from the first while the first
    // was still receiving them: only bytes sent before the receive completed count here.
    let cut_through = middle.inflight_bytes_served();
    assert!(
        cut_through > 0,
        "the first receiver served nothing while receiving"
    );
    assert!(cut_through <= SIZE as u64);
    assert_eq!(
        origin.inflight_bytes_served(),
        0,
        "the origin holds it whole"
    );
    // Both are complete holders now, and the in-flight table is empty again.
    assert_eq!(middle.versions_receiving(), 0);
    assert_eq!(last.versions_receiving(), 0);

    for n in [last, middle, origin] {
        n.shutdown().await;
    }
    broker.shutdown().await;
}

/// The holder a fetcher with these two sources to choose from is pointed at first: the broker
/// breaks ties between equally loaded complete holders by node id.
fn first_of(a: &Node, b: &Node) -> bool {
    a.id().as_bytes() < b.id().as_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_holder_whose_upstream_dies_still_feeds_its_child_correct_bytes() {
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    // Two complete holders, both slow.
    let publisher = node(config(broker.addr(), SLOW)).await;
    let copy = node(config(broker.addr(), SLOW)).await;
    let tensor = Tensor::from_bytes(pattern(SIZE, 3));
    let v = within(LIMIT, "publish", publisher.publish(NAME, tensor.clone()))
        .await
        .expect("publish");
    let held = within(LIMIT, "copy get", copy.get_version(NAME, v))
        .await
        .expect("copy get");
    assert_eq!(held.buffer.data(), tensor.data());
    // `doomed` is the holder the next fetcher is pointed at first; `spare` the other.
    let (doomed, spare) = match first_of(&publisher, &copy) {
        true => (publisher, copy),
        false => (copy, publisher),
    };

    // Two fetchers take one slot each at the two holders; the one with the smaller id takes
    // `doomed`'s (it asks first) and is the one a third fetcher is pointed at.
    let mut fetchers = [
        node(config(broker.addr(), 0)).await,
        node(config(broker.addr(), 0)).await,
    ];
    fetchers.sort_by_key(|n| *n.id().as_bytes());
    let (parent, other) = (fetchers[0].clone(), fetchers[1].clone());
    let child = node(config(broker.addr(), 0)).await;

    let parent_get = get(&parent, v);
    receiving(&parent, "the parent").await;
    let other_get = get(&other, v);
    receiving(&other, "the other fetcher").await;
    let child_get = get(&child, v);
    // The child is being served by the parent, which is still receiving from `doomed`.
    let served = eventually(LIMIT, || parent.inflight_bytes_served() > 0).await;
    assert!(served, "the parent never served the child while receiving");
    assert!(
        parent.versions_receiving() > 0,
        "the parent finished before its upstream could be killed"
    );

    // Its upstream dies mid-transfer: the parent resumes from `spare` at the byte it reached,
    // and keeps feeding the child from the same receive.
    doomed.shutdown().await;

    let got_child = within(LIMIT, "child get", child_get)
        .await
        .expect("task")
        .expect("the child's get completes");
    let got_parent = within(LIMIT, "parent get", parent_get)
        .await
        .expect("task")
        .expect("the parent's get completes from the spare holder");
    let got_other = within(LIMIT, "other get", other_get)
        .await
        .expect("task")
        .expect("other get");
    for (who, got) in [
        ("child", &got_child),
        ("parent", &got_parent),
        ("other", &got_other),
    ] {
        assert_eq!(got.data(), tensor.data(), "{who}'s bytes");
        assert_eq!(got.hash(), tensor.hash(), "{who}'s hash");
    }

    for n in [child, other, parent, spare] {
        n.shutdown().await;
    }
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_of_a_holder_that_dies_mid_receive_fails_over_to_another_holder() {
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let origin = node(config(broker.addr(), SLOW)).await;
    let middle = node(config(broker.addr(), 0)).await;
    let last = node(config(broker.addr(), 0)).await;
    let tensor = Tensor::from_bytes(pattern(SIZE, 11));
    let v = within(LIMIT, "publish", origin.publish(NAME, tensor.clone()))
        .await
        .expect("publish");

    let first = get(&middle, v);
    receiving(&middle, "the first receiver").await;
    let second = get(&last, v);
    let served = eventually(LIMIT, || middle.inflight_bytes_served() > 0).await;
    assert!(served, "the first receiver never served the second");
    // The in-flight holder itself goes away: its child's stream breaks, and the child resumes
    // from the origin (after a second look-up if needed), verified by hash.
    middle.shutdown().await;
    let got = within(LIMIT, "second get", second)
        .await
        .expect("task")
        .expect("the child's get completes from the origin");
    assert_eq!(got.data(), tensor.data());
    assert!(matches!(
        within(LIMIT, "first get", first).await.expect("task"),
        Err(tb_node::Error::Shutdown)
    ));

    for n in [last, origin] {
        n.shutdown().await;
    }
    broker.shutdown().await;
}

/// 16 MiB at 4 MB/s: about 4 s from one source.
const BIG: usize = 16 << 20;
const FAST: u64 = 4_000_000;
/// Far below a quarter of `FAST`: a node the broker ranks last as a source.
const CRAWL: u64 = 100_000;

/// Waits until every node has heartbeated (so the broker knows its upload limit).
async fn joined(nodes: &[&Node]) {
    for n in nodes {
        let ok = eventually(LIMIT, || n.is_joined()).await;
        assert!(ok, "a node never joined");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_with_a_tiny_upload_limit_holds_no_one_back() {
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let origin = node(config(broker.addr(), FAST)).await;
    let slow = node(config(broker.addr(), CRAWL)).await;
    let mut fast = Vec::new();
    for _ in 0..3 {
        fast.push(node(config(broker.addr(), FAST)).await);
    }
    joined(&[&origin, &slow, &fast[0], &fast[1], &fast[2]]).await;
    let tensor = Tensor::from_bytes(pattern(BIG, 5));
    let v = within(LIMIT, "publish", origin.publish(NAME, tensor.clone()))
        .await
        .expect("publish");

    // The slow receiver asks first: by fewest children alone the broker would make it the
    // second link of the chain, and everyone after it would receive at 100 kB/s.
    let slow_get = get(&slow, v);
    receiving(&slow, "the slow receiver").await;
    let mut gets = Vec::new();
    for n in &fast {
        gets.push(get(n, v));
        receiving(n, "a fast receiver").await;
    }
    for (i, g) in gets.into_iter().enumerate() {
        let got = within(LIMIT, "fast get", g)
            .await
            .expect("task")
            .expect("fast get");
        assert_eq!(got.data(), tensor.data(), "fast receiver {i}'s bytes");
    }
    // While the fast ones received, the origin's upload carried about one copy: the slow
    // receiver moved to the chain's tail and left the origin to them. (Once they are done,
    // the origin's idle upload may help the slow one finish.)
    let from_origin = origin.metrics().bytes_out.get();
    assert!(
        from_origin < BIG as u64 * 3 / 2,
        "the origin sent {from_origin} bytes for a {BIG}-byte tensor"
    );
    let got = within(LIMIT, "slow get", slow_get)
        .await
        .expect("task")
        .expect("slow get");
    assert_eq!(got.data(), tensor.data(), "the slow receiver's bytes");

    // Nobody pulled from the slow receiver.
    assert_eq!(slow.metrics().bytes_out.get(), 0, "the slow one served");
    for n in fast.into_iter().chain([slow, origin]) {
        n.shutdown().await;
    }
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_slows_down_is_dropped_for_another() {
    use tb_dashboard::TransferKind;
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    // Two complete holders at the same limit; the fetcher is pointed at `busy` first.
    let publisher = node(config(broker.addr(), FAST)).await;
    let copy = node(config(broker.addr(), FAST)).await;
    let tensor = Tensor::from_bytes(pattern(BIG, 9));
    let v = within(LIMIT, "publish", publisher.publish(NAME, tensor.clone()))
        .await
        .expect("publish");
    within(LIMIT, "copy get", copy.get_version(NAME, v))
        .await
        .expect("copy get");
    let (busy, spare) = match first_of(&publisher, &copy) {
        true => (publisher, copy),
        false => (copy, publisher),
    };
    let fetcher = node(config(broker.addr(), 0)).await;
    let crowd = node(config(broker.addr(), 0)).await;
    joined(&[&busy, &spare, &fetcher, &crowd]).await;
    let (busy_out, spare_out) = (
        busy.metrics().bytes_out.get(),
        spare.metrics().bytes_out.get(),
    );

    let fetch = get(&fetcher, v);
    // Once the fetcher has seen `busy`'s full rate, five direct pulls crowd it out: its
    // share of `busy`'s upload drops to a sixth.
    let seen = eventually(LIMIT, || {
        busy.metrics().bytes_out.get() - busy_out >= 6 << 20
    })
    .await;
    assert!(seen, "the fetcher never got going");
    let mut pulls = Vec::new();
    for _ in 0..5 {
        let (crowd, at) = (crowd.clone(), busy.addr().clone());
        pulls.push(tokio::spawn(
            async move { crowd.pull(&at, NAME, Some(v)).await },
        ));
    }
    let got = within(LIMIT, "fetch", fetch)
        .await
        .expect("task")
        .expect("the fetch completes");
    assert_eq!(got.data(), tensor.data());
    assert_eq!(got.hash(), tensor.hash());
    // Most of what was left came from the spare holder, at the byte reached.
    let from_spare = spare.metrics().bytes_out.get() - spare_out;
    assert!(
        from_spare >= BIG as u64 / 4,
        "the spare sent only {from_spare} bytes"
    );
    assert!(from_spare < BIG as u64, "the fetch started over");
    // Dropping `busy` harmed nothing there: no serve of it failed.
    assert_eq!(busy.metrics().transfers(TransferKind::Serve, false), 0);
    assert_eq!(fetcher.metrics().transfers(TransferKind::Pull, false), 0);
    assert_eq!(fetcher.metrics().transfers(TransferKind::Pull, true), 1);
    for p in pulls {
        p.abort();
    }
    for n in [crowd, fetcher, spare, busy] {
        n.shutdown().await;
    }
    broker.shutdown().await;
}

/// 32 MiB: eight pieces, at 4 MB/s about 8 s from one source.
const WIDE: usize = 32 << 20;

/// Three complete holders of `WIDE` bytes (the publisher and two nodes that got it), each
/// uploading at `FAST`; returns them with the version.
async fn three_holders(broker: &PeerAddr, seed: u8) -> (Vec<Node>, Tensor, u64) {
    let publisher = node(config(broker, FAST)).await;
    let tensor = Tensor::from_bytes(pattern(WIDE, seed));
    let v = within(LIMIT, "publish", publisher.publish(NAME, tensor.clone()))
        .await
        .expect("publish");
    let mut holders = vec![publisher];
    for _ in 0..2 {
        let copy = node(config(broker, FAST)).await;
        let got = within(LIMIT, "copy get", copy.get_version(NAME, v))
            .await
            .expect("copy get");
        assert_eq!(got.buffer.data(), tensor.data());
        holders.push(copy);
    }
    (holders, tensor, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetcher_takes_pieces_from_every_idle_holder_at_once() {
    use tb_dashboard::TransferKind;
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (holders, tensor, v) = three_holders(broker.addr(), 21).await;
    let fetcher = node(config(broker.addr(), 0)).await;
    let refs: Vec<&Node> = holders.iter().chain([&fetcher]).collect();
    joined(&refs).await;
    let before: Vec<u64> = holders
        .iter()
        .map(|h| h.metrics().bytes_out.get())
        .collect();

    let got = within(LIMIT, "fetch", get(&fetcher, v))
        .await
        .expect("task")
        .expect("the fetch completes");
    assert_eq!(got.data(), tensor.data());
    assert_eq!(got.hash(), tensor.hash());
    // Every holder served pieces, and together about one copy: no piece went twice.
    let sent: Vec<u64> = holders
        .iter()
        .zip(&before)
        .map(|(h, b)| h.metrics().bytes_out.get() - b)
        .collect();
    assert!(
        sent.iter().all(|&s| s > 0),
        "a holder served nothing: {sent:?}"
    );
    let total: u64 = sent.iter().sum();
    assert!(
        total >= WIDE as u64 && total < WIDE as u64 * 3 / 2,
        "the holders sent {sent:?} for a {WIDE}-byte tensor"
    );
    assert_eq!(fetcher.metrics().transfers(TransferKind::Pull, true), 1);
    assert_eq!(fetcher.metrics().transfers(TransferKind::Pull, false), 0);
    // The fetcher holds the version it assembled from pieces and serves it.
    let again = node(config(broker.addr(), 0)).await;
    let from_fetcher = within(LIMIT, "pull", again.pull(fetcher.addr(), NAME, Some(v)))
        .await
        .expect("pull from the fetcher");
    assert_eq!(from_fetcher.buffer.data(), tensor.data());
    for n in holders.into_iter().chain([fetcher, again]) {
        n.shutdown().await;
    }
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_dies_mid_fetch_leaves_its_pieces_to_the_others() {
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let (mut holders, tensor, v) = three_holders(broker.addr(), 23).await;
    let fetcher = node(config(broker.addr(), 0)).await;
    let refs: Vec<&Node> = holders.iter().chain([&fetcher]).collect();
    joined(&refs).await;
    let before = holders[1].metrics().bytes_out.get();

    let fetch = get(&fetcher, v);
    // Once the second holder has served some of its pieces, it goes away mid-piece.
    let serving = eventually(LIMIT, || {
        holders[1].metrics().bytes_out.get() - before >= 1 << 20
    })
    .await;
    assert!(serving, "the second holder never served");
    holders.remove(1).shutdown().await;
    let got = within(LIMIT, "fetch", fetch)
        .await
        .expect("task")
        .expect("the fetch completes from the other holders");
    assert_eq!(got.data(), tensor.data());
    assert_eq!(got.hash(), tensor.hash());
    for n in holders.into_iter().chain([fetcher]) {
        n.shutdown().await;
    }
    broker.shutdown().await;
}
