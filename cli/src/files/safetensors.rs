//! `.safetensors`, Hugging Face's tensor file: the JSON header's length (8 bytes, little
//! endian), the header naming each tensor's dtype, shape and byte range, then the bytes.
//!
//! Parsing and validation are the `safetensors` crate's; this module bounds the header, maps
//! dtypes, picks one tensor, and writes one tensor with the crate's header encoding.

use std::{collections::BTreeMap, io, path::Path};

use ::safetensors::{
    Dtype, SafeTensors,
    tensor::{Metadata, TensorInfo},
};
use bytes::Bytes;
use tb_node::Tensor;
use tb_proto::{DType, MAX_RANK, MetaError};

use super::{FileError, Format};

/// Longest JSON header read. A checkpoint with thousands of tensors has a header of a few
/// hundred KiB; the crate itself allows 100 MB.
pub const MAX_HEADER_LEN: u64 = 16 * 1024 * 1024;
/// Bytes of the header's length.
const LEN_PREFIX: usize = 8;
/// The header key that holds file metadata, not a tensor.
const METADATA_KEY: &str = "__metadata__";

/// Reads the tensor `select` names from a `.safetensors` file of at most `max_bytes` bytes;
/// with `None`, the file must hold exactly one tensor.
pub fn read(path: &Path, max_bytes: u64, select: Option<&str>) -> Result<Tensor, FileError> {
    let file = super::read_file(path, max_bytes)?;
    decode(path, file, select)
}

/// Writes `tensor` as the one tensor of a `.safetensors` file, under `key`.
pub fn write(path: &Path, tensor: &Tensor, key: &str) -> Result<(), FileError> {
    if key == METADATA_KEY {
        return Err(super::usage(
            path,
            format!("{key:?} is reserved in .safetensors files; choose another key with --key"),
        ));
    }
    let data = super::host_bytes(path, tensor)?;
    let encode_error = |e: String| super::io_error(path, "write", io::Error::other(e));
    let shape = tensor
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|e| encode_error(e.to_string()))?;
    let info = TensorInfo {
        dtype: to_safetensors(tensor.dtype())
            .ok_or_else(|| encode_error(format!("a {} tensor", tensor.dtype())))?,
        shape,
        data_offsets: (0, data.len()),
    };
    let metadata = Metadata::new(None, vec![(key.to_owned(), info)])
        .map_err(|e| encode_error(e.to_string()))?;
    // What `safetensors::serialize` writes: the JSON padded with spaces to a multiple of 8.
    let mut header = serde_json::to_vec(&metadata).map_err(|e| encode_error(e.to_string()))?;
    header.resize(header.len().next_multiple_of(LEN_PREFIX), b' ');
    let header_len = (header.len() as u64).to_le_bytes();
    super::write_atomic(path, &[&header_len, &header, &data])
}

/// Parses a whole `.safetensors` file (see [`read`]). A tensor that is most of the file is
/// a slice of `file`; a smaller one is copied out, so it does not keep the rest alive.
pub fn decode(path: &Path, file: Bytes, select: Option<&str>) -> Result<Tensor, FileError> {
    let parsed = parse(path, &file)?;
    let metadata = &parsed.metadata;
    let mut names: Vec<String> = metadata.tensors().into_keys().collect();
    names.sort();
    let name = match select {
        Some(key) if metadata.info(key).is_some() => key,
        Some(key) => {
            return Err(FileError::NoSuchKey {
                path: path.to_owned(),
                key: key.to_owned(),
                names,
            });
        }
        None => match names.as_slice() {
            [] => {
                return Err(FileError::Empty {
                    path: path.to_owned(),
                });
            }
            [only] => only.as_str(),
            _ => {
                return Err(FileError::NeedsKey {
                    path: path.to_owned(),
                    names,
                });
            }
        },
    };
    parsed.tensor(path, &file, name, false)
}

/// Reads every tensor of a `.safetensors` file of at most `max_bytes` bytes, in the order
/// their bytes lie in the file, with the file's `__metadata__`: a version set's members.
pub fn read_all(path: &Path, max_bytes: u64) -> Result<FileSet, FileError> {
    let file = super::read_file(path, max_bytes)?;
    decode_all(path, file)
}

/// Every tensor of a `.safetensors` file and its metadata.
#[derive(Debug)]
pub struct FileSet {
    /// `(key, tensor)`, in the order their bytes lie in the file; each a slice of the file.
    pub tensors: Vec<(String, Tensor)>,
    /// The file's `__metadata__` (empty without one).
    pub metadata: BTreeMap<String, String>,
}

