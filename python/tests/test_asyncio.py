"""``tensor_broker.asyncio``: every call as a coroutine, completed from the runtime, and
cancellation that leaves nothing behind."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import tensor_broker as tb
import tensor_broker.asyncio as tba

SIZES = [4 << 10, 1 << 20, 64 << 20]
# Longest any wait for a state below may take.
LIMIT_S = 30


def _payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8)


def run(coro):
    """Runs ``coro`` as the loop's only task, bounded in time."""

    async def bounded():
        async with asyncio.timeout(LIMIT_S * 4):
            return await coro

    return asyncio.run(bounded())


async def _until(what: str, check) -> None:
    """Waits (bounded) until ``await check()`` is true."""
    deadline = time.monotonic() + LIMIT_S
    while not await check():
        assert time.monotonic() < deadline, f"still not {what} after {LIMIT_S} s"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("size", SIZES)
def test_round_trips_by_name_and_push_are_byte_identical(cluster: tb.LocalCluster, size: int) -> None:
    data = _payload(size, size)

    async def main() -> None:
        async with await cluster.connect_async() as a, await cluster.connect_async() as b:
            assert isinstance(a, tba.AsyncClient)
            v = await a.put(f"rt/{size}", data)
            got = await b.get(f"rt/{size}", v)
            assert np.array_equal(got, data)
            out = np.empty_like(data)
            assert (await b.get(f"rt/{size}", out=out)) is out
            assert np.array_equal(out, data)
            await a.push(b.addr, "p", data)
            r = await b.recv(timeout=LIMIT_S)
            assert (r.name, r.sender) == ("p", a.id)
            assert np.array_equal(r.array(), data)
            # The sync client of the same process reads what the async one published.
            with cluster.connect() as c:
                assert np.array_equal(c.get(f"rt/{size}", v), data)

    run(main())


def test_sets_ls_status_and_subscribe(cluster: tb.LocalCluster) -> None:
    async def main() -> None:
        async with await tba.connect(
            cluster.ticket, secret_file=cluster.secret_file
        ) as a, await cluster.connect_async() as b:
            members = {"w": np.arange(6, dtype=np.float32), "b": np.ones(3, dtype=np.int64)}
            v = await a.put_many("set/m", members, metadata={"step": "3"})
            got = await b.get_many("set/m")
            assert got.keys() == members.keys()
            assert all(np.array_equal(got[k], members[k]) for k in members)
            version, _, meta = await b.get_set("set/m")
            assert (version, meta) == (v, {"step": "3"})
            assert [e.name for e in await b.ls("set/m")] == ["set/m"]
            status = await a.status()
            assert status["id"] == a.id and status["joined"]
            async with b.subscribe("sub/*") as sub:
                for i in range(3):
                    await a.put(f"sub/{i}", np.full(4, i, dtype=np.int16))
                seen = []
                async for update in sub:
                    seen.append((update.name, update.array().tolist()))
                    if len(seen) == 3:
                        break
            assert sorted(seen) == [(f"sub/{i}", [i] * 4) for i in range(3)]
            sub2 = await b.subscribe("never/*")
            with pytest.raises(tb.Timeout):
                await sub2.next(timeout=0.05)
            sub2.close()
            with pytest.raises(StopAsyncIteration):
                await sub2.next()

    run(main())


def test_errors_are_raised_from_the_await(cluster: tb.LocalCluster) -> None:
    async def main() -> None:
        async with await cluster.connect_async() as a:
            with pytest.raises(tb.NotFound):
                await a.get("no/such/name")
            with pytest.raises(tb.Timeout):
                await a.recv(timeout=0.05)
            with pytest.raises(tb.InvalidArgument):
                await a.push("nonsense", "x", np.zeros(1))
            with pytest.raises(ValueError):
                await a.get("x", timeout=-1)

    run(main())


