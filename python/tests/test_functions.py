"""Remote functions from Python: ``@client.share`` / ``client.serving()`` on one side,
``client.function(name)`` on the other, in one process and across processes. Results equal
what the handler computed; errors keep their type; cancellation reaches the handler; an
overloaded server says so."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest

import tensor_broker as tb
import tensor_broker.asyncio as tba

LIMIT_S = 30


def test_a_shared_function_is_called_by_name_with_arrays_and_plain_values(
    cluster: tb.LocalCluster,
) -> None:
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("math/affine", concurrency=4)
        def affine(x: np.ndarray, scale: float = 1.0, *, bias: np.ndarray | None = None) -> dict:
            # In-place on what arrived: the argument is the handler's own memory.
            x *= scale
            if bias is not None:
                x += bias
            return {"y": x, "n": int(x.size), "tag": "ok", "shape": list(x.shape)}

        with server.serving():
            f = caller.function("math/affine")
            x = np.arange(12, dtype=np.float32).reshape(3, 4)
            bias = np.ones(4, dtype=np.float32)
            out = f(x, 2.0, bias=bias, timeout=LIMIT_S)
            np.testing.assert_array_equal(out["y"], x * 2 + 1)
            assert out["y"].dtype == np.float32 and out["y"].shape == (3, 4)
            assert (out["n"], out["tag"], out["shape"]) == (12, "ok", [3, 4])
            # The caller's own array is untouched; the result is writable, owned memory.
            np.testing.assert_array_equal(x, np.arange(12, dtype=np.float32).reshape(3, 4))
            out["y"] += 1

            # A 16 MiB argument (pulled once accepted) comes back byte for byte.
            big = np.random.default_rng(1).integers(0, 255, 16 << 20, dtype=np.uint8)
            same = f(big, 1, timeout=LIMIT_S)["y"]
            assert same.tobytes() == big.tobytes()

            # out= receives a one-tensor result (checked first); device= returns torch tensors.
            double = caller.function("math/affine")
            out = np.empty((3, 4), np.float32)
            got = double(np.ones((3, 4), np.float32), 3.0, timeout=LIMIT_S)["y"]
            assert got.shape == (3, 4)
            with pytest.raises(TypeError):
                double(np.ones(4, np.float32), 3.0, out=out, timeout=LIMIT_S)  # a dict result
            with pytest.raises(ValueError):
                double(np.ones(4, np.float32), out=out, device="cpu", timeout=LIMIT_S)

            # submit and map, results in order.
            futures = [f.submit(np.full(3, i, np.float32), timeout=LIMIT_S) for i in range(8)]
            assert [int(fu.result(LIMIT_S)["y"][0]) for fu in futures] == list(range(8))
            mapped = list(f.map((np.full(2, i, np.float64) for i in range(20)), parallel=4))
            assert [int(m["y"][1]) for m in mapped] == list(range(20))

            assert ("math/affine", 1) in caller.functions("math/")

            # A tensor already in the cluster, passed by name: the server gets it itself.
            w = np.arange(6, dtype=np.float32)
            version = caller.put("shared/w", w)
            out = f(tb.Ref("shared/w", version), 3.0, timeout=LIMIT_S)
            np.testing.assert_array_equal(out["y"], w * 3)
            out = f(tb.Ref("shared/w"), 1.0, timeout=LIMIT_S)
            np.testing.assert_array_equal(out["y"], w)
            with pytest.raises(LookupError):
                f(tb.Ref("shared/missing"), timeout=LIMIT_S)


def test_calls_made_one_at_a_time_run_on_one_handler_thread_after_a_burst(
    cluster: tb.LocalCluster,
) -> None:
    """A burst of concurrent calls leaves 8 handler threads; the calls made one at a time
    after it run on the thread that went idle last (warm: its malloc arena and caches), not
    in turn on each of the 8, as a first-in-first-out pool of threads would run them."""
    with cluster.connect() as server, cluster.connect() as caller:
        started = threading.Barrier(8, timeout=LIMIT_S)

        @server.share("threads/which", concurrency=8)
        def which(burst: bool) -> int:
            if burst:
                started.wait()  # all 8 at once: 8 threads
            return threading.get_ident()

        with server.serving():
            f = caller.function("threads/which")
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                burst = list(pool.map(lambda _: f(True, timeout=LIMIT_S), range(8)))
            assert len(set(burst)) == 8
            after = [f(False, timeout=LIMIT_S) for _ in range(32)]
            # One thread, give or take one whose call came back before it was idle again.
            assert len(set(after)) <= 2, sorted(set(after))
            assert set(after) <= set(burst), "no new thread while 8 are idle"


def test_remote_exceptions_keep_their_type_message_and_traceback(cluster: tb.LocalCluster) -> None:
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("fails")
        def fails(kind: str) -> None:
            if kind == "value":
                raise ValueError("no such value")
            raise KeyError("custom")

        with server.serving():
            f = caller.function("fails")
            with pytest.raises(ValueError) as info:
                f("value", timeout=LIMIT_S)
            err = info.value
            assert isinstance(err, tb.RemoteError)
            assert err.remote_type == "ValueError"
            assert "no such value" in str(err)
            assert "raise ValueError" in err.remote_traceback
            assert err.server and server.id.startswith(err.server), (err.server, server.id)
            with pytest.raises(KeyError):
                f("key", timeout=LIMIT_S)
            # Nobody serves this one.
            with pytest.raises(tb.NotFound):
                caller.function("nobody/serves/this")(1, timeout=LIMIT_S)
            # Values that cannot be sent fail before a byte moves.
            with pytest.raises(TypeError):
                f(object(), timeout=LIMIT_S)


def test_a_timeout_cancels_the_running_handler_and_overload_is_typed(
    cluster: tb.LocalCluster,
) -> None:
    started = threading.Event()
    saw_cancel = threading.Event()
    release = threading.Event()
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("slow", concurrency=1, queue=0)
        def slow(mode: str) -> str:
            started.set()
            deadline = time.monotonic() + LIMIT_S
            while time.monotonic() < deadline:
                if mode == "poll" and tb.cancelled():
                    saw_cancel.set()
                    return "cancelled"
                if mode == "hold" and release.is_set():
                    return "released"
                time.sleep(0.01)
            return "never"

        with server.serving():
            f = caller.function("slow")
            with pytest.raises(tb.Timeout):
                f("poll", timeout=0.5)
            assert saw_cancel.wait(LIMIT_S), "the handler never saw its call cancelled"

            # One call holds the only slot: the next is refused as overloaded.
            started.clear()
            holder = f.submit("hold", timeout=LIMIT_S)
            assert started.wait(LIMIT_S)
            with pytest.raises(tb.Overloaded):
                f("hold", timeout=LIMIT_S)
            release.set()
            assert holder.result(LIMIT_S) == "released"


def test_streaming_functions_and_asyncio_calls(cluster: tb.LocalCluster) -> None:
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("count")
        def count(n: int):
            for i in range(n):
                yield np.full(4, i, dtype=np.int32)

        @server.share("double", concurrency=2)
        async def double(x: np.ndarray) -> np.ndarray:
            await asyncio.sleep(0)
            return x * 2

        with server.serving():
            items = list(caller.function("count").stream(20, prefetch=2))
            assert [int(a[0]) for a in items] == list(range(20))
            assert all(a.dtype == np.int32 and a.shape == (4,) for a in items)

            async def main() -> None:
                async with await tba.connect(cluster.ticket, secret_file=cluster.secret_file) as client:
                    f = client.function("double")
                    out = await asyncio.wait_for(f(np.arange(5)), LIMIT_S)
                    np.testing.assert_array_equal(out, np.arange(5) * 2)
                    got = [int(a[0]) async for a in client.function("count").stream(5)]
                    assert got == list(range(5))

            asyncio.run(main())


def test_out_and_device_place_a_result(cluster: tb.LocalCluster) -> None:
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("math/scale")
        def scale(x: np.ndarray, k: float) -> np.ndarray:
            return x * np.float32(k)

        with server.serving():
            f = caller.function("math/scale")
            for n in (6, 1 << 20):  # inline and lent
                x = np.arange(n, dtype=np.float32)
                out = np.full(n, -1, np.float32)
                assert f(x, 2.0, out=out, timeout=LIMIT_S) is out
                np.testing.assert_array_equal(out, x * 2)
                # Another shape or dtype is refused before anything is written.
                wrong = np.full(n + 1, -1, np.float32)
                with pytest.raises(ValueError, match="shape"):
                    f(x, 2.0, out=wrong, timeout=LIMIT_S)
                assert (wrong == -1).all()
                with pytest.raises(ValueError, match="read-only"):
                    f(x, 2.0, out=_read_only(n), timeout=LIMIT_S)
            torch = pytest.importorskip("torch")
            t = f(np.arange(4, dtype=np.float32), 3.0, device="cpu", timeout=LIMIT_S)
            assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
            assert torch.equal(t, torch.arange(4, dtype=torch.float32) * 3)
            tout = torch.empty(4)
            assert f(np.arange(4, dtype=np.float32), 1.0, out=tout, timeout=LIMIT_S) is tout
            assert torch.equal(tout, torch.arange(4, dtype=torch.float32))


def _read_only(n: int) -> np.ndarray:
    a = np.zeros(n, np.float32)
    a.setflags(write=False)
    return a


def test_torch_tensors_in_and_out(cluster: tb.LocalCluster) -> None:
    torch = pytest.importorskip("torch")
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("torch/add_one", torch=True)
        def add_one(x):
            assert isinstance(x, torch.Tensor)
            x.add_(1)  # in place, on the handler's own copy
            return x

        with server.serving():
            x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
            out = caller.function("torch/add_one")(x, timeout=LIMIT_S)
            assert isinstance(out, torch.Tensor)
            assert torch.equal(out, x + 1)
            assert torch.equal(x, torch.arange(6, dtype=torch.float32).reshape(2, 3))
            # Large ones travel as loans (the server maps the caller's memfd, and the caller
            # the server's): in-place ops on either side change only that side's view.
            for _ in range(3):
                big = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
                out = caller.function("torch/add_one")(big, timeout=LIMIT_S)
                assert torch.equal(out, big + 1)
                assert torch.equal(big, torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024))
                out.mul_(2)
                assert torch.equal(out, (big + 1) * 2)


def test_a_function_served_by_another_process(cluster: tb.LocalCluster, spawn) -> None:
    child = spawn(
        """
        client = tb.connect(TICKET, secret_file=SECRET_FILE)

        @client.share("proc/add_one", concurrency=2)
        def add_one(x):
            return x + 1

        with client.serving():
            say("serving")
            wait_for_parent()
        client.close()
        """
    )
    assert child.line() == "serving"
    with cluster.connect() as caller:
        f = caller.function("proc/add_one")
        x = np.random.default_rng(3).standard_normal(1024).astype(np.float32)
        for _ in range(50):
            np.testing.assert_array_equal(f(x, timeout=LIMIT_S), x + 1)
        # 4 MiB each way between processes: lent over the same-host channel once it is up.
        big = np.random.default_rng(4).integers(-1000, 1000, 1 << 20).astype(np.float32)
        for _ in range(5):
            out = f(big, timeout=LIMIT_S)
            np.testing.assert_array_equal(out, big + 1)
            out += 1  # the caller's own memory
            np.testing.assert_array_equal(out, big + 2)
        child.send()
        child.finish()


def test_cancelling_the_awaiting_task_cancels_the_handler(cluster: tb.LocalCluster) -> None:
    started = threading.Event()
    saw_cancel = threading.Event()
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("slow/async")
        def slow() -> str:
            started.set()
            deadline = time.monotonic() + LIMIT_S
            while time.monotonic() < deadline:
                if tb.cancelled():
                    saw_cancel.set()
                    return "cancelled"
                time.sleep(0.01)
            return "never"

        with server.serving():

            async def main() -> None:
                task = asyncio.ensure_future(caller.function("slow/async").acall())
                while not started.is_set():
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            asyncio.run(asyncio.wait_for(main(), LIMIT_S))
            assert saw_cancel.wait(LIMIT_S), "an asyncio cancel did not reach the handler"


def test_a_cancelled_stream_closes_its_generator_at_once(cluster: tb.LocalCluster) -> None:
    # The generator is suspended at a `yield` (its next item has no credit) when the call
    # ends: its `finally` runs then, not whenever the extension next takes the GIL.
    closed = threading.Event()
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("gen/endless")
        def endless():
            try:
                i = 0
                while True:
                    i += 1
                    yield np.full(4, i, np.float32)
            finally:
                closed.set()

        with server.serving():
            items = caller.function("gen/endless").stream(prefetch=1)
            got = [int(next(items)[0]) for _ in range(3)]
            items.close()
            assert got == [1, 2, 3]
            assert closed.wait(LIMIT_S), "the cancelled stream's generator was not closed"


def test_a_cancelled_stream_closes_its_async_generator_at_once(
    cluster: tb.LocalCluster,
) -> None:
    # As above, for an async generator handler: its `finally` runs on its loop when the
    # call ends, not when the generator object is collected.
    closed = threading.Event()
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("gen/endless-async")
        async def endless():
            try:
                i = 0
                while True:
                    i += 1
                    await asyncio.sleep(0)
                    yield np.full(4, i, np.float32)
            finally:
                closed.set()

        with server.serving():
            items = caller.function("gen/endless-async").stream(prefetch=1)
            got = [int(next(items)[0]) for _ in range(3)]
            items.close()
            assert got == [1, 2, 3]
            assert closed.wait(LIMIT_S), "the cancelled stream's async generator was not closed"


def test_cancelling_a_bidirectional_stream_ends_its_handler_and_its_inputs(
    cluster: tb.LocalCluster,
) -> None:
    closed = threading.Event()
    offered = [0]
    got: list[int] = []
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("bidi/echo", inputs=True)
        def echo_each(items):
            try:
                for x in items:
                    yield x
            finally:
                closed.set()

        def endless():
            while True:
                offered[0] += 1
                yield np.full(4, offered[0], np.float32)

        with server.serving():

            async def main() -> None:
                async with await cluster.connect_async() as client:

                    async def consume() -> None:
                        async for y in client.function("bidi/echo").stream(inputs=endless()):
                            got.append(int(y[0]))

                    task = asyncio.ensure_future(consume())
                    while len(got) < 3:
                        await asyncio.sleep(0.01)
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    assert got[:3] == [1, 2, 3]

            asyncio.run(asyncio.wait_for(main(), LIMIT_S))
            assert closed.wait(LIMIT_S), "the cancel did not end the handler's inputs"
            taken = offered[0]
            time.sleep(0.3)
            assert offered[0] == taken, "inputs were still taken after the cancel"
            # Ahead of what was consumed, at most: 2 prefetched results, the handler's item and
            # channel, 2 inputs waiting on the server, the caller's input channel and feeder.
            assert taken <= len(got) + 10, f"{taken} inputs taken for {len(got)} results"


def test_bidirectional_functions_take_a_stream_of_inputs(cluster: tb.LocalCluster) -> None:
    from typing import AsyncIterator, Iterator

    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("bidi/scale", inputs=True)
        def scale(items, k):
            for x in items:
                x *= k  # the handler's own memory
                yield x

        @server.share("bidi/running")
        def running(items: Iterator[int]):
            total = 0
            for x in items:
                total += x
                yield total

        @server.share("bidi/async_up")
        async def async_up(items: AsyncIterator[np.ndarray]):
            async for x in items:
                yield x + 1

        @server.share("bidi/plain")
        def plain(n):
            yield from range(n)

        with server.serving():
            f = caller.function("bidi/scale")
            xs = [np.full(4, i, np.float32) for i in range(50)]
            got = list(f.stream(3.0, inputs=iter(xs)))
            assert len(got) == 50
            for i, y in enumerate(got):
                np.testing.assert_array_equal(y, np.full(4, i * 3, np.float32))
            # Large ones (lent over the same-host channel), each back in order.
            big = [np.arange(1 << 18, dtype=np.float32) + i for i in range(5)]
            for i, y in enumerate(f.stream(2.0, inputs=big)):
                np.testing.assert_array_equal(y, big[i] * 2)

            assert list(caller.function("bidi/running").stream(inputs=range(100))) == [
                i * (i + 1) // 2 for i in range(100)
            ]
            # Called without inputs, its inputs end at once.
            assert list(caller.function("bidi/running").stream()) == []

            ups = list(caller.function("bidi/async_up").stream(
                inputs=(np.full(3, i, np.int64) for i in range(20))))
            assert [int(u[0]) for u in ups] == [i + 1 for i in range(20)]

            # An exception the inputs raise comes back to the consumer.
            def broken():
                yield 1
                raise KeyError("input 2 is missing")

            with pytest.raises(KeyError):
                list(caller.function("bidi/running").stream(inputs=broken()))

            # Inputs to a function that takes none are refused before any moves.
            with pytest.raises(ValueError, match="takes no inputs"):
                list(caller.function("bidi/plain").stream(3, inputs=[1, 2]))

            async def main() -> None:
                async with await cluster.connect_async() as client:
                    f = client.function("bidi/running")
                    got = [x async for x in f.stream(inputs=range(10))]
                    assert got == [i * (i + 1) // 2 for i in range(10)]

            asyncio.run(main())
