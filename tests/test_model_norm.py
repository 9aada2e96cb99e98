"""RMSNorm's Triton path (CUDA; here under the Triton interpreter on CPU) equals the module math in torch ops:
values and the gradients of input and weight, for a hidden-size norm and a per-head (q/k) norm."""
import pytest
import torch

from moeloop.model.norm import RMSNorm, rmsnorm_kernel, rmsnorm_reference
from tests.kernels import DEVICE, needs_kernels

pytestmark = needs_kernels


@pytest.mark.parametrize("shape", [(37, 48), (5, 3, 16), (0, 24), (7, 6, 128)])  # 128: 16-row tiles, a partial one
def test_kernel_equals_module_math_fp32(shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE).requires_grad_()
    up = torch.randn(*shape, generator=g).to(DEVICE)
    results = []
    for fn in (rmsnorm_reference, rmsnorm_kernel):
        x.grad = w.grad = None
        y = fn(x, w, 1e-6)
        y.backward(up)
        results.append((y.detach(), x.grad.clone(), w.grad.clone()))
    for name, a, b in zip(["y", "grad_x", "grad_w"], *results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(DEVICE == "cpu", reason="bf16 rounding: the interpreter does not round to nearest like the GPU")
def test_module_uses_the_kernel_on_cuda_bf16():
    norm = RMSNorm(64).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(300, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(300, 64, device=DEVICE, dtype=torch.bfloat16)
    y = norm(x)
    y.backward(up)
    got = (y.detach(), x.grad.clone(), norm.weight.grad.clone())
    x.grad = norm.weight.grad = None
    ref_y = rmsnorm_reference(x, norm.weight, norm.eps)
    ref_y.backward(up)
    torch.testing.assert_close(got[0], ref_y.detach(), rtol=2e-2, atol=2e-2)  # a bf16 rounding or two
    torch.testing.assert_close(got[1], x.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[2].float(), norm.weight.grad.float(), rtol=2e-2, atol=0.5)  # sum over 300 rows
