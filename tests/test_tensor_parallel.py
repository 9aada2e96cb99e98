"""Tensor parallelism (`parallel.tp`, `moeloop.parallel.tensor`): attention heads and dense MLPs split over the tp
ranks give the one-process logprobs, RL update (gradient clipping on) and SFT step, alone and beside data, context
and expert parallelism, for Qwen3-MoE and for DeepSeek-V3 (MLA, a dense layer, shared experts), with tp above the
kv heads (each kv head on tp / G ranks), and with LoRA adapters split with their linears. Tolerance as the
DP tests': fp32 summation order of the all-reduced activations and gradients."""
import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from moeloop.config import load_config
from moeloop.config.schema import CriticSection
from moeloop.errors import InputError
from moeloop.loop.rl import run_rl
from moeloop.loop.sft import run_sft
from moeloop.model.config import ModelConfig
from moeloop.model.factory import build_model, hf_config_dict, init_model
from moeloop.model.hf_io import load_pretrained
from moeloop.model.transformer import MoEForCausalLM
from moeloop.parallel import Layout
from moeloop.parallel.fsdp import full_tensor
from moeloop.parallel.groups import dp_rank, dp_size, init_parallel_groups
from moeloop.plan import memory_ledger, model_stats
from moeloop.train.actor import Actor
from moeloop.train.critic import Critic
from moeloop.train.lora import AdapterOffReference
from tests.dist import run_ranks
from tests.hf_tiny import TINY_HF_CONFIGS
from tests.test_rl_loop import _cfg as rl_cfg, _rows, _weights, assert_same_run
from tests.test_sft import _cfg as sft_cfg, _conversations
from tests.trainer_fixtures import (actor_cfg, assert_ranks_match, first_pass_then_steps, rl_batch, tiny_model,
                                    use_sgd)


# one kv head (multi-query: tp 2 is above it); biases on q, k, v and o (random: each kv head's differ)
ARCHS = {**TINY_HF_CONFIGS, "qwen3_moe_mqa": {**TINY_HF_CONFIGS["qwen3_moe"], "num_key_value_heads": 1},
         "qwen3_moe_bias": {**TINY_HF_CONFIGS["qwen3_moe"], "attention_bias": True}}


def _model(arch: str):
    if arch == "qwen3_moe":
        return tiny_model()
    torch.manual_seed(0)
    model = MoEForCausalLM(ModelConfig.from_hf_dict(dict(ARCHS[arch])))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.1) if p.dim() > 1 or name.endswith("proj.bias") else p.fill_(1.0)
    return model


def _shard(samples):
    """This rank's samples: its dp rank's groups (the tp and cp ranks of a replica share them)."""
    groups = sorted({s.group_id for s in samples})
    return [s for s in samples if groups.index(s.group_id) % dp_size() == dp_rank()]


