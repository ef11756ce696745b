//! The process's one tokio runtime, and how Python threads wait on it: with the GIL
//! released, in short slices between which pending signals (Ctrl-C) are handled.
//!
//! Async: [`start`] runs the same futures as the blocking calls as tasks on the runtime and
//! hands back an asyncio future that the task completes through the event loop's
//! `call_soon_threadsafe` (no executor thread per call, no polling). Cancelling the asyncio
//! future (cancelling the task that awaits it) cancels the runtime task at once: the call's
//! future is dropped, which releases what it held (budgets, partial versions, borrows).
//!
//! `fork()`: the runtime's threads do not survive into a child process, so a child that
//! calls into a runtime its parent made would wait forever. The pid is recorded when the
//! runtime is made, and every call from another pid fails at once with a clear error (use the
//! `spawn` start method of `multiprocessing`, or connect only after forking).

use std::{
    future::Future,
    sync::OnceLock,
    task::{Context, Poll, Waker},
    time::Duration,
};

use pyo3::{IntoPyObjectExt, prelude::*, sync::PyOnceLock};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::errors;

/// How long one wait on the runtime lasts before pending signals are checked.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// The runtime and the pid of the process that made it.
static RUNTIME: OnceLock<(Runtime, u32)> = OnceLock::new();

/// The runtime, made on first use; an error in a process forked after it was made.
pub(crate) fn runtime() -> PyResult<&'static Runtime> {
    if let Some((rt, pid)) = RUNTIME.get() {
        return match *pid == std::process::id() {
            true => Ok(rt),
            false => Err(errors::forked(*pid)),
        };
    }
    let threads = tb_node::runtime::worker_threads().map_err(errors::invalid)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .thread_name("tensor-broker")
        .build()
        .map_err(|e| errors::base(format!("starting the tensor_broker runtime: {e}")))?;
    // Two threads racing here: one runtime wins, the other is dropped unused.
    let (rt, _) = RUNTIME.get_or_init(|| (rt, std::process::id()));
    Ok(rt)
}

/// Whether this process was forked from the one that made the runtime (objects made there
/// must not touch it: its threads are not here).
pub(crate) fn forked() -> bool {
    RUNTIME
        .get()
        .is_some_and(|(_, pid)| *pid != std::process::id())
}

/// Runs `fut` to completion on the runtime, the GIL released; a pending signal (Ctrl-C)
/// drops the future (cancelling what it was doing) and raises.
pub(crate) fn wait<F, T>(py: Python<'_>, fut: F) -> PyResult<T>
where
    F: Future<Output = T> + Send,
    T: Send,
{
    let rt = runtime()?;
    let mut fut = std::pin::pin!(fut);
    loop {
        let slice = async { tokio::time::timeout(SIGNAL_SLICE, fut.as_mut()).await };
        let polled = py.detach(|| rt.block_on(slice));
        match polled {
            Ok(done) => return Ok(done),
            Err(_) => py.check_signals()?,
        }
    }
}

/// [`wait`] for a `'static` future, run as a task on the runtime's workers instead of on
/// this thread: its steps (a stream opened, written, each frame read) wake a worker, where
/// the I/O driver already is, and only its end wakes this thread (`wait` polls the future
/// here, so each of those steps is a wake-up of this thread, a context switch). A pending
/// signal (Ctrl-C) aborts the task, dropping the future, and raises.
pub(crate) fn wait_task<F, T>(py: Python<'_>, fut: F) -> PyResult<T>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let rt = runtime()?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    // Only this thread receives; the lock makes the receiver usable with the GIL released.
    let rx = std::sync::Mutex::new(rx);
    let task = rt.spawn(async move {
        let _ = tx.send(fut.await);
    });
    // Dropped on every return: a Ctrl-C aborts the task.
    let _task = tokio_util::task::AbortOnDropHandle::new(task);
    loop {
        let got = py.detach(|| {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            rx.recv_timeout(SIGNAL_SLICE)
        });
        match got {
            Ok(done) => return Ok(done),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(errors::base("the runtime dropped a call's task".into()));
            }
        }
    }
}

/// A limit in seconds as a duration; a negative or non-finite one is a `ValueError`.
pub(crate) fn seconds(limit: Option<f64>) -> PyResult<Option<Duration>> {
    limit
        .map(|secs| {
            Duration::try_from_secs_f64(secs).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be >= 0 seconds, got {secs}"
                ))
            })
        })
        .transpose()
}

