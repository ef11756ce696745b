"""What every process of ``python -m tensor_broker bench`` shares: the payload, the line
protocol between the orchestrator and its worker processes, and the constants both ends read.

Kept apart from the workers and the orchestrator because both sides (and the Rust workers,
cli/src/bench_client.rs, which speak the same protocol) must agree on it byte for byte.

- Payload: bytes 0..8 hold the sender's clock in ns, written just before the send, 8..16 the
  sequence number (both little-endian), then byte i is ``(i + seq) mod 256``. Receivers check
  the length and compare every byte, after reading their clock: so each receiver reads the
  whole array, as a consumer would, and its peak RSS counts it.
- Lines: a worker reads commands on stdin, one a line, and answers with one JSON object a
  line on stdout (other lines are ignored); it prints ``{"ready", "addr"}`` first. The
  orchestrator drives it through a :class:`Child`, every wait bounded by ``WAIT_S``.
- Clocks: Python processes stamp with ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock
  for the whole host), so one-way times may be read across processes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

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
# Worker modes: the systems' links (``name``, ``push``, ``zeromq``) and the extra
# measurements' roles (``async``: the asyncio round-trip sender; ``store``: put/get by name).
MODES = ("name", "push", "zeromq", "async", "store")


class BenchError(RuntimeError):
    """A child failed, fell silent, or delivered bytes that failed their check."""


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


def pct(values: list[int], q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation)."""
    return float(np.percentile(values, q))


def stamp(buf: np.ndarray) -> None:
    """Writes the send time into the header: the last step before the send."""
    buf[:8].view("<u8")[0] = time.monotonic_ns()


# ---- the worker's end ------------------------------------------------------------------------


def worker_args(argv: list[str]) -> argparse.Namespace:
    """A worker's arguments; starts the timer that ends a stuck worker even if its parent is
    gone."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--join")
    p.add_argument("--cluster-secret-file")
    p.add_argument("--reply-to")
    p.add_argument("--limit-s", type=float, default=PROCESS_LIMIT_S)
    a = p.parse_args(argv)
    limit = threading.Timer(a.limit_s, lambda: os._exit(3))
    limit.daemon = True
    limit.start()
    return a


def say(**fields: Any) -> None:
    """One answer line to the orchestrator."""
    print(json.dumps(fields), flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


# ---- the orchestrator's end ------------------------------------------------------------------


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

    def ask(self, line: str, timeout: float = WAIT_S) -> dict[str, Any]:
        """:meth:`tell`, then :meth:`hear` the answer."""
        self.tell(line)
        return self.hear(timeout)

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


def ensure_module(module: str, package: str, purpose: str, install: bool,
                  notes: list[str]) -> bool:
    """Whether ``module`` imports; pip-installs ``package`` when it is missing unless
    ``install`` is false (``--no-install``), noting what is skipped then."""
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        pass
    if not install:
        notes.append(f"{purpose}: skipped, {package} is not installed (--no-install)")
        return False
    print(f"{package} is missing: installing it for {purpose} "
          f"({sys.executable} -m pip install {package})", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", package], timeout=600,
                          stdout=sys.stderr)
    importlib.invalidate_caches()
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        notes.append(f"{purpose}: skipped, pip install {package} failed ({done.returncode})")
        return False
