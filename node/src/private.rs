//! [`PrivateBytes`]: a tensor's bytes as a private, writable buffer of one reader's own, for
//! handing to code that may write into what it was given (a Python user's in-place op).

// A buffer handed out by address: the mapping (or allocation) is freed here once.
#![allow(unsafe_code)]

use std::ptr::NonNull;

/// A tensor's bytes as a private, writable buffer of its own: a copy-on-write mapping of
/// the tensor's region, or (small tensors, and where there are no memfds) a copy. What is
/// written into it changes nothing anyone else sees.
pub struct PrivateBytes(Private);

/// The buffer, owned by raw pointer (not a `Box`: callers write through the address while
/// this value only holds it, which a `Box`'s unique ownership would forbid).
enum Private {
    /// A private mapping of `map_len` bytes at `base`; the bytes start `offset` into it.
    #[cfg(target_os = "linux")]
    Mapped {
        base: NonNull<u8>,
        map_len: usize,
        offset: usize,
        len: usize,
        /// What the mapping's file must outlive it for (its region: not pooled meanwhile).
        _keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    },
    /// A heap allocation from `Box::<[u8]>::into_raw`.
    Copied { ptr: NonNull<u8>, len: usize },
}

// SAFETY: the buffer is owned by this value (a private mapping or an allocation) and freed
// once in `Drop`; whoever writes through `as_mut_ptr` (a Python array) coordinates as with any
// buffer it was given.
unsafe impl Send for PrivateBytes {}
// SAFETY: as above: `&PrivateBytes` only hands out the address.
unsafe impl Sync for PrivateBytes {}

impl std::fmt::Debug for PrivateBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_mapped() { "mapped" } else { "copied" };
        write!(f, "PrivateBytes({kind}, {} bytes)", self.len())
    }
}

impl PrivateBytes {
    /// Wraps a private writable mapping of `map_len` bytes at `base`, unmapped on drop, whose
    /// bytes of interest are `offset..offset + len`.
    ///
    /// # Safety
    /// `base..base + map_len` must be a mapping (`mmap`) that nothing else refers to or
    /// unmaps, and `offset + len <= map_len`. `keep` is held until the mapping is gone.
    #[cfg(target_os = "linux")]
    pub(crate) unsafe fn mapped(
        base: NonNull<u8>,
        map_len: usize,
        offset: usize,
        len: usize,
        keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        debug_assert!(offset + len <= map_len);
        PrivateBytes(Private::Mapped {
            base,
            map_len,
            offset,
            len,
            _keep: keep,
        })
    }

    /// A private copy of `bytes`.
    pub(crate) fn copy_of(bytes: &[u8]) -> Self {
        let boxed: Box<[u8]> = bytes.into();
        let len = boxed.len();
        let raw = Box::into_raw(boxed).cast::<u8>();
        // `Box::into_raw` never returns null (an empty box is a dangling, non-null pointer).
        let ptr = NonNull::new(raw).unwrap_or(NonNull::dangling());
        PrivateBytes(Private::Copied { ptr, len })
    }

    /// The first byte's address (writable: writes stay in this buffer).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        match &self.0 {
            #[cfg(target_os = "linux")]
            Private::Mapped { base, offset, .. } => base.as_ptr().wrapping_add(*offset),
            Private::Copied { ptr, .. } => ptr.as_ptr(),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            #[cfg(target_os = "linux")]
            Private::Mapped { len, .. } => *len,
            Private::Copied { len, .. } => *len,
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the bytes are a copy-on-write mapping (no copy made) rather than a copy.
    pub fn is_mapped(&self) -> bool {
        !matches!(self.0, Private::Copied { .. })
    }
}

impl Drop for PrivateBytes {
    fn drop(&mut self) {
        match &self.0 {
            #[cfg(target_os = "linux")]
            Private::Mapped { base, map_len, .. } => {
                // SAFETY: the mapping handed to `mapped`, which nothing else unmaps: unmapped
                // exactly once.
                let _ = unsafe { rustix::mm::munmap(base.as_ptr().cast(), *map_len) };
            }
            Private::Copied { ptr, len } => {
                let slice = std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), *len);
                // SAFETY: `ptr`/`len` came from `Box::into_raw` in `copy_of` and are turned
                // back into that box exactly once.
                drop(unsafe { Box::from_raw(slice) });
            }
        }
    }
}
