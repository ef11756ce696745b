//! [`Region`]: a tensor's bytes in a memfd, mapped read-only; [`RegionFill`] and
//! [`RegionWriter`]: a region being filled.
//!
//! A region is written once, before it exists ([`RegionFill`]: a copy at publish, a receive
//! through a bounce buffer, a copy out of a peer's memfd; [`RegionWriter`]: a receive straight
//! into the buffer), and read through its own read-only mapping. A new memfd is written with
//! `pwrite` (its pages fault in either way); a pooled one through the shared writable
//! [`FillMap`] it keeps from fill to fill, a `memcpy` into mapped pages (a warm 256 MiB put
//! went from 0.55x to 0.78-0.85x of BLAKE3 alone on the development VM, 1 MiB by name from
//! Rust from 555-600 to 376-394 us). Nothing writes through a fill map while its region
//! lives. Before the region's fd first leaves the process ([`Region::shared_fd`]) the fill map
//! is unmapped and the file sealed against writes, shrinking, growing and further seal
//! changes. A peer that receives the fd checks those seals before it maps it:
//! from then on nobody, the sender included, can change the bytes it reads, and the mapping
//! (with the fd) stays valid for as long as anyone holds it, whatever happens to the version
//! in the sender's store.
//!
//! A region whose fd never left the process is not sealed, and when its last holder drops it
//! (the version evicted, every view of it gone) its memfd goes to a small pool of
//! already-touched buffers ([`pool`]), with its mappings: the next region of the same size
//! is written into those pages and read through that mapping (no page-table work),
//! not written into fresh ones that fault in and are zeroed page by page (on this kind of
//! machine a write into fresh memfd pages runs at about 1.1-1.5 GB/s, into touched ones at
//! 10-40 GB/s). Nothing can reach a pooled memfd's old bytes: the region, its `Bytes` and its
//! private views (which keep the region alive) are gone, and it was never passed to anyone.
//!
//! Sealed regions are mapped `MAP_PRIVATE`: before Linux 6.7 a `MAP_SHARED` mapping of an
//! `F_SEAL_WRITE` memfd is refused with `EPERM` even read-only, while a private mapping of
//! the same file shows the same bytes on every kernel. A private mapping can even be
//! writable: writes then copy the touched pages into the writer's process and never reach
//! the file, which is what a Python user's in-place op on a received tensor gets
//! ([`Region::private_view`]). A peer's memfd is mapped only up to the payload's end, whatever the
//! file's size.

#![allow(unsafe_code)] // mmap/munmap: the only unsafe code of the shm channel, checked below.

use std::{
    mem::ManuallyDrop,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    ptr::NonNull,
    sync::{Arc, OnceLock},
};

use bytes::Bytes;
use rustix::{
    fs::{self, SealFlags},
    mm::{self, MapFlags, ProtFlags},
};
use tb_proto::ContentHash;

use super::pool;
use crate::{
    error::{Error, Result},
    private::PrivateBytes,
};

/// Copy-on-write views start at a multiple of this (a multiple of every page size).
const VIEW_ALIGN: usize = 1 << 16;

/// The seals every shared region carries.
const SEALS: SealFlags = SealFlags::WRITE
    .union(SealFlags::SHRINK)
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A memfd and its read-only mapping (the whole file): sealed once its fd leaves the process
/// (always, for one a peer passed).
#[derive(Debug)]
pub(crate) struct Region {
    /// Taken in `Drop` only (to the pool or closed).
    fd: ManuallyDrop<OwnedFd>,
    /// Taken in `Drop` only (to the pool with the fd, or unmapped).
    map: ManuallyDrop<Mapping>,
    /// Set once the file is sealed (`Err`: sealing failed, and the fd is never passed on).
    sealed: OnceLock<std::result::Result<(), String>>,
    /// The writable mapping a pooled buffer was filled through, kept for its next fill once
    /// the region goes back to the pool; never written through while the region lives, and
    /// dropped before the file is sealed.
    fill: std::sync::Mutex<Option<FillMap>>,
}

