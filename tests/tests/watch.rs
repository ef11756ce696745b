//! Versions in one hop: a subscriber that heard of a name's publisher watches it, and the
//! publisher's next small versions (and, on the same-host socket, large ones: their bytes up
//! to 4 MiB, their memfd beyond) come straight down that stream (the broker's event
//! for each is a duplicate the subscription drops). Checks that every offered version is
//! told once, in order, with its bytes, and that the counters on both sides agree, on the
//! same-host socket (the default between two nodes of one host) and over QUIC.

use std::time::Duration;

use tb_broker::{Broker, BrokerOptions};
use tb_node::{
    Config, Node, PeerAddr, SubEvent, Subscription,
    proto::{ChannelKind, ClusterKey},
};
use tb_tests::{f32_tensor, node, test_config, within};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"watch tests share this secret, 32+ bytes..";

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET).expect("secret")
}

async fn broker(dir: &std::path::Path) -> Broker {
    let mut opts = BrokerOptions::new(dir);
    opts.node = test_config();
    opts.node.cluster_key = key();
    within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts")
}

fn worker_config(broker: &PeerAddr) -> Config {
    worker_on(broker, &ChannelKind::DEFAULT)
}

fn worker_on(broker: &PeerAddr, channels: &[ChannelKind]) -> Config {
    Config {
        brokers: vec![broker.clone()],
        channels: channels.to_vec(),
        cluster_key: key(),
        heartbeat_interval: Duration::from_millis(300),
        ..test_config()
    }
}

/// Publishes `version` of "w" (4 KiB, its bytes a function of the version) and waits for the
/// subscriber to be told it; panics on anything else (a duplicate or a gap included).
async fn publish_and_receive(publisher: &Node, sub: &mut Subscription, version: u64) {
    publish_and_receive_of(publisher, sub, "w", 1024, version).await;
}

