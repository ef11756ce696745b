//! Remote functions from Python: `tb_call::Calls` for a client's node, Python values to and
//! from `tb_call::Value`, and Python callables as handlers.
//!
//! Values cross as plain Python objects: `None`, `bool`, `int` (64-bit), `float`, `str`,
//! `bytes`, lists and tuples (as lists), dicts with `str` keys, and [`TensorArg`]s (an
//! array's bytes with a dtype name and shape; `tensor_broker._functions` makes them from
//! numpy arrays and torch tensors, and turns [`TensorOut`]s back into them). Nothing is
//! pickled: anything else is a `TypeError` before a byte moves.
//!
//! A handler runs on a handler thread (`handlers`: the one that went idle last) with the GIL
//! taken per call, so `concurrency` calls of one function run at once in as many threads
//! (numpy and torch release the GIL in their kernels). Its exception comes back to the
//! caller as a `RemoteFailure` with the exception's type, message and formatted traceback.

use std::sync::Arc;

use bytes::Bytes;
use numpy::{PyArray1, PyUntypedArray};
use pyo3::{
    exceptions::{PyTypeError, PyValueError},
    prelude::*,
    types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple},
};
use tb_call::{
    CallContext, CallError, CallOptions, Calls, FailureKind, FunctionSpec, HostTensor, Output,
    RemoteFailure, Serving, Value,
};
use tokio_util::sync::CancellationToken;

use crate::{
    array::RawBytes,
    errors, handlers,
    runtime::{self, start, wait},
};

/// Deepest a Python value may nest (the wire's own limit).
const MAX_DEPTH: usize = tb_node::proto::call::MAX_VALUE_DEPTH;

/// A tensor argument: a C-contiguous array's bytes (`data`, any dtype; read as bytes), the
/// tensor's dtype name and shape.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct TensorArg {
    data: Py<PyUntypedArray>,
    dtype: String,
    shape: Vec<u64>,
}

#[pymethods]
impl TensorArg {
    #[new]
    fn new(data: Bound<'_, PyUntypedArray>, dtype: String, shape: Vec<u64>) -> Self {
        TensorArg {
            data: data.unbind(),
            dtype,
            shape,
        }
    }
}

/// A CUDA tensor argument or result: its bytes as a contiguous 1-D `uint8` CUDA tensor (`data`,
/// whose address and length are read from its `__cuda_array_interface__`), its dtype name,
/// shape and device ordinal. The caller synchronized the work that produced it; it is copied
/// device to device into the node's memory when the value is converted, and lent from there
/// (by CUDA IPC to a peer on this host).
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct CudaArg {
    data: Py<PyAny>,
    ordinal: usize,
    dtype: String,
    shape: Vec<u64>,
}

#[pymethods]
impl CudaArg {
    #[new]
    fn new(data: Py<PyAny>, ordinal: usize, dtype: String, shape: Vec<u64>) -> Self {
        CudaArg {
            data,
            ordinal,
            dtype,
            shape,
        }
    }
}

/// A tensor in the cluster passed by name (and version; the newest when `None`): the server
/// gets it from any holder before its handler runs.
#[pyclass(frozen, module = "tensor_broker._native", get_all)]
pub struct RefArg {
    name: String,
    version: Option<u64>,
}

#[pymethods]
impl RefArg {
    #[new]
    #[pyo3(signature = (name, version=None))]
    fn new(name: String, version: Option<u64>) -> PyResult<Self> {
        tb_node::TensorName::new(name.as_str()).map_err(|e| errors::invalid(e.to_string()))?;
        if version == Some(0) {
            return Err(errors::invalid("versions start at 1".into()));
        }
        Ok(RefArg { name, version })
    }
}

/// A tensor result: its bytes as a writable 1-D `uint8` numpy array the receiver owns (no
/// copy was made after receiving), its dtype name and shape.
#[pyclass(frozen, module = "tensor_broker._native", get_all)]
pub struct TensorOut {
    data: Py<PyAny>,
    dtype: String,
    shape: Vec<u64>,
}

