//! [`NodeHandle`]: the embedded worker node a Python `Client` drives: put, get (into a fresh
//! [`Buffer`] or the caller's array), list, status, subscribe, close. Every wait, transfer and
//! copy runs with the GIL released (see `runtime`).

use std::{collections::BTreeMap, future::Future, time::Duration};

use numpy::{PyArray1, PyUntypedArray};
use pyo3::{exceptions::PyValueError, prelude::*};
use tb_node::{Config, DType, Device, Node, Tensor};

use crate::{
    array::{OutTarget, Source},
    buffer::Buffer,
    errors::{self, to_py},
    runtime::{self, limited, start, wait},
    subscription::Subscription,
};

/// Longest a `close()` waits for the node to shut down (its QUIC connections to drain).
const CLOSE_GRACE: Duration = Duration::from_millis(500);

/// One line of `ls`: a name's newest version.
#[pyclass(frozen, get_all, module = "tensor_broker._native")]
pub struct Entry {
    /// The tensor's name.
    name: String,
    /// Its newest version.
    version: u64,
    /// Its dtype as the CLI spells it.
    dtype: String,
    /// Its shape.
    shape: Vec<u64>,
    /// Its size in bytes.
    size: u64,
    /// How many nodes hold that version.
    holders: u32,
}

#[pymethods]
impl Entry {
    fn __repr__(&self) -> String {
        format!(
            "Entry(name={:?}, version={}, dtype={:?}, shape={:?}, size={}, holders={})",
            self.name, self.version, self.dtype, self.shape, self.size, self.holders
        )
    }
}

/// A node of the cluster in this process.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct NodeHandle {
    /// `None` only while being dropped in a forked child (see `Drop`).
    node: Option<Node>,
}

impl NodeHandle {
    /// Wraps a started node.
    pub(crate) fn new(node: Node) -> Self {
        NodeHandle { node: Some(node) }
    }

    /// The node, usable from this process.
    pub(crate) fn node(&self) -> PyResult<&Node> {
        runtime::runtime()?;
        self.node
            .as_ref()
            .ok_or_else(|| errors::base("the node is gone".into()))
    }
}

impl Drop for NodeHandle {
    fn drop(&mut self) {
        let Some(node) = self.node.take() else {
            return;
        };
        if runtime::forked() {
            // The runtime's threads are in the parent: nothing here can run the shutdown.
            std::mem::forget(node);
            return;
        }
        if let Ok(rt) = runtime::runtime()
            && !node.is_shut_down()
        {
            rt.spawn(async move {
                let _ = tokio::time::timeout(CLOSE_GRACE, node.shutdown()).await;
            });
        }
    }
}

/// A received set as Python gets it: `(version, [(key, Buffer)], metadata)`.
pub(crate) type SetParts = (u64, Vec<(String, Buffer)>, BTreeMap<String, String>);

/// A received set as [`SetParts`]; members named `prefix/key`.
pub(crate) fn set_parts(set: tb_node::TensorSet) -> SetParts {
    let prefix = set.name.as_str().to_owned();
    let members = set
        .members
        .into_iter()
        .map(|(key, t)| {
            let buffer = Buffer::new(format!("{prefix}/{key}"), set.version, t);
            (key, buffer)
        })
        .collect();
    (set.version, members, set.metadata)
}

