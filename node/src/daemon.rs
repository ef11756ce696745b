//! What the daemons (`tb-broker`, `tb-worker`) and the `tb` CLI share when they start: the
//! data dir, the cluster secret, logging, the metrics server, and waiting for a stop signal.

use std::{fmt, net::SocketAddr, path::Path, path::PathBuf, str::FromStr, time::Duration};

use tb_dashboard::{AppState, HttpOptions, HttpToken};
use tb_proto::{AuthError, ClusterKey, HOW_TO_MAKE_A_SECRET};
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;

/// Why a process could not be set up from its flags.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// No `--data-dir` and no home directory to put the default under.
    #[error("no --data-dir given and $HOME is not set")]
    NoHome,
    /// The data dir could not be created.
    #[error("creating the data dir {path}: {source}")]
    DataDir {
        /// The folder.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The secret file could not be read.
    #[error("reading the cluster secret from {path}: {source}")]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The secret is unusable (too short, too long, the example placeholder, a malformed
    /// read-only credential). Its message says how to make one.
    #[error(transparent)]
    Secret(#[from] AuthError),
    /// The HTTP token file is unreadable or holds an unusable token.
    #[error("--http-token-file: {0}")]
    HttpToken(#[from] tb_dashboard::TokenError),
    /// A daemon was started with no secret and without `--insecure-open`.
    #[error(
        "no cluster secret: {HOW_TO_MAKE_A_SECRET} (or set TB_CLUSTER_SECRET_FILE); \
         --insecure-open runs without one, open to anyone who can reach the node"
    )]
    NoSecret,
    /// The metrics server's address could not be bound.
    #[error("binding the metrics server to {addr}: {source}")]
    MetricsAddr {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// How long a stopping metrics server may finish the requests under way.
const METRICS_STOP_GRACE: Duration = Duration::from_secs(2);

/// A daemon's HTTP server for metrics, health, the JSON API and the dashboard (the routes are
/// `tb_dashboard`'s). Bound first, so a worker can tell brokers its URL; serving once the
/// process is up ([`MetricsServer::start`]); stopped with the process.
#[derive(Debug)]
pub struct MetricsServer {
    listener: Option<TcpListener>,
    addr: SocketAddr,
    options: HttpOptions,
    stop: CancellationToken,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0: any free port), with the default guards (no token).
    pub async fn bind(addr: SocketAddr) -> Result<MetricsServer, SetupError> {
        Self::bind_with(addr, HttpOptions::default()).await
    }

    /// Binds `addr`; the server will be guarded as `options` say (token, concurrency limit).
    pub async fn bind_with(
        addr: SocketAddr,
        options: HttpOptions,
    ) -> Result<MetricsServer, SetupError> {
        let bound = tb_dashboard::bind(addr)
            .await
            .and_then(|l| Ok((l.local_addr()?, l)));
        let (addr, listener) = bound.map_err(|source| SetupError::MetricsAddr { addr, source })?;
        Ok(MetricsServer {
            listener: Some(listener),
            addr,
            options,
            stop: CancellationToken::new(),
            task: None,
        })
    }

    /// `http://ip:port` as bound.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts serving `state` and prints `metrics: <url>` on stdout (scripts and tests wait
    /// for that line). A second call does nothing.
    pub fn start(&mut self, state: AppState) {
        let Some(listener) = self.listener.take() else {
            return;
        };
        self.task = Some(tokio::spawn(tb_dashboard::serve(
            listener,
            state,
            self.options.clone(),
            self.stop.clone(),
        )));
        println!("metrics: {}", self.url());
        tracing::info!(url = %self.url(), "metrics server listening");
    }

    /// Stops accepting, lets requests under way finish (briefly), and returns.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(METRICS_STOP_GRACE, task).await {
                Ok(Ok(Err(e))) => tracing::warn!(%e, "metrics server failed"),
                Ok(_) => {}
                Err(_) => tracing::debug!("metrics server still busy at shutdown"),
            }
        }
    }
}

