"""``python -m tensor_broker bench``: tensor-broker's Python package and its Rust API against
ZeroMQ, between separate processes on this host, in one run.

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
so the peak is that size's. ``--repeat N`` runs N passes, the systems alternating within each;
the per-pass medians show a bimodal figure.

The protocol, which the Rust processes speak too:

- Payload: bytes 0..8 hold the sender's clock in ns, written just before the send, 8..16 the
  sequence number (both little-endian), then byte i is ``(i + seq) mod 256``. Receivers check
  the length and compare every byte, after reading their clock: so each receiver reads the
  whole array, as a consumer would, and its peak RSS counts it.
- The receiver takes names under ``<prefix>/to/``, prints ``{"ready", "addr"}``, then for each
  one-way tensor ``{"seq", "size_bytes", "one_way_ns", "check", "ok", "peak_rss_bytes"}``,
  reading its clock once the array is in hand. It answers ``<prefix>/to/ping`` with a
  ``<prefix>/back/pong`` of the same seq. It ends when its stdin closes.
- The sender prints ``{"ready", "addr"}``, then obeys stdin: ``peer <addr>`` (the receiver),
  ``send <size> <seq>`` (answers ``{"sent"}``), ``rtt <count>`` (``count`` ping/pong round
  trips, each pong checked; answers ``{"rtt_ns", "checked"}``).
- One message is in flight at a time: the next is sent once the receiver has reported the
  last. The first of each size, and the first round trip, are warm-ups. Python processes
  stamp with ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for the whole host).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import queue
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

SIZES = [4 << 10, 1 << 20, 64 << 20, 256 << 20]
RTT_SIZE = 4 << 10
# Bytes before the pattern (stamp, seq); received payloads are compared this many bytes at a
# time (a multiple of 256, so every chunk's expected bytes are the first chunk's plus seq).
HEADER = 16
CHECK_CHUNK = 4 << 20
# Longest one answer of a child may take, and one child's whole life.
WAIT_S = 120.0
PROCESS_LIMIT_S = 1800.0
# How often a waiting receiver looks whether its stdin closed (no effect on the timings).
POLL_S = 0.5
ZMQ_HOST = "tcp://127.0.0.1"
BASELINE = "zeromq"


class BenchError(RuntimeError):
    """A child failed, fell silent, or delivered bytes that failed their check."""


# ---- payload ---------------------------------------------------------------------------------


class Payloads:
    """One buffer per size, refilled for each sequence number (the pattern is cached)."""

    def __init__(self) -> None:
        self._pattern: dict[int, np.ndarray] = {}
        self._buf: dict[int, np.ndarray] = {}

    def pattern(self, size: int) -> np.ndarray:
        if size not in self._pattern:
            self._pattern[size] = np.resize(np.arange(256, dtype=np.uint8), size)
        return self._pattern[size]

    def fill(self, size: int, seq: int) -> np.ndarray:
        """The payload of ``seq``, its stamp still to write (:func:`stamp`)."""
        if size < HEADER:
            raise ValueError(f"payloads need at least {HEADER} bytes, not {size}")
        buf = self._buf.setdefault(size, np.empty(size, dtype=np.uint8))
        np.add(self.pattern(size), seq & 0xFF, out=buf)
        buf[8:HEADER].view("<u8")[0] = seq
        return buf

    def check(self, arr: np.ndarray, size: int) -> tuple[int, int, bool]:
        """``(stamp_ns, seq, ok)`` of a received payload: its length and every byte (in
        chunks, so the check holds at most one chunk of expected bytes)."""
        b = arr.reshape(-1).view(np.uint8)
        if b.size < HEADER:
            return 0, 0, False
        stamp_ns, seq = (int(x) for x in b[:HEADER].view("<u8"))
        if b.size != size:
            return stamp_ns, seq, False
        expected = self.pattern(min(size, CHECK_CHUNK)) + (seq & 0xFF)
        ok = np.array_equal(b[HEADER:len(expected)], expected[HEADER:]) and all(
            np.array_equal(b[at:at + CHECK_CHUNK], expected[:size - at])
            for at in range(CHECK_CHUNK, size, CHECK_CHUNK))
        return stamp_ns, seq, bool(ok)


def stamp(buf: np.ndarray) -> None:
    """Writes the send time into the header: the last step before the send."""
    buf[:8].view("<u8")[0] = time.monotonic_ns()


# ---- the worker processes --------------------------------------------------------------------


class BrokerLink:
    """A tensor-broker node of a worker: ``name`` (put / subscription) or ``push`` (push / recv)."""

    def __init__(self, a: argparse.Namespace, receiver: bool) -> None:
        from . import connect

        self.mode, self.prefix, self.peer_addr = a.mode, a.prefix, a.reply_to
        self.client = connect(a.join, secret_file=a.cluster_secret_file)
        watch = f"{a.prefix}/to/*" if receiver else f"{a.prefix}/back/pong"
        self.sub = self.client.subscribe(watch) if a.mode == "name" else None
        self.addr = self.client.addr

    def peer(self, addr: str) -> None:
        self.peer_addr = addr

    def send(self, rest: str, buf: np.ndarray) -> None:
        name = f"{self.prefix}/{rest}"
        if self.mode == "name":
            self.client.put(name, buf)
        else:
            self.client.push(self.peer_addr, name, buf)

    def next(self, timeout: float) -> tuple[str, np.ndarray] | None:
        """The next tensor and its name, as a numpy array; ``None`` after ``timeout``."""
        from . import Timeout

        try:
            if self.sub is None:
                got = self.client.recv(timeout)
                return got.name, got.array()
            update = self.sub.next(timeout)
        except Timeout:
            return None
        return None if update.deleted else (update.name, update.array())

    def answered(self) -> None:
        """The receiver is done with the last tensor (nothing to do here)."""

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
        self.client.close()


class ZmqLink:
    """ZeroMQ REQ (sender) or REP (receiver) with zero-copy frames ``[name, payload]``. The
    REP side answers each one-way tensor with an empty ack and a ping with its pong; the REQ
    side waits for the answer inside ``send``, and ``next`` hands out a pong it holds."""

    def __init__(self, a: argparse.Namespace, receiver: bool) -> None:
        import zmq

        self.zmq, self.prefix = zmq, a.prefix
        self.ctx = zmq.Context()
        self.sock: Any = None
        self.answer: Any = None
        self.owe = False
        if receiver:
            self.sock = self.ctx.socket(zmq.REP)
            self.sock.bind(f"{ZMQ_HOST}:*")
            self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.addr = "-"

    def peer(self, addr: str) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(self.zmq.REQ)
        self.sock.connect(addr)

    def _wait(self, timeout: float) -> bool:
        return bool(self.sock.poll(int(timeout * 1000), self.zmq.POLLIN))

    def send(self, rest: str, buf: np.ndarray) -> None:
        self.sock.send_multipart([f"{self.prefix}/{rest}".encode(), buf], copy=False)
        if self.sock.socket_type == self.zmq.REP:
            self.owe = False
            return
        if not self._wait(WAIT_S):
            raise BenchError(f"zeromq: no answer to {rest} within {WAIT_S} s")
        self.answer = self.sock.recv_multipart(copy=False)

    def next(self, timeout: float) -> tuple[str, np.ndarray] | None:
        if self.sock.socket_type == self.zmq.REQ:
            frames, self.answer = self.answer, None
            if frames is None:
                return None
        elif self._wait(timeout):
            frames, self.owe = self.sock.recv_multipart(copy=False), True
        else:
            return None
        return frames[0].bytes.decode(), np.frombuffer(frames[1].buffer, dtype=np.uint8)

    def answered(self) -> None:
        if self.owe:
            self.sock.send_multipart([b"ack", b""])
            self.owe = False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.ctx.term()


def _worker_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["name", "push", "zeromq"], required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--join")
    p.add_argument("--cluster-secret-file")
    p.add_argument("--reply-to")
    p.add_argument("--limit-s", type=float, default=PROCESS_LIMIT_S)
    a = p.parse_args(argv)
    # A stuck worker must end even if its parent is gone.
    limit = threading.Timer(a.limit_s, lambda: os._exit(3))
    limit.daemon = True
    limit.start()
    return a


@contextlib.contextmanager
def _link(a: argparse.Namespace, receiver: bool) -> Iterator[BrokerLink | ZmqLink]:
    link = ZmqLink(a, receiver) if a.mode == "zeromq" else BrokerLink(a, receiver)
    try:
        yield link
    finally:
        link.close()


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def bench_send(argv: list[str]) -> int:
    """The Python sender: obeys ``peer``, ``send`` and ``rtt`` on stdin until it closes."""
    a = _worker_args(argv)
    pay = Payloads()
    with _link(a, receiver=False) as link:
        _say(ready=True, addr=link.addr)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "peer":
                link.peer(cmd[1])
            elif cmd[0] == "send":
                size, seq = int(cmd[1]), int(cmd[2])
                buf = pay.fill(size, seq)
                stamp(buf)
                link.send(f"to/one/{size}", buf)
                _say(sent=seq)
            elif cmd[0] == "rtt":
                times = []
                for seq in range(int(cmd[1])):
                    buf = pay.fill(RTT_SIZE, seq)
                    start = time.monotonic_ns()
                    stamp(buf)
                    link.send("to/ping", buf)
                    got = link.next(WAIT_S)
                    took = time.monotonic_ns() - start
                    if got is None:
                        raise BenchError(f"no pong {seq} within {WAIT_S} s")
                    _, pong_seq, ok = pay.check(got[1], RTT_SIZE)
                    if not ok or pong_seq != seq:
                        raise BenchError(f"{got[0]}: pong {seq} failed its check")
                    times.append(took)
                _say(rtt_ns=times, checked=len(times))
            else:
                raise BenchError(f"unknown command {line!r}")
    return 0


def bench_recv(argv: list[str]) -> int:
    """The Python receiver: checks and reports each one-way tensor, answers each ping, until
    stdin closes."""
    a = _worker_args(argv)
    pay = Payloads()
    stdin_closed = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stdin_closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    with _link(a, receiver=True) as link:
        _say(ready=True, addr=link.addr, peak_rss_bytes=_peak_rss_bytes())
        while not stdin_closed.is_set():
            got = link.next(POLL_S)
            if got is None:
                continue
            now = time.monotonic_ns()
            name, arr = got
            if name.endswith("/to/ping"):
                _, seq, ok = pay.check(arr, RTT_SIZE)
                if not ok:
                    raise BenchError(f"{name}: ping {seq} failed its check")
                pong = pay.fill(RTT_SIZE, seq)
                stamp(pong)
                link.send("back/pong", pong)
                continue
            sent_ns, seq, ok = pay.check(arr, int(name.rsplit("/", 1)[1]))
            size = arr.nbytes
            del arr, got
            link.answered()
            _say(seq=seq, size_bytes=size, one_way_ns=now - sent_ns, check="full", ok=ok,
                 peak_rss_bytes=_peak_rss_bytes())
    return 0


# ---- the orchestrator ------------------------------------------------------------------------


class Child:
    """A worker process spoken to in lines: commands to its stdin, JSON lines from its stdout,
    read by a thread so every wait is bounded; stderr kept in a file for error messages."""

    def __init__(self, label: str, cmd: list[str]) -> None:
        self.label = label
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _fail(self, what: str) -> BenchError:
        self._err.seek(0)
        tail = self._err.read()[-2000:].decode(errors="replace").strip()
        return BenchError(f"{self.label}: {what}" + (f"; its stderr:\n{tail}" if tail else ""))

    def tell(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._fail(f"exited ({self.proc.poll()}) before {line!r}") from None

    def hear(self, timeout: float = WAIT_S) -> dict[str, Any]:
        """The next JSON line (other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise self._fail(f"no answer within {timeout} s") from None
            if line is None:
                self.proc.wait(timeout=WAIT_S)
                raise self._fail(f"exited ({self.proc.returncode})")
            if line.startswith("{"):
                return json.loads(line)

    def stop(self) -> None:
        """Closes stdin, waits for the exit (kills the process by its PID past the limit)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._err.close()


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


def _systems(cluster: Any, tb_bin: str | None, zmq: bool, notes: list[str]) -> list[System]:
    py = [sys.executable, "-m", "tensor_broker"]
    join = ["--join", cluster.ticket, "--cluster-secret-file", cluster.secret_file]
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
        notes.append(f"zeromq: REQ/REP over {ZMQ_HOST}, send(copy=False) / recv(copy=False) "
                     "and np.frombuffer(frame.buffer); the answer to a one-way send is an ack")
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
        sender.tell(f"rtt {rtt_count + 1}")
        rtt = sender.hear()
        if rtt.get("checked") != rtt_count + 1:
            raise BenchError(f"{sender.label}: {rtt.get('checked')} of {rtt_count + 1} pongs "
                             "checked")
        out["rtt"] = rtt["rtt_ns"][1:]
        progress(f"{_fmt_size(RTT_SIZE)} round trip: p50 {_p(out['rtt'], 50) / 1e3:.1f} µs, "
                 f"p99 {_p(out['rtt'], 99) / 1e3:.1f} µs ({len(out['rtt'])} checked)")
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
    return (f"{_fmt_size(size)} one-way: p50 {p50 / 1e3:.1f} µs, {size / p50 * 1e3:.1f} MB/s "
            f"({len(samples)} checked)")


def _zmq_available(install: bool, notes: list[str]) -> bool:
    try:
        importlib.import_module("zmq")
        return True
    except ImportError:
        pass
    if not install:
        notes.append("zeromq: skipped, pyzmq is not installed (--no-install)")
        return False
    print(f"pyzmq is missing: installing it for the ZeroMQ baseline "
          f"({sys.executable} -m pip install pyzmq)", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "pyzmq"], timeout=600,
                          stdout=sys.stderr)
    importlib.invalidate_caches()
    try:
        importlib.import_module("zmq")
        return True
    except ImportError:
        notes.append(f"zeromq: skipped, pip install pyzmq failed ({done.returncode}): "
                     "ratios to ZeroMQ are missing")
        return False


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
    zmq = _zmq_available(not args.no_install, notes)
    counts, rtt_count = _counts(args.quick), 20 if args.quick else 500
    runs: dict[str, list[dict[str, Any]]] = {}
    with LocalCluster() as cluster:
        systems = _systems(cluster, _find_tb(args.tb), zmq, notes)
        for p in range(args.repeat):
            for system in systems:
                tag = f"[pass {p + 1}/{args.repeat}] {system.name}:"

                def progress(line: str, tag: str = tag) -> None:
                    print(tag, line, file=sys.stderr, flush=True)

                try:
                    run = _run_pass(system, sizes, counts, rtt_count,
                                    f"bench/{system.name}/{p}", progress)
                except BenchError as e:
                    print(f"bench failed: {e}", file=sys.stderr)
                    return 1
                runs.setdefault(system.name, []).append(run)
    report = _report(runs, sizes, args, notes)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_tables(report))
    return 0


# ---- the report ------------------------------------------------------------------------------


def _p(values: list[int], q: float) -> float:
    return float(np.percentile(values, q))


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
        "p50_us": round(_p([v for x in rtts for v in x], 50) / 1e3, 1),
        "p99_us": round(_p([v for x in rtts for v in x], 99) / 1e3, 1),
        "pass_p50_us": [round(_p(x, 50) / 1e3, 1) for x in rtts],
        "pass_p99_us": [round(_p(x, 99) / 1e3, 1) for x in rtts],
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


def _report(runs: dict[str, list[dict[str, Any]]], sizes: list[int], args: argparse.Namespace,
            notes: list[str]) -> dict[str, Any]:
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
        "cases": cases, "notes": notes,
    }


def _fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _columns(sizes: list[int]) -> list[tuple[str, Callable[[dict, Any], str]]]:
    """(heading, cell(cases by (case, size), pass index or None)) for each column."""
    def pick(c: dict[str, Any], key: str, i: Any) -> Any:
        return c[key] if i is None else c[f"pass_{key}"][i]

    cols: list[tuple[str, Callable[[dict, Any], str]]] = []
    for size in sizes:
        big = size >= 1 << 20
        key = "mb_s" if big else "p50_us"
        cols.append((f"{_fmt_size(size)} {'MB/s' if big else 'one-way µs'}",
                     lambda by, i, s=size, k=key: f"{pick(by[('one_way', s)], k, i):g}"))
    rtt = ("rtt", RTT_SIZE)
    cols.insert(1, (f"{_fmt_size(RTT_SIZE)} RTT p50/p99 µs", lambda by, i: (
        f"{pick(by[rtt], 'p50_us', i):g}/{pick(by[rtt], 'p99_us', i):g}")))
    rss = ("peak_rss", sizes[-1])
    cols.append((f"recv peak RSS MiB @{_fmt_size(sizes[-1])} (at start)", lambda by, i: (
        f"{pick(by[rss], 'peak_rss_mib', i):g} ({pick(by[rss], 'start_rss_mib', i):g})")))
    return cols


def _tables(report: dict[str, Any]) -> str:
    sizes, cases = report["sizes"], report["cases"]
    cols = _columns(sizes)
    by_sys = {s: {(c["case"], c["size_bytes"]): c for c in cases if c["system"] == s}
              for s in report["systems"]}

    def table(title: str, rows: list[tuple[str, list[str]]]) -> list[str]:
        head = ["system", *(h for h, _ in cols)]
        width = [max([len(h), *(len([n, *v][k]) for n, v in rows)]) for k, h in enumerate(head)]
        def line(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, width)).rstrip()

        return [title, line(head), *(line([n, *v]) for n, v in rows), ""]

    out = table(f"One-way p50 and MB/s = size/p50, 4 KiB round trip, median of "
                f"{report['passes']} pass(es):",
                [(s, [f(by, None) for _, f in cols]) for s, by in by_sys.items()])
    if report["baseline"]:
        def ratio(s: str, size: int, case: str, key: str) -> str:
            return f"{by_sys[s][(case, size)]['x_zeromq'].get(key, float('nan')):.2f}"

        rows = []
        for s in by_sys:
            cells = [ratio(s, z, "one_way", "mb_s" if z >= 1 << 20 else "p50_us") for z in sizes]
            cells.insert(1, f"{ratio(s, RTT_SIZE, 'rtt', 'p50_us')}/"
                            f"{ratio(s, RTT_SIZE, 'rtt', 'p99_us')}")
            cells.append(ratio(s, sizes[-1], "peak_rss", "peak_rss_mib"))
            rows.append((s, cells))
        out += table("x ZeroMQ (each figure / ZeroMQ's; latency and RSS < 1, MB/s > 1 are "
                     "better):", rows)
    if report["passes"] > 1:
        out += table("Per pass (medians of each pass):", [
            (f"{s} #{i + 1}", [f(by, i) for _, f in cols])
            for s, by in by_sys.items() for i in range(report["passes"])])
    out += report["notes"]
    return "\n".join(out)
