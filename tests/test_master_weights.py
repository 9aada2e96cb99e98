"""fp32 master weights for bf16 training (`model.fp32_master_weights`, moeloop.train.precision): at an RL learning rate
pure bf16 hardly moves the weights while the masters move as fp32 training does; the gradients the masters get are
the bf16 forward's (the same bits with one micro-batch); activation checkpointing recomputes on the same casts; the
engine, the export and the checkpoint get what they should; a checkpoint resumes with the masters switched on or
off; 2 ranks (FSDP's mixed precision) match 1 rank."""
import pytest
import torch

import moeloop.train.actor as actor_module
from moeloop.checkpoint import CheckpointManager
from moeloop.data import EpochCursor
from moeloop.loop.sft import actor_state_load, actor_state_save
from moeloop.model.experts import Experts
from moeloop.model.factory import init_model
from moeloop.model.hf_io import load_pretrained
from moeloop.train.actor import Actor
from moeloop.train.precision import cast_params
from tests.dist import run_ranks
from tests.test_rl_loop import _cfg, _metrics, run_rl
from tests.test_rollout_engine import tiny_model
from tests.trainer_fixtures import actor_cfg, rl_batch, tiny_model as seeded_tiny_model


def _moved(before: dict, model) -> float:
    changed = sum(int((p.detach().float() != before[n].float()).sum()) for n, p in model.named_parameters())
    return changed / sum(p.numel() for p in model.parameters())


def _actor(master: bool, lr: float = 1e-6, experts_impl: str = "auto", **cfg) -> Actor:
    model = tiny_model().to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, Experts):
            module.impl = experts_impl
    actor = Actor(model, actor_cfg(**cfg), torch.device("cpu"), 8, master_weights=master)
    for group in actor.optimizer.param_groups:
        group["lr"] = lr
    return actor


def test_masters_move_at_an_rl_learning_rate_where_pure_bf16_does_not():
    """One AdamW step at lr 1e-6 on a bf16 tiny model: pure bf16 changes under 1% of the weights (each update is
    below bf16's resolution); fp32 masters change as fp32 training does (~90%: the rest get no gradient). The engine's
    weights are the masters rounded to bf16."""
    moved = {}
    for master in (False, True):
        actor = _actor(master)
        before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        actor.update(rl_batch())
        moved[master] = _moved(before, actor.model)
        if master:
            assert all(p.dtype == torch.float32 for p in actor.model.parameters())
            weights = dict(actor.named_weights())
            assert all(w.dtype == torch.bfloat16 for w in weights.values())
            masters = actor.model.state_dict()
            assert all(torch.equal(weights[n], masters[n].to(torch.bfloat16)) for n in weights)
    assert moved[False] < 0.01 and moved[True] > 0.85


def _grads_of(actor: Actor, monkeypatch) -> dict:
    """The gradients the optimizer steps with (captured at `clip_and_step`)."""
    seen, real = {}, actor_module.clip_and_step

    def spy(model, optimizer, grad_clip):
        seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return real(model, optimizer, grad_clip)

    monkeypatch.setattr(actor_module, "clip_and_step", spy)
    actor.update(rl_batch())
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("budget,impl", [(10_000, "auto"), (10_000, "loop"), (24, "auto")])
def test_the_masters_gradients_are_the_bf16_forwards(monkeypatch, budget, impl):
    """The masters get the gradients of the bf16 forward: bit for bit in one micro-batch (each bf16 gradient upcast;
    the experts as grouped_mm and as the per-expert loop); cut into micro-batches, summed in fp32 rather than in bf16
    (within bf16's rounding of the sum)."""
    pure = _grads_of(_actor(False, max_tokens_per_micro_batch=budget, experts_impl=impl), monkeypatch)
    master = _grads_of(_actor(True, max_tokens_per_micro_batch=budget, experts_impl=impl), monkeypatch)
    assert pure.keys() == master.keys()
    for name, g in pure.items():
        assert master[name].dtype == torch.float32
        if budget == 10_000:
            assert torch.equal(master[name], g.float()), name
        else:
            torch.testing.assert_close(master[name].to(torch.bfloat16), g, rtol=2e-2, atol=1e-4)


