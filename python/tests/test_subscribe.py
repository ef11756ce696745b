"""Subscriptions: order per name, skipped versions accounted for, async iteration."""

from __future__ import annotations

import asyncio

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