def _run(tp: int = 1, cp: int = 1, ep: int = 1, kind: str = "rl", arch: str = "qwen3_moe", sp: bool = False,
         lora: list[str] | None = None):
    """`sp`: parallel.sequence_parallel; `lora`: rank-4 LoRA adapters on these actor.lora_target_modules (the weights
    returned then the merged ones). On this rank's share of `rl_batch()`: the old logprobs and entropies (or the
    critic's values), then 2 SGD steps (GRPO updates with the gradient clipped to 0.1, SFT steps, or critic updates);
    a GRPO actor's steps come after an update with every advantage 0. Returns the first pass's values by sample, the
    step metrics, the weights, and the shapes of this rank's q_proj weights and the rows the MoE blocks, their routed
    experts and the first layer took. A `kind` ending "+ckpt": with activation checkpointing."""
    ckpt, kind = kind.endswith("+ckpt"), kind.removesuffix("+ckpt")
    init_parallel_groups(cp, tp, sequence_parallel=sp)
    samples = _shard(rl_batch())
    if kind == "critic":
        model, first, metrics = critic_pass_then_steps(arch, samples)
        weights = {n: full_tensor(t).clone() for n, t in model.model.state_dict().items()}
        return first, metrics, weights, _local_shapes(model.model) + (None,)
    policy = _model(arch)
    policy.gradient_checkpointing = ckpt  # (the recompute runs the layer's row hooks again)
    rows = [0, 0, 0]  # the rows the MoE blocks took here, those their routed experts ran on, the first layer's
    policy.model.layers[0].register_forward_pre_hook(lambda module, args: rows.__setitem__(2, rows[2] + len(args[0])))
    for block in policy.moe_blocks():  # (registered before tp's own hooks, which split the block's rows)
        block.register_forward_pre_hook(lambda module, args: rows.__setitem__(0, rows[0] + args[0].shape[0]))
        block.experts.register_forward_pre_hook(lambda module, args: rows.__setitem__(1, rows[1] + args[0].shape[0]))
    cfg = actor_cfg(max_tokens_per_micro_batch=24, grad_clip=0.1, router_replay="R2" if kind == "r2" else "off",
                    **(dict(lora_rank=4, lora_alpha=8, lora_target_modules=lora) if lora else {}))
    model = Actor(policy, cfg, torch.device("cpu"), 8, ep=ep)
    use_sgd(model, 0.05)
    first, metrics = first_pass_then_steps(model, samples, kind, ("pg_loss", "grad_norm"))
    if lora:  # the KL reference under LoRA, after the steps: the base model's logprobs
        AdapterOffReference(model).compute_logprobs(samples, "ref_logprobs")
        first = {(s.group_id, tuple(s.response_ids)): first[s.group_id, tuple(s.response_ids)] + (s.ref_logprobs,)
                 for s in samples}
    shapes = _local_shapes(model.model) + (rows,) + ((_adapter_splits(model.model),) if lora else ())
    return first, metrics, {n: t.clone() for n, t in model.named_weights()}, shapes


def critic_pass_then_steps(arch: str, samples, model=None):
    """A critic of `model` (default `_model(arch)`; SGD): its values of `samples` (returns: advantages + 0.5), then 2
    updates, then its values again; returns it, the later values by sample (the first are all 0: the value head
    starts at zero) and the value losses."""
    for s in samples:
        s.returns = [a + 0.5 for a in s.advantages]
    cfg = CriticSection()
    cfg.max_tokens_per_micro_batch, cfg.ppo_mini_batch_size = 24, 4
    model = Critic(_model(arch) if model is None else model, cfg, torch.device("cpu"), 8, master_weights=False)
    use_sgd(model, 0.05)
    model.compute_values(samples)  # (the updates' old values, for the value clipping)
    losses = [model.update(samples)["critic/vf_loss"] for _ in range(2)]
    model.compute_values(samples)
    assert any(v != 0 for s in samples for v in s.values)
    return model, {(s.group_id, tuple(s.response_ids)): (s.values,) for s in samples}, losses


def _local_shapes(model) -> tuple:
    """The last layer's query projection: its placement on the mesh's tp dim (None: not split by tp), its shape."""
    attn = model.model.layers[-1].self_attn
    w = attn.q_proj.weight if hasattr(attn, "q_proj") else attn.q_b_proj.weight
    names = w.device_mesh.mesh_dim_names if isinstance(w, DTensor) else ()
    return (w.placements[names.index("tp")] if "tp" in names else None), tuple(w.shape)


def _adapter_splits(model) -> dict[str, object]:
    """The last layer's LoRA adapters: each one's placement on the mesh's tp dim (None: not split by tp)."""
    splits = {}
    for name, p in model.model.layers[-1].named_parameters():
        if ".lora_" in name:
            names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
            splits[name] = p.placements[names.index("tp")] if "tp" in names else None
    return splits


def _rank(rank, world, tp, cp, ep, kind, arch, sp=False, lora=None):
    return _run(tp, cp, ep, kind, arch, sp, lora)


