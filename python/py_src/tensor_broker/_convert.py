"""Arrays in and out: what ``put`` accepts (numpy arrays, torch tensors, any ``__dlpack__``
object) as raw bytes plus dtype and shape, and received buffers as numpy arrays and torch
tensors that share the received memory (no copy)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import _dtypes
from ._native import Buffer


def to_bytes(obj: Any) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """``obj`` as (a C-contiguous array whose bytes are the tensor's, dtype name, shape).

    No copy here: the array returned shares ``obj``'s memory (``put`` copies it once, with
    the GIL released)."""
    if isinstance(obj, np.ndarray):
        name = _dtypes.name_of_numpy(obj.dtype)
        if not obj.flags.c_contiguous:
            raise ValueError(
                "the array is not C-contiguous (a transpose or a slice with steps?): "
                "pass numpy.ascontiguousarray(a)"
            )
        return obj, name, tuple(obj.shape)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_bytes(torch, obj)
    if hasattr(obj, "__dlpack__"):
        return to_bytes(np.from_dlpack(obj))
    raise TypeError(
        f"cannot send a {type(obj).__name__}: pass a numpy array, a torch tensor, or an "
        "object with __dlpack__"
    )


def _torch_bytes(torch: Any, t: Any) -> tuple[np.ndarray, str, tuple[int, ...]]:
    name = _dtypes.name_of_torch(t.dtype)
    if t.device.type != "cpu":
        raise ValueError(
            f"the tensor is on {t.device}: this build sends host tensors; pass t.cpu()"
        )
    if not t.is_contiguous():
        raise ValueError("the tensor is not contiguous: pass t.contiguous()")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat.numpy(), name, tuple(t.shape)


def to_numpy(buf: Buffer) -> np.ndarray:
    """A read-only numpy array over ``buf``'s bytes whose ``base`` is ``buf`` (no copy)."""
    if buf.dtype == "set":
        raise TypeError(f"{buf.name!r} is a set: use get_many() (or Update.arrays())")
    dtype = _dtypes.numpy_dtype(buf.dtype)
    return buf.numpy(dtype)


def to_torch(buf: Buffer) -> Any:
    """A torch tensor over ``buf``'s bytes through DLPack (no copy). It shares memory with
    what the node holds and serves: treat it as read-only (``.clone()`` before writing)."""
    import torch

    if buf.dtype == "set":
        raise TypeError(f"{buf.name!r} is a set: use get_many_torch() (or Update.tensors())")
    dtype = _dtypes.torch_dtype(buf.dtype)
    flat = torch.from_dlpack(buf)
    return flat.view(dtype).reshape(tuple(buf.shape))


def check_out(out: Any) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """``out`` (a numpy array or CPU torch tensor) as a writable array of its bytes."""
    arr, name, shape = to_bytes(out)
    if not arr.flags.writeable:
        raise ValueError("out is read-only: pass a writable array")
    return arr, name, shape
