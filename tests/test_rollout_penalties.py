"""Repetition penalty and min-p: the sampler's processed logits equal transformers' logits processors; the engine's
tokens equal a step-by-step reference (teacher-forced logits, HF processors, the sampler's noise) in mixed batches,
with forks, async scheduling, multi-step decode and preemption, and its logprobs stay the raw model's; with the
options off nothing of theirs is built and multi-step decode runs as before; config and flags are checked."""
import re
from dataclasses import replace

import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper)

from moeloop.errors import InputError
from moeloop.rollout import SamplingParams
from moeloop.rollout import runner as runner_module
from moeloop.rollout.engine import _sample_seed
from moeloop.rollout.kv_cache import kv_bytes_per_block
from moeloop.rollout.logit_processors import processing_fields, seen_tokens
from moeloop.rollout.runner import ModelRunner
from moeloop.rollout.sampler import (Sampler, SamplingTensors, penalised_logits, processed_scores, row_key,
                                     uniform_noise)
from moeloop.rollout.sequence import Sequence
from moeloop.rollout.gumbel_kernel import gumbel_sample
from tests.kernels import DEVICE, needs_kernels
from tests.test_rollout_engine import make_engine, prompts, teacher_forced_logprobs, tiny_model


def hf_scores(logits_V: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    """transformers' processing of one row, in `generate`'s order: the repetition penalty, then (sampled rows)
    temperature, top-k, min-p."""
    ids = torch.tensor([history], dtype=torch.long, device=logits_V.device)
    scores = logits_V[None].clone()
    if p.repetition_penalty != 1:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    if p.temperature > 0:
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
        if p.top_k > 0:
            scores = TopKLogitsWarper(p.top_k)(ids, scores)
        if p.min_p > 0:
            scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


def reference_token(logits_V: torch.Tensor, history: list[int], p: SamplingParams, seed: int, index: int) -> int:
    """The token a row draws: the argmax of the HF-processed scores, plus the sampler's Gumbel noise for (seed,
    response-token index) on sampled rows."""
    scores = hf_scores(logits_V, history, p)
    if p.temperature > 0:
        u = uniform_noise(torch.tensor([row_key(seed, index)]), logits_V.shape[-1])[0]
        scores = scores + -torch.log(-torch.log(u.to(scores.device)))
    return int(scores.argmax())


def sampling_tensors(seqs: list[Sequence], vocab: int, pending=None) -> SamplingTensors:
    """The runner's tensors of rows `seqs` (each sampling its response token 0)."""
    ps = [s.params for s in seqs]
    top_ks = [vocab if p.top_k == -1 else p.top_k for p in ps]
    st = SamplingTensors(torch.tensor([p.temperature for p in ps]), torch.tensor(top_ks),
                         torch.tensor([p.top_p for p in ps]), torch.tensor([row_key(s.seed, 0) for s in seqs]),
                         any_filter=any(k < vocab for k in top_ks), all_greedy=all(p.greedy for p in ps),
                         max_top_k=max(top_ks), any_greedy=any(p.greedy for p in ps), any_top_p=False)
    return replace(st, **processing_fields(seqs, pending, vocab, torch.device("cpu")))


def random_rows(tied: bool, top_k: bool = False, V: int = 300) -> tuple[torch.Tensor, list[Sequence]]:
    """Logits (about half negative; `tied`: on a grid of 0.25, so many equal values) and rows mixing penalties
    above and below 1, off, on greedy rows, with min-p from 0 to 1, each with a history holding repeats."""
    g = torch.Generator().manual_seed(7 if tied else 8)
    temps = [0.7, 1.0, 1.3, 0.5, 0.0, 1.0, 0.9, 2.0, 0.0, 1.1]
    penalties = [1.0, 1.3, 0.7, 2.0, 1.5, 1.1, 1.0, 1.8, 1.0, 1.2]
    min_ps = [0.0, 0.1, 0.05, 0.3, 0.2, 1.0, 0.5, 0.0, 0.0, 0.02]
    logits = torch.randn(len(temps), V, generator=g) * 3
    if tied:
        logits = (logits * 4).round() / 4
    seqs = []
    for j, (t, r, m) in enumerate(zip(temps, penalties, min_ps)):
        n = int(torch.randint(1, 60, (1,), generator=g))
        history = torch.randint(0, V, (n,), generator=g).tolist()
        history += history[: n // 3] + [int(logits[j].argmax())]  # repeats, and the raw argmax
        params = SamplingParams(temperature=t, repetition_penalty=r, min_p=m, top_k=17 if top_k and j % 2 else -1)
        seqs.append(Sequence("r", 0, history, params, seed=100 + j))
    return logits, seqs


@pytest.mark.parametrize("tied,top_k", [(False, False), (True, False), (False, True)])
def test_processed_logits_equal_transformers_processors(tied, top_k):
    """Penalised logits == `RepetitionPenaltyLogitsProcessor` bit for bit (greedy rows included); a sampled row's
    scores == `TemperatureLogitsWarper`, (`TopKLogitsWarper`,) `MinPLogitsWarper` on them, bit for bit (top-k on
    untied logits only: transformers keeps every token tied with the k-th, the sampler the smallest ids)."""
    logits, seqs = random_rows(tied, top_k)
    st = sampling_tensors(seqs, logits.shape[1])
    z = penalised_logits(logits, st)
    scores = processed_scores(z, st)
    assert (logits < 0).any()
    assert st.seen_BV.any(dim=1).tolist() == [s.params.repetition_penalty != 1 for s in seqs]  # penalised rows only
    for j, s in enumerate(seqs):
        p = s.params
        penalised = hf_scores(logits[j], s.token_ids, replace(p, temperature=0))
        assert torch.equal(z[j], penalised), j
        if p.temperature > 0:
            assert torch.equal(scores[j], hf_scores(logits[j], s.token_ids, p)), j
    rows = [j for j, s in enumerate(seqs) if s.params.min_p > 0 and s.params.temperature > 0]
    assert all(torch.isinf(scores[j]).any() for j in rows)  # min-p dropped tokens in every such row
    assert not torch.equal(z, logits)


@pytest.mark.parametrize("tied", [False, True])
def test_sampler_draws_the_reference_tokens_with_raw_logprobs(tied):
    """The draw: the argmax of the penalised logits on greedy rows, of the HF-processed scores + the noise of (seed,
    index) on sampled ones; the logprobs are the raw logits' log-softmax."""
    logits, seqs = random_rows(tied)
    tokens, logprobs = Sampler()(logits, sampling_tensors(seqs, logits.shape[1]), want_logprobs=True)
    want = [reference_token(logits[j], s.token_ids, s.params, s.seed, 0) for j, s in enumerate(seqs)]
    assert tokens.tolist() == want
    assert torch.equal(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    greedy_raw = logits.argmax(-1)
    assert any(tokens[j] != greedy_raw[j] for j, s in enumerate(seqs) if s.params.greedy)  # the penalty moved one


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_the_kernel_draw_of_processed_scores_is_the_torch_draw(monkeypatch, tied):
    """With the kernels (CUDA; here the Triton interpreter) a batch with penalties / min-p draws through one
    `gumbel_sample` launch on its processed scores: the torch path's tokens, the raw logits' logprobs."""
    import moeloop.rollout.sampler as sampler
    logits, seqs = random_rows(tied)
    st = sampling_tensors(seqs, logits.shape[1])
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: False)
    want, want_logprobs = Sampler()(logits, st, want_logprobs=True)
    launched = []
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: True)
    monkeypatch.setattr(sampler, "gumbel_sample", lambda *a: launched.append(1) or gumbel_sample(*a))
    moved = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in vars(st).items()}
    got, logprobs = Sampler()(logits.to(DEVICE), SamplingTensors(**moved), want_logprobs=True)
    assert launched and got.tolist() == want.tolist()
    torch.testing.assert_close(logprobs.cpu(), want_logprobs, rtol=0, atol=1e-6)


