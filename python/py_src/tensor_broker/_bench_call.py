"""``python -m tensor_broker bench call``: remote calls of tensor-broker (``@client.share`` /
``client.function(name)``) against gRPC and ZeroMQ, between separate processes on this host,
in one run.

Processes, per system, one system at a time (this process runs the :class:`LocalCluster`'s
broker and drives the others over stdin/stdout lines, like ``bench``):

- 4 server processes (``python -m tensor_broker _bench-call-server``). A case with 1 server
  uses the first of them only, one with 4 servers all of them; the other 3 stay idle.
- 1 caller process (``_bench-call-caller``). Concurrency is callers as **threads in that one
  caller process**: concurrency 64 is 64 threads, each calling in a loop (its next call once
  its last returned), all started together behind a barrier.

Systems:

- ``tensor-broker``: the servers share ``bench-call/s4/<op>`` (all four) and
  ``bench-call/s1/<op>`` (the first only), ``concurrency=8, queue=256``; the caller has one
  client and calls ``client.function(name)(x, timeout=...)`` from every thread, the package
  spreading calls over the servers. Streams: ``f.stream(items, size)`` (default prefetch 2)
  from a generator function on the first server.
- ``tensor-broker-quic``: the same with every tensor-broker node of the system (servers and
  caller) running QUIC alone (``connect(..., channels="quic")``): calls, their arguments and
  results go on QUIC streams of the pooled, encrypted link, as between two hosts, instead of
  the same-host socket and shared memory.
- ``grpc``: grpcio with generic handlers (``grpc.method_handlers_generic_handler`` of
  ``unary_unary`` / ``unary_stream`` handlers; no .proto): a message is a 2-byte length, a
  ``dtype;shape`` header and the raw bytes (one copy into the message, ``np.frombuffer`` out
  of it); message size limits lifted. Each server is a ``grpc.server`` with 8 worker
  threads; the caller has one channel per server, shared by its threads, and thread ``t``
  sends its ``k``-th call to server ``(t + k) % servers`` (round robin).
- ``zmq``: pyzmq REQ/REP over TCP loopback, the floor: each server is one REP socket
  answered by one thread (no handler pool), frames ``[op;dtype;shape, raw bytes]`` sent and
  received with ``copy=False``; each caller thread has its own REQ socket to every server
  and spreads its calls round robin as gRPC does. Streams: a DEALER socket to the first
  server's ROUTER socket (served by the same thread) asks for ``items`` items of ``size``
  bytes; the server sends them as ``[header, raw bytes]`` frames (``copy=False``), at most
  2 ahead of what the caller took: the caller returns a credit for each item it takes, as
  tensor-broker's ``prefetch=2`` does.

Ops: ``echo`` (returns its argument: ``uint8`` bytes) and ``add_one`` (``x + 1`` of a
``float32`` array, a new array), 4 KiB and 16 MiB, 1 and 64 callers, 1 and 4 servers. Every
handler decodes its argument to a numpy array and encodes the array it returns. The first
call of each case is checked in full (echo: the same dtype, shape and bytes; add_one:
exactly ``x + 1``) and any mismatch fails the run; every timed call's result size is
checked. A case runs for a fixed time (1 s; each thread also makes a minimum number of
calls: 3 with 1 caller, 2 with 64); ``calls_per_s`` is its timed calls over the wall time
from the barrier to the last return, ``p50_us`` / ``p99_us`` the percentiles of every timed
call's latency. Before the first case the caller warms up (8 threads call every op on every
server set, untimed), so every connection is up. A case whose calls raise (the system
failed them, e.g. a lost server) is reported with ``error`` and no figures, the run goes on
and exits non-zero; a wrong result stops the run at once.

Streaming (``op`` ``stream``, every system, 1 caller, 1 server): ``streams``
calls each yielding ``items`` items of 1 MiB or 16 MiB (the same read-only array each time),
each read to its end; ``items_per_s`` and ``mb_s`` over the whole run, ``calls_per_s``
streams per second, and ``p50_us`` / ``p99_us`` the gaps between consecutive items (the
first from the call). The first item of each case is checked in full, every item's size and
each stream's count.

Python over Rust (``python_over_rust`` in ``--json``): right after tensor-broker's Python
cases, the same 4 KiB cases with one caller and one server run from Rust (``tb bench call
--systems tensor-broker --sizes 4KiB --concurrency 1 --servers 1``: a Rust caller and a Rust
server in separate processes, the ``tb`` binary found as ``bench`` finds it, ``--tb`` to
name one), and the difference of the p50s is Python's cost per call: its caller's and its
server's crossings between Python and the runtime together. Skipped, with a note, where no
``tb`` binary is found or it is too old to take those options; a failure of that run is a
note too, and the other systems still run.

``--quick`` (a smoke run: a short time per case) drops the 16 MiB cases with 64 callers (the
output says so in ``dropped`` and in a note).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from . import _bench_report
from ._bench_proto import WAIT_S, BenchError, Child, ensure_module, pct, say

SYSTEMS = ("tensor-broker", "tensor-broker-quic", "grpc", "zmq")
# The tensor-broker systems, and the channels their nodes run (None: the default).
TB_CHANNELS = {"tensor-broker": None, "tensor-broker-quic": "quic"}
OPS = ("echo", "add_one")
SIZES = (4 << 10, 16 << 20)
CONCURRENCY = (1, 64)
SERVERS = (1, 4)
STREAM_SIZES = (1 << 20, 16 << 20)
# Items a ZeroMQ stream's server runs ahead of its caller (tensor-broker's default prefetch).
ZMQ_STREAM_AHEAD = 2
SERVER_PROCESSES = max(SERVERS)
# Python's cost per call over Rust's, 4 KiB, one caller, one server: at most this (the
# project's target for its Python layer).
OVERHEAD_TARGET_US = 40.0
# How long the Rust cases of that comparison may take (a node's start and two cases of about
# a second each).
RUST_LIMIT_S = 60.0
# Handler threads per server (tensor-broker's share concurrency, gRPC's max_workers) and the
# queue tensor-broker admits beyond them (all 64 callers may wait on one server).
SERVER_THREADS = 8
SERVER_QUEUE = 256
PREFIX = "bench-call"
ZMQ_HOST = "tcp://127.0.0.1"
GRPC_SERVICE = "tb.bench"
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# Callers of the warm-up before the first case (see :func:`warm`).
WARM_THREADS = 8
# A worker ends itself after this long even if its parent is gone.
PROCESS_LIMIT_S = 1800.0
LEN = struct.Struct("<H")


def plan(quick: bool) -> dict[str, Any]:
    """What a run measures: seconds per case, minimum calls per thread, the stream counts."""
    if quick:
        return {"seconds": 0.15, "min_calls": {1: 2, 64: 1},
                "stream_items": {1 << 20: 16, 16 << 20: 3}, "streams": 1,
                "drop": {(16 << 20, 64)}}
    return {"seconds": 1.0, "min_calls": {1: 3, 64: 2},
            "stream_items": {1 << 20: 64, 16 << 20: 8}, "streams": 3, "drop": set()}


# ---- payloads and checks ---------------------------------------------------------------------


def payload(op: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The argument of ``op`` at ``size`` bytes and the result it must return."""
    rng = np.random.default_rng(size)
    if op == "echo":
        x = rng.integers(0, 256, size, dtype=np.uint8)
        return x, x
    x = rng.standard_normal(size // 4, dtype=np.float32)
    return x, x + np.float32(1)


def check(what: str, got: Any, expected: np.ndarray) -> None:
    """Fails loudly unless ``got`` is ``expected``: dtype, shape and every byte."""
    if not isinstance(got, np.ndarray):
        raise BenchError(f"{what}: got a {type(got).__name__}, not an array")
    if got.dtype != expected.dtype or got.shape != expected.shape:
        raise BenchError(f"{what}: got {got.dtype}{list(got.shape)}, expected "
                         f"{expected.dtype}{list(expected.shape)}")
    if not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
        bad = int(np.flatnonzero(got.view(np.uint8) != expected.view(np.uint8))[0])
        raise BenchError(f"{what}: wrong result, first differing byte at {bad}")


_patterns: dict[int, np.ndarray] = {}


def pattern(size: int) -> np.ndarray:
    """A stream item: byte i is ``i mod 251`` (read-only, one array per size)."""
    if size not in _patterns:
        # The cycle repeated (a 16 MiB int64 `arange % 251` took ~0.5 s here, which a
        # stream's first item would wait for).
        arr = np.resize(np.arange(251, dtype=np.uint8), size)
        arr.flags.writeable = False
        _patterns[size] = arr
    return _patterns[size]


# ---- gRPC and ZeroMQ messages: a dtype;shape header and the raw bytes -------------------------


def _header(arr: np.ndarray, op: str = "") -> bytes:
    return f"{op};{arr.dtype.str};{','.join(map(str, arr.shape))}".encode()


def _parse(header: bytes) -> tuple[str, np.dtype, tuple[int, ...]]:
    op, dtype, shape = header.decode().split(";")
    return op, np.dtype(dtype), tuple(int(s) for s in shape.split(",") if s)


def grpc_encode(arr: np.ndarray) -> bytes:
    """One gRPC message: the header's length, the header, the array's bytes (one copy)."""
    head = _header(arr)
    return b"".join((LEN.pack(len(head)), head, memoryview(np.ascontiguousarray(arr)).cast("B")))


def grpc_decode(msg: bytes) -> np.ndarray:
    """The array of a gRPC message (a read-only view of the message, no copy)."""
    (n,) = LEN.unpack_from(msg)
    _, dtype, shape = _parse(msg[LEN.size:LEN.size + n])
    return np.frombuffer(msg, dtype=dtype, offset=LEN.size + n).reshape(shape)


def zmq_frames(arr: np.ndarray, op: str = "") -> list[Any]:
    return [_header(arr, op), np.ascontiguousarray(arr)]


def zmq_array(frames: list[Any]) -> tuple[str, np.ndarray]:
    op, dtype, shape = _parse(frames[0].bytes)
    return op, np.frombuffer(frames[1].buffer, dtype=dtype).reshape(shape)


def _add_one(x: np.ndarray) -> np.ndarray:
    return x + np.float32(1)


def _echo(x: np.ndarray) -> np.ndarray:
    return x


HANDLERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"echo": _echo, "add_one": _add_one}


