"""KL estimators, PPO/GSPO/value losses and loss aggregation against hand computations, plus
micro-batch invariance of loss and gradients (float64, tolerance 1e-12 relative)."""
from __future__ import annotations

import math
import re
import random

import numpy as np
import pytest
import torch

from moeloop.algo.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_denominator
from moeloop.algo.kl import kl_estimate
from moeloop.algo.losses import (PolicyInputs, actor_loss, cispo_loss_T, gspo_loss_T, metrics_to_floats, ppo_clip_loss_T,
                                 reduce_metrics, sapo_loss_T, value_loss)
from moeloop.config.schema import ActorSection, CriticSection
from moeloop.train.packing import global_loss_denominators, pack_samples, split_micro_batches, unpack_response_values
from moeloop.types import Sample

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


@pytest.mark.parametrize("kind,expected", [
    ("k1", [0.5, -1.0]),
    ("k2", [0.125, 0.5]),
    ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
    ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
])
def test_kl_estimators_by_hand(kind, expected):
    kl = kl_estimate(t([-1.0, -2.0]), t([-1.5, -1.0]), kind)
    assert torch.allclose(kl, t(expected), atol=1e-12)


def test_k3_clamped_to_10():
    kl = kl_estimate(t([0.0, -15.0, -1.0]), t([-15.0, 0.0, -1.0]), "k3")
    assert kl.tolist() == [10.0, 10.0, 0.0]
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(t([0.0]), t([0.0]), "k4")


# Two packed sequences: A = 4 tokens (2 in loss), B = 4 tokens (3 in loss)
LOSS = [5.0, 1.0, 2.0, 7.0, 6.0, 3.0, 4.0, 5.0]
MASK = [0, 1, 1, 0, 0, 1, 1, 1]
CU = torch.tensor([0, 4, 8], dtype=torch.int32)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),
    ("seq-mean-token-sum", (3 + 12) / 2),
    ("seq-mean-token-mean", (1.5 + 4.0) / 2),
    ("seq-mean-token-sum-norm", (3 + 12) / (2 * 4)),  # max_response_length = 4
])
def test_aggregation_by_hand(mode, expected):
    denom = loss_denominator(num_loss_tokens=5, num_loss_seqs=2, mode=mode, max_response_length=4)
    loss = t(LOSS)
    loss[0] = float("nan")  # a NaN outside the mask must not leak
    assert math.isclose(float(aggregate_loss(loss, t(MASK), CU, mode, denom)), expected, rel_tol=1e-12)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        loss_denominator(1, 1, "sum")
    with pytest.raises(ValueError, match="max_response_length"):
        loss_denominator(1, 1, "seq-mean-token-sum-norm")


def test_ppo_clip_and_dual_clip_branches():
    ratio = [1.1, 1.5, 0.5, 0.5, 2.0, 4.0, 1.0]
    adv = t([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -2.0])
    logp = t([math.log(r) for r in ratio]).requires_grad_()
    loss_T, _ = ppo_clip_loss_T(logp, torch.zeros(7, dtype=F64), adv, 0.2, 0.28, 3.0)
    # in range | clipped high (1.28) | A>0 low ratio unclipped | clipped low (0.8) | A<0 no dual | dual -> 3 | A=-2
    expected = [-1.1, -1.28, -0.5, 0.8, 2.0, 3.0, 2.0]
    assert torch.allclose(loss_T, t(expected), atol=1e-12)
    loss_T.sum().backward()
    assert torch.allclose(logp.grad, t([-1.1, 0.0, -0.5, 0.0, 2.0, 0.0, 2.0]), atol=1e-12)  # d(-A r)/dlogp = -A r
    no_dual, _ = ppo_clip_loss_T(logp.detach(), torch.zeros(7, dtype=F64), adv, 0.2, 0.28, None)
    assert float(no_dual[5]) == pytest.approx(4.0)

    cfg = ActorSection(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    inputs = PolicyInputs(logp.detach(), torch.zeros(7, dtype=F64), adv, torch.ones(7, dtype=F64), torch.tensor([0, 7], dtype=torch.int32))
    loss, m = actor_loss(inputs, cfg, denominator=7.0)
    assert float(loss) == pytest.approx(sum(expected) / 7, rel=1e-12)
    assert (m["pg_clipfrac_high"], m["pg_clipfrac_low"], m["pg_clipfrac_dual"]) == pytest.approx((1 / 7, 1 / 7, 1 / 7))
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratio) / 7)
    _, lazy = actor_loss(inputs, cfg, denominator=7.0, host_metrics=False)  # device scalars: no host sync
    assert isinstance(lazy["pg_loss"], torch.Tensor) and metrics_to_floats(lazy) == m
    _, none_masked = actor_loss(PolicyInputs(logp.detach(), torch.zeros(7, dtype=F64), adv, torch.zeros(7, dtype=F64),
                                             inputs.cu_seqlens), cfg, denominator=7.0)
    assert none_masked["ppo_kl"] == 0.0 and none_masked["num_loss_tokens"] == 0.0


