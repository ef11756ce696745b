//! The pool of idle memfds: regions whose fd never left the process, given back when their
//! last holder dropped them, and taken by the next [`RegionWriter`](super::RegionWriter) of
//! the same size, whose writes then land in pages already faulted in instead of fresh ones.
//!
//! Bounded in bytes and in buffers (the oldest go first), and an idle buffer is closed after
//! [`IDLE`]: a sweeper thread (one per process, started with the first pooled buffer) checks
//! every [`SWEEP`], so a process that stops publishing gives the memory back.

use std::{
    collections::VecDeque,
    os::fd::OwnedFd,
    sync::{Mutex, Once, PoisonError},
    time::{Duration, Instant},
};

/// Most bytes the pool keeps.
pub(crate) const MAX_BYTES: usize = 1 << 30;
/// Most buffers the pool keeps.
pub(crate) const MAX_BUFFERS: usize = 256;
/// How long an idle buffer is kept.
pub(crate) const IDLE: Duration = Duration::from_secs(30);
/// How often the sweeper closes buffers idle longer than [`IDLE`].
const SWEEP: Duration = Duration::from_secs(5);

struct Pool {
    /// Oldest first: (fd, its size, when it was given back).
    idle: VecDeque<(OwnedFd, usize, Instant)>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    idle: VecDeque::new(),
    bytes: 0,
});

/// The pool, locked (held for a scan of at most [`MAX_BUFFERS`] entries, never across a
/// wait; its state stays consistent if a holder panicked).
fn pool() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Gives back an unsealed memfd of `len` bytes that nothing maps any more and that never left
/// the process. Buffers pushed out to stay within the bounds are closed after the lock is
/// released (closing frees their pages, which takes a while for large ones).
pub(crate) fn give(fd: OwnedFd, len: usize) {
    if len > MAX_BYTES {
        return;
    }
    let mut closed = Vec::new();
    {
        let mut pool = pool();
        while pool.idle.len() >= MAX_BUFFERS || pool.bytes + len > MAX_BYTES {
            let Some((old, old_len, _)) = pool.idle.pop_front() else {
                break;
            };
            pool.bytes -= old_len;
            closed.push(old);
        }
        pool.idle.push_back((fd, len, Instant::now()));
        pool.bytes += len;
    }
    drop(closed);
    static SWEEPER: Once = Once::new();
    SWEEPER.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("tb-memfd-pool".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(SWEEP);
                    sweep(Instant::now());
                }
            });
        if let Err(e) = spawned {
            tracing::debug!(%e, "no memfd pool sweeper: idle buffers are closed when the pool is next used");
        }
    });
}

/// A pooled memfd of exactly `len` bytes (the most recently given back), if there is one.
pub(crate) fn take(len: usize) -> Option<OwnedFd> {
    let mut pool = pool();
    let at = pool.idle.iter().rposition(|(_, l, _)| *l == len)?;
    let (fd, len, _) = pool.idle.remove(at)?;
    pool.bytes -= len;
    Some(fd)
}

/// Closes the buffers idle since before `now - IDLE`.
fn sweep(now: Instant) {
    let mut closed = Vec::new();
    {
        let mut pool = pool();
        while let Some((_, len, at)) = pool.idle.front() {
            if now.duration_since(*at) < IDLE {
                break;
            }
            let len = *len;
            if let Some((fd, _, _)) = pool.idle.pop_front() {
                pool.bytes -= len;
                closed.push(fd);
            }
        }
    }
    drop(closed);
}

/// Buffers and bytes the pool holds now.
#[cfg(test)]
pub(crate) fn held() -> (usize, usize) {
    let pool = pool();
    (pool.idle.len(), pool.bytes)
}

/// Whether the pool holds a buffer of `len` bytes.
#[cfg(test)]
pub(crate) fn holds(len: usize) -> bool {
    pool().idle.iter().any(|(_, l, _)| *l == len)
}
