"""torch tensors in and out (CPU), through DLPack, without copies."""

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


def test_cuda_tensors(client: tb.Client) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: this machine has no GPU (or torch has no CUDA)")
    t = torch.arange(16, dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="cpu"):
        client.put("torch/cuda", t)
    client.put("torch/cuda", t.cpu())
    assert torch.equal(client.get_torch("torch/cuda").cuda(), t)
