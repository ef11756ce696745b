//! The pool of idle memfds: regions whose fd never left the process, given back when their
//! last holder dropped them, and taken by the next [`RegionWriter`](super::RegionWriter) of
//! the same size, whose writes then land in pages already faulted in instead of fresh ones.
//!
//! A buffer comes back with the read-only mapping its region had ([`Mapping`]) and the
//! writable one it was filled through ([`FillMap`], made at its first reuse): the next region
//! of its size is written through the one and read through the other, so neither side of a
//! reuse pays for page-table work (mapping 1 MiB and faulting it in took ~110 us on the
//! development VM, about what moving that MiB between two processes takes). The pages written
//! in the meantime are the file's own, which a private read-only mapping shows as they are
//! (a private mapping copies a page only when written through it, which a region's never
//! is).
//!
//! Bounded in bytes and in buffers (the oldest go first), and an idle buffer is closed after
//! [`IDLE`]: a sweeper thread (one per process, started with the first pooled buffer) checks
//! every [`SWEEP`], so a process that stops publishing gives the memory back.
//!
//! A region whose fd is passed to another process is sealed and never comes back, so a
//! stream of versions each mapped by a subscriber would write every version into fresh
//! pages (allocated and zeroed on first touch: 0.3-1.5 GB/s on a VM, against 6-19 GB/s for a
//! copy into touched memory). So when such a region is sealed, a [`spare`] of its size is
//! made off the writer's path: a thread (one per process) creates a memfd, allocates its
//! pages with `fallocate` and pools it, and the next version of that size is written into
//! pages that are already there. Spares obey the pool's bounds and idle time like any
//! buffer; sizes outside [`SPARE_MIN`]..=[`SPARE_MAX`] get none.

use std::{
    collections::VecDeque,
    os::fd::OwnedFd,
    sync::{
        Mutex, Once, OnceLock, PoisonError,
        mpsc::{SyncSender, TrySendError, sync_channel},
    },
    time::{Duration, Instant},
};

use rustix::fs::{self, FallocateFlags, MemfdFlags, SealFlags};

use super::{
    peer_maps,
    region::{FillMap, Mapping},
};

/// Most bytes the pool keeps.
pub(crate) const MAX_BYTES: usize = 1 << 30;
/// Most buffers the pool keeps.
pub(crate) const MAX_BUFFERS: usize = 256;
/// How long an idle buffer is kept.
pub(crate) const IDLE: Duration = Duration::from_secs(30);
/// How often the sweeper closes buffers idle longer than [`IDLE`].
const SWEEP: Duration = Duration::from_secs(5);
/// Smallest size a spare is made for: below it, faulting pages in as the writer goes costs
/// little (tens of microseconds).
pub(crate) const SPARE_MIN: usize = 256 << 10;
/// Largest size a spare is made for (a quarter of the pool).
pub(crate) const SPARE_MAX: usize = MAX_BYTES / 4;
/// Jobs queued for the pool's thread (spares to make, sealed memfds to free); more are
/// dropped (a spare) or done by the caller (a free).
const JOBS_QUEUED: usize = 16;

/// An idle buffer.
struct Idle {
    fd: OwnedFd,
    len: usize,
    /// Its read-only mapping, kept for the next region of its size (`None`: made then).
    map: Option<Mapping>,
    /// Its writable mapping, kept for the next fill (`None`: made then).
    fill: Option<FillMap>,
    /// A region's buffer given back, not a spare: its size is one whose versions are not
    /// passed on (a spare replaces a buffer that was, and the next one of its size likely
    /// will be too), so a writable mapping for its fills is worth making.
    recycled: bool,
    /// When it was given back.
    at: Instant,
}

struct Pool {
    /// Oldest first.
    idle: VecDeque<Idle>,
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

/// Gives back an unsealed memfd of `len` bytes that never left the process and that nothing
/// maps any more but `map` (its whole file, read-only, which nothing reads through until the
/// buffer is taken again). Buffers pushed out to stay within the bounds are freed after the
/// lock is released, large ones on the pool's thread ([`free`]).
pub(crate) fn give(fd: OwnedFd, len: usize, map: Option<Mapping>, fill: Option<FillMap>) {
    keep(fd, len, map, fill, true);
}

/// Pools a buffer (see [`give`]; `recycled`: a region's, not a spare).
fn keep(fd: OwnedFd, len: usize, map: Option<Mapping>, fill: Option<FillMap>, recycled: bool) {
    if len > MAX_BYTES {
        return;
    }
    let mut closed = Vec::new();
    {
        let mut pool = pool();
        while pool.idle.len() >= MAX_BUFFERS || pool.bytes + len > MAX_BYTES {
            let Some(old) = pool.idle.pop_front() else {
                break;
            };
            pool.bytes -= old.len;
            closed.push(old);
        }
        let at = Instant::now();
        pool.idle.push_back(Idle {
            fd,
            len,
            map,
            fill,
            recycled,
            at,
        });
        pool.bytes += len;
    }
    for old in closed {
        free(old.fd, old.map, old.fill, old.len);
    }
    start_sweeper();
}

/// Starts the sweeper thread (one per process, idempotent): every [`SWEEP`] it closes the
/// pool's idle buffers and drops the peers' memfds kept mapped ([`peer_maps`]) but unused.
pub(crate) fn start_sweeper() {
    static SWEEPER: Once = Once::new();
    SWEEPER.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("tb-memfd-pool".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(SWEEP);
                    let now = Instant::now();
                    sweep(now);
                    peer_maps::sweep(now);
                }
            });
        if let Err(e) = spawned {
            tracing::debug!(%e, "no memfd pool sweeper: idle buffers are closed when the pool is next used");
        }
    });
}

