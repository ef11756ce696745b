"""Shared fixtures: a local cluster per module, clients, and child processes (other Python
processes joining the cluster) that are always stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Iterator

import pytest

import tensor_broker as tb

# Longest a child process may take to say it is ready, or to finish.
CHILD_LIMIT_S = 120


@pytest.fixture(scope="module")
def cluster() -> Iterator[tb.LocalCluster]:
    with tb.LocalCluster() as c:
        yield c


@pytest.fixture()
def client(cluster: tb.LocalCluster) -> Iterator[tb.Client]:
    with cluster.connect() as c:
        yield c


class Child:
    """A Python process running ``code`` with ``TICKET`` and ``SECRET_FILE`` defined and
    ``tensor_broker`` imported as ``tb``. It talks in lines: ``say(...)`` prints one,
    ``wait_for_parent()`` blocks until the parent sends a line."""

    PRELUDE = textwrap.dedent(
        """
        import sys, os, hashlib, signal
        # Ctrl-C is KeyboardInterrupt here even when this test run was started in the
        # background, where the shell hands children SIGINT ignored (and Python then installs
        # no handler for it): the tests that send SIGINT test what a terminal user gets.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import numpy as np
        import tensor_broker as tb
        TICKET, SECRET_FILE = sys.argv[1], sys.argv[2]
        def say(*parts):
            print(*parts, flush=True)
        def wait_for_parent():
            return sys.stdin.readline().strip()
        """
    )

    def __init__(self, cluster: tb.LocalCluster, code: str, env: dict[str, str] | None = None):
        script = self.PRELUDE + textwrap.dedent(code)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, cluster.ticket, cluster.secret_file],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def line(self) -> str:
        """The child's next line (fails with its stderr if it exited)."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        if not out:
            self.proc.wait(timeout=CHILD_LIMIT_S)
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"child exited ({self.proc.returncode}): {err}")
        return out.strip()

    def send(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self) -> str:
        """Closes stdin, waits for the exit; returns stderr. Fails on a non-zero status."""
        _, err = self.proc.communicate(timeout=CHILD_LIMIT_S)
        assert self.proc.returncode == 0, f"child failed ({self.proc.returncode}): {err}"
        return err

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=CHILD_LIMIT_S)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture()
def spawn(cluster: tb.LocalCluster) -> Iterator:
    """``spawn(code, env=None) -> Child``; every child is killed at the end of the test."""
    children: list[Child] = []

    def start(code: str, env: dict[str, str] | None = None) -> Child:
        child = Child(cluster, code, env)
        children.append(child)
        return child

    yield start
    for child in children:
        child.stop()