pub(crate) fn to_value(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "a value nested deeper than {MAX_DEPTH} levels"
        )));
    }
    if obj.is_none() {
        return Ok(Value::None);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        let i: i64 = obj
            .extract()
            .map_err(|_| PyValueError::new_err("integers must fit in 64 bits"))?;
        return Ok(Value::Int(i));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Value::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(t) = obj.cast::<TensorArg>() {
        let t = t.get();
        let py = obj.py();
        let dtype = crate::node::parse_dtype(&t.dtype)?;
        let data = t.data.bind(py);
        let raw = RawBytes::of(data)?;
        let shape = t.shape.clone();
        // A large one is copied (and hashed) once, without the GIL, into a memfd: lent to a
        // server on this host as it is. `data` stays referenced meanwhile.
        let tensor = if raw.as_slice().len() >= tb_call::value::LEND_MIN {
            let copied =
                py.detach(move || tb_node::Tensor::copy_from(dtype, shape, raw.as_slice()));
            let copied = copied.map_err(|e| PyValueError::new_err(e.to_string()))?;
            HostTensor::from_node(copied)
        } else {
            HostTensor::new(dtype, shape, Bytes::copy_from_slice(raw.as_slice()))
        };
        let tensor = tensor.map_err(|e| PyValueError::new_err(e.to_string()))?;
        return Ok(Value::Tensor(tensor));
    }
    if let Ok(t) = obj.cast::<CudaArg>() {
        let t = t.get();
        let py = obj.py();
        let dtype = crate::node::parse_dtype(&t.dtype)?;
        let (ptr, len) = crate::node::cuda_bytes(t.data.bind(py))?;
        let (ordinal, shape) = (t.ordinal, t.shape.clone());
        // `t.data` stays referenced (its memory allocated) while the copy runs.
        let copied = py.detach(move || crate::buffer::copy_cuda(ordinal, ptr, len));
        let buffer = copied.map_err(errors::to_py)?;
        let tensor = tb_call::DeviceTensor::new(dtype, shape, buffer)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        return Ok(Value::Device(tensor));
    }
    if let Ok(r) = obj.cast::<RefArg>() {
        let r = r.get();
        let name = tb_node::TensorName::new(r.name.as_str())
            .map_err(|e| errors::invalid(e.to_string()))?;
        return Ok(Value::Named {
            name,
            version: r.version,
        });
    }
    if let Ok(list) = obj.cast::<PyList>() {
        let items = list.iter().map(|v| to_value(&v, depth + 1));
        return Ok(Value::List(items.collect::<PyResult<_>>()?));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        let items = tuple.iter().map(|v| to_value(&v, depth + 1));
        return Ok(Value::List(items.collect::<PyResult<_>>()?));
    }
    if let Ok(dict) = obj.cast::<PyDict>() {
        let mut items = Vec::with_capacity(dict.len());
        for (k, v) in dict.iter() {
            let key: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("dict keys must be str to be sent"))?;
            items.push((key, to_value(&v, depth + 1)?));
        }
        return Ok(Value::Map(items));
    }
    Err(PyTypeError::new_err(format!(
        "cannot send a {}: pass numbers, str, bytes, lists, dicts with str keys, numpy arrays or \
         torch tensors (nothing is pickled)",
        obj.get_type().name()?
    )))
}

pub(crate) fn from_value(py: Python<'_>, value: Value) -> PyResult<Py<PyAny>> {
    Ok(match value {
        Value::None => py.None(),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
        Value::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
        Value::Float(f) => f.into_pyobject(py)?.into_any().unbind(),
        Value::Str(s) => s.into_pyobject(py)?.into_any().unbind(),
        Value::Bytes(b) => PyBytes::new(py, &b).into_any().unbind(),
        Value::List(items) => {
            let items: Vec<Py<PyAny>> = items
                .into_iter()
                .map(|v| from_value(py, v))
                .collect::<PyResult<_>>()?;
            PyList::new(py, items)?.into_any().unbind()
        }
        Value::Map(items) => {
            let dict = PyDict::new(py);
            for (k, v) in items {
                dict.set_item(k, from_value(py, v)?)?;
            }
            dict.into_any().unbind()
        }
        Value::Named { name, version } => Py::new(
            py,
            RefArg {
                name: name.to_string(),
                version,
            },
        )?
        .into_any(),
        Value::Tensor(t) => {
            let data = match t.node_tensor() {
                // A loan's (or a tensor passed by name): a private view of its memfd.
                Some(tensor) => crate::buffer::writable_array(py, tensor)?
                    .into_any()
                    .unbind(),
                // Unique after a receive: taken as the array's own memory, no copy.
                None => PyArray1::from_vec(py, Vec::from(t.data))
                    .into_any()
                    .unbind(),
            };
            let out = TensorOut {
                data,
                dtype: t.dtype.name().to_owned(),
                shape: t.shape,
            };
            Py::new(py, out)?.into_any()
        }
        // A `Buffer` over the device memory, which `_functions` hands to torch by DLPack
        // (memory a pull received into is lent as it is: nothing else holds it).
        Value::Device(t) => {
            let (dtype, shape) = (t.dtype(), t.shape().to_vec());
            let tensor = match t.node_tensor() {
                Some(tensor) => tensor.clone(),
                // Made in this process (not received): hashed once to be a node tensor.
                None => {
                    let buffer = t.buffer().clone();
                    let made =
                        py.detach(|| tb_node::Tensor::from_device(dtype, shape.clone(), buffer));
                    made.map_err(errors::to_py)?
                }
            };
            let buffer = crate::buffer::Buffer::new(String::from("(call value)"), 0, tensor);
            let out = TensorOut {
                data: Py::new(py, buffer)?.into_any(),
                dtype: dtype.name().to_owned(),
                shape,
            };
            Py::new(py, out)?.into_any()
        }
    })
}

