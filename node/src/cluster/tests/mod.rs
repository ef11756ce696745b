//! The cluster client end to end against fake brokers (`fake_broker`): publish, get, failover,
//! holder failures, resumed transfers, subscriptions, retention announcements, heartbeats.

mod fake_broker;
mod lying;
mod race;
mod slow_dial;

use std::{
    collections::BTreeMap,
    future::Future,
    time::{Duration, Instant},
};

use iroh::{
    SecretKey,
    endpoint::Connection,
    protocol::{AcceptError, ProtocolHandler, Router},
};
use tb_proto::{DATA_ALPN, DataRequest, DataResponse, HolderAddr, TensorName};

use self::fake_broker::FakeCluster;
use crate::{
    Config, DType, Error, Node, PeerAddr, SubEvent, Subscription, Tensor, auth, bind_endpoint, wire,
};

const LIMIT: Duration = Duration::from_secs(30);

fn config(brokers: &[PeerAddr]) -> Config {
    Config {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        stall_timeout: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(100),
        brokers: brokers.to_vec(),
        ..Config::default()
    }
}

async fn worker(config: Config) -> Node {
    Node::spawn(config).await.expect("worker starts")
}

fn tensor(n: usize, seed: u8) -> Tensor {
    let data: Vec<u8> = (0..n * 4)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    Tensor::new(DType::F32, vec![n as u64], data).expect("tensor")
}

fn name(s: &str) -> TensorName {
    TensorName::new(s).expect("name")
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(LIMIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {LIMIT:?}"),
    }
}

