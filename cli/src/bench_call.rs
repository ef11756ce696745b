//! `tb bench call`: remote calls (tb-call) per second and their latency, against 1 and 4
//! server processes.
//!
//! Process layout: this process runs an embedded broker on 127.0.0.1 (as `tb bench
//! broadcast` does) and the calling node; each server is a child process of this binary
//! (`tb bench call-serve`) serving `echo` (returns its argument) and `add_one` (x + 1 on an
//! f32 tensor), joined to the broker, printing `ready <node>` once both are advertised. Each
//! server count is measured with a fresh calling node (no server list cached from before).
//!
//! A case is one op (`echo`, `add_one`), argument size and concurrency: `concurrency` tasks
//! each call in a loop until the case's time is up (every task makes at least one call), and
//! calls/s is all calls over the wall time until the last one returned. Warm-up calls first
//! reach the servers and are checked value for value; measured results are checked too
//! (`echo`: every byte; `add_one`: dtype, shape and its first and last element), outside the
//! timed part.

use std::{
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

use crate::fmt;

/// What is measured, each by a calling node of its own against the same servers: the label
/// and the channels the caller offers (the pair's channel: shm between processes on this
/// host, which carries large arguments and results as loans; or QUIC links only).
const SYSTEMS: [(&str, &[ChannelKind]); 2] = [
    ("tensor-broker", &ChannelKind::DEFAULT),
    ("tensor-broker-quic", &[ChannelKind::Quic]),
];
/// The ops, in table order.
const OPS: [&str; 2] = ["echo", "add_one"];
/// How long a server process may take to start and advertise.
const START_LIMIT: Duration = Duration::from_secs(60);
/// Longest one call may take before the case fails.
const CALL_LIMIT: Duration = Duration::from_secs(120);
/// Arguments at least this big are computed on a blocking thread by the server.
const BLOCKING_MIN: usize = 1 << 20;
/// Warm-up calls per server (checked value for value).
const WARMUP_PER_SERVER: usize = 3;

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
    seconds: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of the internal server process.
#[derive(Debug, Args)]
pub struct CallServeArgs {
    /// The broker to join.
    #[arg(long)]
    join: Ticket,
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
struct Case {
    system: &'static str,
    op: &'static str,
    size_bytes: u64,
    concurrency: usize,
    servers: usize,
    calls_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

/// What `--json` prints.
#[derive(Debug, Serialize)]
struct Report {
    cases: Vec<Case>,
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
    let mut servers: Vec<Child> = Vec::new();
    let result = async {
        let mut cases = Vec::new();
        for &n in &counts {
            while servers.len() < n {
                let server = start_server(&exe, &ticket, max_concurrency, !args.json).await?;
                servers.push(server);
            }
            if !args.json {
                eprintln!("measuring with {n} server(s) ...");
            }
            for system in SYSTEMS {
                cases.extend(measure(&ticket, n, &args, system).await?);
            }
        }
        anyhow::Ok(cases)
    }
    .await;
    for mut server in servers {
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
    let cases = result?;
    if args.json {
        println!("{}", serde_json::to_string(&Report { cases })?);
    } else {
        print_table(&cases);
    }
    Ok(())
}

/// Starts one server process and waits for its ready line.
async fn start_server(
    exe: &std::path::Path,
    ticket: &Ticket,
    concurrency: usize,
    show_errors: bool,
) -> Result<Child> {
    let mut child = Command::new(exe)
        .args(["bench", "call-serve", "--join", &ticket.to_string()])
        .args(["--concurrency", &concurrency.to_string()])
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
    ensure!(
        line.starts_with("ready "),
        "a server process printed {line:?} instead of its ready line"
    );
    Ok(child)
}

/// Every case against `servers` servers, from a fresh calling node.
async fn measure(
    ticket: &Ticket,
    servers: usize,
    args: &CallBenchArgs,
    (system, channels): (&'static str, &[ChannelKind]),
) -> Result<Vec<Case>> {
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
        let mut cases = Vec::new();
        for op in OPS {
            for &size in &args.sizes {
                for &concurrency in &args.concurrency {
                    let case =
                        run_case(&calls, system, op, size, concurrency, servers, args.seconds)
                            .await
                            .with_context(|| {
                                format!("{op} of {size} bytes at concurrency {concurrency}")
                            })?;
                    if !args.json {
                        eprintln!(
                            "  {op} {} x{concurrency}: {:.0} calls/s",
                            fmt::bytes(size),
                            case.calls_per_s
                        );
                    }
                    cases.push(case);
                }
            }
        }
        anyhow::Ok(cases)
    }
    .await;
    node.shutdown().await;
    result
}

/// Waits until the broker lists `n` servers of every op.
async fn wait_for_servers(node: &Node, n: usize) -> Result<()> {
    let deadline = Instant::now() + START_LIMIT;
    for op in OPS {
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
fn argument(size: u64) -> Result<HostTensor> {
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
    if op == "echo" {
        ensure!(got.data == arg.data, "echo returned other bytes");
        return Ok(());
    }
    let n = arg.data.len() / 4;
    let value = |d: &[u8], i: usize| {
        f32::from_le_bytes([d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]])
    };
    let mut indices: Box<dyn Iterator<Item = usize>> = if full {
        Box::new(0..n)
    } else {
        Box::new([0, n.saturating_sub(1)].into_iter().filter(move |&i| i < n))
    };
    if let Some(i) = indices.find(|&i| value(&got.data, i) != value(&arg.data, i) + 1.0) {
        bail!("add_one returned a wrong element {i}");
    }
    Ok(())
}

async fn run_case(
    calls: &Calls,
    system: &'static str,
    op: &'static str,
    size: u64,
    concurrency: usize,
    servers: usize,
    seconds: f64,
) -> Result<Case> {
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
    let (arg, value) = (Arc::new(arg), Arc::new(value));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (calls, arg, value, options) =
            (calls.clone(), arg.clone(), value.clone(), options.clone());
        tasks.spawn(async move {
            let mut latencies_us = Vec::new();
            loop {
                let t0 = Instant::now();
                let result = calls.call(op, &value, &options).await?;
                latencies_us.push(t0.elapsed().as_secs_f64() * 1e6);
                check(op, &arg, &result, false)?;
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
    let elapsed = start.elapsed().as_secs_f64();
    Ok(Case {
        system,
        op,
        size_bytes: size,
        concurrency,
        servers,
        calls_per_s: latencies.len() as f64 / elapsed,
        p50_us: fmt::median(&mut latencies),
        p99_us: fmt::percentile(&mut latencies, 0.99),
    })
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
}

/// The server process: serves `echo` and `add_one` on a node joined to the broker, prints
/// `ready <node>`, and serves until its stdin closes (the orchestrator ended or went away).
pub async fn serve(args: CallServeArgs) -> Result<()> {
    let cluster_key = match &args.cluster_secret_file {
        Some(file) => {
            let join = Some(args.join.clone());
            tb_node::discover::resolve(join, Some(file), None)?.1
        }
        None => Config::default().cluster_key,
    };
    let node = Node::spawn(Config {
        brokers: args.join.brokers.clone(),
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
        println!("ready {}", node.addr());
        let mut sink = Vec::new();
        let _ = tokio::io::stdin().read_to_end(&mut sink).await;
        drop((echo, add_one));
        anyhow::Ok(())
    }
    .await;
    crate::cluster::close(&node).await;
    result
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
    let data: Vec<u8> = t
        .data
        .chunks_exact(4)
        .flat_map(|c| (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) + 1.0).to_le_bytes())
        .collect();
    let out = HostTensor::new(t.dtype, t.shape.clone(), data)
        .map_err(|e| RemoteFailure::new(FailureKind::Raised, "ValueError", e.to_string(), ""))?;
    Ok(Value::Tensor(out))
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