/// A read-only private mapping of the first `len` bytes of a memfd, unmapped when dropped:
/// a [`Region`]'s, or a pooled buffer's kept for the next region of its size.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value (unmapped once, in `Drop`); it
// only hands out its address, to the `Region` that reads through it.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` read-only and private, the page-table entries made
    /// at once with `populate` (off a writer's path: the spare thread's).
    fn new(fd: &OwnedFd, len: usize, populate: bool) -> rustix::io::Result<Mapping> {
        let flags = match populate {
            true => MapFlags::PRIVATE | MapFlags::POPULATE,
            false => MapFlags::PRIVATE,
        };
        // SAFETY: a fresh private read-only mapping of `len` bytes of a memfd at least that
        // long that only this process resizes (it does not while a region or the pool holds
        // it) or that is sealed against shrinking, so no access through it can fault with
        // SIGBUS; the kernel picks the address, and nothing else in the process refers to it.
        let ptr = unsafe { mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ, flags, fd, 0) }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(rustix::io::Errno::NOMEM)?;
        Ok(Mapping { ptr, len })
    }

    /// Maps the first `len` bytes of a peer's memfd, read-only and private, for
    /// [`peer_maps`](super::peer_maps): the caller checked that the file is sealed against
    /// shrinking and holds at least `len` bytes.
    pub(crate) fn of_sealed_peer(fd: &OwnedFd, len: usize) -> rustix::io::Result<Mapping> {
        Mapping::new(fd, len, false)
    }

    /// The mapped length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The mapped bytes. Those of a peer's memfd kept mapped by
    /// [`peer_maps`](super::peer_maps) are read only while the peer holds them for the
    /// reader (an offer waiting for its `ShmCopied`), as a kernel copy would read them.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `len` readable bytes mapped at `ptr` for as long as `self` lives (unmapped
        // only in `Drop`); the file cannot end before them (see `new`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// [`Mapping::new`] with its page-table entries made at once (for the pool's spares).
    pub(crate) fn populated(fd: &OwnedFd, len: usize) -> rustix::io::Result<Mapping> {
        Mapping::new(fd, len, true)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped exactly once; its only reader, a
        // `Region`, holds this value for as long as any borrow of its bytes lives.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A shared writable mapping of a whole memfd of this process's pool, kept with the buffer for
/// its fills: a copy into the buffer is then a `memcpy` into pages that are already there and
/// mapped (on the development VM 19 us per MiB in cache, against 66 us for `pwrite`, and
/// 256 MiB in 14 ms against 39 ms), with no page-table work after the first fill. Unmapped
/// when dropped, and always before the file is sealed: a write seal is refused while a
/// writable shared mapping exists.
#[derive(Debug)]
pub(crate) struct FillMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value (unmapped once, in `Drop`) and written only
// through `&mut self`; moving it between threads moves that ownership.
unsafe impl Send for FillMap {}
// SAFETY: a shared reference gives no access to the bytes.
unsafe impl Sync for FillMap {}

impl FillMap {
    /// Maps the whole of `fd` (`len` bytes, its pages there: a pooled buffer) shared and
    /// writable, the page-table entries made at once.
    fn new(fd: &OwnedFd, len: usize) -> rustix::io::Result<FillMap> {
        // SAFETY: a fresh shared writable mapping of `len` bytes of an unsealed memfd of this
        // process at least that long, which nothing resizes while a buffer or region holds it
        // (so no access through it can fault with SIGBUS); the kernel picks the address.
        let ptr = unsafe {
            mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                fd,
                0,
            )
        }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(rustix::io::Errno::NOMEM)?;
        Ok(FillMap { ptr, len })
    }

    /// The buffer's bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` writable bytes while `self` lives, and `self` is borrowed
        // mutably: nothing else reaches them through this mapping (a region reads the same
        // pages through its own read-only mapping only once the fill is finished).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for FillMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped exactly once; no borrow of it outlives
        // `bytes_mut`'s.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

// SAFETY: the mapping is read-only, and nothing writes the file while a `Region` of it
// lives: a peer's memfd is sealed against writes and resizes, and this process writes its own
// only through a `RegionFill` or `RegionWriter` (its `FillMap` included), before the region
// exists or after it was dropped (pooled).
// So the bytes behind `ptr` never change and stay mapped until `Drop`: sharing them between
// threads is like sharing a `&[u8]`.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

/// Alignment for [`release_resident`]: a multiple of every page size Linux uses.
const RELEASE_ALIGN: usize = 64 << 10;

/// Lets the kernel drop this process's page-table entries for the pages of `bytes`, a part of
/// a [`Region`]'s mapping just read through once (hashed): the pages stay in the memfd and
/// fault back in on the next read. The private view a caller gets next maps the same pages
/// again, and without this they would count twice in the process's RSS. Only whole aligned
/// pages inside `bytes` are released; a failure changes nothing and is ignored.
pub(crate) fn release_resident(bytes: &[u8]) {
    let start = (bytes.as_ptr() as usize).next_multiple_of(RELEASE_ALIGN);
    let end = (bytes.as_ptr() as usize + bytes.len()) / RELEASE_ALIGN * RELEASE_ALIGN;
    if end <= start {
        return;
    }
    // SAFETY: `bytes` lies in a read-only private mapping of a sealed memfd (a `Region`'s),
    // never written through, so it holds no private copies: dropping its page-table entries
    // loses nothing, and later reads fault the same file pages back in. The range is
    // page-aligned and inside the mapping.
    let _ = unsafe {
        mm::madvise(
            start as *mut std::ffi::c_void,
            end - start,
            mm::Advice::LinuxDontNeed,
        )
    };
}

impl Region {
    /// Copies `data` into a memfd. `data` must not be empty (a zero-length mapping does not
    /// exist; empty payloads travel inline).
    pub(crate) fn copy_of(data: &[u8]) -> Result<Region> {
        let mut fill = RegionFill::new(data.len())?;
        fill.write_at(data, 0)?;
        fill.finish()
    }

    /// Copies `src` (not empty) into a memfd, a pooled one of its size when there is one,
    /// hashed on the way, on every core: through the pooled buffer's [`FillMap`]
    /// ([`verify::copy_and_hash`]), or written with `pwrite` into a new one (no page-table
    /// work for pages that fault in anyway, [`verify::copy_and_hash_to_fd`]); returns the
    /// region (mapped read-only, pages mapped on first read) and the hash of what was
    /// written.
    pub(crate) fn copy_hashed(src: &[u8]) -> Result<(Region, ContentHash)> {
        let mut fill = RegionFill::new(src.len())?;
        let hash = match fill.fill_map() {
            Some(map) => crate::channel::verify::copy_and_hash(src, map.bytes_mut()),
            None => crate::channel::verify::copy_and_hash_to_fd(src, fill.fd.as_fd())
                .map_err(|e| Error::io("writing a memfd", e))?,
        };
        Ok((fill.finish()?, hash))
    }

    /// The memfd, sealed first (once) so that nobody can change the bytes a peer maps: the
    /// only way the fd leaves the process. A sealed region never goes back to the pool.
    pub(crate) fn shared_fd(&self) -> Result<BorrowedFd<'_>> {
        let sealed = self.sealed.get_or_init(|| {
            // A write seal is refused while a writable shared mapping exists.
            drop(self.fill.lock().unwrap_or_else(|p| p.into_inner()).take());
            fs::fcntl_add_seals(&*self.fd, SEALS).map_err(|e| format!("sealing a memfd: {e}"))?;
            // This memfd will not come back: the next version of its size gets a spare.
            pool::spare(self.len());
            Ok(())
        });
        match sealed {
            Ok(()) => Ok(self.fd.as_fd()),
            Err(e) => Err(Error::Io(e.clone())),
        }
    }

    /// The memfd opened a second time, read-only (through `/proc/self/fd`), and not sealed:
    /// what a [`ShmPayload::MemfdCopy`](tb_proto::ShmPayload) passes, so that the region can
    /// still go back to the pool. The receiver reads the bytes through it but cannot write
    /// them or map them writable (a process of the same user that sets out to could reopen
    /// the file writable: only peers that proved read-write access, and so could publish
    /// other bytes anyway, are passed one).
    pub(crate) fn read_only_fd(&self) -> Result<OwnedFd> {
        use std::os::fd::AsRawFd;
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        fs::open(
            path,
            fs::OFlags::RDONLY | fs::OFlags::CLOEXEC,
            fs::Mode::empty(),
        )
        .map_err(|e| io("reopening a memfd read-only", e))
    }

    /// Maps the first `end` bytes of a memfd a peer passed, after checking that it is sealed
    /// as [`Region::copy_of`] seals (so its bytes can never change) and holds at least `end`
    /// bytes. Returns the region and whether the payload is the whole file (then the fd can
    /// be passed on as it is).
    pub(crate) fn from_peer(fd: OwnedFd, end: u64) -> Result<(Region, bool)> {
        let size = Region::check_peer_fd(&fd, end)?;
        let len = usize::try_from(end)
            .map_err(|_| Error::TooLarge(format!("a payload ending at {end}")))?;
        let region = Region::map(fd, len)?;
        let _ = region.sealed.set(Ok(()));
        Ok((region, size == end))
    }

    /// Checks that a peer's memfd is sealed as [`Region::copy_of`] seals and holds at least
    /// `end` bytes; returns its size.
    pub(crate) fn check_peer_fd(fd: &OwnedFd, end: u64) -> Result<u64> {
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
        if size < end || end == 0 {
            return Err(Error::Io(format!(
                "a peer's memfd holds {size} bytes, the payload ends at {end}"
            )));
        }
        Ok(size)
    }

    /// Maps the first `len` bytes of a sealed memfd, read-only and private (see the module
    /// docs: a shared mapping of a write-sealed memfd fails before Linux 6.7).
    fn map(fd: OwnedFd, len: usize) -> Result<Region> {
        if fail_maps_for_tests() {
            return Err(Error::Io(
                "mapping a memfd: refused (forced by a test hook)".into(),
            ));
        }
        let map = Mapping::new(&fd, len, false).map_err(|e| io("mapping a memfd", e))?;
        Ok(Region::mapped(fd, map))
    }

    /// A region over `fd` read through `map` (the whole file, made by [`Mapping::new`]).
    fn mapped(fd: OwnedFd, map: Mapping) -> Region {
        Region {
            fd: ManuallyDrop::new(fd),
            map: ManuallyDrop::new(map),
            sealed: OnceLock::new(),
            fill: std::sync::Mutex::new(None),
        }
    }

    /// A region over a memfd this process filled, read through `map` when the buffer came
    /// from the pool with one, else mapped now; it keeps `fill` for the buffer's next fill.
    fn filled(
        fd: OwnedFd,
        len: usize,
        map: Option<Mapping>,
        fill: Option<FillMap>,
    ) -> Result<Region> {
        let region = match map {
            Some(map) if map.len == len => Region::mapped(fd, map),
            _ => Region::map(fd, len)?,
        };
        *region.fill.lock().unwrap_or_else(|p| p.into_inner()) = fill;
        Ok(region)
    }

    /// A private, writable copy-on-write mapping of the region's bytes `range` (all of them,
    /// or a set member's): reads share the file's pages, a write copies the page it touches
    /// into this process only. Nothing written through it reaches the file, this region, or
    /// any other reader. The view keeps the region alive (so its memfd is not pooled and
    /// rewritten while the view may still read pages it did not copy).
    pub(crate) fn private_view(
        self: &Arc<Self>,
        range: std::ops::Range<usize>,
    ) -> Result<PrivateBytes> {
        if range.start > range.end || range.end > self.len() || range.is_empty() {
            return Err(Error::Io(format!(
                "a view of bytes {range:?} of a memfd of {} bytes",
                self.len()
            )));
        }
        // Mapping offsets must be page-aligned; 64 KiB is a multiple of every page size.
        let first = range.start & !(VIEW_ALIGN - 1);
        let map_len = range.end - first;
        // SAFETY: a fresh private mapping of bytes `first..range.end` of a sealed file at
        // least `self.len` long (no shrink: no SIGBUS); writes through it stay in this mapping
        // (MAP_PRIVATE), so the sealed file and every other mapping of it are untouched.
        let base = unsafe {
            mm::mmap(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
                &*self.fd,
                first as u64,
            )
        }
        .map_err(|e| io("mapping a memfd copy-on-write", e))?;
        let base = NonNull::new(base.cast::<u8>())
            .ok_or_else(|| Error::Io("mapping a memfd gave a null address".into()))?;
        let keep: Arc<dyn std::any::Any + Send + Sync> = self.clone();
        // SAFETY: `base` is a fresh mapping of `map_len` bytes that nothing else refers to,
        // and the range lies inside it.
        Ok(unsafe { PrivateBytes::mapped(base, map_len, range.start - first, range.len(), keep) })
    }

    /// The whole mapped file.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `map` maps `len` readable bytes that never change (see `Send`) and stay
        // mapped while `self` lives.
        unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr(), self.map.len) }
    }

    /// The file's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.map.len
    }

    /// Where its writable mapping is, if it keeps one.
    #[cfg(test)]
    pub(crate) fn fill_at(&self) -> Option<*const u8> {
        let fill = self.fill.lock().unwrap_or_else(|p| p.into_inner());
        fill.as_ref().map(|f| f.ptr.as_ptr().cast_const())
    }

    /// Whether the file is sealed (its fd was, or may be, passed on).
    #[cfg(test)]
    pub(crate) fn is_sealed(&self) -> bool {
        matches!(self.sealed.get(), Some(Ok(())))
    }

    /// `range` of the region as shared bytes that keep the region (and its mapping) alive.
    pub(crate) fn slice(self: &Arc<Self>, range: std::ops::Range<usize>) -> Bytes {
        Bytes::from_owner(Shared(self.clone())).slice(range)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `fd` and `map` are taken exactly once, here, and never used again; every
        // borrow of the mapping (`bytes`, the `Bytes` of `slice`, private views) holds the
        // region alive, so none is left.
        let (fd, map) = unsafe {
            (
                ManuallyDrop::take(&mut self.fd),
                ManuallyDrop::take(&mut self.map),
            )
        };
        // Never passed on (unsealed), and no other mapping of it is left: its pages, and the
        // mapping that reads them, can take the next region of this size.
        let len = map.len;
        let fill = self
            .fill
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match self.sealed.get() {
            None => pool::give(fd, len, Some(map), fill),
            // Passed on: never reused, and freed off this thread when large.
            Some(_) => pool::release(fd, map, len),
        }
    }
}