/// `dir` if given, else `~/.local/share/tensor-broker/<role>`; created if missing.
pub fn data_dir(dir: Option<PathBuf>, role: &str) -> Result<PathBuf, SetupError> {
    let path = match dir {
        Some(dir) => dir,
        None => crate::discover::default_data_dir(role).ok_or(SetupError::NoHome)?,
    };
    std::fs::create_dir_all(&path).map_err(|source| SetupError::DataDir {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// The cluster key from a secret (or read-only credential) given inline or in a file (one
/// trailing newline ignored); the open cluster's key when neither is given (the `tb` CLI's
/// choice: it reaches open clusters; daemons use [`SecretArgs::key`], which refuses that).
pub fn cluster_key(secret: Option<&str>, file: Option<&Path>) -> Result<ClusterKey, SetupError> {
    crate::discover::cluster_key(secret, file).map_err(|e| match e {
        crate::SecretFileError::Read { path, source } => SetupError::SecretFile { path, source },
        crate::SecretFileError::Invalid(e) => SetupError::Secret(e),
    })
}

/// The cluster-secret flags every daemon takes (with env fallbacks).
#[derive(Debug, Clone, clap::Args)]
pub struct SecretArgs {
    /// File holding the cluster secret (at least 32 bytes; a trailing newline is ignored), or a
    /// read-only credential from `tb secret derive --read-only` (workers only). Make a secret
    /// with `head -c 32 /dev/urandom | base64 > secret && chmod 600 secret`.
    #[arg(
        long,
        env = "TB_CLUSTER_SECRET_FILE",
        conflicts_with = "cluster_secret"
    )]
    pub cluster_secret_file: Option<PathBuf>,
    /// The cluster secret itself (prefer the file: command lines are visible to other users).
    #[arg(long, env = "TB_CLUSTER_SECRET", hide_env_values = true)]
    pub cluster_secret: Option<String>,
    /// Run without a cluster secret: anyone who can reach this node can join the cluster, read,
    /// publish and delete. Only for a trusted network or one machine; the process warns at
    /// start and reports it (`tb_insecure_open` 1, and on the dashboard).
    #[arg(long, conflicts_with_all = ["cluster_secret", "cluster_secret_file"])]
    pub insecure_open: bool,
}

impl SecretArgs {
    /// The cluster key these flags give. Without a secret: [`SetupError::NoSecret`], unless
    /// `--insecure-open` asks for the open cluster's key (then it warns).
    pub fn key(&self) -> Result<ClusterKey, SetupError> {
        let (secret, file) = (
            self.cluster_secret.as_deref(),
            self.cluster_secret_file.as_deref(),
        );
        match (secret, file, self.insecure_open) {
            (None, None, false) => Err(SetupError::NoSecret),
            (None, None, true) => {
                tracing::warn!(
                    "--insecure-open: running without a cluster secret; anyone who can reach \
                     this node can join the cluster, read, publish and delete tensors"
                );
                Ok(ClusterKey::open())
            }
            (secret, file, _) => cluster_key(secret, file),
        }
    }

    /// [`key`](Self::key) for a daemon's `main`, first thing: an unusable secret ends the
    /// process with a one-line error ([`exit_with`]).
    pub fn key_or_exit(&self) -> ClusterKey {
        self.key().unwrap_or_else(|e| exit_with(e))
    }
}

/// Ends a daemon that cannot start: prints `error: <err>` as one line on stderr and exits with
/// status 1 (no backtrace, whatever `RUST_BACKTRACE` says: the line is the whole story).
pub fn exit_with(err: impl fmt::Display) -> ! {
    eprintln!("error: {err}");
    std::process::exit(1)
}

/// The HTTP server's flags every daemon takes (with env fallbacks).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// File holding a bearer token that /api/v1/* then requires (`Authorization: Bearer
    /// <token>`; at least 16 printable ASCII characters, a trailing newline ignored). Make one
    /// with `head -c 32 /dev/urandom | base64 > http_token`. /metrics, /healthz, /readyz and
    /// the page's files stay open; open the dashboard as http://HOST:PORT/#token=TOKEN.
    #[arg(long, env = "TB_HTTP_TOKEN_FILE")]
    pub http_token_file: Option<PathBuf>,
}

