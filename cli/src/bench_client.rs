//! `tb bench client-send` / `tb bench client-recv` (hidden): the Rust side of
//! `python -m tensor_broker bench`, which starts each as its own process and drives it in
//! lines. The protocol and the payload are described once, in the module docs of
//! `python/py_src/tensor_broker/_bench_proto.py` and `_bench_workers.py`; these two do exactly
//! what its Python sender and receiver do, through `tb_node` (`Node::publish` /
//! `Node::subscribe` with `--mode name`, `Node::push` / `Node::recv_timeout` with `--mode
//! push`), so the report's lines differ only in the API.
//!
//! The one difference: std gives no safe access to CLOCK_MONOTONIC's value, so both Rust
//! ends stamp one-way sends with the system clock (CLOCK_REALTIME), also one clock for every
//! process on the host; NTP slewing (at most 500 ppm) is far below the noise over the
//! microseconds to milliseconds measured. Round trips use `Instant`.

use std::{
    path::PathBuf,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use serde_json::json;
use tb_node::{Config, DType, Node, PeerAddr, SubEvent, Subscription, Tensor, Ticket};
use tokio::sync::mpsc;

/// Size of a round trip's ping and pong.
const RTT_SIZE: usize = 4 << 10;
/// Bytes before the pattern: the send stamp, then the sequence number.
const HEADER: usize = 16;

/// How tensors travel between the two processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Published by name and delivered by the receiver's subscription.
    Name,
    /// Pushed to the receiver's address, taken from its queue.
    Push,
}

/// Options of both sides.
#[derive(Debug, Args)]
pub struct ClientBenchArgs {
    /// The cluster ticket.
    #[arg(long)]
    join: Ticket,
    /// File holding the cluster secret.
    #[arg(long)]
    cluster_secret_file: PathBuf,
    /// How tensors travel.
    #[arg(long, value_enum)]
    mode: Mode,
    /// Names are `<prefix>/to/...` (sender to receiver) and `<prefix>/back/pong`.
    #[arg(long)]
    prefix: String,
    /// (receiver, push mode) the sender's address, where pongs go.
    #[arg(long)]
    reply_to: Option<PeerAddr>,
    /// Longest one wait for a tensor may take, in seconds.
    #[arg(long, default_value_t = 60.0)]
    wait_s: f64,
    /// Longest the whole process may run, in seconds.
    #[arg(long, default_value_t = 1800.0)]
    limit_s: f64,
}

impl ClientBenchArgs {
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

    fn wait(&self) -> Duration {
        Duration::from_secs_f64(self.wait_s)
    }

    fn name(&self, rest: &str) -> String {
        format!("{}/{rest}", self.prefix)
    }

    /// Ends `run` with an error once `--limit-s` has passed.
    async fn bounded(&self, run: impl Future<Output = Result<()>>) -> Result<()> {
        let limit = Duration::from_secs_f64(self.limit_s);
        tokio::time::timeout(limit, run)
            .await
            .with_context(|| format!("still running after {limit:?}"))?
    }
}

/// The sender: obeys `peer <addr>`, `send <size> <seq>` and `rtt <count>` on stdin until it
/// closes.
pub async fn send(args: &ClientBenchArgs) -> Result<()> {
    args.bounded(async {
        let node = args.node().await?;
        let result = serve_commands(args, &node).await;
        node.shutdown().await;
        result
    })
    .await
}

async fn serve_commands(args: &ClientBenchArgs, node: &Node) -> Result<()> {
    let mut pongs = match args.mode {
        Mode::Name => Some(node.subscribe(&args.name("back/pong")).await?),
        Mode::Push => None,
    };
    say(&json!({"ready": true, "addr": node.addr().to_string()}));
    let mut peer: Option<PeerAddr> = None;
    let mut lines = stdin_lines();
    while let Some(line) = lines.recv().await {
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["peer", addr] => peer = Some(addr.parse().context("peer address")?),
            ["send", size, seq] => {
                let (size, seq): (usize, u64) = (size.parse()?, seq.parse()?);
                let name = args.name(&format!("to/one/{size}"));
                let body = stamped(payload(size, seq)?);
                deliver(node, args.mode, peer.as_ref(), &name, body).await?;
                say(&json!({"sent": seq}));
            }
            ["rtt", count] => {
                let times = round_trips(args, node, peer.as_ref(), &mut pongs, count.parse()?);
                let times = times.await?;
                say(&json!({"checked": times.len(), "rtt_ns": times}));
            }
            _ => bail!("unknown command {line:?}"),
        }
    }
    Ok(())
}

