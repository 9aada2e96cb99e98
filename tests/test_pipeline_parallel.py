"""Pipeline parallelism (`parallel.pp`, `moeloop.parallel.pipeline`): the decoder layers split over pp stages give the
one-process logprobs, RL update (gradient clipping on), SFT step and critic update, alone and beside data, tensor,
context and expert parallelism, with a middle stage (DeepSeek-V3, pp 3) and an uneven split. Tolerance as the DP
tests': fp32 summation order of the reduced gradients."""
import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor

from moeloop.config import load_config
from moeloop.config.schema import CriticSection
from moeloop.errors import InputError
from moeloop.loop.rl import run_rl
from moeloop.loop.sft import run_sft
from moeloop.model.config import ModelConfig
from moeloop.model.factory import build_model, hf_config_dict, init_model
from moeloop.parallel import Layout
from moeloop.parallel.groups import init_parallel_groups, pp_rank
from moeloop.plan import memory_ledger, model_stats
from moeloop.train.actor import Actor
from moeloop.train.critic import Critic
from tests.dist import run_ranks
from tests.test_rl_loop import _cfg as rl_cfg, _rows, _weights, assert_same_run
from tests.test_sft import _cfg as sft_cfg, _conversations
from tests.test_tensor_parallel import _model, _shard
from tests.trainer_fixtures import actor_cfg, assert_ranks_match, first_pass_then_steps, rl_batch, use_sgd


def _run(pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1, kind: str = "rl", arch: str = "qwen3_moe",
         first_stage_layers: int = 0):
    """On this rank's share of `rl_batch()`: the old logprobs and entropies (or the critic's values), then 2 SGD steps
    (GRPO updates with the gradient clipped to 0.1, SFT steps, or critic updates); a GRPO actor's steps come after an
    update with every advantage 0. Returns the first pass's values by sample, the step metrics, the whole model's
    weights (`named_weights`: gathered from every stage), and (this rank's stage, the decoder layers it holds, whether
    it holds the embedding and the head)."""
    init_parallel_groups(cp, tp, pp, first_stage_layers)
    samples = _shard(rl_batch())
    if kind == "critic":
        for s in samples:
            s.returns = [a + 0.5 for a in s.advantages]
        cfg = CriticSection()
        cfg.max_tokens_per_micro_batch, cfg.ppo_mini_batch_size = 24, 4
        model = Critic(_model(arch), cfg, torch.device("cpu"), 8, master_weights=False)
        use_sgd(model, 0.05)
        model.compute_values(samples)
        first = {(s.group_id, tuple(s.response_ids)): (s.values,) for s in samples}
        metrics = [model.update(samples)["critic/vf_loss"] for _ in range(2)]
    else:
        cfg = actor_cfg(max_tokens_per_micro_batch=24, grad_clip=0.1)
        model = Actor(_model(arch), cfg, torch.device("cpu"), 8, ep=ep)
        use_sgd(model, 0.05)
        first, metrics = first_pass_then_steps(model, samples, kind, ("pg_loss", "grad_norm"))
    weights = {n: t.clone() for n, t in model.named_weights()}
    layers = sorted(int(name.split(".")[2]) for name, _ in model.model.named_parameters()
                    if name.startswith("model.layers."))
    held = (pp_rank(), sorted(set(layers)), model.model.model.embed_tokens.__class__.__name__,
            model.model.lm_head is not None)
    return first, metrics, weights, held


def _rank(rank, world, pp, tp, cp, ep, kind, arch, first_stage_layers):
    return _run(pp, tp, cp, ep, kind, arch, first_stage_layers)


@pytest.mark.parametrize("world,pp,tp,cp,ep,kind,arch,first", [
    (2, 2, 1, 1, 1, "rl", "qwen3_moe", 0),  # pp alone: one decoder layer a stage
    (4, 2, 1, 1, 1, "rl", "qwen3_moe", 0),  # dp 2 x pp 2
    (2, 2, 1, 1, 1, "sft", "qwen3_moe", 0),
    (2, 2, 1, 1, 1, "critic", "qwen3_moe", 0),
    (3, 3, 1, 1, 1, "rl", "deepseek_v3", 0),  # a middle stage (receives and sends); MLA, the dense layer
    (2, 2, 1, 1, 1, "rl", "deepseek_v3", 2),  # uneven: 2 layers on the first stage, 1 on the last
    (4, 2, 2, 1, 1, "rl", "qwen3_moe", 0),  # pp 2 x tp 2
    (4, 2, 1, 2, 1, "rl", "qwen3_moe", 0),  # pp 2 x cp 2: each cp rank passes its rows to its next stage's
    (4, 2, 1, 1, 2, "rl", "qwen3_moe", 0),  # dp 2 x pp 2 with the experts split over ep 2 within a stage
])
def test_pipeline_parallel_matches_one_process(world, pp, tp, cp, ep, kind, arch, first):
    """Besides the numbers: each rank holds its stage's layers only (the embedding on the first stage, the head on
    the last), and `named_weights` gives every rank the whole model."""
    want_first, want_metrics, want, _ = _run(kind=kind, arch=arch)
    results = run_ranks(_rank, world, pp, tp, cp, ep, kind, arch, first)
    num_layers = _model(arch).cfg.num_layers
    counts = Layout(pp=pp, first_stage_layers=first).stage_layers(num_layers)
    for *_, (stage, layers, embedding, head) in results:
        start = sum(counts[:stage])
        assert layers == list(range(start, start + counts[stage]))
        assert embedding == ("Embedding" if stage == 0 else "StageInput")
        assert head == (stage == pp - 1)
    assert sorted({r[3][0] for r in results}) == list(range(pp))
    assert_ranks_match([r[:3] for r in results], want_first, want_metrics, want)


def test_the_gradient_is_clipped_at_pipeline_parallel_as_in_one_process():
    """The clipped steps above clip: the one-process gradient norm is above the 0.1 clip."""
    _, metrics, _, _ = _run()
    assert all(norm > 0.1 for norm in metrics[1::2])
