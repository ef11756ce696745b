//! The receiving process of `tb bench p2p`: measures one system's op against the serving
//! process and prints a [`RecvReport`] as JSON, with its own peak RSS.
//!
//! How a push is timed: the pusher reads the wall clock, pushes, and waits for the serving
//! node's ack, which carries the wall-clock instant that node's `recv()` returned the tensor
//! (both processes read the same host clock). The figure is that difference; the ack's own
//! trip is not in it. Should the clock step in between (a difference outside
//! `0..=round trip`), the whole round trip up to the ack is used instead, an upper bound.
//! A 4 KiB push round trip (`rtt_4k_push`) is the time `Node::push` takes to return, which is
//! after the receiver's Ack.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use iroh::{Endpoint, endpoint::Connection};
use tb_node::{Config, Device, DeviceBuffer, Node, PeerAddr, Tensor};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use crate::{
    bench::{
        LARGEST, Op, RAW_ALPN, RecvReport, SizeSamples, System, check, device_tensor_name, payload,
    },
    bench_serve::{ACK_NAME, PUSH_PREFIX, wall_ns},
    fmt,
};

/// How long the ack of one push may take to arrive.
const ACK_LIMIT: Duration = Duration::from_secs(120);
/// Round trips before the measured ones.
const RTT_WARM_UP: usize = 50;

/// Options of the internal receiver process.
#[derive(Debug, Args)]
pub struct RecvArgs {
    #[arg(long, value_enum)]
    system: System,
    #[arg(long, value_enum)]
    op: Op,
    /// The serving side: `<id>@<ip:port>` (iroh), `ip:port` (raw TCP), empty for memcpy.
    #[arg(long, default_value = "")]
    from: String,
    #[arg(long)]
    iters: usize,
    #[arg(long)]
    round_trips: usize,
    /// The GPU of the tensor-broker-cuda receiver.
    #[arg(long, default_value_t = 0)]
    ordinal: usize,
    /// Skip sizes above this.
    #[arg(long, default_value_t = LARGEST)]
    max_size: u64,
}

/// One system's client on a fresh endpoint.
enum Client {
    Tb {
        node: Node,
        from: PeerAddr,
    },
    /// Pulls the GPU copies into a reused device buffer over the network, or (`routed`) into
    /// fresh device memory by the route a user's `pull_to` takes (CUDA IPC on one host).
    TbCuda {
        node: Node,
        from: PeerAddr,
        ordinal: usize,
        buf: Option<DeviceBuffer>,
        routed: bool,
    },
    Raw {
        ep: Endpoint,
        to: PeerAddr,
        conn: Option<Connection>,
    },
    Tcp {
        to: SocketAddr,
        stream: Option<TcpStream>,
    },
    Memcpy {
        data: Bytes,
    },
}

impl Client {
    async fn new(args: &RecvArgs) -> Result<Client> {
        Ok(match args.system {
            System::RawIroh => Client::Raw {
                ep: tb_node::bind_endpoint(&Config::default(), iroh::SecretKey::generate()).await?,
                to: args.from.parse()?,
                conn: None,
            },
            System::RawTcp => Client::Tcp {
                to: args.from.parse()?,
                stream: None,
            },
            System::Memcpy => Client::Memcpy {
                data: payload(LARGEST.min(args.max_size))?,
            },
            System::TensorBrokerCuda | System::TensorBrokerCudaIpc => Client::TbCuda {
                node: Node::spawn(args.system.config().context("config")?).await?,
                from: args.from.parse()?,
                ordinal: args.ordinal,
                buf: None,
                routed: args.system == System::TensorBrokerCudaIpc,
            },
            system => Client::Tb {
                node: Node::spawn(system.config().context("config")?).await?,
                from: args.from.parse()?,
            },
        })
    }

