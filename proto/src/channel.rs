//! Data channels: how the payload of a transfer moves between two peers once their iroh QUIC
//! link has authenticated them.
//!
//! The link (`tb/data/1`) always carries the control frames and is always usable: it is the
//! default between hosts and the fallback for every other channel. On first contact each side
//! sends the other a [`ChannelOffer`] per extra channel it runs, with what the other needs to
//! open it ([`DataRequest::Channels`](crate::DataRequest::Channels) and its answer); a pair
//! then uses, per transfer, the first kind in the node's order ([`ChannelKind`], the
//! `--channels` option) that both offered.
//!
//! Offers travel only inside the authenticated, encrypted QUIC link, so what they carry (a
//! socket name, a token) is known to that peer alone.

use serde::{Deserialize, Serialize};

use crate::{Access, ByteRange};

/// Most offers one side sends (one per channel kind, with room for later kinds).
pub const MAX_CHANNEL_OFFERS: usize = 8;

/// Bytes of a same-host socket's random abstract name.
pub const SHM_SOCKET_NAME_LEN: usize = 16;

/// One kind of data channel, named as in `--channels`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ChannelKind {
    /// Same-host shared memory: sealed memfds passed over a Unix socket whose abstract name
    /// only the peer learned (Linux). Requests of the pair ride the socket too.
    Shm,
    /// iroh QUIC streams on the pooled link (striped over several for large tensors):
    /// encrypted, always available.
    Quic,
    /// Plain TCP sockets to the sender's advertised port, admitted by a one-time token handed
    /// over the link, every piece BLAKE3-verified. Not encrypted: opt-in, for trusted networks.
    Tcp,
}

impl ChannelKind {
    /// Every kind, in the default order of preference.
    pub const ALL: [ChannelKind; 3] = [ChannelKind::Shm, ChannelKind::Quic, ChannelKind::Tcp];

    /// The default `--channels`: `shm,quic` (`tcp` is opt-in because it is not encrypted).
    pub const DEFAULT: [ChannelKind; 2] = [ChannelKind::Shm, ChannelKind::Quic];

    /// The name used in `--channels`, metrics labels and `tb status`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ChannelKind::Shm => "shm",
            ChannelKind::Quic => "quic",
            ChannelKind::Tcp => "tcp",
        }
    }

    /// Parses a comma-separated list such as `shm,quic`: every name known, none twice, not
    /// empty. `quic` is added at the end when missing, because it is the fallback of every
    /// other channel (a node cannot run without it).
    pub fn parse_list(list: &str) -> Result<Vec<ChannelKind>, ChannelListError> {
        let mut kinds = Vec::new();
        for word in list.split(',').map(str::trim) {
            if word.is_empty() {
                continue;
            }
            let kind = word
                .parse::<ChannelKind>()
                .map_err(|_| ChannelListError::Unknown(word.to_owned()))?;
            if kinds.contains(&kind) {
                return Err(ChannelListError::Repeated(kind));
            }
            kinds.push(kind);
        }
        if kinds.is_empty() {
            return Err(ChannelListError::Empty);
        }
        if !kinds.contains(&ChannelKind::Quic) {
            kinds.push(ChannelKind::Quic);
        }
        Ok(kinds)
    }
}

impl std::fmt::Display for ChannelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ChannelKind {
    type Err = ChannelListError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ChannelKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| ChannelListError::Unknown(s.to_owned()))
    }
}

/// Why a `--channels` list is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelListError {
    /// A name that is no channel.
    #[error("unknown channel \"{0}\" (known: shm, quic, tcp)")]
    Unknown(String),
    /// A channel named twice.
    #[error("channel \"{0}\" is named twice")]
    Repeated(ChannelKind),
    /// No channel named.
    #[error("no channel named (e.g. \"shm,quic\")")]
    Empty,
}

/// What one side tells the other it runs, with what the other needs to open it. QUIC is not
/// offered: every link has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChannelOffer {
    /// A Unix socket in the abstract namespace (reachable only from the same host and network
    /// namespace), and the token that admits this peer on it (a MAC of the peer's id and
    /// access under a key that never leaves the offering process).
    Shm {
        /// The abstract socket name (without the leading NUL).
        socket: [u8; SHM_SOCKET_NAME_LEN],
        /// Presented as the first frame on the socket.
        token: [u8; 32],
    },
    /// A TCP listener on the offering node's host, at the IP the peer reaches its QUIC
    /// endpoint at. Each transfer hands out its own one-time token
    /// ([`DataResponse::TcpTicket`](crate::DataResponse::TcpTicket)).
    Tcp {
        /// The listening port.
        port: u16,
    },
}