@pytest.mark.parametrize("world,tp,cp,ep,kind,arch", [
    (2, 2, 1, 1, "rl", "qwen3_moe"),  # tp alone: 2 of the 4 query heads and 1 of the 2 kv heads a rank
    (4, 2, 1, 1, "rl", "qwen3_moe"),  # dp 2 x tp 2
    (2, 2, 1, 1, "rl", "deepseek_v3"),  # MLA's head projections, the dense layer's MLP, the shared experts
    (2, 2, 1, 1, "sft", "qwen3_moe"),
    (2, 2, 1, 1, "critic", "qwen3_moe"),
    (4, 2, 2, 1, "rl", "qwen3_moe"),  # cp 2 x tp 2: Ulysses over each tp rank's heads
    (4, 2, 1, 2, "rl", "qwen3_moe"),  # dp 2 x tp 2 with the experts split over ep 2
    (2, 2, 1, 1, "r2", "qwen3_moe"),  # routes recorded (gathered from the tp ranks' rows) and replayed (sliced)
    (4, 4, 1, 1, "rl", "qwen3_moe"),  # tp above the 2 kv heads: 1 query head a rank, each kv head on 2 ranks
    (4, 4, 1, 1, "sft", "qwen3_moe"),
    (4, 4, 1, 1, "critic", "qwen3_moe"),
    (4, 2, 2, 1, "rl", "qwen3_moe_mqa"),  # cp 2 x tp 2 above the 1 kv head: Ulysses repeats it to the rank's heads
    (4, 4, 1, 1, "rl", "qwen3_moe_bias"),  # tp 4 above the 2 kv heads: the k and v biases' rows of the rank's head
])
def test_tensor_parallel_matches_one_process(world, tp, cp, ep, kind, arch):
    """Besides the numbers: the query projection is `Shard(0)` on the mesh's tp dim, and the routed experts of the tp
    ranks of a replica ran on the rows of its MoE blocks between them (each rank on its share, fewer than all)."""
    want_first, want_metrics, want, (_, shape, _) = _run(kind=kind, arch=arch)
    results = run_ranks(_rank, world, tp, cp, ep, kind, arch)
    if kind != "critic":
        for first_rank in range(0, world, tp):
            (blocks, _, layer), *_ = tp_rows = [r[3][2] for r in results[first_rank:first_rank + tp]]
            assert all(b == blocks and 0 < e < b and n == layer for b, e, n in tp_rows)
            assert sum(e for _, e, _ in tp_rows) == blocks
    for *_, (local, whole, _) in results:
        assert whole == shape and local == Shard(0)  # the tp ranks split the heads (FSDP shards over dp besides)
    assert_ranks_match([r[:3] for r in results], want_first, want_metrics, want)


@pytest.mark.parametrize("world,tp,kind,arch", [
    (2, 2, "rl", "qwen3_moe"),
    (4, 2, "rl", "qwen3_moe"),  # dp 2 x tp 2
    (2, 2, "sft", "qwen3_moe"),
    (4, 2, "sft", "qwen3_moe"),
    (2, 2, "critic", "qwen3_moe"),
    (2, 2, "r2", "qwen3_moe"),  # routes recorded (gathered from the rows) and replayed (sliced)
    (2, 2, "rl", "deepseek_v3"),  # MLA (its latents and their norms on the gathered rows), a dense MLP, shared experts
    (2, 2, "sft", "deepseek_v3"),
    (4, 4, "rl", "qwen3_moe"),  # above the 2 kv heads; the rows split 4 ways (unevenly)
    (2, 2, "rl", "llama_tied"),  # dense MLPs; the head tied to the embedding, whose gradient is each rank's rows'
    (2, 2, "rl+ckpt", "qwen3_moe"),  # activation checkpointing: the recomputed layers take the same rows
    (2, 2, "sft+ckpt", "deepseek_v3"),
    (4, 2, "sft", "llama_tied"),
    (4, 2, "rl@ep2", "qwen3_moe"),  # dp 2 x tp 2 with the experts split over ep 2: each rank sends its own rows
])
def test_sequence_parallel_matches_one_process(world, tp, kind, arch):
    """parallel.sequence_parallel: the residual stream between the layers holds a tp rank's rows (the first layer's
    input rows over the tp ranks of a replica add up to the MoE blocks' of one process, and the routed experts run on
    all of a rank's block rows: not split again), and the numbers are one process's."""
    kind, ep = kind.split("@ep")[0], int(kind.split("@ep")[1]) if "@ep" in kind else 1
    want_first, want_metrics, want, (_, shape, want_rows) = _run(kind=kind, arch=arch)
    results = run_ranks(_rank, world, tp, 1, ep, kind, arch, True)
    for first_rank in range(0, world, tp):
        tp_rows = [r[3][2] for r in results[first_rank:first_rank + tp]]
        if kind != "critic":
            assert all(0 < n and b == e for b, e, n in tp_rows)
        if kind != "critic" and world == tp:
            assert [sum(counts) for counts in zip(*tp_rows)] == [want_rows[0], want_rows[0], want_rows[2]]
    for *_, (local, whole, _) in results:
        assert whole == shape and local == Shard(0)
    assert_ranks_match([r[:3] for r in results], want_first, want_metrics, want)


