"""Rollout engine on tiny models: parity with transformers generate and with teacher-forced logprobs,
preemption, prefix sharing, seeds, the drain gate for weight updates, sleep/wake, stops."""
import os

import pytest
import torch
import transformers

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton decode kernel on CPU, if triton is installed

from moeloop.config.schema import RolloutSection
from moeloop.model.config import ModelConfig
from moeloop.model.transformer import MoEForCausalLM
from moeloop.rollout.decode_kernel import triton_available
from moeloop.rollout.kv_cache import kv_bytes_per_block
from moeloop.rollout import Engine, SamplingParams, completions_to_samples
from tests.hf_tiny import hf_config


def tiny_model(arch: str = "qwen3_moe", seed: int = 0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    model = MoEForCausalLM(ModelConfig.from_hf_dict(hf_config(arch).to_dict()))  # with transformers' defaults
    with torch.no_grad():  # larger than the 0.02 init so greedy decoding is far from ties
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def make_engine(model, **kw) -> Engine:
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=64, block_size=4, kv_cache_bytes=1 << 20, max_model_len=64)
    cfg.update(kw)
    return Engine(model, RolloutSection(**cfg), eos_token_ids=[])


def prompts(num: int = 16, seed: int = 1, max_len: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (num,), generator=g).tolist()
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_greedy_matches_transformers_generate(arch):
    model = tiny_model(arch)
    ps = prompts()
    outs = make_engine(model).generate(ps, GREEDY)  # 64-token budget: long prompts prefill in chunks
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32).eval()
    hf.load_state_dict(model.state_dict())
    width = max(map(len, ps))  # one left-padded batch
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[:, width:].tolist()
    assert [o.response_ids for o in outs] == ref
    assert all(o.finish_reason == "length" and o.prompt_ids == p for o, p in zip(outs, ps))


def teacher_forced_logprobs(model, prompt, response):
    device = next(model.parameters()).device
    ids = torch.tensor(prompt + response, device=device)
    with torch.no_grad():
        logits = model.compute_logits(model.forward_packed(ids, [len(ids)])).float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return logp.gather(1, torch.tensor(response, device=device)[:, None])[:, 0]


def test_logprobs_equal_teacher_forced_raw_distribution():
    model = tiny_model()
    ps = prompts(6)
    params = SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, seed=3)
    outs = make_engine(model).generate(ps, params)
    for o in outs:
        ref = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-5, rtol=0)
    samples = completions_to_samples(outs)
    assert [s.group_id for s in samples] == [i // 2 for i in range(12)]
    assert samples[0].response_logprobs == outs[0].logprobs


def test_preemption_keeps_greedy_outputs():
    model = tiny_model()
    ps = prompts(12, seed=2)
    params = SamplingParams(temperature=0, max_tokens=16)
    ref = make_engine(model).generate(ps, params)
    tiny = make_engine(model, kv_cache_bytes=15 * kv_bytes_per_block(model.cfg, 4, torch.float32))  # 14 + scratch
    assert tiny.blocks.num_blocks == 14
    outs = tiny.generate(ps, params)
    assert tiny.scheduler.num_preemptions > 0
    assert [o.response_ids for o in outs] == [o.response_ids for o in ref]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_group_of_8_uses_prompt_blocks_once():
    model = tiny_model()
    engine = make_engine(model)
    prompt = prompts(1, seed=5, max_len=2)[0] * 18  # 18 tokens: 4 full blocks + 2 tokens
    engine.add_request(prompt, SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=0))
    engine.step()  # the leader prefills the prompt once; the followers fork from it and sample too
    seqs = engine.scheduler.running
    assert len(seqs) == 8 and all(s.num_response_tokens == 1 for s in seqs)
    prompt_blocks = {b for s in seqs for b in s.block_table[:5]}
    assert len(prompt_blocks) == 4 + 8  # 4 shared full blocks once, one partial block per sample (not 8 * 5)
    assert engine.blocks.num_prefix_hit_blocks == 4 * 7
    assert engine.num_prefill_tokens == 18  # no follower recomputes any prompt token
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len({tuple(o.response_ids) for o in outs}) > 1
    for o in outs:
        ref = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt", [[5, 6, 7], [5, 6, 7, 8]])  # block_size 4: no full block / exactly one
