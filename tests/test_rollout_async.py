"""Async scheduling (step t's host bookkeeping overlaps step t+1 on the device) gives the same completions as
sync mode: greedy and seeded sampling, logprobs, early stops (the row computed past a stop is dropped),
preemption, the drain gate and abort. Runs the async code path on CPU (`rollout.async_scheduling=on`)."""
import pytest
import torch

from moeloop.rollout import SamplingParams
from moeloop.rollout.kv_cache import kv_bytes_per_block
from moeloop.rollout.runner import ModelRunner
from tests.test_rollout_engine import GREEDY, make_engine, prompts, teacher_forced_logprobs, tiny_model


def both(model, ps, params, **kw):
    sync = make_engine(model, async_scheduling="off", **kw)
    asyn = make_engine(model, async_scheduling="on", **kw)
    return sync, sync.generate(ps, params), asyn, asyn.generate(ps, params)


def same(a, b):
    assert [(o.request_id, o.sample_index) for o in a] == [(o.request_id, o.sample_index) for o in b]
    assert [o.response_ids for o in a] == [o.response_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)  # batch composition may differ by a step


def test_async_greedy_and_sampled_equal_sync():
    model = tiny_model()
    ps = prompts(16)
    _, ref, _, out = both(model, ps, GREEDY)
    same(ref, out)
    params = SamplingParams(n=3, temperature=1.0, top_k=20, max_tokens=12, seed=5)
    _, ref, eng, out = both(model, ps, params)
    same(ref, out)
    assert eng.is_drained and eng.blocks.num_free_blocks == eng.blocks.num_blocks
    for o in out[:6]:
        ref_lp = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref_lp, atol=1e-5, rtol=0)


def test_async_inputs_come_from_the_device(monkeypatch):
    """Decode steps take their pending input token from the previous step's device tensor."""
    patched = []
    launch = ModelRunner.launch

    def spy(self, batch, prev=None):
        pending = sum(s.num_computed_tokens >= len(s.token_ids) for s in batch.seqs)
        patched.append(pending)
        return launch(self, batch, prev)

    monkeypatch.setattr(ModelRunner, "launch", spy)
    make_engine(tiny_model(), async_scheduling="on").generate(prompts(4), GREEDY)
    assert max(patched) == 4  # every row of a steady decode step
    patched.clear()
    make_engine(tiny_model(), async_scheduling="off").generate(prompts(4), GREEDY)
    assert max(patched) == 0


def test_async_stops_drop_the_token_past_the_stop():
    model = tiny_model()
    ps = prompts(12, seed=6)
    free = make_engine(model).generate(ps, SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=2))
    stop = free[0].response_ids[2]  # a token that some samples emit early
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=2, stop_token_ids=(stop,))
    _, ref, eng, out = both(model, ps, params)
    same(ref, out)
    stopped = [o for o in out if o.finish_reason == "stop"]
    assert stopped and all(o.response_ids[-1] == stop and stop not in o.response_ids[:-1] for o in stopped)
    assert eng.num_generated_tokens == sum(len(o.response_ids) for o in out)  # dropped tokens are not counted


def test_async_preemption_keeps_outputs():
    model = tiny_model()
    ps = prompts(12, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16)
    budget = 15 * kv_bytes_per_block(model.cfg, 4, torch.float32)
    sync, ref, asyn, out = both(model, ps, params, kv_cache_bytes=budget)
    assert sync.scheduler.num_preemptions > 0 and asyn.scheduler.num_preemptions > 0
    same(ref, out)


def test_async_preemption_with_forked_groups_keeps_outputs():
    model = tiny_model()
    ps = prompts(6, seed=4)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=9)
    budget = 21 * kv_bytes_per_block(model.cfg, 4, torch.float32)
    sync, ref, asyn, out = both(model, ps, params, kv_cache_bytes=budget)
    assert sync.scheduler.num_preemptions > 0 and asyn.scheduler.num_preemptions > 0
    same(ref, out)
    for o in out:  # shared, copied and re-cached prompt blocks all hold the right K/V
        forced = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), forced, atol=1e-5, rtol=0)


def test_async_drain_gate_and_abort():
    model, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = make_engine(model, async_scheduling="on")
    ps = prompts(6, seed=3)
    for p in ps:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    engine.step()
    assert engine._in_flight is not None and not engine.is_drained
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights(new.state_dict().items(), version=1)
    engine.pause()
    done = engine.drain()
    assert engine.is_drained and len(done) == 6 and all(len(c.response_ids) == 8 for c in done)
    engine.update_weights(new.state_dict().items(), version=3)
    engine.resume()
    rid = engine.add_request(ps[0], SamplingParams(n=2, temperature=0, max_tokens=8))
    other = engine.add_request(ps[1], SamplingParams(temperature=0, max_tokens=2))
    rest = []
    for _ in range(3):  # prefill, then 2 decode steps: `other` finishes on the step in flight
        rest += engine.step()
    aborted = engine.abort(rid)  # flushes that step: `other` is kept for the next step(), not lost
    assert [c.finish_reason for c in aborted] == ["abort"] * 2
    while engine.has_unfinished():
        rest += engine.step()
    assert [c.request_id for c in rest] == [other] and rest[0].policy_version == 3
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    fresh = make_engine(new).generate([ps[1]], SamplingParams(temperature=0, max_tokens=2))
    assert rest[0].response_ids == fresh[0].response_ids
