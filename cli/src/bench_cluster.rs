//! `tb bench broadcast` and `tb bench registry`: the cluster benchmarks, each an in-process
//! cluster on 127.0.0.1 (real brokers with gossip, anti-entropy and sled; real nodes on their
//! own QUIC endpoints), so they need nothing but the `tb` binary.
//!
//! - broadcast: one publisher and N receivers, every node's upload limited to the same rate.
//!   `single` = one receiver gets a new version; `broadcast` = all N get the next version
//!   through the cluster at once (the broker points them at each other, and nodes serve what
//!   they are still receiving, so they form a pipelined tree); `naive` = all N pull the next
//!   version straight from the publisher. With `--slow-receivers K`, K receivers upload at
//!   `--slow-upload-rate` only and ask first (so the broker knows them as sources before the
//!   others ask: the worst place for them); `others_s` is when every other receiver is done,
//!   `all_s` when all are; `publisher_uploaded_bytes` is what the publisher sent meanwhile.
//!   Then one more node gets the broadcast version, which the publisher and every receiver
//!   hold by then (`from_holders_s`: pieces from several idle holders at once). Nodes run QUIC
//!   only unless `--channels` says otherwise: they share this host, where shm would hand each
//!   receiver the whole version at once.
//! - registry: names published one after another (a few in flight) on one broker, and the time
//!   until each is visible on every broker (seen by a subscriber on each); then a new broker
//!   joins and the time until it lists every name (catch-up by anti-entropy).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use serde::Serialize;
use tb_broker::{Broker, BrokerConfig, BrokerOptions};
use tb_node::{Config, Node, PeerAddr, SubEvent, Tensor, proto::ChannelKind, rate};
use tokio::task::JoinSet;

use crate::fmt;

/// Longest any one phase of a benchmark may take before it is reported as failed.
const PHASE_LIMIT: Duration = Duration::from_secs(600);

