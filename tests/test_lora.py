"""LoRA on the actor: the adapter's math, a start equal to the base model, only adapters train, the engine after a
push computes the trainer's LoRA policy, the adapters-off reference is the base model, DP=2 equals DP=1 and a resume
equals the straight run through the RL loop, the planner counts adapter state only, and config errors name the field."""
import json
import math

import pytest
import torch
from torch import nn

from moeloop.config.schema import ActorSection, RolloutSection
from moeloop.errors import InputError
from moeloop.loop.rl import run_rl
from moeloop.model.factory import init_model
from moeloop.model.hf_io import load_pretrained
from moeloop.rollout import Engine, SamplingParams
from moeloop.sync import InProcessTransport, WeightSyncer, share_parameters
from moeloop.train.actor import Actor, PolicyForward
from moeloop.train.lora import (AdapterOffReference, LoRALinear, adapted_weights, adapters_off, apply_lora,
                                expert_module_names, linear_module_names)
from tests.dist import run_ranks
from tests.test_rl_loop import STEPS, _assert_dp2_matches_dp1, _cfg, _dp_rank_with, _metrics, _weights
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model

LORA = ["actor.lora_rank=4", "actor.lora_alpha=8", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.5",
        "actor.optim.lr=1e-2"]  # (an lr that moves the adapters well past fp32 noise in 4 steps)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


def _lora_actor(rank: int = 4, alpha: float = 8.0, device: torch.device = torch.device("cpu"), **over) -> Actor:
    return Actor(tiny_model(), actor_cfg(lora_rank=rank, lora_alpha=alpha, max_tokens_per_micro_batch=64, **over),
                 device, 8)


def _logprobs(forward, samples, field="old_logprobs"):
    forward.compute_logprobs(samples, field)
    return [list(getattr(s, field)) for s in samples]


def _trained_actor(steps: int = 3, device: torch.device = torch.device("cpu"), **over) -> Actor:
    actor = _lora_actor(device=device, **over)
    for _ in range(steps):
        actor.update(rl_batch())
    return actor


def test_adapter_is_the_hand_computed_low_rank_update():
    """y = x W^T + b + (alpha / r) (x A^T) B^T, in float64 by hand, with a non-zero B; A is Kaiming-uniform
    (|a| <= 1 / sqrt(in)) and B starts at zero."""
    base = nn.Linear(6, 5, bias=True).double()
    layer = LoRALinear.wrap(base, rank=3, scale=16 / 3, generator=torch.Generator().manual_seed(0))
    assert layer.weight is base.weight and layer.bias is base.bias
    assert torch.equal(layer.lora_B, torch.zeros(5, 3, dtype=torch.float64))
    assert 0 < layer.lora_A.abs().max() <= 1 / math.sqrt(6)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(4, 6, dtype=torch.float64)
    W, b, A, B = (t.detach() for t in (base.weight, base.bias, layer.lora_A, layer.lora_B))
    want = x @ W.T + b + 16 / 3 * (x @ A.T) @ B.T
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)
    with adapters_off(layer):
        assert torch.equal(layer(x), base(x))


def test_default_targets_every_attention_projection_and_start_equals_the_base_model():
    """all-linear on the tiny Qwen3-MoE (every layer MoE, no shared experts) is q/k/v/o_proj of each layer; with B at
    zero the LoRA actor's logprobs are the base model's, bit for bit."""
    actor = _lora_actor()
    assert actor.lora_modules == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTENTION]
    samples = rl_batch()
    base = _logprobs(Actor(tiny_model(), actor_cfg(max_tokens_per_micro_batch=64), torch.device("cpu"), 8), samples)
    assert _logprobs(actor, samples) == base


def test_only_the_adapters_train_and_the_base_weights_stay_bit_identical():
    actor = _lora_actor()
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.{leaf}" for m in actor.lora_modules for leaf in ("lora_A", "lora_B")}
    assert {id(p) for g in actor.optimizer.param_groups for p in g["params"]} == \
        {id(p) for n, p in actor.model.named_parameters() if n in trainable}
    start = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.model.train()
    batch = next(actor.packed_micro_batches(rl_batch()))[1]
    logprobs_T, _ = actor.forward_batch(batch, with_entropy=False)
    (logprobs_T * batch.advantages_T).sum().backward()
    assert {n for n, p in actor.model.named_parameters() if p.grad is not None} == trainable
    actor.optimizer.zero_grad(set_to_none=True)
    actor.update(rl_batch())
    actor.update(rl_batch())
    for name, p in actor.model.named_parameters():
        if name in trainable:
            assert not torch.equal(p, start[name]), name  # both A (once B is non-zero) and B moved
        else:
            assert torch.equal(p, start[name]), name


