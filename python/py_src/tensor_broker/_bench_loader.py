"""``python -m tensor_broker bench loader``: data loading through ``tb.Stream`` against
``torch.utils.data.DataLoader(num_workers=4)``, making the same synthetic batches.

Both sides make the same samples (an image-like ``uint8`` array drawn from the sample's
index, normalized to ``float32``, and its label) and the same batches of ``BATCH`` samples.
The consumer reads them with ``async for`` (tensor-broker) or ``for`` (DataLoader), checks
each batch's labels and its first sample, and takes a training step on it (a sum over the
whole batch). Measured after the first batch (so neither side's start-up counts): batches/s
and the consumer's share of the time spent waiting for the next batch.

- ``DataLoader``: ``num_workers=4``, default ``prefetch_factor`` (2 per worker), samples
  collated in the workers, batches handed over in shared memory.
- ``tb.Stream, batches``: 4 loader processes each serve a streaming function that yields
  whole batches (every 4th); the consumer interleaves the 4 streams (``prefetch=2`` each,
  as DataLoader's) and prefetches 4 more.
- ``tb.Stream, samples``: the loaders yield samples (each up to 2 batches' worth ahead)
  and the consumer's stream stacks them into batches in Rust (``batch(BATCH)``: one buffer,
  no per-sample Python object).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ._bench_proto import WAIT_S, BenchError, say

LOADERS = 4
BATCH = 32
SIDE = 96
PREFIX = "bench-load"
# A loader ends itself after this long even if its parent is gone.
PROCESS_LIMIT_S = 1800.0


def sample(index: int) -> tuple[np.ndarray, int]:
    """Sample ``index``: a ``(3, SIDE, SIDE)`` float32 image normalized from random bytes
    drawn from the index, and its label."""
    img = np.random.default_rng(index).integers(0, 256, (3, SIDE, SIDE), dtype=np.uint8)
    x = (img.astype(np.float32) * (1 / 255) - 0.5) * 4.0
    return x, index


def make_batch(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``k``: samples ``k*BATCH`` to ``k*BATCH + BATCH - 1`` stacked."""
    xs, ys = zip(*(sample(k * BATCH + j) for j in range(BATCH)))
    return np.stack(xs), np.array(ys, dtype=np.int64)


def check(x: Any, y: Any, first_index: int | None) -> None:
    """A batch's shape, and its first sample against sample ``first_index``."""
    x = np.asarray(x)
    if x.shape[1:] != (3, SIDE, SIDE) or x.dtype != np.float32:
        raise BenchError(f"a batch of {x.dtype} {x.shape}")
    if first_index is not None:
        want, label = sample(first_index)
        if int(np.asarray(y)[0]) != label or not np.array_equal(x[0], want):
            raise BenchError(f"batch starting at sample {first_index}: wrong bytes")


def step(x: Any) -> float:
    """The consumer's training step: a pass over the whole batch."""
    return float(np.asarray(x).sum())


class _Dataset:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        x, y = sample(i)
        return torch.from_numpy(x), y


def run_dataloader(batches: int) -> dict[str, Any]:
    import warnings

    import torch.utils.data

    # torch warns that 4 workers exceed this machine's cores: the comparison asks for 4.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    loader = torch.utils.data.DataLoader(_Dataset(batches * BATCH), batch_size=BATCH,
                                         num_workers=LOADERS)
    times = _Times()
    for k, (x, y) in enumerate(times.sync(iter(loader))):
        check(x.numpy(), y.numpy(), k * BATCH if k % 8 == 1 else None)
        step(x.numpy())
    return times.report("torch-dataloader", batches)


class _Times:
    """When each batch arrived and how long the consumer waited for it."""

    def __init__(self) -> None:
        self.count = 0
        self.waited = 0.0
        self.start = 0.0

    def _got(self, t0: float) -> None:
        t1 = time.perf_counter()
        if self.count == 0:
            self.start = t1
        else:
            self.waited += t1 - t0
        self.count += 1

    def sync(self, it: Any) -> Any:
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self._got(t0)
            yield item

    async def aiter(self, it: Any) -> Any:
        while True:
            t0 = time.perf_counter()
            try:
                item = await it.__anext__()
            except StopAsyncIteration:
                return
            self._got(t0)
            yield item

    def report(self, system: str, batches: int) -> dict[str, Any]:
        wall = time.perf_counter() - self.start
        if self.count != batches:
            raise BenchError(f"{system}: {self.count} batches of {batches}")
        return {"system": system, "op": "loader", "batch": BATCH,
                "batch_bytes": BATCH * 3 * SIDE * SIDE * 4, "loaders": LOADERS,
                "batches": batches, "batches_per_s": (batches - 1) / wall,
                "wait_share": self.waited / wall}