async fn eventually(mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < LIMIT {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}

/// An address where nothing answers.
fn dead_broker() -> PeerAddr {
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("free port")
        .port();
    PeerAddr {
        id: SecretKey::generate().public(),
        addr: ([127, 0, 0, 1], port).into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_node_says_so() {
    let node = worker(Config::default()).await;
    assert!(matches!(
        node.publish("m/w", tensor(4, 1)).await,
        Err(Error::Standalone)
    ));
    assert!(matches!(node.get("m/w").await, Err(Error::Standalone)));
    assert!(matches!(
        node.subscribe("m/*").await,
        Err(Error::Standalone)
    ));
    assert!(node.current_broker().is_none());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_then_get_from_another_worker() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let (a, c) = (
        worker(config(std::slice::from_ref(&b))).await,
        worker(config(&[b])).await,
    );
    let (t1, t2) = (tensor(1000, 1), tensor(1000, 2));
    assert_eq!(
        within("publish", a.publish("m/w", t1.clone()))
            .await
            .expect("v1"),
        1
    );
    assert_eq!(
        within("publish", a.publish("m/w", t2.clone()))
            .await
            .expect("v2"),
        2
    );
    let got = within("get", c.get("m/w")).await.expect("get");
    assert_eq!((got.version, got.buffer.data()), (2, t2.data()));
    let old = within("get v1", c.get_version("m/w", 1)).await.expect("v1");
    assert_eq!(old.buffer.data(), t1.data());
    assert!(matches!(c.get("m/none").await, Err(Error::NotFound { .. })));
    assert!(matches!(
        c.get_version("m/w", 0).await,
        Err(Error::NotFound { .. })
    ));
    // The getter holds v2 now, and said so, which ended its fetch at the broker: for versions
    // this small it sent no `Fetching` at all (the look-up recorded the fetch).
    let (n, me) = (name("m/w"), auth::node_id(&c.id()));
    let holds = |v: u64| {
        let st = fake.state();
        let entry = st.registry.entry(&n).expect("live");
        entry.holders_of(v).any(|h| h == me)
    };
    assert!(
        eventually(|| holds(2)).await,
        "the getter announced it holds v2"
    );
    assert!(fake.state().fetching.iter().all(|f| f.2 != me));
    // A large version's fetch is announced as in flight; the holder announcement ends it.
    let big = tensor(1 << 19, 3);
    let v3 = within("publish", a.publish("m/w", big.clone()))
        .await
        .expect("v3");
    let got = within("get", c.get("m/w")).await.expect("get");
    assert_eq!((got.version, got.buffer.data()), (v3, big.data()));
    assert!(
        eventually(|| holds(v3)).await,
        "the getter announced it holds v3"
    );
    let mine = |active| {
        move |f: &(TensorName, u64, tb_proto::NodeId, bool)| f.1 == v3 && f.2 == me && f.3 == active
    };
    assert!(eventually(|| fake.state().fetching.iter().any(mine(true))).await);
    assert!(
        !fake.state().fetching.iter().any(mine(false)),
        "ended by holding"
    );
    let listed = within("list", c.list("m/")).await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].version, listed[0].holders), (v3, 2));
    let members = within("members", c.members()).await.expect("members");
    assert_eq!(members.len(), 2);
    for node in [a, c, broker] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_fail_over_to_the_next_broker_and_stay_there() {
    let fake = FakeCluster::new();
    let (broker, live) = fake.broker(config(&[])).await;
    let mut cfg = config(&[dead_broker(), live.clone()]);
    cfg.connect_timeout = Duration::from_millis(500);
    let a = worker(cfg.clone()).await;
    assert_eq!(
        within("publish", a.publish("m/w", tensor(8, 1)))
            .await
            .expect("publish"),
        1
    );
    assert_eq!(a.current_broker(), Some(&live));
    let started = Instant::now();
    within("list", a.list("")).await.expect("list");
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "the dead broker is not retried first"
    );
    cfg.brokers = vec![dead_broker(), dead_broker()];
    let lost = worker(cfg).await;
    match within("list", lost.list("")).await {
        Err(Error::NoBroker { tried: 2, .. }) => {}
        other => panic!("expected NoBroker, got {other:?}"),
    }
    for node in [a, lost, broker] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_is_passed_over_for_the_next() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let brokers = [b];
    let (a, b, c) = (
        worker(config(&brokers)).await,
        worker(config(&brokers)).await,
        worker(config(&brokers)).await,
    );
    let t = tensor(50_000, 3);
    within("publish", a.publish("m/w", t.clone()))
        .await
        .expect("publish");
    within("get", b.get("m/w")).await.expect("b gets");
    a.shutdown().await;
    let got = within("get", c.get("m/w")).await.expect("c gets from b");
    assert_eq!(got.buffer.data(), t.data());
    for node in [b, c, broker] {
        node.shutdown().await;
    }
}

/// The serving side of the `tb/data/1` hello on the open key, as a raw server does it:
/// whether it succeeded.
async fn data_hello(conn: &Connection, me: iroh::EndpointId) -> bool {
    let key = tb_proto::ClusterKey::open();
    let admission = auth::Admission::new(&Config::default());
    auth::server_hello(conn, me, &key, DATA_ALPN, &admission, 1 << 40, |_| {})
        .await
        .is_ok()
}

/// A holder that sends the header and the first half of the payload, then ends the stream.
#[derive(Debug, Clone)]
struct HalfServer {
    me: iroh::EndpointId,
    tensor: Tensor,
}

