use super::*;

#[test]
fn a_copy_reads_back_and_once_shared_refuses_writes() {
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let region = Arc::new(Region::copy_of(&data).expect("region"));
    assert_eq!(region.bytes(), &data[..]);
    assert_eq!(region.slice(10..20), Bytes::copy_from_slice(&data[10..20]));
    assert!(!region.is_sealed(), "sealed only when the fd is passed on");
    // Sealed before the fd leaves: no write, no resize, even through the owner's own fd.
    let fd = region.shared_fd().expect("sealed");
    assert!(region.is_sealed());
    assert!(rustix::io::pwrite(fd, b"x", 0).is_err());
    assert!(fs::ftruncate(fd, 1).is_err());
    assert!(fs::ftruncate(fd, 1 << 30).is_err());
    // A second call hands out the same, sealed, fd.
    assert!(region.shared_fd().is_ok());
}

#[test]
fn a_writer_finishes_into_a_region_whose_private_views_do_not_write_through() {
    let mut writer = RegionWriter::new(10_000).expect("writer");
    writer.as_mut().fill(7);
    let region = Arc::new(writer.finish().expect("finish"));
    assert!(region.bytes().iter().all(|&b| b == 7));
    let view = region.private_view(0..region.len()).expect("view");
    // SAFETY (test): the view is this test's own writable mapping of `len` bytes.
    let written = unsafe { std::slice::from_raw_parts_mut(view.as_mut_ptr(), view.len()) };
    written[0] = 1;
    written[9_999] = 1;
    assert_eq!((region.bytes()[0], region.bytes()[9_999]), (7, 7));
    let other = region.private_view(0..region.len()).expect("view");
    // SAFETY (test): as above.
    let fresh = unsafe { std::slice::from_raw_parts(other.as_mut_ptr(), other.len()) };
    assert!(fresh.iter().all(|&b| b == 7));
    assert!(
        RegionWriter::new(0).is_err(),
        "an empty memfd cannot be mapped"
    );
}

/// The inode behind a region's fd (a pooled memfd keeps its inode).
fn inode(fd: BorrowedFd<'_>) -> u64 {
    fs::fstat(fd).expect("fstat").st_ino
}

#[test]
fn an_unshared_region_dropped_gives_its_pages_to_the_next_writer_of_its_size() {
    // A size no other test uses: the pool is the process's.
    const LEN: usize = 3 * 4096 + 17;
    let mut writer = RegionWriter::new(LEN).expect("writer");
    writer.as_mut().fill(1);
    let region = Arc::new(writer.finish().expect("finish"));
    let first = inode(region.fd.as_fd());
    // A private view keeps the region, so its memfd is not pooled while the view lives.
    let view = region.private_view(0..LEN).expect("view");
    drop(region);
    let mut other = RegionWriter::new(LEN).expect("writer");
    assert_ne!(
        inode(other.fd.as_fd()),
        first,
        "in use by a view: not reused"
    );
    other.as_mut().fill(3);
    let other = other.finish().expect("finish");
    let other_inode = inode(other.fd.as_fd());
    drop(view);
    // Now nothing maps it: the next writer of that size gets it (the most recent first),
    // rewrites it, and readers see only the new bytes.
    let mut again = RegionWriter::new(LEN).expect("writer");
    assert_eq!(inode(again.fd.as_fd()), first, "reused");
    again.as_mut().fill(2);
    let reused = Arc::new(again.finish().expect("finish"));
    assert!(reused.bytes().iter().all(|&b| b == 2));
    // Another size does not take it.
    let smaller = RegionWriter::new(LEN - 1).expect("writer");
    assert_ne!(inode(smaller.fd.as_fd()), first);
    // A writer dropped unfinished is not pooled (its pages may never have been touched).
    drop(smaller);
    assert!(!pool::holds(LEN - 1));
    drop(other);
    assert_eq!(
        inode(RegionWriter::new(LEN).expect("writer").fd.as_fd()),
        other_inode
    );
    let (buffers, bytes) = pool::held();
    assert!(buffers <= pool::MAX_BUFFERS && bytes <= pool::MAX_BYTES);
}