/// A memfd of `len` bytes (not empty) and what it comes with: a pooled one with the mappings
/// it kept (read-only, and writable for fills) and `true` (its pages are there); else a new
/// one, `None`s and `false`.
fn pooled_or_new(len: usize) -> Result<Buffer> {
    if len == 0 {
        return Err(Error::Io("an empty memfd cannot be mapped".into()));
    }
    match pool::take(len) {
        Some((fd, map, fill, recycled)) => Ok(Buffer {
            fd,
            map,
            fill,
            pooled: true,
            recycled,
        }),
        None => pool::fresh(len)
            .map(|fd| Buffer {
                fd,
                map: None,
                fill: None,
                pooled: false,
                recycled: false,
            })
            .map_err(|e| io("creating a memfd", e)),
    }
}

/// A memfd to fill, from [`pooled_or_new`].
struct Buffer {
    fd: OwnedFd,
    /// Its read-only mapping, if it kept one.
    map: Option<Mapping>,
    /// Its writable mapping, if it kept one.
    fill: Option<FillMap>,
    /// Taken from the pool (its pages are there).
    pooled: bool,
    /// A region's buffer given back (not a spare, whose size's versions get passed on).
    recycled: bool,
}

/// A memfd being filled: a pooled buffer through its [`FillMap`] (made at its first reuse,
/// then kept with it), a new one with `pwrite` (its pages fault in either way, and a mapping
/// would add page-table work). Either way the region it becomes reads through a read-only
/// mapping (a pooled buffer's own: no page-table work). What a copy at publish
/// ([`Region::copy_hashed`]), a receive through a small bounce buffer and a copy out of a
/// peer's memfd write into. Every byte must be written before [`finish`](Self::finish); one
/// dropped unfinished is not pooled.
#[derive(Debug)]
pub(crate) struct RegionFill {
    fd: OwnedFd,
    len: usize,
    map: Option<Mapping>,
    fill: Option<FillMap>,
    /// A region's buffer given back to the pool (its pages are there, and its versions are
    /// not passed on): a [`FillMap`] is worth making. A new buffer's pages fault in anyway;
    /// a spare's size is one whose versions are passed on (sealed), and the mapping would be
    /// made and unmapped for each.
    recycled: bool,
}

