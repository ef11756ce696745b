"""``python -m tensor_broker bench``: get throughput and 4 KiB latency of the Python package
against the Rust API, between two processes, in one run.

The orchestrator (this process) starts a :class:`LocalCluster`. For each API it starts a
publisher process that puts ``count`` tensors per size, then a getter process that gets them one by one (the first of each size untimed) and
reports each get's time. The Python processes run this module (``_bench-put``/``_bench-get``),
the Rust ones ``tb bench client-put``/``client-get`` (the same steps through ``tb_node``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZES = [4 << 10, 1 << 20, 64 << 20, 256 << 20]
# Versions per size: 1 warm-up, the rest timed.
VERSIONS = {4 << 10: 401, 1 << 20: 41, 64 << 20: 6, 256 << 20: 4}
# Longest one publisher or getter may take.
PROCESS_LIMIT_S = 600


def _find_tb(given: str | None) -> str | None:
    """The ``tb`` binary: ``--tb``, ``$TB_BIN``, ``tb`` on the PATH, or the repository's
    release build next to this source tree."""
    for candidate in (given, os.environ.get("TB_BIN"), shutil.which("tb")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    repo = Path(__file__).resolve().parents[3]
    built = repo / "target" / "release" / "tb"
    return str(built) if os.access(built, os.X_OK) else None


def _client_args(ticket: str, secret_file: str, prefix: str, sizes: list[int]) -> list[str]:
    return [
        "--join", ticket,
        "--cluster-secret-file", secret_file,
        "--prefix", prefix,
        "--sizes", ",".join(map(str, sizes)),
        "--versions", ",".join(str(VERSIONS.get(s, 4)) for s in sizes),
    ]


def _run_pair(put_cmd: list[str], get_cmd: list[str]) -> dict[str, Any]:
    """Starts the publisher, waits for ``ready``, runs the getter; returns its report."""
    putter = subprocess.Popen(put_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert putter.stdout is not None
        line = putter.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the publisher {put_cmd[:3]} said {line!r} instead of ready")
        got = subprocess.run(
            get_cmd, stdout=subprocess.PIPE, text=True, timeout=PROCESS_LIMIT_S, check=True
        )
        return json.loads(got.stdout.strip().splitlines()[-1])
    finally:
        if putter.stdin is not None:
            putter.stdin.close()
        try:
            putter.wait(timeout=30)
        except subprocess.TimeoutExpired:
            putter.kill()
            putter.wait(timeout=30)


def _summary(api: str, size: int, samples: list[float]) -> dict[str, Any]:
    median = statistics.median(samples)
    case: dict[str, Any] = {
        "api": api,
        "size_bytes": size,
        "throughput_mb_s": round(size / median / 1e6, 1),
        "median_s": median,
        "samples": len(samples),
    }
    if size <= 4 << 10:
        case["p50_us"] = round(median * 1e6, 1)
        case["p90_us"] = round(float(np.percentile(samples, 90)) * 1e6, 1)
    return case


def bench(args: argparse.Namespace) -> int:
    """Runs the benchmark; prints JSON (``--json``) or a table."""
    from . import LocalCluster

    sizes = args.sizes or SIZES
    tb_bin = _find_tb(args.tb)
    cases: list[dict[str, Any]] = []
    notes: list[str] = []
    py = [sys.executable, "-m", "tensor_broker"]
    with LocalCluster() as cluster:
        systems: list[tuple[str, list[str], list[str]]] = []
        for rnd in range(args.rounds):
            pyargs = _client_args(cluster.ticket, cluster.secret_file, f"bench/py{rnd}", sizes)
            systems.append(("python", py + ["_bench-put", *pyargs], py + ["_bench-get", *pyargs]))
            if tb_bin:
                rsargs = _client_args(cluster.ticket, cluster.secret_file, f"bench/rs{rnd}", sizes)
                systems.append((
                    "rust",
                    [tb_bin, "bench", "client-put", *rsargs],
                    [tb_bin, "bench", "client-get", *rsargs],
                ))
        if not tb_bin:
            notes.append("rust: skipped, no tb binary (build it: cargo build --release --bins)")
        samples: dict[tuple[str, int], list[float]] = {}
        for api, put_cmd, get_cmd in systems:
            report = _run_pair(put_cmd, get_cmd)
            for case in report["cases"]:
                samples.setdefault((api, case["size_bytes"]), []).extend(case["samples_s"])
    for (api, size), values in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cases.append(_summary(api, size, values))
    out: dict[str, Any] = {"cases": cases, "notes": notes}
    by = {(c["api"], c["size_bytes"]): c for c in cases}
    ratios = {}
    for size in sizes:
        p, r = by.get(("python", size)), by.get(("rust", size))
        if p and r:
            ratios[str(size)] = round(p["throughput_mb_s"] / r["throughput_mb_s"], 3)
            if "p50_us" in p:
                out["p50_4k_python_minus_rust_us"] = round(p["p50_us"] - r["p50_us"], 1)
    out["python_over_rust_throughput"] = ratios
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{'API':<8} {'SIZE':>12} {'MB/s':>10} {'p50 us':>9} {'N':>5}")
        for c in cases:
            p50 = f"{c['p50_us']:.1f}" if "p50_us" in c else "-"
            print(f"{c['api']:<8} {c['size_bytes']:>12} {c['throughput_mb_s']:>10.1f} {p50:>9} "
                  f"{c['samples']:>5}")
        for k, v in ratios.items():
            print(f"python/rust throughput at {k} B: {v:.3f}")
        if "p50_4k_python_minus_rust_us" in out:
            print(f"4 KiB get p50, python - rust: {out['p50_4k_python_minus_rust_us']} us")
        for n in notes:
            print(n)
    return 0


def _node_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--join", required=True)
    p.add_argument("--cluster-secret-file", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--versions", required=True)
    a = p.parse_args(argv)
    a.cases = list(zip(map(int, a.sizes.split(",")), map(int, a.versions.split(","))))
    return a


def bench_put(argv: list[str]) -> int:
    """The Python publisher: every tensor of every size; ``ready``; serve until EOF."""
    from . import connect

    a = _node_args(argv)
    with connect(a.join, secret_file=a.cluster_secret_file) as client:
        for size, count in a.cases:
            for i in range(count):
                client.put(f"{a.prefix}/{size}/{i}", np.full(size, i % 251, dtype=np.uint8))
        print("ready", flush=True)
        sys.stdin.read()
    return 0


def bench_get(argv: list[str]) -> int:
    """The Python getter: the tensors of each size, timed but the first; JSON out."""
    from . import connect

    a = _node_args(argv)
    cases = []
    with connect(a.join, secret_file=a.cluster_secret_file) as client:
        for size, count in a.cases:
            times = []
            for i in range(count):
                name = f"{a.prefix}/{size}/{i}"
                start = time.perf_counter()
                got = client.get(name)
                took = time.perf_counter() - start
                if got.nbytes != size:
                    raise RuntimeError(f"{name}: {got.nbytes} bytes, expected {size}")
                del got
                if i > 0:
                    times.append(took)
            cases.append({"size_bytes": size, "samples_s": times})
    print(json.dumps({"api": "python", "cases": cases}))
    return 0
