//! `tb bench client-put` / `tb bench client-get` (hidden): the Rust side of the Python
//! package's benchmark (`python -m tensor_broker bench`). Two processes join a cluster as
//! worker nodes: one publishes `count` tensors `<prefix>/<size>/<i>` per size (distinct
//! names: brokers keep the newest versions of a name only), the other gets them one by one,
//! timing each get until the tensor is usable. The Python side does exactly the same through the package, so the two lines of
//! the report differ only in the API.

use std::{io::BufRead, path::PathBuf, time::Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use tb_node::{Config, Node, Tensor, Ticket};

/// Options of both sides.
#[derive(Debug, Args)]
pub struct ClientBenchArgs {
    /// The cluster ticket.
    #[arg(long)]
    join: Ticket,
    /// File holding the cluster secret.
    #[arg(long)]
    cluster_secret_file: PathBuf,
    /// Names are `<prefix>/<size>/<i>`.
    #[arg(long)]
    prefix: String,
    /// Tensor sizes in bytes, comma-separated.
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<u64>,
    /// Tensors per size (the first get of each size is a warm-up), comma-separated.
    #[arg(long, value_delimiter = ',')]
    versions: Vec<u64>,
}

impl ClientBenchArgs {
    fn cases(&self) -> Result<Vec<(u64, u64)>> {
        if self.sizes.len() != self.versions.len() || self.versions.contains(&0) {
            bail!("--sizes and --versions need as many entries, versions at least 1");
        }
        Ok(self
            .sizes
            .iter()
            .copied()
            .zip(self.versions.iter().copied())
            .collect())
    }

    async fn node(&self) -> Result<Node> {
        let (ticket, key) = tb_node::discover::resolve(
            Some(self.join.clone()),
            Some(&self.cluster_secret_file),
            None,
        )?;
        let config = Config {
            brokers: ticket.brokers,
            cluster_key: key,
            ..Config::default()
        };
        Node::spawn(config).await.context("starting the node")
    }
}

/// What the getter reports: the seconds each timed get took, per size.
#[derive(Debug, Serialize)]
struct GetReport {
    api: &'static str,
    cases: Vec<GetCase>,
}

#[derive(Debug, Serialize)]
struct GetCase {
    size_bytes: u64,
    samples_s: Vec<f64>,
}

/// Publishes every tensor, prints `ready`, and holds them until stdin closes.
pub async fn put(args: &ClientBenchArgs) -> Result<()> {
    let node = args.node().await?;
    for (size, count) in args.cases()? {
        for i in 0..count {
            let name = format!("{}/{size}/{i}", args.prefix);
            let bytes = vec![(i % 251) as u8; usize::try_from(size)?];
            node.publish(&name, Tensor::from_bytes(bytes))
                .await
                .with_context(|| format!("publishing {name}"))?;
        }
    }
    println!("ready");
    // Serve until the orchestrator closes our stdin.
    tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin().lock().read_line(&mut line).unwrap_or(0) > 0 {
            line.clear();
        }
    })
    .await?;
    node.shutdown().await;
    Ok(())
}

/// Gets the tensors of each size in order (the first untimed), and prints the times as JSON.
pub async fn get(args: &ClientBenchArgs) -> Result<()> {
    let node = args.node().await?;
    let mut cases = Vec::new();
    for (size, count) in args.cases()? {
        let mut samples = Vec::new();
        for i in 0..count {
            let name = format!("{}/{size}/{i}", args.prefix);
            let start = Instant::now();
            let got = node
                .get(&name)
                .await
                .with_context(|| format!("getting {name}"))?;
            let took = start.elapsed().as_secs_f64();
            if got.buffer.byte_len() != size {
                bail!("{name}: {} bytes, expected {size}", got.buffer.byte_len());
            }
            drop(got);
            if i > 0 {
                samples.push(took);
            }
        }
        cases.push(GetCase {
            size_bytes: size,
            samples_s: samples,
        });
    }
    node.shutdown().await;
    let report = GetReport { api: "rust", cases };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
