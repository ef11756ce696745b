//! `tb bench p2p`: pull throughput and 4 KiB round trips between two OS processes on
//! 127.0.0.1, for tensor-broker and, in the same run, for a bare iroh connection with the same
//! endpoint settings (the transport's ceiling).
//!
//! Process layout: this process orchestrates; a `serve` child holds the tensors (a tensor-broker
//! node and a raw iroh endpoint); one `recv` child per system measures and reports JSON,
//! including its own peak RSS.
//!
//! With `--device cuda[:N]` the serving node also holds copies of the tensors on that GPU, and
//! a third receiver pulls them over the network straight into device memory (pinned staging
//! on both sides; CUDA IPC is not used), so device throughput is reported next to host
//! throughput.

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::{Args, Subcommand, ValueEnum};
use iroh::{
    Endpoint,
    endpoint::Connection,
    protocol::{AcceptError, ProtocolHandler, Router},
};
use serde::{Deserialize, Serialize};
use tb_node::{Config, Device, DeviceBuffer, Node, PeerAddr, Tensor};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

use crate::fmt;

/// ALPN of the raw baseline: request = u64 LE length, response = that many bytes.
const RAW_ALPN: &[u8] = b"tb-bench/raw/1";
const SIZES: [u64; 4] = [4 << 10, 1 << 20, 64 << 20, 256 << 20];

/// `tb bench ...`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Point-to-point pull throughput and 4 KiB latency, tensor-broker vs bare iroh.
    P2p(P2pArgs),
    /// One new version to many receivers under an upload limit: single receiver vs the
    /// broker's fan-out tree (cut-through) vs everyone pulling from the publisher.
    Broadcast(crate::bench_cluster::BroadcastArgs),
    /// Registry replication: publish-to-visible latency on every broker, and a new broker's
    /// catch-up time.
    Registry(crate::bench_cluster::RegistryArgs),
    /// (internal) serve the benchmark tensors; prints addresses as JSON on stdout.
    #[command(hide = true)]
    P2pServe(ServeArgs),
    /// (internal) measure one system against a serving process; prints JSON on stdout.
    #[command(hide = true)]
    P2pRecv(RecvArgs),
}

/// Options for `tb bench p2p`.
#[derive(Debug, Args)]
pub struct P2pArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Measured pulls per size (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// 4 KiB round trips for the latency quantiles (per round).
    #[arg(long, default_value_t = 1000)]
    round_trips: usize,
    /// Rounds; each runs the raw-iroh receiver then the tensor-broker one, so machine noise
    /// hits both systems alike. Figures are over the samples of all rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Also measure tensors on this device (`cuda` or `cuda:N`), pulled device to device.
    #[arg(long, default_value = "host")]
    device: Device,
}

/// Options of the internal serving process.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Also hold the tensors on this device.
    #[arg(long, default_value = "host")]
    device: Device,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum System {
    TensorBroker,
    TensorBrokerCuda,
    RawIroh,
}

impl System {
    fn label(self) -> &'static str {
        match self {
            System::TensorBroker => "tensor-broker",
            System::TensorBrokerCuda => "tensor-broker-cuda",
            System::RawIroh => "raw-iroh",
        }
    }
}