/// Work for the pool's thread (one per process, started on first use).
enum Job {
    /// Make a spare of this size ([`spare`]).
    Spare(usize),
    /// Unmap and close a memfd ([`free`]).
    Release(OwnedFd, Option<Mapping>, Option<FillMap>),
}

/// Hands `job` to the pool's thread; gives it back when the thread is busy (its queue full)
/// or could not be started.
fn to_thread(job: Job) -> Option<Job> {
    static JOBS: OnceLock<Option<SyncSender<Job>>> = OnceLock::new();
    let jobs = JOBS.get_or_init(|| {
        let (tx, rx) = sync_channel::<Job>(JOBS_QUEUED);
        let spawned = std::thread::Builder::new()
            .name("tb-memfd-jobs".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    match job {
                        Job::Spare(len) => make_spare(len),
                        Job::Release(fd, map, fill) => {
                            #[cfg(test)]
                            freed_here(&fd);
                            drop((map, fill, fd));
                        }
                    }
                }
            });
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::debug!(%e, "no memfd pool thread: spares are not made, and sealed memfds are freed by their last holder");
                None
            }
        }
    });
    match jobs {
        Some(tx) => tx.try_send(job).err().map(|e| match e {
            TrySendError::Full(job) | TrySendError::Disconnected(job) => job,
        }),
        None => Some(job),
    }
}

/// The inodes of the memfds the pool's thread freed (tests check where a memfd was freed).
#[cfg(test)]
pub(crate) static FREED_ON_THREAD: Mutex<Vec<u64>> = Mutex::new(Vec::new());

#[cfg(test)]
fn freed_here(fd: &OwnedFd) {
    if let Ok(stat) = fs::fstat(fd) {
        let mut freed = FREED_ON_THREAD
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        freed.push(stat.st_ino);
    }
}

/// Makes a spare of `len` bytes and pools it, unless the pool holds a buffer of that size.
fn make_spare(len: usize) {
    if holds_size(len) {
        return;
    }
    match allocated(len) {
        // Mapped (and so zeroed: shmem zeroes a fallocated page on its first touch) here
        // too, off the writer's path.
        Ok(fd) => {
            let map = Mapping::populated(&fd, len).ok();
            keep(fd, len, map, None, false);
        }
        Err(e) => tracing::debug!(%e, len, "no spare memfd"),
    }
}

/// Asks for a spare memfd of `len` bytes, its pages allocated, to be pooled off the caller's
/// path (see the module docs), unless the pool holds one of that size already. Never waits:
/// a request beyond [`JOBS_QUEUED`] pending is dropped.
pub(crate) fn spare(len: usize) {
    if (SPARE_MIN..=SPARE_MAX).contains(&len) {
        let _ = to_thread(Job::Spare(len));
    }
}

/// Unmaps `map` and closes `fd`, a sealed region's (which never comes back to the pool), on
/// the pool's thread when the region is large: freeing its pages takes a while (on the
/// development VM, under strace, ~0.3 ms to unmap 1 MiB and as much to close it), which
/// would otherwise land on whoever dropped the last reference, typically a `put` evicting
/// an old version.
pub(crate) fn release(fd: OwnedFd, map: Mapping, len: usize) {
    free(fd, Some(map), None, len);
}

/// Unmaps `map` and closes `fd` (a memfd of `len` bytes): on the pool's thread when it is
/// large, here when it is small or the thread is busy.
fn free(fd: OwnedFd, map: Option<Mapping>, fill: Option<FillMap>, len: usize) {
    if len < SPARE_MIN {
        return drop((map, fill, fd));
    }
    drop(to_thread(Job::Release(fd, map, fill)));
}

/// A new memfd of `len` bytes, sealed against resizes (each buffer keeps its size for life,
/// which lets a peer it is passed to keep it mapped: [`peer_maps`]) and sealable against
/// writes; no page allocated yet.
pub(crate) fn fresh(len: usize) -> rustix::io::Result<OwnedFd> {
    let fd = fs::memfd_create(
        "tensor-broker",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    fs::ftruncate(&fd, len as u64)?;
    fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW)?;
    Ok(fd)
}

/// A new memfd of `len` bytes with every page allocated (zeroed by the kernel).
fn allocated(len: usize) -> rustix::io::Result<OwnedFd> {
    let fd = fresh(len)?;
    fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64)?;
    Ok(fd)
}

/// Whether the pool holds a buffer of exactly `len` bytes.
fn holds_size(len: usize) -> bool {
    pool().idle.iter().any(|idle| idle.len == len)
}

/// A pooled memfd of exactly `len` bytes (the most recently given back) and the read-only
/// and writable mappings it kept, if there is one; `true` if it was a region's (not a
/// spare).
pub(crate) fn take(len: usize) -> Option<(OwnedFd, Option<Mapping>, Option<FillMap>, bool)> {
    let mut pool = pool();
    let at = pool.idle.iter().rposition(|idle| idle.len == len)?;
    let idle = pool.idle.remove(at)?;
    pool.bytes -= idle.len;
    Some((idle.fd, idle.map, idle.fill, idle.recycled))
}

/// Closes the buffers idle since before `now - IDLE`.
fn sweep(now: Instant) {
    let mut closed = Vec::new();
    {
        let mut pool = pool();
        while let Some(idle) = pool.idle.front() {
            if now.duration_since(idle.at) < IDLE {
                break;
            }
            if let Some(idle) = pool.idle.pop_front() {
                pool.bytes -= idle.len;
                closed.push(idle);
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
    holds_size(len)
}
