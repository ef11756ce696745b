"""Remote functions: serve Python callables by name (``@client.share``) and call the
functions other nodes serve (``client.function(name)``).

Arguments and results are numbers, strings, bytes, lists, tuples (received as lists), dicts
with ``str`` keys, numpy arrays and torch tensors, nested up to 32 levels. Nothing is
pickled: nothing received can run code. A call's positional and keyword arguments travel as
``{"args": [...], "kwargs": {...}}``; a handler receives them unpacked. A value that is not
in that form (a call from ``tb call`` or Rust) is passed as the single positional argument.

Arrays arrive as writable numpy arrays (or torch tensors, where the arguments were torch
tensors and torch is loaded) that own their memory: in-place ops on them are safe. A CUDA
torch tensor arrives as a CUDA torch tensor on the receiver's device of the same ordinal: it
is copied once into the sender's node and lent, and a receiver on the same host copies it
device to device by CUDA IPC (no host copy, no hash); one on another host pulls it through
staging; one without that device (or without torch) gets it in host memory. The receiver's
tensor is its own. The caller's ``device=`` puts a result's tensors on the device it names.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from . import _convert, _dtypes
from ._convert import to_bytes
from ._native import CUDA_COMPILED, Buffer, CudaArg, RefArg, TensorArg, TensorOut

#: A tensor in the cluster passed to a function by name (and version; the newest when
#: omitted): ``f(tb.Ref("model/w", 3))``. The server gets it from any holder before its
#: handler runs, which receives the array; no byte of it goes through the caller.
Ref = RefArg

_local = threading.local()


def cancelled() -> bool:
    """Whether the call this handler thread serves was cancelled (its caller went or its
    deadline passed): a long sync handler may check it and stop early. Its result is
    discarded either way. False outside a handler."""
    flag = getattr(_local, "flag", None)
    return bool(flag is not None and flag.is_set())


def _encode(obj: Any, depth: int = 0) -> Any:
    """``obj`` as the native layer takes it: tensors as ``TensorArg``s."""
    if depth > 32:
        raise ValueError("a value nested deeper than 32 levels")
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_encode(v, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return {k: _encode(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, RefArg):
        return obj
    if not isinstance(obj, np.ndarray):
        cuda = _convert.cuda_tensor(obj) if CUDA_COMPILED else None
        if cuda is not None:
            flat, dtype, shape, ordinal = cuda
            return CudaArg(flat, ordinal, dtype, list(shape))
        obj = _on_host(obj)
    data, dtype, shape = to_bytes(obj)
    flat = data.reshape(-1).view(np.uint8) if data.size else np.empty(0, np.uint8)
    return TensorArg(flat, dtype, list(shape))


def _on_host(obj: Any) -> Any:
    """``obj``, or a host copy of it when it is a CUDA torch tensor and the extension was
    built without CUDA. The copy waits for every stream of the tensor's device, as ``put``
    does (torch does not record which stream wrote a tensor)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
        torch.cuda.synchronize(obj.device)
        return obj.detach().cpu()
    return obj


def _decode(obj: Any, torch: bool) -> Any:
    """A received value with its tensors as numpy arrays (torch tensors with ``torch``)."""
    if isinstance(obj, TensorOut) and isinstance(obj.data, Buffer):
        return _device_tensor(obj)
    if isinstance(obj, TensorOut):
        arr = obj.data.view(_dtypes.numpy_dtype(obj.dtype)).reshape(tuple(obj.shape))
        if torch:
            import torch as _torch

            return _torch.from_numpy(arr)
        return arr
    if isinstance(obj, list):
        return [_decode(v, torch) for v in obj]
    if isinstance(obj, dict):
        return {k: _decode(v, torch) for k, v in obj.items()}
    return obj


