//! Mappings of same-host publishers' pooled memfds, kept from one offer to the next.
//!
//! A same-host publisher hands a read-write watcher each version of up to
//! [`INLINE_MAX`](super::INLINE_MAX) as the pooled memfd it holds the version in
//! ([`ShmPayload::MemfdCopy`](tb_proto::ShmPayload)); the watcher copies the bytes into a
//! buffer of its own and answers, and the publisher reuses the memfd for a later version (with
//! `keep=1` it alternates between two). Copying with the kernel (`copy_file_range`) took
//! ~110-250 us per MiB on the development VM, and so did mapping the file afresh for each
//! offer (each page faulted into the new mapping); through a mapping kept from the memfd's
//! previous offer the copy is a `memcpy` of pages already mapped.
//!
//! What makes keeping one safe:
//! - only a memfd sealed against shrinking is mapped (the publisher's pool seals each of its
//!   buffers so when it makes it), and only as far as its size then: no access through the
//!   mapping can land past the file's end, so none raises `SIGBUS`, whatever the publisher
//!   does later;
//! - the mapping is private and read-only: nothing is written through it;
//! - a memfd is known again by its device and inode number. The kernel's internal shmem mount
//!   numbers its inodes from a 64-bit counter since Linux 5.9 (never twice in a kernel's life,
//!   and the kept mapping holds its file, so its number stays taken); older kernels keep no
//!   mapping and copy with the kernel, as before;
//! - the bytes are read while the publisher holds the version for the watcher (it reuses the
//!   memfd only after the watcher's `ShmCopied`), as a kernel copy reads them. A read-write
//!   publisher is trusted with its bytes as any holder that proved read-write access is; a
//!   read-only one's offer is hashed after the copy.
//!
//! Bounded: at most [`MAX_ENTRIES`] mappings and [`MAX_BYTES`] mapped in all (the least
//! recently used go first), each file at most [`MAX_FILE`]; one unused for [`IDLE`] is dropped
//! by the memfd pool's sweeper, so a publisher that freed its buffers gets their memory back
//! within seconds.

use std::{
    collections::VecDeque,
    os::fd::OwnedFd,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::{Duration, Instant},
};

use rustix::fs::{self, SealFlags};

use super::region::{Mapping, RegionFill};
use crate::error::{Error, Result};

/// Most mappings kept.
const MAX_ENTRIES: usize = 16;
/// Most bytes kept mapped.
const MAX_BYTES: usize = 64 << 20;
/// Largest file kept mapped.
const MAX_FILE: usize = 16 << 20;
/// How long an unused mapping is kept.
pub(crate) const IDLE: Duration = Duration::from_secs(5);

/// A kept mapping of a peer's memfd (its first `map.len` bytes: the file's size when mapped).
struct Entry {
    dev: u64,
    ino: u64,
    map: Arc<Mapping>,
    used: Instant,
}

struct Kept {
    /// Least recently used first.
    entries: VecDeque<Entry>,
    bytes: usize,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    entries: VecDeque::new(),
    bytes: 0,
});

/// The kept mappings, locked (held for a scan of at most [`MAX_ENTRIES`], never across a
/// copy or a wait; the list stays consistent if a holder panicked).
fn kept() -> std::sync::MutexGuard<'static, Kept> {
    KEPT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether this kernel numbers memfd inodes from a 64-bit counter (Linux 5.9 and later).
fn inode_numbers_unique() -> bool {
    static UNIQUE: OnceLock<bool> = OnceLock::new();
    *UNIQUE.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .is_ok_and(|release| kernel_at_least(release.trim(), (5, 9)))
    })
}

/// Whether a kernel release string (`6.1.0-13-amd64`) is `min` or later; `false` when it
/// does not parse.
fn kernel_at_least(release: &str, min: (u32, u32)) -> bool {
    let mut parts = release.split(['.', '-']);
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok());
    match (major, minor) {
        (Some(major), Some(minor)) => (major, minor) >= min,
        _ => false,
    }
}

