//! The cluster commands: `tb up` runs a local cluster; `tb ls` and `tb watch` talk to one
//! through a short-lived node of their own, as do `tb put` / `tb get` (`transfer`) and
//! `tb status` (`status`), which find it through [`Join`].
//!
//! Without `--join`, a command uses the cluster `tb up` started on this machine: `tb up`
//! writes its ticket and cluster secret into its data dir (`~/.local/share/tensor-broker/up`,
//! the secret with mode 0600), and the other commands read them from there.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use clap::Args;
use tb_node::{Config, Node, SubEvent, Ticket, proto::ClusterKey};

use crate::fmt::bytes;

/// Where a command finds the cluster.
#[derive(Debug, Clone, Args)]
pub struct Join {
    /// The cluster ticket (tbc1:...). Default: the one `tb up` wrote on this machine.
    #[arg(long, env = "TB_JOIN", global = true)]
    pub join: Option<Ticket>,
    /// File holding the cluster secret. Default: the one `tb up` wrote, if any.
    #[arg(long, env = "TB_CLUSTER_SECRET_FILE", global = true)]
    pub cluster_secret_file: Option<PathBuf>,
    /// Seconds to wait for the cluster before giving up.
    #[arg(long, default_value_t = 10, global = true)]
    pub timeout: u64,
}

/// Longest the shutdown of a command's node may hold up the command: closing its endpoint
/// waits for every QUIC connection to drain, and a handshake to a dead broker (one that lost
/// the race to a live one) drains for about 3 s after the answer is in. Everything before that
/// wait (closing the links to live peers) takes milliseconds; only that wait is cut.
const CLIENT_SHUTDOWN_GRACE: Duration = Duration::from_millis(150);

/// Shuts down a command's node, waiting at most [`CLIENT_SHUTDOWN_GRACE`]. A node whose
/// shutdown is cut short is leaked: the process exits next, and dropping an endpoint that is
/// still closing would only log an error.
pub async fn close(node: &Node) {
    if tokio::time::timeout(CLIENT_SHUTDOWN_GRACE, node.shutdown())
        .await
        .is_err()
    {
        tracing::debug!("node shutdown cut short after {CLIENT_SHUTDOWN_GRACE:?}");
        std::mem::forget(node.clone());
    }
}

/// The folder where `tb up` keeps its state, ticket and secret.
pub fn up_dir() -> Result<PathBuf> {
    Ok(tb_daemon::data_dir(None, "up")?)
}

impl Join {
    /// A node of this cluster for one command (a fresh identity, nothing held).
    pub async fn node(&self) -> Result<Node> {
        let (ticket, key) = self.resolve()?;
        let timeout = Duration::from_secs(self.timeout.max(1));
        let config = Config {
            brokers: ticket.brokers,
            cluster_key: key,
            connect_timeout: timeout,
            request_timeout: timeout,
            auto_fetch: false,
            heartbeats: false,
            // Every interface, any port: this node only dials out, and a socket bound to
            // 127.0.0.1 cannot send to brokers and workers on other machines.
            bind_addr: std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, 0)),
            ..Config::default()
        };
        Node::spawn(config).await.context("starting a node")
    }

    fn resolve(&self) -> Result<(Ticket, ClusterKey)> {
        let file = self.cluster_secret_file.as_deref();
        Ok(tb_node::discover::resolve(self.join.clone(), file, None)?)
    }
}

/// `tb ls`: names, versions, dtypes, shapes, sizes and holder counts. A version set is one
/// row of dtype `set`.
pub async fn ls(join: &Join, prefix: &str) -> Result<()> {
    let node = join.node().await?;
    let listed = node.list(prefix).await;
    close(&node).await;
    let entries = listed.context("listing")?;
    if entries.is_empty() {
        println!("no tensors{}", in_prefix(prefix));
        return Ok(());
    }
    println!(
        "{:<40} {:>7} {:>8} {:>18} {:>10} {:>7}",
        "NAME", "VERSION", "DTYPE", "SHAPE", "SIZE", "HOLDERS"
    );
    for e in entries {
        // A set's shape is its byte count; `tb get` lists its members.
        let shape = match e.meta.dtype {
            tb_node::DType::Set => "-".to_owned(),
            _ => format!("{:?}", e.meta.shape),
        };
        println!(
            "{:<40} {:>7} {:>8} {:>18} {:>10} {:>7}",
            e.name.as_str(),
            e.version,
            e.meta.dtype.name(),
            shape,
            bytes(e.meta.byte_len),
            e.holders
        );
    }
    Ok(())
}