impl ChannelOffer {
    /// The channel this offer is for.
    pub fn kind(&self) -> ChannelKind {
        match self {
            ChannelOffer::Shm { .. } => ChannelKind::Shm,
            ChannelOffer::Tcp { .. } => ChannelKind::Tcp,
        }
    }
}

/// Checks a peer's offers: at most [`MAX_CHANNEL_OFFERS`], one per kind.
pub fn validate_offers(offers: &[ChannelOffer]) -> Result<(), OfferError> {
    if offers.len() > MAX_CHANNEL_OFFERS {
        return Err(OfferError::TooMany(offers.len()));
    }
    for (i, offer) in offers.iter().enumerate() {
        if offers[..i].iter().any(|o| o.kind() == offer.kind()) {
            return Err(OfferError::Repeated(offer.kind()));
        }
    }
    Ok(())
}

/// Why a peer's channel offers were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OfferError {
    /// More offers than [`MAX_CHANNEL_OFFERS`].
    #[error("{0} channel offers, the limit is {MAX_CHANNEL_OFFERS}")]
    TooMany(usize),
    /// Two offers for one kind.
    #[error("two offers for channel {0}")]
    Repeated(ChannelKind),
    /// A TCP pull asking for no sockets or too many.
    #[error("a TCP pull on {0} sockets, the limit is 1 to {MAX_TCP_SOCKETS}")]
    TcpSockets(u8),
}

/// The most sockets one TCP-channel transfer may open (and a holder admits per ticket).
pub const MAX_TCP_SOCKETS: u8 = 8;

/// Checks the socket count of a [`DataRequest::TcpPull`](crate::DataRequest::TcpPull).
pub fn validate_tcp_sockets(sockets: u8) -> Result<(), OfferError> {
    if (1..=MAX_TCP_SOCKETS).contains(&sockets) {
        Ok(())
    } else {
        Err(OfferError::TcpSockets(sockets))
    }
}

/// The channel a pair uses: the first kind in `order` (the local node's preference) that the
/// peer offered or that needs no offer (QUIC), among those `usable` allows (e.g. the kinds
/// whose offer the local node could act on). QUIC when nothing else matches.
pub fn pick(
    order: &[ChannelKind],
    offered: &[ChannelOffer],
    usable: impl Fn(ChannelKind) -> bool,
) -> ChannelKind {
    order
        .iter()
        .copied()
        .find(|&kind| {
            (kind == ChannelKind::Quic || offered.iter().any(|o| o.kind() == kind)) && usable(kind)
        })
        .unwrap_or(ChannelKind::Quic)
}

/// The first frame on a same-host socket, from the connecting side: who it is, the access it
/// proved on the QUIC link, and the token the socket's owner gave it for exactly these two.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmHello {
    /// The connecting node's id (its iroh public key).
    pub node: [u8; 32],
    /// The access that node proved on the QUIC link.
    pub access: Access,
    /// From the owner's [`ChannelOffer::Shm`] to that node.
    pub token: [u8; 32],
}

/// Largest [`ShmHello`] frame body, in bytes (it is about 70).
pub const MAX_SHM_HELLO_FRAME: u32 = 128;

/// On a same-host socket, how the payload after a `Header` (pull) or a `Push` travels. A
/// pull that the socket cannot serve (a version still arriving, device bytes) is answered
/// with an `Error` of code `Busy` instead of a header: pull it over QUIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShmPayload {
    /// The payload bytes follow this frame on the socket.
    Inline,
    /// The payload is at `offset` of the sealed memfd passed with this frame (SCM_RIGHTS);
    /// its length is the header's (or the requested range's).
    Memfd {
        /// Where the payload starts in the memfd.
        offset: u64,
    },
    /// The payload bytes follow this frame on the socket, then the 32 bytes of their BLAKE3
    /// hash: a push whose sender hashed the bytes as it wrote them (the request's metadata
    /// carries no hash). The receiver hashes what arrives and refuses it unless the two
    /// agree; the version's hash is then that one.
    InlineHashAfter,
    /// The payload is at `offset` of the memfd passed with this frame (SCM_RIGHTS), open
    /// read-only and possibly unsealed: the sender's own buffer, which it recycles once the
    /// version goes. The receiver copies the payload out into memory of its own (no mapping,
    /// no bytes on the socket), closes the memfd, and answers [`ShmCopied`]; the sender keeps
    /// the bytes unchanged until that answer (or its stall timeout). Offered only to a
    /// receiver that proved read-write access.
    MemfdCopy {
        /// Where the payload starts in the memfd.
        offset: u64,
    },
}

