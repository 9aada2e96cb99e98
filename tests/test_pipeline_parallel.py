"""Pipeline parallelism (`parallel.pp`, `moeloop.parallel.pipeline`): the decoder layers split over pp stages give the
one-process logprobs, RL update (gradient clipping on), SFT step and critic update, alone and beside data, tensor,
context and expert parallelism, with a middle stage (DeepSeek-V3, pp 3) and an uneven split. Tolerance as the DP
tests': fp32 summation order of the reduced gradients."""
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from moeloop.checkpoint import CheckpointManager
from moeloop.config import load_config
from moeloop.errors import InputError
from moeloop.loop.rl import run_rl
from moeloop.loop.sft import run_sft
from moeloop.model.config import ModelConfig
from moeloop.model.factory import build_model, hf_config_dict, init_model
from moeloop.model.hf_io import save_pretrained
from moeloop.model.tokenizer import build_tokenizer
from moeloop.parallel import Layout
from moeloop.parallel.groups import init_parallel_groups, pp_rank
from moeloop.plan import model_stats
from moeloop.plan.memory import stage_ledgers
from moeloop.train.actor import Actor
from tests.dist import run_ranks
from tests.test_rl_loop import _cfg as rl_cfg, _rows, _weights, assert_same_run
from tests.test_sft import _cfg as sft_cfg, _conversations
from tests.test_tensor_parallel import (_model, _shard, assert_sft_resumes_in_one_process_and_at_dp_2,
                                       critic_pass_then_steps, run_command)
from moeloop.model.transformer import MoEForCausalLM
from tests.trainer_fixtures import (actor_cfg, assert_ranks_match, first_pass_then_steps, rl_batch, tiny_model,
                                    use_sgd)


def _model_of(arch: str):
    """test_tensor_parallel's models, and "qwen3_moe_4" / "qwen3_moe_5": its tiny qwen3_moe with 4 or 5 decoder layers
    (for pp 2 x vpp 2)."""
    return tiny_model(num_hidden_layers=int(arch[-1])) if arch in ("qwen3_moe_4", "qwen3_moe_5") else _model(arch)


def _run(pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1, kind: str = "rl", arch: str = "qwen3_moe",
         first_stage_layers: int = 0, vpp: int = 1, last_stage_layers: int = 0):
    """On this rank's share of `rl_batch()`: the old logprobs and entropies (or the critic's values), then 2 SGD steps
    (GRPO updates with the gradient clipped to 0.1, SFT steps, or critic updates); a GRPO actor's steps come after an
    update with every advantage 0. Returns the first pass's values by sample, the step metrics, the whole model's
    weights (`named_weights`: gathered from every stage), and (this rank's stage, the decoder layers it holds, whether
    it holds the embedding and the head)."""
    init_parallel_groups(cp, tp, pp, first_stage_layers, last_stage_layers, vpp=vpp)
    samples = _shard(rl_batch())
    if kind == "critic":
        model, first, metrics = critic_pass_then_steps(arch, samples, _model_of(arch))
    else:
        cfg = actor_cfg(max_tokens_per_micro_batch=24, grad_clip=0.1, router_replay="R2" if kind == "r2" else "off")
        model = Actor(_model_of(arch), cfg, torch.device("cpu"), 8, ep=ep)
        use_sgd(model, 0.05)
        first, metrics = first_pass_then_steps(model, samples, kind, ("pg_loss", "grad_norm"))
        if kind == "sft":  # the held-out loss's forward-only passes too
            metrics.append(model.sft_eval(samples)["val/sft_loss"])
    weights = {n: t.clone() for n, t in model.named_weights()}
    layers = sorted(int(name.split(".")[2]) for name, _ in model.model.named_parameters()
                    if name.startswith("model.layers."))
    held = (pp_rank(), sorted(set(layers)), model.model.model.embed_tokens.__class__.__name__,
            model.model.lm_head is not None)
    return first, metrics, weights, held


def _rank(rank, world, pp, tp, cp, ep, kind, arch, first_stage_layers, vpp=1, last_stage_layers=0):
    return _run(pp, tp, cp, ep, kind, arch, first_stage_layers, vpp, last_stage_layers)


