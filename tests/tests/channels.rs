//! Data channels between two nodes on this host: the pair negotiates shm (same host, same
//! network namespace), every dtype and awkward size moves byte-identical over it for `pull`
//! (zero-copy), `pull_into` and `push`; a reader's zero-copy tensor outlives the version's
//! eviction; nodes that do not both run shm stay on QUIC; a cluster `get` from a holder of
//! this host maps the holder's memfd too.

use std::time::Duration;

use tb_broker::{Broker, BrokerOptions};
use tb_dashboard::{Direction, TransferKind};
use tb_node::{
    Config, DType, Node, Tensor, TransferProgress,
    proto::{ChannelKind, ClusterKey, ContentHash},
};
use tb_tests::{node, pattern, test_config, within};

const LIMIT: Duration = Duration::from_secs(30);

fn config(channels: &[ChannelKind]) -> Config {
    Config {
        channels: channels.to_vec(),
        ..test_config()
    }
}

/// Tensors of every dtype, with byte lengths around the size above which an inline payload is
/// received into a memfd rather than plain memory (64 KiB) and around the inline limit and
/// parallel-copy threshold (both 4 MiB), none a multiple of a piece size, plus empty ones and
/// tensors of exactly those sizes.
fn tensors() -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    let elems = [0usize, 1, 3, 16_383, 16_385, 1_048_577];
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let n = elems[i % elems.len()];
        let size = dtype.itemsize() as usize;
        let data = pattern(n * size, i as u8);
        let tensor = Tensor::new(dtype, vec![n as u64], data).expect("tensor");
        out.push((format!("t/{dtype}"), tensor));
    }
    out.push((
        "t/empty-2d".into(),
        Tensor::new(DType::F32, vec![0, 7], Vec::new()).expect("tensor"),
    ));
    // The largest heap-received inline payload, and the largest inline one (the next byte
    // goes as a memfd: `F32` above is 4 MiB + 4).
    for len in [64usize << 10, 4 << 20] {
        let tensor = Tensor::new(DType::U8, vec![len as u64], pattern(len, 9)).expect("tensor");
        out.push((format!("t/u8-{len}"), tensor));
    }
    out
}

