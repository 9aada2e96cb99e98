"""Multi-step decode (`rollout.decode_steps` = K): a decode-only batch runs K steps per launch with sampling and
input updates on the device. Completions (tokens, logprobs, finish reasons) equal one step per launch, in sync and
async mode, with stops inside a burst, max_tokens and max_model_len limits, preemption and prefix sharing; the runs
really launch K steps at once. The eager CPU path here; tests/test_rollout_cuda.py runs the CUDA graph path."""
import os
import warnings

import pytest
import torch

from moeloop.rollout import SamplingParams
from moeloop.rollout.kv_cache import kv_bytes_per_block
from moeloop.rollout.runner import ModelRunner
from tests.kernels import needs_kernels
from tests.test_rollout_async import same
from tests.test_rollout_engine import GREEDY, make_engine, prompts, teacher_forced_logprobs, tiny_model


@pytest.fixture
def launches(monkeypatch):
    """num_steps of every launch."""
    seen = []
    launch = ModelRunner.launch

    def spy(self, batch, prev=None):
        seen.append(batch.num_steps)
        return launch(self, batch, prev)

    monkeypatch.setattr(ModelRunner, "launch", spy)
    return seen


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_multistep_equals_single_step(launches, async_scheduling):
    model = tiny_model()
    ps = prompts(10, seed=4)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=13, seed=7)  # 13: not a multiple of K
    for params in (GREEDY, sampled):
        ref = make_engine(model, decode_steps=1, async_scheduling=async_scheduling).generate(ps, params)
        launches.clear()
        eng = make_engine(model, decode_steps=4, async_scheduling=async_scheduling)
        out = eng.generate(ps, params)
        same(ref, out)
        assert launches.count(4) >= 2 and set(launches) <= {1, 4}
        assert eng.num_generated_tokens == sum(len(o.response_ids) for o in out)
        assert eng.is_drained and eng.blocks.num_free_blocks == eng.blocks.num_blocks
    for o in out[:4]:  # the logprobs of a burst are the model's, token by token
        ref_lp = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref_lp, atol=1e-5, rtol=0)


def test_multistep_stops_inside_a_burst_drop_what_follows(launches):
    model = tiny_model()
    ps = prompts(12, seed=6)
    free = make_engine(model).generate(ps, SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=2))
    stop = free[0].response_ids[2]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=2, stop_token_ids=(stop,))
    ref = make_engine(model, decode_steps=1).generate(ps, params)
    eng = make_engine(model, decode_steps=5, async_scheduling="on")
    out = eng.generate(ps, params)
    same(ref, out)
    stopped = [o for o in out if o.finish_reason == "stop"]
    assert stopped and all(o.response_ids[-1] == stop and stop not in o.response_ids[:-1] for o in stopped)
    assert 5 in launches
    assert eng.num_generated_tokens == sum(len(o.response_ids) for o in out)


def test_multistep_respects_each_max_tokens_and_max_model_len(launches):
    model = tiny_model()
    ps = [list(range(3, 3 + n)) for n in (5, 9, 14)]
    params = [SamplingParams(temperature=0, max_tokens=30 - len(p)) for p in ps]  # three budgets, one length cap
    ref = make_engine(model, max_model_len=30, decode_steps=1).generate(ps, params)
    out = make_engine(model, max_model_len=30, decode_steps=6, async_scheduling="on").generate(ps, params)
    same(ref, out)
    assert [len(o.prompt_ids) + len(o.response_ids) for o in out] == [30] * 3
    assert all(o.finish_reason == "length" for o in out) and 6 in launches
    assert any(1 < k < 6 for k in launches)  # without CUDA graphs a launch runs what the budgets leave (< K)


def test_multistep_under_a_small_kv_budget_keeps_outputs(launches):
    """Blocks for K positions ahead may not be free: the batch runs one step (or preempts) and outputs stay equal."""
    model = tiny_model()
    ps = prompts(12, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16)
    budget = 15 * kv_bytes_per_block(model.cfg, 4, torch.float32)
    ref = make_engine(model, kv_cache_bytes=budget, decode_steps=1).generate(ps, params)
    eng = make_engine(model, kv_cache_bytes=budget, decode_steps=4, async_scheduling="on")
    out = eng.generate(ps, params)
    same(ref, out)
    assert eng.scheduler.num_preemptions > 0 and 4 in launches and 1 in launches


