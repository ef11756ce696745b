"""torch tensors in and out (CPU, and CUDA where there is a device), through DLPack,
without copies."""

from __future__ import annotations

import numpy as np
import pytest

import tensor_broker as tb

torch = pytest.importorskip("torch", reason="torch is not installed")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_round_trip(client: tb.Client, cluster: tb.LocalCluster, dtype) -> None:
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(5, 7, generator=g) * 10).to(dtype)
    name = f"torch/{str(dtype).split('.')[-1]}"
    v = client.put(name, t)
    with cluster.connect() as other:
        got = other.get_torch(name, v)
        assert got.dtype == dtype and tuple(got.shape) == (5, 7)
        assert torch.equal(got, t)
        entry = {e.name: e for e in other.ls("torch/")}[name]
        assert tuple(entry.shape) == (5, 7)


def test_bfloat16_meets_ml_dtypes(client: tb.Client) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    client.put("torch/bf", t)
    a = client.get("torch/bf")
    assert a.dtype == np.dtype(ml_dtypes.bfloat16)
    assert a.astype(np.float32).tolist() == [1.5, -2.0, 3.25]


def test_scalar_and_empty(client: tb.Client) -> None:
    client.put("torch/scalar", torch.tensor(4.5))
    client.put("torch/empty", torch.zeros(0, 3))
    assert client.get_torch("torch/scalar").item() == 4.5
    assert tuple(client.get_torch("torch/empty").shape) == (0, 3)


def test_get_torch_shares_the_received_memory(client: tb.Client) -> None:
    client.put("torch/zc", torch.arange(1000, dtype=torch.float32))
    buf = client.get_buffer("torch/zc")
    t = tb._convert.to_torch(buf)
    assert t.data_ptr() == buf.address


def test_torch_inputs_that_need_fixing(client: tb.Client) -> None:
    m = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        client.put("torch/t", m.t())
    client.put("torch/grad", torch.ones(3, requires_grad=True))
    assert client.get("torch/grad").tolist() == [1.0, 1.0, 1.0]
    out = torch.empty(3)
    client.get("torch/grad", out=out)
    assert out.tolist() == [1.0, 1.0, 1.0]


CUDA_HERE = torch.cuda.is_available()
NO_CUDA = (
    "no CUDA device on this machine (torch.cuda.is_available() is False): the device-to-device "
    "path is not exercised here"
)


def test_get_torch_names_its_device(client: tb.Client) -> None:
    client.put("torch/dev", torch.arange(6, dtype=torch.int32))
    assert client.get_torch("torch/dev", device="cpu").device.type == "cpu"
    for bad in ["tpu:0", "cuda:x", -1]:
        with pytest.raises(ValueError, match="device"):
            client.get_torch("torch/dev", device=bad)


@pytest.mark.skipif(CUDA_HERE, reason="this machine has a CUDA device")
def test_a_cuda_get_without_a_device_is_unavailable(client: tb.Client) -> None:
    client.put("torch/nodev", torch.arange(6, dtype=torch.int32))
    with pytest.raises(tb.Unavailable):
        client.get_torch("torch/nodev", device="cuda:0")


@pytest.mark.skipif(not CUDA_HERE, reason=NO_CUDA)
def test_cuda_tensors_round_trip_device_to_device(
    client: tb.Client, cluster: tb.LocalCluster
) -> None:
    if not tb._native.CUDA_COMPILED:
        pytest.skip("the extension was built without tb-node's cuda feature")
    g = torch.Generator(device="cuda").manual_seed(5)
    t = torch.randn(1024, 257, generator=g, device="cuda").to(torch.bfloat16)
    v = client.put("torch/cuda", t)
    # The publisher keeps it on the device: its own get is the same device memory's bytes.
    mine = client.get_torch("torch/cuda", v, device="cuda")
    assert mine.device.type == "cuda" and torch.equal(mine, t)
    with cluster.connect() as other:
        got = other.get_torch("torch/cuda", v, device=t.device)
        assert got.device == t.device and got.dtype == torch.bfloat16
        assert torch.equal(got, t)
        # And as host bytes for a reader without a GPU in mind.
        assert torch.equal(other.get_torch("torch/cuda", v), t.cpu())


@pytest.mark.skipif(not CUDA_HERE, reason=NO_CUDA)
def test_a_call_with_cuda_tensors_hands_the_handler_and_the_caller_cuda_tensors(
    cluster: tb.LocalCluster,
) -> None:
    if not tb._native.CUDA_COMPILED:
        pytest.skip("the extension was built without tb-node's cuda feature")
    # One process: CUDA IPC cannot map memory into the process that owns it, so the lent
    # tensors come over the network (through staging), and arrive on the device all the same.
    with cluster.connect() as server, cluster.connect() as caller:

        @server.share("torch/cuda-scale")
        def scale(x: torch.Tensor, k: float) -> torch.Tensor:
            assert x.is_cuda, f"a CUDA argument arrived on {x.device}"
            x.mul_(k)  # the argument is the handler's own
            return x

        with server.serving():
            f = caller.function("torch/cuda-scale")
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):  # written on a side stream: the call waits for it
                x = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2
            want = torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 6
            got = f(x, 3.0, timeout=60)
            assert got.is_cuda and torch.equal(got, want)
            assert torch.equal(x, want / 3), "the handler's in-place op reached the caller"
            got += 1  # the result is the caller's own
            assert torch.equal(f(x, 1.0, timeout=60), x)
            # device="cpu" and out= take it to host memory.
            assert torch.equal(f(x, 2.0, device="cpu", timeout=60), (x * 2).cpu())
            out = np.empty(1 << 20, np.float32)
            f(x, 1.0, out=out, timeout=60)
            assert np.array_equal(out, x.cpu().numpy())


CUDA_SERVER = """
import torch
client = tb.connect(TICKET, secret_file=SECRET_FILE)

@client.share("torch/cuda-ipc")
def scale(x, k):
    assert x.is_cuda, f"a CUDA argument arrived on {x.device}"
    return {"y": x * k, "ipc_pulls": client._node.cuda_ipc_pulls}

say("serving")
client.serve()
"""


@pytest.mark.skipif(not CUDA_HERE, reason=NO_CUDA)
def test_cuda_tensors_in_a_call_between_processes_move_by_cuda_ipc(
    cluster: tb.LocalCluster, spawn
) -> None:
    if not tb._native.CUDA_COMPILED:
        pytest.skip("the extension was built without tb-node's cuda feature")
    server = spawn(CUDA_SERVER)
    assert server.line() == "serving"
    with cluster.connect() as caller:
        f = caller.function("torch/cuda-ipc")
        g = torch.Generator(device="cuda").manual_seed(9)
        server_pulls = 0
        # 8 MiB and 6 MiB by CUDA IPC; 8 KiB is below its 1 MiB minimum: through staging.
        for n, k, by_ipc in [(1 << 22, 2.0, True), (3 << 20, -1.0, True), (4096, 0.5, False)]:
            x = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
            before = caller._node.cuda_ipc_pulls
            got = f(x, k, timeout=60)
            y = got["y"]
            assert y.is_cuda and y.dtype == torch.bfloat16 and torch.equal(y, x * k)
            # The argument came to the server by CUDA IPC, and the result back the same way.
            assert (got["ipc_pulls"] > server_pulls) == by_ipc
            assert (caller._node.cuda_ipc_pulls > before) == by_ipc
            server_pulls = got["ipc_pulls"]