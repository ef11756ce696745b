//! `tb_node::Error` as the package's exceptions (defined in Python, in
//! `tensor_broker/_errors.py`, so they carry docstrings and base classes such as
//! `TimeoutError`): `NotFound`, `Unauthorized`, `Timeout`, `Unavailable`, `InvalidArgument`,
//! all `TensorBrokerError`s.

use pyo3::{exceptions::PyRuntimeError, prelude::*, sync::PyOnceLock, types::PyType};
use tb_node::{Error, proto::ErrorCode};

/// The module the exception classes live in.
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// An exception of class `class` (a name in `tensor_broker._errors`) with `message`.
fn raise(class: &'static str, message: String) -> PyErr {
    Python::attach(|py| {
        let module = ERRORS.get_or_try_init(py, || {
            PyModule::import(py, "tensor_broker._errors").map(Bound::unbind)
        });
        let ty = module.and_then(|m| {
            m.bind(py)
                .getattr(class)?
                .cast_into::<PyType>()
                .map_err(PyErr::from)
        });
        match ty {
            Ok(ty) => PyErr::from_type(ty, message),
            Err(_) => PyRuntimeError::new_err(message),
        }
    })
}

/// A plain `TensorBrokerError`.
pub(crate) fn base(message: String) -> PyErr {
    raise("TensorBrokerError", message)
}

/// `Unavailable`.
pub(crate) fn unavailable(message: String) -> PyErr {
    raise("Unavailable", message)
}

/// `InvalidArgument` (also a `ValueError`).
pub(crate) fn invalid(message: String) -> PyErr {
    raise("InvalidArgument", message)
}

/// The error of a call made in a process forked from the one that started the runtime.
pub(crate) fn forked(parent: u32) -> PyErr {
    base(format!(
        "tensor_broker was started in process {parent} and this is its fork (pid {}): the \
         runtime's threads do not survive fork(). Connect in the child itself, or use \
         multiprocessing's 'spawn' start method",
        std::process::id()
    ))
}

/// The exception a node error is.
pub(crate) fn to_py(e: Error) -> PyErr {
    let class = match &e {
        Error::NotFound { .. } => "NotFound",
        Error::Timeout { .. } => "Timeout",
        Error::Unauthorized(_) => "Unauthorized",
        Error::Remote { code, .. } => match code {
            ErrorCode::NotFound => "NotFound",
            ErrorCode::Unauthorized => "Unauthorized",
            ErrorCode::Busy | ErrorCode::ShuttingDown => "Unavailable",
            ErrorCode::TooLarge | ErrorCode::InvalidTensor => "InvalidArgument",
            _ => "TensorBrokerError",
        },
        Error::PeerUnreachable { .. }
        | Error::NoBroker { .. }
        | Error::NoHolder { .. }
        | Error::TooManyConnections { .. }
        | Error::Busy(_)
        | Error::SourceAborted(_)
        | Error::Shutdown
        | Error::Standalone
        | Error::DeviceUnavailable(_) => "Unavailable",
        Error::InvalidName(_)
        | Error::InUse(_)
        | Error::InvalidTensor(_)
        | Error::TooLarge(_)
        | Error::BadAddress { .. } => "InvalidArgument",
        _ => "TensorBrokerError",
    };
    raise(class, e.to_string())
}
