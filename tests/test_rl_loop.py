"""The RL loop end to end on a tiny model: it runs, resumes exactly, DP=2 equals DP=1, and a sample
whose reward fell back under `mask` does not touch the update."""
import json

import pytest
import torch

from moeloop.config import load_config
from moeloop.errors import InputError
from moeloop.loop.rl import run_rl
from moeloop.model.factory import init_model
from moeloop.model.hf_io import load_pretrained
from tests.dist import run_ranks

STEPS = 4


def digit_reward(sample) -> float:
    """Varies across samples of an untrained model, so advantages are non-zero from step one."""
    return sum(ch.isdigit() for ch in sample.response_text) / 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


def _cfg(model_dir, run_dir, *extra, device="cpu"):
    """On CPU by default: these tests hold runs to bitwise equality, which CUDA's fp32 reductions do not give. The
    first 128 of synthetic:arith's 4096 rows (a run draws 16 prompts, 64 at most with refills): encoding all 4096
    took ~0.8 s of each ~2 s run."""
    return load_config(None, [f"trainer.device={device}",
        f"model.path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.steps={STEPS}", "trainer.log=[jsonl]",
        "data.train_files=[synthetic:arith]", "data.train_max_samples=128", "data.max_prompt_length=64", "data.max_response_length=4",
        "data.train_batch_size=4", "rollout.n=4", "reward.fn=tests.test_rl_loop.digit_reward", "actor.optim.lr=1e-3",
        "actor.ppo_mini_batch_size=2", "actor.max_tokens_per_micro_batch=72", "checkpoint.export_hf_every=0",
        "algorithm.norm_adv_by_std=false", *extra])


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keep = ("reward/mean", "response/len_mean", "pg_loss", "grad_norm", "entropy")
    return [{k: r[k] for k in keep if k in r} for r in rows]


def _weights(run_dir):
    return load_pretrained(run_dir / "hf").state_dict()


def assert_same_run(one, other, keys: tuple[str, ...]) -> None:
    """Run `other` logged run `one`'s metrics `keys` at every step and ended at its weights (tolerance as the DP loop
    tests': Adam over all-reduced fp32 gradients, notes/cpu-stack.md)."""
    rows_one, rows_other = _rows(one), _rows(other)
    assert len(rows_one) == len(rows_other)
    for r1, r2 in zip(rows_one, rows_other):
        for key in keys:
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key
    w1, w2 = _weights(one), _weights(other)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


def test_loop_runs_and_pushes_versions(model_dir, tmp_path):
    last = run_rl(_cfg(model_dir, tmp_path / "run"))
    assert last["policy/version"] == STEPS and last["batch/samples"] == 16
    for phase in ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights"):
        assert last[f"time/{phase}"] > 0
    before = load_pretrained(model_dir).state_dict()
    after = _weights(tmp_path / "run")
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it trained


def test_resume_equals_straight_run(model_dir, tmp_path):
    ma, mb = _straight_and_resumed(model_dir, tmp_path, "cpu")
    assert ma == mb
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_on_cuda_matches_straight_run_to_fp32_tolerance(model_dir, tmp_path):
    """On the GPU two identical runs already differ in the last bits (pg_loss -0.01339719444 against -0.01339719817
    at step 1 on the H200), so resume is held to tolerances: the same rewards and lengths, losses within 1e-4, and
    each weight within 5% of how far training moved it (`_weight_drift`)."""
    ma, mb = _straight_and_resumed(model_dir, tmp_path, "cuda")
    assert [(r["reward/mean"], r["response/len_mean"]) for r in ma] == \
        [(r["reward/mean"], r["response/len_mean"]) for r in mb]
    for ra, rb in zip(ma, mb, strict=True):
        for key in ("pg_loss", "grad_norm", "entropy"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key
    assert _weight_drift(model_dir, tmp_path) <= 0.05


def _straight_and_resumed(model_dir, tmp_path, device) -> tuple[list, list]:
    """STEPS steps straight into tmp_path/a; STEPS/2, then a resume to STEPS, into tmp_path/b; both runs' metrics."""
    run_rl(_cfg(model_dir, tmp_path / "a", device=device))
    run_rl(_cfg(model_dir, tmp_path / "b", f"trainer.steps={STEPS // 2}", device=device))
    run_rl(_cfg(model_dir, tmp_path / "b", device=device), resume=True)
    return _metrics(tmp_path / "a"), _metrics(tmp_path / "b")


def _weight_drift(model_dir, tmp_path) -> float:
    """The largest, over weights, of |w_resumed - w_straight| / |w_straight - w_initial| (Frobenius norms). A norm,
    not an elementwise bound: Adam turns a last-bit difference in a near-zero gradient into a whole step (lr) on
    that element."""
    w0, wa, wb = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "a"), _weights(tmp_path / "b")
    return max(((wb[n] - wa[n]).norm() / (wa[n] - w0[n]).norm().clamp_min(1e-12)).item() for n in wa)


def test_weight_drift_bound_catches_a_resume_that_loses_the_optimizer_state(model_dir, tmp_path, monkeypatch):
    """The CUDA test's weight bound on CPU: an exact resume has drift 0; one whose checkpoint load skips the
    optimizer (Adam's moments start over at step 3) is far above the 5% bound."""
    _straight_and_resumed(model_dir, tmp_path / "exact", "cpu")
    assert _weight_drift(model_dir, tmp_path / "exact") == 0.0
    from moeloop.checkpoint.manager import CheckpointManager
    real_load = CheckpointManager.load
    monkeypatch.setattr(CheckpointManager, "load", lambda self, path, model, optimizer, **kw: real_load(
        self, path, model, None, **kw))
    _straight_and_resumed(model_dir, tmp_path / "lost", "cpu")
    assert _weight_drift(model_dir, tmp_path / "lost") > 0.05