impl RegionFill {
    /// A memfd of `len` bytes (not empty): a pooled one of that size when there is one, else
    /// a new one.
    pub(crate) fn new(len: usize) -> Result<RegionFill> {
        let Buffer {
            fd,
            map,
            fill,
            recycled,
            ..
        } = pooled_or_new(len)?;
        Ok(RegionFill {
            fd,
            len,
            map,
            fill,
            recycled,
        })
    }

    /// The buffer's writable mapping: the one it kept, or made now for a recycled buffer
    /// (once in its life: it is kept from then on); `None` for a new buffer or a spare, or
    /// when mapping fails (the caller writes with `pwrite`). Made only by the writes that use
    /// it, so a buffer filled by the kernel ([`copy_from`](Self::copy_from)) maps nothing.
    fn fill_map(&mut self) -> Option<&mut FillMap> {
        if self.fill.is_none() && self.recycled {
            self.recycled = false;
            self.fill = FillMap::new(&self.fd, self.len).ok();
        }
        self.fill.as_mut()
    }

    /// The memfd's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Writes `bytes` at `offset` (inside the file).
    pub(crate) fn write_at(&mut self, mut bytes: &[u8], mut offset: usize) -> Result<()> {
        if offset
            .checked_add(bytes.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(Error::Io(format!(
                "writing {} bytes at {offset} of a memfd of {}",
                bytes.len(),
                self.len
            )));
        }
        if let Some(fill) = self.fill_map() {
            fill.bytes_mut()[offset..offset + bytes.len()].copy_from_slice(bytes);
            return Ok(());
        }
        // Bounded: each round writes at least one byte or fails.
        while !bytes.is_empty() {
            let n = rustix::io::pwrite(&self.fd, bytes, offset as u64)
                .map_err(|e| io("writing a memfd", e))?;
            if n == 0 {
                return Err(Error::Io("writing a memfd: no progress".into()));
            }
            (bytes, offset) = (&bytes[n..], offset + n);
        }
        Ok(())
    }

