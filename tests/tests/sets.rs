//! Version sets in one process: a broker and worker nodes on loopback. A set reads back whole
//! and alike on another node; readers and subscribers never see members of two versions
//! together while a publisher keeps publishing; retention drops a set version as a whole;
//! what is not a set is refused with a typed error. Every wait is bounded.

use std::{collections::BTreeMap, path::Path, sync::Arc, time::Duration};

use tb_broker::{Broker, BrokerOptions};
use tb_node::{Config, DType, Error, PeerAddr, SubEvent, Tensor, TensorSet, proto::ClusterKey};
use tb_tests::{f32_tensor, node, pattern, test_config, within};

const LIMIT: Duration = Duration::from_secs(60);
const SECRET: &[u8] = b"set tests share this secret, 32+ bytes...";

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET).expect("secret")
}

async fn broker(dir: &Path) -> Broker {
    let mut opts = BrokerOptions::new(dir);
    opts.node = test_config();
    opts.node.cluster_key = key();
    opts.tick = Duration::from_millis(200);
    within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts")
}

fn worker_config(broker: &PeerAddr) -> Config {
    Config {
        brokers: vec![broker.clone()],
        cluster_key: key(),
        heartbeat_interval: Duration::from_millis(300),
        ..test_config()
    }
}

/// The members of version `v` of the test checkpoint: 8 layers of 4 KiB, every byte `v`.
fn layers(v: u64) -> Vec<(String, Tensor)> {
    (0..8)
        .map(|i| {
            let t = Tensor::new(DType::U8, vec![4096], vec![v as u8; 4096]).expect("tensor");
            (format!("layer.{i}/w"), t)
        })
        .collect()
}

