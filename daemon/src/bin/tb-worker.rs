//! `tb-worker`: runs one worker of a tensor-broker cluster until SIGINT or SIGTERM.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use tb_daemon::LogFormat;
use tb_node::{Config, Node, SubEvent, Subscription, Ticket};
use tracing::{info, warn};

/// Run a tensor-broker worker: it holds tensors and serves them to peers over encrypted QUIC,
/// registers what it holds with the cluster's brokers, and heartbeats so they know it is
/// alive.
///
/// Tensors pushed to a worker (`tb put` does this) are published under their name: the
/// worker holds them and the brokers tell everyone else where to fetch them. With
/// --subscribe, the worker also fetches every new version of matching names as it appears
/// (e.g. `--subscribe 'model/*'` on inference workers), so it can serve them too.
#[derive(Debug, Parser)]
#[command(name = "tb-worker", version)]
struct Args {
    /// The cluster ticket (tbc1:...) a broker printed.
    #[arg(long, env = "TB_JOIN")]
    join: Ticket,
    /// Where the identity key lives. [default: ~/.local/share/tensor-broker/worker]
    #[arg(long, env = "TB_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// UDP address to listen on (QUIC).
    #[arg(long, env = "TB_LISTEN", default_value = "127.0.0.1:7420")]
    listen: SocketAddr,
    /// Address to give peers when it differs from --listen (e.g. listening on 0.0.0.0).
    #[arg(long, env = "TB_ADVERTISE")]
    advertise: Option<SocketAddr>,
    #[command(flatten)]
    secret: tb_daemon::SecretArgs,
    /// Versions of each name to keep; older ones are evicted and withdrawn.
    #[arg(long, env = "TB_KEEP_VERSIONS", default_value_t = 2)]
    keep_versions: usize,
    /// Fetch and hold every new version of names matching this pattern (`name` or `prefix/*`).
    /// Repeatable.
    #[arg(long = "subscribe", value_name = "PATTERN")]
    subscribe: Vec<String>,
    /// Where the HTTP server for /metrics, /healthz, /readyz and /api/v1/status listens
    /// (port 0: any free port; the bound address is printed as `metrics: http://...`).
    #[arg(long, env = "TB_METRICS_ADDR", default_value = tb_dashboard::DEFAULT_WORKER_ADDR)]
    metrics_addr: SocketAddr,
    /// Most payload bytes per second this worker sends to peers, all transfers together, e.g.
    /// `200MB/s`, `1.5GiB/s` (decimal kB/MB/GB or binary KiB/MiB/GiB). 0: unlimited.
    #[arg(long, env = "TB_MAX_UPLOAD_RATE", default_value = "0", value_parser = parse_upload_rate)]
    max_upload_rate: u64,
    /// Most memory that pushes to this worker may hold at once, being received or waiting to
    /// be published, e.g. `2GiB`. A push that does not fit now is refused with Busy (with
    /// TooLarge when it exceeds the whole budget). [default: a quarter of the machine's memory]
    #[arg(long, env = "TB_MAX_PUSH_MEMORY", value_parser = tb_node::rate::parse_size)]
    max_push_memory: Option<u64>,
    /// Data channels to run, best first: shm (same-host shared memory), quic (encrypted,
    /// always run: the fallback), tcp (unencrypted but verified; for trusted networks). Each
    /// transfer with a peer uses the first channel both run.
    #[arg(long, env = "TB_CHANNELS", default_value = "shm,quic", value_parser = parse_channels)]
    channels: Channels,
    /// Log format: text (human-readable) or json.
    #[arg(long, env = "TB_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    http: tb_daemon::HttpArgs,
}

/// A parsed `--channels` list (a newtype: clap would read a bare `Vec` as a repeated flag).
#[derive(Debug, Clone)]
struct Channels(Vec<tb_node::proto::ChannelKind>);

fn parse_channels(list: &str) -> Result<Channels, tb_node::proto::ChannelListError> {
    tb_node::proto::ChannelKind::parse_list(list).map(Channels)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    tb_daemon::init_logging(args.log_format);
    // First: without a secret (or --insecure-open) the worker starts nothing.
    let cluster_key = args.secret.key_or_exit();
    let data_dir = tb_daemon::data_dir(args.data_dir, "worker")?;
    let mut metrics =
        tb_daemon::MetricsServer::bind_with(args.metrics_addr, args.http.options()?).await?;
    let config = Config {
        metrics_url: Some(metrics.url()),
        bind_addr: args.listen,
        data_dir: Some(data_dir.clone()),
        cluster_key,
        brokers: args.join.brokers,
        keep_versions: args.keep_versions.max(1),
        advertise_addrs: args.advertise.into_iter().collect(),
        max_upload_rate: args.max_upload_rate,
        max_push_memory: args
            .max_push_memory
            .unwrap_or_else(tb_node::default_max_push_memory),
        channels: args.channels.0,
        ..Config::default()
    };
    let node = Node::spawn(config)
        .await
        .with_context(|| format!("starting the worker (data dir {})", data_dir.display()))?;
    let mut subs = Vec::new();
    for pattern in &args.subscribe {
        let sub = node
            .subscribe(pattern)
            .await
            .with_context(|| format!("subscribing to {pattern:?}"))?;
        subs.push(sub);
    }
    println!("worker: {}", node.addr());
    metrics.start(tb_daemon::node_dashboard(&node));
    if args.max_upload_rate > 0 {
        info!(
            rate = %tb_node::rate::format_rate(args.max_upload_rate),
            "upload rate limited"
        );
    }
    info!(worker = %node.addr(), "worker started");
    for sub in subs {
        tokio::spawn(follow(sub));
    }
    let serving = node.clone();
    tokio::select! {
        () = tb_daemon::wait_for_signal() => {}
        () = tb_daemon::publish_pushes(serving) => {}
    }
    eprintln!("shutting down");
    metrics.stop().await;
    node.shutdown().await;
    Ok(())
}

/// `--max-upload-rate` for clap: the rate's own error message on bad input.
fn parse_upload_rate(s: &str) -> Result<u64, String> {
    tb_node::rate::parse_rate(s).map_err(|e| e.to_string())
}

/// Logs what a subscription brings (fetching is the subscription's own job).
async fn follow(mut sub: Subscription) {
    while let Some(event) = sub.next().await {
        match event {
            Ok(SubEvent::Version { name, version, .. }) => {
                info!(tensor = %name, version, "holding a new version")
            }
            Ok(SubEvent::Skipped { name, from, to }) => {
                info!(tensor = %name, from, to, "skipped versions (fell behind)")
            }
            Ok(other) => info!(?other, "subscription event"),
            Err(e) => warn!(%e, "subscription error"),
        }
    }
}
