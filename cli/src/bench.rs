//! `tb bench p2p`: throughput and 4 KiB round trips between two OS processes on 127.0.0.1,
//! for every tensor-broker channel set-up and, in the same run, for the baselines: a bare iroh
//! connection with the same endpoint settings (the transport's ceiling), one plain TCP stream,
//! and a memcpy into fresh pages.
//!
//! Process layout: this process orchestrates; a `serve` child (`bench_serve.rs`) holds the
//! tensors — one tensor-broker node per system, each with that system's `Config`, a raw iroh
//! endpoint and a raw TCP listener — and receives the pushes; one `recv` child
//! (`bench_recv.rs`) per system, op and round measures and reports JSON, including its own
//! peak RSS, so one op's memory never inflates another's figure.
//!
//! Ops: `pull_into` (into one reused, pre-touched buffer), `get` (into the receiver's own fresh
//! memory, until the tensor is usable) and `push` (until the serving node's `recv()` returns
//! it; see `bench_recv.rs` for how that instant is read across the two processes).
//!
//! With `--device cuda[:N]` the serving node also holds copies of the tensors on that GPU, and
//! two further receivers pull them into device memory: `tensor-broker-cuda` over the network
//! (CUDA IPC off: pinned staging on both sides), whose throughput is reported next to host
//! throughput, and `tensor-broker-cuda-ipc` as users get it on one host (device to device by
//! CUDA IPC from 1 MiB, the IPC minimum).

use std::{collections::BTreeMap, process::Stdio, time::Duration};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::{Args, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use tb_node::{Config, Device};
use tb_proto::ChannelKind;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::fmt;

/// ALPN of the raw iroh baseline: request = u64 LE length, response = that many bytes.
pub(crate) const RAW_ALPN: &[u8] = b"tb-bench/raw/1";
/// Sizes of `pull_into` (4 KiB and 64 MiB are cheap and kept from earlier runs).
pub(crate) const PULL_INTO_SIZES: [u64; 4] = [4 << 10, 1 << 20, 64 << 20, 256 << 20];
/// Sizes of `get` and `push`.
pub(crate) const OP_SIZES: [u64; 2] = [1 << 20, 256 << 20];
/// The largest size any op moves.
pub(crate) const LARGEST: u64 = 256 << 20;
/// How long one receiver process may run.
const RECEIVER_LIMIT: Duration = Duration::from_secs(900);

/// `tb bench ...`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Point-to-point pull, get and push throughput and 4 KiB latency: tensor-broker on each
    /// channel vs bare iroh, one TCP stream and memcpy.
    P2p(P2pArgs),
    /// One new version to many receivers under an upload limit: single receiver vs the
    /// broker's fan-out tree (cut-through) vs everyone pulling from the publisher.
    Broadcast(crate::bench_cluster::BroadcastArgs),
    /// Registry replication: publish-to-visible latency on every broker, and a new broker's
    /// catch-up time.
    Registry(crate::bench_cluster::RegistryArgs),
    /// Same-host gets of tensors just made in fresh memory, one after another, against one
    /// raw TCP stream into fresh memory (`--count 20 --size 256MiB --runs 10`).
    Gets(crate::bench_gets::GetsArgs),
    /// (internal) make and hold the tensors of `tb bench gets`; prints JSON on stdout.
    #[command(hide = true)]
    GetsHold(crate::bench_gets::GetsHoldArgs),
    /// Remote calls (tb-call): calls/s and p50/p99 latency of `echo` and `add_one` by
    /// argument size and calls in flight, against 1 and 4 server processes.
    Call(crate::bench_call::CallBenchArgs),
    /// (internal) serve `echo` and `add_one` for `tb bench call`; prints a ready line.
    #[command(hide = true)]
    CallServe(crate::bench_call::CallServeArgs),
    /// (internal) serve the benchmark tensors; prints addresses as JSON on stdout.
    #[command(hide = true)]
    P2pServe(crate::bench_serve::ServeArgs),
    /// (internal) measure one system's op against a serving process; prints JSON on stdout.
    #[command(hide = true)]
    P2pRecv(crate::bench_recv::RecvArgs),
    /// (internal) the Rust sender of `python -m tensor_broker bench`: obeys commands on
    /// stdin, answers in JSON lines.
    #[command(hide = true)]
    ClientSend(crate::bench_client::ClientBenchArgs),
    /// (internal) the Rust receiver of `python -m tensor_broker bench`: reports each tensor
    /// in a JSON line, answers pings.
    #[command(hide = true)]
    ClientRecv(crate::bench_client::ClientBenchArgs),
}