# ---- the server processes --------------------------------------------------------------------


def _worker_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--join")
    p.add_argument("--cluster-secret-file")
    p.add_argument("--servers", default="", help="the servers' addresses, comma-separated")
    p.add_argument("--stream-server", default="",
                   help="zmq: the first server's stream (ROUTER) address")
    a = p.parse_args(argv)
    # The orchestrator stops its children (by PID, on errors and Ctrl-C too): a Ctrl-C in
    # the terminal is its to handle, not each child's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limit = threading.Timer(PROCESS_LIMIT_S, lambda: os._exit(3))
    limit.daemon = True
    limit.start()
    return a


def serve(argv: list[str]) -> int:
    """A server process: serves echo, add_one (and stream) until its stdin closes."""
    a = _worker_args(argv)
    for size in STREAM_SIZES:  # made before any stream starts, not within its timing
        pattern(size)
    run = {"grpc": _serve_grpc, "zmq": _serve_zmq}.get(a.system, _serve_tb)
    run(a)
    return 0


def _stream_items(items: int, size: int) -> Iterator[np.ndarray]:
    item = pattern(size)
    for _ in range(items):
        yield item


def _serve_tb(a: argparse.Namespace) -> None:
    from . import connect

    client = connect(a.join, secret_file=a.cluster_secret_file, channels=TB_CHANNELS[a.system])
    try:
        for scope in [f"s{SERVER_PROCESSES}"] + (["s1"] if a.index == 0 else []):
            for op, handler in HANDLERS.items():
                client.share(f"{PREFIX}/{scope}/{op}", concurrency=SERVER_THREADS,
                             queue=SERVER_QUEUE)(handler)
        if a.index == 0:
            client.share(f"{PREFIX}/stream")(_stream_items)
        with client.serving():
            say(ready=True, addr=client.addr)
            sys.stdin.read()
    finally:
        client.close()