def _device_tensor(obj: TensorOut) -> Any:
    """A received tensor in device memory as a torch CUDA tensor over that memory (DLPack, no
    copy: a pull received into it, so nothing else holds it), or, where torch is not
    installed, copied into a numpy array."""
    try:
        import torch
    except ImportError:
        flat = obj.data.host_copy()
        return flat.view(_dtypes.numpy_dtype(obj.dtype)).reshape(tuple(obj.shape))
    flat = torch.from_dlpack(obj.data)
    return flat.view(_dtypes.torch_dtype(obj.dtype)).reshape(tuple(obj.shape))


def _uses_torch(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_uses_torch(v) for v in obj)
    if isinstance(obj, dict):
        return any(_uses_torch(v) for v in obj.values())
    return False


def _pack(args: tuple, kwargs: dict) -> Any:
    return {"args": _encode(list(args)), "kwargs": _encode(kwargs)}


def _unpack(value: Any) -> tuple[list, dict]:
    if isinstance(value, dict) and set(value) == {"args", "kwargs"}:
        args, kwargs = value["args"], value["kwargs"]
        if isinstance(args, list) and isinstance(kwargs, dict):
            return args, kwargs
    return [value], {}


def _place(result: Any, out: Any, device: Any) -> Any:
    """A call's result placed as its caller asked: copied into ``out`` (one tensor result, of
    ``out``'s dtype and shape, checked before anything is written), or its tensors as torch
    tensors on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, a torch device or an
    ordinal)."""
    if out is not None and device is not None:
        raise ValueError("pass out= or device=, not both")
    if out is not None:
        arr, dtype, shape = _convert.check_out(out)
        if _is_tensor(result) and getattr(result, "is_cuda", False):
            result = result.cpu()
        got, got_dtype, got_shape = _convert.to_bytes(result) if _is_tensor(result) else (None, None, None)
        if got is None:
            raise TypeError(f"out= takes a result that is one tensor, not a {type(result).__name__}")
        if (got_dtype, tuple(got_shape)) != (dtype, tuple(shape)):
            raise ValueError(
                f"the result is a {got_dtype} tensor of shape {list(got_shape)}; out is "
                f"{dtype} of shape {list(shape)}"
            )
        np.copyto(arr, got.reshape(-1).view(np.uint8))
        return out
    if device is None:
        return result
    ordinal = _convert.cuda_ordinal(device)
    import torch as _torch

    target = _torch.device("cpu") if ordinal is None else _torch.device("cuda", ordinal)
    return _to_device(result, _torch, target)


def _is_tensor(obj: Any) -> bool:
    if isinstance(obj, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _to_device(obj: Any, torch: Any, target: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj).to(target)
    if isinstance(obj, torch.Tensor):
        return obj.to(target)
    if isinstance(obj, list):
        return [_to_device(v, torch, target) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, torch, target) for k, v in obj.items()}
    return obj


def _takes_inputs(func: Callable) -> bool:
    """Whether ``func`` is a generator whose first parameter is annotated as an iterator or
    iterable (of the caller's inputs)."""
    if not (inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func)):
        return False
    params = list(inspect.signature(func).parameters.values())
    if not params or params[0].annotation is inspect.Parameter.empty:
        return False
    text = str(params[0].annotation)
    return any(k in text for k in ("Iterator", "Iterable"))


async def _async_inputs(items: Iterator[Any]) -> Any:
    """A bidirectional call's inputs for an async handler: each taken on a worker thread (the
    wait for the caller's next input blocks), so the handler's event loop runs meanwhile."""
    loop = asyncio.get_running_loop()
    end = object()
    while True:
        item = await loop.run_in_executor(None, next, items, end)
        if item is end:
            return
        yield item


async def _aclose(agen: Any) -> None:
    """Closes an async generator handler, its error (from its `finally`) to the loop's
    exception handler: no caller is left to receive it. A generator still running (its step
    was cancelled and has not finished unwinding) is left to finish on its own."""
    try:
        await agen.aclose()
    except Exception as e:  # noqa: BLE001 - reported, not raised: the stream is over
        if isinstance(e, RuntimeError) and "already running" in str(e):
            return
        asyncio.get_running_loop().call_exception_handler(
            {"message": "closing a streaming handler raised", "exception": e}
        )


