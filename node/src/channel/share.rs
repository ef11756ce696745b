//! [`share`]: a job run on this thread and, alongside, on whichever threads of the blake3
//! crate's rayon pool start on it in time, without ever waiting for a pool thread to wake.
//!
//! Why: on a machine whose idle cores halt (a VM's, above all), a pool thread asleep for a
//! millisecond takes 100 µs or more to run a job handed to it. A scope (`in_place_scope`)
//! waits for every job it spawned to run, even one that finds nothing left to do: hashing
//! 1 MiB that way took 131-144 µs p50 on the 2-core development VM against 114-131 µs on
//! one thread, with puts a millisecond apart. Here a helper that starts after this thread
//! finished finds the job closed and returns at once, and this thread waits only for
//! helpers that are inside the job, each on its last item.

// The job is lent to pool threads by a pointer whose lifetime is erased; soundness rests on
// the gate below, checked here once.
#![allow(unsafe_code)]

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

/// The gate's bit that says the job is closed (its other bits count helpers inside it).
const CLOSED: usize = 1 << (usize::BITS - 1);

/// How long the caller spins at the end for helpers still inside the job (an item takes
/// ~10-15 µs on the development VM) before it sleeps between looks.
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// The job a helper may run, if the gate lets it in.
struct Gate {
    state: AtomicUsize,
    job: Job,
}

/// The caller's job, its lifetime erased.
struct Job(*const (dyn Fn() + Sync + 'static));

// SAFETY: the pointee is `Sync` (shared between threads by reference is what it is for), and
// it is dereferenced only inside the gate (see `share`).
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

impl Gate {
    /// Counts a helper in, unless the job is closed.
    fn enter(&self) -> bool {
        let mut state = self.state.load(Ordering::Acquire);
        // Bounded: each failed exchange saw another helper enter or leave, or the close.
        loop {
            if state & CLOSED != 0 {
                return false;
            }
            match self.state.compare_exchange_weak(
                state,
                state + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => state = now,
            }
        }
    }

    /// Helpers inside now.
    fn inside(&self) -> usize {
        self.state.load(Ordering::Acquire) & !CLOSED
    }
}

/// Counts a helper out when dropped (also when its job panics).
struct Inside<'a>(&'a Gate);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.state.fetch_sub(1, Ordering::Release);
    }
}

/// Closes the gate when dropped (also when the caller's job panics) and waits until no
/// helper is inside: only then may the job's borrows end.
struct CloseOnDrop<'a>(&'a Gate);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.state.fetch_or(CLOSED, Ordering::AcqRel);
        let until = std::time::Instant::now() + SPIN;
        // Bounded by the helpers inside: none enters after the close, and each leaves once
        // its current item ends (`job` hands out a bounded number of items).
        while self.0.inside() > 0 {
            if std::time::Instant::now() < until {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
    }
}

/// Runs `job` on this thread, and on up to `helpers` threads of the rayon pool that start on
/// it before this thread's run of it returns; returns once this thread's run returned and no
/// helper is still inside it. `job` must be safe to run on several threads at once and must
/// return soon once there is nothing left to do (it claims items from a shared counter).
pub(crate) fn share(helpers: usize, job: &(dyn Fn() + Sync)) {
    if helpers == 0 {
        job();
        return;
    }
    // SAFETY: only the lifetime changes. The pointer is dereferenced only by a helper that
    // entered the gate, before it leaves; this function returns (and `job`'s borrow ends)
    // only after `CloseOnDrop` closed the gate and saw no helper inside. A helper that
    // starts later finds the gate closed and never touches the pointer.
    let erased = unsafe {
        std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const (dyn Fn() + Sync + 'static)>(
            job,
        )
    };
    let gate = Arc::new(Gate {
        state: AtomicUsize::new(0),
        job: Job(erased),
    });
    for _ in 0..helpers {
        let gate = gate.clone();
        rayon_core::spawn(move || {
            if !gate.enter() {
                return;
            }
            let _inside = Inside(&gate);
            // SAFETY: inside the gate (see above): the caller is still in `share`.
            let job = unsafe { &*gate.job.0 };
            job();
        });
    }
    let _close = CloseOnDrop(&gate);
    job();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every item is done exactly once, whoever does it, and the caller returns only once
    /// the helpers that took items are done with them; helpers that start late touch
    /// nothing (the borrowed counters are gone by then: a use would be caught by Miri/ASan,
    /// and here by the counts below staying exact across many rounds).
    #[test]
    fn every_item_once_and_nothing_after_return() {
        for round in 0..200 {
            let items = 1 + round % 37;
            let next = AtomicUsize::new(0);
            let done: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
            let job = || {
                // Bounded by `items`.
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= items {
                        return;
                    }
                    if i % 5 == 0 {
                        std::thread::yield_now();
                    }
                    done[i].fetch_add(1, Ordering::Relaxed);
                }
            };
            share(round % 4, &job);
            assert!(
                done.iter().all(|d| d.load(Ordering::Relaxed) == 1),
                "round {round}: an item done twice or never"
            );
        }
    }
}