impl HttpArgs {
    /// The server's guards these flags give.
    pub fn options(&self) -> Result<HttpOptions, SetupError> {
        let token = match &self.http_token_file {
            Some(path) => Some(HttpToken::from_file(path)?),
            None => None,
        };
        Ok(HttpOptions {
            token,
            ..HttpOptions::default()
        })
    }
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (the default).
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format {other:?} (use text or json)")),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (default `info`).
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second init (tests, embedding) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Publishes every tensor pushed to `node` under its name, until the node shuts down: what a
/// worker does with what `tb put` sends it.
pub async fn publish_pushes(node: crate::Node) {
    while let Ok(pushed) = node.recv().await {
        let name = pushed.name.as_str().to_string();
        match node.publish(&name, pushed.tensor).await {
            Ok(version) => tracing::info!(
                tensor = %name,
                version,
                from = %pushed.from.fmt_short(),
                "published a pushed tensor"
            ),
            Err(e) => tracing::warn!(tensor = %name, %e, "could not publish a pushed tensor"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_come_inline_or_from_a_file_and_are_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("secret");
        let secret = "0123456789abcdef0123456789abcdef";
        std::fs::write(&file, format!("{secret}\n")).expect("write");
        let from_file = cluster_key(None, Some(&file)).expect("file");
        let inline = cluster_key(Some(secret), None).expect("inline");
        assert_eq!(from_file.gossip_topic(), inline.gossip_topic());
        assert!(cluster_key(None, None).expect("open").is_open());
        assert!(matches!(
            cluster_key(Some("short"), None),
            Err(SetupError::Secret(_))
        ));
        assert!(matches!(
            cluster_key(None, Some(&dir.path().join("missing"))),
            Err(SetupError::SecretFile { .. })
        ));
    }

    fn secret_args(file: Option<&Path>, insecure_open: bool) -> SecretArgs {
        SecretArgs {
            cluster_secret_file: file.map(Path::to_owned),
            cluster_secret: None,
            insecure_open,
        }
    }

    #[test]
    fn daemons_without_a_secret_are_refused_with_a_one_line_recipe() {
        let err = secret_args(None, false).key().expect_err("no secret");
        assert!(matches!(err, SetupError::NoSecret));
        let shown = err.to_string();
        assert!(!shown.contains('\n'), "one line: {shown}");
        for part in [
            "head -c 32 /dev/urandom | base64 > secret && chmod 600 secret",
            "--cluster-secret-file",
            "--insecure-open",
        ] {
            assert!(shown.contains(part), "{part} in {shown}");
        }
        let open = secret_args(None, true).key().expect("insecure open");
        assert!(open.is_open());
    }

    #[test]
    fn short_and_example_secrets_are_refused_with_a_recipe() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("secret");
        for bad in ["0123456789abcdef", tb_proto::EXAMPLE_SECRETS[0]] {
            std::fs::write(&file, format!("{bad}\n")).expect("write");
            let err = secret_args(Some(&file), false).key().expect_err("refused");
            assert!(matches!(err, SetupError::Secret(_)), "{err}");
            let shown = err.to_string();
            assert!(shown.contains("head -c 32 /dev/urandom"), "{shown}");
            assert!(!shown.contains('\n'), "one line: {shown}");
        }
    }

    #[test]
    fn a_read_only_credential_file_is_read_like_a_secret_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("ro");
        let root = ClusterKey::from_secret(&[9; 32]).expect("secret");
        let credential = root.read_only_credential().expect("derive");
        std::fs::write(&file, format!("{credential}\n")).expect("write");
        let key = secret_args(Some(&file), false).key().expect("credential");
        assert_eq!(key.access(), tb_proto::Access::ReadOnly);
        assert_eq!(key.read_only_credential().ok(), None);
    }

    #[test]
    fn log_formats_parse() {
        assert_eq!("json".parse(), Ok(LogFormat::Json));
        assert!("xml".parse::<LogFormat>().is_err());
    }
}
