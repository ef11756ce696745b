//! `tb-broker`: runs one broker of a tensor-broker cluster until SIGINT or SIGTERM.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use clap::Parser;
use tb_broker::{Broker, BrokerOptions, Ticket};
use tb_daemon::LogFormat;

/// Run a tensor-broker broker: it keeps the gossip-replicated registry of tensor names,
/// versions and holders (persisted in its data dir), answers look-ups from workers, and
/// streams new versions to subscribers.
///
/// The first broker of a cluster starts without --join and prints the cluster ticket; other
/// brokers and the workers join with that ticket. Every node of a cluster needs the same
/// cluster secret (--cluster-secret-file or TB_CLUSTER_SECRET_FILE); a broker refuses to start
/// without one unless --insecure-open asks for a cluster open to anyone who can reach it.
#[derive(Debug, Parser)]
#[command(name = "tb-broker", version)]
struct Args {
    /// Where the registry (sled) and the identity key live.
    /// [default: ~/.local/share/tensor-broker/broker]
    #[arg(long, env = "TB_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// UDP address to listen on (QUIC).
    #[arg(long, env = "TB_LISTEN", default_value = "127.0.0.1:7410")]
    listen: SocketAddr,
    /// Address to give peers and write in the ticket when it differs from --listen (e.g.
    /// listening on 0.0.0.0, or behind a NAT or a container's port mapping).
    #[arg(long, env = "TB_ADVERTISE")]
    advertise: Option<SocketAddr>,
    #[command(flatten)]
    secret: tb_daemon::SecretArgs,
    /// A cluster ticket (tbc1:...) naming brokers to join.
    #[arg(long, env = "TB_JOIN")]
    join: Option<Ticket>,
    /// Also write the cluster ticket to this file.
    #[arg(long, env = "TB_TICKET_FILE")]
    ticket_file: Option<PathBuf>,
    /// Mark a worker or peer broker dead after this many seconds without a heartbeat.
    #[arg(long, env = "TB_LIVENESS_TIMEOUT", default_value_t = 10)]
    liveness_timeout: u64,
    /// Seconds after which the row of a node marked dead leaves the registry (and `tb status`),
    /// with what that node held: on every broker, from disk too. Default a day.
    #[arg(long, env = "TB_FORGET_DEAD_AFTER", default_value_t = tb_proto::Expiry::DEAD_AFTER_MS / 1000)]
    forget_dead_after: u64,
    /// Seconds after which the row of a node that left cleanly (a client or worker that shut
    /// down, closing its connection) leaves the registry. Keep it well above --sync-interval:
    /// the leave must reach every broker first. Default five minutes.
    #[arg(long, env = "TB_FORGET_LEFT_AFTER", default_value_t = tb_proto::Expiry::LEFT_AFTER_MS / 1000)]
    forget_left_after: u64,
    /// Seconds between anti-entropy rounds with every peer broker.
    #[arg(long, env = "TB_SYNC_INTERVAL", default_value_t = 5)]
    sync_interval: u64,
    /// Where the HTTP server for /metrics, /healthz, /readyz, /api/v1/status,
    /// /api/v1/cluster and the web dashboard (/) listens (port 0: any free port; the bound
    /// address is printed as `metrics: http://...`).
    #[arg(long, env = "TB_METRICS_ADDR", default_value = tb_dashboard::DEFAULT_BROKER_ADDR)]
    metrics_addr: SocketAddr,
    /// Most fetchers one source of a version (a holder, or a node still receiving it) serves
    /// at a time; the fetchers of a new version form chains or trees instead of all pulling
    /// from the publisher.
    #[arg(long, env = "TB_FANOUT", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    fanout: u64,
    /// Tensors at least this big (e.g. `8MiB`) are fanned out bandwidth first (chains, each
    /// link a node's whole upload); smaller ones latency first (a shallow tree).
    #[arg(long, env = "TB_CHAIN_MIN_SIZE", default_value = "8MiB", value_parser = tb_node::rate::parse_size)]
    chain_min_size: u64,
    /// Log format: human-readable text, or JSON lines for machines.
    #[arg(long, env = "TB_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    http: tb_daemon::HttpArgs,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    tb_daemon::init_logging(args.log_format);
    // First: without a secret (or --insecure-open) the broker starts nothing.
    let cluster_key = args.secret.key_or_exit();
    if let Err(e) = cluster_key.require_secret("acting as a broker") {
        tb_daemon::exit_with(e);
    }
    let data_dir = tb_daemon::data_dir(args.data_dir, "broker")?;
    let mut metrics =
        tb_daemon::MetricsServer::bind_with(args.metrics_addr, args.http.options()?).await?;
    let mut opts = BrokerOptions::new(&data_dir);
    opts.node.bind_addr = args.listen;
    opts.node.advertise_addrs = args.advertise.into_iter().collect();
    opts.state.fanout = usize::try_from(args.fanout).unwrap_or(usize::MAX);
    opts.state.chain_min_bytes = args.chain_min_size;
    opts.node.cluster_key = cluster_key;
    opts.join = args.join.map(|t| t.brokers).unwrap_or_default();
    opts.state.liveness_timeout_ms = args.liveness_timeout.saturating_mul(1000);
    opts.state.expiry.dead_after_ms = args.forget_dead_after.saturating_mul(1000);
    opts.state.expiry.left_after_ms = args.forget_left_after.saturating_mul(1000);
    opts.sync_interval = Duration::from_secs(args.sync_interval.max(1));
    let broker = Broker::spawn(opts)
        .await
        .with_context(|| format!("starting the broker (data dir {})", data_dir.display()))?;
    let ticket = broker.ticket().await.to_string();
    println!("ticket: {ticket}");
    if let Some(path) = &args.ticket_file {
        std::fs::write(path, format!("{ticket}\n"))
            .with_context(|| format!("writing the ticket to {}", path.display()))?;
    }
    metrics.start(broker.dashboard());
    tb_daemon::wait_for_signal().await;
    eprintln!("shutting down");
    metrics.stop().await;
    broker.shutdown().await;
    Ok(())
}
