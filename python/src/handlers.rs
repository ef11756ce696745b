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
//! The threads are bounded by the jobs that run at once: each function's `concurrency`
//! (the server admits no more), plus streaming handlers that run.

use std::{
    io,
    panic::AssertUnwindSafe,
    sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock},
    time::Duration,
};

use pyo3::Python;

/// Work for a handler thread: it takes the GIL itself, where and as often as it needs.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// How long a handler thread waits for work before it exits (tokio's blocking pool waits
/// as long).
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// Where one idle thread waits for its next job.
struct Slot {
    job: Mutex<Option<Job>>,
    ready: Condvar,
}

/// The idle threads' slots, the one that went idle last on top.
static IDLE: OnceLock<Mutex<Vec<Arc<Slot>>>> = OnceLock::new();

fn idle() -> MutexGuard<'static, Vec<Arc<Slot>>> {
    lock(IDLE.get_or_init(Mutex::default))
}

/// A lock whose holder never panics while it holds it; a poisoned one is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `job` on the handler thread that went idle last, or on a new one when none is
/// idle. An error when no thread could be started (the job is dropped), or in a process
/// forked from the one that started the threads (they are not here).
pub(crate) fn run(job: Job) -> io::Result<()> {
    if crate::runtime::forked() {
        return Err(io::Error::other(
            "handlers cannot run in a process forked from the one that serves",
        ));
    }
    let top = idle().pop();
    match top {
        Some(slot) => {
            *lock(&slot.job) = Some(job);
            slot.ready.notify_one();
            Ok(())
        }
        None => std::thread::Builder::new()
            .name("tb-handler".into())
            .spawn(move || serve(job))
            .map(drop),
    }
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

/// A handler thread: runs `first`, then each job handed to its slot, until it has waited
/// [`KEEP_ALIVE`] for one. It holds one Python thread state throughout and the GIL only
/// while a job takes it; it runs in the runtime's context, as blocking-pool threads did
/// (a handler may call the package's blocking API, which waits on the runtime).
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
                idle().push(Arc::clone(&slot));
                match next_job(&slot) {
                    Some(next) => job = next,
                    None => return,
                }
            }
        })
    });
}

/// The next job handed to `slot`, or `None` once it has waited [`KEEP_ALIVE`] and taken
/// itself off the idle stack.
fn next_job(slot: &Arc<Slot>) -> Option<Job> {
    let waiting = lock(&slot.job);
    let (mut job, _) = slot
        .ready
        .wait_timeout_while(waiting, KEEP_ALIVE, |job| job.is_none())
        .unwrap_or_else(|p| p.into_inner());
    if let Some(job) = job.take() {
        return Some(job);
    }
    drop(job);
    let mut stack = idle();
    if let Some(at) = stack.iter().position(|s| Arc::ptr_eq(s, slot)) {
        stack.remove(at);
        return None;
    }
    drop(stack);
    // Taken off the stack by `run` just now: its job is on its way.
    let waiting = lock(&slot.job);
    let mut job = slot
        .ready
        .wait_while(waiting, |job| job.is_none())
        .unwrap_or_else(|p| p.into_inner());
    job.take()
}