def test_seen_tokens_take_pending_tokens_from_the_device():
    """A penalised row whose last tokens are still on the device (async scheduling) gets them from there: the one
    token of a one-step launch, every step's token of a multi-step one."""
    V, histories = 50, [[3, 4, 4, 9], [7], [1, 2]]
    full = seen_tokens(histories, [0, 2, 3], None, (4, V), torch.device("cpu"))
    assert full.sum().item() == 3 + 1 + 2 and full[0, 4] and full[2, 7] and not full[1].any()
    prev_tokens = torch.tensor([[11, 9, 2]])  # rows 0 and 3's last tokens sit in rows 1 and 2 there
    pending = seen_tokens([[3, 4, 4], [7], [1]], [0, 2, 3], ([0, 3], [1, 2], prev_tokens), (4, V), torch.device("cpu"))
    assert torch.equal(pending, full)
    two_steps = torch.tensor([[11, 4, 1], [12, 9, 2]], dtype=torch.float64)  # [K, S], as a launch's out holds them
    pending = seen_tokens([[3, 4], [7], [1]], [0, 2, 3], ([0, 3], [1, 2], two_steps), (4, V), torch.device("cpu"))
    assert torch.equal(pending, full)


def run_reference(model, outs, params_of, atol: float = 1e-5) -> None:
    """Every completion's tokens == the step-by-step reference from the teacher-forced logits of its sequence so
    far; its logprobs == the raw model's, teacher-forced (to `atol`)."""
    for o in outs:
        p = params_of[o.request_id]
        ids = torch.tensor(o.prompt_ids + o.response_ids, device=next(model.parameters()).device)
        with torch.no_grad():
            logits = model.compute_logits(model.forward_packed(ids, [len(ids)])).float()
        seed = _sample_seed(p.seed, o.sample_index) if p.seed is not None else None
        history = list(o.prompt_ids)
        for t, token in enumerate(o.response_ids):
            assert seed is not None or p.greedy
            want = reference_token(logits[len(o.prompt_ids) - 1 + t], history, p, seed, t)
            assert token == want, (o.request_id, o.sample_index, t)
            history.append(token)
        ref = teacher_forced_logprobs(model, o.prompt_ids, o.response_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref.cpu(), atol=atol, rtol=0)