ATTENTION_AND_EXPERTS = ["all-linear", "experts"]


@pytest.mark.parametrize("world,tp,cp,ep,sp,kind,arch,lora", [
    (2, 2, 1, 1, False, "rl", "qwen3_moe", ["all-linear"]),  # q, k, v split by output, o by input
    (4, 2, 1, 1, False, "rl", "qwen3_moe", ATTENTION_AND_EXPERTS),  # dp 2 x tp 2; the routed experts' adapters too
    (2, 2, 1, 1, False, "rl", "deepseek_v3", ATTENTION_AND_EXPERTS),  # MLA: heads split, latents whole; dense MLP
    (4, 4, 1, 1, False, "rl", "qwen3_moe_bias", ["all-linear"]),  # above the kv heads: k, v whole, the head's rows of B
    (2, 2, 1, 1, True, "sft", "qwen3_moe", ["all-linear"]),  # sequence parallelism
    (2, 2, 1, 1, True, "rl", "deepseek_v3", ["all-linear"]),
    (4, 2, 2, 1, False, "rl", "qwen3_moe", ["all-linear"]),  # cp 2 x tp 2
    (4, 2, 1, 2, False, "rl", "qwen3_moe", ATTENTION_AND_EXPERTS),  # dp 2 x tp 2, the experts (and adapters) over ep 2
])
def test_lora_at_tensor_parallel_matches_one_process(world, tp, cp, ep, sp, kind, arch, lora):
    """LoRA under tp: a column split's adapter keeps A whole and splits B by output with the weight, a row split's
    splits A by input and keeps B whole (its rank-r intermediate a part on each rank, summed with the output's
    all-reduce); the adapters of projections tp leaves whole (MLA's latents, k and v above the kv heads, shared and
    routed experts) whole. The old logprobs and entropies, the losses and gradient norms of two GRPO updates (SGD,
    gradient clipped; B is non-zero after the first, so the second moves A) or SFT steps, and the merged weights (what
    the engine and the HF export get) are one process's, and so are the adapters-off (KL reference) logprobs after
    the steps: rtol 1e-5 (fp32 summation order of the all-reduces)."""
    want_first, want_metrics, want, *_ = _run(kind=kind, arch=arch, lora=lora)
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.equal(want[o_proj], _model(arch).state_dict()[o_proj])  # the adapters moved the merged weights
    results = run_ranks(_rank, world, tp, cp, ep, kind, arch, sp, lora)
    column = "q_b_proj" if arch == "deepseek_v3" else "q_proj"
    for *_, (_, _, _, splits) in results:
        assert splits[f"self_attn.{column}.lora_A"] == Replicate() and splits[f"self_attn.{column}.lora_B"] == Shard(0)
        assert splits["self_attn.o_proj.lora_A"] == Shard(1) and splits["self_attn.o_proj.lora_B"] == Replicate()
        if arch == "deepseek_v3":
            assert splits["self_attn.kv_a_proj_with_mqa.lora_A"] is None  # (the latent's projection: whole)
        if tp == 4:
            assert splits["self_attn.k_proj.lora_A"] is None and splits["self_attn.k_proj.lora_B"] is None
    assert_ranks_match([r[:3] for r in results], want_first, want_metrics, want)


def _lora_stages_rank(rank, world, pp, tp):
    init_parallel_groups(1, tp, pp)
    cfg = actor_cfg(max_tokens_per_micro_batch=24, grad_clip=0.1, lora_rank=4, lora_alpha=8)
    model = Actor(tiny_model(), cfg, torch.device("cpu"), 8)
    use_sgd(model, 0.05)
    first, metrics = first_pass_then_steps(model, _shard(rl_batch()), "rl", ("pg_loss", "grad_norm"))
    return first, metrics, {n: t.clone() for n, t in model.named_weights()}


