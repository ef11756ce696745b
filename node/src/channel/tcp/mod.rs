//! The `tcp` channel: plain TCP for trusted networks (opt-in with `--channels tcp,...`).
//!
//! Pulls only (a push is small next to what it replaces, and the receiver must be the one
//! that connects). The puller asks for a ticket on the authenticated QUIC link
//! ([`DataRequest::TcpPull`](tb_proto::DataRequest::TcpPull)); the holder answers with the
//! version's header and a random one-time token
//! ([`DataResponse::TcpTicket`](tb_proto::DataResponse::TcpTicket)) that admits at most the
//! asked number of sockets, for a short time, to that one version (a tensor under
//! [`TCP_MIN_BYTES`], a version still arriving, device bytes or an upload limit get an
//! ordinary QUIC answer on that stream instead: header and payload). The puller connects to
//! the holder's advertised port at the IP its QUIC path reaches, and each socket's first
//! frame ([`TcpHello`](tb_proto::TcpHello)) presents the token and the byte range it wants;
//! a socket without a valid token is closed before any tensor byte is written, and counted
//! (`tb_channel_refused_total{channel="tcp"}`). Bytes then move in large writes, a large
//! tensor over several sockets ([`sockets_for`]).
//!
//! Integrity: none from TCP itself. The payload is cut into BLAKE3-subtree pieces
//! ([`verify`](super::verify)), each socket hashes its pieces as their bytes land (on the
//! blake3 crate's rayon pool for large batches), and the merged root must equal the hash
//! in the ticket, which came over the authenticated link: tampered or truncated bytes are
//! a `Corrupt` error, never a visible version. A socket that fails part-way is finished over
//! QUIC from the byte it reached (range pulls on the link), and the fallback counted.
//! Confidentiality: none — names travel in the QUIC link, but tensor bytes are plain on the
//! wire, which is why the channel is opt-in.

mod client;
mod serve;

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use bytes::Bytes;
use iroh::EndpointId;
use tb_proto::{ByteRange, ChannelOffer, channel::MAX_TCP_SOCKETS};

pub(crate) use serve::{serve_ticket, spawn_listener};

use crate::{
    LinkGuard,
    error::{Error, Result},
    tensor::Tensor,
};

/// Sockets a puller asks a ticket for (it opens fewer for smaller tensors).
const SOCKETS: u8 = 4;
const _: () = assert!(SOCKETS <= MAX_TCP_SOCKETS);
/// The least each socket carries: below it one more connection costs more than it wins.
const SOCKET_MIN_BYTES: u64 = 16 << 20;
/// Tensors smaller than this are served over QUIC on the ticket's own stream: a ticket
/// round trip and a connection cost more than TCP wins on them.
const TCP_MIN_BYTES: u64 = 1 << 20;
/// Outstanding tickets per node; a pull asking beyond it is answered over QUIC on its own
/// stream.
const MAX_TICKETS: usize = 256;
/// Sockets served at once per node (counted from the admission of their token); more are
/// closed unserved (their pullers fall back).
const MAX_SERVING: usize = 64;
/// Sockets awaiting their hello at once per node (each holds a few bytes for at most the
/// hello timeout); more are closed at once.
const MAX_HELLOS: usize = 256;

/// How many sockets a pull of `len` bytes opens: one per [`SOCKET_MIN_BYTES`], at least
/// one, at most [`SOCKETS`].
pub(crate) fn sockets_for(len: u64) -> usize {
    (len / SOCKET_MIN_BYTES).clamp(1, SOCKETS as u64) as usize
}

/// One ticket: the version it admits sockets to, how many more, until when.
struct Ticket {
    tensor: Tensor,
    sockets_left: u8,
    expires: Instant,
}

/// This node's end of the TCP channel: the listener's port and the outstanding tickets.
pub(crate) struct Tcp {
    port: u16,
    listener: Mutex<Option<std::net::TcpListener>>,
    tickets: Mutex<HashMap<[u8; 32], Ticket>>,
}

impl std::fmt::Debug for Tcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tcp").field("port", &self.port).finish()
    }
}

/// Why a socket was refused before any tensor byte.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No outstanding ticket has this token (never issued, used up, or expired).
    #[error("no ticket for the presented token")]
    UnknownToken,
    /// The range is not within the ticket's tensor.
    #[error("range {0:?} is outside the ticket's {1} bytes")]
    Range(ByteRange, u64),
}