def test_adaptive_kl_in_reward_moves_the_coefficient_and_resumes(model_dir, tmp_path):
    """KL in the reward with the adaptive controller: each step's coefficient is the last one times
    1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon (hand-computed from the logged KL), and a resumed
    run continues from the saved coefficient (same metrics, same weights as a straight run)."""
    extra = ADAPTIVE_KL
    run_rl(_cfg(model_dir, tmp_path / "a", *extra))
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    coefs, kls = [r["kl_in_reward/coef"] for r in rows], [r["kl_in_reward"] for r in rows]
    assert coefs[0] == 0.05
    for i in range(1, STEPS):
        error = min(max(kls[i - 1] / 0.002 - 1, -0.2), 0.2)
        assert coefs[i] == pytest.approx(coefs[i - 1] * (1 + error * 16 / 40), rel=1e-12)
    assert len(set(coefs)) == STEPS  # it moved every step
    run_rl(_cfg(model_dir, tmp_path / "b", *extra, f"trainer.steps={STEPS // 2}"))
    run_rl(_cfg(model_dir, tmp_path / "b", *extra), resume=True)
    rows_b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_in_reward/coef"] for r in rows_b] == coefs
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


ADAPTIVE_KL = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl=adaptive", "algorithm.kl_coef=0.05",
               "algorithm.kl_target=0.002", "algorithm.kl_horizon=40", "algorithm.adv_estimator=reinforce_pp"]


def _kl_rank(rank, world, model_dir, run_dir):
    """(this rank's last-step coefficient, the logged per-step coefficients: rank 0 writes the metrics)."""
    last = run_rl(_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *ADAPTIVE_KL))
    return last["kl_in_reward/coef"], [json.loads(line)["kl_in_reward/coef"]
                                       for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_adaptive_kl_coefficient_is_the_same_on_2_ranks_as_on_1(model_dir, tmp_path):
    """The adaptive KL coefficient moves by the KL over every rank's tokens: both ranks of a DP=2 run hold the
    coefficient a single-rank run of the same global batch holds, at every step."""
    last_one, one = _kl_rank(0, 1, model_dir, tmp_path / "one")
    (last_a, two), (last_b, _) = run_ranks(_kl_rank, 2, model_dir, tmp_path / "two")
    assert len(set(one)) == STEPS  # it moved
    assert last_a == last_b == two[-1]
    assert two == pytest.approx(one, rel=1e-6)


def test_mask_truncated_with_every_response_cut_leaves_the_policy_unchanged(model_dir, tmp_path):
    """With algorithm.mask_truncated, responses that hit the length limit leave the loss: when every response is
    cut (EOS ignored, 4 tokens each), nothing is learned; without it, the same run trains."""
    extra = ["rollout.ignore_eos=true", "trainer.steps=2"]
    run_rl(_cfg(model_dir, tmp_path / "plain", *extra))
    last = run_rl(_cfg(model_dir, tmp_path / "run", "algorithm.mask_truncated=true", *extra))
    assert last["response/clip_ratio"] == 1.0 and last["grad_norm"] == 0.0
    before, after = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "run")
    assert all(torch.equal(before[n], after[n]) for n in before)
    trained = _weights(tmp_path / "plain")
    assert any(not torch.equal(before[n], trained[n]) for n in before)


def _dp_rank(rank, world, model_dir, run_dir):
    run_rl(_cfg(model_dir, run_dir, "actor.optim.lr=1e-4"))
    return True


def test_dp2_matches_dp1(model_dir, tmp_path):
    run_rl(_cfg(model_dir, tmp_path / "one", "actor.optim.lr=1e-4"))
    run_ranks(_dp_rank, 2, model_dir, tmp_path / "two")
    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [m["reward/mean"] for m in m1] == pytest.approx([m["reward/mean"] for m in m2])
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for name in w1:  # tolerance: Adam over all-reduced fp32 gradients (notes/cpu-stack.md)
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


GAE_CRITIC = ["critic.enable=true", "critic.optim.lr=1e-3", "algorithm.lam=0.95", "critic.ppo_mini_batch_size=2",
              "critic.max_tokens_per_micro_batch=72"]
WHITENED = {"reinforce_pp": [], "reinforce_pp_baseline": [], "gae": GAE_CRITIC,
            "grpo": ["algorithm.norm_adv_by_std=true", "algorithm.adv_std_scope=batch"]}  # (the batch's score std)


def _dp_rank_with(rank, world, model_dir, run_dir, *extra):
    run_rl(_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *extra))
    return True


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_dp2_matches_dp1(tmp_path):
    for r1, r2 in zip(_rows(tmp_path / "one"), _rows(tmp_path / "two")):  # reward-pool counts: every rank's
        for key in ("reward/samples", "reward/scored", "reward/scored_rate", "reward/fallen_back_rate"):
            assert r1[key] == r2[key], key
    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [m["pg_loss"] for m in m1] == pytest.approx([m["pg_loss"] for m in m2], rel=1e-4, abs=1e-6)
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for name in w1:  # tolerance: as test_dp2_matches_dp1
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


