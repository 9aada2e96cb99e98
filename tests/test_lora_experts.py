"""LoRA on the routed experts (`actor.lora_target_modules=[all-linear, experts]`), in both expert implementations:
the forward is the merged model's, the adapters' gradients are a per-token loop's of plain LoRA math, adapters off is
the base model bit for bit, the peft export splits each expert's adapters as the hub splits its weights, FSDP ranks
shard the adapters with their experts and equal one process, a bf16 model keeps fp32 adapters, and the adapters are
drawn from the run's seed. (The RL loop with expert adapters: tests/test_lora.py.)"""
import json

import pytest
import torch
import torch.nn.functional as F

from moeloop.model.experts import Experts, cpu_grouped_mm_works
from moeloop.model.hf_names import hub_named_tensors
from moeloop.train.actor import Actor
from moeloop.train.lora import (LoRAExperts, LoRALinear, adapters_off, apply_lora, lora_modules, merge_and_unload,
                                merged_weights, save_adapter)
from tests.dist import run_ranks
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model, use_sgd

IMPLS = ["grouped_mm", "loop"]
BOTH = ["all-linear", "experts"]


def _lora_model(impl: str = "loop", dtype: torch.dtype = torch.float32, rank: int = 4, seed: int = 0,
                targets: list[str] = BOTH, random_b: bool = True) -> torch.nn.Module:
    """The tiny Qwen3-MoE (4 experts, D 32, F 16) with adapters; B drawn at random (else zero: the start)."""
    model = tiny_model().to(dtype)
    model.set_experts_impl(impl)
    apply_lora(model, actor_cfg(lora_rank=rank, lora_alpha=8.0, lora_target_modules=targets), seed)
    if random_b:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _hidden(model, ids=torch.tensor([5, 6, 7, 8, 9, 3, 11, 12, 13, 14])):
    return model.forward_packed(ids, [6, 4])


def _plain(impl: str, weights: dict, dtype: torch.dtype = torch.float32):
    model = tiny_model().to(dtype)
    model.set_experts_impl(impl)
    model.load_state_dict(weights)
    return model


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_adapters_forward_is_the_merged_model_and_off_is_the_base(impl):
    """A start (B = 0) is the base model bit for bit; with a non-zero B the forward equals the plain model holding
    merged_weights (W_e + scale B_e A_e per expert; fp32, tolerance 1e-5: x W'^T against x W^T + s (x A^T) B^T);
    adapters_off is the base model bit for bit; merge_and_unload leaves that plain model's modules and weights."""
    base = _hidden(_plain(impl, tiny_model().state_dict()))
    assert torch.equal(_hidden(_lora_model(impl, random_b=False)), base)
    model = _lora_model(impl)
    assert {type(m) for m in lora_modules(model).values()} == {LoRALinear, LoRAExperts}
    merged = {name: t.clone() for name, t in merged_weights(model)}
    assert set(merged) == set(tiny_model().state_dict())
    got = _hidden(model)
    torch.testing.assert_close(got, _hidden(_plain(impl, merged)), rtol=0, atol=1e-5)
    assert (got - base).abs().max() > 1e-2  # the expert adapters took part
    with adapters_off(model):
        assert torch.equal(_hidden(model), base)
    merge_and_unload(model)
    assert not lora_modules(model) and type(model.model.layers[0].mlp.experts) is Experts
    assert model.state_dict().keys() == merged.keys()
    assert all(torch.equal(t, merged[n]) for n, t in model.state_dict().items())


def _per_token_reference(x_TD, ids_TK, weights_TK, experts, scale):
    """Float64, one token and one expert at a time, plain LoRA on each projection:
    W x + scale B (A x) with expert e's own W, A, B; SiLU(gate) * up between."""
    p = {n: t.detach().double().requires_grad_(n.endswith(("_A", "_B"))) for n, t in experts.named_parameters()}
    F_ = experts.ffn_dim
    rows = []
    for t in range(x_TD.shape[0]):
        y_D = torch.zeros(experts.dim, dtype=torch.float64)
        for k in range(ids_TK.shape[1]):
            e, x_D = int(ids_TK[t, k]), x_TD[t].double()
            h = p["gate_up_proj"][e] @ x_D + scale * p["gate_up_lora_B"][e] @ (p["gate_up_lora_A"][e] @ x_D)
            m = F.silu(h[:F_]) * h[F_:]
            y = p["down_proj"][e] @ m + scale * p["down_lora_B"][e] @ (p["down_lora_A"][e] @ m)
            y_D = y_D + weights_TK[t, k].double() * y
        rows.append(y_D)
    return torch.stack(rows), p