def test_gspo_sequence_ratio_by_hand():
    # seq A: log-ratios 0.2, 0.4 (A=+1); seq B: 0.1, -0.1, 0.3 (A=-1) + one masked token with log-ratio 5
    logp = t([0.2, 0.4, 0.1, -0.1, 0.3, 5.0]).requires_grad_()
    adv, mask = t([1, 1, -1, -1, -1, -1]), t([1, 1, 1, 1, 1, 0])
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    loss_T, ratio_T = gspo_loss_T(logp, torch.zeros(6, dtype=F64), adv, mask, cu, 0.2, 0.28)
    s_a, s_b = math.exp(0.3), math.exp(0.1)  # geometric means of the token ratios
    assert torch.allclose(ratio_T[:5], t([s_a, s_a, s_b, s_b, s_b]), atol=1e-12)
    assert torch.allclose(loss_T[:5], t([-1.28, -1.28, s_b, s_b, s_b]), atol=1e-12)  # A clipped at 1+0.28
    denom = loss_denominator(5, 2, "seq-mean-token-mean")
    loss = aggregate_loss(loss_T, mask, cu, "seq-mean-token-mean", denom)
    assert loss.item() == pytest.approx((-1.28 + s_b) / 2, rel=1e-12)
    loss.backward()  # token form: d/dlogp_t = -A * s_i (unclipped), then / (3 tokens * 2 seqs)
    assert torch.allclose(logp.grad, t([0, 0, s_b / 6, s_b / 6, s_b / 6, 0]), atol=1e-12)


