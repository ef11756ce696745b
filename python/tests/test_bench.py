"""The benchmark runs and reports what it promises (small sizes only: CI time)."""

from __future__ import annotations

import json
import subprocess
import sys

from tensor_broker import _bench


def test_bench_json_has_python_and_rust_cases() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensor_broker", "bench", "--json", "--sizes", "4096,1048576"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    apis = {"python"} | ({"rust"} if _bench._find_tb(None) else set())
    got = {(c["api"], c["size_bytes"]) for c in report["cases"]}
    assert got == {(a, s) for a in apis for s in (4096, 1048576)}
    for case in report["cases"]:
        assert case["throughput_mb_s"] > 0
        assert case["samples"] >= 40
        if case["size_bytes"] == 4096:
            assert case["p50_us"] > 0
