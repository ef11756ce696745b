//! Budgets: what a member can make a node hold is bounded in bytes, not only in count.
//!
//! - Pushes reserve their bytes before anything is allocated, and keep them until `recv()`
//!   takes the tensor: the excess of a burst is refused at once with `Busy` (or `TooLarge`),
//!   the rest arrives byte for byte. Measured on a real `tb-worker` process: its peak RSS
//!   stays within the push budget plus a stated slack.
//! - Device pushes reserve against a device budget, and a transfer holds at most its share
//!   of a device's staging buffers (both skipped without a CUDA device).
//! - A broker's anti-entropy buffers are bounded in bytes, all conversations together.
//!
//! Every wait is bounded, and every process started is killed by PID when the test ends.

use std::time::Duration;

use iroh::{
    SecretKey,
    endpoint::{Connection, RecvStream, SendStream},
};
use tb_broker::{Broker, BrokerOptions};
use tb_node::{
    Config, ContentHash, CudaConfig, DType, Device, Error, Node, PeerAddr, Tensor, Ticket, auth,
    device,
    framing::{read_frame, write_frame},
    proto::{
        CTL_ALPN, ClusterKey, CtlRequest, CtlResponse, DATA_ALPN, DataRequest, DataResponse,
        ErrorCode, SYNC_BUCKETS, TensorName,
    },
};
use tb_tests::{
    eventually, node, pattern,
    procs::{Proc, broker_command, worker_command},
    raw_client_hello, test_config, within,
};

const LIMIT: Duration = Duration::from_secs(120);
const START: Duration = Duration::from_secs(30);
/// 32 bytes or more, as secrets must be.
const SECRET: &str = "budgets-test-cluster-secret-0123456789";
const MIB: u64 = 1 << 20;

fn key() -> ClusterKey {
    ClusterKey::from_secret(SECRET.as_bytes()).expect("secret")
}

fn u8_tensor(len: usize, seed: u8) -> Tensor {
    Tensor::new(DType::U8, vec![len as u64], pattern(len, seed)).expect("tensor")
}

/// Pushes every `(name, tensor)` to `to` at once, each from one of `from` in turn; the results
/// in the same order.
async fn push_all(
    from: &[Node],
    to: &PeerAddr,
    tensors: &[(String, Tensor)],
) -> Vec<Result<(), Error>> {
    let tasks: Vec<_> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, tensor))| {
            let (pusher, to, name, tensor) = (
                from[i % from.len()].clone(),
                to.clone(),
                name.clone(),
                tensor.clone(),
            );
            tokio::spawn(async move { pusher.push(&to, &name, &tensor).await })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(within(LIMIT, "a push", task).await.expect("push task"));
    }
    results
}