/// Options for `tb bench p2p`.
#[derive(Debug, Args)]
pub struct P2pArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Measured transfers per op and size (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// 4 KiB round trips for the latency quantiles (per round, pulls and pushes each).
    #[arg(long, default_value_t = 1000)]
    round_trips: usize,
    /// Rounds; each runs every system in turn, so machine noise hits them alike. Figures are
    /// over the samples of all rounds.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// The channels whose tensor-broker systems are measured (`shm,quic,tcp`: all); the
    /// auto-negotiated `tensor-broker` and the baselines always run.
    #[arg(long, default_value = "shm,quic,tcp", value_parser = parse_channels)]
    channels: ChannelList,
    /// Also measure tensors on this device (`cuda` or `cuda:N`), pulled device to device.
    #[arg(long, default_value = "host")]
    device: Device,
    /// Skip sizes above this (a quick run: `--max-size 1MiB`).
    #[arg(long, default_value = "256MiB", value_parser = tb_node::rate::parse_size)]
    max_size: u64,
}

/// The kinds `--channels` names (a newtype: clap would read a bare `Vec` as many values).
#[derive(Debug, Clone)]
struct ChannelList(Vec<ChannelKind>);

fn parse_channels(list: &str) -> Result<ChannelList, String> {
    // `parse_list` adds quic as every list's fallback; here only the named ones count.
    let named: Vec<&str> = list.split(',').map(str::trim).collect();
    let kinds = ChannelKind::parse_list(list).map_err(|e| e.to_string())?;
    Ok(ChannelList(
        kinds
            .into_iter()
            .filter(|k| named.contains(&k.as_str()))
            .collect(),
    ))
}

/// What is measured: a tensor-broker set-up or a baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum System {
    /// Default `Config`: channels negotiated as users get them.
    TensorBroker,
    /// QUIC only, one stream per transfer.
    TensorBrokerQuic,
    /// QUIC only, striped by the automatic rule.
    TensorBrokerQuicStriped,
    /// The TCP bulk channel first.
    TensorBrokerTcp,
    /// Same-host shared memory first.
    TensorBrokerShm,
    /// Device tensors pulled into device memory over the network (`--device`).
    TensorBrokerCuda,
    /// Device tensors pulled into device memory by the default route (CUDA IPC on one host).
    TensorBrokerCudaIpc,
    /// A bare iroh connection, no hashing.
    RawIroh,
    /// One plain TCP stream.
    RawTcp,
    /// A copy into freshly allocated pages, in one process.
    Memcpy,
}

/// One measured operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Op {
    /// Into one reused, pre-touched buffer.
    #[value(name = "pull_into")]
    PullInto,
    /// Into the receiver's own fresh memory, until the tensor is usable.
    Get,
    /// Pushed until the serving node's `recv()` returns it.
    Push,
    /// 4 KiB round trips: pulls (every system but memcpy), then pushes (tensor-broker).
    Rtt,
}

impl Op {
    /// The label in JSON and the table.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Op::PullInto => "pull_into",
            Op::Get => "get",
            Op::Push => "push",
            Op::Rtt => "rtt",
        }
    }

    /// The sizes this op moves, up to `max`.
    pub(crate) fn sizes(self, max: u64) -> Vec<u64> {
        let all: &[u64] = match self {
            Op::PullInto => &PULL_INTO_SIZES,
            Op::Get | Op::Push => &OP_SIZES,
            Op::Rtt => &[],
        };
        all.iter().copied().filter(|&s| s <= max).collect()
    }
}

impl System {
    /// The tensor-broker systems, in table order.
    pub(crate) const BROKERS: [System; 5] = [
        System::TensorBroker,
        System::TensorBrokerQuic,
        System::TensorBrokerQuicStriped,
        System::TensorBrokerTcp,
        System::TensorBrokerShm,
    ];

