//! GPU tensors end to end: device to device across two processes (network and CUDA IPC),
//! device to host and host to device, hashing, corrupt transfers, and running out of device
//! memory.
//!
//! Every test but the last two needs a CUDA device and is `#[ignore = "needs a CUDA GPU"]`, so
//! a machine without one reports them as ignored, not passed; on a GPU machine run them with
//! `cargo test --release -p tb-tests --test gpu -- --include-ignored` (they fail, saying why,
//! if no device answers). The file compiles against the same API either way.

use std::{process::Stdio, time::Duration};

use bytes::Bytes;
use iroh::{
    SecretKey,
    endpoint::Connection,
    protocol::{AcceptError, ProtocolHandler, Router},
};
use tb_dashboard::Direction;
use tb_node::{
    Config, ContentHash, DType, Device, DeviceBuffer, Error, PeerAddr, Tensor, TensorMeta, device,
    proto::{ChannelKind, DATA_ALPN, DataRequest, DataResponse, frame},
};
use tb_tests::{node, pattern, raw_server_hello, test_config, within};
use tokio::io::{AsyncBufReadExt, BufReader};

const LIMIT: Duration = Duration::from_secs(120);
/// Not a multiple of the 4 MiB staging chunk, so the last chunk is partial.
const BIG: usize = (12 << 20) + 12_345;
const CHILD_ENV: &str = "TB_GPU_CHILD_IPC";

/// The CUDA device to test on: these tests are ignored unless asked for, so a machine
/// without one is a failure that says why.
fn gpu(test: &str) -> usize {
    match device::probe(0) {
        Ok(_) => 0,
        Err(err) => panic!("{test} needs a CUDA device: {err}"),
    }
}

fn u8_tensor(len: usize, seed: u8) -> Tensor {
    Tensor::new(DType::U8, vec![len as u64], pattern(len, seed)).expect("tensor")
}

