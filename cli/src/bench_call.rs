//! `tb bench call`: remote calls (tb-call) per second and their latency, against 1 and 4
//! server processes, beside the tools a Rust user would pick instead for the same calls:
//! gRPC (tonic) and ZeroMQ (libzmq REQ/REP), measured in the same run (`bench_call_base`).
//!
//! Process layout: this process runs an embedded broker on 127.0.0.1 (as `tb bench
//! broadcast` does) and the calling node; each server is a child process of this binary
//! (`tb bench call-serve`) serving `echo` (returns its argument) and `add_one` (x + 1 on an
//! f32 tensor), joined to the broker, printing `ready <node>` once both are advertised (a
//! baseline's server prints `ready <address>` once it listens). Each server count is measured
//! with a fresh calling node (no server list cached from before).
//!
//! A case is one system, op (`echo`, `add_one`), argument size and concurrency: `concurrency`
//! callers each call in a loop until the case's time is up (every caller makes at least one
//! call), and calls/s is all calls over the wall time until the last one returned. Warm-up
//! calls first reach the servers and are checked value for value; measured results are
//! checked too (`echo`: every byte; `add_one`: dtype, shape and its first and last element),
//! outside the timed part.

use std::{
    future::Future,
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use serde::Serialize;
use tb_broker::{Broker, BrokerConfig, BrokerOptions};
use tb_call::{
    CallContext, CallOptions, Calls, FailureKind, FunctionSpec, HostTensor, Output, RemoteFailure,
    Value,
};
use tb_node::{Config, DType, Node, Ticket, proto::ChannelKind, rate};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, BufReader},
    process::{Child, Command},
};

use crate::{bench_call_base as base, fmt};

/// The tensor-broker systems, each measured by a calling node of its own against the same
/// servers: the label and the channels the caller offers (the pair's channel: shm between
/// processes on this host, which carries large arguments and results as loans; or QUIC links
/// only).
const TB_SYSTEMS: [(&str, &[ChannelKind]); 2] = [
    ("tensor-broker", &ChannelKind::DEFAULT),
    ("tensor-broker-quic", &[ChannelKind::Quic]),
];
/// Every system, in table order: tensor-broker's, then the baselines.
const SYSTEMS: [&str; 4] = ["tensor-broker", "tensor-broker-quic", base::GRPC, base::ZMQ];
/// The ops, in table order.
const OPS: [&str; 2] = ["echo", "add_one"];
/// The streaming function the servers serve: `[items, size]` -> `items` f32 tensors of
/// `size` bytes (the argument pattern).
const STREAM_OP: &str = "stream";
/// How long a server process may take to start and advertise.
const START_LIMIT: Duration = Duration::from_secs(60);
/// Longest one call may take before the case fails.
pub(crate) const CALL_LIMIT: Duration = Duration::from_secs(120);
/// Arguments at least this big are computed on a blocking thread by the server.
pub(crate) const BLOCKING_MIN: usize = 1 << 20;
/// Warm-up calls per server (checked value for value).
pub(crate) const WARMUP_PER_SERVER: usize = 3;

/// Options for `tb bench call`.
#[derive(Debug, Args)]
pub struct CallBenchArgs {
    /// Server process counts, measured in turn (ascending).
    #[arg(long, default_value = "1,4", value_delimiter = ',')]
    servers: Vec<usize>,
    /// Argument sizes (f32 tensors: multiples of 4 bytes).
    #[arg(long, default_value = "4KiB,16MiB", value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Calls in flight at once.
    #[arg(long, default_value = "1,64", value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Seconds each case keeps starting calls (after its warm-up).
    #[arg(long, default_value_t = 0.5)]
    pub(crate) seconds: f64,
    /// Systems to measure: tensor-broker (the default channels: shm on this host),
    /// tensor-broker-quic (QUIC links only), grpc (tonic) and zmq (libzmq REQ/REP).
    #[arg(long, default_value = "tensor-broker,tensor-broker-quic,grpc,zmq",
          value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(SYSTEMS))]
    systems: Vec<String>,
    /// Stream item sizes: each system streams items of each size from one server
    /// (`streams` in `--json`).
    #[arg(long, default_value = "1MiB,16MiB", value_delimiter = ',', value_parser = parse_size)]
    stream_sizes: Vec<u64>,
    /// Skip the streams.
    #[arg(long)]
    no_streams: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of the internal server process.
