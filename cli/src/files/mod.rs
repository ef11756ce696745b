//! Tensor files for `tb put` and `tb get`: `.npy`, `.safetensors` and raw bytes.
//!
//! The extension picks the format ([`Format::of`]): `.npy` and `.safetensors` files carry
//! their dtype and shape; any other file is raw C-order bytes whose dtype and shape the user
//! gives (`--dtype`, `--shape`, parsed by [`parse_shape`]). Readers refuse a file larger than
//! their `max_bytes` before reading it, check every length against dtype and shape, and answer
//! any malformed input with a [`FileError`] that names the file, never with a panic. Writers
//! write a temporary file beside the target and rename it into place, so a failed write never
//! leaves a half-written file under the target's name.

mod npy;
mod pylit;
mod safetensors;

pub use safetensors::{read_all as read_safetensors_set, write_all as write_safetensors_set};

use std::{
    fmt,
    fs::File,
    io::{self, Read, Write},
    path::{Path, PathBuf},
};

use bytes::Bytes;
use tb_node::{Device, Tensor};
use tb_proto::{DType, MAX_RANK};

/// Most tensor names an error lists before it says "and N more".
const MAX_LISTED_NAMES: usize = 20;

/// How a tensor file is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// NumPy's `.npy`: a Python-literal header with dtype and shape, then the bytes.
    Npy,
    /// Hugging Face's `.safetensors`: a JSON header naming one or more tensors, then the bytes.
    Safetensors,
    /// Bare C-order bytes; dtype and shape come from the user.
    Raw,
}

impl Format {
    /// The format a path's extension names (any case): `.npy`, `.safetensors`, else raw.
    pub fn of(path: &Path) -> Format {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ext.eq_ignore_ascii_case("npy") {
            Format::Npy
        } else if ext.eq_ignore_ascii_case("safetensors") {
            Format::Safetensors
        } else {
            Format::Raw
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Npy => ".npy",
            Format::Safetensors => ".safetensors",
            Format::Raw => "raw",
        })
    }
}

/// Everything that can go wrong reading or writing a tensor file. Each message names the file,
/// says what is wrong and, where there is one, what to do.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be opened, read or written.
    #[error("cannot {action} {}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done (`open`, `read`, `write`).
        action: &'static str,
        /// What the system said.
        source: io::Error,
    },
    /// The file is larger than the caller's limit; it was not read.
    #[error("{} is {len} bytes, over the limit of {max} bytes; it was not read", .path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The file is not a well-formed file of its format.
    #[error("{} is not a valid {format} file: {reason}", .path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The format its extension names.
        format: Format,
        /// What is wrong, and where.
        reason: String,
    },
    /// A well-formed file (or a tensor) holding something this tool does not handle.
    #[error("{}: {what} is not supported; {hint}", .path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What is not supported.
        what: String,
        /// What to do instead.
        hint: String,
    },
    /// The data is shorter or longer than dtype and shape need.
    #[error(
        "{}: a {dtype} tensor of shape {shape:?} needs {expected} bytes of data, the file holds {actual}; {hint}",
        .path.display()
    )]
    LengthMismatch {
        /// The file.
        path: PathBuf,
        /// The element type.
        dtype: DType,
        /// The shape.
        shape: Vec<u64>,
        /// `product(shape) * itemsize`.
        expected: u64,
        /// Bytes of data in the file.
        actual: u64,
        /// The likely cause, or what to check.
        hint: &'static str,
    },
    /// The caller's `--dtype` or `--shape` disagrees with the file.
    #[error("{}: {what}", .path.display())]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What disagrees with what.
        what: String,
    },
    /// The file needs an option the caller did not give, or was given one that does not apply.
    #[error("{}: {what}", .path.display())]
    Usage {
        /// The file.
        path: PathBuf,
        /// What is missing or does not apply.
        what: String,
    },
    /// A `.safetensors` file holds several tensors and the caller named none.
    #[error(
        "{} holds {} tensors; choose one with --key: {}",
        .path.display(), .names.len(), list_names(.names)
    )]
    NeedsKey {
        /// The file.
        path: PathBuf,
        /// The tensors it holds, sorted.
        names: Vec<String>,
    },
    /// A `.safetensors` file holds no tensor under the key the caller named.
    #[error("{} holds no tensor {key:?}; it holds: {}", .path.display(), list_names(.names))]
    NoSuchKey {
        /// The file.
        path: PathBuf,
        /// The key asked for.
        key: String,
        /// The tensors it holds, sorted.
        names: Vec<String>,
    },
    /// A `.safetensors` file with no tensors in it.
    #[error("{} holds no tensors", .path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// A `--shape` argument that does not parse.
    #[error(
        "bad shape {input:?}: {reason} (expected dimensions like 2,3,4 or 2x3x4, or [] for a scalar)"
    )]
    BadShape {
        /// What the user gave (at most 64 characters of it).
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The tensor could not be made from the file's bytes, or copied to host memory to write.
    #[error("{}: {source}", .path.display())]
    Tensor {
        /// The file.
        path: PathBuf,
        /// What the node said.
        source: tb_node::Error,
    },
}

