//! The process's one tokio runtime, and how Python threads wait on it: with the GIL
//! released, in short slices between which pending signals (Ctrl-C) are handled.
//!
//! Async: [`start`] runs the same futures as the blocking calls as tasks on the runtime and
//! hands back a [`CallFuture`] (asyncio's future protocol) that the task completes through
//! the event loop's [`LoopWaker`] (no executor thread per call, no polling). Cancelling the
//! future (cancelling the task that awaits it) cancels the runtime task at once: the call's
//! future is dropped, which releases what it held (budgets, partial versions, borrows).
//!
//! `fork()`: the runtime's threads do not survive into a child process, so a child that
//! calls into a runtime its parent made would wait forever. The pid is recorded when the
//! runtime is made, and every call from another pid fails at once with a clear error (use the
//! `spawn` start method of `multiprocessing`, or connect only after forking).

use std::{
    future::Future,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicUsize, Ordering},
    },
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
    wait_task_receiving(py, fut, false)
}

/// [`wait_task`], its result spun for first when `spin` ([`receive`]).
fn wait_task_receiving<F, T>(py: Python<'_>, fut: F, spin: bool) -> PyResult<T>
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
    receive(py, &rx, spin)
}

/// [`wait_task`] for a remote call's answer, which the waiting thread first spins for,
/// polling the call itself ([`spin_polling`]), while no other thread of this process waits
/// for one.
///
/// A lone call's future is polled on this thread first (GIL released, as [`start`] does):
/// its request goes out from here, on the same-host socket straight from this thread, and
/// it is polled again while the thread spins ([`spin_polling`]), which reads the answer
/// here. Only a call still waiting after that moves to a runtime task, spawned by whatever
/// wakes it (the worker whose I/O driver saw the answer) on that worker. Spawning it at
/// once, as [`wait_task`] does, first woke a worker to write the request: a wake-up more per
/// call (4 KiB echo from Python to Python on the 2-core VM, p50 90-93 -> 82-90 µs). Calls made
/// while others wait are spawned at once: 64 threads each writing their own requests made
/// 15-20% fewer calls/s than a worker writing them all.
pub(crate) fn wait_call<F, T>(py: Python<'_>, fut: F) -> PyResult<T>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let _waiting = Calling::start();
    if CALLING.load(Ordering::Acquire) > 1 {
        return wait_task_receiving(py, fut, true);
    }
    let rt = runtime()?;
    let mut work = Box::pin(fut);
    let handoff = match poll_here(py, rt, &mut work) {
        Ok(done) => return Ok(done),
        Err(handoff) => handoff,
    };
    if let Some(done) = py.detach(|| spin_polling(rt, &handoff, &mut work)) {
        return Ok(done);
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let rx = std::sync::Mutex::new(rx);
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    handoff.park(Box::pin(async move {
        tokio::select! {
            biased;
            () = stop.cancelled() => {}
            out = work => {
                let _ = tx.send(out);
            }
        }
    }));
    // Dropped on every return: a Ctrl-C drops the call's future, parked or running.
    let _cancel = CancelOnDrop(Cancel { cancel, handoff });
    // It spun for its SPIN_LIMIT already (or was not to spin at all).
    receive(py, &rx, false)
}

/// Polls `work` once on this thread, the GIL released, in the runtime's context: its
/// output if it is done, else the [`Handoff`] its waker is, to [`park`](Handoff::park) the
/// rest of it with.
fn poll_here<F>(
    py: Python<'_>,
    rt: &Runtime,
    work: &mut std::pin::Pin<Box<F>>,
) -> Result<F::Output, Arc<Handoff>>
where
    F: Future + Send + ?Sized,
    F::Output: Send,
{
    let handoff = Arc::new(Handoff {
        state: Mutex::new(Handing::Polling),
        rt: rt.handle().clone(),
    });
    let first = py.detach(|| {
        let _entered = rt.enter();
        let waker = Waker::from(handoff.clone());
        work.as_mut().poll(&mut Context::from_waker(&waker))
    });
    match first {
        Poll::Ready(out) => Ok(out),
        Poll::Pending => Err(handoff),
    }
}

/// Polls `work` on this thread while it spins, for at most [`SPIN_LIMIT`] and while this is
/// the only call the process waits for on a machine of more than one core ([`spin_for`] says
/// why): its output if it completes meanwhile, else `None` (then the caller parks it,
/// spawned at once if its waker was woken meanwhile).
///
/// Each poll reads the same-host sockets the call waits on itself
/// (`tb_node::runtime::poll_reading_sockets`), so the call completes on this thread the
/// moment its answer lands. Parked at once, the call waited for a runtime thread to wake for
/// the answer, run the task and hand the result over: on the 2-core VM, whose spinning
/// caller, server and woken runtime thread contend for the two cores, that was most of what
/// a Python caller paid over a Rust one (4 KiB echo, Python to a Rust server, p50 60-77 ->
/// 46-48 µs; Python to Python 84-90 -> 58-69 µs). A call that waits on anything else (a
/// QUIC stream to another host) is polled again only when its waker was woken: polling a
/// QUIC stream takes its connection's lock, which the endpoint's task needs to bring the
/// answer in. A call still waiting after [`SPIN_LIMIT`] is parked and ends on a runtime
/// thread as before.
fn spin_polling<F>(
    rt: &Runtime,
    handoff: &Arc<Handoff>,
    work: &mut std::pin::Pin<Box<F>>,
) -> Option<F::Output>
where
    F: Future + Send + ?Sized,
{
    if cores() < 2 {
        return None;
    }
    let _entered = rt.enter();
    let waker = Waker::from(handoff.clone());
    let until = std::time::Instant::now() + SPIN_LIMIT;
    // The first poll (`poll_here`) wrote the request; look at its socket from the start.
    let mut on_socket = true;
    // Bounded by SPIN_LIMIT.
    while CALLING.load(Ordering::Acquire) == 1 && std::time::Instant::now() < until {
        let woken = {
            let mut state = handoff.lock();
            let woken = matches!(*state, Handing::Woken);
            if woken {
                *state = Handing::Polling;
            }
            woken
        };
        if woken || on_socket {
            let mut cx = Context::from_waker(&waker);
            let (polled, waits) = tb_node::runtime::poll_reading_sockets(work.as_mut(), &mut cx);
            if let Poll::Ready(out) = polled {
                return Some(out);
            }
            on_socket = waits;
        }
        std::hint::spin_loop();
    }
    None
}

/// The cores this process may run on (at least 1).
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How a call's task is cancelled, parked or running: the running task's token, and the
/// hand-off a parked one waits in.
struct Cancel {
    cancel: CancellationToken,
    handoff: Arc<Handoff>,
}

impl Cancel {
    /// Cancels the task: a running one sees the token, a parked one is dropped here, in the
    /// runtime's context as a task's future would be (drop code that needs a runtime finds
    /// one).
    fn now(&self) {
        self.cancel.cancel();
        let _entered = self.handoff.rt.enter();
        self.handoff.cancel();
    }
}

/// Cancels a blocking call's task when dropped (every return of [`wait_call`]).
struct CancelOnDrop(Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.now();
    }
}

