"""`mask` fallback end to end: a sample whose reward call keeps failing is masked by the pool, gets no
advantage, is left out of its group's baseline, and does not change the actor's update."""
import torch

from moeloop.algo.advantages import compute_advantages
from moeloop.config.schema import AlgorithmSection
from moeloop.reward import RewardPool
from moeloop.train.actor import Actor
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model, use_sgd


def flaky_reward(sample) -> float:
    if sample.metadata.get("poison"):
        raise RuntimeError("reward service returned 500")
    return float(len(sample.response_ids) % 3)


def _update(samples):
    model = tiny_model()
    actor = Actor(model, actor_cfg(max_tokens_per_micro_batch=30, ppo_mini_batch_size=8), torch.device("cpu"), 8)
    use_sgd(actor, 0.1)
    actor.update(samples)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_masked_sample_is_out_of_baseline_and_loss():
    samples = rl_batch(num_groups=3, n=4, seed=5)
    samples[1].metadata["poison"] = True
    with RewardPool(flaky_reward, concurrency=4, timeout_s=5, retries=1, backoff_s=0.0, fallback="mask") as pool:
        stats = pool.score(samples)
    assert stats.masked == 1 and stats.retried == 1 and samples[1].reward_status == "masked"
    compute_advantages(samples, AlgorithmSection(norm_adv_by_std=False))
    assert all(a == 0 for a in samples[1].advantages)
    group = [s for s in samples if s.group_id == samples[1].group_id and s.in_loss]
    mean = sum(s.reward for s in group) / len(group)  # baseline over the 3 scored samples only
    assert abs(samples[0].advantages[0] - (samples[0].reward - mean)) < 1e-9

    with_masked = _update(samples)
    # the same batch without the masked sample: identical update (token-mean over in-loss tokens)
    without = _update([s for i, s in enumerate(samples) if i != 1])
    for name in with_masked:
        torch.testing.assert_close(with_masked[name], without[name], rtol=1e-6, atol=1e-7)