/// `tb ls --functions`: the functions served under `prefix` and their live server counts.
pub async fn ls_functions(join: &Join, prefix: &str) -> Result<()> {
    let node = join.node().await?;
    let listed = node.functions(prefix).await;
    // The call figures come from the servers' heartbeats (what `tb status` shows); without
    // them the list is still printed.
    let members = match &listed {
        Ok(functions) if !functions.is_empty() => node.members_with_stats().await.ok(),
        _ => None,
    };
    close(&node).await;
    let functions = listed.context("listing the functions")?;
    if functions.is_empty() {
        println!("no functions served{}", in_prefix(prefix));
        return Ok(());
    }
    let stats: Vec<_> = members
        .iter()
        .flat_map(|view| &view.members)
        .filter(|row| row.member.alive)
        .filter_map(|row| row.heartbeat.as_ref())
        .flat_map(|heartbeat| &heartbeat.stats.functions)
        .collect();
    println!(
        "{:<40} {:>7} {:>9} {:>9} {:>10} {:>8}",
        "FUNCTION", "SERVERS", "CALLS/S", "IN-FLIGHT", "CALLS", "FAILED"
    );
    for (name, servers) in functions {
        let reported: Vec<_> = stats.iter().filter(|f| f.name == name).collect();
        let figures = match reported.is_empty() {
            true => format!("{:>9} {:>9} {:>10} {:>8}", "-", "-", "-", "-"),
            false => format!(
                "{:>9.1} {:>9} {:>10} {:>8}",
                reported.iter().map(|f| f.calls_per_s).sum::<f64>(),
                reported.iter().map(|f| u64::from(f.in_flight)).sum::<u64>(),
                reported.iter().map(|f| f.calls_total).sum::<u64>(),
                reported.iter().map(|f| f.failed_total).sum::<u64>(),
            ),
        };
        println!("{:<40} {:>7} {figures}", name.as_str(), servers);
    }
    Ok(())
}

fn in_prefix(prefix: &str) -> String {
    match prefix {
        "" => String::new(),
        p => format!(" under {p:?}"),
    }
}

/// `tb watch`: prints every new version of matching names until Ctrl-C.
pub async fn watch(join: &Join, pattern: &str) -> Result<()> {
    let node = join.node().await?;
    let mut sub = node
        .subscribe(pattern)
        .await
        .with_context(|| format!("subscribing to {pattern:?}"))?;
    eprintln!("watching {pattern:?} (Ctrl-C to stop)");
    loop {
        tokio::select! {
            () = tb_daemon::wait_for_signal() => break,
            event = sub.next() => match event {
                None => {
                    close(&node).await;
                    bail!("the subscription ended: no broker reachable");
                }
                Some(Err(e)) => eprintln!("error: {e}"),
                Some(Ok(SubEvent::Version { name, version, meta, .. })) => println!(
                    "{} v{version} {} {:?} {}",
                    name.as_str(), meta.dtype.name(), meta.shape, bytes(meta.byte_len)
                ),
                Some(Ok(SubEvent::Skipped { name, from, to })) => {
                    println!("{} skipped v{from}..=v{to}", name.as_str())
                }
                Some(Ok(SubEvent::Deleted { name })) => println!("{} deleted", name.as_str()),
            },
        }
    }
    close(&node).await;
    Ok(())
}

/// Options of `tb up`.
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Brokers to start.
    #[arg(long, default_value_t = 1)]
    pub brokers: usize,
    /// Workers to start.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Where the cluster keeps its state (registries, keys, ticket, secret).
    /// [default: ~/.local/share/tensor-broker/up]
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// First UDP port: brokers listen on it and the ports after it, workers from +100.
    /// 0: any free ports (the ticket and the worker lines name them).
    #[arg(long, default_value_t = 7410)]
    pub base_port: u16,
    /// First TCP port of the metrics servers (one per broker and worker): brokers on it and
    /// the ports after it, workers from +10 (or after the last broker). 0: any free ports.
    #[arg(long, default_value_t = 9410)]
    pub metrics_port: u16,
}

/// The metrics port of broker `i` (`worker: false`) or worker `i`: brokers from `base`,
/// workers from `base + 10` (after the brokers when there are more than 10). 0 stays 0.
fn metrics_port(base: u16, brokers: usize, worker: bool, i: usize) -> Result<u16> {
    let offset = if worker { brokers.max(10) + i } else { i };
    port(base, offset)
}