/// [`publish_and_receive`] of `name`, `floats` f32s long.
async fn publish_and_receive_of(
    publisher: &Node,
    sub: &mut Subscription,
    name: &str,
    floats: usize,
    version: u64,
) {
    let tensor = f32_tensor(floats, version as u8);
    let published = publisher
        .publish(name, tensor.clone())
        .await
        .expect("publish");
    assert_eq!(published, version, "versions follow one another");
    let event = within(LIMIT, "event", sub.next_timeout(Duration::from_secs(20)))
        .await
        .expect("the subscription goes on")
        .expect("an event");
    match event {
        SubEvent::Version {
            version: told,
            tensor: got,
            ..
        } => {
            assert_eq!(told, version, "told once, in order");
            let got = got.expect("auto-fetched");
            assert_eq!(got.data(), tensor.data(), "bytes equal");
        }
        other => panic!("v{version}: unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_versions_come_straight_from_their_publisher_on_the_same_host_socket() {
    small_versions_come_straight_from_their_publisher(&ChannelKind::DEFAULT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_versions_come_straight_from_their_publisher_over_quic() {
    small_versions_come_straight_from_their_publisher(&[ChannelKind::Quic]).await;
}

async fn small_versions_come_straight_from_their_publisher(channels: &[ChannelKind]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let publisher = node(worker_on(broker.addr(), channels)).await;
    let subscriber = node(worker_on(broker.addr(), channels)).await;
    let mut sub = subscriber.subscribe("w").await.expect("subscribe");
    // The first versions come through the broker; their events name the publisher, which
    // the subscription starts watching in the background. Bounded: 200 versions.
    let mut version = 0;
    while subscriber.metrics().watch_offers_in.get() == 0 {
        version += 1;
        assert!(version <= 200, "no offer came straight from the publisher");
        publish_and_receive(&publisher, &mut sub, version).await;
    }
    settle_offers(&publisher, &subscriber).await;
    let (taken, sent) = (
        subscriber.metrics().watch_offers_in.get(),
        publisher.metrics().watch_offers_out.get(),
    );
    const MORE: u64 = 20;
    for _ in 0..MORE {
        version += 1;
        publish_and_receive(&publisher, &mut sub, version).await;
    }
    // Each of them was offered and taken (and its broker event dropped as old news). The
    // counters move after the bytes do (a version can be told by its broker's event first),
    // so they are awaited, bounded.
    let counted = tb_tests::eventually(Duration::from_secs(10), || {
        publisher.metrics().watch_offers_out.get() - sent == MORE
            && subscriber.metrics().watch_offers_in.get() - taken == MORE
    })
    .await;
    assert!(counted, "every version was offered and taken once");
    assert_eq!(publisher.metrics().watch_offers_out.get() - sent, MORE);
    assert_eq!(subscriber.metrics().watch_offers_in.get() - taken, MORE);
    assert_eq!(subscriber.metrics().watch_offers_refused.get(), 0);
    // Nothing else is waiting: no duplicate of any version.
    match sub.next_timeout(Duration::from_millis(500)).await {
        Some(Err(tb_node::Error::Timeout { .. })) => {}
        other => panic!("nothing more was published, got {other:?}"),
    }
    drop(sub);
    subscriber.shutdown().await;
    publisher.shutdown().await;
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_versions_come_as_their_bytes_on_the_same_host_socket() {
    // 1 MiB: over the `Offer` frame's limit, within the socket's inline 4 MiB.
    large_versions_come_straight_on_the_same_host_socket(256 << 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn larger_versions_come_as_their_memfd_on_the_same_host_socket() {
    // 5 MiB: passed as the publisher's sealed memfd.
    large_versions_come_straight_on_the_same_host_socket(5 << 18).await;
}

/// Waits (bounded) until every offer the publisher counted as sent is counted as taken and
/// the other way round: the publisher counts an offer once its write is done, which on the
/// same-host socket can be after the subscriber has counted it, so counters read before
/// this would tell one offer apart.
async fn settle_offers(publisher: &Node, subscriber: &Node) {
    let settled = tb_tests::eventually(Duration::from_secs(10), || {
        publisher.metrics().watch_offers_out.get()
            == subscriber.metrics().watch_offers_in.get()
                + subscriber.metrics().watch_offers_refused.get()
    })
    .await;
    assert!(
        settled,
        "{} offers sent, {} taken before the counted versions",
        publisher.metrics().watch_offers_out.get(),
        subscriber.metrics().watch_offers_in.get()
    );
}

/// Versions of `FLOATS` f32s published one after another reach a same-host subscriber
/// straight from the publisher, each told once with its bytes.
async fn large_versions_come_straight_on_the_same_host_socket(floats: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let publisher = node(worker_config(broker.addr())).await;
    let subscriber = node(worker_config(broker.addr())).await;
    let mut sub = subscriber.subscribe("big").await.expect("subscribe");
    // The first versions come through the broker (and are pulled) until the watch is up;
    // bounded: 200 versions.
    let mut version = 0;
    while subscriber.metrics().watch_offers_in.get() == 0 {
        version += 1;
        assert!(
            version <= 200,
            "no large version came straight from the publisher"
        );
        publish_and_receive_of(&publisher, &mut sub, "big", floats, version).await;
    }
    settle_offers(&publisher, &subscriber).await;
    let taken = subscriber.metrics().watch_offers_in.get();
    let sent = publisher.metrics().watch_offers_out.get();
    let pulled = subscriber.metrics().bytes_in.get();
    const MORE: u64 = 10;
    for _ in 0..MORE {
        version += 1;
        publish_and_receive_of(&publisher, &mut sub, "big", floats, version).await;
    }
    // The broker's event may beat an offer (on the same-host socket it often does): the
    // version is then pulled after a short wait, and the test publishes the next one while
    // that offer is still on its way, so the publisher may coalesce an offer away. Each
    // version is offered once at most and each offer taken once at most, and the watch
    // carries versions.
    let offered = || publisher.metrics().watch_offers_out.get() - sent;
    let took = || subscriber.metrics().watch_offers_in.get() - taken;
    let settled = tb_tests::eventually(Duration::from_secs(10), || took() == offered()).await;
    assert!(settled, "{} offers sent, {} taken", offered(), took());
    assert!(
        (1..=MORE).contains(&offered()),
        "{} offers for {MORE} versions",
        offered()
    );
    assert_eq!(subscriber.metrics().watch_offers_refused.get(), 0);
    // An offer and the broker's event race: a version whose event came first is pulled (and
    // its offer, old news, dropped), so no more than that was pulled. How often offers win
    // is the benchmark's business.
    let extra_pulled = subscriber.metrics().bytes_in.get() - pulled;
    assert!(
        extra_pulled <= MORE * (floats as u64 * 4),
        "pulled {extra_pulled} bytes"
    );
    drop(sub);
    subscriber.shutdown().await;
    publisher.shutdown().await;
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_versions_over_quic_and_a_nodes_own_versions_are_not_offered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let quic = [ChannelKind::Quic];
    let publisher = node(worker_on(broker.addr(), &quic)).await;
    let subscriber = node(worker_on(broker.addr(), &quic)).await;
    let mut theirs = subscriber.subscribe("big").await.expect("subscribe");
    let mut mine = publisher.subscribe("w").await.expect("subscribe");
    for v in 1..=5u8 {
        // 64 KiB: over the inline limit, told through the broker and pulled.
        let big = f32_tensor(16 << 10, v);
        publisher
            .publish("big", big.clone())
            .await
            .expect("publish");
        let small = f32_tensor(1024, v);
        publisher
            .publish("w", small.clone())
            .await
            .expect("publish");
        for (sub, tensor) in [(&mut theirs, &big), (&mut mine, &small)] {
            let event = within(LIMIT, "event", sub.next_timeout(Duration::from_secs(20)))
                .await
                .expect("goes on")
                .expect("event");
            let SubEvent::Version {
                version,
                tensor: Some(got),
                ..
            } = event
            else {
                panic!("unexpected {event:?}");
            };
            assert_eq!(version, u64::from(v));
            assert_eq!(got.data(), tensor.data(), "bytes equal");
        }
    }
    assert_eq!(publisher.metrics().watch_offers_out.get(), 0);
    assert_eq!(subscriber.metrics().watch_offers_in.get(), 0);
    drop((theirs, mine));
    subscriber.shutdown().await;
    publisher.shutdown().await;
    broker.shutdown().await;
}

/// `subscribe` returns once its broker registered the subscription: a version published right
/// after it returns is told, every time (20 fresh names, no settling sleep).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_published_right_after_subscribe_returns_is_told() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let publisher = node(worker_config(broker.addr())).await;
    let subscriber = node(worker_config(broker.addr())).await;
    for i in 0..20u8 {
        let name = format!("fresh/{i}");
        let mut sub = subscriber.subscribe(&name).await.expect("subscribe");
        let tensor = f32_tensor(256, i);
        let version = publisher
            .publish(&name, tensor.clone())
            .await
            .expect("publish");
        let event = within(LIMIT, "event", sub.next_timeout(Duration::from_secs(20)))
            .await
            .expect("the subscription goes on")
            .unwrap_or_else(|e| {
                panic!("{name}: the version published right after was missed: {e}")
            });
        match event {
            SubEvent::Version {
                version: told,
                tensor: got,
                ..
            } => {
                assert_eq!(told, version, "{name}");
                assert_eq!(got.expect("auto-fetched").data(), tensor.data(), "{name}");
            }
            other => panic!("{name}: unexpected {other:?}"),
        }
    }
    subscriber.shutdown().await;
    publisher.shutdown().await;
    broker.shutdown().await;
}