#[test]
fn a_pooled_buffer_is_read_again_through_the_mapping_it_kept() {
    // A size no other test uses: the pool is the process's.
    const LEN: usize = 5 * 4096 + 3;
    let first: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
    let (region, _) = Region::copy_hashed(&first).expect("region");
    let (ino, at) = (inode(region.fd.as_fd()), region.bytes().as_ptr());
    drop(region);
    // The same memfd and the same mapping, showing what the second fill put there.
    let second: Vec<u8> = first.iter().map(|b| b ^ 0x5a).collect();
    let (region, hash) = Region::copy_hashed(&second).expect("region");
    assert_eq!(inode(region.fd.as_fd()), ino, "the pooled memfd");
    assert_eq!(
        region.bytes().as_ptr(),
        at,
        "read through the mapping it kept"
    );
    assert_eq!(region.bytes(), &second[..]);
    assert_eq!(hash, ContentHash::of(&second));
    // Filled piece by piece, the next region of the size shows every piece.
    drop(region);
    let mut fill = RegionFill::new(LEN).expect("fill");
    fill.write_at(&first[..4096], 0).expect("write");
    fill.write_at(&first[4096..], 4096).expect("write");
    assert!(fill.write_at(&[0], LEN).is_err(), "past the end is refused");
    let region = fill.finish().expect("finish");
    assert_eq!((region.bytes().as_ptr(), region.bytes()), (at, &first[..]));
}

#[test]
fn a_pooled_buffer_keeps_its_writable_mapping_until_its_region_is_sealed() {
    // A size no other test uses: the pool is the process's.
    const LEN: usize = 7 * 4096 + 11;
    let first: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    let second: Vec<u8> = first.iter().map(|b| b ^ 0x3c).collect();
    // A new memfd is written with `pwrite`: nothing mapped writable.
    let (region, _) = Region::copy_hashed(&first).expect("region");
    assert!(region.fill_at().is_none());
    drop(region);
    // Reused, it is filled through a writable mapping, which it keeps.
    let (region, hash) = Region::copy_hashed(&second).expect("region");
    let at = region
        .fill_at()
        .expect("a pooled buffer is mapped writable once");
    assert_eq!(
        (region.bytes(), hash),
        (&second[..], ContentHash::of(&second))
    );
    drop(region);
    let (region, hash) = Region::copy_hashed(&first).expect("region");
    assert_eq!(region.fill_at(), Some(at), "the mapping it kept");
    assert_eq!(
        (region.bytes(), hash),
        (&first[..], ContentHash::of(&first))
    );
    // Sealed, it has none: a write seal is refused while one exists.
    region.shared_fd().expect("sealed");
    assert!(region.fill_at().is_none());
    assert!(region.is_sealed());
}

/// Whether this process has an fd open on the memfd of inode `ino`.
fn holds_inode(ino: u64) -> bool {
    std::fs::read_dir("/proc/self/fd")
        .expect("fds")
        .filter_map(|e| std::fs::metadata(e.ok()?.path()).ok())
        .any(|m| std::os::unix::fs::MetadataExt::ino(&m) == ino)
}

#[test]
fn a_large_shared_region_dropped_is_freed_off_the_dropping_thread() {
    // A size no other test uses (the pool is the process's).
    const LEN: usize = pool::SPARE_MIN + 7 * 4096 + 5;
    let region = Region::copy_of(&vec![4u8; LEN]).expect("region");
    let ino = inode(region.shared_fd().expect("sealed"));
    assert!(holds_inode(ino));
    drop(region);
    // Closed by the pool's thread (bounded wait), and never pooled.
    let closed = (0..500).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(10));
        !holds_inode(ino)
    });
    assert!(closed, "the sealed memfd was closed");
    let freed = pool::FREED_ON_THREAD.lock().expect("freed list");
    assert!(freed.contains(&ino), "closed by the pool's thread");
    drop(freed);
    assert!(!pool::holds(LEN) || RegionWriter::new(LEN).is_ok_and(|w| inode(w.fd.as_fd()) != ino));
}

#[test]
fn a_region_whose_fd_was_shared_is_never_pooled() {
    const LEN: usize = 5 * 4096 + 3;
    let region = Region::copy_of(&[9u8; LEN]).expect("region");
    let first = inode(region.fd.as_fd());
    region.shared_fd().expect("sealed");
    drop(region);
    let writer = RegionWriter::new(LEN).expect("writer");
    assert_ne!(
        inode(writer.fd.as_fd()),
        first,
        "a sealed memfd is not rewritten"
    );
    // A region mapped from a peer's fd is sealed: never pooled either.
    let source = Region::copy_of(&[4u8; LEN]).expect("region");
    let dup = source
        .shared_fd()
        .expect("sealed")
        .try_clone_to_owned()
        .expect("dup");
    let peer_inode = inode(dup.as_fd());
    let (peer, _) = Region::from_peer(dup, LEN as u64).expect("mapped");
    drop((peer, source));
    let writer = RegionWriter::new(LEN).expect("writer");
    assert_ne!(inode(writer.fd.as_fd()), peer_inode);
}

