"""Advantage estimators, KL-in-reward and DAPO helpers against hand-computed numbers."""
from __future__ import annotations

import math

import pytest

from moeloop.algo.advantages import compute_advantages
from moeloop.algo.dapo import filter_uniform_groups, mask_truncated, overlong_penalty
from moeloop.algo.token_rewards import TOKEN_REWARDS_KEY, apply_kl_in_reward
from moeloop.config.schema import AlgorithmSection
from moeloop.types import Sample


def S(reward: float, group: int, num_resp: int, masked: bool = False, **kw) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[5] * num_resp, reward=reward, group_id=group,
                  reward_status="masked" if masked else "scored", **kw)


def approx(values, expected, tol=1e-9):
    assert len(values) == len(expected)
    assert all(math.isclose(a, b, rel_tol=tol, abs_tol=tol) for a, b in zip(values, expected)), (values, expected)


def grpo_batch() -> list[Sample]:
    # group 0: rewards 1, 0, 0.5 (+ a masked sample with reward 100); group 1: rewards 2, 4; group 2: single 3
    return [S(1.0, 0, 2), S(0.0, 0, 3, loss_mask=[1, 0, 1]), S(0.5, 0, 1), S(100.0, 0, 2, masked=True),
            S(2.0, 1, 1), S(4.0, 1, 2), S(3.0, 2, 1)]


def test_grpo_std_normalised_by_hand():
    samples = compute_advantages(grpo_batch(), AlgorithmSection(adv_estimator="grpo"))
    # group 0: mean 0.5, unbiased std sqrt((0.25+0.25+0)/2) = 0.5; masked reward 100 is ignored
    a = 0.5 / (0.5 + 1e-6)
    approx(samples[0].advantages, [a, a])
    approx(samples[1].advantages, [-a, 0.0, -a])  # loss_mask zero keeps a zero advantage
    approx(samples[2].advantages, [0.0])
    approx(samples[3].advantages, [0.0, 0.0])  # masked: zero
    # group 1: mean 3, std sqrt(2)
    b = 1.0 / (2 ** 0.5 + 1e-6)
    approx(samples[4].advantages, [-b])
    approx(samples[5].advantages, [b, b])
    approx(samples[6].advantages, [3.0 / (1 + 1e-6)])  # single-sample group: mean 0, std 1 (verl)


def test_grpo_with_the_batch_std_by_hand():
    """algorithm.adv_std_scope=batch (TRL's scale_rewards="batch"): each group's centred scores over the unbiased std
    of every in-loss score in the batch (the masked 100 left out)."""
    samples = compute_advantages(grpo_batch(), AlgorithmSection(adv_estimator="grpo", adv_std_scope="batch"))
    scores = [1.0, 0.0, 0.5, 2.0, 4.0, 3.0]
    mean = sum(scores) / 6
    std = (sum((x - mean) ** 2 for x in scores) / 5) ** 0.5  # 1.5411
    approx(samples[0].advantages, [0.5 / (std + 1e-6)] * 2)
    approx(samples[1].advantages, [-0.5 / (std + 1e-6), 0.0, -0.5 / (std + 1e-6)])
    approx(samples[3].advantages, [0.0, 0.0])
    approx(samples[5].advantages, [1.0 / (std + 1e-6)] * 2)
    approx(samples[6].advantages, [3.0 / (std + 1e-6)])  # a single-sample group: mean 0 (verl), the batch's std


def test_dr_grpo_no_std():
    samples = compute_advantages(grpo_batch(), AlgorithmSection(adv_estimator="grpo", norm_adv_by_std=False))
    approx(samples[0].advantages, [0.5, 0.5])
    approx(samples[1].advantages, [-0.5, 0.0, -0.5])
    approx(samples[2].advantages, [0.0])
    approx(samples[4].advantages, [-1.0])
    approx(samples[5].advantages, [1.0, 1.0])


def test_rloo_leave_one_out():
    samples = compute_advantages(grpo_batch(), AlgorithmSection(adv_estimator="rloo"))
    approx(samples[0].advantages, [0.75, 0.75])  # 1 - (0 + 0.5)/2
    approx(samples[1].advantages, [-0.75, 0.0, -0.75])  # 0 - (1 + 0.5)/2
    approx(samples[2].advantages, [0.0])  # 0.5 - (1 + 0)/2
    approx(samples[3].advantages, [0.0, 0.0])
    approx(samples[4].advantages, [-2.0])
    approx(samples[5].advantages, [2.0, 2.0])
    approx(samples[6].advantages, [3.0])