impl ProtocolHandler for HalfServer {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !data_hello(&conn, self.me).await {
            return Ok(());
        }
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let version = match wire::read_frame(&mut recv).await {
                Ok(DataRequest::Pull { version, .. }) => version,
                // No channels besides QUIC.
                Ok(DataRequest::Channels { .. }) => {
                    let none = DataResponse::Channels { offers: Vec::new() };
                    let _ = wire::write_frame(&mut send, &none).await;
                    let _ = send.finish();
                    continue;
                }
                _ => break,
            };
            let header = DataResponse::Header {
                meta: self.tensor.meta().clone(),
                version: version.unwrap_or(1),
            };
            let half = self.tensor.data().slice(..self.tensor.data().len() / 2);
            let _ = wire::write_frame(&mut send, &header).await;
            let _ = send.write_all(&half).await;
            let _ = send.finish();
            let _ = send.stopped().await;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_breaks_mid_transfer_is_resumed_at_the_byte_by_the_next() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let (a, c) = (
        worker(config(std::slice::from_ref(&b))).await,
        worker(config(&[b])).await,
    );
    let t = tensor(1 << 20, 4); // 4 MiB
    within("publish", a.publish("m/big", t.clone()))
        .await
        .expect("publish");
    let ep = bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    let half = HalfServer {
        me: ep.id(),
        tensor: t.clone(),
    };
    let holder = HolderAddr {
        node: auth::node_id(&ep.id()),
        addrs: vec![ep.bound_sockets()[0].to_string()],
        complete: true,
    };
    let router = Router::builder(ep).accept(DATA_ALPN, half).spawn();
    fake.state().first_holder = Some(holder);
    let sent_before = a.ctx().metrics.bytes_out.get();
    let got = within("get", c.get("m/big")).await.expect("get");
    assert_eq!(got.buffer.data(), t.data());
    let from_a = a.ctx().metrics.bytes_out.get() - sent_before;
    assert_eq!(
        from_a,
        t.byte_len() / 2,
        "the second holder sent only the missing half"
    );
    let _ = router.shutdown().await;
    for node in [a, c, broker] {
        node.shutdown().await;
    }
}

/// A holder that offers every piece of `tensor` honestly but sends piece 1 with a byte
/// flipped.
#[derive(Debug, Clone)]
struct LyingPieceServer {
    me: iroh::EndpointId,
    tensor: Tensor,
}

impl ProtocolHandler for LyingPieceServer {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !data_hello(&conn, self.me).await {
            return Ok(());
        }
        let len = self.tensor.byte_len();
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            match wire::read_frame(&mut recv).await {
                Ok(DataRequest::Pieces { .. }) => {
                    let outline = DataResponse::Outline {
                        piece_len: tb_proto::piece::piece_len(len),
                        values: crate::channel::verify::outline(self.tensor.data()),
                        complete: true,
                        have: Vec::new(),
                    };
                    let _ = wire::write_frame(&mut send, &outline).await;
                }
                Ok(DataRequest::Pull {
                    version,
                    range: Some(range),
                    ..
                }) => {
                    let header = DataResponse::Header {
                        meta: self.tensor.meta().clone(),
                        version: version.unwrap_or(1),
                    };
                    let (at, end) = (range.offset as usize, (range.offset + range.len) as usize);
                    let mut bytes = self.tensor.data()[at..end].to_vec();
                    if tb_proto::piece::piece_range(len, 1).start == range.offset {
                        bytes[7] ^= 0x40;
                    }
                    let _ = wire::write_frame(&mut send, &header).await;
                    let _ = send.write_all(&bytes).await;
                }
                // No channels besides QUIC.
                Ok(DataRequest::Channels { .. }) => {
                    let none = DataResponse::Channels { offers: Vec::new() };
                    let _ = wire::write_frame(&mut send, &none).await;
                }
                _ => break,
            }
            let _ = send.finish();
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_sends_a_bad_piece_is_dropped_and_its_good_pieces_kept() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let (a, c) = (
        worker(config(std::slice::from_ref(&b))).await,
        worker(config(&[b])).await,
    );
    // 16 MiB: four pieces, fetched in pieces.
    let t = tensor(4 << 20, 6);
    assert_eq!(tb_proto::piece::piece_count(t.byte_len()), 4);
    within("publish", a.publish("m/big", t.clone()))
        .await
        .expect("publish");
    let ep = bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    let liar = LyingPieceServer {
        me: ep.id(),
        tensor: t.clone(),
    };
    let holder = HolderAddr {
        node: auth::node_id(&ep.id()),
        addrs: vec![ep.bound_sockets()[0].to_string()],
        complete: true,
    };
    let router = Router::builder(ep).accept(DATA_ALPN, liar).spawn();
    fake.state().first_holder = Some(holder);
    let sent_before = a.ctx().metrics.bytes_out.get();
    let got = within("get", c.get("m/big")).await.expect("get");
    assert_eq!(got.buffer.data(), t.data());
    assert_eq!(got.buffer.hash(), t.hash());
    // The bad piece came again from the honest holder; the liar's first piece, verified on
    // arrival, was kept.
    let from_a = a.ctx().metrics.bytes_out.get() - sent_before;
    let piece = tb_proto::piece::piece_len(t.byte_len());
    assert!(from_a >= piece, "the honest holder sent {from_a} bytes");
    assert!(
        from_a < t.byte_len(),
        "the fetch started over: {from_a} bytes"
    );
    let _ = router.shutdown().await;
    for node in [a, c, broker] {
        node.shutdown().await;
    }
}