def test_truncated_importance_sampling_by_hand():
    """tis_cap: each token's PPO loss times min(pi_old / pi_rollout, cap), with no gradient through the weight."""
    old = t([-1.0, -2.0, -0.5, -1.0])
    rollout = t([-1.0 + math.log(2.0), -2.0 - math.log(1.5), -0.5 - 3.0, -1.0])  # weights 0.5, 1.5, e^3 -> 2, 1
    adv, mask = t([1.0, -1.0, 1.0, 2.0]), t([1, 1, 1, 0])
    logp = (old + t([0.1, 0.0, -0.1, 0.0])).requires_grad_()  # ratios e^0.1, 1, e^-0.1, 1: inside the clip range
    cfg = ActorSection(tis_cap=2.0)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    loss, m = actor_loss(PolicyInputs(logp, old, adv, mask, cu, rollout_logprobs_T=rollout), cfg, denominator=3.0)
    ratio = [math.exp(0.1), 1.0, math.exp(-0.1)]
    w = [0.5, 1.5, 2.0]
    assert float(loss) == pytest.approx(sum(-a * r * wi for a, r, wi in zip([1.0, -1.0, 1.0], ratio, w)) / 3, rel=1e-12)
    assert m["tis_weight"] == pytest.approx(4.0 / 3) and m["tis_capped_frac"] == pytest.approx(1 / 3)
    loss.backward()  # d/dlogp of -A r w = -A r w (w held fixed)
    torch.testing.assert_close(logp.grad, t([-ratio[0] * 0.5 / 3, 1.5 / 3, -ratio[2] * 2.0 / 3, 0.0]))
    plain, _ = actor_loss(PolicyInputs(logp.detach(), old, adv, mask, cu), ActorSection(), denominator=3.0)
    assert float(plain) == pytest.approx(sum(-a * r for a, r in zip([1.0, -1.0, 1.0], ratio)) / 3, rel=1e-12)
    with pytest.raises(ValueError, match="rollout_logprobs_T"):
        actor_loss(PolicyInputs(logp, old, adv, mask, cu), cfg, denominator=3.0)


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    """CISPO: loss -sg(clip(r, 1-low, 1+high)) A log pi; the gradient -w A at every token, also where PPO clips."""
    ratio = [1.1, 1.5, 0.5, 0.05]
    adv = t([1.0, 1.0, -1.0, -2.0])
    old = t([-1.0, -2.0, -0.5, -3.0])
    logp = (old + t([math.log(r) for r in ratio])).requires_grad_()
    loss_T, ratio_T = cispo_loss_T(logp, old, adv, 1.0, 0.28)  # low 1: no lower bound (the paper's setting)
    w = [1.1, 1.28, 0.5, 0.05]
    torch.testing.assert_close(ratio_T, t(ratio))
    torch.testing.assert_close(loss_T, t([-wi * a * lp for wi, a, lp in zip(w, [1.0, 1.0, -1.0, -2.0], logp.tolist())]))
    loss_T.sum().backward()
    torch.testing.assert_close(logp.grad, t([-1.1, -1.28, 0.5, 0.1]))  # PPO would give 0 at the clipped 1.5
    two_sided, _ = cispo_loss_T(logp.detach(), old, adv, 0.2, 0.28)
    assert float(two_sided[3]) == pytest.approx(-0.8 * -2.0 * float(logp[3]))  # weight clamped up to 1 - 0.2
    cfg = ActorSection(policy_loss="cispo", clip_ratio_low=1.0, clip_ratio_high=0.28)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    loss, m = actor_loss(PolicyInputs(logp.detach(), old, adv, torch.ones(4, dtype=F64), cu), cfg, denominator=4.0)
    assert float(loss) == pytest.approx(float(loss_T.sum()) / 4, rel=1e-12)
    assert (m["pg_clipfrac_high"], m["pg_clipfrac_low"], m["pg_clipfrac_dual"]) == pytest.approx((0.25, 0.0, 0.0))
    on_policy, _ = actor_loss(PolicyInputs(old.clone().requires_grad_(), old, adv, torch.ones(4, dtype=F64), cu),
                              cfg, denominator=4.0)
    assert float(on_policy) == pytest.approx(-sum(a * o for a, o in zip(adv.tolist(), old.tolist())) / 4, rel=1e-12)


