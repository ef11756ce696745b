//! [`Region`]: a tensor's bytes in a sealed memfd, mapped read-only.
//!
//! A region is written once (by `pwrite`, never through a writable mapping), then sealed
//! against writes, shrinking, growing and further seal changes, and only then mapped. A peer
//! that receives the fd checks those seals before it maps it: from then on nobody, the
//! sender included, can change the bytes it reads, and the mapping (with the fd) stays valid
//! for as long as anyone holds it, whatever happens to the version in the sender's store.

#![allow(unsafe_code)] // mmap/munmap: the only unsafe code of the shm channel, checked below.

use std::{
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    ptr::NonNull,
    sync::Arc,
};

use bytes::Bytes;
use rustix::{
    fs::{self, MemfdFlags, SealFlags},
    mm::{self, MapFlags, ProtFlags},
};

use crate::error::{Error, Result};

/// The seals every shared region carries.
const SEALS: SealFlags = SealFlags::WRITE
    .union(SealFlags::SHRINK)
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A sealed memfd and its read-only mapping (the whole file).
#[derive(Debug)]
pub(crate) struct Region {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only and the file sealed against writes and resizes, so the
// bytes behind `ptr` never change and stay mapped until `Drop`: sharing them between threads
// is like sharing a `&[u8]`.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// Copies `data` into a new sealed memfd. `data` must not be empty (a zero-length mapping
    /// does not exist; empty payloads travel inline).
    pub(crate) fn copy_of(data: &[u8]) -> Result<Region> {
        let fd = fs::memfd_create(
            "tensor-broker",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| io("creating a memfd", e))?;
        fs::ftruncate(&fd, data.len() as u64).map_err(|e| io("sizing a memfd", e))?;
        let mut written = 0;
        // Bounded: every round writes at least one byte or fails.
        while written < data.len() {
            let n = rustix::io::pwrite(&fd, &data[written..], written as u64)
                .map_err(|e| io("writing a memfd", e))?;
            if n == 0 {
                return Err(Error::Io("writing a memfd: no progress".into()));
            }
            written += n;
        }
        fs::fcntl_add_seals(&fd, SEALS).map_err(|e| io("sealing a memfd", e))?;
        Region::map(fd, data.len())
    }

    /// Maps a memfd a peer passed, after checking that it is sealed as [`Region::copy_of`]
    /// seals (so its bytes can never change) and holds at least `end` bytes.
    pub(crate) fn from_peer(fd: OwnedFd, end: u64) -> Result<Region> {
        let len = Region::check_peer_fd(&fd, end)?;
        Region::map(fd, len)
    }

    /// Checks that a peer's memfd is sealed as [`Region::copy_of`] seals and holds at least
    /// `end` bytes; returns its length.
    pub(crate) fn check_peer_fd(fd: &OwnedFd, end: u64) -> Result<usize> {
        let seals = fs::fcntl_get_seals(fd)
            .map_err(|e| Error::Io(format!("a peer's memfd has no seals: {e}")))?;
        if !seals.contains(SEALS) {
            return Err(Error::Io(format!(
                "a peer's memfd is not sealed against writes and resizes ({seals:?})"
            )));
        }
        let size = fs::fstat(fd)
            .map_err(|e| io("reading a memfd's size", e))?
            .st_size;
        let size = u64::try_from(size).unwrap_or(0);
        if size < end || size == 0 {
            return Err(Error::Io(format!(
                "a peer's memfd holds {size} bytes, the payload ends at {end}"
            )));
        }
        usize::try_from(size).map_err(|_| Error::TooLarge(format!("a memfd of {size} bytes")))
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Region> {
        // SAFETY: a fresh shared read-only mapping of `len` bytes of a file sealed against
        // shrinking (so no access through it can fault with SIGBUS) and writing; the kernel
        // picks the address, and nothing else in the process refers to it.
        let ptr = unsafe {
            mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| io("mapping a memfd", e))?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::Io("mapping a memfd gave a null address".into()))?;
        Ok(Region { fd, ptr, len })
    }

