"""The Python API: :func:`connect`, :class:`Client`, :class:`LocalCluster`, subscriptions.

Every call that waits (a transfer, a broker round trip, the next update) releases the GIL and
can be interrupted with Ctrl-C; copies of tensor bytes also run without the GIL.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from typing import Any, AsyncIterator, Callable, Iterator, Mapping

import numpy as np

from . import _convert, _native
from ._errors import Timeout


class Update:
    """A new version (or the deletion) of a name a subscription watches.

    Attributes: ``name``, ``version``, ``skipped`` (versions of this name published since the
    last update and not reported: the subscriber fell behind, only the newest is fetched),
    ``skipped_from`` (the first of them), ``deleted``, ``dtype``, ``shape``, ``size``.
    """

    __slots__ = ("_event", "_client", "_loaded")

    def __init__(self, event: _native.Event, client: Any, loaded: Any = None) -> None:
        self._event = event
        self._client = client
        # What an async subscription got itself when the node had not fetched it: a Buffer,
        # or a set's (version, members, metadata).
        self._loaded = loaded

    @property
    def name(self) -> str:
        """The tensor's name."""
        return self._event.name

    @property
    def version(self) -> int:
        """The new version (0 when the name was deleted)."""
        return self._event.version

    @property
    def skipped(self) -> int:
        """How many versions of this name before this one were not reported."""
        return self._event.skipped

    @property
    def skipped_from(self) -> int | None:
        """The first version not reported, if any."""
        return self._event.skipped_from

    @property
    def deleted(self) -> bool:
        """Whether the name was deleted (then there is no array)."""
        return self._event.deleted

    @property
    def dtype(self) -> str | None:
        """The dtype's name (``f32``, ``bf16``, ...), ``set`` for a tensor set."""
        return self._event.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape."""
        return tuple(self._event.shape)

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._event.size

    def buffer(self) -> _native.Buffer:
        """The received bytes (fetched by the subscription, else got now)."""
        if self.deleted:
            raise ValueError(f"{self.name!r} was deleted: no array")
        if isinstance(self._loaded, _native.Buffer):
            return self._loaded
        buf = self._event.buffer()
        if buf is None:
            buf = self._client._node.get(self.name, self.version)
        return buf

    def array(self) -> np.ndarray:
        """This version as a read-only numpy array (no copy). For a set, see :meth:`arrays`."""
        return _convert.to_numpy(self.buffer())

    def arrays(self) -> dict[str, np.ndarray]:
        """The members of this version of a set (``put_many``), key to read-only array, all
        of this one version (no copy)."""
        return {k: _convert.to_numpy(b) for k, b in self._set_members()}

    def tensors(self) -> dict[str, Any]:
        """The members of this version of a set as torch tensors (no copy of the payload;
        private views: in-place ops change only them)."""
        return {k: _convert.to_torch(b) for k, b in self._set_members()}

    def _set_members(self) -> list[tuple[str, _native.Buffer]]:
        if self.dtype != "set":
            raise TypeError(f"{self.name!r} is a {self.dtype} tensor, not a set: use .array()")
        got = self._loaded if isinstance(self._loaded, tuple) else self._event.set_members()
        if got is None:
            got = self._client._node.get_set(self.name, self.version)
        return got[1]

    def tensor(self) -> Any:
        """This version as a torch tensor (no copy of the payload; a private view: in-place ops
        change only it)."""
        return _convert.to_torch(self.buffer())

    def __repr__(self) -> str:
        if self.deleted:
            return f"Update(name={self.name!r}, deleted=True)"
        return f"Update(name={self.name!r}, version={self.version}, skipped={self.skipped})"


class Received:
    """A tensor another node pushed to this one (:meth:`Client.push`), as :meth:`Client.recv`
    returns it: ``name`` (the name the sender gave it), ``sender`` (the pushing node's id),
    ``dtype``, ``shape``, ``size``; its bytes through :meth:`array`, :meth:`tensor`,
    :meth:`buffer`. The bytes were verified against the sender's hash before it was queued.
    """

    __slots__ = ("_pushed",)

    def __init__(self, pushed: _native.Pushed) -> None:
        self._pushed = pushed

    @property
    def name(self) -> str:
        """The name the sender gave it."""
        return self._pushed.name

    @property
    def sender(self) -> str:
        """The pushing node's id."""
        return self._pushed.sender

    @property
    def dtype(self) -> str:
        """The dtype's name (``f32``, ``bf16``, ...)."""
        return self._pushed.buffer.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape."""
        return tuple(self._pushed.buffer.shape)

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._pushed.buffer.nbytes

    def buffer(self) -> _native.Buffer:
        """The received bytes as the package's :class:`Buffer`."""
        return self._pushed.buffer

    def array(self) -> np.ndarray:
        """The tensor as a read-only numpy array (no copy)."""
        return _convert.to_numpy(self._pushed.buffer)

    def tensor(self) -> Any:
        """The tensor as a torch tensor (no copy of the payload; a private view: in-place ops
        change only it)."""
        return _convert.to_torch(self._pushed.buffer)

    def __repr__(self) -> str:
        return f"Received(name={self.name!r}, sender={self.sender[:10]!r}, shape={self.shape})"


class Subscription:
    """The updates of the names matching a pattern, in increasing version order per name.

    Iterate it (``for u in sub``) or ``async for u in sub``; ``next(timeout=)`` waits for one.
    Use it as a context manager, or ``close()`` it, to end it.
    """

    def __init__(self, sub: _native.Subscription, client: Client) -> None:
        self._sub = sub
        self._client = client

    @property
    def pattern(self) -> str:
        """The pattern watched."""
        return self._sub.pattern

    def next(self, timeout: float | None = None) -> Update:
        """The next update; ``Timeout`` after ``timeout`` seconds (the subscription goes on);
        ``StopIteration`` once it ended or was closed (a :meth:`close` from another thread
        ends a waiting call at once)."""
        event = self._sub.next(timeout)
        if event is None:
            raise StopIteration
        return Update(event, self._client)

    def __iter__(self) -> Iterator[Update]:
        return self

    def __next__(self) -> Update:
        return self.next()

    def __aiter__(self) -> AsyncIterator[Update]:
        return self

    async def __anext__(self) -> Update:
        event = await self._sub.next_async()
        if event is None:
            raise StopAsyncIteration
        return Update(event, self._client)

    def close(self) -> None:
        """Ends the subscription, from any thread: an iteration waiting for the next update
        (in another thread, or ``async for``) ends at once. Idempotent."""
        self._sub.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """A node of the cluster running in this process: publishes, gets, lists and watches
    tensors by name. Make one with :func:`connect` or :meth:`LocalCluster.connect`.

    What it publishes it holds and serves to other nodes until a newer version replaces it
    (the newest 2 by default, see ``put(keep=)``) or the client closes.
    """

    def __init__(self, node: _native.NodeHandle) -> None:
        self._node = node
        self._calls_handle: Any = None
        self._shared: list[Any] = []
        self._serving: list[tuple[Any, Any]] = []
        self._pool: Any = None
        self._lock = threading.Lock()

    # Remote functions (see tensor_broker._functions).

    def _calls(self) -> Any:
        with self._lock:
            if self._calls_handle is None:
                self._calls_handle = self._node.calls()
            return self._calls_handle

    def _executor(self) -> Any:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=64, thread_name_prefix="tb-call"
                )
            return self._pool

    def share(
        self,
        name: str,
        *,
        concurrency: int = 1,
        queue: int = 64,
        read_only_callers: bool = False,
        idempotent: bool = False,
        resumable: bool = False,
        torch: bool = False,
        inputs: bool | None = None,
    ) -> Callable[[Callable], Callable]:
        """Decorates a handler to serve as function ``name`` while this client serves
        (``with client.serving():`` or ``client.serve()``). ``concurrency`` calls run at once
        (in as many threads), ``queue`` more wait; beyond that callers get ``Overloaded``. A
        generator (sync or async) streams its items; a coroutine function runs on an event
        loop of its own. ``read_only_callers`` admits callers with a read-only credential;
        ``idempotent`` lets callers retry a call whose server was lost. ``resumable`` (a
        generator taking a ``start=`` keyword, the index of its first item) lets a caller
        whose server died mid-stream start it again elsewhere from the next item. ``torch``
        hands the handler torch tensors instead of numpy arrays. ``inputs`` makes a
        bidirectional function: a generator whose first parameter is an iterator of the
        caller's inputs (an async iterator for an async generator), which yields its results
        as it takes them, the way a streaming server's ``process`` transforms each tensor;
        callers send the inputs with ``f.stream(..., inputs=iterable)``. By default a
        generator whose first parameter is annotated as an ``Iterator``, ``Iterable``,
        ``AsyncIterator`` or ``AsyncIterable`` takes inputs. Returns the handler unchanged."""
        from ._functions import Shared

        def register(func: Callable) -> Callable:
            shared = Shared(
                name, func, concurrency, queue, read_only_callers, idempotent, torch, resumable,
                inputs,
            )
            self._shared.append(shared)
            if self._serving:
                self._serve_one(shared)
            return func

        return register

    def _serve_one(self, shared: Any) -> None:
        handle = self._calls().serve(
            shared.name,
            shared.native_handler(),
            shared.concurrency,
            shared.queue,
            shared.read_only_callers,
            shared.idempotent,
            shared.streaming,
            shared.resumable,
            shared.inputs,
        )
        self._serving.append((shared, handle))

    @contextlib.contextmanager
    def serving(self) -> Iterator[Client]:
        """Serves every shared function until the block ends, then unserves them: new calls go
        to other servers, and those admitted here finish first (a drain)."""
        if not self._shared:
            raise ValueError("nothing to serve: decorate a handler with @client.share(name) first")
        try:
            for shared in self._shared:
                self._serve_one(shared)
            yield self
        finally:
            self._unserve()

    def _unserve(self) -> None:
        serving, self._serving = self._serving, []
        for shared, handle in serving:
            handle.stop()
            shared.stop()

    def serve(self) -> None:
        """Serves every shared function until Ctrl-C (or SIGTERM), then drains and returns."""
        import signal

        stop = threading.Event()
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            with self.serving():
                while not stop.wait(0.2):
                    pass
        except KeyboardInterrupt:
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def function(self, name: str, *, idempotent: bool = False) -> Any:
        """A handle to call function ``name`` wherever the cluster serves it (see
        :class:`tensor_broker.Function`). ``idempotent`` lets a call whose server was lost be
        retried on another server."""
        from ._functions import Function

        return Function(self, name, idempotent)

    def functions(self, prefix: str = "") -> list[tuple[str, int]]:
        """The functions served in the cluster under ``prefix``: ``(name, servers)`` pairs."""
        return self._calls().functions(prefix)

    @property
    def id(self) -> str:
        """This node's id."""
        return self._node.id

    @property
    def addr(self) -> str:
        """This node's address, ``<node-id>@<ip:port>``."""
        return self._node.addr

    def put(self, name: str, array: Any, *, keep: int | None = None) -> int:
        """Publishes ``array`` as the next version of ``name`` and returns that version.

        ``array``: a numpy array of any supported dtype (bf16/f8 through ``ml_dtypes``), a
        torch tensor, or any object with ``__dlpack__``; C-contiguous (else ``ValueError``:
        pass ``numpy.ascontiguousarray(a)``). Its bytes are copied once (GIL released), so
        changing the array afterwards does not change the version. A CUDA torch tensor is
        copied device to device (after every stream of its device is synchronized, so whichever
        stream produced it has finished) and the
        node keeps and serves it from device memory (same-host peers pulling to a device get
        it by CUDA IPC); that needs a build with CUDA (``Unavailable`` otherwise). ``keep``: how many
        versions of this name this node keeps and serves (default 2; the brokers offer the
        newest 2 of a name, so more only helps readers of this node's own store).
        """
        cuda = _convert.cuda_tensor(array)
        if cuda is not None:
            flat, dtype, shape, ordinal = cuda
            return self._node.put_cuda(name, flat, ordinal, dtype, list(shape), keep)
        data, dtype, shape = _convert.to_bytes(array)
        return self._node.put(name, data, dtype, list(shape), keep)

    def get(
        self,
        name: str,
        version: int | None = None,
        *,
        timeout: float | None = None,
        out: Any = None,
    ) -> np.ndarray:
        """Gets ``version`` (default: the newest) of ``name`` as a numpy array.

        Without ``out``: a read-only array over the received bytes (no copy after the
        transfer; its ``base`` is the package's :class:`Buffer`; freed when the array and the
        node's copy are gone). With ``out`` (a writable C-contiguous array, or CPU torch
        tensor, of the same dtype and shape): the bytes are received straight into it (over
        QUIC; a same-host transfer or a version this node holds is copied in once) and
        ``out`` is returned; this node then does not keep or serve the version. A tensor of
        another dtype or shape is refused before anything is written; if the call fails or is
        interrupted mid-transfer, ``out`` holds part of the bytes. An ``out`` (or a view of
        it) that another call is receiving into at the same time is refused with
        ``BufferError`` before anything is written: give each concurrent get its own array.
        ``timeout``: seconds for the whole call (``Timeout`` past it).
        """
        if out is None:
            return _convert.to_numpy(self._node.get(name, version, timeout))
        arr, dtype, shape = _convert.check_out(out)
        self._node.get_into(name, arr, dtype, list(shape), version, timeout)
        return out

    def get_buffer(
        self, name: str, version: int | None = None, *, timeout: float | None = None
    ) -> _native.Buffer:
        """Gets ``name`` as the package's :class:`Buffer` (buffer protocol and DLPack)."""
        return self._node.get(name, version, timeout)

    def get_torch(
        self,
        name: str,
        version: int | None = None,
        *,
        timeout: float | None = None,
        device: Any = None,
    ) -> Any:
        """Gets ``name`` as a torch tensor through DLPack, without a copy.

        ``device``: ``None``/``"cpu"`` for host memory, or ``"cuda"``, ``"cuda:N"``, a torch
        device or an ordinal: the tensor on that CUDA device, received into device memory
        (device to device by CUDA IPC from a holder on this host that keeps it on a GPU;
        over the shm channel and one copy up from a same-host holder that keeps it in host
        memory; through pinned staging from others; this node does not keep that copy), or this
        node's own device copy after its ``put`` of a CUDA tensor. ``Unavailable`` without
        CUDA. The tensor is a private view (host: copy-on-write, no copy of the payload;
        device: the memory it was received into, or a private device copy of this node's
        own): changing it in place never changes what this node holds and serves to others.
        """
        ordinal = _convert.cuda_ordinal(device)
        return _convert.to_torch(self._node.get(name, version, timeout, ordinal))

    def put_many(
        self,
        prefix: str,
        mapping: Mapping[str, Any],
        *,
        metadata: Mapping[str, str] | None = None,
        keep: int | None = None,
    ) -> int:
        """Publishes ``mapping`` (key to array or tensor, e.g. a ``state_dict()``) as the next
        version of the set ``prefix``, atomically: readers get every member of one version,
        never a mix. Returns the version. Keys become ``prefix/key`` names (``.``, ``/``,
        ``-``, ``_``, ``:`` and alphanumerics). The same sets as ``tb put`` of a whole
        ``.safetensors`` file; ``metadata`` is its ``__metadata__``."""
        members, meta = _convert.set_members(mapping, metadata)
        return self._node.put_set(prefix, members, meta, keep)

    def get_many(
        self, prefix: str, version: int | None = None, *, timeout: float | None = None
    ) -> dict[str, np.ndarray]:
        """Gets ``version`` (default: the newest) of the set ``prefix`` as a dict of key to
        read-only numpy array, every member of that one version (no copy after the transfer:
        the arrays are slices of the one received buffer)."""
        _, members, _ = self._node.get_set(prefix, version, timeout)
        return {k: _convert.to_numpy(b) for k, b in members}

    def get_many_torch(
        self, prefix: str, version: int | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """:meth:`get_many` as torch tensors (private copy-on-write views, no copy of the
        payload: an optimizer may update them in place), ready for
        ``model.load_state_dict``."""
        _, members, _ = self._node.get_set(prefix, version, timeout)
        return {k: _convert.to_torch(b) for k, b in members}

    def get_set(
        self, prefix: str, version: int | None = None, *, timeout: float | None = None
    ) -> tuple[int, dict[str, np.ndarray], dict[str, str]]:
        """:meth:`get_many` with the version received and the set's metadata."""
        v, members, meta = self._node.get_set(prefix, version, timeout)
        return v, {k: _convert.to_numpy(b) for k, b in members}, meta

    def subscribe(self, pattern: str) -> Subscription:
        """Watches ``pattern`` (a name, ``prefix/*`` or ``*``): every version published from
        now on comes as an :class:`Update`, in order per name. It returns once a broker has
        registered the subscription, so a version published right after is never missed; a
        broker that refuses it (this node holds too many subscriptions there) raises
        ``Unavailable`` here."""
        return Subscription(self._node.subscribe(pattern), self)

    def push(self, peer_addr: str, name: str, array: Any) -> None:
        """Sends ``array`` (as for :meth:`put`, host memory) straight to the node at
        ``peer_addr`` (its :attr:`addr`, ``<node-id>@<ip:port>``) under ``name``, over the
        pair's data channel (shared memory on one host: up to 4 MiB the bytes go from the
        array straight to the peer's socket, hashed on the way, with no copy of this node's).
        Returns once that node has verified the bytes against their hash and queued them for
        its :meth:`recv`. Keep the array unchanged until it returns. No broker is
        involved and nothing is published. Refused (``Unavailable``) when the receiver's
        queue or byte budget is full; a read-only member may push only to nodes that accept
        read-only pushes."""
        data, dtype, shape = _convert.to_bytes(array)
        self._node.push(peer_addr, name, data, dtype, list(shape))

    def recv(self, timeout: float | None = None) -> Received:
        """The next tensor pushed to this node (oldest first), waiting at most ``timeout``
        seconds (``Timeout`` then) or forever (Ctrl-C interrupts)."""
        return Received(self._node.recv(timeout))

    async def arecv(self, timeout: float | None = None) -> Received:
        """:meth:`recv` as a coroutine (completed from the runtime, no executor thread;
        cancelling it takes nothing from the queue)."""
        return Received(await self._node.recv_async(timeout))

    async def aincoming(self, timeout: float | None = None) -> AsyncIterator[Received]:
        """:meth:`incoming` for ``async for``."""
        while True:
            try:
                yield await self.arecv(timeout)
            except Timeout:
                return

    def incoming(self, timeout: float | None = None) -> Iterator[Received]:
        """The tensors pushed to this node, as they arrive; ends when ``timeout`` seconds pass
        without one (runs forever without ``timeout``)."""
        while True:
            try:
                yield self.recv(timeout)
            except Timeout:
                return

    def ls(self, prefix: str = "") -> list[_native.Entry]:
        """The live names starting with ``prefix``: entries with ``name``, ``version``,
        ``dtype``, ``shape``, ``size`` (bytes) and ``holders``."""
        return self._node.ls(prefix)

    def status(self) -> dict[str, Any]:
        """This node (id, address, broker, what it holds) and the cluster's members."""
        return self._node.status()

    def close(self) -> None:
        """Stops this node: what it published is no longer served from here. Idempotent."""
        if self._serving:
            self._unserve()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._node.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._node.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(addr={self.addr!r})"


def connect(
    join: str | None = None,
    *,
    secret_file: str | os.PathLike[str] | None = None,
    secret: str | None = None,
    listen: str | None = None,
    max_push_memory: int | None = None,
    channels: str | None = None,
) -> Client:
    """Starts a node in this process that joins a cluster, and returns its :class:`Client`.

    ``join``: a cluster ticket (``tbc1:...``). Without it, the cluster is found as the ``tb``
    CLI finds it: ``TB_JOIN``, else the ticket of a ``tb up`` running on this machine.
    ``secret_file`` (else ``TB_CLUSTER_SECRET_FILE``, else ``tb up``'s own when its ticket is
    used) or ``secret``: the cluster secret. ``listen``: the ``ip:port`` the node serves
    from (default ``127.0.0.1:<free port>``; give a routable address to serve other machines).
    ``max_push_memory``: most bytes tensors pushed to this node (:meth:`Client.push`) may
    hold while received or queued for :meth:`Client.recv` (default: a quarter of the
    machine's memory); a push that does not fit is refused at once (``Unavailable``, or
    ``InvalidArgument`` when larger than the whole budget). ``channels``: the data channels
    the node runs, best first, as ``tb-worker --channels`` takes them (``"shm,quic"``, the
    default; ``"quic"``: QUIC only, as between hosts; ``"tcp,quic"``); else ``TB_CHANNELS``.
    Each transfer with a peer uses the first channel both run; QUIC is always run.
    """
    path = os.fspath(secret_file) if secret_file is not None else None
    return Client(
        _native.NodeHandle.connect(join, path, secret, listen, max_push_memory, channels)
    )


class LocalCluster:
    """A broker (and ``workers`` worker nodes) in this process on free 127.0.0.1 ports, with
    a fresh secret: a cluster for a notebook or a test. Use it as a context manager.

    Other processes join it with ``connect(cluster.ticket, secret_file=cluster.secret_file)``.
    """

    def __init__(self, workers: int = 0) -> None:
        self._cluster = _native.LocalCluster(workers)

    @property
    def ticket(self) -> str:
        """The cluster ticket (``tbc1:...``)."""
        return self._cluster.ticket

    @property
    def secret_file(self) -> str:
        """The file holding the cluster secret (removed with the cluster)."""
        return self._cluster.secret_file

    @property
    def workers(self) -> list[str]:
        """The worker nodes' addresses."""
        return self._cluster.workers

    @property
    def read_only_credential(self) -> str:
        """The cluster's read-only credential, for ``connect(secret=...)``: such a client may
        get, list and watch, not publish or push to read-write nodes."""
        return self._cluster.read_only_credential

    def connect(
        self,
        *,
        listen: str | None = None,
        max_push_memory: int | None = None,
        read_only: bool = False,
        channels: str | None = None,
    ) -> Client:
        """A client of this cluster in this process (``read_only``: with the read-only
        credential; the other arguments as for :func:`connect`)."""
        return Client(self._cluster.connect(listen, max_push_memory, read_only, channels))

    async def connect_async(
        self,
        *,
        listen: str | None = None,
        max_push_memory: int | None = None,
        read_only: bool = False,
        channels: str | None = None,
    ) -> Any:
        """:meth:`connect` for asyncio: a :class:`tensor_broker.asyncio.AsyncClient`."""
        from .asyncio import AsyncClient

        native = await self._cluster.connect_async(listen, max_push_memory, read_only, channels)
        return AsyncClient(native)

    def close(self) -> None:
        """Stops the workers and the broker. Idempotent."""
        self._cluster.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalCluster(ticket={self.ticket!r})"
