//! `tb demo`: first two nodes in this process exchange a set of tensors by pull and push, every
//! byte verified, and a summary table is printed; then the cluster story runs (brokers,
//! subscribers, a broker restart: see [`cluster`]).

mod cluster;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use clap::Args;
use tb_node::{Config, DType, Node, Tensor};

use crate::fmt;

/// Options for `tb demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Largest tensor in the set, in MiB (the set is capped to it).
    #[arg(long, default_value_t = 256)]
    max_mib: u64,
    /// Round trips for the 4 KiB latency figure.
    #[arg(long, default_value_t = 200)]
    round_trips: usize,
    /// Size of each model version in the cluster story, in MiB (0 skips the story).
    #[arg(long, default_value_t = 32)]
    cluster_mib: u64,
}

/// The demo's tensor set: (name, dtype, shape).
fn tensor_set(max_bytes: u64) -> Vec<(&'static str, DType, Vec<u64>)> {
    let set = vec![
        ("demo/bias", DType::F32, vec![1024]),
        ("demo/mask", DType::Bool, vec![64, 64]),
        ("demo/embedding", DType::F16, vec![512, 512]),
        ("demo/attn/wq", DType::BF16, vec![1024, 1024]),
        ("demo/token_ids", DType::I64, vec![8, 131_072]),
        ("demo/quantized", DType::F8E4M3, vec![64 << 20]),
        ("demo/weights", DType::F32, vec![16_384, 4096]),
    ];
    set.into_iter()
        .filter(|(_, d, s)| tb_node::proto::byte_len_for(*d, s).is_ok_and(|n| n <= max_bytes))
        .collect()
}

/// Deterministic, non-repeating-looking bytes (xorshift), so any misplaced byte shows.
pub(crate) fn fill(len: usize, seed: u64) -> Bytes {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut data = Vec::with_capacity(len);
    while data.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let take = (len - data.len()).min(8);
        data.extend_from_slice(&state.to_le_bytes()[..take]);
    }
    Bytes::from(data)
}

struct Row {
    name: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    bytes: u64,
    pull: Duration,
    push: Duration,
}

/// Runs the demo.
pub async fn run(args: DemoArgs) -> Result<()> {
    let started = Instant::now();
    let a = Node::spawn(Config::default())
        .await
        .context("starting node A")?;
    let b = Node::spawn(Config::default())
        .await
        .context("starting node B")?;
    println!("node A  {}", a.addr());
    println!("node B  {}", b.addr());
    let result = exchange(&a, &b, &args).await;
    a.shutdown().await;
    b.shutdown().await;
    let rows = result?;
    print_table(&rows);
    println!(
        "\nall {} tensors verified byte for byte in {:.1} s",
        rows.len() * 2,
        started.elapsed().as_secs_f64()
    );
    if args.cluster_mib == 0 {
        return Ok(());
    }
    let story = cluster::run(args.cluster_mib << 20).await?;
    let slowest = story
        .deliveries
        .iter()
        .map(|(_, d)| d.as_secs_f64())
        .fold(0.0, f64::max);
    println!(
        "\ncluster story: {} versions of {} delivered in order to every subscriber (slowest {:.0} ms), \
         a broker stopped and restarted (caught up to v{}), {} holders at the end; {:.1} s in all",
        story.deliveries.len(),
        fmt::bytes(story.version_bytes),
        slowest * 1e3,
        story.caught_up_version,
        story.holders,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn exchange(a: &Node, b: &Node, args: &DemoArgs) -> Result<Vec<Row>> {
    let set = tensor_set(args.max_mib << 20);
    ensure!(
        !set.is_empty(),
        "--max-mib {} leaves no tensor to send",
        args.max_mib
    );
    let mut rows = Vec::new();
    for (i, (name, dtype, shape)) in set.into_iter().enumerate() {
        let len = usize::try_from(tb_node::proto::byte_len_for(dtype, &shape)?)?;
        let tensor = Tensor::new(dtype, shape.clone(), fill(len, i as u64 + 1))?;
        b.publish_local(name, tensor.clone())?;

        let t = Instant::now();
        let pulled = a
            .pull(b.addr(), name, None)
            .await
            .with_context(|| format!("pulling {name}"))?;
        let pull = t.elapsed();
        ensure!(
            pulled.buffer.data() == tensor.data(),
            "{name}: pulled bytes differ"
        );
        ensure!(
            pulled.meta == *tensor.meta(),
            "{name}: pulled metadata differs"
        );

        let t = Instant::now();
        a.push(b.addr(), name, &pulled.buffer)
            .await
            .with_context(|| format!("pushing {name}"))?;
        let push = t.elapsed();
        let got = b.wait_for(name, Duration::from_secs(30)).await?;
        ensure!(
            got.tensor.data() == tensor.data(),
            "{name}: pushed bytes differ"
        );
        ensure!(got.from == a.id(), "{name}: wrong sender");
        rows.push(Row {
            name,
            dtype,
            shape,
            bytes: len as u64,
            pull,
            push,
        });
    }
    latency(a, b, args.round_trips).await?;
    let stats = a.pool_stats();
    println!(
        "pool on A: {} link(s), {} dial(s), {} reuse(s) over {} transfers; channel A-B: {}",
        stats.links(),
        stats.dials,
        stats.reuses,
        stats.dials + stats.reuses,
        a.channel_to(&b.id())
    );
    if stats.dials != 1 {
        bail!(
            "expected one pooled link to be reused, saw {} dials",
            stats.dials
        );
    }
    Ok(rows)
}

async fn latency(a: &Node, b: &Node, round_trips: usize) -> Result<()> {
    b.publish_local("demo/ping", Tensor::from_bytes(fill(4096, 99)))?;
    let mut buf = vec![0u8; 4096];
    let mut micros = Vec::with_capacity(round_trips);
    for _ in 0..round_trips.max(1) {
        let t = Instant::now();
        a.pull_into(b.addr(), "demo/ping", None, |_| Ok(&mut buf[..]))
            .await?;
        micros.push(t.elapsed().as_secs_f64() * 1e6);
    }
    println!(
        "4 KiB pull round trip over {} runs: p50 {:.0} us, p99 {:.0} us",
        micros.len(),
        fmt::median(&mut micros),
        fmt::percentile(&mut micros, 0.99)
    );
    Ok(())
}

fn print_table(rows: &[Row]) {
    println!(
        "\n{:<18} {:<7} {:<14} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "tensor", "dtype", "shape", "size", "pull ms", "pull MB/s", "push ms", "push MB/s"
    );
    for r in rows {
        println!(
            "{:<18} {:<7} {:<14} {:>9} {:>10.2} {:>10.0} {:>10.2} {:>10.0}",
            r.name,
            r.dtype.to_string(),
            format!("{:?}", r.shape),
            fmt::bytes(r.bytes),
            r.pull.as_secs_f64() * 1e3,
            fmt::mb_per_s(r.bytes, r.pull.as_secs_f64()),
            r.push.as_secs_f64() * 1e3,
            fmt::mb_per_s(r.bytes, r.push.as_secs_f64()),
        );
    }
}
