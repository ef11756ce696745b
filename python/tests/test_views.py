"""What a user does to an array or tensor they got cannot change what any node holds or
serves, nor crash the process: received buffers are private copy-on-write views of the
node's memfd (a copy for small tensors). Each scenario runs in a child process, so a crash
(SIGSEGV on a read-only mapping) is a failing exit code, not a dead test run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

# Three clients of one cluster in one process, as users run them; every check is on bytes.
PRELUDE = """
import warnings
import torch
JOIN = dict(join=TICKET, secret_file=SECRET_FILE)
a, b, c = tb.connect(**JOIN), tb.connect(**JOIN), tb.connect(**JOIN)
"""


def run(spawn, code: str) -> None:
    child = spawn(PRELUDE + code)
    assert child.line() == "ok"
    child.finish()


# 5 MiB (a mapping of the holder's memfd: above the 4 MiB inline limit), 1 MiB (inline into a
# memfd of the reader's, then a mapping) and 4 KB (a copy)
@pytest.mark.parametrize("n", [5 << 18, 1 << 18, 1000])
def test_in_place_ops_on_a_same_host_get_change_nothing_served(spawn, n: int) -> None:
    run(
        spawn,
        f"""
x = np.arange({n}, dtype=np.float32)
v = a.put("views/x", x)
t = b.get_torch("views/x")
t.add_(1)                      # a read-only mapping here used to kill the process
assert torch.equal(t, torch.from_numpy(x) + 1)
for reader in (a, b, c):
    assert np.array_equal(reader.get("views/x"), x), "a get after the write"
own = a.get_torch("views/x")   # the publisher's own put
own.mul_(0)
assert np.array_equal(c.get("views/x"), x) and np.array_equal(b.get("views/x"), x)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns that the array is not writable
    through_numpy = torch.from_numpy(b.get("views/x"))
through_numpy.sub_(5)
assert np.array_equal(c.get("views/x"), x)
target = b.get_torch("views/x")
b.get("views/x", out=target)   # a get into a tensor that is itself a received view
assert np.array_equal(target.numpy(), x)
assert np.array_equal(c.get("views/x"), x)
say("ok")
""",
    )


def test_an_optimizer_step_on_a_received_state_dict_changes_nothing_served(spawn) -> None:
    run(
        spawn,
        """
w0 = np.linspace(-1, 1, 5 << 18, dtype=np.float32)  # 5 MiB: the holder's memfd, mapped
a.put_many("views/m", {"w": w0, "b": np.ones(7, np.float32)})
sd = b.get_many_torch("views/m")
w = torch.nn.Parameter(sd["w"])
opt = torch.optim.SGD([w], lr=0.5)
w.grad = torch.ones_like(w)
opt.step()
assert torch.allclose(w.detach(), torch.from_numpy(w0) - 0.5)
for reader in (a, b, c):
    assert np.array_equal(reader.get_many("views/m")["w"], w0)
say("ok")
""",
    )


def test_get_many_members_map_the_sets_memfd(client, cluster) -> None:
    import numpy as np

    from test_roundtrip import memfd_of

    # 10 MiB in all: above the 4 MiB inline limit, the set travels as the holder's memfd;
    # each member is above 4 MiB, so its view is a mapping (smaller ones are copies).
    sd = {"w": np.arange(5 << 18, dtype=np.float32), "b": np.ones(5 << 18, np.float32)}
    client.put_many("views/sd", sd)
    with cluster.connect() as other:
        first, second = other.get_many("views/sd"), other.get_many("views/sd")
        files = {memfd_of(a.ctypes.data) for got in (first, second) for a in got.values()}
        assert len(files) == 1, "every member of both gets maps the one memfd of the set"
        for got in (first, second):
            assert all(np.array_equal(got[k], sd[k]) for k in sd)


def test_a_large_get_is_a_mapping_shared_by_its_arrays(client, cluster) -> None:
    import numpy as np
    import tensor_broker as tb

    x = np.arange(5 << 18, dtype=np.float32)  # 5 MiB: above the 4 MiB inline limit
    client.put("views/zc", x)
    with cluster.connect() as other:
        buf = other.get_buffer("views/zc")
        assert buf.mapped, "no payload byte copied for a large get"
        arr = tb._convert.to_numpy(buf)
        t = tb._convert.to_torch(buf)
        assert arr.ctypes.data == buf.address == t.data_ptr()
        t.add_(2)  # the arrays of one get share its private view
        assert np.array_equal(arr, x + 2)
        assert np.array_equal(other.get("views/zc"), x), "another get sees the original"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_in_place_ops_on_cuda_gets_change_nothing_served(spawn) -> None:
    run(
        spawn,
        """
if not tb._native.CUDA_COMPILED:
    say("ok")  # a build without CUDA has no device path to check
    raise SystemExit(0)
t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
a.put("views/cuda", t)          # the publisher keeps it in device memory
mine = a.get_torch("views/cuda", device="cuda")
mine.add_(1)                    # the holder's own get: used to write the served buffer
got = b.get_torch("views/cuda", device="cuda")
assert torch.equal(got, t), "a reader gets the published bytes"
got.mul_(0)
for reader in (a, b, c):
    assert torch.equal(reader.get_torch("views/cuda", device="cuda"), t)
    assert torch.equal(reader.get_torch("views/cuda"), t.cpu())
s = torch.cuda.Stream()
with torch.cuda.stream(s):      # produced on a side stream: put waits for the device
    u = torch.full((1 << 24,), 3.0, device="cuda") * 2
a.put("views/stream", u)
assert torch.equal(c.get_torch("views/stream"), torch.full((1 << 24,), 6.0))
say("ok")
""",
    )


def test_more_tensors_than_a_1024_fd_limit_arrive_over_shm(client, spawn) -> None:
    import numpy as np

    # Every tensor above 64 KiB is a memfd on both sides (held by the node, and received into
    # one by each same-host reader, inline up to 4 MiB): more of them than Python's common soft
    # limit of 1024 open files.
    import resource

    n, elems = 1100, 20_000
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * n + 256:
        pytest.skip(f"the hard open-file limit here is {hard}: too low to hold {n} tensors")
    for i in range(n):
        client.put(f"fds/{i}", np.full(elems, i, dtype=np.float32))
    child = spawn(
        f"""
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
with tb.connect(join=TICKET, secret_file=SECRET_FILE) as c:
    held = [c.get(f"fds/{{i}}") for i in range({n})]
    assert all(a.shape == ({elems},) and a[0] == i and a[-1] == i for i, a in enumerate(held))
    say("ok", len(held))
"""
    )
    assert child.line() == f"ok {n}"
    child.finish()
