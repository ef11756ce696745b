"""Every dtype and shape between two processes, byte-identical; 256 MiB; out=; zero-copy."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

import tensor_broker as tb
from tensor_broker import _dtypes

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16/f8 numpy dtypes need ml_dtypes")

SHAPES = [(), (0,), (7,), (2, 3, 4), (3, 0, 2)]

# Makes the same array in both processes from (dtype, shape): bytes from a seeded generator.
MAKE = """
def make(dtype_name, shape):
    from tensor_broker import _dtypes
    dt = _dtypes.numpy_dtype(dtype_name)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    seed = int(hashlib.sha256(f"{dtype_name}{shape}".encode()).hexdigest()[:8], 16)
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype_name == "bool":
        raw = raw & 1
    return raw.view(dt).reshape(shape)
"""
exec(MAKE, globals())


def name_of(dtype: str, shape: tuple[int, ...]) -> str:
    return f"rt/{dtype}/" + ("x".join(map(str, shape)) or "scalar")


def test_every_dtype_and_shape_between_two_processes(client: tb.Client, spawn) -> None:
    child = spawn(
        MAKE
        + f"""
c = tb.connect(TICKET, secret_file=SECRET_FILE)
for d in {list(_dtypes.DTYPES)!r}:
    for s in {SHAPES!r}:
        c.put("rt/" + d + "/" + ("x".join(map(str, s)) or "scalar"), make(d, s))
say("ready")
wait_for_parent()
c.close()
"""
    )
    assert child.line() == "ready"
    for dtype in _dtypes.DTYPES:
        for shape in SHAPES:
            expected = make(dtype, shape)
            got = client.get(name_of(dtype, shape))
            assert got.dtype == expected.dtype, (dtype, shape)
            assert got.shape == shape
            assert got.tobytes() == expected.tobytes(), (dtype, shape)
            assert not got.flags.writeable
    listed = {e.name: e for e in client.ls("rt/f32/")}
    entry = listed[name_of("f32", (2, 3, 4))]
    assert (entry.dtype, tuple(entry.shape), entry.size) == ("f32", (2, 3, 4), 96)
    child.send()
    child.finish()


BIG = 256 << 20


def test_256_mib_between_two_processes_while_another_thread_runs(client: tb.Client, spawn) -> None:
    child = spawn(
        f"""
c = tb.connect(TICKET, secret_file=SECRET_FILE)
big = np.random.default_rng(7).integers(0, 256, {BIG}, dtype=np.uint8)
c.put("big/x", big)
say(hashlib.sha256(big).hexdigest())
wait_for_parent()
c.close()
"""
    )
    digest = child.line()
    ticks = 0
    stop = threading.Event()
    started = threading.Event()

    def count() -> None:
        nonlocal ticks
        started.set()
        while not stop.is_set():
            ticks += 1

    thread = threading.Thread(target=count)
    thread.start()
    started.wait(timeout=30)
    try:
        before = ticks
        got = client.get("big/x")
        during = ticks - before
    finally:
        stop.set()
        thread.join(timeout=30)
    assert got.nbytes == BIG
    assert hashlib.sha256(got).hexdigest() == digest
    # The other thread ran while the get waited and copied (the GIL was released).
    assert during > 0
    child.send()
    child.finish()


def memfd_of(address: int) -> tuple[str, str]:
    """(device, inode) of the memfd mapped at ``address`` in this process (from
    /proc/self/maps); fails if no memfd is mapped there."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                assert len(fields) >= 6 and fields[5].startswith("/memfd:"), line
                return fields[3], fields[4]
    raise AssertionError(f"nothing mapped at {address:#x}")


def test_get_is_zero_copy(client: tb.Client, cluster: tb.LocalCluster) -> None:
    a = np.arange(5 << 18, dtype=np.float32)  # 5 MiB: above the 4 MiB inline limit
    v = client.put("zc/a", a)
    with cluster.connect() as other:
        got = other.get("zc/a")
        again = other.get("zc/a", v)
        base = got.base
        assert isinstance(base, tb.Buffer), type(base)
        # The array is the received buffer's view, and each get's view maps the bytes the
        # node holds (private copy-on-write: no payload byte copied, none written back).
        assert got.ctypes.data == base.address
        assert base.mapped and again.base.mapped
        # Both gets map one file, the node's memfd of that version: nothing was copied.
        assert memfd_of(got.ctypes.data) == memfd_of(again.ctypes.data)
        assert np.array_equal(got, a) and np.array_equal(again, a)
        with pytest.raises(ValueError):
            got[0] = 1.0
        t = tb._convert.to_torch(base)
        assert t.data_ptr() == got.ctypes.data


