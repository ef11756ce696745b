"""``python -m tensor_broker bench device``: a tensor got onto a GPU between two processes of
one host, as a Python user gets it, against what they would use instead.

- ``tensor-broker``: a publisher process ``put``s the tensor (a CUDA tensor, which its node
  keeps on the GPU, or a host tensor); a reader process times
  ``get_torch(name, device="cuda")`` until the device is synchronized. The reader gets a
  private device copy (CUDA IPC device to device from a GPU-held version; the pair's shm
  channel and one copy up from a host-held one).
- ``torch-mp``: ``torch.multiprocessing`` (spawned processes, a ``Pipe``): the reader asks for
  item ``i``, the producer sends a distinct tensor (made ahead, kept alive) and the reader
  makes it a private copy on its device (``clone()`` of a CUDA tensor received by CUDA IPC;
  ``.cuda()`` of a host tensor received through shared memory), until synchronized.

Then a call with a CUDA tensor (``call`` rows): a server process applies ``x + 1`` (uint8,
on the GPU) and the caller times the call until its device is synchronized, with the result
on its GPU:

- ``tensor-broker``: ``f(x)`` of a CUDA tensor; argument and result are lent and copied
  device to device by CUDA IPC.
- ``torch-mp``: the same request/reply over a ``torch.multiprocessing`` ``Pipe`` (CUDA IPC
  both ways); the caller ``clone()``s the result (its own memory, as tensor-broker's is).
- ``host path`` (``x_host``): ``f(x.cpu())`` then ``.cuda()`` of the result, which is how a
  call moved a CUDA tensor before calls lent device memory.

Each case is the median of ``--iters`` timed transfers after one warm-up; every first
transfer is checked byte for byte on the device. ``x_torch`` = torch-mp's median time /
tensor-broker's (above 1: tensor-broker is faster). Needs torch with a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

MIB = 1 << 20
DEFAULT_SIZES = [4 * MIB, 64 * MIB, 256 * MIB]
CHILD_LIMIT_S = 300

READER = r"""
import json, sys, time, torch, tensor_broker as tb
ticket, secret, sizes, iters = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with tb.connect(ticket, secret_file=secret) as c:
    for held in ("cuda", "host"):
        for n in map(int, sizes.split(",")):
            name = f"bench-device/{held}/{n}"
            t = c.get_torch(name, device="cuda")
            torch.cuda.synchronize()
            want = (torch.arange(n, device="cuda", dtype=torch.int64) % 251).to(torch.uint8)
            if not torch.equal(t.view(torch.uint8).reshape(-1), want):
                raise SystemExit(f"{name}: the bytes differ")
            del t, want
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                t = c.get_torch(name, device="cuda")
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                del t
            print(json.dumps({"held": held, "size": n, "times": times}), flush=True)