def test_cispo_with_sequence_weights_and_off_policy_masking_dp2_matches_dp1(model_dir, tmp_path):
    """The newer policy losses run through the loop, their metrics logged, and 2 ranks give 1 rank's update: CISPO
    with sequence-level masked rollout weights and off-policy sequence masking, two epochs so the policy moves."""
    extra = ["actor.policy_loss=cispo", "actor.clip_ratio_low=1.0", "actor.clip_ratio_high=1.0", "actor.ppo_epochs=2",
             "actor.tis_cap=2", "actor.tis_floor=0.5", "actor.tis_mode=sequence_mask",
             "actor.off_policy_mask_threshold=1e-4"]  # thresholds far from fp32 noise (~1e-7), or a mask can flip
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *extra)
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *extra)
    _assert_dp2_matches_dp1(tmp_path)
    rows = _rows(tmp_path / "one")
    assert all(0 <= r["opsm_masked_frac"] <= 1 and 0 <= r["tis_masked_frac"] <= 1 for r in rows)
    assert any(r["opsm_masked_frac"] > 0 for r in rows)  # the second epoch's policy has moved off the sampling one


def test_the_reference_moves_toward_the_actor_and_resumes(model_dir, tmp_path, monkeypatch):
    """actor.ref_sync_steps=2, alpha 0.5: after steps 2 and 4 ref = 0.5 actor + 0.5 ref (the parameters before and
    after the step-4 mix, against the actor's at that moment); a run stopped at step 2 and resumed saves and reloads
    the moved reference, so its metrics equal the straight run's (KL loss on, so the reference shapes every update)."""
    ref_sync = ("actor.use_kl_loss=true", "actor.kl_loss_coef=0.5", "actor.ref_sync_steps=2",
                "actor.ref_sync_alpha=0.5")
    import moeloop.loop.rl as rl_module
    seen, real = [], rl_module.mix_into

    def params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def spy(target, source, alpha):
        before = params(target)
        real(target, source, alpha)
        seen.append((before, params(target), params(source)))
    monkeypatch.setattr(rl_module, "mix_into", spy)
    run_rl(_cfg(model_dir, tmp_path / "a", *ref_sync))
    monkeypatch.undo()
    assert len(seen) == 2  # after steps 2 and 4
    before, after, actor = seen[1]
    for name in after:
        torch.testing.assert_close(after[name], 0.5 * actor[name] + 0.5 * before[name], rtol=1e-6, atol=1e-7)
    assert [r["ref/synced"] for r in _rows(tmp_path / "a")] == [0.0, 1.0, 0.0, 1.0]
    run_rl(_cfg(model_dir, tmp_path / "b", *ref_sync, f"trainer.steps={STEPS // 2}"))
    assert (tmp_path / "b" / "checkpoints" / "ref" / "step_000002" / "meta.json").is_file()
    run_rl(_cfg(model_dir, tmp_path / "b", *ref_sync), resume=True)
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    with pytest.raises(InputError, match="ref_sync_steps=2 moves the reference policy, which only a KL term reads"):
        _cfg(model_dir, tmp_path / "c", "actor.ref_sync_steps=2")


def test_the_reference_moves_on_its_shards_under_dp2(model_dir, tmp_path):
    """Under FSDP each rank mixes its own shards of the reference: 2 ranks give 1 rank's run. The 2-rank run stops
    after step 3 (the reference last ran a forward, moved at step 2) and resumes: its checkpoint holds the moved
    reference's shards, and the resumed run ends as the straight one."""
    ref_sync = ("actor.use_kl_loss=true", "actor.kl_loss_coef=0.5", "actor.ref_sync_steps=2", "actor.ref_sync_alpha=0.5")
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *ref_sync)
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *ref_sync, "trainer.steps=3")
    run_ranks(_dp_rank_resumed, 2, model_dir, tmp_path / "two", *ref_sync)
    _assert_dp2_matches_dp1(tmp_path)
    assert [r["ref/synced"] for r in _rows(tmp_path / "two")] == [0.0, 1.0, 0.0, 1.0]


def _dp_rank_resumed(rank, world, model_dir, run_dir, *extra):
    run_rl(_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *extra), resume=True)
    return True


def test_remax_baselines_are_the_greedy_rewards_and_dp2_matches_dp1(model_dir, tmp_path, monkeypatch):
    """algorithm.adv_estimator=remax: each prompt's baseline is the reward of its greedy response (checked at step 1
    against a greedy generate of the starting model), the mean is logged, and 2 ranks give 1 rank's update."""
    import moeloop.loop.rl as rl_module
    from moeloop.loop.components import build_components
    seen = []
    real = rl_module.compute_advantages
    monkeypatch.setattr(rl_module, "compute_advantages",
                        lambda samples, cfg: seen.append([(s.prompt_ids, s.baseline) for s in samples]) or real(samples, cfg))
    remax = ("algorithm.adv_estimator=remax",)
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *remax)
    c = build_components(_cfg(model_dir, tmp_path / "greedy"), resume=False)
    try:
        prompts = list(dict.fromkeys(tuple(p) for p, _ in seen[0]))
        greedy = c.rollout.generate([c.train[i] for i in range(len(c.train)) if tuple(c.train[i].prompt_ids) in prompts],
                                    c.rollout.params(1, 0.0), 0)
    finally:
        c.finish()
    want = {tuple(g.prompt_ids): digit_reward(g) for g in greedy}
    assert len(want) == len(prompts) == 4 and {tuple(p): b for p, b in seen[0]} == want
    rows = _rows(tmp_path / "one")
    assert rows[0]["reward/baseline_rate"] == pytest.approx(sum(want.values()) / 4)
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *remax)
    _assert_dp2_matches_dp1(tmp_path)