/// Starts a node that joins the cluster of `brokers` with `key`, serving from `listen`
/// (`ip:port`), holding at most `max_push_memory` bytes of pushes.
pub(crate) fn start_work(
    brokers: Vec<tb_node::PeerAddr>,
    key: tb_node::proto::ClusterKey,
    listen: Option<&str>,
    max_push_memory: Option<u64>,
    channels: Option<&str>,
) -> PyResult<impl Future<Output = Work<NodeHandle>> + Send + 'static> {
    let mut config = Config {
        brokers,
        cluster_key: key,
        ..Config::default()
    };
    // As tb-worker's `--channels`: the argument, else `TB_CHANNELS`, else the default.
    let from_env = std::env::var("TB_CHANNELS").ok();
    if let Some(list) = channels.or(from_env.as_deref()) {
        config.channels = tb_node::proto::ChannelKind::parse_list(list).map_err(|e| {
            PyValueError::new_err(format!(
                "channels {list:?}: {e} (a comma-separated list of shm, quic and tcp)"
            ))
        })?;
    }
    if let Some(bytes) = max_push_memory {
        config.max_push_memory = bytes;
    }
    if let Some(listen) = listen {
        config.bind_addr = listen.parse().map_err(|e| {
            PyValueError::new_err(format!("listen {listen:?}: {e} (expected ip:port)"))
        })?;
    }
    runtime::runtime()?;
    Ok(async move {
        let node = Node::spawn(config).await.map_err(to_py)?;
        Ok(NodeHandle::new(node))
    })
}

/// What `status` returns, as a dict.
#[derive(IntoPyObject)]
pub(crate) struct Status {
    id: String,
    addr: String,
    broker: Option<String>,
    joined: bool,
    tensors_held: usize,
    bytes_held: u64,
    brokers_answering: Vec<String>,
    members: Vec<MemberRow>,
    /// Each linked peer's id and the data channel in use with it.
    links: Vec<(String, &'static str)>,
    /// Versions this node is receiving now (gets in flight).
    versions_receiving: usize,
    /// Pushed tensors waiting for `recv`.
    pushes_queued: usize,
    /// Host bytes pushes hold now (being received or queued) against `max_push_memory`.
    push_bytes_held: u64,
}

/// One member in `status`, as a dict.
#[derive(IntoPyObject)]
pub(crate) struct MemberRow {
    id: String,
    role: String,
    alive: bool,
    addrs: Vec<String>,
}

/// A tensor pushed to this node, as `recv` returns it.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct Pushed {
    /// The name the sender gave it.
    #[pyo3(get)]
    name: String,
    /// The pushing node's id (hex).
    #[pyo3(get)]
    sender: String,
    /// Its bytes.
    #[pyo3(get)]
    buffer: Py<Buffer>,
}

/// A pushed tensor taken from the node's inbox, made into a [`Pushed`] only where Python
/// receives it (on the caller's thread, or the event loop's): no runtime thread waits for
/// the GIL, and an awaited `recv` cancelled before its loop delivered the tensor gives it
/// back to the inbox ([`runtime::start_returning`]).
pub(crate) struct Taken(tb_node::Received);

impl<'py> IntoPyObject<'py> for Taken {
    type Target = Pushed;
    type Output = Bound<'py, Pushed>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, Pushed>> {
        let got = self.0;
        let name = got.name.as_str().to_owned();
        // Pushes carry no version: 0.
        let buffer = Py::new(py, Buffer::new(name.clone(), 0, got.tensor))?;
        Bound::new(
            py,
            Pushed {
                name,
                sender: got.from.to_string(),
                buffer,
            },
        )
    }
}

/// A call's work: the future the blocking form waits for and the async form runs as a task.
type Work<T> = PyResult<T>;

/// Publishes `tensor` as the next version of `name` (the end of a put), after setting how
/// many versions of it this node keeps when `keep` is given.
async fn publish(node: Node, name: String, keep: Option<usize>, tensor: Tensor) -> Work<u64> {
    if let Some(keep) = keep {
        node.set_keep(&name, keep).map_err(to_py)?;
    }
    node.publish(&name, tensor).await.map_err(to_py)
}