def test_cancelled_recv_takes_nothing(cluster: tb.LocalCluster) -> None:
    async def main() -> None:
        async with await cluster.connect_async() as a, await cluster.connect_async() as b:
            waiting = asyncio.create_task(b.recv())
            await asyncio.sleep(0.1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await a.push(b.addr, "after", np.arange(5, dtype=np.int32))
            got = await b.recv(timeout=LIMIT_S)
            assert got.name == "after" and got.array().tolist() == list(range(5))
            # Cancelled at once with a timeout too (asyncio.timeout).
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await b.recv()
            assert (await b.status())["pushes_queued"] == 0
            assert asyncio.all_tasks() == {asyncio.current_task()}

    run(main())


def test_cancelled_get_leaves_no_partial_version(cluster: tb.LocalCluster, spawn) -> None:
    size = 256 << 20
    # A holder in another process, so the get crosses a channel and takes a while.
    child = spawn(
        f"""
        c = tb.connect(TICKET, secret_file=SECRET_FILE)
        data = np.random.default_rng(3).integers(0, 255, {size}, dtype=np.uint8)
        v = c.put("cancel/big", data)
        say(v, hashlib.sha256(data.tobytes()).hexdigest())
        wait_for_parent()
        c.close()
        """
    )
    version, digest = child.line().split()

    async def main() -> None:
        async with await cluster.connect_async() as b:
            for delay in (0.0, 0.01, 0.05):
                task = asyncio.create_task(b.get("cancel/big", int(version)))
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

                async def idle() -> bool:
                    return (await b.status())["versions_receiving"] == 0

                await _until("done receiving", idle)
                assert asyncio.all_tasks() == {asyncio.current_task()}
            # Nothing partial was kept: a get now receives the whole version, verified.
            got = await b.get("cancel/big", int(version), timeout=LIMIT_S * 2)
            import hashlib

            assert hashlib.sha256(got.tobytes()).hexdigest() == digest

    run(main())
    child.send()
    child.finish()


def test_async_calls_run_concurrently_on_one_loop(cluster: tb.LocalCluster) -> None:
    async def main() -> None:
        async with await cluster.connect_async() as a, await cluster.connect_async() as b:
            names = [f"conc/{i}" for i in range(16)]
            await asyncio.gather(*(a.put(n, np.full(64, i, np.int32)) for i, n in enumerate(names)))
            got = await asyncio.gather(*(b.get(n) for n in names))
            assert [g[0] for g in got] == list(range(16))
            # A recv waiting does not block other calls on the same loop.
            waiting = asyncio.create_task(b.recv(timeout=LIMIT_S))
            await a.push(b.addr, "late", np.zeros(8, np.uint8))
            assert (await waiting).name == "late"

    run(main())


def test_sync_client_arecv_and_aincoming(cluster: tb.LocalCluster) -> None:
    with cluster.connect() as a, cluster.connect() as b:

        async def main() -> None:
            for i in range(3):
                a.push(b.addr, f"i/{i}", np.full(2, i, np.uint8))
            first = await b.arecv(timeout=LIMIT_S)
            assert first.name == "i/0"
            rest = [r.name async for r in b.aincoming(timeout=0.1)]
            assert rest == ["i/1", "i/2"]

        run(main())


def test_a_cancelled_wait_on_a_subscription_loses_no_version(cluster: tb.LocalCluster) -> None:
    """Small versions come straight from their publisher once the subscription watches it;
    cancelling a task that awaits the next one neither ends the subscription nor loses the
    version that arrives after."""

    async def main() -> None:
        async with await cluster.connect_async() as a, await cluster.connect_async() as b:
            async with b.subscribe("cw") as sub:
                # The first versions are told by the broker; their events start the watch.
                for i in range(1, 6):
                    await a.put("cw", np.full(16, i, dtype=np.int32))
                    got = await sub.next(timeout=LIMIT_S)
                    assert (got.version, got.array().tolist()) == (i, [i] * 16)
                for i in range(6, 11):
                    waiting = asyncio.create_task(sub.next())
                    await asyncio.sleep(0.02)
                    waiting.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await waiting
                    await a.put("cw", np.full(16, i, dtype=np.int32))
                    got = await sub.next(timeout=LIMIT_S)
                    assert (got.version, got.array().tolist()) == (i, [i] * 16)
            assert asyncio.all_tasks() == {asyncio.current_task()}

    run(main())


def test_a_read_cancelled_after_it_took_its_tensor_gives_it_back(cluster: tb.LocalCluster) -> None:
    """Regression: an awaited ``recv`` (or subscription read) cancelled after the runtime
    took its tensor, but before the event loop delivered it, lost that tensor. The loop is
    held (no ``await``) while the tensor arrives, so the runtime completes the read and the
    loop cannot deliver it before the cancel."""

    async def main() -> None:
        async with await cluster.connect_async() as b:
            with cluster.connect() as pusher:
                for i in range(3):
                    fut = b._node.recv_async(None)
                    assert not fut.done()  # the inbox is empty: the read waits
                    pusher.push(b.addr, f"back/{i}", np.full(8, i, dtype=np.int16))
                    # The read takes it on the runtime meanwhile (the queue empties; the
                    # sync status call does not let the loop run).
                    deadline = time.monotonic() + LIMIT_S
                    while b._node.status()["pushes_queued"]:
                        assert time.monotonic() < deadline, "the waiting read took nothing"
                        time.sleep(0.01)
                    assert fut.cancel() and fut.cancelled()
                    got = await b.recv(timeout=LIMIT_S)
                    assert (got.name, got.array().tolist()) == (f"back/{i}", [i] * 8)
                # Back in order, ahead of what came after it; two given back in either
                # order go back in the order they came.
                fut = b._node.recv_async(None)
                pusher.push(b.addr, "back/first", np.zeros(2, dtype=np.int8))
                time.sleep(0.2)
                pusher.push(b.addr, "back/second", np.ones(2, dtype=np.int8))
                assert fut.cancel()
                names = [(await b.recv(timeout=LIMIT_S)).name for _ in range(2)]
                assert names == ["back/first", "back/second"]
                futs = [b._node.recv_async(None) for _ in range(2)]
                for name in ("back/x", "back/y", "back/z"):
                    pusher.push(b.addr, name, np.ones(2, dtype=np.int8))
                time.sleep(0.2)
                assert futs[1].cancel() and futs[0].cancel()
                names = [(await b.recv(timeout=LIMIT_S)).name for _ in range(3)]
                assert names == ["back/x", "back/y", "back/z"]
                assert (await b.status())["pushes_queued"] == 0
                # Subscription reads the same way. Nothing here shows whether the read took
                # the version before the cancel (0.3 s is ample on this VM); either way the
                # next read must return it, in order.
                async with b.subscribe("back/v") as sub:
                    for i in range(1, 4):
                        fut = sub._sub.next_async(None)
                        pusher.put("back/v", np.full(4, i, dtype=np.int32))
                        time.sleep(0.3)
                        assert fut.cancel()
                        got = await sub.next(timeout=LIMIT_S)
                        assert (got.version, got.array().tolist()) == (i, [i] * 4)
            assert asyncio.all_tasks() == {asyncio.current_task()}

    run(main())


def test_event_loops_in_several_threads_each_get_their_results(cluster: tb.LocalCluster) -> None:
    # Each loop has its own waker; a loop closed and a new one made (asyncio.run twice in a
    # thread) gets a new one. Every result reaches the loop that awaited it.
    import threading

    with cluster.connect() as seed:
        for i in range(8):
            seed.put(f"loops/{i}", np.full(16, i, np.int64))
        failures: list[BaseException] = []

        def worker(k: int) -> None:
            async def main() -> None:
                async with await cluster.connect_async() as c:
                    got = await asyncio.gather(*(c.get(f"loops/{i}") for i in range(8)))
                    assert [int(g[0]) for g in got] == list(range(8))
                    await c.put(f"loops/from/{k}", np.full(4, k, np.int32))
                    # Another client's blocking get on this loop's thread, while c holds it.
                    assert seed.get(f"loops/from/{k}").tolist() == [k] * 4

            try:
                for _ in range(2):
                    run(main())
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(LIMIT_S * 4)
        assert not any(t.is_alive() for t in threads)
        assert not failures, failures


def test_a_loop_that_cannot_watch_a_socket_still_gets_its_results(cluster: tb.LocalCluster) -> None:
    # Completions then come through call_soon_threadsafe (from a runtime thread with the GIL).
    class NoReaders(asyncio.SelectorEventLoop):
        def add_reader(self, *args, **kwargs):  # type: ignore[override]
            raise NotImplementedError("no readers here")

    async def main() -> None:
        async with await cluster.connect_async() as a, await cluster.connect_async() as b:
            await a.put("noreader/x", np.arange(6, dtype=np.int16))
            assert (await b.get("noreader/x")).tolist() == list(range(6))
            waiting = asyncio.create_task(b.recv(timeout=LIMIT_S))
            await asyncio.sleep(0.05)
            await a.push(b.addr, "noreader/p", np.ones(3, np.uint8))
            assert (await waiting).name == "noreader/p"

    loop = NoReaders()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), LIMIT_S * 4))
    finally:
        loop.close()