def _serve_grpc(a: argparse.Namespace) -> None:
    import concurrent.futures

    import grpc

    def stream(request: bytes, context: Any) -> Iterator[np.ndarray]:
        items, size = struct.unpack("<QQ", request)
        return _stream_items(items, size)

    methods = {op: grpc.unary_unary_rpc_method_handler(
        lambda x, context, f=f: f(x), request_deserializer=grpc_decode,
        response_serializer=grpc_encode) for op, f in HANDLERS.items()}
    methods["stream"] = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=None, response_serializer=grpc_encode)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=SERVER_THREADS),
                         options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(GRPC_SERVICE,
                                                                          methods)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        say(ready=True, addr=f"127.0.0.1:{port}")
        sys.stdin.read()
    finally:
        server.stop(grace=None)


def _serve_zmq(a: argparse.Namespace) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.bind(f"{ZMQ_HOST}:*")
    streams = ctx.socket(zmq.ROUTER)
    streams.bind(f"{ZMQ_HOST}:*")
    stop = threading.Event()

    def answer() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(streams, zmq.POLLIN)
        # Per stream (the caller's identity): items still to send, credits in hand.
        left: dict[bytes, list[int]] = {}
        while not stop.is_set():
            ready = dict(poller.poll(200))
            if sock in ready:
                frames = sock.recv_multipart(copy=False)
                op, x = zmq_array(frames)
                sock.send_multipart(zmq_frames(HANDLERS[op](x)), copy=False)
            if streams in ready:
                who, what, *rest = streams.recv_multipart()
                if what == b"go":
                    items, size = struct.unpack("<QQ", rest[0])
                    left[who] = [items, size, ZMQ_STREAM_AHEAD]
                elif who in left:  # b"more": the caller took an item
                    left[who][2] += 1
                state = left.get(who)
                while state and state[0] > 0 and state[2] > 0:
                    streams.send_multipart([who, *zmq_frames(pattern(state[1]))], copy=False)
                    state[0] -= 1
                    state[2] -= 1
                if state and state[0] == 0:
                    del left[who]

    worker = threading.Thread(target=answer, daemon=True)
    worker.start()
    try:
        say(ready=True, addr=sock.getsockopt_string(zmq.LAST_ENDPOINT),
            stream_addr=streams.getsockopt_string(zmq.LAST_ENDPOINT))
        sys.stdin.read()
    finally:
        stop.set()
        worker.join(timeout=5)
        sock.close(linger=0)
        streams.close(linger=0)
        ctx.term()


# ---- the caller process ----------------------------------------------------------------------


Call = Callable[[np.ndarray], Any]


class TbCalls:
    """One tensor-broker client; every thread calls through it."""

    def __init__(self, a: argparse.Namespace) -> None:
        from . import connect

        self.client = connect(a.join, secret_file=a.cluster_secret_file,
                              channels=TB_CHANNELS[a.system])
        self._servers = [addr.split("@")[0] for addr in a.servers.split(",") if addr]
        self._ready()

    def links(self) -> list[str]:
        """The data channel this client uses with each server (after the warm-up)."""
        links = dict(self.client.status()["links"])
        return [links.get(server, "none") for server in self._servers]

    def _ready(self) -> None:
        """Waits until the broker lists every server of every function (a readiness check
        of the setup, not part of any figure)."""
        want = {f"{PREFIX}/{s}/{op}": n for n in SERVERS for s in [f"s{n}"] for op in OPS}
        want[f"{PREFIX}/stream"] = 1
        deadline = time.monotonic() + WAIT_S
        while True:
            got = dict(self.client.functions(PREFIX + "/"))
            if all(got.get(k) == v for k, v in want.items()):
                return
            if time.monotonic() > deadline:
                raise BenchError(f"tensor-broker: functions served {got}, expected {want}")
            time.sleep(0.05)

    def caller(self, op: str, servers: int, thread: int) -> Call:
        f = self.client.function(f"{PREFIX}/s{servers}/{op}")
        return lambda x: f(x, timeout=WAIT_S)

    @contextlib.contextmanager
    def stream(self, items: int, size: int) -> Iterator[Iterator[Any]]:
        it = self.client.function(f"{PREFIX}/stream").stream(items, size)
        try:
            yield it
        finally:
            it.close()  # on an error: drops the call's handle, which cancels it

    def reset(self) -> None:
        """After a failed call (nothing to do)."""

    def close(self) -> None:
        self.client.close()


