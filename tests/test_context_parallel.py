"""Context parallelism (`parallel.cp`, `moeloop.parallel.context`: Ulysses): a micro-batch's packed stream split over
the cp ranks of a group gives the one-process logprobs, RL update and SFT step, alone and beside data parallelism
(4 ranks = dp 2 x cp 2), and with more ranks than key/value heads (cp 4 over the tiny model's 2: they are repeated).
Tolerance as the DP tests': fp32 summation order of the gathered gradients."""

import pytest
import torch

from moeloop.config import load_config
from moeloop.errors import InputError
from moeloop.loop.rl import run_rl
from moeloop.loop.sft import run_sft
from moeloop.model.factory import init_model
from moeloop.parallel.context import UlyssesAttention
from moeloop.parallel.groups import dp_rank, dp_size, init_parallel_groups
from moeloop.config.schema import CriticSection
from moeloop.parallel.fsdp import full_tensor
from moeloop.train.actor import Actor
from moeloop.train.critic import Critic
from tests.dist import run_ranks
from tests.test_rl_loop import _cfg as rl_cfg, _rows, _rows_of, _weights, assert_same_run
from tests.test_sft import _cfg as sft_cfg, _conversations
from tests.trainer_fixtures import (actor_cfg, assert_ranks_match, first_pass_then_steps, rl_batch, tiny_model,
                                    use_sgd)


def _shard(samples):
    """This rank's samples: its dp rank's groups (the cp ranks of a group share them)."""
    groups = sorted({s.group_id for s in samples})
    return [s for s in samples if groups.index(s.group_id) % dp_size() == dp_rank()]


def _run(budget: int, cp: int = 1, kind: str = "rl", ep: int = 1):
    """On this rank's share of `rl_batch()`: the first pass (the old logprobs and entropies, or the critic's values),
    then 2 SGD steps (GRPO updates, SFT steps or critic updates); a GRPO actor's steps come after an update with
    every advantage 0 (nothing to train: the skip's one dummy pass of a 2-token sample, fewer rows than ranks).
    `kind` "r2" records the routes in the first pass and replays them in the updates; "ep" splits the experts over
    `ep` ranks. Returns the first pass's values by sample, the losses, the weights, and the attention calls with the
    rows each ran on here."""
    init_parallel_groups(cp)
    calls = []
    attend = UlyssesAttention.attend

    def counted(self, layer_idx, q, *args):
        calls.append((q.shape[0], self.num_rows))
        return attend(self, layer_idx, q, *args)

    UlyssesAttention.attend = counted
    try:
        samples = _shard(rl_batch())
        if kind == "critic":
            for s in samples:
                s.returns = [a + 0.5 for a in s.advantages]
            cfg = CriticSection()
            cfg.max_tokens_per_micro_batch, cfg.ppo_mini_batch_size = budget, 4
            model = Critic(tiny_model(), cfg, torch.device("cpu"), 8, master_weights=False)
            use_sgd(model, 0.05)
            model.compute_values(samples)
            first = {(s.group_id, tuple(s.response_ids)): (s.values,) for s in samples}
            losses = [model.update(samples)["critic/vf_loss"] for _ in range(2)]
            weights = {n: full_tensor(t).clone() for n, t in model.model.state_dict().items()}
            return first, losses, weights, calls
        cfg = actor_cfg(max_tokens_per_micro_batch=budget, router_replay="R2" if kind == "r2" else "off",
                        lora_rank=4 if kind == "lora" else 0)
        policy = tiny_model()
        policy.gradient_checkpointing = kind == "lora"  # (the recompute runs the exchanges again in the backward)
        model = Actor(policy, cfg, torch.device("cpu"), 8, ep=ep)
        use_sgd(model, 0.05)
        first, losses = first_pass_then_steps(model, samples, kind)
    finally:
        UlyssesAttention.attend = attend
    return first, losses, {n: t.clone() for n, t in model.named_weights()}, calls


def _rank(rank, world, budget, cp, kind, ep):
    return _run(budget, cp, kind, ep)


@pytest.mark.parametrize("world,cp,kind,ep", [(2, 2, "rl", 1), (4, 2, "rl", 1), (4, 4, "rl", 1), (2, 2, "sft", 1),
                                              (4, 2, "critic", 1), (4, 2, "ep", 2), (2, 2, "r2", 1), (2, 2, "lora", 1)])
