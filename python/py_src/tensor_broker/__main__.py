"""``python -m tensor_broker``: ``bench`` (and the benchmark's internal steps)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from . import _bench

    if argv[:1] == ["_bench-put"]:
        return _bench.bench_put(argv[1:])
    if argv[:1] == ["_bench-get"]:
        return _bench.bench_get(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tensor_broker")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="get throughput and 4 KiB latency, Python package vs the Rust API, two processes",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="sizes in bytes, comma-separated (default 4 KiB,1 MiB,64 MiB,256 MiB)")
    b.add_argument("--rounds", type=int, default=1,
                   help="rounds; each runs Python then Rust, samples pooled")
    b.add_argument("--tb", default=None, help="the tb binary (default: $TB_BIN, PATH, target/release)")
    args = parser.parse_args(argv)
    return _bench.bench(args)


if __name__ == "__main__":
    sys.exit(main())
