//! Reading and writing the bytes of numpy arrays (any dtype, including `ml_dtypes`' bf16
//! and f8): arrays sent are checked C-contiguous and copied with the GIL released, kept
//! alive by a reference wherever the copy runs; arrays received into are checked writable by
//! numpy's borrow tracking and their bytes claimed process-wide, so two calls never write
//! the same memory at once.

// A numpy array's data is a raw pointer: read here, after the checks.
#![allow(unsafe_code)]

use std::{
    ops::Range,
    sync::{Mutex, PoisonError},
};

use numpy::{BorrowError, PyArray1, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::{
    exceptions::{PyBufferError, PyTypeError, PyValueError},
    prelude::*,
};

use numpy::prelude::PyArrayDescrMethods;
use tb_node::{DType, Tensor};

use crate::errors::to_py;

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

/// Largest copy made on the calling task; larger ones run on the blocking pool, so an async
/// put never stalls the runtime's workers for a whole copy and hash.
const INLINE_COPY_MAX: usize = 256 << 10;

/// An array's bytes to send, with a reference that keeps the array alive wherever the copy
/// runs (a runtime task can outlive the Python call that started it: a cancelled await).
pub(crate) struct Source {
    raw: RawBytes,
    array: Py<PyAny>,
}

impl Source {
    /// The bytes of `array`, checked as [`RawBytes::of`] does.
    pub(crate) fn of(array: &Bound<'_, PyUntypedArray>) -> PyResult<Self> {
        Ok(Source {
            raw: RawBytes::of(array)?,
            array: array.clone().into_any().unbind(),
        })
    }

    /// The bytes, for as long as `self` (which keeps the array alive) is borrowed.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.raw.as_slice()
    }

    /// The bytes copied (and hashed) into a node tensor on this thread, with the GIL
    /// released: for a blocking call, whose thread waits for the copy either way (handing a
    /// large copy to the blocking pool would add a thread's wake-up before and after it).
    pub(crate) fn tensor_here(
        self,
        py: Python<'_>,
        dtype: DType,
        shape: Vec<u64>,
    ) -> PyResult<Tensor> {
        let Source { raw, array } = self;
        // `raw` moves into the closure (it is `Send`); `array`, held here, keeps its bytes.
        let copied = py.detach(move || Tensor::copy_from(dtype, shape, raw.as_slice()));
        drop(array);
        copied.map_err(to_py)
    }

    /// The bytes copied (and hashed) into a node tensor: on the blocking pool when large,
    /// which then owns the array's reference until the copy is done.
    pub(crate) async fn into_tensor(self, dtype: DType, shape: Vec<u64>) -> PyResult<Tensor> {
        if self.raw.len <= INLINE_COPY_MAX {
            return Tensor::copy_from(dtype, shape, self.raw.as_slice()).map_err(to_py);
        }
        tokio::task::spawn_blocking(move || {
            let copied = Tensor::copy_from(dtype, shape, self.raw.as_slice());
            drop(self.array);
            copied
        })
        .await
        .map_err(|e| crate::errors::base(format!("copying the array: {e}")))?
        .map_err(to_py)
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

/// The bytes of an `out` array a receive writes, claimed process-wide (see [`RECEIVING`]):
/// while it lives, a second receive into any of these addresses (the same array, a view of
/// it, a torch tensor over it) is refused, so the receive's `&mut [u8]` is the only one. A
/// reference keeps the array alive, so the receive may run as a runtime task that outlives
/// the Python call (a cancelled await).
pub(crate) struct OutTarget {
    ptr: *mut u8,
    len: usize,
    _claim: Claim,
    _array: Py<PyAny>,
}

// SAFETY: the claim makes this the only receive into those bytes, and the reference keeps
// them allocated wherever the target goes.
unsafe impl Send for OutTarget {}

impl OutTarget {
    /// Claims the bytes of `out` (contiguous, writable); `BufferError` while another receive
    /// writes any of them.
    pub(crate) fn claim(out: &Bound<'_, PyArray1<u8>>) -> PyResult<Self> {
        // numpy's own check first (writeable, not borrowed by other Rust code), released
        // at once: the claim is what keeps receives apart from here on.
        let mut borrowed = out.try_readwrite().map_err(|e| match e {
            BorrowError::NotWriteable => PyValueError::new_err("the out array is read-only"),
            _ => PyBufferError::new_err(ALREADY_WRITTEN),
        })?;
        borrowed.as_slice_mut().map_err(|_| {
            PyValueError::new_err("the out array is not C-contiguous: pass a contiguous array")
        })?;
        drop(borrowed);
        let start = out.data() as usize;
        let claim = Claim::take(start..start.saturating_add(out.len()))
            .ok_or_else(|| PyBufferError::new_err(ALREADY_WRITTEN))?;
        Ok(OutTarget {
            ptr: out.data(),
            len: out.len(),
            _claim: claim,
            _array: out.clone().into_any().unbind(),
        })
    }

    /// The bytes to receive into, exclusive while `self` lives.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `claim` checked contiguity and length; the claim makes the slice the only
        // one written; the reference keeps the memory alive while `self` (and so the
        // borrow) lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