def test_ctrl_c_ends_an_asyncio_program_waiting_on_a_call(spawn) -> None:
    # asyncio.run turns SIGINT into cancelling the main task: the parked recv is dropped and
    # KeyboardInterrupt reaches the program, which can still use a new client afterwards.
    child = spawn(
        """
import asyncio
import tensor_broker.asyncio as tba
async def main():
    async with await tba.connect(TICKET, secret_file=SECRET_FILE) as c:
        say("waiting")
        await c.recv()
try:
    asyncio.run(main())
except KeyboardInterrupt:
    say("interrupted")
with tb.connect(TICKET, secret_file=SECRET_FILE) as c:
    say(c.status()["pushes_queued"])
"""
    )
    assert child.line() == "waiting"
    import os
    import signal

    os.kill(child.proc.pid, signal.SIGINT)
    assert child.line() == "interrupted"
    assert child.line() == "0"
    child.finish()


def test_an_awaited_calls_future_follows_asyncio_s_future_protocol(cluster: tb.LocalCluster) -> None:
    # What `await` waits on is the extension's own future (its done callbacks run as the
    # runtime completes it); asyncio's combinators, cancellation and contexts must work on it
    # as on a loop's `create_future()`.
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reported: list[dict] = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        async with await cluster.connect_async() as a, await cluster.connect_async() as b:
            # A pending one: the protocol's fields, then cancel(msg) with callbacks.
            fut = b._node.recv_async(None)
            assert asyncio.isfuture(fut) and not fut.done() and not fut.cancelled()
            assert fut.get_loop() is loop
            with pytest.raises(asyncio.InvalidStateError):
                fut.result()
            seen: list[tuple[str, object]] = []
            ctx = contextvars.copy_context()
            ctx.run(var.set, "in ctx")

            def cb(f: object) -> None:
                seen.append((var.get(), f))

            fut.add_done_callback(cb, context=ctx)
            fut.add_done_callback(seen.append)
            assert fut.remove_done_callback(seen.append) == 1
            assert fut.cancel("bye") and not fut.cancel()
            assert fut.done() and fut.cancelled()
            with pytest.raises(asyncio.CancelledError, match="bye"):
                fut.result()
            with pytest.raises(asyncio.CancelledError):
                fut.exception()
            assert seen == []  # scheduled, as asyncio does on cancel()
            await asyncio.sleep(0)
            assert seen == [("in ctx", fut)]
            # The cancelled recv took nothing: the next push goes to the next recv.
            await a.push(b.addr, "proto/p", np.arange(4, dtype=np.int8))
            assert (await b.recv(timeout=LIMIT_S)).name == "proto/p"
            assert (await b.status())["pushes_queued"] == 0

            # Completed by the runtime: every done callback runs, in its context; one that
            # raises goes to the loop's exception handler and does not stop the others.
            var.set("task")
            fut = b._node.recv_async(None)
            order: list[str] = []

            def boom(_f: object) -> None:
                order.append("boom")
                raise RuntimeError("a callback failed")

            fut.add_done_callback(boom)
            fut.add_done_callback(lambda f: order.append(f"{var.get()}:{f.result().name}"))
            await a.push(b.addr, "proto/q", np.ones(2, np.uint8))
            got = await fut
            assert got.name == "proto/q" and fut.exception() is None
            assert order == ["boom", "task:proto/q"]
            assert [str(r.get("exception")) for r in reported] == ["a callback failed"]
            assert var.get() == "task"
            # A callback added to a future already done is scheduled, not run inside the add.
            late: list[object] = []
            fut.add_done_callback(late.append)
            assert late == []
            await asyncio.sleep(0)
            assert late == [fut]

            # Failures: exception() and await both give the call's exception.
            fut = a._node.get_async("proto/none", None, None)
            with pytest.raises(tb.NotFound):
                await fut
            assert isinstance(fut.exception(), tb.NotFound)

            # Re-raising keeps the traceback it was set with (it does not grow per raise).
            depth = []
            for _ in range(3):
                try:
                    fut.result()
                except tb.NotFound as e:
                    t, n = e.__traceback__, 0
                    while t is not None:
                        t, n = t.tb_next, n + 1
                    depth.append(n)
            assert depth[0] == depth[1] == depth[2], depth

            # A callback whose __eq__ raises: remove_done_callback raises, and no callback
            # is lost.
            class Touchy:
                def __eq__(self, other: object) -> bool:
                    raise RuntimeError("no comparing")

                __hash__ = object.__hash__

                def __call__(self, f: object) -> None:
                    order.append("touchy")

            fut = b._node.recv_async(None)
            fut.add_done_callback(Touchy())
            fut.add_done_callback(lambda f: order.append("kept"))
            with pytest.raises(RuntimeError, match="no comparing"):
                fut.remove_done_callback(print)
            order.clear()
            await a.push(b.addr, "proto/t", np.ones(1, np.uint8))
            await fut
            assert order == ["touchy", "kept"]

            # gather over the raw futures: a cancelled child cancels it, or is returned.
            for return_exceptions in (False, True):
                children = [b._node.recv_async(None), a._node.ls_async("proto/")]
                g = asyncio.gather(*children, return_exceptions=return_exceptions)
                await asyncio.sleep(0)
                children[0].cancel("stop")
                if return_exceptions:
                    got = await asyncio.wait_for(g, LIMIT_S)
                    assert isinstance(got[0], asyncio.CancelledError) and "stop" in str(got[0])
                    assert got[1] == []  # nothing published under proto/ yet
                else:
                    with pytest.raises(asyncio.CancelledError):
                        await asyncio.wait_for(g, LIMIT_S)

            # Combinators: gather, wait, shield, wait_for (which cancels the call).
            await a.put("proto/x", np.arange(3, dtype=np.int64))
            xs = await asyncio.gather(*(a.get("proto/x") for _ in range(5)))
            assert [x.tolist() for x in xs] == [[0, 1, 2]] * 5
            done, pending = await asyncio.wait([asyncio.ensure_future(a._node.ls_async("proto/"))])
            assert not pending and [e.name for e in done.pop().result()] == ["proto/x"]
            assert (await asyncio.shield(a.get("proto/x"))).tolist() == [0, 1, 2]
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(b._node.recv_async(None), 0.05)
            await a.push(b.addr, "proto/r", np.zeros(1, np.uint8))
            assert (await b.recv(timeout=LIMIT_S)).name == "proto/r"
            assert asyncio.all_tasks() == {asyncio.current_task()}

    run(main())


def test_async_clients_take_channels_too(cluster: tb.LocalCluster) -> None:
    # connect_async(channels="quic"): two clients of one host move a tensor over QUIC alone.
    async def main() -> None:
        async with await cluster.connect_async(channels="quic") as a, \
                await cluster.connect_async(channels="quic") as b:
            x = np.arange(1 << 16, dtype=np.float32)
            await a.put("achannels/x", x)
            np.testing.assert_array_equal(await b.get("achannels/x"), x)
            assert dict((await b.status())["links"])[a.id] == "quic"
        with pytest.raises(ValueError, match="channels"):
            await cluster.connect_async(channels="udp")

    run(main())
