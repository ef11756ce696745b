"""Type stubs of the Rust extension ``tensor_broker._native`` (see src/ in the package's
crate). Users call it through :mod:`tensor_broker`; these names are its building blocks."""

from typing import Any, Awaitable, Optional

import numpy as np

CUDA_COMPILED: bool
"""Whether the extension was built with tb-node's ``cuda`` feature."""

class Buffer:
    """A received tensor's bytes as a private view: a copy-on-write mapping of the node's
    memfd (a copy for 4 MiB or less; on a GPU, a private device copy), so nothing written
    into it reaches what the node holds or serves. The buffer protocol (``memoryview``,
    read-only), DLPack (a 1-D ``uint8`` capsule, on the CPU or the CUDA device) and
    :meth:`numpy` (read-only arrays) lend it out."""

    @property
    def name(self) -> str:
        """The tensor's name."""
    @property
    def version(self) -> int:
        """The version received."""
    @property
    def dtype(self) -> str:
        """The dtype's name as the CLI spells it (``f32``, ``bf16``, ``set``, ...)."""
    @property
    def shape(self) -> list[int]:
        """The shape."""
    @property
    def nbytes(self) -> int:
        """Size in bytes."""
    @property
    def address(self) -> int:
        """Address of the first byte of the view this buffer's arrays share (host only)."""
    @property
    def mapped(self) -> bool:
        """Whether the view maps the node's memfd (no payload byte copied) rather than being
        a copy (4 MiB or less)."""
    @property
    def cuda_device(self) -> Optional[int]:
        """The CUDA device holding the bytes, or ``None`` for host memory."""
    def host_copy(self) -> np.ndarray[Any, Any]:
        """The bytes as a writable 1-D ``uint8`` array of the caller's own (a copy to host
        memory of a device tensor's)."""
    def numpy(self, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        """A read-only array of ``dtype`` over the bytes whose ``base`` is this buffer.
        ``TypeError`` for a dtype with Python objects, fields, a subarray or void items."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule over the bytes (1-D ``uint8``, CPU)."""
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCPU, 0)``."""

class Entry:
    """One line of ``ls``: a name's newest version."""

    name: str
    version: int
    dtype: str
    shape: list[int]
    size: int
    holders: int

class Event:
    """What a subscription reported about one name."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def dtype(self) -> Optional[str]: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def size(self) -> int: ...
    @property
    def skipped(self) -> int: ...
    @property
    def skipped_from(self) -> Optional[int]: ...
    @property
    def deleted(self) -> bool: ...
    def buffer(self) -> Optional[Buffer]:
        """The fetched bytes, if the node fetched them."""
    def set_members(
        self,
    ) -> Optional[tuple[int, list[tuple[str, Buffer]], dict[str, str]]]:
        """The members of a fetched set version."""

class Pushed:
    """A tensor another node pushed to this one."""

    @property
    def name(self) -> str: ...
    @property
    def sender(self) -> str:
        """The pushing node's id (hex)."""
    @property
    def buffer(self) -> Buffer: ...