/// The result a task sends on `rx`, spun for first ([`spin_for`]) when `spin`; a pending
/// signal (Ctrl-C) raises between slices of the wait.
fn receive<T: Send>(
    py: Python<'_>,
    rx: &std::sync::Mutex<std::sync::mpsc::Receiver<T>>,
    spin: bool,
) -> PyResult<T> {
    if spin && let Some(done) = py.detach(|| spin_for(rx)) {
        return Ok(done);
    }
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

/// Longest a thread waiting for a call's answer spins before it sleeps.
const SPIN_LIMIT: Duration = Duration::from_micros(200);

/// Threads of this process waiting in [`wait_call`].
static CALLING: AtomicUsize = AtomicUsize::new(0);

/// One thread counted in [`CALLING`] while it lives.
struct Calling;

impl Calling {
    fn start() -> Self {
        CALLING.fetch_add(1, Ordering::AcqRel);
        Calling
    }
}

impl Drop for Calling {
    fn drop(&mut self) {
        CALLING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Waits for `rx` by spinning, for at most [`SPIN_LIMIT`], while this is the only call the
/// process waits for and the machine has more than one core: `None` if nothing came.
///
/// A short call between two processes of one host is mostly the time threads take to wake:
/// the answer wakes a runtime thread, which wakes this one. Where an idle core halts (a
/// virtual machine's, above all), waking a thread whose core halted costs tens of µs: a
/// third of a 4 KiB call from Python to Python on a 2-core VM (p50 139-185 µs sleeping,
/// 101-120 spinning). Only a lone call spins: many at once would lose a core to it (a
/// third of their calls/s on 2 cores when one of them spun), and so would two processes
/// that both spin while they wait for each other (a round trip of subscriptions or pushes,
/// whose waits therefore never spin: their p50 went from 300 to 500 µs when they did). A
/// server's handlers run on handler threads (`handlers`), which never spin between calls
/// (on 2 cores that doubled a one-caller call's p50); a handler's own sync calls spin as
/// any caller's do.
fn spin_for<T>(rx: &std::sync::Mutex<std::sync::mpsc::Receiver<T>>) -> Option<T> {
    let alone = || CALLING.load(Ordering::Acquire) == 1;
    if cores() < 2 || !alone() {
        return None;
    }
    let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
    let until = std::time::Instant::now() + SPIN_LIMIT;
    // Bounded by SPIN_LIMIT.
    loop {
        match rx.try_recv() {
            Ok(done) => return Some(done),
            Err(std::sync::mpsc::TryRecvError::Empty)
                if alone() && std::time::Instant::now() < until =>
            {
                std::hint::spin_loop();
            }
            Err(_) => return None,
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

/// Runs `work` on the runtime and returns a [`CallFuture`] of the running event loop (an
/// asyncio-compatible future) that completes with its result (converted under the GIL) or
/// its exception. Cancelling that future drops `work` at once.
///
/// `work` is polled once right here first (GIL released): what is ready at once (a queued
/// push, a version this node holds) completes the future before it is returned, with no
/// thread hop, and what is not has already sent its first request when it moves to a
/// runtime task. Only the completion then crosses threads, through the loop's
/// [`LoopWaker`]: the runtime thread queues it and writes a byte the loop reads, and the
/// loop converts and settles it, running the awaiting task's step there and then (see
/// [`CallFuture`]). No runtime thread waits for the GIL (with one worker, a loop busy in
/// Python code would hold up every transfer of the process). A loop without `add_reader`
/// support gets `call_soon_threadsafe` instead, from a runtime thread that takes the GIL.
pub(crate) fn start<'py, F, T>(py: Python<'py>, work: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    start_returning(py, work, drop)
}

/// [`start`] for work that takes something from a queue (a pushed tensor, a subscription's
/// event): a result the future can no longer deliver, because it was cancelled after the
/// work completed but before the loop settled it, goes to `give_back` (which puts it back
/// where it was in its queue) instead of being dropped. A cancel that comes before the work
/// completes drops the work, which has taken nothing then.
pub(crate) fn start_returning<'py, F, T, G>(
    py: Python<'py>,
    work: F,
    give_back: G,
) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
    G: FnOnce(T) + Send + 'static,
{
    let rt = runtime()?;
    let event_loop = get_running_loop(py)?;
    let mut work = Box::pin(work);
    let handoff = match poll_here(py, rt, &mut work) {
        Ok(out) => {
            let (ok, value) = outcome(py, out);
            let state = Settled::of(ok, value);
            return Ok(
                Bound::new(py, CallFuture::new(event_loop.unbind(), state, None, None))?.into_any(),
            );
        }
        Err(handoff) => handoff,
    };
    let cancel = CancellationToken::new();
    let on_cancel = Cancel {
        cancel: cancel.clone(),
        handoff: handoff.clone(),
    };
    let waker = LoopWaker::of(&event_loop)?;
    let future = Bound::new(
        py,
        CallFuture::new(
            event_loop.clone().unbind(),
            Settled::Pending,
            Some(on_cancel),
            waker.as_ref().map(|w| w.clone_ref(py)),
        ),
    )?;
    let settled = future.clone().unbind();
    let event_loop = event_loop.unbind();
    let task = async move {
        let out = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            out = work => out,
        };
        if let Some(waker) = waker {
            let convert: Convert = Box::new(move |py, wanted| match (wanted, out) {
                (true, out) => Some(outcome(py, out)),
                (false, Ok(value)) => {
                    give_back(value);
                    None
                }
                (false, Err(_)) => None,
            });
            waker.get().complete(settled, convert);
            return;
        }
        // Not at all when the interpreter is shutting down: nobody awaits the result.
        Python::try_attach(|py| {
            // Cancelled already: the result goes back (a future borrowed elsewhere right now
            // is settled as usual). One cancelled between here and the loop's `settle` is a
            // window this fallback, for loops that cannot watch a file descriptor, leaves
            // open.
            if settled.bind(py).try_borrow().is_ok_and(|f| f.done()) {
                if let Ok(value) = out {
                    give_back(value);
                }
                return;
            }
            let (ok, value) = outcome(py, out);
            let Ok(settle) = settler(py) else {
                return;
            };
            // A closed loop raises: nobody is left to wake.
            let _ = event_loop
                .bind(py)
                .call_method1("call_soon_threadsafe", (settle, settled, ok, value));
        });
    };
    handoff.park(Box::pin(task));
    Ok(future.into_any())
}

/// `asyncio.get_running_loop()`, the function looked up once.
fn get_running_loop(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static GET: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    asyncio_attr(py, &GET, "get_running_loop")?.call0()
}

/// A call's task, parked until what its first poll waits for wakes it.
type Parked = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// The waker of a call's first poll (on the caller's thread, in [`start`]): the call's task
/// is spawned only when that waker is woken, from the thread that wakes it, mostly a runtime
/// worker whose I/O driver saw the answer. The task then runs on that worker next, where
/// spawning it at once from the event loop's thread would wake a worker for nothing but to
/// poll it again and wait.
struct Handoff {
    state: Mutex<Handing>,
    rt: tokio::runtime::Handle,
}

enum Handing {
    /// The first poll runs (or the task is not parked yet), not woken.
    Polling,
    /// Woken before the task was parked: [`Handoff::park`] spawns it at once.
    Woken,
    /// Waiting to be woken.
    Parked(Parked),
    /// Spawned, or dropped by a cancel.
    Gone,
}

impl Handoff {
    fn lock(&self) -> std::sync::MutexGuard<'_, Handing> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Parks `task` until the first poll's waker is woken, or spawns it if it was.
    fn park(&self, task: Parked) {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, Handing::Gone) {
            Handing::Polling => *state = Handing::Parked(task),
            Handing::Woken => {
                drop(state);
                self.rt.spawn(task);
            }
            // Cancelled meanwhile: dropped, outside the lock (a drop may wake this waker).
            Handing::Parked(_) | Handing::Gone => {
                drop(state);
                drop(task);
            }
        }
    }

    /// Drops a parked task (its call cancelled before anything woke it).
    fn cancel(&self) {
        let parked = std::mem::replace(&mut *self.lock(), Handing::Gone);
        drop(parked);
    }
}

impl std::task::Wake for Handoff {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut state = self.lock();
        match std::mem::replace(&mut *state, Handing::Gone) {
            Handing::Polling | Handing::Woken => *state = Handing::Woken,
            Handing::Parked(task) => {
                drop(state);
                self.rt.spawn(task);
            }
            Handing::Gone => {}
        }
    }
}

/// A completed call's result, made into Python objects on the loop's thread when its
/// future still waits for it (`true`), else given back to where the call took it from
/// (`None`, see [`start_returning`]).
type Convert =
    Box<dyn for<'py> FnOnce(Python<'py>, bool) -> Option<(bool, Bound<'py, PyAny>)> + Send>;

/// How runtime threads hand completed calls to one asyncio event loop without the GIL: a
/// queue, and a socket pair whose reading end the loop watches (`add_reader`). A completion
/// queued into an empty queue writes one byte; the loop's [`drain`](Self::drain) reads the
/// bytes first and then takes the whole queue, so nothing queued is left without a byte
/// to wake the loop for it. One per loop, made on its first call.
#[pyclass(frozen, module = "tensor_broker._native")]
pub(crate) struct LoopWaker {
    queue: Mutex<std::collections::VecDeque<(Py<CallFuture>, Convert)>>,
    wake: std::os::unix::net::UnixStream,
    woken: std::os::unix::net::UnixStream,
}

impl LoopWaker {
    /// The waker of `event_loop`, made and registered with it on first use; `None` where
    /// the loop cannot watch a file descriptor or be weakly referenced (the caller falls
    /// back to `call_soon_threadsafe`).
    fn of(event_loop: &Bound<'_, PyAny>) -> PyResult<Option<Py<LoopWaker>>> {
        static WAKERS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let py = event_loop.py();
        let wakers = WAKERS
            .get_or_try_init(py, || {
                py.import("weakref")?
                    .call_method0("WeakKeyDictionary")
                    .map(Bound::unbind)
            })?
            .bind(py);
        // A loop that cannot be weakly referenced raises here.
        let Ok(known) = wakers.call_method1("get", (event_loop,)) else {
            return Ok(None);
        };
        if !known.is_none() {
            return Ok(Some(known.cast_into::<LoopWaker>()?.unbind()));
        }
        let (wake, woken) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| errors::base(format!("making an event loop's waker: {e}")))?;
        for end in [&wake, &woken] {
            end.set_nonblocking(true)
                .map_err(|e| errors::base(format!("making an event loop's waker: {e}")))?;
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(&woken);
        let waker = Bound::new(
            py,
            LoopWaker {
                queue: Mutex::default(),
                wake,
                woken,
            },
        )?;
        if wakers.set_item(event_loop, &waker).is_err() {
            return Ok(None);
        }
        if event_loop
            .call_method1("add_reader", (fd, waker.getattr("drain")?))
            .is_err()
        {
            let _ = wakers.del_item(event_loop);
            return Ok(None);
        }
        Ok(Some(waker.unbind()))
    }

    /// Gives back the result of `future` (cancelled) if it is queued here: the loop would
    /// give it back when it drains the queue, after whatever a next call takes meanwhile.
    fn give_back(&self, py: Python<'_>, future: &Bound<'_, CallFuture>) {
        // A call completes once: at most one entry is its.
        let mine = {
            let mut queue = self.lock();
            let at = queue.iter().position(|(queued, _)| queued.is(future));
            at.and_then(|at| queue.remove(at))
        };
        if let Some((_, convert)) = mine {
            convert(py, false);
        }
    }

    /// Queues `future`'s result (any runtime thread; no GIL needed) and wakes the loop if
    /// the queue was empty.
    fn complete(&self, future: Py<CallFuture>, convert: Convert) {
        let mut queue = self.lock();
        let first = queue.is_empty();
        queue.push_back((future, convert));
        drop(queue);
        if first {
            self.wake();
        }
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::VecDeque<(Py<CallFuture>, Convert)>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the byte that makes the loop call [`drain`](Self::drain).
    fn wake(&self) {
        // A full socket already holds a byte the loop has yet to read.
        let _ = std::io::Write::write(&mut &self.wake, &[1]);
    }

    /// Wakes the loop again for completions queued while it drained (they found the queue
    /// not empty, so wrote no byte).
    fn wake_if_left(&self) {
        if !self.lock().is_empty() {
            self.wake();
        }
    }

    /// The oldest completion queued.
    fn pop(&self) -> Option<(Py<CallFuture>, Convert)> {
        self.lock().pop_front()
    }
}

/// Results still queued when the waker goes (its loop closed and was dropped before it
/// drained them) are given back to where their calls took them from, not dropped.
impl Drop for LoopWaker {
    fn drop(&mut self) {
        let left = std::mem::take(&mut *self.lock());
        if left.is_empty() {
            return;
        }
        let _ = Python::try_attach(|py| {
            for (_, convert) in left {
                convert(py, false);
            }
        });
    }
}

#[pymethods]
impl LoopWaker {
    /// Settles every queued completion (the loop calls it when the socket is readable),
    /// running each awaiting task's step here, in this callback, rather than in a callback
    /// of the loop's next iteration (see [`CallFuture`]).
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        let mut bytes = [0u8; 64];
        // One byte per wake-up: a short read means the socket is empty.
        while let Ok(64) = std::io::Read::read(&mut &self.woken, &mut bytes) {}
        // Taken one at a time, so that a step run here which cancels another call finds that
        // call's result still queued and gives it back at once (`give_back`). At most what
        // was queued when it began: more is left for another call, woken for here.
        let mut count = self.lock().len();
        // Bounded by `count`.
        while count > 0 {
            count -= 1;
            let Some((future, convert)) = self.pop() else {
                return Ok(());
            };
            let future = future.bind(py);
            let wanted = !future.borrow().done();
            let Some((ok, value)) = convert(py, wanted) else {
                continue;
            };
            if let Err(e) = CallFuture::settle(future, ok, value, true) {
                // Ctrl-C or an exit in a step: what is left of the batch is settled before
                // it propagates (bounded by `count`).
                while let Some((future, convert)) = (count > 0).then(|| self.pop()).flatten() {
                    count -= 1;
                    let future = future.bind(py);
                    let wanted = !future.borrow().done();
                    if let Some((ok, value)) = convert(py, wanted) {
                        let _ = CallFuture::settle(future, ok, value, false);
                    }
                }
                self.wake_if_left();
                return Err(e);
            }
        }
        self.wake_if_left();
        Ok(())
    }
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

/// A result made into a Python object by the event loop that settles the awaiting future
/// (with the GIL it holds anyway), not by the runtime thread that finished the work: what a
/// [`start`]ed future returns when making its result takes Python (arrays, value trees), so
/// that no runtime thread waits for the GIL (nor makes a Python thread state of its own
/// for it).
pub(crate) struct OnLoop<F>(pub(crate) F);

impl<'py, F> IntoPyObject<'py> for OnLoop<F>
where
    F: for<'a> FnOnce(Python<'a>) -> PyResult<Py<PyAny>>,
{
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        (self.0)(py).map(|made| made.into_bound(py))
    }
}

