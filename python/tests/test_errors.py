"""Every exception, raised where it should be."""

from __future__ import annotations

import os
import signal
import tempfile

import numpy as np
import pytest

import tensor_broker as tb


def test_not_found(client: tb.Client) -> None:
    with pytest.raises(tb.NotFound):
        client.get("missing/x")
    client.put("nf/x", np.zeros(1))
    with pytest.raises(tb.NotFound):
        client.get("nf/x", 99)
    with pytest.raises(tb.NotFound):
        client.get("nf/x", 0)
    assert issubclass(tb.NotFound, tb.TensorBrokerError)


def test_unauthorized_with_the_wrong_secret(cluster: tb.LocalCluster) -> None:
    with tempfile.TemporaryDirectory() as d:
        wrong = os.path.join(d, "secret")
        with open(wrong, "w") as f:
            f.write("this-is-not-the-cluster-secret-0123456789abcdef\n")
        with tb.connect(cluster.ticket, secret_file=wrong) as c:
            with pytest.raises(tb.Unauthorized):
                c.ls()


def test_timeout(client: tb.Client, spawn) -> None:
    # The only holder is a stopped process: the get waits on it until the limit.
    child = spawn(
        """
c = tb.connect(TICKET, secret_file=SECRET_FILE)
c.put("to/x", np.zeros(1 << 20, dtype=np.uint8))
say("ready")
wait_for_parent()
"""
    )
    assert child.line() == "ready"
    os.kill(child.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(tb.Timeout):
            client.get("to/x", timeout=1.0)
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
    assert issubclass(tb.Timeout, TimeoutError)


def test_unavailable_when_no_broker_answers() -> None:
    with tb.LocalCluster() as gone:
        ticket, secret = gone.ticket, open(gone.secret_file).read()
    with tb.connect(ticket, secret=secret.strip()) as c:
        with pytest.raises(tb.Unavailable):
            c.ls()


def test_unavailable_after_close(cluster: tb.LocalCluster) -> None:
    c = cluster.connect()
    c.close()
    c.close()
    assert c.closed
    with pytest.raises(tb.Unavailable):
        c.ls()


def test_invalid_arguments(client: tb.Client) -> None:
    with pytest.raises(tb.InvalidArgument):
        tb.connect("not-a-ticket")
    with pytest.raises(tb.InvalidArgument):
        client.get("bad name")
    with pytest.raises(ValueError):
        client.get("x/y", timeout=-1)
    with pytest.raises(tb.InvalidArgument):
        tb.LocalCluster(workers=1000)


def test_no_cluster_to_find(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TB_JOIN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(tb.Unavailable, match="tb up"):
        tb.connect()
