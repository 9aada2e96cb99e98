"""Colocated weight sharing: the engine aliases the actor's parameters, generates exactly what a copied
engine would, is paused and drained by every optimizer step, refuses to generate until the push, and the
push still gates on drain and bumps the version."""
import pytest
import torch

from moeloop.config.schema import RolloutSection
from moeloop.rollout import Engine, SamplingParams
from moeloop.sync import InProcessTransport, WeightSyncer, drain_before_step, share_parameters
from moeloop.train.actor import Actor
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model

ROLLOUT = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, kv_cache_bytes=1 << 20, max_model_len=48)
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6)
PROMPTS = [[5, 6, 7], [9, 3], [11, 12, 13, 14]]


def _shared_setup():
    actor = Actor(tiny_model(), actor_cfg(), torch.device("cpu"), 8)
    model = tiny_model(seed=1)  # other weights: sharing must replace them
    names = share_parameters(actor.model, model)
    engine = Engine(model, RolloutSection(**ROLLOUT), eos_token_ids=[])
    drain_before_step(actor.optimizer, engine)
    return actor, engine, names


def _copied_engine(actor):
    model = tiny_model(seed=1)
    model.load_state_dict(actor.model.state_dict())
    return Engine(model, RolloutSection(**ROLLOUT), eos_token_ids=[])


def _tokens(engine):
    return [c.response_ids for c in engine.generate(PROMPTS, GREEDY)]


def test_engine_aliases_every_parameter_and_generates_like_a_copy():
    actor, engine, names = _shared_setup()
    trainer = dict(actor.model.named_parameters())
    assert sorted(names) == sorted(trainer)
    for name, p in engine.model.named_parameters():
        assert p.data_ptr() == trainer[name].data_ptr()
    assert _tokens(engine) == _tokens(_copied_engine(actor))


def test_optimizer_step_drains_and_pauses_until_the_push():
    actor, engine, _ = _shared_setup()
    engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # one sequence in flight
    with pytest.raises(RuntimeError, match="in flight"):  # the engine's own gate still refuses an update
        engine.update_weights(actor.named_weights(), version=1)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    actor.update(rl_batch())  # the optimizer step pauses and drains first
    assert engine.is_drained and engine.scheduler.paused
    assert any(not torch.equal(p, before[n]) for n, p in engine.model.named_parameters())  # weights moved in place
    with pytest.raises(RuntimeError, match="paused"):  # nothing generates from new weights at the old version
        engine.generate(PROMPTS, GREEDY)
    report = WeightSyncer(InProcessTransport("cpu")).push(actor.named_weights(), engine, version=1)
    assert engine.policy_version == 1 and not engine.scheduler.paused and report.num_tensors > 0
    assert _tokens(engine) == _tokens(_copied_engine(actor))


def test_checkpoint_of_a_stateless_optimizer_leaves_the_engine_running():
    """DCP initialises an optimizer with no state by a step at lr 0 (zero gradients): that step moves no weight, so
    the gate lets it pass; a real step still pauses the engine until the push."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    actor, engine, _ = _shared_setup()
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    assert not actor.optimizer.state
    get_optimizer_state_dict(actor.model, actor.optimizer)
    assert actor.optimizer.state  # DCP stepped it
    assert not engine.scheduler.paused
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    assert _tokens(engine) == _tokens(_copied_engine(actor))
    actor.update(rl_batch())
    assert engine.scheduler.paused


def test_mismatched_dtype_keeps_its_own_copy_and_push_copies_it():
    actor = Actor(tiny_model(), actor_cfg(), torch.device("cpu"), 8)
    model = tiny_model(seed=1).to(torch.bfloat16)
    assert share_parameters(actor.model, model) == []
    engine = Engine(model, RolloutSection(**ROLLOUT), eos_token_ids=[])
    WeightSyncer(InProcessTransport("cpu")).push(actor.named_weights(), engine, version=1)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, dict(actor.model.named_parameters())[name].detach().to(torch.bfloat16))