def test_multistep_group_shares_prompt_blocks(launches):
    model = tiny_model()
    prompt = list(range(3, 3 + 17))  # 4 full blocks of 4 + one partial
    eng = make_engine(model, decode_steps=3)
    out = eng.generate([prompt], SamplingParams(n=8, temperature=1.0, max_tokens=9, seed=1))
    ref = make_engine(model, decode_steps=1).generate([prompt], SamplingParams(n=8, temperature=1.0, max_tokens=9,
                                                                                seed=1))
    same(ref, out)
    assert eng.blocks.num_prefix_hit_blocks == 7 * 4 and 3 in launches
    assert len({tuple(o.response_ids) for o in out}) > 1


def test_decode_steps_config_is_checked():
    from moeloop.config.schema import RolloutSection
    with pytest.raises(ValueError, match="rollout.decode_steps"):
        RolloutSection(decode_steps=-1).check()


def test_multistep_drain_gate_abort_and_requeue(launches):
    """A K-step launch in flight blocks update_weights; drain(abort=True) re-queues its sequences, which after the
    update generate what a fresh engine on the new weights does; abort() of one request mid-burst loses no other."""
    model, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = make_engine(model, decode_steps=4, async_scheduling="on")
    ps = prompts(5, seed=3)
    for p in ps:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=12))
    for _ in range(3):  # prefill, then K-step launches
        engine.step()
    assert 4 in launches and engine._in_flight is not None and engine._in_flight.num_steps == 4
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights(new.state_dict().items(), version=1)
    engine.pause()
    assert engine.drain(abort=True) == [] and engine.is_drained
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # look-ahead blocks returned too
    engine.update_weights(new.state_dict().items(), version=2)
    engine.resume()
    out = []
    while engine.has_unfinished():
        out += engine.step()
    fresh = make_engine(new, decode_steps=1).generate(ps, SamplingParams(temperature=0, max_tokens=12))
    assert sorted(o.response_ids for o in out) == sorted(o.response_ids for o in fresh)
    assert all(o.policy_version == 2 for o in out)

    rid = engine.add_request(ps[0], SamplingParams(n=2, temperature=0, max_tokens=12))
    other = engine.add_request(ps[1], SamplingParams(temperature=0, max_tokens=12))
    rest = []
    for _ in range(3):
        rest += engine.step()
    assert engine._in_flight is not None and engine._in_flight.num_steps == 4
    assert [c.finish_reason for c in engine.abort(rid)] == ["abort"] * 2
    while engine.has_unfinished():
        rest += engine.step()
    assert [c.request_id for c in rest] == [other]
    assert rest[0].response_ids == make_engine(new).generate([ps[1]], SamplingParams(temperature=0,
                                                                                      max_tokens=12))[0].response_ids
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU engine under the Triton interpreter only; "
                    "on a GPU, test_rollout_cuda.py's multi-step test runs the kernel")
@needs_kernels
def test_record_advance_kernel_gives_the_torch_ops_results(monkeypatch, launches):
    """The one-launch record + input update (`_record_advance`, the CUDA path; here under the Triton interpreter)
    gives the same completions as the torch ops, and really runs."""
    from moeloop.rollout import multistep
    model = tiny_model()
    ps = prompts(6, seed=8)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=11, seed=3)
    ref = make_engine(model, decode_steps=1).generate(ps, params)
    calls = []
    launch = multistep._record_advance.__getitem__
    monkeypatch.setattr(multistep, "_kernel_failed", False)
    monkeypatch.setattr(multistep, "kernels_apply", lambda x: True)
    monkeypatch.setattr(multistep, "_record_advance", type("Spy", (), {
        "__getitem__": lambda self, grid: calls.append(grid) or launch(grid)})())
    with warnings.catch_warnings():
        # a failed launch would fall back to the torch ops with this warning
        warnings.filterwarnings("error", message="the multi-step record/advance kernel failed")
        out = make_engine(model, decode_steps=4).generate(ps, params)
    same(ref, out)
    assert calls and 4 in launches and not multistep._kernel_failed


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_multistep_leaves_one_token_prompt_chunks_alone(launches, async_scheduling):
    """A token budget that leaves a prompt a 1-token chunk (mid-prompt, so it does not sample) keeps that batch at
    one step: its next inputs are prompt tokens, not sampled ones (a K-step launch here corrupted the prompt's K/V
    and overran its length)."""
    model = tiny_model()
    params = SamplingParams(temperature=0, max_tokens=8)
    for ps in ([[5, 6], [7, 8], list(range(3, 43))], [[5, 6], [7, 8], [9, 10, 11]]):
        ref = make_engine(model, decode_steps=1, max_num_batched_tokens=3).generate(ps, params)
        out = make_engine(model, decode_steps=4, max_num_batched_tokens=3,
                          async_scheduling=async_scheduling).generate(ps, params)
        same(ref, out)
    assert 4 in launches


