"""Regression tests for memory- and thread-safety defects a Python user could hit: a view
dtype that crashed the process, a close() that hung behind a waiting iterator, and two
receives writing one out array at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import tensor_broker as tb

# Longest an isolated child process (its own cluster) may run.
ISOLATED_LIMIT_S = 120
# Longest a thread of a test may take to finish once it should.
JOIN_LIMIT_S = 10


def run_isolated(code: str) -> str:
    """Runs ``code`` in a fresh interpreter with ``tb`` and ``np`` imported, so a crash or a
    hang fails the test (a return code, a timeout) instead of killing or stalling pytest;
    returns its stdout. Fails with its stderr on a non-zero status."""
    prelude = "import threading, time\nimport numpy as np\nimport tensor_broker as tb\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=ISOLATED_LIMIT_S,
    )
    assert done.returncode == 0, f"child failed ({done.returncode}): {done.stderr}"
    return done.stdout


def test_numpy_view_refuses_object_and_structured_dtypes_instead_of_crashing() -> None:
    out = run_isolated(
        """
        with tb.LocalCluster() as cluster, cluster.connect() as c:
            c.put("safety/i64", np.arange(4, dtype=np.int64))
            buf = c.get_buffer("safety/i64")
            refused = [
                np.dtype(object),
                np.dtype([("a", np.int32), ("b", np.int32)]),
                np.dtype([("o", object)]),
                np.dtype((np.int32, (2,))),
                np.dtype("V8"),
            ]
            for dtype in refused:
                try:
                    buf.numpy(dtype)
                except TypeError as e:
                    assert "cannot view" in str(e), e
                else:
                    raise AssertionError(f"{dtype} was accepted")
            # A plain dtype of the same size still views the bytes.
            assert buf.numpy(np.dtype(np.int64)).tolist() == [0, 1, 2, 3]
            assert buf.numpy(np.dtype(np.float64)).shape == (4,)
            print("alive")
        """
    )
    assert out.strip() == "alive"


def test_close_from_another_thread_ends_a_waiting_iteration() -> None:
    out = run_isolated(
        f"""
        with tb.LocalCluster() as cluster, cluster.connect() as c:
            sub = c.subscribe("safety/idle/*")
            seen, ended, waiting = [], threading.Event(), threading.Event()

            def iterate():
                waiting.set()
                for u in sub:  # nothing is published: blocks in next()
                    seen.append(u)
                ended.set()

            t = threading.Thread(target=iterate, daemon=True)
            t.start()
            assert waiting.wait({JOIN_LIMIT_S})
            time.sleep(0.3)  # the iterator is now waiting inside next()
            closer = threading.Thread(target=sub.close, daemon=True)
            start = time.monotonic()
            closer.start()
            closer.join({JOIN_LIMIT_S})
            assert not closer.is_alive(), "close() did not return"
            t.join({JOIN_LIMIT_S})
            assert not t.is_alive(), "the iteration did not end"
            assert ended.is_set() and seen == []
            took = time.monotonic() - start
            # A closed subscription answers at once, and close() again is harmless.
            sub.close()
            try:
                sub.next(timeout=5.0)
            except StopIteration:
                pass
            else:
                raise AssertionError("next() after close() gave an update")
            print("ended", took)
        """
    )
    word, took = out.split()
    assert word == "ended"
    assert float(took) < 5.0


def zeros_out(kind: str, n: int):  # type: ignore[no-untyped-def]
    """A zeroed int32 ``out`` of ``n`` items: a numpy array, or a torch tensor (which hands
    numpy a new owner object for every view of it)."""
    if kind == "torch":
        torch = pytest.importorskip("torch", reason="torch is not installed")
        return torch.zeros(n, dtype=torch.int32)
    return np.zeros(n, dtype=np.int32)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_second_receive_into_the_same_out_is_refused_while_one_is_pending(
    client: tb.Client, spawn, kind: str
) -> None:
    # The only holder is a stopped process: a get into `out` stays pending (holding `out`)
    # until the holder resumes, so a second get into `out`, or into a view of it, must be
    # refused at once, never run beside it.
    n = 1 << 20
    name = f"safety/pending-{kind}"
    child = spawn(
        f"""
c = tb.connect(TICKET, secret_file=SECRET_FILE)
c.put("{name}", np.arange({n}, dtype=np.int32))
say("ready")
wait_for_parent()
"""
    )
    assert child.line() == "ready"
    out = zeros_out(kind, n)
    targets = {"whole": out, "view": out[:]}
    results: dict[str, object] = {}
    go = threading.Barrier(2, timeout=JOIN_LIMIT_S)
    first_done = threading.Event()

    def receive(key: str) -> None:
        go.wait()
        try:
            results[key] = client.get(name, out=targets[key], timeout=60)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            results[key] = e
        first_done.set()

    os.kill(child.proc.pid, signal.SIGSTOP)
    threads = [threading.Thread(target=receive, args=(k,), daemon=True) for k in targets]
    try:
        for t in threads:
            t.start()
        # Neither can finish while the holder is stopped, except by being refused.
        assert first_done.wait(JOIN_LIMIT_S), "neither call was refused"
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    refused = [k for k, r in results.items() if isinstance(r, BufferError)]
    assert len(refused) == 1, results
    assert "already being written" in str(results[refused[0]])
    (done,) = [k for k in results if k not in refused]
    assert results[done] is targets[done], results
    assert np.array_equal(np.asarray(out), np.arange(n, dtype=np.int32))
    child.send()
    child.finish()


def test_out_is_free_again_after_a_call_ends(client: tb.Client) -> None:
    a = np.arange(1024, dtype=np.float32)
    client.put("safety/again", a)
    out = np.zeros_like(a)
    with pytest.raises(tb.NotFound):
        client.get("safety/missing", out=out)
    with pytest.raises(ValueError):
        client.get("safety/again", out=np.zeros(7, dtype=np.float32))
    for _ in range(3):
        assert client.get("safety/again", out=out) is out
        assert np.array_equal(out, a)


BIG = 64 << 20


def test_two_threads_receiving_into_one_out_never_corrupt_it(
    client: tb.Client, cluster: tb.LocalCluster
) -> None:
    # Whether the two receives overlap is up to the scheduler: each either finishes with the
    # published bytes or is refused; at least one finishes, and `out` ends right.
    a = np.random.default_rng(3).integers(0, 256, BIG, dtype=np.uint8)
    client.put("safety/big", a)
    out = np.zeros_like(a)
    results: list[object] = []
    go = threading.Barrier(2, timeout=JOIN_LIMIT_S)
    with cluster.connect() as reader:

        def receive() -> None:
            go.wait()
            try:
                results.append(reader.get("safety/big", out=out, timeout=60))
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                results.append(e)

        threads = [threading.Thread(target=receive, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
            assert not t.is_alive()
    done = [r for r in results if isinstance(r, np.ndarray)]
    refused = [r for r in results if isinstance(r, BufferError)]
    assert len(done) >= 1 and len(done) + len(refused) == 2, results
    assert np.array_equal(out, a)
