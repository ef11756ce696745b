//! `.npy`, NumPy's array file: the magic `\x93NUMPY`, a version (1.0, 2.0 or 3.0), the
//! header's length (2 bytes in 1.0, 4 after), a header that is a Python dict literal such as
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }` padded with spaces to a
//! multiple of 64 bytes and ending in `\n`, then the array's bytes.
//!
//! The header parser is written here rather than taken from a crate: it is a few Python
//! literals under three known keys, and the crates that read `.npy` (`npyz`, `ndarray-npy`)
//! bring an array model of their own while this needs its own limits (header size, nesting,
//! rank, exact data length) and errors that say what to do.

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
const OTHER_FORMATS: &str = "write a .safetensors file, or a raw file (any other extension) and read \
     it back with --dtype and --shape";

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
    // NumPy >= 1.24 leaves room for the first axis to grow in place; older versions did not,
    // but since the padding goes at the same place the bytes match until the header crosses
    // a 64-byte boundary.
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
        DType::BF16 | DType::F8E4M3 | DType::F8E5M2 => return None,
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
                "this tool reads versions 1.0, 2.0 and 3.0; save with a NumPy that writes one of those",
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
mod tests {
    use std::{fs, process::Command};

    use proptest::prelude::*;

    use super::*;
    use crate::files::tests::{SHAPES, sample};

    fn path() -> &'static Path {
        Path::new("t.npy")
    }

    /// A `.npy` file with `dict` as its header (version 1.0, padded like NumPy) and `data`.
    fn npy_with(dict: &str, data: &[u8]) -> Bytes {
        let pad = ALIGN - (MAGIC.len() + 4 + dict.len() + 1) % ALIGN;
        let len = u16::try_from(dict.len() + pad + 1).expect("short header");
        let mut out = MAGIC.to_vec();
        out.extend([1, 0]);
        out.extend(len.to_le_bytes());
        out.extend(dict.as_bytes());
        out.extend(std::iter::repeat_n(b' ', pad));
        out.push(b'\n');
        out.extend(data);
        Bytes::from(out)
    }

    fn decode_dict(dict: &str, data: &[u8]) -> Result<Tensor, FileError> {
        decode(path(), npy_with(dict, data), None)
    }

    /// `np.save(f, np.arange(6, dtype='<f4').reshape(2, 3))`: 10 bytes of magic, version and
    /// header length (118), the dict, 58 spaces and `\n` (128 in all), then 0.0..=5.0.
    fn arange_2x3_f32() -> Vec<u8> {
        [
            &b"\x93NUMPY\x01\x00\x76\x00"[..],
            b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            &[b' '; 58],
            b"\n",
            &[0, 0, 0, 0, 0, 0, 0x80, 0x3f, 0, 0, 0, 0x40],
            &[0, 0, 0x40, 0x40, 0, 0, 0x80, 0x40, 0, 0, 0xa0, 0x40],
        ]
        .concat()
    }

    fn arange_f32(shape: &[u64]) -> Tensor {
        let data: Vec<u8> = (0u8..6).flat_map(|i| f32::from(i).to_le_bytes()).collect();
        Tensor::new(DType::F32, shape.to_vec(), data).expect("tensor")
    }

    #[test]
    fn golden_numpy_file_reads_and_writes_byte_for_byte() {
        let golden = arange_2x3_f32();
        assert_eq!(golden.len(), 128 + 24);
        let tensor = decode(path(), Bytes::from(golden.clone()), None).expect("decode");
        assert_eq!(tensor, arange_f32(&[2, 3]));
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("a.npy");
        write(&file, &tensor).expect("write");
        assert_eq!(fs::read(&file).expect("read"), golden);
    }

    #[test]
    fn headers_match_numpy_for_a_scalar_and_a_long_first_axis() {
        // np.save(f, np.float64(1.5))
        let scalar = [
            &b"\x93NUMPY\x01\x00\x76\x00"[..],
            b"{'descr': '<f8', 'fortran_order': False, 'shape': (), }",
            &[b' '; 62],
            b"\n",
        ]
        .concat();
        assert_eq!(header(DType::F64, &[]).expect("f64"), scalar);
        // np.save(f, np.zeros((123456789012, 0), dtype='|u1'))
        let dict = b"{'descr': '|u1', 'fortran_order': False, 'shape': (123456789012, 0), }";
        let long = [
            &b"\x93NUMPY\x01\x00\x76\x00"[..],
            dict,
            &[b' '; 118 - 70 - 1],
            b"\n",
        ]
        .concat();
        assert_eq!(header(DType::U8, &[123_456_789_012, 0]).expect("u8"), long);
        for shape in SHAPES {
            let h = header(DType::I16, shape).expect("i16");
            assert_eq!(h.len() % ALIGN, 0, "{shape:?}");
            assert_eq!(h.last(), Some(&b'\n'));
        }
    }

    #[test]
    fn every_numpy_dtype_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        for dtype in DType::ALL.into_iter().filter(|&d| descr_for(d).is_some()) {
            for shape in SHAPES {
                let file = dir.path().join("t.npy");
                let tensor = sample(dtype, shape);
                write(&file, &tensor).expect("write");
                let back = read(&file, 1 << 20, None).expect("read");
                assert_eq!(back, tensor, "{dtype} {shape:?}");
            }
        }
    }

    #[test]
    fn bf16_and_f8_are_refused_for_writing_with_a_way_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("t.npy");
        for dtype in [DType::BF16, DType::F8E4M3, DType::F8E5M2] {
            let err = write(&file, &sample(dtype, &[2])).expect_err("refused");
            assert!(matches!(err, FileError::Unsupported { .. }), "{err:?}");
            let msg = err.to_string();
            assert!(
                msg.contains(".safetensors") && msg.contains("t.npy"),
                "{msg}"
            );
        }
        assert!(!file.exists());
    }

    #[test]
    fn untyped_elements_need_a_dtype_of_their_size() {
        let data = [1, 2, 3, 4, 5, 6];
        let v2 = npy_with(
            "{'descr': '<V2', 'fortran_order': False, 'shape': (3,), }",
            &data,
        );
        let err = decode(path(), v2.clone(), None).expect_err("needs dtype");
        assert!(matches!(err, FileError::Usage { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("--dtype, one of u16, i16, f16, bf16"), "{msg}");
        let err = decode(path(), v2.clone(), Some(DType::F32)).expect_err("wrong size");
        assert!(err.to_string().contains("not f32 (4 bytes)"), "{err}");
        let t = decode(path(), v2, Some(DType::BF16)).expect("bf16");
        assert_eq!(
            (t.dtype(), t.shape(), t.data().as_ref()),
            (DType::BF16, &[3][..], &data[..])
        );
        let v1 = npy_with(
            "{'descr': '|V1', 'fortran_order': False, 'shape': (6,), }",
            &data,
        );
        let t = decode(path(), v1, Some(DType::F8E4M3)).expect("f8");
        assert_eq!(t.dtype(), DType::F8E4M3);
        let err = decode_dict(
            "{'descr': '|V3', 'fortran_order': False, 'shape': (2,), }",
            &data,
        )
        .expect_err("no 3-byte dtype");
        assert!(matches!(err, FileError::Unsupported { .. }), "{err:?}");
    }

    #[test]
    fn dtype_may_reinterpret_unsigned_bits_only_as_types_numpy_lacks() {
        let u16s = npy_with(
            "{'descr': '<u2', 'fortran_order': False, 'shape': (2,), }",
            &[0; 4],
        );
        let t = decode(path(), u16s.clone(), Some(DType::BF16)).expect("bf16 bits");
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(
            decode(path(), u16s.clone(), Some(DType::U16))
                .expect("same")
                .dtype(),
            DType::U16
        );
        for wrong in [DType::I16, DType::F16, DType::U32] {
            let err = decode(path(), u16s.clone(), Some(wrong)).expect_err("mismatch");
            assert!(
                matches!(err, FileError::Mismatch { .. }),
                "{wrong}: {err:?}"
            );
        }
        let u8s = npy_with(
            "{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }",
            &[0; 2],
        );
        assert_eq!(
            decode(path(), u8s, Some(DType::F8E5M2))
                .expect("f8")
                .dtype(),
            DType::F8E5M2
        );
    }

    #[test]
    fn versions_two_and_three_are_read() {
        let dict = "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }";
        for major in [2u8, 3] {
            let mut file = MAGIC.to_vec();
            file.extend([major, 0]);
            file.extend(u32::try_from(dict.len() + 1).expect("len").to_le_bytes());
            file.extend(dict.as_bytes());
            file.push(b'\n');
            file.extend([1, 0, 0, 0, 2, 0, 0, 0]);
            let t = decode(path(), Bytes::from(file.clone()), None).expect("decode");
            assert_eq!((t.dtype(), t.shape()), (DType::I32, &[2][..]));
            file[MAGIC.len()] = 4;
            let err = decode(path(), Bytes::from(file), None).expect_err("4.0");
            assert!(err.to_string().contains("version 4.0"), "{err}");
        }
        let mut bad_utf8 = MAGIC.to_vec();
        bad_utf8.extend([3, 0, 4, 0, 0, 0, b'{', 0xff, b'}', b'\n']);
        let err = decode(path(), Bytes::from(bad_utf8), None).expect_err("utf8");
        assert!(err.to_string().contains("not UTF-8"), "{err}");
    }

    #[test]
    fn byte_orders_are_checked_where_they_matter() {
        let ok = [
            ("=f4", 4),
            ("|u1", 1),
            (">u1", 1),
            ("<b1", 1),
            (">i1", 1),
            ("<V2", 2),
        ];
        for (descr, size) in ok {
            let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (1,), }}");
            let dtype = descr.ends_with("V2").then_some(DType::BF16);
            let file = npy_with(&dict, &vec![0; size]);
            decode(path(), file, dtype).unwrap_or_else(|e| panic!("{descr}: {e}"));
        }
        let err = decode_dict(
            "{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }",
            &[0; 4],
        )
        .expect_err("big-endian");
        assert!(matches!(err, FileError::Unsupported { .. }), "{err:?}");
        assert!(err.to_string().contains("big-endian"), "{err}");
        assert!(err.to_string().contains("newbyteorder('<')"), "{err}");
        let err = decode_dict(
            "{'descr': '|f4', 'fortran_order': False, 'shape': (1,), }",
            &[0; 4],
        )
        .expect_err("no order");
        assert!(matches!(err, FileError::Corrupt { .. }), "{err:?}");
    }

    #[test]
    fn unsupported_arrays_say_what_to_do() {
        let cases = [
            (
                "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }",
                "ascontiguousarray",
            ),
            (
                "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }",
                "structured",
            ),
            (
                "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
                "Python objects",
            ),
            (
                "{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }",
                "complex",
            ),
            (
                "{'descr': '<U3', 'fortran_order': False, 'shape': (1,), }",
                "strings",
            ),
            (
                "{'descr': '<M8[ns]', 'fortran_order': False, 'shape': (1,), }",
                "dates",
            ),
            (
                "{'descr': '<f16', 'fortran_order': False, 'shape': (1,), }",
                "a float of that size",
            ),
        ];
        for (dict, needle) in cases {
            let err = decode_dict(dict, &[0; 16]).expect_err(dict);
            assert!(
                matches!(err, FileError::Unsupported { .. }),
                "{dict}: {err:?}"
            );
            assert!(err.to_string().contains(needle), "{dict}: {err}");
        }
        // With at most one axis longer than 1, Fortran order is C order.
        let t = decode_dict(
            "{'descr': '<f4', 'fortran_order': True, 'shape': (1, 2), }",
            &[0; 8],
        )
        .expect("fortran 1x2");
        assert_eq!(t.shape(), &[1, 2]);
    }

    #[test]
    fn malformed_headers_are_corrupt() {
        let cases = [
            (
                "{'descr': '<f4', 'fortran_order': False}",
                "no \"shape\" key",
            ),
            (
                "{'descr': '<f4', 'shape': (1,), 'fortran_order': False, 'x': 1}",
                "unexpected header key \"x\"",
            ),
            (
                "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}",
                "twice",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}",
                "sizes from 0",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1.5,)}",
                "expected ','",
            ),
            (
                "{'descr': '<f4', 'fortran_order': 0, 'shape': (1,)}",
                "not a bool",
            ),
            (
                "{'descr': 4, 'fortran_order': False, 'shape': (1,)}",
                "not a string",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': 1}",
                "not a tuple",
            ),
            ("['descr', '<f4']", "not a dict"),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} x",
                "after its header dict",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)",
                "expected ',' or '}'",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}",
                "sizes from 0",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}",
                "overflows",
            ),
        ];
        for (dict, needle) in cases {
            let err = decode_dict(dict, &[0; 4]).expect_err(dict);
            assert!(matches!(err, FileError::Corrupt { .. }), "{dict}: {err:?}");
            let msg = err.to_string();
            assert!(
                msg.contains(needle) && msg.contains("t.npy"),
                "{dict}: {msg}"
            );
        }
        let deep = format!(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}), }}",
            vec!["1"; MAX_RANK + 1].join(", ")
        );
        let err = decode_dict(&deep, &[0; 4]).expect_err("rank");
        assert!(matches!(err, FileError::Unsupported { .. }), "{err:?}");
    }

    #[test]
    fn python_spellings_numpy_has_written_are_accepted() {
        // Python 2 longs, double quotes, keys in any order, no trailing comma, a list shape.
        let dict = "{\"shape\": (2L, 1L), \"fortran_order\": False, \"descr\": \"<i2\"}";
        let t = decode_dict(dict, &[0; 4]).expect("py2");
        assert_eq!((t.dtype(), t.shape()), (DType::I16, &[2, 1][..]));
        let t = decode_dict("{'descr':'<i2','fortran_order':False,'shape':[2]}", &[0; 4])
            .expect("compact");
        assert_eq!(t.shape(), &[2]);
    }

    #[test]
    fn header_length_is_limited() {
        let mut file = MAGIC.to_vec();
        file.extend([2, 0]);
        file.extend(
            u32::try_from(MAX_HEADER_LEN + 1)
                .expect("len")
                .to_le_bytes(),
        );
        file.resize(file.len() + MAX_HEADER_LEN + 1, b' ');
        let err = decode(path(), Bytes::from(file), None).expect_err("too long");
        assert!(err.to_string().contains("over the limit of 65536"), "{err}");
    }

    #[test]
    fn truncated_and_padded_files_give_the_right_error() {
        let golden = arange_2x3_f32();
        for len in 0..golden.len() {
            let err = decode(path(), Bytes::copy_from_slice(&golden[..len]), None)
                .expect_err("truncated");
            if len < 128 {
                assert!(matches!(err, FileError::Corrupt { .. }), "{len}: {err:?}");
            } else {
                assert!(
                    matches!(err, FileError::LengthMismatch { expected: 24, actual, .. } if actual == len as u64 - 128),
                    "{len}: {err:?}"
                );
                assert!(err.to_string().contains("truncated"), "{err}");
            }
        }
        let mut long = golden;
        long.push(0);
        let err = decode(path(), Bytes::from(long), None).expect_err("trailing");
        assert!(
            matches!(err, FileError::LengthMismatch { actual: 25, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("bytes after the array"), "{err}");
    }

    /// NumPy's own files, and ours read back by NumPy, when `python3` has NumPy
    /// (`TB_TEST_PYTHON` names another interpreter); skipped otherwise.
    #[test]
    fn numpy_reads_ours_and_we_read_numpys() {
        let python = std::env::var("TB_TEST_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        let has_numpy = Command::new(&python)
            .args(["-c", "import numpy"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !has_numpy {
            eprintln!("skipped: {python} has no numpy");
            return;
        }
        let theirs = tempfile::tempdir().expect("tempdir");
        let ours = tempfile::tempdir().expect("tempdir");
        // Each array in versions 1.0, 2.0 and 3.0, with its bytes in a .bin beside it.
        let make = r#"
import sys, numpy as np
from numpy.lib import format as npf
d = sys.argv[1]
arrays = {'scalar': np.float32(2.5), 'empty': np.zeros((0, 3), dtype='<i2')}
for name in ['bool', 'uint8', 'uint16', 'uint32', 'uint64', 'int8', 'int16', 'int32',
             'int64', 'float16', 'float32', 'float64']:
    a = np.arange(24) % 2 if name == 'bool' else np.arange(24) - 3
    arrays[name] = a.astype(name).reshape(2, 3, 4)
for name, a in arrays.items():
    np.asarray(a).tofile(f'{d}/{name}.bin')
    for v in [(1, 0), (2, 0), (3, 0)]:
        with open(f'{d}/{name}-v{v[0]}.npy', 'wb') as f:
            npf.write_array(f, np.asarray(a), version=v)
np.save(f'{d}/fortran.x', np.asfortranarray(np.ones((2, 3), dtype='<f4')))
"#;
        let out = Command::new(&python)
            .args(["-c", make, &theirs.path().to_string_lossy()])
            .output()
            .expect("python");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pairs = Vec::new();
        for entry in fs::read_dir(theirs.path()).expect("ls") {
            let file = entry.expect("entry").path();
            if file.extension().is_none_or(|e| e != "npy") || file.ends_with("fortran.x.npy") {
                continue;
            }
            let t = read(&file, 1 << 20, None).unwrap_or_else(|e| panic!("{e}"));
            let stem = file.file_stem().and_then(|s| s.to_str()).expect("stem");
            let name = stem.rsplit_once("-v").map_or(stem, |(name, _)| name);
            let raw = fs::read(theirs.path().join(format!("{name}.bin"))).expect("raw");
            assert_eq!(t.data().as_ref(), raw, "{stem}");
            let mine = ours.path().join(format!("{stem}.npy"));
            write(&mine, &t).expect("write");
            if stem.ends_with("-v1") {
                let theirs = fs::read(&file).expect("theirs");
                assert_eq!(
                    fs::read(&mine).expect("ours"),
                    theirs,
                    "np.save's bytes: {stem}"
                );
            }
            pairs.push(file.to_string_lossy().into_owned());
            pairs.push(mine.to_string_lossy().into_owned());
        }
        assert_eq!(pairs.len(), 2 * 3 * 14);
        let check = r#"
import sys, numpy as np
for theirs, ours in zip(sys.argv[1::2], sys.argv[2::2]):
    a, b = np.load(theirs), np.load(ours)
    assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), (theirs, a, b)
"#;
        let out = Command::new(&python)
            .args(["-c", check])
            .args(&pairs)
            .output()
            .expect("python");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let err = read(&theirs.path().join("fortran.x.npy"), 1 << 20, None).expect_err("F order");
        assert!(err.to_string().contains("Fortran-order"), "{err}");
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(path(), Bytes::from(bytes), None);
        }

        #[test]
        fn arbitrary_headers_never_panic(
            major in 1u8..=3,
            tokens in proptest::collection::vec(
                prop_oneof![
                    Just("{"), Just("}"), Just("("), Just(")"), Just("["), Just("]"), Just(","),
                    Just(":"), Just("'descr'"), Just("'shape'"), Just("'fortran_order'"),
                    Just("'<f4'"), Just("'|V2'"), Just("'>i8'"), Just("True"), Just("False"),
                    Just("None"), Just("0"), Just("3"), Just("-1"), Just("18446744073709551616"),
                    Just("'"), Just("\\"), Just(" "), Just("é"), Just("\n"), Just("L"),
                ],
                0..40,
            ),
            data in proptest::collection::vec(any::<u8>(), 0..64),
            dtype in proptest::option::of(proptest::sample::select(DType::ALL.to_vec())),
        ) {
            let text = tokens.concat();
            let mut file = MAGIC.to_vec();
            file.push(major);
            file.push(0);
            if major == 1 {
                file.extend(u16::try_from(text.len()).expect("short").to_le_bytes());
            } else {
                file.extend(u32::try_from(text.len()).expect("short").to_le_bytes());
            }
            file.extend(text.as_bytes());
            file.extend(data);
            let _ = decode(path(), Bytes::from(file), dtype);
        }
    }
}
