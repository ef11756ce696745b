//! Node-to-node scenarios on loopback: push, pull, concurrency, large tensors, failures,
//! shutdown, and the connection pool. Every wait is bounded.

use std::{collections::HashSet, sync::Arc, time::Duration};

use tb_node::{Config, Error, Node, PeerAddr, Tensor, TransferProgress};
use tb_tests::{
    DelayProxy, ProgressSamples, check_progress, eventually, f32_tensor, free_udp_port, node,
    pattern, test_config, within,
};

const LIMIT: Duration = Duration::from_secs(60);

async fn pair() -> (Node, Node) {
    (node(test_config()).await, node(test_config()).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_arrives_intact() {
    let (a, b) = pair().await;
    let tensor = f32_tensor(1000, 7);
    within(LIMIT, "push", a.push(b.addr(), "grad/step1", &tensor))
        .await
        .expect("push");
    let got = within(LIMIT, "recv", b.recv_timeout(Duration::from_secs(5)))
        .await
        .expect("recv");
    assert_eq!(got.name.as_str(), "grad/step1");
    assert_eq!(got.from, a.id());
    assert_eq!(got.tensor.data(), tensor.data());
    assert_eq!(got.tensor.meta(), tensor.meta());
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pushs_progress_climbs_to_the_tensors_length() {
    let (a, b) = pair().await;
    let tensor = Tensor::from_bytes(pattern(32 << 20, 5));
    let total = tensor.byte_len();
    let progress = Arc::new(TransferProgress::default());
    let samples = ProgressSamples::start(progress.clone());
    within(
        LIMIT,
        "push",
        a.push_with_progress(b.addr(), "big/push", &tensor, &progress),
    )
    .await
    .expect("push");
    let samples = samples.stop().await;
    assert_eq!(progress.total(), Some(total));
    let between = check_progress(&samples, total);
    println!(
        "{} readings, {between} distinct values under way",
        samples.len()
    );
    let got = within(LIMIT, "recv", b.recv_timeout(Duration::from_secs(5)))
        .await
        .expect("recv");
    assert_eq!(got.tensor.data(), tensor.data(), "bytes equal");
    // A small push (sent with its header in one write) reports its bytes too.
    let small = TransferProgress::default();
    let tiny = f32_tensor(10, 1);
    a.push_with_progress(b.addr(), "small/push", &tiny, &small)
        .await
        .expect("small push");
    assert_eq!((small.bytes(), small.total()), (40, Some(40)));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_by_name_and_version() {
    let (a, b) = pair().await;
    let v1 = b
        .publish_local("model/w", f32_tensor(64, 1))
        .expect("publish");
    let v2 = b
        .publish_local("model/w", f32_tensor(64, 2))
        .expect("publish");
    let v3 = b
        .publish_local("model/w", f32_tensor(64, 3))
        .expect("publish");
    assert_eq!((v1, v2, v3), (1, 2, 3));
    let newest = a
        .pull(b.addr(), "model/w", None)
        .await
        .expect("pull newest");
    assert_eq!(newest.version, 3);
    assert_eq!(newest.buffer.data(), f32_tensor(64, 3).data());
    let older = a.pull(b.addr(), "model/w", Some(2)).await.expect("pull v2");
    assert_eq!(older.buffer.data(), f32_tensor(64, 2).data());
    // Retention keeps 2 versions: v1 is gone, and says so.
    match a.pull(b.addr(), "model/w", Some(1)).await {
        Err(Error::NotFound { what }) => assert!(what.contains("evicted"), "{what}"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_into_caller_buffer() {
    let (a, b) = pair().await;
    let tensor = f32_tensor(4096, 9);
    b.publish_local("kv/cache", tensor.clone())
        .expect("publish");
    let mut reused = vec![0u8; 4096 * 4];
    let pulled = a
        .pull_into(b.addr(), "kv/cache", None, |meta| {
            assert_eq!(meta.byte_len, 4096 * 4);
            Ok(&mut reused[..])
        })
        .await
        .expect("pull_into");
    assert_eq!(pulled.meta, *tensor.meta());
    assert_eq!(&reused[..], tensor.data().as_ref());
    // A wrong-sized destination is refused, not overrun.
    let mut small = [0u8; 10];
    let err = a
        .pull_into(b.addr(), "kv/cache", None, |_| Ok(&mut small[..]))
        .await;
    assert!(matches!(err, Err(Error::InvalidTensor(_))), "{err:?}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_from_many_tasks() {
    let (a, b) = pair().await;
    let mut tasks = Vec::new();
    for t in 0..32u8 {
        let (a, to) = (a.clone(), b.addr().clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..8u8 {
                let tensor = Tensor::from_bytes(pattern(1000 + usize::from(i), t));
                a.push(&to, &format!("t{t}/i{i}"), &tensor)
                    .await
                    .expect("push");
            }
        }));
    }
    let mut names = HashSet::new();
    for _ in 0..(32 * 8) {
        let got = within(LIMIT, "recv", b.recv_timeout(Duration::from_secs(20)))
            .await
            .expect("recv");
        let (t, i) = got.name.as_str().split_once('/').expect("name");
        let t: u8 = t[1..].parse().expect("t");
        let i: usize = i[1..].parse().expect("i");
        assert_eq!(got.tensor.data(), &pattern(1000 + i, t), "{}", got.name);
        names.insert(got.name);
    }
    assert_eq!(names.len(), 32 * 8, "every push arrives exactly once");
    for task in tasks {
        task.await.expect("task");
    }
    assert_eq!(a.pool_stats().dials, 1, "all tasks share one link");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_fire_small_sends_keep_order() {
    let (a, b) = pair().await;
    let receiver = {
        let b = b.clone();
        tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..2000 {
                let got = b.recv_timeout(Duration::from_secs(20)).await.expect("recv");
                seen.push(u32::from_le_bytes(
                    got.tensor.data()[..4].try_into().expect("4"),
                ));
            }
            seen
        })
    };
    for i in 0..2000u32 {
        let tensor = Tensor::from_bytes(i.to_le_bytes().repeat(16));
        a.push(b.addr(), "tick", &tensor).await.expect("push");
    }
    let seen = within(LIMIT, "receiver", receiver).await.expect("join");
    assert_eq!(seen, (0..2000).collect::<Vec<_>>());
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_tensor_256mib() {
    let (a, b) = pair().await;
    let tensor = Tensor::from_bytes(pattern(256 << 20, 3));
    b.publish_local("big", tensor.clone()).expect("publish");
    let pulled = within(LIMIT, "pull 256 MiB", a.pull(b.addr(), "big", None))
        .await
        .expect("pull");
    assert_eq!(pulled.meta.hash, tensor.hash());
    assert!(pulled.buffer.data() == tensor.data(), "bytes differ");
    // And the other way, by push.
    within(
        LIMIT,
        "push 256 MiB",
        a.push(b.addr(), "big/back", &pulled.buffer),
    )
    .await
    .expect("push");
    let got = b
        .wait_for("big/back", Duration::from_secs(30))
        .await
        .expect("wait_for");
    assert!(got.tensor.data() == tensor.data(), "pushed bytes differ");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sender_several_receivers() {
    let a = node(test_config()).await;
    let mut receivers = Vec::new();
    for _ in 0..4 {
        receivers.push(node(test_config()).await);
    }
    let tensor = f32_tensor(250_000, 5);
    let sends: Vec<_> = receivers
        .iter()
        .map(|r| {
            let (a, to, t) = (a.clone(), r.addr().clone(), tensor.clone());
            tokio::spawn(async move { a.push(&to, "weights", &t).await })
        })
        .collect();
    for send in sends {
        within(LIMIT, "push", send)
            .await
            .expect("join")
            .expect("push");
    }
    for r in &receivers {
        let got = r
            .wait_for("weights", Duration::from_secs(10))
            .await
            .expect("wait_for");
        assert_eq!(got.tensor.data(), tensor.data());
    }
    assert_eq!(a.pool_size(), 4, "one pooled link per receiver");
    for r in receivers {
        r.shutdown().await;
    }
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sending_before_the_receiver_is_ready() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_udp_port();
    let receiver_config = Config {
        bind_addr: ([127, 0, 0, 1], port).into(),
        data_dir: Some(dir.path().to_path_buf()),
        ..test_config()
    };
    // Learn the receiver's id from its key file, without starting it.
    let id = tb_node::load_or_create_key(dir.path())
        .expect("key")
        .public();
    let to: PeerAddr = format!("{id}@127.0.0.1:{port}").parse().expect("addr");
    let a = node(Config {
        connect_timeout: Duration::from_millis(500),
        ..test_config()
    })
    .await;
    let tensor = f32_tensor(100, 1);
    match within(LIMIT, "push to nobody", a.push(&to, "early", &tensor)).await {
        Err(Error::PeerUnreachable { .. }) => {}
        other => panic!("expected PeerUnreachable, got {other:?}"),
    }
    assert_eq!(a.pool_stats().connect_failures, 1);
    let b = node(receiver_config).await;
    assert_eq!(b.id(), id);
    let mut delivered = false;
    for _ in 0..20 {
        if a.push(&to, "early", &tensor).await.is_ok() {
            delivered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(delivered, "a retry after the receiver started succeeds");
    let got = b
        .wait_for("early", Duration::from_secs(5))
        .await
        .expect("wait_for");
    assert_eq!(got.tensor.data(), tensor.data());
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_shutdown_during_transfers() {
    let (a, b) = pair().await;
    b.publish_local("big", Tensor::from_bytes(pattern(64 << 20, 1)))
        .expect("publish");
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (a, from) = (a.clone(), b.addr().clone());
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                a.pull(&from, "big", None).await.map(|_| ())
            } else {
                a.push(&from, "up", &Tensor::from_bytes(pattern(8 << 20, 2)))
                    .await
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    within(Duration::from_secs(20), "shutdown", a.shutdown()).await;
    for task in tasks {
        let result = within(Duration::from_secs(20), "in-flight call", task)
            .await
            .expect("no panic");
        assert!(
            matches!(result, Ok(()) | Err(Error::Shutdown)),
            "in-flight calls finish or get Shutdown, got {result:?}"
        );
    }
    // The peer keeps working for others.
    let c = node(test_config()).await;
    c.pull(b.addr(), "big", None).await.expect("b still serves");
    b.shutdown().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_shutdown_mid_transfer_is_an_error_not_a_hang() {
    let (a, b) = pair().await;
    b.publish_local("big", Tensor::from_bytes(pattern(128 << 20, 1)))
        .expect("publish");
    let pull = {
        let (a, from) = (a.clone(), b.addr().clone());
        tokio::spawn(async move { a.pull(&from, "big", None).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    b.shutdown().await;
    let result = within(Duration::from_secs(30), "pull from a stopped peer", pull)
        .await
        .expect("join");
    // Either it finished before the stop, or it failed with a transport error.
    if let Err(e) = result {
        assert!(
            matches!(e, Error::Io(_) | Error::PeerUnreachable { .. }),
            "{e:?}"
        );
    }
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_are_typed() {
    let a = node(test_config()).await;
    let started = std::time::Instant::now();
    assert!(matches!(
        a.recv_timeout(Duration::from_millis(100)).await,
        Err(Error::Timeout { .. })
    ));
    assert!(matches!(
        a.wait_for("never", Duration::from_millis(100)).await,
        Err(Error::Timeout { .. })
    ));
    assert!(started.elapsed() < Duration::from_secs(10));
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulling_a_missing_name_is_not_found() {
    let (a, b) = pair().await;
    match a.pull(b.addr(), "does/not/exist", None).await {
        Err(Error::NotFound { what }) => assert!(what.contains("does/not/exist"), "{what}"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_addresses_and_names_are_refused() {
    for input in ["", "nonsense", "abc@127.0.0.1:1", "@127.0.0.1:9", "x@y@z"] {
        assert!(
            // Parsing is tb-link's; the node's error keeps the variant.
            matches!(
                input.parse::<PeerAddr>().map_err(Error::from),
                Err(Error::BadAddress { .. })
            ),
            "{input:?}"
        );
    }
    let (a, b) = pair().await;
    for name in ["", "has space", "/lead", "trail/", "a//b", &"x".repeat(300)] {
        assert!(
            matches!(
                a.pull(b.addr(), name, None).await,
                Err(Error::InvalidName(_))
            ),
            "{name:?}"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_shutdown_are_shutdown() {
    let (a, b) = pair().await;
    a.shutdown().await;
    a.shutdown().await; // idempotent
    let t = f32_tensor(4, 1);
    assert!(matches!(
        a.push(b.addr(), "x", &t).await,
        Err(Error::Shutdown)
    ));
    assert!(matches!(
        a.pull(b.addr(), "x", None).await,
        Err(Error::Shutdown)
    ));
    assert!(matches!(a.publish_local("x", t), Err(Error::Shutdown)));
    assert!(matches!(a.recv().await, Err(Error::Shutdown)));
    assert!(matches!(
        a.wait_for("x", Duration::from_secs(1)).await,
        Err(Error::Shutdown)
    ));
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_reuses_one_link_per_peer() {
    let (a, b) = (node(quic_config()).await, node(quic_config()).await);
    let t = f32_tensor(16, 1);
    a.push(b.addr(), "one", &t).await.expect("first");
    a.push(b.addr(), "two", &t).await.expect("second");
    let stats = a.pool_stats();
    assert_eq!(stats.dials, 1, "second send dials nothing");
    assert_eq!(stats.reuses, 1);
    assert_eq!(a.pool_size(), 1);
    // The receiver adopted the inbound link: answering uses it, no dial.
    assert!(eventually(Duration::from_secs(5), || b.pool_size() == 1).await);
    b.push(a.addr(), "back", &t).await.expect("reply");
    assert_eq!(b.pool_stats().dials, 0, "the adopted link is reused");
    a.shutdown().await;
    b.shutdown().await;
}

/// Regression guard for the iroh-blobs pool deadlock: many requests for one slow peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_requests_to_a_slow_peer_share_one_dial() {
    let (a, b) = pair().await;
    b.publish_local("small", f32_tensor(1024, 4))
        .expect("publish");
    let proxy = DelayProxy::start(b.addr().addr, Duration::from_millis(150)).await;
    let via_proxy = PeerAddr {
        id: b.id(),
        addr: proxy.addr,
    };
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let (a, to) = (a.clone(), via_proxy.clone());
        tasks.push(tokio::spawn(
            async move { a.pull(&to, "small", None).await },
        ));
    }
    for task in tasks {
        let pulled = within(LIMIT, "pull via slow link", task)
            .await
            .expect("join")
            .expect("pull");
        assert_eq!(pulled.buffer.data(), f32_tensor(1024, 4).data());
    }
    let stats = a.pool_stats();
    assert_eq!(
        stats.dials, 1,
        "exactly one dial for 200 concurrent requests"
    );
    assert_eq!(a.pool_size(), 1);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_links_are_evicted_after_the_timeout() {
    let a = node(Config {
        idle_timeout: Duration::from_millis(200),
        ..quic_config()
    })
    .await;
    let b = node(quic_config()).await;
    a.push(b.addr(), "x", &f32_tensor(4, 1))
        .await
        .expect("push");
    assert!(eventually(Duration::from_secs(10), || a.pool_size() == 0).await);
    assert_eq!(a.pool_stats().evictions_idle, 1);
    a.push(b.addr(), "y", &f32_tensor(4, 1))
        .await
        .expect("push after eviction");
    assert_eq!(a.pool_stats().dials, 2, "an evicted link is redialed");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lru_link_is_evicted_at_max_links() {
    let a = node(Config {
        max_links: 2,
        ..quic_config()
    })
    .await;
    let peers = [
        node(quic_config()).await,
        node(quic_config()).await,
        node(quic_config()).await,
    ];
    let t = f32_tensor(4, 1);
    for p in &peers {
        a.push(p.addr(), "x", &t).await.expect("push");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(a.pool_size(), 2);
    let stats = a.pool_stats();
    assert_eq!(stats.evictions_lru, 1);
    // peers[0] was least recently used: it was evicted; peers[2] is still pooled.
    a.push(peers[2].addr(), "x", &t).await.expect("push");
    assert_eq!(a.pool_stats().dials, 3, "the newest link is reused");
    a.push(peers[0].addr(), "x", &t).await.expect("push");
    assert_eq!(a.pool_stats().dials, 4, "the evicted peer is redialed");
    a.shutdown().await;
    for p in peers {
        p.shutdown().await;
    }
}

/// Regression: a node that adopted a peer's link closed it after its *own* idle timeout (the
/// streams it served took no use of the link), cutting the pulls the peer was still making
/// through it ("receiving tensor bytes: connection lost", "link closed while being handed
/// out").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_pulls_outlive_the_serving_sides_idle_timeout() {
    const IDLE: Duration = Duration::from_millis(500);
    const PULLING: Duration = Duration::from_secs(4);
    const MAX_PULLS: usize = 2000;
    let server = node(Config {
        idle_timeout: IDLE,
        ..quic_config()
    })
    .await;
    let puller = node(quic_config()).await;
    let tensor = f32_tensor(4 << 20, 5); // 16 MiB
    server.publish_local("w", tensor.clone()).expect("publish");
    let started = std::time::Instant::now();
    let (mut pulls, mut failures) = (0, Vec::new());
    while started.elapsed() < PULLING && pulls < MAX_PULLS {
        pulls += 1;
        match within(LIMIT, "pull", puller.pull(server.addr(), "w", None)).await {
            Ok(pulled) => assert!(
                pulled.buffer.data() == tensor.data(),
                "pull {pulls} differs"
            ),
            Err(e) => failures.push(e.to_string()),
        }
    }
    let (served, pulled) = (server.pool_stats(), puller.pool_stats());
    eprintln!(
        "{pulls} pulls, {} failed; serving side: {} idle evictions; pulling side: {} dials",
        failures.len(),
        served.evictions_idle,
        pulled.dials
    );
    assert!(
        failures.is_empty(),
        "{} of {pulls} failed: {failures:?}",
        failures.len()
    );
    assert_eq!(
        served.evictions_idle, 0,
        "the link in use was never idle-closed"
    );
    assert_eq!(pulled.dials, 1, "one link for all {pulls} pulls");
    // Once the pulls stop, the serving side does close the link, gracefully: the next pull
    // redials.
    let closed = || server.pool_stats().evictions_idle == 1;
    assert!(eventually(Duration::from_secs(10), closed).await);
    let again = within(LIMIT, "pull", puller.pull(server.addr(), "w", None)).await;
    assert!(again.expect("pull after the idle close").buffer.data() == tensor.data());
    assert_eq!(puller.pool_stats().dials, 2, "the closed link was redialed");
    puller.shutdown().await;
    server.shutdown().await;
}

/// Regression: a full pool adopted an inbound link and closed it at once, dropping the
/// request the dialer had sent on it ("connection lost").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_refuses_an_inbound_dial_with_too_many_connections() {
    let server = node(Config {
        max_links: 1,
        ..quic_config()
    })
    .await;
    server
        .publish_local("small", f32_tensor(1024, 2))
        .expect("publish");
    // The server's one link is busy for seconds: it pulls from an upload-limited holder.
    let holder = node(Config {
        max_upload_rate: 4 << 20,
        ..quic_config()
    })
    .await;
    let slow = f32_tensor(4 << 20, 1); // 16 MiB at 4 MiB/s
    holder.publish_local("slow", slow.clone()).expect("publish");
    let busy = tokio::spawn({
        let (server, at) = (server.clone(), holder.addr().clone());
        async move { server.pull(&at, "slow", None).await }
    });
    let link_busy = || server.pool_stats().links_active == 1;
    assert!(eventually(Duration::from_secs(10), link_busy).await);

    let dialer = node(quic_config()).await;
    match within(LIMIT, "pull", dialer.pull(server.addr(), "small", None)).await {
        Err(Error::TooManyConnections { peer: Some(p), .. }) => {
            assert_eq!(p, server.id().fmt_short().to_string());
        }
        other => panic!("expected TooManyConnections, got {other:?}"),
    }
    // The busy transfer is untouched; once it is over its idle link makes room.
    let pulled = within(LIMIT, "busy pull", busy).await.expect("join");
    assert!(pulled.expect("the busy pull").buffer.data() == slow.data());
    let pulled = within(LIMIT, "pull", dialer.pull(server.addr(), "small", None)).await;
    assert_eq!(
        pulled.expect("pull once a link is idle").buffer.data(),
        f32_tensor(1024, 2).data()
    );
    assert_eq!(
        server.pool_stats().evictions_lru,
        1,
        "the idle link made room"
    );
    for n in [dialer, holder, server] {
        n.shutdown().await;
    }
}

fn with_secret(secret: &[u8]) -> Config {
    Config {
        cluster_key: tb_proto::ClusterKey::from_secret(secret).expect("secret"),
        ..test_config()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_cluster_secret_is_refused() {
    let secret = b"correct horse battery staple, 32 bytes";
    let (a, b) = (
        node(with_secret(secret)).await,
        node(with_secret(secret)).await,
    );
    b.publish_local("model/w", f32_tensor(256, 4))
        .expect("publish");
    let pulled = within(LIMIT, "pull", a.pull(b.addr(), "model/w", None))
        .await
        .expect("a member pulls");
    assert_eq!(pulled.buffer.data(), f32_tensor(256, 4).data());

    // A node with another secret, and one with none, are refused before any request is read,
    // whichever side dials.
    let wrong = node(with_secret(b"another secret of some length, 32+")).await;
    let open = node(test_config()).await;
    for outsider in [&wrong, &open] {
        match within(LIMIT, "pull", outsider.pull(b.addr(), "model/w", None)).await {
            Err(Error::Unauthorized(msg)) => assert!(msg.contains("refused"), "{msg}"),
            other => panic!("expected Unauthorized, got {other:?}"),
        }
        let tensor = f32_tensor(4, 1);
        match within(LIMIT, "push", b.push(outsider.addr(), "x", &tensor)).await {
            Err(Error::Unauthorized(_)) => {}
            other => panic!("expected Unauthorized, got {other:?}"),
        }
        assert_eq!(outsider.inbox_len(), 0, "nothing reached the outsider");
    }
    assert_eq!(b.auth_failures(), 2, "b counted both refusals");
    assert_eq!(wrong.auth_failures() + open.auth_failures(), 2);
    // The members keep working.
    within(LIMIT, "pull again", a.pull(b.addr(), "model/w", None))
        .await
        .expect("b still serves members");
    for n in [a, b, wrong, open] {
        n.shutdown().await;
    }
}

/// A test config on QUIC alone: the pool tests count QUIC links, dials and reuses, which the
/// shm channel (the default between two nodes of one host) would bypass.
fn quic_config() -> tb_node::Config {
    tb_node::Config {
        channels: vec![tb_node::proto::ChannelKind::Quic],
        ..test_config()
    }
}

/// Bytes are counted as they move, not when a transfer ends: while a paced 8 MiB pull is
/// under way, both sides' byte counters (the node's and the QUIC channel's) show part of it;
/// at the end, all of it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_are_counted_while_they_move() {
    use tb_dashboard::Direction;
    use tb_node::proto::ChannelKind;
    const LEN: u64 = 8 << 20;
    let holder = node(Config {
        max_upload_rate: 4_000_000,
        ..quic_config()
    })
    .await;
    let reader = node(quic_config()).await;
    let data = pattern(LEN as usize, 5);
    let tensor = Tensor::new(tb_node::DType::U8, vec![LEN], data.clone()).expect("tensor");
    holder.publish_local("paced", tensor).expect("publish");
    let pull = {
        let (reader, addr) = (reader.clone(), holder.addr().clone());
        tokio::spawn(async move { reader.pull(&addr, "paced", None).await })
    };
    let (r, h) = (reader.metrics().clone(), holder.metrics().clone());
    let partway = |bytes: u64| bytes > 0 && bytes < LEN;
    let seen = eventually(LIMIT, || {
        partway(r.bytes_in.get())
            && partway(r.channels.bytes(ChannelKind::Quic, Direction::In))
            && partway(h.bytes_out.get())
    })
    .await;
    assert!(
        seen,
        "no partial count: in {}, out {}",
        r.bytes_in.get(),
        h.bytes_out.get()
    );
    let got = within(LIMIT, "pull", pull)
        .await
        .expect("task")
        .expect("pull");
    assert_eq!(got.buffer.data(), &data);
    assert_eq!(r.bytes_in.get(), LEN);
    assert_eq!(r.channels.bytes(ChannelKind::Quic, Direction::In), LEN);
    assert_eq!(r.channels.transfers(ChannelKind::Quic), 1);
    assert!(eventually(LIMIT, || h.bytes_out.get() == LEN).await);
    reader.shutdown().await;
    holder.shutdown().await;
}