/// Copies the bytes at `offset` of a peer's memfd `src` into `fill` (all of it) through a
/// kept mapping of `src`, made now if there is none. `None` when `src` is not one to keep
/// mapped (not sealed against shrinking, too large, an older kernel, or the mapping failed):
/// the caller copies another way. A file shorter than the payload is an error.
pub(crate) fn copy(src: &OwnedFd, offset: u64, fill: &mut RegionFill) -> Option<Result<()>> {
    let len = fill.len();
    read(src, offset, len, |bytes| fill.write_at(bytes, 0)).map(Result::flatten)
}

/// Copies the bytes at `offset` of a peer's memfd `src` into `dest` (all of it), as
/// [`copy`] does.
pub(crate) fn copy_to(src: &OwnedFd, offset: u64, dest: &mut [u8]) -> Option<Result<()>> {
    read(src, offset, dest.len(), |bytes| dest.copy_from_slice(bytes))
}

/// Calls `f` with the `len` bytes at `offset` of a peer's memfd `src`, read through a kept
/// mapping of it (see [`copy`]).
fn read<R>(
    src: &OwnedFd,
    offset: u64,
    len: usize,
    f: impl FnOnce(&[u8]) -> R,
) -> Option<Result<R>> {
    if !inode_numbers_unique() {
        return None;
    }
    let seals = fs::fcntl_get_seals(src).ok()?;
    if !seals.contains(SealFlags::SHRINK) {
        return None;
    }
    let stat = fs::fstat(src).ok()?;
    let size = usize::try_from(stat.st_size).ok()?;
    let start = usize::try_from(offset).ok()?;
    let Some(end) = start.checked_add(len).filter(|end| *end <= size) else {
        return Some(Err(Error::Io(format!(
            "a peer's memfd holds {size} bytes, the payload ends at {offset} + {len}"
        ))));
    };
    if size > MAX_FILE {
        return None;
    }
    let map = mapping(src, stat.st_dev, stat.st_ino, size)?;
    // The file cannot shrink below `size` (sealed), and `map` covers `size` bytes of it.
    Some(Ok(f(&map.bytes()[start..end])))
}

/// The kept mapping of the file `(dev, ino)` of `size` bytes, made (and kept) now if there
/// is none or the one kept is shorter; `None` if mapping fails.
fn mapping(src: &OwnedFd, dev: u64, ino: u64, size: usize) -> Option<Arc<Mapping>> {
    let now = Instant::now();
    {
        let mut kept = kept();
        if let Some(at) = (kept.entries.iter()).position(|e| e.dev == dev && e.ino == ino) {
            let mut entry = kept.entries.remove(at)?;
            if entry.map.len() >= size {
                entry.used = now;
                let map = entry.map.clone();
                kept.entries.push_back(entry);
                return Some(map);
            }
            // A file that grew since (a seal against growing is not required): mapped anew.
            kept.bytes -= entry.map.len();
        }
    }
    let map = Arc::new(Mapping::of_sealed_peer(src, size).ok()?);
    let mut dropped = Vec::new();
    {
        let mut kept = kept();
        // Mapped meanwhile by another copy too: this one replaces it.
        let again = (kept.entries.iter()).position(|e| e.dev == dev && e.ino == ino);
        if let Some(old) = again.and_then(|at| kept.entries.remove(at)) {
            kept.bytes -= old.map.len();
            dropped.push(old);
        }
        while kept.entries.len() >= MAX_ENTRIES || kept.bytes + size > MAX_BYTES {
            let Some(old) = kept.entries.pop_front() else {
                break;
            };
            kept.bytes -= old.map.len();
            dropped.push(old);
        }
        kept.bytes += size;
        kept.entries.push_back(Entry {
            dev,
            ino,
            map: map.clone(),
            used: now,
        });
    }
    // Unmapped outside the lock (a copy elsewhere may still hold one: its `Arc`).
    drop(dropped);
    super::pool::start_sweeper();
    Some(map)
}

