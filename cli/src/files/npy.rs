//! `.npy`, NumPy's array file: the magic `\x93NUMPY`, a version (1.0, 2.0 or 3.0), the
//! header's length (2 bytes in 1.0, 4 after), a header that is a Python dict literal such as
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }` padded with spaces to a
//! multiple of 64 bytes and ending in `\n`, then the array's bytes.
//!
//! The header's Python literal is parsed by the `py_literal` crate (what `ndarray-npy` and
//! `npyz` use) behind this tool's own limits (`pylit.rs`); the rest is here rather than taken
//! from those crates: they bring an array model of their own while this needs its own limits
//! (header size, nesting, rank, exact data length) and errors that say what to do.

use std::path::Path;

use bytes::Bytes;
use tb_node::Tensor;
use tb_proto::{DType, MAX_RANK, MetaError};

use super::{
    FileError, Format,
    pylit::{self, Lit},
};

/// What every `.npy` file starts with.
const MAGIC: &[u8] = b"\x93NUMPY";
/// Longest header read. NumPy's own reader refuses more than 10 000 bytes by default.
pub const MAX_HEADER_LEN: usize = 64 * 1024;
/// Deepest nesting of brackets in a header (structured dtypes nest lists of tuples).
const MAX_NESTING: usize = 8;
/// NumPy aligns the data to this many bytes from the start of the file.
const ALIGN: usize = 64;
/// NumPy pads the header so that the first axis can grow to this many digits in place.
const GROWTH_AXIS_MAX_DIGITS: usize = 21;
/// Where to point a user whose dtype `.npy` cannot carry.
const OTHER_FORMATS: &str = "write a .safetensors file, or a raw file (any other extension) \
     and read it back with --dtype and --shape";

/// Reads a `.npy` file of at most `max_bytes` bytes. `dtype` names the elements of an untyped
/// `V<n>` file (how NumPy saves bfloat16), may reinterpret unsigned integers as the dtypes
/// NumPy cannot name (bf16, f8e4m3, f8e5m2), and must otherwise agree with the file.
pub fn read(path: &Path, max_bytes: u64, dtype: Option<DType>) -> Result<Tensor, FileError> {
    let file = super::read_file(path, max_bytes)?;
    decode(path, file, dtype)
}

/// Writes `tensor` as a version 1.0 `.npy` file (2.0 if the header needs it), byte for byte
/// what `np.save` writes for the same array. bf16 and f8 tensors are refused: NumPy has no
/// standard type for them.
pub fn write(path: &Path, tensor: &Tensor) -> Result<(), FileError> {
    let header = header(tensor.dtype(), tensor.shape()).ok_or_else(|| {
        super::unsupported(
            path,
            format!("writing a {} tensor to .npy", tensor.dtype()),
            format!(
                "NumPy has no standard {} type: {OTHER_FORMATS}",
                tensor.dtype()
            ),
        )
    })?;
    let data = super::host_bytes(path, tensor)?;
    super::write_atomic(path, &[&header, &data])
}

/// Parses a whole `.npy` file (see [`read`]); the tensor's bytes are a slice of `file`.
pub fn decode(path: &Path, file: Bytes, dtype: Option<DType>) -> Result<Tensor, FileError> {
    let corrupt = |reason: String| super::corrupt(path, Format::Npy, reason);
    let (text, data_start) = split_header(path, &file)?;
    let lit = pylit::parse(&text, MAX_NESTING).map_err(&corrupt)?;
    let header = Header::from_lit(path, lit)?;
    let dtype = resolve_dtype(path, &header.descr, header.elem, dtype)?;
    let expected = tb_proto::byte_len_for(dtype, &header.shape).map_err(|e| match e {
        MetaError::RankTooLarge { rank } => super::unsupported(
            path,
            format!("an array of {rank} dimensions"),
            format!("at most {MAX_RANK} are allowed"),
        ),
        e => corrupt(format!("shape {:?}: {e}", header.shape)),
    })?;
    let actual = (file.len() - data_start) as u64;
    if actual != expected {
        return Err(FileError::LengthMismatch {
            path: path.to_owned(),
            dtype,
            shape: header.shape,
            expected,
            actual,
            hint: if actual < expected {
                "the file is truncated"
            } else {
                "the file has bytes after the array"
            },
        });
    }
    Tensor::new(dtype, header.shape, file.slice(data_start..))
        .map_err(|source| super::tensor_error(path, source))
}

/// The header `np.save` writes for a C-order array of `dtype` and `shape`: magic, version,
/// length and the padded dict. `None` for dtypes NumPy has no standard descr for.
pub fn header(dtype: DType, shape: &[u64]) -> Option<Vec<u8>> {
    let mut dict = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
        descr_for(dtype)?,
        py_tuple(shape)
    );
    // Recent NumPy leaves room for the first axis to grow in place. Older versions did not;
    // their padding sits at the same place, so their files differ only where this spills
    // into one more 64-byte block.
    if let Some(first) = shape.first() {
        let digits = first.to_string().len();
        dict.push_str(&" ".repeat(GROWTH_AXIS_MAX_DIGITS.saturating_sub(digits)));
    }
    // Like NumPy: version 1.0 while the length fits in 2 bytes, else 2.0; the padding is
    // 1..=64 spaces (a full 64 when already aligned), then `\n`.
    let padded_len = |prefix: usize| {
        let unpadded = prefix + dict.len() + 1;
        dict.len() + (ALIGN - unpadded % ALIGN) + 1
    };
    let v1_len = padded_len(MAGIC.len() + 2 + 2);
    let mut out = MAGIC.to_vec();
    let header_len = match u16::try_from(v1_len) {
        Ok(len) => {
            out.extend([1, 0]);
            out.extend(len.to_le_bytes());
            v1_len
        }
        Err(_) => {
            let len = padded_len(MAGIC.len() + 2 + 4);
            out.extend([2, 0]);
            out.extend(u32::try_from(len).ok()?.to_le_bytes());
            len
        }
    };
    out.extend(dict.as_bytes());
    out.resize(out.len() + header_len - dict.len() - 1, b' ');
    out.push(b'\n');
    Some(out)
}

/// The descr `np.save` writes for `dtype`, if NumPy has a standard type for it.
fn descr_for(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "|b1",
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::BF16 | DType::F8E4M3 | DType::F8E5M2 | DType::Set => return None,
    })
}

/// A shape as Python writes a tuple: `()`, `(6,)`, `(2, 3)`.
fn py_tuple(shape: &[u64]) -> String {
    match shape {
        [] => "()".to_owned(),
        [only] => format!("({only},)"),
        _ => {
            let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
            format!("({})", dims.join(", "))
        }
    }
}

/// Checks magic and version and returns the header text (decoded as the version says) and
/// where the data starts.
fn split_header(path: &Path, file: &[u8]) -> Result<(String, usize), FileError> {
    let corrupt = |reason: String| super::corrupt(path, Format::Npy, reason);
    if !file.starts_with(MAGIC) {
        return Err(corrupt(
            "it does not start with the .npy magic string \\x93NUMPY".to_owned(),
        ));
    }
    let truncated = || {
        corrupt(format!(
            "the file ends after {} bytes, inside the header",
            file.len()
        ))
    };
    let (major, minor) = match file.get(MAGIC.len()..MAGIC.len() + 2) {
        Some(&[major, minor]) => (major, minor),
        _ => return Err(truncated()),
    };
    let len_size = match (major, minor) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        _ => {
            return Err(super::unsupported(
                path,
                format!(".npy format version {major}.{minor}"),
                "this tool reads versions 1.0, 2.0 and 3.0; save with a NumPy that writes one of \
                 those",
            ));
        }
    };
    let len_at = MAGIC.len() + 2;
    let header_len = match *file.get(len_at..len_at + len_size).ok_or_else(truncated)? {
        [a, b] => usize::from(u16::from_le_bytes([a, b])),
        [a, b, c, d] => usize::try_from(u32::from_le_bytes([a, b, c, d])).unwrap_or(usize::MAX),
        _ => return Err(truncated()),
    };
    if header_len > MAX_HEADER_LEN {
        return Err(corrupt(format!(
            "its header claims {header_len} bytes, over the limit of {MAX_HEADER_LEN}"
        )));
    }
    let start = len_at + len_size;
    let bytes = file.get(start..start + header_len).ok_or_else(truncated)?;
    let text = if major == 3 {
        std::str::from_utf8(bytes)
            .map_err(|e| corrupt(format!("its version 3.0 header is not UTF-8: {e}")))?
            .to_owned()
    } else {
        // Versions 1.0 and 2.0 are Latin-1: every byte is the character of that number.
        bytes.iter().map(|&b| char::from(b)).collect()
    };
    Ok((text, start + header_len))
}

/// The element type a descr names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    /// A type this tool knows.
    Typed(DType),
    /// `V<n>`: untyped elements of n bytes; the caller must say what they are.
    Untyped(u64),
}

/// The header's three fields, checked.
#[derive(Debug)]
struct Header {
    descr: String,
    elem: Elem,
    shape: Vec<u64>,
}

impl Header {
    /// Checks the parsed header: a dict of exactly `descr`, `fortran_order` and `shape`.
    fn from_lit(path: &Path, lit: Lit) -> Result<Header, FileError> {
        let corrupt = |reason: String| super::corrupt(path, Format::Npy, reason);
        let Lit::Dict(entries) = lit else {
            return Err(corrupt("its header is not a dict".to_owned()));
        };
        let (mut descr, mut fortran_order, mut shape) = (None, None, None);
        for (key, value) in entries {
            let Lit::Str(key) = key else {
                return Err(corrupt(format!(
                    "a header key is {}, not a string",
                    key.kind()
                )));
            };
            let slot = match key.as_str() {
                "descr" => &mut descr,
                "fortran_order" => &mut fortran_order,
                "shape" => &mut shape,
                _ => {
                    return Err(corrupt(format!(
                        "unexpected header key {key:?} (a .npy header has descr, \
                         fortran_order and shape)"
                    )));
                }
            };
            if slot.replace(value).is_some() {
                return Err(corrupt(format!("its header has the key {key:?} twice")));
            }
        }
        let missing = |key: &str| corrupt(format!("its header has no {key:?} key"));
        let descr = match descr.ok_or_else(|| missing("descr"))? {
            Lit::Str(descr) => descr,
            Lit::List(_) => {
                return Err(super::unsupported(
                    path,
                    "a structured dtype (record array)".to_owned(),
                    "save each field as an array of its own",
                ));
            }
            other => {
                return Err(corrupt(format!(
                    "'descr' is {}, not a string",
                    other.kind()
                )));
            }
        };
        let elem = parse_descr(path, &descr)?;
        let shape = match shape.ok_or_else(|| missing("shape"))? {
            Lit::Tuple(dims) | Lit::List(dims) => dims,
            other => return Err(corrupt(format!("'shape' is {}, not a tuple", other.kind()))),
        };
        if shape.len() > MAX_RANK {
            return Err(super::unsupported(
                path,
                format!("an array of {} dimensions", shape.len()),
                format!("at most {MAX_RANK} are allowed"),
            ));
        }
        let shape = shape
            .into_iter()
            .map(|dim| match dim {
                Lit::Int(n) => u64::try_from(n).ok(),
                _ => None,
            })
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| {
                corrupt("'shape' holds something other than sizes from 0 to 2^64-1".to_owned())
            })?;
        match fortran_order.ok_or_else(|| missing("fortran_order"))? {
            Lit::Bool(false) => {}
            // With at most one axis longer than 1, Fortran and C order are the same bytes.
            Lit::Bool(true) if shape.iter().filter(|&&d| d > 1).count() <= 1 => {}
            Lit::Bool(true) => {
                return Err(super::unsupported(
                    path,
                    "a Fortran-order (column-major) array".to_owned(),
                    "save a C-order copy: np.save(path, np.ascontiguousarray(a))",
                ));
            }
            other => {
                return Err(corrupt(format!(
                    "'fortran_order' is {}, not a bool",
                    other.kind()
                )));
            }
        }
        Ok(Header { descr, elem, shape })
    }
}

/// Maps a descr such as `<f4` to an element type. The byte order must be little-endian
/// (`<`, or `=`, native, on the little-endian machines this runs on) for multi-byte types;
/// one-byte and untyped elements have none (`|`, though any is accepted).
fn parse_descr(path: &Path, descr: &str) -> Result<Elem, FileError> {
    let unsupported = |what: &str| {
        super::unsupported(
            path,
            format!("dtype {descr:?} ({what})"),
            "this tool reads bool, unsigned and signed integers of 1, 2, 4 and 8 bytes, \
             and floats of 2, 4 and 8 bytes",
        )
    };
    let (order, rest) = match descr.strip_prefix(['<', '>', '|', '=']) {
        Some(rest) => (descr.chars().next(), rest),
        None => (None, descr),
    };
    let mut chars = rest.chars();
    let kind = chars.next();
    let size: Option<u64> = chars.as_str().parse().ok();
    let elem = match (kind, size) {
        (Some('b'), Some(1)) => Elem::Typed(DType::Bool),
        (Some('u'), Some(1)) => Elem::Typed(DType::U8),
        (Some('u'), Some(2)) => Elem::Typed(DType::U16),
        (Some('u'), Some(4)) => Elem::Typed(DType::U32),
        (Some('u'), Some(8)) => Elem::Typed(DType::U64),
        (Some('i'), Some(1)) => Elem::Typed(DType::I8),
        (Some('i'), Some(2)) => Elem::Typed(DType::I16),
        (Some('i'), Some(4)) => Elem::Typed(DType::I32),
        (Some('i'), Some(8)) => Elem::Typed(DType::I64),
        (Some('f'), Some(2)) => Elem::Typed(DType::F16),
        (Some('f'), Some(4)) => Elem::Typed(DType::F32),
        (Some('f'), Some(8)) => Elem::Typed(DType::F64),
        (Some('V'), Some(n)) if n > 0 => Elem::Untyped(n),
        (Some('c'), _) => return Err(unsupported("complex numbers")),
        (Some('f'), _) => return Err(unsupported("a float of that size")),
        (Some('O'), _) => return Err(unsupported("Python objects")),
        (Some('S' | 'a' | 'U'), _) => return Err(unsupported("strings")),
        (Some('M' | 'm'), _) => return Err(unsupported("dates and times")),
        _ => return Err(unsupported("not a type this tool knows")),
    };
    let multi_byte = matches!(elem, Elem::Typed(d) if d.itemsize() > 1);
    match order {
        Some('>') if multi_byte => Err(super::unsupported(
            path,
            format!("big-endian data ({descr:?})"),
            "save a little-endian copy: np.save(path, a.astype(a.dtype.newbyteorder('<')))",
        )),
        Some('|') if multi_byte => Err(super::corrupt(
            path,
            Format::Npy,
            format!("descr {descr:?} gives no byte order for a multi-byte type"),
        )),
        _ => Ok(elem),
    }
}

/// The tensor's dtype: the file's, unless the caller's `given` names untyped elements or
/// reinterprets unsigned integers as a type NumPy cannot name.
fn resolve_dtype(
    path: &Path,
    descr: &str,
    elem: Elem,
    given: Option<DType>,
) -> Result<DType, FileError> {
    match (elem, given) {
        (Elem::Typed(file), None) => Ok(file),
        (Elem::Typed(file), Some(given)) if given == file => Ok(file),
        (Elem::Typed(file), Some(given))
            if matches!(file, DType::U8 | DType::U16)
                && given.itemsize() == file.itemsize()
                && descr_for(given).is_none() =>
        {
            Ok(given)
        }
        (Elem::Typed(file), Some(given)) => Err(super::mismatch(
            path,
            format!(
                "the file holds {file} data ({descr:?}) but --dtype says {given}; leave \
                 --dtype out (for .npy it only names untyped V elements, or reads u8/u16 as \
                 f8/bf16)"
            ),
        )),
        (Elem::Untyped(n), Some(given)) if given.itemsize() == n => Ok(given),
        (Elem::Untyped(n), given) => {
            let fits: Vec<&str> = DType::ALL
                .into_iter()
                .filter(|d| d.itemsize() == n)
                .map(DType::name)
                .collect();
            if fits.is_empty() {
                return Err(super::unsupported(
                    path,
                    format!("dtype {descr:?} (untyped elements of {n} bytes)"),
                    "no dtype of this tool has elements of that size",
                ));
            }
            let said = given.map_or(String::new(), |d| {
                format!(", not {d} ({} bytes)", d.itemsize())
            });
            Err(super::usage(
                path,
                format!(
                    "dtype {descr:?} holds untyped {n}-byte elements (NumPy saves bfloat16 and \
                     float8 this way); say what they are with --dtype, one of {}{said}",
                    fits.join(", ")
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests;