#[derive(Debug, Args)]
pub struct CallServeArgs {
    /// What it serves with: tensor-broker (a node joined to `--join`), grpc or zmq.
    #[arg(long, default_value = "tensor-broker",
          value_parser = clap::builder::PossibleValuesParser::new(["tensor-broker", base::GRPC, base::ZMQ]))]
    system: String,
    /// The broker to join (tensor-broker).
    #[arg(long)]
    join: Option<Ticket>,
    /// Calls each function runs at once (as many more may wait).
    #[arg(long, default_value_t = 64)]
    concurrency: u32,
    /// File holding the cluster secret (none: the open cluster the benchmark runs).
    #[arg(long)]
    cluster_secret_file: Option<std::path::PathBuf>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    match rate::parse_size(s)? {
        n if n == 0 || n % 4 != 0 => {
            Err(format!("{s}: sizes are f32 tensors, a multiple of 4 bytes"))
        }
        n => Ok(n),
    }
}

/// One measured case, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Case {
    system: &'static str,
    op: &'static str,
    size_bytes: u64,
    concurrency: usize,
    servers: usize,
    calls_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

impl Case {
    /// The case of `system` from its calls' latencies (µs) over `elapsed` seconds.
    fn of(
        system: &'static str,
        (op, size, concurrency, servers): (&'static str, u64, usize, usize),
        mut latencies_us: Vec<f64>,
        elapsed: f64,
    ) -> Case {
        Case {
            system,
            op,
            size_bytes: size,
            concurrency,
            servers,
            calls_per_s: latencies_us.len() as f64 / elapsed,
            p50_us: fmt::median(&mut latencies_us),
            p99_us: fmt::percentile(&mut latencies_us, 0.99),
        }
    }
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Report {
    cases: Vec<Case>,
    streams: Vec<StreamCase>,
}

/// Streams of each size, one after the other, per system (after an untimed one of one item).
pub(crate) const STREAMS: u64 = 3;
/// Bytes of one stream: its items are this over their size, 4 to 64 of them.
const STREAM_BYTES: u64 = 128 << 20;

/// One measured stream case, as `--json` prints it: items/s and MB/s over the wall time of
/// all its streams, and the gap before each item (the first's from its stream's start).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StreamCase {
    system: &'static str,
    size_bytes: u64,
    streams: u64,
    items_per_stream: u64,
    items_per_s: f64,
    mb_s: f64,
    gap_p50_us: f64,
    gap_p99_us: f64,
}

/// Times a run of streams: the gap before each item, and the items over the wall time.
pub(crate) struct StreamTimer {
    start: Instant,
    last: Instant,
    gaps_us: Vec<f64>,
}

impl StreamTimer {
    pub(crate) fn start() -> StreamTimer {
        let now = Instant::now();
        StreamTimer {
            start: now,
            last: now,
            gaps_us: Vec::new(),
        }
    }

    /// A stream is asked for now.
    pub(crate) fn stream(&mut self) {
        self.last = Instant::now();
    }