MIXED = [SamplingParams(n=3, temperature=0.8, repetition_penalty=1.4, min_p=0.05, max_tokens=9, seed=1),
         SamplingParams(n=2, temperature=1.0, max_tokens=14, seed=2),  # no options; longer: decodes alone at the end
         SamplingParams(temperature=0, repetition_penalty=1.6, max_tokens=9),
         SamplingParams(n=2, temperature=1.2, min_p=0.15, top_k=40, max_tokens=9, seed=3),
         SamplingParams(n=2, temperature=0.9, repetition_penalty=0.6, max_tokens=9, seed=4),  # < 1 rewards repeats
         SamplingParams(temperature=0, max_tokens=12),
         SamplingParams(temperature=0, repetition_penalty=30.0, max_tokens=16)]  # greedy: a token left unseen repeats


def mixed_prompts() -> list[list[int]]:
    ps = prompts(len(MIXED), seed=12, max_len=14)
    return [p + p[:4] for p in ps]  # repeated prompt tokens


def spy_launches(monkeypatch) -> dict:
    """num_steps of every launch, and the number of penalised rows whose last token came from the device."""
    seen = dict(steps=[], pending=0, processed_steps=0)
    launch, pending = ModelRunner.launch, runner_module._pending_samples

    def launch_spy(self, batch, prev=None):
        seen["steps"].append(batch.num_steps)
        seen["processed_steps"] += batch.num_steps > 1 and any(s.params.processes_logits for s in batch.seqs)
        return launch(self, batch, prev)

    def pending_spy(seqs, prev):
        out = pending(seqs, prev)
        seen["pending"] += len(out[0]) if out else 0
        return out

    monkeypatch.setattr(ModelRunner, "launch", launch_spy)
    monkeypatch.setattr(runner_module, "_pending_samples", pending_spy)
    return seen


@pytest.fixture
def spies(monkeypatch):
    return spy_launches(monkeypatch)


def generate_mixed(engine, model, atol: float = 1e-5) -> None:
    """Run the `MIXED` requests to the end, step by step, and check them against `run_reference`."""
    ids = [engine.add_request(p, sp) for p, sp in zip(mixed_prompts(), MIXED)]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == sum(p.n for p in MIXED) and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    run_reference(model, outs, dict(zip(ids, MIXED)), atol)


