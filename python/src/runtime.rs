//! The process's one tokio runtime, and how Python threads wait on it: with the GIL
//! released, in short slices between which pending signals (Ctrl-C) are handled.
//!
//! `fork()`: the runtime's threads do not survive into a child process, so a child that
//! calls into a runtime its parent made would wait forever. The pid is recorded when the
//! runtime is made, and every call from another pid fails at once with a clear error (use the
//! `spawn` start method of `multiprocessing`, or connect only after forking).

use std::{future::Future, sync::OnceLock, time::Duration};

use pyo3::prelude::*;
use tokio::runtime::Runtime;

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
    let rt = tokio::runtime::Builder::new_multi_thread()
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

/// [`wait`] with an optional limit in seconds: past it, `Timeout` naming `what`.
pub(crate) fn wait_limited<F, T>(
    py: Python<'_>,
    limit: Option<f64>,
    what: impl FnOnce() -> String,
    fut: F,
) -> PyResult<T>
where
    F: Future<Output = T> + Send,
    T: Send,
{
    let Some(secs) = limit else {
        return wait(py, fut);
    };
    let after = Duration::try_from_secs_f64(secs).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!("timeout must be >= 0 seconds, got {secs}"))
    })?;
    match wait(py, async move { tokio::time::timeout(after, fut).await })? {
        Ok(done) => Ok(done),
        Err(_) => Err(errors::to_py(tb_node::Error::Timeout {
            what: what(),
            after,
        })),
    }
}