async fn pair(a: &[ChannelKind], b: &[ChannelKind]) -> (Node, Node) {
    (node(config(a)).await, node(config(b)).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_moves_byte_identical_over_shm() {
    let (holder, reader) = pair(&ChannelKind::DEFAULT, &ChannelKind::DEFAULT).await;
    let tensors = tensors();
    for (name, tensor) in &tensors {
        holder.publish_local(name, tensor.clone()).expect("publish");
    }
    within(LIMIT, "pulls and pushes", async {
        for (name, tensor) in &tensors {
            let got = reader.pull(holder.addr(), name, None).await.expect("pull");
            assert_eq!(got.buffer.data(), tensor.data(), "{name}: pull");
            assert_eq!(got.meta, *tensor.meta(), "{name}: meta");
            let into = reader
                .pull_into(holder.addr(), name, None, |m| {
                    Ok(vec![0xAAu8; m.byte_len as usize])
                })
                .await
                .expect("pull_into");
            assert_eq!(&into.buffer[..], &tensor.data()[..], "{name}: pull_into");
            assert_eq!(ContentHash::of(&into.buffer), tensor.hash(), "{name}: hash");
            reader
                .push(holder.addr(), name, tensor)
                .await
                .expect("push");
            let pushed = holder.wait_for(name, LIMIT).await.expect("pushed");
            assert_eq!(pushed.tensor.data(), tensor.data(), "{name}: push");
            assert_eq!(pushed.tensor.meta(), tensor.meta(), "{name}: push meta");
        }
    })
    .await;
    // Both directions negotiated shm on the one link between them.
    assert_eq!(reader.channel_to(&holder.id()), ChannelKind::Shm);
    assert_eq!(holder.channel_to(&reader.id()), ChannelKind::Shm);
    assert_eq!(
        reader.pool_stats().dials,
        1,
        "one QUIC link, for the exchange"
    );
    holder.shutdown().await;
    reader.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_copy_tensor_stays_valid_after_its_version_is_evicted() {
    let holder = node(Config {
        keep_versions: 1,
        ..config(&ChannelKind::DEFAULT)
    })
    .await;
    let reader = node(config(&ChannelKind::DEFAULT)).await;
    // Past the inline limit (4 MiB): the reader maps the holder's memfd.
    const LEN: usize = 5 << 20;
    let first = Tensor::new(DType::U8, vec![LEN as u64], pattern(LEN, 7)).expect("tensor");
    let v1 = holder.publish_local("w", first.clone()).expect("publish");
    let got = within(LIMIT, "pull", reader.pull(holder.addr(), "w", Some(v1)))
        .await
        .expect("pull v1");
    assert_eq!(reader.channel_to(&holder.id()), ChannelKind::Shm);
    // Newer versions evict v1 from the holder's store; the reader's mapping keeps the bytes.
    for seed in 0..3u8 {
        let next = Tensor::new(DType::U8, vec![LEN as u64], pattern(LEN, seed)).expect("t");
        holder.publish_local("w", next).expect("publish");
    }
    let evicted = within(
        LIMIT,
        "pull evicted",
        reader.pull(holder.addr(), "w", Some(v1)),
    )
    .await;
    assert!(
        matches!(evicted, Err(tb_node::Error::NotFound { .. })),
        "v1 is gone from the holder: {evicted:?}"
    );
    drop(first);
    assert_eq!(got.buffer.data(), &pattern(LEN, 7));
    assert_eq!(ContentHash::of(got.buffer.data()), got.meta.hash);
    holder.shutdown().await;
    reader.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_shm_keeps_its_peers_on_quic() {
    let (holder, reader) = pair(&[ChannelKind::Quic], &ChannelKind::DEFAULT).await;
    let tensor = Tensor::new(DType::I64, vec![300_001], pattern(2_400_008, 3)).expect("tensor");
    holder.publish_local("q", tensor.clone()).expect("publish");
    let got = within(LIMIT, "pull", reader.pull(holder.addr(), "q", None))
        .await
        .expect("pull");
    assert_eq!(got.buffer.data(), tensor.data());
    reader
        .push(holder.addr(), "back", &tensor)
        .await
        .expect("push");
    let pushed = within(LIMIT, "recv", holder.wait_for("back", LIMIT))
        .await
        .expect("recv");
    assert_eq!(pushed.tensor.data(), tensor.data());
    assert_eq!(reader.channel_to(&holder.id()), ChannelKind::Quic);
    assert_eq!(holder.channel_to(&reader.id()), ChannelKind::Quic);
    holder.shutdown().await;
    reader.shutdown().await;
}

const SECRET: &[u8] = b"channel tests share this secret, 32+ bytes";

/// Bytes `node` received over `kind`.
fn bytes_in(node: &Node, kind: ChannelKind) -> u64 {
    node.metrics().channels.bytes(kind, Direction::In)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_get_from_a_holder_of_this_host_moves_over_shm() {
    let key = ClusterKey::from_secret(SECRET).expect("secret");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut opts = BrokerOptions::new(dir.path());
    opts.node = Config {
        cluster_key: key.clone(),
        ..test_config()
    };
    let broker = within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts");
    let worker = || {
        node(Config {
            brokers: vec![broker.addr().clone()],
            cluster_key: key.clone(),
            heartbeat_interval: Duration::from_millis(300),
            ..config(&ChannelKind::DEFAULT)
        })
    };
    let (holder, reader) = (worker().await, worker().await);
    // Past the inline limit (4 MiB): the holder passes its sealed memfd.
    let len = (8 << 20) + 3;
    let tensor = Tensor::new(DType::U8, vec![len as u64], pattern(len, 5)).expect("tensor");
    let version = within(LIMIT, "publish", holder.publish("c/w", tensor.clone()))
        .await
        .expect("publish");
    let (shm_before, quic_before) = (
        bytes_in(&reader, ChannelKind::Shm),
        bytes_in(&reader, ChannelKind::Quic),
    );
    let pulls_before = reader.metrics().transfers(TransferKind::Pull, true);
    let all_before = reader.metrics().bytes_in.get();
    let progress = TransferProgress::default();
    let got = within(
        LIMIT,
        "get",
        reader.get_with_progress("c/w", Some(version), &progress),
    )
    .await
    .expect("get");
    assert_eq!(got.buffer.data(), tensor.data(), "bytes equal");
    assert_eq!(got.meta, *tensor.meta());
    assert_eq!(reader.channel_to(&holder.id()), ChannelKind::Shm);
    let len = len as u64;
    assert_eq!(bytes_in(&reader, ChannelKind::Shm) - shm_before, len);
    let over_quic = bytes_in(&reader, ChannelKind::Quic) - quic_before;
    assert!(over_quic < len, "{over_quic} bytes came over QUIC");
    assert_eq!(reader.metrics().bytes_in.get() - all_before, len);
    let pulls = reader.metrics().transfers(TransferKind::Pull, true) - pulls_before;
    assert_eq!(pulls, 1, "one pull, timed");
    assert_eq!((progress.bytes(), progress.total()), (len, Some(len)));
    // The cut-through receive ended with the tensor: nothing is left receiving.
    assert_eq!(reader.versions_receiving(), 0);
    // The reader keeps the version and holds it for others: a get now is local.
    let again = within(LIMIT, "local get", reader.get_version("c/w", version))
        .await
        .expect("local get");
    assert_eq!(again.buffer.data(), tensor.data());
    assert_eq!(bytes_in(&reader, ChannelKind::Shm) - shm_before, len);
    holder.shutdown().await;
    reader.shutdown().await;
    broker.shutdown().await;
}