/// The function the event loop calls to complete a future from [`start`] where the loop
/// has no [`LoopWaker`]: sets its result (`ok`) or exception unless it is already done
/// (cancelled).
#[pyfunction]
fn settle(future: &Bound<'_, CallFuture>, ok: bool, value: Bound<'_, PyAny>) -> PyResult<()> {
    CallFuture::settle(future, ok, value, true)
}

/// [`settle`] as a Python callable, made once.
fn settler(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static SETTLE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let f = SETTLE.get_or_try_init(py, || {
        wrap_pyfunction!(settle, py).map(|f| f.into_any().unbind())
    })?;
    Ok(f.bind(py))
}

impl Settled {
    /// A result (`ok`) or an exception, with its traceback now.
    fn of(ok: bool, value: Bound<'_, PyAny>) -> Settled {
        match ok {
            true => Settled::Result(value.unbind()),
            false => {
                let py = value.py();
                let tb = value
                    .getattr("__traceback__")
                    .map_or_else(|_| py.None(), Bound::unbind);
                Settled::Exception(value.unbind(), tb)
            }
        }
    }
}

/// Where a [`CallFuture`] stands.
enum Settled {
    Pending,
    Result(Py<PyAny>),
    /// The exception instance and its traceback when it was set (`None` or a traceback;
    /// restored before each raise, so re-raising it does not grow its traceback, as
    /// asyncio's futures do).
    Exception(Py<PyAny>, Py<PyAny>),
    /// Cancelled, with the message given to `cancel()`.
    Cancelled(Option<Py<PyAny>>),
}