/// Panics unless every member of `set` is of its own version (`layers(set.version)`).
fn assert_one_version(set: &TensorSet) {
    assert_eq!(set.members.len(), 8, "v{}", set.version);
    for (key, tensor) in &set.members {
        let stray = tensor.data().iter().find(|&&b| u64::from(b) != set.version);
        assert!(
            stray.is_none(),
            "set v{} has member {key} of v{}",
            set.version,
            stray.copied().unwrap_or(0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_set_reads_back_whole_on_another_node() {
    tb_tests::init_logs();
    let dir = tempfile::tempdir().expect("tempdir");
    let b = broker(dir.path()).await;
    let publisher = node(worker_config(b.addr())).await;
    let reader = node(worker_config(b.addr())).await;

    let members = vec![
        ("embed".to_string(), f32_tensor(1000, 1)),
        (
            "layer.0/w".into(),
            Tensor::new(DType::BF16, vec![3, 5], pattern(30, 2)).expect("valid"),
        ),
        (
            "step".into(),
            Tensor::new(DType::I64, vec![], 7i64.to_le_bytes().to_vec()).expect("valid"),
        ),
        (
            "empty".into(),
            Tensor::new(DType::F16, vec![0, 4], Vec::new()).expect("valid"),
        ),
    ];
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let version = within(
        LIMIT,
        "publish_set",
        publisher.publish_set("ckpt", members.clone(), metadata.clone()),
    )
    .await
    .expect("publish_set");
    assert_eq!(version, 1);

    let set = within(LIMIT, "get_set", reader.get_set("ckpt", None))
        .await
        .expect("get_set");
    assert_eq!((set.name.as_str(), set.version), ("ckpt", 1));
    assert_eq!(set.metadata, metadata);
    assert_eq!(
        set.members, members,
        "same keys, order, dtypes, shapes and bytes"
    );

    // A member is readable by its own name, `set/key`, at the set's version.
    let w = reader.get("ckpt/layer.0/w").await.expect("member by name");
    assert_eq!((w.name.as_str(), w.version), ("ckpt/layer.0/w", 1));
    assert_eq!(w.buffer, members[1].1);
    let step = reader.get_version("ckpt/step", 1).await.expect("member v1");
    assert_eq!(step.buffer, members[2].1);
    for missing in ["ckpt/nope", "ckpt/layer.0/nope", "nothing/here"] {
        let err = reader.get(missing).await.expect_err(missing);
        assert!(matches!(err, Error::NotFound { .. }), "{missing}: {err}");
    }

    // One registry entry of dtype `set`; a plain get returns the set's own bytes.
    let listed = reader.list("ckpt").await.expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].meta.dtype, DType::Set);
    let raw = reader.get("ckpt").await.expect("get");
    assert_eq!(raw.meta.dtype, DType::Set);
    let again = TensorSet::from_tensor(raw.name, raw.version, &raw.buffer).expect("decodes");
    assert_eq!(again.members, members);

    // What is not a set is refused, and nothing is published.
    publisher
        .publish("plain", f32_tensor(4, 1))
        .await
        .expect("publish");
    let err = reader.get_set("plain", None).await.expect_err("not a set");
    assert!(
        matches!(err, Error::InvalidTensor(ref m) if m.contains("not a set")),
        "{err}"
    );
    let bogus = Tensor::new(DType::Set, vec![16], vec![0u8; 16]).expect("valid");
    let err = publisher
        .publish("bogus", bogus)
        .await
        .expect_err("bogus set");
    assert!(matches!(err, Error::InvalidTensor(_)), "{err}");
    let bad_key = vec![("a b".to_string(), f32_tensor(4, 1))];
    let err = publisher
        .publish_set("bad", bad_key, BTreeMap::new())
        .await
        .expect_err("bad key");
    assert!(
        matches!(err, Error::InvalidTensor(ref m) if m.contains("\"a b\"")),
        "{err}"
    );
    let names: Vec<String> = reader
        .list("")
        .await
        .expect("list")
        .into_iter()
        .map(|e| e.name.as_str().to_owned())
        .collect();
    assert_eq!(names, ["ckpt", "plain"]);
    let err = reader.get_set("missing", None).await.expect_err("missing");
    assert!(matches!(err, Error::NotFound { .. }), "{err}");

    for n in [publisher, reader] {
        n.shutdown().await;
    }
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_and_subscribers_never_see_two_versions_at_once() {
    tb_tests::init_logs();
    const VERSIONS: u64 = 30;
    let dir = tempfile::tempdir().expect("tempdir");
    let b = broker(dir.path()).await;
    let publisher = Arc::new(node(worker_config(b.addr())).await);
    let reader = Arc::new(node(worker_config(b.addr())).await);
    let subscriber = node(worker_config(b.addr())).await;
    let mut sub = subscriber.subscribe("ckpt").await.expect("subscribe");

    let publishing = {
        let publisher = publisher.clone();
        tokio::spawn(async move {
            for v in 1..=VERSIONS {
                let got = publisher
                    .publish_set("ckpt", layers(v), BTreeMap::new())
                    .await
                    .expect("publish_set");
                assert_eq!(got, v);
            }
        })
    };
    // Read the newest set over and over while versions keep coming (bounded in count). A
    // `NotFound` (nothing published yet) pauses before the next try: it comes back at once,
    // and 200 of them in a row once ran out before the first publish landed (CI, every
    // suite at once on 2 cores).
    let reading = {
        let reader = reader.clone();
        tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..200 {
                match reader.get_set("ckpt", None).await {
                    Ok(set) => {
                        assert_one_version(&set);
                        seen.push(set.version);
                        if set.version == VERSIONS {
                            break;
                        }
                    }
                    Err(Error::NotFound { .. }) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(e) => panic!("get_set: {e}"),
                }
            }
            seen
        })
    };
    within(LIMIT, "publishing", publishing)
        .await
        .expect("publisher");
    let seen = within(LIMIT, "reading", reading).await.expect("reader");
    assert!(!seen.is_empty());
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");

    // The subscriber: one event per set version, in order, each whole; what it did not get
    // is reported as skipped.
    let mut covered = 0;
    let mut delivered = 0;
    while covered < VERSIONS {
        let event = within(LIMIT, "event", sub.next_timeout(Duration::from_secs(20)))
            .await
            .unwrap_or_else(|| panic!("subscription ended at v{covered}"))
            .expect("event");
        match event {
            SubEvent::Version {
                name,
                version,
                tensor,
                ..
            } => {
                assert_eq!(version, covered + 1, "one event per version, in order");
                let tensor = tensor.expect("auto-fetched");
                let set = TensorSet::from_tensor(name, version, &tensor).expect("a set");
                assert_one_version(&set);
                covered = version;
                delivered += 1;
            }
            SubEvent::Skipped { from, to, .. } => {
                assert_eq!(from, covered + 1);
                covered = to;
            }
            SubEvent::Deleted { .. } => panic!("nothing was deleted"),
        }
    }
    assert!(delivered >= 1);

    // Retention (2 versions per name by default) dropped old versions whole.
    let fresh = node(worker_config(b.addr())).await;
    let newest = fresh.get_set("ckpt", Some(VERSIONS)).await.expect("newest");
    assert_one_version(&newest);
    let err = fresh
        .get_set("ckpt", Some(1))
        .await
        .expect_err("evicted everywhere");
    assert!(matches!(err, Error::NotFound { .. }), "{err}");

    for n in [fresh, subscriber] {
        n.shutdown().await;
    }
    for n in [publisher, reader] {
        n.shutdown().await;
    }
    b.shutdown().await;
}
