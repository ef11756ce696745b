//! [`ByteBudget`]: bytes that peers may make this node hold, reserved before they are
//! allocated and released when they are let go.
//!
//! A peer announces a length (a push's header, a run of anti-entropy frames) before it sends
//! the bytes; the receiver reserves that length here first and allocates only with a
//! [`Reservation`] in hand. The reservation travels with the bytes (a pushed tensor keeps its
//! own while it waits in the inbox) and gives them back on drop. Nothing waits for room: a
//! reservation that does not fit is refused at once, so a sender hears `Busy` (or `TooLarge`,
//! when it could never fit) before it has sent more than its header, and no stream sits on
//! memory it cannot use.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    /// More than the whole budget: it could never fit.
    #[error("{bytes} bytes is more than the whole budget of {limit} bytes")]
    TooLarge {
        /// What was asked for (for a reservation that grows: its size after growing).
        bytes: u64,
        /// The budget.
        limit: u64,
    },
    /// It would fit in an empty budget, but not now: retry once others have been let go.
    #[error("{bytes} bytes do not fit now: {in_use} of {limit} bytes are in use")]
    Busy {
        /// What was asked for.
        bytes: u64,
        /// Bytes reserved by others at the time.
        in_use: u64,
        /// The budget.
        limit: u64,
    },
}

#[derive(Debug)]
struct Inner {
    limit: u64,
    used: AtomicU64,
}

impl Inner {
    /// Adds `bytes` to the reserved total if it stays within the limit. `held` is what the
    /// caller already holds, for telling "never fits" from "not now".
    fn take(&self, bytes: u64, held: u64) -> Result<(), BudgetError> {
        let limit = self.limit;
        let wanted = held.saturating_add(bytes);
        if wanted > limit {
            return Err(BudgetError::TooLarge {
                bytes: wanted,
                limit,
            });
        }
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            })
            .map(|_| ())
            .map_err(|used| BudgetError::Busy {
                bytes,
                in_use: used.saturating_sub(held),
                limit,
            })
    }
}

/// A budget of bytes shared by everything that reserves from it. Cloning shares it.
#[derive(Debug, Clone)]
pub struct ByteBudget(Arc<Inner>);

impl ByteBudget {
    /// A budget of `limit` bytes, none reserved.
    pub fn new(limit: u64) -> Self {
        ByteBudget(Arc::new(Inner {
            limit,
            used: AtomicU64::new(0),
        }))
    }

    /// The budget's size in bytes.
    pub fn limit(&self) -> u64 {
        self.0.limit
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> u64 {
        self.0.used.load(Ordering::Acquire)
    }

    /// Reserves `bytes` if they fit now; never waits.
    pub fn try_reserve(&self, bytes: u64) -> Result<Reservation, BudgetError> {
        self.0.take(bytes, 0)?;
        Ok(Reservation {
            budget: self.0.clone(),
            bytes,
        })
    }

    /// Reserves `bytes` even past the limit: for bytes already in memory that come back
    /// under the budget (a pushed tensor taken from the inbox and put back because nobody
    /// could receive it), which must neither be dropped nor go uncounted. Never use it for
    /// bytes about to be allocated.
    pub fn reserve_over(&self, bytes: u64) -> Reservation {
        self.0.used.fetch_add(bytes, Ordering::AcqRel);
        Reservation {
            budget: self.0.clone(),
            bytes,
        }
    }

    /// An empty reservation, to grow as bytes arrive ([`Reservation::try_grow`]).
    pub fn empty(&self) -> Reservation {
        Reservation {
            budget: self.0.clone(),
            bytes: 0,
        }
    }
}

/// Bytes held against a [`ByteBudget`]; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Inner>,
    bytes: u64,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Holds `more` bytes as well, if they fit now. `TooLarge` when the whole would exceed
    /// the budget even if nobody else held anything.
    pub fn try_grow(&mut self, more: u64) -> Result<(), BudgetError> {
        self.budget.take(more, self.bytes)?;
        self.bytes += more;
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_until_the_budget_is_spent_and_come_back_on_drop() {
        let budget = ByteBudget::new(100);
        let a = budget.try_reserve(60).expect("first fits");
        assert_eq!(budget.in_use(), 60);
        assert_eq!(
            budget.try_reserve(41).expect_err("over"),
            BudgetError::Busy {
                bytes: 41,
                in_use: 60,
                limit: 100
            }
        );
        let b = budget.try_reserve(40).expect("exactly full");
        assert_eq!(budget.in_use(), 100);
        drop(a);
        assert_eq!(budget.in_use(), 40);
        assert!(budget.try_reserve(60).is_ok(), "room again after a drop");
        drop(b);
        assert_eq!(budget.in_use(), 0);
    }

    #[test]
    fn more_than_the_whole_budget_is_too_large_not_busy() {
        let budget = ByteBudget::new(100);
        assert_eq!(
            budget.try_reserve(101).expect_err("never fits"),
            BudgetError::TooLarge {
                bytes: 101,
                limit: 100
            }
        );
        assert!(matches!(
            budget.try_reserve(u64::MAX),
            Err(BudgetError::TooLarge { .. })
        ));
        assert_eq!(budget.in_use(), 0, "a refusal holds nothing");
        assert!(ByteBudget::new(0).try_reserve(0).is_ok());
        assert!(matches!(
            ByteBudget::new(0).try_reserve(1),
            Err(BudgetError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_growing_reservation_is_refused_at_the_limit_and_keeps_what_it_had() {
        let budget = ByteBudget::new(100);
        let other = budget.try_reserve(30).expect("other");
        let mut growing = budget.empty();
        growing.try_grow(50).expect("fits");
        assert!(matches!(
            growing.try_grow(30),
            Err(BudgetError::Busy { in_use: 30, .. })
        ));
        assert_eq!(growing.bytes(), 50);
        assert!(matches!(
            growing.try_grow(51),
            Err(BudgetError::TooLarge { bytes: 101, .. })
        ));
        drop(other);
        growing.try_grow(50).expect("fits once the other is gone");
        assert_eq!(budget.in_use(), 100);
        drop(growing);
        assert_eq!(budget.in_use(), 0);
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_budget() {
        let budget = ByteBudget::new(1000);
        let peak = Arc::new(AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..8 {
                let (budget, peak) = (budget.clone(), peak.clone());
                s.spawn(move || {
                    for _ in 0..2000 {
                        if let Ok(r) = budget.try_reserve(300) {
                            peak.fetch_max(budget.in_use(), Ordering::Relaxed);
                            drop(r);
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::Relaxed) <= 1000);
        assert_eq!(budget.in_use(), 0);
    }
}