/// Collects events until `done` says the subscriber has seen enough; returns per name the
/// versions delivered and skipped.
async fn collect(
    sub: &mut Subscription,
    mut done: impl FnMut(&BTreeMap<String, Vec<u64>>) -> bool,
) -> (BTreeMap<String, Vec<u64>>, BTreeMap<String, Vec<u64>>) {
    let (mut delivered, mut skipped) = (BTreeMap::new(), BTreeMap::<String, Vec<u64>>::new());
    while !done(&delivered) {
        match within("event", sub.next()).await {
            Some(Ok(SubEvent::Version {
                name,
                version,
                meta,
                tensor,
            })) => {
                let tensor = tensor.expect("auto-fetched");
                assert_eq!(tensor.hash(), meta.hash);
                delivered
                    .entry(name.to_string())
                    .or_insert_with(Vec::new)
                    .push(version);
            }
            Some(Ok(SubEvent::Skipped { name, from, to })) => {
                skipped
                    .entry(name.to_string())
                    .or_default()
                    .extend(from..=to);
            }
            Some(Ok(SubEvent::Deleted { name })) => panic!("unexpected delete of {name}"),
            Some(Err(e)) => panic!("subscription failed: {e}"),
            None => panic!("subscription ended"),
        }
    }
    (delivered, skipped)
}

