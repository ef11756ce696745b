"""The extra measurements of ``python -m tensor_broker bench``: three figures the systems'
table does not show, each with its target and a baseline measured in the same run (the
machine's speed moves between runs; a ratio within one run does not).

- ``get_by_name``: a 4 KiB ``Client.get(name)`` (the newest version) in a getter process that
  subscribes to nothing, from a publisher process, through the orchestrator's broker: the
  publisher puts version ``seq``, then the getter times its ``get`` and checks every byte (and
  that it got ``seq``). p50 and p99; target p50 <= 250 µs.
- ``put_warm``: ``Client.put`` of 256 MiB (keep=1, the same name, after warm-up puts, so the
  store recycles the memory of the version it evicts), against hashing the same buffer alone
  with BLAKE3 on every core (the ``blake3`` package, ``max_threads=blake3.AUTO``), in the same
  process, the two alternating. GB/s = 1e9 bytes/s = size / median time; ``x_blake3`` =
  put GB/s / BLAKE3 GB/s (a put hashes what it stores, so hashing alone bounds it); target
  >= 0.8. After the timed puts the last version is got back and compared with the buffer.
- ``async_rtt``: the 4 KiB round trip of ``python-name`` (put a ping, the receiver's
  subscription answers with a pong, the sender's subscription delivers it) from an asyncio
  sender (``await client.put(...)``, the pong through ``async for`` over its subscription)
  and from a sync sender, each with its own receiver process, alternating in chunks.
  ``x_sync`` = async p50 / sync p50 (``x_sync_p99``: the p99s'); target <= 1.1.

The roles run as ``_bench-send --mode store`` (put and get by name) and ``--mode async``
(the asyncio sender, which speaks the systems' ``rtt <count>``); the receivers are the
systems' ``python-name`` ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from ._bench_proto import (
    RTT_SIZE,
    WAIT_S,
    BenchError,
    Child,
    Payloads,
    pct,
    say,
    stamp,
)

GET_SIZE = 4 << 10
PUT_SIZE = 256 << 20
PUT_KEEP = 1
TARGET_GET_P50_US = 250.0
TARGET_PUT_X_BLAKE3 = 0.8
TARGET_ASYNC_X_SYNC = 1.1


def counts(quick: bool) -> dict[str, int]:
    """Timed samples of each measurement per pass (warm-ups come on top)."""
    if quick:
        return {"get": 10, "put_warmups": 2, "put": 3, "rtt_chunks": 2, "rtt_chunk": 10}
    return {"get": 200, "put_warmups": 3, "put": 10, "rtt_chunks": 5, "rtt_chunk": 100}


# ---- the worker roles ------------------------------------------------------------------------


def serve(a: argparse.Namespace) -> int:
    """A worker of the extras: ``--mode async`` or ``--mode store``."""
    return _serve_async(a) if a.mode == "async" else _serve_store(a)


def _serve_store(a: argparse.Namespace) -> int:
    """Puts and gets by name, no subscription: ``put <rest> <size> <seq>`` (answers ``{"put",
    "version"}``), ``get <rest> <size> <seq>`` (``{"got", "get_ns", "ok"}``), ``puthash <size>
    <warmups> <count> <keep> <hash 0|1>`` (``{"put_ns", "blake3_ns", "versions", "ok"}``)."""
    from . import connect

    pay = Payloads()
    with connect(a.join, secret_file=a.cluster_secret_file) as client:
        say(ready=True, addr=client.addr)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "put":
                name, size, seq = f"{a.prefix}/{cmd[1]}", int(cmd[2]), int(cmd[3])
                buf = pay.fill(size, seq)
                stamp(buf)
                say(put=seq, version=client.put(name, buf))
            elif cmd[0] == "get":
                name, size, seq = f"{a.prefix}/{cmd[1]}", int(cmd[2]), int(cmd[3])
                start = time.monotonic_ns()
                arr = client.get(name, timeout=WAIT_S)
                took = time.monotonic_ns() - start
                _, got, ok = pay.check(arr, size)
                say(got=got, get_ns=took, ok=ok and got == seq)
            elif cmd[0] == "puthash":
                size, warmups, count, keep, hashing = (int(x) for x in cmd[1:6])
                say(**_put_vs_hash(client, f"{a.prefix}/put/{size}", size, warmups, count,
                                   keep, bool(hashing)))
            else:
                raise BenchError(f"unknown command {line!r}")
    return 0


def _put_vs_hash(client: Any, name: str, size: int, warmups: int, count: int, keep: int,
                 hashing: bool) -> dict[str, Any]:
    """``warmups`` untimed puts, then ``count`` timed puts and BLAKE3 hashes of the same
    buffer, alternating which goes first; each put's header (stamp, seq) is new, so every
    version's bytes differ."""
    buf = Payloads().fill(size, 0)
    hash_once: Callable[[], Any] | None = None
    if hashing:
        import blake3

        def hash_once() -> Any:
            return blake3.blake3(buf, max_threads=blake3.blake3.AUTO).digest()

    def put(seq: int) -> tuple[int, int]:
        buf[8:16].view("<u8")[0] = seq
        stamp(buf)
        start = time.monotonic_ns()
        version = client.put(name, buf, keep=keep)
        return time.monotonic_ns() - start, version

    def timed_hash() -> int:
        assert hash_once is not None
        start = time.monotonic_ns()
        hash_once()
        return time.monotonic_ns() - start

    for seq in range(warmups):
        put(seq)
    if hash_once is not None:
        timed_hash()  # starts the hasher's threads
    put_ns, hash_ns, versions = [], [], []
    for i in range(count):
        if hash_once is not None and i % 2 == 1:
            hash_ns.append(timed_hash())
        took, version = put(warmups + i)
        put_ns.append(took)
        versions.append(version)
        if hash_once is not None and i % 2 == 0:
            hash_ns.append(timed_hash())
    got = client.get(name, timeout=WAIT_S)
    ok = bool(np.array_equal(got.reshape(-1).view(np.uint8), buf))
    return {"put_ns": put_ns, "blake3_ns": hash_ns, "versions": versions, "ok": ok}


