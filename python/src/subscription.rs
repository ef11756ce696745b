//! [`Subscription`]: a node subscription read from Python, one [`Event`] per new version
//! (or delete) of a matching name. Skipped versions are folded into the next event of their
//! name (`skipped`, `skipped_from`), so an iterator yields only versions a caller can load.
//!
//! `close()` from any thread ends a `next()` waiting in another: the close signal lives
//! outside the reader's lock, and a waiting `next()` watches it.

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    sync::Arc,
};

use pyo3::prelude::*;
use tb_node::{SubEvent, Tensor, TensorName, TensorSet};
use tokio_util::sync::CancellationToken;

use crate::{
    buffer::Buffer,
    errors::to_py,
    node::{SetParts, set_parts},
    runtime::{limited, start_returning, wait},
};

/// What a subscription reported about one name.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct Event {
    name: String,
    version: u64,
    dtype: Option<&'static str>,
    shape: Vec<u64>,
    size: u64,
    skipped: u64,
    skipped_from: Option<u64>,
    deleted: bool,
    tensor: Option<Tensor>,
    /// Its place in the order the subscription read events: what puts an event given back
    /// (an awaited read cancelled after it took it) where it was.
    seq: u64,
}

#[pymethods]
impl Event {
    /// The tensor's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The new version (0 for a delete).
    #[getter]
    fn version(&self) -> u64 {
        self.version
    }

    /// Its dtype name (`None` for a delete).
    #[getter]
    fn dtype(&self) -> Option<&'static str> {
        self.dtype
    }

    /// Its shape.
    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.shape.clone()
    }

    /// Its size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }

    /// Versions of this name published since the last one reported and not reported.
    #[getter]
    fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The first of those versions (`None` when none were skipped).
    #[getter]
    fn skipped_from(&self) -> Option<u64> {
        self.skipped_from
    }

    /// Whether the name was deleted.
    #[getter]
    fn deleted(&self) -> bool {
        self.deleted
    }

    /// The fetched bytes (`None` when the node did not fetch them).
    fn buffer(&self) -> Option<Buffer> {
        self.tensor
            .as_ref()
            .filter(|t| t.host_data().is_some())
            .map(|t| Buffer::new(self.name.clone(), self.version, t.clone()))
    }

    /// The members of a fetched set version: `(version, [(key, Buffer)], metadata)`
    /// (`None` when the node did not fetch it); `InvalidArgument` when this is no set.
    fn set_members(&self) -> PyResult<Option<SetParts>> {
        let Some(tensor) = &self.tensor else {
            return Ok(None);
        };
        let name = TensorName::new(&self.name).map_err(|e| to_py(e.into()))?;
        let set = TensorSet::from_tensor(name, self.version, tensor).map_err(to_py)?;
        Ok(Some(set_parts(set)))
    }

    fn __repr__(&self) -> String {
        match self.deleted {
            true => format!("Event(name={:?}, deleted=True)", self.name),
            false => format!(
                "Event(name={:?}, version={}, skipped={})",
                self.name, self.version, self.skipped
            ),
        }
    }
}

/// A live subscription.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct Subscription {
    inner: Arc<tokio::sync::Mutex<Reader>>,
    /// Fired by `close`; outside the lock, which a waiting `next` holds.
    closed: CancellationToken,
    /// Events an awaited `next` took but could not deliver (cancelled in the moment before
    /// its loop settled it): the next `next` returns them before reading on.
    given_back: Arc<GivenBack>,
    pattern: String,
}

/// The node's subscription and the skips not reported yet.
struct Reader {
    sub: Option<tb_node::Subscription>,
    skipped: HashMap<String, (u64, u64)>,
    /// The next event's [`Event::seq`].
    next_seq: u64,
}

/// Events given back ([`Subscription::next_async`]), in the order they were read, and the
/// signal that wakes a `next` waiting meanwhile to return them first.
#[derive(Default)]
struct GivenBack {
    events: std::sync::Mutex<VecDeque<Event>>,
    added: tokio::sync::Notify,
}

impl GivenBack {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Event>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts `event` back before every event read after it.
    fn put(&self, event: Event) {
        let mut events = self.lock();
        let at = events.partition_point(|e| e.seq < event.seq);
        events.insert(at, event);
        drop(events);
        self.added.notify_one();
    }
}

