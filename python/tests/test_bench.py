"""The benchmark runs and reports what it promises (``--quick``, small sizes: CI time; no
timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tensor_broker import _bench

SIZES = (4096, 65536)


@pytest.fixture(scope="module")
def report() -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tensor_broker", "bench", "--quick", "--json", "--no-install",
         "--sizes", ",".join(map(str, SIZES))],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _expected_systems() -> set[str]:
    systems = {"python-name", "python-push"}
    tb = _bench._find_tb(None)
    if tb and _bench._speaks_bench(tb):
        systems |= {"rust-name", "rust-push"}
    return systems


def test_every_system_reports_every_case(report: dict) -> None:
    assert set(report["systems"]) >= _expected_systems()
    assert report["sizes"] == list(SIZES)
    got = {(c["system"], c["case"], c["size_bytes"]) for c in report["cases"]}
    for system in report["systems"]:
        assert {(system, "one_way", s) for s in SIZES} <= got
        assert (system, "rtt", _bench.RTT_SIZE) in got
        assert (system, "peak_rss", max(SIZES)) in got
    assert len(got) == len(report["cases"]) == len(report["systems"]) * (len(SIZES) + 2)


def test_every_case_reports_positive_numbers_and_checked_arrays(report: dict) -> None:
    for c in report["cases"]:
        assert c["checked"] > 0, c
        if c["case"] == "peak_rss":
            assert c["peak_rss_mib"] > 0 and all(v > 0 for v in c["pass_peak_rss_mib"]), c
            assert 0 < c["start_rss_mib"] <= c["peak_rss_mib"], c
            continue
        assert c["samples"] > 0 and c["checked"] > c["samples"], c  # warm-ups checked too
        assert c["check"] == "full", c
        assert c["p50_us"] > 0 and all(v > 0 for v in c["pass_p50_us"]), c
        if c["case"] == "one_way":
            assert c["mb_s"] > 0, c
        else:
            assert c["p99_us"] >= c["p50_us"], c


def test_the_zeromq_baseline_divides_every_figure(report: dict) -> None:
    pytest.importorskip("zmq")
    assert report["baseline"] == "zeromq" and "zeromq" in report["systems"]
    for c in report["cases"]:
        assert c["x_zeromq"] and all(v > 0 for v in c["x_zeromq"].values()), c
        if c["system"] == "zeromq":
            assert set(c["x_zeromq"].values()) == {1.0}, c


def test_payload_check_finds_a_changed_byte() -> None:
    pay = _bench.Payloads()
    for size in (16, 4096, 2 * _bench.CHECK_CHUNK + 4096):
        buf = pay.fill(size, 7).copy()
        _bench.stamp(buf)
        stamp_ns, seq, ok = pay.check(buf, size)
        assert ok and seq == 7 and stamp_ns > 0
        buf[-1] ^= 1
        assert size == 16 or not pay.check(buf, size)[2]
        assert not pay.check(buf[:-1], size)[2]
