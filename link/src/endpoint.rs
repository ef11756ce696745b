//! The offline iroh endpoint (no relays, no address lookup), identity keys, and the node
//! address string users copy around: `<node-id>@<ip:port>`.
//!
//! # Flow control is the memory bound
//!
//! A QUIC peer can only send what the receiver's windows allow, so the windows set here are
//! what any peer can make this node buffer. Every connection starts with the *pre-auth*
//! limits of [`transport_config`]: one bidirectional stream (the hello's), no unidirectional
//! ones, no datagrams, and a connection window of [`PREAUTH_RECEIVE_WINDOW`] across all
//! streams. A peer that has not proved the cluster secret can therefore make the node buffer
//! at most that many bytes, however many streams it tries to open (opening more is a QUIC
//! protocol violation that closes its connection). Once the hello is verified both sides
//! [`open_link`]: the peer may open [`LinkConfig::max_concurrent_streams`] streams and the
//! connection window becomes [`LINK_RECEIVE_WINDOW`]. Protocols without a hello (gossip)
//! get [`OPEN_PROTOCOL_RECEIVE_WINDOW`] and a few unidirectional streams at the end of the
//! QUIC handshake instead.
//!
//! [`LinkConfig::max_concurrent_streams`]: crate::LinkConfig::max_concurrent_streams

use std::{
    fmt,
    io::Write,
    net::SocketAddr,
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use iroh::{
    Endpoint, EndpointAddr, EndpointId, RelayMode, SecretKey,
    endpoint::{
        AckFrequencyConfig, AfterHandshakeOutcome, Connection, EndpointHooks, MtuDiscoveryConfig,
        PortmapperConfig, QuicTransportConfig, VarInt, presets,
    },
};

use crate::error::{Error, Result};

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

/// The key in a key file's text: 64 hex characters, surrounding white space ignored. Total:
/// any other text is an `Io` error naming the file, never a panic.
fn parse_key(path: &Path, text: &str) -> Result<SecretKey> {
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(text.trim(), &mut bytes).map_err(|e| {
        Error::io(
            &format!("{}: not a node key (64 hex characters)", path.display()),
            e,
        )
    })?;
    Ok(SecretKey::from_bytes(&bytes))
}

fn create_key(dir: &Path, path: &PathBuf) -> Result<SecretKey> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(&format!("creating {}", dir.display()), e))?;
    let key = SecretKey::generate();
    let hex = hex::encode(key.to_bytes());
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

/// Receive window of each stream, in bytes: noq's default (100 ms at 100 Mbit/s), set
/// explicitly because larger ones break (IROH-NOTES: a stream window above ~1.4 MB aborts
/// connections in noq 1.4, quinn#2809) and measured no faster.
pub const STREAM_RECEIVE_WINDOW: u32 = 1_250_000;

/// Streams of one link the data path expects to be receiving at full speed at once (a
/// striped transfer, or several pulls from one peer).
pub const LINK_PARALLEL_STREAMS: u32 = 8;

/// Connection-level receive window of an authenticated link, in bytes: the rule is one
/// [`STREAM_RECEIVE_WINDOW`] for each of [`LINK_PARALLEL_STREAMS`] streams (10 MB), so that
/// many streams can run at full window together while one link never holds more than this
/// of the node's memory (without it, the bound was streams × stream window: 1.25 GB).
/// Striping over more streams than this shares the window; raise the stream count here, not
/// the stream window.
pub const LINK_RECEIVE_WINDOW: u32 = STREAM_RECEIVE_WINDOW * LINK_PARALLEL_STREAMS;

/// Connection-level receive window until the peer's hello is verified, in bytes: room for a
/// hello frame ([`MAX_HELLO_FRAME`](tb_proto::MAX_HELLO_FRAME) + prefix) and the reply, and
/// all a peer that has not authenticated can make the node buffer per connection.
pub const PREAUTH_RECEIVE_WINDOW: u32 = 4 << 10;

/// Bidirectional streams a peer may open until its hello is verified: the hello's own.
pub const PREAUTH_STREAMS: u32 = 1;

/// Connection-level receive window of protocols without a hello (iroh-gossip), in bytes:
/// sixteen of gossip's largest messages (4 KiB, IROH-NOTES) in flight.
pub const OPEN_PROTOCOL_RECEIVE_WINDOW: u32 = 64 << 10;