    /// The whole mapped file.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes that never change (see `Send`) and stay
        // mapped while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The file's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The memfd, to pass to a peer.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `range` of the region as shared bytes that keep the region (and its mapping) alive.
    pub(crate) fn slice(self: &Arc<Self>, range: std::ops::Range<usize>) -> Bytes {
        Bytes::from_owner(Shared(self.clone())).slice(range)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `map`, unmapped exactly once; every
        // borrow of it (`bytes`, the `Bytes` of `slice`) holds the region alive.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Payloads at least this large are copied on two threads.
const PARALLEL_MIN: usize = 4 << 20;
/// Bytes copied per round before the task yields to the runtime.
const COPY_ROUND: usize = 32 << 20;

/// Copies `dest.len()` bytes at `offset` of `fd` into `dest` with `pread` (no mapping, so no
/// page-table work), in rounds of [`COPY_ROUND`] split over two threads for large payloads,
/// yielding to the runtime between rounds.
pub(crate) async fn pread_parallel(fd: BorrowedFd<'_>, dest: &mut [u8], offset: u64) -> Result<()> {
    let mut at = 0;
    // Bounded: each round copies min(COPY_ROUND, rest) bytes or fails.
    while at < dest.len() {
        let end = (at + COPY_ROUND).min(dest.len());
        let round = &mut dest[at..end];
        let from = offset + at as u64;
        if round.len() < PARALLEL_MIN {
            pread_all(fd, round, from)?;
        } else {
            let half = round.len() / 2;
            let (a, b) = round.split_at_mut(half);
            std::thread::scope(|s| {
                let other = s.spawn(|| pread_all(fd, b, from + half as u64));
                let mine = pread_all(fd, a, from);
                let theirs = other
                    .join()
                    .unwrap_or_else(|_| Err(Error::Io("a copy thread panicked".into())));
                mine.and(theirs)
            })?;
        }
        at = end;
        if at < dest.len() {
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}

fn pread_all(fd: BorrowedFd<'_>, dest: &mut [u8], offset: u64) -> Result<()> {
    let mut done = 0;
    // Bounded: each round reads at least one byte or fails.
    while done < dest.len() {
        let n = rustix::io::pread(fd, &mut dest[done..], offset + done as u64)
            .map_err(|e| io("reading a peer's memfd", e))?;
        if n == 0 {
            return Err(Error::Io("a peer's memfd ended early".into()));
        }
        done += n;
    }
    Ok(())
}

/// A region as the owner of a `Bytes`.
struct Shared(Arc<Region>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

fn io(what: &str, err: rustix::io::Errno) -> Error {
    Error::Io(format!("{what}: {err}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_copy_reads_back_and_refuses_writes() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let region = Arc::new(Region::copy_of(&data).expect("region"));
        assert_eq!(region.bytes(), &data[..]);
        assert_eq!(region.slice(10..20), Bytes::copy_from_slice(&data[10..20]));
        // Sealed: no write, no resize, even through the owner's own fd.
        assert!(rustix::io::pwrite(region.fd(), b"x", 0).is_err());
        assert!(fs::ftruncate(region.fd(), 1).is_err());
        assert!(fs::ftruncate(region.fd(), 1 << 30).is_err());
    }

    #[test]
    fn a_peer_fd_must_be_sealed_and_long_enough() {
        let region = Region::copy_of(b"hello").expect("region");
        let dup = region.fd.try_clone().expect("dup");
        let peer = Region::from_peer(dup, 5).expect("sealed");
        assert_eq!(peer.bytes(), b"hello");
        let dup = region.fd.try_clone().expect("dup");
        assert!(Region::from_peer(dup, 6).is_err());
        // An unsealed memfd (its owner could still change it) is refused.
        let open = fs::memfd_create("t", MemfdFlags::ALLOW_SEALING).expect("memfd");
        fs::ftruncate(&open, 5).expect("size");
        assert!(Region::from_peer(open, 5).is_err());
        // So is a file descriptor that is no memfd at all.
        let file = std::fs::File::open("/proc/self/status").expect("file");
        assert!(Region::from_peer(OwnedFd::from(file), 1).is_err());
    }
}