@pytest.mark.parametrize("world,pp,tp,cp,ep,kind,arch,first", [
    (2, 2, 1, 1, 1, "rl", "qwen3_moe", 0),  # pp alone: one decoder layer a stage
    (4, 2, 1, 1, 1, "rl", "qwen3_moe", 0),  # dp 2 x pp 2
    (2, 2, 1, 1, 1, "sft", "qwen3_moe", 0),
    (2, 2, 1, 1, 1, "critic", "qwen3_moe", 0),
    (3, 3, 1, 1, 1, "rl", "deepseek_v3", 0),  # a middle stage (receives and sends); MLA, the dense layer
    (2, 2, 1, 1, 1, "rl", "deepseek_v3", 2),  # uneven: 2 layers on the first stage, 1 on the last
    (4, 2, 2, 1, 1, "rl", "qwen3_moe", 0),  # pp 2 x tp 2
    (4, 2, 1, 2, 1, "rl", "qwen3_moe", 0),  # pp 2 x cp 2: each cp rank passes its rows to its next stage's
    (4, 2, 1, 1, 2, "rl", "qwen3_moe", 0),  # dp 2 x pp 2 with the experts split over ep 2 within a stage
    (2, 2, 1, 1, 1, "r2", "qwen3_moe", 0),  # routes recorded by each stage's layers, pooled; replayed by each stage
    (2, 2, 1, 1, 1, "rl", "llama_tied", 0),  # the head tied to the embedding: a copy on each end, equal gradients
    (4, 2, 2, 1, 1, "sft", "llama_tied", 0),  # ... with tp 2 on each stage
    (2, 2, 1, 1, 1, "critic", "llama_tied", 0),  # a critic's value head is not tied to the embedding
])
def test_pipeline_parallel_matches_one_process(world, pp, tp, cp, ep, kind, arch, first):
    """Besides the numbers: each rank holds its stage's layers only (the embedding on the first stage, the head on
    the last), and `named_weights` gives every rank the whole model. The steps' gradient is clipped: these are
    test_tensor_parallel's one-process steps, whose norm its `test_the_gradient_is_clipped...` shows above the clip."""
    want_first, want_metrics, want, _ = _run(kind=kind, arch=arch)
    results = run_ranks(_rank, world, pp, tp, cp, ep, kind, arch, first)
    num_layers = _model(arch).cfg.num_layers
    counts = Layout(pp=pp, first_stage_layers=first).stage_layers(num_layers)
    for *_, (stage, layers, embedding, head) in results:
        start = sum(counts[:stage])
        assert layers == list(range(start, start + counts[stage]))
        assert embedding == ("Embedding" if stage == 0 else "StageInput")
        assert head == (stage == pp - 1)
    assert sorted({r[3][0] for r in results}) == list(range(pp))
    assert_ranks_match([r[:3] for r in results], want_first, want_metrics, want)


@pytest.mark.parametrize("world,pp,vpp,tp,cp,ep,kind,arch", [
    (2, 2, 2, 1, 1, 1, "rl", "qwen3_moe_4"),  # two chunks a stage: layers 0 and 2 on stage 0, 1 and 3 on stage 1
    (2, 2, 2, 1, 1, 1, "sft", "qwen3_moe_4"),
    (2, 2, 2, 1, 1, 1, "critic", "qwen3_moe_4"),
    (2, 2, 2, 1, 1, 1, "r2", "qwen3_moe_4"),  # routes recorded by every chunk of a stage into one tape
    (4, 2, 2, 1, 1, 1, "rl", "qwen3_moe_4"),  # dp 2 x pp 2 x vpp 2
    (4, 2, 2, 2, 1, 1, "sft", "qwen3_moe_4"),  # pp 2 x vpp 2 x tp 2
    (4, 2, 2, 1, 2, 1, "rl", "qwen3_moe_4"),  # pp 2 x vpp 2 x cp 2
    (4, 2, 2, 1, 1, 2, "rl", "qwen3_moe_4"),  # dp 2 x pp 2 x vpp 2, the experts over ep 2 within a stage
    (2, 2, 2, 1, 1, 1, "rl", "qwen3_moe_5-last3"),  # uneven: the last stage's 3 layers as 2 + 1, the first's 2 as 1 + 1
    (2, 2, 2, 1, 1, 1, "sft", "qwen3_moe_5-first3"),  # the first stage's 3 as 2 + 1, the last's as 1 + 1
])
def test_interleaved_pipeline_matches_one_process(world, pp, vpp, tp, cp, ep, kind, arch):
    """`parallel.vpp`: each stage holds vpp chunks of layers (chunk k of pp * vpp on stage k % pp), its first chunk's
    embedding on the first stage and its last chunk's head on the last, and the passes run in the interleaved order;
    the numbers are one process's. With `parallel.first_stage_layers` / `last_stage_layers` (an arch's "-first3" /
    "-last3"), that stage's layers split over its chunks and the rest over the other stage's."""
    arch, _, uneven = arch.partition("-")
    first, last = (int(uneven[-1]) if uneven.startswith(end) else 0 for end in ("first", "last"))
    want_first, want_metrics, want, _ = _run(kind=kind, arch=arch)
    results = run_ranks(_rank, world, pp, tp, cp, ep, kind, arch, first, vpp, last)
    counts = Layout(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last).chunk_layers(
        _model_of(arch).cfg.num_layers)
    assert not uneven or counts == ([1, 2, 1, 1] if last else [2, 1, 1, 1])
    for *_, (stage, layers, embedding, head) in results:
        kept = [k for k in range(pp * vpp) if k % pp == stage]
        assert layers == [i for k in kept for i in range(sum(counts[:k]), sum(counts[:k + 1]))]
        assert embedding == ("Embedding" if stage == 0 else "StageInput")
        assert head == (stage == pp - 1)
    assert_ranks_match([r[:3] for r in results], want_first, want_metrics, want)


