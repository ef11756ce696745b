//! Load through one worker, as users run it: a `tb-broker` and a `tb-worker` process. The
//! test pushes 1,000 small tensors (4 KiB) and four large ones (256 MiB) to the worker, then
//! runs 1,000 concurrent 4 KiB gets and 4 concurrent 256 MiB gets through it at once, from
//! two client nodes of the test process on QUIC (the path between hosts). Every byte is
//! verified, nothing stalls (everything ends within the limit), and the worker's peak RSS
//! stays under its tensors plus [`RSS_HEADROOM`]. Processes are killed by PID at the end.

use std::{sync::Arc, time::Duration};

use tb_node::{
    Config, Node, PeerAddr, Tensor, Ticket,
    proto::{ChannelKind, ClusterKey},
};
use tb_tests::{
    pattern,
    procs::{Proc, broker_command, worker_command},
    test_config, within,
};
use tokio::{sync::Semaphore, task::JoinSet};

const SECRET: &str = "load-test-cluster-secret-of-32-bytes";
const START: Duration = Duration::from_secs(30);
const LIMIT: Duration = Duration::from_secs(240);
const SMALL: usize = 4 << 10;
const SMALLS: usize = 1000;
const LARGE: usize = 256 << 20;
const LARGES: usize = 4;
/// What the serving worker may hold beyond its tensors at its peak: receive buffers of the
/// pushes in flight, per-stream buffers of 1,000 concurrent pulls, the runtime. Measured
/// 33 MiB (1,060 MiB peak for 1,027 MiB held); the bound leaves room for a busier machine.
const RSS_HEADROOM: u64 = 256 << 20;

/// A client node of the cluster on QUIC only.
async fn client(ticket: &Ticket) -> Node {
    Node::spawn(Config {
        brokers: ticket.brokers.clone(),
        cluster_key: ClusterKey::from_secret(SECRET.as_bytes()).expect("secret"),
        auto_fetch: false,
        channels: vec![ChannelKind::Quic],
        ..test_config()
    })
    .await
    .expect("client node")
}

/// The process's peak resident set (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM");
    kib * 1024
}

fn small(i: usize) -> Tensor {
    Tensor::from_bytes(pattern(SMALL, i as u8 ^ (i >> 8) as u8))
}

fn large(i: usize) -> Tensor {
    Tensor::from_bytes(pattern(LARGE, 100 + i as u8))
}

/// Pushes every tensor to the worker (which publishes what it is pushed), 16 at a time.
async fn load_worker(pusher: &Node, worker: &PeerAddr) {
    let slots = Arc::new(Semaphore::new(16));
    let mut pushes = JoinSet::new();
    for i in 0..SMALLS {
        let (pusher, worker, slots) = (pusher.clone(), worker.clone(), slots.clone());
        pushes.spawn(async move {
            let _slot = slots.acquire().await.expect("semaphore");
            let (name, tensor) = (format!("small/{i}"), small(i));
            let push = pusher.push(&worker, &name, &tensor);
            push.await.expect("push small");
        });
    }
    within(LIMIT, "small pushes", async {
        while let Some(done) = pushes.join_next().await {
            done.expect("push task");
        }
    })
    .await;
    for i in 0..LARGES {
        let (name, tensor) = (format!("large/{i}"), large(i));
        let push = pusher.push(worker, &name, &tensor);
        within(LIMIT, "large push", push).await.expect("push large");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_small_and_four_large_gets_through_one_worker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).expect("secret");
    let log = |name: &str| dir.path().join(format!("{name}.log"));
    let mut broker = Proc::start(
        "broker",
        broker_command(dir.path(), "broker", &secret_file),
        &log("broker"),
    );
    let ticket: Ticket = broker.wait_line("ticket:", START).parse().expect("ticket");
    let mut worker = Proc::start(
        "worker",
        worker_command(dir.path(), "worker", &secret_file, &ticket.to_string()),
        &log("worker"),
    );
    let addr: PeerAddr = worker.wait_line("worker:", START).parse().expect("address");
    let pusher = client(&ticket).await;
    load_worker(&pusher, &addr).await;
    pusher.shutdown().await;
    let before = peak_rss(worker.pid());

    let (smalls, larges) = (client(&ticket).await, client(&ticket).await);
    let mut gets = JoinSet::new();
    for i in 0..SMALLS {
        let smalls = smalls.clone();
        gets.spawn(async move {
            let got = smalls.get(&format!("small/{i}")).await.expect("small get");
            assert_eq!(got.buffer.data(), small(i).data(), "small/{i}");
        });
    }
    for i in 0..LARGES {
        let larges = larges.clone();
        gets.spawn(async move {
            let got = larges.get(&format!("large/{i}")).await.expect("large get");
            assert_eq!(got.meta.hash, large(i).hash(), "large/{i}");
            assert_eq!(got.buffer.data(), large(i).data(), "large/{i}");
        });
    }
    within(LIMIT, "gets under load", async {
        while let Some(done) = gets.join_next().await {
            done.expect("a get verified its bytes");
        }
    })
    .await;

    let peak = peak_rss(worker.pid());
    let held = (SMALLS * SMALL + LARGES * LARGE) as u64;
    println!(
        "worker peak RSS: {} MiB after the pushes, {} MiB after the gets; it holds {} MiB",
        before >> 20,
        peak >> 20,
        held >> 20
    );
    assert!(
        peak <= held + RSS_HEADROOM,
        "worker peak RSS {} MiB over {} MiB held + {} MiB",
        peak >> 20,
        held >> 20,
        RSS_HEADROOM >> 20
    );
    smalls.shutdown().await;
    larges.shutdown().await;
    drop(worker);
    drop(broker);
}