def test_checkpointed_layers_recompute_on_the_same_casts(monkeypatch):
    """With activation checkpointing the backward recomputes each layer inside the casts: the same gradients."""
    plain = _grads_of(_actor(True), monkeypatch)
    actor = _actor(True)
    actor.model.model.gradient_checkpointing = True
    checkpointed = _grads_of(actor, monkeypatch)
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=0, atol=0)


def test_cast_params_restores_the_parameters_and_shares_one_cast():
    model = tiny_model()
    params = dict(model.named_parameters())
    q_proj = model.model.layers[0].self_attn.q_proj
    with cast_params(model, torch.bfloat16):
        assert q_proj.weight.dtype == torch.bfloat16 and q_proj.weight.grad_fn is not None  # the cast
        assert all(p is params[n] for n, p in model.named_parameters())  # the table still holds the masters
    assert q_proj.weight is params["model.layers.0.self_attn.q_proj.weight"]
    assert all(p is params[n] for n, p in model.named_parameters())


RUNS = {"bf16": (torch.bfloat16, False), "masters": (torch.bfloat16, True), "fp32": (torch.float32, True)}


def _run_actor(run: str, seed: int) -> Actor:
    """An actor as a run of `RUNS[run]` (model.dtype, model.fp32_master_weights) builds it."""
    dtype, master = RUNS[run]
    return Actor(seeded_tiny_model(seed).to(dtype), actor_cfg(), torch.device("cpu"), 8, total_steps=4,
                 master_weights=master)


@pytest.mark.parametrize("saved,resumed,note", [("bf16", "masters", "upcast exactly to float32"),
                                                ("masters", "bf16", "rounded to bfloat16"),
                                                ("fp32", "bf16", "rounded to bfloat16"),
                                                ("fp32", "masters", None)])
def test_a_checkpoint_resumes_with_the_masters_switched(tmp_path, capsys, saved, resumed, note):
    """A checkpoint resumes across model.fp32_master_weights (and a float32 run's in bfloat16): the weights and the
    Adam state (step, exp_avg, exp_avg_sq) are the saved ones in the dtype the resumed run keeps (bf16 upcast exactly,
    fp32 rounded), as torch's Optimizer.load_state_dict casts; a cast is named on stderr; training goes on."""
    saver = _run_actor(saved, seed=0)
    saver.update(rl_batch())
    actor_state_save(CheckpointManager(tmp_path), 1, saver, EpochCursor(10))
    capsys.readouterr()
    actor = _run_actor(resumed, seed=1)  # other initial weights: what it holds comes from the checkpoint
    actor_state_load(CheckpointManager(tmp_path), tmp_path / "step_000001", actor, EpochCursor(10))
    dtype = torch.bfloat16 if resumed == "bf16" else torch.float32
    before = dict(saver.model.named_parameters())
    for name, p in actor.model.named_parameters():
        assert p.dtype == dtype and torch.equal(p, before[name].to(dtype)), name
        state, saved_state = actor.optimizer.state[p], saver.optimizer.state[before[name]]
        assert state.keys() == saved_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].item() == 1 and state["exp_avg"].dtype == dtype, name
        assert all(torch.equal(state[k], saved_state[k].to(state[k].dtype)) for k in state), name
    assert actor.scheduler.last_epoch == saver.scheduler.last_epoch == 1
    err = capsys.readouterr().err
    assert (f"{tmp_path / 'step_000001'}: " in err and note in err and "model.fp32_master_weights" in err) if note \
        else err == "", err
    actor.update(rl_batch(seed=1))  # fused AdamW steps with its state in each parameter's dtype


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


def _bf16_rank(rank, world, model_dir, run_dir, *extra):
    # (every sample trains: with actor.skip_zero_advantage the ranks' bf16 products see other row counts, and step 2's
    # small gradient norm drifted 6% between 1 and 2 ranks; the skip's DP equality is checked in fp32, test_rl_loop)
    run_rl(_cfg(model_dir, run_dir, "model.dtype=bfloat16", "actor.optim.lr=1e-5", "actor.skip_zero_advantage=false",
                *extra))
    return True