def test_lora_at_pipeline_and_tensor_parallel_matches_one_process():
    """pp 2 x tp 2 with LoRA on the attention: each stage's adapters split over its tp pair, the merged weights
    gathered from both stages; the numbers are one process's (tolerance as above)."""
    assert_ranks_match(run_ranks(_lora_stages_rank, 4, 2, 2), *_lora_stages_rank(0, 1, 1, 1))


@pytest.mark.parametrize("world,tp,kind", [(2, 1, "rl"), (2, 1, "sft"), (2, 2, "rl"), (4, 2, "rl")])
def test_tied_embeddings_at_data_and_tensor_parallel_match_one_process(world, tp, kind):
    """A dense model whose head is its embedding (tie_word_embeddings, as Qwen3's and Llama's small models): FSDP shards
    the shared weight once, in the root's unit, and under tp each rank's gradient of it sums its share of the head's
    with 1/tp of the embedding's (every tp rank embeds every token)."""
    want_first, want_metrics, want, _ = _run(kind=kind, arch="llama_tied")
    results = run_ranks(_rank, world, tp, 1, 1, kind, "llama_tied")
    assert_ranks_match([r[:3] for r in results], want_first, want_metrics, want)


def test_the_gradient_is_clipped_at_tensor_parallel_as_in_one_process():
    """The clipped steps above clip: the one-process gradient norm is above the 0.1 clip."""
    _, metrics, _, _ = _run()
    assert all(norm > 0.1 for norm in metrics[1::2])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


def run_command(command: str, model_dir, run_dir, *extra: str) -> None:
    """`moeloop sft` or `moeloop rl` (lr 1e-4) of the tiny model with the loop tests' configs and `extra` overrides."""
    if command == "sft":
        run_sft(sft_cfg(model_dir, run_dir, *extra))
    else:
        run_rl(rl_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *extra))


def _loop_rank(rank, world, command, model_dir, run_dir, *extra):
    """Runs the command; returns the tp sizes the trainer split a model over (one a model: the actor's; "sp2": tp 2 with
    sequence parallelism)."""
    import moeloop.train.actor as actor
    splits, apply_tp = [], actor.apply_tp

    def split(model, mesh, sequence_parallel=False):
        splits.append(f"sp{mesh.size()}" if sequence_parallel else mesh.size())
        apply_tp(model, mesh, sequence_parallel)
    actor.apply_tp = split
    try:
        run_command(command, model_dir, run_dir, *extra)
    finally:
        actor.apply_tp = apply_tp
    return splits


@pytest.mark.parametrize("world,extra", [
    (2, ()),  # tp 2: each rank generates its share of the prompts, the tp pair trains on both ranks' samples
    (4, ("actor.ppo_mini_batch_size=4",)),  # dp 2 x tp 2
    (2, ("actor.router_replay=R3",)),  # the engine's routes, pooled with the samples, replayed on each rank's MoE rows
    (2, ("rollout.mode=async", "rollout.max_staleness=1")),  # generated on a thread, pooled on the main one
    (2, ("algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=2")),  # kept groups dealt by dp rank
])
def test_the_rl_loop_at_tensor_parallel_matches_one_process(model_dir, tmp_path, world, extra):
    """`moeloop rl` with parallel.tp=2 gives one process's metrics and weights (tolerance as the DP loop tests': Adam
    over all-reduced fp32 gradients)."""
    assert _loop_rank(0, 1, "rl", model_dir, tmp_path / "one", *extra) == []
    assert run_ranks(_loop_rank, world, "rl", model_dir, tmp_path / "tp", *extra, "parallel.tp=2") == [[2]] * world
    assert_same_run(tmp_path / "one", tmp_path / "tp",
                    ("reward/mean", "reward/samples", "pg_loss", "grad_norm", "response/len_mean"))


