"""Remote functions across real processes: servers killed mid-run, a rolling restart, Ctrl-C
in a caller, and a stalled consumer of a stream. Every wait is bounded; every child process
is stopped by the ``spawn`` fixture."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import numpy as np
import pytest

import tensor_broker as tb

LIMIT_S = 60

SERVER = """
client = tb.connect(TICKET, secret_file=SECRET_FILE)

@client.share("procs/add", concurrency=4, idempotent=True)
def add(x, k):
    return x + k

say("serving", os.getpid())
client.serve()          # until SIGTERM (drains) or SIGKILL
say("drained")
client.close()
"""


def _servers(cluster: tb.LocalCluster, caller: tb.Client, spawn, n: int) -> list:
    children = [spawn(SERVER) for _ in range(n)]
    for child in children:
        assert child.line().startswith("serving")
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        if ("procs/add", n) in caller.functions("procs/"):
            return children
        time.sleep(0.05)
    raise AssertionError(f"{n} servers never listed: {caller.functions('procs/')}")


def _run_calls(f, callers: int, per_caller: int, halfway: threading.Event) -> tuple[int, list]:
    """``callers`` threads each make ``per_caller`` calls; returns (ok count, failures)."""
    failures: list = []
    ok = 0
    lock = threading.Lock()

    def work(seed: int) -> None:
        nonlocal ok
        rng = np.random.default_rng(seed)
        for i in range(per_caller):
            if seed == 0 and i == per_caller // 2:
                halfway.set()
            x = rng.standard_normal(64).astype(np.float32)
            k = int(rng.integers(0, 100))
            try:
                got = f(x, k, timeout=LIMIT_S)
            except tb.TensorBrokerError as e:
                with lock:
                    failures.append(e)
                continue
            # Never a wrong result.
            np.testing.assert_array_equal(got, x + k)
            with lock:
                ok += 1

    with concurrent.futures.ThreadPoolExecutor(callers) as pool:
        for fut in [pool.submit(work, s) for s in range(callers)]:
            fut.result(timeout=LIMIT_S * 10)
    return ok, failures


def test_a_server_killed_halfway_loses_no_idempotent_call(cluster: tb.LocalCluster, spawn) -> None:
    with cluster.connect() as caller:
        children = _servers(cluster, caller, spawn, 3)
        halfway = threading.Event()

        def kill_one() -> None:
            assert halfway.wait(LIMIT_S)
            children[0].proc.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_one)
        killer.start()
        f = caller.function("procs/add", idempotent=True)
        ok, failures = _run_calls(f, callers=4, per_caller=2500, halfway=halfway)
        killer.join(LIMIT_S)
        assert failures == [], failures[:3]
        assert ok == 10_000


def test_a_rolling_restart_fails_no_call(cluster: tb.LocalCluster, spawn) -> None:
    with cluster.connect() as caller:
        children = _servers(cluster, caller, spawn, 2)
        halfway = threading.Event()

        def restart() -> None:
            assert halfway.wait(LIMIT_S)
            # A replacement first, then SIGTERM the old server: it drains and exits.
            fresh = spawn(SERVER)
            assert fresh.line().startswith("serving")
            children[0].proc.send_signal(signal.SIGTERM)
            assert children[0].line() == "drained"

        restarter = threading.Thread(target=restart)
        restarter.start()
        # Not idempotent: a call lost mid-run would fail rather than be retried.
        f = caller.function("procs/add")
        ok, failures = _run_calls(f, callers=2, per_caller=1000, halfway=halfway)
        restarter.join(LIMIT_S)
        assert failures == [], failures[:3]
        assert ok == 2000


def test_ctrl_c_in_a_caller_cancels_the_handler(cluster: tb.LocalCluster, spawn) -> None:
    started = threading.Event()
    saw_cancel = threading.Event()
    with cluster.connect() as server:

        @server.share("procs/slow")
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
            child = spawn(
                """
                client = tb.connect(TICKET, secret_file=SECRET_FILE)
                say("calling")
                try:
                    client.function("procs/slow")()
                    say("returned")
                except KeyboardInterrupt:
                    say("interrupted")
                client.close()
                """
            )
            assert child.line() == "calling"
            assert started.wait(LIMIT_S), "the call never reached the handler"
            child.proc.send_signal(signal.SIGINT)
            assert child.line() == "interrupted"
            assert saw_cancel.wait(LIMIT_S), "Ctrl-C in the caller did not cancel the handler"
            child.finish()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_stalled_consumer_keeps_the_producers_memory_flat(cluster: tb.LocalCluster, spawn) -> None:
    producer = spawn(
        """
        client = tb.connect(TICKET, secret_file=SECRET_FILE)
        made = [0]

        @client.share("procs/items")
        def items(n):
            for i in range(n):
                made[0] += 1
                yield np.full(1 << 20, i % 251, dtype=np.uint8)

        with client.serving():
            say("serving", os.getpid())
            while wait_for_parent() == "made":
                say(made[0])
        client.close()
        """
    )
    line = producer.line()
    assert line.startswith("serving")
    pid = int(line.split()[1])
    with cluster.connect() as consumer:
        deadline = time.monotonic() + LIMIT_S
        while ("procs/items", 1) not in consumer.functions("procs/"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # 1 GiB offered, prefetch 2: take three items, then stall.
        stream = consumer.function("procs/items").stream(1024, prefetch=2)
        for i in range(3):
            assert int(next(stream)[0]) == i
        time.sleep(1.0)
        before = _rss_mib(pid)
        producer.send("made")
        made_then = int(producer.line())
        time.sleep(2.0)
        producer.send("made")
        made_later = int(producer.line())
        after = _rss_mib(pid)
        # The producer ran at most a few items ahead, and its memory stayed flat.
        assert made_later == made_then <= 3 + 2 + 2, (made_then, made_later)
        assert after - before < 32, (before, after)
        # Taking more resumes it, in order.
        for i in range(3, 8):
            assert int(next(stream)[0]) == i
        stream.close()
    producer.send("stop")
    producer.finish()


def test_a_resumable_stream_survives_its_servers_death_with_items_exactly_once(
    cluster: tb.LocalCluster, spawn
) -> None:
    code = """
    client = tb.connect(TICKET, secret_file=SECRET_FILE)

    @client.share("procs/ticks", resumable=True)
    def ticks(n, *, start=0):
        for i in range(start, n):
            time.sleep(0.005)
            yield {"i": i, "pid": os.getpid()}

    import time
    say("serving", os.getpid())
    client.serve()
    """
    servers = [spawn(code) for _ in range(2)]
    for s in servers:
        assert s.line().startswith("serving")
    with cluster.connect() as caller:
        deadline = time.monotonic() + LIMIT_S
        while ("procs/ticks", 2) not in caller.functions("procs/"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got, pids = [], set()
        for item in caller.function("procs/ticks").stream(300, prefetch=4):
            got.append(item["i"])
            pids.add(item["pid"])
            if len(got) == 100:
                # Kill the server producing this stream, mid-stream.
                os.kill(item["pid"], signal.SIGKILL)
        assert got == list(range(300)), [g for g in got if got.count(g) > 1][:5]
        assert len(pids) == 2, pids