"""


def pattern(torch: Any, n: int, device: str) -> Any:
    return (torch.arange(n, device=device, dtype=torch.int64) % 251).to(torch.uint8)


def _torch_producer(conn: Any, held: str, n: int, count: int) -> None:
    """Makes ``count`` distinct tensors of ``n`` bytes (on the GPU or in shared host memory)
    and sends item ``i`` each time the reader asks for it, keeping them all alive."""
    import torch

    device = "cuda" if held == "cuda" else "cpu"
    base = pattern(torch, n, device)
    items = [base.clone() for _ in range(count)]
    if held == "cuda":
        torch.cuda.synchronize()
    else:
        for t in items:
            t.share_memory_()
    conn.send("ready")
    while True:
        i = conn.recv()
        if i is None:
            break
        conn.send(items[i])
    conn.close()


def torch_case(held: str, n: int, iters: int) -> list[float]:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_torch_producer, args=(theirs, held, n, iters + 1), daemon=True)
    proc.start()
    try:
        if not ours.poll(CHILD_LIMIT_S) or ours.recv() != "ready":
            raise RuntimeError("the torch producer did not start")

        def one(i: int) -> Any:
            ours.send(i)
            got = ours.recv()
            mine = got.clone() if held == "cuda" else got.cuda()
            torch.cuda.synchronize()
            del got
            return mine

        first = one(0)
        if not torch.equal(first, pattern(torch, n, "cuda")):
            raise RuntimeError(f"torch-mp {held} {n}: the bytes differ")
        del first
        times = []
        for i in range(1, iters + 1):
            t0 = time.perf_counter()
            mine = one(i)
            times.append(time.perf_counter() - t0)
            del mine
        ours.send(None)
        return times
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def tb_cases(sizes: list[int], iters: int) -> dict[tuple[str, int], list[float]]:
    import torch

    import tensor_broker as tb

    got: dict[tuple[str, int], list[float]] = {}
    with tb.LocalCluster() as cluster, cluster.connect() as pub:
        keep = []
        for n in sizes:
            host = pattern(torch, n, "cpu")
            pub.put(f"bench-device/host/{n}", host)
            dev = host.cuda()
            pub.put(f"bench-device/cuda/{n}", dev)
            keep.append(dev)
        args = [sys.executable, "-c", READER, cluster.ticket, cluster.secret_file,
                ",".join(map(str, sizes)), str(iters)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=CHILD_LIMIT_S)
        if out.returncode:
            raise RuntimeError(f"the tensor-broker reader failed:\n{out.stderr[-3000:]}")
        for line in out.stdout.splitlines():
            case = json.loads(line)
            got[(case["held"], case["size"])] = case["times"]
    return got


CALL_SERVER = r"""
import sys, torch, tensor_broker as tb
with tb.connect(sys.argv[1], secret_file=sys.argv[2]) as c:
    @c.share("bench-device/add-one", concurrency=4)
    def add_one(x):
        return x + 1
    print("serving", flush=True)
    c.serve()
