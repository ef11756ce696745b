//! Tests of format detection, shapes, raw files, and what every format shares: size limits,
//! option checks, atomic writes.

use std::fs;

use super::*;

/// Shapes every round trip covers: a scalar, empty, 1-D, 2-D, empty in the middle, 3-D.
pub(super) const SHAPES: [&[u64]; 6] = [&[], &[0], &[5], &[2, 3], &[2, 0, 3], &[1, 2, 4]];

/// A tensor of `dtype` and `shape` whose bytes are a pattern (0 and 1 for bool).
pub(super) fn sample(dtype: DType, shape: &[u64]) -> Tensor {
    let len = tb_proto::byte_len_for(dtype, shape).expect("shape") as usize;
    let data: Vec<u8> = (0..len)
        .map(|i| match dtype {
            DType::Bool => (i % 2) as u8,
            _ => (i * 37 + 11) as u8,
        })
        .collect();
    Tensor::new(dtype, shape.to_vec(), data).expect("tensor")
}

fn opts(max_bytes: u64) -> ReadOptions {
    ReadOptions::new(max_bytes)
}

#[test]
fn format_follows_the_extension_in_any_case() {
    assert_eq!(Format::of(Path::new("a/w.npy")), Format::Npy);
    assert_eq!(Format::of(Path::new("W.NPY")), Format::Npy);
    assert_eq!(Format::of(Path::new("m.safetensors")), Format::Safetensors);
    assert_eq!(Format::of(Path::new("m.SafeTensors")), Format::Safetensors);
    for raw in ["w.bin", "w", "w.npy.bin", ".npy", "dir.npy/w"] {
        assert_eq!(Format::of(Path::new(raw)), Format::Raw, "{raw}");
    }
}

#[test]
fn shapes_parse_in_every_spelling() {
    let cases: [(&str, &[u64]); 12] = [
        ("2,3,4", &[2, 3, 4]),
        ("2x3x4", &[2, 3, 4]),
        ("2X3", &[2, 3]),
        (" 2 , 3 ", &[2, 3]),
        ("[2, 3]", &[2, 3]),
        ("(6,)", &[6]),
        ("6,", &[6]),
        ("6", &[6]),
        ("0", &[0]),
        ("", &[]),
        ("[]", &[]),
        ("( )", &[]),
    ];
    for (input, shape) in cases {
        assert_eq!(parse_shape(input).expect(input), shape, "{input:?}");
    }
    let max = vec!["1"; MAX_RANK].join(",");
    assert_eq!(parse_shape(&max).expect("max rank").len(), MAX_RANK);
}

#[test]
fn bad_shapes_say_what_is_wrong() {
    let cases = [
        ("2,,3", "dimension 2 is empty"),
        (",", "dimension 1 is empty"),
        ("2x3,4", "mixes"),
        ("2,-1", "dimension 2 (\"-1\") is not a size"),
        ("2,a", "dimension 2 (\"a\")"),
        ("99999999999999999999", "too large"),
        ("[2,3", "'[' without a closing ']'"),
        ("2x", "dimension 2 is empty"),
    ];
    for (input, needle) in cases {
        let err = parse_shape(input).expect_err(input);
        assert!(
            matches!(err, FileError::BadShape { .. }),
            "{input}: {err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(needle), "{input}: {msg}");
        assert!(msg.contains("2,3,4 or 2x3x4"), "{msg}");
    }
    let deep = vec!["1"; MAX_RANK + 1].join("x");
    let msg = parse_shape(&deep).expect_err("too deep").to_string();
    assert!(msg.contains("over the limit of 32"), "{msg}");
}

#[test]
fn raw_round_trips_every_dtype() {
    let dir = tempfile::tempdir().expect("tempdir");
    for dtype in DType::ALL {
        for shape in SHAPES {
            let path = dir.path().join(format!("{dtype}.bin"));
            let tensor = sample(dtype, shape);
            assert_eq!(
                write(&path, &tensor, "ignored").expect("write"),
                Format::Raw
            );
            assert_eq!(fs::read(&path).expect("read back"), tensor.data().as_ref());
            let back = read_raw(&path, 1 << 20, dtype, shape).expect("read_raw");
            assert_eq!(back, tensor, "{dtype} {shape:?}");
            let opts = ReadOptions {
                dtype: Some(dtype),
                shape: Some(shape.to_vec()),
                ..opts(1 << 20)
            };
            assert_eq!(read(&path, &opts).expect("read"), tensor);
        }
    }
}

#[test]
fn raw_length_must_match_dtype_and_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.bin");
    fs::write(&path, [0u8; 23]).expect("write");
    let err = read_raw(&path, 1 << 20, DType::F32, &[2, 3]).expect_err("short");
    assert!(
        matches!(
            err,
            FileError::LengthMismatch {
                expected: 24,
                actual: 23,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("w.bin") && msg.contains("check --dtype and --shape"),
        "{msg}"
    );
    fs::write(&path, [0u8; 25]).expect("write");
    let err = read_raw(&path, 1 << 20, DType::F32, &[2, 3]).expect_err("long");
    assert!(
        matches!(err, FileError::LengthMismatch { actual: 25, .. }),
        "{err:?}"
    );
    let err = read_raw(&path, 1 << 20, DType::F64, &[u64::MAX, 2]).expect_err("overflow");
    assert!(matches!(err, FileError::Usage { .. }), "{err:?}");
}

#[test]
fn raw_files_need_dtype_and_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.bin");
    fs::write(&path, [0u8; 8]).expect("write");
    for (dtype, shape) in [
        (None, Some(vec![2])),
        (Some(DType::F32), None),
        (None, None),
    ] {
        let opts = ReadOptions {
            dtype,
            shape,
            ..opts(1 << 20)
        };
        let err = read(&path, &opts).expect_err("needs both");
        assert!(matches!(err, FileError::Usage { .. }), "{err:?}");
        assert!(
            err.to_string().contains("needs --dtype and --shape"),
            "{err}"
        );
    }
}

#[test]
fn files_over_the_limit_are_refused_before_reading() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tensor = sample(DType::F32, &[4, 4]);
    for name in ["w.npy", "w.safetensors", "w.bin"] {
        let path = dir.path().join(name);
        write(&path, &tensor, "w").expect("write");
        let len = fs::metadata(&path).expect("stat").len();
        let mut opts = ReadOptions {
            dtype: Some(DType::F32),
            shape: Some(vec![4, 4]),
            ..opts(len)
        };
        assert_eq!(read(&path, &opts).expect(name), tensor);
        opts.max_bytes = len - 1;
        let err = read(&path, &opts).expect_err(name);
        assert!(
            matches!(err, FileError::TooLarge { len: l, max, .. } if l == len && max == len - 1),
            "{name}: {err:?}"
        );
        assert!(err.to_string().contains(name), "{err}");
    }
}