class GrpcCalls:
    """One channel per server, shared by every thread; round robin over the case's servers."""

    def __init__(self, a: argparse.Namespace) -> None:
        import grpc

        self.grpc = grpc
        self.channels = [grpc.insecure_channel(addr, options=GRPC_OPTIONS)
                         for addr in a.servers.split(",")]
        for ch in self.channels:
            grpc.channel_ready_future(ch).result(timeout=WAIT_S)
        self.stubs = {op: [ch.unary_unary(f"/{GRPC_SERVICE}/{op}", request_serializer=grpc_encode,
                                          response_deserializer=grpc_decode)
                           for ch in self.channels] for op in OPS}
        self.streamer = self.channels[0].unary_stream(
            f"/{GRPC_SERVICE}/stream", request_serializer=None, response_deserializer=grpc_decode)

    def caller(self, op: str, servers: int, thread: int) -> Call:
        stubs, turn = self.stubs[op][:servers], itertools.count(thread)
        return lambda x: stubs[next(turn) % servers](x, timeout=WAIT_S)

    @contextlib.contextmanager
    def stream(self, items: int, size: int) -> Iterator[Iterator[Any]]:
        call = self.streamer(struct.pack("<QQ", items, size), timeout=WAIT_S)
        try:
            yield call
        finally:
            call.cancel()  # on an error (a no-op once the stream ended)

    def reset(self) -> None:
        """After a failed call (nothing to do)."""

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


class ZmqCalls:
    """A REQ socket per (thread, server), made before the thread runs and kept for the next
    cases (a socket moves between threads only across a thread start/join)."""

    def __init__(self, a: argparse.Namespace) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.addrs = a.servers.split(",")
        self.stream_addr = a.stream_server
        self.socks: list[list[Any]] = []
        self.streamer: Any = None

    def _socket(self, addr: str) -> Any:
        sock = self.ctx.socket(self.zmq.REQ)
        sock.connect(addr)
        ping = np.zeros(1, np.uint8)
        self._ask(sock, ping, "echo")  # connected and answered before any timing
        return sock

    def _ask(self, sock: Any, x: np.ndarray, op: str) -> np.ndarray:
        sock.send_multipart(zmq_frames(x, op), copy=False)
        if not sock.poll(int(WAIT_S * 1000), self.zmq.POLLIN):
            raise TimeoutError(f"zmq: no answer within {WAIT_S} s")
        return zmq_array(sock.recv_multipart(copy=False))[1]

    def caller(self, op: str, servers: int, thread: int) -> Call:
        while len(self.socks) <= thread:
            self.socks.append([self._socket(addr) for addr in self.addrs])
        socks, turn = self.socks[thread][:servers], itertools.count(thread)
        return lambda x: self._ask(socks[next(turn) % servers], x, op)

    @contextlib.contextmanager
    def stream(self, items: int, size: int) -> Iterator[Iterator[Any]]:
        if self.streamer is None:
            self.streamer = self.ctx.socket(self.zmq.DEALER)
            self.streamer.connect(self.stream_addr)
        sock = self.streamer

        def take() -> Iterator[np.ndarray]:
            sock.send_multipart([b"go", struct.pack("<QQ", items, size)])
            for _ in range(items):
                if not sock.poll(int(WAIT_S * 1000), self.zmq.POLLIN):
                    raise TimeoutError(f"zmq: no stream item within {WAIT_S} s")
                item = zmq_array(sock.recv_multipart(copy=False))[1]
                sock.send(b"more")  # the credit for the item taken
                yield item

        yield take()

    def reset(self) -> None:
        """After a failed call: a REQ socket left waiting for its answer is not reusable,
        nor a stream's socket with items of the failed stream still coming."""
        for socks in self.socks:
            for s in socks:
                s.close(linger=0)
        self.socks = []
        if self.streamer is not None:
            self.streamer.close(linger=0)
            self.streamer = None

    def close(self) -> None:
        self.reset()
        self.ctx.term()