impl Tcp {
    /// Binds a listener on `ip`, any port (the accept loop starts with [`spawn_listener`]).
    pub(crate) fn bind(ip: IpAddr) -> Result<Tcp> {
        let listener = std::net::TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(&format!("binding the TCP channel on {ip}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("binding the TCP channel", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io("binding the TCP channel", e))?
            .port();
        Ok(Tcp {
            port,
            listener: Mutex::new(Some(listener)),
            tickets: Mutex::new(HashMap::new()),
        })
    }

    /// The offer every peer gets (tokens are per transfer, not per peer).
    pub(crate) fn offer(&self) -> ChannelOffer {
        ChannelOffer::Tcp { port: self.port }
    }

    fn tickets(&self) -> MutexGuard<'_, HashMap<[u8; 32], Ticket>> {
        self.tickets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Issues a ticket to `tensor`, valid for `ttl`, for the sockets the puller will open:
    /// `sockets` at most, and no more than [`sockets_for`] its size (so no slot of a ticket
    /// is left unused to outlive the transfer); `None` when [`MAX_TICKETS`] are outstanding.
    pub(crate) fn issue(
        &self,
        tensor: Tensor,
        sockets: u8,
        ttl: Duration,
    ) -> Result<Option<[u8; 32]>> {
        let mut token = [0u8; 32];
        super::fill_random(&mut token)?;
        let now = Instant::now();
        let mut tickets = self.tickets();
        tickets.retain(|_, t| t.expires > now);
        if tickets.len() >= MAX_TICKETS {
            return Ok(None);
        }
        let sockets = sockets.min(sockets_for(tensor.byte_len()) as u8);
        let ticket = Ticket {
            tensor,
            sockets_left: sockets,
            expires: now + ttl,
        };
        tickets.insert(token, ticket);
        Ok(Some(token))
    }

    /// Admits one socket that presented `token` for `range`: the bytes to write. Uses one
    /// of the ticket's sockets; the last one removes it.
    pub(crate) fn admit(&self, token: &[u8; 32], range: ByteRange) -> Result<Bytes, Refusal> {
        let now = Instant::now();
        let mut tickets = self.tickets();
        // Expired tickets go here too, so a holder that stops issuing frees their versions.
        tickets.retain(|_, t| t.expires > now);
        let ticket = tickets
            .get_mut(token)
            .filter(|t| t.expires > now)
            .ok_or(Refusal::UnknownToken)?;
        let len = ticket.tensor.byte_len();
        let bytes = crate::serve::byte_range(len, Some(range))
            .and_then(|r| ticket.tensor.host_data().map(|data| data.slice(r)))
            .ok_or(Refusal::Range(range, len))?;
        ticket.sockets_left = ticket.sockets_left.saturating_sub(1);
        if ticket.sockets_left == 0 {
            tickets.remove(token);
        }
        Ok(bytes)
    }
}

/// What a pull from one peer over TCP needs: the link its ticket is asked on (held for the
/// transfer, and for the QUIC fallback) and the address of the peer's listener.
pub(crate) struct TcpRoute {
    link: LinkGuard,
    addr: SocketAddr,
}

impl TcpRoute {
    /// The route over `link` to the peer's listener on `port`, at the IP of the link's
    /// selected path (`None` when that is not a direct IP path).
    pub(crate) fn new(link: LinkGuard, port: u16) -> Option<TcpRoute> {
        let ip = super::selected_addr(&link)?.ip();
        Some(TcpRoute {
            link,
            addr: SocketAddr::new(ip, port),
        })
    }

    /// The peer.
    pub(crate) fn peer(&self) -> EndpointId {
        self.link.peer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(len: usize) -> Tensor {
        let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
        Tensor::new(tb_proto::DType::U8, vec![len as u64], bytes).expect("tensor")
    }

    fn range(offset: u64, len: u64) -> ByteRange {
        ByteRange { offset, len }
    }

    #[test]
    fn a_ticket_admits_its_sockets_once_each_and_only_its_ranges() {
        let tcp = Tcp::bind(IpAddr::from([127, 0, 0, 1])).expect("bind");
        let ttl = Duration::from_secs(60);
        let token = tcp
            .issue(tensor(1000), 2, ttl)
            .expect("issue")
            .expect("room");
        assert_eq!(tcp.admit(&[0; 32], range(0, 1)), Err(Refusal::UnknownToken));
        let outside = range(990, 20);
        assert_eq!(
            tcp.admit(&token, outside),
            Err(Refusal::Range(outside, 1000))
        );
        // Asked for 2 sockets, but 1000 bytes ride one: the ticket admits one.
        let first = tcp.admit(&token, range(500, 500)).expect("the socket");
        assert_eq!(first.len(), 500);
        assert_eq!(first[0], (500 % 256) as u8);
        // Used up: a second socket (a replay of the token) is refused.
        assert_eq!(tcp.admit(&token, range(0, 1)), Err(Refusal::UnknownToken));
        // A large tensor's ticket admits as many sockets as it was asked for.
        let len = SOCKET_MIN_BYTES * 2;
        let big = Tensor::new(tb_proto::DType::U8, vec![len], vec![7u8; len as usize]);
        let token = tcp.issue(big.expect("tensor"), 2, ttl).expect("issue");
        let token = token.expect("room");
        for _ in 0..2 {
            tcp.admit(&token, range(0, 1)).expect("a socket");
        }
        assert_eq!(tcp.admit(&token, range(0, 1)), Err(Refusal::UnknownToken));
    }

    #[test]
    fn expired_tickets_admit_nothing_and_tickets_are_bounded() {
        let tcp = Tcp::bind(IpAddr::from([127, 0, 0, 1])).expect("bind");
        let token = tcp
            .issue(tensor(10), 1, Duration::ZERO)
            .expect("issue")
            .expect("room");
        assert_eq!(tcp.admit(&token, range(0, 10)), Err(Refusal::UnknownToken));
        let ttl = Duration::from_secs(60);
        for _ in 0..MAX_TICKETS {
            assert!(tcp.issue(tensor(1), 1, ttl).expect("issue").is_some());
        }
        assert!(tcp.issue(tensor(1), 1, ttl).expect("issue").is_none());
    }

    #[test]
    fn socket_counts_follow_the_size() {
        assert_eq!(sockets_for(0), 1);
        assert_eq!(sockets_for(SOCKET_MIN_BYTES * 2), 2);
        assert_eq!(sockets_for(1 << 40), SOCKETS as usize);
    }
}