/// Whether the call a handler runs for was cancelled (the caller went, or its deadline
/// passed): a sync handler may check it and stop early; its result is discarded anyway.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct CancelFlag(CancellationToken);

#[pymethods]
impl CancelFlag {
    fn is_set(&self) -> bool {
        self.0.is_cancelled()
    }
}

/// A handler's exception as the caller gets it: type (qualified unless a builtin),
/// message, formatted traceback.
fn failure_of(py: Python<'_>, err: PyErr) -> RemoteFailure {
    let ty = err.get_type(py);
    let name = ty.qualname().map(|n| n.to_string()).unwrap_or_default();
    let module = ty.module().map(|m| m.to_string()).unwrap_or_default();
    let remote_type = match module.as_str() {
        "builtins" | "" => name,
        module => format!("{module}.{name}"),
    };
    let message = err
        .value(py)
        .str()
        .map(|s| s.to_string())
        .unwrap_or_default();
    let traceback = err
        .traceback(py)
        .and_then(|tb| tb.format().ok())
        .unwrap_or_default();
    RemoteFailure::new(FailureKind::Raised, remote_type, message, traceback)
}

/// A Python callable as a handler: `func(args, cancel_flag, start, inputs)` returns the
/// result (a unary function) or an iterator of items from item `start` on (`streaming`);
/// `inputs` is an [`InputIter`] over the caller's inputs for a bidirectional function, else
/// `None`.
struct PyHandler {
    func: Arc<Py<PyAny>>,
    streaming: bool,
    inputs: bool,
}

/// The inputs of a bidirectional call as a Python iterator: each `next` waits (without the
/// GIL) for the caller's next input; the iteration ends with the caller's inputs (or the
/// call).
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct InputIter(tb_call::Inputs);

#[pymethods]
impl InputIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let inputs = self.0.clone();
        match py.detach(move || inputs.blocking_next()) {
            Some(value) => Ok(Some(from_value(py, value)?)),
            None => Ok(None),
        }
    }
}

impl tb_call::Handler for PyHandler {
    fn call(&self, args: Value, cx: CallContext) -> Output {
        let func = self.func.clone();
        let flag = cx.cancel.clone();
        let start = cx.start;
        let inputs = self.inputs.then(|| InputIter(cx.inputs.clone()));
        if self.streaming {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let refused = tx.clone();
            let run = move || stream_items(&func, args, start, inputs, flag, tx);
            if let Err(e) = handlers::run(Box::new(run)) {
                // The channel is new: its one place is free.
                let why = format!("no thread to run it on: {e}");
                let _ = refused.try_send(Err(thread_failure(why)));
            }
            return Output::Stream(rx);
        }
        Output::Unary(Box::pin(async move {
            let ran = handlers::call(move || {
                Python::attach(|py| {
                    let args = from_value(py, args).map_err(|e| failure_of(py, e))?;
                    let out = func
                        .call1(py, (args, CancelFlag(flag), start, inputs))
                        .map_err(|e| failure_of(py, e))?;
                    to_value(out.bind(py), 0).map_err(|e| failure_of(py, e))
                })
            })
            .await;
            ran.unwrap_or_else(|e| Err(thread_failure(e)))
        }))
    }
}