def run_case(calls: Any, op: str, size: int, conc: int, servers: int, seconds: float,
             min_calls: int) -> dict[str, Any]:
    """One case: the first call checked in full, then ``conc`` threads calling for
    ``seconds`` (and at least ``min_calls`` each)."""
    x, expected = payload(op, size)
    what = f"{op} {size} B, {conc} caller(s), {servers} server(s)"
    try:
        first = calls.caller(op, servers, 0)(x)
    except Exception as e:  # noqa: BLE001
        raise CallFailed(f"{what}, first call: {e!r}") from e
    check(f"{what}, first call", first, expected)
    del first
    fns = [calls.caller(op, servers, t) for t in range(conc)]
    lat: list[list[int]] = [[] for _ in range(conc)]
    errors: list[BaseException] = []
    start: list[int] = []
    barrier = threading.Barrier(conc, action=lambda: start.append(time.perf_counter_ns()))

    def loop(t: int) -> None:
        try:
            barrier.wait()
            deadline = start[0] + int(seconds * 1e9)
            mine, call = lat[t], fns[t]
            while True:
                t0 = time.perf_counter_ns()
                out = call(x)
                t1 = time.perf_counter_ns()
                mine.append(t1 - t0)
                if out.nbytes != size:
                    raise BenchError(f"{what}: a result of {out.nbytes} B")
                del out
                if len(mine) >= min_calls and t1 >= deadline:
                    return
        except BaseException as e:  # noqa: BLE001  (raised once every thread is done)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(conc)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    end = time.perf_counter_ns()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
    wrong = [e for e in real if isinstance(e, BenchError)]
    if wrong:
        raise BenchError(f"{what}: {wrong[0]}")
    if real:
        raise CallFailed(f"{what}: {real[0]!r}")
    samples = [v for per in lat for v in per]
    return {"calls": len(samples), "seconds": round((end - start[0]) / 1e9, 3),
            "calls_per_s": round(len(samples) / ((end - start[0]) / 1e9), 1),
            "p50_us": round(pct(samples, 50) / 1e3, 1),
            "p99_us": round(pct(samples, 99) / 1e3, 1), "checked": "first call in full"}


class CallFailed(Exception):
    """A call raised (the system failed it), as opposed to a wrong result (``BenchError``):
    the run records the case as failed and goes on, then exits non-zero."""


@contextlib.contextmanager
def _failing_as_call(what: str) -> Iterator[None]:
    try:
        yield
    except BenchError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CallFailed(f"{what}: {e!r}") from e


def run_stream(calls: Any, size: int, items: int, streams: int) -> dict[str, Any]:
    """``streams`` streams of ``items`` items of ``size`` bytes, one after the other."""
    expected = pattern(size)
    gaps: list[int] = []
    t_start = time.perf_counter_ns()
    for s in range(streams):
        got = 0
        last = time.perf_counter_ns()
        with _failing_as_call(f"stream of {size} B items"), calls.stream(items, size) as stream:
            for item in stream:
                now = time.perf_counter_ns()
                gaps.append(now - last)
                last = now
                if s == 0 and got == 0:
                    check(f"stream of {size} B items, first item", item, expected)
                elif item.nbytes != size:
                    raise BenchError(f"stream of {size} B items: an item of {item.nbytes} B")
                got += 1
                del item
        if got != items:
            raise BenchError(f"stream of {size} B items: {got} items, expected {items}")
    wall = (time.perf_counter_ns() - t_start) / 1e9
    return {"calls": streams, "items_per_stream": items, "seconds": round(wall, 3),
            "calls_per_s": round(streams / wall, 2),
            "items_per_s": round(streams * items / wall, 1),
            "mb_s": round(streams * items * size / wall / 1e6, 1),
            "p50_us": round(pct(gaps, 50) / 1e3, 1), "p99_us": round(pct(gaps, 99) / 1e3, 1),
            "checked": "first item in full"}


def warm(calls: Any) -> None:
    """Before any case: ``WARM_THREADS`` threads call every op on every server set a few
    times (4 KiB, untimed, checked), so connections to every server are up and the first
    case's figures are not its setup."""
    for op, servers in itertools.product(OPS, SERVERS):
        run_case(calls, op, 4 << 10, WARM_THREADS, servers, 0.0, 4)


def caller(argv: list[str]) -> int:
    """The caller process: warms up, then obeys JSON commands on stdin (``case``,
    ``stream``) until it closes, answering each with one JSON line (``failed`` when a case's
    calls raised, ``error`` when the run must stop)."""
    a = _worker_args(argv)
    kind = {"grpc": GrpcCalls, "zmq": ZmqCalls}.get(a.system, TbCalls)
    calls = kind(a)
    try:
        warm(calls)
        say(ready=True, links=calls.links() if isinstance(calls, TbCalls) else None)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "case":
                    say(**run_case(calls, cmd["op"], cmd["size"], cmd["concurrency"],
                                   cmd["servers"], cmd["seconds"], cmd["min_calls"]))
                elif cmd["cmd"] == "stream":
                    say(**run_stream(calls, cmd["size"], cmd["items"], cmd["streams"]))
                else:
                    raise BenchError(f"unknown command {line!r}")
            except CallFailed as e:  # the case failed; the run goes on
                calls.reset()
                say(failed=str(e))
            except Exception as e:  # noqa: BLE001  (the orchestrator fails the run with it)
                say(error=f"{type(e).__name__}: {e}")
                return 1
    finally:
        calls.close()
    return 0


# ---- the orchestrator ------------------------------------------------------------------------


