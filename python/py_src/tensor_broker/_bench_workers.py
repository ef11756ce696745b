"""The sender and receiver processes of ``python -m tensor_broker bench``'s systems
(``python -m tensor_broker _bench-send`` / ``_bench-recv``), for the Python package by name
and by push and for the ZeroMQ baseline; the Rust ones are ``tb bench client-send`` /
``client-recv`` (cli/src/bench_client.rs) and speak the same lines.

Each worker is its own process so a figure includes every cost a real consumer pays (its own
interpreter, node, copies and page faults) and the receiver's peak RSS is its own.

- The receiver takes names under ``<prefix>/to/``, prints ``{"ready", "addr"}``, then for each
  one-way tensor ``{"seq", "size_bytes", "one_way_ns", "check", "ok", "peak_rss_bytes"}``,
  reading its clock once the array is in hand. It answers ``<prefix>/to/ping`` with a
  ``<prefix>/back/pong`` of the same seq. It ends when its stdin closes.
- The sender prints ``{"ready", "addr"}``, then obeys stdin: ``peer <addr>`` (the receiver),
  ``send <size> <seq>`` (answers ``{"sent"}``), ``rtt <count>`` (``count`` ping/pong round
  trips, each pong checked; answers ``{"rtt_ns", "checked"}``).

``--mode async`` and ``--mode store`` are the extra measurements' roles
(:mod:`._bench_extra`); ``_bench-send`` hands them over.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from typing import Iterator

import numpy as np

from ._bench_proto import (
    POLL_S,
    RTT_SIZE,
    WAIT_S,
    BenchError,
    Payloads,
    peak_rss_bytes,
    say,
    stamp,
    worker_args,
)
from ._bench_zmq import ZmqLink


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


@contextlib.contextmanager
def _link(a: argparse.Namespace, receiver: bool) -> Iterator[BrokerLink | ZmqLink]:
    if a.mode not in ("name", "push", "zeromq"):
        raise BenchError(f"--mode {a.mode}: not a system's link")
    link = ZmqLink(a, receiver) if a.mode == "zeromq" else BrokerLink(a, receiver)
    try:
        yield link
    finally:
        link.close()


def bench_send(argv: list[str]) -> int:
    """The Python sender: obeys ``peer``, ``send`` and ``rtt`` on stdin until it closes (the
    extra measurements' roles for ``--mode async`` / ``store``)."""
    a = worker_args(argv)
    if a.mode in ("async", "store"):
        from . import _bench_extra

        return _bench_extra.serve(a)
    pay = Payloads()
    with _link(a, receiver=False) as link:
        say(ready=True, addr=link.addr)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "peer":
                link.peer(cmd[1])
            elif cmd[0] == "send":
                size, seq = int(cmd[1]), int(cmd[2])
                buf = pay.fill(size, seq)
                stamp(buf)
                link.send(f"to/one/{size}", buf)
                say(sent=seq)
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
                say(rtt_ns=times, checked=len(times))
            else:
                raise BenchError(f"unknown command {line!r}")
    return 0


def bench_recv(argv: list[str]) -> int:
    """The Python receiver: checks and reports each one-way tensor, answers each ping, until
    stdin closes."""
    a = worker_args(argv)
    pay = Payloads()
    stdin_closed = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stdin_closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    with _link(a, receiver=True) as link:
        say(ready=True, addr=link.addr, peak_rss_bytes=peak_rss_bytes())
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
            say(seq=seq, size_bytes=size, one_way_ns=now - sent_ns, check="full", ok=ok,
                peak_rss_bytes=peak_rss_bytes())
    return 0