def test_group_forks_from_one_prefill(prompt):
    model = tiny_model()
    engine = make_engine(model)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=0)
    engine.add_request(prompt, params)
    engine.step()
    assert len(engine.scheduler.running) == 8 and engine.num_prefill_tokens == len(prompt)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len({tuple(o.response_ids) for o in outs}) > 1
    for o in outs:  # the copied partial block and the shared full one hold the right K/V
        forced = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), forced, atol=1e-5, rtol=0)
    # the same samples as without forks (one sequence at a time: every sample prefills or reuses cached blocks)
    ref = make_engine(model, max_num_seqs=1).generate([prompt], params)
    assert [o.response_ids for o in outs] == [r.response_ids for r in ref]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_seed_reproducible_and_independent_of_batch():
    model = tiny_model()
    p = prompts(1, seed=7)[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=11)
    alone = make_engine(model).generate([p], params)
    crowded = make_engine(model).generate(prompts(9, seed=8) + [p], [SamplingParams(n=2, max_tokens=8)] * 9 + [params])
    assert [o.response_ids for o in alone] == [o.response_ids for o in crowded[-4:]]
    other = make_engine(model).generate([p], SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=12))
    assert [o.response_ids for o in alone] != [o.response_ids for o in other]
    assert len({tuple(o.response_ids) for o in alone}) == 4  # the n samples differ from each other