def _serve_async(a: argparse.Namespace) -> int:
    """The asyncio round-trip sender: ``rtt <count>`` (answers ``{"rtt_ns", "checked"}``) as
    the systems' sender does it, from a :mod:`tensor_broker.asyncio` client."""
    import asyncio

    from . import asyncio as tba

    pay = Payloads()

    async def rtt(client: Any, sub: Any, count: int) -> list[int]:
        times: list[int] = []

        async def ping(seq: int) -> int:
            buf = pay.fill(RTT_SIZE, seq)
            start = time.monotonic_ns()
            stamp(buf)
            await client.put(f"{a.prefix}/to/ping", buf)
            return start

        if count < 1:
            return times
        start = await ping(0)
        async for update in sub:
            if update.deleted:
                continue
            arr = update.array()
            took = time.monotonic_ns() - start
            _, seq, ok = pay.check(arr, RTT_SIZE)
            if not ok or seq != len(times):
                raise BenchError(f"{update.name}: pong {len(times)} failed its check")
            times.append(took)
            if len(times) == count:
                break
            start = await ping(len(times))
        return times

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with await tba.connect(a.join, secret_file=a.cluster_secret_file) as client:
            async with client.subscribe(f"{a.prefix}/back/pong") as sub:
                say(ready=True, addr=client.addr)
                while line := await loop.run_in_executor(None, sys.stdin.readline):
                    cmd = line.split()
                    if cmd[0] != "rtt":
                        raise BenchError(f"unknown command {line!r}")
                    times = await asyncio.wait_for(rtt(client, sub, int(cmd[1])), WAIT_S)
                    say(rtt_ns=times, checked=len(times))

    asyncio.run(main())
    return 0


# ---- the orchestrator's side -----------------------------------------------------------------


def _worker(label: str, role: str, mode: str, join: list[str], prefix: str) -> Child:
    return Child(f"extra {label}", [sys.executable, "-m", "tensor_broker", f"_bench-{role}",
                                    "--mode", mode, *join, "--prefix", prefix])


