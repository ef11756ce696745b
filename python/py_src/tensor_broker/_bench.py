"""``python -m tensor_broker bench``: tensor-broker's Python package and its Rust API against
ZeroMQ, between separate processes on this host, in one run; and three extra figures, each
against a baseline of the same run.

Systems, each a sender process and a receiver process (this process runs the
:class:`LocalCluster`'s broker and drives both):

- ``python-name``: ``put`` / the receiver's subscription, ``Update.array()``;
- ``python-push``: ``push(peer.addr, ...)`` / ``recv().array()``;
- ``rust-name``, ``rust-push``: the same through ``tb_node`` (``tb bench client-send`` /
  ``client-recv``, cli/src/bench_client.rs), when a ``tb`` binary is found;
- ``zeromq``: pyzmq REQ/REP over TCP loopback with zero-copy frames, the baseline every
  figure is divided by.

Cases, per system: one-way latency per size (p50, and MB/s = size / p50); the 4 KiB round trip
(p50, p99); the receiver's peak RSS at the largest size, which runs in a fresh receiver process
so the peak is that size's. One message is in flight at a time: the next is sent once the
receiver has reported the last. The first of each size, and the first round trip, are
warm-ups. ``--repeat N`` runs N passes, the systems alternating within each; the per-pass
medians show a bimodal figure.

Extras, after the systems in each pass (:mod:`._bench_extra`; their sizes are fixed,
``--sizes`` does not change them): a 4 KiB ``get`` by name from a process that subscribes to
nothing (p50, p99); a warm 256 MiB ``put`` in GB/s against BLAKE3 hashing the same bytes alone
on every core; the 4 KiB round trip from an asyncio client against the same from a sync one.

The code, by concern: this module (the run: systems, passes, the command), ``_bench_proto``
(payload, line protocol, the worker process handle), ``_bench_workers`` (the Python sender and
receiver), ``_bench_zmq`` (the ZeroMQ baseline), ``_bench_extra`` (the extras: roles, runs,
summary), ``_bench_report`` (the JSON object and the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from . import _bench_extra, _bench_report, _bench_zmq
from ._bench_proto import (  # noqa: F401  (re-exported: the tests and callers use them here)
    CHECK_CHUNK,
    HEADER,
    RTT_SIZE,
    BenchError,
    Child,
    Payloads,
    ensure_module,
    pct,
    stamp,
)
from ._bench_workers import bench_recv, bench_send  # noqa: F401  (python -m tensor_broker)

SIZES = [4 << 10, 1 << 20, 64 << 20, 256 << 20]
BASELINE = _bench_zmq.BASELINE
#: Every system the benchmark knows, in the order each pass runs them.
SYSTEMS = ("python-name", "python-push", "rust-name", "rust-push", BASELINE)


class System:
    """How to start one system's sender and receiver."""

    def __init__(self, name: str, base: list[str], send: str, recv: str, args: list[str]):
        self.name, self._base, self._send, self._recv, self._args = name, base, send, recv, args

    def sender(self, prefix: str) -> Child:
        return Child(f"{self.name} sender", [*self._base, self._send, *self._args,
                                               "--prefix", prefix])

    def receiver(self, prefix: str, reply_to: str) -> Child:
        return Child(f"{self.name} receiver", [*self._base, self._recv, *self._args,
                                                 "--prefix", prefix, "--reply-to", reply_to])


def _join(cluster: Any) -> list[str]:
    """The arguments by which a worker joins the orchestrator's cluster."""
    return ["--join", cluster.ticket, "--cluster-secret-file", cluster.secret_file]


def _systems(cluster: Any, tb_bin: str | None, zmq: bool, notes: list[str]) -> list[System]:
    py = [sys.executable, "-m", "tensor_broker"]
    join = _join(cluster)
    out = [System(f"python-{m}", py, "_bench-send", "_bench-recv", ["--mode", m, *join])
           for m in ("name", "push")]
    if tb_bin and not _speaks_bench(tb_bin):
        notes.append(f"rust: skipped, {tb_bin} has no `bench client-send` (an older build: "
                     "cargo build --release -p tb-cli)")
    elif tb_bin:
        out += [System(f"rust-{m}", [tb_bin, "bench"], "client-send", "client-recv",
                       ["--mode", m, *join]) for m in ("name", "push")]
        notes.append("rust: both ends stamp one-way sends with CLOCK_REALTIME (std has no "
                     "CLOCK_MONOTONIC value); also one clock for the host")
    else:
        notes.append("rust: skipped, no tb binary (cargo build --release -p tb-cli, or --tb)")
    if zmq:
        out.append(System(BASELINE, py, "_bench-send", "_bench-recv", ["--mode", "zeromq"]))
        notes.append(_bench_zmq.NOTE)
    return out


