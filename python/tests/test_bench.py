"""The benchmark runs and reports what it promises (``--quick``, small sizes: CI time; no
timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tensor_broker import _bench, _bench_extra, _bench_report

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


def test_the_extras_report_every_measurement(report: dict) -> None:
    x = report["extra"]
    assert set(x) == {"get_by_name", "put_warm", "async_rtt"}
    n = _bench_extra.counts(quick=True)

    get = x["get_by_name"]
    assert get["size_bytes"] == _bench_extra.GET_SIZE and get["check"] == "full"
    assert get["samples"] == n["get"] and get["checked"] == n["get"] + 1  # the warm-up too
    assert 0 < get["p50_us"] <= get["p99_us"], get
    assert get["pass_p50_us"] == [get["p50_us"]] and get["pass_p99_us"] == [get["p99_us"]]
    assert get["met"] is (get["p50_us"] <= get["target_p50_us"] == 250)

    put = x["put_warm"]
    assert put["size_bytes"] == 256 << 20 and put["keep"] == 1 and put["checked"] == 1
    assert put["samples"] == n["put"] and put["warmups"] == n["put_warmups"]
    assert put["put_gb_s"] > 0 and put["pass_put_gb_s"] == [put["put_gb_s"]], put

    rtt = x["async_rtt"]
    assert rtt["size_bytes"] == _bench.RTT_SIZE
    for kind in ("async", "sync"):
        assert rtt[f"{kind}_samples"] == n["rtt_chunks"] * n["rtt_chunk"], rtt
        assert 0 < rtt[f"{kind}_p50_us"] <= rtt[f"{kind}_p99_us"], rtt
    # Ratios of the unrounded percentiles; the figures beside them are rounded to 0.1 µs.
    assert rtt["x_sync"] == pytest.approx(rtt["async_p50_us"] / rtt["sync_p50_us"], rel=1e-2)
    assert rtt["x_sync_p99"] == pytest.approx(rtt["async_p99_us"] / rtt["sync_p99_us"],
                                              rel=1e-2)
    assert rtt["pass_x_sync"] == [rtt["x_sync"]]
    assert rtt["met"] is (rtt["x_sync"] <= rtt["target_x_sync"] == 1.1)


def test_the_put_is_divided_by_blake3_alone(report: dict) -> None:
    pytest.importorskip("blake3")
    put = report["extra"]["put_warm"]
    assert put["blake3_gb_s"] > 0 and put["blake3_threads"] == "AUTO", put
    assert put["x_blake3"] == pytest.approx(put["put_gb_s"] / put["blake3_gb_s"], rel=1e-2)
    assert put["pass_x_blake3"] == [put["x_blake3"]]
    assert put["met"] is (put["x_blake3"] >= put["target_x_blake3"] == 0.8)


def test_the_tables_show_the_extras(report: dict) -> None:
    text = _bench_report.tables(report)
    assert "Extra measurements" in text
    for row in ("4 KiB get by name, not subscribed", "256 MiB put, warm (keep=1)",
                "4 KiB round trip, asyncio vs sync"):
        assert row in text


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


def test_systems_picks_what_runs_and_an_unknown_one_is_refused() -> None:
    run = [sys.executable, "-m", "tensor_broker", "bench", "--quick", "--json", "--no-install",
           "--sizes", "4096", "--no-extra"]
    done = subprocess.run([*run, "--systems", "python-push"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert rep["systems"] == ["python-push"]
    assert {c["system"] for c in rep["cases"]} == {"python-push"}
    assert rep["extra"] is None
    assert not any(n.startswith(("zeromq:", "rust:")) for n in rep["notes"])
    done = subprocess.run([*run, "--systems", "python-push,carrier-pigeon"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "carrier-pigeon" in done.stderr


def test_bench_device_says_what_it_needs_or_reports_every_case() -> None:
    """``bench device`` without a CUDA device exits 2 saying why (CI); with one, every case
    reports positive times and its ratio to torch.multiprocessing."""
    run = [sys.executable, "-m", "tensor_broker", "bench", "device", "--json", "--sizes", "1",
           "--iters"]
    bad = subprocess.run([*run, "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--iters" in bad.stderr
    done = subprocess.run([*run, "1"], capture_output=True, text=True, timeout=300)
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        assert done.returncode == 2, done.stderr
        assert "needs" in done.stderr and ("CUDA" in done.stderr or "torch" in done.stderr)
        return
    assert done.returncode == 0, done.stderr
    cases = json.loads(done.stdout)["cases"]
    assert {(c["held"], c["size_bytes"]) for c in cases} == {("cuda", 1 << 20),
                                                               ("host", 1 << 20)}
    for c in cases:
        assert c["tensor_broker_ms"] > 0 and c["torch_mp_ms"] > 0 and c["x_torch"] > 0
