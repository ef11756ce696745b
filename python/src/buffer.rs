//! [`Buffer`]: the bytes of a received tensor as a Python object, without a copy of the
//! payload. It holds the node's `Tensor` (shared, immutable bytes: the ones the node's store
//! keeps and serves) and lends Python a *private* view of them
//! ([`Tensor::private_view`]): a copy-on-write mapping of the tensor's sealed memfd (up to
//! 4 MiB: a copy, which costs less than mapping the pages). Arrays and tensors made from one `Buffer` share that view; an
//! in-place write into one of them (a torch op, an optimizer step, `get(out=t)`) copies the
//! pages it touches into this process and changes nothing the node holds or serves, nor
//! what any other get returns. The view is lent through the buffer protocol (read-only:
//! numpy's `frombuffer`, `memoryview`), as read-only numpy arrays, and as a 1-D `uint8`
//! DLPack capsule (`torch.from_dlpack`). A tensor on a CUDA device is lent as a DLPack
//! capsule of that device (`kDLCUDA`) over a private device-to-device copy (one per buffer,
//! at device memory speed; none for a get received into fresh device memory, which nothing
//! else holds), so in-place ops on it never reach the node's buffer either. The bytes live
//! until the last array or tensor made from them is gone.

// The buffer protocol and DLPack are C interfaces: raw pointers handed to Python, checked
// here once.
#![allow(unsafe_code)]

use std::{
    ffi::{CStr, c_int, c_void},
    ptr::{self, NonNull},
    sync::{Arc, OnceLock},
};

use numpy::{
    PyArrayDescr, PyArrayDescrMethods, PyUntypedArray,
    npyffi::{self, PY_ARRAY_API, npy_intp},
};
use pyo3::{
    exceptions::{PyBufferError, PyTypeError, PyValueError},
    ffi,
    prelude::*,
    types::PyCapsule,
};
use tb_node::{DeviceBuffer, PrivateBytes, Tensor};

/// A received tensor's bytes, read-only, with its name, version, dtype and shape.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct Buffer {
    tensor: Tensor,
    name: String,
    version: u64,
    /// The private view Python's arrays and tensors use, made on first need.
    view: OnceLock<Arc<PrivateBytes>>,
    /// The private device copy a DLPack consumer gets of a device tensor, made on first need.
    device_view: OnceLock<DeviceBuffer>,
}

impl Buffer {
    /// Wraps a tensor (a device tensor lends its bytes through DLPack only).
    pub(crate) fn new(name: String, version: u64, tensor: Tensor) -> Self {
        Buffer {
            tensor,
            name,
            version,
            view: OnceLock::new(),
            device_view: OnceLock::new(),
        }
    }

    /// The private copy of the device bytes (one device-to-device copy, made on first call
    /// with the GIL released), so a consumer's in-place writes never reach the node's buffer.
    /// Bytes that only this buffer holds (a get received into fresh device memory, which the
    /// node does not keep) are lent as they are: they are private already.
    fn device_view(&self, py: Python<'_>, buf: &DeviceBuffer) -> PyResult<&DeviceBuffer> {
        if let Some(view) = self.device_view.get() {
            return Ok(view);
        }
        let made = match buf.is_unique() {
            true => buf.clone(),
            false => py
                .detach(|| buf.duplicate())
                .map_err(crate::errors::to_py)?,
        };
        Ok(self.device_view.get_or_init(|| made))
    }

    /// The private view of the host bytes, made on first call (a mapping, or for a tensor
    /// that has no memfd yet one copy into one, made with the GIL released).
    fn view(&self, py: Python<'_>) -> PyResult<&Arc<PrivateBytes>> {
        if let Some(view) = self.view.get() {
            return Ok(view);
        }
        self.bytes()?;
        let made = py
            .detach(|| self.tensor.private_view())
            .map_err(crate::errors::to_py)?;
        // Two threads racing here: one view wins, the other is unmapped unused.
        Ok(self.view.get_or_init(|| Arc::new(made)))
    }

    /// What a DLPack capsule points at: the first byte, the length, the device, and the
    /// private view that holds the bytes.
    fn exported_memory(&self, py: Python<'_>) -> PyResult<(*mut c_void, usize, DlDevice, Kept)> {
        if let Some(buf) = self.tensor.device_buffer() {
            let buf = self.device_view(py, buf)?;
            let device = DlDevice {
                device_type: DL_CUDA,
                device_id: i32::try_from(buf.ordinal())
                    .map_err(|_| PyBufferError::new_err("device ordinal out of range"))?,
            };
            // A device address, never dereferenced here: DLPack consumers read it on the
            // device. The capsule keeps the buffer alive.
            let data = buf.device_ptr() as usize as *mut c_void;
            return Ok((data, buf.len(), device, Kept::Device(buf.clone())));
        }
        let view = self.view(py)?;
        let device = DlDevice {
            device_type: DL_CPU,
            device_id: 0,
        };
        Ok((
            view.as_mut_ptr().cast::<c_void>(),
            view.len(),
            device,
            Kept::Host(view.clone()),
        ))
    }