/// On a same-host socket, a receiver's answer to a [`ShmPayload::MemfdCopy`]: it copied
/// `version`'s bytes and closed the memfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmCopied {
    /// The version whose bytes were copied.
    pub version: u64,
}

/// The first frame on a TCP-channel socket, from the puller: the one-time token of its
/// [`DataResponse::TcpTicket`](crate::DataResponse::TcpTicket) and the bytes of the payload
/// this socket carries. A socket whose hello is not exactly this, in time, is closed before
/// any tensor byte is sent; otherwise the holder writes the range's raw bytes and closes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpHello {
    /// From the ticket.
    pub token: [u8; 32],
    /// The payload bytes to send on this socket (within the ticket's tensor).
    pub range: ByteRange,
}

/// Largest [`TcpHello`] frame body, in bytes (it is at most 52).
pub const MAX_TCP_HELLO_FRAME: u32 = 64;

#[cfg(test)]
mod tests {
    use super::*;

    fn shm() -> ChannelOffer {
        ChannelOffer::Shm {
            socket: [1; SHM_SOCKET_NAME_LEN],
            token: [2; 32],
        }
    }

    #[test]
    fn lists_parse_with_quic_as_the_implied_fallback() {
        use ChannelKind::*;
        assert_eq!(ChannelKind::parse_list("shm,quic"), Ok(vec![Shm, Quic]));
        assert_eq!(
            ChannelKind::parse_list(" TCP , shm "),
            Ok(vec![Tcp, Shm, Quic])
        );
        assert_eq!(ChannelKind::parse_list("quic,tcp"), Ok(vec![Quic, Tcp]));
        assert_eq!(ChannelKind::parse_list(""), Err(ChannelListError::Empty));
        assert_eq!(ChannelKind::parse_list(" , "), Err(ChannelListError::Empty));
        assert_eq!(
            ChannelKind::parse_list("shm,rdma"),
            Err(ChannelListError::Unknown("rdma".into()))
        );
        assert_eq!(
            ChannelKind::parse_list("shm,shm"),
            Err(ChannelListError::Repeated(Shm))
        );
        for kind in ChannelKind::ALL {
            assert_eq!(kind.as_str().parse::<ChannelKind>(), Ok(kind));
        }
    }

    #[test]
    fn the_pair_uses_the_first_kind_in_local_order_that_both_allow() {
        use ChannelKind::*;
        let tcp = ChannelOffer::Tcp { port: 9 };
        let all = |_| true;
        assert_eq!(pick(&[Shm, Quic], &[shm()], all), Shm);
        assert_eq!(pick(&[Shm, Quic], &[], all), Quic);
        assert_eq!(pick(&[Quic, Shm], &[shm()], all), Quic);
        assert_eq!(pick(&[Tcp, Quic], &[shm(), tcp.clone()], all), Tcp);
        assert_eq!(pick(&[Shm, Quic], &[tcp], all), Quic);
        assert_eq!(pick(&[Shm, Quic], &[shm()], |k| k != Shm), Quic);
        assert_eq!(pick(&[], &[shm()], all), Quic);
    }

    #[test]
    fn offers_are_bounded_and_one_per_kind() {
        assert_eq!(
            validate_offers(&[shm(), ChannelOffer::Tcp { port: 1 }]),
            Ok(())
        );
        assert_eq!(
            validate_offers(&[shm(), shm()]),
            Err(OfferError::Repeated(ChannelKind::Shm))
        );
        let many = vec![ChannelOffer::Tcp { port: 1 }; MAX_CHANNEL_OFFERS + 1];
        assert_eq!(
            validate_offers(&many),
            Err(OfferError::TooMany(MAX_CHANNEL_OFFERS + 1))
        );
    }
}
