//! Sources that stall or lie: a holder that trickles bytes below the floor rate, holders whose
//! bytes do not hash right after a resume, a local copy that is not the registry's, and a
//! get's deadline. The misbehaving holders are raw `tb/data/1` servers (`Fake`); the broker
//! is the fake one, whose registry the tests edit to order the holders.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use iroh::{
    SecretKey,
    endpoint::{Connection, SendStream},
    protocol::{AcceptError, ProtocolHandler, Router},
};
use tb_proto::{
    ChannelKind, DATA_ALPN, DataRequest, DataResponse, HolderAddr, Member, NodeId, RegistryOp,
    Role, Stamp,
};

use super::{FakeCluster, config, data_hello, eventually, name, tensor, within, worker};
use crate::{Config, Error, Node, Tensor, auth, bind_endpoint, cluster::wall_ms, wire};

/// Bytes a trickle sends at once after the header.
const BURST: usize = 64 << 10;
/// Pause between a trickle's single bytes.
const DRIP: Duration = Duration::from_millis(50);
/// Most single bytes a trickle sends (about a minute).
const MAX_DRIPS: usize = 1200;

/// How a fake holder answers a pull of its tensor.
#[derive(Debug, Clone, Copy)]
enum Act {
    /// The header, [`BURST`] bytes, then one byte every [`DRIP`].
    Trickle,
    /// The first half of the bytes asked for, each byte flipped, then the end of the stream.
    CorruptHalf,
    /// The first half of the bytes asked for, right, then the end of the stream.
    HonestHalf,
    /// Every byte asked for, flipped.
    Lie,
}

/// What a fake holder saw.
#[derive(Debug, Default)]
struct Seen {
    /// Pulls of the whole version.
    whole: AtomicUsize,
    /// Pulls of a range (a resume).
    ranged: AtomicUsize,
    /// A write failed: the puller stopped the stream or dropped the link.
    stopped: AtomicBool,
}

/// A `tb/data/1` server that holds `tensor` and answers pulls as `act` says.
#[derive(Debug, Clone)]
struct Fake {
    me: iroh::EndpointId,
    tensor: Tensor,
    act: Act,
    seen: Arc<Seen>,
}

impl ProtocolHandler for Fake {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !data_hello(&conn, self.me).await {
            return Ok(());
        }
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let (version, range) = match wire::read_frame(&mut recv).await {
                Ok(DataRequest::Pull { version, range, .. }) => (version, range),
                // No channels besides QUIC.
                Ok(DataRequest::Channels { .. }) => {
                    let none = DataResponse::Channels { offers: Vec::new() };
                    let _ = wire::write_frame(&mut send, &none).await;
                    let _ = send.finish();
                    continue;
                }
                _ => break,
            };
            let len = self.tensor.data().len();
            let (at, end) = match range {
                Some(r) => {
                    self.seen.ranged.fetch_add(1, Ordering::SeqCst);
                    (r.offset as usize, (r.offset + r.len) as usize)
                }
                None => {
                    self.seen.whole.fetch_add(1, Ordering::SeqCst);
                    (0, len)
                }
            };
            let header = DataResponse::Header {
                meta: self.tensor.meta().clone(),
                version: version.unwrap_or(1),
            };
            if wire::write_frame(&mut send, &header).await.is_err() {
                continue;
            }
            // Each stream on its own task: a trickle must not hold up the next request.
            let (fake, bytes) = (self.clone(), self.tensor.data().slice(at..end));
            tokio::spawn(async move { fake.answer(send, &bytes).await });
        }
        Ok(())
    }
}

impl Fake {
    /// Sends `bytes` (the range asked for) as `self.act` says.
    async fn answer(&self, mut send: SendStream, bytes: &[u8]) {
        let flipped = |b: &[u8]| b.iter().map(|x| x ^ 0x5a).collect::<Vec<u8>>();
        let half = &bytes[..bytes.len() / 2];
        let sent = match self.act {
            Act::Trickle => self.trickle(&mut send, bytes).await,
            Act::CorruptHalf => send.write_all(&flipped(half)).await.is_ok(),
            Act::HonestHalf => send.write_all(half).await.is_ok(),
            Act::Lie => send.write_all(&flipped(bytes)).await.is_ok(),
        };
        if !sent {
            self.seen.stopped.store(true, Ordering::SeqCst);
            return;
        }
        let _ = send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(10), send.stopped()).await;
    }

    /// Sends [`BURST`] bytes, then one byte per [`DRIP`]: whether every write went out.
    async fn trickle(&self, send: &mut SendStream, bytes: &[u8]) -> bool {
        let burst = BURST.min(bytes.len());
        if send.write_all(&bytes[..burst]).await.is_err() {
            return false;
        }
        for b in bytes[burst..].iter().take(MAX_DRIPS) {
            tokio::time::sleep(DRIP).await;
            if send.write_all(&[*b]).await.is_err() {
                return false;
            }
        }
        true
    }
}