@pytest.mark.parametrize("world,extra", [
    (2, ()),
    (4, ("actor.ppo_mini_batch_size=4",)),  # dp 2 x tp 2
    (2, ("actor.router_replay=R3",)),  # the engine's routes replayed on each rank's rows
])
def test_the_rl_loop_at_sequence_parallel_matches_one_process(model_dir, tmp_path, world, extra):
    """`moeloop rl` with parallel.tp=2 parallel.sequence_parallel=true gives one process's metrics and weights."""
    assert run_ranks(_loop_rank, world, "rl", model_dir, tmp_path / "sp", *extra, "parallel.tp=2",
                     "parallel.sequence_parallel=true") == [["sp2"]] * world
    assert _loop_rank(0, 1, "rl", model_dir, tmp_path / "one", *extra) == []
    assert_same_run(tmp_path / "one", tmp_path / "sp",
                    ("reward/mean", "reward/samples", "pg_loss", "grad_norm", "response/len_mean"))


LORA_RL = ("actor.lora_rank=4", "actor.lora_alpha=8", "actor.optim.lr=1e-3")
KL = ("actor.use_kl_loss=true", "actor.kl_loss_coef=0.5")  # (the reference: the actor with its adapters off)


@pytest.mark.parametrize("world,extra,layout,splits", [
    (2, KL, (), [2]),
    (4, ("actor.ppo_mini_batch_size=4", "actor.lora_target_modules=[all-linear,experts]"), (), [2]),  # dp 2 x tp 2
    (2, (), ("parallel.sequence_parallel=true",), ["sp2"]),
])
def test_the_lora_rl_loop_at_tensor_parallel_matches_one_process(model_dir, tmp_path, world, extra, layout, splits):
    """`moeloop rl` with actor.lora_rank=4 at parallel.tp=2 gives one process's metrics and weights: the merged ones
    it syncs to the engine and exports (the adapted weights moved), and the adapters it writes in peft's format.
    Tolerance as the loop tests' (Adam over all-reduced fp32 gradients; lr 1e-3: at 1e-2 Adam's first steps magnify
    fp32 order to 4e-4 in grad_norm).
    With the KL loss its kl_loss is not compared: the base model's (adapters-off) logprobs of one step's prompt group
    differed by up to 9e-3 at tp 2 (a full fine-tune's kl_loss differs at that step too; not at dp 2: an MoE routing
    near-tie that fp32 order tips, it seems), and at dp 2 x tp 2 that moved the step's grad_norm by 3e-4, so KL is on
    in the first case only (`test_lora_at_tensor_parallel_matches_one_process` compares the adapters-off logprobs)."""
    extra = (*LORA_RL, *extra)
    assert run_ranks(_loop_rank, world, "rl", model_dir, tmp_path / "tp", *extra, "parallel.tp=2", *layout) == \
        [splits] * world
    assert _loop_rank(0, 1, "rl", model_dir, tmp_path / "one", *extra) == []
    assert_same_run(tmp_path / "one", tmp_path / "tp",
                    ("reward/mean", "reward/samples", "pg_loss", "grad_norm", "response/len_mean"))
    w0, w1 = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "one")
    assert {n for n in w0 if not torch.equal(w0[n], w1[n])} >= {f"model.layers.{i}.self_attn.{p}.weight"
                                                                 for i in range(2) for p in ("q_proj", "o_proj")}
    from safetensors.torch import load_file
    one, split = (load_file(tmp_path / run / "lora_adapter" / "adapter_model.safetensors") for run in ("one", "tp"))
    assert one.keys() == split.keys()  # the adapters alone in peft's format, gathered whole
    for name in one:  # (rtol: with the KL loss, the near-tie's step moved one element of an A by 7e-4 relative)
        torch.testing.assert_close(split[name], one[name], rtol=1e-3, atol=5e-5)


def test_the_rl_loop_above_the_kv_heads_matches_one_process(model_dir, tmp_path):
    """`moeloop rl` with parallel.tp=4, above the tiny model's 2 kv heads (each on 2 ranks), gives one process's
    metrics and weights: the trainer's steps and the whole k and v projections it syncs to the engine."""
    extra = ("actor.ppo_mini_batch_size=4",)  # (each of the 4 ranks generates its share of a mini-batch's prompts)
    assert run_ranks(_loop_rank, 4, "rl", model_dir, tmp_path / "tp", *extra, "parallel.tp=4") == [[4]] * 4
    assert _loop_rank(0, 1, "rl", model_dir, tmp_path / "one", *extra) == []
    assert_same_run(tmp_path / "one", tmp_path / "tp",
                    ("reward/mean", "reward/samples", "pg_loss", "grad_norm", "response/len_mean"))


