//! Fair shares of a device's pinned staging buffers, as plain logic (tested without a GPU).
//!
//! All transfers on a device draw from one small pool of pinned buffers. A sending transfer
//! keeps each staged chunk until QUIC drops it, which is when the receiver has acknowledged
//! it: a receiver that reads slowly keeps its sender's chunks out of the pool. Unbounded, one
//! such transfer could hold every buffer and stall all the others until the stall timeout.
//! So each transfer takes at most `per_transfer` buffers ([`TransferShare`]), and a transfer
//! that holds none always finds one as long as fewer than `total / per_transfer` others are
//! stuck at their share.

use std::sync::{Arc, Mutex, MutexGuard};

/// Counts of buffers handed out, the pool's and each transfer's, under one lock so that both
/// limits are checked and taken together.
#[derive(Debug)]
pub(crate) struct StagingQuota {
    total: usize,
    per_transfer: usize,
    in_use: Mutex<usize>,
}

impl StagingQuota {
    /// `total` buffers (at least 1), at most `per_transfer` (between 1 and `total`) to one
    /// transfer.
    pub(crate) fn new(total: usize, per_transfer: usize) -> Arc<StagingQuota> {
        let total = total.max(1);
        Arc::new(StagingQuota {
            total,
            per_transfer: per_transfer.clamp(1, total),
            in_use: Mutex::new(0),
        })
    }

    /// Buffers in the pool.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Most buffers one transfer may hold.
    pub(crate) fn per_transfer(&self) -> usize {
        self.per_transfer
    }

    fn lock(&self) -> MutexGuard<'_, usize> {
        self.in_use.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Buffers handed out now, all transfers together.
    pub(crate) fn in_use(&self) -> usize {
        *self.lock()
    }

    /// The share of a new transfer: it holds nothing yet.
    pub(crate) fn share(self: &Arc<Self>) -> TransferShare {
        TransferShare {
            quota: self.clone(),
            held: Arc::new(Mutex::new(0)),
        }
    }
}

/// One transfer's claim on the pool. Permits it takes outlive it if they must (a staged chunk
/// still in QUIC's hands): each gives its buffer back to the counts when dropped.
#[derive(Debug)]
pub(crate) struct TransferShare {
    quota: Arc<StagingQuota>,
    /// Changed only under the quota's lock.
    held: Arc<Mutex<usize>>,
}

impl TransferShare {
    /// A permit for one more buffer, if this transfer is under its share and the pool has one.
    pub(crate) fn try_take(&self) -> Option<Permit> {
        let mut in_use = self.quota.lock();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if *held >= self.quota.per_transfer || *in_use >= self.quota.total {
            return None;
        }
        *held += 1;
        *in_use += 1;
        Some(Permit {
            quota: self.quota.clone(),
            held: self.held.clone(),
        })
    }

    /// Buffers this transfer holds now.
    pub(crate) fn held(&self) -> usize {
        *self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The right to hold one buffer, counted against the pool and its transfer until dropped.
#[derive(Debug)]
pub(crate) struct Permit {
    quota: Arc<StagingQuota>,
    held: Arc<Mutex<usize>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut in_use = self.quota.lock();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        *held = held.saturating_sub(1);
        *in_use = in_use.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_at_its_share_takes_no_more_while_another_still_gets_buffers() {
        let quota = StagingQuota::new(8, 2);
        let slow = quota.share();
        let held: Vec<Permit> = (0..2)
            .map(|_| slow.try_take().expect("within share"))
            .collect();
        assert!(
            slow.try_take().is_none(),
            "a third buffer for the slow transfer"
        );
        assert_eq!(slow.held(), 2);
        let other = quota.share();
        let got = other
            .try_take()
            .expect("another transfer still gets a buffer");
        assert_eq!((other.held(), quota.in_use()), (1, 3));
        drop(held);
        assert_eq!((slow.held(), quota.in_use()), (0, 1));
        assert!(
            slow.try_take().is_some(),
            "room again once its buffers are back"
        );
        drop(got);
    }

    #[test]
    fn the_pool_total_holds_across_transfers() {
        let quota = StagingQuota::new(8, 2);
        let shares: Vec<TransferShare> = (0..5).map(|_| quota.share()).collect();
        let mut permits = Vec::new();
        for share in &shares {
            while let Some(p) = share.try_take() {
                permits.push(p);
            }
        }
        assert_eq!(
            permits.len(),
            8,
            "four transfers at their share fill the pool"
        );
        assert_eq!(
            shares[4].held(),
            0,
            "the fifth waits for a buffer to come back"
        );
        permits.pop();
        assert!(shares[4].try_take().is_some());
    }

    #[test]
    fn permits_outliving_their_share_still_give_buffers_back() {
        let quota = StagingQuota::new(4, 2);
        let permit = {
            let share = quota.share();
            share.try_take().expect("permit")
        };
        assert_eq!(quota.in_use(), 1);
        drop(permit);
        assert_eq!(quota.in_use(), 0);
    }

    #[test]
    fn shares_are_clamped_to_the_pool() {
        let quota = StagingQuota::new(2, 0);
        assert_eq!(quota.per_transfer(), 1, "a share is at least one buffer");
        let quota = StagingQuota::new(2, 9);
        assert_eq!(quota.per_transfer(), 2, "and at most the whole pool");
        assert_eq!(StagingQuota::new(0, 1).total(), 1);
    }
}