/// Binds the metrics server of one cluster process on 127.0.0.1.
async fn bind_metrics(port: u16) -> Result<tb_daemon::MetricsServer> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    Ok(tb_daemon::MetricsServer::bind(addr).await?)
}

/// `tb up`: a local cluster on 127.0.0.1 until Ctrl-C.
pub async fn up(args: UpArgs) -> Result<()> {
    if args.brokers == 0 || args.brokers > 16 || args.workers > 64 {
        bail!("tb up runs 1 to 16 brokers and 0 to 64 workers");
    }
    let dir = match args.data_dir {
        Some(d) => tb_daemon::data_dir(Some(d), "up")?,
        None => up_dir()?,
    };
    let secret_file = dir.join("secret");
    ensure_secret(&secret_file)?;
    let key = tb_daemon::cluster_key(None, Some(&secret_file))?;
    let mut brokers: Vec<tb_broker::Broker> = Vec::new();
    let mut servers = Vec::new();
    for i in 0..args.brokers {
        let mut server = bind_metrics(metrics_port(args.metrics_port, args.brokers, false, i)?)
            .await
            .with_context(|| format!("broker {i}'s metrics server"))?;
        let mut opts = tb_broker::BrokerOptions::new(dir.join(format!("broker-{i}")));
        opts.node.bind_addr = ([127, 0, 0, 1], port(args.base_port, i)?).into();
        opts.node.cluster_key = key.clone();
        opts.join = brokers
            .first()
            .map(|b| b.addr().clone())
            .into_iter()
            .collect();
        let broker = tb_broker::Broker::spawn(opts)
            .await
            .with_context(|| format!("starting broker {i} (is another `tb up` running?)"))?;
        server.start(broker.dashboard());
        servers.push(server);
        brokers.push(broker);
    }
    let broker_addrs: Vec<_> = brokers.iter().map(|b| b.addr().clone()).collect();
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let mut server = bind_metrics(metrics_port(args.metrics_port, args.brokers, true, i)?)
            .await
            .with_context(|| format!("worker {i}'s metrics server"))?;
        let config = Config {
            metrics_url: Some(server.url()),
            bind_addr: ([127, 0, 0, 1], port(args.base_port, 100 + i)?).into(),
            data_dir: Some(dir.join(format!("worker-{i}"))),
            brokers: broker_addrs.clone(),
            cluster_key: key.clone(),
            ..Config::default()
        };
        let worker = Node::spawn(config)
            .await
            .with_context(|| format!("starting worker {i}"))?;
        tokio::spawn(tb_daemon::publish_pushes(worker.clone()));
        server.start(tb_daemon::node_dashboard(&worker));
        servers.push(server);
        workers.push(worker);
    }
    // Every broker this process started, in order: a broker's own ticket names only the
    // brokers it has heard of so far, and the others may not have gossiped their rows yet.
    let ticket = Ticket {
        brokers: broker_addrs,
    };
    let ticket_file = dir.join("ticket");
    std::fs::write(&ticket_file, format!("{ticket}\n"))
        .with_context(|| format!("writing {}", ticket_file.display()))?;
    println!(
        "cluster up: {} broker(s), {} worker(s)",
        brokers.len(),
        workers.len()
    );
    println!("ticket: {ticket}");
    println!("secret: {} (mode 0600)", secret_file.display());
    for w in &workers {
        println!("worker: {}", w.addr());
    }
    if let Some(first) = servers.first() {
        println!("dashboard: {}/", first.url());
    }
    println!("try: tb put demo/x some.npy   tb ls   tb get demo/x -o x.npy   (Ctrl-C stops)");
    tb_daemon::wait_for_signal().await;
    eprintln!("stopping the cluster");
    for server in servers {
        server.stop().await;
    }
    for w in workers {
        w.shutdown().await;
    }
    for b in brokers {
        b.shutdown().await;
    }
    let _ = std::fs::remove_file(&ticket_file);
    Ok(())
}

/// Port `base + offset`; 0 stays 0 (any free port).
fn port(base: u16, offset: usize) -> Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(offset)
        .ok()
        .and_then(|o| base.checked_add(o))
        .with_context(|| format!("--base-port {base} leaves no room for port +{offset}"))
}

/// Creates a random cluster secret (mode 0600) unless one exists.
fn ensure_secret(path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    tb_node::discover::create_secret_file(path)
        .with_context(|| format!("creating {}", path.display()))
}