@pytest.mark.parametrize("impl,rank", [("grouped_mm", 4), ("grouped_mm", 2), ("loop", 4)])
def test_expert_adapter_grads_are_per_expert_lora_math(impl, rank):
    """Output and the gradients of every expert adapter (and of the input) against a float64 per-token loop; rank 2
    takes grouped_mm's fallback for the adapter (8-byte rows). Tolerance: fp32 against float64, 1e-5 relative."""
    torch.manual_seed(0)
    E, D, Fd, T, K = 4, 8, 8, 7, 2
    experts = Experts(E, D, Fd, impl)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3), experts.down_proj.normal_(0, 0.3)
    experts.requires_grad_(False)  # (as apply_lora freezes the base)
    layer = LoRAExperts.wrap(experts, rank, 1.5, torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer.gate_up_lora_B.normal_(0, 0.3), layer.down_lora_B.normal_(0, 0.3)
    x_TD = torch.randn(T, D, requires_grad=True)
    ids_TK = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 0], [1, 0], [0, 1], [2, 1]])  # expert 3 gets no token
    weights_TK = torch.rand(T, K)
    g_TD = torch.randn(T, D)
    y_TD = layer(x_TD, ids_TK, weights_TK)
    (y_TD * g_TD).sum().backward()
    x64_TD = x_TD.detach().double().requires_grad_(True)
    want_TD, ref = _per_token_reference(x64_TD, ids_TK, weights_TK, layer, 1.5)
    (want_TD * g_TD.double()).sum().backward()
    torch.testing.assert_close(y_TD.double(), want_TD, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_TD.grad.double(), x64_TD.grad, rtol=1e-5, atol=1e-6)
    for name in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
        got = getattr(layer, name).grad
        torch.testing.assert_close(got.double(), ref[name].grad, rtol=1e-5, atol=1e-6, msg=name)
        assert not got[3].any(), name  # the expert with no token
    assert layer.gate_up_proj.grad is None and layer.down_proj.grad is None  # frozen base


def test_expert_adapters_refuse_an_impl_that_would_leave_them_out():
    """A plugged experts impl (the engine's decode kernels, expert parallelism's dispatch) runs the base weights only:
    setting one on adapted experts, or adapting experts that run one, raises at once instead of training nothing."""
    from moeloop.model.experts import register_experts_impl
    register_experts_impl("test_lora_plugged", lambda experts, x_TD, ids_TK, weights_TK: x_TD)
    layer = LoRAExperts.wrap(Experts(4, 8, 8), 4, 1.0, torch.Generator())
    with pytest.raises(ValueError, match="'test_lora_plugged' does not run LoRA adapters"):
        layer.impl = "test_lora_plugged"
    plugged = Experts(4, 8, 8, "test_lora_plugged")
    with pytest.raises(ValueError, match="does not run LoRA adapters"):
        LoRAExperts.wrap(plugged, 4, 1.0, torch.Generator())
    layer.impl = "loop"  # a built-in one is fine
    assert layer.impl == "loop"


