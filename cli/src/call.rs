//! `tb call`: calls a function the cluster serves (tb-call) with tensor files as its
//! arguments, and prints (or writes) what it returns.
//!
//! Arguments: none is `None`; one `.npy` file is a tensor; one `.safetensors` file is a map of
//! its tensors by name; several files are a list of those, in order. A result holding
//! tensors is summarized on stdout (dtype, shape, size and the BLAKE3 of the bytes) and, with
//! `-o`, written to a file; any other result is printed as a Python-like literal.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use clap::Args;
use tb_call::{CallError, CallOptions, Calls, FailureKind, HostTensor, Value};
use tb_node::Tensor;

use crate::{
    cluster::Join,
    files::{self, Format},
    fmt::bytes,
};

/// Most bytes of a `bytes` result printed before the rest is elided.
const MAX_PRINTED_BYTES: usize = 256;

/// The key a lone tensor result is written under in a `.safetensors` file.
const RESULT_KEY: &str = "result";

/// Options of `tb call`.
#[derive(Debug, Clone, Args)]
pub struct CallArgs {
    /// The function's name (`tb ls --functions` lists those served).
    pub name: String,
    /// The arguments: none (the function gets None), one `.npy` file (a tensor), one
    /// `.safetensors` file (a map of its tensors by name), or several files (a list of
    /// those, in order).
    pub args: Vec<PathBuf>,
    /// Write the result to this file: a tensor to `.npy` (or `.safetensors`, under the key
    /// "result", or raw bytes for any other name); a map or a list of tensors to
    /// `.safetensors` (a list's tensors under the keys "0", "1", ...).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// The call may run twice: after a server is lost mid-call it is retried on another.
    #[arg(long)]
    pub idempotent: bool,
}

/// `tb call`: joins the cluster, calls the function, prints the result (writes it with -o).
pub async fn call(join: &Join, args: CallArgs) -> Result<()> {
    tb_node::proto::TensorName::new(args.name.as_str())
        .with_context(|| format!("function name {:?}", args.name))?;
    let paths = args.args.clone();
    let value = tokio::task::spawn_blocking(move || read_args(&paths))
        .await
        .context("reading the arguments")??;
    let timeout = Duration::from_secs(join.timeout.max(1));
    let node = join.node().await?;
    let started = std::time::Instant::now();
    let result = match Calls::attach(&node) {
        Ok(calls) => {
            let options = CallOptions {
                timeout: Some(timeout),
                idempotent: args.idempotent,
            };
            // Ctrl-C (or SIGTERM) drops the call: the server cancels it once this node's
            // links close, instead of running it until the link times out.
            tokio::select! {
                result = calls.call(&args.name, &value, &options) => {
                    result.map_err(|e| call_error(&args.name, e))
                }
                () = tb_daemon::wait_for_signal() => {
                    Err(anyhow::anyhow!("interrupted: the call to {:?} was cancelled", args.name))
                }
            }
        }
        Err(e) => Err(anyhow::Error::new(e).context("attaching remote calls to the node")),
    };
    let seconds = started.elapsed().as_secs_f64();
    crate::cluster::close(&node).await;
    // A device tensor in the result (a server's, pulled onto this node's GPU) is written
    // out from host memory.
    let result = result?;
    let result = tokio::task::block_in_place(|| result.into_host())?;
    report(&args, result, seconds).await
}

/// The call's arguments from the files named.
fn read_args(paths: &[PathBuf]) -> Result<Value> {
    match paths {
        [] => Ok(Value::None),
        [one] => read_arg(one),
        many => Ok(Value::List(
            many.iter().map(|p| read_arg(p)).collect::<Result<_>>()?,
        )),
    }
}