/// Regression: a receiver allocated every push's declared length before its first byte
/// arrived and queued pushes by count only, so a burst of pushes could take all its memory.
/// Now the budget admits what fits — held until `recv()` takes it — and refuses the rest at
/// once; accepted pushes arrive byte for byte, refused ones leave nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_over_the_budget_are_refused_busy_and_accepted_ones_arrive_intact() {
    const LEN: usize = 1 << 20;
    const FIT: usize = 4;
    let receiver = node(Config {
        // Room for four pushes, not five.
        max_push_memory: FIT as u64 * LEN as u64 + LEN as u64 / 2,
        ..test_config()
    })
    .await;
    let pushers = [node(test_config()).await, node(test_config()).await];
    let tensors: Vec<(String, Tensor)> = (0..10)
        .map(|i| (format!("burst/{i}"), u8_tensor(LEN, i as u8)))
        .collect();
    let results = push_all(&pushers, receiver.addr(), &tensors).await;
    let mut accepted = Vec::new();
    for ((name, tensor), result) in tensors.iter().zip(results) {
        match result {
            Ok(()) => accepted.push((name.clone(), tensor.clone())),
            Err(Error::Busy(msg)) => assert!(msg.contains("push budget"), "{msg}"),
            Err(other) => panic!("push of {name}: expected Ok or Busy, got {other:?}"),
        }
    }
    // Nobody took any: each accepted push still holds its bytes, so exactly four fit.
    assert_eq!(accepted.len(), FIT, "pushes accepted");
    assert_eq!(
        receiver.inbox_len(),
        FIT,
        "refused pushes leave nothing in the inbox"
    );
    assert_eq!(receiver.push_bytes_held(), (FIT * LEN) as u64);

    // More than the whole budget could never fit: TooLarge, not Busy.
    let huge = u8_tensor(5 * LEN, 99);
    match pushers[0].push(receiver.addr(), "burst/huge", &huge).await {
        Err(Error::TooLarge(msg)) => assert!(msg.contains("push budget"), "{msg}"),
        other => panic!("expected TooLarge, got {other:?}"),
    }

    for _ in 0..FIT {
        let got = receiver
            .recv_timeout(Duration::from_secs(5))
            .await
            .expect("an accepted push");
        let (_, sent) = accepted
            .iter()
            .find(|(name, _)| name == got.name.as_str())
            .unwrap_or_else(|| panic!("{} was not accepted", got.name));
        assert_eq!(got.tensor.data(), sent.data(), "{} byte for byte", got.name);
        assert_eq!(ContentHash::of(got.tensor.data()), sent.hash());
    }
    assert!(
        receiver
            .recv_timeout(Duration::from_millis(100))
            .await
            .is_err(),
        "no refused push became visible"
    );
    assert_eq!(
        receiver.push_bytes_held(),
        0,
        "taking pushes frees the budget"
    );
    // The budget is free again: a refused sender that retries now gets through.
    let (name, tensor) = &tensors[9];
    pushers[1]
        .push(receiver.addr(), name, tensor)
        .await
        .expect("a retry after recv()");
    for n in pushers.iter().chain([&receiver]) {
        n.shutdown().await;
    }
}

/// The device counterpart: pushes placed on a GPU reserve against the device budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn device_pushes_over_the_device_budget_are_refused_busy() {
    if let Err(err) = device::probe(0) {
        panic!("this test needs a CUDA device: {err}");
    }
    const LEN: usize = 1 << 20;
    let receiver = node(Config {
        push_placement: Device::Cuda(0),
        max_push_device_memory: Some(3 * LEN as u64 + 1000),
        ..test_config()
    })
    .await;
    let pusher = node(test_config()).await;
    let tensors: Vec<(String, Tensor)> = (0..6)
        .map(|i| (format!("gpu-burst/{i}"), u8_tensor(LEN, i as u8)))
        .collect();
    let results = push_all(std::slice::from_ref(&pusher), receiver.addr(), &tensors).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, 3, "three fit the device budget: {results:?}");
    assert!(
        results
            .iter()
            .all(|r| matches!(r, Ok(()) | Err(Error::Busy(_)))),
        "{results:?}"
    );
    assert_eq!(receiver.push_bytes_held(), 0, "no host budget spent");
    for _ in 0..3 {
        let got = receiver
            .recv_timeout(Duration::from_secs(5))
            .await
            .expect("accepted");
        assert_eq!(got.tensor.device(), Device::Cuda(0));
        let (_, sent) = tensors
            .iter()
            .find(|(n, _)| n == got.name.as_str())
            .expect("sent");
        let back = got.tensor.to_device(Device::Host).expect("to host");
        assert_eq!(back.data(), sent.data());
    }
    pusher.shutdown().await;
    receiver.shutdown().await;
}