def run_pass(join: list[str], prefix: str, quick: bool, hashing: bool,
             progress: Callable[[str], None]) -> dict[str, Any]:
    """One pass of the three measurements; their raw samples (ns)."""
    n = counts(quick)
    children: list[Child] = []

    def start(label: str, role: str, mode: str, at: str) -> Child:
        child = _worker(label, role, mode, join, at)
        children.append(child)
        child.hear()  # ready
        return child

    out: dict[str, Any] = {}
    try:
        pub = start("publisher", "send", "store", prefix)
        getter = start("getter", "send", "store", prefix)
        out["get_ns"] = _gets(pub, getter, n["get"])
        progress(f"{GET_SIZE >> 10} KiB get by name, not subscribed: p50 "
                 f"{pct(out['get_ns'], 50) / 1e3:.1f} µs, p99 {pct(out['get_ns'], 99) / 1e3:.1f}"
                 f" µs ({len(out['get_ns'])} checked)")
        getter.stop()
        got = pub.ask(f"puthash {PUT_SIZE} {n['put_warmups']} {n['put']} {PUT_KEEP} "
                      f"{int(hashing)}", timeout=2 * WAIT_S)
        if not got["ok"] or len(got["put_ns"]) != n["put"]:
            raise BenchError(f"{pub.label}: the last 256 MiB version failed its check")
        if got["versions"] != list(range(got["versions"][0], got["versions"][0] + n["put"])):
            raise BenchError(f"{pub.label}: put versions {got['versions']} are not consecutive")
        out["put_ns"], out["blake3_ns"] = got["put_ns"], got["blake3_ns"]
        line = f"{PUT_SIZE >> 20} MiB put, warm: {_gb_s(PUT_SIZE, out['put_ns']):.2f} GB/s"
        if out["blake3_ns"]:
            line += f", BLAKE3 alone {_gb_s(PUT_SIZE, out['blake3_ns']):.2f} GB/s"
        progress(line)
        pub.stop()
        out["rtt_ns"] = _round_trips(start, prefix, n["rtt_chunks"], n["rtt_chunk"])
        progress(f"{RTT_SIZE >> 10} KiB round trip p50: asyncio "
                 f"{pct(out['rtt_ns']['async'], 50) / 1e3:.1f} µs, sync "
                 f"{pct(out['rtt_ns']['sync'], 50) / 1e3:.1f} µs")
        return out
    finally:
        for child in reversed(children):
            child.stop()


def _gets(pub: Child, getter: Child, count: int) -> list[int]:
    """``count`` timed gets after one warm-up, each of a version just put."""
    samples = []
    for seq in range(count + 1):
        put = pub.ask(f"put get/{GET_SIZE} {GET_SIZE} {seq}")
        if put.get("put") != seq:
            raise BenchError(f"{pub.label}: asked to put #{seq}, answered {put}")
        got = getter.ask(f"get get/{GET_SIZE} {GET_SIZE} {seq}")
        if not got["ok"]:
            raise BenchError(f"{getter.label}: {GET_SIZE} B #{seq} failed its check (got "
                             f"#{got['got']})")
        if seq > 0:
            samples.append(got["get_ns"])
    return samples


def _round_trips(start: Callable[[str, str, str, str], Child], prefix: str, chunks: int,
                 per_chunk: int) -> dict[str, list[int]]:
    """The sync and the asyncio sender's round trips, each pair on its own names, in
    ``chunks`` alternating chunks of ``per_chunk`` (each chunk's first is a warm-up)."""
    senders = {}
    for kind, mode in (("sync", "name"), ("async", "async")):
        senders[kind] = start(f"{kind} sender", "send", mode, f"{prefix}/rtt-{kind}")
        start(f"{kind} receiver", "recv", "name", f"{prefix}/rtt-{kind}")
    out: dict[str, list[int]] = {"sync": [], "async": []}
    for chunk in range(chunks):
        for kind in ("sync", "async") if chunk % 2 == 0 else ("async", "sync"):
            got = senders[kind].ask(f"rtt {per_chunk + 1}")
            if got.get("checked") != per_chunk + 1:
                raise BenchError(f"{senders[kind].label}: {got.get('checked')} of "
                                 f"{per_chunk + 1} pongs checked")
            out[kind] += got["rtt_ns"][1:]
    return out


