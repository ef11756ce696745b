//! The cluster half of `tb demo`: two brokers and four workers in this process, on loopback.
//! A publisher puts new versions of a model; three subscribers receive every version in order
//! (fetched and verified), the later ones from each other as well as from the publisher; a
//! broker is stopped (workers fail over) and restarted from its data dir (it catches up); a
//! late worker gets the newest version by name.

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use tb_broker::{Broker, BrokerOptions};
use tb_node::{Config, DType, Node, PeerAddr, SubEvent, Subscription, Tensor, proto::ClusterKey};

use super::fill;
use crate::fmt;

/// The model's name and how it is watched.
const MODEL: &str = "demo/model/weights";
const PATTERN: &str = "demo/model/*";
/// Subscribing workers.
const SUBSCRIBERS: usize = 3;
/// Bound on every wait of the story.
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// What the cluster story measured.
pub struct Story {
    /// Bytes per version.
    pub version_bytes: u64,
    /// Per version: publish call to the last subscriber holding it.
    pub deliveries: Vec<(u64, Duration)>,
    /// Nodes holding the newest version at the end (publisher, subscribers, the late worker).
    pub holders: u32,
    /// The restarted broker's registry had the version published while it was down.
    pub caught_up_version: u64,
}

struct Cluster {
    brokers: Vec<Option<Broker>>,
    broker_addrs: Vec<PeerAddr>,
    key: ClusterKey,
    dir: tempfile::TempDir,
}

impl Cluster {
    async fn start(brokers: usize) -> Result<Cluster> {
        let dir = tempfile::tempdir().context("creating the demo's data dir")?;
        let secret = iroh::SecretKey::generate().to_bytes();
        let key = ClusterKey::from_secret(&secret).context("cluster secret")?;
        let mut cluster = Cluster {
            brokers: Vec::new(),
            broker_addrs: Vec::new(),
            key,
            dir,
        };
        for i in 0..brokers {
            let broker = cluster.spawn_broker(i, unspecified_port()).await?;
            cluster.broker_addrs.push(broker.addr().clone());
            cluster.brokers.push(Some(broker));
        }
        Ok(cluster)
    }

    fn broker_dir(&self, i: usize) -> std::path::PathBuf {
        self.dir.path().join(format!("broker{i}"))
    }

    async fn spawn_broker(&self, i: usize, bind: SocketAddr) -> Result<Broker> {
        let mut opts = BrokerOptions::new(self.broker_dir(i));
        opts.node.bind_addr = bind;
        opts.node.cluster_key = self.key.clone();
        opts.join = self.broker_addrs.iter().take(i).cloned().collect();
        opts.sync_interval = Duration::from_secs(1);
        Broker::spawn(opts)
            .await
            .with_context(|| format!("starting broker {i}"))
    }

    async fn worker(&self, first_broker: usize) -> Result<Node> {
        let n = self.broker_addrs.len();
        let config = Config {
            brokers: (0..n)
                .map(|k| self.broker_addrs[(first_broker + k) % n].clone())
                .collect(),
            cluster_key: self.key.clone(),
            heartbeat_interval: Duration::from_millis(500),
            ..Config::default()
        };
        Node::spawn(config).await.context("starting a worker")
    }

    async fn stop_broker(&mut self, i: usize) {
        if let Some(broker) = self.brokers.get_mut(i).and_then(Option::take) {
            broker.shutdown().await;
        }
    }

    /// Starts broker `i` again from its data dir, on its old address (workers know that one).
    async fn restart_broker(&mut self, i: usize) -> Result<()> {
        let addr = self.broker_addrs[i].addr;
        let broker = self.spawn_broker(i, addr).await?;
        ensure!(
            broker.addr().id == self.broker_addrs[i].id,
            "broker {i} came back with another identity"
        );
        self.brokers[i] = Some(broker);
        Ok(())
    }

    async fn shutdown(mut self) {
        for i in 0..self.brokers.len() {
            self.stop_broker(i).await;
        }
    }
}

fn unspecified_port() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

/// Runs the cluster story with versions of `version_bytes` bytes.
pub async fn run(version_bytes: u64) -> Result<Story> {
    let mut cluster = Cluster::start(2).await?;
    println!(
        "\ncluster: 2 brokers ({} and {}), 1 publisher, {SUBSCRIBERS} subscribers on 127.0.0.1",
        cluster.broker_addrs[0], cluster.broker_addrs[1]
    );
    let mut nodes = Vec::new();
    let result = story(&mut cluster, &mut nodes, version_bytes).await;
    for node in nodes {
        node.shutdown().await;
    }
    cluster.shutdown().await;
    result
}

