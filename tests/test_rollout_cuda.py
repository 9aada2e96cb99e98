"""The engine's CUDA path (Triton decode kernel, CUDA graphs) against transformers and the trainer's
teacher-forced logprobs, fp32 on the GPU. Skipped without CUDA; run through the GPU machine."""
import pytest
import torch
import transformers

from tests.hf_tiny import hf_config
from tests.test_rollout_engine import GREEDY, make_engine, prompts, teacher_forced_logprobs, tiny_model
from moeloop.rollout import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("eager", [True, False])
def test_cuda_greedy_matches_transformers(arch, eager):
    model = tiny_model(arch).cuda()
    ps = prompts()
    outs = make_engine(model, enforce_eager=eager).generate(ps, GREEDY)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32).eval().cuda()
    hf.load_state_dict(model.state_dict())
    width = max(map(len, ps))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps]).cuda()
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps]).cuda()
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[:, width:].tolist()
    assert [o.response_ids for o in outs] == ref


def test_cuda_logprobs_equal_teacher_forced():
    model = tiny_model().cuda()
    outs = make_engine(model, enforce_eager=False).generate(prompts(6), SamplingParams(n=2, max_tokens=12, seed=3))
    for o in outs:
        ref = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids).cpu()
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)


def test_cuda_async_scheduling_equals_sync_with_stops():
    """Graph replays fed from the previous step's device tokens (async) give the sync engine's samples."""
    model = tiny_model().cuda()
    ps = prompts(12, seed=6)
    free = make_engine(model, enforce_eager=False).generate(ps, SamplingParams(n=2, max_tokens=12, seed=2))
    params = SamplingParams(n=2, max_tokens=12, seed=2, stop_token_ids=(free[0].response_ids[2],))
    sync = make_engine(model, enforce_eager=False, async_scheduling="off").generate(ps, params)
    asyn = make_engine(model, enforce_eager=False, async_scheduling="on").generate(ps, params)
    assert [o.response_ids for o in asyn] == [o.response_ids for o in sync]
    assert any(o.finish_reason == "stop" for o in asyn)
    for a, s in zip(asyn, sync):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(s.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("eager", [True, False])
def test_cuda_multistep_decode_equals_one_step_per_launch(eager, monkeypatch):
    """K decode steps per launch (one CUDA graph with sampling and on-device input updates, or op by op) give the
    same tokens, logprobs and finish reasons as one step per launch, with stops inside a burst and top-k."""
    from moeloop.rollout.runner import ModelRunner
    bursts, launch_steps = [], ModelRunner._launch_steps
    monkeypatch.setattr(ModelRunner, "_launch_steps", lambda self, b, *a: bursts.append(b.num_steps) or
                        launch_steps(self, b, *a))
    model = tiny_model().cuda()
    ps = prompts(12, seed=6)
    free = make_engine(model, enforce_eager=eager).generate(ps, SamplingParams(n=2, max_tokens=13, seed=2))
    for params in (GREEDY, SamplingParams(n=2, max_tokens=13, seed=2, stop_token_ids=(free[0].response_ids[2],)),
                   SamplingParams(n=2, max_tokens=13, seed=4, top_k=7)):
        ref = make_engine(model, enforce_eager=eager, decode_steps=1).generate(ps, params)
        engine = make_engine(model, enforce_eager=eager, decode_steps=8)
        out = engine.generate(ps, params)
        assert engine.runner.decode_steps == 8  # no capture fell back
        assert [o.response_ids for o in out] == [o.response_ids for o in ref]
        assert [o.finish_reason for o in out] == [o.finish_reason for o in ref]
        for a, b in zip(out, ref):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert 8 in bursts and (eager or engine.runner.graphs.step_graphs)  # K steps a launch (in a graph)


def test_cuda_fused_capture_failure_falls_back_to_module_graphs(monkeypatch):
    """A fused decode forward that cannot be captured (here: it raises while a capture runs) makes the engine capture
    the module forward instead, multi-step graphs included, and decode the same tokens."""
    import warnings
    from moeloop.rollout import cuda_graphs
    model = tiny_model().cuda()
    ps = prompts(6, seed=6)
    ref = make_engine(model, enforce_eager=True, decode_steps=1).generate(ps, GREEDY)
    real = cuda_graphs.fused_decode_logits

    def uncapturable(*args):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a host sync inside the capture")
        return real(*args)

    monkeypatch.setattr(cuda_graphs, "fused_decode_logits", uncapturable)
    engine = make_engine(model, enforce_eager=False, decode_steps=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.generate(ps, GREEDY)
    assert any("fused decode forward failed" in str(w.message) for w in caught)
    assert [o.response_ids for o in out] == [o.response_ids for o in ref]
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.fused and graphs.graphs and graphs.step_graphs
    assert engine.runner.decode_steps == 8


def test_cuda_shared_weights_changed_in_place_reach_the_packed_qkv_on_push():
    """The engine aliases a trainer's parameters (`share_parameters`) and decodes through its packed q|k|v copies.
    Weights changed in place by the trainer reach those copies at the push (`update_weights`), so the engine then
    generates what an engine freshly built on the new weights does."""
    from moeloop.sync.shared import share_parameters
    trainer = tiny_model(seed=0).cuda()
    model = tiny_model(seed=5).cuda()
    share_parameters(trainer, model)
    engine = make_engine(model, enforce_eager=False)
    assert engine.runner.derived  # the fused decode with packed projections is in use
    ps = prompts(8, seed=9)
    before = [o.response_ids for o in engine.generate(ps, GREEDY)]
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():  # a large change to the packed projections only (negating all of attention would not
        for name, p in trainer.named_parameters():  # change the function: q/k norms and o_proj undo the signs)
            if any(f"self_attn.{w}_proj" in name for w in "qkv"):
                p.add_(torch.randn(p.shape, generator=g, device="cuda"), alpha=0.5 * p.std().item())
    engine.update_weights(trainer.state_dict().items(), version=1)
    for pack, layer in zip(engine.runner.derived, model.model.layers):
        attn = layer.self_attn
        assert torch.equal(pack.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    after = [o.response_ids for o in engine.generate(ps, GREEDY)]
    fresh = tiny_model(seed=1).cuda()
    fresh.load_state_dict(trainer.state_dict())
    want = [o.response_ids for o in make_engine(fresh, enforce_eager=False).generate(ps, GREEDY)]
    assert after != before  # the change moves the greedy tokens
    assert after == want


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_cuda_penalties_and_min_p_equal_the_step_by_step_reference(monkeypatch, async_scheduling):
    """Repetition penalty and min-p on the CUDA path: batches with them run multi-step decode graphs (the seen mask
    and min-p's thresholds in the graph's static buffers, the seen tokens growing inside the graph), and one-step
    launches take their logits from the decode graphs; under async scheduling a penalised row's pending tokens come
    from the device; tokens == the step-by-step reference (teacher-forced logits on the GPU, transformers'
    processors, the sampler's noise), logprobs == the raw model's to 1e-4 (Triton decode attention against the
    packed forward). See tests/test_rollout_penalties.py for the CPU version."""
    from tests.test_rollout_penalties import generate_mixed, spy_launches
    seen = spy_launches(monkeypatch)
    model = tiny_model().cuda()
    engine = make_engine(model, enforce_eager=False, async_scheduling=async_scheduling)  # decode_steps: 8 on CUDA
    generate_mixed(engine, model, atol=1e-4)
    graphs = engine.runner.graphs.step_graphs
    assert engine.runner.decode_steps == 8 and graphs  # no capture fell back
    assert seen["processed_steps"] > 0 and any(key[-1] == ("penalties_B", "seen_BV", "min_ps_B") for key in graphs)
    assert (seen["pending"] > 0) == (async_scheduling == "on")