impl Subscription {
    pub(crate) fn new(sub: tb_node::Subscription) -> Self {
        Subscription {
            pattern: sub.pattern().to_string(),
            inner: Arc::new(tokio::sync::Mutex::new(Reader {
                sub: Some(sub),
                skipped: HashMap::new(),
                next_seq: 0,
            })),
            closed: CancellationToken::new(),
            given_back: Arc::default(),
        }
    }
}

impl Reader {
    fn take_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// The next version or delete (`None`: the subscription ended).
    async fn next(&mut self) -> Option<tb_node::Result<Event>> {
        // Bounded by what the node sends: every event is either returned or a skip folded
        // into a later one.
        loop {
            let event = match self.sub.as_mut()?.next().await {
                None => {
                    self.sub = None;
                    return None;
                }
                Some(Err(e)) => return Some(Err(e)),
                Some(Ok(event)) => event,
            };
            match event {
                SubEvent::Skipped { name, from, to } => {
                    let entry = self
                        .skipped
                        .entry(name.as_str().to_owned())
                        .or_insert((from, 0));
                    entry.1 += to.saturating_sub(from) + 1;
                }
                SubEvent::Version {
                    name,
                    version,
                    meta,
                    tensor,
                } => {
                    let name = name.as_str().to_owned();
                    let (from, count) = self.skipped.remove(&name).unzip();
                    return Some(Ok(Event {
                        name,
                        version,
                        dtype: Some(meta.dtype.name()),
                        shape: meta.shape.clone(),
                        size: meta.byte_len,
                        skipped: count.unwrap_or(0),
                        skipped_from: from,
                        deleted: false,
                        tensor,
                        seq: self.take_seq(),
                    }));
                }
                SubEvent::Deleted { name } => {
                    let name = name.as_str().to_owned();
                    self.skipped.remove(&name);
                    return Some(Ok(Event {
                        name,
                        version: 0,
                        dtype: None,
                        shape: Vec::new(),
                        size: 0,
                        skipped: 0,
                        skipped_from: None,
                        deleted: true,
                        tensor: None,
                        seq: self.take_seq(),
                    }));
                }
            }
        }
    }
}

impl Subscription {
    /// The next event (`None` once ended or closed), within `timeout` seconds.
    fn next_work(
        &self,
        timeout: Option<f64>,
    ) -> PyResult<impl Future<Output = PyResult<Option<Event>>> + Send + 'static> {
        let inner = self.inner.clone();
        let closed = self.closed.clone();
        let given_back = self.given_back.clone();
        let pattern = self.pattern.clone();
        let what = move || format!("an update for {pattern:?}");
        limited(timeout, what, async move {
            // Bounded by the events given back while it waits: each makes one more round.
            loop {
                if closed.is_cancelled() {
                    return Ok(None);
                }
                let added = given_back.added.notified();
                if let Some(event) = given_back.lock().pop_front() {
                    return Ok(Some(event));
                }
                // Biased: once closed, no event is read, even one that is ready; an event
                // given back meanwhile comes before the next one read (reading is
                // cancel-safe: what it folded in stays in the reader).
                let got = tokio::select! {
                    biased;
                    () = closed.cancelled() => None,
                    () = added => continue,
                    got = async { inner.lock().await.next().await } => got,
                };
                return got.transpose().map_err(to_py);
            }
        })
    }
}

#[pymethods]
impl Subscription {
    /// The pattern it watches.
    #[getter]
    fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The next event, waiting at most `timeout` seconds (`Timeout` then; the subscription
    /// goes on) or forever; `None` once the subscription ended or was closed (a `close`
    /// from another thread ends a waiting call at once).
    #[pyo3(signature = (timeout=None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Event>> {
        wait(py, self.next_work(timeout)?)?
    }

    /// [`next`](Self::next) as an awaitable. Cancelling it loses no event: one not yet
    /// read stays for the next call, and one read in the moment before the cancel is given
    /// back to be returned first.
    #[pyo3(signature = (timeout=None))]
    fn next_async<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let given_back = self.given_back.clone();
        start_returning(py, self.next_work(timeout)?, move |event| {
            if let Some(event) = event {
                given_back.put(event);
            }
        })
    }

    /// Ends the subscription, at once: a `next` waiting in another thread returns `None`.
    /// Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        // The signal first: a waiting `next` drops the lock when it sees it, so the wait for
        // the lock below is short.
        self.closed.cancel();
        let inner = self.inner.clone();
        wait(py, async move { inner.lock().await.sub = None })
    }
}
