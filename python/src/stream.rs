//! [`StreamHandle`]: a `tb_call::Pipeline` driven from Python (`tensor_broker.Stream`).
//!
//! Its stages run on the runtime without the GIL: streaming calls and subscriptions as
//! sources, remote maps, interleaving, prefetching and batching. Python is entered only for
//! what is Python's: a Python iterable as a source (read on a thread of its own, one item
//! ahead) and a Python callable as a map (on the runtime's blocking pool, the GIL taken per
//! item), and for each item the consumer takes.
//!
//! A combinator takes the pipeline out of the handle it is called on: that handle is then
//! spent (using it again is a `ValueError`), as a Rust iterator moved into an adapter.

use std::sync::Arc;

use pyo3::{exceptions::PyValueError, prelude::*};
use tb_call::{Pipeline, PipelineError, Value};

use crate::{
    calls::{
        CallsHandle, call_error, call_options, from_value, next_value, read_ahead, server_prefetch,
        to_value,
    },
    errors,
    node::NodeHandle,
    runtime::{start, wait, wait_task},
};

/// A pipeline of values, pulled by `next` or `next_async`.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct StreamHandle {
    /// `None` once a combinator took it.
    pipeline: Arc<tokio::sync::Mutex<Option<Pipeline>>>,
}

impl StreamHandle {
    fn of(pipeline: Pipeline) -> Self {
        StreamHandle {
            pipeline: Arc::new(tokio::sync::Mutex::new(Some(pipeline))),
        }
    }

    /// The pipeline, taken out of this handle for a combinator.
    fn take(&self) -> PyResult<Pipeline> {
        let mut held = self.pipeline.try_lock().map_err(|_| {
            PyValueError::new_err("the stream is being read: combine it before reading it")
        })?;
        held.take().ok_or_else(spent)
    }

    /// Builds the next stage on the pipeline taken out of this handle.
    fn then(
        &self,
        stage: impl FnOnce(Pipeline) -> Result<Pipeline, PipelineError>,
    ) -> PyResult<StreamHandle> {
        let pipeline = stage(self.take()?).map_err(pipeline_error)?;
        Ok(StreamHandle::of(pipeline))
    }
}

/// Copies above this many bytes in one item are made on the blocking pool, not on the
/// runtime's worker.
const READY_INLINE_MAX: usize = 64 << 10;

/// `item` with its tensors that Python would get as private copies (loaned or named node
/// tensors of at most [`tb_node::VIEW_COPY_MAX`] bytes) copied now into memory of their own,
/// which Python then takes as it is (`from_value`): the copy is made here, by a prefetching
/// stage ahead of the consumer, not in the consumer's wait for the item.
async fn ready_for_python(value: Value) -> tb_call::pipeline::Item {
    if to_copy(&value) <= READY_INLINE_MAX {
        return Ok(owned_small_tensors(value));
    }
    tokio::task::spawn_blocking(move || owned_small_tensors(value))
        .await
        .map_err(|e| PipelineError::Invalid(format!("preparing an item: {e}")))
}

/// Whether `t` is a node tensor Python would copy (see [`ready_for_python`]).
fn copied_by_python(t: &tb_call::HostTensor) -> bool {
    t.node_tensor().is_some() && t.data.len() <= tb_node::VIEW_COPY_MAX
}

/// The bytes [`owned_small_tensors`] copies in `value`.
fn to_copy(value: &Value) -> usize {
    match value {
        Value::Tensor(t) if copied_by_python(t) => t.data.len(),
        Value::List(items) => items.iter().map(to_copy).sum(),
        Value::Map(items) => items.iter().map(|(_, v)| to_copy(v)).sum(),
        _ => 0,
    }
}

fn owned_small_tensors(value: Value) -> Value {
    match value {
        Value::Tensor(t) if copied_by_python(&t) => {
            match tb_call::HostTensor::new(t.dtype, t.shape.clone(), t.data.to_vec()) {
                Ok(owned) => Value::Tensor(owned),
                Err(_) => Value::Tensor(t),
            }
        }
        Value::List(items) => Value::List(items.into_iter().map(owned_small_tensors).collect()),
        Value::Map(items) => Value::Map(
            items
                .into_iter()
                .map(|(k, v)| (k, owned_small_tensors(v)))
                .collect(),
        ),
        other => other,
    }
}

