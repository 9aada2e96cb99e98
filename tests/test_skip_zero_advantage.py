"""`actor.skip_zero_advantage`: the update leaves out the samples whose gradient is zero (every loss token's
advantage 0 with no KL or entropy term, or no loss token) and ends where the full update ends: the same weights,
with AdamW's momentum and weight decay applied on a step where nothing is left to train, at 1 and 2 ranks."""
import copy

import pytest
import torch

import moeloop.train.actor as actor_module
from moeloop.train.actor import Actor, dummy_sample
from tests.dist import run_ranks
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model, use_sgd


def _batch():
    """rl_batch's 4 groups of 3; group 0's rewards all equal (advantage 0), group 2's first sample out of the loss."""
    samples = rl_batch()
    for s in samples:
        if s.group_id == 0:
            s.advantages = [0.0] * len(s.response_ids)
    samples[6].loss_mask = [0] * len(samples[6].response_ids)
    return samples


def _packed_spy(monkeypatch) -> list:
    """The samples each micro-batch packs (the dummy of an empty one left out)."""
    packed: list = []
    pack = actor_module.pack_samples

    def spy(samples, *a, **kw):
        packed.append([s for s in samples if s != dummy_sample()])
        return pack(samples, *a, **kw)
    monkeypatch.setattr(actor_module, "pack_samples", spy)
    return packed


def _weights(actor):
    return {n: t.clone() for n, t in actor.named_weights()}


def _update(samples, skip: bool, **over):
    actor = Actor(tiny_model(), actor_cfg(skip_zero_advantage=skip, **over), torch.device("cpu"), 8)
    use_sgd(actor, 0.05)
    metrics = actor.update(samples)
    return metrics, _weights(actor)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_update_trains_only_the_samples_that_move_the_weights(monkeypatch, mode):
    """(Each aggregation's denominator counts the left-out samples: their tokens, or their sequences.)"""
    samples = _batch()
    _, want = _update(samples, skip=False, loss_agg_mode=mode)
    packed = _packed_spy(monkeypatch)
    metrics, got = _update(samples, skip=True, loss_agg_mode=mode)
    trained = [s for part in packed for s in part]
    assert len(trained) == 12 - 4 and all(s.group_id != 0 for s in trained) and samples[6] not in trained
    assert metrics["skipped_samples_frac"] == pytest.approx(4 / 12)
    for name, w in want.items():  # tolerance: fp32 summation order (fewer rows in the products)
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("term", [dict(entropy_coeff=0.01), dict(use_kl_loss=True)])
def test_a_kl_or_entropy_term_keeps_the_zero_advantage_samples(monkeypatch, term):
    samples = _batch()
    for s in samples:
        s.ref_logprobs = [-2.5] * len(s.response_ids)
    packed = _packed_spy(monkeypatch)
    metrics, _ = _update(samples, skip=True, **term)
    trained = [s for part in packed for s in part]
    assert len(trained) == 11 and samples[6] not in trained  # only the sample without a loss token
    assert metrics["skipped_samples_frac"] == pytest.approx(1 / 12)


@pytest.mark.parametrize("trained_before", [True, False])
def test_a_step_with_nothing_to_train_still_steps_adamw(monkeypatch, trained_before):
    """An update whose advantages are all 0 moves the weights as the full update does (AdamW's momentum and weight
    decay on a zero gradient), bit for bit, and packs no sample. After a training step (momentum nonzero) it runs no
    pass: the parameters that pass reached get zeros. As the first update it runs one dummy pass to reach them."""
    flat = rl_batch()
    for s in flat:
        s.advantages = [0.0] * len(s.response_ids)
    results = {}
    for skip in (False, True):
        actor = Actor(tiny_model(), actor_cfg(skip_zero_advantage=skip), torch.device("cpu"), 8)
        actor.optimizer.param_groups[0]["weight_decay"] = 0.1
        if trained_before:
            actor.update(rl_batch())
        packed = _packed_spy(monkeypatch) if skip else []
        metrics = actor.update(flat)
        results[skip] = _weights(actor)
        monkeypatch.undo()
    assert packed == ([] if trained_before else [[]]) and metrics["skipped_samples_frac"] == 1.0
    for name, w in results[False].items():
        torch.testing.assert_close(results[True][name], w, rtol=0, atol=0)


def _steps(samples):
    """Two updates on `_batch()`'s samples, then one on the same samples with every advantage 0."""
    flat = [copy.copy(s) for s in samples]
    for s in flat:
        s.advantages = [0.0] * len(s.response_ids)
    return [samples, samples, flat]


def _dp_rank(rank, world):
    """Rank 0 holds groups 0 and 2: group 0 has nothing to train, so its rank runs fewer passes of its own; at the
    third step no rank has anything to train."""
    samples = _batch()
    mine = [s for s in samples if s.group_id % world == rank]
    actor = Actor(tiny_model(), actor_cfg(max_tokens_per_micro_batch=24), torch.device("cpu"), 8)
    use_sgd(actor, 0.05)
    metrics = [actor.update(batch) for batch in _steps(mine)]
    return [m["skipped_samples_frac"] for m in metrics], _weights(actor)


def test_two_ranks_with_skipped_samples_equal_one_process_without_skipping():
    actor = Actor(tiny_model(), actor_cfg(max_tokens_per_micro_batch=24, skip_zero_advantage=False),
                  torch.device("cpu"), 8)
    use_sgd(actor, 0.05)
    for batch in _steps(_batch()):
        actor.update(batch)
    want = _weights(actor)
    for fracs, weights in run_ranks(_dp_rank, 2):
        assert fracs == [pytest.approx(4 / 12)] * 2 + [1.0]
        for name, w in want.items():  # tolerance: fp32 summation order (all-reduce, fewer rows)
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)
