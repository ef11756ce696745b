//! From a daemon's flags to what it starts with: the data dir, the cluster key (with the
//! flags every daemon takes for it, and the refusal to run without a secret unless asked), the
//! HTTP server's guards, and the one-line exit of a process that cannot start.
//!
//! Every error here is a [`SetupError`] whose message names the flag or file at fault, so a
//! `main` can print it as it is ([`exit_with`]) and an operator knows what to fix.

use std::{fmt, net::SocketAddr, path::Path, path::PathBuf};

use tb_dashboard::{HttpOptions, HttpToken};
use tb_proto::{AuthError, ClusterKey, HOW_TO_MAKE_A_SECRET};

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

/// `dir` if given, else `~/.local/share/tensor-broker/<role>`; created if missing.
pub fn data_dir(dir: Option<PathBuf>, role: &str) -> Result<PathBuf, SetupError> {
    let path = match dir {
        Some(dir) => dir,
        None => tb_node::discover::default_data_dir(role).ok_or(SetupError::NoHome)?,
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
    tb_node::discover::cluster_key(secret, file).map_err(|e| match e {
        tb_node::SecretFileError::Read { path, source } => SetupError::SecretFile { path, source },
        tb_node::SecretFileError::Invalid(e) => SetupError::Secret(e),
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
}