def _cut_rank(rank, world, vpp, budget):
    init_parallel_groups(1, 1, 2, vpp=vpp)
    actor = Actor(_model_of("qwen3_moe_4"), actor_cfg(max_tokens_per_micro_batch=budget), torch.device("cpu"), 8)
    samples = rl_batch(num_groups=1, n=3)
    return [len(actor.micro_batches(samples)), len(actor.micro_batches(samples[:1])), len(actor.micro_batches([]))]


def test_an_interleaved_pipeline_cuts_whole_groups_of_pp_micro_batches():
    """As verl rounds Megatron's: under vpp the micro-batch count is a multiple of pp (the last group of the
    interleaved order full), padded with empty micro-batches where there are fewer samples; without vpp the budget's."""
    budget = max(len(s.prompt_ids) + len(s.response_ids) for s in rl_batch(num_groups=1, n=3))
    assert run_ranks(_cut_rank, 2, 1, budget) == [[3, 1, 0]] * 2
    assert run_ranks(_cut_rank, 2, 2, budget) == [[4, 2, 0]] * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


@pytest.fixture(scope="module")
def model_dir_4(tmp_path_factory):
    """The tiny qwen3_moe with 4 decoder layers (pp 2 x vpp 2: one a chunk), and the tokenizer."""
    out = tmp_path_factory.mktemp("model4") / "m"
    torch.manual_seed(3)
    model = MoEForCausalLM(ModelConfig.from_hf_dict({**hf_config_dict("qwen3_moe", "tiny"), "num_hidden_layers": 4}))
    build_tokenizer(out)
    save_pretrained(model, out)
    return out


def _loop_rank(rank, world, command, model_dir, run_dir, *extra):
    """Runs the command; returns the stage each model the trainer built kept (one a model: the actor's, ...)."""
    import moeloop.train.actor as actor
    stages, split_stages = [], actor.split_stages
    actor.split_stages = lambda model, **kw: (split_stages(model, **kw), stages.append(model.pipeline_stage))
    try:
        run_command(command, model_dir, run_dir, *extra)
    finally:
        actor.split_stages = split_stages
    return stages


@pytest.mark.parametrize("world,extra", [
    (2, ()),  # pp 2: each rank generates its share of the prompts, both stages train on both ranks' samples
    (4, ("actor.ppo_mini_batch_size=4",)),  # dp 2 x pp 2
    (2, ("rollout.mode=async", "rollout.max_staleness=1")),  # generated on a thread, pooled on the main one
    (2, ("actor.router_replay=R3",)),  # the engine's routes, pooled with the samples; each stage replays its layers
    (2, ("actor.use_kl_loss=true", "critic.enable=true", "algorithm.adv_estimator=gae")),  # reference and critic too
    (2, ("actor.lora_rank=4", "actor.use_kl_loss=true")),  # adapters on each stage's layers; the engine gets merged weights
    (2, ("algorithm.dynamic_sampling=true", "algorithm.max_refill_rounds=2")),  # kept groups dealt by dp rank
])
def test_the_rl_loop_at_pipeline_parallel_matches_one_process(model_dir, tmp_path, world, extra):
    """`moeloop rl` with parallel.pp=2 gives one process's metrics and weights (tolerance as the DP loop tests': Adam
    over all-reduced fp32 gradients); the engine of every rank gets the whole model from the stages."""
    assert _loop_rank(0, 1, "rl", model_dir, tmp_path / "one", *extra) == []
    # the actor, the reference (under LoRA the actor with its adapters off: no model of its own), the critic
    models = 1 + ("actor.use_kl_loss=true" in extra and "actor.lora_rank=4" not in extra) + ("critic.enable=true" in extra)
    stages = run_ranks(_loop_rank, world, "rl", model_dir, tmp_path / "pp", *extra, "parallel.pp=2")
    assert stages == [[rank % 2] * models for rank in range(world)]  # ranks ordered (dp, pp)
    assert_same_run(tmp_path / "one", tmp_path / "pp",
                    ("reward/mean", "reward/samples", "pg_loss", "grad_norm", "response/len_mean"))