/// The failure of a call whose handler's thread did not answer (`why`).
fn thread_failure(why: String) -> RemoteFailure {
    RemoteFailure::new(
        FailureKind::Raised,
        "RuntimeError",
        format!("the handler's thread: {why}"),
        "",
    )
}

/// Runs a streaming handler's iterator on this (handler) thread, one item per send.
fn stream_items(
    func: &Py<PyAny>,
    args: Value,
    start: u64,
    inputs: Option<InputIter>,
    flag: CancellationToken,
    tx: tokio::sync::mpsc::Sender<tb_call::HandlerResult>,
) {
    let iter = Python::attach(|py| -> Result<Py<PyAny>, RemoteFailure> {
        let args = from_value(py, args).map_err(|e| failure_of(py, e))?;
        let out = func
            .call1(py, (args, CancelFlag(flag.clone()), start, inputs))
            .map_err(|e| failure_of(py, e))?;
        out.bind(py)
            .try_iter()
            .map(|i| i.into_any().unbind())
            .map_err(|e| failure_of(py, e))
    });
    let iter = match iter {
        Ok(iter) => Closing(Some(iter)),
        Err(failure) => {
            let _ = tx.blocking_send(Err(failure));
            return;
        }
    };
    let Closing(Some(iter)) = &iter else { return };
    while !flag.is_cancelled() {
        let next = Python::attach(|py| {
            let it = iter.bind(py);
            match it.call_method0("__next__") {
                Ok(item) => Some(to_value(&item, 0).map_err(|e| failure_of(py, e))),
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => None,
                Err(e) => Some(Err(failure_of(py, e))),
            }
        });
        let Some(item) = next else { return };
        let failed = item.is_err();
        if tx.blocking_send(item).is_err() || failed {
            return;
        }
    }
}

/// A streaming handler's iterator, closed and let go with the GIL held however its stream
/// ends. A generator suspended at a `yield` when its call is cancelled runs its `finally`
/// now: an iterator dropped without the GIL is only let go the next time some thread takes
/// it through this extension, which may be never.
struct Closing(Option<Py<PyAny>>);

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(iter) = self.0.take() {
            Python::attach(|py| {
                let it = iter.bind(py);
                if let Ok(close) = it.getattr("close") {
                    // A close that raises is the handler's own error, after its stream ended.
                    let _ = close.call0();
                }
                drop(iter);
            });
        }
    }
}

/// The exception a call error is (classes in `tensor_broker._errors`).
pub(crate) fn call_error(e: CallError) -> PyErr {
    Python::attach(|py| {
        let made = (|| -> PyResult<PyErr> {
            let module = py.import("tensor_broker._errors")?;
            let err = match &e {
                CallError::Remote {
                    function,
                    server,
                    failure,
                } => module.getattr("_remote_error")?.call1((
                    function,
                    server,
                    &failure.remote_type,
                    &failure.message,
                    &failure.traceback,
                ))?,
                CallError::Overloaded { .. } => {
                    module.getattr("Overloaded")?.call1((e.to_string(),))?
                }
                CallError::ServerLost { maybe_ran, .. } => module
                    .getattr("ServerLost")?
                    .call1((e.to_string(), *maybe_ran))?,
                CallError::Timeout { .. } => module.getattr("Timeout")?.call1((e.to_string(),))?,
                CallError::NoServer { .. } => {
                    module.getattr("NotFound")?.call1((e.to_string(),))?
                }
                CallError::Unauthorized { .. } => {
                    module.getattr("Unauthorized")?.call1((e.to_string(),))?
                }
                CallError::BadValue { .. } => {
                    module.getattr("InvalidArgument")?.call1((e.to_string(),))?
                }
                CallError::Node(_) => return Ok(errors::base(e.to_string())),
            };
            Ok(PyErr::from_value(err))
        })();
        made.unwrap_or_else(|err| err)
    })
}

/// A call's options from Python's `timeout` (seconds) and `idempotent`.
pub(crate) fn call_options(timeout: Option<f64>, idempotent: bool) -> PyResult<CallOptions> {
    Ok(CallOptions {
        timeout: runtime::seconds(timeout)?,
        idempotent,
    })
}

/// Remote functions on a client's node: what it serves and calls to what others serve.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct CallsHandle {
    calls: Calls,
}