    /// The host bytes.
    pub(crate) fn bytes(&self) -> PyResult<&[u8]> {
        match self.tensor.host_data() {
            Some(bytes) => Ok(bytes),
            None => Err(PyBufferError::new_err(format!(
                "tensor \"{}\" v{} is on {:?}, not in host memory",
                self.name,
                self.version,
                self.tensor.device()
            ))),
        }
    }
}

/// The name DLPack gives a capsule that has not been consumed yet.
const DLTENSOR: &CStr = c"dltensor";
/// `kDLCPU`.
const DL_CPU: i32 = 1;
/// `kDLCUDA`.
const DL_CUDA: i32 = 2;
/// `kDLUInt`.
const DL_UINT: u8 = 1;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack's (unversioned) `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// What a capsule owns: the managed tensor (first, so a pointer to it is a pointer to this),
/// its shape, and the private view its bytes are in.
#[repr(C)]
struct Exported {
    managed: DlManagedTensor,
    shape: [i64; 1],
    _kept: Kept,
}

/// The private view a capsule keeps alive (held, never read: dropping it frees the bytes):
/// host bytes, or a device copy.
enum Kept {
    Host(#[allow(dead_code)] Arc<PrivateBytes>),
    Device(#[allow(dead_code)] DeviceBuffer),
}

/// DLPack's deleter: frees what [`Buffer::__dlpack__`] allocated (any thread, no GIL needed).
unsafe extern "C" fn delete_exported(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the first field of a boxed `Exported` (see `__dlpack__`), and a
    // consumer calls the deleter once.
    unsafe { drop(Box::from_raw(managed.cast::<Exported>())) };
}

/// The capsule's destructor: frees the tensor unless a consumer took it (and renamed the
/// capsule `used_dltensor`; then the consumer calls the deleter).
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            delete_exported(managed.cast::<DlManagedTensor>());
        }
    }
}

#[pymethods]
impl Buffer {
    /// The tensor's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The version received.
    #[getter]
    fn version(&self) -> u64 {
        self.version
    }