def test_sft_above_the_kv_heads_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path):
    """`moeloop sft` at tp 4 on 4 ranks, above the tiny model's 2 kv heads (k_proj and v_proj whole on each rank in
    its DCP checkpoint): see `assert_sft_resumes_in_one_process_and_at_dp_2`."""
    assert_sft_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path, _loop_rank, "parallel.tp=4", [[4]] * 4)


def test_sft_at_tensor_parallel_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path):
    """`moeloop sft` at tp 2 (the heads split over the tp pair in its DCP checkpoint): see
    `assert_sft_resumes_in_one_process_and_at_dp_2`."""
    assert_sft_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path, _loop_rank, "parallel.tp=2", [[2], [2]])


def test_lora_sft_at_tensor_parallel_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path):
    """`moeloop sft` with LoRA on the attention and the routed experts at tp 2: its DCP checkpoint holds the adapters
    (whole tensors to DCP: a column split's B and a row split's A in the tp pair's halves) and their Adam state, and
    resumes at tp 1 (one process, and dp 2): see `assert_sft_resumes_in_one_process_and_at_dp_2` (the weights compared
    are the merged export's)."""
    lora = ("actor.lora_rank=4", "actor.lora_alpha=8", "actor.optim.lr=1e-2",
            "actor.lora_target_modules=[all-linear,experts]")
    assert_sft_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path, _loop_rank, "parallel.tp=2", [[2], [2]], lora)
    w0, w1 = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "one")
    assert {n for n in w0 if not torch.equal(w0[n], w1[n])} == {
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                           "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                                           "mlp.experts.gate_up_proj", "mlp.experts.down_proj")}


def assert_sft_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path, loop_rank, layout: str, splits: list,
                                                 more: tuple[str, ...] = ()) -> None:
    """`moeloop sft` at `layout` (overrides, space-separated) on len(splits) ranks for 2 steps gives one process's losses
    (`loop_rank` returns how the trainer split its model on each rank: `splits`); its checkpoint resumes in one process, and at dp 2 in
    another directory's copy, for the 3rd and 4th steps, which end at the straight 4-step run's weights. `more`:
    overrides of every run."""
    train = _conversations(tmp_path / "train.jsonl")
    extra = ("data.prompt_key=messages", "data.max_response_length=16", f"data.train_files=[{train}]",
             "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "data.val_files=[]", *more)
    run_sft(sft_cfg(model_dir, tmp_path / "one", "trainer.steps=4", *extra))
    assert run_ranks(loop_rank, len(splits), "sft", model_dir, tmp_path / "split", "trainer.steps=2", *layout.split(),
                     *extra) == splits
    shutil.copytree(tmp_path / "split", tmp_path / "dp")
    run_sft(sft_cfg(model_dir, tmp_path / "split", "trainer.steps=4", *extra), resume=True)
    run_ranks(_resume_rank, 2, model_dir, tmp_path / "dp", "trainer.steps=4", *extra)
    one = [r["sft_loss"] for r in _rows(tmp_path / "one")]
    for run in ("split", "dp"):
        assert [r["sft_loss"] for r in _rows(tmp_path / run)] == pytest.approx(one, rel=1e-5), run
        w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / run)
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


def _resume_rank(rank, world, model_dir, run_dir, *extra):
    run_sft(sft_cfg(model_dir, run_dir, *extra), resume=True)
    return True


