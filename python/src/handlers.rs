//! The threads Python handlers run on: the thread that went idle last takes the next call.
//!
//! A remote function's handler is Python code run on a thread of its own (the GIL taken
//! per call), up to the function's `concurrency` at once. Tokio's blocking pool, which ran
//! them before, wakes its longest-idle thread for each task (its idle threads wait on one
//! condition variable, and waiters wake first in, first out), so one caller's calls in turn
//! went round every thread the pool had. Each of those threads was cold when its turn came:
//! its CPU caches, and above all its malloc arena. glibc gives each thread an arena of its
//! own, so the first `x + 1` of 16 MiB on each handler thread wrote into pages no process
//! had touched (35 ms here, against 2 ms into reused ones). After a burst of calls had grown
//! the pool to 8 threads, the next one-caller calls paid that again and again: 8 to 10
//! calls of 40 ms in a row, in a benchmark case that lasts one second.
//!
//! Here an idle thread waits on a slot of its own, on a stack. A job goes to the top one
//! (the thread that finished last, its memory and caches still warm), so calls made one at
//! a time all run on one thread; a new thread starts only when none is idle; and a thread
//! idle for [`KEEP_ALIVE`] exits, the coldest first. Each thread also keeps one Python
//! thread state for its whole life, where a blocking-pool thread made and freed one per
//! call (`PyGILState_Ensure` on a thread without one).
//!
//! At most [`MAX_THREADS`] threads run; jobs beyond them wait in a queue, which each thread
//! empties before it goes idle (calls are bounded before that by each function's
//! `concurrency` and queue, but a cancelled call's handler runs on to its end, and its slot
//! is given to the next call meanwhile).
//!
//! As in a `concurrent.futures.ThreadPoolExecutor` (which gRPC's Python servers run
//! handlers on), what a handler leaves in its thread stays for the next call that runs
//! there: `threading.local` attributes, and context variables set without a reset.
//!
//! When the interpreter exits it frees every thread's Python state; an idle thread whose
//! wait ends after that must not touch Python again, so it waits for the process to end
//! instead (`at_exit`, registered with `atexit` by the module).

use std::{
    collections::VecDeque,
    io,
    panic::AssertUnwindSafe,
    sync::{
        Arc, Condvar, Mutex, MutexGuard, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use pyo3::prelude::*;

/// Work for a handler thread: it takes the GIL itself, where and as often as it needs.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// How long a handler thread waits for work before it exits (tokio's blocking pool waits
/// as long).
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// Most handler threads at once (tokio's blocking pool has the same limit).
const MAX_THREADS: usize = 512;

/// A handler thread's stack: as large as a Python thread's on Linux (deep recursion in a
/// handler needs what it would have on a thread of its own).
const STACK_SIZE: usize = 8 << 20;

/// Where one idle thread waits for its next job.
struct Slot {
    job: Mutex<Option<Job>>,
    ready: Condvar,
}

/// The pool: idle threads' slots (the one that went idle last on top), jobs waiting for a
/// thread while [`MAX_THREADS`] run, and how many threads there are.
#[derive(Default)]
struct Pool {
    idle: Vec<Arc<Slot>>,
    queued: VecDeque<Job>,
    threads: usize,
}

static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();

/// Set once the interpreter exits (`atexit`): idle threads then never take the GIL again.
static EXITING: AtomicBool = AtomicBool::new(false);

fn state() -> MutexGuard<'static, Pool> {
    lock(POOL.get_or_init(Mutex::default))
}

/// A lock whose holder never panics while it holds it; a poisoned one is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Called by `atexit` (registered when the module loads): the interpreter is exiting.
#[pyfunction]
pub(crate) fn at_exit() {
    EXITING.store(true, Ordering::SeqCst);
}

/// Runs `job` on the handler thread that went idle last, or on a new one when none is
/// idle, or (with [`MAX_THREADS`] running) on the first thread to finish its job. An error
/// when no thread could be started (the job is dropped), or in a process forked from the
/// one that started the threads (they are not here).
pub(crate) fn run(job: Job) -> io::Result<()> {
    if crate::runtime::forked() {
        return Err(io::Error::other(
            "handlers cannot run in a process forked from the one that serves",
        ));
    }
    let mut pool = state();
    if let Some(slot) = pool.idle.pop() {
        drop(pool);
        *lock(&slot.job) = Some(job);
        slot.ready.notify_one();
        return Ok(());
    }
    if pool.threads >= MAX_THREADS {
        pool.queued.push_back(job);
        return Ok(());
    }
    pool.threads += 1;
    drop(pool);
    let started = std::thread::Builder::new()
        .name("tb-handler".into())
        .stack_size(STACK_SIZE)
        .spawn(move || serve(job));
    if started.is_err() {
        state().threads -= 1;
    }
    started.map(drop)
}

/// Runs `f` on a handler thread ([`run`]) and waits for what it returns; an error that says
/// why when no thread could run it or it panicked.
pub(crate) async fn call<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job = move || {
        let _ = tx.send(f());
    };
    run(Box::new(job)).map_err(|e| format!("no thread to run it on: {e}"))?;
    rx.await
        .map_err(|_| "its thread failed before it returned".to_owned())
}

/// A handler thread: runs `first`, then each queued job or job handed to its slot, until
/// it has waited [`KEEP_ALIVE`] for one. It holds one Python thread state throughout and
/// the GIL only while a job takes it. It runs in the runtime's context, as blocking-pool
/// threads did, so code that looks the runtime up (`Handle::current()`) finds it.
fn serve(first: Job) {
    let _context = crate::runtime::runtime().ok().map(|rt| rt.handle().enter());
    Python::attach(|py| {
        py.detach(|| {
            let slot = Arc::new(Slot {
                job: Mutex::new(None),
                ready: Condvar::new(),
            });
            let mut job = first;
            // Bounded by the jobs handed to this thread; it ends after KEEP_ALIVE idle.
            loop {
                // A job that panics ends alone: whoever waits for its result sees it dropped.
                let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
                let mut pool = state();
                if let Some(queued) = pool.queued.pop_front() {
                    job = queued;
                    continue;
                }
                pool.idle.push(Arc::clone(&slot));
                drop(pool);
                match next_job(&slot) {
                    Some(next) => job = next,
                    None => return,
                }
            }
        })
    });
}

/// The next job handed to `slot`, or `None` once it has waited [`KEEP_ALIVE`] and taken
/// itself off the idle stack (it never returns once the interpreter is exiting: the thread
/// then waits for the process to end without touching Python).
fn next_job(slot: &Arc<Slot>) -> Option<Job> {
    // Bounded: a job comes, or the wait times out and the thread leaves (or, at exit, waits
    // for the process to end).
    loop {
        let waiting = lock(&slot.job);
        let (mut job, _) = slot
            .ready
            .wait_timeout_while(waiting, KEEP_ALIVE, |job| job.is_none())
            .unwrap_or_else(|p| p.into_inner());
        if let Some(job) = job.take() {
            return Some(job);
        }
        drop(job);
        if EXITING.load(Ordering::SeqCst) {
            continue;
        }
        let mut pool = state();
        if let Some(at) = pool.idle.iter().position(|s| Arc::ptr_eq(s, slot)) {
            pool.idle.remove(at);
            pool.threads -= 1;
            return None;
        }
        drop(pool);
        // Taken off the stack by `run` just now: its job is on its way.
        let waiting = lock(&slot.job);
        let mut job = slot
            .ready
            .wait_while(waiting, |job| job.is_none())
            .unwrap_or_else(|p| p.into_inner());
        return job.take();
    }
}
