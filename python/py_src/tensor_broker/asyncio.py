"""``tensor_broker.asyncio``: the client API as coroutines, for asyncio programs.

>>> import asyncio, numpy as np, tensor_broker as tb, tensor_broker.asyncio as tba
>>> async def main(ticket, secret_file):
...     async with await tba.connect(ticket, secret_file=secret_file) as client:
...         await client.put("w", np.ones(4, np.float32))
...         async with client.subscribe("w") as sub:
...             async for update in sub:
...                 print(update.version, update.array())

:func:`connect` (and :meth:`tensor_broker.LocalCluster.connect_async`) returns an
:class:`AsyncClient` with the methods of :class:`tensor_broker.Client` as coroutines. Each
call runs as a task on the package's runtime (the same code as the blocking call) and
completes an asyncio-compatible future through the event loop (a socket the loop watches;
the awaiting task's next step runs as the loop reads it): no executor thread per call, no
polling. Cancelling the awaiting task (``task.cancel()``,
``asyncio.timeout``, ``wait_for``) cancels the call at once: a transfer in flight is dropped,
the bytes it held against budgets are released, nothing partial is kept, and a cancelled
``recv`` or subscription read takes nothing from its queue.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any, AsyncIterator, Generator, Mapping

import numpy as np

from . import _convert, _native
from ._client import Received, Update
from ._errors import Timeout

__all__ = ["connect", "AsyncClient", "AsyncSubscription"]


async def connect(
    join: str | None = None,
    *,
    secret_file: str | os.PathLike[str] | None = None,
    secret: str | None = None,
    listen: str | None = None,
    max_push_memory: int | None = None,
    channels: str | None = None,
) -> AsyncClient:
    """Starts a node in this process that joins a cluster; the arguments are those of
    :func:`tensor_broker.connect`. Use the client with ``async with``."""
    path = os.fspath(secret_file) if secret_file is not None else None
    return AsyncClient(
        await _native.NodeHandle.connect_async(
            join, path, secret, listen, max_push_memory, channels
        )
    )


class AsyncSubscription:
    """The updates of the names matching a pattern, for ``async for``; made by
    :meth:`AsyncClient.subscribe` (``async with client.subscribe(p) as sub`` or
    ``sub = await client.subscribe(p)``)."""

    def __init__(self, sub: _native.Subscription, client: AsyncClient) -> None:
        self._sub = sub
        self._client = client

    @property
    def pattern(self) -> str:
        """The pattern watched."""
        return self._sub.pattern

    async def next(self, timeout: float | None = None) -> Update:
        """The next update, its bytes in hand; ``Timeout`` after ``timeout`` seconds (the
        subscription goes on); ``StopAsyncIteration`` once it ended or was closed."""
        event = await self._sub.next_async(timeout)
        if event is None:
            raise StopAsyncIteration
        loaded = None
        if not event.deleted and event.buffer() is None:
            # The node did not fetch it (auto-fetch off, or the fetch failed): get it here,
            # so the update's accessors never block the event loop.
            node = self._client._node
            if event.dtype == "set":
                loaded = await node.get_set_async(event.name, event.version)
            else:
                loaded = await node.get_async(event.name, event.version)
        return Update(event, self._client, loaded)  # type: ignore[arg-type]

    def __aiter__(self) -> AsyncIterator[Update]:
        return self

    # ``async for``'s step is `next` itself (no coroutine around it).
    __anext__ = next

    def close(self) -> None:
        """Ends the subscription: an ``async for`` waiting on it ends at once. Idempotent."""
        self._sub.close()

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class _Subscribing:
    """What :meth:`AsyncClient.subscribe` returns: await it for the subscription, or use it
    with ``async with`` (closed on exit)."""

    def __init__(self, client: AsyncClient, pattern: str) -> None:
        self._client = client
        self._pattern = pattern
        self._sub: AsyncSubscription | None = None

    async def _open(self) -> AsyncSubscription:
        native = await self._client._node.subscribe_async(self._pattern)
        self._sub = AsyncSubscription(native, self._client)
        return self._sub

    def __await__(self) -> Generator[Any, None, AsyncSubscription]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncSubscription:
        return await self._open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sub is not None:
            self._sub.close()


class AsyncClient:
    """A node of the cluster running in this process, driven from asyncio: the methods of
    :class:`tensor_broker.Client` as coroutines (same arguments, same results, same errors).
    Use it with ``async with`` (closed on exit)."""

    def __init__(self, node: _native.NodeHandle) -> None:
        self._node = node
        self._calls_handle: Any = None

    def _calls(self) -> Any:
        if self._calls_handle is None:
            self._calls_handle = self._node.calls()
        return self._calls_handle

    def function(self, name: str, *, idempotent: bool = False) -> Any:
        """A handle to call function ``name``: ``await f(...)`` and
        ``async for x in f.stream(...)``. Cancelling the awaiting task cancels the call on its
        server."""
        from ._functions import AsyncFunction

        return AsyncFunction(self, name, idempotent)

    @property
    def id(self) -> str:
        """This node's id."""
        return self._node.id

    @property
    def addr(self) -> str:
        """This node's address, ``<node-id>@<ip:port>``: what peers :meth:`push` to."""
        return self._node.addr

    async def put(self, name: str, array: Any, *, keep: int | None = None) -> int:
        """:meth:`tensor_broker.Client.put`: publishes ``array`` as the next version of
        ``name``; returns the version."""
        cuda = _convert.cuda_tensor(array)
        if cuda is not None:
            flat, dtype, shape, ordinal = cuda
            return await self._node.put_cuda_async(name, flat, ordinal, dtype, list(shape), keep)
        data, dtype, shape = _convert.to_bytes(array)
        return await self._node.put_async(name, data, dtype, list(shape), keep)

    async def get(
        self,
        name: str,
        version: int | None = None,
        *,
        timeout: float | None = None,
        out: Any = None,
    ) -> np.ndarray:
        """:meth:`tensor_broker.Client.get`: ``version`` (default the newest) of ``name`` as a
        read-only numpy array, or received into ``out``."""
        if out is None:
            return _convert.to_numpy(await self._node.get_async(name, version, timeout))
        arr, dtype, shape = _convert.check_out(out)
        await self._node.get_into_async(name, arr, dtype, list(shape), version, timeout)
        return out

    async def get_buffer(
        self, name: str, version: int | None = None, *, timeout: float | None = None
    ) -> _native.Buffer:
        """``name`` as the package's :class:`Buffer`."""
        return await self._node.get_async(name, version, timeout)

    async def get_torch(
        self,
        name: str,
        version: int | None = None,
        *,
        timeout: float | None = None,
        device: Any = None,
    ) -> Any:
        """:meth:`tensor_broker.Client.get_torch`: ``name`` as a torch tensor (no copy)."""
        ordinal = _convert.cuda_ordinal(device)
        return _convert.to_torch(await self._node.get_async(name, version, timeout, ordinal))

    async def put_many(
        self,
        prefix: str,
        mapping: Mapping[str, Any],
        *,
        metadata: Mapping[str, str] | None = None,
        keep: int | None = None,
    ) -> int:
        """:meth:`tensor_broker.Client.put_many`: ``mapping`` as the next version of the set
        ``prefix``, atomically; returns the version."""
        members, meta = _convert.set_members(mapping, metadata)
        return await self._node.put_set_async(prefix, members, meta, keep)

    async def get_many(
        self, prefix: str, version: int | None = None, *, timeout: float | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`tensor_broker.Client.get_many`: every member of one version of a set."""
        _, members, _ = await self._node.get_set_async(prefix, version, timeout)
        return {k: _convert.to_numpy(b) for k, b in members}

    async def get_many_torch(
        self, prefix: str, version: int | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """:meth:`get_many` as torch tensors."""
        _, members, _ = await self._node.get_set_async(prefix, version, timeout)
        return {k: _convert.to_torch(b) for k, b in members}

    async def get_set(
        self, prefix: str, version: int | None = None, *, timeout: float | None = None
    ) -> tuple[int, dict[str, np.ndarray], dict[str, str]]:
        """:meth:`get_many` with the version received and the set's metadata."""
        v, members, meta = await self._node.get_set_async(prefix, version, timeout)
        return v, {k: _convert.to_numpy(b) for k, b in members}, meta

    def subscribe(self, pattern: str) -> _Subscribing:
        """Watches ``pattern``: ``async with client.subscribe(p) as sub: async for u in
        sub: ...``, or ``sub = await client.subscribe(p)``."""
        return _Subscribing(self, pattern)

    async def push(self, peer_addr: str, name: str, array: Any) -> None:
        """:meth:`tensor_broker.Client.push`: sends ``array`` to the node at ``peer_addr``;
        returns once that node verified and queued it."""
        data, dtype, shape = _convert.to_bytes(array)
        await self._node.push_async(peer_addr, name, data, dtype, list(shape))

    async def recv(self, timeout: float | None = None) -> Received:
        """The next tensor pushed to this node; ``Timeout`` after ``timeout`` seconds.
        Cancelling the wait takes nothing from the queue."""
        return Received(await self._node.recv_async(timeout))

    # The sync API's name for the same call, as redis.asyncio keeps its names.
    arecv = recv

    async def incoming(self, timeout: float | None = None) -> AsyncIterator[Received]:
        """``async for r in client.incoming()``: the tensors pushed to this node as they
        arrive; ends when ``timeout`` seconds pass without one (never without ``timeout``)."""
        while True:
            try:
                yield await self.recv(timeout)
            except Timeout:
                return

    def __aiter__(self) -> AsyncIterator[Received]:
        """``async for r in client``: :meth:`incoming` without a timeout."""
        return self.incoming()

    async def ls(self, prefix: str = "") -> list[_native.Entry]:
        """The live names starting with ``prefix``."""
        return await self._node.ls_async(prefix)

    async def status(self) -> dict[str, Any]:
        """This node, its links' channels, and the cluster's members."""
        return await self._node.status_async()

    async def close(self) -> None:
        """Stops this node. Idempotent."""
        await self._node.close_async()

    aclose = close

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._node.closed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient(addr={self.addr!r})"