def test_tensor_parallel_refuses_what_it_cannot_split(model_dir, tmp_path):
    with pytest.raises(AssertionError, match=r"parallel.tp=3 must be >= 1 and divide the 2 ranks"):
        run_ranks(_loop_rank, 2, "rl", model_dir, tmp_path / "a", "parallel.tp=3")
    for layout in ("parallel.cp=2", "parallel.pp=2"):
        with pytest.raises(InputError, match=rf"^parallel.sequence_parallel: true with {layout} is not supported"):
            load_config(None, ["model.path=unused", "parallel.tp=2", layout, "parallel.sequence_parallel=true"])
    with pytest.raises(InputError, match=r"^parallel.sequence_parallel=true with parallel.pp=2 is not supported"):
        init_parallel_groups(1, 2, 2, sequence_parallel=True)  # (run time: before any group is made)
    from moeloop.parallel.context import check_heads
    from moeloop.parallel.tensor import check_tp
    with pytest.raises(InputError, match=r"parallel.cp=2 x parallel.tp=4 must divide the model's 4 attention heads"):
        check_heads(4, 2, 4)  # Ulysses splits each tp rank's 1 head over cp 2
    cfg = ModelConfig.from_hf_dict(dict(TINY_HF_CONFIGS["deepseek_v3"]))
    with pytest.raises(InputError, match=r"parallel.tp=3 must divide the model's num_attention_heads=4, "
                                         r"intermediate_size=128$"):
        check_tp(cfg, 3)
    check_tp(ModelConfig.from_hf_dict(dict(TINY_HF_CONFIGS["qwen3_moe"])), 4)  # above the 2 kv heads, a multiple
    cfg = ModelConfig.from_hf_dict({**TINY_HF_CONFIGS["qwen3_moe"], "num_attention_heads": 6, "num_key_value_heads": 2})
    with pytest.raises(InputError, match=r"^parallel.tp=3 must divide the model's num_key_value_heads=2 or be a "
                                         r"multiple of it$"):
        check_tp(cfg, 3)


LORA_EVERYWHERE = ["all-linear", "experts"]


def _weights_rank(rank, world, tp, arch, lora_rank=0):
    init_parallel_groups(1, tp)
    model = build_model(arch, "tiny", seed=0).to(torch.bfloat16)
    lora = {"lora_rank": lora_rank, "lora_target_modules": LORA_EVERYWHERE} if lora_rank else {}
    Actor(model, actor_cfg(**lora), torch.device("cpu"), 8, master_weights=False)
    persistent = [b for name, b in model.named_buffers() if name in model.state_dict()]  # (DeepSeek's router bias)
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
               for p in [*model.parameters(), *persistent])


@pytest.mark.parametrize("world,tp,arch,lora_rank", [
    (2, 2, "qwen3_moe", 0), (4, 2, "qwen3_moe", 0), (2, 1, "qwen3_moe", 0), (2, 2, "deepseek_v3", 0),
    (4, 4, "qwen3_moe", 0),
    (4, 2, "qwen3_moe", 4), (2, 2, "deepseek_v3", 4), (4, 4, "qwen3_moe", 4),  # + fp32 LoRA adapters everywhere
])
def test_the_planner_counts_the_weights_a_tensor_parallel_rank_keeps(world, tp, arch, lora_rank):
    """`moeloop plan`'s weights entry for dp x tp is the mean bytes a rank of the trainer keeps: the heads and dense
    widths split by tp, the embedding, head, norms, router and shared experts whole on each tp rank (and the k and v
    projections, at tp above the kv heads), all sharded by FSDP over dp, and the routed experts over every rank. LoRA's
    adapters as tp splits them: a column split's A whole and B by output, a row split's A by input and B whole, whole
    where the linear is (MLA's latents, shared experts, k and v above the kv heads)."""
    kept = run_ranks(_weights_rank, world, tp, arch, lora_rank)
    lora = [f"actor.lora_rank={lora_rank}", f"actor.lora_target_modules=[{','.join(LORA_EVERYWHERE)}]"]
    cfg = load_config(None, ["model.path=unused", f"parallel.dp={world // tp}", f"parallel.tp={tp}",
                             "model.dtype=bfloat16", "model.fp32_master_weights=false", *(lora if lora_rank else [])])
    cfg.plan.hf_config = hf_config_dict(arch, "tiny")
    stats = model_stats(ModelConfig.from_hf_dict(cfg.plan.hf_config))
    planned = memory_ledger(cfg, stats, Layout.from_section(cfg.parallel)).entries["weights"]
    assert sum(kept) / world == pytest.approx(planned, rel=1e-9)