// Each operation is one `*_work` method building the future (under the GIL: arguments are
// checked and Python objects referenced here), awaited by the blocking method (`wait`) or
// run as a task by the `*_async` one (`start`): one implementation for both.
impl NodeHandle {
    fn put_work(
        &self,
        name: String,
        data: &Bound<'_, PyUntypedArray>,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<impl Future<Output = Work<u64>> + Send + 'static> {
        let node = self.node()?.clone();
        let dtype = parse_dtype(dtype)?;
        let source = Source::of(data)?;
        Ok(async move {
            let tensor = source.into_tensor(dtype, shape).await?;
            publish(node, name, keep, tensor).await
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn put_cuda_work(
        &self,
        name: String,
        tensor: &Bound<'_, PyAny>,
        ordinal: usize,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<impl Future<Output = Work<u64>> + Send + 'static> {
        let node = self.node()?.clone();
        let dtype = parse_dtype(dtype)?;
        let (ptr, nbytes) = cuda_bytes(tensor)?;
        let expected = tb_node::proto::byte_len_for(dtype, &shape)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        if expected != nbytes as u64 {
            return Err(PyValueError::new_err(format!(
                "a {dtype} tensor of shape {shape:?} has {expected} bytes, the CUDA buffer {nbytes}"
            )));
        }
        // Referenced until the copy is done (its memory stays allocated).
        let alive = tensor.clone().unbind();
        Ok(async move {
            let copied = tokio::task::spawn_blocking(move || {
                let buf = crate::buffer::copy_cuda(ordinal, ptr, nbytes);
                drop(alive);
                buf.and_then(|buf| Tensor::from_device(dtype, shape, buf))
            })
            .await
            .map_err(|e| errors::base(format!("copying the CUDA tensor: {e}")))?;
            let tensor = copied.map_err(to_py)?;
            if let Some(keep) = keep {
                node.set_keep(&name, keep).map_err(to_py)?;
            }
            node.publish(&name, tensor).await.map_err(to_py)
        })
    }

    fn get_work(
        &self,
        name: String,
        version: Option<u64>,
        timeout: Option<f64>,
        device: Option<usize>,
    ) -> PyResult<impl Future<Output = Work<Buffer>> + Send + 'static> {
        let node = self.node()?.clone();
        let want = device.map_or(Device::Host, Device::Cuda);
        let what = {
            let name = name.clone();
            move || format!("getting \"{name}\"")
        };
        let got: std::pin::Pin<Box<dyn Future<Output = Work<_>> + Send>> = match want {
            Device::Cuda(_) => Box::pin(limited(timeout, what, async move {
                node.get_to(&name, version, want).await.map_err(to_py)
            })?),
            // The node's own deadline: past it, everything the get started stops.
            Device::Host => {
                let deadline = runtime::seconds(timeout)?;
                Box::pin(async move {
                    let got = node.get_within(&name, version, deadline).await;
                    got.map_err(to_py)
                })
            }
        };
        Ok(async move {
            let got = got.await?;
            // A host get of a version this node keeps on a device: its bytes, in host memory.
            let tensor = match got.buffer.device() {
                now if now == want => got.buffer,
                _ => {
                    let on_device = got.buffer;
                    tokio::task::spawn_blocking(move || on_device.to_device(want))
                        .await
                        .map_err(|e| errors::base(format!("copying to {want:?}: {e}")))?
                        .map_err(to_py)?
                }
            };
            Ok(Buffer::new(
                got.name.as_str().to_owned(),
                got.version,
                tensor,
            ))
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn get_into_work(
        &self,
        name: String,
        out: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        shape: Vec<u64>,
        version: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<impl Future<Output = Work<u64>> + Send + 'static> {
        let node = self.node()?.clone();
        let mut target = OutTarget::claim(out)?;
        let want = dtype.to_owned();
        let check = move |meta: &tb_node::TensorMeta| {
            if meta.dtype.name() == want && meta.shape == shape {
                return Ok(());
            }
            Err(tb_node::Error::InvalidTensor(format!(
                "the tensor is {} {:?}; out is {want} {shape:?}",
                meta.dtype.name(),
                meta.shape
            )))
        };
        let what = {
            let name = name.clone();
            move || format!("getting \"{name}\"")
        };
        limited(timeout, what, async move {
            let dest = target.as_mut_slice();
            let got = node.get_into(&name, version, dest, check).await;
            got.map(|(version, _)| version).map_err(to_py)
        })
    }

    fn put_set_work(
        &self,
        prefix: String,
        members: Vec<(String, Bound<'_, PyUntypedArray>, String, Vec<u64>)>,
        metadata: Option<BTreeMap<String, String>>,
        keep: Option<usize>,
    ) -> PyResult<impl Future<Output = Work<u64>> + Send + 'static> {
        let node = self.node()?.clone();
        let mut sources = Vec::with_capacity(members.len());
        for (key, data, dtype, shape) in &members {
            let dtype: DType = dtype.parse().map_err(|e: tb_node::proto::UnknownDType| {
                errors::invalid(format!("{key}: {e}"))
            })?;
            sources.push((key.clone(), Source::of(data)?, dtype, shape.clone()));
        }
        Ok(async move {
            let mut tensors = Vec::with_capacity(sources.len());
            for (key, source, dtype, shape) in sources {
                tensors.push((key, source.into_tensor(dtype, shape).await?));
            }
            if let Some(keep) = keep {
                node.set_keep(&prefix, keep).map_err(to_py)?;
            }
            let metadata = metadata.unwrap_or_default();
            let published = node.publish_set(&prefix, tensors, metadata).await;
            published.map_err(to_py)
        })
    }

    fn get_set_work(
        &self,
        prefix: String,
        version: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<impl Future<Output = Work<SetParts>> + Send + 'static> {
        let node = self.node()?.clone();
        let what = {
            let prefix = prefix.clone();
            move || format!("getting the set \"{prefix}\"")
        };
        limited(timeout, what, async move {
            let set = node.get_set(&prefix, version).await.map_err(to_py)?;
            Ok(set_parts(set))
        })
    }

    fn ls_work(
        &self,
        prefix: String,
    ) -> PyResult<impl Future<Output = Work<Vec<Entry>>> + Send + 'static> {
        let node = self.node()?.clone();
        Ok(async move {
            let listed = node.list(&prefix).await.map_err(to_py)?;
            Ok(listed
                .into_iter()
                .map(|e| Entry {
                    name: e.name.as_str().to_owned(),
                    version: e.version,
                    dtype: e.meta.dtype.name().to_owned(),
                    shape: e.meta.shape.clone(),
                    size: e.meta.byte_len,
                    holders: e.holders,
                })
                .collect())
        })
    }

    fn status_work(&self) -> PyResult<impl Future<Output = Work<Status>> + Send + 'static> {
        let node = self.node()?.clone();
        Ok(async move {
            let view = node.members_with_stats().await.map_err(to_py)?;
            let (tensors_held, bytes_held) = node.store_usage();
            let members = view
                .members
                .iter()
                .map(|row| MemberRow {
                    id: hex::encode(row.member.node.0),
                    role: format!("{:?}", row.member.role).to_lowercase(),
                    alive: row.member.alive,
                    addrs: row.member.addrs.clone(),
                })
                .collect();
            Ok(Status {
                id: node.id().to_string(),
                addr: node.addr().to_string(),
                broker: node.current_broker().map(|b| b.to_string()),
                joined: node.is_joined(),
                tensors_held,
                bytes_held,
                brokers_answering: view.answered.iter().map(|b| b.to_string()).collect(),
                members,
                versions_receiving: node.versions_receiving(),
                pushes_queued: node.inbox_len(),
                push_bytes_held: node.push_bytes_held(),
                links: node
                    .links()
                    .into_iter()
                    .map(|(peer, channel)| (peer.to_string(), channel))
                    .collect(),
            })
        })
    }

    fn subscribe_work(
        &self,
        pattern: String,
    ) -> PyResult<impl Future<Output = Work<Subscription>> + Send + 'static> {
        let node = self.node()?.clone();
        Ok(async move {
            let sub = node.subscribe(&pattern).await.map_err(to_py)?;
            Ok(Subscription::new(sub))
        })
    }

    fn push_work(
        &self,
        peer: &str,
        name: String,
        data: &Bound<'_, PyUntypedArray>,
        dtype: &str,
        shape: Vec<u64>,
    ) -> PyResult<impl Future<Output = Work<()>> + Send + 'static> {
        let node = self.node()?.clone();
        let addr: tb_node::PeerAddr = peer.parse().map_err(|e| {
            errors::invalid(format!(
                "peer {peer:?}: {e} (expected a node's addr, <node-id>@<ip:port>)"
            ))
        })?;
        let dtype = parse_dtype(dtype)?;
        let source = Source::of(data)?;
        Ok(async move {
            // Up to 4 MiB straight from the array (same host: hashed on the way); the future
            // holds the array's reference for as long as it reads it. Larger ones are copied
            // into a tensor on the blocking pool first (never on an event loop's thread).
            if source.bytes().len() <= tb_node::PUSH_BYTES_STREAMED_MAX {
                let pushed = node.push_bytes(&addr, &name, dtype, shape, source.bytes());
                return pushed.await.map_err(to_py);
            }
            let tensor = source.into_tensor(dtype, shape).await?;
            node.push(&addr, &name, &tensor).await.map_err(to_py)
        })
    }

    fn recv_work(
        &self,
        timeout: Option<f64>,
    ) -> PyResult<impl Future<Output = Work<Taken>> + Send + 'static> {
        let node = self.node()?.clone();
        let what = || "a pushed tensor".to_owned();
        limited(timeout, what, async move {
            node.recv().await.map(Taken).map_err(to_py)
        })
    }

    fn close_work(&self) -> PyResult<impl Future<Output = Work<()>> + Send + 'static> {
        let node = self.node()?.clone();
        Ok(async move {
            if !node.is_shut_down() {
                let _ = tokio::time::timeout(CLOSE_GRACE, node.shutdown()).await;
            }
            Ok(())
        })
    }
}