def test_out_receives_into_the_callers_array(client: tb.Client) -> None:
    a = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    v = client.put("out/a", a)
    out = np.zeros_like(a)
    assert client.get("out/a", out=out) is out
    assert np.array_equal(out, a)
    assert client.get("out/a", v, out=np.empty_like(a)).tobytes() == a.tobytes()
    with pytest.raises(ValueError, match="f64"):
        client.get("out/a", out=np.empty((64, 32), dtype=np.float64))
    with pytest.raises(ValueError, match=r"\[32, 64\]"):
        client.get("out/a", out=np.empty((32, 64), dtype=np.float32))
    ro = np.empty_like(a)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        client.get("out/a", out=ro)
    with pytest.raises(ValueError, match="ascontiguousarray"):
        client.get("out/a", out=np.empty((32, 64), dtype=np.float32).T)


def test_put_copies_so_later_changes_do_not_leak(client: tb.Client) -> None:
    a = np.ones(8, dtype=np.int64)
    v = client.put("copy/a", a)
    a[:] = 5
    assert client.get("copy/a", v).tolist() == [1] * 8


def test_put_refuses_what_it_cannot_send(client: tb.Client) -> None:
    m = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="ascontiguousarray"):
        client.put("bad/t", m.T)
    with pytest.raises(ValueError, match="ascontiguousarray"):
        client.put("bad/s", m[:, ::2])
    with pytest.raises(TypeError, match="objects"):
        client.put("bad/o", np.array([object(), 1], dtype=object))
    with pytest.raises(ValueError, match="big-endian"):
        client.put("bad/be", np.arange(4, dtype=">f4"))
    with pytest.raises(TypeError, match="not supported"):
        client.put("bad/c", np.zeros(2, dtype=np.complex64))
    with pytest.raises(TypeError, match="numpy array"):
        client.put("bad/l", [1, 2, 3])
    with pytest.raises(tb.InvalidArgument):
        client.put("bad name with spaces", m)


def test_any_dlpack_object_is_accepted(client: tb.Client) -> None:
    class Exporter:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __dlpack__(self, **kw):  # type: ignore[no-untyped-def]
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):  # type: ignore[no-untyped-def]
            return self.a.__dlpack_device__()

    a = np.arange(10, dtype=np.int32)
    v = client.put("dl/a", Exporter(a))
    assert client.get("dl/a", v).tolist() == list(range(10))


def test_keep_sets_how_many_versions_this_node_serves(client: tb.Client, cluster) -> None:
    for i in range(3):
        client.put("keep/two", np.full(2, i, dtype=np.int8))  # the default: the newest 2
        client.put("keep/one", np.full(2, i, dtype=np.int8), keep=1)
    with cluster.connect() as other:
        assert other.get("keep/two", 2).tolist() == [1, 1]
        assert other.get("keep/one", 3).tolist() == [2, 2]
        # Evicted at its only holder: NotFound once the broker heard, else no holder serves it.
        with pytest.raises((tb.NotFound, tb.Unavailable)):
            other.get("keep/one", 2)


def test_arrays_got_keep_their_bytes_while_evicted_versions_memory_is_reused(
    client: tb.Client,
) -> None:
    # Versions above 64 KiB live in memfds; an evicted one nobody views is rewritten by the next
    # put of its size. An array a user still holds must never see that.
    n = 1 << 18  # 1 MiB of float32
    first = np.arange(n, dtype=np.float32)
    v = client.put("reuse/w", first, keep=1)
    held = client.get("reuse/w", v)
    for i in range(1, 6):
        latest = np.full(n, float(i), dtype=np.float32)
        client.put("reuse/w", latest, keep=1)
        assert np.array_equal(client.get("reuse/w"), latest)
    assert np.array_equal(held, first)


def test_channels_picks_the_data_channels_a_client_runs(cluster: tb.LocalCluster, monkeypatch) -> None:
    # Two clients of this process are on one host: by default they move tensors over shm;
    # `channels="quic"` (as between hosts) or TB_CHANNELS=quic makes a node run QUIC alone.
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    for opts, env, want in (({}, None, "shm"), ({"channels": "quic"}, None, "quic"),
                            ({}, "quic", "quic"), ({"channels": "shm,quic"}, "quic", "shm")):
        if env is None:
            monkeypatch.delenv("TB_CHANNELS", raising=False)
        else:
            monkeypatch.setenv("TB_CHANNELS", env)
        with cluster.connect(**opts) as a, cluster.connect(**opts) as b:
            name = f"channels/{want}/{env}"
            a.put(name, x)
            np.testing.assert_array_equal(b.get(name), x)
            links = dict(b.status()["links"])
            assert links[a.id] == want, (opts, env, links)
    monkeypatch.delenv("TB_CHANNELS", raising=False)
    for bad in ("udp", "", "quic,quic"):
        with pytest.raises(ValueError, match="channels"):
            cluster.connect(channels=bad)
    monkeypatch.setenv("TB_CHANNELS", "carrier-pigeon")
    with pytest.raises(ValueError, match="carrier-pigeon"):
        cluster.connect()