/// `count` 4 KiB ping/pong round trips through the receiver, each pong checked; their times.
async fn round_trips(
    args: &ClientBenchArgs,
    node: &Node,
    peer: Option<&PeerAddr>,
    pongs: &mut Option<Subscription>,
    count: u64,
) -> Result<Vec<u64>> {
    let ping = args.name("to/ping");
    let mut times = Vec::new();
    for seq in 0..count {
        let body = payload(RTT_SIZE, seq)?;
        let start = Instant::now();
        deliver(node, args.mode, peer, &ping, stamped(body)).await?;
        let (name, pong) = next_tensor(node, pongs, args.wait())
            .await?
            .with_context(|| format!("no pong {seq} within {:?}", args.wait()))?;
        let took = start.elapsed();
        let got = check(pong.data(), RTT_SIZE);
        if !got.ok || got.seq != seq {
            bail!("{name}: pong {seq} failed its check ({got:?})");
        }
        times.push(u64::try_from(took.as_nanos())?);
    }
    Ok(times)
}

/// The receiver: checks and reports each one-way tensor, answers each ping, until stdin
/// closes.
pub async fn recv(args: &ClientBenchArgs) -> Result<()> {
    args.bounded(async {
        let node = args.node().await?;
        let result = receive(args, &node).await;
        node.shutdown().await;
        result
    })
    .await
}

async fn receive(args: &ClientBenchArgs, node: &Node) -> Result<()> {
    let mut sub = match args.mode {
        Mode::Name => Some(node.subscribe(&args.name("to/*")).await?),
        Mode::Push => None,
    };
    let (addr, rss) = (node.addr().to_string(), crate::bench_recv::peak_rss_bytes());
    say(&json!({"ready": true, "addr": addr, "peak_rss_bytes": rss}));
    let (ping, pong) = (args.name("to/ping"), args.name("back/pong"));
    let mut lines = stdin_lines();
    loop {
        let got = tokio::select! {
            line = lines.recv() => match line {
                Some(_) => continue,
                None => return Ok(()),
            },
            got = next_tensor(node, &mut sub, args.wait()) => got?,
        };
        let Some((name, tensor)) = got else { continue };
        let now = now_ns();
        let data = tensor.host_data().context("a tensor outside host memory")?;
        if name == ping {
            let got = check(data, RTT_SIZE);
            if !got.ok {
                bail!("{name}: ping {} failed its check", got.seq);
            }
            let answer = stamped(payload(RTT_SIZE, got.seq)?);
            deliver(node, args.mode, args.reply_to.as_ref(), &pong, answer).await?;
            continue;
        }
        let size: usize = name
            .rsplit('/')
            .next()
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("{name}: no size at the end of the name"))?;
        let got = check(data, size);
        say(&json!({
            "name": name,
            "seq": got.seq,
            "size_bytes": data.len(),
            "one_way_ns": now.saturating_sub(got.stamp_ns),
            "check": "full",
            "ok": got.ok,
            "peak_rss_bytes": crate::bench_recv::peak_rss_bytes(),
        }));
    }
}

/// Sends `body` as `name`: published (a tensor made of it), or pushed to `peer` straight
/// from it (`Node::push_bytes`, as a program holding raw bytes would).
async fn deliver(
    node: &Node,
    mode: Mode,
    peer: Option<&PeerAddr>,
    name: &str,
    body: Vec<u8>,
) -> Result<()> {
    match mode {
        Mode::Name => {
            node.publish(name, Tensor::from_bytes(body))
                .await
                .with_context(|| format!("publishing {name}"))?;
        }
        Mode::Push => {
            let peer = peer.with_context(|| format!("pushing {name}: no peer address yet"))?;
            let shape = vec![body.len() as u64];
            node.push_bytes(peer, name, DType::U8, shape, &body)
                .await
                .with_context(|| format!("pushing {name} to {peer}"))?;
        }
    }
    Ok(())
}