    /// Receives `size` bytes into `buf` (a reused buffer).
    async fn pull_into(&mut self, size: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Client::Tb { node, from } => {
                let name = crate::bench::tensor_name(size);
                let pulled = node.pull_into(from, &name, None, |_| Ok(&mut *buf)).await?;
                if pulled.meta.byte_len != size {
                    bail!("got {} bytes, wanted {size}", pulled.meta.byte_len);
                }
            }
            Client::TbCuda {
                node,
                from,
                ordinal,
                buf,
                routed: true,
            } => {
                let device = Device::Cuda(*ordinal);
                let pulled = node
                    .pull_to(from, &device_tensor_name(size), None, device)
                    .await?;
                *buf = pulled.buffer.device_buffer().cloned();
            }
            Client::TbCuda {
                node,
                from,
                ordinal,
                buf,
                routed: false,
            } => {
                let len = usize::try_from(size)?;
                let dest = match buf.take() {
                    Some(b) if b.len() == len => b,
                    _ => DeviceBuffer::alloc(*ordinal, len)?,
                };
                let pulled = node
                    .pull_into_device(from, &device_tensor_name(size), None, |_| Ok(dest))
                    .await?;
                *buf = Some(pulled.buffer);
            }
            Client::Raw { .. } | Client::Tcp { .. } => self.raw_request(size, buf).await?,
            Client::Memcpy { .. } => bail!("memcpy has no pull_into"),
        }
        Ok(())
    }

    /// Copies what the last pull received into `dest`, where it is not there already (a
    /// device buffer), outside the timed part.
    fn copy_out(&self, dest: &mut [u8]) -> Result<()> {
        if let Client::TbCuda { buf: Some(buf), .. } = self {
            dest.copy_from_slice(&buf.to_host()?);
        }
        Ok(())
    }

    /// Receives `size` bytes into memory of its own, until they are usable.
    async fn get(&mut self, size: u64) -> Result<Bytes> {
        let len = usize::try_from(size)?;
        Ok(match self {
            Client::Tb { node, from } => {
                let pulled = node
                    .pull(from, &crate::bench::tensor_name(size), None)
                    .await?;
                pulled.buffer.data().clone()
            }
            Client::Memcpy { data } => Bytes::from(data[..len].to_vec()),
            Client::Raw { .. } | Client::Tcp { .. } => {
                let mut buf = vec![0u8; len];
                self.raw_request(size, &mut buf).await?;
                Bytes::from(buf)
            }
            Client::TbCuda { .. } => bail!("tensor-broker-cuda measures pull_into only"),
        })
    }

    /// One request of a baseline: the length out, that many bytes back.
    async fn raw_request(&mut self, size: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Client::Raw { ep, to, conn } => {
                if conn.is_none() {
                    let dialed = ep.connect(to.to_endpoint_addr(), RAW_ALPN).await?;
                    tb_node::open_link(&dialed, 0);
                    *conn = Some(dialed);
                }
                let conn = conn.as_ref().context("connection")?;
                let (mut send, mut recv) = conn.open_bi().await?;
                send.write_all(&size.to_le_bytes()).await?;
                send.finish()?;
                recv.read_exact(buf).await?;
            }
            Client::Tcp { to, stream } => {
                if stream.is_none() {
                    let s = TcpStream::connect(*to).await?;
                    s.set_nodelay(true)?;
                    *stream = Some(s);
                }
                let s = stream.as_mut().context("stream")?;
                s.write_all(&size.to_le_bytes()).await?;
                s.read_exact(buf).await?;
            }
            _ => bail!("not a baseline"),
        }
        Ok(())
    }

    /// Pushes `tensor` and returns the seconds until the serving node's `recv()` returned it.
    async fn push(&mut self, tensor: &Tensor) -> Result<f64> {
        let Client::Tb { node, from } = self else {
            bail!("only tensor-broker pushes");
        };
        let port = node.addr().addr.port();
        let name = format!("{PUSH_PREFIX}{port}/{}", tensor.byte_len());
        let (started, start_ns) = (Instant::now(), wall_ns());
        node.push(from, &name, tensor).await?;
        let ack = node.wait_for(ACK_NAME, ACK_LIMIT).await?;
        let round = started.elapsed().as_secs_f64();
        let at = ack.tensor.data().get(..8).context("ack payload")?;
        let at = u64::from_le_bytes(at.try_into()?);
        let one_way = at.saturating_sub(start_ns) as f64 / 1e9;
        Ok(if one_way > 0.0 && one_way <= round {
            one_way
        } else {
            round
        })
    }

    /// The channel the node picks for the serving peer now (tensor-broker only).
    fn channel(&self) -> Option<String> {
        match self {
            Client::Tb { node, from } | Client::TbCuda { node, from, .. } => {
                Some(node.channel_to(&from.id).to_string())
            }
            _ => None,
        }
    }

    async fn close(self) {
        match self {
            Client::Tb { node, .. } | Client::TbCuda { node, .. } => node.shutdown().await,
            Client::Raw { ep, .. } => ep.close().await,
            Client::Tcp { .. } | Client::Memcpy { .. } => {}
        }
    }
}

