"""Context parallelism (`parallel.cp`, `moeloop.parallel.context`: Ulysses): a micro-batch's packed stream split over
the cp ranks of a group gives the one-process logprobs, RL update and SFT step, alone and beside data parallelism
(4 ranks = dp 2 x cp 2), and with more ranks than key/value heads (cp 4 over the tiny model's 2: they are repeated).
Tolerance as the DP tests': fp32 summation order of the gathered gradients."""
from dataclasses import replace

import pytest
import torch

from moeloop.config import load_config
from moeloop.errors import InputError
from moeloop.loop.rl import run_rl
from moeloop.loop.sft import run_sft
from moeloop.model.factory import init_model
from moeloop.parallel.context import UlyssesAttention
from moeloop.parallel.groups import dp_rank, dp_size, init_context_parallel
from moeloop.train.actor import Actor
from tests.dist import run_ranks
from tests.test_rl_loop import _cfg as rl_cfg, _rows, _weights
from tests.test_sft import _cfg as sft_cfg
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model, use_sgd


def _shard(samples):
    """This rank's samples: its dp rank's groups (the cp ranks of a group share them)."""
    groups = sorted({s.group_id for s in samples})
    return [s for s in samples if groups.index(s.group_id) % dp_size() == dp_rank()]


def _run(budget: int, cp: int = 1, sft: bool = False):
    """Old logprobs, then 2 SGD steps (GRPO update, or SFT steps) on this rank's share of `rl_batch()`, the first
    update after one with every advantage 0 (nothing to train: the skip's one dummy pass of a 2-token sample, fewer
    rows than ranks); the attention calls counted, with the rows each ran on here."""
    init_context_parallel(cp)
    calls = []
    attend = UlyssesAttention.attend

    def counted(self, layer_idx, q, *args):
        calls.append((q.shape[0], self.num_rows))
        return attend(self, layer_idx, q, *args)

    UlyssesAttention.attend = counted
    try:
        samples = _shard(rl_batch())
        actor = Actor(tiny_model(), actor_cfg(max_tokens_per_micro_batch=budget), torch.device("cpu"), 8)
        use_sgd(actor, 0.05)
        actor.compute_logprobs(samples, "old_logprobs", entropy_field="old_entropy")
        first = {(s.group_id, tuple(s.response_ids)): (s.old_logprobs, s.old_entropy) for s in samples}
        step = actor.sft_step if sft else actor.update
        if not sft:
            actor.update([replace(s, advantages=[0.0] * len(s.advantages)) for s in samples])
        losses = [step(samples)["sft_loss" if sft else "pg_loss"] for _ in range(2)]
    finally:
        UlyssesAttention.attend = attend
    return first, losses, {n: t.clone() for n, t in actor.named_weights()}, calls


def _rank(rank, world, budget, cp, sft):
    return _run(budget, cp, sft)


@pytest.mark.parametrize("world,cp,sft", [(2, 2, False), (4, 2, False), (4, 4, False), (2, 2, True)])
def test_context_parallel_matches_one_process(world, cp, sft):
    want_first, want_losses, want, calls = _run(24, sft=sft)
    assert not calls
    results = run_ranks(_rank, world, 24, cp, sft)
    got_first = {}
    for first, losses, weights, calls in results:
        assert calls and all(rows == -(-total // cp) for rows, total in calls)  # 1/cp of each stream's rows
        got_first.update(first)
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for name, w in want.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)
    assert got_first.keys() == want_first.keys()
    for key, (logprobs, entropy) in want_first.items():
        torch.testing.assert_close(torch.tensor(got_first[key][0]), torch.tensor(logprobs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got_first[key][1]), torch.tensor(entropy), rtol=1e-5, atol=1e-5)


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
])
def test_the_rl_loop_at_context_parallel_matches_one_process(model_dir, tmp_path, command, world, extra):
    """`moeloop rl` with parallel.cp=2 gives one process's metrics and weights (tolerance as the DP loop tests': Adam
    over all-reduced fp32 gradients)."""
    _loop_rank(0, 1, command, model_dir, tmp_path / "one", *extra)
    run_ranks(_loop_rank, world, command, model_dir, tmp_path / "cp", *extra, "parallel.cp=2")
    one, cp = _rows(tmp_path / "one"), _rows(tmp_path / "cp")
    keys = ("reward/mean", "reward/samples", "pg_loss", "response/len_mean")
    assert len(one) == len(cp)
    for r1, r2 in zip(one, cp):
        for key in keys:
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "cp")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


def test_sft_at_context_parallel_matches_one_process_and_its_checkpoint_resumes_in_one(model_dir, tmp_path):
    """`moeloop sft` at cp 2 for 3 steps gives one process's losses; its checkpoint (DCP, sharded over both ranks)
    resumes in one process for the 4th step, which ends at the straight 4-step run's weights."""
    run_sft(sft_cfg(model_dir, tmp_path / "one", "trainer.steps=4"))
    run_ranks(_loop_rank, 2, "sft", model_dir, tmp_path / "cp", "trainer.steps=3", "parallel.cp=2")
    run_sft(sft_cfg(model_dir, tmp_path / "cp", "trainer.steps=4"), resume=True)
    one, cp = _rows(tmp_path / "one"), _rows(tmp_path / "cp")
    assert [r["sft_loss"] for r in cp] == pytest.approx([r["sft_loss"] for r in one], rel=1e-5)
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "cp")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


@pytest.mark.parametrize("extra,message", [
    (("parallel.cp=3",), "parallel.cp=3 must be >= 1 and divide the 2 ranks"),
    (("actor.router_replay=R3",), "does not run with actor.router_replay"),
    (("parallel.ep=2",), "does not run with parallel.ep"),
])
def test_context_parallel_refuses_what_it_does_not_run(model_dir, tmp_path, extra, message):
    with pytest.raises(AssertionError, match=message):
        run_ranks(_loop_rank, 2, "rl", model_dir, tmp_path / "run", "parallel.cp=2", *extra)


def test_the_token_budget_counts_one_ranks_tokens():
    """actor.max_tokens_per_micro_batch is what one rank holds: at parallel.cp=2 a micro-batch packs twice as many, so a
    sequence up to twice the budget fits (and the check says so when it does not)."""
    over = ["model.path=unused", "data.max_prompt_length=64", "data.max_response_length=16"]
    load_config(None, over + ["parallel.cp=2", "actor.max_tokens_per_micro_batch=40"])
    with pytest.raises(InputError, match=r"max_tokens_per_micro_batch=39 x parallel.cp=2 must be >= .* = 80"):
        load_config(None, over + ["parallel.cp=2", "actor.max_tokens_per_micro_batch=39"])
    with pytest.raises(InputError, match=r"max_tokens_per_micro_batch=40 must be >= .* = 80"):
        load_config(None, over + ["actor.max_tokens_per_micro_batch=40"])