class Subscription:
    """A live subscription."""

    @property
    def pattern(self) -> str: ...
    def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event (``None``: ended or closed); ``Timeout`` after ``timeout`` seconds."""
    def next_async(self, timeout: Optional[float] = None) -> Awaitable[Optional[Event]]:
        """:meth:`next` as an awaitable, completed from the runtime (cancelling it loses no
        event)."""
    def close(self) -> None:
        """Ends it at once, from any thread: a waiting ``next`` returns ``None``."""

class NodeHandle:
    """A node of the cluster in this process. Every method that waits has an ``*_async``
    twin with the same arguments returning an awaitable of the running event loop (the same
    work, run as a task on the runtime; cancelling the awaitable cancels it)."""

    @staticmethod
    def connect(
        join: Optional[str] = None,
        secret_file: Optional[str] = None,
        secret: Optional[str] = None,
        listen: Optional[str] = None,
        max_push_memory: Optional[int] = None,
        channels: Optional[str] = None,
    ) -> NodeHandle: ...
    @staticmethod
    def connect_async(
        join: Optional[str] = None,
        secret_file: Optional[str] = None,
        secret: Optional[str] = None,
        listen: Optional[str] = None,
        max_push_memory: Optional[int] = None,
        channels: Optional[str] = None,
    ) -> Awaitable[NodeHandle]: ...
    @property
    def id(self) -> str: ...
    @property
    def addr(self) -> str: ...
    @property
    def cuda_ipc_pulls(self) -> int:
        """Pulls into device memory this node made by CUDA IPC (gets, and call values)."""
    @property
    def closed(self) -> bool: ...
    def put(
        self,
        name: str,
        data: np.ndarray[Any, Any],
        dtype: str,
        shape: list[int],
        keep: Optional[int] = None,
    ) -> int: ...
    def put_cuda(
        self,
        name: str,
        tensor: Any,
        ordinal: int,
        dtype: str,
        shape: list[int],
        keep: Optional[int] = None,
    ) -> int: ...
    def get(
        self,
        name: str,
        version: Optional[int] = None,
        timeout: Optional[float] = None,
        device: Optional[int] = None,
    ) -> Buffer: ...
    def get_into(
        self,
        name: str,
        out: np.ndarray[Any, np.dtype[np.uint8]],
        dtype: str,
        shape: list[int],
        version: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> int:
        """Receives ``name`` into ``out``, the 1-D ``uint8`` view of an array's bytes;
        ``BufferError`` while another call receives into the same memory."""
    def put_set(
        self,
        prefix: str,
        members: list[tuple[str, np.ndarray[Any, Any], str, list[int]]],
        metadata: Optional[dict[str, str]] = None,
        keep: Optional[int] = None,
    ) -> int: ...
    def get_set(
        self, prefix: str, version: Optional[int] = None, timeout: Optional[float] = None
    ) -> tuple[int, list[tuple[str, Buffer]], dict[str, str]]: ...
    def ls(self, prefix: str = "") -> list[Entry]: ...
    def status(self) -> dict[str, Any]:
        """id, addr, broker, joined, tensors_held, bytes_held, brokers_answering, members,
        links (peer id, channel), versions_receiving, pushes_queued, push_bytes_held."""
    def subscribe(self, pattern: str) -> Subscription: ...
    def push(
        self, peer: str, name: str, data: np.ndarray[Any, Any], dtype: str, shape: list[int]
    ) -> None:
        """Sends ``data`` to the node at ``peer``; returns once it verified and queued it."""
    def recv(self, timeout: Optional[float] = None) -> Pushed:
        """The next tensor pushed to this node; ``Timeout`` after ``timeout`` seconds."""
    def close(self) -> None: ...
    def put_async(
        self,
        name: str,
        data: np.ndarray[Any, Any],
        dtype: str,
        shape: list[int],
        keep: Optional[int] = None,
    ) -> Awaitable[int]: ...
    def put_cuda_async(
        self,
        name: str,
        tensor: Any,
        ordinal: int,
        dtype: str,
        shape: list[int],
        keep: Optional[int] = None,
    ) -> Awaitable[int]: ...
    def get_async(
        self,
        name: str,
        version: Optional[int] = None,
        timeout: Optional[float] = None,
        device: Optional[int] = None,
    ) -> Awaitable[Buffer]: ...
    def get_into_async(
        self,
        name: str,
        out: np.ndarray[Any, np.dtype[np.uint8]],
        dtype: str,
        shape: list[int],
        version: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> Awaitable[int]: ...
    def put_set_async(
        self,
        prefix: str,
        members: list[tuple[str, np.ndarray[Any, Any], str, list[int]]],
        metadata: Optional[dict[str, str]] = None,
        keep: Optional[int] = None,
    ) -> Awaitable[int]: ...
    def get_set_async(
        self, prefix: str, version: Optional[int] = None, timeout: Optional[float] = None
    ) -> Awaitable[tuple[int, list[tuple[str, Buffer]], dict[str, str]]]: ...
    def ls_async(self, prefix: str = "") -> Awaitable[list[Entry]]: ...
    def status_async(self) -> Awaitable[dict[str, Any]]: ...
    def subscribe_async(self, pattern: str) -> Awaitable[Subscription]: ...
    def push_async(
        self, peer: str, name: str, data: np.ndarray[Any, Any], dtype: str, shape: list[int]
    ) -> Awaitable[None]: ...
    def recv_async(self, timeout: Optional[float] = None) -> Awaitable[Pushed]: ...
    def close_async(self) -> Awaitable[None]: ...

class LocalCluster:
    """A broker and ``workers`` worker nodes in this process."""

    def __init__(self, workers: int = 0) -> None: ...
    @property
    def ticket(self) -> str: ...
    @property
    def secret_file(self) -> str: ...
    @property
    def workers(self) -> list[str]: ...
    @property
    def closed(self) -> bool: ...
    @property
    def read_only_credential(self) -> str: ...
    def connect(
        self,
        listen: Optional[str] = None,
        max_push_memory: Optional[int] = None,
        read_only: bool = False,
        channels: Optional[str] = None,
    ) -> NodeHandle: ...
    def connect_async(
        self,
        listen: Optional[str] = None,
        max_push_memory: Optional[int] = None,
        read_only: bool = False,
        channels: Optional[str] = None,
    ) -> Awaitable[NodeHandle]: ...
    def close(self) -> None: ...
