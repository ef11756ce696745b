"""Processes: finding the cluster from the environment, fork, Ctrl-C, LocalCluster workers."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import tensor_broker as tb


def test_connect_finds_the_cluster_from_the_environment(client: tb.Client, spawn, cluster) -> None:
    client.put("env/x", np.arange(3, dtype=np.int16))
    child = spawn(
        """
with tb.connect() as c:
    say(c.get("env/x").tolist())
""",
        env={"TB_JOIN": cluster.ticket, "TB_CLUSTER_SECRET_FILE": cluster.secret_file},
    )
    assert child.line() == "[0, 1, 2]"
    child.finish()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_gets_a_clear_error(client: tb.Client) -> None:
    client.put("fork/x", np.zeros(2))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what a call raises, then leave at once
        os.close(r)
        try:
            client.ls()
            message = "no error"
        except tb.TensorBrokerError as e:
            message = str(e)
        except BaseException as e:  # noqa: BLE001 - anything else is a failure to report
            message = f"wrong error {type(e).__name__}: {e}"
        os.write(w, message.encode())
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r) as f:
            message = f.read()
    finally:
        os.waitpid(pid, 0)
    assert "fork" in message, message
    # The parent goes on as before.
    assert client.get("fork/x").tolist() == [0.0, 0.0]


def test_ctrl_c_interrupts_a_blocking_wait(spawn) -> None:
    child = spawn(
        """
c = tb.connect(TICKET, secret_file=SECRET_FILE)
sub = c.subscribe("never/*")
try:
    say("waiting")  # inside the try: the signal may land before next() starts waiting
    sub.next()
except KeyboardInterrupt:
    say("interrupted")
"""
    )
    assert child.line() == "waiting"
    os.kill(child.proc.pid, signal.SIGINT)
    assert child.line() == "interrupted"
    child.finish()


def test_local_cluster_workers() -> None:
    with tb.LocalCluster(workers=2) as c:
        assert len(c.workers) == 2
        with c.connect() as a, c.connect() as b:
            a.put("w/x", np.ones(4))
            assert b.get("w/x").tolist() == [1.0] * 4
            roles = sorted(m["role"] for m in b.status()["members"])
            assert roles.count("broker") == 1 and roles.count("worker") >= 4
    assert c._cluster.closed
    with pytest.raises(tb.Unavailable):
        c.connect()


@pytest.mark.parametrize("threads", ["1", "3"])
def test_runtime_threads_from_the_environment(client: tb.Client, spawn, threads: str) -> None:
    client.put("threads/x", np.arange(4, dtype=np.int32))
    # A get, a put seen by this process, and an awaited round trip, on that many workers.
    child = spawn(
        """
import asyncio
with tb.connect(TICKET, secret_file=SECRET_FILE) as c:
    say(c.get("threads/x").tolist())
    c.put("threads/y", np.full(3, 7, np.uint8))
    async def main():
        async with await tb.asyncio.connect(TICKET, secret_file=SECRET_FILE) as a:
            return (await a.get("threads/x")).tolist()
    import tensor_broker.asyncio
    say(asyncio.run(main()))
    wait_for_parent()
""",
        env={"TB_RUNTIME_THREADS": threads},
    )
    assert child.line() == "[0, 1, 2, 3]"
    assert child.line() == "[0, 1, 2, 3]"
    assert client.get("threads/y").tolist() == [7, 7, 7]
    child.send()
    child.finish()


@pytest.mark.parametrize("bad", ["0", "many", "-2"])
def test_a_bad_runtime_threads_value_is_a_clear_error(spawn, bad: str) -> None:
    child = spawn(
        """
try:
    tb.connect(TICKET, secret_file=SECRET_FILE)
    say("connected")
except tb.InvalidArgument as e:
    say("refused", "TB_RUNTIME_THREADS" in str(e))
""",
        env={"TB_RUNTIME_THREADS": bad},
    )
    assert child.line() == "refused True"
    child.finish()