/// `a, b, c` for at most [`MAX_LISTED_NAMES`] names, then `and N more`.
fn list_names(names: &[String]) -> String {
    let mut out = names
        .iter()
        .take(MAX_LISTED_NAMES)
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX_LISTED_NAMES {
        out.push_str(&format!(" and {} more", names.len() - MAX_LISTED_NAMES));
    }
    out
}

/// What [`read`] needs besides the path.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// Largest file read, in bytes; a larger one is refused before it is read.
    pub max_bytes: u64,
    /// The tensor to take from a `.safetensors` file that holds several (`--key`).
    pub key: Option<String>,
    /// The element type (`--dtype`): required for raw files and for `.npy` files of untyped
    /// `V<n>` elements (how NumPy saves bfloat16); elsewhere it must agree with the file.
    pub dtype: Option<DType>,
    /// The shape (`--shape`): required for raw files; elsewhere it must agree with the file.
    pub shape: Option<Vec<u64>>,
}

impl ReadOptions {
    /// No key, dtype or shape; files up to `max_bytes`.
    pub fn new(max_bytes: u64) -> Self {
        ReadOptions {
            max_bytes,
            key: None,
            dtype: None,
            shape: None,
        }
    }
}

/// Reads one tensor from `path`, in the format its extension names ([`Format::of`]).
pub fn read(path: &Path, opts: &ReadOptions) -> Result<Tensor, FileError> {
    let format = Format::of(path);
    if opts.key.is_some() && format != Format::Safetensors {
        return Err(usage(
            path,
            format!("--key applies to .safetensors files only, this is a {format} file"),
        ));
    }
    let tensor = match format {
        Format::Npy => npy::read(path, opts.max_bytes, opts.dtype)?,
        Format::Safetensors => safetensors::read(path, opts.max_bytes, opts.key.as_deref())?,
        Format::Raw => {
            let (Some(dtype), Some(shape)) = (opts.dtype, opts.shape.as_deref()) else {
                return Err(usage(
                    path,
                    "a file named neither .npy nor .safetensors is read as raw bytes, which \
                     needs --dtype and --shape"
                        .to_owned(),
                ));
            };
            return read_raw(path, opts.max_bytes, dtype, shape);
        }
    };
    if let Some(dtype) = opts.dtype.filter(|&d| d != tensor.dtype()) {
        return Err(mismatch(
            path,
            format!(
                "the file holds {} data but --dtype says {dtype}",
                tensor.dtype()
            ),
        ));
    }
    if let Some(shape) = opts.shape.as_deref().filter(|&s| s != tensor.shape()) {
        return Err(mismatch(
            path,
            format!(
                "the file holds a tensor of shape {:?} but --shape says {shape:?}",
                tensor.shape()
            ),
        ));
    }
    Ok(tensor)
}

/// Writes `tensor` to `path` in the format its extension names, replacing any file there;
/// `key` names it inside a `.safetensors` file. A tensor on a GPU is copied to host memory
/// first. Returns the format written.
pub fn write(path: &Path, tensor: &Tensor, key: &str) -> Result<Format, FileError> {
    let format = Format::of(path);
    if tensor.dtype() == DType::Set {
        return Err(usage(
            path,
            format!("{key:?} is a set of tensors; write it to a .safetensors file"),
        ));
    }
    match format {
        Format::Npy => npy::write(path, tensor)?,
        Format::Safetensors => safetensors::write(path, tensor, key)?,
        Format::Raw => write_raw(path, tensor)?,
    }
    Ok(format)
}

/// Reads a raw file: its bytes are the tensor's, C-order, and its length must be exactly
/// `product(shape) * itemsize` (checked before reading).
pub fn read_raw(
    path: &Path,
    max_bytes: u64,
    dtype: DType,
    shape: &[u64],
) -> Result<Tensor, FileError> {
    let expected = tb_proto::byte_len_for(dtype, shape)
        .map_err(|e| usage(path, format!("--dtype {dtype} with --shape {shape:?}: {e}")))?;
    let (file, len) = open_sized(path, max_bytes)?;
    let length_mismatch = |actual| FileError::LengthMismatch {
        path: path.to_owned(),
        dtype,
        shape: shape.to_vec(),
        expected,
        actual,
        hint: "check --dtype and --shape",
    };
    if len != expected {
        return Err(length_mismatch(len));
    }
    let data = read_opened(path, file, len, max_bytes)?;
    if data.len() as u64 != expected {
        return Err(length_mismatch(data.len() as u64));
    }
    Tensor::new(dtype, shape.to_vec(), data).map_err(|source| tensor_error(path, source))
}

/// Writes the tensor's bytes, C-order, with nothing around them.
pub fn write_raw(path: &Path, tensor: &Tensor) -> Result<(), FileError> {
    let data = host_bytes(path, tensor)?;
    write_atomic(path, &[&data])
}