/// The future of an awaited call: what `await` on any of the extension's `*_async` methods
/// waits for. It follows asyncio's future protocol (`_asyncio_future_blocking`, `get_loop`,
/// `add_done_callback` with `context=`, `remove_done_callback`, `result`, `exception`,
/// `done`, `cancelled`, `cancel(msg)`, `__await__`), so asyncio's `Task`, `gather`, `wait`,
/// `shield` and `wait_for` take it as one of theirs.
///
/// It differs from `loop.create_future()` in one place: when the runtime completes the
/// call, the loop's [`LoopWaker::drain`] (itself a callback of the loop) runs the done
/// callbacks there and then, in their contexts, instead of scheduling each with
/// `call_soon` for the loop's next iteration. The awaiting task's step, the one callback
/// in the common case, so runs one loop iteration earlier, without a `Handle` made and run
/// for it. Everything else schedules callbacks as asyncio does: `cancel()` (a task's own
/// cancel calls it, and must not step that task inside it) and a callback added to a future
/// already done. `cancel()` also cancels the call behind the future at once.
#[pyclass(module = "tensor_broker._native")]
pub(crate) struct CallFuture {
    event_loop: Py<PyAny>,
    state: Settled,
    /// The done callbacks and their contexts.
    callbacks: Vec<(Py<PyAny>, Py<PyAny>)>,
    /// Cancels the call behind the future; dropped once it is done.
    cancel: Option<Cancel>,
    /// The loop's waker that completes it, where a cancel looks for a result it holds
    /// already (none for a future done when made, or one completed by the fallback).
    waker: Option<Py<LoopWaker>>,
    /// asyncio's flag: set while a task waits on the future (the future protocol).
    #[pyo3(get, set, name = "_asyncio_future_blocking")]
    blocking: bool,
}