class _Proc(Child):
    """A worker, stopped by closing its stdin and, past ``grace``, killed by its PID."""

    stopped = False

    def stop(self, grace: float = 15.0, check: bool = False) -> None:  # type: ignore[override]
        """``check``: fail (with its stderr) unless it exits 0 within ``grace``."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            if check:
                raise self._fail(f"still running {grace} s after its stdin closed: killed")
        try:
            if check and self.proc.returncode != 0:
                raise self._fail(f"exited ({self.proc.returncode})")
        finally:
            self._err.close()


def _stop_all(children: list[_Proc], grace: float) -> None:
    """Stops every child; interrupted (a second Ctrl-C), kills the rest by PID at once."""
    try:
        for child in reversed(children):
            child.stop(grace)
    except BaseException:
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()
        for child in children:
            with contextlib.suppress(Exception):
                child.proc.wait(timeout=30)
        raise


def _ask(child: _Proc, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
    got = child.ask(json.dumps(cmd), timeout)
    if "error" in got:
        raise BenchError(f"{child.label}: {got['error']}")
    return got


def _failed(case: dict[str, Any], why: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """A case whose calls failed: no figures, its error."""
    progress(f"FAILED: {why}")
    return {**case, "calls_per_s": None, "p50_us": None, "p99_us": None, "error": why}


def _cases(p: dict[str, Any]) -> Iterator[tuple[str, int, int, int]]:
    for op, size, conc, servers in itertools.product(OPS, SIZES, CONCURRENCY, SERVERS):
        if (size, conc) not in p["drop"]:
            yield op, size, conc, servers


def _run_system(system: str, cluster: Any, p: dict[str, Any], children: list[_Proc],
                progress: Callable[[str], None]) -> list[dict[str, Any]]:
    py = [sys.executable, "-m", "tensor_broker"]
    join = ["--join", cluster.ticket, "--cluster-secret-file", cluster.secret_file]
    servers = []
    for i in range(SERVER_PROCESSES):
        servers.append(_Proc(f"{system} server {i}", [*py, "_bench-call-server", "--system",
                                                        system, "--index", str(i), *join]))
        children.append(servers[-1])
    ready = [s.hear() for s in servers]
    addrs = [r["addr"] for r in ready]
    stream_at = ["--stream-server", ready[0]["stream_addr"]] if system == "zmq" else []
    call = _Proc(f"{system} caller", [*py, "_bench-call-caller", "--system", system,
                                      "--servers", ",".join(addrs), *stream_at, *join])
    children.append(call)
    links = call.hear().get("links")
    out = []
    slow = WAIT_S * 4  # a 16 MiB case with 64 callers on one server takes a while
    for op, size, conc, n in _cases(p):
        r = _ask(call, {"cmd": "case", "op": op, "size": size, "concurrency": conc,
                        "servers": n, "seconds": p["seconds"],
                        "min_calls": p["min_calls"][conc]},
                 slow)
        case = {"system": system, "op": op, "size_bytes": size, "concurrency": conc,
                "servers": n}
        out.append(_record(case, r, progress, lambda: (
            f"{op} {_bench_report.fmt_size(size)}, {conc} caller(s), {n} server(s): "
            f"{_n(r['calls_per_s'])} calls/s, p50 {_n(r['p50_us'])} µs, p99 "
            f"{_n(r['p99_us'])} µs ({r['calls']} calls)")))
    for size in STREAM_SIZES:
        items = p["stream_items"][size]
        r = _ask(call, {"cmd": "stream", "size": size, "items": items,
                        "streams": p["streams"]}, slow)
        case = {"system": system, "op": "stream", "size_bytes": size, "concurrency": 1,
                "servers": 1}
        out.append(_record(case, r, progress, lambda: (
            f"stream of {_bench_report.fmt_size(size)} items: "
            f"{_n(r['items_per_s'])} items/s ({_n(r['mb_s'])} MB/s), gap p50 "
            f"{_n(r['p50_us'])} µs")))
    for child in [call, *servers]:
        child.stop(check=True)
    return out, links


def _rust_overhead(tb_bin: str, python: list[dict[str, Any]], seconds: float,
                   progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Python's cost per call: the 4 KiB one-caller, one-server cases of ``python`` (this
    run's tensor-broker cases from Python) against the same cases run now by ``tb bench
    call`` from Rust (caller and server in separate processes). Empty when no Python case is
    comparable (they failed, and the report says so); raises :class:`BenchError` when ``tb``
    fails or its output lacks the cases (the caller notes it and goes on)."""
    ours = [c for c in python if "error" not in c
            and (c["size_bytes"], c["concurrency"], c["servers"]) == (4 << 10, 1, 1)]
    if not ours:
        return []
    cmd = [tb_bin, "bench", "call", "--systems", "tensor-broker", "--sizes", "4KiB",
           "--concurrency", "1", "--servers", "1", "--no-streams", "--json",
           "--seconds", f"{seconds:g}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUST_LIMIT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{' '.join(cmd)}: no answer in {RUST_LIMIT_S:.0f} s") from e
    except OSError as e:
        raise BenchError(f"{' '.join(cmd)}: {e}") from e
    if done.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {done.returncode}: "
                         f"{done.stderr.strip()[-2000:]}")
    try:
        rust = {c["op"]: (float(c["p50_us"]), float(c["calls_per_s"]))
                for c in json.loads(done.stdout)["cases"]}
    except (ValueError, KeyError, TypeError) as e:
        raise BenchError(f"{' '.join(cmd)}: unreadable output ({e!r}): "
                         f"{done.stdout[:500]!r}") from e
    out = []
    for case in ours:
        if case["op"] not in rust:
            raise BenchError(f"{' '.join(cmd)} printed no 4 KiB {case['op']} case")
        rust_p50, rust_rate = rust[case["op"]]
        over = case["p50_us"] - rust_p50
        out.append({"op": case["op"], "size_bytes": case["size_bytes"],
                    "python_p50_us": case["p50_us"], "rust_p50_us": rust_p50,
                    "python_calls_per_s": case["calls_per_s"], "rust_calls_per_s": rust_rate,
                    "overhead_us": over, "target_us": OVERHEAD_TARGET_US,
                    "met": over <= OVERHEAD_TARGET_US})
        progress(f"{case['op']} 4 KiB from Rust: p50 {_n(rust_p50)} µs; Python's "
                 f"{_n(case['p50_us'])} µs: {over:+.1f} µs per call")
    return out


