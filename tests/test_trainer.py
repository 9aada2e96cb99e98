"""The trainer: micro-batch invariance of the update, DP=2/4 == DP=1 on the same global batch,
logprobs equal to a naive forward, and the compact-stream forward equal to the full packed one."""
import random

import pytest
import torch

from moeloop.train.actor import Actor
from moeloop.train.packing import pack_samples
from tests.dist import run_ranks
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model, use_sgd


def _params(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _train(budget: int, samples, steps: int = 2, optim: str = "sgd", **cfg_over):
    model = tiny_model()
    actor = Actor(model, actor_cfg(max_tokens_per_micro_batch=budget, **cfg_over), torch.device("cpu"), 8)
    if optim == "sgd":
        use_sgd(actor, 0.05)
    losses = [actor.update([s for s in samples])["pg_loss"] for _ in range(steps)]
    return losses, _params(actor.model)


def test_logprobs_match_naive_forward():
    samples = rl_batch()
    model = tiny_model()
    ref = tiny_model()
    Actor(model, actor_cfg(max_tokens_per_micro_batch=16), torch.device("cpu"), 8).compute_logprobs(samples, "old_logprobs")
    for s in samples:
        ids = torch.tensor(s.prompt_ids + s.response_ids)
        logits = ref.compute_logits(ref.forward_packed(ids, [len(ids)]))
        want = torch.log_softmax(logits.float(), -1)[len(s.prompt_ids) - 1:-1].gather(-1, ids[len(s.prompt_ids):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.old_logprobs), want, rtol=1e-5, atol=1e-5)


def test_compact_stream_forward_matches_full_forward():
    """Each group's prompt runs once and no last token runs (the stream has fewer rows); logprobs and entropy
    at loss positions and all gradients are those of the full packed forward (tolerance: fp32 summation
    order of the shared rows' gradients)."""
    samples = rl_batch()
    out = {}
    for compact in (False, True):
        batch = pack_samples(samples, compact=compact)
        actor = Actor(tiny_model(), actor_cfg(), torch.device("cpu"), 8)
        logprobs_T, entropy_T = actor.forward_batch(batch, with_entropy=True)
        ((logprobs_T * batch.advantages_T).sum() + 0.1 * (entropy_T * batch.loss_mask_T).sum()).backward()
        grads = {n: p.grad for n, p in actor.model.named_parameters()}
        out[compact] = (logprobs_T.detach(), entropy_T.detach(), grads, batch)
    batch = out[True][3]
    assert batch.stream.input_ids_U.numel() < batch.num_tokens - len(samples)  # prompts shared, last tokens gone
    on = batch.loss_mask_T.bool()
    torch.testing.assert_close(out[True][0][on], out[False][0][on], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[True][1][on], out[False][1][on], rtol=1e-6, atol=1e-6)
    for name, grad in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_update_invariant_to_micro_batch_cut(mode):
    samples = rl_batch()
    big = max(s.num_tokens for s in samples)
    losses_1, params_1 = _train(10_000, samples, loss_agg_mode=mode)
    for budget in (big, big + 5):  # several micro-batches per mini-batch
        losses_n, params_n = _train(budget, samples, loss_agg_mode=mode)
        assert losses_n == pytest.approx(losses_1, rel=1e-5)
        for name in params_1:  # tolerance: fp32 summation order over micro-batches
            torch.testing.assert_close(params_n[name], params_1[name], rtol=1e-5, atol=1e-6)


def _dp_rank(rank, world, budget):
    samples = rl_batch()
    groups = sorted({s.group_id for s in samples})
    mine = [s for s in samples if groups.index(s.group_id) % world == rank]
    model = tiny_model()
    actor = Actor(model, actor_cfg(max_tokens_per_micro_batch=budget), torch.device("cpu"), 8)
    use_sgd(actor, 0.05)
    losses = [actor.update(mine)["pg_loss"] for _ in range(2)]
    return losses, {n: t.clone() for n, t in actor.named_weights()}


@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_single_process(world):
    samples = rl_batch()
    _, want = _train(24, samples)
    results = run_ranks(_dp_rank, world, 24)
    for _, weights in results:
        for name, w in want.items():  # tolerance: gradient all-reduce order (fp32)
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)


