"""rollout.mode=async (`loop.rl.RolloutAhead`): step t+1's batch is generated on a thread while step t trains, on
the weights of before that update; each batch is then one version old, the old policy is the sampling one, no batch
is generated ahead across a checkpoint (so resume is exact), and the engine keeps its own weights."""
import threading

import pytest
import torch

from moeloop.errors import InputError
from moeloop.loop import rl
from moeloop.loop.components import build_components
from moeloop.loop.generation import RolloutWorker
from moeloop.model.factory import init_model
from tests.test_rl_loop import STEPS, _cfg, _metrics, _weights

ASYNC = ("rollout.mode=async", "rollout.max_staleness=1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


def _rows(run_dir):
    import json
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_batches_after_the_first_are_generated_on_the_thread_one_version_old(model_dir, tmp_path, monkeypatch):
    threads = []
    generate = RolloutWorker.generate
    def recorded(self, *a, **kw):
        threads.append(threading.current_thread().name)
        return generate(self, *a, **kw)
    monkeypatch.setattr(RolloutWorker, "generate", recorded)
    rl.run_rl(_cfg(model_dir, tmp_path / "async", *ASYNC))
    rows = _rows(tmp_path / "async")
    assert [r["policy/sample_lag"] for r in rows] == [0, 1, 1, 1]
    assert [name.startswith("moeloop-rollout") for name in threads] == [False, True, True, True]
    assert all("time/gen_beside" in r for r in rows[1:]) and "time/gen_beside" not in rows[0]
    assert all(r["time/wait_rollout"] >= 0 for r in rows[:-1])
    # the first step trains on the same batch as a synchronous run; later batches come from older weights
    rl.run_rl(_cfg(model_dir, tmp_path / "sync"))
    sync = _rows(tmp_path / "sync")
    assert [r["policy/sample_lag"] for r in sync] == [0, 0, 0, 0]
    assert (rows[0]["reward/mean"], rows[0]["response/len_mean"]) == (sync[0]["reward/mean"],
                                                                      sync[0]["response/len_mean"])
    assert rows[0]["pg_loss"] == pytest.approx(sync[0]["pg_loss"], abs=1e-5)  # old logprobs: the rollout's
    wa, ws = _weights(tmp_path / "async"), _weights(tmp_path / "sync")
    assert any(not torch.allclose(wa[n], ws[n], atol=1e-6) for n in wa)


def test_old_logprobs_are_the_sampling_policy_s(model_dir, tmp_path, monkeypatch):
    seen = []
    fill = rl.fill_old_logprobs
    monkeypatch.setattr(rl, "fill_old_logprobs",
                        lambda c, cfg, samples, off: fill(c, cfg, samples, off) or seen.append(samples))
    rl.run_rl(_cfg(model_dir, tmp_path / "run", *ASYNC, "trainer.steps=2"))
    assert len(seen) == 2 and all(s.old_logprobs == s.response_logprobs for batch in seen for s in batch)


def test_resume_equals_straight_run(model_dir, tmp_path):
    """A checkpoint every 2 steps: the batch after it is generated in line in both runs, so the resumed run
    repeats the straight one bit for bit."""
    every = "checkpoint.save_every=2"
    rl.run_rl(_cfg(model_dir, tmp_path / "a", *ASYNC, every))
    rl.run_rl(_cfg(model_dir, tmp_path / "b", *ASYNC, every, f"trainer.steps={STEPS // 2}"))
    rl.run_rl(_cfg(model_dir, tmp_path / "b", *ASYNC, every), resume=True)
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    assert [r["policy/sample_lag"] for r in _rows(tmp_path / "a")] == [0, 1, 0, 1]
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_engine_keeps_its_own_weights(model_dir, tmp_path):
    c = build_components(_cfg(model_dir, tmp_path / "run", *ASYNC), resume=False)
    try:
        actor = {n: p.data_ptr() for n, p in c.actor.model.named_parameters()}
        engine = dict(c.engine.model.named_parameters())
        assert engine and all(engine[n].data_ptr() != ptr for n, ptr in actor.items() if n in engine)
    finally:
        c.finish()
    colocated = build_components(_cfg(model_dir, tmp_path / "col"), resume=False)
    try:  # (the default shares them)
        engine = dict(colocated.engine.model.named_parameters())
        assert any(engine[n].data_ptr() == p.data_ptr() for n, p in colocated.actor.model.named_parameters())
    finally:
        colocated.finish()


@pytest.mark.parametrize("extra, field", [(("rollout.max_staleness=0",), "rollout.max_staleness"),
                                          (("algorithm.dynamic_sampling=true",), "algorithm.dynamic_sampling")])
def test_settings_async_cannot_run_are_named(model_dir, tmp_path, extra, field):
    with pytest.raises(InputError, match=field):
        rl.run_rl(_cfg(model_dir, tmp_path / "run", "rollout.mode=async", "rollout.max_staleness=1", *extra))


def _dp_rank(rank, world, model_dir, run_dir, extra):
    rl.run_rl(_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *extra))


def check_dp2_matches_dp1(model_dir, tmp_path, extra):
    """Two gloo ranks train as one rank does (the DP tolerance of tests/test_rl_loop.py), with batches one version
    old from the second step on."""
    from tests.dist import run_ranks
    rl.run_rl(_cfg(model_dir, tmp_path / "one", "actor.optim.lr=1e-4", *extra))
    run_ranks(_dp_rank, 2, model_dir, tmp_path / "two", extra)
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["policy/sample_lag"] for r in two] == [0, 1, 1, 1]
    assert [r["reward/mean"] for r in one] == pytest.approx([r["reward/mean"] for r in two])
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


def test_dp2_matches_dp1(model_dir, tmp_path):
    """Each rank with its own rollout thread."""
    check_dp2_matches_dp1(model_dir, tmp_path, ASYNC)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_on_cuda_runs_one_version_behind(model_dir, tmp_path):
    """On CUDA the rollout thread generates on its own stream (CUDA graphs and all) while the trainer updates."""
    rl.run_rl(_cfg(model_dir, tmp_path / "run", *ASYNC, device="cuda"))
    rows = _rows(tmp_path / "run")
    assert [r["policy/sample_lag"] for r in rows] == [0, 1, 1, 1]
    assert all(torch.isfinite(torch.tensor([r["pg_loss"], r["grad_norm"]])).all() for r in rows)
    before, after = _weights_before(model_dir), _weights(tmp_path / "run")
    assert any(not torch.equal(before[n], after[n].cpu()) for n in before)


def _weights_before(model_dir):
    from moeloop.model.hf_io import load_pretrained
    return load_pretrained(model_dir).state_dict()
