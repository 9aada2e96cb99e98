"""Router replay (moeloop.model.routes): the engine records the experts the trainer would choose at every position
(through chunked prefill, forks, preemption and the prefix cache), a replayed route is the one used and is weighted
by the router's own scores, replaying the model's own routes changes nothing, the packed trainer maps routes to and
from its rows, and R2 / R3 run through the RL loop with 2 ranks equal to 1."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moeloop.errors import InputError
from moeloop.model.attention import PackedAttention
from moeloop.model.routes import RouteTape
from moeloop.rollout import SamplingParams, completions_to_samples
from moeloop.rollout.decode_kernel import triton_available
from moeloop.rollout.kv_cache import kv_bytes_per_block
from moeloop.train.actor import Actor
from moeloop.train.packing import pack_samples
from tests.test_rollout_engine import make_engine, prompts, tiny_model
from tests.trainer_fixtures import actor_cfg, rl_batch
from tests import trainer_fixtures


def own_routes(model, token_ids: list[int], replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes [L, T, K] the model chooses over one whole sequence, its logprobs of each next token [T - 1]);
    `replay` [L, T, K]: route through those instead."""
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, device=device)
    ctx = PackedAttention(torch.tensor([0, len(ids)], dtype=torch.int32, device=device))
    ctx.routes = RouteTape(replay, record=True)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(len(ids), device=device), ctx))
    logp = torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[1:, None])[:, 0]
    return ctx.routes.stacked().cpu(), logp.cpu()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_the_engine_records_the_experts_the_trainer_chooses(arch):
    """Chunked prefill (a 16-token budget), n=3 forks off one prefill, preemption (a tight KV budget) and the prefix
    cache (a second generate of the same prompts) all leave each position's recorded experts equal to those of a
    whole-sequence forward. deepseek_v3 has a dense first layer: the MoE layers are counted apart."""
    model = tiny_model(arch)
    num_moe = sum(model.cfg.is_moe_layer(i) for i in range(model.cfg.num_layers))
    per_block = kv_bytes_per_block(model.cfg, 4, torch.float32, record_routes=True)
    engine = make_engine(model, record_routes=True, max_num_batched_tokens=16, kv_cache_bytes=21 * per_block)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5)
    ps = prompts(6, seed=4)
    outs = engine.generate(ps, params) + engine.generate(ps[:2], params)
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_prefix_hit_blocks > 0
    for o in outs:
        tokens = o.prompt_ids + o.response_ids
        routes, logp = own_routes(model, tokens)
        assert o.routed_experts.shape == (len(tokens) - 1, num_moe, model.cfg.num_experts_per_tok)
        assert o.routed_experts.dtype == np.int16
        got = np.sort(o.routed_experts, axis=-1)  # the sigmoid router's top-k is unsorted
        want = np.sort(routes[:, :-1].transpose(0, 1).numpy(), axis=-1)
        np.testing.assert_array_equal(got, want)
        torch.testing.assert_close(torch.tensor(o.logprobs), logp[len(o.prompt_ids) - 1:], atol=1e-5, rtol=0)
    sample = completions_to_samples(outs[:1])[0]
    assert sample.routed_experts is outs[0].routed_experts
    plain = make_engine(model).generate(ps[:1], params)[0]
    assert plain.routed_experts is None and plain.response_ids == outs[0].response_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_engine_records_through_graphs_multistep_decode_and_async_scheduling():
    """The CUDA engine's default path (decode graphs over the fused decode forward, 8 decode steps a launch, async
    scheduling) with recording on: the recorded experts are the trainer's (fp32; a near tie may round the other way
    on another kernel, so at least 99% of the (position, layer) choices)."""
    model = tiny_model().cuda()
    engine = make_engine(model, record_routes=True)
    runner = engine.runner
    assert runner.graphs is not None and runner.decode_steps == 8 and engine.async_scheduling and runner.fused_ok
    outs = engine.generate(prompts(8), SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=1))
    agree = total = 0
    for o in outs:
        tokens = o.prompt_ids + o.response_ids
        routes, logp = own_routes(model, tokens)
        assert o.routed_experts.shape == (len(tokens) - 1, 2, 2)
        same = np.sort(o.routed_experts, -1) == np.sort(routes[:, :-1].transpose(0, 1).numpy(), -1)
        agree, total = agree + int(same.all(-1).sum()), total + same.shape[0] * same.shape[1]
        torch.testing.assert_close(torch.tensor(o.logprobs), logp[len(o.prompt_ids) - 1:], atol=1e-4, rtol=0)
    assert agree / total >= 0.99, (agree, total)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (CPU torch wheel)")
