//! Tests of `.npy` files: golden bytes, every dtype, NumPy's own files when NumPy is
//! installed, and malformed, truncated and arbitrary input.

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
    let t =
        decode_dict("{'descr':'<i2','fortran_order':False,'shape':[2]}", &[0; 4]).expect("compact");
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
        let err =
            decode(path(), Bytes::copy_from_slice(&golden[..len]), None).expect_err("truncated");
        if len < 128 {
            assert!(matches!(err, FileError::Corrupt { .. }), "{len}: {err:?}");
        } else {
            let data_len = len as u64 - 128;
            assert!(
                matches!(err, FileError::LengthMismatch { expected: 24, actual, .. } if actual == data_len),
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