/// Every version `1..=newest` is delivered or skipped, delivered ones in increasing order.
fn accounted(delivered: &[u64], skipped: &[u64], newest: u64) {
    assert!(delivered.windows(2).all(|w| w[0] < w[1]), "{delivered:?}");
    let mut all: Vec<u64> = delivered.iter().chain(skipped).copied().collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (1..=newest).collect::<Vec<_>>(),
        "{delivered:?} + {skipped:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_delivers_each_name_in_order_and_accounts_for_every_version() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let (a, s) = (
        worker(config(std::slice::from_ref(&b))).await,
        worker(config(&[b])).await,
    );
    let mut sub = within("subscribe", s.subscribe("m/*"))
        .await
        .expect("subscribe");
    assert!(eventually(|| fake.state().subscribers == 1).await);
    for v in 1..=6u8 {
        a.publish("m/a", tensor(10_000, v))
            .await
            .expect("publish a");
        if v <= 2 {
            a.publish("m/b", tensor(10, v)).await.expect("publish b");
        }
    }
    a.publish("other/x", tensor(4, 0))
        .await
        .expect("publish other");
    let newest = |d: &BTreeMap<String, Vec<u64>>, n: &str, v: u64| {
        d.get(n).and_then(|v| v.last()).copied() == Some(v)
    };
    let (delivered, skipped) =
        collect(&mut sub, |d| newest(d, "m/a", 6) && newest(d, "m/b", 2)).await;
    assert_eq!(delivered.len(), 2, "{delivered:?}");
    for (n, top) in [("m/a", 6), ("m/b", 2)] {
        let none = Vec::new();
        accounted(&delivered[n], skipped.get(n).unwrap_or(&none), top);
    }
    drop(sub);
    assert!(
        eventually(|| fake.state().subscribers == 0).await,
        "dropping ends it"
    );
    for node in [a, s, broker] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_moves_to_the_next_broker_when_its_broker_goes() {
    let fake = FakeCluster::new();
    let (first, b1) = fake.broker(config(&[])).await;
    let (second, b2) = fake.broker(config(&[])).await;
    let s = worker(config(&[b1.clone(), b2.clone()])).await;
    let a = worker(config(&[b2])).await;
    a.publish("m/w", tensor(100, 1)).await.expect("v1 before");
    let mut sub = within("subscribe", s.subscribe("m/w"))
        .await
        .expect("subscribe");
    assert_eq!(s.current_broker(), Some(&b1));
    assert!(eventually(|| fake.state().subscribers == 1).await);
    first.shutdown().await;
    a.publish("m/w", tensor(100, 2))
        .await
        .expect("v2 during the move");
    a.publish("m/w", tensor(100, 3))
        .await
        .expect("v3 during the move");
    let (delivered, skipped) = collect(&mut sub, |d| {
        d.get("m/w").and_then(|v| v.last()).copied() == Some(3)
    })
    .await;
    let mut seen: Vec<u64> = delivered["m/w"].clone();
    seen.extend(skipped.get("m/w").cloned().unwrap_or_default());
    seen.sort_unstable();
    assert_eq!(seen, [2, 3], "v1 predates the subscription");
    assert!(
        eventually(|| fake.state().subscribers == 1).await,
        "resubscribed"
    );
    a.publish("m/w", tensor(100, 4)).await.expect("v4 after");
    let (delivered, _) = collect(&mut sub, |d| d.contains_key("m/w")).await;
    assert_eq!(delivered["m/w"], [4]);
    for node in [a, s, second] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_versions_are_announced_and_heartbeats_stop_at_shutdown() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let a = worker(Config {
        keep_versions: 1,
        ..config(&[b])
    })
    .await;
    a.publish("m/w", tensor(4, 1)).await.expect("v1");
    a.publish("m/w", tensor(4, 2)).await.expect("v2");
    let (n, me) = (name("m/w"), auth::node_id(&a.id()));
    let holds = |v| {
        let st = fake.state();
        let entry = st.registry.entry(&n).cloned();
        entry.is_some_and(|e| e.holders_of(v).any(|h| h == me))
    };
    assert!(
        eventually(|| !holds(1)).await,
        "v1 was announced as dropped"
    );
    assert!(holds(2));
    assert!(eventually(|| fake.state().heartbeats >= 3).await);
    // Heartbeats carry the worker's figures: it holds v2 (4 f32s, 16 bytes) only.
    let stats = fake
        .state()
        .last_stats
        .clone()
        .expect("heartbeats carry stats");
    assert_eq!((stats.tensors, stats.store_bytes), (1, 16));
    assert_eq!(stats.metrics_url, None);
    a.shutdown().await;
    let after = fake.state().heartbeats;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(fake.state().heartbeats, after);
    broker.shutdown().await;
}