/// Measures `args.op` of `args.system`.
pub(crate) async fn receive(args: &RecvArgs) -> Result<RecvReport> {
    let mut report = RecvReport::default();
    match args.op {
        Op::PullInto => pull_into(args, &mut report).await?,
        Op::Get => get(args, &mut report).await?,
        Op::Push => push(args, &mut report).await?,
        Op::Rtt => round_trips(args, &mut report).await?,
    }
    report.peak_rss_bytes = peak_rss_bytes();
    Ok(report)
}

/// Samples of one size: the first transfer (on a fresh endpoint, so it includes the connect
/// and handshake), one warm-up, then `iters` measured ones.
async fn sizes<F>(args: &RecvArgs, op: Op, report: &mut RecvReport, mut once: F) -> Result<()>
where
    F: AsyncFnMut(&mut Client, u64) -> Result<f64>,
{
    for size in op.sizes(args.max_size) {
        let mut client = Client::new(args).await?;
        let first_transfer_ms = once(&mut client, size).await? * 1e3;
        // The first transfer warmed the link; one more warm-up where it is cheap.
        if size < LARGEST {
            once(&mut client, size).await?;
        }
        let mut rates = Vec::with_capacity(args.iters);
        for _ in 0..args.iters.max(1) {
            rates.push(fmt::mb_per_s(size, once(&mut client, size).await?));
        }
        report.channel = client.channel().or(report.channel.take());
        client.close().await;
        report.sizes.push(SizeSamples {
            size_bytes: size,
            first_transfer_ms,
            rates_mb_s: rates,
        });
    }
    Ok(())
}

async fn pull_into(args: &RecvArgs, report: &mut RecvReport) -> Result<()> {
    let mut buf = vec![0u8; usize::try_from(LARGEST.min(args.max_size))?];
    sizes(args, Op::PullInto, report, async |client, size| {
        let dest = &mut buf[..usize::try_from(size)?];
        let t = Instant::now();
        client.pull_into(size, dest).await?;
        let secs = t.elapsed().as_secs_f64();
        client.copy_out(dest)?;
        check(dest)?;
        Ok(secs)
    })
    .await
}

async fn get(args: &RecvArgs, report: &mut RecvReport) -> Result<()> {
    sizes(args, Op::Get, report, async |client, size| {
        let t = Instant::now();
        let got = client.get(size).await?;
        let secs = t.elapsed().as_secs_f64();
        if got.len() as u64 != size {
            bail!("got {} bytes, wanted {size}", got.len());
        }
        check(&got)?;
        Ok(secs)
    })
    .await
}

async fn push(args: &RecvArgs, report: &mut RecvReport) -> Result<()> {
    let data = payload(LARGEST.min(args.max_size))?;
    let mut tensors = Vec::new();
    for size in Op::Push.sizes(args.max_size) {
        tensors.push((
            size,
            Tensor::from_bytes(data.slice(..usize::try_from(size)?)),
        ));
    }
    sizes(args, Op::Push, report, async |client, size| {
        let tensor = tensors
            .iter()
            .find(|(s, _)| *s == size)
            .map(|(_, t)| t)
            .context("no tensor of that size")?;
        client.push(tensor).await
    })
    .await
}

/// 4 KiB round trips on one warm client: pulls, then pushes (tensor-broker only).
async fn round_trips(args: &RecvArgs, report: &mut RecvReport) -> Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut client = Client::new(args).await?;
    for _ in 0..RTT_WARM_UP {
        client.pull_into(4096, &mut buf).await?;
    }
    for _ in 0..args.round_trips.max(1) {
        let t = Instant::now();
        client.pull_into(4096, &mut buf).await?;
        report.rtt_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    if let Client::Tb { node, from } = &client {
        let tensor = Tensor::from_bytes(payload(4096)?);
        for i in 0..RTT_WARM_UP + args.round_trips.max(1) {
            let t = Instant::now();
            node.push(from, "bench-rtt/4096", &tensor).await?;
            if i >= RTT_WARM_UP {
                report.rtt_push_us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    report.channel = client.channel();
    client.close().await;
    Ok(())
}

/// This process's peak resident set (VmHWM), 0 where /proc is not available.
pub(crate) fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