async fn story(cluster: &mut Cluster, nodes: &mut Vec<Node>, version_bytes: u64) -> Result<Story> {
    let len = usize::try_from(version_bytes)?;
    let elems = version_bytes / 4;
    let version = |v: u64| Tensor::new(DType::F32, vec![elems], fill(len, 1000 + v));

    nodes.push(cluster.worker(0).await?);
    let mut subs = Vec::new();
    for i in 0..SUBSCRIBERS {
        let node = cluster.worker(i + 1).await?;
        subs.push(node.subscribe(PATTERN).await.context("subscribing")?);
        nodes.push(node);
    }
    println!("  {SUBSCRIBERS} subscribers watch {PATTERN:?}");

    let mut deliveries = Vec::new();
    for v in 1..=3 {
        let tensor = version(v)?;
        let started = Instant::now();
        let got = nodes[0].publish(MODEL, tensor.clone()).await?;
        ensure!(got == v, "published as v{got}, expected v{v}");
        await_version(&mut subs, v, &tensor).await?;
        let took = started.elapsed();
        println!(
            "  published {MODEL} v{v} ({}): every subscriber has it, verified, in {:.0} ms",
            fmt::bytes(version_bytes),
            took.as_secs_f64() * 1e3
        );
        deliveries.push((v, took));
    }

    // A broker goes away: workers fail over to the other one and the story goes on.
    cluster.stop_broker(0).await;
    println!("  broker 0 stopped");
    let tensor = version(4)?;
    let started = Instant::now();
    let got = nodes[0].publish(MODEL, tensor.clone()).await?;
    ensure!(got == 4, "published as v{got}, expected v4");
    await_version(&mut subs, 4, &tensor).await?;
    let took = started.elapsed();
    println!(
        "  published v4 through broker 1: every subscriber has it in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    deliveries.push((4, took));

    // It comes back from its data dir and catches up on what it missed.
    cluster.restart_broker(0).await?;
    let caught_up_version = caught_up(cluster, 0, 4).await?;
    println!(
        "  broker 0 restarted from its data dir: its registry has {MODEL} v{caught_up_version}"
    );

    // A late worker asks by name and gets the newest version from one of its holders.
    let holders_of = async |node: &Node| -> Result<u32> {
        let listed = node.list(PATTERN.trim_end_matches('*')).await?;
        let entry = listed.iter().find(|e| e.name.as_str() == MODEL);
        Ok(entry.map_or(0, |e| e.holders))
    };
    let before = holders_of(&nodes[0]).await?;
    let late = cluster.worker(0).await?;
    let pulled = late.get(MODEL).await.context("late worker: get")?;
    nodes.push(late);
    ensure!(pulled.version == 4, "late worker got v{}", pulled.version);
    ensure!(
        pulled.buffer.data() == tensor.data(),
        "late worker: bytes differ"
    );
    // The late worker's holder announcement reaches the brokers a moment after its get:
    // asked again (bounded) until it is counted.
    let mut holders = holders_of(&nodes[0]).await?;
    for _ in 0..50 {
        if holders > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        holders = holders_of(&nodes[0]).await?;
    }
    println!("  a late worker got {MODEL} v4 by name; {holders} nodes now hold it");
    Ok(Story {
        version_bytes,
        deliveries,
        holders,
        caught_up_version,
    })
}

/// Waits until every subscriber reports version `v` of the model with `expected`'s bytes.
async fn await_version(subs: &mut [Subscription], v: u64, expected: &Tensor) -> Result<()> {
    for (i, sub) in subs.iter_mut().enumerate() {
        loop {
            let event = sub
                .next_timeout(STEP_LIMIT)
                .await
                .with_context(|| format!("subscriber {i}: no v{v} within {STEP_LIMIT:?}"))?
                .with_context(|| format!("subscriber {i}"))?;
            match event {
                SubEvent::Version {
                    version, tensor, ..
                } if version == v => {
                    let tensor =
                        tensor.with_context(|| format!("subscriber {i}: v{v} not fetched"))?;
                    ensure!(
                        tensor.data() == expected.data(),
                        "subscriber {i}: v{v} bytes differ"
                    );
                    break;
                }
                SubEvent::Version { version, .. } if version < v => continue,
                other => bail!("subscriber {i}: expected v{v}, got {other:?}"),
            }
        }
    }
    Ok(())
}

/// Asks only broker `i` until its registry lists version `want` of the model.
async fn caught_up(cluster: &Cluster, i: usize, want: u64) -> Result<u64> {
    let config = Config {
        brokers: vec![cluster.broker_addrs[i].clone()],
        cluster_key: cluster.key.clone(),
        heartbeats: false,
        ..Config::default()
    };
    let asker = Node::spawn(config).await?;
    let deadline = Instant::now() + STEP_LIMIT;
    let result = loop {
        let listed = asker.list(MODEL).await;
        if let Ok(entries) = &listed
            && let Some(e) = entries.iter().find(|e| e.name.as_str() == MODEL)
            && e.version >= want
        {
            break Ok(e.version);
        }
        if Instant::now() > deadline {
            break Err(anyhow::anyhow!(
                "restarted broker {i} did not list {MODEL} v{want} within {STEP_LIMIT:?} (last answer: {listed:?})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    asker.shutdown().await;
    result
}