    /// The dtype's name as the CLI spells it (`f32`, `bf16`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.tensor.dtype().name()
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.tensor.shape().to_vec()
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.tensor.byte_len()
    }

    /// Address of the first byte of the private view that this buffer's arrays and tensors
    /// share (to check that they share it).
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.view(py)?.as_mut_ptr() as usize)
    }

    /// Whether the view is a copy-on-write mapping of the node's memfd (no payload byte
    /// copied) rather than a copy (small tensors).
    #[getter]
    fn mapped(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.view(py)?.is_mapped())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.bytes()?.len())
    }

    fn __repr__(&self) -> String {
        format!(
            "Buffer(name={:?}, version={}, dtype={}, shape={:?})",
            self.name,
            self.version,
            self.tensor.dtype().name(),
            self.tensor.shape()
        )
    }

    /// Lends the bytes read-only, as unsigned bytes (`B`); a writable request is refused.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("no view to fill"));
        }
        if (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "a received tensor is read-only (copy it to write: numpy.array(a))",
            ));
        }
        let (buf, len) = {
            let view = slf.get().view(slf.py())?;
            (view.as_mut_ptr().cast_const(), view.len())
        };
        let len = isize::try_from(len).map_err(|_| PyBufferError::new_err("buffer too large"))?;
        // SAFETY: `view` is the non-null view Python asks us to fill; the bytes stay valid
        // while `view.obj` (a reference to this object, released by Python) lives, because the
        // object holds its private view until it is dropped. `format` points to a static string, and
        // `shape`/`strides` into the view itself, as the protocol allows.
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = buf.cast_mut().cast::<c_void>();
            (*view).len = len;
            (*view).readonly = 1;
            (*view).itemsize = 1;
            (*view).format = match (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
                true => c"B".as_ptr().cast_mut(),
                false => ptr::null_mut(),
            };
            (*view).ndim = 1;
            (*view).shape = match (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND {
                true => &raw mut (*view).len,
                false => ptr::null_mut(),
            };
            (*view).strides = match (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
                true => &raw mut (*view).itemsize,
                false => ptr::null_mut(),
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = ptr::null_mut();
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    /// The bytes as a DLPack capsule: a 1-D `uint8` tensor over them, no copy (the package
    /// views it as the real dtype and shape), on the CPU or on the CUDA device that holds
    /// them. `stream` and the other arguments of the protocol are accepted: a device
    /// tensor's bytes were written and synchronized before the buffer was made, so they are
    /// ready on any stream.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let _ = (stream, max_version, dl_device);
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "a copy was asked for: the package exports its bytes without copying",
            ));
        }
        let this = slf.get();
        let (data, len, device, kept) = this.exported_memory(slf.py())?;
        let len = i64::try_from(len).map_err(|_| PyBufferError::new_err("too large"))?;
        let exported = Box::new(Exported {
            managed: DlManagedTensor {
                dl_tensor: DlTensor {
                    data,
                    device,
                    ndim: 1,
                    dtype: DlDataType {
                        code: DL_UINT,
                        bits: 8,
                        lanes: 1,
                    },
                    shape: ptr::null_mut(),
                    strides: ptr::null_mut(),
                    byte_offset: 0,
                },
                manager_ctx: ptr::null_mut(),
                deleter: Some(delete_exported),
            },
            shape: [len],
            _kept: kept,
        });
        let raw = Box::into_raw(exported);
        // SAFETY: `raw` is a valid, uniquely owned allocation; the shape pointer points into
        // it (stable: it is boxed) and the data pointer into bytes it keeps alive.
        unsafe {
            (*raw).managed.dl_tensor.shape = (&raw mut (*raw).shape).cast::<i64>();
            (*raw).managed.manager_ctx = raw.cast::<c_void>();
        }
        let pointer = NonNull::new(raw.cast::<c_void>())
            .ok_or_else(|| PyBufferError::new_err("allocation failed"))?;
        // SAFETY: the capsule points to the managed tensor (first field of `Exported`); its
        // destructor frees it unless a consumer renamed the capsule and took ownership.
        let capsule = unsafe {
            PyCapsule::new_with_pointer_and_destructor(
                slf.py(),
                pointer,
                DLTENSOR,
                Some(drop_capsule),
            )
        };
        if capsule.is_err() {
            // SAFETY: the capsule was not made, so nobody else owns `raw`.
            unsafe { delete_exported(raw.cast::<DlManagedTensor>()) };
        }
        capsule
    }

    /// The bytes as a writable 1-D `uint8` numpy array the caller owns: a copy to host memory
    /// of a device tensor's (the GIL released meanwhile), a private view of a host one's.
    fn host_copy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyUntypedArray>> {
        let host = py
            .detach(|| self.tensor.to_device(tb_node::Device::Host))
            .map_err(crate::errors::to_py)?;
        writable_array(py, &host)
    }

    /// A read-only numpy array of `dtype` over the bytes, shaped as the tensor, whose `base`
    /// is this buffer (no copy). `dtype`'s item size must fit the tensor's; a dtype holding
    /// Python objects, or a structured or void one, is refused (`TypeError`).
    fn numpy<'py>(
        slf: &Bound<'py, Self>,
        dtype: Bound<'py, PyArrayDescr>,
    ) -> PyResult<Bound<'py, PyUntypedArray>> {
        let py = slf.py();
        let this = slf.get();
        check_view_dtype(&dtype, &this.name)?;
        let view = this.view(py)?;
        let mut dims = this
            .tensor
            .shape()
            .iter()
            .map(|d| npy_intp::try_from(*d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| PyValueError::new_err("a dimension does not fit numpy's index type"))?;
        let elements: u64 = this.tensor.shape().iter().product();
        let itemsize = dtype.itemsize() as u64;
        if elements.checked_mul(itemsize) != Some(view.len() as u64) {
            return Err(PyValueError::new_err(format!(
                "dtype {dtype} does not fit tensor \"{}\" ({} bytes for shape {:?})",
                this.name,
                view.len(),
                this.tensor.shape()
            )));
        }
        let ndim = c_int::try_from(dims.len())
            .map_err(|_| PyValueError::new_err("too many dimensions"))?;
        // SAFETY: a new array over `bytes` (valid while this buffer lives: the array's base
        // is set to it below, and it never changes them), C-contiguous, read-only (no
        // WRITEABLE flag); `dtype`'s reference is stolen by the call, so it is given one.
        let array = unsafe {
            let array = PY_ARRAY_API.PyArray_NewFromDescr(
                py,
                npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
                dtype.into_dtype_ptr(),
                ndim,
                dims.as_mut_ptr(),
                ptr::null_mut(),
                view.as_mut_ptr().cast::<c_void>(),
                npyffi::NPY_ARRAY_C_CONTIGUOUS,
                ptr::null_mut(),
            );
            let array = Bound::from_owned_ptr_or_err(py, array)?;
            // Steals the reference to the buffer it is given.
            let set = PY_ARRAY_API.PyArray_SetBaseObject(
                py,
                array.as_ptr().cast::<npyffi::PyArrayObject>(),
                slf.clone().into_any().into_ptr(),
            );
            if set != 0 {
                return Err(PyErr::fetch(py));
            }
            array.cast_into_unchecked::<PyUntypedArray>()
        };
        Ok(array)
    }

    /// Where the DLPack tensor lives: `(kDLCPU, 0)`, or `(kDLCUDA, ordinal)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        match self.tensor.device_buffer() {
            Some(buf) => (DL_CUDA, i32::try_from(buf.ordinal()).unwrap_or(i32::MAX)),
            None => (DL_CPU, 0),
        }
    }

    /// The CUDA device holding the bytes, or `None` for host memory.
    #[getter]
    fn cuda_device(&self) -> Option<usize> {
        self.tensor.device_buffer().map(|b| b.ordinal())
    }
}