impl CallFuture {
    fn new(
        event_loop: Py<PyAny>,
        state: Settled,
        cancel: Option<Cancel>,
        waker: Option<Py<LoopWaker>>,
    ) -> CallFuture {
        CallFuture {
            event_loop,
            state,
            callbacks: Vec::new(),
            cancel,
            waker,
            blocking: false,
        }
    }

    /// Completes `future` with `value` (its result when `ok`, else the exception to raise)
    /// unless it is done already (cancelled), then runs its done callbacks here (`now`) or
    /// schedules them on its loop. A callback's exception goes to the loop's exception
    /// handler, as the loop does with its own callbacks; Ctrl-C or an exit propagates, once
    /// the remaining callbacks are scheduled.
    fn settle(
        future: &Bound<'_, CallFuture>,
        ok: bool,
        value: Bound<'_, PyAny>,
        now: bool,
    ) -> PyResult<()> {
        let py = future.py();
        let (callbacks, event_loop) = {
            let mut me = future.borrow_mut();
            if !matches!(me.state, Settled::Pending) {
                return Ok(());
            }
            me.state = Settled::of(ok, value);
            me.cancel = None;
            me.waker = None;
            (
                std::mem::take(&mut me.callbacks),
                me.event_loop.clone_ref(py),
            )
        };
        let event_loop = event_loop.bind(py);
        if !now {
            return schedule(event_loop, future.as_any(), callbacks);
        }
        let mut callbacks = callbacks.into_iter();
        while let Some((callback, context)) = callbacks.next() {
            let Err(err) = context.bind(py).call_method1("run", (callback, future)) else {
                continue;
            };
            if interrupts(py, &err) {
                let _ = schedule(event_loop, future.as_any(), callbacks.collect());
                return Err(err);
            }
            let report = pyo3::types::PyDict::new(py);
            report.set_item(
                "message",
                "Exception in a tensor_broker future's done callback",
            )?;
            report.set_item("exception", err.value(py))?;
            report.set_item("future", future)?;
            if let Err(e) = event_loop.call_method1("call_exception_handler", (report,)) {
                // The handler lets Ctrl-C and exits through, as the loop's own does.
                if interrupts(py, &e) {
                    let _ = schedule(event_loop, future.as_any(), callbacks.collect());
                    return Err(e);
                }
                e.write_unraisable(py, Some(future.as_any()));
            }
        }
        Ok(())
    }
}