def test_top_entropy_selection_dp2_matches_dp1(model_dir, tmp_path):
    """actor.top_entropy_quantile=0.5: the threshold is taken over every rank's loss tokens (2 ranks give 1 rank's
    update), from the old-logprob pass's entropies, which runs for them although the update is on-policy. (Every
    loss token trains here, so that pg_token_kept_frac covers them all: with actor.skip_zero_advantage it covers the
    trained samples' tokens only.)"""
    extra = ["actor.top_entropy_quantile=0.5", "actor.ppo_mini_batch_size=4", "actor.skip_zero_advantage=false"]
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *extra)
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *extra)
    _assert_dp2_matches_dp1(tmp_path)
    for r in _rows(tmp_path / "one"):
        assert 0.5 <= r["pg_token_kept_frac"] <= 0.6 and r["time/old_log_prob"] > 0


@pytest.mark.parametrize("estimator", list(WHITENED))
def test_batch_whitened_estimators_dp2_match_dp1(model_dir, tmp_path, estimator):
    """REINFORCE++ and GAE whiten advantages over the whole batch, and GRPO with adv_std_scope=batch divides by the
    batch's score std: under DP these statistics are taken over every rank's samples, so 2 ranks give 1 rank's
    update."""
    extra = [f"algorithm.adv_estimator={estimator}", *WHITENED[estimator]]
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *extra)
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *extra)
    _assert_dp2_matches_dp1(tmp_path)


def test_dynamic_sampling_dp2_matches_dp1(model_dir, tmp_path):
    """DAPO dynamic sampling decides over the global batch (which groups to keep, how many prompts to refill, in
    what order), and deals the kept groups to the ranks as a fresh batch is dealt: 2 ranks train on what 1 does.
    digit_reward makes some groups uniform (dropped and refilled) and the 4-prompt batch leaves odd refills."""
    extra = ["algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=3"]
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *extra)
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *extra)
    _assert_dp2_matches_dp1(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["dapo/kept_groups"] == 4 for r in rows)


def _no_reward(sample) -> float:
    return 0.0


def test_dynamic_sampling_with_every_group_filtered_saves_and_goes_on(model_dir, tmp_path):
    """Every group uniform (reward 0): each step's batch is empty, the optimizer never gets a gradient, and the
    checkpoint at step 2 makes DCP initialise the optimizer's state by a step. The run then goes on generating
    (the colocated engine is not left paused by that step) and keeps the model's weights."""
    last = run_rl(_cfg(model_dir, tmp_path / "run", "algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=1",
                       "reward.fn=tests.test_rl_loop._no_reward", "checkpoint.save_every=2", "trainer.steps=3"))
    assert last["policy/version"] == 3 and last["batch/samples"] == 0 and last["dapo/kept_groups"] == 0
    before, after = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "run")
    assert all(torch.equal(before[n], after[n]) for n in before)


def _fails_on_odd_first_tokens(sample) -> float:
    if sample.response_ids[0] % 2:
        raise RuntimeError("reward service returned 500")
    return digit_reward(sample)


def test_fallen_back_rewards_are_reported_on_stderr(model_dir, tmp_path, capsys):
    """Rewards that fail fall back (masked) and the run goes on; each step with any says so on stderr, with the
    count and the first error."""
    last = run_rl(_cfg(model_dir, tmp_path / "run", "reward.fn=tests.test_rl_loop._fails_on_odd_first_tokens",
                       "reward.retries=0", "trainer.steps=2"))
    err = capsys.readouterr().err
    fell = int(last["reward/fallen_back"])
    assert 0 < fell < 16 and last["policy/version"] == 2
    assert f"step 2: {fell} of 16 rewards fell back (reward.fallback=mask); first error: RuntimeError: reward service " \
           "returned 500" in err


def test_console_bar_of_a_resumed_run_counts_from_its_first_step(tmp_path):
    """A run resumed at step 2 of 4 logs steps 3 and 4: its progress bar ends at 4 of 4 (it ended at 2 of 4)."""
    from moeloop.loop.metrics import MetricsLogger
    for opened_at in (2, None):  # the loop's `start_at`, or none (the bar opens at the first step logged)
        logger = MetricsLogger(tmp_path, ["console"], total_steps=4, append=True)
        if opened_at is not None:
            logger.start_at(opened_at)
        for step in (3, 4):
            logger.log(step, {"reward/mean": 0.5})
        assert (logger._bar.n, logger._bar.total) == (4, 4), opened_at
        logger.close()


def test_a_log_sink_without_its_package_names_it(tmp_path, monkeypatch):
    """trainer.log=[wandb] without wandb installed: an error naming the sink and the fix (a bare traceback before)."""
    import importlib
    from moeloop.errors import InputError
    from moeloop.loop.metrics import MetricsLogger
    real = importlib.import_module

    def no_wandb(name, *a, **kw):
        if name == "wandb":
            raise ModuleNotFoundError("No module named 'wandb'")
        return real(name, *a, **kw)
    monkeypatch.setattr(importlib, "import_module", no_wandb)
    with pytest.raises(InputError, match="trainer.log: the wandb sink needs the wandb package .*pip install wandb"):
        MetricsLogger(tmp_path, ["jsonl", "wandb"], total_steps=2)