#[pymethods]
impl NodeHandle {
    /// Joins the cluster: `join` a ticket, else `TB_JOIN`, else the ticket of a running
    /// `tb up`; the secret inline, from `secret_file`, `TB_CLUSTER_SECRET_FILE` or `tb up`'s.
    #[staticmethod]
    #[pyo3(signature = (join=None, secret_file=None, secret=None, listen=None, max_push_memory=None, channels=None))]
    fn connect(
        py: Python<'_>,
        join: Option<&str>,
        secret_file: Option<std::path::PathBuf>,
        secret: Option<&str>,
        listen: Option<&str>,
        max_push_memory: Option<u64>,
        channels: Option<&str>,
    ) -> PyResult<NodeHandle> {
        let work = connect_work(join, secret_file, secret, listen, max_push_memory, channels)?;
        wait(py, work)?
    }

    /// [`connect`](Self::connect) as an awaitable.
    #[staticmethod]
    #[pyo3(signature = (join=None, secret_file=None, secret=None, listen=None, max_push_memory=None, channels=None))]
    fn connect_async<'py>(
        py: Python<'py>,
        join: Option<&str>,
        secret_file: Option<std::path::PathBuf>,
        secret: Option<&str>,
        listen: Option<&str>,
        max_push_memory: Option<u64>,
        channels: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let work = connect_work(join, secret_file, secret, listen, max_push_memory, channels)?;
        start(py, work)
    }

    /// This node's id (hex).
    #[getter]
    fn id(&self) -> PyResult<String> {
        Ok(self.node()?.id().to_string())
    }

    /// How many pulls into device memory this node made by CUDA IPC (device to device from a
    /// holder on this host): gets, and tensors lent in calls.
    #[getter]
    fn cuda_ipc_pulls(&self) -> PyResult<u64> {
        Ok(self.node()?.cuda_ipc_pulls())
    }

    /// This node's address, `<node-id>@<ip:port>`: what peers push to.
    #[getter]
    fn addr(&self) -> PyResult<String> {
        Ok(self.node()?.addr().to_string())
    }

    /// Publishes the bytes of `data` (a C-contiguous array; its bytes are taken as they are)
    /// as the next version of `name`, a `dtype` tensor of `shape`; returns the version.
    #[pyo3(signature = (name, data, dtype, shape, keep=None))]
    fn put(
        &self,
        py: Python<'_>,
        name: String,
        data: &Bound<'_, PyUntypedArray>,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<u64> {
        // Copied on this thread: it waits for the put either way.
        let node = self.node()?.clone();
        let dtype = parse_dtype(dtype)?;
        let tensor = Source::of(data)?.tensor_here(py, dtype, shape)?;
        wait(py, publish(node, name, keep, tensor))?
    }

    /// [`put`](Self::put) as an awaitable.
    #[pyo3(signature = (name, data, dtype, shape, keep=None))]
    fn put_async<'py>(
        &self,
        py: Python<'py>,
        name: String,
        data: &Bound<'_, PyUntypedArray>,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.put_work(name, data, dtype, shape, keep)?)
    }

    /// Publishes a CUDA tensor's bytes (`tensor`: its bytes as a contiguous 1-D `uint8` CUDA
    /// tensor on device `ordinal`, whose address and length are read from its
    /// `__cuda_array_interface__`, never taken from the caller) as the next version of
    /// `name`, a `dtype` tensor of `shape`, copied device to device into the node's memory,
    /// where it stays and is served from; returns the version. The caller synchronized the
    /// work that produced it. `Unavailable` in a build without CUDA.
    #[pyo3(signature = (name, tensor, ordinal, dtype, shape, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn put_cuda(
        &self,
        py: Python<'_>,
        name: String,
        tensor: &Bound<'_, PyAny>,
        ordinal: usize,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<u64> {
        let work = self.put_cuda_work(name, tensor, ordinal, dtype, shape, keep)?;
        wait(py, work)?
    }

    /// [`put_cuda`](Self::put_cuda) as an awaitable.
    #[pyo3(signature = (name, tensor, ordinal, dtype, shape, keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn put_cuda_async<'py>(
        &self,
        py: Python<'py>,
        name: String,
        tensor: &Bound<'_, PyAny>,
        ordinal: usize,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        start(
            py,
            self.put_cuda_work(name, tensor, ordinal, dtype, shape, keep)?,
        )
    }

    /// Gets `version` (the newest when `None`) of `name`, within `timeout` seconds if given,
    /// in host memory, or on CUDA device `device` (`Node::get_to`: device to device by CUDA
    /// IPC from a same-host holder that keeps it on a device, through pinned staging into
    /// device memory from others; not kept by this node).
    #[pyo3(signature = (name, version=None, timeout=None, device=None))]
    fn get(
        &self,
        py: Python<'_>,
        name: String,
        version: Option<u64>,
        timeout: Option<f64>,
        device: Option<usize>,
    ) -> PyResult<Buffer> {
        wait(py, self.get_work(name, version, timeout, device)?)?
    }

    /// [`get`](Self::get) as an awaitable.
    #[pyo3(signature = (name, version=None, timeout=None, device=None))]
    fn get_async<'py>(
        &self,
        py: Python<'py>,
        name: String,
        version: Option<u64>,
        timeout: Option<f64>,
        device: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.get_work(name, version, timeout, device)?)
    }

    /// Gets `name` into `out` (the bytes of a writable array whose dtype name is `dtype` and
    /// whose shape is `shape`, as a 1-D `uint8` view), received straight into it
    /// (`Node::get_into`); returns the version. A tensor of another dtype or shape is refused
    /// before anything is written; so is an `out` that another call is writing (a
    /// `BufferError`: two receives never write the same memory).
    #[pyo3(signature = (name, out, dtype, shape, version=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_into(
        &self,
        py: Python<'_>,
        name: String,
        out: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        shape: Vec<u64>,
        version: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<u64> {
        let work = self.get_into_work(name, out, dtype, shape, version, timeout)?;
        wait(py, work)?
    }

    /// [`get_into`](Self::get_into) as an awaitable (cancelling it ends the receive; `out`
    /// then holds part of the bytes).
    #[pyo3(signature = (name, out, dtype, shape, version=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_into_async<'py>(
        &self,
        py: Python<'py>,
        name: String,
        out: &Bound<'_, PyArray1<u8>>,
        dtype: &str,
        shape: Vec<u64>,
        version: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let work = self.get_into_work(name, out, dtype, shape, version, timeout)?;
        start(py, work)
    }

    /// Publishes `members` (`(key, data, dtype, shape)`, data as for `put`) with `metadata`
    /// as the next version of the set `prefix`, atomically; returns the version.
    #[pyo3(signature = (prefix, members, metadata=None, keep=None))]
    fn put_set(
        &self,
        py: Python<'_>,
        prefix: String,
        members: Vec<(String, Bound<'_, PyUntypedArray>, String, Vec<u64>)>,
        metadata: Option<BTreeMap<String, String>>,
        keep: Option<usize>,
    ) -> PyResult<u64> {
        wait(py, self.put_set_work(prefix, members, metadata, keep)?)?
    }

    /// [`put_set`](Self::put_set) as an awaitable.
    #[pyo3(signature = (prefix, members, metadata=None, keep=None))]
    fn put_set_async<'py>(
        &self,
        py: Python<'py>,
        prefix: String,
        members: Vec<(String, Bound<'_, PyUntypedArray>, String, Vec<u64>)>,
        metadata: Option<BTreeMap<String, String>>,
        keep: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.put_set_work(prefix, members, metadata, keep)?)
    }

    /// Gets `version` (the newest when `None`) of the set `prefix`: `(version, members,
    /// metadata)`, members as `(key, Buffer)` in publish order, every one of that version.
    #[pyo3(signature = (prefix, version=None, timeout=None))]
    fn get_set(
        &self,
        py: Python<'_>,
        prefix: String,
        version: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<SetParts> {
        wait(py, self.get_set_work(prefix, version, timeout)?)?
    }

    /// [`get_set`](Self::get_set) as an awaitable.
    #[pyo3(signature = (prefix, version=None, timeout=None))]
    fn get_set_async<'py>(
        &self,
        py: Python<'py>,
        prefix: String,
        version: Option<u64>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.get_set_work(prefix, version, timeout)?)
    }

    /// The live names starting with `prefix`, in name order.
    #[pyo3(signature = (prefix=String::new()))]
    fn ls(&self, py: Python<'_>, prefix: String) -> PyResult<Vec<Entry>> {
        wait(py, self.ls_work(prefix)?)?
    }

    /// [`ls`](Self::ls) as an awaitable.
    #[pyo3(signature = (prefix=String::new()))]
    fn ls_async<'py>(&self, py: Python<'py>, prefix: String) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.ls_work(prefix)?)
    }

    /// This node (and each link's data channel) and the cluster's members, as a dict.
    fn status(&self, py: Python<'_>) -> PyResult<Status> {
        wait(py, self.status_work()?)?
    }

    /// [`status`](Self::status) as an awaitable.
    fn status_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.status_work()?)
    }

    /// Subscribes to the names matching `pattern` (a name, `prefix/*` or `*`).
    fn subscribe(&self, py: Python<'_>, pattern: String) -> PyResult<Subscription> {
        wait(py, self.subscribe_work(pattern)?)?
    }

    /// [`subscribe`](Self::subscribe) as an awaitable.
    fn subscribe_async<'py>(
        &self,
        py: Python<'py>,
        pattern: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.subscribe_work(pattern)?)
    }

    /// Sends the bytes of `data` (as for `put`), a `dtype` tensor of `shape`, straight to the
    /// node at `peer` (`<node-id>@<ip:port>`) under `name`; returns once that node has
    /// verified and queued it (its `recv` takes it).
    fn push(
        &self,
        py: Python<'_>,
        peer: &str,
        name: String,
        data: &Bound<'_, PyUntypedArray>,
        dtype: &str,
        shape: Vec<u64>,
    ) -> PyResult<()> {
        wait(py, self.push_work(peer, name, data, dtype, shape)?)?
    }

    /// [`push`](Self::push) as an awaitable.
    fn push_async<'py>(
        &self,
        py: Python<'py>,
        peer: &str,
        name: String,
        data: &Bound<'_, PyUntypedArray>,
        dtype: &str,
        shape: Vec<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.push_work(peer, name, data, dtype, shape)?)
    }

    /// The next tensor pushed to this node, waiting at most `timeout` seconds (`Timeout`
    /// then) or forever.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Taken> {
        wait(py, self.recv_work(timeout)?)?
    }

    /// [`recv`](Self::recv) as an awaitable. Cancelling it takes nothing from the queue:
    /// a tensor taken in the moment before the cancel goes back where it was.
    #[pyo3(signature = (timeout=None))]
    fn recv_async<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self.node()?.clone();
        runtime::start_returning(py, self.recv_work(timeout)?, move |taken: Taken| {
            node.give_back(taken.0)
        })
    }

    /// Stops the node (its links close; what it held is no longer served). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        wait(py, self.close_work()?)?
    }

    /// [`close`](Self::close) as an awaitable.
    fn close_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        start(py, self.close_work()?)
    }

    /// Remote functions on this node (attached once: the client keeps the handle).
    fn calls(&self) -> PyResult<crate::calls::CallsHandle> {
        crate::calls::CallsHandle::attach(self.node()?)
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> PyResult<bool> {
        Ok(self.node()?.is_shut_down())
    }
}