def test_adapters_off_reference_is_the_base_model():
    """The KL reference under LoRA (the actor with its adapters off) gives the base model's logprobs, bit for bit,
    after the adapters trained; the actor itself has moved away from them."""
    actor = _trained_actor()
    samples = rl_batch()
    base = _logprobs(PolicyForward(tiny_model(), torch.device("cpu"), 64, 1024), samples, "ref_logprobs")
    assert _logprobs(AdapterOffReference(actor), samples, "ref_logprobs") == base
    moved = _logprobs(actor, samples)
    assert max(abs(a - b) for x, y in zip(moved, base) for a, b in zip(x, y)) > 1e-3


def test_the_loops_reference_under_lora_is_the_adapters_off_actor(model_dir, tmp_path):
    """build_reference makes no second model under LoRA: the actor with its adapters off; without LoRA a copy."""
    from moeloop.loop.components import build_reference
    from moeloop.loop.env import RunEnv, load_policy
    env = RunEnv(torch.device("cpu"), 0, 1, tmp_path)
    for lora, kind in ((LORA, AdapterOffReference), (["actor.use_kl_loss=true"], PolicyForward)):
        cfg = _cfg(model_dir, tmp_path, *lora)
        actor = Actor(load_policy(cfg), cfg.actor, env.device, 4)
        ref = build_reference(cfg, actor, env)
        assert type(ref) is kind and (kind is PolicyForward or ref.actor is actor)


ROLLOUT = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, kv_cache_bytes=1 << 20, max_model_len=48)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("targets", [["all-linear"], ["all-linear", "experts"]])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_engine_after_a_push_computes_the_trainers_lora_policy(device, targets):
    """Colocated as the RL loop builds it: the engine aliases the actor's frozen parameters but the adapted weights
    (with `experts`, the routed experts' stacked weights too), which the push fills with the merged W + scale B A. The
    logprobs the engine reports for its samples then equal the trainer's teacher-forced LoRA logprobs (tolerance: fp32,
    x (W + sBA)^T against x W^T + s (x A^T) B^T; on CUDA the engine's kernels and graphs, 1e-4 as
    tests/test_rollout_cuda.py), and differ from the base model's."""
    actor = _trained_actor(device=torch.device(device), lora_target_modules=targets)
    model = tiny_model(seed=1).to(device)  # other weights: the push and the sharing must replace all of them
    adapted = set(adapted_weights(actor.model))
    assert any(".mlp.experts." in n for n in adapted) == ("experts" in targets)
    shared = share_parameters(actor.model, model, skip=adapted)
    assert sorted(shared) == sorted(n for n, _ in model.named_parameters() if n not in adapted)
    engine = Engine(model, RolloutSection(**ROLLOUT, enforce_eager=False), eos_token_ids=[])
    WeightSyncer(InProcessTransport(device)).push(actor.named_weights(), engine, version=1)
    trainer = dict(actor.model.named_parameters())
    for name, p in model.named_parameters():
        assert (p.data_ptr() == trainer[name].data_ptr()) == (name in shared), name
    prompts = [[5, 6, 7], [9, 3], [11, 12, 13, 14]]
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=0))
    from moeloop.rollout.completion import completions_to_samples
    samples = completions_to_samples(outs)
    lora = _logprobs(actor, samples)
    with adapters_off(actor.model):
        base = _logprobs(actor, samples)
    got = torch.tensor([lp for s in samples for lp in s.response_logprobs])
    atol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(got, torch.tensor([lp for x in lora for lp in x]), rtol=0, atol=atol)
    assert (got - torch.tensor([lp for x in base for lp in x])).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lora_rl_run_trains_the_adapted_weights_only(model_dir, tmp_path):
    """The RL loop with LoRA on the GPU (the planner's LoRA ledger runs at start-up there, the engine's CUDA path
    generates from the merged weights): it runs, and its export moved the attention weights only."""
    last = run_rl(_cfg(model_dir, tmp_path / "run", *LORA, device="cuda"))
    assert last["policy/version"] == STEPS
    w0, w = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "run")
    assert {n for n in w0 if not torch.equal(w0[n], w[n])} == {f"model.layers.{i}.self_attn.{p}.weight"
                                                               for i in range(2) for p in ATTENTION}