fn spent() -> PyErr {
    PyValueError::new_err(
        "this stream was combined into another (map, batch, prefetch, interleave): read that one",
    )
}

/// A pipeline's error as the exception Python sees: a Python source's or map's own
/// exception as it was raised.
pub(crate) fn pipeline_error(e: PipelineError) -> PyErr {
    match e {
        PipelineError::Call(e) => call_error(e),
        PipelineError::Node(e) => errors::to_py(e),
        PipelineError::Source(e) => match e.downcast::<PyErr>() {
            Ok(e) => *e,
            Err(e) => errors::base(e.to_string()),
        },
        e @ (PipelineError::Batch(_) | PipelineError::Invalid(_)) => {
            PyValueError::new_err(e.to_string())
        }
    }
}

/// Reads a Python iterator on this thread into `tx`, one item ahead of the pipeline, until
/// it ends, raises (sent as the pipeline's error) or the pipeline is gone.
fn feed(iter: &Py<PyAny>, tx: &tokio::sync::mpsc::Sender<tb_call::pipeline::Item>) {
    loop {
        let item = match next_value(iter) {
            Ok(Some(value)) => Ok(value),
            Ok(None) => return,
            Err(e) => Err(PipelineError::Source(Box::new(e))),
        };
        let failed = item.is_err();
        if tx.blocking_send(item).is_err() || failed {
            return;
        }
    }
}

/// Python's positional-and-keyword convention for one argument.
fn one_arg(item: Value) -> Value {
    Value::Map(vec![
        ("args".into(), Value::List(vec![item])),
        ("kwargs".into(), Value::Map(Vec::new())),
    ])
}

/// A pipeline's item as Python takes it: `None` at the end, an error raised.
pub(crate) fn item_out(
    py: Python<'_>,
    item: Option<tb_call::pipeline::Item>,
) -> PyResult<Option<Py<PyAny>>> {
    match item {
        None => Ok(None),
        Some(Ok(value)) => Ok(Some(from_value(py, value)?)),
        Some(Err(e)) => Err(pipeline_error(e)),
    }
}

#[pymethods]
impl StreamHandle {
    /// The items of streaming function `name` called with `args`, `prefetch` requested ahead.
    #[staticmethod]
    #[pyo3(signature = (calls, name, args, prefetch=2))]
    fn call(
        py: Python<'_>,
        calls: &CallsHandle,
        name: String,
        args: &Bound<'_, PyAny>,
        prefetch: u32,
    ) -> PyResult<StreamHandle> {
        let value = to_value(args, 0)?;
        let calls = calls.calls().clone();
        let prefetch = server_prefetch(prefetch);
        let stream = wait(
            py,
            async move { calls.stream(&name, &value, prefetch).await },
        )?;
        Ok(StreamHandle::of(read_ahead(stream.map_err(call_error)?)?))
    }

    /// The tensor of each version published under `pattern` from now on.
    #[staticmethod]
    fn subscribe(py: Python<'_>, node: &NodeHandle, pattern: String) -> PyResult<StreamHandle> {
        let node = node.node()?.clone();
        let subscribed = {
            let node = node.clone();
            wait(py, async move { node.subscribe(&pattern).await })?
        };
        let sub = subscribed.map_err(errors::to_py)?;
        Ok(StreamHandle::of(Pipeline::from_subscription(node, sub)))
    }