def test_sft_step_is_token_mean_cross_entropy_and_cut_invariant():
    samples = rl_batch()
    ref = tiny_model()
    want = []
    for s in samples:
        ids = torch.tensor(s.prompt_ids + s.response_ids)
        logp = torch.log_softmax(ref.compute_logits(ref.forward_packed(ids, [len(ids)])), -1)
        want.append(-logp[len(s.prompt_ids) - 1:-1].gather(-1, ids[len(s.prompt_ids):, None]).sum())
    want_loss = float(torch.stack(want).sum()) / sum(len(s.response_ids) for s in samples)
    params = []
    for budget in (10_000, max(s.num_tokens for s in samples)):  # one micro-batch, then several
        actor = Actor(tiny_model(), actor_cfg(max_tokens_per_micro_batch=budget), torch.device("cpu"), 8)
        use_sgd(actor, 0.05)
        assert actor.sft_step(samples)["sft_loss"] == pytest.approx(want_loss, rel=1e-5)
        params.append(_params(actor.model))
    for name in params[0]:
        torch.testing.assert_close(params[1][name], params[0][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_clip", [0.0, 1e-3, 1e6])
def test_clip_and_step_equals_clip_grad_norm(grad_clip):
    """The scale pass runs only when it clips; gradients, norm and the step are bit-identical to torch's."""
    from moeloop.train.actor import clip_and_step
    results = []
    for ours in (True, False):
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.lm_head(model.forward_packed(torch.arange(1, 9), [8])).square().mean().backward()
        if ours:
            norm = clip_and_step(model, optimizer, grad_clip)
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf")))
            optimizer.step()
        results.append((norm, _params(model)))
    assert results[0][0] == results[1][0]
    for name, p in results[1][1].items():
        assert torch.equal(results[0][1][name], p), name


def test_tis_at_the_cap_scales_the_update_by_the_cap():
    """Through the actor: rollout logprobs far below the old ones put every token's weight at tis_cap, so one SGD
    step moves the weights exactly tis_cap times as far as without TIS (the dummy-free path, two micro-batches)."""
    samples = rl_batch()
    for s in samples:
        s.response_logprobs = [lp - 5.0 for lp in s.old_logprobs]
    base, capped = _train(40, samples, steps=1)[1], _train(40, samples, steps=1, tis_cap=1.5)[1]
    start = _params(tiny_model())
    for name in start:
        torch.testing.assert_close(capped[name] - start[name], 1.5 * (base[name] - start[name]), rtol=1e-4, atol=1e-6)


def test_top_entropy_selection_is_the_same_however_the_mini_batch_is_cut():
    """actor.top_entropy_quantile: one threshold for the mini-batch (from the old entropies), so one or several
    micro-batches give the same step; the selection changes the step."""
    samples = rl_batch()
    rng = random.Random(5)
    for s in samples:
        s.old_entropy = [rng.uniform(0, 3) for _ in s.response_ids]
    whole = _train(10_000, samples, steps=1, top_entropy_quantile=0.3)[1]
    cut = _train(max(s.num_tokens for s in samples), samples, steps=1, top_entropy_quantile=0.3)[1]
    every = _train(10_000, samples, steps=1)[1]
    for name in whole:
        torch.testing.assert_close(cut[name], whole[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(whole[name], every[name]) for name in whole)


def test_mix_into_moves_each_parameter_toward_the_source():
    from moeloop.train.actor import mix_into
    target, source = tiny_model(seed=1), tiny_model(seed=2)
    start = _params(target)
    mix_into(target, source, 0.25)
    for name, p in target.named_parameters():
        torch.testing.assert_close(p.detach(), 0.75 * start[name] + 0.25 * dict(source.named_parameters())[name].detach())
    mix_into(target, source, 1.0)
    assert all(torch.equal(p, q) for p, q in zip(target.parameters(), source.parameters()))
