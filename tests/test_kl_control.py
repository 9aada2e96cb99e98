"""The in-reward KL coefficient: fixed stays, adaptive follows the proportional rule (hand computation), the
shaped rewards use the coefficient given, and bad settings name their field."""
import pytest
import torch

from moeloop.algo.kl_control import KLController
from moeloop.algo.token_rewards import TOKEN_REWARDS_KEY, apply_kl_in_reward, kl_in_reward_sums
from moeloop.config import load_config
from moeloop.config.schema import AlgorithmSection
from moeloop.types import Sample


def test_fixed_controller_keeps_its_coefficient():
    ctrl = KLController(AlgorithmSection(kl_coef=0.3))
    for kl in (0.0, 1.0, 50.0):
        ctrl.update(kl, 64)
    assert ctrl.coef == 0.3


def test_adaptive_controller_by_hand():
    ctrl = KLController(AlgorithmSection(kl_ctrl="adaptive", kl_coef=0.1, kl_target=0.05, kl_horizon=100))
    ctrl.update(0.055, 32)  # error 0.1, inside the clip: x (1 + 0.1 * 32 / 100)
    assert ctrl.coef == pytest.approx(0.1 * 1.032, rel=1e-12)
    ctrl.update(0.5, 32)  # error 9 -> clipped to 0.2
    assert ctrl.coef == pytest.approx(0.1 * 1.032 * 1.064, rel=1e-12)
    ctrl.update(0.0, 50)  # error -1 -> clipped to -0.2: x (1 - 0.2 * 50 / 100)
    assert ctrl.coef == pytest.approx(0.1 * 1.032 * 1.064 * 0.9, rel=1e-12)
    again = KLController(AlgorithmSection(kl_ctrl="adaptive", kl_coef=7.0))
    again.load_state_dict(ctrl.state_dict())
    assert again.coef == ctrl.coef


def _sample(reward, old, ref):
    return Sample(prompt_ids=[1, 2], response_ids=[3] * len(old), loss_mask=[1] * len(old), reward=reward,
                  old_logprobs=old, ref_logprobs=ref)


def test_rewards_are_shaped_with_the_coefficient_given():
    cfg = AlgorithmSection(use_kl_in_reward=True, kl_coef=0.5, kl_penalty="k1")
    old, ref = [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5]  # k1 = old - ref = 0.5, -1.0, 0.0
    s = _sample(2.0, old, ref)
    kl_sum, num_tokens = kl_in_reward_sums([s], cfg, coef=0.2)
    assert (kl_sum, num_tokens) == (pytest.approx(-0.5), 3)
    expected = torch.tensor([0.0, 0.0, 2.0]) - 0.2 * torch.tensor([0.5, -1.0, 0.0])  # the score on the last token
    torch.testing.assert_close(torch.tensor(s.metadata[TOKEN_REWARDS_KEY], dtype=torch.float64), expected.double())
    assert apply_kl_in_reward([s], cfg) == pytest.approx(-0.5 / 3)  # default: cfg.kl_coef
    torch.testing.assert_close(torch.tensor(s.metadata[TOKEN_REWARDS_KEY], dtype=torch.float64),
                               (torch.tensor([0.0, 0.0, 2.0]) - 0.5 * torch.tensor([0.5, -1.0, 0.0])).double())


@pytest.mark.parametrize("override,field", [("algorithm.kl_ctrl=pid", "algorithm.kl_ctrl"),
                                            ("algorithm.kl_target=0", "algorithm.kl_target"),
                                            ("algorithm.kl_horizon=-5", "algorithm.kl_horizon")])
def test_bad_settings_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        load_config(None, ["model.path=m", override])
