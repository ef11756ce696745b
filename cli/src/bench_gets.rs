//! `tb bench gets`: same-host gets of versions that were just made, the case where every
//! version's bytes sit in memory no process had touched before (a trainer publishing new
//! weights every step, each a fresh allocation).
//!
//! Each run starts a holder process (`tb bench gets-hold`) that makes `--count` tensors of
//! `--size` bytes, each from a new allocation copied into the node's memory as a `put` does,
//! and holds them; it also serves one raw TCP stream of the same size (the baseline). This
//! process then gets them one after another with a fresh node (`Node::pull`, until the tensor
//! is usable), with raw TCP reads into fresh memory interleaved, and checks every byte of
//! every tensor outside the clock. A get by name through a broker adds its look-up to the
//! same transfer.
//!
//! The target: every get at least 1.0x one raw TCP stream of the same run, the median
//! at least 2x.

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use serde::{Deserialize, Serialize};
use tb_node::{Node, PeerAddr, Tensor};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, TcpStream},
};

use crate::{bench::System, fmt};

/// How long a holder may take to make its tensors.
const HOLD_LIMIT: Duration = Duration::from_secs(600);
/// How long one get or raw TCP read may take.
const GET_LIMIT: Duration = Duration::from_secs(120);
/// The name of the small tensor pulled first, so the link and channel are up before the
/// clock runs.
const WARM_NAME: &str = "bench-gets/warm";
/// At most this many tensors per run: each tensor's pattern starts at its own place in the
/// period, so no two of them hold the same bytes (and 20 of 256 MiB is 5 GiB already).
const MAX_COUNT: u64 = 250;

/// Options for `tb bench gets`.
#[derive(Debug, Args)]
pub struct GetsArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Tensors the holder makes per run, each in newly allocated memory; they are gotten one
    /// after another.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=MAX_COUNT))]
    count: u64,
    /// Bytes per tensor.
    #[arg(long, default_value = "256MiB", value_parser = parse_tensor_size)]
    size: u64,
    /// Runs, each with a new holder process and a new getting node.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=1000))]
    runs: u64,
    /// Raw TCP reads of `--size` per run (into fresh memory), spread among the gets: the
    /// baseline each get is divided by is their median over the run.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    tcp_reads: u64,
}

/// A tensor size: at least one byte, at most 64 GiB.
fn parse_tensor_size(s: &str) -> Result<u64, String> {
    let size = tb_node::rate::parse_size(s)?;
    if size == 0 || size > 64 << 30 {
        return Err(format!("{s}: a tensor of 1 byte to 64 GiB"));
    }
    Ok(size)
}

/// Options of the internal holder process.
#[derive(Debug, Args)]
pub struct GetsHoldArgs {
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_COUNT))]
    count: u64,
    #[arg(long, value_parser = parse_tensor_size)]
    size: u64,
}

/// What the holder prints once it holds every tensor.
#[derive(Debug, Serialize, Deserialize)]
struct Held {
    /// The holding node (`<id>@<ip:port>`).
    node: String,
    /// The raw TCP listener (`ip:port`).
    tcp: String,
    /// Seconds the holder took to make and publish its tensors.
    hold_s: f64,
}

/// One run's figures.
#[derive(Debug, Serialize)]
struct Run {
    hold_s: f64,
    /// Each get's throughput, in get order.
    get_mb_s: Vec<f64>,
    /// Each raw TCP read's throughput.
    tcp_mb_s: Vec<f64>,
    /// The channel the getting node used.
    channel: String,
}

impl Run {
    fn tcp_median(&self) -> f64 {
        fmt::median(&mut self.tcp_mb_s.clone())
    }

    /// Each get over the run's raw TCP median.
    fn ratios(&self) -> Vec<f64> {
        let tcp = self.tcp_median();
        self.get_mb_s
            .iter()
            .map(|g| if tcp > 0.0 { g / tcp } else { 0.0 })
            .collect()
    }
}

/// The name the holder keeps tensor `k` under.
fn name(k: usize) -> String {
    format!("bench-gets/{k}")
}

/// Where tensor `k`'s byte pattern starts within its period of 251 (distinct up to
/// [`MAX_COUNT`]).
fn shift(k: usize) -> usize {
    (k + 1) % 251
}

/// `len` bytes of tensor `k`: byte `i` is `(i + shift(k)) % 251`, in a new allocation.
fn pattern(len: usize, k: usize) -> Vec<u8> {
    crate::bench::periodic(len, shift(k))
}

/// Fails unless `got` is tensor `k`'s pattern.
fn check(got: &[u8], k: usize) -> Result<()> {
    crate::bench::check_periodic(got, shift(k)).with_context(|| format!("tensor {k}"))
}