    /// The name in JSON and the table.
    pub(crate) fn label(self) -> &'static str {
        match self {
            System::TensorBroker => "tensor-broker",
            System::TensorBrokerQuic => "tensor-broker-quic",
            System::TensorBrokerQuicStriped => "tensor-broker-quic-striped",
            System::TensorBrokerTcp => "tensor-broker-tcp",
            System::TensorBrokerShm => "tensor-broker-shm",
            System::TensorBrokerCuda => "tensor-broker-cuda",
            System::TensorBrokerCudaIpc => "tensor-broker-cuda-ipc",
            System::RawIroh => "raw-iroh",
            System::RawTcp => "raw-tcp",
            System::Memcpy => "memcpy",
        }
    }

    /// The node configuration of a tensor-broker system (both the serving node's and the
    /// receiver's), `None` for baselines.
    pub(crate) fn config(self) -> Option<Config> {
        let mut config = Config::default();
        match self {
            System::TensorBroker | System::TensorBrokerCudaIpc => {}
            System::TensorBrokerQuic => {
                config.channels = vec![ChannelKind::Quic];
                config.quic_stripes = 1;
            }
            System::TensorBrokerQuicStriped => {
                config.channels = vec![ChannelKind::Quic];
                config.quic_stripes = 0;
            }
            System::TensorBrokerTcp => config.channels = vec![ChannelKind::Tcp, ChannelKind::Quic],
            System::TensorBrokerShm => config.channels = vec![ChannelKind::Shm, ChannelKind::Quic],
            System::TensorBrokerCuda => config.cuda.ipc = false,
            System::RawIroh | System::RawTcp | System::Memcpy => return None,
        }
        Some(config)
    }

    /// The channel whose `--channels` entry selects this system (`None`: always measured).
    fn channel(self) -> Option<ChannelKind> {
        match self {
            System::TensorBrokerQuic | System::TensorBrokerQuicStriped => Some(ChannelKind::Quic),
            System::TensorBrokerTcp => Some(ChannelKind::Tcp),
            System::TensorBrokerShm => Some(ChannelKind::Shm),
            _ => None,
        }
    }

    /// The ops that make sense for this system.
    pub(crate) fn ops(self) -> &'static [Op] {
        match self {
            System::RawIroh | System::RawTcp => &[Op::PullInto, Op::Get, Op::Rtt],
            System::Memcpy => &[Op::Get],
            System::TensorBrokerCuda | System::TensorBrokerCudaIpc => &[Op::PullInto, Op::Rtt],
            _ => &[Op::PullInto, Op::Get, Op::Push, Op::Rtt],
        }
    }
}

/// What the serving process prints: where each system is served.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ServeInfo {
    /// Each tensor-broker system's serving node (`<id>@<ip:port>`), by label.
    pub(crate) tb: BTreeMap<String, String>,
    /// The raw iroh endpoint.
    pub(crate) raw: String,
    /// The raw TCP listener (`ip:port`).
    pub(crate) tcp: String,
}

impl ServeInfo {
    fn addr_of(&self, system: System) -> Result<String> {
        Ok(match system {
            System::RawIroh => self.raw.clone(),
            System::RawTcp => self.tcp.clone(),
            System::Memcpy => String::new(),
            System::TensorBrokerCuda | System::TensorBrokerCudaIpc => {
                self.addr_of(System::TensorBroker)?
            }
            s => self
                .tb
                .get(s.label())
                .cloned()
                .with_context(|| format!("no serving node for {}", s.label()))?,
        })
    }
}

/// One receiver process's raw samples.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct RecvReport {
    pub(crate) sizes: Vec<SizeSamples>,
    pub(crate) rtt_us: Vec<f64>,
    pub(crate) rtt_push_us: Vec<f64>,
    pub(crate) peak_rss_bytes: u64,
    /// The channel the node picked for the serving peer after its transfers (tensor-broker).
    pub(crate) channel: Option<String>,
}

