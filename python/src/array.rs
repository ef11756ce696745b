//! Reading and writing the bytes of numpy arrays (any dtype, including `ml_dtypes`' bf16
//! and f8): arrays sent are checked C-contiguous and copied with the GIL released; arrays
//! received into are borrowed for writing through numpy's borrow tracking, and their bytes
//! claimed process-wide, so two calls never write the same memory at once.

// A numpy array's data is a raw pointer: read here, after the checks.
#![allow(unsafe_code)]

use std::{
    ops::Range,
    sync::{Mutex, PoisonError},
};

use numpy::{
    BorrowError, PyArray1, PyArrayMethods, PyReadwriteArray1, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::{
    exceptions::{PyBufferError, PyTypeError, PyValueError},
    prelude::*,
};

use numpy::prelude::PyArrayDescrMethods;

/// An array's bytes, pinned by a reference to the array the caller keeps.
pub(crate) struct RawBytes {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is only used while the caller holds a reference to the array (which
// keeps its memory alive); moving the address to another thread changes nothing about that.
unsafe impl Send for RawBytes {}

impl RawBytes {
    /// The bytes of `array`: it must be C-contiguous with no Python objects in it.
    pub(crate) fn of(array: &Bound<'_, PyUntypedArray>) -> PyResult<Self> {
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
        let data = unsafe { (*raw).fields.data };
        let len = array
            .shape()
            .iter()
            .try_fold(dtype.itemsize(), |n, d| n.checked_mul(*d))
            .ok_or_else(|| PyValueError::new_err("the array's size overflows"))?;
        Ok(RawBytes {
            ptr: data.cast::<u8>().cast_const(),
            len,
        })
    }

    /// The bytes, to copy from. Call with the array alive (the caller holds it) and use the
    /// slice only during the call that received it.
    pub(crate) fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `of` checked the array is contiguous and `len` bytes long; the caller keeps
        // it alive while the slice (borrowed from `self`) is used.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// What a second receive into memory being received into is told.
const ALREADY_WRITTEN: &str =
    "the out array is already being written by another call: give each get its own array";

/// The address ranges calls of this process are receiving into. numpy's borrow tracking
/// knows memory by the Python object that owns it, and a torch tensor hands numpy a new
/// owner (a new tensor) for every view of it, so two receives into one torch tensor would
/// both pass numpy's check; this list sees the addresses themselves.
static RECEIVING: Mutex<Vec<Range<usize>>> = Mutex::new(Vec::new());

/// A range of [`RECEIVING`], given back on drop.
struct Claim(Range<usize>);

impl Claim {
    /// Claims `range`; `None` while another claim overlaps it.
    fn take(range: Range<usize>) -> Option<Self> {
        if range.is_empty() {
            return Some(Claim(range));
        }
        // Held for a scan of the receives in flight (a handful) and never across a wait;
        // the list stays consistent if a holder panicked, so a poisoned lock is used as is.
        let mut held = RECEIVING.lock().unwrap_or_else(PoisonError::into_inner);
        if held
            .iter()
            .any(|r| r.start < range.end && range.start < r.end)
        {
            return None;
        }
        held.push(range.clone());
        Some(Claim(range))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let mut held = RECEIVING.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = held.iter().position(|r| *r == self.0) {
            held.swap_remove(i);
        }
    }
}

/// An `out` array (its bytes as a 1-D `uint8` view) borrowed for writing: while this guard
/// lives, numpy's borrow tracking refuses any other Rust borrow of overlapping memory (a
/// second call receiving into the same array, or a view of it), and the claim on its
/// addresses refuses a second receive into them however they are owned, so the receive's
/// `&mut [u8]` is the only one. Keep it on the stack, GIL held, around the whole receive;
/// only the slice goes where the GIL is released.
pub(crate) struct OutBytes<'py> {
    guard: PyReadwriteArray1<'py, u8>,
    _claim: Claim,
}

impl<'py> OutBytes<'py> {
    /// Borrows `out` for writing: refused with `BufferError` while another call writes it,
    /// `ValueError` when it is read-only or not contiguous.
    pub(crate) fn borrow(out: &Bound<'py, PyArray1<u8>>) -> PyResult<Self> {
        let guard = out.try_readwrite().map_err(|e| match e {
            BorrowError::NotWriteable => PyValueError::new_err("the out array is read-only"),
            _ => PyBufferError::new_err(ALREADY_WRITTEN),
        })?;
        let start = out.data() as usize;
        let claim = Claim::take(start..start.saturating_add(out.len()))
            .ok_or_else(|| PyBufferError::new_err(ALREADY_WRITTEN))?;
        Ok(OutBytes {
            guard,
            _claim: claim,
        })
    }

    /// The bytes to receive into, exclusive while `self` lives.
    pub(crate) fn as_mut_slice(&mut self) -> PyResult<&mut [u8]> {
        self.guard.as_slice_mut().map_err(|_| {
            PyValueError::new_err("the out array is not C-contiguous: pass a contiguous array")
        })
    }
}