@pytest.mark.parametrize("extra", [
    (),
    ("actor.use_kl_loss=true", "critic.enable=true", "algorithm.adv_estimator=gae"),  # reference and critic too
])
def test_the_rl_loop_at_an_interleaved_pipeline_matches_one_process(model_dir_4, tmp_path, extra):
    """`moeloop rl` with parallel.pp=2 parallel.vpp=2 (two chunks of one layer a stage) gives one process's metrics
    and weights; the engines get the whole model."""
    run_command("rl", model_dir_4, tmp_path / "one", *extra)
    models = 1 + 2 * ("critic.enable=true" in extra)
    stages = run_ranks(_loop_rank, 2, "rl", model_dir_4, tmp_path / "pp", *extra, "parallel.pp=2", "parallel.vpp=2")
    assert stages == [[0] * models, [1] * models]
    assert_same_run(tmp_path / "one", tmp_path / "pp",
                    ("reward/mean", "reward/samples", "pg_loss", "grad_norm", "response/len_mean"))


def test_sft_at_an_interleaved_pipeline_resumes_in_one_process_and_at_dp_2(model_dir_4, tmp_path):
    """Checkpoints of an interleaved pipeline (each rank saving its two chunks' layers) reshard: see
    `assert_sft_resumes_in_one_process_and_at_dp_2`."""
    assert_sft_resumes_in_one_process_and_at_dp_2(model_dir_4, tmp_path, _loop_rank, "parallel.pp=2 parallel.vpp=2",
                                                  [[0], [1]])


def test_sft_at_pipeline_parallel_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path):
    """`moeloop sft` at pp 2 (each stage's layers saved by its rank in its DCP checkpoint): see
    `assert_sft_resumes_in_one_process_and_at_dp_2`."""
    assert_sft_resumes_in_one_process_and_at_dp_2(model_dir, tmp_path, _loop_rank, "parallel.pp=2", [[0], [1]])


def test_pipeline_parallel_refuses_what_it_cannot_split(model_dir, tmp_path):
    with pytest.raises(AssertionError, match=r"parallel.pp=3 must be >= 1 and divide the 2 ranks"):
        run_ranks(_loop_rank, 2, "rl", model_dir, tmp_path / "a", "parallel.pp=3")
    with pytest.raises(InputError, match=r"parallel.etp=2"):
        run_rl(rl_cfg(model_dir, tmp_path / "c", "parallel.pp=2", "parallel.etp=2"))
    with pytest.raises(AssertionError, match=r"the model chunks would hold \[2, 0\] of the 2 decoder layers"):
        run_ranks(_loop_rank, 2, "rl", model_dir, tmp_path / "d", "parallel.pp=2", "parallel.first_stage_layers=2")
    with pytest.raises(AssertionError, match=r"parallel.pp=2, parallel.vpp=2: the model chunks would hold \[1, 1, 0, 0\]"):
        run_ranks(_loop_rank, 2, "rl", model_dir, tmp_path / "e", "parallel.pp=2", "parallel.vpp=2")
    with pytest.raises(AssertionError, match=r"parallel.vpp=2: the model chunks would hold \[1, 1, 0, 0\]"):
        run_ranks(_loop_rank, 2, "rl", model_dir, tmp_path / "f", "parallel.pp=2", "parallel.vpp=2",
                  "parallel.last_stage_layers=1")  # (the last stage's one layer cannot fill its 2 chunks)
    with pytest.raises(InputError, match=r"parallel.vpp=2: .* pp > 1 for vpp > 1"):
        run_rl(rl_cfg(model_dir, tmp_path / "g", "parallel.vpp=2"))


