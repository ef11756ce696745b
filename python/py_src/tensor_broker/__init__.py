"""tensor_broker: numpy and torch tensors by name across processes and machines.

A thin layer over tensor-broker's Rust node (``tb-node``): each :class:`Client` runs a node
in this process that joins a cluster of brokers, publishes tensors (``put``), gets them by
name from whichever node holds them (``get``, verified by BLAKE3 hash, zero-copy into numpy
or torch), lists (``ls``) and watches them (``subscribe``).

>>> import numpy as np, tensor_broker as tb
>>> with tb.LocalCluster() as cluster, cluster.connect() as client:
...     v = client.put("model/w", np.arange(6, dtype=np.float32).reshape(2, 3))
...     client.get("model/w").sum()
np.float32(15.0)

Processes and threads: one runtime per process, shared by every client. The GIL is released
while a call waits or copies, and Ctrl-C interrupts a waiting call. After ``os.fork()`` the
child must not use clients (or the runtime) its parent made: every call there raises
:class:`TensorBrokerError` at once (the runtime's threads did not survive the fork). Connect
in the child, or use ``multiprocessing``'s ``spawn`` start method.
"""

from __future__ import annotations

from ._client import Client, LocalCluster, Received, Subscription, Update, connect
from ._errors import (
    InvalidArgument,
    NotFound,
    Overloaded,
    RemoteError,
    ServerLost,
    TensorBrokerError,
    Timeout,
    Unauthorized,
    Unavailable,
)
from ._functions import Function, Ref, cancelled
from ._native import CUDA_COMPILED, Buffer, Entry
from ._stream import Stream

__all__ = [
    "connect",
    "Client",
    "LocalCluster",
    "Subscription",
    "Update",
    "Received",
    "Buffer",
    "Entry",
    "TensorBrokerError",
    "NotFound",
    "Unauthorized",
    "Timeout",
    "Unavailable",
    "InvalidArgument",
    "RemoteError",
    "Overloaded",
    "ServerLost",
    "Function",
    "Ref",
    "Stream",
    "cancelled",
    "CUDA_COMPILED",
]
