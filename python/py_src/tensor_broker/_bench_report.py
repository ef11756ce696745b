"""The report of ``python -m tensor_broker bench``: the raw samples of every pass turned into
the ``--json`` object (cases per system, ratios to the ZeroMQ baseline, the extras) and into
the tables printed without ``--json``.

Apart from the measuring code so the figures' definitions (pooled medians, per-pass medians,
ratios) sit in one place, next to the tables that print them.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

from ._bench_proto import RTT_SIZE, pct
from ._bench_zmq import BASELINE


def _cases(system: str, passes: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    out = []
    for size in sizes:
        per = [r["one_way"][size] for r in passes]
        p50s = [statistics.median(x) for x in per]
        pooled = statistics.median([v for x in per for v in x])
        out.append({
            "system": system, "case": "one_way", "size_bytes": size,
            "samples": sum(map(len, per)), "checked": sum(len(x) + 1 for x in per),
            "check": "full",
            "p50_us": round(pooled / 1e3, 1), "mb_s": round(size / pooled * 1e3, 1),
            "pass_p50_us": [round(v / 1e3, 1) for v in p50s],
            "pass_mb_s": [round(size / v * 1e3, 1) for v in p50s],
        })
    rtts = [r["rtt"] for r in passes]
    out.append({
        "system": system, "case": "rtt", "size_bytes": RTT_SIZE,
        "samples": sum(map(len, rtts)), "checked": sum(map(len, rtts)) + len(rtts),
        "check": "full",
        "p50_us": round(pct([v for x in rtts for v in x], 50) / 1e3, 1),
        "p99_us": round(pct([v for x in rtts for v in x], 99) / 1e3, 1),
        "pass_p50_us": [round(pct(x, 50) / 1e3, 1) for x in rtts],
        "pass_p99_us": [round(pct(x, 99) / 1e3, 1) for x in rtts],
    })
    rss = [r["peak_rss"] / (1 << 20) for r in passes]
    start = [r["start_rss"] / (1 << 20) for r in passes]
    out.append({
        "system": system, "case": "peak_rss", "size_bytes": sizes[-1],
        "checked": sum(len(r["one_way"][sizes[-1]]) + 1 for r in passes),
        "peak_rss_mib": round(statistics.median(rss), 1),
        "pass_peak_rss_mib": [round(v, 1) for v in rss],
        # The fresh receiver's peak once connected, before any tensor: its own baseline.
        "start_rss_mib": round(statistics.median(start), 1),
        "pass_start_rss_mib": [round(v, 1) for v in start],
    })
    return out


def report(runs: dict[str, list[dict[str, Any]]], extra: dict[str, Any] | None,
           sizes: list[int], args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    """The ``--json`` object."""
    cases = [c for system, passes in runs.items() for c in _cases(system, passes, sizes)]
    base = {(c["case"], c["size_bytes"]): c for c in cases if c["system"] == BASELINE}
    for c in cases:
        b = base.get((c["case"], c["size_bytes"]))
        if b is not None:
            c["x_zeromq"] = {k: round(c[k] / b[k], 3) for k in
                             ("p50_us", "p99_us", "mb_s", "peak_rss_mib") if k in c and b[k]}
    return {
        "sizes": sizes, "rtt_size_bytes": RTT_SIZE, "passes": args.repeat, "quick": args.quick,
        "systems": list(runs), "baseline": BASELINE if BASELINE in runs else None,
        "cases": cases, "extra": extra, "notes": notes,
    }


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _grid(title: str, head: list[str], rows: list[list[str]]) -> list[str]:
    """A left-aligned text table under ``title``, then an empty line."""
    width = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, width)).rstrip()

    return [title, line(head), *(line(r) for r in rows), ""]


def _columns(sizes: list[int]) -> list[tuple[str, Callable[[dict, Any], str]]]:
    """(heading, cell(cases by (case, size), pass index or None)) for each column."""
    def pick(c: dict[str, Any], key: str, i: Any) -> Any:
        return c[key] if i is None else c[f"pass_{key}"][i]

    cols: list[tuple[str, Callable[[dict, Any], str]]] = []
    for size in sizes:
        big = size >= 1 << 20
        key = "mb_s" if big else "p50_us"
        cols.append((f"{fmt_size(size)} {'MB/s' if big else 'one-way µs'}",
                     lambda by, i, s=size, k=key: f"{pick(by[('one_way', s)], k, i):g}"))
    rtt = ("rtt", RTT_SIZE)
    cols.insert(1, (f"{fmt_size(RTT_SIZE)} RTT p50/p99 µs", lambda by, i: (
        f"{pick(by[rtt], 'p50_us', i):g}/{pick(by[rtt], 'p99_us', i):g}")))
    rss = ("peak_rss", sizes[-1])
    cols.append((f"recv peak RSS MiB @{fmt_size(sizes[-1])} (at start)", lambda by, i: (
        f"{pick(by[rss], 'peak_rss_mib', i):g} ({pick(by[rss], 'start_rss_mib', i):g})")))
    return cols


def _extra_rows(x: dict[str, Any], i: int | None) -> list[list[str]]:
    """The extras' rows: measure, figure, ratio, target, met (``i``: that pass's figures)."""
    def pick(d: dict[str, Any], key: str) -> Any:
        return d[key] if i is None else d[f"pass_{key}"][i]

    def met(d: dict[str, Any], ok: bool | None) -> str:
        return "-" if i is not None or ok is None else "yes" if ok else "no"

    get, put, rtt = x["get_by_name"], x["put_warm"], x["async_rtt"]
    rows = [[f"{fmt_size(get['size_bytes'])} get by name, not subscribed",
             f"p50 {pick(get, 'p50_us'):g} µs, p99 {pick(get, 'p99_us'):g} µs", "-",
             f"p50 <= {get['target_p50_us']:g} µs",
             met(get, get["met"])]]
    figure = f"put {pick(put, 'put_gb_s'):g} GB/s"
    if "blake3_gb_s" in put:
        figure += f", BLAKE3 alone {pick(put, 'blake3_gb_s'):g} GB/s"
    rows.append([f"{fmt_size(put['size_bytes'])} put, warm (keep={put['keep']})", figure,
                 f"{pick(put, 'x_blake3'):.2f}x BLAKE3" if "x_blake3" in put else "-",
                 f">= {put['target_x_blake3']:g}x", met(put, put.get("met"))])
    rows.append([f"{fmt_size(rtt['size_bytes'])} round trip, asyncio vs sync",
                 f"p50 {pick(rtt, 'async_p50_us'):g}/{pick(rtt, 'sync_p50_us'):g} µs, "
                 f"p99 {pick(rtt, 'async_p99_us'):g}/{pick(rtt, 'sync_p99_us'):g} µs",
                 f"{pick(rtt, 'x_sync'):.2f}x sync (p99 {pick(rtt, 'x_sync_p99'):.2f}x)",
                 f"<= {rtt['target_x_sync']:g}x", met(rtt, rtt["met"])])
    return rows


def tables(rep: dict[str, Any]) -> str:
    """The report as text tables."""
    sizes, cases = rep["sizes"], rep["cases"]
    cols = _columns(sizes)
    head = ["system", *(h for h, _ in cols)]
    by_sys = {s: {(c["case"], c["size_bytes"]): c for c in cases if c["system"] == s}
              for s in rep["systems"]}

    out = _grid(f"One-way p50 and MB/s = size/p50, 4 KiB round trip, median of "
                f"{rep['passes']} pass(es):", head,
                [[s, *(f(by, None) for _, f in cols)] for s, by in by_sys.items()])
    if rep["baseline"]:
        def ratio(s: str, size: int, case: str, key: str) -> str:
            return f"{by_sys[s][(case, size)]['x_zeromq'].get(key, float('nan')):.2f}"

        rows = []
        for s in by_sys:
            cells = [ratio(s, z, "one_way", "mb_s" if z >= 1 << 20 else "p50_us") for z in sizes]
            cells.insert(1, f"{ratio(s, RTT_SIZE, 'rtt', 'p50_us')}/"
                            f"{ratio(s, RTT_SIZE, 'rtt', 'p99_us')}")
            cells.append(ratio(s, sizes[-1], "peak_rss", "peak_rss_mib"))
            rows.append([s, *cells])
        out += _grid("x ZeroMQ (each figure / ZeroMQ's; latency and RSS < 1, MB/s > 1 are "
                     "better):", head, rows)
    if rep["passes"] > 1:
        out += _grid("Per pass (medians of each pass):", head, [
            [f"{s} #{i + 1}", *(f(by, i) for _, f in cols)]
            for s, by in by_sys.items() for i in range(rep["passes"])])
    if rep["extra"]:
        x_head = ["measure", "figure", "ratio (same run)", "target", "met"]
        out += _grid(f"Extra measurements, median of {rep['passes']} pass(es) (asyncio/sync "
                     "for the round trip):", x_head, _extra_rows(rep["extra"], None))
        if rep["passes"] > 1:
            out += _grid("Extra measurements per pass:", x_head, [
                [f"{r[0]} #{i + 1}", *r[1:]] for i in range(rep["passes"])
                for r in _extra_rows(rep["extra"], i)])
    out += rep["notes"]
    return "\n".join(out)