impl CallsHandle {
    pub(crate) fn attach(node: &tb_node::Node) -> PyResult<Self> {
        let calls = Calls::attach(node).map_err(errors::to_py)?;
        Ok(CallsHandle { calls })
    }

    pub(crate) fn calls(&self) -> &Calls {
        &self.calls
    }
}

/// A function being served; `stop()` unserves it once its calls end.
#[pyclass(module = "tensor_broker._native")]
pub struct ServingHandle {
    serving: Option<Serving>,
}

#[pymethods]
impl ServingHandle {
    /// Withdraws the function, refuses new calls, and waits for those admitted to end.
    fn stop(&mut self, py: Python<'_>) -> PyResult<()> {
        match self.serving.take() {
            Some(serving) => wait(py, serving.stop()),
            None => Ok(()),
        }
    }

    /// Calls running or queued.
    fn outstanding(&self) -> u32 {
        self.serving.as_ref().map_or(0, Serving::outstanding)
    }
}

/// The next item of the Python iterator `iter` as a value (`None` at its end), the GIL taken
/// for it alone.
pub(crate) fn next_value(iter: &Py<PyAny>) -> PyResult<Option<Value>> {
    Python::attach(|py| match iter.bind(py).call_method0("__next__") {
        Ok(item) => to_value(&item, 0).map(Some),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => Ok(None),
        Err(e) => Err(e),
    })
}