/// One size's samples of one op.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct SizeSamples {
    pub(crate) size_bytes: u64,
    pub(crate) first_transfer_ms: f64,
    pub(crate) rates_mb_s: Vec<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Case {
    system: String,
    op: &'static str,
    size_bytes: u64,
    throughput_mb_s: f64,
    first_transfer_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    channel: Option<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Rtt {
    p50_us: f64,
    p99_us: f64,
}

impl Rtt {
    fn of(samples: &mut [f64]) -> Rtt {
        Rtt {
            p50_us: fmt::median(samples),
            p99_us: fmt::percentile(samples, 0.99),
        }
    }
}

/// One system's figures over all rounds.
struct Summary {
    system: System,
    cases: Vec<Case>,
    rtt_4k: Option<Rtt>,
    rtt_4k_push: Option<Rtt>,
    peak_rss_bytes: u64,
    /// Peak RSS of the `pull_into` receivers (the figure the RSS target is about).
    pull_into_rss_bytes: u64,
    channel: Option<String>,
}

fn summarize(system: System, reports: &[(Op, RecvReport)], max_size: u64) -> Summary {
    let channel = reports.iter().rev().find_map(|(_, r)| r.channel.clone());
    let mut cases = Vec::new();
    for &op in system.ops() {
        for size in op.sizes(max_size) {
            let (mut rates, mut firsts): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
            let samples = reports
                .iter()
                .filter(|(o, _)| *o == op)
                .flat_map(|(_, r)| r.sizes.iter().filter(|s| s.size_bytes == size));
            for s in samples {
                rates.extend(&s.rates_mb_s);
                firsts.push(s.first_transfer_ms);
            }
            cases.push(Case {
                system: system.label().to_string(),
                op: op.label(),
                size_bytes: size,
                throughput_mb_s: fmt::median(&mut rates),
                first_transfer_ms: fmt::median(&mut firsts),
                channel: channel.clone(),
            });
        }
    }
    let all = |f: fn(&RecvReport) -> &Vec<f64>| -> Vec<f64> {
        reports
            .iter()
            .flat_map(|(_, r)| f(r).iter().copied())
            .collect()
    };
    let (mut rtt, mut rtt_push) = (all(|r| &r.rtt_us), all(|r| &r.rtt_push_us));
    let rss = |ops: &[Op]| {
        reports
            .iter()
            .filter(|(o, _)| ops.contains(o))
            .map(|(_, r)| r.peak_rss_bytes)
            .max()
            .unwrap_or(0)
    };
    Summary {
        system,
        cases,
        rtt_4k: (!rtt.is_empty()).then(|| Rtt::of(&mut rtt)),
        rtt_4k_push: (!rtt_push.is_empty()).then(|| Rtt::of(&mut rtt_push)),
        peak_rss_bytes: rss(system.ops()),
        pull_into_rss_bytes: rss(&[Op::PullInto]),
        channel,
    }
}

/// Runs a bench subcommand.
pub async fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::P2p(args) => p2p(args).await,
        // Boxed: inline, its future's layout exceeds the compiler's query depth limit.
        BenchCommand::Broadcast(args) => Box::pin(crate::bench_cluster::broadcast(args)).await,
        BenchCommand::Registry(args) => crate::bench_cluster::registry(args).await,
        BenchCommand::Gets(args) => crate::bench_gets::bench(args).await,
        BenchCommand::GetsHold(args) => crate::bench_gets::hold(args).await,
        BenchCommand::Call(args) => crate::bench_call::bench(args).await,
        BenchCommand::CallServe(args) => crate::bench_call::serve(args).await,
        BenchCommand::P2pServe(args) => crate::bench_serve::serve(args).await,
        BenchCommand::ClientSend(args) => crate::bench_client::send(&args).await,
        BenchCommand::ClientRecv(args) => crate::bench_client::recv(&args).await,
        BenchCommand::P2pRecv(args) => {
            let report = crate::bench_recv::receive(&args).await?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
    }
}

/// The name the serving nodes hold a host tensor of `size` bytes under.
pub(crate) fn tensor_name(size: u64) -> String {
    format!("bench/{size}")
}

/// The name of the copy held on the GPU.
pub(crate) fn device_tensor_name(size: u64) -> String {
    format!("bench-cuda/{size}")
}

/// The period of the benchmarks' byte patterns: a prime, so a misplaced piece shows.
const PERIOD: usize = 251;