/// Whether `err` is one the loop lets through its callbacks' handling (Ctrl-C, an exit).
fn interrupts(py: Python<'_>, err: &PyErr) -> bool {
    err.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py)
        || err.is_instance_of::<pyo3::exceptions::PySystemExit>(py)
}

/// Schedules `callbacks` of `future` on `event_loop`, each in its context, as asyncio's own
/// futures do.
fn schedule(
    event_loop: &Bound<'_, PyAny>,
    future: &Bound<'_, PyAny>,
    callbacks: Vec<(Py<PyAny>, Py<PyAny>)>,
) -> PyResult<()> {
    let py = future.py();
    for (callback, context) in callbacks {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("context", context)?;
        event_loop.call_method("call_soon", (callback, future), Some(&kwargs))?;
    }
    Ok(())
}

/// `asyncio.<name>`, looked up once into `cell`.
fn asyncio_attr<'py>(
    py: Python<'py>,
    cell: &'static PyOnceLock<Py<PyAny>>,
    name: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let attr = cell.get_or_try_init(py, || {
        py.import("asyncio")?.getattr(name).map(Bound::unbind)
    })?;
    Ok(attr.bind(py).clone())
}

#[pymethods]
impl CallFuture {
    fn get_loop(&self, py: Python<'_>) -> Py<PyAny> {
        self.event_loop.clone_ref(py)
    }

