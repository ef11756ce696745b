//! The offline iroh endpoint (no relays, no address lookup), identity keys, and the node
//! address string users copy around: `<node-id>@<ip:port>`.

use std::{
    fmt,
    io::Write,
    net::SocketAddr,
    path::{Path, PathBuf},
    str::FromStr,
};

use iroh::{
    Endpoint, EndpointAddr, EndpointId, RelayMode, SecretKey,
    endpoint::{MtuDiscoveryConfig, PortmapperConfig, QuicTransportConfig, VarInt, presets},
};

use crate::{
    config::Config,
    error::{Error, Result},
};

/// File in the data dir holding the node's secret key (hex), created with mode 0600.
pub const KEY_FILE: &str = "node.key";

/// A peer's address: its node id (public key) and the UDP address it listens on.
///
/// Written and parsed as `<node-id>@<ip:port>`, the form `Node::addr()` prints.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerAddr {
    /// The peer's node id (iroh public key).
    pub id: EndpointId,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl PeerAddr {
    /// The iroh form, for dialing.
    pub fn to_endpoint_addr(&self) -> EndpointAddr {
        EndpointAddr::new(self.id).with_ip_addr(self.addr)
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.id, self.addr)
    }
}

impl FromStr for PeerAddr {
    type Err = Error;

    fn from_str(input: &str) -> Result<Self> {
        let bad = |reason: &str| Error::BadAddress {
            input: input.chars().take(200).collect(),
            reason: reason.to_string(),
        };
        let trimmed = input.trim();
        let (id, addr) = trimmed
            .split_once('@')
            .ok_or_else(|| bad("missing '@' between node id and address"))?;
        if id.is_empty() {
            return Err(bad("empty node id"));
        }
        let id = EndpointId::from_str(id)
            .map_err(|e| bad(&format!("node id is not a valid public key ({e})")))?;
        let addr = SocketAddr::from_str(addr)
            .map_err(|e| bad(&format!("address is not ip:port ({e})")))?;
        if addr.port() == 0 {
            return Err(bad("port 0 cannot be dialed"));
        }
        Ok(PeerAddr { id, addr })
    }
}

/// Loads the secret key from `<dir>/node.key`, or creates it there (mode 0600) on first run.
pub fn load_or_create_key(dir: &Path) -> Result<SecretKey> {
    let path = dir.join(KEY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_key(&path, &text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => create_key(dir, &path),
        Err(e) => Err(Error::io(&format!("reading {}", path.display()), e)),
    }
}

fn parse_key(path: &Path, text: &str) -> Result<SecretKey> {
    let hex = text.trim();
    let mut bytes = [0u8; 32];
    if hex.len() != 64 {
        return Err(Error::Io(format!(
            "{}: expected 64 hex characters, found {}",
            path.display(),
            hex.len()
        )));
    }
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|e| Error::io(&format!("{}: not hex", path.display()), e))?;
    }
    Ok(SecretKey::from_bytes(&bytes))
}

fn create_key(dir: &Path, path: &PathBuf) -> Result<SecretKey> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(&format!("creating {}", dir.display()), e))?;
    let key = SecretKey::generate();
    let hex: String = key.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .map_err(|e| Error::io(&format!("creating {}", path.display()), e))?;
    file.write_all(hex.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::io(&format!("writing {}", path.display()), e))?;
    Ok(key)
}

/// The QUIC settings every tensor-broker endpoint uses (see IROH-NOTES: keep iroh's windows,
/// cap MTU discovery at the largest UDP payload iroh sends).
pub fn transport_config(config: &Config) -> QuicTransportConfig {
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(1472);
    QuicTransportConfig::builder()
        .max_concurrent_bidi_streams(VarInt::from_u32(config.max_concurrent_streams))
        .mtu_discovery_config(Some(mtu))
        .build()
}

/// Binds an offline endpoint: no relays, no address lookup, no port mapping.
pub async fn bind_endpoint(config: &Config, key: SecretKey) -> Result<Endpoint> {
    let builder = Endpoint::builder(presets::Minimal)
        .relay_mode(RelayMode::Disabled)
        .clear_address_lookup()
        .portmapper_config(PortmapperConfig::Disabled)
        .net_report_config(iroh::NetReportConfig::minimal())
        .transport_config(transport_config(config))
        .secret_key(key)
        .bind_addr(config.bind_addr)
        .map_err(|e| Error::io(&format!("bind address {}", config.bind_addr), e))?;
    builder
        .bind()
        .await
        .map_err(|e| Error::io(&format!("binding endpoint on {}", config.bind_addr), e))
}

/// The address peers should dial: the first bound socket, with an unspecified IP replaced by
/// loopback so the string is dialable on this machine.
pub fn local_peer_addr(endpoint: &Endpoint) -> Result<PeerAddr> {
    let mut addr = endpoint
        .bound_sockets()
        .into_iter()
        .next()
        .ok_or_else(|| Error::Io("endpoint has no bound socket".into()))?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    Ok(PeerAddr {
        id: endpoint.id(),
        addr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PeerAddr {
        PeerAddr {
            id: SecretKey::generate().public(),
            addr: "127.0.0.1:4000".parse().expect("addr"),
        }
    }

    #[test]
    fn peer_addr_round_trips() {
        let addr = sample();
        let parsed: PeerAddr = addr.to_string().parse().expect("parse");
        assert_eq!(parsed, addr);
    }

    #[test]
    fn bad_addresses_are_bad_address() {
        let id = sample().id;
        for input in [
            String::new(),
            "nonsense".into(),
            "@127.0.0.1:4000".into(),
            "abc@127.0.0.1:4000".into(),
            format!("{id}@"),
            format!("{id}@localhost:4000"),
            format!("{id}@127.0.0.1"),
            format!("{id}@127.0.0.1:0"),
            format!("{id}@127.0.0.1:99999"),
        ] {
            match input.parse::<PeerAddr>() {
                Err(Error::BadAddress { .. }) => {}
                other => panic!("{input:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn key_is_created_private_and_reloaded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = load_or_create_key(dir.path()).expect("create");
        let again = load_or_create_key(dir.path()).expect("load");
        assert_eq!(first.public(), again.public());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(KEY_FILE))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn corrupt_key_file_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(KEY_FILE), "zz").expect("write");
        assert!(matches!(load_or_create_key(dir.path()), Err(Error::Io(_))));
    }
}
