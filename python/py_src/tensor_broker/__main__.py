"""``python -m tensor_broker``: ``bench``, ``bench call``, ``bench loader``, ``bench device``
(and the benchmarks' internal steps)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "device"]:
        # Gets onto a GPU vs torch.multiprocessing (needs torch with CUDA).
        from . import _bench_device

        return _bench_device.main(argv[2:])
    if argv[:2] == ["bench", "loader"] or argv[:1] == ["_bench-loader-server"]:
        # tb.Stream loaders vs torch's DataLoader.
        from . import _bench_loader

        if argv[:1] == ["_bench-loader-server"]:
            return _bench_loader.serve(argv[1:])
        return _bench_loader.main(argv[2:])
    if argv[:2] == ["bench", "call"] or argv[:1] in (["_bench-call-server"],
                                                      ["_bench-call-caller"]):
        # Remote calls vs gRPC and ZeroMQ (its own parser: ``bench``'s options are unchanged).
        from . import _bench_call

        if argv[:1] == ["_bench-call-server"]:
            return _bench_call.serve(argv[1:])
        if argv[:1] == ["_bench-call-caller"]:
            return _bench_call.caller(argv[1:])
        return _bench_call.main(argv[2:])
    from . import _bench

    if argv[:1] == ["_bench-send"]:
        return _bench.bench_send(argv[1:])
    if argv[:1] == ["_bench-recv"]:
        return _bench.bench_recv(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m tensor_broker",
        epilog="python -m tensor_broker bench call [--json] [--quick] [--no-install]: remote "
        "calls (echo, add_one, streaming) vs gRPC and ZeroMQ between processes, and tb.Stream "
        "loaders vs torch's DataLoader; python -m tensor_broker bench loader [--json] [--quick]: "
        "the loaders only; python -m tensor_broker bench device [--json]: a tensor got onto a "
        "GPU between two processes vs torch.multiprocessing (needs CUDA)")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="one-way latency, MB/s, 4 KiB round trip and receiver peak RSS between two "
        "processes: the Python package and the Rust API, by name and by push, vs ZeroMQ",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="one-way sizes in bytes, comma-separated (default 4 KiB,1 MiB,64 MiB,"
                   "256 MiB); the largest runs in a fresh receiver, whose peak RSS is reported")
    b.add_argument("--repeat", type=int, default=1,
                   help="passes, the systems alternating within each; per-pass medians too")
    b.add_argument("--quick", action="store_true",
                   help="few messages per case (a smoke run, not a measurement)")
    b.add_argument("--no-install", action="store_true",
                   help="skip ZeroMQ when pyzmq is missing instead of pip-installing it")
    b.add_argument("--tb", default=None,
                   help="the tb binary (default: $TB_BIN, PATH, target/release)")
    b.add_argument("--systems", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="which systems to run, comma-separated, of "
                   f"{','.join(_bench.SYSTEMS)} (default all; ratios need zeromq)")
    b.add_argument("--no-extra", action="store_true",
                   help="skip the extra measurements (get by name, warm put, asyncio)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    unknown = sorted(set(args.systems or []) - set(_bench.SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)} (known: "
                     f"{', '.join(_bench.SYSTEMS)})")
    return _bench.bench(args)


if __name__ == "__main__":
    sys.exit(main())