#[test]
fn a_peer_fd_must_be_sealed_and_long_enough() {
    let region = Region::copy_of(b"hello").expect("region");
    let fd = region.shared_fd().expect("sealed");
    let dup = fd.try_clone_to_owned().expect("dup");
    let (peer, whole) = Region::from_peer(dup, 5).expect("sealed");
    assert_eq!(peer.bytes(), b"hello");
    assert!(whole);
    // Only the payload is mapped, however long the file.
    let dup = region.fd.try_clone().expect("dup");
    let (peer, whole) = Region::from_peer(dup, 3).expect("sealed");
    assert_eq!((peer.bytes(), whole), (&b"hel"[..], false));
    let dup = region.fd.try_clone().expect("dup");
    assert!(Region::from_peer(dup, 6).is_err());
    // An unsealed memfd (its owner could still change it) is refused.
    let open = fs::memfd_create("t", fs::MemfdFlags::ALLOW_SEALING).expect("memfd");
    fs::ftruncate(&open, 5).expect("size");
    assert!(Region::from_peer(open, 5).is_err());
    // So is a file descriptor that is no memfd at all.
    let file = std::fs::File::open("/proc/self/status").expect("file");
    assert!(Region::from_peer(OwnedFd::from(file), 1).is_err());
}

#[test]
fn sealing_a_large_region_pools_a_spare_of_its_size_with_its_pages_allocated() {
    // A size no other test uses (the pool is the process's).
    const LEN: usize = pool::SPARE_MIN + 3 * 4096 + 17;
    let region = Region::copy_of(&[5u8; LEN]).expect("region");
    let sealed = inode(region.fd.as_fd());
    assert!(!pool::holds(LEN));
    region.shared_fd().expect("sealed");
    // Made on the spare thread: wait for it, bounded (100 x 20 ms).
    let made = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        pool::holds(LEN)
    });
    assert!(made, "a spare of the sealed region's size was pooled");
    let mut writer = RegionWriter::new(LEN).expect("writer");
    let spare = inode(writer.fd.as_fd());
    assert_ne!(spare, sealed, "the spare is a new memfd");
    let blocks = fs::fstat(&writer.fd).expect("fstat").st_blocks as usize;
    assert!(
        blocks * 512 >= LEN,
        "its pages are allocated ({blocks} blocks)"
    );
    // Written like any pooled buffer: every byte is the writer's.
    writer.as_mut().fill(8);
    let next = writer.finish().expect("finish");
    assert!(next.bytes().iter().all(|&b| b == 8));
    // A small region gets no spare.
    let small = Region::copy_of(&[1u8; 3 * 4096 + 1]).expect("region");
    small.shared_fd().expect("sealed");
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!pool::holds(3 * 4096 + 1));
}

#[test]
fn a_fill_copies_a_peers_memfd_at_an_offset_by_the_kernel_or_by_reads() {
    // A size no other test uses: the pool is the process's.
    const LEN: usize = 3 * 4096 + 17;
    const AT: u64 = 5000;
    let data: Vec<u8> = (0..LEN + AT as usize).map(|i| (i % 241) as u8).collect();
    let peer = Region::copy_of(&data).expect("a peer's memfd");
    let src = peer.read_only_fd().expect("read-only");
    assert!(
        rustix::io::pwrite(&src, b"x", 0).is_err(),
        "the fd passed on cannot write"
    );
    let want = &data[AT as usize..];
    // `copy_file_range`, and the reads it falls back to where the kernel cannot.
    let mut fill = RegionFill::new(LEN).expect("fill");
    fill.copy_from(&src, AT).expect("copied");
    assert_eq!(fill.finish().expect("region").bytes(), want);
    let mut fill = RegionFill::new(LEN).expect("fill");
    fill.read_from(&src, AT).expect("read");
    assert_eq!(fill.finish().expect("region").bytes(), want);
    // A file that ends before the payload does is an error either way, never a short copy.
    let mut fill = RegionFill::new(LEN).expect("fill");
    assert!(fill.copy_from(&src, AT + 1).is_err());
    let mut fill = RegionFill::new(LEN).expect("fill");
    assert!(fill.read_from(&src, AT + 1).is_err());
    assert!(
        !peer.is_sealed(),
        "a read-only fd of it was made, nothing sealed"
    );
}