/// Unidirectional streams a peer of a protocol without a hello may open (iroh-gossip opens
/// one per topic and direction).
pub const OPEN_PROTOCOL_UNI_STREAMS: u32 = 8;

// No ACK frequency extension. Asking peers to ACK within 1 ms (QUIC's default delay is
// 25 ms, which is also what a sender adds to its probe timeout, the only thing that recovers
// a lost *last* packet of a flight) cut the p99 of 1-2 MiB QUIC pushes on a busy 2-core
// machine from 29-58 ms to 5-7 ms. But noq-proto 1.4.0 writes the ACK_FREQUENCY frame
// without checking the packet's remaining space (`populate_packet`, unlike the frames around
// it), and a full packet then panics in the connection driver ("advance out of bounds: the
// len is 0 but advancing by 2"), seen once in about ten benchmark runs: a node whose
// endpoint panicked is dead. Turn it back on (`AckFrequencyConfig`, `max_ack_delay` 1 ms)
// once the QUIC stack checks that space.

/// ALPNs that start with this open with the cluster-secret hello (`tb/data/1`, `tb/ctl/1`)
/// and keep the pre-auth limits until it is verified; any other protocol on the endpoint
/// (gossip) gets the open-protocol limits when its QUIC handshake ends.
pub const HELLO_ALPN_PREFIX: &[u8] = b"tb/";

// The rules above, checked when the crate compiles.
const _: () = {
    assert!(
        STREAM_RECEIVE_WINDOW <= 1_400_000,
        "IROH-NOTES: larger stream windows break"
    );
    let hello = tb_proto::MAX_HELLO_FRAME as usize + tb_proto::LEN_PREFIX;
    assert!(
        hello <= PREAUTH_RECEIVE_WINDOW as usize,
        "a hello must fit the pre-auth window"
    );
};

/// The longest a peer may hold back an ACK, asked of it with QUIC's ACK frequency extension
/// (every tensor-broker endpoint speaks it): 1 ms instead of QUIC's default 25 ms.
///
/// Bulk data both ways on one link (concurrent calls: arguments one way, results the other)
/// stalled with the default: on this 2-core VM, 16 MiB gets both ways at once on one link
/// moved 107-125 MB/s with single gets stalled up to 1.5 s, against 400-430 MB/s one way
/// at a time (and 490 MB/s both ways over two links): most likely each side held back its
/// ACKs of the other's data up to 25 ms while its own data went out, and the other sender,
/// clocked by those ACKs, waited with them. With 1 ms: 240-290 MB/s both ways, worst get 0.45-0.55 s; 16 MiB calls over QUIC
/// with 8 and 64 callers 12-16 -> 23-25 and 7-9 -> 21-22 calls/s; one-way transfers and
/// 4 KiB round trips within this VM's noise. (Looser loss detection, NewReno and a larger
/// initial window did not help; a smaller connection window ended UDP receive-buffer drops
/// but not the stalls.)
pub const MAX_ACK_DELAY: Duration = Duration::from_millis(1);

/// How often peers acknowledge: after every second ack-eliciting packet (QUIC's default),
/// and within [`MAX_ACK_DELAY`] otherwise.
fn ack_frequency() -> AckFrequencyConfig {
    let mut config = AckFrequencyConfig::default();
    config
        .ack_eliciting_threshold(VarInt::from_u32(1))
        .max_ack_delay(Some(MAX_ACK_DELAY));
    config
}

/// The QUIC settings every tensor-broker endpoint uses: the pre-auth limits every connection
/// starts with (see the module doc), explicit stream windows (IROH-NOTES: keep them at
/// iroh's default), MTU discovery capped at the largest UDP payload iroh sends, and prompt
/// ACKs ([`MAX_ACK_DELAY`]).
pub fn transport_config() -> QuicTransportConfig {
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(1472);
    QuicTransportConfig::builder()
        .max_concurrent_bidi_streams(VarInt::from_u32(PREAUTH_STREAMS))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .stream_receive_window(VarInt::from_u32(STREAM_RECEIVE_WINDOW))
        .receive_window(VarInt::from_u32(PREAUTH_RECEIVE_WINDOW))
        .datagram_receive_buffer_size(None)
        .mtu_discovery_config(Some(mtu))
        .ack_frequency_config(Some(ack_frequency()))
        .build()
}

