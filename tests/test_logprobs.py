"""Chunked token logprobs/entropy == naive full-logits log_softmax + gather, values and gradients."""
import pytest
import torch

from moeloop.model.logprobs import naive_token_logprobs, token_logprobs
from tests.kernels import DEVICE, needs_kernels

T, V, D = 37, 101, 16


def _inputs(dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, D, generator=g) * 2).to(device, dtype).requires_grad_()
    weight = torch.randn(V, D, generator=g).to(device, dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    return hidden, weight, labels


def _loss(logprobs, entropy, seed=1):
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(T, generator=g).to(logprobs.device) for _ in range(2))  # non-uniform upstream grads
    return (a * logprobs).sum() + (b * entropy).sum()


def _values_and_grads(fn, hidden, weight, labels, **kw):
    hidden.grad = weight.grad = None
    lp, ent = fn(hidden, weight, labels, **kw)
    _loss(lp, ent).backward()
    return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk_tokens", [1, 8, 10, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_values_and_grads(chunk_tokens, temperature):
    hidden, weight, labels = _inputs()
    ref = _values_and_grads(naive_token_logprobs, hidden, weight, labels, temperature=temperature)
    got = _values_and_grads(token_logprobs, hidden, weight, labels, temperature=temperature,
                            chunk_tokens=chunk_tokens)
    for name, r, x in zip(["logprobs", "entropy", "grad_hidden", "grad_weight"], ref, got):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_ignored_labels_give_zero_and_no_logprob_grad():
    hidden, weight, labels = _inputs()
    labels[::3] = -100
    ref = _values_and_grads(naive_token_logprobs, hidden, weight, labels)
    got = _values_and_grads(token_logprobs, hidden, weight, labels, chunk_tokens=7)
    assert torch.all(got[0][::3] == 0)
    for r, x in zip(ref, got):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5)


def test_without_entropy_and_logprob_only_grad():
    hidden, weight, labels = _inputs()
    lp, ent = token_logprobs(hidden, weight, labels, chunk_tokens=5, with_entropy=False)
    assert ent is None
    lp.sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_lp, _ = naive_token_logprobs(hidden, weight, labels)
    ref_lp.sum().backward()
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_grad():
    hidden, weight, labels = _inputs()
    weight.requires_grad_(False)
    lp, ent = token_logprobs(hidden, weight, labels, chunk_tokens=9)
    _loss(lp, ent).backward()
    assert weight.grad is None and hidden.grad is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the bf16 GEMMs with fp32 accumulation are the CUDA path"))])
def test_bf16_inputs_use_fp32_math(device):
    hidden, weight, labels = (t.detach().to(device) for t in _inputs(torch.bfloat16))
    hidden.requires_grad_(), weight.requires_grad_()
    got = _values_and_grads(token_logprobs, hidden, weight, labels, chunk_tokens=8)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    # reference: the same bf16 values upcast, all fp32
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    ref = _values_and_grads(naive_token_logprobs, h32, w32, labels)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # values: exact fp32 math
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2].float(), ref[2], rtol=1e-2, atol=1e-2)  # grads rounded to bf16
    torch.testing.assert_close(got[3].float(), ref[3], rtol=1e-2, atol=1e-2)


def test_gradcheck_double():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (6,), generator=g)

    def f(h, w):  # fp32 math inside, so compare against finite differences loosely
        lp, ent = token_logprobs(h, w, labels, chunk_tokens=4)
        return lp, ent
    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-2, atol=1e-2, rtol=1e-2)


def test_bad_shapes_raise():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="dim"):
        token_logprobs(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="labels"):
        token_logprobs(hidden, weight, labels[:-1])


@needs_kernels
@pytest.mark.parametrize("temperature,with_entropy,ignore", [(1.0, True, False), (0.7, True, True), (1.0, False, True)])
def test_chunk_kernels_equal_naive(monkeypatch, temperature, with_entropy, ignore):
    """The Triton chunk kernels (CUDA; here under the Triton interpreter) give the naive values and gradients."""
    import moeloop.model.logprobs as lp_mod
    monkeypatch.setattr(lp_mod, "kernels_apply", lambda h: True)
    device = DEVICE  # the kernels need CUDA tensors outside the interpreter
    hidden, weight, labels = _inputs(device=device)
    if ignore:
        labels[::4] = -100
    ref_lp, ref_ent = naive_token_logprobs(hidden, weight, labels, temperature)
    lp, ent = token_logprobs(hidden, weight, labels, temperature, chunk_tokens=10, with_entropy=with_entropy)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5, msg=lambda m: f"logprobs: {m}")
    ramp = torch.linspace(-1, 1, T, device=device)
    loss = _loss(lp, ent) if with_entropy else (lp * ramp).sum()
    ref_loss = _loss(ref_lp, ref_ent) if with_entropy else (ref_lp * ramp).sum()
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(ref_loss, (hidden, weight))
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5, msg=lambda m: f"entropy: {m}")
    # gradients: sums over tokens, chunk by chunk here and in one GEMM there; on the H200 the two fp32 reduction
    # orders differ by up to 2.2e-5 on 2 of 1616 weight-gradient entries (temperature 0.7 scales them by 1/0.7)
    for name, g_, w_ in zip(["grad_hidden", "grad_weight"], got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=5e-5, msg=lambda m: f"{name}: {m}")
