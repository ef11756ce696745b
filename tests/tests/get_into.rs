//! `Node::get_into`: a cluster get into the caller's buffer (what the Python package's
//! `get(out=)` uses). Over QUIC the bytes land in the caller's buffer; over shm, or from what
//! the node holds, they are copied in; a tensor the caller's check refuses, or one that does
//! not fit, leaves the buffer untouched. The reader keeps nothing. Every wait is bounded.

use std::{path::Path, time::Duration};

use tb_broker::{Broker, BrokerOptions};
use tb_node::{Config, Error, PeerAddr, proto::ChannelKind, proto::ClusterKey};
use tb_tests::{f32_tensor, node, test_config, within};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"get_into tests share this secret, 32+ bytes";
/// 3 MiB of f32: several reads and hash batches.
const FLOATS: usize = 3 << 18;

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET).expect("secret")
}

async fn broker(dir: &Path) -> Broker {
    let mut opts = BrokerOptions::new(dir);
    opts.node = test_config();
    opts.node.cluster_key = key();
    within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts")
}

fn worker(broker: &PeerAddr, channels: &[ChannelKind]) -> Config {
    Config {
        brokers: vec![broker.clone()],
        cluster_key: key(),
        channels: channels.to_vec(),
        ..test_config()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn get_into_fills_the_callers_buffer_over_each_channel_and_keeps_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let holder = node(worker(broker.addr(), &ChannelKind::DEFAULT)).await;
    let tensor = f32_tensor(FLOATS, 7);
    let v = within(LIMIT, "publish", holder.publish("into/w", tensor.clone()))
        .await
        .expect("published");
    for channels in [&[ChannelKind::Quic][..], &ChannelKind::DEFAULT[..]] {
        let reader = node(worker(broker.addr(), channels)).await;
        let mut dest = vec![0u8; FLOATS * 4];
        let got = reader.get_into("into/w", None, &mut dest, |meta| {
            assert_eq!(meta.shape, vec![FLOATS as u64]);
            Ok(())
        });
        let (version, meta) = within(LIMIT, "get_into", got).await.expect("got");
        assert_eq!((version, &meta), (v, tensor.meta()), "{channels:?}");
        assert!(
            dest == tensor.data().as_ref(),
            "bytes differ over {channels:?}"
        );
        assert_eq!(reader.store_usage(), (0, 0), "the reader keeps nothing");
        reader.shutdown().await;
    }
    // The holder's own copy.
    let mut dest = vec![0u8; FLOATS * 4];
    let own = holder.get_into("into/w", Some(v), &mut dest, |_| Ok(()));
    within(LIMIT, "own get_into", own).await.expect("own");
    assert!(dest == tensor.data().as_ref());
    holder.shutdown().await;
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_or_misfitting_get_into_writes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let broker = broker(dir.path()).await;
    let holder = node(worker(broker.addr(), &ChannelKind::DEFAULT)).await;
    let reader = node(worker(broker.addr(), &[ChannelKind::Quic])).await;
    within(
        LIMIT,
        "publish",
        holder.publish("into/x", f32_tensor(1024, 3)),
    )
    .await
    .expect("published");
    let mut dest = vec![0u8; 4096];
    let refused = reader.get_into("into/x", None, &mut dest, |_| {
        Err(Error::InvalidTensor("not the dtype I hold".into()))
    });
    match within(LIMIT, "refused", refused).await {
        Err(Error::InvalidTensor(m)) => assert!(m.contains("not the dtype"), "{m}"),
        other => panic!("expected the check's error, got {other:?}"),
    }
    let mut small = vec![0u8; 4095];
    match within(
        LIMIT,
        "too small",
        reader.get_into("into/x", None, &mut small, |_| Ok(())),
    )
    .await
    {
        Err(Error::InvalidTensor(m)) => assert!(m.contains("4095"), "{m}"),
        other => panic!("expected InvalidTensor, got {other:?}"),
    }
    assert!(
        dest.iter().chain(&small).all(|&b| b == 0),
        "nothing was written"
    );
    match within(
        LIMIT,
        "missing",
        reader.get_into("into/none", None, &mut dest, |_| Ok(())),
    )
    .await
    {
        Err(Error::NotFound { .. }) => {}
        other => panic!("expected NotFound, got {other:?}"),
    }
    reader.shutdown().await;
    holder.shutdown().await;
    broker.shutdown().await;
}
