"""``tb.Stream``: data-loading streams composed and run in Rust.

A stream's stages (streaming calls, subscriptions, remote maps, interleaving, prefetching,
batching) run on the process's runtime without the GIL; Python is entered only to read a
Python iterable given as a source, to run a Python function given to ``map``, and to hand
each item to the consumer. Consume it with ``for`` (the GIL is released while waiting,
Ctrl-C interrupts) or ``async for`` (awaited on the running event loop, no thread).

>>> batches = (
...     tb.Stream.interleave(*(tb.Stream.call(client.function(f"load/{i}"), epoch=0)
...                            for i in range(4)))
...     .batch(32)
...     .prefetch(4)
... )
>>> async for x, y in batches: ...

Memory: nothing runs ahead of the consumer but each ``prefetch(k)`` stage (``k`` items),
each ``map``'s ``parallel`` items in flight, and each streaming call's own ``prefetch`` on
its server; so a stalled consumer holds at most the sum of those.

A combinator takes over the stream it is called on (as a Rust iterator moved into an
adapter): read the stream it returns; the one it was called on raises ``ValueError`` if
used again. The first error ends a stream: it is raised once (a Python source's or
function's own exception as it was raised, a remote function's as ``RemoteError``), then
the stream is over.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterable, Iterator

from ._functions import AsyncFunction, Function, _decode, _encode, _pack, _uses_torch
from ._native import StreamHandle


class Stream:
    """A stream of items (numpy arrays, or torch tensors after :meth:`as_torch`; lists and
    dicts of them; plain numbers and strings), built from a source:

    - ``Stream(iterable)``: a Python iterable's items, read on a thread of its own, one
      item ahead (a CUDA tensor among them is copied to host memory, as in calls);
    - :meth:`Stream.call`: a streaming function's items;
    - :meth:`Stream.subscribe`: the tensor of each new version of matching names;
    - :meth:`Stream.interleave`: the items of several streams as they come.
    """

    def __init__(self, source: Iterable[Any] | StreamHandle | "Stream", *, torch: bool = False) -> None:
        if isinstance(source, Stream):
            self._handle, self._torch = source._handle, source._torch or torch
            return
        self._torch = torch
        if isinstance(source, StreamHandle):
            self._handle = source
            return
        if not hasattr(source, "__iter__"):
            raise TypeError(f"a Stream's source is an iterable, not a {type(source).__name__}")
        items = iter(source)
        self._handle = StreamHandle.iterate(_encode(x) for x in items)

    def __repr__(self) -> str:
        return f"Stream(torch={self._torch})"

    @classmethod
    def call(cls, function: Function | AsyncFunction, *args: Any, prefetch: int = 2,
             **kwargs: Any) -> "Stream":
        """The items of streaming function ``function`` called with ``args`` and ``kwargs``
        (its server runs at most ``prefetch`` items ahead). Closing or dropping the stream
        cancels the call. Items are torch tensors when an argument is one."""
        if not isinstance(function, (Function, AsyncFunction)):
            raise TypeError("Stream.call takes a function handle: client.function(name)")
        torch = _uses_torch(args) or _uses_torch(kwargs)
        handle = StreamHandle.call(
            function._client._calls(), function.name, _pack(args, kwargs), max(1, prefetch)
        )
        return cls(handle, torch=torch)

    @classmethod
    def subscribe(cls, client: Any, pattern: str) -> "Stream":
        """The tensor of each version published under ``pattern`` (a name, ``prefix/*`` or
        ``*``) from now on, as the subscription fetched it. Versions the subscription
        skipped (it fell behind) and deletes yield nothing."""
        return cls(StreamHandle.subscribe(client._node, pattern))

    @classmethod
    def interleave(cls, *streams: "Stream") -> "Stream":
        """The items of every stream, each as soon as it comes (no stream waits for
        another)."""
        if not streams:
            raise ValueError("interleave needs at least one stream")
        streams = tuple(s if isinstance(s, Stream) else Stream(s) for s in streams)
        handle = StreamHandle.interleave([s._handle for s in streams])
        return cls(handle, torch=any(s._torch for s in streams))

    def map(self, fn: Function | AsyncFunction | Callable[[Any], Any], parallel: int = 1,
            ordered: bool = True, timeout: float | None = None) -> "Stream":
        """Each item through ``fn``, ``parallel`` at a time, in the items' order (or as they
        finish with ``ordered=False``). A function handle (``client.function(name)``) is
        called remotely with the item as its one argument, spread over its servers; a
        Python callable runs on the runtime's worker threads (the GIL taken per item: give
        it numpy or torch work that releases the GIL for ``parallel`` to help)."""
        if isinstance(fn, (Function, AsyncFunction)):
            handle = self._handle.map_call(
                fn._client._calls(), fn.name, parallel, ordered, timeout, fn.idempotent
            )
            return Stream(handle, torch=self._torch)
        if not callable(fn):
            raise TypeError(f"map takes a function handle or a callable, not a {type(fn).__name__}")
        torch = self._torch

        def local(item: Any) -> Any:
            return _encode(fn(_decode(item, torch)))

        return Stream(self._handle.map_local(local, parallel, ordered), torch=torch)

    def prefetch(self, k: int) -> "Stream":
        """Up to ``k`` items pulled ahead of the consumer by a task of their own."""
        return Stream(self._handle.prefetch(k), torch=self._torch)

    def batch(self, n: int, drop_last: bool = False) -> "Stream":
        """``n`` items at a time stacked, in Rust, into one buffer per tensor position:
        arrays of one dtype and shape into one array of shape ``(n, ...)``, numbers into a
        1-D array, lists and dicts position by position (as torch's ``default_collate``);
        anything else as a list. The last batch may be short, unless ``drop_last``. Items
        that cannot be stacked raise ``ValueError``."""
        return Stream(self._handle.batch(n, drop_last), torch=self._torch)

    def as_torch(self) -> "Stream":
        """The same stream, its tensors as torch tensors (sharing the received memory)."""
        return Stream(self, torch=True)

    def close(self) -> None:
        """Ends the stream now: its calls are cancelled and its tasks stopped."""
        self._handle.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = self._handle.next()
        if item is None:
            raise StopIteration
        return _decode(item, self._torch)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = await self._handle.next_async()
        if item is None:
            raise StopAsyncIteration
        return _decode(item, self._torch)