/// One argument file: a `.npy` file's tensor, or a `.safetensors` file's tensors as a map.
fn read_arg(path: &Path) -> Result<Value> {
    let max = tb_node::DEFAULT_MAX_TENSOR_BYTES;
    match Format::of(path) {
        Format::Npy => {
            let tensor = files::read(path, &files::ReadOptions::new(max))?;
            Ok(Value::Tensor(host_tensor(path, &tensor)?))
        }
        Format::Safetensors => {
            let file = files::read_safetensors_set(path, max)?;
            let map = file
                .tensors
                .iter()
                .map(|(key, t)| Ok((key.clone(), Value::Tensor(host_tensor(path, t)?))))
                .collect::<Result<_>>()?;
            Ok(Value::Map(map))
        }
        Format::Raw => bail!(
            "{}: tb call takes .npy and .safetensors files as arguments (their names must end \
             so)",
            path.display()
        ),
    }
}

fn host_tensor(path: &Path, tensor: &Tensor) -> Result<HostTensor> {
    let data = tensor
        .host_data()
        .with_context(|| format!("{}: the tensor is not in host memory", path.display()))?;
    HostTensor::new(tensor.dtype(), tensor.shape().to_vec(), data.clone())
        .with_context(|| format!("{} as a call argument", path.display()))
}

/// A clear message for a failed call.
fn call_error(function: &str, e: CallError) -> anyhow::Error {
    match e {
        CallError::Remote {
            server, failure, ..
        } => {
            let what = match failure.kind {
                FailureKind::Raised => "raised",
                FailureKind::DeadlineExceeded => "ran past its deadline:",
                FailureKind::BadArguments => "refused its arguments:",
                FailureKind::Stopped => "was stopped:",
            };
            let mut msg = format!(
                "function {function:?} {what} {} on server {server}: {}",
                failure.remote_type, failure.message
            );
            let traceback = failure.traceback.trim_end();
            if !traceback.is_empty() {
                let _ = write!(msg, "\nremote traceback:\n{traceback}");
            }
            anyhow::anyhow!(msg)
        }
        CallError::Overloaded { detail, .. } => {
            // The server's refusal names the function already.
            let here = format!("function \"{function}\" is overloaded here: ");
            let detail = detail.strip_prefix(&here).unwrap_or(&detail);
            anyhow::anyhow!(
                "function {function:?} is overloaded: every server tried refused the call (the \
                 last: {detail}); try again later"
            )
        }
        CallError::NoServer { .. } => anyhow::anyhow!(
            "no live node serves function {function:?} (`tb ls --functions` lists those served)"
        ),
        CallError::Timeout { timeout, .. } => anyhow::anyhow!(
            "function {function:?}: no result within {} s (--timeout sets how long to wait)",
            timeout.as_secs()
        ),
        other => anyhow::Error::new(other).context(format!("calling {function:?}")),
    }
}

/// Prints the result, writing it to `-o` when asked.
async fn report(args: &CallArgs, result: Value, seconds: f64) -> Result<()> {
    let took = format!("in {seconds:.3} s");
    let out = args.output.as_deref();
    if let Value::Tensor(t) = &result {
        let written = match out {
            Some(path) => {
                let (tensor, to) = (node_tensor(t)?, path.to_owned());
                let format =
                    tokio::task::spawn_blocking(move || files::write(&to, &tensor, RESULT_KEY))
                        .await
                        .context("writing the result")??;
                format!(" -> {} ({format})", path.display())
            }
            None => String::new(),
        };
        println!("{} {took}{written}", summary(t));
        return Ok(());
    }
    let Some(members) = tensor_members(&result) else {
        println!("{}", render(&result));
        return match out {
            Some(path) => bail!(
                "-o {}: the result is {}, not tensors; nothing was written",
                path.display(),
                kind_of(&result)
            ),
            None => Ok(()),
        };
    };
    let kind = if matches!(result, Value::Map(_)) {
        "map"
    } else {
        "list"
    };
    let total: u64 = members.iter().map(|(_, t)| t.data.len() as u64).sum();
    let written = match out {
        Some(path) => {
            write_members(path, &members, kind).await?;
            format!(" -> {} (.safetensors)", path.display())
        }
        None => String::new(),
    };
    println!(
        "{kind} of {} tensors ({}) {took}{written}",
        members.len(),
        bytes(total)
    );
    for (key, t) in &members {
        println!("  {key}: {}", summary(t));
    }
    Ok(())
}