def test_ppo_with_gae_critic_runs_and_resumes(model_dir, tmp_path):
    extra = ["algorithm.adv_estimator=gae", *GAE_CRITIC]
    last = run_rl(_cfg(model_dir, tmp_path / "a", *extra))
    assert "critic/vf_loss" in last and last["time/values"] > 0 and last["time/update_critic"] > 0
    run_rl(_cfg(model_dir, tmp_path / "b", *extra, f"trainer.steps={STEPS // 2}"))
    run_rl(_cfg(model_dir, tmp_path / "b", *extra), resume=True)
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")


def source_reward(sample) -> float:
    """Easy prompts: always right; of the hard ones, prompts 3 and 4 right at their first sample only."""
    if sample.data_source == "easy":
        return 1.0
    return 1.0 if int(sample.ground_truth) // 2 in (3, 4) and sample.metadata["sample_index"] == 0 else 0.0


def test_validation_accuracy_per_data_source(model_dir, tmp_path):
    """Two held-out sources: each gets its own accuracy (acc/val/<source>) beside the overall one, and pass@k (the
    fraction of prompts any of the k samples solves), on 1 rank and on 2 (each rank scores its share of each
    data.val_batch_size chunk; counts are summed). data.val_max_samples=8 leaves the last two rows out.
    trainer.log_val_generations=8 writes the first 8 held-out generations (by row, then sample) of each validation,
    and trainer.rollout_data_dir each step's samples, every rank's, with their scores and advantages. `moeloop plot`
    draws the held-out curves."""
    val = tmp_path / "val.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "data_source": "easy" if i < 3 or i > 7 else "hard"}
            for i in range(10)]
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = [f"data.val_files=[{val}]", "trainer.val_every=1", "trainer.steps=1", "trainer.val_samples=2",
             "data.val_batch_size=3", "data.val_max_samples=8", "reward.fn=tests.test_rl_loop.source_reward",
             "trainer.log_val_generations=8"]
    expected = {"acc/val": (1.0, 2 / 5, 5 / 8), "acc/val_sampled": (1.0, 2 / 10, 8 / 16),
                "acc/val_pass@2": (1.0, 2 / 5, 5 / 8), "reward/val": (1.0, 2 / 5, 5 / 8),
                "reward/val_sampled": (1.0, 2 / 10, 8 / 16)}  # (rewards of 1 and 0: their mean is the accuracy)
    for world, run_dir in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        dump = f"trainer.rollout_data_dir={run_dir / 'rollouts'}"
        if world == 1:
            run_rl(_cfg(model_dir, run_dir, *extra, dump))
        else:
            run_ranks(_dp_rank_with, 2, model_dir, run_dir, *extra, dump)
        last = [json.loads(line) for line in (run_dir / "val.jsonl").read_text().splitlines()][-1]
        for key, (easy, hard, overall) in expected.items():
            assert (last[f"{key}/easy"], last[f"{key}/hard"], last[key]) == pytest.approx((easy, hard, overall)), (world, key)
        generations = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
        assert [(g["step"], g["index"], g["sample_index"]) for g in generations] == [
            (step, i // 2, i % 2) for step in (0, 1) for i in range(8)], world
        assert [g["score"] for g in generations[:8]] == [1.0] * 7 + [0.0]  # row 3's second sample
        assert all(f"{g['index']}+{g['index']}=" in g["prompt"] for g in generations)
        rollouts = [json.loads(line) for line in (run_dir / "rollouts" / "1.jsonl").read_text().splitlines()]
        assert len(rollouts) == 16 and {r["step"] for r in rollouts} == {1}, world  # 4 prompts x 4 samples
        assert all(r["score"] == 0.0 and isinstance(r["advantage"], float) and r["response"] is not None
                   for r in rollouts)
    # `moeloop plot`: the held-out curves, pass@k among them, from step 0
    from moeloop.loop.plot import curves, plot_run, read_metrics
    one = curves(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "one", "val.jsonl"))
    assert set(one) == {"reward/mean", "acc/train", "acc/val", "acc/val_sampled", "acc/val_pass@2"}
    assert one["acc/val_pass@2"] == ([(0, pytest.approx(5 / 8)), (1, pytest.approx(5 / 8))], "o")
    assert [p.name for p in plot_run(tmp_path / "one")] == ["reward.png", "phases.png"]


def test_critic_warmup_trains_only_the_critic_first(model_dir, tmp_path):
    """trainer.critic_warmup=2: steps 1-2 update the critic alone (the policy and its samples stay the initial
    model's), then the actor trains too."""
    extra = ["algorithm.adv_estimator=gae", *GAE_CRITIC, "trainer.critic_warmup=2", "trainer.steps=2"]
    run_rl(_cfg(model_dir, tmp_path / "warm", *extra))
    rows = _rows(tmp_path / "warm")
    assert all("critic/vf_loss" in r and "pg_loss" not in r for r in rows)
    before, after = load_pretrained(model_dir).state_dict(), _weights(tmp_path / "warm")
    assert all(torch.equal(before[n], after[n]) for n in before)
    run_rl(_cfg(model_dir, tmp_path / "warm", *extra[:-1], "trainer.steps=3"), resume=True)
    assert "pg_loss" in _rows(tmp_path / "warm")[-1]
    assert any(not torch.equal(before[n], w) for n, w in _weights(tmp_path / "warm").items())
    with pytest.raises(ValueError, match="trainer.critic_warmup"):
        _cfg(model_dir, tmp_path / "x", "trainer.critic_warmup=1")  # no critic


def test_critic_learns_returns():
    from tests.trainer_fixtures import rl_batch, tiny_model
    from moeloop.config.schema import CriticSection
    from moeloop.train.critic import Critic
    samples = rl_batch()
    for s in samples:
        s.returns, s.values = [1.5] * len(s.response_ids), [0.0] * len(s.response_ids)
    cfg = CriticSection(enable=True, cliprange_value=100.0, max_tokens_per_micro_batch=24, ppo_mini_batch_size=4)
    cfg.optim.lr = 1e-2
    critic = Critic(tiny_model(), cfg, torch.device("cpu"), 8)
    losses = [critic.update(samples)["critic/vf_loss"] for _ in range(15)]
    assert losses[-1] < 0.1 * losses[0]
    critic.compute_values(samples)
    assert abs(samples[0].values[0] - 1.5) < 0.4


def test_epochs_set_the_rl_step_count(model_dir, tmp_path):
    """trainer.epochs > 0 runs that many passes over the train rows, ceil(epochs * rows / data.train_batch_size) steps,
    as SFT does (RL ignored it and ran trainer.steps). The run directory's config.yaml holds the resolved count."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6)))
    last = run_rl(_cfg(model_dir, tmp_path / "run", f"data.train_files=[{rows}]", "trainer.epochs=1",
                       "trainer.steps=50"))
    assert last["policy/version"] == 2 and len(_rows(tmp_path / "run")) == 2  # 6 rows in batches of 4
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert (saved.trainer.steps, saved.trainer.epochs, saved.data.train_files) == (2, 1, [str(rows)])
    last = run_rl(_cfg(model_dir, tmp_path / "four", f"data.train_files=[{rows}]", "trainer.epochs=1",
                       "data.train_max_samples=4"))  # the first 4 rows: one batch
    assert last["policy/version"] == 1 and len(_rows(tmp_path / "four")) == 1


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl reward function: 1 when every argument arrived as the verl-format row gave it, else 0 (or a crash)."""
    ok = (data_source == "verl/arith" and isinstance(solution_str, str) and ground_truth == extra_info["answer_copy"]
          and extra_info["split"] == "train")
    return {"score": float(ok), "acc": ok}


def test_a_verl_parquet_dataset_and_compute_score_run_as_they_are(model_dir, tmp_path):
    """verl's data layout (chat-message prompts, the answer at reward_model.ground_truth, extra_info) read through
    data.answer_key=reward_model.ground_truth, scored by a verl-style compute_score(data_source, solution_str,
    ground_truth, extra_info) returning a dict: every reward is 1, none falls back (fallback=fail would stop the
    run). The adapter pickles, for reward.executor=process."""
    import pickle

    import pyarrow as pa
    import pyarrow.parquet as pq

    from moeloop.reward.registry import get_reward_fn
    from moeloop.types import Sample
    rows = [{"data_source": "verl/arith", "prompt": [{"role": "user", "content": f"{i}+{i}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "answer_copy": str(2 * i)}} for i in range(8)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    run_rl(_cfg(model_dir, tmp_path / "run", f"data.train_files=[{path}]", "data.answer_key=reward_model.ground_truth",
                "reward.fn=tests.test_rl_loop.verl_compute_score", "reward.fallback=fail", "trainer.steps=2"))
    assert [r["reward/mean"] for r in _rows(tmp_path / "run")] == [1.0, 1.0]
    fn = pickle.loads(pickle.dumps(get_reward_fn("tests.test_rl_loop.verl_compute_score")))
    sample = Sample(prompt_ids=[1], data_source="verl/arith", response_text="4", ground_truth="4",
                    metadata={"extra_info": {"split": "train", "answer_copy": "4"}})
    assert fn(sample) == {"score": 1.0, "acc": True}


def test_resume_from_a_chosen_checkpoint_replays_the_steps_after_it(model_dir, tmp_path):
    """checkpoint.resume_from=<run>/checkpoints/step_000002 in a run that reached step 4: it goes on from step 2
    (actor, critic, optimizer, data cursor), and its logs (validation too: every 3 steps and at the last) and weights
    then equal the straight run's. A folder that is not a checkpoint is named."""
    extra = ["algorithm.adv_estimator=gae", *GAE_CRITIC, "trainer.steps=4", "checkpoint.save_every=2",
             "checkpoint.keep=5", "data.val_files=[synthetic:arith-val]", "data.val_max_samples=4", "trainer.val_every=3",
             "trainer.val_samples=0"]
    run_rl(_cfg(model_dir, tmp_path / "a", *extra))
    run_rl(_cfg(model_dir, tmp_path / "b", *extra))
    run_rl(_cfg(model_dir, tmp_path / "b", *extra, f"checkpoint.resume_from={tmp_path / 'b' / 'checkpoints' / 'step_000002'}"))
    assert [r["step"] for r in _rows(tmp_path / "b")] == [1, 2, 3, 4]
    validated = [[json.loads(line)["step"] for line in (tmp_path / r / "val.jsonl").read_text().splitlines()]
                 for r in ("a", "b")]
    assert validated == [[0, 3, 4], [0, 3, 4]]  # every 3 steps, and at the last
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    from moeloop.errors import InputError
    with pytest.raises(InputError, match=r"checkpoint.resume_from=.*: not a checkpoint"):
        run_rl(_cfg(model_dir, tmp_path / "c", *extra, f"checkpoint.resume_from={tmp_path / 'a'}"))


def test_wandb_gets_the_project_the_run_name_and_the_config(tmp_path, monkeypatch):
    """trainer.log=[wandb]: wandb.init gets trainer.project_name, trainer.experiment_name (or the run directory's
    name) and the resolved config, and each step's metrics go to wandb.log (a stand-in module records the calls)."""
    import sys
    import types

    from moeloop.config import load_config
    from moeloop.loop.metrics import MetricsLogger
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or types.SimpleNamespace(
        log=lambda record, step: calls.append(("log", step, record)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for extra, name in ((["trainer.experiment_name=exp-1"], "exp-1"), ([], "myrun")):
        calls.clear()
        cfg = load_config("examples/tiny.yaml", ["trainer.log=[wandb]", "trainer.project_name=proj",
                                                 f"trainer.run_dir={tmp_path / 'myrun'}", *extra])
        logger = MetricsLogger.for_run(cfg, tmp_path / "myrun", True, append=False)
        logger.log(1, {"reward/mean": 0.5})
        (_, init), log = calls
        assert (init["project"], init["name"], init["dir"]) == ("proj", name, str(tmp_path / "myrun"))
        assert init["config"]["actor"]["optim"]["lr"] == 3e-4 and init["config"]["rollout"]["n"] == 16
        assert log == ("log", 1, {"step": 1, "reward/mean": 0.5})


def test_val_kwargs_set_the_sampled_validations_sampling(model_dir, tmp_path):
    """rollout.val_kwargs.temperature=0: the sampled validation's k samples of a prompt are all the greedy one; by
    default (the training rollout's temperature 1) they differ."""
    extra = ["trainer.steps=0", "trainer.val_every=1", "trainer.val_samples=2", "data.val_files=[synthetic:arith-val]",
             "data.val_max_samples=6", "trainer.log_val_generations=12"]

    def responses(run_dir):
        rows = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
        return [(rows[i]["response"], rows[i + 1]["response"]) for i in range(0, len(rows), 2)]
    run_rl(_cfg(model_dir, tmp_path / "greedy", *extra, "rollout.val_kwargs.temperature=0"))
    run_rl(_cfg(model_dir, tmp_path / "sampled", *extra))
    assert len(responses(tmp_path / "greedy")) == 6 and all(a == b for a, b in responses(tmp_path / "greedy"))
    assert any(a != b for a, b in responses(tmp_path / "sampled"))
    val = json.loads((tmp_path / "greedy" / "val.jsonl").read_text().splitlines()[0])
    assert val["acc/val_sampled"] == val["acc/val"]


def test_repetition_penalty_and_min_p_reach_every_sampling_params(model_dir, tmp_path, monkeypatch):
    """rollout.repetition_penalty and min_p reach the training rollouts, rollout.val_kwargs' (the penalty set there,
    min-p inherited) the sampled validation; the greedy responses take the penalty and no min-p: ReMax's baselines
    the rollout's, the greedy validation the validation's."""
    from moeloop.loop.generation import RolloutWorker
    seen = set()
    real = RolloutWorker.generate

    def spy(self, examples, params, group_base):
        for p in params if isinstance(params, list) else [params]:
            seen.add((p.temperature, p.repetition_penalty, p.min_p))
        return real(self, examples, params, group_base)
    monkeypatch.setattr(RolloutWorker, "generate", spy)
    run_rl(_cfg(model_dir, tmp_path / "run", "trainer.steps=1", "algorithm.adv_estimator=remax",
                "rollout.repetition_penalty=1.3", "rollout.min_p=0.05", "rollout.val_kwargs.repetition_penalty=1.1",
                "trainer.val_every=1", "trainer.val_samples=2", "data.val_files=[synthetic:arith-val]",
                "data.val_max_samples=2"))
    assert seen == {(1.0, 1.3, 0.05), (0.0, 1.3, 0.0), (0.0, 1.1, 0.0), (1.0, 1.1, 0.05)}


def test_each_held_out_row_samples_with_a_seed_of_its_own(model_dir, tmp_path, monkeypatch):
    """The sampled validation gives each held-out row its own seed, from (trainer.seed, the row's index): with one
    seed for all, sample i of every prompt drew the same noise, so the k draws of a decision that barely depends on
    the prompt (call a tool or not) were k draws for the whole held-out set. Split over two generate calls
    (data.val_batch_size=3), the rows keep their seeds."""
    from moeloop.loop.generation import RolloutWorker
    seeds = {}
    real = RolloutWorker.generate

    def spy(self, examples, params, group_base):
        for e, p in zip(examples, params if isinstance(params, list) else [params] * len(examples)):
            if p.temperature > 0:
                seeds.setdefault(e.prompt_text, set()).add(p.seed)
        return real(self, examples, params, group_base)
    monkeypatch.setattr(RolloutWorker, "generate", spy)
    extra = ["trainer.steps=0", "trainer.val_every=1", "trainer.val_samples=2", "data.val_files=[synthetic:arith-val]",
             "data.val_max_samples=6"]
    run_rl(_cfg(model_dir, tmp_path / "one", *extra))
    first, seeds = seeds, {}
    run_rl(_cfg(model_dir, tmp_path / "two", *extra, "data.val_batch_size=3"))
    assert len(first) == 6 and all(len(s) == 1 for s in first.values())
    assert len({s for v in first.values() for s in v}) == 6 and seeds == first


def test_val_before_train_false_skips_the_step_0_validation(model_dir, tmp_path):
    """trainer.val_before_train=false: validations at steps 2 and 4 only; true (the default): step 0 too; a
    validate-only run (trainer.steps=0) validates whatever it says."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(3)))
    extra = (f"data.val_files=[{val}]", "trainer.val_every=2", "trainer.val_samples=0", "reward.fn=arith")
    for flag, want in (("false", [2, 4]), ("true", [0, 2, 4])):
        run_rl(_cfg(model_dir, tmp_path / flag, *extra, f"trainer.val_before_train={flag}"))
        assert [r["step"] for r in _rows_of(tmp_path / flag / "val.jsonl")] == want
    run_rl(_cfg(model_dir, tmp_path / "only", *extra, "trainer.val_before_train=false", "trainer.steps=0"))
    assert [r["step"] for r in _rows_of(tmp_path / "only" / "val.jsonl")] == [0]


def _rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_validation_prints_a_console_line(tmp_path, capsys):
    """With the console sink a validation prints its metrics on a line of its own (step 0's was printed nowhere, so
    an evaluation-only run, trainer.steps=0, showed nothing)."""
    from moeloop.loop.metrics import MetricsLogger
    logger = MetricsLogger(tmp_path, ["console"], total_steps=2)
    logger.start_at(0)
    logger.log(0, {"acc/val": 0.25, "acc/val_pass@4": 0.5}, "val.jsonl")
    logger.close()
    assert "validation at step 0: acc/val=0.25 acc/val_pass@4=0.5" in capsys.readouterr().out


def length_reward(sample) -> float:
    return len(sample.response_text) / 8


def test_reward_fns_sum_their_weighted_scores(model_dir, tmp_path):
    """reward.fns (TRL's reward_funcs + reward_weights): each sample's reward is the weighted sum of its components'
    scores, each component's mean is logged as reward_fn/<name>, and the step's reward mean is their weighted sum.
    Entries that are not {fn, weight, options, name} are named."""
    from moeloop.errors import InputError
    fns = "[{fn: tests.test_rl_loop.digit_reward}, {fn: tests.test_rl_loop.length_reward, weight: 0.5}]"
    run_rl(_cfg(model_dir, tmp_path / "run", f"reward.fns={fns}", "trainer.steps=1",
                f"trainer.rollout_data_dir={tmp_path / 'dump'}"))
    rows = [json.loads(line) for line in (tmp_path / "dump" / "1.jsonl").read_text().splitlines()]
    for r in rows:
        digits, length = sum(ch.isdigit() for ch in r["response"]) / 4, len(r["response"]) / 8
        assert r["reward_info"]["components"] == {"digit_reward": digits, "length_reward": length}
        assert r["score"] == pytest.approx(digits + 0.5 * length)
    (step,) = _rows(tmp_path / "run")
    assert step["reward_fn/length_reward"] == pytest.approx(sum(len(r["response"]) / 8 for r in rows) / len(rows))
    assert step["reward/mean"] == pytest.approx(step["reward_fn/digit_reward"] + 0.5 * step["reward_fn/length_reward"])
    assert step["reward_fn/length_reward"] > 0
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", f"reward.fns={fns}", "trainer.steps=1")  # (sums over ranks)
    (two,) = _rows(tmp_path / "two")
    assert [two[k] for k in ("reward_fn/digit_reward", "reward_fn/length_reward", "reward/mean")] == pytest.approx(
        [step[k] for k in ("reward_fn/digit_reward", "reward_fn/length_reward", "reward/mean")], rel=1e-12)
    for fns, match in (("[{weight: 1}]", r"reward.fns\[0\]: must be an object with a reward function name"),
                       ("[{fn: arith, wieght: 1}]", r"reward.fns\[0\]: unknown keys \['wieght'\]"),
                       ("[{fn: arith}, {fn: arith}]", "a second component named 'arith'")):
        with pytest.raises(InputError, match=match):
            run_rl(_cfg(model_dir, tmp_path / "bad", f"reward.fns={fns}", "trainer.steps=1"))
    with pytest.raises(InputError, match="reward.executor=process: reward.fns runs its sync components in threads"):
        run_rl(_cfg(model_dir, tmp_path / "bad", "reward.fns=[{fn: arith}]", "reward.executor=process"))


def test_a_run_refuses_an_engine_layout_it_cannot_run(model_dir, tmp_path):
    """`parallel.rollout_tp` plans another engine's layout (`moeloop plan`); moeloop's engine holds the whole model on
    each rank, so a run with it set would not be the run planned."""
    with pytest.raises(InputError, match=r"parallel.rollout_tp=2: moeloop's rollout engine holds the whole model on "
                                         r"each rank"):
        run_rl(_cfg(model_dir, tmp_path / "bad", "parallel.rollout_tp=2"))
    assert not (tmp_path / "bad" / "checkpoints").exists()