/// Options for `tb bench broadcast`.
#[derive(Debug, Args)]
pub struct BroadcastArgs {
    /// Receivers of each new version.
    #[arg(long, default_value_t = 8)]
    receivers: usize,
    /// Tensor size, e.g. `256MiB`, `64MB`, `1GiB`.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    size: u64,
    /// Upload limit of every node (publisher and receivers), e.g. `200MB/s`; 0: unlimited.
    #[arg(long, default_value = "200MB/s", value_parser = parse_rate)]
    max_upload_rate: u64,
    /// Fetchers one source serves at a time (the broker's fan-out).
    #[arg(long, default_value_t = 2)]
    fanout: usize,
    /// Tensors at least this big are fanned out bandwidth first (chains), smaller ones
    /// latency first (a shallow tree), like `tb-broker --chain-min-size`.
    #[arg(long, default_value = "8MiB", value_parser = rate::parse_size)]
    chain_min_size: u64,
    /// Receivers whose upload is limited to `--slow-upload-rate` instead (at most
    /// `--receivers - 1`; the first receiver, timed alone as `single`, is never slow).
    #[arg(long, default_value_t = 0)]
    slow_receivers: usize,
    /// Upload limit of the slow receivers.
    #[arg(long, default_value = "5MB/s", value_parser = parse_rate)]
    slow_upload_rate: u64,
    /// Data channels every node runs, best first (`quic`, `tcp,quic`, `shm,tcp,quic`).
    #[arg(long, default_value = "quic", value_parser = parse_channels)]
    channels: Channels,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// The kinds `--channels` names, QUIC always among them (a newtype: clap would read a bare
/// `Vec` as many values).
#[derive(Debug, Clone)]
struct Channels(Vec<ChannelKind>);

fn parse_channels(list: &str) -> Result<Channels, String> {
    ChannelKind::parse_list(list)
        .map(Channels)
        .map_err(|e| e.to_string())
}

/// Options for `tb bench registry`.
#[derive(Debug, Args)]
pub struct RegistryArgs {
    /// Brokers of the cluster (a further one joins for the catch-up measurement).
    #[arg(long, default_value_t = 3)]
    brokers: usize,
    /// Names to publish.
    #[arg(long, default_value_t = 10_000)]
    names: usize,
    /// Publishes in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_rate(s: &str) -> Result<u64, String> {
    rate::parse_rate(s).map_err(|e| e.to_string())
}

/// A tensor size for a benchmark: at least 1 byte.
fn parse_size(s: &str) -> Result<u64, String> {
    match rate::parse_size(s)? {
        0 => Err("the size must be at least 1 byte".into()),
        n => Ok(n),
    }
}

#[derive(Debug, Serialize)]
struct BroadcastReport {
    bench: &'static str,
    receivers: usize,
    size_bytes: u64,
    single_transfer_s: f64,
    broadcast_s: f64,
    naive_s: f64,
    slow_receivers: usize,
    /// When every receiver that is not slow had the whole version (the broadcast's start
    /// to the last one done).
    others_s: f64,
    /// When every receiver had it (`broadcast_s`).
    all_s: f64,
    /// Payload bytes the slow receivers uploaded during the broadcast.
    slow_uploaded_bytes: u64,
    /// Payload bytes the publisher uploaded during the broadcast (one copy is `size_bytes`).
    publisher_uploaded_bytes: u64,
    /// One more node's get of the version once the publisher and every receiver hold it
    /// (pieces from several idle holders at once).
    from_holders_s: f64,
}

#[derive(Debug, Serialize)]
struct RegistryReport {
    bench: &'static str,
    names: usize,
    visible_p50_ms: f64,
    visible_p99_ms: f64,
    catch_up_s: f64,
}

/// A broker in a temporary data dir.
struct TempBroker {
    broker: Broker,
    _dir: tempfile::TempDir,
}

/// A broker with the default decisions, joining `join`.
async fn start_broker(join: &[PeerAddr]) -> Result<TempBroker> {
    start_broker_with(join, BrokerConfig::default()).await
}

async fn start_broker_with(join: &[PeerAddr], state: BrokerConfig) -> Result<TempBroker> {
    let dir = tempfile::tempdir().context("a temporary data dir")?;
    let mut opts = BrokerOptions::new(dir.path());
    opts.join = join.to_vec();
    opts.state = state;
    let broker = Broker::spawn(opts).await.context("starting a broker")?;
    Ok(TempBroker { broker, _dir: dir })
}

fn node_config(brokers: Vec<PeerAddr>, max_upload_rate: u64) -> Config {
    Config {
        brokers,
        max_upload_rate,
        channels: vec![ChannelKind::Quic],
        // One version per node: the benchmark publishes a new one per phase, and the old
        // ones would only take memory.
        keep_versions: 1,
        heartbeat_interval: Duration::from_millis(500),
        ..Config::default()
    }
}

async fn timed<T>(what: &str, fut: impl Future<Output = Result<T>>) -> Result<(T, f64)> {
    let start = Instant::now();
    let out = tokio::time::timeout(PHASE_LIMIT, fut)
        .await
        .with_context(|| format!("{what}: not done within {PHASE_LIMIT:?}"))??;
    Ok((out, start.elapsed().as_secs_f64()))
}

/// Runs `tb bench broadcast`.
pub async fn broadcast(args: BroadcastArgs) -> Result<()> {
    if args.receivers == 0 {
        bail!("--receivers must be at least 1");
    }
    if args.slow_receivers >= args.receivers {
        bail!("--slow-receivers must be below --receivers (the first receiver is never slow)");
    }
    let len = usize::try_from(args.size).context("--size does not fit in memory")?;
    let state = BrokerConfig {
        fanout: args.fanout.max(1),
        chain_min_bytes: args.chain_min_size,
        ..BrokerConfig::default()
    };
    let broker = start_broker_with(&[], state).await?;
    let brokers = vec![broker.broker.addr().clone()];
    let rate = args.max_upload_rate;
    let config = |rate| Config {
        channels: args.channels.0.clone(),
        ..node_config(brokers.clone(), rate)
    };
    let publisher = Node::spawn(config(rate)).await?;
    let mut receivers = Vec::new();
    for i in 0..args.receivers {
        let slow = i >= args.receivers - args.slow_receivers;
        let rate = if slow { args.slow_upload_rate } else { rate };
        receivers.push(Node::spawn(config(rate)).await?);
    }
    if !args.json {
        eprintln!(
            "broadcast: {} to {} receivers ({} of them uploading at {}), upload limit {} per \
             node, fan-out {}, chains from {}, channels {:?}",
            fmt::bytes(args.size),
            args.receivers,
            args.slow_receivers,
            rate::format_rate(args.slow_upload_rate),
            rate::format_rate(rate),
            args.fanout,
            fmt::bytes(args.chain_min_size),
            args.channels.0,
        );
    }
    // Gets the broadcast version once every receiver holds it: from several idle holders.
    let late = Node::spawn(config(rate)).await?;
    let (fast, slow) = receivers.split_at(args.receivers - args.slow_receivers);
    let result = broadcast_phases(&publisher, fast, slow, &late, len).await;
    for node in receivers.iter().chain([&publisher, &late]) {
        node.shutdown().await;
    }
    broker.broker.shutdown().await;
    let m = result?;
    let report = BroadcastReport {
        bench: "broadcast",
        receivers: args.receivers,
        size_bytes: args.size,
        single_transfer_s: round3(m.single),
        broadcast_s: round3(m.all),
        naive_s: round3(m.naive),
        slow_receivers: args.slow_receivers,
        others_s: round3(m.others),
        all_s: round3(m.all),
        slow_uploaded_bytes: m.slow_uploaded,
        publisher_uploaded_bytes: m.publisher_uploaded,
        from_holders_s: round3(m.from_holders),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{:<28} {:>10} {:>10} {:>10}",
            "", "seconds", "x single", "MB/s each"
        );
        let mut rows = vec![
            ("single transfer (1 rcv)", m.single),
            ("broadcast (fan-out tree)", m.all),
        ];
        if args.slow_receivers > 0 {
            rows.push(("  all but the slow ones", m.others));
        }
        rows.push(("naive (all from publisher)", m.naive));
        rows.push(("1 more, from idle holders", m.from_holders));
        for (label, secs) in rows {
            println!(
                "{label:<28} {secs:>10.3} {:>10.2} {:>10.1}",
                secs / m.single.max(f64::MIN_POSITIVE),
                fmt::mb_per_s(args.size, secs)
            );
        }
        println!(
            "the publisher uploaded {} during the broadcast ({:.2} copies)",
            fmt::bytes(m.publisher_uploaded),
            m.publisher_uploaded as f64 / args.size.max(1) as f64
        );
        if args.slow_receivers > 0 {
            println!(
                "the slow receivers uploaded {} during the broadcast",
                fmt::bytes(m.slow_uploaded)
            );
        }
    }
    Ok(())
}