@pytest.mark.parametrize("async_scheduling,decode_steps,tight", [("off", 1, False), ("on", 1, False),
                                                                 ("on", 4, False), ("off", 4, True)])
def test_engine_tokens_equal_the_step_by_step_reference(spies, async_scheduling, decode_steps, tight):
    """A batch mixing rows with and without a penalty / min-p, greedy and sampled, n > 1 forks; async scheduling
    (the penalised rows' last tokens still on the device), multi-step decode (a batch with such rows runs K steps
    too, the seen tokens growing on the device), a KV budget that preempts."""
    model = tiny_model()
    kw = dict(kv_cache_bytes=13 * kv_bytes_per_block(model.cfg, 4, torch.float32)) if tight else {}
    engine = make_engine(model, async_scheduling=async_scheduling, decode_steps=decode_steps, **kw)
    generate_mixed(engine, model)
    assert (spies["pending"] > 0) == (async_scheduling == "on")
    if decode_steps > 1 and not tight:
        assert decode_steps in spies["steps"]
        assert spies["processed_steps"] > 0  # launches of K steps with penalised / min-p rows in them
    if tight:
        assert engine.scheduler.num_preemptions > 0


def test_options_off_build_nothing_and_keep_multistep(monkeypatch, spies):
    """With no row penalised or min-p sampled (min-p on a greedy row is no option), no processing tensor is built
    and multi-step decode runs; the same request's tokens are those it gets in a batch with penalised rows."""
    model = tiny_model()
    plain = [SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=2),
             SamplingParams(temperature=0, min_p=0.3, max_tokens=10)]
    real = runner_module.processing_fields
    monkeypatch.setattr(runner_module, "processing_fields", lambda *a: pytest.fail("built for an options-free batch"))
    out = make_engine(model, decode_steps=4).generate(mixed_prompts()[:2], plain)
    assert 4 in spies["steps"]
    monkeypatch.setattr(runner_module, "processing_fields", real)
    mixed = make_engine(model, decode_steps=4).generate(mixed_prompts()[:2] + mixed_prompts()[:1],
                                                        plain + [MIXED[0]])
    assert [o.response_ids for o in out] == [o.response_ids for o in mixed[:3]]
    for a, b in zip(out, mixed):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw,message", [(dict(repetition_penalty=0.0), "SamplingParams.repetition_penalty must be"),
                                        (dict(repetition_penalty=float("inf")), "repetition_penalty must be finite"),
                                        (dict(min_p=1.5), r"SamplingParams.min_p must be in [0, 1]"),
                                        (dict(min_p=-0.1), r"SamplingParams.min_p must be in [0, 1]")])
def test_sampling_params_check_the_new_fields(kw, message):
    with pytest.raises(InputError, match=re.escape(message)):
        SamplingParams(**kw)


@pytest.mark.parametrize("override,message", [
    ("rollout.repetition_penalty=0", "rollout.repetition_penalty: must be finite and > 0 (1 = off)"),
    ("rollout.min_p=1.5", "rollout.min_p: must be in [0, 1] (0 = off)"),
    ("rollout.val_kwargs.repetition_penalty=-1", "rollout.val_kwargs.repetition_penalty: must be finite and > 0"),
    ("rollout.val_kwargs.min_p=2", "rollout.val_kwargs.min_p: must be in [0, 1]"),
])
def test_config_errors_name_the_field(override, message):
    from moeloop.config import load_config
    with pytest.raises(InputError, match=re.escape(message)):
        load_config(None, ["model.path=m", override])


def test_val_kwargs_inherit_the_rollouts_penalty_and_min_p():
    from moeloop.config import load_config
    cfg = load_config(None, ["model.path=m", "rollout.repetition_penalty=1.2", "rollout.min_p=0.05",
                             "rollout.val_kwargs.min_p=0.1", "rollout.val_kwargs.temperature=0.6"])
    v = cfg.rollout.val_sampling()
    assert (v.repetition_penalty, v.min_p, v.temperature, v.top_p, v.top_k) == (1.2, 0.1, 0.6, 1.0, -1)
    assert (cfg.rollout.repetition_penalty, cfg.rollout.min_p) == (1.2, 0.05)