/// Options of the internal receiver process.
#[derive(Debug, Args)]
pub struct RecvArgs {
    #[arg(long, value_enum)]
    system: System,
    #[arg(long)]
    tb: String,
    #[arg(long)]
    raw: String,
    #[arg(long)]
    iters: usize,
    #[arg(long)]
    round_trips: usize,
    /// The GPU of the tensor-broker-cuda receiver.
    #[arg(long, default_value_t = 0)]
    ordinal: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct ServeInfo {
    tb: String,
    raw: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Case {
    system: String,
    size_bytes: u64,
    throughput_mb_s: f64,
    first_transfer_ms: f64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Rtt {
    p50_us: f64,
    p99_us: f64,
}

/// One receiver process's raw samples.
#[derive(Debug, Serialize, Deserialize)]
struct RecvReport {
    sizes: Vec<SizeSamples>,
    rtt_us: Vec<f64>,
    peak_rss_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct SizeSamples {
    size_bytes: u64,
    first_transfer_ms: f64,
    rates_mb_s: Vec<f64>,
}

/// One system's figures over all rounds.
struct Summary {
    cases: Vec<Case>,
    rtt_4k: Rtt,
    peak_rss_bytes: u64,
}

fn summarize(system: System, reports: &[RecvReport]) -> Summary {
    let cases = SIZES
        .iter()
        .map(|&size| {
            let samples = reports
                .iter()
                .flat_map(|r| r.sizes.iter().filter(move |s| s.size_bytes == size));
            let (mut rates, mut firsts): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
            for s in samples {
                rates.extend(&s.rates_mb_s);
                firsts.push(s.first_transfer_ms);
            }
            Case {
                system: system.label().to_string(),
                size_bytes: size,
                throughput_mb_s: fmt::median(&mut rates),
                first_transfer_ms: fmt::median(&mut firsts),
            }
        })
        .collect();
    let mut rtt: Vec<f64> = reports
        .iter()
        .flat_map(|r| r.rtt_us.iter().copied())
        .collect();
    Summary {
        cases,
        rtt_4k: Rtt {
            p50_us: fmt::median(&mut rtt),
            p99_us: fmt::percentile(&mut rtt, 0.99),
        },
        peak_rss_bytes: reports.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0),
    }
}

/// Runs a bench subcommand.
pub async fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::P2p(args) => p2p(args).await,
        BenchCommand::Broadcast(args) => crate::bench_cluster::broadcast(args).await,
        BenchCommand::Registry(args) => crate::bench_cluster::registry(args).await,
        BenchCommand::P2pServe(args) => serve(args.device).await,
        BenchCommand::P2pRecv(args) => {
            let report = receive(&args).await?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
    }
}

fn tensor_name(size: u64) -> String {
    format!("bench/{size}")
}

/// The name of the copy held on the GPU.
fn device_tensor_name(size: u64) -> String {
    format!("bench-cuda/{size}")
}

fn payload(size: u64) -> Result<Bytes> {
    let len = usize::try_from(size)?;
    Ok(Bytes::from(
        (0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>(),
    ))
}

async fn p2p(args: P2pArgs) -> Result<()> {
    let mut systems = vec![System::RawIroh, System::TensorBroker];
    if let Device::Cuda(ordinal) = args.device {
        let info =
            tb_node::device::probe(ordinal).with_context(|| format!("--device {}", args.device))?;
        if !args.json {
            eprintln!(
                "device tensors on cuda:{ordinal}: {} ({})",
                info.name,
                fmt::bytes(info.total_bytes)
            );
        }
        systems.push(System::TensorBrokerCuda);
    }
    let exe = std::env::current_exe().context("locating the tb binary")?;
    let mut server = tokio::process::Command::new(&exe)
        .args(["bench", "p2p-serve", "--device", &args.device.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the serving process")?;
    let stdout = server.stdout.take().context("server stdout")?;
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    let read = reader.read_line(&mut line);
    tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .context("the serving process did not start within 120 s")??;
    let info: ServeInfo = serde_json::from_str(line.trim()).context("serving process output")?;

    let (mut raw_reports, mut tb_reports, mut cuda_reports) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=args.rounds.max(1) {
        for &system in &systems {
            if !args.json {
                eprintln!(
                    "round {round}/{}: measuring {} ...",
                    args.rounds,
                    system.label()
                );
            }
            let report = run_receiver(&exe, system, &info, &args).await?;
            match system {
                System::RawIroh => raw_reports.push(report),
                System::TensorBroker => tb_reports.push(report),
                System::TensorBrokerCuda => cuda_reports.push(report),
            }
        }
    }
    drop(server.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(10), server.wait()).await;
    let _ = server.kill().await;

    let tb = summarize(System::TensorBroker, &tb_reports);
    let raw = summarize(System::RawIroh, &raw_reports);
    let cuda =
        (!cuda_reports.is_empty()).then(|| summarize(System::TensorBrokerCuda, &cuda_reports));
    let mut cases: Vec<&Case> = tb.cases.iter().chain(raw.cases.iter()).collect();
    let mut rtt = serde_json::json!({ "tensor-broker": tb.rtt_4k, "raw-iroh": raw.rtt_4k });
    if let Some(cuda) = &cuda {
        cases.extend(cuda.cases.iter());
        rtt["tensor-broker-cuda"] = serde_json::json!(cuda.rtt_4k);
    }
    let json = serde_json::json!({
        "bench": "p2p",
        "device": args.device.to_string(),
        "cases": cases,
        "rtt_4k": rtt,
        "receiver_peak_rss_bytes": tb.peak_rss_bytes,
    });
    if args.json {
        println!("{json}");
    } else {
        print_table(&tb, &raw);
        if let Some(cuda) = &cuda {
            print_device_table(&tb, cuda, args.device);
        }
    }
    Ok(())
}

async fn run_receiver(
    exe: &std::path::Path,
    system: System,
    info: &ServeInfo,
    args: &P2pArgs,
) -> Result<RecvReport> {
    let out = tokio::process::Command::new(exe)
        .args(["bench", "p2p-recv", "--system", system.label()])
        .args(["--tb", &info.tb, "--raw", &info.raw])
        .args(["--iters", &args.iters.to_string()])
        .args(["--round-trips", &args.round_trips.to_string()])
        .args([
            "--ordinal",
            &args.device.cuda_ordinal().unwrap_or(0).to_string(),
        ])
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(900), out)
        .await
        .context("a receiver process ran over 15 minutes")??;
    if !out.status.success() {
        bail!("the {} receiver failed ({})", system.label(), out.status);
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{} receiver output", system.label()))
}

fn print_table(tb: &Summary, raw: &Summary) {
    println!(
        "{:>9} {:>18} {:>14} {:>7} {:>16} {:>14}",
        "size", "tensor-broker MB/s", "raw-iroh MB/s", "ratio", "tb first ms", "raw first ms"
    );
    for (t, r) in tb.cases.iter().zip(&raw.cases) {
        println!(
            "{:>9} {:>18.0} {:>14.0} {:>7.2} {:>16.2} {:>14.2}",
            fmt::bytes(t.size_bytes),
            t.throughput_mb_s,
            r.throughput_mb_s,
            t.throughput_mb_s / r.throughput_mb_s.max(f64::MIN_POSITIVE),
            t.first_transfer_ms,
            r.first_transfer_ms
        );
    }
    println!(
        "4 KiB round trip: tensor-broker p50 {:.0} us p99 {:.0} us; raw-iroh p50 {:.0} us p99 {:.0} us",
        tb.rtt_4k.p50_us, tb.rtt_4k.p99_us, raw.rtt_4k.p50_us, raw.rtt_4k.p99_us
    );
    println!(
        "tensor-broker receiver peak RSS: {}",
        fmt::bytes(tb.peak_rss_bytes)
    );
}

fn print_device_table(host: &Summary, cuda: &Summary, device: Device) {
    println!();
    println!(
        "{:>9} {:>18} {:>18} {:>10}",
        "size",
        "host MB/s",
        format!("{device} MB/s"),
        "dev/host"
    );
    for (h, d) in host.cases.iter().zip(&cuda.cases) {
        println!(
            "{:>9} {:>18.0} {:>18.0} {:>10.2}",
            fmt::bytes(h.size_bytes),
            h.throughput_mb_s,
            d.throughput_mb_s,
            d.throughput_mb_s / h.throughput_mb_s.max(f64::MIN_POSITIVE)
        );
    }
    println!(
        "4 KiB round trip to {device}: p50 {:.0} us p99 {:.0} us",
        cuda.rtt_4k.p50_us, cuda.rtt_4k.p99_us
    );
}

// ---- serving process ----

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

async fn serve(device: Device) -> Result<()> {
    let largest = SIZES[SIZES.len() - 1];
    let data = payload(largest)?;
    let node = Node::spawn(Config::default()).await?;
    for size in SIZES {
        let tensor = Tensor::from_bytes(data.slice(..usize::try_from(size)?));
        if device != Device::Host {
            let on_device = tensor.to_device(device)?;
            node.publish_local(&device_tensor_name(size), on_device)?;
        }
        node.publish_local(&tensor_name(size), tensor)?;
    }
    let config = Config::default();
    let raw_ep = tb_node::bind_endpoint(&config, iroh::SecretKey::generate()).await?;
    let raw_addr = tb_node::PeerAddr {
        id: raw_ep.id(),
        addr: raw_ep
            .bound_sockets()
            .first()
            .copied()
            .context("raw endpoint socket")?,
    };
    let router = Router::builder(raw_ep)
        .accept(RAW_ALPN, RawServer { data })
        .spawn();
    let info = ServeInfo {
        tb: node.addr().to_string(),
        raw: raw_addr.to_string(),
    };
    println!("{}", serde_json::to_string(&info)?);
    // Serve until the orchestrator closes our stdin (or goes away).
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    node.shutdown().await;
    let _ = router.shutdown().await;
    Ok(())
}

// ---- receiving process ----

/// One system's client: a fresh endpoint, pulling sizes into a reused buffer.
enum Client {
    Tb {
        node: Node,
        from: PeerAddr,
    },
    /// Pulls the GPU copies into a reused device buffer.
    TbCuda {
        node: Node,
        from: PeerAddr,
        ordinal: usize,
        buf: Option<DeviceBuffer>,
    },
    Raw {
        ep: Endpoint,
        to: PeerAddr,
        conn: Option<Connection>,
    },
}

impl Client {
    async fn new(args: &RecvArgs) -> Result<Client> {
        Ok(match args.system {
            System::TensorBroker => Client::Tb {
                node: Node::spawn(Config::default()).await?,
                from: args.tb.parse()?,
            },
            System::TensorBrokerCuda => {
                let mut config = Config::default();
                config.cuda.ipc = false;
                Client::TbCuda {
                    node: Node::spawn(config).await?,
                    from: args.tb.parse()?,
                    ordinal: args.ordinal,
                    buf: None,
                }
            }
            System::RawIroh => Client::Raw {
                ep: tb_node::bind_endpoint(&Config::default(), iroh::SecretKey::generate()).await?,
                to: args.raw.parse()?,
                conn: None,
            },
        })
    }

    async fn fetch(&mut self, size: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Client::Tb { node, from } => {
                let pulled = node
                    .pull_into(from, &tensor_name(size), None, |_| Ok(&mut *buf))
                    .await?;
                if pulled.meta.byte_len != size {
                    bail!("got {} bytes, wanted {size}", pulled.meta.byte_len);
                }
            }
            Client::TbCuda {
                node,
                from,
                ordinal,
                buf,
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
        }
        Ok(())
    }

    /// Copies what the last fetch received into `dest`, where it is not there already.
    fn copy_out(&self, dest: &mut [u8]) -> Result<()> {
        if let Client::TbCuda { buf: Some(buf), .. } = self {
            dest.copy_from_slice(&buf.to_host()?);
        }
        Ok(())
    }

    async fn close(self) {
        match self {
            Client::Tb { node, .. } | Client::TbCuda { node, .. } => node.shutdown().await,
            Client::Raw { ep, .. } => ep.close().await,
        }
    }
}

async fn receive(args: &RecvArgs) -> Result<RecvReport> {
    let mut sizes = Vec::new();
    let mut buf = vec![0u8; usize::try_from(SIZES[SIZES.len() - 1])?];
    for size in SIZES {
        let len = usize::try_from(size)?;
        let dest = &mut buf[..len];
        // First transfer on a fresh endpoint: includes the connect and handshake.
        let mut client = Client::new(args).await?;
        let t = Instant::now();
        client.fetch(size, dest).await?;
        let first_transfer_ms = t.elapsed().as_secs_f64() * 1e3;
        client.copy_out(dest)?;
        check(dest)?;
        client.fetch(size, dest).await?; // warm-up
        let mut rates = Vec::with_capacity(args.iters);
        for _ in 0..args.iters.max(1) {
            let t = Instant::now();
            client.fetch(size, dest).await?;
            rates.push(fmt::mb_per_s(size, t.elapsed().as_secs_f64()));
        }
        client.copy_out(dest)?;
        check(dest)?;
        client.close().await;
        sizes.push(SizeSamples {
            size_bytes: size,
            first_transfer_ms,
            rates_mb_s: rates,
        });
    }
    let rtt_us = round_trips(args, &mut buf[..4096]).await?;
    Ok(RecvReport {
        sizes,
        rtt_us,
        peak_rss_bytes: peak_rss_bytes(),
    })
}

fn check(buf: &[u8]) -> Result<()> {
    if let Some(i) = buf
        .iter()
        .enumerate()
        .position(|(i, b)| *b != (i % 251) as u8)
    {
        bail!("byte {i} is wrong");
    }
    Ok(())
}

async fn round_trips(args: &RecvArgs, buf: &mut [u8]) -> Result<Vec<f64>> {
    let mut client = Client::new(args).await?;
    for _ in 0..50 {
        client.fetch(4096, buf).await?;
    }
    let mut micros = Vec::with_capacity(args.round_trips);
    for _ in 0..args.round_trips.max(1) {
        let t = Instant::now();
        client.fetch(4096, buf).await?;
        micros.push(t.elapsed().as_secs_f64() * 1e6);
    }
    client.close().await;
    Ok(micros)
}

/// This process's peak resident set (VmHWM), 0 where /proc is not available.
fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