/// Starts a node that joins the cluster found from the arguments or the environment.
fn connect_work(
    join: Option<&str>,
    secret_file: Option<std::path::PathBuf>,
    secret: Option<&str>,
    listen: Option<&str>,
    max_push_memory: Option<u64>,
    channels: Option<&str>,
) -> PyResult<impl Future<Output = Work<NodeHandle>> + Send + 'static> {
    let (ticket, key) = tb_node::discover::resolve_env(join, secret_file.as_deref(), secret)
        .map_err(|e| match e {
            tb_node::discover::DiscoverError::NoCluster => errors::unavailable(e.to_string()),
            other => errors::invalid(other.to_string()),
        })?;
    start_work(ticket.brokers, key, listen, max_push_memory, channels)
}

/// A dtype name as the CLI spells it (`f32`, `bf16`, ...); `InvalidArgument` otherwise.
pub(crate) fn parse_dtype(name: &str) -> PyResult<DType> {
    name.parse()
        .map_err(|e: tb_node::proto::UnknownDType| errors::invalid(e.to_string()))
}

/// The device address and byte length of a contiguous 1-D `uint8` CUDA array, read from its
/// `__cuda_array_interface__` (so they describe memory the object owns).
pub(crate) fn cuda_bytes(obj: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
    let bad = |why: &str| PyValueError::new_err(format!("a CUDA tensor: {why}"));
    let cai = obj
        .getattr("__cuda_array_interface__")
        .map_err(|_| bad("the object has no __cuda_array_interface__"))?;
    let typestr: String = cai.get_item("typestr")?.extract()?;
    if !matches!(typestr.as_str(), "|u1" | "<u1" | ">u1") {
        return Err(bad(&format!("expected its bytes as uint8, got {typestr}")));
    }
    let shape: Vec<usize> = cai.get_item("shape")?.extract()?;
    let [len] = shape[..] else {
        return Err(bad(&format!(
            "expected a 1-D view of its bytes, got shape {shape:?}"
        )));
    };
    let strides = cai.get_item("strides").ok().filter(|s| !s.is_none());
    if let Some(strides) = strides {
        let strides: Vec<isize> = strides.extract()?;
        if len > 1 && strides != [1] {
            return Err(bad(&format!(
                "its bytes are not contiguous (strides {strides:?})"
            )));
        }
    }
    let (ptr, _read_only): (u64, bool) = cai.get_item("data")?.extract()?;
    if ptr == 0 && len > 0 {
        return Err(bad("a null device address"));
    }
    Ok((ptr, len))
}