    fn done(&self) -> bool {
        !matches!(self.state, Settled::Pending)
    }

    fn cancelled(&self) -> bool {
        matches!(self.state, Settled::Cancelled(_))
    }

    /// The result; raises the call's exception, `CancelledError`, or `InvalidStateError`
    /// while the call runs.
    fn result(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match &self.state {
            Settled::Result(value) => Ok(value.clone_ref(py)),
            Settled::Exception(exc, tb) => {
                // As asyncio's futures: the traceback it was set with, none when it had none.
                let exc = exc.bind(py);
                exc.call_method1("with_traceback", (tb,))?;
                Err(PyErr::from_value(exc.clone()))
            }
            Settled::Cancelled(msg) => Err(cancelled_error(py, msg.as_ref())?),
            Settled::Pending => {
                static INVALID: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
                let class = asyncio_attr(py, &INVALID, "InvalidStateError")?;
                Err(PyErr::from_value(class.call1(("Result is not set.",))?))
            }
        }
    }

    /// The call's exception (`None` when it succeeded); raises as `result()` does when
    /// cancelled or not done.
    fn exception(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        match &self.state {
            Settled::Result(_) => Ok(None),
            Settled::Exception(exc, _) => Ok(Some(exc.clone_ref(py))),
            Settled::Cancelled(_) | Settled::Pending => self.result(py).map(|_| None),
        }
    }

    /// Adds a done callback, called with the future in `context` (a copy of the current one
    /// when not given); scheduled at once when the future is done already.
    #[pyo3(signature = (callback, *, context = None))]
    fn add_done_callback(
        slf: &Bound<'_, Self>,
        callback: Py<PyAny>,
        context: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let py = slf.py();
        let context = match context {
            Some(c) if !c.is_none(py) => c,
            _ => py
                .import("contextvars")?
                .call_method0("copy_context")?
                .unbind(),
        };
        let done = slf.borrow().done();
        if done {
            let event_loop = slf.borrow().event_loop.clone_ref(py);
            return schedule(event_loop.bind(py), slf.as_any(), vec![(callback, context)]);
        }
        slf.borrow_mut().callbacks.push((callback, context));
        Ok(())
    }

