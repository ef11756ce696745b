//! [`NodeHandle`]: the embedded worker node a Python `Client` drives: put, get (into a fresh
//! [`Buffer`] or the caller's array), list, status, subscribe, close. Every wait, transfer and
//! copy runs with the GIL released (see `runtime`).

use std::{collections::BTreeMap, time::Duration};

use numpy::{PyArray1, PyUntypedArray};
use pyo3::{exceptions::PyValueError, prelude::*, types::PyDict};
use tb_node::{Config, DType, Device, Node, Tensor};

use crate::{
    array::{OutBytes, RawBytes},
    buffer::Buffer,
    errors::{self, to_py},
    runtime::{self, wait, wait_limited},
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

/// Starts a node that joins the cluster of `ticket` with `key`.
pub(crate) fn start(
    py: Python<'_>,
    brokers: Vec<tb_node::PeerAddr>,
    key: tb_node::proto::ClusterKey,
    listen: Option<&str>,
) -> PyResult<NodeHandle> {
    let mut config = Config {
        brokers,
        cluster_key: key,
        ..Config::default()
    };
    if let Some(listen) = listen {
        config.bind_addr = listen.parse().map_err(|e| {
            PyValueError::new_err(format!("listen {listen:?}: {e} (expected ip:port)"))
        })?;
    }
    let node = wait(py, Node::spawn(config))?.map_err(to_py)?;
    Ok(NodeHandle::new(node))
}

#[pymethods]
impl NodeHandle {
    /// Joins the cluster: `join` a ticket, else `TB_JOIN`, else the ticket of a running
    /// `tb up`; the secret inline, from `secret_file`, `TB_CLUSTER_SECRET_FILE` or `tb up`'s.
    #[staticmethod]
    #[pyo3(signature = (join=None, secret_file=None, secret=None, listen=None))]
    fn connect(
        py: Python<'_>,
        join: Option<&str>,
        secret_file: Option<std::path::PathBuf>,
        secret: Option<&str>,
        listen: Option<&str>,
    ) -> PyResult<NodeHandle> {
        let (ticket, key) = tb_node::discover::resolve_env(join, secret_file.as_deref(), secret)
            .map_err(|e| match e {
                tb_node::discover::DiscoverError::NoCluster => errors::unavailable(e.to_string()),
                other => errors::invalid(other.to_string()),
            })?;
        start(py, ticket.brokers, key, listen)
    }

    /// This node's id (hex).
    #[getter]
    fn id(&self) -> PyResult<String> {
        Ok(self.node()?.id().to_string())
    }

    /// This node's address, `<node-id>@<ip:port>`.
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
        name: &str,
        data: &Bound<'_, PyUntypedArray>,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<u64> {
        let node = self.node()?.clone();
        let dtype = parse_dtype(dtype)?;
        let raw = RawBytes::of(data)?;
        // The copy and its hash, without the GIL (`data` stays referenced meanwhile).
        let tensor = py
            .detach(move || Tensor::copy_from(dtype, shape, raw.as_slice()))
            .map_err(to_py)?;
        if let Some(keep) = keep {
            node.set_keep(name, keep).map_err(to_py)?;
        }
        wait(py, node.publish(name, tensor))?.map_err(to_py)
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
        name: &str,
        tensor: &Bound<'_, PyAny>,
        ordinal: usize,
        dtype: &str,
        shape: Vec<u64>,
        keep: Option<usize>,
    ) -> PyResult<u64> {
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
        // `tensor` stays referenced (its memory allocated) for the whole call.
        let _alive = tensor;
        let tensor = py
            .detach(move || {
                let buf = crate::buffer::copy_cuda(ordinal, ptr, nbytes)?;
                Tensor::from_device(dtype, shape, buf)
            })
            .map_err(to_py)?;
        if let Some(keep) = keep {
            node.set_keep(name, keep).map_err(to_py)?;
        }
        wait(py, node.publish(name, tensor))?.map_err(to_py)
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
        let node = self.node()?.clone();
        let what = || format!("getting \"{name}\"");
        let want = device.map_or(Device::Host, Device::Cuda);
        let got = wait_limited(py, timeout, what, async {
            match (want, version) {
                (Device::Cuda(_), _) => node.get_to(&name, version, want).await,
                (_, Some(v)) => node.get_version(&name, v).await,
                (_, None) => node.get(&name).await,
            }
        })?
        .map_err(to_py)?;
        // A host get of a version this node keeps on a device: its bytes, in host memory.
        let tensor = match got.buffer.device() {
            now if now == want => got.buffer,
            _ => py.detach(|| got.buffer.to_device(want)).map_err(to_py)?,
        };
        Ok(Buffer::new(
            got.name.as_str().to_owned(),
            got.version,
            tensor,
        ))
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
        let node = self.node()?.clone();
        // Borrowed for the whole call, GIL released or not: only the slice leaves this frame.
        let mut borrowed = OutBytes::borrow(out)?;
        let dest = borrowed.as_mut_slice()?;
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
        let what = || format!("getting \"{name}\"");
        let got = wait_limited(py, timeout, what, async {
            node.get_into(&name, version, dest, check).await
        })?
        .map_err(to_py)?;
        Ok(got.0)
    }

    /// Publishes `members` (`(key, data, dtype, shape)`, data as for `put`) with `metadata`
    /// as the next version of the set `prefix`, atomically; returns the version.
    #[pyo3(signature = (prefix, members, metadata=None, keep=None))]
    fn put_set(
        &self,
        py: Python<'_>,
        prefix: &str,
        members: Vec<(String, Bound<'_, PyUntypedArray>, String, Vec<u64>)>,
        metadata: Option<BTreeMap<String, String>>,
        keep: Option<usize>,
    ) -> PyResult<u64> {
        let node = self.node()?.clone();
        let mut raws = Vec::with_capacity(members.len());
        for (key, data, dtype, shape) in &members {
            let dtype: DType = dtype.parse().map_err(|e: tb_node::proto::UnknownDType| {
                errors::invalid(format!("{key}: {e}"))
            })?;
            raws.push((key.clone(), RawBytes::of(data)?, dtype, shape.clone()));
        }
        // Copies and hashes without the GIL (`members` keeps every array referenced).
        let tensors = py
            .detach(move || {
                raws.into_iter()
                    .map(|(key, raw, dtype, shape)| {
                        Ok((key, Tensor::copy_from(dtype, shape, raw.as_slice())?))
                    })
                    .collect::<tb_node::Result<Vec<_>>>()
            })
            .map_err(to_py)?;
        if let Some(keep) = keep {
            node.set_keep(prefix, keep).map_err(to_py)?;
        }
        let metadata = metadata.unwrap_or_default();
        wait(py, node.publish_set(prefix, tensors, metadata))?.map_err(to_py)
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
        let node = self.node()?.clone();
        let what = || format!("getting the set \"{prefix}\"");
        let set =
            wait_limited(py, timeout, what, node.get_set(&prefix, version))?.map_err(to_py)?;
        Ok(set_parts(set))
    }

    /// The live names starting with `prefix`, in name order.
    #[pyo3(signature = (prefix=""))]
    fn ls(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<Entry>> {
        let node = self.node()?.clone();
        let listed = wait(py, node.list(prefix))?.map_err(to_py)?;
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
    }

    /// This node and the cluster's members, as a dict.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let node = self.node()?.clone();
        let view = wait(py, node.members_with_stats())?.map_err(to_py)?;
        let out = PyDict::new(py);
        out.set_item("id", node.id().to_string())?;
        out.set_item("addr", node.addr().to_string())?;
        out.set_item("broker", node.current_broker().map(|b| b.to_string()))?;
        out.set_item("joined", node.is_joined())?;
        let (tensors, bytes) = node.store_usage();
        out.set_item("tensors_held", tensors)?;
        out.set_item("bytes_held", bytes)?;
        out.set_item(
            "brokers_answering",
            view.answered
                .iter()
                .map(|b| b.to_string())
                .collect::<Vec<_>>(),
        )?;
        let mut members = Vec::new();
        for row in &view.members {
            let m = PyDict::new(py);
            m.set_item("id", hex::encode(row.member.node.0))?;
            m.set_item("role", format!("{:?}", row.member.role).to_lowercase())?;
            m.set_item("alive", row.member.alive)?;
            m.set_item("addrs", row.member.addrs.clone())?;
            members.push(m);
        }
        out.set_item("members", members)?;
        Ok(out)
    }

    /// Subscribes to the names matching `pattern` (a name, `prefix/*` or `*`).
    fn subscribe(&self, py: Python<'_>, pattern: &str) -> PyResult<Subscription> {
        let node = self.node()?.clone();
        let sub = wait(py, node.subscribe(pattern))?.map_err(to_py)?;
        Ok(Subscription::new(sub))
    }

    /// Stops the node (its links close; what it held is no longer served). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let node = self.node()?.clone();
        if node.is_shut_down() {
            return Ok(());
        }
        let _ = wait(py, async move {
            tokio::time::timeout(CLOSE_GRACE, node.shutdown()).await
        })?;
        Ok(())
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> PyResult<bool> {
        Ok(self.node()?.is_shut_down())
    }
}

/// A dtype name as the CLI spells it (`f32`, `bf16`, ...); `InvalidArgument` otherwise.
fn parse_dtype(name: &str) -> PyResult<DType> {
    name.parse()
        .map_err(|e: tb_node::proto::UnknownDType| errors::invalid(e.to_string()))
}

/// The device address and byte length of a contiguous 1-D `uint8` CUDA array, read from its
/// `__cuda_array_interface__` (so they describe memory the object owns).
fn cuda_bytes(obj: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
    let bad = |why: &str| PyValueError::new_err(format!("put of a CUDA tensor: {why}"));
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
