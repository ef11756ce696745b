//! # tensor_broker._native: the Rust core of the Python package
//!
//! A thin PyO3 layer over `tb-node`'s client API; the Python modules in
//! `py_src/tensor_broker` turn its buffers into numpy arrays and torch tensors (as
//! safetensors' bindings do). It holds no logic the Rust crates do not already have.
//!
//! - `runtime`: the process's one tokio runtime; waits release the GIL and check signals in
//!   short slices (Ctrl-C interrupts); a forked child gets a clear error, not a hang.
//! - `node`: [`node::NodeHandle`], the embedded node a `Client` drives (put, get, get_into,
//!   ls, status, subscribe, close), and `Entry` rows of `ls`.
//! - `buffer`: [`buffer::Buffer`], received bytes lent read-only to numpy (buffer protocol)
//!   and torch (DLPack), never copied.
//! - `array`: reading and writing numpy arrays' bytes (checked contiguous).
//! - `subscription`: versions of matching names as `Event`s, skips folded in.
//! - `calls`: remote functions (serve Python callables, call by name), Python values to and
//!   from `tb_call::Value`.
//! - `handlers`: the threads Python handlers run on, the one that went idle last first.
//! - `stream`: `tb_call::Pipeline`s (data-loading streams) built and read from Python.
//! - `cluster`: [`cluster::LocalCluster`], a broker (and workers) in this process.
//! - `errors`: `tb_node::Error` as the package's exception classes.

mod array;
mod buffer;
mod calls;
mod cluster;
mod errors;
mod handlers;
mod node;
mod runtime;
mod stream;
mod subscription;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<node::NodeHandle>()?;
    m.add_class::<node::Entry>()?;
    m.add_class::<node::Pushed>()?;
    m.add_class::<buffer::Buffer>()?;
    m.add_class::<buffer::PrivateOwner>()?;
    m.add_class::<subscription::Subscription>()?;
    m.add_class::<subscription::Event>()?;
    m.add_class::<cluster::LocalCluster>()?;
    m.add_class::<calls::CallsHandle>()?;
    m.add_class::<calls::ServingHandle>()?;
    m.add_class::<calls::CallStreamHandle>()?;
    m.add_class::<calls::InputIter>()?;
    m.add_class::<calls::TensorArg>()?;
    m.add_class::<calls::CudaArg>()?;
    m.add_class::<calls::RefArg>()?;
    m.add_class::<calls::TensorOut>()?;
    m.add_class::<calls::CancelFlag>()?;
    m.add_class::<stream::StreamHandle>()?;
    m.add_class::<runtime::LoopWaker>()?;
    m.add_class::<runtime::CallFuture>()?;
    m.add("CUDA_COMPILED", tb_node::CUDA_COMPILED)?;
    // Idle handler threads must not take the GIL once the interpreter exits (`handlers`).
    let at_exit = wrap_pyfunction!(handlers::at_exit, m)?;
    m.py()
        .import("atexit")?
        .call_method1("register", (at_exit,))?;
    Ok(())
}
