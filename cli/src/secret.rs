//! `tb secret derive --read-only`: the read-only credential of a cluster, derived offline from
//! its secret. Workers and clients given a file holding it (`--cluster-secret-file`,
//! `TB_CLUSTER_SECRET_FILE`) can get, list, watch and see status, never publish, delete, push
//! or act as a broker.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use tb_node::{proto::ClusterKey, read_secret_file};

use crate::cluster::up_dir;

/// `tb secret ...`.
#[derive(Debug, Subcommand)]
pub enum SecretCommand {
    /// Print a credential derived from the cluster secret on stdout (one line). Put it in a
    /// file (mode 0600) and give that file where a secret file goes.
    Derive(DeriveArgs),
}

/// Options of `tb secret derive`.
#[derive(Debug, Args)]
pub struct DeriveArgs {
    /// Derive the read-only credential: get, list, watch and status; no publish, delete, push
    /// or broker. (The only kind there is; the flag says what you get.)
    #[arg(long, required = true)]
    pub read_only: bool,
    /// File holding the cluster secret. Default: the one `tb up` wrote, if any.
    #[arg(long, env = "TB_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
}

/// Runs a `tb secret` command.
pub fn run(cmd: SecretCommand) -> Result<()> {
    match cmd {
        SecretCommand::Derive(args) => {
            let key = secret_key(args.cluster_secret_file)?;
            println!("{}", key.read_only_credential()?);
            Ok(())
        }
    }
}

/// The cluster key in `file`, or in the secret `tb up` wrote.
fn secret_key(file: Option<PathBuf>) -> Result<ClusterKey> {
    let up_secret = up_dir().ok().map(|d| d.join("secret"));
    let path = match (file, up_secret) {
        (Some(file), _) => file,
        (None, Some(up)) if up.exists() => up,
        _ => bail!(
            "no cluster secret to derive from: pass --cluster-secret-file (or set \
             TB_CLUSTER_SECRET_FILE)"
        ),
    };
    Ok(read_secret_file(&path)?)
}