/// The next tensor to arrive, with its name: from the subscription (by name) or the push
/// queue; `None` when none came within `wait`.
async fn next_tensor(
    node: &Node,
    sub: &mut Option<Subscription>,
    wait: Duration,
) -> Result<Option<(String, Tensor)>> {
    let Some(sub) = sub else {
        return match node.recv_timeout(wait).await {
            Ok(got) => Ok(Some((got.name.as_str().to_owned(), got.tensor))),
            Err(tb_node::Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(e).context("receiving a push"),
        };
    };
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match sub.next_timeout(left).await {
            None => bail!("the subscription to {} ended", sub.pattern()),
            Some(Err(tb_node::Error::Timeout { .. })) => return Ok(None),
            Some(Err(e)) => return Err(e).context("the subscription failed"),
            Some(Ok(SubEvent::Version {
                name,
                version,
                tensor,
                ..
            })) => {
                let tensor = match tensor {
                    Some(t) => t,
                    None => node.get_version(name.as_str(), version).await?.buffer,
                };
                return Ok(Some((name.as_str().to_owned(), tensor)));
            }
            // Skipped or deleted: the version after it comes next.
            Some(Ok(_)) => {}
        }
    }
}

/// `size` bytes: the header (stamp left 0, `seq`), then byte i is `(i + seq) mod 256`.
fn payload(size: usize, seq: u64) -> Result<Vec<u8>> {
    if size < HEADER {
        bail!("payloads need at least {HEADER} bytes, not {size}");
    }
    // The pattern wraps by design (`as u8`).
    let mut bytes: Vec<u8> = (0..size as u64)
        .map(|i| i.wrapping_add(seq) as u8)
        .collect();
    bytes[8..HEADER].copy_from_slice(&seq.to_le_bytes());
    Ok(bytes)
}

/// Writes the send stamp into the header last, just before the bytes are sent.
fn stamped(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes[..8].copy_from_slice(&now_ns().to_le_bytes());
    bytes
}

/// What [`check`] found in a payload.
#[derive(Debug)]
struct Checked {
    stamp_ns: u64,
    seq: u64,
    /// The length and every byte are right.
    ok: bool,
}

/// Checks `data` against the payload of `size` bytes whose header it carries, every byte
/// (so the receiver reads the whole tensor, as a consumer would).
fn check(data: &[u8], size: usize) -> Checked {
    let word = |at: usize| {
        data.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    };
    let (stamp_ns, seq) = (word(0), word(8));
    let ok = data.len() == size
        && size >= HEADER
        && (data.iter().enumerate().skip(HEADER))
            .all(|(i, &b)| b == (i as u64).wrapping_add(seq) as u8);
    Checked { stamp_ns, seq, ok }
}

/// The system clock in ns (see the module doc for why not CLOCK_MONOTONIC).
fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// One JSON line on stdout, for the orchestrator.
fn say(value: &serde_json::Value) {
    println!("{value}");
}

/// Stdin's lines; the channel closes when stdin does. The reading thread ends then too.
fn stdin_lines() -> mpsc::UnboundedReceiver<String> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_passes_its_check_and_a_changed_one_fails() {
        for size in [HEADER, 4096, (1 << 20) + 4096] {
            let mut bytes = payload(size, 7).expect("payload");
            bytes[..8].copy_from_slice(&5u64.to_le_bytes());
            let got = check(&bytes, size);
            assert!(
                got.ok && got.seq == 7 && got.stamp_ns == 5,
                "{size}: {got:?}"
            );
            if size > HEADER {
                let last = bytes.len() - 1;
                bytes[last] ^= 1;
                assert!(!check(&bytes, size).ok, "{size}");
            }
        }
        assert!(!check(&payload(4096, 1).expect("payload"), 4097).ok);
    }
}