/// A fake holder of `tensor` running on an endpoint of its own (with `key`, a fresh one by
/// default): its router, its address for look-ups, and what it sees.
async fn fake_holder(
    tensor: &Tensor,
    act: Act,
    key: Option<SecretKey>,
) -> (Router, HolderAddr, Arc<Seen>) {
    let key = key.unwrap_or_else(SecretKey::generate);
    let ep = bind_endpoint(&Config::default(), key)
        .await
        .expect("endpoint");
    let seen = Arc::new(Seen::default());
    let fake = Fake {
        me: ep.id(),
        tensor: tensor.clone(),
        act,
        seen: seen.clone(),
    };
    let holder = HolderAddr {
        node: auth::node_id(&ep.id()),
        addrs: vec![ep.bound_sockets()[0].to_string()],
        complete: true,
    };
    let router = Router::builder(ep).accept(DATA_ALPN, fake).spawn();
    (router, holder, seen)
}

/// A stamp newer than any the fake brokers issue during a test.
fn later() -> Stamp {
    Stamp {
        wall_ms: wall_ms() + 3_600_000,
        logical: 0,
        node: NodeId([0xcc; 32]),
    }
}

/// Writes straight into the fake registry that `holder` holds `version` of `name` (or, with
/// `present` false, no longer does).
fn mark_holder(fake: &FakeCluster, name: &str, version: u64, holder: &HolderAddr, present: bool) {
    let mut st = fake.state();
    if present {
        st.registry.apply(&RegistryOp::Member(Member {
            node: holder.node,
            role: Role::Worker,
            addrs: holder.addrs.clone(),
            epoch: 1,
            alive: true,
            stamp: later(),
        }));
    }
    let op = RegistryOp::holder(super::name(name), version, holder.node, later(), present);
    st.registry.apply(&op);
}

/// A node on QUIC alone (shm would hand a same-host holder's version over whole).
fn quic(brokers: &[crate::PeerAddr]) -> Config {
    Config {
        channels: vec![ChannelKind::Quic],
        ..config(brokers)
    }
}

/// A getter that judges its sources over one-second periods, with a floor of 256 KiB/s:
/// above a trickle's burst, far below what a holder on this host sends even on a busy
/// machine.
fn impatient(brokers: &[crate::PeerAddr]) -> Config {
    Config {
        stall_timeout: Duration::from_secs(1),
        min_source_rate: 256 << 10,
        ..quic(brokers)
    }
}