# ---- the summary -----------------------------------------------------------------------------


def _gb_s(size: int, ns: list[int]) -> float:
    """size / median time, in GB/s (bytes per ns)."""
    return size / statistics.median(ns)


def summary(passes: list[dict[str, Any]], quick: bool, hashing: bool) -> dict[str, Any]:
    """The ``extra`` object of the report: pooled figures, per-pass figures, ratios, targets."""
    def us(v: float) -> float:
        return round(v / 1e3, 1)

    gets = [p["get_ns"] for p in passes]
    pooled = [v for x in gets for v in x]
    get = {
        "size_bytes": GET_SIZE, "samples": len(pooled), "checked": len(pooled) + len(gets),
        "check": "full", "p50_us": us(pct(pooled, 50)), "p99_us": us(pct(pooled, 99)),
        "pass_p50_us": [us(pct(x, 50)) for x in gets],
        "pass_p99_us": [us(pct(x, 99)) for x in gets],
        "target_p50_us": TARGET_GET_P50_US,
    }
    get["met"] = get["p50_us"] <= TARGET_GET_P50_US

    puts = [p["put_ns"] for p in passes]
    put_gb_s = _gb_s(PUT_SIZE, [v for x in puts for v in x])
    put: dict[str, Any] = {
        "size_bytes": PUT_SIZE, "keep": PUT_KEEP, "warmups": counts(quick)["put_warmups"],
        "samples": sum(map(len, puts)), "checked": len(puts),
        "put_gb_s": round(put_gb_s, 3), "pass_put_gb_s": [round(_gb_s(PUT_SIZE, x), 3)
                                                          for x in puts],
        "blake3_threads": "AUTO", "cpu_count": os.cpu_count(),
        "target_x_blake3": TARGET_PUT_X_BLAKE3,
    }
    hashes = [p["blake3_ns"] for p in passes]
    if hashing and all(hashes):
        blake3_gb_s = _gb_s(PUT_SIZE, [v for x in hashes for v in x])
        put["blake3_gb_s"] = round(blake3_gb_s, 3)
        put["pass_blake3_gb_s"] = [round(_gb_s(PUT_SIZE, x), 3) for x in hashes]
        put["x_blake3"] = round(put_gb_s / blake3_gb_s, 3)
        put["pass_x_blake3"] = [round(_gb_s(PUT_SIZE, p) / _gb_s(PUT_SIZE, h), 3)
                                for p, h in zip(puts, hashes)]
        put["met"] = put["x_blake3"] >= TARGET_PUT_X_BLAKE3

    rtt: dict[str, Any] = {"size_bytes": RTT_SIZE, "target_x_sync": TARGET_ASYNC_X_SYNC}
    raw: dict[str, dict[str, list[float]]] = {}
    for kind in ("async", "sync"):
        per = [p["rtt_ns"][kind] for p in passes]
        both = [v for x in per for v in x]
        rtt[f"{kind}_samples"] = len(both)
        for q in (50, 99):
            raw[f"{kind}_p{q}"] = {"all": [pct(both, q)], "pass": [pct(x, q) for x in per]}
            rtt[f"{kind}_p{q}_us"] = us(raw[f"{kind}_p{q}"]["all"][0])
            rtt[f"pass_{kind}_p{q}_us"] = [us(v) for v in raw[f"{kind}_p{q}"]["pass"]]
    for q, key in ((50, "x_sync"), (99, "x_sync_p99")):
        a, s = raw[f"async_p{q}"], raw[f"sync_p{q}"]
        rtt[key] = round(a["all"][0] / s["all"][0], 3)
        rtt[f"pass_{key}"] = [round(x / y, 3) for x, y in zip(a["pass"], s["pass"])]
    rtt["met"] = rtt["x_sync"] <= TARGET_ASYNC_X_SYNC
    return {"get_by_name": get, "put_warm": put, "async_rtt": rtt}