/// The benchmark's bytes: `i % 251`, so a misplaced piece is caught by [`check`].
pub(crate) fn payload(size: u64) -> Result<Bytes> {
    Ok(Bytes::from(periodic(usize::try_from(size)?, 0)))
}

/// Fails unless `buf` holds the start of [`payload`].
pub(crate) fn check(buf: &[u8]) -> Result<()> {
    check_periodic(buf, 0)
}

/// `len` bytes whose byte `i` is `(i + start) % 251`, in a new allocation.
pub(crate) fn periodic(len: usize, start: usize) -> Vec<u8> {
    let mut v: Vec<u8> = Vec::with_capacity(len);
    v.extend((0..PERIOD.min(len)).map(|i| ((i + start) % PERIOD) as u8));
    // Doubling copies of whole periods, then the tail.
    while v.len() < len {
        let whole = v.len() / PERIOD * PERIOD;
        let n = whole.min(len - v.len());
        v.extend_from_within(..n);
    }
    v
}

/// Fails unless `buf` is [`periodic`]`(buf.len(), start)`, compared a block at a time.
pub(crate) fn check_periodic(buf: &[u8], start: usize) -> Result<()> {
    const BLOCK: usize = PERIOD * 4096;
    let table = periodic(BLOCK + PERIOD, 0);
    let mut offset = 0;
    for chunk in buf.chunks(BLOCK) {
        let at = (offset + start) % PERIOD;
        let expected = &table[at..at + chunk.len()];
        if chunk != expected {
            let wrong = chunk.iter().zip(expected).position(|(a, b)| a != b);
            bail!("byte {} is wrong", offset + wrong.unwrap_or(0));
        }
        offset += chunk.len();
    }
    Ok(())
}

/// The systems `args` asks for, in table order.
fn systems(args: &P2pArgs) -> Vec<System> {
    let mut systems: Vec<System> = System::BROKERS
        .into_iter()
        .filter(|s| s.channel().is_none_or(|c| args.channels.0.contains(&c)))
        .collect();
    if args.device.cuda_ordinal().is_some() {
        systems.extend([System::TensorBrokerCuda, System::TensorBrokerCudaIpc]);
    }
    systems.extend([System::RawIroh, System::RawTcp, System::Memcpy]);
    systems
}

async fn start_server(
    exe: &std::path::Path,
    args: &P2pArgs,
    systems: &[System],
) -> Result<(tokio::process::Child, ServeInfo)> {
    let labels: Vec<&str> = systems
        .iter()
        .filter(|s| System::BROKERS.contains(s))
        .map(|s| s.label())
        .collect();
    let mut server = tokio::process::Command::new(exe)
        .args(["bench", "p2p-serve", "--device", &args.device.to_string()])
        .args(["--systems", &labels.join(",")])
        .args(["--max-size", &args.max_size.to_string()])
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
    Ok((server, info))
}

async fn p2p(args: P2pArgs) -> Result<()> {
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
    }
    let systems = systems(&args);
    let exe = std::env::current_exe().context("locating the tb binary")?;
    let (mut server, info) = start_server(&exe, &args, &systems).await?;
    let mut reports: BTreeMap<System, Vec<(Op, RecvReport)>> = BTreeMap::new();
    for round in 1..=args.rounds.max(1) {
        for &system in &systems {
            if !args.json {
                eprintln!(
                    "round {round}/{}: measuring {} ...",
                    args.rounds,
                    system.label()
                );
            }
            for &op in system.ops() {
                let report = run_receiver(&exe, system, op, &info, &args).await?;
                reports.entry(system).or_default().push((op, report));
            }
        }
    }
    drop(server.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(10), server.wait()).await;
    let _ = server.kill().await;

    let summaries: Vec<Summary> = systems
        .iter()
        .map(|&s| {
            let reports = reports.get(&s).map(Vec::as_slice).unwrap_or_default();
            summarize(s, reports, args.max_size)
        })
        .collect();
    if args.json {
        println!("{}", json(&summaries, args.device));
    } else {
        crate::bench_table::print(&summaries_view(&summaries));
        let host = summaries.iter().find(|s| s.system == System::TensorBroker);
        let cuda = summaries
            .iter()
            .find(|s| s.system == System::TensorBrokerCuda);
        if let (Some(host), Some(cuda)) = (host, cuda) {
            print_device_table(host, cuda, args.device);
        }
    }
    Ok(())
}