def _speaks_bench(tb_bin: str) -> bool:
    """Whether ``tb_bin`` has the internal subcommands this benchmark drives."""
    try:
        done = subprocess.run([tb_bin, "bench", "client-send", "--help"], capture_output=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _one_way(sender: Child, receiver: Child, size: int, count: int) -> tuple[list[int], int]:
    """``count`` timed sends of ``size`` after one warm-up; their one-way ns and the
    receiver's peak RSS."""
    samples, rss = [], 0
    for seq in range(count + 1):
        sender.tell(f"send {size} {seq}")
        sent, got = sender.hear(), receiver.hear()
        if sent.get("sent") != seq or got["seq"] != seq or got["size_bytes"] != size:
            raise BenchError(f"{receiver.label}: sent {seq} of {size} B, got {got}")
        if not got["ok"]:
            raise BenchError(f"{receiver.label}: {size} B #{seq} failed its {got['check']} check")
        if seq > 0:
            samples.append(got["one_way_ns"])
        rss = got["peak_rss_bytes"]
    return samples, rss


def _run_pass(system: System, sizes: list[int], counts: Callable[[int], int], rtt_count: int,
              prefix: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """One pass of one system: the smaller sizes and the round trip with one receiver, the
    largest size with a fresh one."""
    children: list[Child] = []

    def start(child: Child) -> tuple[Child, dict[str, Any]]:
        children.append(child)
        return child, child.hear()

    out: dict[str, Any] = {"one_way": {}}
    try:
        sender, ready = start(system.sender(prefix))
        receiver, r = start(system.receiver(prefix, ready["addr"]))
        sender.tell(f"peer {r['addr']}")
        for size in sizes[:-1]:
            out["one_way"][size], _ = _one_way(sender, receiver, size, counts(size))
            progress(_one_way_line(size, out["one_way"][size]))
        rtt = sender.ask(f"rtt {rtt_count + 1}")
        if rtt.get("checked") != rtt_count + 1:
            raise BenchError(f"{sender.label}: {rtt.get('checked')} of {rtt_count + 1} pongs "
                             "checked")
        out["rtt"] = rtt["rtt_ns"][1:]
        progress(f"{_bench_report.fmt_size(RTT_SIZE)} round trip: p50 "
                 f"{pct(out['rtt'], 50) / 1e3:.1f} µs, p99 {pct(out['rtt'], 99) / 1e3:.1f} µs "
                 f"({len(out['rtt'])} checked)")
        receiver.stop()
        receiver, r = start(system.receiver(prefix, ready["addr"]))
        out["start_rss"] = r["peak_rss_bytes"]
        sender.tell(f"peer {r['addr']}")
        largest = sizes[-1]
        out["one_way"][largest], out["peak_rss"] = _one_way(
            sender, receiver, largest, counts(largest))
        progress(_one_way_line(largest, out["one_way"][largest]) +
                 f", fresh receiver's peak RSS {out['peak_rss'] / (1 << 20):.0f} MiB")
        return out
    finally:
        for child in reversed(children):
            child.stop()


def _one_way_line(size: int, samples: list[int]) -> str:
    p50 = statistics.median(samples)
    return (f"{_bench_report.fmt_size(size)} one-way: p50 {p50 / 1e3:.1f} µs, "
            f"{size / p50 * 1e3:.1f} MB/s ({len(samples)} checked)")


def _find_tb(given: str | None) -> str | None:
    """The ``tb`` binary: ``--tb`` (only it, when given), ``$TB_BIN``, ``tb`` on the PATH,
    or the repository's release build next to this source tree."""
    if given:
        return given if os.access(given, os.X_OK) else None
    for candidate in (os.environ.get("TB_BIN"), shutil.which("tb")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    repo = Path(__file__).resolve().parents[3]
    built = repo / "target" / "release" / "tb"
    return str(built) if os.access(built, os.X_OK) else None


def _counts(quick: bool) -> Callable[[int], int]:
    """Timed messages per size (a warm-up comes on top)."""
    def count(size: int) -> int:
        if quick:
            return 10 if size <= 64 << 10 else 3
        return 200 if size <= 64 << 10 else 50 if size <= 4 << 20 else 10 if size <= 64 << 20 else 5
    return count


def bench(args: argparse.Namespace) -> int:
    """Runs the benchmark; prints one JSON object (``--json``) or tables."""
    from . import LocalCluster

    # A terminated run still stops its children (``finally`` blocks run on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = sorted(set(args.sizes or SIZES))
    if sizes[0] < HEADER:
        raise SystemExit(f"--sizes: at least {HEADER} bytes each")
    notes: list[str] = []
    zmq = _bench_zmq.available(not args.no_install, notes)
    hashing = ensure_module("blake3", "blake3", "the put's BLAKE3 baseline (no x_blake3)",
                            not args.no_install, notes)
    counts, rtt_count = _counts(args.quick), 20 if args.quick else 500
    runs: dict[str, list[dict[str, Any]]] = {}
    extras: list[dict[str, Any]] = []
    with LocalCluster() as cluster:
        systems = _systems(cluster, _find_tb(args.tb), zmq, notes)
        if args.systems:
            systems = [s for s in systems if s.name in args.systems]
            # Notes about systems left out go too ("rust: ...", "zeromq: ...").
            kinds = {s.name.split("-")[0] for s in systems}
            notes[:] = [n for n in notes if n.split(":")[0] in kinds]
        for p in range(args.repeat):
            def progress(line: str, tag: str) -> None:
                print(f"[pass {p + 1}/{args.repeat}] {tag}:", line, file=sys.stderr,
                      flush=True)

            try:
                for system in systems:
                    runs.setdefault(system.name, []).append(_run_pass(
                        system, sizes, counts, rtt_count, f"bench/{system.name}/{p}",
                        lambda line, tag=system.name: progress(line, tag)))
                if args.no_extra:
                    continue
                extras.append(_bench_extra.run_pass(
                    _join(cluster), f"bench/extra/{p}", args.quick, hashing,
                    lambda line: progress(line, "extra")))
            except BenchError as e:
                print(f"bench failed: {e}", file=sys.stderr)
                return 1
    if hashing and extras:
        notes.append(f"extra: BLAKE3 alone is blake3.blake3(buf, max_threads=AUTO) on the "
                     f"{os.cpu_count()} cores seen, in the putting process, alternating with "
                     "its puts")
    extra = _bench_extra.summary(extras, args.quick, hashing) if extras else None
    rep = _bench_report.report(runs, extra, sizes, args, notes)
    print(json.dumps(rep, indent=2) if args.json else _bench_report.tables(rep))
    return 0