/// Refuses a `dtype` that cannot safely view received bytes: one holding Python objects
/// (numpy would read the bytes as object pointers and crash the process), or a structured,
/// subarray or plain void one (fields and subarrays reinterpret the layout; the package
/// never makes them). A user-defined dtype (`ml_dtypes`' bf16 and f8) is of kind `V` too,
/// so plain void is told apart by its type number, not its kind.
fn check_view_dtype(dtype: &Bound<'_, PyArrayDescr>, name: &str) -> PyResult<()> {
    if dtype.has_object()
        || dtype.has_fields()
        || dtype.has_subarray()
        || dtype.num() == npyffi::NPY_TYPES::NPY_VOID as c_int
    {
        return Err(PyTypeError::new_err(format!(
            "dtype {dtype} cannot view tensor \"{name}\": a dtype with Python objects, \
             fields, a subarray or void items cannot view received bytes"
        )));
    }
    Ok(())
}

/// Copies the `len` bytes of a CUDA tensor at device address `ptr` on device `ordinal` into a
/// buffer of the node's, device to device (blocks until done).
///
/// The caller (`Client.put`) passes a contiguous torch CUDA tensor's `data_ptr()` and
/// `nbytes` after synchronizing the stream that produced it, and keeps the tensor referenced
/// for the whole call.
pub(crate) fn copy_cuda(
    ordinal: usize,
    ptr: u64,
    len: usize,
) -> tb_node::Result<tb_node::DeviceBuffer> {
    // SAFETY: per the caller's contract above, `ptr..ptr + len` is live device memory of this
    // process on `ordinal` (torch allocates in the primary context, which the node's CUDA
    // context is), finished and not written while the copy runs.
    unsafe { tb_node::DeviceBuffer::copy_from_device_ptr(ordinal, ptr, len) }
}

/// The owner of a private, writable view that a numpy array is made over (its `base`): the
/// mapping is freed when the last array over it is gone.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct PrivateOwner(#[allow(dead_code)] PrivateBytes);

/// A writable 1-D `uint8` numpy array over a private view of `tensor`'s bytes (a
/// copy-on-write mapping of its sealed memfd; a copy for a small tensor): the receiver's own
/// memory, whose writes change nothing the node holds or serves, made without copying the
/// payload.
pub(crate) fn writable_array<'py>(
    py: Python<'py>,
    tensor: &Tensor,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    let view = py
        .detach(|| tensor.private_view())
        .map_err(crate::errors::to_py)?;
    let mut dims = [npy_intp::try_from(view.len())
        .map_err(|_| PyValueError::new_err("a tensor too large for numpy's index type"))?];
    let (ptr, owner) = (view.as_mut_ptr(), Bound::new(py, PrivateOwner(view))?);
    let dtype = numpy::dtype::<u8>(py);
    // SAFETY: a new 1-D array over the `dims[0]` bytes at `ptr`, which stay mapped while
    // `owner` lives (set as the array's base below, which keeps it alive); the view is this
    // process's own copy-on-write mapping, so writing through the array is sound. `dtype`'s
    // reference is stolen by the call, so it is given one.
    let array = unsafe {
        let array = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            dtype.into_dtype_ptr(),
            1,
            dims.as_mut_ptr(),
            ptr::null_mut(),
            ptr.cast::<c_void>(),
            npyffi::NPY_ARRAY_C_CONTIGUOUS | npyffi::NPY_ARRAY_WRITEABLE,
            ptr::null_mut(),
        );
        let array = Bound::from_owned_ptr_or_err(py, array)?;
        // Steals the reference to the owner it is given.
        let set = PY_ARRAY_API.PyArray_SetBaseObject(
            py,
            array.as_ptr().cast::<npyffi::PyArrayObject>(),
            owner.into_any().into_ptr(),
        );
        if set != 0 {
            return Err(PyErr::fetch(py));
        }
        array.cast_into_unchecked::<PyUntypedArray>()
    };
    Ok(array)
}
