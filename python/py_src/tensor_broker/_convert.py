"""Arrays in and out: what ``put`` accepts (numpy arrays, torch tensors, any ``__dlpack__``
object) as raw bytes plus dtype and shape, and received buffers as numpy arrays and torch
tensors that share the received memory (no copy)."""

from __future__ import annotations

import sys
from typing import Any, Mapping

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


def cuda_tensor(obj: Any) -> tuple[Any, str, tuple[int, ...], int] | None:
    """``obj`` as (its bytes as a 1-D ``uint8`` CUDA tensor, dtype name, shape, device
    ordinal) when it is a torch CUDA tensor, else ``None``. The native call takes the address
    and length from the tensor itself (``__cuda_array_interface__``). The work that produced
    it is finished first: every stream of its device is synchronized (torch does not record
    which stream wrote a tensor), so its bytes can be copied."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or obj.device.type != "cuda":
        return None
    name = _dtypes.name_of_torch(obj.dtype)
    if not obj.is_contiguous():
        raise ValueError("the tensor is not contiguous: pass t.contiguous()")
    t = obj.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    ordinal = t.device.index if t.device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(t.device)
    flat = t.reshape(-1).view(torch.uint8)
    return flat, name, tuple(t.shape), ordinal


def cuda_ordinal(device: Any) -> int | None:
    """The CUDA device ordinal ``device`` names (``"cuda"``, ``"cuda:1"``, a torch device,
    an int), or ``None`` for ``"cpu"``/``None``."""
    if device is None:
        return None
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device {device}: a CUDA ordinal is at least 0")
        return device
    text = str(device)
    if text == "cpu":
        return None
    if text == "cuda":
        import torch

        return int(torch.cuda.current_device())
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or an int")


def _torch_bytes(torch: Any, t: Any) -> tuple[np.ndarray, str, tuple[int, ...]]:
    name = _dtypes.name_of_torch(t.dtype)
    if t.device.type != "cpu":
        raise ValueError(
            f"the tensor is on {t.device}: put() sends CUDA tensors device to device; "
            "put_many() and out= take host tensors: pass t.cpu()"
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
    """A torch tensor over ``buf``'s private view through DLPack (no copy of the payload), on
    the CPU or on the CUDA device holding them. Writing into it in place is safe: it changes
    this view only, never what the node holds and serves (a host view is copy-on-write; a
    device one is the memory a get received into, which the node does not keep, or a private
    device copy)."""
    import torch

    if buf.dtype == "set":
        raise TypeError(f"{buf.name!r} is a set: use get_many_torch() (or Update.tensors())")
    dtype = _dtypes.torch_dtype(buf.dtype)
    flat = torch.from_dlpack(buf)
    return flat.view(dtype).reshape(tuple(buf.shape))


def check_out(out: Any) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """``out`` (a numpy array or CPU torch tensor) as a writable 1-D ``uint8`` view of its
    bytes (no copy), its dtype name and shape. The native call borrows that view for writing
    (numpy's borrow tracking, and a claim on its addresses), so a second receive into the
    same memory at the same time is refused."""
    arr, name, shape = to_bytes(out)
    if not arr.flags.writeable:
        raise ValueError("out is read-only: pass a writable array")
    return arr.reshape(-1).view(np.uint8), name, shape


def set_members(
    mapping: Mapping[str, Any], metadata: Mapping[str, str] | None
) -> tuple[list[tuple[str, np.ndarray, str, list[int]]], dict[str, str]]:
    """A ``put_many`` mapping as the native layer takes it: ``(key, bytes, dtype, shape)``
    per member, and the metadata as strings."""
    members = []
    for key, value in mapping.items():
        data, dtype, shape = to_bytes(value)
        members.append((str(key), data, dtype, list(shape)))
    return members, {str(k): str(v) for k, v in (metadata or {}).items()}

