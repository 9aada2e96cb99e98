"""Properties of the memory ledger over random MoE models, layouts and settings."""
import copy

from hypothesis import given, settings, strategies as st

from moeloop.config.schema import RunConfig
from moeloop.model.config import ModelConfig
from moeloop.parallel import Layout
from moeloop.plan import memory_ledger, model_stats
from moeloop.plan.activations import stage_activation_bytes
from moeloop.plan.memory import ENTRIES, stage_ledgers, state_parts

FAST = settings(max_examples=40, deadline=None)


@st.composite
def moe_models(draw):
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    raw = {"model_type": "qwen3_moe", "vocab_size": draw(st.integers(100, 50_000)),
           "hidden_size": 64 * draw(st.integers(1, 64)), "num_hidden_layers": draw(st.integers(1, 48)),
           "num_attention_heads": kv * draw(st.sampled_from([1, 2, 4])), "num_key_value_heads": kv,
           "head_dim": draw(st.sampled_from([64, 128])), "num_experts": draw(st.sampled_from([8, 16, 64, 128])),
           "moe_intermediate_size": 64 * draw(st.integers(1, 32))}
    raw["num_experts_per_tok"] = draw(st.integers(1, min(8, raw["num_experts"])))
    return ModelConfig.from_hf_dict(raw)


@st.composite
def run_configs(draw):
    cfg = RunConfig()
    cfg.model.dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    cfg.model.gradient_checkpointing = draw(st.booleans())
    cfg.plan.sharding = draw(st.sampled_from(["fsdp", "optimizer", "none"]))
    cfg.plan.logits = draw(st.sampled_from(["chunked", "naive"]))
    cfg.plan.cpu_optimizer_step = draw(st.booleans())
    cfg.rollout.mode = draw(st.sampled_from(["colocated", "disaggregated"]))
    cfg.actor.max_tokens_per_micro_batch = draw(st.integers(128, 32_768))
    cfg.plan.reserve_gb = draw(st.floats(0, 4))
    return cfg


layouts = st.builds(lambda dp, tp, pp, cp: Layout(dp=dp, tp=tp, pp=pp, cp=cp),
                    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]))


def _with(layout: Layout, **kw) -> Layout:
    return Layout(**{**layout.__dict__, **kw})


@FAST
@given(moe_models(), run_configs(), layouts, st.sampled_from([1, 2, 4, 8]))
def test_more_ep_never_raises_expert_memory_per_rank(m, cfg, layout, ep):
    small, big = _with(layout, ep=ep), _with(layout, ep=2 * ep)
    if small.validate(m) or big.validate(m):
        return
    stats = model_stats(m)
    for stage in range(layout.pp):
        before = sum(e for _, e in state_parts(cfg, stats, small, stage).values())
        after = sum(e for _, e in state_parts(cfg, stats, big, stage).values())
        assert after <= before * (1 + 1e-12)


@FAST
@given(moe_models(), run_configs(), layouts, st.tuples(st.booleans(), st.booleans(), st.booleans()),
       st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_offload_never_raises_gpu_memory(m, cfg, layout, less, extra):
    stats = model_stats(m)
    fewer = copy.deepcopy(cfg)
    fewer.actor.offload.params, fewer.actor.offload.grads, fewer.actor.offload.optimizer = less
    more = copy.deepcopy(cfg)  # a superset of fewer's offload flags
    more.actor.offload.params, more.actor.offload.grads, more.actor.offload.optimizer = (
        a or b for a, b in zip(less, extra))
    assert memory_ledger(more, stats, layout).peak_bytes <= memory_ledger(fewer, stats, layout).peak_bytes
    for a, b in zip(stage_ledgers(fewer, stats, layout), stage_ledgers(more, stats, layout)):
        assert all(b.phase_bytes(p) <= a.phase_bytes(p) for p in a.phases)


@FAST
@given(moe_models(), layouts, st.integers(1, 32_768), st.integers(1, 64))
def test_checkpointed_activations_never_exceed_full(m, layout, tokens, micro_batches):
    layers = list(range(m.num_layers))[: max(1, m.num_layers // layout.pp)]
    for stage in range(layout.pp):
        full = stage_activation_bytes(m, layout, layers, tokens, micro_batches, stage, checkpointing=False)
        ckpt = stage_activation_bytes(m, layout, layers, tokens, micro_batches, stage, checkpointing=True)
        assert 0 < ckpt <= full


@FAST
@given(moe_models(), run_configs(), layouts)
def test_ledger_sums(m, cfg, layout):
    led = memory_ledger(cfg, model_stats(m), layout)
    assert set(led.entries) == set(ENTRIES)
    assert all(v >= 0 for v in led.entries.values())
    for phase, names in led.phases.items():
        assert led.phase_bytes(phase) == sum(led.entries[n] for n in names)
    assert led.peak_bytes == max(led.phase_bytes(p) for p in led.phases)
    d = led.to_dict()
    assert abs(d["peak_gb"] - max(d["phases_gb"].values())) < 1e-9
    assert abs(led.resident_bytes - sum(sum(p) for p in state_parts(cfg, model_stats(m), layout, led.stage).values())) <= 1e-6 * max(1.0, led.resident_bytes)
    assert "rollout" in led.phases if cfg.rollout.mode == "colocated" else "rollout" not in led.phases