def test_peft_export_splits_each_experts_adapters_as_the_hub_splits_its_weights(tmp_path):
    """save_adapter: per-expert gate_proj / up_proj / down_proj adapters under the hub's module names (gate and up
    share the expert's A, B cut in rows), target_modules exactly those modules; base hub W + alpha / r * B @ A of each
    is the merged model's hub tensor. Mixtral's hub names (block_sparse_moe.experts.<e>.w1/w3/w2) likewise."""
    from safetensors.torch import load_file
    model = _lora_model()
    save_adapter(model, actor_cfg(lora_rank=4, lora_alpha=8.0, lora_target_modules=BOTH), tmp_path, "base")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")]
    attention = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert config["target_modules"] == sorted(experts + attention)
    assert set(tensors) == {f"base_model.model.{m}.lora_{x}.weight" for m in experts + attention for x in "AB"}
    cfg = model.cfg
    base = dict(hub_named_tensors(tiny_model().state_dict().items(), cfg))
    merged = dict(hub_named_tensors(merged_weights(model), cfg))
    for m in experts + attention:
        a, b = tensors[f"base_model.model.{m}.lora_A.weight"], tensors[f"base_model.model.{m}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == 4
        torch.testing.assert_close(base[f"{m}.weight"] + 2.0 * b @ a, merged[f"{m}.weight"], rtol=0, atol=1e-6)
    from moeloop.model.config import ModelConfig
    from moeloop.model.factory import hf_config_dict
    from moeloop.model.transformer import MoEForCausalLM
    from moeloop.train.lora import peft_tensors
    mixtral = MoEForCausalLM(ModelConfig.from_hf_dict(hf_config_dict("mixtral", "tiny")))
    apply_lora(mixtral, actor_cfg(lora_rank=4, lora_target_modules=["experts"]))
    assert sorted(peft_tensors(mixtral)) == sorted(
        f"base_model.model.model.layers.{i}.block_sparse_moe.experts.{e}.{w}.lora_{x}.weight"
        for i in range(2) for e in range(8) for w in ("w1", "w2", "w3") for x in "AB")


def test_bf16_model_keeps_fp32_adapters():
    """Adapters (and so their grads and Adam state) in fp32 on a bf16 model, as peft's autocast_adapter_dtype; the
    adapter term is computed in fp32 and the sum cast back once (bit for bit on a LoRALinear); the forward is the
    merged bf16 model's to bf16 rounding, adapters off the bf16 base bit for bit; merged weights are bf16."""
    model = _lora_model("loop", torch.bfloat16)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(p.dtype == torch.float32 for p in adapters.values())
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n not in adapters)
    out = _hidden(model)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in adapters.values())
    merged = dict(merged_weights(model))
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    for impl in IMPLS:
        model.set_experts_impl(impl)
        want = _hidden(_plain(impl, merged, torch.bfloat16)).float()
        torch.testing.assert_close(_hidden(model).float(), want, rtol=0, atol=5e-2 * want.abs().max().item())
        with adapters_off(model):
            assert torch.equal(_hidden(model), _hidden(_plain(impl, tiny_model().to(torch.bfloat16).state_dict(),
                                                                torch.bfloat16)))
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 32).to(torch.bfloat16)
    want = (F.linear(x, q.weight) + q.scale * F.linear(F.linear(x.float(), q.lora_A), q.lora_B)).to(torch.bfloat16)
    assert torch.equal(q(x), want)


def test_adapters_are_drawn_from_the_run_seed():
    """A comes from the seed given (the run's trainer.seed: Actor passes it on), not from the global RNG: the same seed
    gives the same A whatever the global RNG, another seed another A; B starts at zero."""
    def a_of(seed, global_seed):
        torch.manual_seed(global_seed)
        model = _lora_model(seed=seed, random_b=False)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}
    a0, a0_again, a1 = a_of(0, 0), a_of(0, 123), a_of(1, 0)
    assert all(torch.equal(a0[n], a0_again[n]) for n in a0)
    assert all(not torch.equal(a0[n], a1[n]) for n in a0)
    actor = Actor(tiny_model(), actor_cfg(lora_rank=4, lora_alpha=8.0, lora_target_modules=BOTH),
                  torch.device("cpu"), 8, seed=1)
    assert all(torch.equal(p, a1[n]) for n, p in actor.model.named_parameters() if "lora_A" in n)


def _train(rank, world, dtype, ep=1, impl="auto"):
    """Two SGD updates of a LoRA actor (all-linear + experts, the experts' `impl`) on this rank's groups, the experts
    split over `ep` ranks (the local experts' path `impl` does not take raises); returns the merged weights, the full
    adapters and, sharded, the placements and local experts of each expert weight and adapter."""
    samples = rl_batch()
    groups = sorted({s.group_id for s in samples})
    mine = [s for s in samples if groups.index(s.group_id) % world == rank]
    model = tiny_model().to(dtype)
    model.set_experts_impl(impl)
    torch.manual_seed(100 + rank)  # the global RNG differs across ranks, as RunEnv seeds it; the adapters must not
    cfg = actor_cfg(max_tokens_per_micro_batch=24, lora_rank=4, lora_alpha=8.0, lora_target_modules=BOTH)
    actor = Actor(model, cfg, torch.device("cpu"), 8, seed=7, ep=ep)
    if ep > 1:
        grouped = impl == "grouped_mm" or (impl == "auto" and cpu_grouped_mm_works())
        for m in lora_modules(actor.model).values():
            if isinstance(m, LoRAExperts):
                setattr(m, "looped_over" if grouped else "grouped_over", _refuse)
    use_sgd(actor, 0.5)
    for _ in range(2):
        actor.update(mine)
    experts = actor.model.model.layers[0].mlp.experts
    shards = {}
    for name, p in experts.named_parameters():
        if hasattr(p, "placements"):
            shards[name] = (str(p.placements), p.to_local().shape[0])
    adapters = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in actor.model.named_parameters() if p.requires_grad}
    return {n: t.clone() for n, t in actor.named_weights()}, adapters, shards


