//! Where the shm channel ends, with real `tb-worker` processes: a worker in another network
//! namespace of this host is out of its reach (abstract Unix sockets exist per namespace), so
//! its peers fall back to QUIC, byte-identical and visibly; and a tensor mapped from a
//! holder's memfd stays readable after that holder is killed.
//!
//! The namespace test needs root and iproute2's `ip` (see `tb_tests::netns`); without them it
//! says SKIPPED. Every process and namespace is removed when a test ends, passing or failing.

use std::{net::SocketAddr, path::Path, process::Command, time::Duration};

use tb_broker::{Broker, BrokerOptions};
use tb_dashboard::Direction;
use tb_node::{
    Config, DType, Error, Node, PeerAddr, Tensor, Ticket,
    proto::{ChannelKind, ClusterKey, ContentHash},
};
use tb_tests::{
    http,
    netns::Netns,
    node, pattern,
    procs::{Proc, bin, worker_command},
    test_config, within,
};

const LIMIT: Duration = Duration::from_secs(60);
const START: Duration = Duration::from_secs(30);
const SECRET: &str = "channel-bounds-test-secret-32-bytes";
/// Past the inline limit (4 MiB): a holder passes its memfd.
const LEN: usize = (8 << 20) + 3;

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET.as_bytes()).expect("secret")
}

/// A broker in this process listening on `ip`, and the secret in a file for workers.
async fn broker(dir: &Path, ip: [u8; 4]) -> (Broker, std::path::PathBuf) {
    let secret = dir.join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret file");
    let mut opts = BrokerOptions::new(dir.join("broker"));
    opts.node = Config {
        bind_addr: SocketAddr::from((ip, 0)),
        cluster_key: key(),
        ..test_config()
    };
    let broker = within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts");
    (broker, secret)
}

/// A node of the cluster in this process, listening on `ip`, running `channels`.
async fn client(broker: &Broker, ip: [u8; 4], channels: &[ChannelKind]) -> Node {
    node(Config {
        bind_addr: SocketAddr::from((ip, 0)),
        brokers: vec![broker.addr().clone()],
        cluster_key: key(),
        channels: channels.to_vec(),
        ..test_config()
    })
    .await
}

fn ticket(broker: &Broker) -> String {
    let ticket = Ticket {
        brokers: vec![broker.addr().clone()],
    };
    ticket.to_string()
}

fn tensor() -> Tensor {
    Tensor::new(DType::U8, vec![LEN as u64], pattern(LEN, 11)).expect("tensor")
}

/// Gets `name` through the cluster, waiting (bounded) until the broker knows it.
async fn get_when_known(node: &Node, name: &str) -> Tensor {
    within(LIMIT, "get", async {
        loop {
            match node.get(name).await {
                Err(Error::NotFound { .. }) => tokio::time::sleep(Duration::from_millis(50)).await,
                other => break other.expect("get").buffer,
            }
        }
    })
    .await
}