def test_the_fused_decode_forward_records_the_same_routes():
    """The fused decode forward (the Triton kernels; on CPU under the interpreter) records at each slot the experts
    its own top-k kernel chose: the module forward's, with the same tokens and logprobs."""
    model = tiny_model()
    ps, params = prompts(2, seed=7), SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=2)  # 3 fused decode steps
    runs = []
    for kernels in (False, True):
        engine = make_engine(model, enforce_eager=True, record_routes=True)
        engine.runner.use_kernel = kernels
        runs.append(engine.generate(ps, params))
    for fused, plain in zip(*runs):
        assert fused.response_ids == plain.response_ids
        np.testing.assert_array_equal(fused.routed_experts, plain.routed_experts)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (CPU torch wheel)")
def test_one_sequence_records_through_its_own_router_launch(monkeypatch):
    """B=1: the composed o_proj + router launch keeps its expert ids in the expert kernels, so a recording engine
    passes it over (no `o_proj_router` call) and records its own top-k's ids: the module forward's routes, tokens
    and logprobs."""
    from moeloop.rollout import decode_packs, fused_decode
    monkeypatch.setattr(decode_packs, "ROUTER_COMPOSE", True)
    calls, real = [], fused_decode.o_proj_router
    monkeypatch.setattr(fused_decode, "o_proj_router", lambda *a: calls.append(1) or real(*a))
    model = tiny_model()
    assert len(decode_packs.pack_routers(model)) == len(model.model.layers)
    ps, params = prompts(1, seed=5), SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=2)
    runs = []
    for kernels in (False, True):
        engine = make_engine(model, enforce_eager=True, record_routes=True)
        engine.runner.use_kernel = kernels
        runs.append(engine.generate(ps, params)[0])
    plain, fused = runs
    assert not calls and fused.response_ids == plain.response_ids
    np.testing.assert_array_equal(fused.routed_experts, plain.routed_experts)
    torch.testing.assert_close(torch.tensor(fused.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=0)
    engine = make_engine(model, enforce_eager=True)  # without recording the composed launch runs
    engine.runner.use_kernel = True
    engine.generate(ps, params)
    assert calls


def test_an_engine_of_a_dense_model_has_no_routes_to_record():
    with pytest.raises(InputError, match="no MoE layer"):
        make_engine(tiny_model("llama_tied"), record_routes=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_replayed_route_is_the_one_used_and_weighted_by_the_routers_scores(arch):
    """One MoE block by hand: with replayed ids the output is sum_k w_k expert_k(x), w the router's scores of those
    experts (softmax probabilities, or sigmoid scores), renormalised when the model does, times the scaling
    factor; rows marked invalid keep their own top-k. Replaying the block's own choice is bit-identical."""
    model = tiny_model(arch)
    block = model.moe_blocks()[0]
    torch.manual_seed(0)
    x = torch.randn(5, model.cfg.hidden_size)
    own = block.gate(x)
    E, K = model.cfg.num_experts, model.cfg.num_experts_per_tok
    replay = (own.ids_TK + 1) % E
    valid = torch.tensor([True, True, False, True, True])
    tape = RouteTape(replay[None], valid, record=True)
    out = block(x, tape)
    used = torch.where(valid[:, None], replay, own.ids_TK)
    torch.testing.assert_close(tape.stacked()[0], used, rtol=0, atol=0)
    logits = x @ block.gate.weight.T
    scores = torch.softmax(logits, -1) if block.gate.scoring_func == "softmax" else torch.sigmoid(logits)
    w = scores.gather(1, used)
    if block.gate.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    w = w * block.gate.routed_scaling_factor
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    want = torch.zeros_like(x)
    for t in range(5):
        for k in range(K):
            e = int(used[t, k])
            g, u = (gate_up[e] @ x[t]).chunk(2)  # gate_up_proj [E, 2F, D], down_proj [E, D, F]
            want[t] += w[t, k] * (down[e] @ (torch.nn.functional.silu(g) * u))
    if hasattr(block, "shared_experts"):
        want += block.shared_experts(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(block(x, RouteTape(own.ids_TK[None])), block(x))


def test_the_packed_trainer_maps_routes_to_its_rows_and_back():
    """Groups share their prompt (the compact stream runs it once): R2's recording gives each sample its own
    whole-sequence routes, and replaying arbitrary routes gives each sample the logprobs of a whole-sequence forward
    through them; replaying its own routes gives the plain logprobs exactly."""
    model = trainer_fixtures.tiny_model()
    actor = Actor(model, actor_cfg(max_tokens_per_micro_batch=24), torch.device("cpu"), 8)
    samples = rl_batch()
    assert pack_samples(samples).stream is not None
    actor.compute_logprobs(samples, "old_logprobs")
    plain = [list(s.old_logprobs) for s in samples]
    actor.compute_logprobs(samples, "old_logprobs", routes="record")
    assert [s.old_logprobs for s in samples] == plain
    for s in samples:
        routes, _ = own_routes(model, s.prompt_ids + s.response_ids)
        np.testing.assert_array_equal(s.routed_experts, routes[:, :-1].transpose(0, 1).numpy())
    actor.compute_logprobs(samples, "old_logprobs", routes="replay")
    assert [s.old_logprobs for s in samples] == plain
    E = model.cfg.num_experts
    for s in samples:  # routes no router would choose, a shift per group (its samples share the prompt's rows)
        s.routed_experts = ((s.routed_experts.astype(np.int64) + 1 + s.group_id) % E).astype(np.int16)
    actor.compute_logprobs(samples, "old_logprobs", routes="replay")
    for s in samples:
        tokens = s.prompt_ids + s.response_ids
        replay = torch.from_numpy(s.routed_experts.astype(np.int64)).transpose(0, 1)
        replay = torch.cat([replay, replay[:, -1:]], 1)  # the last position predicts nothing: any route
        _, logp = own_routes(model, tokens, replay)
        torch.testing.assert_close(torch.tensor(s.old_logprobs), logp[len(s.prompt_ids) - 1:], atol=1e-5, rtol=0)
    assert any(abs(a - b) > 1e-3 for s, p in zip(samples, plain) for a, b in zip(s.old_logprobs, p))


def test_r2_updates_replay_the_routes_of_the_old_logprob_pass(monkeypatch):
    """Through Actor.update with three mini-batches: every update forward is given the routes the old pass recorded,
    the first mini-batch's ratios are exactly 1, and without replay the same update takes other routes."""
    used = []
    real = RouteTape.replay

    def spy(self, moe_index):
        got = real(self, moe_index)
        if got is not None and moe_index == 0:
            used.append(got[0].clone())
        return got
    monkeypatch.setattr(RouteTape, "replay", spy)
    samples = rl_batch(num_groups=6)
    actor = Actor(trainer_fixtures.tiny_model(), actor_cfg(router_replay="R2", ppo_mini_batch_size=2,
                                                           max_tokens_per_micro_batch=1000),
                  torch.device("cpu"), 8)
    actor.compute_logprobs(samples, "old_logprobs", routes="record")
    recorded = [s.routed_experts for s in samples]
    metrics = actor.update(samples)
    assert len(used) == 3  # one replaying forward per mini-batch
    assert metrics["ppo_kl"] != 0.0
    for rows, group in zip(used, range(0, 6, 2)):
        part = [s for s in samples if s.group_id in (group, group + 1)]
        batch = pack_samples(part)
        assert torch.equal(rows, batch.replay_routes[0])
    assert all(s.routed_experts is r for s, r in zip(samples, recorded))


@pytest.fixture
def tape_passes(monkeypatch):
    """(mode, whether it replays routes) of every actor pass's route tape (`train.actor.route_tape`), in order; a
    pass of a dummy batch (no loss token: an empty rank's, or an update's with nothing to train) is left out."""
    import moeloop.train.actor as actor_module
    passes = []
    real = actor_module.route_tape

    def spy(batch, mode):
        tape = real(batch, mode)
        if batch.loss_mask_T.any():
            passes.append((mode, tape is not None and tape.replay_LTK is not None))
        return tape
    monkeypatch.setattr(actor_module, "route_tape", spy)
    return passes


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_router_replay_through_the_loop_dp2_matches_dp1(tmp_path, mode, tape_passes):
    """Each step's passes: R3 replays the rollout's routes in the old-logprob pass and in both epochs' updates; R2
    records in the old-logprob pass and replays in the updates. 4 steps x 2 mini-batches x 2 epochs."""
    from tests.test_rl_loop import _assert_dp2_matches_dp1, _dp_rank_with, _rows
    from tests.dist import run_ranks
    from moeloop.model.factory import init_model
    passes = tape_passes
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m", seed=3)
    extra = [f"actor.router_replay={mode}", "actor.ppo_epochs=2"]
    _dp_rank_with(0, 1, model_dir, tmp_path / "one", *extra)
    replays = [replayed for m, replayed in passes if m == "replay"]
    records = [m for m, _ in passes if m == "record"]
    assert all(replays) and len(replays) >= 4 * 2 * 2 + (4 if mode == "R3" else 0)  # R3: the old pass replays too
    assert (len(records) >= 4) if mode == "R2" else not records  # the old pass's micro-batches, each step
    assert {m for m, _ in passes} <= {"replay", "record"}
    run_ranks(_dp_rank_with, 2, model_dir, tmp_path / "two", *extra)
    _assert_dp2_matches_dp1(tmp_path)
    assert len(_rows(tmp_path / "one")) == 4


def test_r3_routes_come_from_an_engine_process_and_from_the_rollout_thread(tmp_path, tape_passes):
    """rollout.mode=disaggregated (the engine in a process of its own, on-policy): the completions bring their
    routes through the pipe and the run is bit for bit the colocated R3 run. rollout.mode=async (a thread
    generating one step ahead): every update replays too."""
    from moeloop.loop.rl import run_rl
    from moeloop.model.factory import init_model
    from tests.test_rl_async import ASYNC
    from tests.test_rl_loop import _cfg, _metrics, _weights
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m", seed=3)
    r3 = ("actor.router_replay=R3", "actor.ppo_epochs=2")
    run_rl(_cfg(model_dir, tmp_path / "apart", *r3, "rollout.mode=disaggregated", "rollout.max_staleness=0"))
    assert tape_passes and all(replayed for _, replayed in tape_passes)
    tape_passes.clear()
    run_rl(_cfg(model_dir, tmp_path / "col", *r3))
    assert _metrics(tmp_path / "apart") == _metrics(tmp_path / "col")
    wa, wc = _weights(tmp_path / "apart"), _weights(tmp_path / "col")
    assert all(torch.equal(wa[name], wc[name]) for name in wa)
    tape_passes.clear()
    run_rl(_cfg(model_dir, tmp_path / "ahead", *r3, *ASYNC))
    assert tape_passes and all(replayed for _, replayed in tape_passes)