/// Parses a whole `.safetensors` file into all its tensors (see [`read_all`]).
pub fn decode_all(path: &Path, file: Bytes) -> Result<FileSet, FileError> {
    let parsed = parse(path, &file)?;
    let keys = parsed.metadata.offset_keys();
    if keys.is_empty() {
        return Err(FileError::Empty {
            path: path.to_owned(),
        });
    }
    let tensors = keys
        .into_iter()
        .map(|key| {
            let tensor = parsed.tensor(path, &file, &key, true)?;
            Ok((key, tensor))
        })
        .collect::<Result<_, FileError>>()?;
    let metadata = parsed
        .metadata
        .metadata()
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(FileSet { tensors, metadata })
}

/// A `.safetensors` header that parsed and bounds-checked: where the data starts and what
/// each tensor is.
struct Parsed {
    metadata: Metadata,
    data_start: usize,
}

fn parse(path: &Path, file: &Bytes) -> Result<Parsed, FileError> {
    let corrupt = |reason: String| super::corrupt(path, Format::Safetensors, reason);
    let Some(&prefix) = file.first_chunk::<LEN_PREFIX>() else {
        return Err(corrupt(format!(
            "it is {} bytes, too short for the 8-byte header length",
            file.len()
        )));
    };
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(corrupt(format!(
            "its header claims {header_len} bytes, over the limit of {MAX_HEADER_LEN}"
        )));
    }
    let data_start = LEN_PREFIX + usize::try_from(header_len).unwrap_or(usize::MAX);
    let Some(header) = file.get(LEN_PREFIX..data_start) else {
        return Err(corrupt(format!(
            "its header claims {header_len} bytes but the file ends after {}",
            file.len()
        )));
    };
    check_ends(header, file.len() - data_start).map_err(&corrupt)?;
    let (_, metadata) = SafeTensors::read_metadata(file).map_err(|e| corrupt(e.to_string()))?;
    Ok(Parsed {
        metadata,
        data_start,
    })
}

impl Parsed {
    /// The tensor `name` (which the header has). With `share`, or when it is most of the
    /// file, its bytes are a slice of `file`; else a copy, so it does not keep the rest alive.
    fn tensor(
        &self,
        path: &Path,
        file: &Bytes,
        name: &str,
        share: bool,
    ) -> Result<Tensor, FileError> {
        let corrupt = |reason: String| super::corrupt(path, Format::Safetensors, reason);
        let Some(info) = self.metadata.info(name) else {
            return Err(corrupt(format!("tensor {name:?} has no entry")));
        };
        let dtype = from_safetensors(info.dtype).ok_or_else(|| {
            super::unsupported(
                path,
                format!("tensor {name:?} of dtype {}", info.dtype),
                "this tool handles BOOL, U8, U16, U32, U64, I8, I16, I32, I64, F16, BF16, F32, \
                 F64, F8_E4M3 and F8_E5M2",
            )
        })?;
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        tb_proto::byte_len_for(dtype, &shape).map_err(|e| match e {
            MetaError::RankTooLarge { rank } => super::unsupported(
                path,
                format!("tensor {name:?} of {rank} dimensions"),
                format!("at most {MAX_RANK} are allowed"),
            ),
            e => corrupt(format!("tensor {name:?} of shape {shape:?}: {e}")),
        })?;
        let (start, end) = info.data_offsets;
        let data_start = self.data_start;
        let range = data_start
            .checked_add(start)
            .zip(data_start.checked_add(end));
        let Some((start, end)) = range.filter(|&(s, e)| s <= e && e <= file.len()) else {
            return Err(corrupt(format!("tensor {name:?} lies outside the file")));
        };
        let data = if share || (end - start) * 2 >= file.len() {
            file.slice(start..end)
        } else {
            Bytes::copy_from_slice(&file[start..end])
        };
        Tensor::new(dtype, shape, data).map_err(|source| super::tensor_error(path, source))
    }
}