"""


def _torch_server(conn: Any, keep: int) -> None:
    """Answers each CUDA tensor it gets with ``x + 1``, keeping its last ``keep`` results
    alive (the caller maps them by CUDA IPC)."""
    import torch

    kept: list[Any] = []
    conn.send("ready")
    while True:
        x = conn.recv()
        if x is None:
            break
        y = x + 1
        torch.cuda.synchronize()
        kept = (kept + [y])[-keep:]
        del x
        conn.send(y)
    conn.close()


def torch_call_case(n: int, iters: int) -> list[float]:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_torch_server, args=(theirs, 4), daemon=True)
    proc.start()
    try:
        if not ours.poll(CHILD_LIMIT_S) or ours.recv() != "ready":
            raise RuntimeError("the torch server did not start")
        x = pattern(torch, n, "cuda")
        want = x + 1
        times = []
        for i in range(iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ours.send(x)
            got = ours.recv()
            mine = got.clone()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del got
            if i == 0 and not torch.equal(mine, want):
                raise RuntimeError(f"torch-mp call {n}: the bytes differ")
        ours.send(None)
        return times[1:]
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def tb_call_cases(sizes: list[int], iters: int) -> dict[tuple[str, int], list[float]]:
    """``(path, size)`` -> times, path ``device`` (CUDA tensors in and out) or ``host``."""
    import torch

    import tensor_broker as tb

    got: dict[tuple[str, int], list[float]] = {}
    with tb.LocalCluster() as cluster:
        server = subprocess.Popen(
            [sys.executable, "-c", CALL_SERVER, cluster.ticket, cluster.secret_file],
            stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "serving":
                raise RuntimeError("the tensor-broker call server did not start")
            with cluster.connect() as caller:
                deadline = time.monotonic() + CHILD_LIMIT_S
                while ("bench-device/add-one", 1) not in caller.functions("bench-device/"):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the call server was never listed")
                    time.sleep(0.05)
                f = caller.function("bench-device/add-one")
                for n in sizes:
                    x = pattern(torch, n, "cuda")
                    want = x + 1
                    calls = {"device": lambda: f(x, timeout=CHILD_LIMIT_S),
                             "host": lambda: f(x.cpu(), timeout=CHILD_LIMIT_S).cuda()}
                    for path, call in calls.items():
                        first = call()
                        torch.cuda.synchronize()
                        if not (first.is_cuda and torch.equal(first, want)):
                            raise RuntimeError(f"tensor-broker call {path} {n}: the bytes differ")
                        del first
                        times = []
                        for _ in range(iters):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            y = call()
                            torch.cuda.synchronize()
                            times.append(time.perf_counter() - t0)
                            del y
                        got[(path, n)] = times
        finally:
            server.kill()
            server.wait(30)
    return got


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tensor_broker bench device",
        description="a tensor got onto a GPU between two processes of one host: tensor-broker "
        "get_torch(device='cuda') against torch.multiprocessing (needs torch with CUDA)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", type=lambda s: [int(x) * MIB for x in s.split(",")],
                        default=DEFAULT_SIZES, help="sizes in MiB, comma-separated "
                        "(default 4,64,256)")
    parser.add_argument("--iters", type=int, default=7,
                        help="timed transfers per case after a warm-up; the median is reported")
    args = parser.parse_args(argv)
    if args.iters < 1 or any(n < 1 for n in args.sizes):
        parser.error("--iters and every size: at least 1")
    try:
        import torch
    except ImportError:
        print("bench device needs torch (pip install torch)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench device needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    progress = (lambda msg: print(msg, file=sys.stderr, flush=True))
    progress(f"tensor-broker: {len(args.sizes) * 2} cases ...")
    ours = tb_cases(args.sizes, args.iters)
    cases = []
    for held in ("cuda", "host"):
        for n in args.sizes:
            progress(f"torch-mp: {held}-held {n // MIB} MiB ...")
            theirs = median(torch_case(held, n, args.iters))
            mine = median(ours[(held, n)])
            cases.append({
                "held": held, "size_bytes": n,
                "tensor_broker_ms": round(mine * 1e3, 3),
                "torch_mp_ms": round(theirs * 1e3, 3),
                "tensor_broker_gb_s": round(n / mine / 1e9, 2),
                "torch_mp_gb_s": round(n / theirs / 1e9, 2),
                "x_torch": round(theirs / mine, 2),
            })
    progress(f"tensor-broker calls: {len(args.sizes) * 2} cases ...")
    our_calls = tb_call_cases(args.sizes, args.iters)
    calls = []
    for n in args.sizes:
        progress(f"torch-mp call: {n // MIB} MiB ...")
        theirs = median(torch_call_case(n, args.iters))
        mine, host = median(our_calls[("device", n)]), median(our_calls[("host", n)])
        calls.append({
            "size_bytes": n,
            "tensor_broker_ms": round(mine * 1e3, 3),
            "torch_mp_ms": round(theirs * 1e3, 3),
            "host_path_ms": round(host * 1e3, 3),
            "x_torch": round(theirs / mine, 2),
            "x_host": round(host / mine, 2),
        })
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(0), "iters": args.iters,
                          "cases": cases, "calls": calls}))
        return 0
    print(f"{'held':<6}{'size':>9}{'tb ms':>10}{'tb GB/s':>10}{'torch-mp ms':>13}"
          f"{'torch GB/s':>12}{'x_torch':>9}")
    for c in cases:
        print(f"{c['held']:<6}{c['size_bytes'] // MIB:>6}MiB{c['tensor_broker_ms']:>10}"
              f"{c['tensor_broker_gb_s']:>10}{c['torch_mp_ms']:>13}{c['torch_mp_gb_s']:>12}"
              f"{c['x_torch']:>9}")
    print()
    print(f"{'call':<6}{'size':>9}{'tb ms':>10}{'torch-mp ms':>13}{'host path ms':>14}"
          f"{'x_torch':>9}{'x_host':>8}")
    for c in calls:
        print(f"{'x+1':<6}{c['size_bytes'] // MIB:>6}MiB{c['tensor_broker_ms']:>10}"
              f"{c['torch_mp_ms']:>13}{c['host_path_ms']:>14}{c['x_torch']:>9}{c['x_host']:>8}")
    return 0