/// A map's or list's members when there are some and every one is a tensor (keys: the
/// map's, or "0", "1", ...).
fn tensor_members(value: &Value) -> Option<Vec<(String, &HostTensor)>> {
    let members: Option<Vec<_>> = match value {
        Value::Map(items) => items
            .iter()
            .map(|(k, v)| Some((k.clone(), v.as_tensor()?)))
            .collect(),
        Value::List(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| Some((i.to_string(), v.as_tensor()?)))
            .collect(),
        _ => None,
    };
    members.filter(|m| !m.is_empty())
}

async fn write_members(path: &Path, members: &[(String, &HostTensor)], kind: &str) -> Result<()> {
    if Format::of(path) != Format::Safetensors {
        bail!(
            "-o {}: the result is a {kind} of {} tensors; write it to a .safetensors file",
            path.display(),
            members.len()
        );
    }
    let tensors = members
        .iter()
        .map(|(k, t)| Ok((k.clone(), node_tensor(t)?)))
        .collect::<Result<Vec<_>>>()?;
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        files::write_safetensors_set(&path, &tensors, &Default::default())
    })
    .await
    .context("writing the result")??;
    Ok(())
}

fn node_tensor(t: &HostTensor) -> Result<Tensor> {
    Tensor::new(t.dtype, t.shape.clone(), t.data.clone()).context("the result's tensor")
}

/// `f32 [2, 3] 24 B blake3:<hex>`.
fn summary(t: &HostTensor) -> String {
    format!(
        "{} {:?} {} blake3:{}",
        t.dtype.name(),
        t.shape,
        bytes(t.data.len() as u64),
        blake3::hash(&t.data).to_hex()
    )
}

/// What kind of value, for messages.
fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) => "a str",
        Value::Bytes(_) => "bytes",
        Value::List(items) if items.is_empty() => "an empty list",
        Value::Map(items) if items.is_empty() => "an empty map",
        Value::List(_) => "a list holding more than tensors",
        Value::Map(_) => "a map holding more than tensors",
        Value::Tensor(_) => "a tensor",
        Value::Device(_) => "a device tensor",
        Value::Named { .. } => "a tensor by name",
    }
}

/// A value as a Python-like literal; tensors as `<tensor f32 [3] 12 B blake3:...>`.
pub fn render(value: &Value) -> String {
    let mut out = String::new();
    render_into(value, &mut out);
    out
}