def test_masked_sample_excluded_from_group_baseline():
    base = compute_advantages(grpo_batch(), AlgorithmSection())
    changed = grpo_batch()
    changed[3].reward = -1e6
    changed = compute_advantages(changed, AlgorithmSection())
    assert [s.advantages for s in base] == [s.advantages for s in changed]
    unmasked = grpo_batch()
    unmasked[3].reward_status = "scored"
    unmasked = compute_advantages(unmasked, AlgorithmSection())
    assert unmasked[0].advantages != base[0].advantages  # the test can fail: the sample does matter when in loss


def test_reinforce_pp_discounted_then_whitened():
    samples = [S(1.0, 0, 3), S(-1.0, 1, 2), S(50.0, 0, 2, masked=True)]
    compute_advantages(samples, AlgorithmSection(adv_estimator="reinforce_pp", gamma=0.5))
    approx(samples[0].returns, [0.25, 0.5, 1.0])
    approx(samples[1].returns, [-0.5, -1.0])
    # tokens 0.25 0.5 1 -0.5 -1: mean 0.05, unbiased var 2.55/4 = 0.6375
    std = math.sqrt(0.6375 + 1e-8)
    approx(samples[0].advantages, [0.2 / std, 0.45 / std, 0.95 / std])
    approx(samples[1].advantages, [-0.55 / std, -1.05 / std])
    approx(samples[2].advantages, [0.0, 0.0])


def test_kl_in_reward_then_reinforce_pp_returns():
    s = S(1.0, 0, 3, old_logprobs=[-1.0, -2.0, -1.0], ref_logprobs=[-1.5, -2.0, -0.5])
    cfg = AlgorithmSection(adv_estimator="reinforce_pp", use_kl_in_reward=True, kl_coef=0.1, kl_penalty="k1")
    mean_kl = apply_kl_in_reward([s], cfg)
    approx([mean_kl], [0.0])  # k1 = 0.5, 0, -0.5
    approx(s.metadata[TOKEN_REWARDS_KEY], [-0.05, 0.0, 1.05])
    apply_kl_in_reward([s], cfg)  # idempotent: recomputed from the score, not compounded
    approx(s.metadata[TOKEN_REWARDS_KEY], [-0.05, 0.0, 1.05])
    compute_advantages([s], cfg)
    approx(s.returns, [1.0, 1.05, 1.05])  # gamma = 1


def test_kl_in_reward_changes_grpo_score():
    a = S(1.0, 0, 2, old_logprobs=[-1.0, -1.0], ref_logprobs=[-2.0, -2.0])  # k1 = 1 per token
    b = S(1.0, 0, 2, old_logprobs=[-1.0, -1.0], ref_logprobs=[-1.0, -1.0])
    cfg = AlgorithmSection(use_kl_in_reward=True, kl_coef=0.5, norm_adv_by_std=False)
    apply_kl_in_reward([a, b], cfg)
    compute_advantages([a, b], cfg)  # scores 1 - 0.5*2 = 0 and 1: mean 0.5
    approx(a.advantages, [-0.5, -0.5])
    approx(b.advantages, [0.5, 0.5])


def test_reinforce_pp_baseline():
    samples = [S(1.0, 0, 2), S(0.0, 0, 1), S(2.0, 1, 1), S(9.0, 1, 3, masked=True)]
    compute_advantages(samples, AlgorithmSection(adv_estimator="reinforce_pp_baseline"))
    # centred: 0.5 0.5 | -0.5 | 2 (single in-loss sample: no baseline); mean 0.625, var 3.1875/3
    std = math.sqrt(1.0625 + 1e-8)
    approx(samples[0].advantages, [-0.125 / std, -0.125 / std])
    approx(samples[1].advantages, [-1.125 / std])
    approx(samples[2].advantages, [1.375 / std])
    approx(samples[3].advantages, [0.0, 0.0, 0.0])