/// Takes a bidirectional call's inputs from the Python iterator `iter` (with the GIL, one at
/// a time) into `tx` (without it, waiting while the server asks for none), until the
/// iterator ends, fails (its exception kept in `failed`, the inputs ended), or the call is
/// gone.
fn feed_inputs(
    iter: &Py<PyAny>,
    tx: &tokio::sync::mpsc::Sender<Value>,
    failed: &std::sync::Mutex<Option<PyErr>>,
) {
    loop {
        match next_value(iter) {
            Ok(Some(value)) => {
                if tx.blocking_send(value).is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Err(e) => {
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                return;
            }
        }
    }
}

/// What a streaming call read through [`read_ahead`] asks its server for: one fewer than the
/// consumer's `prefetch` (at least 1), the reader task holding the other.
pub(crate) fn server_prefetch(prefetch: u32) -> u32 {
    prefetch.saturating_sub(1).max(1)
}

/// A streaming call's items, read by a task of its own one item ahead: Python's waits
/// (`next`, `next_async`) are on that task's channel, so a cancelled wait never leaves the
/// call's stream cut part-way through a frame or read by two tasks at once.
pub(crate) fn read_ahead(stream: tb_call::CallStream) -> PyResult<tb_call::Pipeline> {
    let items = tb_call::Pipeline::from_call(stream).prefetch(1);
    items.map_err(crate::stream::pipeline_error)
}

/// The items of a streaming call.
#[pyclass(module = "tensor_broker._native")]
pub struct CallStreamHandle {
    /// The call's items, read ahead by a task of their own ([`read_ahead`]).
    stream: Arc<tokio::sync::Mutex<tb_call::Pipeline>>,
    /// What the inputs' iterator raised (a bidirectional call), raised by the next `next`.
    input_error: Arc<std::sync::Mutex<Option<PyErr>>>,
}

impl CallStreamHandle {
    fn input_error(&self) -> Option<PyErr> {
        self.input_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

#[pymethods]
impl CallStreamHandle {
    /// The next item, or `None` at the end. An exception the inputs' iterator raised is
    /// raised here.
    fn next(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let stream = self.stream.clone();
        let item = runtime::wait_task(py, async move { stream.lock().await.next().await })?;
        if let Some(e) = self.input_error() {
            return Err(e);
        }
        crate::stream::item_out(py, item)
    }

    /// [`next`](Self::next) as an awaitable: cancelling it leaves the stream whole (see
    /// [`read_ahead`]).
    fn next_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stream = self.stream.clone();
        let input_error = self.input_error.clone();
        start(py, async move {
            let item = stream.lock().await.next().await;
            let failed = input_error.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(e) = failed {
                return Err(e);
            }
            Ok(runtime::OnLoop(move |py: Python<'_>| {
                crate::stream::item_out(py, item).map(|out| out.unwrap_or_else(|| py.None()))
            }))
        })
    }
}

#[pymethods]
impl CallsHandle {
    /// Serves `func` as `name`: `func(args, cancel_flag, start)` returns the result, or (with
    /// `streaming`) an iterator of items from item `start` on.
    #[pyo3(signature = (name, func, concurrency=1, queue=64, read_only_callers=false, idempotent=false, streaming=false, resumable=false, inputs=false))]
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &self,
        py: Python<'_>,
        name: &str,
        func: Py<PyAny>,
        concurrency: u32,
        queue: u32,
        read_only_callers: bool,
        idempotent: bool,
        streaming: bool,
        resumable: bool,
        inputs: bool,
    ) -> PyResult<ServingHandle> {
        let mut spec = FunctionSpec::new(name)
            .map_err(|e| errors::invalid(e.to_string()))?
            .concurrency(concurrency)
            .queue(queue);
        spec.read_only_callers = read_only_callers;
        spec.idempotent = idempotent;
        spec.resumable = resumable;
        spec.inputs = inputs;
        let handler = PyHandler {
            func: Arc::new(func),
            streaming,
            inputs,
        };
        let calls = self.calls.clone();
        let serving = wait(py, async move { calls.serve(spec, handler).await })?;
        Ok(ServingHandle {
            serving: Some(serving.map_err(errors::to_py)?),
        })
    }

    /// Calls `name` with `args` (a value tree) and returns its result.
    #[pyo3(signature = (name, args, timeout=None, idempotent=false))]
    fn call(
        &self,
        py: Python<'_>,
        name: String,
        args: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        idempotent: bool,
    ) -> PyResult<Py<PyAny>> {
        let value = to_value(args, 0)?;
        let options = call_options(timeout, idempotent)?;
        let calls = self.calls.clone();
        let call = async move { calls.call(&name, &value, &options).await };
        let out = runtime::wait_call(py, call)?;
        from_value(py, out.map_err(call_error)?)
    }

    /// [`call`](Self::call) as an awaitable (cancelling it cancels the call on its server).
    #[pyo3(signature = (name, args, timeout=None, idempotent=false))]
    fn call_async<'py>(
        &self,
        py: Python<'py>,
        name: String,
        args: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        idempotent: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let value = to_value(args, 0)?;
        let options = call_options(timeout, idempotent)?;
        let calls = self.calls.clone();
        start(py, async move {
            let out = calls.call(&name, &value, &options).await;
            Ok(runtime::OnLoop(move |py: Python<'_>| {
                from_value(py, out.map_err(call_error)?)
            }))
        })
    }

    /// Starts streaming function `name` with `args`, `prefetch` items requested ahead; with
    /// `inputs` (an iterator of value trees), a bidirectional call whose inputs a thread of
    /// its own takes from the iterator as the server asks for them.
    #[pyo3(signature = (name, args, prefetch=2, inputs=None))]
    fn stream(
        &self,
        py: Python<'_>,
        name: String,
        args: &Bound<'_, PyAny>,
        prefetch: u32,
        inputs: Option<Py<PyAny>>,
    ) -> PyResult<CallStreamHandle> {
        let value = to_value(args, 0)?;
        let calls = self.calls.clone();
        let input_error: Arc<std::sync::Mutex<Option<PyErr>>> = Arc::default();
        let prefetch = server_prefetch(prefetch);
        let stream = match inputs {
            None => wait(
                py,
                async move { calls.stream(&name, &value, prefetch).await },
            )?,
            Some(iter) => {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                let failed = input_error.clone();
                std::thread::Builder::new()
                    .name("tb-call-inputs".into())
                    .spawn(move || feed_inputs(&iter, &tx, &failed))
                    .map_err(|e| errors::invalid(format!("no thread for the inputs: {e}")))?;
                let call = async move { calls.stream_inputs(&name, &value, rx, prefetch).await };
                wait(py, call)?
            }
        };
        let items = read_ahead(stream.map_err(call_error)?)?;
        Ok(CallStreamHandle {
            stream: Arc::new(tokio::sync::Mutex::new(items)),
            input_error,
        })
    }

    /// The functions served in the cluster under `prefix`: `(name, servers)` pairs.
    #[pyo3(signature = (prefix=""))]
    fn functions(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<(String, u32)>> {
        let calls = self.calls.clone();
        let prefix = prefix.to_owned();
        let listed = wait(py, async move { calls.node().functions(&prefix).await })?;
        Ok(listed
            .map_err(errors::to_py)?
            .into_iter()
            .map(|(n, c)| (n.to_string(), c))
            .collect())
    }
}
