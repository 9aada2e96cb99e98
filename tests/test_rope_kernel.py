"""The half-split RoPE Triton path (CUDA; here under the Triton interpreter on CPU) is bit-identical to the torch
ops in fp32 and bf16: values and the input gradient, for q-like and k-like head counts and strided input views;
the gate keeps interleaved rotation, mixed dtypes and tables that need a gradient on torch."""
from types import SimpleNamespace

import pytest
import torch

from moeloop.model import rope_kernel
from moeloop.model.rope import RopeTables, RotaryEmbedding, _rotate_half_split
from tests.kernels import DEVICE, counted_launches, needs_kernels

pytestmark = needs_kernels


@pytest.fixture
def launches(monkeypatch):
    """Forces the kernel path on CPU tensors and records each launch: False forward, True backward."""
    return counted_launches(monkeypatch, rope_kernel, lambda *a, **k: k["backward"])


def _tables(T: int, R: int, dtype: torch.dtype, g: torch.Generator) -> RopeTables:
    # independent halves and values past 1, so a swapped half or a lost rounding shows
    cos = (torch.randn(T, R, generator=g) * 2).to(DEVICE, dtype)
    sin = (torch.randn(T, R, generator=g) * 2).to(DEVICE, dtype)
    return RopeTables(cos, sin, interleaved=False)


def _view(T: int, H: int, R: int, layout: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """x [T, H, R] as a contiguous tensor or a strided view (row/head strides; a last-dim stride of 2)."""
    if layout == "contiguous":
        base = torch.randn(T, H, R, generator=g)
    elif layout == "padded_rows":  # like a slice of a wider projection
        base = torch.randn(T, H, R + 8, generator=g)[..., 3:R + 3]
    elif layout == "heads_major":
        base = torch.randn(H, T, R, generator=g).transpose(0, 1)
    else:  # "strided_last"
        base = torch.randn(T, H, R, 2, generator=g)[..., 1]
    return (base * 3).to(DEVICE, dtype)


def _rotate_and_grad(rotate, x: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    y = rotate(x)
    y.backward(up)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,R", [(7, 12, 16), (7, 4, 16), (7, 3, 16), (5, 3, 128), (6, 1, 12)])
def test_kernel_equals_torch_bitwise(launches, T, H, R, dtype):
    g = torch.Generator().manual_seed(T * H + R)
    tables = _tables(T, R, dtype, g)
    x, up = _view(T, H, R, "contiguous", dtype, g), _view(T, H, R, "contiguous", dtype, g)
    got = _rotate_and_grad(tables.rotate, x, up)
    assert launches == [False, True]
    want = _rotate_and_grad(lambda x: _rotate_half_split(x, tables.cos_TR, tables.sin_TR), x, up)
    for name, a, b in zip(["y", "grad_x"], got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("layout", ["padded_rows", "heads_major", "strided_last"])
def test_strided_views_bitwise(launches, layout):
    T, H, R, dtype = 7, 3, 16, torch.bfloat16
    g = torch.Generator().manual_seed(1)
    tables = _tables(T, R, dtype, g)
    x, up = _view(T, H, R, layout, dtype, g), _view(T, H, R, layout, dtype, g)  # a strided output gradient too
    got = _rotate_and_grad(tables.rotate, x, up)
    assert launches == [False, True]
    want = _rotate_and_grad(lambda x: _rotate_half_split(x, tables.cos_TR, tables.sin_TR), x, up)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_real_tables_bf16_bitwise(launches):
    """cos/sin as the model builds them (equal halves), a head dim of 128."""
    cfg = SimpleNamespace(rope_dim=128, rope_theta=1e6, rope_scaling={}, model_type="qwen3_moe", hf_config={})
    tables = RotaryEmbedding(cfg).tables(torch.tensor([0, 1, 2, 900, 3, 4000]).to(DEVICE), torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x, up = _view(6, 4, 128, "contiguous", torch.bfloat16, g), _view(6, 4, 128, "contiguous", torch.bfloat16, g)
    got = _rotate_and_grad(tables.rotate, x, up)
    assert launches == [False, True]
    want = _rotate_and_grad(lambda x: _rotate_half_split(x, tables.cos_TR, tables.sin_TR), x, up)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gate_keeps_torch_where_the_kernel_does_not_apply(launches):
    g = torch.Generator().manual_seed(3)
    tables = _tables(5, 16, torch.float32, g)
    x = _view(5, 2, 16, "contiguous", torch.float32, g)
    RopeTables(tables.cos_TR, tables.sin_TR, interleaved=True).rotate(x)
    RopeTables(tables.cos_TR, tables.sin_TR, interleaved=False).rotate(x.to(torch.bfloat16))  # mixed dtypes
    needs_grad = tables.cos_TR.clone().requires_grad_()
    RopeTables(needs_grad, tables.sin_TR, interleaved=False).rotate(x).sum().backward()
    assert needs_grad.grad is not None and launches == []
    RopeTables(tables.cos_TR, tables.sin_TR, interleaved=False).rotate(x)
    assert launches == [False]


def test_empty_batch(launches):
    tables = _tables(0, 16, torch.float32, torch.Generator().manual_seed(4))
    x = torch.zeros(0, 3, 16, device=DEVICE, requires_grad=True)
    tables.rotate(x).sum().backward()
    assert x.grad.shape == (0, 3, 16) and launches == [False, True]