def _refuse(*args):
    raise AssertionError("the local experts took the other path")


@pytest.mark.parametrize("world,dtype,ep,impl", [(2, torch.float32, 1, "auto"), (2, torch.bfloat16, 1, "auto"),
                                                 (2, torch.float32, 2, "auto"), (4, torch.float32, 2, "loop")])
def test_ranks_shard_expert_adapters_with_their_experts_and_equal_one_process(world, dtype, ep, impl):
    """Ranks (gloo) train the same adapters as one process given every group, under FSDP (ep 1) or with the experts
    split over ep ranks (parallel.ep=2; at 4 ranks FSDP shards them over expert_dp 2 as well), each rank's local
    experts through grouped_mm ("auto" in fp32, where this torch has a CPU kernel) or the loop: the experts' weights
    and adapters are split alike on dim 0 (each rank holds 4 / world experts' rows, with their adapters), the
    adapters moved, and they and the merged weights match. Tolerance: fp32, gradient reduction order (1e-5); bf16
    model (its fp32 adapters beside bf16 weights in one FSDP unit), activations rounded to bf16 in other packings: 2%
    of each tensor's largest entry (measured 0.7%; bf16's epsilon is 0.4%)."""
    want, want_adapters, _ = _train(0, 1, dtype, 1, impl)
    assert all(t.abs().max() > 0 for n, t in want_adapters.items() if "lora_B" in n)  # (B starts at zero)
    for weights, adapters, shards in run_ranks(_train, world, dtype, ep, impl):
        assert set(shards) == {"gate_up_proj", "down_proj", "gate_up_lora_A", "gate_up_lora_B", "down_lora_A",
                               "down_lora_B"}
        assert set(shards.values()) == {(shards["gate_up_proj"][0], 4 // world)}, shards
        for got, ref in ((adapters, want_adapters), (weights, want)):
            for name, t in ref.items():
                assert got[name].dtype == t.dtype, name
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got[name].float(), t.float(), rtol=0,
                                           atol=tol * max(t.abs().max().item(), 1e-3), msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_expert_adapters_train_through_grouped_mm():
    """On CUDA in bf16 (the experts' grouped_mm; the fp32 adapters through grouped_mm where this torch has it, else
    the loop): the forward equals the plain model holding merged_weights within bf16 rounding, adapters_off is the
    base bit for bit, and one update moves every expert's adapters (B starts at zero: A gets no gradient yet)."""
    model = _lora_model("grouped_mm", torch.bfloat16).cuda()
    ids = torch.tensor([5, 6, 7, 8, 9, 3, 11, 12, 13, 14], device="cuda")
    merged = {name: t.clone() for name, t in merged_weights(model)}
    plain = _plain("grouped_mm", {n: t.cpu() for n, t in merged.items()}, torch.bfloat16).cuda()
    torch.testing.assert_close(_hidden(model, ids).float(), _hidden(plain, ids).float(), rtol=2e-2, atol=2e-2)
    with adapters_off(model):
        off = _hidden(model, ids)
    base = _plain("grouped_mm", tiny_model().to(torch.bfloat16).state_dict(), torch.bfloat16).cuda()
    assert torch.equal(off, _hidden(base, ids))
    plain_model = tiny_model().to(torch.bfloat16)
    plain_model.set_experts_impl("grouped_mm")
    actor = Actor(plain_model, actor_cfg(lora_rank=4, lora_alpha=8.0, lora_target_modules=BOTH), torch.device("cuda"),
                  8)
    experts = [m for m in lora_modules(actor.model).values() if isinstance(m, LoRAExperts)]
    before = [m.gate_up_lora_B.detach().clone() for m in experts]
    actor.update(rl_batch())
    assert all(m.gate_up_lora_B.dtype == torch.float32 for m in experts)
    assert all((m.gate_up_lora_B != b).any() for m, b in zip(experts, before))