def test_a_bf16_run_trains_fp32_masters_exports_bf16_and_2_ranks_match_1(model_dir, tmp_path):
    """The RL loop with model.dtype=bfloat16: the HF export is bf16 (the masters rounded), the checkpoint holds the
    fp32 masters, and 2 ranks (FSDP's mixed precision: fp32 shards, bf16 compute, fp32 reduction) give 1 rank's
    rewards and, within bf16 compute's noise, its losses and weights."""
    _bf16_rank(0, 1, model_dir, tmp_path / "one", "checkpoint.save_every=2")
    run_ranks(_bf16_rank, 2, model_dir, tmp_path / "two")
    from safetensors import safe_open
    for shard in (tmp_path / "one" / "hf").glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    one = load_pretrained(tmp_path / "one" / "hf", dtype=torch.bfloat16).state_dict()
    base = load_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    _bf16_rank(0, 1, model_dir, tmp_path / "pure", "model.fp32_master_weights=false")
    pure = load_pretrained(tmp_path / "pure" / "hf", dtype=torch.bfloat16).state_dict()
    changed = {name: sum(int((w[n] != base[n]).sum()) for n in w) for name, w in (("one", one), ("pure", pure))}
    # the masters' small steps add up to bf16 steps, pure bf16's mostly vanish (52,222 against 20,583 when written)
    assert changed["one"] > 2 * changed["pure"], changed
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(str(tmp_path / "one" / "checkpoints" / "step_000002")).read_metadata()
    dtypes = {m.properties.dtype for k, m in meta.state_dict_metadata.items() if k.startswith("model.")
              and hasattr(m, "properties")}
    assert dtypes == {torch.float32}
    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [m["reward/mean"] for m in m2] == pytest.approx([m["reward/mean"] for m in m1])
    assert [m["grad_norm"] for m in m2] == pytest.approx([m["grad_norm"] for m in m1], rel=2e-2)
    two = load_pretrained(tmp_path / "two" / "hf", dtype=torch.bfloat16).state_dict()
    # bf16 compute's noise in a tiny gradient can flip the sign of Adam's normalised step (lr each way, 4 steps), and
    # the export rounds to bf16 (2^-7 relative)
    for name in one:
        torch.testing.assert_close(two[name].float(), one[name].float(), rtol=2 ** -7, atol=8e-5)
    diff = sum(int((two[n] != one[n]).sum()) for n in one)
    assert diff < 0.02 * sum(t.numel() for t in one.values()), diff  # and equal but for a few (893 of 140,672 when written)


def test_the_planner_counts_fp32_state_for_bf16_training():
    """`moeloop plan`'s default state bytes a parameter: fp32 weights, grads and Adam m and v with the masters; bf16
    without them; a LoRA base stays in model.dtype (its adapters are counted apart)."""
    from moeloop.config.load import load_config
    from moeloop.plan.memory import state_bytes
    def sb(*extra):
        s = state_bytes(load_config(None, ["model.path=unused", "model.dtype=bfloat16", *extra]))
        return s.weights, s.grads, s.optimizer
    assert sb() == (4, 4, 8)
    assert sb("model.fp32_master_weights=false") == (2, 2, 4)
    assert sb("actor.lora_rank=8") == (2, 2, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_masters_get_the_bf16_forwards_gradients_and_move():
    """On CUDA (bf16 grouped_mm experts, Triton training kernels): the masters' gradients equal the pure bf16 run's
    upcast (to bf16 kernels' run-to-run noise), and one step at lr 1e-6 moves the masters where pure bf16 barely moves."""
    def run(master: bool):
        model = tiny_model().to("cuda", torch.bfloat16)
        actor = Actor(model, actor_cfg(), torch.device("cuda"), 8, master_weights=master)
        for group in actor.optimizer.param_groups:
            group["lr"] = 1e-6
        before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        grads, real = {}, actor_module.clip_and_step

        def spy(model, optimizer, grad_clip):
            grads.update({n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
            return real(model, optimizer, grad_clip)
        actor_module.clip_and_step = spy
        try:
            actor.update(rl_batch())
        finally:
            actor_module.clip_and_step = real
        return grads, _moved(before, actor.model)
    (pure, moved_pure), (master, moved_master) = run(False), run(True)
    for name, g in pure.items():
        torch.testing.assert_close(master[name], g, rtol=2e-2, atol=1e-3)
    assert moved_pure < 0.05 and moved_master > 0.85
