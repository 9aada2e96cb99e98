"""The experts' SiLU(gate) * up Triton path (CUDA; here under the Triton interpreter on CPU) against the torch ops:
values and the gradient of h, for the strided [S, 2F] views grouped_mm gives and through `Experts`, with grad and
under inference_mode; the gate keeps torch where the kernel does not apply."""

import pytest
import torch
import torch.nn.functional as F

from moeloop.model import swiglu_kernel
from moeloop.model.experts import Experts, expert_counts, grouped_mm_available
from tests.kernels import DEVICE, counted_launches, needs_kernels

pytestmark = needs_kernels


@pytest.fixture
def launches(monkeypatch):
    """Forces the kernel path on CPU tensors and records each launch: False forward, True backward."""
    return counted_launches(monkeypatch, swiglu_kernel, lambda h, dy: dy is not None)


def _h(S: int, F: int, layout: str, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """h [S, 2F]: contiguous as grouped_mm returns it (the kernel reads its halves at row stride 2F), or a slice of
    wider rows. Gates spread over [-12, 12] so silu's negative tail and its near-identity range both show."""
    width = 2 * F if layout == "contiguous" else 2 * F + 8
    base = torch.randn(S, width, generator=g) * 4
    return base[:, :2 * F].to(DEVICE, dtype) if layout == "contiguous" else base[:, 5:2 * F + 5].to(DEVICE, dtype)


def _torch_silu_mul(h_S2F: torch.Tensor) -> torch.Tensor:
    gate_SF, up_SF = h_S2F.chunk(2, dim=-1)
    return F.silu(gate_SF) * up_SF


def _value_and_grad(fn, h: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = h.detach().requires_grad_()
    y = fn(h)
    y.backward(dy)
    return y.detach(), h.grad


def _assert_match(got, want, dtype: torch.dtype) -> None:
    for name, a, b in zip(["y", "grad_h"], got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        # bf16: every rounding point as torch, the same bits. Not a law on CPU: numpy's exp (the interpreter's) and
        # torch's CPU exp differ in the last fp32 bit for some inputs, which flips a bf16 tie in ~1 of 10^5
        # elements (3 gate grads of 262k at S=512, F=512); none at these seeds and sizes
        if dtype == torch.bfloat16:
            assert torch.equal(a, b), f"{name}: {(a != b).sum()} differ, max {(a.float() - b.float()).abs().max()}"
        else:  # fp32: exp from numpy here vs torch's own, and FMA contraction may differ; a few ulps
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,F,layout", [(7, 16, "contiguous"), (7, 16, "padded_rows"), (5, 24, "contiguous"),
                                        (3, 512, "contiguous")])
def test_kernel_equals_torch(launches, S, F, layout, dtype):
    g = torch.Generator().manual_seed(S * F)
    h = _h(S, F, layout, dtype, g)
    dy = (torch.randn(S, F, generator=g) * 3).to(DEVICE, dtype)
    got = _value_and_grad(swiglu_kernel.swiglu_kernel, h, dy)
    assert launches == [False, True]
    _assert_match(got, _value_and_grad(_torch_silu_mul, h, dy), dtype)


def test_strided_output_gradient(launches):
    g = torch.Generator().manual_seed(1)
    h = _h(6, 16, "contiguous", torch.bfloat16, g)
    dy = (torch.randn(16, 6, generator=g) * 3).to(DEVICE, torch.bfloat16).t()  # last-dim stride 6: copied
    got = _value_and_grad(swiglu_kernel.swiglu_kernel, h, dy)
    assert launches == [False, True]
    _assert_match(got, _value_and_grad(_torch_silu_mul, h, dy), torch.bfloat16)


def test_inference_mode_and_no_grad(launches):
    g = torch.Generator().manual_seed(2)
    h = _h(7, 16, "contiguous", torch.bfloat16, g)
    want = _torch_silu_mul(h)
    with torch.inference_mode():
        h_inf = h.clone()
        assert torch.equal(swiglu_kernel.swiglu_kernel(h_inf), want)
    with torch.no_grad():
        assert torch.equal(swiglu_kernel.swiglu_kernel(h.requires_grad_()), want)
    assert launches == [False, False]


def _experts(impl: str, dtype: torch.dtype, g: torch.Generator) -> Experts:
    experts = Experts(num_experts=4, dim=16, ffn_dim=16, impl=impl)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(4, 32, 16, generator=g))
        experts.down_proj.copy_(torch.randn(4, 16, 16, generator=g) * 0.3)
    return experts.to(DEVICE, dtype)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_experts_with_kernel_equal_torch_path(monkeypatch, launches, impl):
    """Output, input and weight gradients of a bf16 `Experts` with the kernel == the same module on torch ops."""
    if impl == "grouped_mm" and not grouped_mm_available():
        pytest.skip("no grouped_mm in this torch")
    g = torch.Generator().manual_seed(3)
    experts = _experts(impl, torch.bfloat16, g)
    x = torch.randn(5, 16, generator=g).to(DEVICE, torch.bfloat16)
    ids = torch.tensor([[0, 2], [2, 3], [0, 2], [1, 0], [2, 3]], device=DEVICE)
    wts = torch.rand(5, 2, generator=g).to(DEVICE)

    def run():
        experts.zero_grad()
        xg = x.detach().requires_grad_()
        y = experts(xg, ids, wts)
        y.backward(torch.ones_like(y))
        return [y.detach(), xg.grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    got = run()
    num_experts_used = len(ids.unique()) if impl == "loop" else 1
    assert launches == [False] * num_experts_used + [True] * num_experts_used
    monkeypatch.setattr(swiglu_kernel, "kernels_apply", lambda x: False)
    for a, b in zip(got, run()):
        assert torch.equal(a, b)
    with torch.inference_mode():
        monkeypatch.setattr(swiglu_kernel, "kernels_apply", lambda x: True)
        counts = expert_counts(ids, 4)
        assert torch.equal(experts.sorted_forward(x, ids, wts, counts), got[0])


def test_gate_keeps_torch_where_the_kernel_does_not_apply(launches):
    h = _h(4, 8, "contiguous", torch.float32, torch.Generator().manual_seed(4))
    for other in (h.double(), h[:, :15], h.t().contiguous().t(), h.view(2, 2, 16)):  # dtype, odd width, strides, 3-D
        assert not swiglu_kernel.swiglu_kernel_applies(other)
    assert swiglu_kernel.swiglu_kernel_applies(h)
    assert launches == []


def test_empty_rows(launches):
    h = torch.zeros(0, 32, device=DEVICE, requires_grad=True)
    swiglu_kernel.swiglu_kernel(h).sum().backward()
    assert h.grad.shape == (0, 32) and launches == [False, True]