/// Regression (GPU): all transfers of a device share 8 pinned staging buffers, and a sender
/// keeps a chunk's buffer until its receiver takes the bytes. Three receivers that ask for a
/// device tensor and then read nothing used to hold every buffer (3 + 3 + 2), so a fourth
/// pull waited for one until its stall timeout. Now each transfer holds at most 2 and the
/// fourth pull goes through while the three stay stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn stalled_receivers_cannot_take_every_staging_buffer() {
    if let Err(err) = device::probe(0) {
        panic!("this test needs a CUDA device: {err}");
    }
    const LEN: usize = 40 << 20;
    let no_ipc = CudaConfig {
        ipc: false,
        ..CudaConfig::default()
    };
    // The server waits long for stalled receivers (they keep their buffers all along), the
    // puller gives up sooner: with every buffer taken its pull would fail.
    let server = node(Config {
        stall_timeout: Duration::from_secs(60),
        cuda: no_ipc.clone(),
        ..test_config()
    })
    .await;
    let host = u8_tensor(LEN, 7);
    let on_gpu = host.to_device(Device::Cuda(0)).expect("to device");
    server.publish_local("slow/w", on_gpu).expect("publish");
    let ep = tb_node::bind_endpoint(&test_config(), SecretKey::generate())
        .await
        .expect("endpoint");
    let mut stalled = Vec::new();
    for _ in 0..3 {
        let conn = ep
            .connect(server.addr().to_endpoint_addr(), DATA_ALPN)
            .await
            .expect("connect");
        raw_client_hello(&conn, ep.id()).await;
        let (mut send, mut recv) = conn.open_bi().await.expect("open");
        let pull = DataRequest::Pull {
            name: TensorName::new("slow/w").expect("name"),
            version: None,
            range: None,
        };
        write_frame(&mut send, &pull).await.expect("pull");
        let header = within(LIMIT, "header", read_frame::<DataResponse>(&mut recv)).await;
        assert!(
            matches!(header, Ok(DataResponse::Header { .. })),
            "{header:?}"
        );
        // Read nothing more: the server's sender stalls holding what it staged.
        stalled.push((conn, send, recv));
    }
    // Let the three senders stage ahead (they do so at once; this only orders the pulls).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let puller = node(Config {
        stall_timeout: Duration::from_secs(15),
        cuda: no_ipc,
        ..test_config()
    })
    .await;
    let got = within(LIMIT, "pull", puller.pull(server.addr(), "slow/w", None))
        .await
        .expect("a pull beside three stalled receivers");
    assert_eq!(got.buffer.data(), host.data());
    drop(stalled);
    ep.close().await;
    puller.shutdown().await;
    server.shutdown().await;
}

/// `VmHWM` (peak resident set) of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM line");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("VmHWM value");
    kib * 1024
}

/// The worker's push budget in the RSS test.
const WORKER_BUDGET: u64 = 64 * MIB;
/// What the worker may hold beyond its push budget: the one version it keeps of the pushed
/// name (16 MiB, `--keep-versions 1`) and 32 MiB for QUIC stream buffers, allocator slack and
/// runtime growth under load.
const RSS_SLACK: u64 = 48 * MIB;

