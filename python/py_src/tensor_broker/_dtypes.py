"""Dtypes: tensor-broker's names (as the CLI spells them) and numpy's and torch's dtypes.

bf16 and the f8 formats have no numpy dtype of their own: with ``ml_dtypes`` installed
(``pip install ml_dtypes``) they map to its ``bfloat16``, ``float8_e4m3fn`` and
``float8_e5m2``; torch has them built in.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

_NUMPY: dict[str, Any] = {
    "bool": np.dtype(np.bool_),
    "u8": np.dtype(np.uint8),
    "u16": np.dtype(np.uint16),
    "u32": np.dtype(np.uint32),
    "u64": np.dtype(np.uint64),
    "i8": np.dtype(np.int8),
    "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
}
# ml_dtypes' names for the dtypes numpy lacks.
_ML_DTYPES = {"bf16": "bfloat16", "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}

try:  # pragma: no cover - depends on the environment
    import ml_dtypes

    for _ours, _theirs in _ML_DTYPES.items():
        _NUMPY[_ours] = np.dtype(getattr(ml_dtypes, _theirs))
    HAVE_ML_DTYPES = True
except ImportError:  # pragma: no cover
    HAVE_ML_DTYPES = False

_FROM_NUMPY = {dt: name for name, dt in _NUMPY.items()}
_ML_NAMES = {theirs: ours for ours, theirs in _ML_DTYPES.items()}

# Every dtype tensor-broker knows (the CLI's list).
DTYPES = (
    "bool", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64",
    "f16", "bf16", "f32", "f64", "f8e4m3", "f8e5m2",
)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of tensor-broker dtype ``name``."""
    try:
        return _NUMPY[name]
    except KeyError:
        if name in _ML_DTYPES:
            raise TypeError(
                f"{name} has no numpy dtype without ml_dtypes: pip install ml_dtypes, "
                "or use get_torch()"
            ) from None
        raise TypeError(f"dtype {name!r} has no numpy equivalent") from None


def name_of_numpy(dtype: np.dtype) -> str:
    """tensor-broker's name of numpy ``dtype``; ValueError/TypeError saying what to do."""
    if dtype.hasobject:
        raise TypeError(
            f"arrays of dtype {dtype} hold Python objects and cannot be sent: "
            "convert them to a numeric dtype first"
        )
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big"):
        raise ValueError(
            f"dtype {dtype} is big-endian: tensors are little-endian; pass "
            "a.astype(a.dtype.newbyteorder('<'))"
        )
    name = _FROM_NUMPY.get(dtype)
    if name is None:
        name = _ML_NAMES.get(dtype.name)
    if name is None:
        raise TypeError(
            f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)}; "
            "bf16 and f8 through ml_dtypes)"
        )
    return name


def _torch_table(torch: Any) -> dict[str, Any]:
    table = {
        "bool": torch.bool,
        "u8": torch.uint8,
        "i8": torch.int8,
        "i16": torch.int16,
        "i32": torch.int32,
        "i64": torch.int64,
        "f16": torch.float16,
        "bf16": torch.bfloat16,
        "f32": torch.float32,
        "f64": torch.float64,
    }
    for ours, theirs in (
        ("u16", "uint16"),
        ("u32", "uint32"),
        ("u64", "uint64"),
        ("f8e4m3", "float8_e4m3fn"),
        ("f8e5m2", "float8_e5m2"),
    ):
        if hasattr(torch, theirs):
            table[ours] = getattr(torch, theirs)
    return table


def torch_dtype(name: str) -> Any:
    """The torch dtype of tensor-broker dtype ``name``."""
    import torch

    try:
        return _torch_table(torch)[name]
    except KeyError:
        raise TypeError(f"dtype {name!r} has no torch equivalent in torch {torch.__version__}") from None


def name_of_torch(dtype: Any) -> str:
    """tensor-broker's name of torch ``dtype``."""
    import torch

    for ours, theirs in _torch_table(torch).items():
        if theirs == dtype:
            return ours
    raise TypeError(f"torch dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")