def test_lora_config_errors_name_the_field(model_dir, tmp_path):
    from moeloop.config import load_config
    for override, match in (("actor.lora_rank=-1", "actor.lora_rank: must be >= 0"),
                            ("actor.lora_alpha=0", "actor.lora_alpha: must be > 0"),
                            ("actor.lora_dropout=0.1", "actor.lora_dropout: must be 0"),
                            ("actor.lora_target_modules=[all-linear,q_proj]", "actor.lora_target_modules: all-linear"),
                            ("actor.lora_target_modules=[]", "actor.lora_target_modules: must list module names")):
        with pytest.raises(InputError, match=match):
            load_config(None, [f"model.path={model_dir}", "actor.lora_rank=4", override])
    with pytest.raises(InputError, match="actor.ref_sync_steps=2 with actor.lora_rank=4"):
        _cfg(model_dir, tmp_path, "actor.lora_rank=4", "actor.use_kl_loss=true", "actor.ref_sync_steps=2")
    with pytest.raises(InputError, match="critic.lora_rank: must be 0"):
        _cfg(model_dir, tmp_path, "critic.enable=true", "critic.lora_rank=4")
    with pytest.raises(InputError, match=r"actor.lora_target_modules: 'q_prj' matches no module LoRA can target; "
                                         r"the model's are \(in every layer that has them\) mlp.experts, "
                                         r"self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, self_attn.v_proj, "
                                         r"or all-linear"):
        _lora_actor(lora_target_modules=["q_proj", "q_prj"])
    actor = _lora_actor(lora_target_modules=["q_proj", "self_attn.v_proj"])
    assert actor.lora_modules == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]


def test_the_planners_linear_modules_and_experts_are_the_models():
    """plan.accounting.decoder_linears lists the model's linear modules (names and shapes) and decoder_experts its
    routed experts, for dense, MoE, shared-expert and MLA layers alike; LoRA's adapter counts per layer (dense, and
    the experts' under `experts`) are the adapters apply_lora gives the model."""
    from moeloop.model.config import ModelConfig
    from moeloop.model.factory import hf_config_dict
    from moeloop.model.transformer import MoEForCausalLM
    from moeloop.plan.accounting import decoder_experts, decoder_linears, lora_layer_params
    variants = [(arch, {}) for arch in ("qwen3_moe", "qwen3", "mixtral", "deepseek_v3")]  # (deepseek_v3 tiny: 1 dense
    variants += [("deepseek_v3", {"n_shared_experts": 2, "q_lora_rank": None})]  # + 2 MoE layers, q_lora_rank 32)
    for arch, over in variants:
        cfg = ModelConfig.from_hf_dict({**hf_config_dict(arch, "tiny"), **over})
        with torch.device("meta"):
            model = MoEForCausalLM(cfg)
        modules = dict(model.named_modules())
        have = [(n, modules[n].in_features, modules[n].out_features) for n in linear_module_names(model)]
        assert sorted(decoder_linears(cfg)) == sorted(have), arch
        assert [(n, e, d, f) for n, e, d, f in decoder_experts(cfg)] == [
            (n, modules[n].num_experts, modules[n].dim, modules[n].ffn_dim) for n in expert_module_names(model)], arch
        dense, expert = lora_layer_params(cfg, ActorSection(lora_rank=2))
        assert sum(dense) == sum(2 * (i + o) for _, i, o in have) and sum(expert) == 0
        if not decoder_experts(cfg):  # (a dense model: `experts` names none of its modules, an InputError)
            continue
        section = ActorSection(lora_rank=2, lora_target_modules=["all-linear", "experts"])
        apply_lora(model, section)
        adapters = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
        dense, expert = lora_layer_params(cfg, section)
        assert sum(dense) == sum(v for n, v in adapters.items() if ".mlp.experts." not in n), arch
        assert sum(expert) == sum(v for n, v in adapters.items() if ".mlp.experts." in n) > 0, arch