/// `fut` within an optional limit in seconds: past it, `Timeout` naming `what`. A negative
/// or non-finite limit is a `ValueError` at once.
pub(crate) fn limited<F, T>(
    limit: Option<f64>,
    what: impl FnOnce() -> String + Send,
    fut: F,
) -> PyResult<impl Future<Output = PyResult<T>> + Send>
where
    F: Future<Output = PyResult<T>> + Send,
{
    let after = seconds(limit)?;
    Ok(async move {
        let Some(after) = after else {
            return fut.await;
        };
        match tokio::time::timeout(after, fut).await {
            Ok(done) => done,
            Err(_) => Err(errors::to_py(tb_node::Error::Timeout {
                what: what(),
                after,
            })),
        }
    })
}

/// Runs `work` on the runtime and returns an asyncio future of the running event loop that
/// completes with its result (converted under the GIL) or its exception. Cancelling that
/// future drops `work` at once.
///
/// `work` is polled once right here first (GIL released): what is ready at once (a queued
/// push, a version this node holds) completes the future before it is returned, with no
/// thread hop, and what is not has already sent its first request when it moves to a
/// runtime task. Only the completion then crosses threads: `call_soon_threadsafe`.
pub(crate) fn start<'py, F, T>(py: Python<'py>, work: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    let rt = runtime()?;
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let future = event_loop.call_method0("create_future")?;
    let mut work = Box::pin(work);
    let first = py.detach(|| {
        let _entered = rt.enter();
        let mut cx = Context::from_waker(Waker::noop());
        work.as_mut().poll(&mut cx)
    });
    if let Poll::Ready(out) = first {
        let (ok, value) = outcome(py, out);
        settle(&future, ok, value)?;
        return Ok(future);
    }
    let cancel = CancellationToken::new();
    future.call_method1("add_done_callback", (CancelOnDone(cancel.clone()),))?;
    let (event_loop, settled) = (event_loop.unbind(), future.clone().unbind());
    // The task's first poll registers its waker (the one above was a no-op): nothing that
    // became ready meanwhile is missed.
    rt.spawn(async move {
        let out = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            out = work => out,
        };
        // Not at all when the interpreter is shutting down: nobody awaits the result.
        Python::try_attach(|py| {
            let (ok, value) = outcome(py, out);
            let Ok(settle) = settler(py) else {
                return;
            };
            // A closed loop raises: nobody is left to wake.
            let _ = event_loop
                .bind(py)
                .call_method1("call_soon_threadsafe", (settle, settled, ok, value));
        });
    });
    Ok(future)
}

/// A call's outcome as Python sees it: `(true, result)` or `(false, exception)`.
fn outcome<'py, T>(py: Python<'py>, out: PyResult<T>) -> (bool, Bound<'py, PyAny>)
where
    T: for<'a> IntoPyObject<'a>,
{
    match out.and_then(|v| v.into_bound_py_any(py)) {
        Ok(value) => (true, value),
        Err(e) => (false, e.into_value(py).into_bound(py).into_any()),
    }
}

/// The function the event loop calls to complete a future from [`start`]: sets its result
/// (`ok`) or exception unless it is already done (cancelled).
#[pyfunction]
fn settle(future: &Bound<'_, PyAny>, ok: bool, value: Bound<'_, PyAny>) -> PyResult<()> {
    if future.call_method0("done")?.is_truthy()? {
        return Ok(());
    }
    match ok {
        true => future.call_method1("set_result", (value,))?,
        false => future.call_method1("set_exception", (value,))?,
    };
    Ok(())
}

/// [`settle`] as a Python callable, made once.
fn settler(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static SETTLE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let f = SETTLE.get_or_try_init(py, || {
        wrap_pyfunction!(settle, py).map(|f| f.into_any().unbind())
    })?;
    Ok(f.bind(py))
}

/// An asyncio future's done callback that cancels the runtime task behind it when the
/// future was cancelled.
#[pyclass(frozen, module = "tensor_broker._native")]
struct CancelOnDone(CancellationToken);

#[pymethods]
impl CancelOnDone {
    fn __call__(&self, future: &Bound<'_, PyAny>) -> PyResult<()> {
        if future.call_method0("cancelled")?.is_truthy()? {
            self.0.cancel();
        }
        Ok(())
    }
}