/// Writes `tensors` (with `metadata` as `__metadata__`) as a `.safetensors` file: a version
/// set's members. Keys keep their order, so the file lists them as the set does.
pub fn write_all(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), FileError> {
    if let Some((key, _)) = tensors.iter().find(|(key, _)| key == METADATA_KEY) {
        return Err(super::usage(
            path,
            format!("member {key:?} is reserved in .safetensors files"),
        ));
    }
    let encode_error = |e: String| super::io_error(path, "write", io::Error::other(e));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut datas = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    for (key, tensor) in tensors {
        let data = super::host_bytes(path, tensor)?;
        let dtype = to_safetensors(tensor.dtype()).ok_or_else(|| {
            encode_error(format!(
                "member {key:?} of dtype {} has no safetensors dtype",
                tensor.dtype()
            ))
        })?;
        let shape = tensor
            .shape()
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<usize>, _>>()
            .map_err(|e| encode_error(e.to_string()))?;
        let info = TensorInfo {
            dtype,
            shape,
            data_offsets: (offset, offset + data.len()),
        };
        offset += data.len();
        infos.push((key.clone(), info));
        datas.push(data);
    }
    let metadata = (!metadata.is_empty()).then(|| {
        metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    });
    let header = Metadata::new(metadata, infos).map_err(|e| encode_error(e.to_string()))?;
    let mut header = serde_json::to_vec(&header).map_err(|e| encode_error(e.to_string()))?;
    header.resize(header.len().next_multiple_of(LEN_PREFIX), b' ');
    let header_len = (header.len() as u64).to_le_bytes();
    let mut parts: Vec<&[u8]> = vec![&header_len, &header];
    parts.extend(datas.iter().map(|d| &d[..]));
    super::write_atomic(path, &parts)
}

/// Checks that every tensor ends within the file's `data_len` bytes of data. The crate
/// checks that they tile the data exactly, but adds the last end to the header's size
/// unchecked (a panic in debug builds when a file claims ends near 2^64); bounding each end
/// first keeps that sum small. Headers that are not a JSON object are left to the crate.
fn check_ends(header: &[u8], data_len: usize) -> Result<(), String> {
    let Ok(entries) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(header)
    else {
        return Ok(());
    };
    for (name, entry) in entries.iter().filter(|(name, _)| *name != METADATA_KEY) {
        let end = entry
            .get("data_offsets")
            .and_then(|offsets| offsets.get(1))
            .and_then(serde_json::Value::as_u64);
        if let Some(end) = end.filter(|&end| end > data_len as u64) {
            return Err(format!(
                "tensor {name:?} ends at byte {end} of the data, past its end ({data_len} bytes)"
            ));
        }
    }
    Ok(())
}

/// The safetensors dtype of `dtype` (`None` for [`DType::Set`], not an element type).
fn to_safetensors(dtype: DType) -> Option<Dtype> {
    Some(match dtype {
        DType::Bool => Dtype::BOOL,
        DType::U8 => Dtype::U8,
        DType::U16 => Dtype::U16,
        DType::U32 => Dtype::U32,
        DType::U64 => Dtype::U64,
        DType::I8 => Dtype::I8,
        DType::I16 => Dtype::I16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F8E4M3 => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
        DType::Set => return None,
    })
}

/// Our dtype for a safetensors dtype, if we have one (not F4, F6, F8_E8M0, the FNUZ f8s, C64).
fn from_safetensors(dtype: Dtype) -> Option<DType> {
    DType::ALL
        .into_iter()
        .find(|&d| to_safetensors(d) == Some(dtype))
}

#[cfg(test)]
mod tests {
    use std::{borrow::Cow, fs};

    use ::safetensors::View;
    use proptest::prelude::*;

    use super::*;
    use crate::files::tests::{SHAPES, sample};

