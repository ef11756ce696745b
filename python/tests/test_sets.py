"""put_many / get_many: whole state_dicts as one atomic version."""

from __future__ import annotations

import numpy as np
import pytest

import tensor_broker as tb

ROUNDS = 40


def test_round_trip_and_listing(client: tb.Client, cluster) -> None:
    sd = {
        "layer1.weight": np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32),
        "layer1.bias": np.zeros(16, dtype=np.float32),
        "step": np.array(7, dtype=np.int64),
    }
    v = client.put_many("sets/model", sd, metadata={"format": "pt"})
    with cluster.connect() as other:
        got = other.get_many("sets/model")
        assert list(got) == list(sd)
        for k in sd:
            assert got[k].tobytes() == sd[k].tobytes()
            assert got[k].shape == sd[k].shape
        version, arrays, meta = other.get_set("sets/model", v)
        assert version == v and meta == {"format": "pt"} and set(arrays) == set(sd)
        (entry,) = other.ls("sets/")
        assert (entry.name, entry.dtype, entry.version) == ("sets/model", "set", v)
        with pytest.raises(TypeError, match="get_many"):
            other.get("sets/model")


def test_readers_never_see_a_mix_of_versions(client: tb.Client, spawn, cluster) -> None:
    # A child publishes versions as fast as it can; every member of version i holds i.
    child = spawn(
        f"""
c = tb.connect(TICKET, secret_file=SECRET_FILE)
for i in range(1, {ROUNDS} + 1):
    c.put_many("atomic/m", {{k: np.full((256,), i, dtype=np.int32) for k in "abcd"}})
    if i == 1:
        say("first")
say("done")
wait_for_parent()
c.close()
"""
    )
    assert child.line() == "first"
    with cluster.connect() as reader, reader.subscribe("atomic/m") as sub:
        reads = 0
        for _ in range(ROUNDS):
            try:
                got = reader.get_many("atomic/m")
            except tb.NotFound:
                # The newest version was evicted while this get fetched it (the publisher
                # moved on by more than the versions kept): a lost race, never a mix.
                continue
            reads += 1
            values = {int(a[0]) for a in got.values()} | {int(a[-1]) for a in got.values()}
            assert len(values) == 1, f"members from different versions: {values}"
        assert reads > 0
        assert child.line() == "done"
        last = reader.get_many("atomic/m")
        assert {int(a[0]) for a in last.values()} == {ROUNDS}
        client.put_many("atomic/m", {k: np.full((256,), 0, dtype=np.int32) for k in "abcd"})
        for _ in range(ROUNDS + 1):
            u = sub.next(timeout=30)
            arrays = u.arrays()
            assert len({int(a[0]) for a in arrays.values()}) == 1
            if int(arrays["a"][0]) == 0:
                break
        else:
            raise AssertionError("the subscriber never saw the last set")
    child.send()
    child.finish()


def test_bad_keys_are_refused(client: tb.Client) -> None:
    with pytest.raises(tb.InvalidArgument):
        client.put_many("sets/bad", {"has space": np.zeros(1)})
    with pytest.raises(tb.NotFound):
        client.get_many("sets/none")
