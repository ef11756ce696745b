//! The serving process of `tb bench p2p`: one tensor-broker node per measured system (each
//! with that system's `Config`, all holding the same bytes), a raw iroh endpoint and a raw TCP
//! listener; it also receives the benchmark's pushes and answers each with an ack (see
//! [`ACK_NAME`]). It serves until the orchestrator closes its stdin.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Args;
use iroh::{
    endpoint::Connection,
    protocol::{AcceptError, ProtocolHandler, Router},
};
use tb_node::{Config, Device, Node, PeerAddr, Tensor};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::bench::{
    LARGEST, PULL_INTO_SIZES, RAW_ALPN, ServeInfo, System, device_tensor_name, payload, tensor_name,
};

/// The name the serving node pushes back once `recv()` has returned a measured push: its
/// payload is the wall-clock instant of that return, in nanoseconds since the Unix epoch
/// (u64 LE).
pub(crate) const ACK_NAME: &str = "bench-ack";
/// Prefix of measured pushes: `bench-push/<pusher's port>/<size>`.
pub(crate) const PUSH_PREFIX: &str = "bench-push/";
/// How long pushing an ack back may take.
const ACK_LIMIT: Duration = Duration::from_secs(30);

/// Options of the internal serving process.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Also hold the tensors on this device.
    #[arg(long, default_value = "host")]
    device: Device,
    /// The tensor-broker systems to serve (labels, comma-separated).
    #[arg(long, default_value = "tensor-broker")]
    systems: String,
    /// Hold no size above this.
    #[arg(long, default_value_t = LARGEST)]
    max_size: u64,
}

/// Now on the wall clock, in nanoseconds since the Unix epoch: one clock every process on
/// the host reads alike (0 if the clock is before 1970).
pub(crate) fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Serves the benchmark's tensors until stdin closes.
pub(crate) async fn serve(args: ServeArgs) -> Result<()> {
    let data = payload(LARGEST.min(args.max_size))?;
    let mut nodes = Vec::new();
    let mut tb = BTreeMap::new();
    for label in args.systems.split(',').filter(|l| !l.is_empty()) {
        let system = System::BROKERS
            .into_iter()
            .find(|s| s.label() == label)
            .with_context(|| format!("unknown system {label}"))?;
        let config = system.config().context("a tensor-broker system")?;
        let node = Node::spawn(config).await?;
        let device = if system == System::TensorBroker {
            args.device
        } else {
            Device::Host
        };
        hold(&node, &data, device)?;
        tokio::spawn(answer_pushes(node.clone()));
        tb.insert(label.to_string(), node.addr().to_string());
        nodes.push(node);
    }
    let config = Config::default();
    let raw_ep = tb_node::bind_endpoint(&config, iroh::SecretKey::generate()).await?;
    let raw_addr = PeerAddr {
        id: raw_ep.id(),
        addr: raw_ep
            .bound_sockets()
            .first()
            .copied()
            .context("raw endpoint socket")?,
    };
    let router = Router::builder(raw_ep)
        .accept(RAW_ALPN, RawServer { data: data.clone() })
        .spawn();
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let tcp = listener.local_addr()?;
    let tcp_task = tokio::spawn(serve_tcp(listener, data));
    let info = ServeInfo {
        tb,
        raw: raw_addr.to_string(),
        tcp: tcp.to_string(),
    };
    println!("{}", serde_json::to_string(&info)?);
    // Serve until the orchestrator closes our stdin (or goes away).
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    tcp_task.abort();
    for node in nodes {
        node.shutdown().await;
    }
    let _ = router.shutdown().await;
    Ok(())
}

/// Publishes every size of `data` on `node` (and on `device` too, when it is a GPU).
fn hold(node: &Node, data: &Bytes, device: Device) -> Result<()> {
    for size in PULL_INTO_SIZES
        .into_iter()
        .filter(|&s| s <= data.len() as u64)
    {
        let tensor = Tensor::from_bytes(data.slice(..usize::try_from(size)?));
        if device != Device::Host {
            let on_device = tensor.to_device(device)?;
            node.publish_local(&device_tensor_name(size), on_device)?;
        }
        node.publish_local(&tensor_name(size), tensor)?;
    }
    Ok(())
}

/// Takes every tensor pushed to `node` until it shuts down; a measured push
/// (`bench-push/<port>/<size>`) is answered with [`ACK_NAME`] carrying the instant `recv()`
/// returned it, pushed back to the pusher at `127.0.0.1:<port>`.
async fn answer_pushes(node: Node) {
    while let Ok(got) = node.recv().await {
        let at = wall_ns();
        let port = got
            .name
            .as_str()
            .strip_prefix(PUSH_PREFIX)
            .and_then(|rest| rest.split('/').next())
            .and_then(|p| p.parse::<u16>().ok());
        drop(got.tensor);
        let Some(port) = port else { continue };
        let to = PeerAddr {
            id: got.from,
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        };
        let ack = Tensor::from_bytes(at.to_le_bytes().to_vec());
        let pushed = tokio::time::timeout(ACK_LIMIT, node.push(&to, ACK_NAME, &ack)).await;
        // A pusher that got its ack may close before our push sees the Ack frame: harmless.
        if !matches!(pushed, Ok(Ok(()))) {
            tracing::debug!(?pushed, "pushing a benchmark ack");
        }
    }
}

/// The raw iroh baseline: each stream asks for a length, gets that many bytes.
#[derive(Debug, Clone)]
struct RawServer {
    data: Bytes,
}

impl ProtocolHandler for RawServer {
    async fn accept(&self, conn: Connection) -> Result<(), AcceptError> {
        // No hello on the raw protocol: open the data path's limits at once.
        tb_node::open_link(&conn, Config::default().max_concurrent_streams);
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let data = self.data.clone();
            tokio::spawn(async move {
                let mut len = [0u8; 8];
                if recv.read_exact(&mut len).await.is_err() {
                    return;
                }
                let len = usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX);
                let Some(body) = data.get(..len).map(|_| data.slice(..len)) else {
                    return;
                };
                let mut offset = 0;
                while offset < body.len() {
                    let end = (offset + (1 << 20)).min(body.len());
                    if send.write_chunk(body.slice(offset..end)).await.is_err() {
                        return;
                    }
                    offset = end;
                }
                let _ = send.finish();
            });
        }
        Ok(())
    }
}

/// The raw TCP baseline: one stream per client, the same request/response shape as the raw
/// iroh one (u64 LE length, then that many bytes), requests one after another.
pub(crate) async fn serve_tcp(listener: TcpListener, data: Bytes) {
    while let Ok((stream, _)) = listener.accept().await {
        tokio::spawn(answer_tcp(stream, data.clone()));
    }
}

async fn answer_tcp(mut stream: TcpStream, data: Bytes) {
    let _ = stream.set_nodelay(true);
    let mut len = [0u8; 8];
    // Bounded by the client: it ends when the client closes or asks for too much.
    while stream.read_exact(&mut len).await.is_ok() {
        let len = usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX);
        let Some(body) = data.get(..len) else { return };
        if stream.write_all(body).await.is_err() {
            return;
        }
    }
}