async fn shut(nodes: impl IntoIterator<Item = Node>, routers: impl IntoIterator<Item = Router>) {
    for router in routers {
        let _ = router.shutdown().await;
    }
    for node in nodes {
        node.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_source_trickling_under_the_floor_is_left_for_the_next_at_the_byte_reached() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let brokers = [b];
    let (a, c) = (
        worker(quic(&brokers)).await,
        worker(impatient(&brokers)).await,
    );
    let t = tensor(256 << 10, 7); // 1 MiB: one stream
    within("publish", a.publish("m/w", t.clone()))
        .await
        .expect("publish");
    let (router, trickler, seen) = fake_holder(&t, Act::Trickle, None).await;
    fake.state().first_holder = Some(trickler);
    let sent_before = a.ctx().metrics.bytes_out.get();
    // Before the floor, one byte per 50 ms kept the stall watchdog quiet for ~4 hours.
    let got = within("get", c.get("m/w")).await.expect("get");
    assert_eq!(got.buffer.data(), t.data());
    assert_eq!(got.buffer.hash(), t.hash());
    let from_a = a.ctx().metrics.bytes_out.get() - sent_before;
    assert!(
        from_a > 0 && from_a < t.byte_len(),
        "the honest holder sent the rest only: {from_a} of {} bytes",
        t.byte_len()
    );
    assert_eq!(seen.whole.load(Ordering::SeqCst), 1, "asked once");
    assert!(
        eventually(|| seen.stopped.load(Ordering::SeqCst)).await,
        "the trickle's stream was stopped"
    );
    shut([a, c, broker], [router]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_whose_only_source_trickles_fails_with_no_holder_and_the_floor_timeout() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let brokers = [b];
    let (a, c) = (
        worker(quic(&brokers)).await,
        worker(impatient(&brokers)).await,
    );
    let t = tensor(256 << 10, 8);
    within("publish", a.publish("m/w", t.clone()))
        .await
        .expect("publish");
    let (router, trickler, seen) = fake_holder(&t, Act::Trickle, None).await;
    // The registry forgets the honest holder: the trickler is the only source.
    let honest = HolderAddr {
        node: auth::node_id(&a.id()),
        addrs: Vec::new(),
        complete: true,
    };
    mark_holder(&fake, "m/w", 1, &honest, false);
    fake.state().first_holder = Some(trickler);
    match within("get", c.get("m/w")).await {
        Err(Error::NoHolder { tried, last, .. }) => {
            assert_eq!(tried, 1, "{last}");
            assert!(last.contains("timed out"), "{last}");
            assert!(last.contains("bytes/s or more"), "{last}");
        }
        other => panic!("expected NoHolder after the floor timeout, got {other:?}"),
    }
    assert_eq!(seen.whole.load(Ordering::SeqCst), 1);
    assert_eq!(c.versions_receiving(), 0);
    shut([a, c, broker], [router]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_after_a_resume_does_not_drop_the_honest_source_that_finished() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let brokers = [b];
    let (a, c) = (worker(quic(&brokers)).await, worker(quic(&brokers)).await);
    let t = tensor(256 << 10, 9);
    within("publish", a.publish("m/w", t.clone()))
        .await
        .expect("publish");
    // The liar sends a bad first half and breaks; the honest holder resumes at the half.
    let (router, liar, seen) = fake_holder(&t, Act::CorruptHalf, None).await;
    fake.state().first_holder = Some(liar);
    let sent_before = a.ctx().metrics.bytes_out.get();
    let got = within("get", c.get("m/w")).await.expect("get");
    assert_eq!(got.buffer.data(), t.data());
    assert_eq!(got.buffer.hash(), t.hash());
    // Before, the honest holder that finished was the one dropped, and the get failed.
    let from_a = a.ctx().metrics.bytes_out.get() - sent_before;
    assert_eq!(
        from_a,
        t.byte_len() / 2 + t.byte_len(),
        "the honest holder sent the rest, then the whole version"
    );
    assert_eq!(seen.whole.load(Ordering::SeqCst), 1, "the liar was dropped");
    assert_eq!(seen.ranged.load(Ordering::SeqCst), 0);
    shut([a, c, broker], [router]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_liar_that_resumed_is_asked_for_the_whole_version_and_dropped() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let brokers = [b];
    let (a, c) = (worker(quic(&brokers)).await, worker(quic(&brokers)).await);
    let t = tensor(256 << 10, 10);
    within("publish", a.publish("m/w", t.clone()))
        .await
        .expect("publish");
    // Holders in look-up order: the honest one that breaks at the half, the liar (its id
    // sorts before the publisher's), the publisher.
    let (half_router, half, half_seen) = fake_holder(&t, Act::HonestHalf, None).await;
    let a_id = auth::node_id(&a.id());
    let key = (0..256)
        .map(|_| SecretKey::generate())
        .find(|k| auth::node_id(&k.public()) < a_id)
        .expect("a key that sorts first");
    let (liar_router, liar, liar_seen) = fake_holder(&t, Act::Lie, Some(key)).await;
    mark_holder(&fake, "m/w", 1, &liar, true);
    fake.state().first_holder = Some(half);
    let sent_before = a.ctx().metrics.bytes_out.get();
    let got = within("get", c.get("m/w")).await.expect("get");
    assert_eq!(got.buffer.data(), t.data());
    assert_eq!(got.buffer.hash(), t.hash());
    assert_eq!(half_seen.whole.load(Ordering::SeqCst), 1);
    // The liar resumed, the bytes did not hash right, and it was asked for the whole
    // version: it lied alone, was dropped and not asked again.
    assert_eq!(liar_seen.ranged.load(Ordering::SeqCst), 1);
    assert_eq!(liar_seen.whole.load(Ordering::SeqCst), 1);
    let from_a = a.ctx().metrics.bytes_out.get() - sent_before;
    assert_eq!(from_a, t.byte_len(), "the publisher sent the whole version");
    shut([a, c, broker], [half_router, liar_router]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_copy_that_is_not_the_registrys_is_never_returned() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let brokers = [b];
    let (a, c, d) = (
        worker(quic(&brokers)).await,
        worker(quic(&brokers)).await,
        worker(quic(&brokers)).await,
    );
    let (t, stale) = (tensor(1000, 11), tensor(1000, 12));
    // c and d hold other bytes under v1 than the registry will list.
    assert_eq!(c.publish_local("m/w", stale.clone()).expect("local"), 1);
    assert_eq!(d.publish_local("m/w", stale.clone()).expect("local"), 1);
    let v = within("publish", a.publish("m/w", t.clone()))
        .await
        .expect("publish");
    assert_eq!(v, 1);
    let mut into = vec![0u8; t.data().len()];
    let (got_v, meta) = within(
        "get_into",
        d.get_into("m/w", Some(1), &mut into, |_| Ok(())),
    )
    .await
    .expect("get_into");
    assert_eq!((got_v, &meta), (1, t.meta()));
    assert_eq!(&into[..], &t.data()[..]);
    let got = within("get v1", c.get_version("m/w", 1))
        .await
        .expect("get v1");
    assert_eq!(got.buffer.data(), t.data());
    let got = within("get", c.get("m/w")).await.expect("get");
    assert_eq!(got.buffer.data(), t.data());
    // When no other node holds the version, the stale copy is still not returned.
    let holder = |n: &Node| HolderAddr {
        node: auth::node_id(&n.id()),
        addrs: Vec::new(),
        complete: true,
    };
    mark_holder(&fake, "m/w", 1, &holder(&a), false);
    mark_holder(&fake, "m/w", 1, &holder(&c), false);
    match within("get", d.get_version("m/w", 1)).await {
        Err(Error::NotFound { what }) => assert!(what.contains("this node's copy"), "{what}"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    shut([a, c, d, broker], []).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_past_its_deadline_times_out_and_stops_what_it_started() {
    let fake = FakeCluster::new();
    let (broker, b) = fake.broker(config(&[])).await;
    let brokers = [b];
    // No floor: without a deadline, the trickle would hold this get for hours.
    let patient = Config {
        min_source_rate: 0,
        ..quic(&brokers)
    };
    let (a, c) = (worker(quic(&brokers)).await, worker(patient).await);
    let t = tensor(256 << 10, 13);
    within("publish", a.publish("m/w", t.clone()))
        .await
        .expect("publish");
    let got = within(
        "get within",
        c.get_within("m/w", None, Some(Duration::from_secs(20))),
    )
    .await
    .expect("a get well within its deadline");
    assert_eq!(got.buffer.data(), t.data());

    let t2 = tensor(256 << 10, 14);
    let v2 = within("publish", a.publish("m/w", t2.clone()))
        .await
        .expect("publish");
    let (router, trickler, seen) = fake_holder(&t2, Act::Trickle, None).await;
    fake.state().first_holder = Some(trickler);
    let deadline = Duration::from_millis(1500);
    match within("get within", c.get_within("m/w", Some(v2), Some(deadline))).await {
        Err(Error::Timeout { what, after }) => {
            assert_eq!(after, deadline);
            assert!(
                what.contains("m/w") && what.contains(&format!("v{v2}")),
                "{what}"
            );
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert_eq!(seen.whole.load(Ordering::SeqCst), 1);
    // Its stream stopped, its receive ended, and the broker heard that it stopped fetching.
    assert!(eventually(|| seen.stopped.load(Ordering::SeqCst)).await);
    assert_eq!(c.versions_receiving(), 0);
    let me = auth::node_id(&c.id());
    let n = name("m/w");
    let ended = || {
        let st = fake.state();
        let mut mine = st.fetching.iter().rev();
        let last = mine.find(|f| f.0 == n && f.1 == v2 && f.2 == me);
        last.is_some_and(|f| !f.3)
    };
    assert!(eventually(ended).await, "the fan-out slot was handed back");
    shut([a, c, broker], [router]).await;
}