fn render_into(value: &Value, out: &mut String) {
    match value {
        Value::None => out.push_str("None"),
        Value::Named { name, version } => {
            let _ = match version {
                Some(v) => write!(out, "tb.Ref({:?}, {v})", name.as_str()),
                None => write!(out, "tb.Ref({:?})", name.as_str()),
            };
        }
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        Value::Int(i) => {
            let _ = write!(out, "{i}");
        }
        Value::Float(f) => {
            let _ = write!(out, "{f:?}");
        }
        Value::Str(s) => {
            let _ = write!(out, "{s:?}");
        }
        Value::Bytes(b) => {
            out.push_str("b\"");
            for &byte in b.iter().take(MAX_PRINTED_BYTES) {
                match byte {
                    b'"' | b'\\' => {
                        out.push('\\');
                        out.push(byte as char);
                    }
                    0x20..=0x7e => out.push(byte as char),
                    _ => {
                        let _ = write!(out, "\\x{byte:02x}");
                    }
                }
            }
            out.push('"');
            if b.len() > MAX_PRINTED_BYTES {
                let _ = write!(out, "... ({} bytes)", b.len());
            }
        }
        Value::List(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                render_into(v, out);
            }
            out.push(']');
        }
        Value::Map(items) => {
            out.push('{');
            for (i, (k, v)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                let _ = write!(out, "{k:?}: ");
                render_into(v, out);
            }
            out.push('}');
        }
        Value::Tensor(t) => {
            let _ = write!(out, "<tensor {}>", summary(t));
        }
        Value::Device(t) => {
            let (dtype, shape, device) = (t.dtype().name(), t.shape(), t.ordinal());
            let _ = write!(out, "<tensor {dtype} {shape:?} on cuda:{device}>");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tb_node::DType;

    fn t(values: &[f32]) -> Value {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Value::Tensor(HostTensor::new(DType::F32, vec![values.len() as u64], data).expect("t"))
    }

    #[test]
    fn plain_values_render_as_python_literals() {
        let v = Value::Map(vec![
            ("a".into(), Value::Int(3)),
            (
                "b".into(),
                Value::List(vec![Value::Bool(true), Value::None]),
            ),
            ("c".into(), Value::Str("x\"y".into())),
            ("d".into(), Value::Bytes(b"ok\x00\\".to_vec())),
            ("e".into(), Value::Float(1.5)),
        ]);
        assert_eq!(
            render(&v),
            r#"{"a": 3, "b": [True, None], "c": "x\"y", "d": b"ok\x00\\", "e": 1.5}"#
        );
        let long = render(&Value::Bytes(vec![b'a'; 300]));
        assert!(long.ends_with("\"... (300 bytes)"), "{long}");
    }

    #[test]
    fn tensors_render_with_dtype_shape_size_and_hash() {
        let v = t(&[1.0, 2.0]);
        let Value::Tensor(inner) = &v else {
            unreachable!()
        };
        let hash = blake3::hash(&inner.data).to_hex().to_string();
        assert_eq!(
            render(&Value::List(vec![v.clone()])),
            format!("[<tensor f32 [2] 8 B blake3:{hash}>]")
        );
        let list = Value::List(vec![v.clone(), v.clone()]);
        let members = tensor_members(&list).expect("all tensors");
        assert_eq!(members.len(), 2);
        assert_eq!(members[1].0, "1");
        assert!(tensor_members(&Value::List(vec![v, Value::Int(1)])).is_none());
    }

    #[test]
    fn arguments_from_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(read_args(&[]).expect("none"), Value::None);
        let raw = dir.path().join("x.bin");
        std::fs::write(&raw, [0u8; 4]).expect("write");
        let err = read_args(std::slice::from_ref(&raw)).expect_err("raw refused");
        assert!(err.to_string().contains(".npy and .safetensors"), "{err}");

        let tensor = Tensor::new(DType::F32, vec![2], vec![0u8; 8]).expect("tensor");
        let npy = dir.path().join("x.npy");
        files::write(&npy, &tensor, "x").expect("npy");
        let one = read_args(std::slice::from_ref(&npy)).expect("one");
        assert_eq!(
            one.as_tensor().map(|t| t.shape.clone()),
            Some(vec![2]),
            "{one:?}"
        );
        let st = dir.path().join("m.safetensors");
        files::write_safetensors_set(
            &st,
            &[("w".into(), tensor.clone()), ("b".into(), tensor)],
            &Default::default(),
        )
        .expect("safetensors");
        let both = read_args(&[npy, st]).expect("two");
        let Value::List(items) = both else {
            panic!("a list: {both:?}")
        };
        assert!(items[0].as_tensor().is_some());
        let Value::Map(map) = &items[1] else {
            panic!("a map: {:?}", items[1])
        };
        let mut keys: Vec<&str> = map.iter().map(|(k, _)| k.as_str()).collect();
        keys.sort();
        assert_eq!(keys, ["b", "w"]);
    }
}
