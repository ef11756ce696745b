//! How many worker threads the tokio runtime of a process embedding a node gets (the Python
//! package's and `tb`'s): `TB_RUNTIME_THREADS` when set, else [`default_worker_threads`]:
//! half the cores, at least 1 and at most [`DEFAULT_MAX_THREADS`].
//!
//! Why not one per core (tokio's default): such a process shares its cores with other
//! threads (the interpreter, torch's, the copies and hashes the node runs on its blocking
//! pool) and other processes (the peers on the host, a broker), and a message's steps hop
//! between workers that each wake the other. On the 2-core development VM, one worker
//! instead of two took a 4 KiB remote call from Python from ~370 to ~255 µs p50 and a 4 KiB
//! round trip by name from ~300 to ~240 µs, and QUIC moved as much (pulls of 64 MiB: 917
//! against 739 MB/s): the heavy byte work is not on the workers.

/// Polls `fut` as a thread that spins for its answer does: same-host sockets it waits on are
/// read by this poll itself, whatever the runtime's I/O driver has seen (a `MSG_PEEK`, then a
/// `recv`), so an answer that landed is taken now, on this thread, not after a runtime
/// thread woke for it. Also says whether the poll, left pending, waits on such a socket (so
/// that polling again soon may find its answer); a future that waits on anything else (a
/// QUIC stream, a channel) makes progress only when its waker is woken, and is best polled
/// then. For a thread outside the runtime's tasks, in the runtime's context (the Python
/// package's lone blocking calls).
pub fn poll_reading_sockets<F: std::future::Future + ?Sized>(
    fut: std::pin::Pin<&mut F>,
    cx: &mut std::task::Context<'_>,
) -> (std::task::Poll<F::Output>, bool) {
    crate::channel::reading_sockets(|| fut.poll(cx))
}

/// The environment variable that sets the number of runtime worker threads.
pub const RUNTIME_THREADS_ENV: &str = "TB_RUNTIME_THREADS";

/// The most worker threads `TB_RUNTIME_THREADS` may ask for.
pub const MAX_RUNTIME_THREADS: usize = 1024;

/// Worker threads for a runtime embedding a node: `TB_RUNTIME_THREADS` (1 to
/// [`MAX_RUNTIME_THREADS`]) when set, else [`default_worker_threads`]. A value that is not
/// such a number is an error naming the variable.
pub fn worker_threads() -> Result<usize, String> {
    match std::env::var(RUNTIME_THREADS_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(default_worker_threads()),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("{RUNTIME_THREADS_ENV} is not valid UTF-8"))
        }
        Ok(value) => parse_threads(&value),
    }
}

fn parse_threads(value: &str) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_RUNTIME_THREADS).contains(&n) => Ok(n),
        _ => Err(format!(
            "{RUNTIME_THREADS_ENV}={value:?}: expected a number of threads from 1 to \
             {MAX_RUNTIME_THREADS}"
        )),
    }
}

/// The most worker threads the default gives (a 64-core host gets 8).
pub const DEFAULT_MAX_THREADS: usize = 8;

/// Half the cores this process may use, at least 1 and at most [`DEFAULT_MAX_THREADS`].
pub fn default_worker_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    (cores / 2).clamp(1, DEFAULT_MAX_THREADS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_thread_counts_within_limits() {
        assert_eq!(parse_threads("1"), Ok(1));
        assert_eq!(parse_threads(" 8 "), Ok(8));
        assert_eq!(parse_threads("1024"), Ok(1024));
        for bad in ["0", "-1", "", "two", "1025", "1.5"] {
            let err = parse_threads(bad).expect_err("refused");
            assert!(err.contains(RUNTIME_THREADS_ENV), "{bad:?}: {err}");
        }
        assert!((1..=DEFAULT_MAX_THREADS).contains(&default_worker_threads()));
    }
}