/// A counter's value in Prometheus text (`line` up to the value), 0 when absent.
fn counter(text: &str, line: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_in_two_network_namespaces_fall_back_to_quic() {
    // Declared first, dropped last: the processes inside are killed before it goes.
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!("SKIPPED: cannot create a network namespace ({why})");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let outer = ns.outer_ip.octets();
    let (broker, secret) = broker(dir.path(), outer).await;
    // The worker runs inside the namespace, as the same user as this test.
    let mut cmd = ns.command(&bin("tb-worker"));
    cmd.arg("--join")
        .arg(ticket(&broker))
        .arg("--data-dir")
        .arg(dir.path().join("worker"))
        .arg("--listen")
        .arg(SocketAddr::from((ns.inner_ip, 7420)).to_string())
        .arg("--cluster-secret-file")
        .arg(&secret)
        .arg("--metrics-addr")
        .arg(SocketAddr::from((ns.inner_ip, 0)).to_string());
    let mut worker = Proc::start("worker", cmd, &dir.path().join("worker.log"));
    let worker_addr: PeerAddr = worker.wait_line("worker:", START).parse().expect("addr");
    let metrics_url = format!("{}/metrics", worker.wait_line("metrics:", START));

    // A push from this namespace: both offer shm, its socket is out of reach, QUIC carries it.
    let pusher = client(&broker, outer, &ChannelKind::DEFAULT).await;
    let tensor = tensor();
    within(LIMIT, "push", pusher.push(&worker_addr, "ns/w", &tensor))
        .await
        .expect("push");
    let (channels, id) = (&pusher.metrics().channels, worker_addr.id);
    assert_eq!(channels.fallbacks(ChannelKind::Shm), 1);
    assert_eq!(channels.bytes(ChannelKind::Shm, Direction::Out), 0);
    assert_eq!(pusher.channel_to(&id), ChannelKind::Quic);
    let links = pusher.links();
    assert!(links.contains(&(id, "quic")), "{links:?}");

    // The worker publishes what it is pushed; a cluster get from here falls back the same way.
    let reader = client(&broker, outer, &ChannelKind::DEFAULT).await;
    let got = get_when_known(&reader, "ns/w").await;
    assert_eq!(got.data(), tensor.data(), "bytes equal");
    assert_eq!(ContentHash::of(got.data()), tensor.hash());
    let channels = &reader.metrics().channels;
    assert_eq!(channels.fallbacks(ChannelKind::Shm), 1);
    assert_eq!(channels.bytes(ChannelKind::Shm, Direction::In), 0);
    assert!(channels.bytes(ChannelKind::Quic, Direction::In) >= LEN as u64);
    assert_eq!(reader.channel_to(&id), ChannelKind::Quic);

    // The worker's own count: the push reached it over QUIC, nothing over shm.
    let (status, text) = http::get(&metrics_url).expect("worker metrics");
    assert_eq!(status, 200);
    let quic_in = r#"tb_channel_bytes_total{channel="quic",direction="in"}"#;
    let shm_in = r#"tb_channel_bytes_total{channel="shm",direction="in"}"#;
    assert!(counter(&text, quic_in) >= LEN as u64, "{text}");
    assert_eq!(counter(&text, shm_in), 0, "{text}");

    pusher.shutdown().await;
    reader.shutdown().await;
    assert!(worker.terminate(START), "the worker stops on SIGTERM");
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_mapped_over_shm_outlives_its_killed_holder() {
    let dir = tempfile::tempdir().expect("tempdir");
    let local = [127, 0, 0, 1];
    let (broker, secret) = broker(dir.path(), local).await;
    let cmd: Command = worker_command(dir.path(), "worker", &secret, &ticket(&broker));
    let mut worker = Proc::start("worker", cmd, &dir.path().join("worker.log"));
    let worker_addr: PeerAddr = worker.wait_line("worker:", START).parse().expect("addr");

    // Pushed over QUIC, so the memfd the reader maps is one the worker made.
    let pusher = client(&broker, local, &[ChannelKind::Quic]).await;
    let tensor = tensor();
    within(LIMIT, "push", pusher.push(&worker_addr, "kill/w", &tensor))
        .await
        .expect("push");
    let reader = client(&broker, local, &ChannelKind::DEFAULT).await;
    let got = within(LIMIT, "pull", async {
        loop {
            match reader.pull(&worker_addr, "kill/w", None).await {
                Err(Error::NotFound { .. }) => tokio::time::sleep(Duration::from_millis(50)).await,
                other => break other.expect("pull"),
            }
        }
    })
    .await;
    assert_eq!(reader.channel_to(&worker_addr.id), ChannelKind::Shm);
    let shm_in = reader
        .metrics()
        .channels
        .bytes(ChannelKind::Shm, Direction::In);
    assert_eq!(shm_in, LEN as u64, "zero-copy over shm");

    worker.kill9();
    drop(tensor);
    let expected = pattern(LEN, 11);
    assert_eq!(got.buffer.data(), &expected, "readable after the kill");
    assert_eq!(ContentHash::of(got.buffer.data()), got.meta.hash);
    pusher.shutdown().await;
    reader.shutdown().await;
    broker.shutdown().await;
}