def test_sapo_soft_gate_by_hand():
    """SAPO: loss -A (4 / tau) sigmoid(tau (r - 1)), tau_pos for A > 0 else tau_neg; at r = 1 its gradient is PPO's."""
    def sig(x):
        return 1 / (1 + math.exp(-x))
    ratio, adv = [1.0, 1.5, 0.7, 1.0], [1.0, 1.0, -1.0, -2.0]
    logp = t([math.log(r) for r in ratio]).requires_grad_()
    loss_T, _ = sapo_loss_T(logp, torch.zeros(4, dtype=F64), t(adv), 1.0, 1.05)
    taus = [1.0, 1.0, 1.05, 1.05]
    expected = [-a * 4 / tau * sig(tau * (r - 1)) for a, r, tau in zip(adv, ratio, taus)]
    torch.testing.assert_close(loss_T, t(expected), rtol=1e-12, atol=1e-12)
    loss_T.sum().backward()  # d/dlogp = -A * 4 sig(1 - sig) * r
    grads = [-a * 4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) * r for a, r, tau in zip(adv, ratio, taus)]
    torch.testing.assert_close(logp.grad, t(grads), rtol=1e-12, atol=1e-12)
    assert float(logp.grad[0]) == pytest.approx(-1.0) and float(logp.grad[3]) == pytest.approx(2.0)  # PPO's -A r
    assert 0 < -float(logp.grad[1]) < 1.5  # at r = 1.5: below PPO's unclipped -A r, above its clipped 0
    cfg = ActorSection(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    loss, _ = actor_loss(PolicyInputs(logp.detach(), torch.zeros(4, dtype=F64), t(adv), t([1, 1, 1, 0]),
                                      torch.tensor([0, 4], dtype=torch.int32)), cfg, denominator=3.0)
    assert float(loss) == pytest.approx(sum(expected[:3]) / 3, rel=1e-12)


def importance_case():
    """Two sequences [3 tokens, 2 tokens]; the last token of each is out of the loss. Token weights pi_old/pi_rollout
    2, 0.25, e^9 (masked) | 3, 7 (masked). Ratios pi/pi_old are 1 (on-policy), so each token's PPO loss is -A."""
    old = t([-1.0, -2.0, -0.5, -1.0, -1.5])
    weights = [2.0, 0.25, math.exp(9.0), 3.0, 7.0]
    rollout = old - t([math.log(w) for w in weights])
    adv, mask = t([1.0, 1.0, 1.0, -2.0, -2.0]), t([1, 1, 0, 1, 0])
    return PolicyInputs(old.clone(), old, adv, mask, torch.tensor([0, 3, 5], dtype=torch.int32),
                        rollout_logprobs_T=rollout)


@pytest.mark.parametrize("mode,floor,expected_w,frac_key,frac", [
    ("token_truncate", 0.5, [2.0, 0.5, None, 2.5], "tis_capped_frac", 2 / 3),  # clamped into [0.5, 2.5]
    ("token_mask", 0.5, [2.0, 0.0, None, 0.0], "tis_masked_frac", 2 / 3),  # 0.25 < floor, 3 > cap
    ("sequence_truncate", 0.0, [0.5, 0.5, None, 2.5], "tis_capped_frac", 1 / 3),  # products 0.5 (loss tokens) and 3
    ("sequence_mask", 0.0, [0.5, 0.5, None, 0.0], "tis_masked_frac", 1 / 3),
])
def test_rollout_importance_weight_modes_by_hand(mode, floor, expected_w, frac_key, frac):
    inputs = importance_case()
    cfg = ActorSection(tis_cap=2.5, tis_mode=mode, tis_floor=floor)
    loss, m = actor_loss(inputs, cfg, denominator=3.0)
    w = [expected_w[0], expected_w[1], expected_w[3]]
    assert float(loss) == pytest.approx((-w[0] - w[1] + 2 * w[2]) / 3, rel=1e-12)
    assert m["tis_weight"] == pytest.approx(sum(w) / 3, rel=1e-12)
    assert m[frac_key] == pytest.approx(frac)


def test_off_policy_sequences_with_negative_advantages_leave_the_loss():
    """OPSM: sequence KL = mean over its loss tokens of (log pi_sampling - log pi). Seq 0 (A > 0) stays whatever its
    KL; seq 1 (A < 0, KL 0.3) leaves at a threshold of 0.2 and stays at 0.4; seq 2 (A < 0, KL 0.1) stays."""
    logp = t([-1.0, -1.0, -2.0, -2.0, -3.0])
    rollout = logp + t([1.0, 1.0, 0.2, 0.4, 0.1])  # seq 0: KL 1.0; seq 1: (0.2 + 0.4) / 2 = 0.3; seq 2: 0.1
    adv, mask = t([1.0, 1.0, -1.0, -1.0, -0.5]), t([1, 1, 1, 1, 1])
    cu = torch.tensor([0, 2, 4, 5], dtype=torch.int32)
    inputs = PolicyInputs(logp.clone().requires_grad_(), logp, adv, mask, cu, rollout_logprobs_T=rollout)
    loss, m = actor_loss(inputs, ActorSection(off_policy_mask_threshold=0.2), denominator=5.0)
    assert float(loss) == pytest.approx((-1 - 1 + 0.5) / 5, rel=1e-12)  # seq 1's two tokens (+1 each) are gone
    assert m["opsm_masked_frac"] == pytest.approx(2 / 5)
    loss.backward()
    torch.testing.assert_close(inputs.logprobs_T.grad, t([-0.2, -0.2, 0.0, 0.0, 0.1]))
    kept, m = actor_loss(inputs, ActorSection(off_policy_mask_threshold=0.4), denominator=5.0)
    assert float(kept) == pytest.approx((-1 - 1 + 1 + 1 + 0.5) / 5, rel=1e-12) and m["opsm_masked_frac"] == 0.0
    no_rollout = PolicyInputs(logp, logp - 1.0, adv, mask, cu)  # the old logprobs stand in: KL -1 everywhere
    assert actor_loss(no_rollout, ActorSection(off_policy_mask_threshold=0.0), 5.0)[1]["opsm_masked_frac"] == 0.0


def test_top_entropy_selection_keeps_its_tokens_in_the_policy_term_only():
    """pg_keep_T zeroes the policy-gradient term of the tokens it drops; KL and entropy keep every token, and the
    denominator is unchanged."""
    logp, ref, ent = t([-1.0, -2.0, -0.5, -1.0]), t([-1.5, -1.0, -0.5, -3.0]), t([0.5, 1.0, 1.5, 2.0])
    adv, keep = t([1.0, -2.0, 3.0, 4.0]), t([0, 1, 1, 0])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    cfg = ActorSection(use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.1, entropy_coeff=0.01)
    loss, m = actor_loss(PolicyInputs(logp, logp.clone(), adv, t([1, 1, 1, 0]), cu, ref, ent, pg_keep_T=keep), cfg, 3.0)
    pg = (2.0 - 3.0) / 3  # tokens 1 and 2 (ratio 1: -A); token 3 is out of the loss mask
    assert m["pg_loss"] == pytest.approx(pg) and m["pg_token_kept_frac"] == pytest.approx(2 / 3)
    assert float(loss) == pytest.approx(pg + 0.1 * (-0.5 / 3) - 0.01 * 1.0, rel=1e-12)


def test_entropy_threshold_is_the_quantile_of_the_loss_tokens():
    from moeloop.train.actor import entropy_threshold
    rng = random.Random(0)
    samples = make_samples(seed=4)
    for s in samples:
        s.old_entropy = [rng.uniform(0, 3) for _ in s.response_ids]
    kept = [e for s in samples if s.in_loss for e, m in zip(s.old_entropy, s.loss_mask) if m]
    assert len(kept) < sum(len(s.response_ids) for s in samples)  # a masked sample and masked tokens are left out
    for top in (0.2, 0.5, 0.9):
        assert entropy_threshold(samples, top) == pytest.approx(float(np.quantile(kept, 1 - top)), rel=1e-12)
        share = sum(e >= entropy_threshold(samples, top) for e in kept) / len(kept)
        assert abs(share - top) <= 1 / len(kept) + 1e-12  # the top fraction, to one token
    assert entropy_threshold([], 0.2) == float("-inf")
    samples[0].old_entropy = None
    with pytest.raises(ValueError, match="old_entropy"):
        entropy_threshold(samples, 0.2)


def test_kl_loss_and_entropy_bonus():
    n = 4
    logp, ref = t([-1.0, -2.0, -0.5, -1.0]), t([-1.5, -1.0, -0.5, -3.0])
    ent = t([0.5, 1.0, 1.5, 2.0])
    inputs = PolicyInputs(logp, logp.clone(), torch.zeros(n, dtype=F64), t([1, 1, 1, 0]),
                          torch.tensor([0, n], dtype=torch.int32), ref_logprobs_T=ref, entropy_T=ent)
    cfg = ActorSection(use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.1, entropy_coeff=0.01)
    loss, m = actor_loss(inputs, cfg, denominator=3.0)
    # pg = 0 (A = 0); kl = (0.5 - 1 + 0)/3; entropy = (0.5 + 1 + 1.5)/3
    assert float(loss) == pytest.approx(0.1 * (-0.5 / 3) - 0.01 * 1.0, rel=1e-12)
    assert m["entropy"] == pytest.approx(1.0) and m["kl_mean"] == pytest.approx(-0.5 / 3)
    with pytest.raises(ValueError, match="ref_logprobs_T"):
        actor_loss(PolicyInputs(logp, logp, logp, t([1, 1, 1, 1]), inputs.cu_seqlens), cfg, 4.0)


def test_value_loss_clipped_by_hand():
    values, old, returns = t([1.0, 2.0, 2.0]), t([0.5, 2.0, 1.0]), t([0.0, 2.5, 3.0])
    # token 1: max(1, 0.7^2) = 1; token 2: 0.25; token 3: max(1, (1.2 - 3)^2 = 3.24) = 3.24 (clipped wins)
    loss, m = value_loss(values, old, returns, t([1, 1, 1]), torch.tensor([0, 3], dtype=torch.int32),
                         CriticSection(cliprange_value=0.2), denominator=3.0)
    assert float(loss) == pytest.approx(0.5 * (1 + 0.25 + 3.24) / 3, rel=1e-12)
    assert m["vf_clipfrac"] == pytest.approx(1 / 3)


# ---- micro-batch invariance ------------------------------------------------------------------

VOCAB = 11


def make_samples(seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(12):
        r = rng.randint(1, 9)
        samples.append(Sample(
            prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))],
            response_ids=[rng.randrange(VOCAB) for _ in range(r)], group_id=i // 4,
            reward_status="masked" if i == 5 else "scored",
            old_logprobs=[-rng.uniform(1.5, 3.5) for _ in range(r)], ref_logprobs=[-rng.uniform(1.5, 3.5) for _ in range(r)],
            advantages=[rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 2.0)] * r,
            loss_mask=[1] * (r - 1) + [rng.randint(0, 1)]))
    return samples