/// The holder: makes `count` tensors, each from a new allocation, publishes them, serves a
/// raw TCP stream of `size` bytes, prints [`Held`] and serves until stdin closes.
pub(crate) async fn hold(args: GetsHoldArgs) -> Result<()> {
    let len = usize::try_from(args.size)?;
    let node = Node::spawn(System::TensorBroker.config().context("config")?).await?;
    node.publish_local(WARM_NAME, Tensor::from_bytes(pattern(4096, 0)))?;
    let started = Instant::now();
    for k in 0..usize::try_from(args.count)? {
        // As a trainer's new weights: a new allocation, copied (and hashed) into the node's
        // memory, then dropped.
        let tensor = tokio::task::block_in_place(|| Tensor::from_bytes(pattern(len, k)));
        node.publish_local(&name(k), tensor)?;
    }
    let hold_s = started.elapsed().as_secs_f64();
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
    let held = Held {
        node: node.addr().to_string(),
        tcp: listener.local_addr()?.to_string(),
        hold_s,
    };
    let tcp_task = tokio::spawn(crate::bench_serve::serve_tcp(
        listener,
        Bytes::from(pattern(len, 0)),
    ));
    println!("{}", serde_json::to_string(&held)?);
    let mut sink = Vec::new();
    let _ = tokio::io::stdin().read_to_end(&mut sink).await;
    tcp_task.abort();
    node.shutdown().await;
    Ok(())
}

/// `tb bench gets`.
pub(crate) async fn bench(args: GetsArgs) -> Result<()> {
    // The holder keeps every tensor of a run at once (and the raw TCP stream's bytes).
    let needs = args.size.saturating_mul(args.count + 1);
    if let Some(available) = available_memory()
        && needs > available
    {
        bail!(
            "a run holds {} ({} tensors of {} and the raw TCP stream's bytes), but only {} of \
             memory is available: lower --count or --size",
            fmt::bytes(needs),
            args.count,
            fmt::bytes(args.size),
            fmt::bytes(available)
        );
    }
    let exe = std::env::current_exe().context("locating the tb binary")?;
    let mut runs = Vec::new();
    for r in 1..=args.runs {
        if !args.json {
            eprintln!(
                "run {r}/{}: a holder makes {} tensors of {} ...",
                args.runs,
                args.count,
                fmt::bytes(args.size)
            );
        }
        let run = one_run(&exe, &args)
            .await
            .with_context(|| format!("run {r}"))?;
        if !args.json {
            print_run(r, &run);
        }
        runs.push(run);
    }
    let (min_ratio, median_ratio) = min_and_median(runs.iter().flat_map(Run::ratios).collect());
    let mut gets: Vec<f64> = runs.iter().flat_map(|r| r.get_mb_s.clone()).collect();
    let mut tcp: Vec<f64> = runs.iter().flat_map(|r| r.tcp_mb_s.clone()).collect();
    if args.json {
        let v = serde_json::json!({
            "bench": "gets",
            "size_bytes": args.size,
            "count": args.count,
            "runs": runs,
            "get_median_mb_s": fmt::median(&mut gets),
            "tcp_median_mb_s": fmt::median(&mut tcp),
            "min_ratio": min_ratio,
            "median_ratio": median_ratio,
        });
        println!("{v}");
    } else {
        println!(
            "{} gets of {} in {} runs: median {:.0} MB/s (raw TCP {:.0} MB/s); each get over its \
             run's raw TCP median: min {:.2}x (target >= 1.0x: {}), median {:.2}x (target >= \
             2x: {})",
            gets.len(),
            fmt::bytes(args.size),
            runs.len(),
            fmt::median(&mut gets),
            fmt::median(&mut tcp),
            min_ratio,
            if min_ratio >= 1.0 { "met" } else { "not met" },
            median_ratio,
            if median_ratio >= 2.0 {
                "met"
            } else {
                "not met"
            },
        );
    }
    Ok(())
}

/// The smallest and the median of `values`.
fn min_and_median(mut values: Vec<f64>) -> (f64, f64) {
    let median = fmt::median(&mut values); // sorts them
    (values.first().copied().unwrap_or(0.0), median)
}

fn print_run(r: u64, run: &Run) {
    let gets: Vec<String> = run.get_mb_s.iter().map(|g| format!("{g:.0}")).collect();
    let (min, median) = min_and_median(run.ratios());
    println!(
        "run {r}: held in {:.1} s; gets MB/s ({}): {}; raw TCP MB/s: {}; min {:.2}x, median \
         {:.2}x raw TCP",
        run.hold_s,
        run.channel,
        gets.join(" "),
        run.tcp_mb_s
            .iter()
            .map(|t| format!("{t:.0}"))
            .collect::<Vec<_>>()
            .join(" "),
        min,
        median,
    );
}

