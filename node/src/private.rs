//! [`PrivateBytes`]: a tensor's bytes as a private, writable buffer of one reader's own, for
//! handing to code that may write into what it was given (a Python user's in-place op).

// A buffer handed out by address: the mapping (or box) is freed here once.
#![allow(unsafe_code)]

use std::ptr::NonNull;

/// A tensor's bytes as a private, writable buffer of its own: a copy-on-write mapping of
/// the tensor's region, or (small tensors, and where there are no memfds) a copy. What is
/// written into it changes nothing anyone else sees.
pub struct PrivateBytes(Private);

enum Private {
    #[cfg(target_os = "linux")]
    Mapped {
        ptr: NonNull<u8>,
        len: usize,
    },
    Copied(Box<[u8]>),
}

// SAFETY: the buffer is owned by this value (a private mapping or a box) and freed once in
// `Drop`; whoever writes through `as_mut_ptr` (a Python array) coordinates as with any buffer.
unsafe impl Send for PrivateBytes {}
// SAFETY: as above: `&PrivateBytes` only hands out the address.
unsafe impl Sync for PrivateBytes {}

impl std::fmt::Debug for PrivateBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.0 {
            #[cfg(target_os = "linux")]
            Private::Mapped { .. } => "mapped",
            Private::Copied(_) => "copied",
        };
        write!(f, "PrivateBytes({kind}, {} bytes)", self.len())
    }
}

impl PrivateBytes {
    /// Wraps a private writable mapping of `len` bytes at `ptr`, unmapped on drop.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be a mapping (`mmap`) that nothing else refers to or unmaps.
    #[cfg(target_os = "linux")]
    pub(crate) unsafe fn mapped(ptr: NonNull<u8>, len: usize) -> Self {
        PrivateBytes(Private::Mapped { ptr, len })
    }

    /// A private copy of `bytes`.
    pub(crate) fn copy_of(bytes: &[u8]) -> Self {
        PrivateBytes(Private::Copied(bytes.into()))
    }

    /// The first byte's address (writable: writes stay in this buffer).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        match &self.0 {
            #[cfg(target_os = "linux")]
            Private::Mapped { ptr, .. } => ptr.as_ptr(),
            Private::Copied(b) => b.as_ptr().cast_mut(),
        }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        match &self.0 {
            #[cfg(target_os = "linux")]
            Private::Mapped { len, .. } => *len,
            Private::Copied(b) => b.len(),
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the bytes are a copy-on-write mapping (no copy made) rather than a copy.
    pub fn is_mapped(&self) -> bool {
        !matches!(self.0, Private::Copied(_))
    }
}

impl Drop for PrivateBytes {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Private::Mapped { ptr, len } = self.0 {
            // SAFETY: the mapping handed to `mapped`, which nothing else unmaps: unmapped
            // exactly once.
            let _ = unsafe { rustix::mm::munmap(ptr.as_ptr().cast(), len) };
        }
    }
}