def test_remax_subtracts_the_greedy_reward():
    """ReMax: return minus the prompt's greedy reward at every counted token (gamma 1: the return is the reward);
    gamma 0.5 discounts the outcome reward back from the last token; no baseline, or a masked sample: zero."""
    samples = [S(1.0, 0, 2, baseline=0.25), S(0.0, 0, 3, baseline=0.25, loss_mask=[1, 0, 1]), S(2.0, 1, 1),
               S(5.0, 2, 2, masked=True, baseline=1.0)]
    compute_advantages(samples, AlgorithmSection(adv_estimator="remax"))
    approx(samples[0].advantages, [0.75, 0.75])
    approx(samples[1].advantages, [-0.25, 0.0, -0.25])
    approx(samples[2].advantages, [0.0])  # its greedy response's reward fell back
    approx(samples[3].advantages, [0.0, 0.0])
    approx(samples[0].returns, [1.0, 1.0])
    discounted = compute_advantages([S(1.0, 0, 3, baseline=0.1)], AlgorithmSection(adv_estimator="remax", gamma=0.5))
    approx(discounted[0].advantages, [0.25 - 0.1, 0.5 - 0.1, 1.0 - 0.1])


def test_gae_by_hand():
    samples = [S(1.0, 0, 3, values=[0.5, 0.4, 0.2]), S(0.0, 1, 1, values=[0.3]), S(5.0, 2, 2, masked=True)]
    compute_advantages(samples, AlgorithmSection(adv_estimator="gae", gamma=0.9, lam=0.8))
    # t=2: d=1-0.2=0.8; t=1: d=0.9*0.2-0.4=-0.22, A=-0.22+0.72*0.8=0.356; t=0: d=0.9*0.4-0.5=-0.14, A=-0.14+0.72*0.356
    raw = [0.11632, 0.356, 0.8, -0.3]
    approx(samples[0].returns, [0.61632, 0.756, 1.0])
    approx(samples[1].returns, [0.0])
    mean = sum(raw) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 3 + 1e-8)
    approx(samples[0].advantages + samples[1].advantages, [(x - mean) / std for x in raw])
    approx(samples[2].advantages, [0.0, 0.0])


def test_gae_needs_values():
    with pytest.raises(ValueError, match="sample.values"):
        compute_advantages([S(1.0, 0, 2)], AlgorithmSection(adv_estimator="gae"))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="adv_estimator"):
        compute_advantages([S(1.0, 0, 1)], AlgorithmSection(adv_estimator="ppo2"))


def test_filter_uniform_groups():
    samples = [S(1, 0, 1), S(1, 0, 1), S(1, 0, 1),  # all equal: dropped
               S(1, 1, 1), S(0, 1, 1), S(7, 1, 1, masked=True),  # kept, masked member kept too
               S(0, 2, 1), S(0, 2, 1), S(1, 2, 1, masked=True),  # equal once the masked one is ignored: dropped
               S(1, 3, 1)]  # single: dropped
    kept = filter_uniform_groups(samples)
    assert kept == samples[3:6]


def test_overlong_penalty():
    samples = [S(1.0, 0, n) for n in (5, 6, 8, 10)] + [S(1.0, 0, 10, masked=True)]
    overlong_penalty(samples, max_response_length=10, buffer_len=4, factor=1.0)  # expected length 6
    approx([s.reward for s in samples], [1.0, 1.0, 0.5, 0.0, 1.0])
    assert samples[2].reward_info["overlong_penalty"] == -0.5
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(samples, max_response_length=10, buffer_len=0, factor=1.0)


def test_mask_truncated_leaves_the_loss_not_the_baseline():
    """DAPO overlong filtering: a response cut at the length limit loses its loss tokens (and its place in the
    seq-mean denominators) but its reward still sets its group's baseline."""
    from moeloop.train.packing import global_loss_denominators
    samples = [S(1.0, 0, 2, finish_reason="stop"), S(0.0, 0, 3, finish_reason="length"),
               S(0.5, 0, 4, finish_reason="stop", loss_mask=[1, 1, 0, 1])]
    assert mask_truncated(samples) == 1
    assert [s.loss_mask for s in samples] == [None, [0, 0, 0], [1, 1, 0, 1]]
    compute_advantages(samples, AlgorithmSection(adv_estimator="grpo", norm_adv_by_std=False))
    approx(samples[0].advantages, [0.5, 0.5])  # 1 - mean(1, 0, 0.5): the truncated reward is in the mean
    assert global_loss_denominators(samples, "token-mean") == 5  # 2 + 3 loss tokens; none of the truncated one
    assert global_loss_denominators(samples, "seq-mean-token-mean") == 2
