"""push/recv: a tensor sent straight to one node, verified and queued for its ``recv``."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import tensor_broker as tb

SIZES = [4 << 10, 1 << 20, 64 << 20]


def _payload(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, size, dtype=np.uint8)


@pytest.mark.parametrize("size", SIZES)
def test_push_then_recv_is_byte_identical(cluster: tb.LocalCluster, size: int) -> None:
    with cluster.connect() as sender, cluster.connect() as receiver:
        data = _payload(size, size).view(np.float32).reshape(-1, 4)
        sender.push(receiver.addr, "w", data)
        got = receiver.recv(timeout=30)
        assert got.name == "w"
        assert got.sender == sender.id
        assert got.dtype == "f32" and got.shape == data.shape and got.size == data.nbytes
        arr = got.array()
        assert arr.dtype == np.float32 and arr.shape == data.shape
        assert np.array_equal(arr.view(np.uint8), data.view(np.uint8))
        assert not arr.flags.writeable


def test_recv_times_out_and_keeps_order(client: tb.Client, cluster: tb.LocalCluster) -> None:
    with pytest.raises(tb.Timeout):
        client.recv(timeout=0.05)
    with cluster.connect() as sender:
        for i in range(5):
            sender.push(client.addr, f"n/{i}", np.full(3, i, dtype=np.int32))
    got = [client.recv(timeout=10) for _ in range(5)]
    assert [r.name for r in got] == [f"n/{i}" for i in range(5)]
    assert [r.array().tolist() for r in got] == [[i] * 3 for i in range(5)]
    assert list(client.incoming(timeout=0.05)) == []


def test_pushed_tensor_in_torch_is_private(client: tb.Client, cluster: tb.LocalCluster) -> None:
    torch = pytest.importorskip("torch")
    with cluster.connect() as sender:
        sender.push(client.addr, "t", torch.arange(1 << 16, dtype=torch.float32))
    got = client.recv(timeout=10)
    t = got.tensor()
    t.add_(1)  # in place: a private view
    assert float(t[0]) == 1.0
    assert float(got.tensor()[0]) in (0.0, 1.0)  # the same buffer's view, never the node's
    assert got.array()[5] in (5.0, 6.0)


def test_push_to_a_bad_address_is_invalid(client: tb.Client) -> None:
    with pytest.raises(tb.InvalidArgument, match="expected a node's addr"):
        client.push("not-an-addr", "x", np.zeros(1))


def test_push_over_the_receivers_budget_is_refused(cluster: tb.LocalCluster) -> None:
    budget = 1 << 20
    with cluster.connect(max_push_memory=budget) as receiver, cluster.connect() as sender:
        # Larger than the whole budget: refused, nothing queued.
        with pytest.raises(tb.InvalidArgument):
            sender.push(receiver.addr, "big", np.zeros(2 << 20, dtype=np.uint8))
        # Fits once; a second one while the first is queued does not.
        sender.push(receiver.addr, "a", np.ones(600 << 10, dtype=np.uint8))
        with pytest.raises(tb.Unavailable):
            sender.push(receiver.addr, "b", np.ones(600 << 10, dtype=np.uint8))
        assert receiver.status()["push_bytes_held"] == 600 << 10
        got = receiver.recv(timeout=10)
        assert got.name == "a" and int(got.array().sum()) == 600 << 10
        del got
        # Taken: the budget is free again.
        sender.push(receiver.addr, "c", np.ones(600 << 10, dtype=np.uint8))
        assert receiver.recv(timeout=10).name == "c"
        with pytest.raises(tb.Timeout):
            receiver.recv(timeout=0.05)


def test_a_read_only_member_cannot_push_to_a_read_write_node(cluster: tb.LocalCluster) -> None:
    with cluster.connect(read_only=True) as reader, cluster.connect() as writer:
        with pytest.raises(tb.Unauthorized):
            reader.push(writer.addr, "x", np.zeros(16, dtype=np.uint8))
        with pytest.raises(tb.Timeout):
            writer.recv(timeout=0.05)
        # Nor does a read-only node take pushes (they are publishes of a kind).
        with pytest.raises(tb.Unauthorized, match="read-only"):
            writer.push(reader.addr, "y", np.arange(16, dtype=np.uint8))
        with pytest.raises(tb.Timeout):
            reader.recv(timeout=0.05)


def test_push_between_processes(client: tb.Client, spawn) -> None:
    size = 8 << 20
    child = spawn(
        f"""
        c = tb.connect(TICKET, secret_file=SECRET_FILE)
        peer = wait_for_parent()
        data = np.random.default_rng(7).integers(0, 255, {size}, dtype=np.uint8)
        c.push(peer, "from-child", data)
        say(hashlib.sha256(data.tobytes()).hexdigest(), c.id)
        got = c.recv(timeout=60)
        say(got.name, got.sender, hashlib.sha256(got.array().tobytes()).hexdigest())
        c.close()
        """
    )
    child.send(client.addr)
    digest, child_id = child.line().split()
    got = client.recv(timeout=60)
    assert got.name == "from-child" and got.sender == child_id
    assert hashlib.sha256(got.array().tobytes()).hexdigest() == digest
    back = _payload(3 << 20, 9)
    client.push(got_sender_addr(client, child_id), "reply", back)
    name, sender, digest = child.line().split()
    assert (name, sender) == ("reply", client.id)
    assert digest == hashlib.sha256(back.tobytes()).hexdigest()
    child.finish()


def got_sender_addr(client: tb.Client, node_id: str) -> str:
    """The address of member ``node_id``, from the cluster's member list."""
    for m in client.status()["members"]:
        if m["id"] == node_id and m["addrs"]:
            return f"{node_id}@{m['addrs'][0]}"
    raise AssertionError(f"{node_id} is not a member with an address")