    /// Fills the memfd with the bytes at `offset` of the file `src` (a peer's memfd passed
    /// for [`ShmPayload::MemfdCopy`](tb_proto::ShmPayload)), copied by the kernel from page
    /// cache to page cache (`copy_file_range`: nothing mapped, no bounce buffer), or read and
    /// written through a bounce buffer where the kernel cannot. A file shorter than that is
    /// an error.
    pub(crate) fn copy_from(&mut self, src: &OwnedFd, offset: u64) -> Result<()> {
        let len = self.len as u64;
        let short = || Error::Io(format!("a peer's memfd ends before byte {offset} + {len}"));
        let (mut from, mut to) = (offset, 0u64);
        // Bounded: each round copies at least one byte, or fails, or falls back below.
        while to < len {
            let left = usize::try_from(len - to).unwrap_or(usize::MAX);
            match fs::copy_file_range(src, Some(&mut from), &self.fd, Some(&mut to), left) {
                Ok(0) => return Err(short()),
                Ok(_) => {}
                // Kernels and file systems that cannot copy between these files.
                Err(rustix::io::Errno::XDEV | rustix::io::Errno::NOSYS)
                | Err(rustix::io::Errno::INVAL | rustix::io::Errno::OPNOTSUPP)
                    if to == 0 =>
                {
                    return self.read_from(src, offset);
                }
                Err(e) => return Err(io("copying a peer's memfd", e)),
            }
        }
        Ok(())
    }

