"""Subscriptions: order per name, skipped versions accounted for, async iteration."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

import tensor_broker as tb

VERSIONS = 20


def test_updates_come_in_order_and_skips_are_counted(client: tb.Client, cluster) -> None:
    with cluster.connect() as reader, reader.subscribe("sub/*") as sub:
        for i in range(1, VERSIONS + 1):
            client.put("sub/a", np.full(4, i, dtype=np.int32))
        seen, last = 0, 0
        # Bounded: at most one update per version published.
        for _ in range(VERSIONS):
            u = sub.next(timeout=30)
            assert u.name == "sub/a"
            assert u.version > last
            assert u.skipped == u.version - last - 1
            if u.skipped:
                assert u.skipped_from == last + 1
            assert u.array().tolist() == [u.version] * 4
            seen += 1 + u.skipped
            last = u.version
            if last == VERSIONS:
                break
        assert last == VERSIONS
        assert seen == VERSIONS


def test_skips_before_the_first_update_are_reported(client: tb.Client, cluster) -> None:
    # The subscriber reads nothing until every version is out; whatever it was not given is
    # reported as skipped (the sum always adds up).
    with cluster.connect() as reader, reader.subscribe("lag/x") as sub:
        for i in range(1, 11):
            client.put("lag/x", np.full(2, i, dtype=np.int64))
        total, last = 0, 0
        for _ in range(10):
            u = sub.next(timeout=30)
            total += 1 + u.skipped
            last = u.version
            if last == 10:
                break
        assert (last, total) == (10, 10)


def test_next_times_out_and_the_subscription_goes_on(client: tb.Client, cluster) -> None:
    with cluster.connect() as reader, reader.subscribe("quiet/*") as sub:
        with pytest.raises(tb.Timeout):
            sub.next(timeout=0.2)
        client.put("quiet/a", np.zeros(1))
        assert sub.next(timeout=30).name == "quiet/a"


def test_async_for(client: tb.Client, cluster) -> None:
    async def main() -> list[int]:
        got = []
        with cluster.connect() as reader, reader.subscribe("aio/x") as sub:
            for i in range(3):
                client.put("aio/x", np.full(1, i, dtype=np.int8))
            async for u in sub:
                got.append(u.version)
                if u.version >= 3:
                    break
        return got

    versions = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert versions[-1] == 3
    assert versions == sorted(set(versions))


def test_iteration_yields_updates(client: tb.Client, cluster) -> None:
    with cluster.connect() as reader, reader.subscribe("it/x") as sub:
        client.put("it/x", np.ones(3))
        for u in sub:
            assert (u.name, u.version, u.dtype, u.shape) == ("it/x", 1, "f64", (3,))
            break


def test_mib_versions_by_name_between_processes_are_exact_and_private(client: tb.Client,
                                                                       spawn) -> None:
    # 1 MiB versions: over an offer frame's limit, under the same-host socket's 4 MiB, so the
    # subscriber (another process, read-write) copies each out of the publisher's memfd. It
    # changes every tensor it gets in place (torch: a private view); what the publisher
    # serves stays as published, and the update's read-only array is refused a write.
    n = 1 << 18  # float32s: 1 MiB
    child = spawn(
        """
import torch
c = tb.connect(TICKET, secret_file=SECRET_FILE)
with c.subscribe("mib/*") as sub:
    say("ready")
    last = 0
    # Bounded: one update per version, 30 s each at most.
    while last < 12:
        u = sub.next(timeout=30)
        a = u.array()
        digest = hashlib.sha256(a.tobytes()).hexdigest()
        try:
            a += 1.0
            refused = "no"
        except ValueError:
            refused = "yes"
        t = u.tensor()
        t.add_(1.0)  # in place, on what arrived
        same = hashlib.sha256(u.array().tobytes()).hexdigest() == digest
        say(u.version, u.skipped, digest, refused, same)
        last = u.version
"""
    )
    assert child.line() == "ready"
    sent = {}
    for v in range(1, 13):
        arr = (np.arange(n, dtype=np.float32) * v) % 1000
        sent[client.put("mib/w", arr)] = hashlib.sha256(arr.tobytes()).hexdigest()
        version, skipped, digest, refused, same = child.line().split()
        assert (int(skipped), refused, same) == (0, "yes", "True")
        assert digest == sent[int(version)], f"v{version} arrived changed"
    child.finish()
    again = client.get("mib/w")
    assert hashlib.sha256(again.tobytes()).hexdigest() == sent[max(sent)]