def test_context_parallel_matches_one_process(world, cp, kind, ep):
    """cp 4: more ranks than the tiny model's 2 key/value heads (repeated); ep: dp 2 x cp 2 with the experts split over
    2 ranks; r2: routes recorded and replayed; lora: LoRA adapters under activation checkpointing."""
    want_first, want_losses, want, calls = _run(24, kind=kind)
    assert not calls
    results = run_ranks(_rank, world, 24, cp, kind, ep)
    for *_, calls in results:
        assert calls and all(rows == -(-total // cp) for rows, total in calls)  # 1/cp of each stream's rows
    assert_ranks_match([r[:3] for r in results], want_first, want_losses, want)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


def _loop_rank(rank, world, command, model_dir, run_dir, *extra):
    if command == "sft":
        run_sft(sft_cfg(model_dir, run_dir, *extra))
    else:
        run_rl(rl_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *extra))
    return True


@pytest.mark.parametrize("command,world,extra", [
    ("rl", 4, ("actor.ppo_mini_batch_size=4",)),  # dp 2 x cp 2: each rank generates its share of the prompts, a
    # cp group trains on both ranks' samples
    ("rl", 2, ("algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=2")),  # kept groups dealt by dp rank
    ("rl", 2, ("actor.router_replay=R3",)),  # the engine's routes, pooled with the samples, replayed on each rank's rows
    ("rl", 2, ("rollout.mode=async", "rollout.max_staleness=1")),  # generated on a thread, pooled on the main one
])
def test_the_rl_loop_at_context_parallel_matches_one_process(model_dir, tmp_path, command, world, extra):
    """`moeloop rl` with parallel.cp=2 gives one process's metrics and weights (tolerance as the DP loop tests': Adam
    over all-reduced fp32 gradients)."""
    _loop_rank(0, 1, command, model_dir, tmp_path / "one", *extra)
    run_ranks(_loop_rank, world, command, model_dir, tmp_path / "cp", *extra, "parallel.cp=2")
    assert_same_run(tmp_path / "one", tmp_path / "cp",
                    ("reward/mean", "reward/samples", "pg_loss", "response/len_mean"))


def test_sft_at_context_parallel_matches_one_process_and_its_checkpoint_resumes_in_one(model_dir, tmp_path):
    """`moeloop sft` at cp 2 for 3 steps (conversations, held-out loss every 2 steps) gives one process's losses; its
    checkpoint (DCP, sharded over both ranks) resumes in one process for the 4th step, which ends at the straight
    4-step run's weights."""
    train, val = _conversations(tmp_path / "train.jsonl"), _conversations(tmp_path / "val.jsonl", 9)
    extra = ("data.prompt_key=messages", "data.max_response_length=16", f"data.train_files=[{train}]",
             f"data.val_files=[{val}]", "trainer.val_every=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8")
    run_sft(sft_cfg(model_dir, tmp_path / "one", "trainer.steps=4", *extra))
    run_ranks(_loop_rank, 2, "sft", model_dir, tmp_path / "cp", "trainer.steps=3", "parallel.cp=2", *extra)
    run_sft(sft_cfg(model_dir, tmp_path / "cp", "trainer.steps=4", *extra), resume=True)
    one, cp = _rows(tmp_path / "one"), _rows(tmp_path / "cp")
    assert [r["sft_loss"] for r in cp] == pytest.approx([r["sft_loss"] for r in one], rel=1e-5)
    val_one, val_cp = ({r["step"]: r["val/sft_loss"] for r in _rows_of(tmp_path / d / "val.jsonl")} for d in ("one", "cp"))
    assert set(val_one) == {0, 2, 4} and {0, 2, 3, 4} == set(val_cp)
    assert [val_cp[k] for k in (0, 2, 4)] == pytest.approx([val_one[k] for k in (0, 2, 4)], rel=1e-5)
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "cp")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


def test_context_parallel_refuses_a_cp_that_does_not_divide_the_ranks(model_dir, tmp_path):
    with pytest.raises(AssertionError, match="parallel.cp=3 must be >= 1 and divide the 2 ranks"):
        run_ranks(_loop_rank, 2, "rl", model_dir, tmp_path / "run", "parallel.cp=3")


def test_the_token_budget_counts_one_ranks_tokens():
    """actor.max_tokens_per_micro_batch is what one rank holds: at parallel.cp=2 a micro-batch packs twice as many, so a
    sequence up to twice the budget fits (and the check says so when it does not)."""
    over = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16"]
    load_config(None, over + ["parallel.cp=2", "actor.max_tokens_per_micro_batch=40"])
    with pytest.raises(InputError, match=r"max_tokens_per_micro_batch=39 x parallel.cp=2 must be >= .* = 80"):
        load_config(None, over + ["parallel.cp=2", "actor.max_tokens_per_micro_batch=39"])
    with pytest.raises(InputError, match=r"max_tokens_per_micro_batch=40 must be >= .* = 80"):
        load_config(None, over + ["actor.max_tokens_per_micro_batch=40"])
