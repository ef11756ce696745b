//! Helpers for tensor-broker's integration tests: nodes with test-friendly settings, tensors
//! with known contents, a UDP proxy that delays every packet (a slow network on loopback),
//! and bounded polling; real processes ([`procs`]) and network namespaces ([`netns`]).

pub mod http;
pub mod netns;
pub mod procs;

use std::{
    future::Future,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use iroh::{EndpointId, endpoint::Connection};
use tb_node::{
    Config, DType, Node, Tensor, TransferProgress, auth,
    proto::{ClusterKey, DATA_ALPN},
};
use tokio::{net::UdpSocket, sync::mpsc, task::JoinHandle};

/// A config for tests: loopback, short timeouts so failures are quick.
pub fn test_config() -> Config {
    Config {
        connect_timeout: Duration::from_secs(3),
        request_timeout: Duration::from_secs(10),
        stall_timeout: Duration::from_secs(10),
        ..Config::default()
    }
}

/// Starts a node with `config`.
pub async fn node(config: Config) -> Node {
    Node::spawn(config).await.expect("node starts")
}

/// Bytes `0, 1, 2, ...` offset by `seed`, so different tensors differ.
pub fn pattern(len: usize, seed: u8) -> Bytes {
    let mut data = Vec::with_capacity(len);
    data.extend((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
    Bytes::from(data)
}

/// An f32 tensor of `n` elements with a seeded pattern.
pub fn f32_tensor(n: usize, seed: u8) -> Tensor {
    Tensor::new(DType::F32, vec![n as u64], pattern(n * 4, seed)).expect("valid tensor")
}

/// Polls `check` every 20 ms until it is true or `limit` passes; returns whether it became true.
pub async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}

/// Like [`eventually`] for async checks: polls `check` every 50 ms until it is true or `limit`
/// passes; returns whether it became true.
pub async fn eventually_async<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check().await
}

/// Awaits `fut`, failing the test if it takes longer than `limit` (a hang is a failure).
pub async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {limit:?}"),
    }
}

/// Most readings a [`ProgressSamples`] keeps (about a minute of them).
const MAX_PROGRESS_SAMPLES: usize = 60_000;

/// Reads a transfer's [`TransferProgress`] every millisecond while it runs, from a task of
/// its own, as a progress bar would.
pub struct ProgressSamples {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Vec<u64>>,
}

impl ProgressSamples {
    /// Starts reading `progress`.
    pub fn start(progress: Arc<TransferProgress>) -> ProgressSamples {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) && seen.len() < MAX_PROGRESS_SAMPLES {
                    seen.push(progress.bytes());
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                seen.push(progress.bytes());
                seen
            }
        });
        ProgressSamples { stop, task }
    }

    /// Stops reading; the values read, in order, the last one read after the transfer ended.
    pub async fn stop(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        within(Duration::from_secs(5), "progress sampler", self.task)
            .await
            .expect("sampler task")
    }
}

/// Checks what a [`ProgressSamples`] saw of a successful transfer of `total` bytes: never
/// decreasing, never past the total, ending exactly at it. Returns how many distinct values
/// it saw strictly between 0 and the total (for the test's log: timing decides how many).
pub fn check_progress(samples: &[u64], total: u64) -> usize {
    assert!(
        samples.windows(2).all(|w| w[0] <= w[1]),
        "progress went backwards: {samples:?}"
    );
    assert!(
        samples.iter().all(|&b| b <= total),
        "past {total}: {samples:?}"
    );
    assert_eq!(samples.last(), Some(&total), "ends at the tensor's length");
    let mut between: Vec<u64> = samples
        .iter()
        .copied()
        .filter(|&b| b > 0 && b < total)
        .collect();
    between.dedup();
    between.len()
}

/// A free UDP port on 127.0.0.1 (bound then released).
pub fn free_udp_port() -> u16 {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    sock.local_addr().expect("addr").port()
}

