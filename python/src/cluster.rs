//! [`LocalCluster`]: a broker (and optional workers) in this process on free 127.0.0.1
//! ports, with a fresh secret in a temporary folder: a whole cluster for a notebook or a test.

use std::sync::Mutex;

use pyo3::prelude::*;
use tb_broker::{Broker, BrokerOptions};
use tb_node::{Config, Node, Ticket};

use crate::{
    errors::{self, to_py},
    node::{self, NodeHandle},
    runtime::{self, wait},
};

/// Most workers a local cluster starts.
const MAX_WORKERS: usize = 16;

/// What a running local cluster owns.
struct Running {
    broker: Broker,
    workers: Vec<Node>,
    /// Holds the broker's registry, the secret and the ticket; removed when dropped.
    _dir: tempfile::TempDir,
}

/// A broker and `workers` worker nodes in this process.
#[pyclass(frozen, module = "tensor_broker._native")]
pub struct LocalCluster {
    running: Mutex<Option<Running>>,
    ticket: Ticket,
    key: tb_node::proto::ClusterKey,
    secret_file: String,
}

#[pymethods]
impl LocalCluster {
    /// Starts the broker and the workers.
    #[new]
    #[pyo3(signature = (workers=0))]
    fn new(py: Python<'_>, workers: usize) -> PyResult<Self> {
        if workers > MAX_WORKERS {
            return Err(errors::invalid(format!(
                "a local cluster runs 0 to {MAX_WORKERS} workers, not {workers}"
            )));
        }
        let dir = tempfile::Builder::new()
            .prefix("tensor-broker-")
            .tempdir()
            .map_err(|e| errors::base(format!("making a temporary folder: {e}")))?;
        let secret_file = dir.path().join("secret");
        tb_node::discover::create_secret_file(&secret_file)
            .map_err(|e| errors::base(format!("writing {}: {e}", secret_file.display())))?;
        let key = tb_node::discover::cluster_key(None, Some(&secret_file))
            .map_err(|e| errors::base(e.to_string()))?;
        let mut opts = BrokerOptions::new(dir.path().join("broker"));
        opts.node.bind_addr = ([127, 0, 0, 1], 0).into();
        opts.node.cluster_key = key.clone();
        let broker = wait(py, Broker::spawn(opts))?
            .map_err(|e| errors::unavailable(format!("starting the broker: {e}")))?;
        let ticket = Ticket {
            brokers: vec![broker.addr().clone()],
        };
        let mut running = Running {
            broker,
            workers: Vec::new(),
            _dir: dir,
        };
        for _ in 0..workers {
            let config = Config {
                brokers: ticket.brokers.clone(),
                cluster_key: key.clone(),
                ..Config::default()
            };
            match wait(py, Node::spawn(config))? {
                Ok(worker) => running.workers.push(worker),
                Err(e) => {
                    stop(py, running)?;
                    return Err(to_py(e));
                }
            }
        }
        std::fs::write(running._dir.path().join("ticket"), format!("{ticket}\n"))
            .map_err(|e| errors::base(format!("writing the ticket: {e}")))?;
        Ok(LocalCluster {
            running: Mutex::new(Some(running)),
            ticket,
            key,
            secret_file: secret_file.display().to_string(),
        })
    }

    /// The cluster ticket (`tbc1:...`): what `connect(join=...)` and `tb --join` take.
    #[getter]
    fn ticket(&self) -> String {
        self.ticket.to_string()
    }

    /// The file holding the cluster secret (mode 0600), removed with the cluster.
    #[getter]
    fn secret_file(&self) -> &str {
        &self.secret_file
    }

    /// The worker nodes' addresses.
    #[getter]
    fn workers(&self) -> Vec<String> {
        self.lock()
            .as_ref()
            .map(|r| r.workers.iter().map(|w| w.addr().to_string()).collect())
            .unwrap_or_default()
    }

    /// A node of this cluster in this process (`read_only`: with the read-only credential).
    #[pyo3(signature = (listen=None, max_push_memory=None, read_only=false, channels=None))]
    fn connect(
        &self,
        py: Python<'_>,
        listen: Option<&str>,
        max_push_memory: Option<u64>,
        read_only: bool,
        channels: Option<&str>,
    ) -> PyResult<NodeHandle> {
        wait(
            py,
            self.connect_work(listen, max_push_memory, read_only, channels)?,
        )?
    }

    /// [`connect`](Self::connect) as an awaitable.
    #[pyo3(signature = (listen=None, max_push_memory=None, read_only=false, channels=None))]
    fn connect_async<'py>(
        &self,
        py: Python<'py>,
        listen: Option<&str>,
        max_push_memory: Option<u64>,
        read_only: bool,
        channels: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let work = self.connect_work(listen, max_push_memory, read_only, channels)?;
        runtime::start(py, work)
    }

    /// The cluster's read-only credential: a secret for `connect(secret=...)` that may get,
    /// list and watch but not publish or push to read-write nodes.
    #[getter]
    fn read_only_credential(&self) -> PyResult<String> {
        self.key
            .read_only_credential()
            .map_err(|e| errors::base(e.to_string()))
    }

    /// Stops the workers and the broker and removes the folder. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let running = self.lock().take();
        match running {
            Some(running) => stop(py, running),
            None => Ok(()),
        }
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_none()
    }
}

impl LocalCluster {
    /// Starts a node of this cluster.
    fn connect_work(
        &self,
        listen: Option<&str>,
        max_push_memory: Option<u64>,
        read_only: bool,
        channels: Option<&str>,
    ) -> PyResult<impl std::future::Future<Output = PyResult<NodeHandle>> + Send + 'static> {
        if self.lock().is_none() {
            return Err(errors::unavailable("the local cluster is closed".into()));
        }
        let key = match read_only {
            false => self.key.clone(),
            true => {
                let credential = self.read_only_credential()?;
                tb_node::discover::cluster_key(Some(&credential), None)
                    .map_err(|e| errors::base(e.to_string()))?
            }
        };
        let brokers = self.ticket.brokers.clone();
        node::start_work(brokers, key, listen, max_push_memory, channels)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Shuts down what `running` owns, workers first.
fn stop(py: Python<'_>, running: Running) -> PyResult<()> {
    let Running {
        broker,
        workers,
        _dir,
    } = running;
    wait(py, async move {
        for w in workers {
            w.shutdown().await;
        }
        broker.shutdown().await;
    })?;
    drop(_dir);
    Ok(())
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let Some(running) = self.lock().take() else {
            return;
        };
        if runtime::forked() {
            std::mem::forget(running);
            return;
        }
        if let Ok(rt) = runtime::runtime() {
            rt.spawn(async move {
                for w in running.workers {
                    w.shutdown().await;
                }
                running.broker.shutdown().await;
            });
        }
    }
}