    /// [`copy_from`](Self::copy_from) with `pread` through a bounce buffer, then
    /// [`write_at`](Self::write_at).
    fn read_from(&mut self, src: &OwnedFd, offset: u64) -> Result<()> {
        const BOUNCE: usize = 64 << 10;
        let mut buf = vec![0u8; BOUNCE.min(self.len)];
        // Bounded: each round reads a whole piece, or fails.
        for at in (0..self.len).step_by(BOUNCE) {
            let piece = &mut buf[..BOUNCE.min(self.len - at)];
            pread_all(src.as_fd(), piece, offset + at as u64)?;
            self.write_at(piece, at)?;
        }
        Ok(())
    }

    /// The filled memfd as a [`Region`].
    pub(crate) fn finish(self) -> Result<Region> {
        Region::filled(self.fd, self.len, self.map, self.fill)
    }
}

/// A memfd being filled through a shared writable mapping, before it is sealed: the
/// receive buffer of a tensor that is then served (and viewed) from its region without a
/// copy.
#[derive(Debug)]
pub(crate) struct RegionWriter {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
    /// The read-only mapping a pooled buffer came with, for the region it becomes.
    ro: Option<Mapping>,
    /// The writable mapping a pooled buffer came with, for its next fills.
    fill: Option<FillMap>,
}

