//! Arbitrary bytes as a cluster ticket and as one peer address (`<node-id>@<ip:port>`), the
//! strings users paste into `--join` and `tb` commands. What is accepted must print back to
//! itself and respect the ticket's limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tb_link::{MAX_TICKET_BROKERS, PeerAddr, Ticket};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(ticket) = s.parse::<Ticket>() {
        assert!(!ticket.brokers.is_empty() && ticket.brokers.len() <= MAX_TICKET_BROKERS);
        assert!(ticket.brokers.iter().all(|b| b.addr.port() != 0));
        assert_eq!(ticket.to_string().parse::<Ticket>().as_ref(), Ok(&ticket));
    }
    if let Ok(addr) = s.parse::<PeerAddr>() {
        assert_ne!(addr.addr.port(), 0);
        let back = addr.to_string().parse::<PeerAddr>();
        assert!(matches!(&back, Ok(b) if *b == addr), "{addr} -> {back:?}");
    }
});