def test_the_ledger_counts_grads_and_optimizer_of_the_adapters_only(model_dir):
    """actor.lora_rank=8: weights are the model's plus the adapters', grads and optimizer state the adapters' only
    (counted by hand from the model's q/k/v/o_proj), no reference copy; the checkpoint holds the adapters' state."""
    from moeloop.config import load_config
    from moeloop.parallel import Layout
    from moeloop.plan import build_plan, memory_ledger, model_stats
    from moeloop.plan.memory import state_bytes
    from moeloop.model.config import ModelConfig
    m = ModelConfig.from_pretrained(model_dir)
    stats = model_stats(m)
    kl = ["actor.use_kl_loss=true", f"model.path={model_dir}"]
    full = memory_ledger(load_config(None, kl), stats, Layout(dp=2))
    cfg = load_config(None, [*kl, "actor.lora_rank=8"])
    lora = memory_ledger(cfg, stats, Layout(dp=2))
    sb = state_bytes(cfg)
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    adapters = m.num_layers * 8 * ((h + q) * 2 + (h + kv) * 2)  # q, o: (h + q); k, v: (h + kv)
    assert lora.entries["grads"] == pytest.approx(sb.grads * adapters / 2)
    assert lora.entries["optimizer"] == pytest.approx(sb.optimizer * adapters / 2)
    assert lora.entries["weights"] == pytest.approx(full.entries["weights"] + sb.weights * adapters / 2)
    assert full.entries["ref_weights"] > 0 and lora.entries["ref_weights"] == 0
    assert build_plan(cfg, stats).checkpoint["state_gb"] == pytest.approx(adapters * (sb.weights + sb.optimizer) / 1e9)
    # + the routed experts: per expert A [8, h] + B [2f, 8] on gate_up, A [8, f] + B [h, 8] on down
    both = memory_ledger(load_config(None, [*kl, "actor.lora_rank=8", "actor.lora_target_modules=[all-linear,experts]"]),
                         stats, Layout(dp=2))
    experts = m.num_layers * m.num_experts * 8 * ((h + 2 * m.moe_intermediate_size) + (m.moe_intermediate_size + h))
    assert both.entries["grads"] == pytest.approx(sb.grads * (adapters + experts) / 2)
    # a bf16 model: the adapters, their grads and Adam state are fp32 all the same (4, 4, 8 bytes)
    bf16 = [*kl, "model.dtype=bfloat16"]
    # (the base's bf16 weights: a full fine-tune would keep fp32 masters, model.fp32_master_weights)
    full16 = memory_ledger(load_config(None, [*bf16, "model.fp32_master_weights=false"]), stats, Layout(dp=2))
    lora16 = memory_ledger(load_config(None, [*bf16, "actor.lora_rank=8"]), stats, Layout(dp=2))
    assert (lora16.entries["grads"], lora16.entries["optimizer"]) == pytest.approx((4 * adapters / 2, 8 * adapters / 2))
    assert lora16.entries["weights"] == pytest.approx(full16.entries["weights"] + 4 * adapters / 2)