class Shared:
    """A function shared by a client (``@client.share``), served while the client serves."""

    def __init__(
        self,
        name: str,
        func: Callable,
        concurrency: int,
        queue: int,
        read_only_callers: bool,
        idempotent: bool,
        torch: bool,
        resumable: bool = False,
        inputs: bool | None = None,
    ) -> None:
        self.name = name
        self.resumable = resumable
        self.func = func
        self.concurrency = concurrency
        self.queue = queue
        self.read_only_callers = read_only_callers
        self.idempotent = idempotent
        self.torch = torch
        self.streaming = inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func)
        self.inputs = _takes_inputs(func) if inputs is None else bool(inputs)
        if self.inputs and not self.streaming:
            raise TypeError(
                f"{name}: a function that takes inputs is a generator (it yields its results)"
            )
        if self.inputs and resumable:
            raise TypeError(f"{name}: a function that takes inputs cannot be resumable")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop async handlers run on: one thread per shared function, made on need."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name=f"tb-share-{self.name}", daemon=True
                ).start()
                self._loop = loop
            return self._loop

    def _run_async(self, coro: Any, flag: Any) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._event_loop())
        while True:
            try:
                return fut.result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                if flag.is_set():
                    fut.cancel()
                    raise asyncio.CancelledError("the call was cancelled by its caller")

    def native_handler(self) -> Callable:
        """What the native layer calls: ``(value, flag)`` to a result (or an iterator)."""

        def handle(value: Any, flag: Any, start: int, inputs: Any = None) -> Any:
            args, kwargs = _unpack(value)
            args = [_decode(a, self.torch) for a in args]
            kwargs = {k: _decode(v, self.torch) for k, v in kwargs.items()}
            if self.resumable:
                kwargs["start"] = start
            if self.inputs:
                items = (_decode(v, self.torch) for v in inputs)
                if inspect.isasyncgenfunction(self.func):
                    items = _async_inputs(items)
                args = [items, *args]
            _local.flag = flag
            try:
                out = self.func(*args, **kwargs)
                if inspect.iscoroutine(out):
                    out = self._run_async(out, flag)
                if inspect.isasyncgen(out):
                    return self._async_items(out, flag)
                if self.streaming:
                    return (_encode(item) for item in out)
                return _encode(out)
            finally:
                _local.flag = None

        return handle

    def _async_items(self, agen: Any, flag: Any) -> Iterator[Any]:
        try:
            while True:
                try:
                    item = self._run_async(agen.__anext__(), flag)
                except StopAsyncIteration:
                    return
                yield _encode(item)
        finally:
            # The stream ended early (cancelled, or its caller stopped taking items, and
            # the native layer closed this iterator): the handler's own `finally` runs now,
            # on its loop, not when the async generator is collected (if ever).
            asyncio.run_coroutine_threadsafe(_aclose(agen), self._event_loop())

    def stop(self) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