/// The next version event of `sub`, with its tensor.
async fn next_version(sub: &mut Subscription) -> (u64, Tensor) {
    match within("event", sub.next()).await {
        Some(Ok(SubEvent::Version {
            version,
            meta,
            tensor: Some(tensor),
            ..
        })) => {
            assert_eq!(tensor.hash(), meta.hash);
            (version, tensor)
        }
        other => panic!("expected a version with its tensor, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_version_reaches_subscribers_with_its_event_and_a_tampered_one_is_refused() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let (a, s) = (
        worker(config(std::slice::from_ref(&b))).await,
        worker(config(&[b])).await,
    );
    let mut sub = within("subscribe", s.subscribe("m/*"))
        .await
        .expect("subscribe");
    assert!(eventually(|| fake.state().subscribers == 1).await);
    // 4 KiB: its bytes ride with the publish and the event; the subscriber asks nobody.
    let small = tensor(1024, 1);
    let v1 = a.publish("m/s", small.clone()).await.expect("publish");
    let (version, got) = next_version(&mut sub).await;
    assert_eq!((version, got.data()), (v1, small.data()));
    assert_eq!(fake.state().lookups, 0, "no look-up for an inline version");
    // A second publish proposes its version: no NextVersion round trip, the next number.
    let v2 = a.publish("m/s", tensor(1024, 2)).await.expect("publish");
    assert_eq!(v2, v1 + 1);
    assert_eq!(next_version(&mut sub).await.0, v2);
    // Over the inline limit: fetched after the event, as before.
    let big = tensor(tb_proto::MAX_INLINE_BYTES as usize / 4 + 1, 3);
    a.publish("m/b", big.clone()).await.expect("publish big");
    let (_, got) = next_version(&mut sub).await;
    assert_eq!(got.data(), big.data());
    assert!(fake.state().lookups >= 1, "a large version is looked up");
    // A broker that flips a byte of the inline payload: the event is refused and the version
    // comes from its holder, verified, after the subscription reconnects.
    fake.state().tamper_inline = 1;
    let honest = tensor(1024, 4);
    let v3 = a.publish("m/s", honest.clone()).await.expect("publish");
    let (version, got) = next_version(&mut sub).await;
    assert_eq!((version, got.data()), (v3, honest.data()));
    assert_eq!(fake.state().tamper_inline, 0, "the tampered event was sent");
    for node in [a, s, broker] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_reaches_subscribers_and_hides_the_name() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let (a, s) = (
        worker(config(std::slice::from_ref(&b))).await,
        worker(Config {
            auto_fetch: false,
            ..config(&[b])
        })
        .await,
    );
    a.publish("m/w", tensor(4, 1)).await.expect("publish");
    let mut sub = within("subscribe", s.subscribe("m/w"))
        .await
        .expect("subscribe");
    assert!(eventually(|| fake.state().subscribers == 1).await);
    within("delete", a.delete("m/w")).await.expect("delete");
    match within("event", sub.next()).await {
        Some(Ok(SubEvent::Deleted { name })) => assert_eq!(name.as_str(), "m/w"),
        other => panic!("expected Deleted, got {other:?}"),
    }
    assert!(a.ctx().store.held_versions(&name("m/w")).is_empty());
    assert!(matches!(s.get("m/w").await, Err(Error::NotFound { .. })));
    a.publish("m/w", tensor(4, 2)).await.expect("publish again");
    match within("event", sub.next()).await {
        Some(Ok(SubEvent::Version {
            version: 2,
            tensor: None,
            ..
        })) => {}
        other => panic!("expected v2 without a tensor, got {other:?}"),
    }
    for node in [a, s, broker] {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_to_the_host_is_a_get_and_to_a_missing_device_is_unavailable() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let (a, c) = (
        worker(config(std::slice::from_ref(&b))).await,
        worker(config(&[b])).await,
    );
    let t = tensor(1000, 8);
    let v = within("publish", a.publish("m/dev", t.clone()))
        .await
        .expect("publish");
    let got = within("get_to", c.get_to("m/dev", Some(v), crate::Device::Host))
        .await
        .expect("get_to the host");
    assert_eq!(got.buffer.data(), t.data());
    if crate::device::probe(0).is_err() {
        let err = within("get_to", c.get_to("m/dev", None, crate::Device::Cuda(0)))
            .await
            .expect_err("no device here");
        assert!(matches!(err, Error::DeviceUnavailable(_)), "{err:?}");
    }
    for node in [a, c, broker] {
        node.shutdown().await;
    }
}