/// Parses `--shape`: `2,3,4`, `2x3x4`, optionally in `[]` or `()`; empty, `[]` or `()` is a
/// scalar. At most [`MAX_RANK`] dimensions.
pub fn parse_shape(input: &str) -> Result<Vec<u64>, FileError> {
    let bad = |reason: String| FileError::BadShape {
        input: input.chars().take(64).collect(),
        reason,
    };
    let mut s = input.trim();
    for (open, close) in [('[', ']'), ('(', ')')] {
        if let Some(inner) = s.strip_prefix(open) {
            s = inner
                .strip_suffix(close)
                .ok_or_else(|| bad(format!("'{open}' without a closing '{close}'")))?
                .trim();
            break;
        }
    }
    if s.is_empty() {
        return Ok(Vec::new());
    }
    let parts: Vec<&str> = match (s.contains(','), s.contains(['x', 'X'])) {
        (true, true) => return Err(bad("it mixes ',' and 'x' separators".to_owned())),
        (false, true) => s.split(['x', 'X']).collect(),
        // A trailing comma is fine, as in Python's `(6,)`.
        _ => s.strip_suffix(',').unwrap_or(s).split(',').collect(),
    };
    if parts.len() > MAX_RANK {
        return Err(bad(format!(
            "{} dimensions, over the limit of {MAX_RANK}",
            parts.len()
        )));
    }
    parts
        .iter()
        .enumerate()
        .map(|(i, part)| {
            let part = part.trim();
            if part.is_empty() {
                return Err(bad(format!("dimension {} is empty", i + 1)));
            }
            part.parse::<u64>()
                .map_err(|e| bad(format!("dimension {} ({part:?}) is not a size: {e}", i + 1)))
        })
        .collect()
}

/// Opens `path` and checks its size against `max_bytes` before anything is read.
fn open_sized(path: &Path, max_bytes: u64) -> Result<(File, u64), FileError> {
    let file = File::open(path).map_err(|e| io_error(path, "open", e))?;
    let len = file
        .metadata()
        .map_err(|e| io_error(path, "read", e))?
        .len();
    if len > max_bytes {
        return Err(FileError::TooLarge {
            path: path.to_owned(),
            len,
            max: max_bytes,
        });
    }
    Ok((file, len))
}

/// Reads all of a file opened by [`open_sized`], never more than `max_bytes` (it may have
/// grown since, or be a device whose size reads 0).
fn read_opened(path: &Path, file: File, len: u64, max_bytes: u64) -> Result<Bytes, FileError> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(usize::try_from(len).unwrap_or(usize::MAX))
        .map_err(|e| io_error(path, "read", io::Error::new(io::ErrorKind::OutOfMemory, e)))?;
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|e| io_error(path, "read", e))?;
    if buf.len() as u64 > max_bytes {
        return Err(FileError::TooLarge {
            path: path.to_owned(),
            len: buf.len() as u64,
            max: max_bytes,
        });
    }
    Ok(Bytes::from(buf))
}

/// Reads a whole file of at most `max_bytes`.
fn read_file(path: &Path, max_bytes: u64) -> Result<Bytes, FileError> {
    let (file, len) = open_sized(path, max_bytes)?;
    read_opened(path, file, len, max_bytes)
}

/// Writes `parts` one after another to a temporary file beside `path`, then renames it to
/// `path`: readers of `path` see the old file or the whole new one, never a part.
fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<(), FileError> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(".tb-").suffix(".partial");
    // tempfile makes owner-only files by default; ask for what `File::create` gives (the
    // umask still applies), since this one becomes the user's output file.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder
        .tempfile_in(dir)
        .map_err(|e| io_error(path, "create a temporary file beside", e))?;
    for part in parts {
        tmp.write_all(part)
            .map_err(|e| io_error(path, "write", e))?;
    }
    tmp.as_file()
        .sync_all()
        .map_err(|e| io_error(path, "write", e))?;
    tmp.persist(path)
        .map_err(|e| io_error(path, "write", e.error))?;
    Ok(())
}

/// The tensor's bytes in host memory, copied from its GPU if it is on one.
fn host_bytes(path: &Path, tensor: &Tensor) -> Result<Bytes, FileError> {
    if let Some(data) = tensor.host_data() {
        return Ok(data.clone());
    }
    let host = tensor
        .to_device(Device::Host)
        .map_err(|source| tensor_error(path, source))?;
    Ok(host.data().clone())
}

fn io_error(path: &Path, action: &'static str, source: io::Error) -> FileError {
    FileError::Io {
        path: path.to_owned(),
        action,
        source,
    }
}

fn corrupt(path: &Path, format: Format, reason: String) -> FileError {
    FileError::Corrupt {
        path: path.to_owned(),
        format,
        reason,
    }
}

fn unsupported(path: &Path, what: String, hint: impl Into<String>) -> FileError {
    FileError::Unsupported {
        path: path.to_owned(),
        what,
        hint: hint.into(),
    }
}

fn mismatch(path: &Path, what: String) -> FileError {
    FileError::Mismatch {
        path: path.to_owned(),
        what,
    }
}

fn usage(path: &Path, what: String) -> FileError {
    FileError::Usage {
        path: path.to_owned(),
        what,
    }
}

fn tensor_error(path: &Path, source: tb_node::Error) -> FileError {
    FileError::Tensor {
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests;