class Function:
    """A function served somewhere in the cluster, called by name.

    ``f(*args, timeout=None, **kwargs)`` returns its result; ``f.submit(...)`` returns a
    ``concurrent.futures.Future``; ``f.map(xs, parallel=16)`` yields results in order;
    ``f.stream(...)`` iterates a streaming function's items.

    ``timeout=``, ``out=`` and ``device=`` are the call's own keywords, not the function's:
    ``out`` (a writable array or CPU torch tensor) receives a one-tensor result, checked to
    be its dtype and shape before anything is written, and is returned; ``device`` returns
    the result's tensors as torch tensors there (``"cpu"``, ``"cuda"``, ``"cuda:N"``).
    """

    def __init__(self, client: Any, name: str, idempotent: bool = False) -> None:
        self._client = client
        self.name = name
        self.idempotent = idempotent

    def __repr__(self) -> str:
        return f"Function({self.name!r})"

    def __call__(self, *args: Any, timeout: float | None = None, out: Any = None,
                 device: Any = None, **kwargs: Any) -> Any:
        torch = _uses_torch(args) or _uses_torch(kwargs)
        got = self._client._calls().call(
            self.name, _pack(args, kwargs), timeout, self.idempotent
        )
        return _place(_decode(got, torch), out, device)

    async def acall(self, *args: Any, timeout: float | None = None, out: Any = None,
                    device: Any = None, **kwargs: Any) -> Any:
        """The call as a coroutine on the running event loop (no thread): cancelling the
        awaiting task cancels the call on its server."""
        torch = _uses_torch(args) or _uses_torch(kwargs)
        got = await self._client._calls().call_async(
            self.name, _pack(args, kwargs), timeout, self.idempotent
        )
        return _place(_decode(got, torch), out, device)

    def submit(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> concurrent.futures.Future:
        """Starts the call and returns a future of its result."""
        return self._client._executor().submit(self, *args, timeout=timeout, **kwargs)

    def map(self, iterable: Iterable[Any], parallel: int = 16, timeout: float | None = None) -> Iterator[Any]:
        """Calls the function on each item, ``parallel`` at a time (spread over every server),
        and yields the results in the items' order."""
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        pending: list[concurrent.futures.Future] = []
        it = iter(iterable)
        with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
            for item in it:
                pending.append(pool.submit(self, item, timeout=timeout))
                if len(pending) >= parallel:
                    yield pending.pop(0).result()
            for fut in pending:
                yield fut.result()

    def stream(self, *args: Any, prefetch: int = 2, inputs: Iterable[Any] | None = None,
               **kwargs: Any) -> Iterator[Any]:
        """Iterates a streaming function's items, at most ``prefetch`` requested ahead (the
        server runs no further ahead than that). With ``inputs`` (an iterable), calls a
        bidirectional function (``@share(..., inputs=True)``): its handler takes them in
        order, and each is taken from ``inputs`` (on a thread of the call's own) only as the
        server asks for it (at most 2 waiting there), so a slow consumer holds both sides'
        memory flat. An exception ``inputs`` raises is raised here."""
        torch = _uses_torch(args) or _uses_torch(kwargs)
        feed = None if inputs is None else (_encode(x) for x in inputs)
        handle = self._client._calls().stream(
            self.name, _pack(args, kwargs), max(1, prefetch), feed
        )
        while True:
            item = handle.next()
            if item is None:
                return
            yield _decode(item, torch)


class AsyncFunction:
    """A :class:`Function` for asyncio: ``await f(...)`` and ``async for x in f.stream(...)``.
    Cancelling the awaiting task cancels the call on its server."""

    def __init__(self, client: Any, name: str, idempotent: bool = False) -> None:
        self._client = client
        self.name = name
        self.idempotent = idempotent

    async def __call__(self, *args: Any, timeout: float | None = None, out: Any = None,
                       device: Any = None, **kwargs: Any) -> Any:
        torch = _uses_torch(args) or _uses_torch(kwargs)
        got = await self._client._calls().call_async(
            self.name, _pack(args, kwargs), timeout, self.idempotent
        )
        return _place(_decode(got, torch), out, device)

    async def stream(self, *args: Any, prefetch: int = 2, inputs: Iterable[Any] | None = None,
                     **kwargs: Any):
        """``async for`` over a streaming function's items; ``inputs`` as for
        :meth:`Function.stream` (a plain iterable: it is read on a thread of its own)."""
        torch = _uses_torch(args) or _uses_torch(kwargs)
        feed = None if inputs is None else (_encode(x) for x in inputs)
        handle = self._client._calls().stream(
            self.name, _pack(args, kwargs), max(1, prefetch), feed
        )
        while True:
            item = await handle.next_async()
            if item is None:
                return
            yield _decode(item, torch)