    fn path() -> &'static Path {
        Path::new("t.safetensors")
    }

    /// A tensor as the crate's `serialize` takes it.
    struct Raw(Dtype, Vec<usize>, Vec<u8>);

    impl View for &Raw {
        fn dtype(&self) -> Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> Cow<'_, [u8]> {
            Cow::Borrowed(&self.2)
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }

    /// A file holding `tensors`, written by the crate.
    fn file_of(tensors: &[(&str, Raw)]) -> Bytes {
        let views = tensors.iter().map(|(name, raw)| (*name, raw));
        Bytes::from(::safetensors::serialize(views, None).expect("serialize"))
    }

    fn f32s(n: usize) -> Raw {
        Raw(Dtype::F32, vec![n], vec![7; n * 4])
    }

    /// A file whose JSON header is `json` (padded to 8 bytes) followed by `data`.
    fn file_with_header(json: &str, data: &[u8]) -> Bytes {
        let mut header = json.as_bytes().to_vec();
        header.resize(header.len().next_multiple_of(8), b' ');
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend(header);
        out.extend(data);
        Bytes::from(out)
    }

    #[test]
    fn every_dtype_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("t.safetensors");
        for dtype in DType::ALL {
            assert_eq!(
                from_safetensors(to_safetensors(dtype).expect("valid")),
                Some(dtype)
            );
            for shape in SHAPES {
                let tensor = sample(dtype, shape);
                write(&file, &tensor, "model/layer.0/w").expect("write");
                let back = read(&file, 1 << 20, None).expect("read");
                assert_eq!(back, tensor, "{dtype} {shape:?}");
                let named = read(&file, 1 << 20, Some("model/layer.0/w")).expect("by key");
                assert_eq!(named, tensor);
            }
        }
    }

    #[test]
    fn whole_files_round_trip_with_their_metadata() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("back.safetensors");
        let tensors: Vec<(String, Tensor)> = DType::ALL
            .iter()
            .enumerate()
            .map(|(i, &dtype)| (format!("m.{i}"), sample(dtype, &[2, 3])))
            .chain([("empty".to_string(), sample(DType::F32, &[0]))])
            .collect();
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        write_all(&out, &tensors, &metadata).expect("write");
        let back = read_all(&out, 1 << 20).expect("read");
        assert_eq!(
            back.tensors, tensors,
            "same order, dtypes, shapes and bytes"
        );
        assert_eq!(back.metadata, metadata);
        // What the crate reads, with the metadata where it looks for it.
        let bytes = std::fs::read(&out).expect("valid");
        let (_, header) = SafeTensors::read_metadata(&bytes).expect("crate reads it");
        assert_eq!(header.metadata().as_ref().expect("valid")["format"], "pt");
        // A file without tensors is no set.
        let empty = file_with_header("{}", &[]);
        assert!(matches!(
            decode_all(path(), empty),
            Err(FileError::Empty { .. })
        ));
        let reserved = vec![(METADATA_KEY.to_string(), sample(DType::U8, &[1]))];
        assert!(write_all(&out, &reserved, &BTreeMap::new()).is_err());
    }

    #[test]
    fn we_write_what_the_crate_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("t.safetensors");
        for (dtype, shape) in [
            (DType::BF16, &[2u64, 3][..]),
            (DType::U8, &[]),
            (DType::F64, &[0, 4]),
        ] {
            let tensor = sample(dtype, shape);
            write(&file, &tensor, "a/\"quoted\"/w").expect("write");
            let shape = shape.iter().map(|&d| d as usize).collect();
            let raw = Raw(
                to_safetensors(dtype).expect("valid"),
                shape,
                tensor.data().to_vec(),
            );
            let theirs = file_of(&[("a/\"quoted\"/w", raw)]);
            assert_eq!(fs::read(&file).expect("read"), theirs.as_ref(), "{dtype}");
        }
    }

    #[test]
    fn several_tensors_need_a_key() {
        let file = file_of(&[("b", f32s(2)), ("a", f32s(3)), ("c/d", f32s(1))]);
        let err = decode(path(), file.clone(), None).expect_err("needs key");
        assert!(matches!(err, FileError::NeedsKey { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            "t.safetensors holds 3 tensors; choose one with --key: \"a\", \"b\", \"c/d\""
        );
        let t = decode(path(), file.clone(), Some("a")).expect("a");
        assert_eq!((t.dtype(), t.shape()), (DType::F32, &[3][..]));
        assert_eq!(t.data().as_ref(), &[7; 12]);
        let err = decode(path(), file, Some("e")).expect_err("no e");
        assert!(matches!(err, FileError::NoSuchKey { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains("holds no tensor \"e\"; it holds: \"a\", \"b\""),
            "{err}"
        );
        let many: Vec<(String, Raw)> = (0..25).map(|i| (format!("t{i:02}"), f32s(1))).collect();
        let many: Vec<(&str, Raw)> = many
            .into_iter()
            .map(|(n, r)| (n.leak() as &str, r))
            .collect();
        let err = decode(path(), file_of(&many), None).expect_err("needs key");
        assert!(err.to_string().ends_with("\"t19\" and 5 more"), "{err}");
    }

    #[test]
    fn a_tensor_that_is_most_of_the_file_is_not_copied() {
        let file = file_of(&[("big", f32s(100)), ("small", f32s(1))]);
        let big = decode(path(), file.clone(), Some("big")).expect("big");
        let file_range = file.as_ptr_range();
        assert!(file_range.contains(&big.data().as_ptr()));
        let small = decode(path(), file.clone(), Some("small")).expect("small");
        assert!(!file_range.contains(&small.data().as_ptr()));
    }

    #[test]
    fn files_without_tensors_or_with_foreign_dtypes_are_refused() {
        let empty = file_with_header("{}", &[]);
        let err = decode(path(), empty, None).expect_err("empty");
        assert!(matches!(err, FileError::Empty { .. }), "{err:?}");
        let meta_only = file_with_header(r#"{"__metadata__":{"format":"pt"}}"#, &[]);
        assert!(matches!(
            decode(path(), meta_only, None),
            Err(FileError::Empty { .. })
        ));
        let complex = file_of(&[("z", Raw(Dtype::C64, vec![1], vec![0; 8]))]);
        let err = decode(path(), complex, None).expect_err("c64");
        assert!(matches!(err, FileError::Unsupported { .. }), "{err:?}");
        assert!(err.to_string().contains("dtype C64"), "{err}");
        let deep = file_of(&[("deep", Raw(Dtype::U8, vec![1; MAX_RANK + 1], vec![0]))]);
        let err = decode(path(), deep, None).expect_err("rank");
        assert!(err.to_string().contains("33 dimensions"), "{err}");
    }

    #[test]
    fn truncated_and_padded_files_are_corrupt() {
        let file = file_of(&[("w", f32s(3))]);
        for len in 0..file.len() {
            let err = decode(path(), file.slice(..len), None).expect_err("truncated");
            assert!(matches!(err, FileError::Corrupt { .. }), "{len}: {err:?}");
        }
        let mut long = file.to_vec();
        long.push(0);
        let err = decode(path(), Bytes::from(long), None).expect_err("trailing");
        assert!(matches!(err, FileError::Corrupt { .. }), "{err:?}");
        let mut huge = file.to_vec();
        huge[..8].copy_from_slice(&(MAX_HEADER_LEN + 1).to_le_bytes());
        let err = decode(path(), Bytes::from(huge), None).expect_err("huge header");
        assert!(err.to_string().contains("over the limit"), "{err}");
    }

    /// The crate adds the last tensor's end to the header size unchecked; ends that sum to
    /// near 2^64 must be refused before that (a panic in debug builds).
    #[test]
    fn offsets_near_u64_max_are_corrupt_not_a_panic() {
        let big = (1u64 << 61) - 1;
        let mut entries = Vec::new();
        let mut start = 0u64;
        for i in 0..9 {
            let len = if i < 8 { big } else { u64::MAX - start };
            entries.push(format!(
                r#""t{i}":{{"dtype":"U8","shape":[{len}],"data_offsets":[{start},{}]}}"#,
                start + len
            ));
            start += len;
        }
        let file = file_with_header(&format!("{{{}}}", entries.join(",")), &[0; 16]);
        let err = decode(path(), file, None).expect_err("corrupt");
        assert!(matches!(err, FileError::Corrupt { .. }), "{err:?}");
        assert!(err.to_string().contains("past its end"), "{err}");
    }

    #[test]
    fn the_metadata_key_is_reserved() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("t.safetensors");
        let err = write(&file, &sample(DType::U8, &[1]), METADATA_KEY).expect_err("reserved");
        assert!(matches!(err, FileError::Usage { .. }), "{err:?}");
        assert!(!file.exists());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            select in proptest::option::of("[a-c]"),
        ) {
            let _ = decode(path(), Bytes::from(bytes), select.as_deref());
        }

        #[test]
        fn arbitrary_headers_never_panic(
            tokens in proptest::collection::vec(
                prop_oneof![
                    Just("{"), Just("}"), Just("["), Just("]"), Just(","), Just(":"),
                    Just("\"a\""), Just("\"b\""), Just("\"dtype\""), Just("\"shape\""),
                    Just("\"data_offsets\""), Just("\"__metadata__\""), Just("\"F32\""),
                    Just("\"U8\""), Just("\"C64\""), Just("0"), Just("4"), Just("8"),
                    Just("2305843009213693951"), Just("18446744073709551615"), Just("-1"),
                ],
                0..48,
            ),
            data in proptest::collection::vec(any::<u8>(), 0..64),
            select in proptest::option::of("[a-c]"),
        ) {
            let file = file_with_header(&tokens.concat(), &data);
            let _ = decode(path(), file, select.as_deref());
        }

        #[test]
        fn well_formed_files_round_trip(
            dtype in proptest::sample::select(DType::ALL.to_vec()),
            shape in proptest::collection::vec(0u64..4, 0..4),
        ) {
            let tensor = sample(dtype, &shape);
            let dims = shape.iter().map(|&d| d as usize).collect();
            let raw = Raw(to_safetensors(dtype).expect("valid"), dims, tensor.data().to_vec());
            let back = decode(path(), file_of(&[("x", raw)]), None).expect("decode");
            prop_assert_eq!(back, tensor);
        }
    }
}
