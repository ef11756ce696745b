"""``python -m tensor_broker bench call`` runs and reports what it promises (``--quick``: CI
time; no timing thresholds), and its result checks catch a wrong answer."""

from __future__ import annotations

import importlib
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from tensor_broker import _bench_call
from tensor_broker._bench_proto import BenchError

FIELDS = {"system", "op", "size_bytes", "concurrency", "servers", "calls_per_s", "p50_us",
          "p99_us"}


@pytest.fixture(scope="module")
def report() -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tensor_broker", "bench", "call", "--quick", "--json",
         "--no-install"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def _expected_systems() -> list[str]:
    """tensor-broker (its default channels and QUIC alone), and each baseline whose package
    is installed (``--no-install``)."""
    return ["tensor-broker", "tensor-broker-quic",
            *(s for s, m in (("grpc", "grpc"), ("zmq", "zmq")) if _imports(m))]


def test_every_case_has_the_promised_fields(report: dict) -> None:
    assert report["quick"] is True
    assert report["systems"] == _expected_systems()
    assert report["cases"]
    for c in report["cases"]:
        assert FIELDS <= set(c), c
        assert c["system"] in report["systems"], c
        assert c["op"] in ("echo", "add_one", "stream"), c


def test_every_system_reports_every_case_but_the_dropped_ones(report: dict) -> None:
    dropped = {(d["op"], d["size_bytes"], d["concurrency"], d["servers"])
               for d in report["dropped"]}
    # --quick drops the 16 MiB cases with 64 callers, and says so.
    assert dropped == {(op, 16 << 20, 64, n) for op in ("echo", "add_one") for n in (1, 4)}
    assert any("dropped" in note for note in report["notes"])
    grid = {k for k in itertools.product(("echo", "add_one"), (4 << 10, 16 << 20), (1, 64),
                                         (1, 4))} - dropped
    got: dict[str, set] = {}
    for c in report["cases"]:
        got.setdefault(c["system"], set()).add(
            (c["op"], c["size_bytes"], c["concurrency"], c["servers"]))
    streams = {("stream", size, 1, 1) for size in (1 << 20, 16 << 20)}
    for system in report["systems"]:
        assert got[system] == grid | streams, system
    assert len(report["cases"]) == sum(map(len, got.values()))  # no case twice


def test_python_is_compared_with_rust_call_for_call(report: dict) -> None:
    """The 4 KiB one-caller cases ran from Rust too, and the report says what Python adds."""
    rows = report["python_over_rust"]
    if not rows:  # only where no tb binary was found, and then the notes say so
        assert any(n.startswith("python over rust: skipped") for n in report["notes"])
        return
    assert sorted(r["op"] for r in rows) == ["add_one", "echo"]
    py = {c["op"]: c for c in report["cases"] if c["system"] == "tensor-broker"
          and (c["size_bytes"], c["concurrency"], c["servers"]) == (4096, 1, 1)}
    for r in rows:
        assert r["size_bytes"] == 4096
        assert r["python_p50_us"] == py[r["op"]]["p50_us"]
        assert r["rust_p50_us"] > 0 and r["rust_calls_per_s"] > 0
        assert r["overhead_us"] == pytest.approx(r["python_p50_us"] - r["rust_p50_us"])
        assert r["met"] == (r["overhead_us"] <= r["target_us"])


def test_every_tensor_broker_case_has_a_rate_and_ordered_percentiles(report: dict) -> None:
    tb = [c for c in report["cases"] if c["system"] in ("tensor-broker", "tensor-broker-quic")]
    assert tb
    for c in tb:
        assert c["calls_per_s"] > 0, c
        assert 0 < c["p50_us"] <= c["p99_us"], c
        assert c["calls"] > 0 and c["checked"], c
        if c["op"] == "stream":
            assert c["items_per_s"] > 0 and c["mb_s"] > 0, c
    for c in report["cases"]:
        if c["op"] == "stream":  # every system's streams were read to their end
            assert c["items_per_stream"] > 0 and c["items_per_s"] > 0, c
        assert c["p50_us"] <= c["p99_us"], c


def test_the_checks_catch_a_wrong_result() -> None:
    for op in ("echo", "add_one"):
        x, expected = _bench_call.payload(op, 4096)
        assert x.nbytes == 4096
        _bench_call.check(op, expected.copy(), expected)
        wrong = expected.copy()
        wrong.view(np.uint8)[100] ^= 1
        with pytest.raises(BenchError, match="first differing byte at 100"):
            _bench_call.check(op, wrong, expected)
        with pytest.raises(BenchError):
            _bench_call.check(op, expected[:-1].copy(), expected)
    x, expected = _bench_call.payload("add_one", 4096)
    with pytest.raises(BenchError):  # an echo is not x + 1
        _bench_call.check("add_one", x, expected)


def test_the_grpc_message_round_trips() -> None:
    for arr in (np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros(0, np.uint8),
                np.array(7, dtype=np.int64)):
        back = _bench_call.grpc_decode(_bench_call.grpc_encode(arr))
        assert back.dtype == arr.dtype and back.shape == arr.shape
        assert back.tobytes() == arr.tobytes()


def test_the_loaders_compare_tb_stream_with_dataloader(report: dict) -> None:
    if not _imports("torch"):
        assert report["loaders"] == [] and any("DataLoader" in n for n in report["notes"])
        return
    systems = [r["system"] for r in report["loaders"]]
    assert systems == ["torch-dataloader", "tensor-broker (batches)", "tensor-broker (samples)"]
    for r in report["loaders"]:
        assert r["op"] == "loader" and r["loaders"] == 4 and r["batch"] == 32, r
        assert r["batches"] == 12 and r["batches_per_s"] > 0, r
        assert 0 <= r["wait_share"] <= 1, r


def test_the_loader_check_catches_wrong_bytes() -> None:
    from tensor_broker import _bench_loader

    x, y = _bench_loader.make_batch(3)
    assert x.shape == (32, 3, _bench_loader.SIDE, _bench_loader.SIDE)
    assert y.tolist() == list(range(96, 128))
    _bench_loader.check(x, y, 96)
    x[0, 1, 2, 3] += 1
    with pytest.raises(BenchError, match="wrong bytes"):
        _bench_loader.check(x, y, 96)


def test_each_tensor_broker_system_ran_on_its_channels(report: dict) -> None:
    # The caller's links to its 4 servers: shared memory by default on one host, QUIC alone
    # for tensor-broker-quic (a `channels=` left unused would show here).
    assert report["links"]["tensor-broker"] == ["shm"] * 4
    assert report["links"]["tensor-broker-quic"] == ["quic"] * 4
    for base in ("grpc", "zmq"):
        assert report["links"].get(base) is None


def test_systems_are_picked_by_name() -> None:
    assert _bench_call._systems("zmq, tensor-broker-quic") == ["tensor-broker-quic", "zmq"]
    for bad in ("", "redis", "grpc,redis"):
        with pytest.raises(Exception, match="pick from"):
            _bench_call._systems(bad)
    done = subprocess.run(
        [sys.executable, "-m", "tensor_broker", "bench", "call", "--systems", "redis"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "redis" in done.stderr and "Traceback" not in done.stderr