def test_multistep_equals_single_step_on_random_configurations(monkeypatch):
    """Seeded random mixes of group size, greedy/sampled, stops, max_tokens, KV budget (preemption), max_num_seqs,
    token budget (chunked prompts), async on/off, K and the step counts a launch may run (any up to K, as without
    CUDA graphs, or only K down to 2, or only K, as with them): completions equal one step per launch and every
    block is returned."""
    import random
    model = tiny_model()
    rng = random.Random(0)
    counts = {"any": lambda K: None, "K..2": lambda K: tuple(range(K, 1, -1)), "K": lambda K: (K,)}
    for trial in range(12):
        kind = rng.choice(sorted(counts))
        monkeypatch.setattr(ModelRunner, "step_counts", property(lambda self: counts[kind](self.decode_steps)))
        ps = prompts(rng.randint(3, 10), seed=trial, max_len=18)
        stop = make_engine(model).generate(ps[:1], SamplingParams(max_tokens=6, seed=trial))[0].response_ids[
            rng.randint(0, 5)]
        params = SamplingParams(n=rng.choice([1, 2, 3]), temperature=rng.choice([0, 1.0]),
                                max_tokens=rng.randint(5, 20), seed=trial, stop_token_ids=(stop,))
        kw = dict(kv_cache_bytes=rng.randint(14, 30) * kv_bytes_per_block(model.cfg, 4, torch.float32),
                  max_num_seqs=rng.choice([4, 8, 16]), max_num_batched_tokens=rng.choice([3, 8, 64]),
                  async_scheduling=rng.choice(["on", "off"]))
        ref = make_engine(model, decode_steps=1, **kw).generate(ps, params)
        eng = make_engine(model, decode_steps=rng.choice([2, 3, 5, 8]), **kw)
        same(ref, eng.generate(ps, params))
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks, (trial, kw)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_multistep_tail_runs_in_the_captured_step_counts(monkeypatch, launches, async_scheduling):
    """With CUDA graphs a launch runs one of the captured step counts (`ModelRunner.step_counts`); with counts 8, 4
    and 2, 15 tokens after the prefill's one run as 8 + 4 + 2 + 1 launches, not 8 and then seven single steps, with
    the completions of one step per launch."""
    monkeypatch.setattr(ModelRunner, "step_counts", property(lambda self: (8, 4, 2)))
    model = tiny_model()
    ps = prompts(3, seed=5)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=1)
    ref = make_engine(model, decode_steps=1, async_scheduling=async_scheduling).generate(ps, params)
    launches.clear()
    out = make_engine(model, decode_steps=8, async_scheduling=async_scheduling).generate(ps, params)
    same(ref, out)
    assert [n for n in launches if n > 1] == [8, 4, 2] and launches.count(1) <= 2  # the prefill, the last step


def test_runner_step_counts_run_a_tail_in_one_launch(monkeypatch, launches):
    """`step_counts` with graphs: K down to 2 (a tail of 1 < r < K tokens in one launch); without graphs any count
    (None). With them, 15 tokens after the prefill's one run as 8 + 7."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.graphs = object()
    for K, want in [(8, (8, 7, 6, 5, 4, 3, 2)), (2, (2,)), (1, ())]:
        runner.decode_steps = K
        assert runner.step_counts == want
    runner.graphs = None
    assert runner.step_counts is None
    monkeypatch.setattr(ModelRunner, "step_counts", property(lambda self: tuple(range(8, 1, -1))))
    model = tiny_model()
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=2)
    ref = make_engine(model, decode_steps=1).generate(prompts(2, seed=3), params)
    launches.clear()
    same(ref, make_engine(model, decode_steps=8).generate(prompts(2, seed=3), params))
    assert [n for n in launches if n > 1] == [8, 7]