def _weights_rank(rank, world, pp, tp, arch):
    init_parallel_groups(1, tp, pp)
    model = build_model(arch, "tiny", seed=0).to(torch.bfloat16)
    Actor(model, actor_cfg(), torch.device("cpu"), 8, master_weights=False)
    persistent = [b for name, b in model.named_buffers() if name in model.state_dict()]  # (DeepSeek's router bias)
    kept = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 2 for p in [*model.parameters(), *persistent])
    return pp_rank(), kept


@pytest.mark.parametrize("world,pp,tp,arch", [(2, 2, 1, "qwen3_moe"), (4, 2, 1, "qwen3_moe"), (4, 2, 2, "qwen3_moe"),
                                              (3, 3, 1, "deepseek_v3")])
def test_the_planner_counts_the_weights_a_pipeline_stage_keeps(world, pp, tp, arch):
    """`moeloop plan`'s weights entry of each stage is the mean bytes a rank of that stage keeps: its layers (the
    embedding on the first stage, the final norm and head on the last), sharded as without pipeline parallelism."""
    kept = run_ranks(_weights_rank, world, pp, tp, arch)
    cfg = load_config(None, ["model.path=unused", f"parallel.dp={world // (pp * tp)}", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", "model.dtype=bfloat16", "model.fp32_master_weights=false"])
    cfg.plan.hf_config = hf_config_dict(arch, "tiny")
    stats = model_stats(ModelConfig.from_hf_dict(cfg.plan.hf_config))
    ledgers = stage_ledgers(cfg, stats, Layout.from_section(cfg.parallel))
    for stage, ledger in enumerate(ledgers):
        mine = [b for s, b in kept if s == stage]
        assert len(mine) == world // pp
        assert sum(mine) / len(mine) == pytest.approx(ledger.entries["weights"], rel=1e-9), stage


def _schedule_rank(rank, world, passes, vpp=1):
    from moeloop.parallel import pipeline
    init_parallel_groups(1, 1, world, vpp=vpp)
    events = []

    def forward(i):
        name = f"{i}" if vpp == 1 else f"{i}.{pipeline._SCHEDULE.chunk}"  # micro-batch.chunk
        events.append(f"F{name}")
        x = torch.ones((), requires_grad=True)
        x.register_hook(lambda grad, name=name: events.append(f"B{name}"))
        return x * 2
    pipeline.run_passes(range(passes), forward)
    return events


def test_the_stages_run_their_passes_in_1f1b_order():
    """Stage s runs pp - 1 - s forwards ahead, then a forward and a backward in turn, then the backwards left (at most
    pp - s micro-batches in flight, as `moeloop plan` counts); with fewer passes than that, all forwards first."""
    assert run_ranks(_schedule_rank, 3, 4) == [
        ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]]
    assert run_ranks(_schedule_rank, 3, 1) == [["F0", "B0"]] * 3


def test_the_stages_run_their_chunks_passes_in_megatrons_interleaved_order():
    """pp 2 x vpp 2, 4 micro-batches: groups of pp micro-batches through chunk 0 then chunk 1 (backward: chunk 1 then
    0); stage s runs 2 (pp - 1 - s) + (vpp - 1) pp forwards ahead (Megatron's interleaved warmup), then a forward and a
    backward in turn."""
    assert run_ranks(_schedule_rank, 2, 4, 2) == [
        ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "B0.1", "F3.0", "B1.1", "F2.1", "B0.0", "F3.1", "B1.0",
         "B2.1", "B3.1", "B2.0", "B3.0"],
        ["F0.0", "F1.0", "F0.1", "B0.1", "F1.1", "B1.1", "F2.0", "B0.0", "F3.0", "B1.0", "F2.1", "B2.1",
         "F3.1", "B3.1", "B2.0", "B3.0"]]