#[test]
fn options_must_agree_with_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tensor = sample(DType::F32, &[2, 3]);
    let npy = dir.path().join("w.npy");
    let st = dir.path().join("w.safetensors");
    write(&npy, &tensor, "w").expect("npy");
    write(&st, &tensor, "w").expect("safetensors");
    for path in [&npy, &st] {
        let wrong_shape = ReadOptions {
            shape: Some(vec![3, 2]),
            ..opts(1 << 20)
        };
        let err = read(path, &wrong_shape).expect_err("shape");
        assert!(matches!(err, FileError::Mismatch { .. }), "{err:?}");
        assert!(err.to_string().contains("--shape says [3, 2]"), "{err}");
        let right = ReadOptions {
            shape: Some(vec![2, 3]),
            dtype: Some(DType::F32),
            ..opts(1 << 20)
        };
        assert_eq!(read(path, &right).expect("agrees"), tensor);
        let wrong_dtype = ReadOptions {
            dtype: Some(DType::I32),
            ..opts(1 << 20)
        };
        let err = read(path, &wrong_dtype).expect_err("dtype");
        assert!(matches!(err, FileError::Mismatch { .. }), "{err:?}");
    }
    let keyed = ReadOptions {
        key: Some("w".to_owned()),
        ..opts(1 << 20)
    };
    assert_eq!(read(&st, &keyed).expect("key"), tensor);
    let err = read(&npy, &keyed).expect_err("key on npy");
    assert!(
        err.to_string()
            .contains("--key applies to .safetensors files only"),
        "{err}"
    );
}

#[test]
fn missing_files_and_directories_are_io_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing.npy");
    let err = read(&missing, &opts(1 << 20)).expect_err("missing");
    assert!(
        matches!(err, FileError::Io { action: "open", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("missing.npy"), "{err}");
    let subdir = dir.path().join("d.npy");
    fs::create_dir(&subdir).expect("mkdir");
    let err = read(&subdir, &opts(1 << 20)).expect_err("directory");
    assert!(matches!(err, FileError::Io { .. }), "{err:?}");
    let err = write(
        &dir.path().join("no/such/dir/w.npy"),
        &sample(DType::U8, &[1]),
        "w",
    )
    .expect_err("no dir");
    assert!(matches!(err, FileError::Io { .. }), "{err:?}");
}

#[test]
fn writes_replace_the_file_whole_and_leave_no_temporary_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("w.bin");
    fs::write(&path, vec![9u8; 1000]).expect("old");
    let tensor = sample(DType::U8, &[3]);
    write_raw(&path, &tensor).expect("write");
    assert_eq!(fs::read(&path).expect("read"), tensor.data().as_ref());
    let names: Vec<_> = fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["w.bin"]);
}

#[cfg(unix)]
#[test]
fn written_files_get_the_mode_file_create_gives() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let reference = dir.path().join("reference");
    fs::File::create(&reference).expect("create");
    let path = dir.path().join("w.npy");
    write(&path, &sample(DType::U8, &[3]), "w").expect("write");
    let mode = |p: &Path| fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&path), mode(&reference));
}

#[test]
fn long_name_lists_are_cut_at_twenty() {
    let names: Vec<String> = (0..25).map(|i| format!("t{i:02}")).collect();
    let list = list_names(&names);
    assert!(list.starts_with("\"t00\", \"t01\""), "{list}");
    assert!(list.ends_with("\"t19\" and 5 more"), "{list}");
    assert_eq!(list_names(&names[..2]), "\"t00\", \"t01\"");
}

proptest::proptest! {
    /// `--shape` is user input: any string is a shape of at most MAX_RANK sizes or an error,
    /// never a panic.
    #[test]
    fn arbitrary_shapes_never_panic(
        input in proptest::prop_oneof![
            proptest::prelude::any::<String>(),
            "[ \\[\\]()0-9xX,é+-]{0,40}",
        ]
    ) {
        if let Ok(shape) = parse_shape(&input) {
            proptest::prop_assert!(shape.len() <= MAX_RANK);
        }
    }
}
