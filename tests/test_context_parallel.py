"""Context parallelism (`parallel.cp`, `moeloop.parallel.context`: Ulysses): a micro-batch's packed stream split over
the cp ranks of a group gives the one-process logprobs, RL update and SFT step, alone and beside data parallelism
(4 ranks = dp 2 x cp 2), and with more ranks than key/value heads (cp 4 over the tiny model's 2: they are repeated).
Tolerance as the DP tests': fp32 summation order of the gathered gradients."""
import pytest
import torch

from moeloop.errors import InputError
from moeloop.parallel.context import UlyssesAttention
from moeloop.parallel.groups import dp_rank, dp_size, init_context_parallel
from moeloop.train.actor import Actor
from tests.dist import run_ranks
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model, use_sgd


def _shard(samples):
    """This rank's samples: its dp rank's groups (the cp ranks of a group share them)."""
    groups = sorted({s.group_id for s in samples})
    return [s for s in samples if groups.index(s.group_id) % dp_size() == dp_rank()]


def _run(budget: int, cp: int = 1, sft: bool = False):
    """Old logprobs, then 2 SGD steps (GRPO update, or SFT steps) on this rank's share of `rl_batch()`; the
    attention calls counted, with the rows each ran on here."""
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
