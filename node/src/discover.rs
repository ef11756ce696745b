//! Finding the cluster a client joins when it is not told which: the rules the `tb` CLI and
//! the Python package share (one implementation, so both find the same cluster).
//!
//! A ticket given by the caller wins; else [`JOIN_ENV`]; else the ticket a running `tb up`
//! wrote into its data dir ([`up_dir`]). The key comes from an inline secret, else a secret
//! file (the caller's, else [`SECRET_FILE_ENV`]), else — only when the ticket is `tb up`'s
//! own — the secret `tb up` wrote beside it; with none of them, the open cluster's key.

use std::path::{Path, PathBuf};

use tb_proto::ClusterKey;

use crate::{
    Ticket,
    config::{SecretFileError, parse_secret, read_secret_file},
};

/// The environment variable holding a cluster ticket.
pub const JOIN_ENV: &str = "TB_JOIN";
/// The environment variable naming the cluster secret file.
pub const SECRET_FILE_ENV: &str = "TB_CLUSTER_SECRET_FILE";
/// The file in [`up_dir`] holding the ticket of a running `tb up`.
pub const UP_TICKET_FILE: &str = "ticket";
/// The file in [`up_dir`] holding `tb up`'s cluster secret (mode 0600).
pub const UP_SECRET_FILE: &str = "secret";

/// Why no cluster could be found.
#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    /// No ticket given, none in the environment, and no `tb up` running here.
    #[error(
        "no cluster to talk to: give a cluster ticket (--join, TB_JOIN; a broker prints it) \
         or start one with `tb up`"
    )]
    NoCluster,
    /// A ticket (given, from the environment or from a file) is malformed or unreadable.
    #[error("the ticket {from}: {reason}")]
    Ticket {
        /// Where it came from.
        from: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The secret is unreadable or unusable.
    #[error(transparent)]
    Secret(#[from] SecretFileError),
}

/// `~/.local/share/tensor-broker/<role>`, the default data dir of a daemon role; `None`
/// without `$HOME`. Not created here.
pub fn default_data_dir(role: &str) -> Option<PathBuf> {
    let home = std::env::var_os("HOME")?;
    Some(
        PathBuf::from(home)
            .join(".local/share/tensor-broker")
            .join(role),
    )
}

/// Where `tb up` keeps its state, ticket and secret (`None` without `$HOME`).
pub fn up_dir() -> Option<PathBuf> {
    default_data_dir("up")
}

/// The cluster key from a secret given inline or a file holding one (or a read-only
/// credential); the open cluster's key when neither is given.
pub fn cluster_key(
    secret: Option<&str>,
    file: Option<&Path>,
) -> Result<ClusterKey, SecretFileError> {
    match (secret, file) {
        (Some(s), _) => Ok(parse_secret(s.as_bytes())?),
        (None, Some(path)) => read_secret_file(path),
        (None, None) => Ok(ClusterKey::open()),
    }
}

/// The cluster's ticket and key from what the caller gave (see the module doc for the
/// order). Environment variables are the caller's business (the CLI reads them through its
/// flags); [`resolve_env`] reads them too.
pub fn resolve(
    join: Option<Ticket>,
    secret_file: Option<&Path>,
    secret: Option<&str>,
) -> Result<(Ticket, ClusterKey), DiscoverError> {
    let up = up_dir();
    let from_up = join.is_none();
    let ticket = match (join, &up) {
        (Some(t), _) => t,
        (None, Some(dir)) if dir.join(UP_TICKET_FILE).exists() => {
            read_ticket(&dir.join(UP_TICKET_FILE))?
        }
        _ => return Err(DiscoverError::NoCluster),
    };
    let up_secret = up
        .map(|dir| dir.join(UP_SECRET_FILE))
        .filter(|f| from_up && f.exists());
    let file = secret_file.map(Path::to_path_buf).or(up_secret);
    let key = cluster_key(secret, file.as_deref())?;
    Ok((ticket, key))
}

/// [`resolve`], with [`JOIN_ENV`] and [`SECRET_FILE_ENV`] standing in for a ticket and a
/// secret file the caller did not give. `join` is a ticket string.
pub fn resolve_env(
    join: Option<&str>,
    secret_file: Option<&Path>,
    secret: Option<&str>,
) -> Result<(Ticket, ClusterKey), DiscoverError> {
    let env_join = std::env::var(JOIN_ENV)
        .ok()
        .filter(|s| !s.trim().is_empty());
    let (text, from) = match (join, &env_join) {
        (Some(j), _) => (Some(j), "given"),
        (None, Some(j)) => (Some(j.as_str()), JOIN_ENV),
        (None, None) => (None, ""),
    };
    let ticket = text.map(|t| parse_ticket(t, from)).transpose()?;
    let env_file = std::env::var_os(SECRET_FILE_ENV)
        .filter(|s| !s.is_empty())
        .map(PathBuf::from);
    let file = secret_file.map(Path::to_path_buf).or(env_file);
    resolve(ticket, file.as_deref(), secret)
}

fn parse_ticket(text: &str, from: &str) -> Result<Ticket, DiscoverError> {
    text.trim()
        .parse()
        .map_err(|e: crate::TicketError| DiscoverError::Ticket {
            from: from.into(),
            reason: e.to_string(),
        })
}

/// Writes a fresh random cluster secret to `path` (mode 0600), failing if the file exists.
pub fn create_secret_file(path: &Path) -> std::io::Result<()> {
    use std::io::Write;
    let secret = hex::encode(iroh::SecretKey::generate().to_bytes());
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    options
        .open(path)?
        .write_all(format!("{secret}\n").as_bytes())
}

/// Reads a ticket file (surrounding whitespace ignored).
pub fn read_ticket(path: &Path) -> Result<Ticket, DiscoverError> {
    let from = format!("in {}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| DiscoverError::Ticket {
        from: from.clone(),
        reason: e.to_string(),
    })?;
    parse_ticket(&text, &from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_ticket_and_secret_win() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("secret");
        std::fs::write(&file, "0123456789abcdef0123456789abcdef-a-secret\n").expect("write");
        let ticket = Ticket {
            brokers: vec![crate::PeerAddr {
                id: iroh::SecretKey::from_bytes(&[1; 32]).public(),
                addr: ([127, 0, 0, 1], 7410).into(),
            }],
        };
        let (t, key) = resolve(Some(ticket.clone()), Some(&file), None).expect("resolves");
        assert_eq!(t, ticket);
        assert!(!key.is_open());
        let (_, open) = resolve(Some(ticket), None, None).expect("resolves");
        assert!(open.is_open());
    }

    #[test]
    fn bad_tickets_and_secrets_say_where_they_came_from() {
        let err = parse_ticket("nope", JOIN_ENV).expect_err("not a ticket");
        assert!(err.to_string().contains(JOIN_ENV), "{err}");
        let missing = Path::new("/nonexistent/tb-secret");
        let err = cluster_key(None, Some(missing)).expect_err("no file");
        assert!(err.to_string().contains("/nonexistent/tb-secret"), "{err}");
        assert!(cluster_key(Some("short"), None).is_err());
    }

    #[test]
    fn a_new_secret_file_is_private_and_usable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("secret");
        create_secret_file(&file).expect("created");
        assert!(create_secret_file(&file).is_err(), "never overwrites");
        assert!(!cluster_key(None, Some(&file)).expect("key").is_open());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&file).expect("meta").permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