/// Raises `conn`'s limits from the pre-auth ones to an authenticated link's: the peer may
/// open `max_streams` bidirectional streams and send [`LINK_RECEIVE_WINDOW`] bytes ahead.
/// Both sides call it once the hello is verified (the hello functions do).
pub fn open_link(conn: &Connection, max_streams: u32) {
    conn.set_max_concurrent_bi_streams(VarInt::from_u32(max_streams));
    conn.set_receive_window(VarInt::from_u32(LINK_RECEIVE_WINDOW));
}

/// Gives connections of protocols without a hello (gossip) their limits when the QUIC
/// handshake ends, in both directions; `tb/` protocols keep the pre-auth ones.
#[derive(Debug)]
struct OpenProtocolLimits;

impl EndpointHooks for OpenProtocolLimits {
    async fn after_handshake<'a>(&'a self, conn: &'a Connection) -> AfterHandshakeOutcome {
        if !conn.alpn().starts_with(HELLO_ALPN_PREFIX) {
            conn.set_max_concurrent_uni_streams(VarInt::from_u32(OPEN_PROTOCOL_UNI_STREAMS));
            conn.set_receive_window(VarInt::from_u32(OPEN_PROTOCOL_RECEIVE_WINDOW));
        }
        AfterHandshakeOutcome::accept()
    }
}

/// Binds an offline endpoint: no relays, no address lookup, no port mapping, and one UDP
/// socket on `bind_addr` only (iroh's default sockets on `0.0.0.0` and `[::]` are cleared,
/// so the node listens on nothing it was not given).
pub async fn bind_endpoint(bind_addr: SocketAddr, key: SecretKey) -> Result<Endpoint> {
    let builder = Endpoint::builder(presets::Minimal)
        .relay_mode(RelayMode::Disabled)
        .clear_address_lookup()
        .portmapper_config(PortmapperConfig::Disabled)
        .net_report_config(iroh::NetReportConfig::minimal())
        .transport_config(transport_config())
        .hooks(OpenProtocolLimits)
        .secret_key(key)
        .clear_ip_transports()
        .bind_addr(bind_addr)
        .map_err(|e| Error::io(&format!("bind address {bind_addr}"), e))?;
    builder
        .bind()
        .await
        .map_err(|e| Error::io(&format!("binding endpoint on {bind_addr}"), e))
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

    #[test]
    fn non_ascii_key_file_of_64_bytes_is_an_error_not_a_panic() {
        let path = Path::new("node.key");
        // 64 bytes, but 'é' is two bytes: slicing at byte 2*i used to split a character.
        let text = format!("a{}", "é".repeat(31)) + "b";
        assert_eq!(text.len(), 64);
        match parse_key(path, &text) {
            Err(Error::Io(msg)) => assert!(msg.contains("node.key"), "{msg}"),
            other => panic!("expected Io, got {other:?}"),
        }
        let valid = hex::encode([7u8; 32]);
        let key = parse_key(path, &format!("  {valid}\n")).expect("valid key");
        assert_eq!(key.to_bytes(), [7u8; 32]);
        assert!(parse_key(path, &valid.to_uppercase()).is_ok());
    }

    proptest::proptest! {
        #[test]
        fn parse_key_never_panics(
            chars in proptest::collection::vec(
                proptest::sample::select(vec!['0', '9', 'a', 'F', 'g', ' ', '\n', 'é', '€', '😀']),
                0..70,
            ),
            text in "\\PC{0,80}",
        ) {
            let path = Path::new("node.key");
            // Mostly hex-looking text of every byte length around 64, with multi-byte
            // characters anywhere; then arbitrary text.
            let _ = parse_key(path, &chars.into_iter().collect::<String>());
            let _ = parse_key(path, &text);
        }
    }

    #[test]
    fn hello_protocols_keep_the_pre_auth_limits() {
        for alpn in [tb_proto::DATA_ALPN, tb_proto::CTL_ALPN] {
            assert!(alpn.starts_with(HELLO_ALPN_PREFIX));
        }
        assert_eq!(LINK_RECEIVE_WINDOW, 10_000_000);
    }
}