def _dcp_keys(step_dir):
    import torch.distributed.checkpoint as dcp
    return set(dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


def test_lora_rl_resume_equals_the_straight_run_and_exports_the_merged_model(model_dir, tmp_path):
    """With LoRA on the linear modules and the routed experts and a KL loss (the reference: adapters off): a run stopped
    at step 2 and resumed logs and ends as the straight run. Its checkpoint holds the adapters and their Adam state
    only; the HF export is the merged model (load_pretrained loads it), whose q/k/v/o_proj and expert weights moved and
    nothing else did, `moeloop ckpt export` of the final checkpoint writes the same weights, and the adapters alone are
    beside it in peft's format. A resume under other LoRA settings is refused."""
    lora = [*LORA, "actor.lora_target_modules=[all-linear,experts]"]
    run_rl(_cfg(model_dir, tmp_path / "a", *lora))
    run_rl(_cfg(model_dir, tmp_path / "b", *lora, f"trainer.steps={STEPS // 2}"))
    run_rl(_cfg(model_dir, tmp_path / "b", *lora), resume=True)
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    step = tmp_path / "b" / "checkpoints" / f"step_{STEPS:06d}"
    adapters = {f"model.layers.{i}.self_attn.{p}.{leaf}" for i in range(2) for p in ATTENTION
                for leaf in ("lora_A", "lora_B")}
    adapters |= {f"model.layers.{i}.mlp.experts.{p}_lora_{x}" for i in range(2) for p in ("gate_up", "down")
                 for x in "AB"}
    keys = _dcp_keys(step)
    assert {k[len("model."):] for k in keys if k.startswith("model.")} == adapters
    assert {k[len("optim.state."):].rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")} == adapters
    assert json.loads((step / "meta.json").read_text())["lora"] == {"rank": 4, "alpha": 8.0,
                                                                    "target_modules": ["all-linear", "experts"]}
    w0 = load_pretrained(model_dir).state_dict()
    moved = {n for n in w0 if not torch.equal(w0[n], wa[n])}
    assert moved == {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ATTENTION} | \
        {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    from moeloop.checkpoint.command import export_checkpoint
    exported = load_pretrained(export_checkpoint(step, model_dir, tmp_path / "exported")).state_dict()
    assert all(torch.equal(exported[n], wa[n]) for n in wa)
    _check_peft_adapter(tmp_path / "a" / "lora_adapter", model_dir, w0, wa, num_experts=8)
    with pytest.raises(InputError, match="saved with LoRA settings .* this run's actor.lora_rank"):
        run_rl(_cfg(model_dir, tmp_path / "b", *lora, "actor.lora_alpha=16", "trainer.steps=5"), resume=True)


def _check_peft_adapter(adapter_dir, model_dir, base, merged, num_experts=0):
    """<run_dir>/lora_adapter in peft's layout (peft 0.21's PeftModel.from_pretrained loaded one onto transformers'
    model of model.path and gave the merged export's logits to 3e-7; peft is no dependency, so here the files): the
    config, and base W + alpha / r * B @ A from its tensors is the merged export, under the hub's names (with
    `num_experts`, each routed expert's gate_proj / up_proj / down_proj too, as the export writes them)."""
    from safetensors.torch import load_file
    from moeloop.model.config import ModelConfig
    from moeloop.model.hf_names import hub_named_tensors
    cfg = ModelConfig.from_pretrained(model_dir)
    base, merged = dict(hub_named_tensors(base.items(), cfg)), dict(hub_named_tensors(merged.items(), cfg))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    modules = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTENTION]
    modules += [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")]
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "base_model_name_or_path")} == \
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0, "base_model_name_or_path": str(model_dir)}
    assert sorted(config["target_modules"]) == sorted(modules)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    assert set(tensors) == {f"base_model.model.{m}.{leaf}.weight" for m in modules for leaf in ("lora_A", "lora_B")}
    for m in modules:
        a, b = tensors[f"base_model.model.{m}.lora_A.weight"], tensors[f"base_model.model.{m}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == 4
        torch.testing.assert_close(base[f"{m}.weight"] + 8 / 4 * b @ a, merged[f"{m}.weight"], rtol=0, atol=1e-6)


def test_lora_rl_dp2_matches_dp1(model_dir, tmp_path):
    """Two FSDP ranks (the frozen base and the adapters sharded in the same units) give one rank's LoRA run, the
    reference being the adapters-off actor on each."""
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *LORA)
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *LORA)
    _assert_dp2_matches_dp1(tmp_path)
    w0, w1 = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "one")
    assert {n for n in w0 if not torch.equal(w0[n], w1[n])} == {f"model.layers.{i}.self_attn.{p}.weight"
                                                                 for i in range(2) for p in ATTENTION}


def test_lora_sft_learns_and_resumes_exactly(model_dir, tmp_path):
    """SFT (TRL's SFTTrainer with peft_config): the loss falls, a resumed run equals the straight one, the export
    moved the attention weights only, and the adapters are written beside it."""
    from moeloop.loop.sft import run_sft
    from tests.test_sft import _cfg as sft_cfg, _losses
    lora = ("actor.lora_rank=8", "actor.optim.lr=1e-2")
    run_sft(sft_cfg(model_dir, tmp_path / "a", *lora))
    run_sft(sft_cfg(model_dir, tmp_path / "b", *lora, "trainer.steps=3"))
    run_sft(sft_cfg(model_dir, tmp_path / "b", *lora), resume=True)
    losses = _losses(tmp_path / "a")
    assert losses == _losses(tmp_path / "b") and losses[-1] < losses[0] - 0.5, losses
    w0, wa, wb = (load_pretrained(d).state_dict() for d in (model_dir, tmp_path / "a" / "hf", tmp_path / "b" / "hf"))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert {n for n in w0 if not torch.equal(w0[n], wa[n])} == {f"model.layers.{i}.self_attn.{p}.weight"
                                                                 for i in range(2) for p in ATTENTION}
    assert (tmp_path / "a" / "lora_adapter" / "adapter_model.safetensors").is_file()
