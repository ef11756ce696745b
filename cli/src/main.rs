//! `tb`: the tensor-broker command line.
//!
//! - `tb up`: a local cluster (brokers and workers) on 127.0.0.1 until Ctrl-C.
//! - `tb put`, `tb get`: send a tensor file to a worker to publish; fetch one into a file
//!   (with a progress bar on a terminal).
//! - `tb call`: call a function the cluster serves (tb-call) with tensor files as arguments;
//!   `tb ls --functions` lists the functions served.
//! - `tb ls`, `tb watch`, `tb status`: what a cluster holds, new versions as they come, its
//!   members with their pool, store and throughput figures.
//! - `tb secret derive --read-only`: the read-only credential derived from the cluster secret.
//! - `tb demo`: a self-contained run of two nodes exchanging tensors, verified byte for byte.
//! - `tb bench p2p`: point-to-point pull, get and push throughput and latency on each channel,
//!   against a bare iroh connection, one TCP stream and memcpy;
//!   `tb bench broadcast`: one version to many receivers (fan-out tree, cut-through, upload
//!   limit); `tb bench registry`: registry replication latency and a new broker's catch-up;
//!   `tb bench call`: remote calls per second and their latency against 1 and 4 servers.

mod bench;
mod bench_call;
mod bench_call_base;
mod bench_client;
mod bench_cluster;
mod bench_gets;
mod bench_recv;
mod bench_serve;
mod bench_table;
mod call;
mod cluster;
mod demo;
mod files;
mod fmt;
mod progress;
mod secret;
mod status;
mod transfer;

use clap::{Parser, Subcommand};

/// tensor-broker: move tensors between processes and machines over pooled QUIC links.
#[derive(Debug, Parser)]
#[command(name = "tb", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a local cluster on 127.0.0.1 (1 broker and 2 workers by default) until Ctrl-C; it
    /// prints the ticket, and the other commands find it without --join.
    Up(cluster::UpArgs),
    /// Send a tensor file (.npy, .safetensors, raw) to a worker, which publishes and holds it.
    Put {
        #[command(flatten)]
        args: transfer::PutArgs,
        #[command(flatten)]
        join: cluster::Join,
    },
    /// Fetch a tensor from the cluster (newest version by default) and write it to a file.
    Get {
        #[command(flatten)]
        args: transfer::GetArgs,
        #[command(flatten)]
        join: cluster::Join,
    },
    /// List the tensors a cluster holds: name, version, dtype, shape, size, holders (with
    /// --functions: the functions served and how many live nodes serve each).
    Ls {
        /// Only names starting with this.
        #[arg(default_value = "")]
        prefix: String,
        /// List the functions served (`tb call` calls them) instead of tensors.
        #[arg(long)]
        functions: bool,
        #[command(flatten)]
        join: cluster::Join,
    },
    /// Call a function the cluster serves, with tensor files as its arguments, and print the
    /// result (or write it with -o).
    #[command(
        long_about = CALL_ABOUT,
        mut_arg("timeout", |a| a.help("Seconds to wait for the cluster and for the call's result"))
    )]
    Call {
        #[command(flatten)]
        args: call::CallArgs,
        #[command(flatten)]
        join: cluster::Join,
    },
    /// Print every new version of names matching a pattern (`name` or `prefix/*`).
    Watch {
        /// The pattern.
        pattern: String,
        #[command(flatten)]
        join: cluster::Join,
    },
    /// The cluster's brokers and workers: alive or dead, and each worker's pooled links,
    /// tensors, store size, throughput and heartbeat age.
    Status {
        #[command(flatten)]
        args: status::StatusArgs,
        #[command(flatten)]
        join: cluster::Join,
    },
    /// Start two nodes in this process, move tensors of several dtypes and sizes (up to
    /// 256 MiB) by pull and push, verify every byte, and print a summary. Exits 0 on success.
    Demo(demo::DemoArgs),
    /// Credentials derived from the cluster secret.
    #[command(subcommand)]
    Secret(secret::SecretCommand),
    /// Benchmarks; they print a table, or one JSON object with --json.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// `tb call --help`.
const CALL_ABOUT: &str = "\
Call a function the cluster serves (by a node that serves it with tb-call, e.g. Python's \
`serve`), with tensor files as its arguments, and print the result.

Arguments: none (the function gets None); one .npy file (a tensor); one .safetensors file \
(a map of its tensors by name); several files (a list of those, in order).

Result: a tensor is summarized on stdout (dtype, shape, size, BLAKE3 of its bytes) and \
written to -o when given (.npy, .safetensors, or raw bytes); a map or list of tensors is \
summarized one tensor a line and written to a .safetensors -o; any other value is printed \
as a Python-like literal.

--timeout bounds joining the cluster and the call itself (the server is told the time left \
and stops the handler when it passes): raise it for slow functions. Ctrl-C cancels the call \
on its server.

Errors end the command with a non-zero exit and one line on stderr: the function's own \
error (its remote type and message, then the remote traceback when there is one), no live \
server for the function, every server overloaded, no result within --timeout, or the \
server lost mid-call.

Example: tb call math/add_one x.npy -o y.npy --timeout 60";

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let threads = match tb_node::runtime::worker_threads() {
        Ok(threads) => threads,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Up(args) => cluster::up(args).await,
            Command::Put { args, join } => transfer::put(&join, args).await,
            Command::Get { args, join } => transfer::get(&join, args).await,
            Command::Ls {
                prefix,
                functions: false,
                join,
            } => cluster::ls(&join, &prefix).await,
            Command::Ls {
                prefix,
                functions: true,
                join,
            } => cluster::ls_functions(&join, &prefix).await,
            Command::Call { args, join } => call::call(&join, args).await,
            Command::Watch { pattern, join } => cluster::watch(&join, &pattern).await,
            Command::Status { args, join } => status::status(&join, &args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Secret(cmd) => secret::run(cmd),
            Command::Bench(cmd) => bench::run(cmd).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