/// `MemAvailable` of `/proc/meminfo`, in bytes (`None` where it cannot be read).
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// One holder, one getting node: every get and the raw TCP reads among them.
async fn one_run(exe: &std::path::Path, args: &GetsArgs) -> Result<Run> {
    let mut holder = tokio::process::Command::new(exe)
        .args(["bench", "gets-hold", "--count", &args.count.to_string()])
        .args(["--size", &args.size.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the holder process")?;
    let stdout = holder.stdout.take().context("holder stdout")?;
    let mut line = String::new();
    tokio::time::timeout(HOLD_LIMIT, BufReader::new(stdout).read_line(&mut line))
        .await
        .context("the holder did not hold its tensors in time")??;
    if line.trim().is_empty() {
        let status = tokio::time::timeout(Duration::from_secs(10), holder.wait()).await;
        let status = match status {
            Ok(Ok(status)) => status.to_string(),
            _ => "still running".to_string(),
        };
        bail!("the holder ended without holding its tensors ({status}; out of memory?)");
    }
    let held: Held = serde_json::from_str(line.trim()).context("the holder's output")?;
    let result = measure(args, &held).await;
    drop(holder.stdin.take());
    let _ = tokio::time::timeout(Duration::from_secs(10), holder.wait()).await;
    let _ = holder.kill().await;
    result
}

async fn measure(args: &GetsArgs, held: &Held) -> Result<Run> {
    let from: PeerAddr = held.node.parse()?;
    let node = Node::spawn(System::TensorBroker.config().context("config")?).await?;
    let result = async {
        // The link and its channel first, off the clock.
        let warm = tokio::time::timeout(GET_LIMIT, node.pull(&from, WARM_NAME, None))
            .await
            .context("the first get (the link's set-up) timed out")??;
        check(warm.buffer.data(), 0)?;
        let mut tcp = tokio::time::timeout(GET_LIMIT, TcpStream::connect(&held.tcp))
            .await
            .context("connecting to the raw TCP stream timed out")??;
        tcp.set_nodelay(true)?;
        let len = usize::try_from(args.size)?;
        let (count, tcp_reads) = (
            usize::try_from(args.count)?,
            usize::try_from(args.tcp_reads)?,
        );
        let mut run = Run {
            hold_s: held.hold_s,
            get_mb_s: Vec::with_capacity(count),
            tcp_mb_s: Vec::with_capacity(tcp_reads),
            channel: String::new(),
        };
        for k in 0..count {
            // Raw TCP reads at evenly spread places among the gets.
            while run.tcp_mb_s.len() < tcp_reads && k * tcp_reads >= run.tcp_mb_s.len() * count {
                run.tcp_mb_s.push(tcp_read(&mut tcp, len).await?);
            }
            let t = Instant::now();
            let got = tokio::time::timeout(GET_LIMIT, node.pull(&from, &name(k), None))
                .await
                .with_context(|| format!("get {k} took over {GET_LIMIT:?}"))??;
            let secs = t.elapsed().as_secs_f64();
            let data = got.buffer.data();
            if data.len() != len {
                bail!("get {k}: {} bytes, wanted {len}", data.len());
            }
            tokio::task::block_in_place(|| check(data, k))?;
            run.get_mb_s.push(fmt::mb_per_s(args.size, secs));
        }
        while run.tcp_mb_s.len() < tcp_reads {
            run.tcp_mb_s.push(tcp_read(&mut tcp, len).await?);
        }
        run.channel = node.channel_to(&from.id).to_string();
        Ok(run)
    }
    .await;
    node.shutdown().await;
    result
}

/// One raw TCP read of `len` bytes into fresh memory; its MB/s (the bytes checked after).
async fn tcp_read(stream: &mut TcpStream, len: usize) -> Result<f64> {
    let t = Instant::now();
    let mut buf = vec![0u8; len];
    let read = async {
        stream.write_all(&(len as u64).to_le_bytes()).await?;
        stream.read_exact(&mut buf).await
    };
    tokio::time::timeout(GET_LIMIT, read)
        .await
        .context("a raw TCP read timed out")??;
    let secs = t.elapsed().as_secs_f64();
    tokio::task::block_in_place(|| check(&buf, 0))?;
    Ok(fmt::mb_per_s(len as u64, secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_check_and_misplaced_bytes_do_not() {
        for (len, k) in [(0, 0), (1, 3), (250, 1), (251, 2), (5000, 4), (1 << 20, 19)] {
            let p = pattern(len, k);
            assert_eq!(p.len(), len);
            assert!(
                p.iter()
                    .enumerate()
                    .all(|(i, b)| *b as usize == (i + shift(k)) % 251)
            );
            check(&p, k).expect("its own pattern");
            if len > 300 {
                assert!(check(&p, k + 1).is_err(), "another tensor's pattern");
                let mut bad = p.clone();
                bad[len - 1] ^= 1;
                let err = check(&bad, k).expect_err("a flipped byte");
                let err = format!("{err:#}");
                assert!(err.starts_with(&format!("tensor {k}")), "{err}");
                assert!(err.contains(&format!("byte {}", len - 1)), "{err}");
            }
        }
    }
}