def model_logprobs(weight: torch.Tensor, batch):
    """A fake model: logits of a token = one row of `weight`; returns (logprobs_T, entropy_T)."""
    logp_all = torch.log_softmax(weight[batch.input_ids_T], dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(1, batch.labels_T[:, None])[:, 0], entropy


def run_cut(samples, num_micro: int, cfg: ActorSection):
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, VOCAB, dtype=F64, requires_grad=True)
    denom = global_loss_denominators(samples, cfg.loss_agg_mode, max_response_length=9)
    cuts = split_micro_batches(samples, max_tokens_per_micro_batch=10_000, min_num_micro_batches=num_micro)
    assert len(cuts) == num_micro
    total, token_grads, metrics = 0.0, {}, []
    for idx in cuts:
        batch = pack_samples([samples[i] for i in idx], dtype=F64)
        logp, ent = model_logprobs(weight, batch)
        logp.retain_grad()
        inputs = PolicyInputs(logp, batch.old_logprobs_T, batch.advantages_T, batch.loss_mask_T, batch.cu_seqlens,
                              ref_logprobs_T=batch.ref_logprobs_T, entropy_T=ent, rollout_logprobs_T=batch.rollout_logprobs_T)
        loss, m = actor_loss(inputs, cfg, denom)
        loss.backward()
        total += loss.item()
        metrics.append(m)
        token_grads.update(zip(idx, unpack_response_values(batch, logp.grad)))
    return total, weight.grad.clone(), token_grads, reduce_metrics(metrics)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo", "sapo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_invariance(mode, policy_loss):
    samples = make_samples(seed=1)
    cfg = ActorSection(loss_agg_mode=mode, policy_loss=policy_loss, use_kl_loss=True, kl_loss_coef=0.1,
                       entropy_coeff=0.01, clip_ratio_low=0.2, clip_ratio_high=0.28)
    check_micro_batch_invariance(samples, cfg)