/// The one JSON object `--json` prints.
fn json(summaries: &[Summary], device: Device) -> serde_json::Value {
    let (mut rtt, mut rtt_push) = (serde_json::Map::new(), serde_json::Map::new());
    let (mut rss, mut channels) = (serde_json::Map::new(), serde_json::Map::new());
    for s in summaries {
        let label = s.system.label().to_string();
        if let Some(r) = s.rtt_4k {
            rtt.insert(label.clone(), serde_json::json!(r));
        }
        if let Some(r) = s.rtt_4k_push {
            rtt_push.insert(label.clone(), serde_json::json!(r));
        }
        if let Some(c) = &s.channel {
            channels.insert(label.clone(), serde_json::json!(c));
        }
        rss.insert(label, serde_json::json!(s.peak_rss_bytes));
    }
    let cases: Vec<&Case> = summaries.iter().flat_map(|s| &s.cases).collect();
    let receiver_rss = summaries
        .iter()
        .find(|s| s.system == System::TensorBroker)
        .map_or(0, |s| s.pull_into_rss_bytes);
    serde_json::json!({
        "bench": "p2p",
        "device": device.to_string(),
        "cases": cases,
        "rtt_4k": rtt,
        "rtt_4k_push": rtt_push,
        "channel": channels,
        "receiver_peak_rss_bytes": receiver_rss,
        "peak_rss_bytes": rss,
    })
}

/// The summaries as the table prints them.
fn summaries_view(summaries: &[Summary]) -> crate::bench_table::View {
    use crate::bench_table::{Row, RttRow, View};
    let rows = summaries
        .iter()
        .flat_map(|s| &s.cases)
        .map(|c| Row {
            system: c.system.clone(),
            op: c.op,
            size_bytes: c.size_bytes,
            mb_s: c.throughput_mb_s,
            first_ms: c.first_transfer_ms,
            channel: c.channel.clone(),
        })
        .collect();
    let rtts = summaries
        .iter()
        .filter_map(|s| {
            let pull = s.rtt_4k?;
            Some(RttRow {
                system: s.system.label().to_string(),
                pull: (pull.p50_us, pull.p99_us),
                push: s.rtt_4k_push.map(|p| (p.p50_us, p.p99_us)),
            })
        })
        .collect();
    let rss = summaries
        .iter()
        .map(|s| (s.system.label().to_string(), s.peak_rss_bytes))
        .collect();
    View { rows, rtts, rss }
}

async fn run_receiver(
    exe: &std::path::Path,
    system: System,
    op: Op,
    info: &ServeInfo,
    args: &P2pArgs,
) -> Result<RecvReport> {
    let out = tokio::process::Command::new(exe)
        .args(["bench", "p2p-recv", "--system", system.label()])
        .args(["--op", op.label(), "--from", &info.addr_of(system)?])
        .args(["--iters", &args.iters.to_string()])
        .args(["--round-trips", &args.round_trips.to_string()])
        .args(["--max-size", &args.max_size.to_string()])
        .args([
            "--ordinal",
            &args.device.cuda_ordinal().unwrap_or(0).to_string(),
        ])
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(RECEIVER_LIMIT, out)
        .await
        .context("a receiver process ran over 15 minutes")??;
    if !out.status.success() {
        bail!(
            "the {} {} receiver failed ({})",
            system.label(),
            op.label(),
            out.status
        );
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{} {} receiver output", system.label(), op.label()))
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
    let host_pulls = host.cases.iter().filter(|c| c.op == Op::PullInto.label());
    for (h, d) in host_pulls.zip(&cuda.cases) {
        println!(
            "{:>9} {:>18.0} {:>18.0} {:>10.2}",
            fmt::bytes(h.size_bytes),
            h.throughput_mb_s,
            d.throughput_mb_s,
            d.throughput_mb_s / h.throughput_mb_s.max(f64::MIN_POSITIVE)
        );
    }
    if let Some(rtt) = cuda.rtt_4k {
        println!(
            "4 KiB round trip to {device}: p50 {:.0} us p99 {:.0} us",
            rtt.p50_us, rtt.p99_us
        );
    }
}