    /// Removes every instance of `callback` (the same object, or an equal one as a bound
    /// method is) from the done callbacks; returns how many.
    fn remove_done_callback(slf: &Bound<'_, Self>, callback: Bound<'_, PyAny>) -> PyResult<usize> {
        let py = slf.py();
        // Compared with no borrow held: `__eq__` is Python code, which may use the future.
        let callbacks: Vec<Py<PyAny>> = slf
            .borrow()
            .callbacks
            .iter()
            .map(|(cb, _)| cb.clone_ref(py))
            .collect();
        let mut matching = Vec::new();
        for cb in callbacks {
            let cb = cb.into_bound(py);
            if cb.is(&callback) || cb.eq(&callback)? {
                matching.push(cb.unbind());
            }
        }
        let mut me = slf.borrow_mut();
        let before = me.callbacks.len();
        me.callbacks
            .retain(|(cb, _)| !matching.iter().any(|m| m.is(cb)));
        Ok(before - me.callbacks.len())
    }

    /// The message given to `cancel()` (`asyncio.gather` reads it).
    #[getter]
    fn _cancel_message(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match &self.state {
            Settled::Cancelled(msg) => msg.as_ref().map(|m| m.clone_ref(py)),
            _ => None,
        }
    }

    /// The `CancelledError` a cancelled future raises (`asyncio.gather` calls it).
    fn _make_cancelled_error(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let msg = match &self.state {
            Settled::Cancelled(msg) => msg.as_ref(),
            _ => None,
        };
        Ok(cancelled_error(py, msg)?.into_value(py).into_any())
    }

    /// Cancels the future and the call behind it (dropped at once); schedules the done
    /// callbacks. False when it was done already. A result the runtime completed already,
    /// which the loop has yet to settle, goes back where the call took it from now, ahead of
    /// anything taken after (see [`start_returning`]).
    #[pyo3(signature = (msg = None))]
    fn cancel(slf: &Bound<'_, Self>, msg: Option<Py<PyAny>>) -> PyResult<bool> {
        let py = slf.py();
        let (callbacks, cancel, waker, event_loop) = {
            let mut me = slf.borrow_mut();
            if me.done() {
                return Ok(false);
            }
            me.state = Settled::Cancelled(msg);
            (
                std::mem::take(&mut me.callbacks),
                me.cancel.take(),
                me.waker.take(),
                me.event_loop.clone_ref(py),
            )
        };
        if let Some(cancel) = cancel {
            cancel.now();
        }
        if let Some(waker) = waker {
            waker.get().give_back(py, slf);
        }
        schedule(event_loop.bind(py), slf.as_any(), callbacks)?;
        Ok(true)
    }

    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// `await`'s step: yields the future itself to the awaiting task while the call runs,
    /// then returns its result (raises its exception).
    fn __next__(mut slf: PyRefMut<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        if !slf.done() {
            slf.blocking = true;
            return Ok(slf.into_pyobject(py)?.into_any().unbind());
        }
        let value = slf.result(py)?;
        Err(pyo3::exceptions::PyStopIteration::new_err((value,)))
    }

    fn __repr__(&self) -> String {
        let state = match self.state {
            Settled::Pending => "pending",
            Settled::Result(_) => "finished",
            Settled::Exception(..) => "finished with an exception",
            Settled::Cancelled(_) => "cancelled",
        };
        format!("<tensor_broker CallFuture {state}>")
    }

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.event_loop)?;
        if let Some(waker) = &self.waker {
            visit.call(waker)?;
        }
        for (callback, context) in &self.callbacks {
            visit.call(callback)?;
            visit.call(context)?;
        }
        match &self.state {
            Settled::Exception(v, tb) => {
                visit.call(v)?;
                visit.call(tb)
            }
            Settled::Result(v) | Settled::Cancelled(Some(v)) => visit.call(v),
            Settled::Pending | Settled::Cancelled(None) => Ok(()),
        }
    }

    fn __clear__(&mut self) {
        self.callbacks.clear();
        self.waker = None;
        self.state = Settled::Cancelled(None);
    }
}

/// `CancelledError(msg)`, or `CancelledError()` without a message.
fn cancelled_error(py: Python<'_>, msg: Option<&Py<PyAny>>) -> PyResult<PyErr> {
    static CANCELLED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let class = asyncio_attr(py, &CANCELLED, "CancelledError")?;
    let exc = match msg {
        Some(m) => class.call1((m,))?,
        None => class.call0()?,
    };
    Ok(PyErr::from_value(exc))
}
