//! Reading and writing the bytes of numpy arrays (any dtype, including `ml_dtypes`' bf16
//! and f8): checked C-contiguous, copied with the GIL released.

// A numpy array's data is a raw pointer: read (or written) here, after the checks.
#![allow(unsafe_code)]

use numpy::{PyUntypedArray, PyUntypedArrayMethods, npyffi};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    prelude::*,
};

use numpy::prelude::PyArrayDescrMethods;

/// An array's bytes, pinned by a reference to the array the caller keeps.
pub(crate) struct RawBytes {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is only used while the caller holds a reference to the array (which
// keeps its memory alive); moving the address to another thread changes nothing about that.
unsafe impl Send for RawBytes {}

impl RawBytes {
    /// The bytes of `array`: it must be C-contiguous with no Python objects in it;
    /// `writable` also asks for a writable array.
    pub(crate) fn of(array: &Bound<'_, PyUntypedArray>, writable: bool) -> PyResult<Self> {
        let dtype = array.dtype();
        if dtype.has_object() {
            return Err(PyTypeError::new_err(
                "arrays of Python objects cannot be sent: convert to a numeric dtype",
            ));
        }
        if !array.is_c_contiguous() {
            return Err(PyValueError::new_err(
                "the array is not C-contiguous: pass numpy.ascontiguousarray(a)",
            ));
        }
        let raw = array.as_array_ptr();
        // SAFETY: `raw` is the live array object `array` refers to.
        let (data, flags) = unsafe { ((*raw).fields.data, (*raw).fields.flags) };
        if writable && (flags & npyffi::NPY_ARRAY_WRITEABLE) == 0 {
            return Err(PyValueError::new_err("the out array is read-only"));
        }
        let len = array
            .shape()
            .iter()
            .try_fold(dtype.itemsize(), |n, d| n.checked_mul(*d))
            .ok_or_else(|| PyValueError::new_err("the array's size overflows"))?;
        Ok(RawBytes {
            ptr: data.cast::<u8>(),
            len,
        })
    }

    /// A copy of the bytes. Call with the array alive (the caller holds it).
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        if self.len == 0 {
            return Vec::new();
        }
        // SAFETY: `of` checked the array is contiguous and `len` bytes long; the caller keeps
        // it alive for this call.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }

    /// The bytes as a mutable slice, for receiving into. Call with the array alive and no
    /// other Rust view of it (the caller holds the array; `self` is borrowed mutably).
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `of(.., writable: true)` checked the array is writable, contiguous and
        // `len` bytes long; the caller keeps it alive while the slice is used, and the
        // mutable borrow of `self` makes this the only Rust view of it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