// SAFETY: the writer owns its mapping exclusively (no other reference to it exists until it
// is sealed); moving it between threads moves that ownership.
unsafe impl Send for RegionWriter {}
// SAFETY: shared references only read through `as_ref`, like a `&[u8]`.
unsafe impl Sync for RegionWriter {}

impl RegionWriter {
    /// A memfd of `len` bytes (not empty), mapped writable: a pooled one of that size when
    /// there is one (its pages already touched; every byte is rewritten by the writer's user
    /// before anyone reads it), else a new one.
    pub(crate) fn new(len: usize) -> Result<RegionWriter> {
        // A pooled memfd's pages are all there: map them in one call rather than one page
        // fault per page as the writer goes.
        let Buffer {
            fd,
            map: ro,
            fill,
            pooled,
            ..
        } = pooled_or_new(len)?;
        let populate = match pooled {
            true => MapFlags::POPULATE,
            false => MapFlags::empty(),
        };
        // SAFETY: a fresh shared writable mapping of a file of exactly `len` bytes that only
        // this writer can resize (it does not); unmapped in `seal` or `Drop`.
        let ptr = unsafe {
            mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | populate,
                &fd,
                0,
            )
        }
        .map_err(|e| io("mapping a memfd for writing", e))?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::Io("mapping a memfd gave a null address".into()))?;
        Ok(RegionWriter {
            fd,
            ptr,
            len,
            ro,
            fill,
        })
    }

    /// Unmaps the writable mapping and maps the file read-only: a [`Region`] (sealed when
    /// its fd is first passed on, [`Region::shared_fd`]).
    pub(crate) fn finish(self) -> Result<Region> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: the mapping made in `new`, unmapped once (`Drop` will not run: the writer
        // is consumed), before the region exists (a write seal is refused while it exists).
        let _ = unsafe { mm::munmap(this.ptr.as_ptr().cast(), this.len) };
        // SAFETY: the fd and the pooled mappings are moved out exactly once; `this` is never
        // used again.
        let (fd, ro, fill) = unsafe {
            (
                std::ptr::read(&this.fd),
                std::ptr::read(&this.ro),
                std::ptr::read(&this.fill),
            )
        };
        Region::filled(fd, this.len, ro, fill)
    }
}

impl AsRef<[u8]> for RegionWriter {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` bytes while the writer lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsMut<[u8]> for RegionWriter {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and the writer is borrowed mutably: the only view of the bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for RegionWriter {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped exactly once.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        // Not pooled: a writer dropped unfinished (a receive that failed, or a buffer made
        // for a transfer that arrived zero-copy instead) may never have touched its pages,
        // and a pooled buffer is mapped with all its pages populated: that would allocate
        // and zero the whole size for nothing.
    }
}

/// Set by [`fail_maps_for_tests`]' hook: every later mapping of a sealed memfd fails, as it
/// would on a kernel that refused it.
static FAIL_MAPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes every later read-only mapping of a sealed memfd in this process fail (a test hook:
/// how the shm channel behaves on a kernel that refuses the mapping).
pub fn force_map_failures_for_tests() {
    FAIL_MAPS.store(true, std::sync::atomic::Ordering::Relaxed);
}

fn fail_maps_for_tests() -> bool {
    FAIL_MAPS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether this kernel maps sealed memfds as the shm channel does (made, sealed and mapped
/// once per process; the answer is kept). `Err` says why not.
pub(crate) fn probe() -> std::result::Result<(), String> {
    static PROBED: std::sync::OnceLock<std::result::Result<(), String>> =
        std::sync::OnceLock::new();
    PROBED
        .get_or_init(|| {
            // Made, sealed, and mapped again as a peer maps it (a private view too).
            let probe = Region::copy_of(&[0u8; 1]).and_then(|region| {
                let fd = region
                    .shared_fd()?
                    .try_clone_to_owned()
                    .map_err(|e| Error::Io(format!("duplicating a memfd: {e}")))?;
                let (mapped, _) = Region::from_peer(fd, 1)?;
                let view = Arc::new(mapped).private_view(0..1)?;
                drop(view);
                Ok(())
            });
            probe.map_err(|e| e.to_string())
        })
        .clone()
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

/// Reads `dest.len()` bytes at `offset` of `fd` (a file that ends before is an error).
pub(crate) fn pread_all(fd: BorrowedFd<'_>, dest: &mut [u8], offset: u64) -> Result<()> {
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
mod tests;