def _messages(units, pp: int, vpp: int, stage: int) -> dict:
    """What `stage` sends and receives, in its order, by (sender, receiver, kind): a chunk's forward receives the
    previous chunk's output and sends its own on, its backward receives its output's gradient and sends its input's."""
    out, last = {}, pp * vpp - 1
    for forward, mb, c in units:
        k = c * pp + stage
        prev, nxt = (k - 1, (stage - 1) % pp), (k + 1, (stage + 1) % pp)
        if forward:
            moves = [(prev[1], stage, "act", k - 1)] * (k > 0) + [(stage, nxt[1], "act", k)] * (k < last)
        else:
            moves = [(nxt[1], stage, "grad", k + 1)] * (k < last) + [(stage, prev[1], "grad", k)] * (k > 0)
        for src, dst, kind, chunk in moves:
            out.setdefault(("send" if src == stage else "recv", src, dst, kind), []).append((mb, chunk))
    return out


def test_every_schedule_runs_each_pass_once_matches_its_sends_and_cannot_deadlock():
    """For pp 2-5, vpp 1-3 and 1 to 3 pp + 1 micro-batches: each stage runs each (micro-batch, chunk) forward once and
    its backward once after it; the stages get through their passes (so no wait can deadlock); on each channel and
    kind the receiver takes the messages in the order the sender sends them (point-to-point messages match in order);
    with whole groups of pp micro-batches the bubble is Megatron's, (pp - 1) / vpp passes (m + (pp - 1) / vpp) / m."""
    from moeloop.parallel.pipeline import _finish_time, schedule, schedule_stretch
    for pp in (2, 3, 4, 5):
        for vpp in (1, 2, 3):
            for m in range(1, 3 * pp + 2):
                stages = schedule(m, pp, vpp)
                every = sorted((mb, c) for mb in range(m) for c in range(vpp))
                sent, received = {}, {}
                for stage, units in enumerate(stages):
                    forwards = [(mb, c) for f, mb, c in units if f]
                    assert sorted(forwards) == every and sorted((mb, c) for f, mb, c in units if not f) == every
                    assert all(units.index((True, mb, c)) < units.index((False, mb, c)) for mb, c in every)
                    for (way, *channel), msgs in _messages(units, pp, vpp, stage).items():
                        (sent if way == "send" else received)[tuple(channel)] = msgs
                assert sent == received, (pp, vpp, m)
                assert _finish_time(stages, pp, vpp) is not None
                if m % pp == 0:
                    assert schedule_stretch(m, pp, vpp) == pytest.approx((m + (pp - 1) / vpp) / m), (pp, vpp, m)