def test_update_weights_needs_drain_and_matches_fresh_engine():
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = make_engine(old)
    ps = prompts(8, seed=3)
    for p in ps:
        engine.add_request(p, GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights(new.state_dict().items(), version=1)
    engine.pause()
    engine.drain(abort=True)  # partial responses dropped, sequences re-queued from the prompt
    assert engine.is_drained
    engine.update_weights(new.state_dict().items(), version=7)
    engine.resume()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    outs.sort(key=lambda c: int(c.request_id))
    fresh = make_engine(new).generate(ps, GREEDY)
    assert [o.response_ids for o in outs] == [o.response_ids for o in fresh]
    assert {o.policy_version for o in outs} == {7}
    with pytest.raises(KeyError):
        engine.update_weights([("no.such.weight", torch.zeros(1))])
    with pytest.raises(RuntimeError, match="half-updated"):
        engine.step()


def test_drain_waits_for_in_flight_and_keeps_waiting_queue():
    engine = make_engine(tiny_model(), max_num_seqs=2)
    for p in prompts(4, seed=4):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    engine.pause()
    done = engine.drain()
    assert len(done) == 2 and engine.is_drained and len(engine.scheduler.waiting) == 2
    assert engine.step() == [] and len(engine.scheduler.waiting) == 2  # paused: nothing admitted
    engine.resume()
    while engine.has_unfinished():
        done += engine.step()
    assert len(done) == 4


def test_sleep_wake_frees_kv_and_keeps_outputs():
    engine = make_engine(tiny_model())
    ps = prompts(6, seed=9)
    before = engine.generate(ps, SamplingParams(n=2, max_tokens=8, seed=1))
    allocated = engine.cache.num_bytes
    engine.sleep()
    assert engine.cache.num_bytes == 0 and allocated > 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(ps, GREEDY)
    engine.scheduler.waiting.clear()
    engine.wake()
    after = engine.generate(ps, SamplingParams(n=2, max_tokens=8, seed=1))
    assert [o.response_ids for o in before] == [o.response_ids for o in after]
    assert engine.cache.num_bytes == allocated


def test_stops_and_abort():
    model = tiny_model()
    p = prompts(1, seed=6)[0]
    free_run = make_engine(model).generate([p], GREEDY)[0].response_ids
    stop_tok = free_run[4]
    first = free_run.index(stop_tok)
    out = make_engine(model).generate([p], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop_tok,)))[0]
    assert out.finish_reason == "stop" and out.response_ids == free_run[:first + 1]
    eos_engine = Engine(model, RolloutSection(block_size=4, kv_cache_bytes=1 << 20, max_model_len=64),
                        eos_token_ids=[stop_tok], detokenize=lambda ids: " ".join(map(str, ids)))
    out = eos_engine.generate([p], GREEDY)[0]
    assert out.finish_reason == "stop" and out.response_ids[-1] == stop_tok and out.text.endswith(str(stop_tok))
    stop_str = f"{free_run[1]} {free_run[2]}"
    out = eos_engine.generate([p], SamplingParams(temperature=0, max_tokens=10, stop=stop_str, ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.response_ids == free_run[:3]
    rid = eos_engine.add_request(p, SamplingParams(n=3, max_tokens=10, ignore_eos=True))
    eos_engine.step()
    aborted = eos_engine.abort(rid)
    assert [c.finish_reason for c in aborted] == ["abort"] * 3 and not eos_engine.has_unfinished()
    assert eos_engine.blocks.num_free_blocks == eos_engine.blocks.num_blocks
    with pytest.raises(ValueError, match="max_model_len"):
        eos_engine.add_request(p, SamplingParams(max_tokens=64))
    with pytest.raises(ValueError, match="detokenize"):
        make_engine(model).add_request(p, SamplingParams(max_tokens=4, stop="x"))


def test_generate_checks_every_prompt_before_queueing_any():
    """A bad prompt among good ones (empty, too long, ids out of the vocabulary) or a params list of another length:
    an InputError naming the prompt, and nothing left queued; the engine then generates as before."""
    from moeloop.errors import InputError
    model = tiny_model("qwen3_moe")
    engine = make_engine(model)
    good, params = prompts(3, seed=4), SamplingParams(temperature=0, max_tokens=4)
    for bad, message in (([], "prompt 1: empty prompt"), ([5] * 70, "prompt 1: prompt \\(70\\) \\+ max_tokens"),
                         ([10 ** 6], "prompt 1: prompt token ids must be in")):
        with pytest.raises(InputError, match=message):
            engine.generate([good[0], bad, good[1]], params)
        assert not engine.has_unfinished()
    with pytest.raises(InputError, match="3 prompts but 2 SamplingParams"):
        engine.generate(good, [params, params])
    assert not engine.has_unfinished()
    assert [o.response_ids for o in engine.generate(good, params)] == \
        [o.response_ids for o in make_engine(model).generate(good, params)]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (CPU torch wheel)")
def test_triton_decode_path_keeps_greedy_outputs():
    """The Triton decode kernels (compiled on CUDA, the interpreter without) against the torch ops path."""
    model = tiny_model("deepseek_v3").to("cuda" if torch.cuda.is_available() else "cpu")  # MLA: Dk != Dv
    ps = prompts(4, seed=10)
    outs = {}
    for use_kernel in (False, True):
        engine = make_engine(model, enforce_eager=True)
        engine.runner.use_kernel = use_kernel
        outs[use_kernel] = [o.response_ids for o in engine.generate(ps, GREEDY)]
    assert outs[True] == outs[False]


def test_flat_graph_inputs_layout():
    """`flat_inputs` (the CUDA graphs' staging layout): ids | positions | slots | lengths, each padded to the graph
    size (padding rows point at the scratch block, length 1), then block tables padded with the scratch block,
    then the patch's row lists."""
    from moeloop.rollout.cuda_graphs import flat_inputs
    flat, n_in = flat_inputs(3, 4, scratch=9, block_size=16, ids=[5, 6], pos=[17, 3], slots=[33, 51], lens=[18, 4],
                             tables=[[2, 3], [4]], patch=([1], [0], None))
    assert n_in == 3 * 4 + 3 * 4
    assert list(flat) == [5, 6, 0, 17, 3, 0, 33, 51, 9 * 16, 18, 4, 1,
                          2, 3, 9, 9, 4, 9, 9, 9, 9, 9, 9, 9, 1, 0]


def test_a_live_request_id_is_refused_and_reusable_once_finished():
    """Request ids name one live request (completions and abort() go by them): a given id still running is an
    InputError (it silently merged two requests), an automatic id skips a given one that is live, and an id is free
    again once its last sample completes."""
    from moeloop.errors import InputError
    engine = Engine(tiny_model(), RolloutSection(max_num_seqs=8, kv_cache_bytes=1 << 20, max_model_len=64))
    params = SamplingParams(n=2, max_tokens=3, temperature=0.0)
    engine.add_request([5, 6, 7], params, request_id="1")
    with pytest.raises(InputError, match="request id '1' is still running"):
        engine.add_request([8, 9], params, request_id="1")
    first = engine.add_request([8, 9], params)  # automatic: "0"
    second = engine.add_request([8, 9], params)  # "1" is live: skipped
    assert (first, second) == ("0", "2")
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert sorted((c.request_id, c.sample_index) for c in done) == [(r, i) for r in ("0", "1", "2") for i in (0, 1)]
    engine.add_request([5, 6, 7], params, request_id="1")  # finished: free again
    assert [c.finish_reason for c in engine.abort("1")] == ["abort", "abort"]



def test_generate_keeps_the_completions_of_other_requests_for_step():
    """A request added with add_request that finishes while generate() runs is returned by the next step() (generate
    consumed and dropped it)."""
    engine = Engine(tiny_model(), RolloutSection(max_num_seqs=8, kv_cache_bytes=1 << 20, max_model_len=64))
    engine.add_request([5, 6, 7], SamplingParams(n=2, max_tokens=2, temperature=0.0), request_id="mine")
    out = engine.generate([[8, 9]], SamplingParams(n=1, max_tokens=6, temperature=0.0))
    assert [c.request_id for c in out] == ["0"]
    later = []
    while engine.has_unfinished():
        later += engine.step()
    assert sorted((c.request_id, c.sample_index, c.finish_reason) for c in later) == [("mine", 0, "length"),
                                                                                      ("mine", 1, "length")]