fn config(ipc: bool) -> Config {
    let mut config = test_config();
    config.cuda.ipc = ipc;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn device_tensor_hashes_like_its_host_bytes() {
    let gpu = gpu("device_tensor_hashes_like_its_host_bytes");
    for len in [0, 1, 4096, BIG] {
        let host = u8_tensor(len, 3);
        let on_gpu = host.to_device(Device::Cuda(gpu)).expect("to device");
        assert_eq!(on_gpu.device(), Device::Cuda(gpu));
        assert_eq!(on_gpu.hash(), host.hash());
        // Hashing from scratch on the device (through staging) agrees with the host.
        let buf = DeviceBuffer::from_host(gpu, host.data()).expect("upload");
        let fresh = Tensor::from_device(DType::U8, vec![len as u64], buf).expect("from_device");
        assert_eq!(fresh.hash(), ContentHash::of(host.data()));
        let back = fresh.to_device(Device::Host).expect("to host");
        assert_eq!(back.data(), host.data());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn device_to_host_and_host_to_device() {
    let gpu = gpu("device_to_host_and_host_to_device");
    let (a, b) = (node(config(true)).await, node(config(true)).await);
    let host = u8_tensor(BIG, 5);
    // Device -> host: b serves from its GPU through staging, a receives into host memory.
    let on_gpu = host.to_device(Device::Cuda(gpu)).expect("to device");
    b.publish_local("gpu/w", on_gpu.clone()).expect("publish");
    let pulled = within(LIMIT, "pull", a.pull(b.addr(), "gpu/w", None))
        .await
        .expect("pull");
    assert_eq!(pulled.buffer.device(), Device::Host);
    assert_eq!(pulled.buffer.data(), host.data());
    // Host -> device: a serves host bytes; a host tensor is not exported by IPC, so b takes
    // the pair's channel (shm: the two share a host) and copies the bytes up once.
    a.publish_local("cpu/w", host.clone()).expect("publish");
    let shm_in = || b.metrics().channels.bytes(ChannelKind::Shm, Direction::In);
    let shm_before = shm_in();
    let pulled = within(
        LIMIT,
        "pull_to",
        b.pull_to(a.addr(), "cpu/w", None, Device::Cuda(gpu)),
    )
    .await
    .expect("pull_to");
    assert_eq!(pulled.buffer.device(), Device::Cuda(gpu));
    assert_eq!(b.cuda_ipc_pulls(), 0);
    assert_eq!(b.channel_to(&a.addr().id), ChannelKind::Shm);
    assert!(
        shm_in() - shm_before >= BIG as u64,
        "the bytes came over shm"
    );
    let back = pulled.buffer.to_device(Device::Host).expect("to host");
    assert_eq!(back.data(), host.data());
    // Push from the device to a node that places pushes on its device.
    let c = node(Config {
        push_placement: Device::Cuda(gpu),
        ..config(true)
    })
    .await;
    within(LIMIT, "push", a.push(c.addr(), "grad/0", &on_gpu))
        .await
        .expect("push");
    let got = c.recv_timeout(Duration::from_secs(30)).await.expect("recv");
    assert_eq!(got.tensor.device(), Device::Cuda(gpu));
    let back = got.tensor.to_device(Device::Host).expect("to host");
    assert_eq!(back.data(), host.data());
    for n in [a, b, c] {
        n.shutdown().await;
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn freed_device_buffers_are_reused_for_the_same_size() {
    let gpu = gpu("freed_device_buffers_are_reused_for_the_same_size");
    if std::env::var("TB_CUDA_POOL_MIB").is_ok_and(|v| v.trim() == "0") {
        panic!("TB_CUDA_POOL_MIB=0 turns the pool this test checks off: unset it");
    }
    let len = (8 << 20) + 4097;
    let first = DeviceBuffer::alloc(gpu, len).expect("alloc");
    let at = first.device_ptr();
    drop(first);
    // The same size again gets the allocation back (kept by the pool), and its bytes are
    // whatever is written next.
    let host = u8_tensor(len, 21);
    let again = DeviceBuffer::from_host(gpu, host.data()).expect("upload");
    assert_eq!(again.device_ptr(), at, "the freed allocation was reused");
    assert_eq!(again.to_host().expect("to host"), host.data().to_vec());
    // Given back again, it is not handed out for half the size (too large a waste).
    drop(again);
    let small = DeviceBuffer::alloc(gpu, len / 2).expect("alloc");
    assert_ne!(
        small.device_ptr(),
        at,
        "a buffer of half the size takes a new allocation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn a_device_tensor_lent_unhashed_is_pulled_to_a_device_or_the_host_and_hashed_on_the_way() {
    let gpu = gpu("a_device_tensor_lent_unhashed_is_pulled_to_a_device_or_the_host");
    let (lender, borrower) = (node(config(true)).await, node(config(true)).await);
    let host = u8_tensor(BIG, 11);
    // The borrower gets a link to the lender (a pull of something it holds).
    lender
        .publish_local("held", u8_tensor(4096, 1))
        .expect("publish");
    within(LIMIT, "pull", borrower.pull(lender.addr(), "held", None))
        .await
        .expect("pull");
    let ttl = Duration::from_secs(60);
    let lend = |seed: u8| {
        let buf = DeviceBuffer::from_host(gpu, u8_tensor(BIG, seed).data()).expect("upload");
        (lender.lend_device(borrower.id(), DType::U8, vec![BIG as u64], buf, ttl))
            .expect("lends a device tensor")
    };
    // To a device: CUDA IPC cannot map memory into the process that exported it, so this
    // takes the network; the loan survives the same-host channel's refusal (device bytes do
    // not go through it) and is hashed before it is served, so the pull verifies.
    let to_device = lend(11);
    let got = within(
        LIMIT,
        "pull_lent_to",
        borrower.pull_lent_to(lender.id(), to_device.name(), Device::Cuda(gpu)),
    )
    .await
    .expect("pulled to the device");
    assert_eq!(got.device(), Device::Cuda(gpu));
    assert_eq!(got.hash(), host.hash(), "hashed before it was served");
    let back = got.to_device(Device::Host).expect("to host");
    assert_eq!(back.data(), host.data());
    assert!(to_device.ended(), "one pull per loan");
    // To the host: the same, into host memory.
    let to_host = lend(12);
    let got = within(
        LIMIT,
        "pull_lent",
        borrower.pull_lent(lender.id(), to_host.name()),
    )
    .await
    .expect("pulled to the host");
    assert_eq!(got.device(), Device::Host);
    assert_eq!(got.data(), u8_tensor(BIG, 12).data());
    for n in [lender, borrower] {
        n.shutdown().await;
    }
}

/// Starts this test binary again as a process that publishes a `BIG` tensor on its GPU as
/// `gpu/shared` (with CUDA IPC offered or not) and returns its address; it serves until its
/// stdin closes.
async fn spawn_gpu_server(ipc: bool) -> (tokio::process::Child, PeerAddr) {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = tokio::process::Command::new(exe)
        .args(["--ignored", "--exact", "gpu_child_server", "--nocapture"])
        .env(CHILD_ENV, if ipc { "1" } else { "0" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the serving process");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let addr = within(LIMIT, "child address", async {
        while let Some(line) = lines.next_line().await.expect("read child") {
            if let Some(addr) = line.strip_prefix("ADDR ") {
                return addr.parse::<PeerAddr>().expect("address");
            }
        }
        panic!("the serving process ended without an address");
    })
    .await;
    // Keep draining its output so the test harness in it never writes to a closed pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

/// The serving half of the two-process tests; runs only when started by them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process for the two-process GPU tests"]
async fn gpu_child_server() {
    let Ok(ipc) = std::env::var(CHILD_ENV) else {
        return;
    };
    let n = node(config(ipc == "1")).await;
    let tensor = u8_tensor(BIG, 9)
        .to_device(Device::Cuda(0))
        .expect("to device");
    n.publish_local("gpu/shared", tensor).expect("publish");
    println!("ADDR {}", n.addr());
    let mut rest = String::new();
    let stdin = tokio::io::stdin();
    let _ = tokio::time::timeout(LIMIT, BufReader::new(stdin).read_line(&mut rest)).await;
    n.shutdown().await;
}

async fn pull_from_other_process(ipc: bool) -> (Tensor, u64) {
    pull_from_other_process_as(ipc, config(ipc)).await
}

/// Pulls the child's tensor to device 0 with a node of `config`.
async fn pull_from_other_process_as(ipc: bool, config: Config) -> (Tensor, u64) {
    let (mut child, addr) = spawn_gpu_server(ipc).await;
    let a = node(config).await;
    let pulled = within(
        LIMIT,
        "pull_to",
        a.pull_to(&addr, "gpu/shared", None, Device::Cuda(0)),
    )
    .await
    .expect("pull_to");
    let ipc_pulls = a.cuda_ipc_pulls();
    a.shutdown().await;
    drop(child.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    (pulled.buffer, ipc_pulls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn device_to_device_pull_across_two_processes() {
    gpu("device_to_device_pull_across_two_processes");
    let (tensor, ipc_pulls) = pull_from_other_process(false).await;
    assert_eq!(ipc_pulls, 0, "IPC is off: the bytes crossed the network");
    assert_eq!(tensor.device(), Device::Cuda(0));
    assert_eq!(tensor.hash(), ContentHash::of(&pattern(BIG, 9)));
    let back = tensor.to_device(Device::Host).expect("to host");
    assert_eq!(back.data(), &pattern(BIG, 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn ipc_path_maps_the_other_process_memory() {
    gpu("ipc_path_maps_the_other_process_memory");
    let (tensor, ipc_pulls) = pull_from_other_process(true).await;
    assert_eq!(ipc_pulls, 1, "same host, device tensor: CUDA IPC");
    assert_eq!(tensor.device(), Device::Cuda(0));
    let back = tensor.to_device(Device::Host).expect("to host");
    assert_eq!(back.data(), &pattern(BIG, 9));
    assert_eq!(ContentHash::of(back.data()), tensor.hash());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn a_read_only_node_gets_no_cuda_ipc_mapping_and_pulls_over_the_network() {
    gpu("a_read_only_node_gets_no_cuda_ipc_mapping_and_pulls_over_the_network");
    // An IPC handle maps the server's memory writable: only read-write peers get one.
    let read_only = Config {
        cluster_key: tb_node::proto::ClusterKey::open().read_only(),
        ..config(true)
    };
    let (tensor, ipc_pulls) = pull_from_other_process_as(true, read_only).await;
    assert_eq!(ipc_pulls, 0, "the read-only node pulled over the network");
    assert_eq!(tensor.device(), Device::Cuda(0));
    let back = tensor.to_device(Device::Host).expect("to host");
    assert_eq!(back.data(), &pattern(BIG, 9));
}

/// A `tb/data/1` server that answers every pull with `meta` and then `payload`.
#[derive(Debug, Clone)]
struct Liar {
    me: iroh::EndpointId,
    meta: TensorMeta,
    payload: Bytes,
}

impl ProtocolHandler for Liar {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        if !raw_server_hello(&conn, self.me).await {
            return Ok(());
        }
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let mut prefix = [0u8; 4];
            if recv.read_exact(&mut prefix).await.is_err() {
                return Ok(());
            }
            let Ok(len) = frame::body_len(prefix) else {
                return Ok(());
            };
            let mut body = vec![0u8; len];
            if recv.read_exact(&mut body).await.is_err() {
                return Ok(());
            }
            let request = frame::decode_body::<DataRequest>(&body);
            if let Ok(DataRequest::Channels { .. }) = request {
                // No channels besides QUIC.
                let none = DataResponse::Channels { offers: Vec::new() };
                if let Ok(bytes) = frame::encode(&none) {
                    let _ = send.write_all(&bytes).await;
                    let _ = send.finish();
                }
                continue;
            }
            let Ok(DataRequest::Pull { .. }) = request else {
                // Anything else (CUDA IPC): not served here, as a node without it answers.
                let no = DataResponse::Error {
                    code: tb_node::proto::ErrorCode::Unsupported,
                    message: "not served here".into(),
                };
                if let Ok(bytes) = frame::encode(&no) {
                    let _ = send.write_all(&bytes).await;
                    let _ = send.finish();
                }
                continue;
            };
            let header = DataResponse::Header {
                meta: self.meta.clone(),
                version: 1,
            };
            let Ok(mut bytes) = frame::encode(&header) else {
                return Ok(());
            };
            bytes.extend_from_slice(&self.payload);
            let _ = send.write_all(&bytes).await;
            let _ = send.finish();
            // Keep the stream open until the puller is done with it.
            let _ = recv.read_to_end(1024).await;
        }
        Ok(())
    }
}

async fn liar(meta: TensorMeta, payload: Bytes) -> (Router, PeerAddr) {
    let ep = tb_node::bind_endpoint(&Config::default(), SecretKey::generate())
        .await
        .expect("endpoint");
    let addr = PeerAddr {
        id: ep.id(),
        addr: *ep.bound_sockets().first().expect("socket"),
    };
    let me = ep.id();
    let router = Router::builder(ep)
        .accept(DATA_ALPN, Liar { me, meta, payload })
        .spawn();
    (router, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn corrupt_transfer_to_device_is_rejected() {
    let gpu = gpu("corrupt_transfer_to_device_is_rejected");
    let payload = pattern(BIG, 1);
    let mut meta = u8_tensor(BIG, 1).meta().clone();
    meta.hash = ContentHash::of(b"something else");
    let (router, addr) = liar(meta, payload).await;
    let a = node(config(true)).await;
    match within(
        LIMIT,
        "pull_to",
        a.pull_to(&addr, "x", None, Device::Cuda(gpu)),
    )
    .await
    {
        Err(Error::Corrupt(msg)) => assert!(msg.contains("expected hash"), "{msg}"),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    a.shutdown().await;
    let _ = router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a CUDA GPU"]
async fn out_of_memory_on_the_receiving_device_is_a_typed_error() {
    let gpu = gpu("out_of_memory_on_the_receiving_device_is_a_typed_error");
    let info = device::probe(gpu).expect("probe");
    let too_big = info.total_bytes * 2;
    match DeviceBuffer::alloc(gpu, usize::try_from(too_big).expect("64-bit")) {
        Err(Error::DeviceOutOfMemory(_)) => {}
        other => panic!("expected DeviceOutOfMemory, got {other:?}"),
    }
    // A peer announcing a tensor larger than the device: refused when allocating, before any
    // payload is read.
    let meta = TensorMeta {
        dtype: DType::U8,
        shape: vec![too_big],
        byte_len: too_big,
        hash: ContentHash::of(b""),
    };
    let (router, addr) = liar(meta, Bytes::new()).await;
    let a = node(Config {
        max_tensor_bytes: u64::MAX,
        ..config(true)
    })
    .await;
    match within(
        LIMIT,
        "pull_to",
        a.pull_to(&addr, "huge", None, Device::Cuda(gpu)),
    )
    .await
    {
        Err(Error::DeviceOutOfMemory(msg)) => {
            assert!(msg.contains(&format!("cuda:{gpu}")), "{msg}")
        }
        other => panic!("expected DeviceOutOfMemory, got {other:?}"),
    }
    a.shutdown().await;
    let _ = router.shutdown().await;
}

/// Runs everywhere: without a device, every device call is a typed error, never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_device_device_calls_fail_with_device_unavailable() {
    if device::probe(0).is_ok() {
        return;
    }
    let (a, b) = (node(test_config()).await, node(test_config()).await);
    b.publish_local("w", u8_tensor(64, 1)).expect("publish");
    match a.pull_to(b.addr(), "w", None, Device::Cuda(0)).await {
        Err(Error::DeviceUnavailable(_)) => {}
        other => panic!("expected DeviceUnavailable, got {other:?}"),
    }
    match u8_tensor(64, 1).to_device(Device::Cuda(0)) {
        Err(Error::DeviceUnavailable(_)) => {}
        other => panic!("expected DeviceUnavailable, got {other:?}"),
    }
    // The host path is untouched.
    let pulled = a
        .pull_to(b.addr(), "w", None, Device::Host)
        .await
        .expect("host pull");
    assert_eq!(pulled.buffer.data(), &pattern(64, 1));
    a.shutdown().await;
    b.shutdown().await;
}

/// Runs everywhere: CUDA IPC is a request kind on the pooled data link. A host tensor is
/// declined (use the network), a tensor nobody holds is declined, a read-only asker is refused
/// (the mapping would be writable), and an oversized host id is refused before anything is
/// looked up; the same-host socket sends the kind back to the link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_requests_on_the_data_link_are_declined_or_refused_with_reasons() {
    use tb_node::proto::{
        ErrorCode, TensorName,
        ipc::{IpcRequest, IpcResponse, MAX_HOST_ID_LEN},
    };
    let (a, b) = (node(test_config()).await, node(test_config()).await);
    b.publish_local("ipc/host", u8_tensor(1 << 20, 2))
        .expect("publish");
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_string())
        .unwrap_or_default();
    let open = |name: &str, host: String| {
        DataRequest::CudaIpc(IpcRequest::Open {
            name: TensorName::new(name).expect("name"),
            version: None,
            host,
            min_bytes: 0,
        })
    };
    let ask = |node: &tb_node::Node, request: DataRequest| {
        let peer = b.addr().clone();
        let node = node.clone();
        async move {
            let opened = node.open_request(&peer, &request, &[], true, LIMIT);
            within(LIMIT, "a CUDA IPC request", opened)
                .await
                .expect("answered")
                .answer
        }
    };
    for name in ["ipc/host", "ipc/missing"] {
        match ask(&a, open(name, boot.clone())).await {
            DataResponse::CudaIpc(IpcResponse::Declined { reason }) => {
                let why = if name == "ipc/host" {
                    "host memory"
                } else {
                    "not held"
                };
                assert!(reason.contains(why), "{name}: {reason}");
            }
            other => panic!("{name}: expected a refusal to export, got {other:?}"),
        }
    }
    match ask(&a, open("ipc/host", "b".repeat(MAX_HOST_ID_LEN + 1))).await {
        DataResponse::Error { code, message } => {
            assert_eq!(code, ErrorCode::InvalidTensor, "{message}");
        }
        other => panic!("expected an invalid request, got {other:?}"),
    }
    let read_only = node(Config {
        cluster_key: tb_node::proto::ClusterKey::open().read_only(),
        ..test_config()
    })
    .await;
    match ask(&read_only, open("ipc/host", boot.clone())).await {
        DataResponse::Error { code, message } => {
            assert_eq!(code, ErrorCode::Unauthorized, "{message}");
        }
        other => panic!("expected Unauthorized, got {other:?}"),
    }
    // The host tensor still comes, over the pair's channel, after the declined request.
    let pulled = within(LIMIT, "pull", a.pull(b.addr(), "ipc/host", None))
        .await
        .expect("pull");
    assert_eq!(pulled.buffer.data(), &pattern(1 << 20, 2));
    for n in [a, b, read_only] {
        n.shutdown().await;
    }
}