/// A one-client UDP proxy on 127.0.0.1 that forwards both ways, holding every datagram for
/// `delay`: a slow network path in front of a real node.
pub struct DelayProxy {
    /// Where clients should send (dial this instead of the target).
    pub addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl DelayProxy {
    /// Starts a proxy to `target`.
    pub async fn start(target: SocketAddr, delay: Duration) -> DelayProxy {
        let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind front"));
        let back = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind back"));
        back.connect(target).await.expect("connect back");
        let addr = front.local_addr().expect("addr");
        let client: Arc<std::sync::Mutex<Option<SocketAddr>>> = Arc::default();
        let seen = Arc::new(AtomicBool::new(false));
        let (to_target, rx_t) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let (to_client, rx_c) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
        let mut tasks = Vec::new();
        // Client -> proxy: remember the client, queue for the target.
        tasks.push(tokio::spawn({
            let (front, client, seen) = (front.clone(), client.clone(), seen.clone());
            async move {
                let mut buf = vec![0u8; 65536];
                while let Ok((n, from)) = front.recv_from(&mut buf).await {
                    *client.lock().expect("lock") = Some(from);
                    seen.store(true, Ordering::Release);
                    let _ = to_target.send((Instant::now() + delay, buf[..n].to_vec()));
                }
            }
        }));
        // Target -> proxy: queue for the client.
        tasks.push(tokio::spawn({
            let back = back.clone();
            async move {
                let mut buf = vec![0u8; 65536];
                while let Ok(n) = back.recv(&mut buf).await {
                    let _ = to_client.send((Instant::now() + delay, buf[..n].to_vec()));
                }
            }
        }));
        tasks.push(tokio::spawn(forward(rx_t, move |d| {
            let back = back.clone();
            async move {
                let _ = back.send(&d).await;
            }
        })));
        tasks.push(tokio::spawn(forward(rx_c, move |d| {
            let (front, client) = (front.clone(), client.clone());
            async move {
                let to = *client.lock().expect("lock");
                if let Some(to) = to {
                    let _ = front.send_to(&d, to).await;
                }
            }
        })));
        DelayProxy { addr, tasks }
    }
}

async fn forward<F, Fut>(mut rx: mpsc::UnboundedReceiver<(Instant, Vec<u8>)>, send: F)
where
    F: Fn(Vec<u8>) -> Fut,
    Fut: Future<Output = ()>,
{
    while let Some((due, datagram)) = rx.recv().await {
        tokio::time::sleep_until(due.into()).await;
        send(datagram).await;
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The client half of the `tb/data/1` hello with the open cluster key, for raw test peers
/// that misbehave after it, not in it.
pub async fn raw_client_hello(conn: &Connection, me: EndpointId) {
    auth::client_hello(
        conn,
        me,
        &ClusterKey::open(),
        DATA_ALPN,
        Duration::from_secs(30),
        Config::default().max_concurrent_streams,
    )
    .await
    .expect("hello");
}

/// The server half of that hello; false if the client failed it.
pub async fn raw_server_hello(conn: &Connection, me: EndpointId) -> bool {
    let key = ClusterKey::open();
    let admission = auth::Admission::new(&Config::default());
    auth::server_hello(conn, me, &key, DATA_ALPN, &admission, 1 << 40, |_| {})
        .await
        .is_ok()
}

/// Logs to the test's output, filtered by `RUST_LOG` (nothing unless it is set).
pub fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A 1-D little-endian f32 `.npy` file (format 1.0) of `values`.
pub fn write_npy(path: &std::path::Path, values: &[f32]) {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        values.len()
    );
    // Magic (6) + version (2) + length (2) + header + '\n', padded to 64 bytes.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut file = b"\x93NUMPY\x01\x00".to_vec();
    file.extend_from_slice(&(header.len() as u16).to_le_bytes());
    file.extend_from_slice(header.as_bytes());
    file.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    std::fs::write(path, file).expect("write .npy");
}
