"""The ZeroMQ baseline of ``python -m tensor_broker bench``: pyzmq REQ/REP over TCP loopback
with zero-copy frames, which every figure of the systems' table is divided by.

Its own module because it is the one system that is not tensor-broker: its link, the note
describing it and the pip install of pyzmq live here, next to nothing else.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ._bench_proto import WAIT_S, BenchError, ensure_module

ZMQ_HOST = "tcp://127.0.0.1"
BASELINE = "zeromq"
NOTE = (f"zeromq: REQ/REP over {ZMQ_HOST}, send(copy=False) / recv(copy=False) and "
        "np.frombuffer(frame.buffer); the answer to a one-way send is an ack")


def available(install: bool, notes: list[str]) -> bool:
    """Whether pyzmq imports (pip-installed when missing unless ``install`` is false)."""
    return ensure_module("zmq", "pyzmq", "zeromq (ratios to ZeroMQ are missing)", install,
                         notes)


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