    /// An item arrived now.
    pub(crate) fn item(&mut self) {
        let now = Instant::now();
        self.gaps_us
            .push(now.duration_since(self.last).as_secs_f64() * 1e6);
        self.last = now;
    }
}

/// Checks a stream's item: byte for byte against `pattern` when `full`, else its length.
pub(crate) fn check_item(got: &[u8], pattern: &[u8], full: bool) -> Result<()> {
    ensure!(
        got.len() == pattern.len(),
        "a stream item of {} bytes, not {}",
        got.len(),
        pattern.len()
    );
    ensure!(!full || got == pattern, "a stream item with other bytes");
    Ok(())
}

/// Measures a stream case of each `--stream-sizes` size for `system`: `run(size, items)`
/// checks one untimed stream of one item (every byte), then times [`STREAMS`] streams of
/// `items` items (checking each item's length, the first's every byte) with a timer it
/// returns.
pub(crate) async fn each_stream<F, Fut>(
    args: &CallBenchArgs,
    system: &'static str,
    mut run: F,
) -> Result<Vec<StreamCase>>
where
    F: FnMut(u64, u64) -> Fut,
    Fut: Future<Output = Result<StreamTimer>>,
{
    let mut out = Vec::new();
    if args.no_streams {
        return Ok(out);
    }
    for &size in &args.stream_sizes {
        let items = (STREAM_BYTES / size).clamp(4, 64);
        let timer = run(size, items)
            .await
            .with_context(|| format!("{system}: a stream of {size}-byte items"))?;
        let wall = timer.start.elapsed().as_secs_f64();
        let mut gaps = timer.gaps_us;
        let taken = gaps.len() as f64;
        ensure!(
            gaps.len() as u64 == STREAMS * items,
            "{system}: {} stream items taken, not {}",
            gaps.len(),
            STREAMS * items
        );
        let case = StreamCase {
            system,
            size_bytes: size,
            streams: STREAMS,
            items_per_stream: items,
            items_per_s: taken / wall,
            mb_s: taken * size as f64 / wall / 1e6,
            gap_p50_us: fmt::median(&mut gaps),
            gap_p99_us: fmt::percentile(&mut gaps, 0.99),
        };
        if !args.json {
            eprintln!(
                "  {system} stream of {} items: {:.0} items/s",
                fmt::bytes(size),
                case.items_per_s
            );
        }
        out.push(case);
    }
    Ok(out)
}

/// Runs `tb bench call`.
pub async fn bench(args: CallBenchArgs) -> Result<()> {
    let mut counts = args.servers.clone();
    counts.sort_unstable();
    counts.dedup();
    ensure!(
        counts.first().is_some_and(|&n| n >= 1) && counts.last().is_some_and(|&n| n <= 64),
        "--servers takes counts from 1 to 64"
    );
    ensure!(
        args.concurrency.iter().all(|&c| (1..=1024).contains(&c)),
        "--concurrency takes values from 1 to 1024"
    );
    ensure!(
        args.seconds.is_finite() && args.seconds > 0.0 && args.seconds <= 600.0,
        "--seconds must be above 0 and at most 600"
    );
    let max_concurrency = args.concurrency.iter().copied().max().unwrap_or(1);
    let dir = tempfile::tempdir().context("a temporary data dir")?;
    let mut opts = BrokerOptions::new(dir.path());
    opts.state = BrokerConfig {
        liveness_timeout_ms: 5_000,
        ..BrokerConfig::default()
    };
    let broker = Broker::spawn(opts).await.context("starting the broker")?;
    let ticket = Ticket {
        brokers: vec![broker.addr().clone()],
    };
    let exe = std::env::current_exe().context("locating the tb binary")?;
    let mut children: Vec<Child> = Vec::new();
    let result = async {
        let (mut cases, mut streams) = (Vec::new(), Vec::new());
        // The ready lines of each kind of server started so far (node ids, addresses).
        let mut started: Vec<(&str, Vec<String>)> = Vec::new();
        for (round, &n) in counts.iter().enumerate() {
            // Streams run once per system, against the first round's servers.
            let stream_too = round == 0;
            if !args.json {
                eprintln!("measuring with {n} server(s) ...");
            }
            for system in SYSTEMS
                .into_iter()
                .filter(|s| args.systems.iter().any(|a| a == s))
            {
                let serves = match system {
                    base::GRPC | base::ZMQ => system,
                    _ => "tensor-broker",
                };
                let at = match started.iter().position(|(kind, _)| *kind == serves) {
                    Some(at) => at,
                    None => {
                        started.push((serves, Vec::new()));
                        started.len() - 1
                    }
                };
                let ready = &mut started[at].1;
                while ready.len() < n {
                    let mut serve = vec!["--system".to_string(), serves.to_string()];
                    serve.extend(["--concurrency".to_string(), max_concurrency.to_string()]);
                    if serves == "tensor-broker" {
                        serve.extend(["--join".to_string(), ticket.to_string()]);
                    }
                    let (child, line) = start_server(&exe, &serve, !args.json).await?;
                    children.push(child);
                    ready.push(line);
                }
                let servers = &ready[..n];
                let (measured, streamed) = match system {
                    base::GRPC => base::measure_grpc(servers, &args, stream_too).await?,
                    base::ZMQ => base::measure_zmq(servers, &args, stream_too).await?,
                    _ => {
                        let channels = TB_SYSTEMS
                            .into_iter()
                            .find(|(name, _)| *name == system)
                            .map(|(_, channels)| channels)
                            .context("a tensor-broker system")?;
                        let system = (system, channels);
                        measure(&ticket, n, &args, system, stream_too).await?
                    }
                };
                cases.extend(measured);
                streams.extend(streamed);
            }
        }
        anyhow::Ok((cases, streams))
    }
    .await;
    for mut server in children {
        // Stdin closed: the server shuts down by itself; killed if it takes too long.
        drop(server.stdin.take());
        if tokio::time::timeout(Duration::from_secs(5), server.wait())
            .await
            .is_err()
        {
            let _ = server.kill().await;
        }
    }
    broker.shutdown().await;
    let (cases, streams) = result?;
    if args.json {
        println!("{}", serde_json::to_string(&Report { cases, streams })?);
    } else {
        print_table(&cases);
        print_streams(&streams);
    }
    Ok(())
}

/// Starts one server process (`tb bench call-serve` with `serve` after it) and waits for its
/// ready line; returns the process and what its line says after `ready `.
async fn start_server(
    exe: &std::path::Path,
    serve: &[String],
    show_errors: bool,
) -> Result<(Child, String)> {
    let mut child = Command::new(exe)
        .args(["bench", "call-serve"])
        .args(serve)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(if show_errors {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .kill_on_drop(true)
        .spawn()
        .context("starting a server process")?;
    let stdout = child.stdout.take().context("server stdout")?;
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    tokio::time::timeout(START_LIMIT, reader.read_line(&mut line))
        .await
        .with_context(|| format!("a server process did not start within {START_LIMIT:?}"))??;
    let ready = line
        .trim_end()
        .strip_prefix("ready ")
        .with_context(|| format!("a server process printed {line:?} instead of its ready line"))?;
    Ok((child, ready.to_string()))
}

/// Measures every case `args` asks for (ops, sizes, concurrency, in table order) of `system`
/// against `servers` servers: `run(op, size, concurrency)` gives one case's latencies (µs)
/// and wall time (s). Prints each case's rate when the table (not JSON) is asked for.
pub(crate) async fn each_case<F, Fut>(
    args: &CallBenchArgs,
    system: &'static str,
    servers: usize,
    mut run: F,
) -> Result<Vec<Case>>
where
    F: FnMut(&'static str, u64, usize) -> Fut,
    Fut: Future<Output = Result<(Vec<f64>, f64)>>,
{
    let mut out = Vec::new();
    for op in OPS {
        for &size in &args.sizes {
            for &concurrency in &args.concurrency {
                let (latencies, elapsed) = run(op, size, concurrency)
                    .await
                    .with_context(|| format!("{system}: {op} of {size} bytes x{concurrency}"))?;
                let key = (op, size, concurrency, servers);
                let case = Case::of(system, key, latencies, elapsed);
                if !args.json {
                    eprintln!(
                        "  {system} {op} {} x{concurrency}: {:.0} calls/s",
                        fmt::bytes(size),
                        case.calls_per_s
                    );
                }
                out.push(case);
            }
        }
    }
    Ok(out)
}

/// Runs `concurrency` callers, each calling `call(its index)` in a loop (the future measures
/// and checks one call and returns its latency in µs) until `seconds` are up, every caller
/// at least once; returns every latency and the wall time in seconds until the last call
/// returned.
pub(crate) async fn timed<F, Fut>(
    concurrency: usize,
    seconds: f64,
    call: F,
) -> Result<(Vec<f64>, f64)>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<f64>> + Send,
{
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for caller in 0..concurrency {
        let call = call.clone();
        tasks.spawn(async move {
            let mut latencies_us = Vec::new();
            loop {
                latencies_us.push(call(caller).await?);
                if Instant::now() >= deadline {
                    return anyhow::Ok(latencies_us);
                }
            }
        });
    }
    let mut latencies = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        latencies.extend(joined.context("a calling task")??);
    }
    Ok((latencies, start.elapsed().as_secs_f64()))
}

/// Every case against `servers` servers, from a fresh calling node.
async fn measure(
    ticket: &Ticket,
    servers: usize,
    args: &CallBenchArgs,
    (system, channels): (&'static str, &[ChannelKind]),
    stream_too: bool,
) -> Result<(Vec<Case>, Vec<StreamCase>)> {
    let node = Node::spawn(Config {
        brokers: ticket.brokers.clone(),
        channels: channels.to_vec(),
        heartbeats: false,
        auto_fetch: false,
        ..Config::default()
    })
    .await
    .context("starting the calling node")?;
    let result = async {
        let calls = Calls::attach(&node)?;
        wait_for_servers(&node, servers).await?;
        let cases = each_case(args, system, servers, |op, size, concurrency| {
            run_case(&calls, (op, size, concurrency, servers), args.seconds)
        })
        .await?;
        let streams = match stream_too {
            true => each_stream(args, system, |size, items| stream_tb(&calls, size, items)).await?,
            false => Vec::new(),
        };
        anyhow::Ok((cases, streams))
    }
    .await;
    node.shutdown().await;
    result
}

/// Waits until the broker lists `n` servers of every op.
async fn wait_for_servers(node: &Node, n: usize) -> Result<()> {
    let deadline = Instant::now() + START_LIMIT;
    for op in OPS.into_iter().chain([STREAM_OP]) {
        let name = op.parse().context("function name")?;
        loop {
            let found = node.servers(&name).await.map(|s| s.len()).unwrap_or(0);
            if found == n {
                break;
            }
            if Instant::now() >= deadline {
                bail!("the broker lists {found} servers of {op}, not {n}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// The argument of a case: `size / 4` f32 values `i % 251`.
pub(crate) fn argument(size: u64) -> Result<HostTensor> {
    let n = usize::try_from(size / 4)?;
    let data: Vec<u8> = (0..n)
        .flat_map(|i| ((i % 251) as f32).to_le_bytes())
        .collect();
    Ok(HostTensor::new(DType::F32, vec![n as u64], data)?)
}

/// Checks a result: `echo` returns the argument, `add_one` x + 1 (every element when `full`,
/// else the first and last).
fn check(op: &str, arg: &HostTensor, result: &Value, full: bool) -> Result<()> {
    let got = result
        .as_tensor()
        .with_context(|| format!("{op} returned {result:?}, not a tensor"))?;
    ensure!(
        got.dtype == arg.dtype && got.shape == arg.shape,
        "{op} returned a {} tensor of shape {:?}",
        got.dtype.name(),
        got.shape
    );
    check_bytes(op, &arg.data, &got.data, full)
}

/// [`check`] on the f32 tensors' bytes alone (what the baselines carry).
pub(crate) fn check_bytes(op: &str, arg: &[u8], got: &[u8], full: bool) -> Result<()> {
    ensure!(
        got.len() == arg.len(),
        "{op} returned {} bytes for {}",
        got.len(),
        arg.len()
    );
    if op == "echo" {
        ensure!(got == arg, "echo returned other bytes");
        return Ok(());
    }
    let n = arg.len() / 4;
    let value = |d: &[u8], i: usize| {
        f32::from_le_bytes([d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]])
    };
    let mut indices: Box<dyn Iterator<Item = usize>> = if full {
        Box::new(0..n)
    } else {
        Box::new([0, n.saturating_sub(1)].into_iter().filter(move |&i| i < n))
    };
    if let Some(i) = indices.find(|&i| value(got, i) != value(arg, i) + 1.0) {
        bail!("add_one returned a wrong element {i}");
    }
    Ok(())
}

/// One case: every call's latency (µs) and the wall time (s).
async fn run_case(
    calls: &Calls,
    (op, size, concurrency, servers): (&'static str, u64, usize, usize),
    seconds: f64,
) -> Result<(Vec<f64>, f64)> {
    let arg = argument(size)?;
    let value = Value::Tensor(arg.clone());
    let options = CallOptions {
        timeout: Some(CALL_LIMIT),
        idempotent: false,
    };
    for _ in 0..WARMUP_PER_SERVER * servers {
        let result = calls.call(op, &value, &options).await?;
        check(op, &arg, &result, true)?;
    }
    let shared = Arc::new((calls.clone(), arg, value, options));
    timed(concurrency, seconds, move |_| {
        let shared = shared.clone();
        async move {
            let (calls, arg, value, options) = &*shared;
            let t0 = Instant::now();
            let result = calls.call(op, value, options).await?;
            let latency = t0.elapsed().as_secs_f64() * 1e6;
            check(op, arg, &result, false)?;
            Ok(latency)
        }
    })
    .await
}

/// One stream case of tensor-broker: see [`each_stream`].
async fn stream_tb(calls: &Calls, size: u64, items: u64) -> Result<StreamTimer> {
    let pattern = argument(size)?.data;
    let ask = |items: u64| -> Result<Value> {
        Ok(Value::List(vec![
            Value::Int(i64::try_from(items)?),
            Value::Int(i64::try_from(size)?),
        ]))
    };
    let take = |value: Value, full: bool| -> Result<()> {
        let item = value
            .as_tensor()
            .with_context(|| format!("a stream item {value:?}, not a tensor"))?;
        check_item(&item.data, &pattern, full)
    };
    let mut warm = calls.stream(STREAM_OP, &ask(1)?, 2).await?;
    let mut taken = 0;
    while let Some(item) = warm.next().await {
        take(item?, true)?;
        taken += 1;
    }
    ensure!(taken == 1, "a warm-up stream of {taken} items, not 1");
    let mut timer = StreamTimer::start();
    for run in 0..STREAMS {
        timer.stream();
        let mut stream = calls.stream(STREAM_OP, &ask(items)?, 2).await?;
        let mut taken = 0;
        while let Some(item) = stream.next().await {
            timer.item();
            take(item?, run == 0 && taken == 0)?;
            taken += 1;
        }
        ensure!(taken == items, "a stream of {taken} items, not {items}");
    }
    Ok(timer)
}

fn print_streams(streams: &[StreamCase]) {
    if streams.is_empty() {
        return;
    }
    println!(
        "\n{:<20} {:>9} {:>8} {:>11} {:>9} {:>12} {:>12}",
        "stream", "item", "items", "items/s", "MB/s", "gap p50 us", "gap p99 us"
    );
    for c in streams {
        println!(
            "{:<20} {:>9} {:>8} {:>11.0} {:>9.0} {:>12.0} {:>12.0}",
            c.system,
            fmt::bytes(c.size_bytes),
            c.streams * c.items_per_stream,
            c.items_per_s,
            c.mb_s,
            c.gap_p50_us,
            c.gap_p99_us
        );
    }
}

fn print_table(cases: &[Case]) {
    println!(
        "{:<20} {:>8} {:>9} {:>5} {:>8} {:>11} {:>11} {:>11}",
        "system", "op", "size", "conc", "servers", "calls/s", "p50 us", "p99 us"
    );
    for c in cases {
        println!(
            "{:<20} {:>8} {:>9} {:>5} {:>8} {:>11.0} {:>11.0} {:>11.0}",
            c.system,
            c.op,
            fmt::bytes(c.size_bytes),
            c.concurrency,
            c.servers,
            c.calls_per_s,
            c.p50_us,
            c.p99_us
        );
    }
    print_ratios(cases);
}

/// tensor-broker's calls/s over each baseline's in the same case, where both were measured.
fn print_ratios(cases: &[Case]) {
    let baselines: Vec<&str> = [base::GRPC, base::ZMQ]
        .into_iter()
        .filter(|b| cases.iter().any(|c| c.system == *b))
        .collect();
    let ours = cases.iter().filter(|c| !baselines.contains(&c.system));
    let rows: Vec<(&Case, Vec<Option<f64>>)> = ours
        .map(|c| {
            let ratios = baselines.iter().map(|b| {
                cases
                    .iter()
                    .find(|o| {
                        o.system == *b
                            && (o.op, o.size_bytes, o.concurrency, o.servers)
                                == (c.op, c.size_bytes, c.concurrency, c.servers)
                    })
                    .map(|o| c.calls_per_s / o.calls_per_s)
            });
            (c, ratios.collect())
        })
        .collect();
    if baselines.is_empty() || rows.is_empty() {
        return;
    }
    println!("\ncalls/s over the baseline's in the same case (> 1: tensor-broker is faster):");
    let head: Vec<String> = baselines.iter().map(|b| format!("x {b}")).collect();
    println!(
        "{:<20} {:>8} {:>9} {:>5} {:>8} {}",
        "system",
        "op",
        "size",
        "conc",
        "servers",
        head.iter().map(|h| format!("{h:>9}")).collect::<String>()
    );
    for (c, ratios) in rows {
        let cells: String = ratios
            .iter()
            .map(|r| match r {
                Some(r) => format!("{r:>9.2}"),
                None => format!("{:>9}", "-"),
            })
            .collect();
        println!(
            "{:<20} {:>8} {:>9} {:>5} {:>8} {cells}",
            c.system,
            c.op,
            fmt::bytes(c.size_bytes),
            c.concurrency,
            c.servers
        );
    }
}

/// The server process: serves `echo` and `add_one` on a node joined to the broker, prints
/// `ready <node>`, and serves until its stdin closes (the orchestrator ended or went away).
pub async fn serve(args: CallServeArgs) -> Result<()> {
    let join = match args.system.as_str() {
        base::GRPC => return base::serve_grpc().await,
        base::ZMQ => return base::serve_zmq().await,
        _ => args
            .join
            .clone()
            .context("a tensor-broker server needs --join")?,
    };
    let cluster_key = match &args.cluster_secret_file {
        Some(file) => tb_node::discover::resolve(Some(join.clone()), Some(file), None)?.1,
        None => Config::default().cluster_key,
    };
    let node = Node::spawn(Config {
        brokers: join.brokers.clone(),
        cluster_key,
        auto_fetch: false,
        heartbeat_interval: Duration::from_millis(500),
        ..Config::default()
    })
    .await
    .context("starting the server's node")?;
    let result = async {
        let calls = Calls::attach(&node)?;
        let spec = |name: &str| -> Result<FunctionSpec> {
            Ok(FunctionSpec::new(name)?
                .concurrency(args.concurrency)
                .queue(args.concurrency))
        };
        let echo = calls.serve(spec("echo")?, echo).await?;
        let add_one = calls.serve(spec("add_one")?, add_one).await?;
        let items = StreamItems::default();
        let stream = calls
            .serve(spec(STREAM_OP)?, move |args, cx| items.stream(args, cx))
            .await?;
        println!("ready {}", node.addr());
        let mut sink = Vec::new();
        let _ = tokio::io::stdin().read_to_end(&mut sink).await;
        drop((echo, add_one, stream));
        anyhow::Ok(())
    }
    .await;
    crate::cluster::close(&node).await;
    result
}

/// The stream function's items, one tensor per size (made on its first stream, in a memfd
/// of the node's: lent as it is, as a version would be).
#[derive(Clone, Default)]
struct StreamItems(Arc<std::sync::Mutex<std::collections::HashMap<u64, HostTensor>>>);

impl StreamItems {
    fn item(&self, size: u64) -> Result<HostTensor, RemoteFailure> {
        let failed = |e: String| RemoteFailure::new(FailureKind::Raised, "ValueError", e, "");
        let mut items = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(item) = items.get(&size) {
            return Ok(item.clone());
        }
        let pattern = argument(size).map_err(|e| failed(e.to_string()))?;
        let tensor = tb_node::Tensor::copy_from(DType::F32, pattern.shape, &pattern.data)
            .map_err(|e| failed(e.to_string()))?;
        let item = HostTensor::from_node(tensor).map_err(|e| failed(e.to_string()))?;
        items.insert(size, item.clone());
        Ok(item)
    }

    /// `[items, size]`: `items` tensors of `size` bytes, sent as the caller takes them.
    fn stream(&self, args: Value, _cx: CallContext) -> Output {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let me = self.clone();
        tokio::spawn(async move {
            let asked = match &args {
                Value::List(v) => match v.as_slice() {
                    [Value::Int(items), Value::Int(size)] => Some((*items, *size)),
                    _ => None,
                },
                _ => None,
            };
            let item = match asked {
                Some((items, size)) if items >= 0 && size > 0 && size % 4 == 0 => {
                    let size = size as u64;
                    tokio::task::spawn_blocking(move || me.item(size))
                        .await
                        .map_err(|e| {
                            RemoteFailure::new(FailureKind::Raised, "Panic", e.to_string(), "")
                        })
                        .and_then(|made| made)
                        .map(|item| (items, item))
                }
                _ => Err(RemoteFailure::new(
                    FailureKind::Raised,
                    "ValueError",
                    format!("stream takes [items, size], not {args:?}"),
                    "",
                )),
            };
            let (items, item) = match item {
                Ok(made) => made,
                Err(failure) => {
                    let _ = tx.send(Err(failure)).await;
                    return;
                }
            };
            for _ in 0..items {
                if tx.send(Ok(Value::Tensor(item.clone()))).await.is_err() {
                    return;
                }
            }
        });
        Output::Stream(rx)
    }
}

fn echo(args: Value, _cx: CallContext) -> Output {
    Output::Unary(Box::pin(async move { Ok(args) }))
}

/// `x + 1` of an f32 tensor (on a blocking thread when large); a `ValueError` otherwise.
fn add_one(args: Value, _cx: CallContext) -> Output {
    Output::Unary(Box::pin(async move {
        let Value::Tensor(t) = args else {
            return Err(bad_argument(&args));
        };
        if t.dtype != DType::F32 {
            return Err(bad_argument(&Value::Tensor(t)));
        }
        if t.data.len() < BLOCKING_MIN {
            return plus_one(&t);
        }
        tokio::task::spawn_blocking(move || plus_one(&t))
            .await
            .map_err(|e| RemoteFailure::new(FailureKind::Raised, "Panic", e.to_string(), ""))?
    }))
}

fn plus_one(t: &HostTensor) -> Result<Value, RemoteFailure> {
    let out = HostTensor::new(t.dtype, t.shape.clone(), plus_one_bytes(&t.data))
        .map_err(|e| RemoteFailure::new(FailureKind::Raised, "ValueError", e.to_string(), ""))?;
    Ok(Value::Tensor(out))
}

/// x + 1 of each f32 in `data` (little-endian; a trailing part of an element is dropped).
pub(crate) fn plus_one_bytes(data: &[u8]) -> Vec<u8> {
    data.chunks_exact(4)
        .flat_map(|c| (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) + 1.0).to_le_bytes())
        .collect()
}

fn bad_argument(args: &Value) -> RemoteFailure {
    let what = match args {
        Value::Tensor(t) => format!("a {} tensor", t.dtype.name()),
        _ => "a value that is no tensor".to_string(),
    };
    RemoteFailure::new(
        FailureKind::Raised,
        "ValueError",
        format!("add_one takes an f32 tensor, not {what}"),
        "",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_one_results_are_checked() {
        let arg = argument(64).expect("argument");
        let good = plus_one(&arg).expect("x + 1 of an f32 tensor");
        check("add_one", &arg, &good, true).expect("x + 1");
        check("echo", &arg, &Value::Tensor(arg.clone()), true).expect("echo");
        let mut bad = good.as_tensor().expect("tensor").clone();
        let mut data = bad.data.to_vec();
        data[20] ^= 1;
        bad.data = data.into();
        assert!(check("add_one", &arg, &Value::Tensor(bad.clone()), true).is_err());
        assert!(check("echo", &arg, &Value::Tensor(bad), true).is_err());
        assert!(check("echo", &arg, &Value::None, false).is_err());
        assert!(parse_size("6").is_err() && parse_size("4KiB") == Ok(4096));
    }
}