    /// The items of a Python iterator of value trees, read on a thread of its own.
    #[staticmethod]
    fn iterate(iter: Py<PyAny>) -> PyResult<StreamHandle> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        std::thread::Builder::new()
            .name("tb-stream-source".into())
            .spawn(move || feed(&iter, &tx))
            .map_err(|e| errors::invalid(format!("no thread for the stream's source: {e}")))?;
        Ok(StreamHandle::of(Pipeline::from_channel(rx)))
    }

    /// The items of every stream, each as it comes.
    #[staticmethod]
    fn interleave(streams: Vec<Bound<'_, StreamHandle>>) -> PyResult<StreamHandle> {
        if streams.is_empty() {
            return Err(PyValueError::new_err(
                "interleave needs at least one stream",
            ));
        }
        let mut taken = Vec::with_capacity(streams.len());
        for s in &streams {
            match s.get().take() {
                Ok(p) => taken.push(p),
                Err(e) => {
                    // Nothing half-taken: put back what was taken so far.
                    for (s, p) in streams.iter().zip(taken) {
                        *s.get().pipeline.blocking_lock() = Some(p);
                    }
                    return Err(e);
                }
            }
        }
        Ok(StreamHandle::of(Pipeline::interleave(taken)))
    }

    /// Each item through `func` (a Python callable taking and returning value trees), on
    /// the handler threads (`handlers`: the one that went idle last), `parallel` at a time.
    #[pyo3(signature = (func, parallel=1, ordered=true))]
    fn map_local(&self, func: Py<PyAny>, parallel: usize, ordered: bool) -> PyResult<StreamHandle> {
        let func = Arc::new(func);
        let map = move |item: Value| {
            let func = func.clone();
            async move {
                let ran = crate::handlers::call(move || {
                    Python::attach(|py| -> PyResult<Value> {
                        let arg = from_value(py, item)?;
                        let out = func.call1(py, (arg,))?;
                        to_value(out.bind(py), 0)
                    })
                })
                .await;
                match ran {
                    Ok(done) => done.map_err(|e| PipelineError::Source(Box::new(e))),
                    Err(e) => Err(PipelineError::Invalid(format!("the map's thread: {e}"))),
                }
            }
        };
        self.then(|p| p.map(map, parallel, ordered))
    }

    /// Each item through remote function `name` (as its one positional argument),
    /// `parallel` calls at a time over its servers.
    #[pyo3(signature = (calls, name, parallel=1, ordered=true, timeout=None, idempotent=false))]
    fn map_call(
        &self,
        calls: &CallsHandle,
        name: String,
        parallel: usize,
        ordered: bool,
        timeout: Option<f64>,
        idempotent: bool,
    ) -> PyResult<StreamHandle> {
        let options = call_options(timeout, idempotent)?;
        let calls = calls.calls().clone();
        self.then(|p| p.map_call(calls, name, options, one_arg, parallel, ordered))
    }

    /// Up to `k` items pulled ahead by a task of its own, each made ready for Python there
    /// (tensors Python would copy are copied by that task, not in the consumer's wait).
    fn prefetch(&self, k: usize) -> PyResult<StreamHandle> {
        // Each item is made ready for Python before it is held: what the consumer then
        // gets is memory of its own, with no copy left for its thread to make.
        self.then(|p| p.map(ready_for_python, 1, true)?.prefetch(k))
    }

    /// `n` items at a time stacked (see `tb_call::Pipeline::batch`).
    #[pyo3(signature = (n, drop_last=false))]
    fn batch(&self, n: usize, drop_last: bool) -> PyResult<StreamHandle> {
        self.then(|p| p.batch(n, drop_last))
    }

    /// The next item, `None` at the end (the GIL released while waiting; Ctrl-C interrupts).
    fn next(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let pipeline = self.pipeline.clone();
        let item = wait_task(py, async move {
            let mut held = pipeline.lock().await;
            match held.as_mut() {
                Some(p) => Ok(p.next().await),
                None => Err(()),
            }
        })?;
        item_out(py, item.map_err(|()| spent())?)
    }

    /// [`next`](Self::next) as an awaitable (cancelling it drops nothing but the wait: an
    /// item already being made stays in the pipeline's stages).
    fn next_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pipeline = self.pipeline.clone();
        start(py, async move {
            let mut held = pipeline.lock().await;
            let item = match held.as_mut() {
                Some(p) => p.next().await,
                None => return Err(spent()),
            };
            drop(held);
            Ok(crate::runtime::OnLoop(move |py: Python<'_>| {
                item_out(py, item).map(|out| out.unwrap_or_else(|| py.None()))
            }))
        })
    }

    /// Ends the pipeline now: its calls are cancelled, its tasks stopped.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let pipeline = self.pipeline.clone();
        let taken = wait(py, async move { pipeline.lock().await.take() })?;
        py.detach(move || drop(taken));
        Ok(())
    }
}