def _tied_adam_state(actor: Actor) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's Adam state of its copies of the tied weight (one process: the one parameter; pp 2: the embedding on
    the first stage, the head on the last), whole: {name: {"step", "exp_avg", "exp_avg_sq"}}. Collective under FSDP."""
    copies = [(n, p) for n, p in actor.model.named_parameters() if n in ("model.embed_tokens.weight", "lm_head.weight")]
    return {n: {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                for k, v in actor.optimizer.state[p].items()} for n, p in copies}


def _sizes(layout: str) -> dict[str, int]:
    """"dp2-pp2-tp2" -> {"dp": 2, "pp": 2, "tp": 2, "vpp": 1, "world": 8}; "one": one process."""
    sizes = {"dp": 1, "pp": 1, "tp": 1, "vpp": 1}
    sizes.update({part[:-1]: int(part[-1]) for part in layout.split("-") if part != "one"})
    return {**sizes, "world": sizes["dp"] * sizes["pp"] * sizes["tp"]}


def _tied_checkpoint_rank(rank, world, layout, directory, save, legacy=False):
    """A tied-head actor (the tiny qwen3_moe with 4 decoder layers and tie_word_embeddings; AdamW at a constant lr) at
    `layout` (`_sizes`): an update and a save, or a load; then one more update. Returns the tied weight's Adam state
    after the save or the load (`_tied_adam_state`), and the whole model's weights after that update. `legacy`: saved
    as before the state had one name (the last stage's copy under its own)."""
    import moeloop.checkpoint.manager as manager_module
    if legacy:
        manager_module._head_copy_name = lambda model: None
    sizes = _sizes(layout)
    init_parallel_groups(1, sizes["tp"], sizes["pp"], vpp=sizes["vpp"])
    cfg = actor_cfg(max_tokens_per_micro_batch=24)
    cfg.optim.min_lr_ratio = 1.0
    actor = Actor(tiny_model(num_hidden_layers=4, tie_word_embeddings=True), cfg, torch.device("cpu"), 8)
    manager = CheckpointManager(directory)
    if save:
        actor.update(_shard(rl_batch()))
        manager.save(1, actor.model, actor.optimizer, {})
    else:
        manager.load(manager.latest(), actor.model, actor.optimizer)
    state = _tied_adam_state(actor)
    actor.update(_shard(rl_batch()))
    return state, {n: t.clone() for n, t in actor.named_weights()}


@pytest.mark.parametrize("saved,resumed,legacy", [
    ("one", ["pp2", "dp2-pp2", "pp2-tp2", "pp2-vpp2"], False),  # both copies' state from the one saved
    ("pp2", ["one", "dp2"], False),  # dp 2: FSDP, each rank a shard of the one parameter
    ("dp2-pp2", ["one", "pp2"], False),  # each copy's state saved in two shards, by its stage's ranks
    ("pp2-vpp2", ["one", "pp2"], False),
    ("pp2", ["one", "dp2", "pp2"], True),  # a pp 2 checkpoint of before: its param groups may be the last stage's
])
def test_a_tied_heads_optimizer_state_moves_between_pipeline_layouts(tmp_path, saved, resumed, legacy):
    """A head tied to the embedding is one parameter in one process and two copies at pp 2 (first and last stage),
    whose Adam states are equal (same summed gradient, same steps); a checkpoint holds that state once, under the
    embedding's name, and every copy at every layout loads it: bit-exact (DCP copies it), and the next update then
    gives the saving run's weights, the head's copy included (tolerance as `assert_ranks_match`'s, Adam steps over
    another fp32 summation order)."""
    saver = run_ranks(_tied_checkpoint_rank, _sizes(saved)["world"], saved, tmp_path, True, legacy)
    saved_names = dcp.FileSystemReader(str(CheckpointManager(tmp_path).latest())).read_metadata().state_dict_metadata
    assert "optim.state.model.embed_tokens.weight.exp_avg" in saved_names
    assert bool([name for name in saved_names if name.startswith("optim.state.lm_head.")]) == legacy
    state = saver[0][0]["model.embed_tokens.weight"]
    for copy in (c for rank_state, _ in saver for c in rank_state.values()):  # (pp 2: the head's copy too, equal)
        for key, value in state.items():
            torch.testing.assert_close(copy[key], value, rtol=0, atol=0)
    for layout in resumed:
        ranks = run_ranks(_tied_checkpoint_rank, _sizes(layout)["world"], layout, tmp_path, False)
        for copies in (copies for copies, _ in ranks):
            assert copies and all(copy.keys() == state.keys() for copy in copies.values())
            for name, copy in copies.items():
                for key, value in state.items():
                    torch.testing.assert_close(copy[key], value, rtol=0, atol=0,
                                               msg=lambda m: f"{layout} {name} {key}: {m}")
        for weights in (weights for _, weights in ranks):
            assert weights.keys() == saver[0][1].keys() and "lm_head.weight" in weights
            for name, w in saver[0][1].items():
                torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{layout} {name}: {m}")


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """The tiny qwen3_moe with its head tied to the embedding (tie_word_embeddings), and the tokenizer."""
    out = tmp_path_factory.mktemp("tied") / "m"
    torch.manual_seed(3)
    cfg = ModelConfig.from_hf_dict({**hf_config_dict("qwen3_moe", "tiny"), "tie_word_embeddings": True})
    model = MoEForCausalLM(cfg)
    build_tokenizer(out)
    save_pretrained(model, out)
    return out


def _on_ranks(fn, world: int, *args):
    """`fn` on `world` gloo ranks, or in this process for 1."""
    return fn(0, 1, *args) if world == 1 else run_ranks(fn, world, *args)


def _sft_rank(rank, world, model_dir, run_dir, resume, *extra):
    """`moeloop sft` (`resume`: from run_dir's latest checkpoint) with the SFT tests' config and `extra` overrides."""
    run_sft(sft_cfg(model_dir, run_dir, *extra), resume=resume)
    return True


def test_a_tied_models_sft_resumes_across_pipeline_layouts(tied_model_dir, tmp_path):
    """`moeloop sft` of a model whose head is tied to the embedding, 4 steps: straight at pp 2 as in one process; 2
    steps in one process resumed at pp 2 for the 3rd and 4th; 2 at pp 2 resumed in one process and at dp 2 (model,
    AdamW state, scheduler, data cursor, RNG). Each logs one process's loss, gradient norm and lr at every step and ends
    at its weights (tolerance as `assert_sft_resumes_in_one_process_and_at_dp_2`'s: AdamW over another fp32 summation
    order). A resumed head copy without its AdamW state would step otherwise than the embedding from the 3rd step, and
    the 4th step's loss (computed with the head) would show it."""
    train = _conversations(tmp_path / "train.jsonl")
    extra = ("data.prompt_key=messages", "data.max_response_length=16", f"data.train_files=[{train}]",
             "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "data.val_files=[]")

    def at(world, run, resume, steps, *layout):
        _on_ranks(_sft_rank, world, tied_model_dir, tmp_path / run, resume, f"trainer.steps={steps}", *extra, *layout)
    at(1, "one", False, 4)
    at(2, "pp", False, 4, "parallel.pp=2")
    at(1, "one_to_pp", False, 2)
    at(2, "one_to_pp", True, 4, "parallel.pp=2")
    at(2, "pp_to_one", False, 2, "parallel.pp=2")
    shutil.copytree(tmp_path / "pp_to_one", tmp_path / "pp_to_dp")
    at(1, "pp_to_one", True, 4)
    at(2, "pp_to_dp", True, 4)
    want = [(r["sft_loss"], r["grad_norm"], r["lr"]) for r in _rows(tmp_path / "one")]
    assert len(want) == 4
    for run in ("pp", "one_to_pp", "pp_to_one", "pp_to_dp"):
        got = [(r["sft_loss"], r["grad_norm"], r["lr"]) for r in _rows(tmp_path / run)]
        assert len(got) == 4, run
        for step, (g, w) in enumerate(zip(got, want), 1):
            assert g == pytest.approx(w, rel=1e-5), (run, step)
        w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / run)
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5, msg=lambda m: f"{run} {name}: {m}")