@pytest.mark.parametrize("tis_mode", ["token_mask", "sequence_truncate", "sequence_mask"])
def test_micro_batch_invariance_of_sequence_weights_and_masks(tis_mode):
    """The sequence-level weights and the off-policy mask read whole sequences: a cut never splits one."""
    samples = make_samples(seed=3)
    rng = random.Random(3)
    for s in samples:
        s.response_logprobs = [lp + rng.uniform(-0.6, 0.6) for lp in s.old_logprobs]
    cfg = ActorSection(loss_agg_mode="seq-mean-token-mean", tis_cap=1.5, tis_mode=tis_mode, tis_floor=0.5,
                       off_policy_mask_threshold=0.4)
    ref_m = check_micro_batch_invariance(samples, cfg)
    assert 0 < ref_m["opsm_masked_frac"] < 1
    assert 0 < ref_m.get("tis_masked_frac", ref_m.get("tis_capped_frac")) < 1


def check_micro_batch_invariance(samples, cfg: ActorSection) -> dict[str, float]:
    policy_loss = cfg.policy_loss
    ref_loss, ref_grad, ref_tok, ref_m = run_cut(samples, 1, cfg)
    assert ref_grad.abs().sum() > 0
    if policy_loss == "ppo":
        assert ref_m["pg_clipfrac_high"] + ref_m["pg_clipfrac_low"] > 0  # clipping is exercised
    for num_micro in (3, 7):
        loss, grad, tok, m = run_cut(samples, num_micro, cfg)
        assert math.isclose(loss, ref_loss, rel_tol=1e-12, abs_tol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
        for i in range(len(samples)):
            torch.testing.assert_close(tok[i], ref_tok[i], rtol=1e-12, atol=1e-12)
        for key in ref_m:
            assert math.isclose(m[key], ref_m[key], rel_tol=1e-9, abs_tol=1e-12), key
    return ref_m


def test_masked_sample_takes_no_part_in_loss():
    cfg = ActorSection(use_kl_loss=True, entropy_coeff=0.01)
    samples = make_samples(seed=2)
    loss, grad, tok, _ = run_cut(samples, 3, cfg)
    assert tok[5].abs().sum() == 0
    changed = make_samples(seed=2)
    changed[5].advantages = [100.0] * len(changed[5].advantages)
    changed[5].old_logprobs = [-50.0] * len(changed[5].old_logprobs)
    loss2, grad2, _, _ = run_cut(changed, 3, cfg)
    assert loss == loss2 and torch.equal(grad, grad2)
    changed[5].reward_status = "scored"  # sanity: the same change does matter once the sample is in the loss
    loss3, _, _, _ = run_cut(changed, 3, cfg)
    assert loss3 != loss


@pytest.mark.parametrize("override,message", [
    ("actor.policy_loss=grpo", "actor.policy_loss: must be one of ppo|gspo|cispo|sapo"),
    ("actor.tis_mode=sequence", "actor.tis_mode: must be one of token_truncate|token_mask|sequence_truncate"),
    ("actor.sapo_tau_neg=0", "actor.sapo_tau_neg: must be > 0"),
    ("actor.tis_floor=2.0", "actor.tis_floor: must be below actor.tis_cap (2.0)"),
    ("actor.off_policy_mask_threshold=-1", "actor.off_policy_mask_threshold: must be >= 0"),
])
def test_bad_loss_settings_are_named(override, message):
    from moeloop.config import load_config
    from moeloop.errors import InputError
    with pytest.raises(InputError, match=re.escape(message)):
        load_config(None, ["model.path=m", "actor.tis_cap=2.0", override])


def test_a_bare_off_or_on_reaches_the_switch_fields(tmp_path):
    """YAML reads off / on as bools; the fields whose values are off|on|... take them back as those words."""
    from moeloop.config import load_config
    cfg = load_config(None, ["model.path=m", "actor.router_replay=off", "rollout.async_scheduling=on"])
    assert (cfg.actor.router_replay, cfg.rollout.async_scheduling) == ("off", "on")
    (tmp_path / "c.yaml").write_text("model: {path: m}\nrollout: {async_scheduling: off}\nactor: {router_replay: R3}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.actor.router_replay, cfg.rollout.async_scheduling) == ("R3", "off")