def run_tb(client: Any, batches: int, mode: str) -> dict[str, Any]:
    from . import Stream

    if mode == "batches":
        parts = [Stream.call(client.function(f"{PREFIX}/{i}/batches"), batches)
                 for i in range(LOADERS)]
        stream = Stream.interleave(*parts).prefetch(4)
    else:
        # Each loader runs up to 2 batches' worth of samples ahead (DataLoader's default
        # prefetch_factor=2 batches per worker).
        parts = [Stream.call(client.function(f"{PREFIX}/{i}/samples"), batches * BATCH,
                             prefetch=2 * BATCH)
                 for i in range(LOADERS)]
        stream = Stream.interleave(*parts).batch(BATCH).prefetch(4)
    times = _Times()

    async def consume() -> None:
        async for x, y in times.aiter(stream):
            # Batches come in any order (interleaved), samples mixed across loaders: the
            # label says which sample came first.
            check(x, y, int(y[0]) if times.count % 8 == 1 else None)
            step(x)

    asyncio.run(asyncio.wait_for(consume(), WAIT_S * 10))
    return times.report(f"tensor-broker ({mode})", batches)


# ---- the loader processes --------------------------------------------------------------------


def serve(argv: list[str]) -> int:
    """A loader process: serves its shard's batches and samples until its stdin closes."""
    p = argparse.ArgumentParser()
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--join", required=True)
    p.add_argument("--cluster-secret-file", required=True)
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limit = threading.Timer(PROCESS_LIMIT_S, lambda: os._exit(3))
    limit.daemon = True
    limit.start()
    from . import connect

    client = connect(a.join, secret_file=a.cluster_secret_file)

    def batches(n: int):
        for k in range(a.index, n, LOADERS):
            yield list(make_batch(k))

    def samples(n: int):
        for i in range(a.index, n, LOADERS):
            x, y = sample(i)
            yield [x, y]

    try:
        client.share(f"{PREFIX}/{a.index}/batches")(batches)
        client.share(f"{PREFIX}/{a.index}/samples")(samples)
        with client.serving():
            say(ready=True)
            sys.stdin.read()
    finally:
        client.close()
    return 0


def run(quick: bool, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every loader case: DataLoader, then tb.Stream with batches and with samples."""
    from . import LocalCluster
    from ._bench_call import _Proc, _stop_all

    batches = 12 if quick else 96
    out = [run_dataloader(batches)]
    progress(_line(out[-1]))
    children: list[_Proc] = []
    failed = True
    with LocalCluster() as cluster, cluster.connect() as client:
        try:
            py = [sys.executable, "-m", "tensor_broker", "_bench-loader-server", "--join",
                  cluster.ticket, "--cluster-secret-file", cluster.secret_file]
            for i in range(LOADERS):
                children.append(_Proc(f"loader {i}", [*py, "--index", str(i)]))
            for c in children:
                c.hear()
            for mode in ("batches", "samples"):
                out.append(run_tb(client, batches, mode))
                progress(_line(out[-1]))
            failed = False
        finally:
            _stop_all(children, 2.0 if failed else 15.0)
    return out


def _line(r: dict[str, Any]) -> str:
    return (f"{r['system']}: {r['batches_per_s']:.1f} batches/s, consumer waiting "
            f"{100 * r['wait_share']:.0f}% of the time")


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["system"] == "torch-dataloader"), None)
    lines = [f"Data loading: {LOADERS} loaders, batches of {BATCH} samples "
             f"({rows[0]['batch_bytes'] / 2**20:.1f} MiB), async for (tb.Stream) / for "
             "(DataLoader):",
             f"  {'system':<34} {'batches/s':>10} {'waiting':>8} {'vs DataLoader':>14}"]
    for r in rows:
        ratio = f"{r['batches_per_s'] / base['batches_per_s']:.2f}x" if base else "-"
        lines.append(f"  {r['system']:<34} {r['batches_per_s']:>10.1f} "
                     f"{100 * r['wait_share']:>7.0f}% {ratio:>14}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tensor_broker bench loader",
        description="data loading through tb.Stream (4 loader processes) vs torch's "
        "DataLoader(num_workers=4), the same synthetic batches")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="few batches (a smoke run)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        rows = run(args.quick, lambda line: print(line, file=sys.stderr, flush=True))
    except BenchError as e:
        print(f"bench loader failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench loader interrupted", file=sys.stderr)
        return 130
    rep = {"quick": args.quick, "loaders": rows, "cpus": os.cpu_count()}
    print(json.dumps(rep, indent=2) if args.json else table(rows))
    return 0