/// Drops the mappings unused since before `now - IDLE` (the memfd pool's sweeper calls it).
pub(crate) fn sweep(now: Instant) {
    let mut dropped = Vec::new();
    {
        let mut kept = kept();
        while let Some(entry) = kept.entries.front() {
            if now.duration_since(entry.used) < IDLE {
                break;
            }
            if let Some(entry) = kept.entries.pop_front() {
                kept.bytes -= entry.map.len();
                dropped.push(entry);
            }
        }
    }
    drop(dropped);
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;

    use rustix::fs;

    use super::*;
    use crate::channel::shm::pool;

    /// How many mappings of `fd`'s file are kept.
    fn kept_of(fd: &OwnedFd) -> usize {
        let stat = fs::fstat(fd).expect("fstat");
        let kept = kept();
        let same = |e: &&Entry| e.dev == stat.st_dev && e.ino == stat.st_ino;
        kept.entries.iter().filter(same).count()
    }

    fn copied(src: &OwnedFd, at: u64, len: usize) -> Option<Result<Vec<u8>>> {
        let mut fill = RegionFill::new(len).expect("fill");
        let done = copy(src, at, &mut fill)?;
        Some(done.and_then(|()| Ok(fill.finish()?.bytes().to_vec())))
    }

    #[test]
    fn a_peers_memfd_is_copied_through_one_kept_mapping_that_sees_its_rewrites() {
        if !inode_numbers_unique() {
            eprintln!("skipped: a kernel before 5.9 keeps no mapping");
            return;
        }
        // Sizes no other test uses: the pool is the process's.
        const LEN: usize = 5 * 4096 + 33;
        const AT: u64 = 4096;
        let total = LEN + AT as usize;
        // A publisher's pooled buffer: sealed against resizes when made.
        let peer = pool::fresh(total).expect("memfd");
        let first: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        rustix::io::pwrite(&peer, &first, 0).expect("written");
        let got = copied(&peer, AT, LEN)
            .expect("kept mapped")
            .expect("copied");
        assert_eq!(got, &first[AT as usize..]);
        assert_eq!(kept_of(&peer), 1);
        // The publisher reuses the buffer for a later version: the same mapping reads it.
        let second: Vec<u8> = (0..total).map(|i| (i % 239) as u8 ^ 0x5a).collect();
        rustix::io::pwrite(&peer, &second, 0).expect("rewritten");
        let got = copied(&peer, AT, LEN)
            .expect("kept mapped")
            .expect("copied");
        assert_eq!(got, &second[AT as usize..]);
        assert_eq!(kept_of(&peer), 1, "one mapping, kept");
        // A payload past the file's end is an error, never a short copy or a fault.
        assert!(copied(&peer, AT + 1, LEN).expect("looked at").is_err());
        // Unused for `IDLE`, it is dropped by the sweeper.
        sweep(Instant::now() + IDLE + Duration::from_secs(1));
        assert_eq!(kept_of(&peer), 0);
        // A memfd that can shrink is never kept mapped: the caller copies with the kernel.
        let loose = fs::memfd_create("t", fs::MemfdFlags::CLOEXEC).expect("memfd");
        fs::ftruncate(&loose, total as u64).expect("sized");
        assert!(copied(&loose, AT, LEN).is_none());
        assert_eq!(kept_of(&loose), 0);
    }

    #[test]
    fn kernel_releases_are_compared_by_major_and_minor() {
        assert!(kernel_at_least("6.1.0-13-amd64", (5, 9)));
        assert!(kernel_at_least("5.9.0", (5, 9)));
        assert!(kernel_at_least("5.15.0-91-generic", (5, 9)));
        assert!(!kernel_at_least("5.4.0-150-generic", (5, 9)));
        assert!(!kernel_at_least("4.19.0", (5, 9)));
        assert!(!kernel_at_least("garbage", (5, 9)));
        assert!(!kernel_at_least("6", (5, 9)));
    }
}