/// Regression, measured on the process under test: sixteen concurrent 16 MiB pushes (256 MiB)
/// to a `tb-worker` with `--max-push-memory 64MiB`. Before, the worker allocated all of them
/// at once (peak RSS about 256 MiB over its idle peak); now the excess is refused with `Busy`
/// and the peak stays within the budget plus [`RSS_SLACK`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_under_a_push_flood_stays_within_its_push_budget() {
    const LEN: usize = 16 << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret file");
    let mut broker = Proc::start(
        "broker",
        broker_command(dir.path(), "broker", &secret),
        &dir.path().join("broker.log"),
    );
    let ticket: Ticket = broker.wait_line("ticket:", START).parse().expect("ticket");
    let mut cmd = worker_command(dir.path(), "worker", &secret, &ticket.to_string());
    cmd.args(["--max-push-memory", "64MiB", "--keep-versions", "1"]);
    let mut worker = Proc::start("worker", cmd, &dir.path().join("worker.log"));
    let worker_addr: PeerAddr = worker
        .wait_line("worker:", START)
        .parse()
        .expect("worker address");
    let client = node(Config {
        brokers: ticket.brokers.clone(),
        cluster_key: key(),
        heartbeats: false,
        auto_fetch: false,
        ..test_config()
    })
    .await;

    // Warm up (link, runtime, one small tensor held), then take the idle peak.
    let warm = u8_tensor(1 << 20, 1);
    within(
        LIMIT,
        "warm-up push",
        client.push(&worker_addr, "flood/warm", &warm),
    )
    .await
    .expect("warm-up push");
    let idle = peak_rss(worker.pid());

    let tensors: Vec<(String, Tensor)> = (0..16)
        .map(|i| ("flood/w".to_string(), u8_tensor(LEN, 10 + i as u8)))
        .collect();
    let results = push_all(std::slice::from_ref(&client), &worker_addr, &tensors).await;
    let huge = u8_tensor((WORKER_BUDGET + MIB) as usize, 2);
    let huge_push = client.push(&worker_addr, "flood/huge", &huge).await;
    let peak = peak_rss(worker.pid());
    let grew = peak.saturating_sub(idle);
    let mut accepted = Vec::new();
    let mut busy = 0;
    for ((_, tensor), result) in tensors.iter().zip(&results) {
        match result {
            Ok(()) => accepted.push(tensor.clone()),
            Err(Error::Busy(_)) => busy += 1,
            Err(other) => panic!("expected Ok or Busy, got {other:?}"),
        }
    }
    println!(
        "worker peak RSS: idle {} MiB, after the flood {} MiB (+{} MiB); budget {} MiB + slack \
         {} MiB; {} pushes accepted, {busy} busy",
        idle / MIB,
        peak / MIB,
        grew / MIB,
        WORKER_BUDGET / MIB,
        RSS_SLACK / MIB,
        accepted.len()
    );
    assert!(
        grew <= WORKER_BUDGET + RSS_SLACK,
        "the worker's peak RSS grew by {} MiB, over its {} MiB push budget plus {} MiB",
        grew / MIB,
        WORKER_BUDGET / MIB,
        RSS_SLACK / MIB
    );
    assert!(busy > 0, "256 MiB at once cannot fit a 64 MiB budget");
    assert!(!accepted.is_empty(), "what fits is accepted");
    assert!(
        matches!(huge_push, Err(Error::TooLarge(_))),
        "a push over the whole budget: expected TooLarge, got {huge_push:?}"
    );

    // The worker publishes what it accepted: the version it keeps is one of them, intact.
    let mut held = None;
    for _ in 0..100 {
        if let Ok(pulled) = client.pull(&worker_addr, "flood/w", None).await {
            held = Some(pulled.buffer);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let held = held.expect("the worker publishes an accepted push");
    assert!(
        accepted.iter().any(|t| t.data() == held.data()),
        "the kept version is byte for byte one of the accepted pushes"
    );
    client.shutdown().await;
    worker.terminate(Duration::from_secs(10));
    broker.terminate(Duration::from_secs(10));
}

/// A raw `tb/ctl/1` connection to `broker`, past the hello.
async fn ctl_connect(ep: &iroh::Endpoint, broker: &Broker) -> Connection {
    let conn = ep
        .connect(broker.addr().to_endpoint_addr(), CTL_ALPN)
        .await
        .expect("connect");
    auth::client_hello(&conn, ep.id(), &key(), CTL_ALPN, Duration::from_secs(10), 0)
        .await
        .expect("hello");
    conn
}

/// Opens an anti-entropy conversation as an asker with an empty registry, through the
/// broker's `SyncDiff` answer.
async fn open_sync(conn: &Connection) -> (SendStream, RecvStream) {
    let (mut send, mut recv) = conn.open_bi().await.expect("open");
    let ask = CtlRequest::SyncBuckets {
        buckets: vec![[0u8; 32]; SYNC_BUCKETS],
        members: Vec::new(),
    };
    write_frame(&mut send, &ask).await.expect("SyncBuckets");
    for _ in 0..64 {
        match next(&mut recv).await {
            CtlResponse::SyncDiff { last: true, .. } => return (send, recv),
            CtlResponse::SyncDiff { .. } => {}
            other => panic!("expected SyncDiff, got {other:?}"),
        }
    }
    panic!("no last SyncDiff");
}

async fn next(recv: &mut RecvStream) -> CtlResponse {
    within(Duration::from_secs(10), "a ctl frame", read_frame(recv))
        .await
        .expect("frame")
}

/// A `SyncNames` frame of about 400 KB: names `sync/<start>...` with made-up digests.
fn names_frame(start: usize, last: bool) -> CtlRequest {
    let names = (start..start + 1700)
        .map(|i| {
            let name = TensorName::new(format!("sync/{i:0200}")).expect("name");
            (name, [7u8; 32])
        })
        .collect();
    CtlRequest::SyncNames { names, last }
}

async fn refusal(recv: &mut RecvStream) -> ErrorCode {
    match next(recv).await {
        CtlResponse::Error { code, .. } => code,
        other => panic!("expected an Error frame, got {other:?}"),
    }
}

/// Regression: a member could make a broker buffer 4096 frames of 1 MiB of anti-entropy
/// names per conversation, in as many conversations as it liked. Now every conversation draws
/// from one byte budget: one that alone exceeds it is `TooLarge`, one that does not fit beside
/// the others is `Busy`, and the broker still completes the conversations that fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anti_entropy_buffers_are_bounded_in_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut opts = BrokerOptions::new(dir.path());
    opts.node = test_config();
    opts.node.cluster_key = key();
    opts.state.max_sync_bytes = MIB;
    let broker = within(LIMIT, "broker start", Broker::spawn(opts))
        .await
        .expect("broker starts");
    let ep = tb_node::bind_endpoint(&test_config(), SecretKey::generate())
        .await
        .expect("endpoint");
    let conn = ctl_connect(&ep, &broker).await;

    // Alone past the budget: the third ~400 KB frame is refused as too large.
    let (mut send, mut recv) = open_sync(&conn).await;
    for i in 0..3 {
        if write_frame(&mut send, &names_frame(i * 1700, false))
            .await
            .is_err()
        {
            break;
        }
    }
    assert_eq!(refusal(&mut recv).await, ErrorCode::TooLarge);
    drop((send, recv));
    assert!(
        eventually(Duration::from_secs(5), || broker.sync_bytes_held() == 0).await,
        "a refused conversation holds nothing"
    );

    // Two conversations, about 800 KB held by the first: the second's 400 KB is Busy.
    let (mut first, mut first_recv) = open_sync(&conn).await;
    for i in 0..2 {
        write_frame(&mut first, &names_frame(i * 1700, false))
            .await
            .expect("names");
    }
    assert!(
        eventually(Duration::from_secs(5), || broker.sync_bytes_held()
            > 700_000)
        .await,
        "the first conversation's names are held: {}",
        broker.sync_bytes_held()
    );
    let (mut second, mut second_recv) = open_sync(&conn).await;
    write_frame(&mut second, &names_frame(10_000, false))
        .await
        .expect("names");
    assert_eq!(refusal(&mut second_recv).await, ErrorCode::Busy);

    // The first one still completes: its entries (none: the broker has no names) follow.
    write_frame(
        &mut first,
        &CtlRequest::SyncNames {
            names: Vec::new(),
            last: true,
        },
    )
    .await
    .expect("last names");
    match next(&mut first_recv).await {
        CtlResponse::SyncEntries { last: true, .. } => {}
        other => panic!("expected the last SyncEntries, got {other:?}"),
    }
    drop((first, first_recv, second, second_recv));
    assert!(
        eventually(Duration::from_secs(5), || broker.sync_bytes_held() == 0).await,
        "finished conversations give their bytes back"
    );
    conn.close(0u32.into(), b"done");
    ep.close().await;
    broker.shutdown().await;
}