/// What `broadcast_phases` measured, in seconds.
struct Measured {
    single: f64,
    /// Broadcast: every receiver done.
    all: f64,
    /// Broadcast: every receiver that is not slow done.
    others: f64,
    naive: f64,
    slow_uploaded: u64,
    publisher_uploaded: u64,
    from_holders: f64,
}

/// The measurements, each on a version of its own. `slow` receivers start the broadcast
/// first (each once it is receiving), then the `fast` ones.
async fn broadcast_phases(
    publisher: &Node,
    fast: &[Node],
    slow: &[Node],
    late: &Node,
    len: usize,
) -> Result<Measured> {
    const NAME: &str = "bench/broadcast";
    let publish = |seed: u8| {
        let tensor = Tensor::from_bytes(pattern(len, seed));
        let publisher = publisher.clone();
        async move { publisher.publish(NAME, tensor).await.context("publishing") }
    };
    let check = |got: &Tensor, want: &tb_node::proto::ContentHash| -> Result<()> {
        if got.hash() != *want {
            bail!("received bytes hash to {}, not {want}", got.hash());
        }
        Ok(())
    };

    let v = publish(1).await?;
    let (got, single) = timed("single transfer", async {
        Ok(fast[0].get_version(NAME, v).await?)
    })
    .await?;
    check(&got.buffer, &got.meta.hash)?;
    drop(got);

    let v = publish(2).await?;
    let uploaded =
        |nodes: &[Node]| -> u64 { nodes.iter().map(|n| n.metrics().bytes_out.get()).sum() };
    let slow_before = uploaded(slow);
    let publisher_before = publisher.metrics().bytes_out.get();
    let t0 = Instant::now();
    let get = move |node: Node| async move {
        let got = node.get_version(NAME, v).await?;
        let after_s = t0.elapsed().as_secs_f64();
        tracing::info!(
            receiver = %node.id().fmt_short(),
            after_s,
            served_while_receiving = node.inflight_bytes_served(),
            "broadcast receiver done"
        );
        Ok((got.meta.hash == got.buffer.hash(), after_s))
    };
    let ((slow_done, fast_done), _) = timed("broadcast", async {
        let mut slow_set = JoinSet::new();
        for node in slow {
            slow_set.spawn(get(node.clone()));
            // The broker counts it as a source once its look-up is answered.
            let asked = Instant::now();
            while node.versions_receiving() == 0 && asked.elapsed() < ASK_FIRST_LIMIT {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let mut fast_set = JoinSet::new();
        for node in fast {
            fast_set.spawn(get(node.clone()));
        }
        let fast_done = join_all(fast_set).await?;
        let slow_done = join_all(slow_set).await?;
        Ok((slow_done, fast_done))
    })
    .await?;
    let others = fast_done;
    let all = others.max(slow_done);
    let slow_uploaded = uploaded(slow) - slow_before;
    let publisher_uploaded = publisher.metrics().bytes_out.get() - publisher_before;
    let (got, from_holders) = timed("from several holders", async {
        Ok(late.get_version(NAME, v).await?)
    })
    .await?;
    check(&got.buffer, &got.meta.hash)?;
    drop(got);

    let v = publish(3).await?;
    let from = publisher.addr().clone();
    let mut naive_set = JoinSet::new();
    for node in fast.iter().chain(slow) {
        let (node, from) = (node.clone(), from.clone());
        naive_set.spawn(async move {
            let got = node.pull(&from, NAME, Some(v)).await?;
            Ok((got.meta.hash == got.buffer.hash(), 0.0))
        });
    }
    let (_, naive) = timed("naive", join_all(naive_set)).await?;
    Ok(Measured {
        single,
        all,
        others,
        naive,
        slow_uploaded,
        publisher_uploaded,
        from_holders,
    })
}

/// How long a slow receiver may take to start receiving before the others ask anyway.
const ASK_FIRST_LIMIT: Duration = Duration::from_secs(10);

/// Waits for every receiver task; fails if any fails or reports a bad hash. The latest of the
/// times they report (0 if none).
async fn join_all(mut set: JoinSet<Result<(bool, f64), tb_node::Error>>) -> Result<f64> {
    let mut latest: f64 = 0.0;
    while let Some(done) = set.join_next().await {
        match done.context("a receiver task")? {
            Ok((true, at)) => latest = latest.max(at),
            Ok((false, _)) => bail!("a receiver got bytes with the wrong hash"),
            Err(e) => return Err(e).context("a receiver"),
        }
    }
    Ok(latest)
}

fn pattern(len: usize, seed: u8) -> Bytes {
    let mut data = Vec::with_capacity(len);
    data.extend((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
    Bytes::from(data)
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Runs `tb bench registry`.
pub async fn registry(args: RegistryArgs) -> Result<()> {
    if args.brokers == 0 || args.names == 0 {
        bail!("--brokers and --names must be at least 1");
    }
    let mut brokers: Vec<TempBroker> = Vec::new();
    for _ in 0..args.brokers {
        let join: Vec<PeerAddr> = brokers
            .first()
            .map(|b| b.broker.addr().clone())
            .into_iter()
            .collect();
        brokers.push(start_broker(&join).await?);
    }
    let result = registry_phases(&args, &brokers).await;
    for b in brokers {
        b.broker.shutdown().await;
    }
    let (mut latencies, catch_up) = result?;
    let report = RegistryReport {
        bench: "registry",
        names: args.names,
        visible_p50_ms: round3(fmt::percentile(&mut latencies, 0.5)),
        visible_p99_ms: round3(fmt::percentile(&mut latencies, 0.99)),
        catch_up_s: round3(catch_up),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} names on {} brokers: visible everywhere p50 {:.3} ms, p99 {:.3} ms; a new broker caught up in {:.3} s",
            report.names,
            args.brokers,
            report.visible_p50_ms,
            report.visible_p99_ms,
            report.catch_up_s
        );
    }
    Ok(())
}

/// A client node that does not heartbeat (not a holder), talking to `brokers` only.
async fn client(brokers: Vec<PeerAddr>) -> Result<Node> {
    let config = Config {
        heartbeats: false,
        auto_fetch: false,
        ..node_config(brokers, 0)
    };
    Ok(Node::spawn(config).await?)
}

/// Publish-to-visible latencies in ms, and the new broker's catch-up time in s.
async fn registry_phases(args: &RegistryArgs, brokers: &[TempBroker]) -> Result<(Vec<f64>, f64)> {
    let n = args.names;
    let names: Vec<String> = (0..n).map(|i| format!("bench/registry/{i:06}")).collect();
    // One subscriber per broker: it sees a name once that broker has it.
    let seen: Arc<Mutex<HashMap<String, (usize, Instant)>>> = Arc::default();
    let mut observers = Vec::new();
    let mut watchers = JoinSet::new();
    for b in brokers {
        let node = client(vec![b.broker.addr().clone()]).await?;
        let mut sub = node.subscribe("bench/registry/*").await?;
        let seen = seen.clone();
        watchers.spawn(async move {
            let mut count = 0;
            while count < n {
                match sub.next().await {
                    Some(Ok(SubEvent::Version { name, .. })) => {
                        count += 1;
                        let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                        let e = seen.entry(name.to_string()).or_insert((0, Instant::now()));
                        e.0 += 1;
                        e.1 = Instant::now();
                    }
                    Some(_) => {}
                    None => break,
                }
            }
        });
        observers.push(node);
    }
    let publisher = client(vec![brokers[0].broker.addr().clone()]).await?;
    let tensor = Tensor::from_bytes(vec![1u8, 2, 3, 4]);
    let started: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let publish_all = async {
        let mut set = JoinSet::new();
        for name in &names {
            while set.len() >= args.concurrency.max(1) {
                if let Some(done) = set.join_next().await {
                    done.context("a publish task")??;
                }
            }
            let (publisher, tensor, name, started) = (
                publisher.clone(),
                tensor.clone(),
                name.clone(),
                started.clone(),
            );
            set.spawn(async move {
                started
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(name.clone(), Instant::now());
                publisher.publish(&name, tensor).await.map(|_| ())
            });
        }
        while let Some(done) = set.join_next().await {
            done.context("a publish task")??;
        }
        anyhow::Ok(())
    };
    timed("publishing", publish_all).await?;
    let everywhere = brokers.len();
    let (_, _) = timed("every name visible on every broker", async {
        loop {
            let all_seen = {
                let seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                seen.len() == n && seen.values().all(|(c, _)| *c >= everywhere)
            };
            if all_seen {
                break anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await?;
    watchers.abort_all();
    let latencies: Vec<f64> = {
        let seen = seen.lock().unwrap_or_else(|p| p.into_inner());
        let started = started.lock().unwrap_or_else(|p| p.into_inner());
        names
            .iter()
            .filter_map(|name| {
                let start = started.get(name)?;
                let (_, at) = seen.get(name)?;
                Some(at.saturating_duration_since(*start).as_secs_f64() * 1000.0)
            })
            .collect()
    };
    // A new broker joins; time until a client of it lists every name.
    let start = Instant::now();
    let late = start_broker(&[brokers[0].broker.addr().clone()]).await?;
    let lister = client(vec![late.broker.addr().clone()]).await?;
    let caught_up = timed("the new broker catching up", async {
        loop {
            let listed = lister
                .list("bench/registry/")
                .await
                .map(|l| l.len())
                .unwrap_or(0);
            if listed >= n {
                break anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let catch_up = start.elapsed().as_secs_f64();
    lister.shutdown().await;
    late.broker.shutdown().await;
    publisher.shutdown().await;
    for node in observers {
        node.shutdown().await;
    }
    caught_up?;
    Ok((latencies, catch_up))
}