def _speaks_call_bench(tb_bin: str) -> bool:
    """Whether ``tb_bin``'s ``bench call`` takes the options :func:`_rust_overhead` passes
    (an older build may lack ``--no-streams``)."""
    try:
        done = subprocess.run([tb_bin, "bench", "call", "--help"], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "--no-streams" in done.stdout


def _overhead_table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["op, size", "Python p50 µs", "Rust p50 µs", "Python over Rust", "target", "met"]
    body = [[f"{r['op']} {_bench_report.fmt_size(r['size_bytes'])}", _n(r["python_p50_us"]),
             _n(r["rust_p50_us"]), f"{r['overhead_us']:+.1f} µs",
             f"<= {r['target_us']:.0f} µs", "yes" if r["met"] else "no"] for r in rows]
    return _bench_report._grid(
        "Python's cost per call over Rust's (1 caller, 1 server, same run; caller and "
        "server both Python, or both Rust):", head, body)


def _record(case: dict[str, Any], r: dict[str, Any], progress: Callable[[str], None],
            line: Callable[[], str]) -> dict[str, Any]:
    """A case's entry of the report: its figures (and ``line()`` shown), or its failure."""
    if "failed" in r:
        return _failed(case, r["failed"], progress)
    progress(line())
    return {**case, **r}


def _n(v: float) -> str:
    """A figure for the table: no exponent, 3 significant digits below 100."""
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _table(rep: dict[str, Any]) -> str:
    systems = rep["systems"]
    by = {(c["system"], c["op"], c["size_bytes"], c["concurrency"], c["servers"]): c
          for c in rep["cases"]}
    keys = sorted({k[1:] for k in by}, key=lambda k: (k[0] == "stream", OPS.index(k[0])
                                                      if k[0] in OPS else 0, *k[1:]))
    head = ["op", "size", "callers", "servers"]
    for s in systems:
        head.append(f"{s} calls/s (items/s), p50/p99 µs")
    ratios = [(tb, base) for tb in TB_CHANNELS if tb in systems
              for base in ("grpc", "zmq") if base in systems]
    for tb, base in ratios:
        head.append(f"{_short(tb)}/{base} calls/s")
    rows = []
    for op, size, conc, n in keys:
        row = [op, _bench_report.fmt_size(size), str(conc), str(n)]
        for s in systems:
            c = by.get((s, op, size, conc, n))
            if c is None:
                row.append("-")
            elif "error" in c:
                row.append("FAILED (see below)")
            elif op == "stream":
                row.append(f"{_n(c['items_per_s'])} items/s, gap {_n(c['p50_us'])}/"
                           f"{_n(c['p99_us'])}")
            else:
                row.append(f"{_n(c['calls_per_s'])}, {_n(c['p50_us'])}/{_n(c['p99_us'])}")
        for tb, base in ratios:
            tb_case = by.get((tb, op, size, conc, n))
            b = by.get((base, op, size, conc, n))
            key = "items_per_s" if op == "stream" else "calls_per_s"
            row.append(f"{tb_case[key] / b[key]:.2f}x"
                       if tb_case and b and tb_case.get(key) and b.get(key) else "-")
        rows.append(row)
    title = ("Remote calls between processes on this host (calls/s over the wall time; "
             "p50/p99 per call; stream: items/s and the gaps between items):")
    if rep["quick"]:
        title = "QUICK RUN (a smoke run, not a measurement). " + title
    failed = [f"FAILED {c['system']}: {c['error']}" for c in rep["cases"] if "error" in c]
    over = ["", *_overhead_table(rep["python_over_rust"])] if rep["python_over_rust"] else []
    return "\n".join(_bench_report._grid(title, head, rows) + over + failed + rep["notes"])


def _short(system: str) -> str:
    """A tensor-broker system's name in a ratio column's head."""
    return system.replace("tensor-broker", "tb")


def _systems(arg: str) -> list[str]:
    """``--systems``: known names, comma-separated, in the table's order."""
    asked = [s.strip() for s in arg.split(",") if s.strip()]
    unknown = [s for s in asked if s not in SYSTEMS]
    if unknown or not asked:
        raise argparse.ArgumentTypeError(
            f"unknown system(s) {', '.join(unknown) or '(none)'}: pick from {', '.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in asked]


def main(argv: list[str]) -> int:
    """``python -m tensor_broker bench call``: runs it, prints JSON (``--json``) or a table."""
    parser = argparse.ArgumentParser(
        prog="python -m tensor_broker bench call",
        description="remote calls (echo, add_one, streaming) of tensor-broker vs gRPC and "
        "ZeroMQ between processes on this host")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true",
                        help="a short time per case, no 16 MiB cases with 64 callers (a smoke "
                        "run, under a minute)")
    parser.add_argument("--no-install", action="store_true",
                        help="skip gRPC / ZeroMQ when grpcio / pyzmq is missing instead of "
                        "pip-installing it")
    parser.add_argument("--tb", default=None,
                        help="the tb binary for the Rust side of Python's cost per call "
                        "(default: $TB_BIN, PATH, target/release)")
    parser.add_argument("--systems", type=_systems, default=list(SYSTEMS),
                        help="the systems to measure, comma-separated (default: "
                        f"{','.join(SYSTEMS)})")
    parser.add_argument("--no-loader", action="store_true",
                        help="skip the data-loading comparison (tb.Stream vs torch's "
                        "DataLoader; also `bench loader` on its own)")
    args = parser.parse_args(argv)
    from . import LocalCluster, _bench, _bench_loader

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = plan(args.quick)
    notes: list[str] = []
    systems = [s for s in args.systems if s in TB_CHANNELS]
    if "grpc" in args.systems and ensure_module("grpc", "grpcio", "grpc", not args.no_install,
                                                notes):
        systems.append("grpc")
    if "zmq" in args.systems and ensure_module("zmq", "pyzmq", "zmq", not args.no_install,
                                               notes):
        systems.append("zmq")
    dropped = [{"op": op, "size_bytes": size, "concurrency": conc, "servers": n,
                "why": "--quick"}
               for op, size, conc, n in itertools.product(OPS, SIZES, CONCURRENCY, SERVERS)
               if (size, conc) in p["drop"]]
    if dropped:
        notes.append("quick: dropped the 16 MiB cases with 64 callers (every system)")
    notes.append(f"callers: threads of one caller process; servers: {SERVER_PROCESSES} server "
                 "processes per system, a 1-server case uses the first; handlers: "
                 f"{SERVER_THREADS} threads per server (zmq: one REP thread)")
    notes.append("grpc and zmq: each caller thread sends its calls to the case's servers "
                 "round robin; tensor-broker spreads them itself")
    notes.append("stream: each stream read to its end; tensor-broker's f.stream with the "
                 "default prefetch=2, gRPC with its own flow control, zmq with a credit per "
                 f"item taken ({ZMQ_STREAM_AHEAD} ahead)")
    notes.append(f"{os.cpu_count()} CPU cores seen: every process of a system shares them")
    if not systems:
        print("bench call: no system to measure (--systems, and grpcio / pyzmq missing with "
              "--no-install)", file=sys.stderr)
        return 2
    tb_bin = _bench._find_tb(args.tb)
    if "tensor-broker" not in systems:
        notes.append("python over rust: skipped, tensor-broker is not among --systems")
        tb_bin = None
    elif tb_bin is None:
        notes.append("python over rust: skipped, no tb binary (--tb, $TB_BIN, PATH, "
                     "target/release)")
    elif not _speaks_call_bench(tb_bin):
        notes.append(f"python over rust: skipped, {tb_bin} has no `bench call --no-streams` "
                     "(an older build: rebuild it, cargo build --release)")
        tb_bin = None
    cases: list[dict[str, Any]] = []
    # Each tensor-broker system's data channel with each server, as its caller saw them.
    links: dict[str, Any] = {}
    over_rust: list[dict[str, Any]] = []
    children: list[_Proc] = []
    failed = True
    try:
        with LocalCluster() as cluster:
            try:
                for system in systems:
                    def progress(line: str, s: str = system) -> None:
                        print(f"{s}: {line}", file=sys.stderr, flush=True)

                    ran, links[system] = _run_system(system, cluster, p, children, progress)
                    cases += ran
                    if system == "tensor-broker" and tb_bin is not None:
                        # Right after the Python cases, so both sides see the same machine;
                        # a failure here is noted, and the other systems still run.
                        try:
                            over_rust = _rust_overhead(tb_bin, ran, max(p["seconds"], 0.5),
                                                       progress)
                        except BenchError as e:
                            notes.append(f"python over rust: failed: {e}")
                            progress(f"python over rust: failed: {e}")
                failed = False
            finally:
                # Before the cluster goes: every child, by its PID past a grace period.
                _stop_all(children, 2.0 if failed else 15.0)
        loaders: list[dict[str, Any]] = []
        if args.no_loader:
            notes.append("data loading: skipped (--no-loader)")
        elif ensure_module("torch", "torch", "torch's DataLoader", not args.no_install, notes):
            loaders = _bench_loader.run(args.quick, lambda line: print(
                f"loader: {line}", file=sys.stderr, flush=True))
    except BenchError as e:
        print(f"bench call failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench call interrupted", file=sys.stderr)
        return 130
    rep = {"quick": args.quick, "systems": systems, "seconds_per_case": p["seconds"],
           "min_calls_per_thread": {str(k): v for k, v in p["min_calls"].items()},
           "cases": cases, "links": links, "python_over_rust": over_rust, "dropped": dropped,
           "notes": notes,
           "loaders": loaders}
    print(json.dumps(rep, indent=2) if args.json else _table(rep) + (
        "\n\n" + _bench_loader.table(loaders) if loaders else ""))
    broken = [c for c in cases if "error" in c]
    if broken:
        print(f"bench call: {len(broken)} case(s) FAILED (their calls raised; figures "
              "missing):", *(f"{c['system']}: {c['error']}" for c in broken), sep="\n  ",
              file=sys.stderr)
        return 1
    return 0
