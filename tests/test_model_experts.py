"""Routed experts: grouped_mm path == per-expert loop == a per-token reference (values and grads, fp32 CPU),
router statistics, and activation checkpointing leaving loss, grads and stats unchanged."""
import pytest
import torch
import torch.nn.functional as F

from moeloop.model.experts import Experts, grouped_mm_available
from tests.kernels import DEVICE, needs_kernels
from tests.model_pairs import hf_model, max_rel_err, our_model, token_batch

needs_grouped_mm = pytest.mark.skipif(not grouped_mm_available(), reason="this torch has no grouped_mm")
T, D, FF, E, K = 13, 16, 8, 6, 2  # E > T*K/3 so some experts get no token


def _experts_and_inputs(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    experts = Experts(E, D, FF).to(device)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * FF, D, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(E, D, FF, generator=g) * 0.3)
    x = torch.randn(T, D, generator=g).to(device).requires_grad_()
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(T)]).to(device)  # experts E-2, E-1 unused
    weights = torch.rand(T, K, generator=g).to(device).requires_grad_()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    return experts, x, ids, weights, counts


def _per_token_reference(experts, x, ids, weights):
    out = []
    for t in range(T):
        acc = 0
        for k in range(K):
            e = ids[t, k]
            gate, up = F.linear(x[t], experts.gate_up_proj[e]).chunk(2)
            acc = acc + weights[t, k] * F.linear(F.silu(gate) * up, experts.down_proj[e])
        out.append(acc)
    return torch.stack(out)


def _run(impl, seed=0, device="cpu"):
    experts, x, ids, weights, counts = _experts_and_inputs(seed, device)
    if impl == "reference":
        y = _per_token_reference(experts, x, ids, weights)
    else:
        experts.impl = impl
        y = experts(x, ids, weights, counts)
    (y * torch.linspace(-1, 1, D, device=y.device)).square().sum().backward()  # a real loss: no stride-0 grads
    return [y.detach(), x.grad, weights.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


@pytest.mark.parametrize("impl", ["loop", pytest.param("grouped_mm", marks=needs_grouped_mm)])
def test_experts_match_per_token_reference(impl):
    ref = _run("reference")
    got = _run(impl)
    assert got[4][-2:].abs().max() == 0  # unused experts get no gradient
    for a, b in zip(got, ref):
        assert max_rel_err(a, b) < 1e-5


@needs_kernels
def test_row_kernels_match_torch_indexing(monkeypatch):
    """The CUDA gather/combine kernels (`expert_rows`; here under the Triton interpreter, or on the GPU) give the
    torch-indexing path's values and gradients."""
    import moeloop.model.experts as experts_mod
    ref = _run("loop", device=DEVICE)  # the kernels need CUDA tensors outside the interpreter
    monkeypatch.setattr(experts_mod, "row_kernels_apply", lambda x: True)
    got = _run("loop", device=DEVICE)
    for name, a, b in zip(["y", "grad_x", "grad_weights", "grad_gate_up", "grad_down"], got, ref):
        assert max_rel_err(a, b) < 1e-6, name


@needs_grouped_mm
def test_model_grouped_mm_equals_loop_values_and_grads():
    hf = hf_model("deepseek_v3")
    outs = []
    for impl in ("loop", "grouped_mm"):
        model = our_model(hf, experts_impl=impl)
        ids = token_batch(model.cfg.vocab_size).reshape(-1)
        logits = model.compute_logits(model.forward_packed(ids, [12, 12]))
        F.cross_entropy(logits[:-1], ids[1:]).backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert max_rel_err(outs[1][0], outs[0][0]) < 1e-5
    for name, g in outs[0][1].items():
        assert max_rel_err(outs[1][1][name], g) < 1e-4, name


def test_auto_impl_on_cpu_follows_the_kernel_probe_and_bad_impl_raises():
    from moeloop.model.experts import cpu_grouped_mm_works
    experts, x, ids, weights, _ = _experts_and_inputs()
    assert experts.resolved_impl(x) == ("grouped_mm" if cpu_grouped_mm_works() else "loop")
    assert experts.resolved_impl(x.double()) == "loop"  # CPU grouped_mm has no fp64 kernel: auto must not pick it
    experts.double()(x.double(), ids, weights)
    with pytest.raises(ValueError, match="experts_impl"):
        experts.impl = "cutlass"


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_router_stats_counts_sum_to_tokens_times_k(arch):
    model = our_model(hf_model(arch))
    with pytest.raises(RuntimeError, match="forward first"):
        model.router_stats()
    ids = token_batch(model.cfg.vocab_size).reshape(-1)
    model.forward_packed(ids, [12, 12])
    stats = model.router_stats()
    assert len(stats) == len(model.cfg.moe_layers)
    for s in stats:
        assert s.load_counts_E.shape == (model.cfg.num_experts,)
        assert s.load_counts_E.sum().item() == 24 * model.cfg.num_experts_per_tok
        assert (s.load_counts_E > 0).sum() > model.cfg.num_experts_per_tok  # tokens spread over experts
        assert torch.allclose(s.prob_sum_E.sum(), torch.tensor(24.0))
    assert model.load_balance_loss().requires_grad


def test_gradient_checkpointing_keeps_loss_grads_and_stats():
    hf = hf_model("qwen3_moe")
    results = []
    for ckpt in (False, True):
        model = our_model(hf, gradient_checkpointing=ckpt)
        ids = token_batch(model.cfg.vocab_size).reshape(-1)
        logits = model.compute_logits(model.forward_packed(ids, [12, 12]))
        stats = model.router_stats()
        loss = F.cross_entropy(logits[:-1], ids[1:]) + 0.1 * model.load_balance_loss()
        loss.backward()
        assert all(a is b for a, b in zip(stats, model.router_stats()))  # recompute did not replace them
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name, g in results[0][1].items():
        assert max_rel_err(results[1][1][name], g) < 1e-6, name
    assert results[0][1]["model.layers.0.mlp.gate.weight"].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_grouped_mm_matches_loop_and_hf():
    """bf16 on GPU: auto picks grouped_mm; logits within 3e-2 (max rel) of the loop path and of transformers."""
    hf = hf_model("qwen3_moe").to("cuda", torch.bfloat16)
    ids = token_batch(hf.config.vocab_size).cuda()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()
    logits = {}
    for impl in ("auto", "loop"):
        model = our_model(hf, experts_impl=impl).to("cuda", torch.bfloat16)
        assert impl == "loop" or model.moe_blocks()[0].experts.resolved_impl(torch.zeros(1, 32, device="cuda",
                                                                                dtype=torch.bfloat16)) == "grouped_mm"
        out = model.compute_logits(model.forward_packed(ids.reshape(-1), [12, 12]))
        F.cross_entropy(out[:-1].float(), ids.reshape(-1)[1:]).backward()
        logits[impl] = out.detach().float().view_as(ref)
    assert max_rel_err(logits["auto"], logits["loop"]) < 3e-2
    assert max_rel_err(logits["auto"], ref) < 3e-2


def test_cpu_grouped_mm_probe_is_not_fooled_by_no_grad():
    from moeloop.model.experts import cpu_grouped_mm_works
    if not grouped_mm_available():
        pytest.skip("this torch has no grouped_mm")
    cpu_grouped_mm_works.cache_clear()
    with torch.inference_mode():
        first = cpu_grouped_mm_works()
    assert first == cpu_grouped_mm_works() and first  # torch 2.13 CPU has the kernel
