//! [`TransferProgress`]: how far one transfer got, readable from another task while it runs (for
//! progress bars).
//!
//! The transfer writes one relaxed atomic per chunk it moves (no lock, no channel); readers
//! poll at their own pace. The byte count only ever grows: a get that starts over (bytes that
//! did not hash right) holds it until the new receive passes it again.

use std::sync::{
    OnceLock,
    atomic::{AtomicU64, Ordering},
};

/// Payload bytes one transfer has moved so far, out of how many. Give each transfer a fresh
/// one ([`TransferProgress::default`]) and share it (`Arc`) with whoever shows it.
#[derive(Debug, Default)]
pub struct TransferProgress {
    /// Payload bytes moved so far (received into the buffer, or handed to QUIC).
    done: AtomicU64,
    /// The payload's length, once known (a get knows it after the broker's look-up).
    total: OnceLock<u64>,
}

impl TransferProgress {
    /// Payload bytes moved so far; never decreases, and equals [`total`](Self::total) when
    /// the transfer succeeded.
    pub fn bytes(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// The payload's length in bytes, once the transfer knows it.
    pub fn total(&self) -> Option<u64> {
        self.total.get().copied()
    }

    /// Whether every byte is in (false while the total is unknown).
    pub fn is_complete(&self) -> bool {
        self.total().is_some_and(|t| self.bytes() >= t)
    }

    /// Records the payload's length (the first call wins: one transfer, one length).
    pub(crate) fn set_total(&self, total: u64) {
        let _ = self.total.set(total);
    }

    /// Records that the first `bytes` of the payload are through (a smaller value than
    /// already recorded, after a restart, leaves it as it is).
    pub(crate) fn reached(&self, bytes: u64) {
        self.done.fetch_max(bytes, Ordering::Relaxed);
    }
}

/// Records `bytes` on `progress` when there is one: the hot-path form.
pub(crate) fn reached(progress: Option<&TransferProgress>, bytes: u64) {
    if let Some(p) = progress {
        p.reached(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_only_grow_and_the_first_total_wins() {
        let p = TransferProgress::default();
        assert_eq!((p.bytes(), p.total(), p.is_complete()), (0, None, false));
        p.set_total(100);
        p.set_total(7);
        reached(Some(&p), 60);
        reached(Some(&p), 10);
        assert_eq!(
            (p.bytes(), p.total(), p.is_complete()),
            (60, Some(100), false)
        );
        reached(Some(&p), 100);
        assert!(p.is_complete());
        reached(None, 5);
    }
}