def _rl_rank(rank, world, model_dir, run_dir, resume, *extra):
    """`moeloop rl` (`resume`: from run_dir's latest checkpoint) as `run_command`'s, with `extra` overrides."""
    run_rl(rl_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *extra), resume=resume)
    return True


def test_a_tied_models_rl_loop_resumes_across_pipeline_layouts(tied_model_dir, tmp_path):
    """`moeloop rl` of a model whose head is tied to the embedding, 4 steps: 2 in one process resumed at pp 2, and 2
    at pp 2 resumed in one process, log the straight one-process run's rewards, lengths, losses and gradient norms at
    every step and end at its weights (`assert_same_run`: Adam over all-reduced fp32 gradients). (The engine takes the
    weight stream's head under its own name too: `RolloutEngine.update_weights`.)"""
    for run, first, then in (("one_to_pp", (), ("parallel.pp=2",)), ("pp_to_one", ("parallel.pp=2",), ())):
        for resume, layout, steps in ((False, first, 2), (True, then, 4)):
            _on_ranks(_rl_rank, 2 if layout else 1, tied_model_dir, tmp_path / run, resume, f"trainer.steps={steps}",
                      *layout)
    _rl_rank(0, 1, tied_model_dir, tmp_path / "one", False, "trainer.steps=4")
    for run in ("one_to_pp", "pp_to_one"):
        assert len(_rows(tmp_path / run)) == 4
        assert_same_run(tmp_path / "one", tmp_path / run,
                        ("reward/mean", "reward/samples", "pg_loss", "grad_norm", "response/len_mean"))


def _timeouts_rank(rank, world, timeout):
    from moeloop.parallel import groups
    from moeloop.parallel.expert import build_expert_mesh
    from moeloop.parallel.fsdp import build_dp_mesh
    groups.init_parallel_groups(1, 2, 2, timeout=timeout)
    of = lambda group: group._get_backend(torch.device("cpu")).options._timeout  # noqa: E731
    made = [groups.tp_group(), groups.pp_group(), groups.pp_grad_group(), groups.pipeline_ends_group(),
            groups.replica_group()]
    meshes = [build_dp_mesh("cpu"), build_expert_mesh("cpu", 2)]
    made += [mesh.get_group(dim) for mesh in meshes for dim in range(mesh.ndim)]
    return [of(group).total_seconds() for group in made]


def test_the_parallel_groups_and_meshes_take_the_runs_timeout():
    """torch gives a subgroup (and DeviceMesh's groups) its own 30-minute default, not the default group's: the run's
    (`init_parallel_groups(timeout=...)`, `loop.env.DIST_TIMEOUT`) reaches every group and mesh dim the layouts use."""
    from datetime import timedelta
    assert run_ranks(_timeouts_rank, 4, timedelta(seconds=42)) == [[42.0] * 9] * 4
