//! [`Ticket`]: what a node needs to join a cluster — the brokers' node ids and addresses.
//! Never the secret: that travels separately (flag, env var or file).

use std::{fmt, str::FromStr};

use crate::endpoint::PeerAddr;

/// Prefix of a ticket string; the number is the ticket format's version.
pub const TICKET_PREFIX: &str = "tbc1:";

/// Most brokers one ticket may name.
pub const MAX_TICKET_BROKERS: usize = 64;

/// The brokers of a cluster, as `tbc1:<node-id>@<ip:port>,<node-id>@<ip:port>,...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// The brokers, in the order a node tries them.
    pub brokers: Vec<PeerAddr>,
}

/// Why a ticket string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    /// It does not start with [`TICKET_PREFIX`].
    #[error("not a cluster ticket (expected it to start with {TICKET_PREFIX:?})")]
    Prefix,
    /// It names no broker.
    #[error("the ticket names no broker")]
    Empty,
    /// It names more than [`MAX_TICKET_BROKERS`] brokers.
    #[error("the ticket names {0} brokers, more than the {MAX_TICKET_BROKERS} allowed")]
    TooMany(usize),
    /// A broker address is malformed.
    #[error("broker {index} in the ticket: {reason}")]
    Broker {
        /// Its position, from 1.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
}

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(TICKET_PREFIX)?;
        for (i, b) in self.brokers.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{b}")?;
        }
        Ok(())
    }
}

impl FromStr for Ticket {
    type Err = TicketError;

    fn from_str(s: &str) -> Result<Self, TicketError> {
        let body = s
            .trim()
            .strip_prefix(TICKET_PREFIX)
            .ok_or(TicketError::Prefix)?;
        let parts: Vec<&str> = body.split(',').filter(|p| !p.is_empty()).collect();
        if parts.is_empty() {
            return Err(TicketError::Empty);
        }
        if parts.len() > MAX_TICKET_BROKERS {
            return Err(TicketError::TooMany(parts.len()));
        }
        let brokers = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                p.parse::<PeerAddr>().map_err(|e| TicketError::Broker {
                    index: i + 1,
                    reason: e.to_string(),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Ticket { brokers })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn addr(seed: u8, port: u16) -> PeerAddr {
        PeerAddr {
            id: iroh::SecretKey::from_bytes(&[seed; 32]).public(),
            addr: ([127, 0, 0, 1], port).into(),
        }
    }

    #[test]
    fn round_trips_and_refuses_garbage() {
        let t = Ticket {
            brokers: vec![addr(1, 4000), addr(2, 4001)],
        };
        let s = t.to_string();
        assert!(s.starts_with(TICKET_PREFIX));
        assert_eq!(s.parse::<Ticket>(), Ok(t));
        assert_eq!("tbc1:".parse::<Ticket>(), Err(TicketError::Empty));
        assert_eq!("hello".parse::<Ticket>(), Err(TicketError::Prefix));
        assert!(matches!(
            "tbc1:nonsense".parse::<Ticket>(),
            Err(TicketError::Broker { index: 1, .. })
        ));
        let many = format!("tbc1:{}", vec![addr(3, 1).to_string(); 65].join(","));
        assert_eq!(many.parse::<Ticket>(), Err(TicketError::TooMany(65)));
    }

    /// Pieces of tickets and peer addresses, well-formed and not, so that random strings
    /// reach every branch of the parsers and not only the prefix check.
    fn ticket_like() -> impl Strategy<Value = String> {
        let id = addr(9, 1).id.to_string();
        let piece = prop_oneof![
            Just(TICKET_PREFIX.to_owned()),
            Just(id.clone()),
            Just(id[..63].to_owned()),
            Just("@".to_owned()),
            Just(",".to_owned()),
            Just(" ".to_owned()),
            Just("127.0.0.1:4000".to_owned()),
            Just("[::1]:0".to_owned()),
            Just("[fe80::1%2]:7".to_owned()),
            Just(":".to_owned()),
            Just("é".to_owned()),
            Just("\u{0}".to_owned()),
            "[0-9a-f]{1,3}",
            any::<String>(),
        ];
        proptest::collection::vec(piece, 0..12).prop_map(|v| v.concat())
    }

    proptest! {
        /// A ticket or peer address string is parsed or refused, never a panic; what parses
        /// prints back to itself.
        #[test]
        fn arbitrary_tickets_and_addresses_never_panic(s in ticket_like()) {
            if let Ok(t) = s.parse::<Ticket>() {
                prop_assert!(!t.brokers.is_empty() && t.brokers.len() <= MAX_TICKET_BROKERS);
                prop_assert_eq!(t.to_string().parse::<Ticket>(), Ok(t));
            }
            if let Ok(a) = s.parse::<PeerAddr>() {
                prop_assert_ne!(a.addr.port(), 0);
                prop_assert_eq!(a.to_string().parse::<PeerAddr>().ok(), Some(a));
            }
        }

        #[test]
        fn valid_tickets_round_trip(seeds in proptest::collection::vec((1u8..=255, 1u16..), 1..=MAX_TICKET_BROKERS)) {
            let t = Ticket { brokers: seeds.iter().map(|&(seed, port)| addr(seed, port)).collect() };
            prop_assert_eq!(t.to_string().parse::<Ticket>(), Ok(t));
        }
    }
}
