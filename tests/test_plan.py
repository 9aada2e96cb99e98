"""The planner against seed 002's published figures and verl's DeepSeek-V3-671B demo."""
import json
from pathlib import Path

import pytest

from moeloop.config.load import load_config
from moeloop.model.config import ModelConfig
from moeloop.parallel import Layout
from moeloop.plan import (build_plan, decode_tokens_per_s, memory_ledger, model_stats, offload_round_trip_s,
                          predict_peak_bytes, save_every_steps, stats_from_counts, transfer_s, young_daly_interval_s)
from moeloop.plan.command import main as plan_main
from moeloop.plan.memory import GB
from moeloop.plan.activations import in_flight_micro_batches
from moeloop.plan.memory import avg_seq_tokens, num_micro_batches
from moeloop.plan.step_time import step_phases, step_seconds

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SEED002 = EXAMPLES / "plan_seed002.yaml"
DSV3 = EXAMPLES / "plan_dsv3_671b.yaml"


def test_seed002_table_is_reproduced():
    plan = build_plan(load_config(SEED002))
    rows = {r.train_gpus: r for r in plan.split}
    got = [(r.layout.dp, r.layout.expert_dp, f"{r.ledger.entries['optimizer'] / GB:.2f}", f"{r.train_peak_bytes / GB:.1f}")
           for r in (rows[40], rows[32], rows[24], rows[16])]
    assert got == [(40, 5, "10.50", "85.7"), (32, 4, "13.12", "88.3"), (24, 3, "17.50", "92.7"), (16, 2, "26.25", "101.4")]
    assert rows[16].verdict == "OOM" and rows[16].train_peak_bytes > 96 * GB
    assert [rows[n].verdict for n in (40, 32, 24)] == ["fits", "tight", "tight"]
    assert plan.ledger is not None and plan.layout.dp == 32 and not plan.problems


def test_seed002_formula_as_written_does_not_give_its_column():
    """4.01e9 x 12 B / expert-DP 5 is 9.62 GB; 10.50 needs the dense term (or 4.375e9 experts per EP rank)."""
    cfg = load_config(SEED002, ["plan.dense_params=0", "parallel.dp=40"])
    as_written = memory_ledger(cfg, stats_from_counts(0, 8 * 4.01e9), Layout(dp=40, ep=8))
    assert f"{as_written.entries['optimizer'] / GB:.2f}" == "9.62"
    fitted = memory_ledger(cfg, stats_from_counts(0, 8 * 4.375e9), Layout(dp=40, ep=8))
    assert f"{fitted.entries['optimizer'] / GB:.2f}" == "10.50"


def test_seed002_sync_checkpoint_decode_and_offload_figures():
    plan = build_plan(load_config(SEED002))
    assert plan.sync_bytes == pytest.approx(70e9)
    assert plan.sync_s["disk"] == pytest.approx(70.0)          # NFS 1 GB/s
    assert plan.sync_s["broadcast"] == pytest.approx(2.8)      # RoCE 25 GB/s, "about 3 s"
    assert transfer_s(70e9, 1.0) == 70.0
    assert young_daly_interval_s(490, 24 * 3600) == pytest.approx(9201.7, abs=0.1)
    assert save_every_steps(490, 24 * 3600, 120) == 77         # section 6: C=490 s, save_steps ~ 77
    assert plan.checkpoint["save_s"] == 490 and plan.checkpoint["interval_s"] == pytest.approx(9201.7, abs=0.1)
    assert decode_tokens_per_s(6e9, 4000) == pytest.approx(666.7, abs=0.1)   # H20
    assert decode_tokens_per_s(6e9, 3350) == pytest.approx(558.3, abs=0.1)   # H100
    assert offload_round_trip_s(38.1e9, 64) == pytest.approx(1.19, abs=0.01)  # "one way 0.6 s, both 1.2 s"
    offloaded = build_plan(load_config(SEED002, ["actor.offload.params=true", "actor.offload.grads=true",
                                                 "actor.offload.optimizer=true", "parallel.dp=40", "rollout.mode=colocated"]))
    assert offloaded.ledger.cpu_bytes_per_node / GB == pytest.approx(8 * 38.15)  # seed: 8 x 38 GB = 304 GB


def test_model_accounting_matches_published_counts():
    dsv3 = model_stats(ModelConfig.from_hf_dict(dict(load_config(DSV3).plan.hf_config)))
    assert dsv3.total_params / 1e9 == pytest.approx(671.0, rel=2e-3)
    assert dsv3.active_params / 1e9 == pytest.approx(37.5, rel=1e-2)
    assert dsv3.kv_bytes_per_token() == 61 * (512 + 64) * 2      # MLA latent cache
    assert dsv3.expanded_kv_bytes_per_token() == 61 * 128 * (192 + 128) * 2
    q30 = model_stats(ModelConfig.from_hf_dict({
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768}))
    assert q30.total_params / 1e9 == pytest.approx(30.5, rel=5e-3)
    assert q30.active_params / 1e9 == pytest.approx(3.3, rel=2e-2)
    assert q30.kv_bytes_per_token() == 2 * 48 * 4 * 128 * 2
    assert q30.train_flops_per_token(4096) == 3 * q30.forward_flops_per_token(4096)
    norms = 48 * (2 * 2048 + 2 * 128) + 2048                   # layer norms, q/k norms, final norm: no FLOPs
    assert q30.forward_flops_per_token(0) == 2 * (q30.active_params - q30.embedding - norms)


def test_dsv3_demo_plan():
    plan = build_plan(load_config(DSV3))
    assert plan.problems == [] and plan.layout.world_size == 96 and plan.layout.expert_dp == 1
    led = plan.ledger
    assert led.stage == 11                                   # the 6-layer last stage with the lm_head
    assert led.peak_phase == "rollout"                      # offload moves all training state off the GPU
    assert "optimizer" not in led.phases["train"]            # the optimizer step runs on CPU
    assert led.cpu_bytes_per_node == pytest.approx(8 * led.resident_bytes)
    assert led.entries["rollout_weights"] == pytest.approx(2 * plan.stats.total_params / 32)
    assert plan.decode is not None and plan.decode.engines == 3 and plan.decode.batch > 1
    no_offload = build_plan(load_config(DSV3, ["actor.offload.params=false", "actor.offload.grads=false",
                                               "actor.offload.optimizer=false", "plan.cpu_optimizer_step=false"]))
    assert no_offload.gpu_verdict == "OOM" and plan.gpu_verdict != "OOM"


def test_cli_prints_tables_and_json(capsys):
    assert plan_main([str(DSV3)]) == 0
    out = capsys.readouterr().out
    for heading in ("## model", "## layout", "## memory per rank", "## colocate vs split", "## weight sync",
                    "## step time", "## checkpoint (Young/Daly)", "## assumptions"):
        assert heading in out
    assert plan_main([str(SEED002), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [round(r["optimizer_gb"], 2) for r in data["split"][:4]] == [10.5, 13.12, 17.5, 26.25]
    assert sum(data["phase_shares"].values()) == pytest.approx(1.0)
    assert plan_main([str(SEED002), "parallel.ep=7"]) == 1   # 64 % ... and 32 % 7: layout rules fail
    assert "ep*etp = 7*1 = 7 must divide" in capsys.readouterr().out
    assert plan_main([str(SEED002), "plan.sharding=zero9"]) == 2


def test_predict_peak_bytes_is_the_ledger_peak_without_reserve():
    cfg = load_config(DSV3, ["plan.reserve_gb=5"])
    m = ModelConfig.from_hf_dict(dict(cfg.plan.hf_config))
    led = memory_ledger(cfg, model_stats(m), Layout.from_section(cfg.parallel))
    assert predict_peak_bytes(cfg, m) == int(led.peak_bytes - 5 * GB)
    assert predict_peak_bytes(cfg, include_reserve=True) == int(led.peak_bytes)


def test_given_entries_must_exist():
    with pytest.raises(ValueError, match="unknown entries"):
        build_plan(load_config(SEED002, ["plan.given_gb.weightz=1"]))


def test_async_keeps_the_engine_beside_the_trainer_in_every_phase():
    """rollout.mode=async runs the engine on the training GPUs while the trainer works (the RL loop's
    RolloutAhead): its weights and KV join every phase, so the peak is the colocated training phase plus both, and
    no GPUs are asked for beyond the training ones."""
    col = load_config(DSV3, ["rollout.mode=colocated"])
    asy = load_config(DSV3, ["rollout.mode=async", "rollout.max_staleness=1"])
    layout = Layout.from_section(col.parallel)
    stats = model_stats(ModelConfig.from_hf_dict(dict(col.plan.hf_config)))
    a, c = memory_ledger(asy, stats, layout), memory_ledger(col, stats, layout)
    engine = a.entries["rollout_weights"] + a.entries["rollout_kv"]
    assert engine > 0 and engine == c.entries["rollout_weights"] + c.entries["rollout_kv"]
    for phase in ("train", "optimizer_step", "sync", "rollout"):
        assert {"rollout_weights", "rollout_kv"} <= set(a.phases[phase])
    assert a.phase_bytes("train") == pytest.approx(c.phase_bytes("train") + engine)
    plan = build_plan(asy)
    assert not any("GPUs for rollout" in p for p in plan.problems) and plan.offload_s == 0.0


def test_the_kl_reference_and_the_critic_are_planned_in_every_phase():
    """A KL term keeps a reference model on the GPU (model.dtype, sharded as the actor's weights), and PPO's critic
    its own weights, grads and optimizer: both were missing from the ledger, so a KL or PPO run could OOM past the
    planned peak."""
    base = load_config(DSV3, ["actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false"])
    layout = Layout.from_section(base.parallel)
    stats = model_stats(ModelConfig.from_hf_dict(dict(base.plan.hf_config)))
    plain = memory_ledger(base, stats, layout)
    assert plain.entries["ref_weights"] == plain.entries["critic_state"] == 0.0
    kl = memory_ledger(load_config(DSV3, ["actor.use_kl_loss=true", "model.dtype=bfloat16", "plan.weight_bytes=4"]),
                       stats, layout)
    assert kl.entries["ref_weights"] == pytest.approx(kl.entries["weights"] / 2)  # bf16 copy of fp32 weights
    ppo = memory_ledger(load_config(DSV3, ["actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
                                           "critic.enable=true", "algorithm.adv_estimator=gae",
                                           "critic.max_tokens_per_micro_batch=16384"]), stats, layout)
    state = plain.entries["weights"] + plain.entries["grads"] + plain.entries["optimizer"]
    assert ppo.entries["critic_state"] == pytest.approx(state)
    for phase in plain.phases:
        assert {"ref_weights", "critic_state"} <= set(kl.phases[phase])
        assert ppo.phase_bytes(phase) == pytest.approx(plain.phase_bytes(phase) + state)


def test_the_step_time_counts_the_passes_and_responses_the_loop_runs():
    """The old-logprob pass only when the loop runs it (not for an exactly on-policy update, always for the
    top-entropy selection); ReMax's greedy response per prompt in generation and reward; the checkpoint holds the
    critic's state and a moving reference."""
    def old_logprob_pass(cfg):
        return cfg.old_logprob_pass(cfg.rollout.generates_ahead)
    base = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_epochs=1", "actor.use_kl_loss=false",
            "algorithm.use_kl_in_reward=false"]
    assert not old_logprob_pass(load_config(DSV3, base))
    assert old_logprob_pass(load_config(DSV3, base + ["actor.ppo_mini_batch_size=4"]))
    assert old_logprob_pass(load_config(DSV3, base + ["actor.top_entropy_quantile=0.2"]))
    assert not old_logprob_pass(load_config(DSV3, base + ["actor.ppo_epochs=2", "actor.recompute_old_logprobs=false"]))
    plain, remax = build_plan(load_config(DSV3, base)), build_plan(load_config(DSV3, base + ["algorithm.adv_estimator=remax"]))
    n = load_config(DSV3, base).rollout.n
    assert remax.phases_s["gen"] == pytest.approx(plain.phases_s["gen"] * (n + 1) / n)
    kl = base[:-2] + ["actor.use_kl_loss=true"]
    moving = build_plan(load_config(DSV3, kl + ["actor.ref_sync_steps=10"]))
    fixed = build_plan(load_config(DSV3, kl))
    assert moving.checkpoint["state_gb"] > fixed.checkpoint["state_gb"]


def test_tool_turns_are_prefilled_not_decoded_and_their_calls_take_their_time():
    """rollout.multi_turn: a sample's tool-turn tokens leave the decode and are prefilled at plan.mfu on the rollout
    GPUs; the calls take samples x calls x plan.tool_s_per_call / concurrency (by hand); the defaults are a call
    every turn but the last with max_tool_response_tokens each; on the rollout side when generated ahead."""
    base = ["plan.avg_response_tokens=2000", "plan.avg_prompt_tokens=500"]
    tools = base + ["rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=3",
                    "rollout.multi_turn.concurrency=16"]
    plain = build_plan(load_config(DSV3, base))
    cfg = load_config(DSV3, tools + ["plan.tool_s_per_call=2", "plan.avg_tool_tokens=100"])
    plan = build_plan(cfg)
    samples, seq = cfg.data.train_batch_size * cfg.rollout.n, 2500
    peak = cfg.hardware.peak_tflops * 1e12 * cfg.plan.mfu
    prefill = samples * 100 * plan.stats.forward_flops_per_token(seq) / (plan.decode.gpus * peak)
    assert plan.phases_s["gen"] == pytest.approx(plain.phases_s["gen"] * 1900 / 2000 + prefill)
    assert 0 < prefill < plain.phases_s["gen"] * 100 / 2000  # prefill runs faster than decode
    assert plan.phases_s["tools"] == pytest.approx(samples * 2 * 2.0 / 16) and plain.phases_s["tools"] == 0
    assert plan.step_s == pytest.approx(step_seconds(plan.phases_s, False))
    assert any("tool turns: 2 calls and 100 tool-turn tokens a sample" in a for a in plan.assumptions)
    default = build_plan(load_config(DSV3, tools))  # 2 calls x 256 tokens, the calls' time not counted
    assert default.phases_s["tools"] == 0 and any("2 calls and 512 tool-turn tokens" in a for a in default.assumptions)
    assert step_seconds({"gen": 5.0, "tools": 2.0, "reward": 1.0, "update_actor": 7.0, "update_weights": 0.5},
                        ahead=True) == 8.0 + 0.5


def test_step_time_overlaps_generation_only_when_generated_ahead_elsewhere():
    """Generated ahead on devices of its own (disaggregated, max_staleness >= 1), gen + reward overlap the trainer
    side and the push waits for both; otherwise (async too: it shares the training GPUs' HBM) every phase runs in
    turn."""
    phases = {"gen": 5.0, "reward": 1.0, "old_log_prob": 0.5, "ref": 0.0, "update_actor": 3.0, "update_weights": 0.25,
              "offload": 0.0}
    assert step_seconds(phases, ahead=True) == 6.0 + 0.25
    assert step_seconds({**phases, "update_actor": 8.0}, ahead=True) == 8.5 + 0.25
    assert step_seconds(phases, ahead=False) == sum(phases.values())
    modes = {("async", 1): (True, False), ("disaggregated", 1): (True, True), ("disaggregated", 0): (False, False),
             ("colocated", 0): (False, False)}
    for (mode, staleness), (ahead, overlaps) in modes.items():
        cfg = load_config(DSV3, [f"rollout.mode={mode}", f"rollout.max_staleness={staleness}"])
        assert cfg.rollout.generates_ahead == ahead, mode
        plan = build_plan(cfg)
        assert plan.step_s == pytest.approx(step_seconds(plan.phases_s, overlaps)), mode


def test_a_disaggregated_engine_is_planned_with_the_memory_fraction_it_takes():
    """The run's own engine on GPUs of its own gets rollout.gpu_memory_utilization, as the engine process does
    (the split table's other layouts keep the dedicated default)."""
    batches = []
    for fraction in (0.3, 0.8):  # 96 training GPUs and 64 for rollout: two engines of rollout_tp=32
        plan = build_plan(load_config(DSV3, ["rollout.mode=disaggregated", "plan.total_gpus=160",
                                             f"rollout.gpu_memory_utilization={fraction}"]))
        assert plan.decode is not None and not plan.problems
        batches.append(plan.decode.batch)
    assert batches == [1, 256]  # 0.3 of an H200 holds little beyond DeepSeek-V3's weights; 0.8 the most sequences


def test_an_engine_process_is_planned_with_the_buffers_it_is_lent():
    """rollout.mode=disaggregated: the trainer keeps the engine process's lent buffers (`sync.transport`'s
    LENT_BUFFERS of sync.bucket_bytes each), one more bucket than a colocated push holds."""
    from moeloop.plan import memory
    from moeloop.sync.transport import LENT_BUFFERS
    assert memory.LENT_BUFFERS == LENT_BUFFERS
    m = ModelConfig.from_hf_dict(dict(load_config(DSV3).plan.hf_config))
    sync = {}
    for mode in ("colocated", "disaggregated"):
        cfg = load_config(DSV3, [f"rollout.mode={mode}", "sync.bucket_bytes=1000000000"])
        sync[mode] = memory_ledger(cfg, model_stats(m), Layout.from_section(cfg.parallel)).entries["sync_buffers"]
    assert sync["disaggregated"] - sync["colocated"] == (LENT_BUFFERS - 1) * 1e9


def test_a_disaggregated_push_is_planned_over_cuda_ipc():
    """The engine process takes the weights through CUDA IPC (NVLink) whatever sync.transport says; colocated pushes
    cross the configured transport (inprocess: an HBM copy)."""
    from moeloop.plan.sync_cost import sync_costs
    pushes = {}
    for mode in ("colocated", "disaggregated"):
        plan = build_plan(load_config(SEED002, [f"rollout.mode={mode}", "sync.transport=inprocess"]))
        costs = sync_costs(plan.sync_bytes, load_config(SEED002).hardware)
        pushes[mode] = plan.phases_s["update_weights"]
        assert pushes[mode] == costs["cuda_ipc" if mode == "disaggregated" else "inprocess"] > 0
        assert any(f"over {'cuda_ipc' if mode == 'disaggregated' else 'inprocess'}" in a for a in plan.assumptions)
    assert pushes["disaggregated"] > pushes["colocated"]


def test_the_engine_decode_packs_are_planned_as_the_engine_allocates_them():
    """`decode_pack_bytes`: the fused decode's packed q|k|v copies and composed routers, as `derive_decode_weights`
    allocates them for a bf16 Qwen3-MoE (counted from the tensors), the hand count at the reference size, nothing for
    MLA; colocated, the engine's weights entry carries them."""
    import torch
    from moeloop.model.factory import build_model, hf_config_dict
    from moeloop.plan.memory import ROW_MAX_D, decode_pack_bytes
    from moeloop.rollout import decode_packs
    assert ROW_MAX_D == decode_packs.ROW_MAX_D
    model = build_model("qwen3_moe", "tiny").to(torch.bfloat16)
    saved = decode_packs.ROUTER_COMPOSE
    decode_packs.ROUTER_COMPOSE = True
    try:
        packs = decode_packs.derive_decode_weights(model)
    finally:
        decode_packs.ROUTER_COMPOSE = saved
    allocated = sum(p.weight.numel() * p.weight.element_size() for p in packs)
    assert any(isinstance(p, decode_packs.ComposedRouter) for p in packs)
    assert decode_pack_bytes(model.cfg) == allocated
    ref = ModelConfig.from_hf_dict(hf_config_dict("qwen3_moe", "reference"))
    assert decode_pack_bytes(ref) == 16 * (2 * 1536 * (12 + 2 * 4) * 128 + 4 * 64 * (12 * 128 + 1536))
    assert decode_pack_bytes(ModelConfig.from_hf_dict(hf_config_dict("deepseek_v3", "reference"))) == 0
    cfg = load_config(DSV3, ["rollout.mode=colocated"])
    stats, tp = model_stats(ref), cfg.parallel.rollout_tp
    led = memory_ledger(cfg, stats, Layout(dp=8))
    assert tp > 1 and led.entries["rollout_weights"] == pytest.approx(2 * stats.total_params / tp
                                                                      + decode_pack_bytes(ref, tp))
    assert decode_pack_bytes(ref, tp) > decode_pack_bytes(ref) / tp  # the composed routers are not split


def test_the_trainer_phases_count_the_pipeline_bubble():
    """Under parallel.pp the update's compute spreads over pp x the GPUs, and its 1F1B pipeline fills and drains once a
    mini-batch: (m + pp - 1) / m of that for m micro-batches a stage; the forward-only passes fill once a step."""
    cfg1 = load_config(DSV3, ["parallel.pp=1", "parallel.dp=4", "actor.use_kl_loss=true"])
    cfg4 = load_config(DSV3, ["parallel.pp=4", "parallel.dp=4", "actor.use_kl_loss=true"])
    stats = model_stats(ModelConfig.from_hf_dict(dict(cfg1.plan.hf_config)))
    one, four = (step_phases(c, stats, Layout.from_section(c.parallel), 0.0, 0.0, 0.0) for c in (cfg1, cfg4))
    m = num_micro_batches(cfg4, Layout.from_section(cfg4.parallel))
    fills = cfg4.data.train_batch_size // cfg4.actor.ppo_mini_batch_size
    assert m > 1 and fills > 1
    assert four["update_actor"] == pytest.approx(one["update_actor"] / 4 * (m + 3) / m, rel=1e-12)
    assert four["ref"] == pytest.approx(one["ref"] / 4 * (m * fills + 3) / (m * fills), rel=1e-12)


def test_an_interleaved_pipeline_plans_the_runtimes_bubble_and_activations():
    """With vpp chunks a stage the update's bubble shrinks to Megatron's (pp - 1) / vpp passes, and each stage holds
    the activations of the passes the runtime's interleaved order keeps in flight (`parallel.pipeline.schedule`): at
    pp 4 x vpp 2, 10 + 1 chunk passes on the first stage, 5.5 micro-batches of its layers (pp + (pp - 1) / vpp, as
    Megatron's), against 4 without chunks; 4 + 1 on the last, 2.5 against 1."""
    cfg4 = load_config(DSV3, ["parallel.pp=4", "parallel.dp=4", "actor.use_kl_loss=true"])
    cfg8 = load_config(DSV3, ["parallel.pp=4", "parallel.vpp=2", "parallel.dp=4", "actor.use_kl_loss=true"])
    stats = model_stats(ModelConfig.from_hf_dict(dict(cfg4.plan.hf_config)))
    plain, chunked = (step_phases(c, stats, Layout.from_section(c.parallel), 0.0, 0.0, 0.0) for c in (cfg4, cfg8))
    m = num_micro_batches(cfg8, Layout.from_section(cfg8.parallel))
    assert m % 4 == 0  # (rounded up to whole groups of pp, as the trainer does)
    assert num_micro_batches(cfg4, Layout.from_section(cfg4.parallel)) == m
    assert chunked["update_actor"] == pytest.approx(plain["update_actor"] * (m + 1.5) / (m + 3), rel=1e-12)
    assert [in_flight_micro_batches(Layout(pp=4, vpp=2), s, m) for s in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert [in_flight_micro_batches(Layout(pp=4), s, m) for s in range(4)] == [4, 3, 2, 1]
    tokens = cfg4.actor.ppo_mini_batch_size * cfg4.rollout.n * avg_seq_tokens(cfg4)
    five = [f"actor.max_tokens_per_micro_batch={-(-tokens // 20)}"]  # 5 micro-batches on each of the 4 dp ranks
    assert num_micro_batches(load_config(DSV3, ["parallel.pp=4", "parallel.dp=4", *five]), Layout(dp=4, pp=4)) == 5
    assert num_micro_batches(load_config(DSV3, ["parallel.pp=4", "parallel.vpp=2", "parallel.dp=4", *five]),
                             Layout(dp=4, pp=4, vpp=2)) == 8
    assert in_flight_micro_batches(Layout(pp=4), 0, 2) == 2  # fewer micro-batches than stages


def test_the_plan_shows_each_pipeline_stage_as_the_runtime_runs_it():
    """`moeloop plan` under parallel.pp: each stage's layers (its chunks' runs under vpp, the runtime's split), the
    micro-batches' activations it holds at once in the schedule's order, its peak, and the update's bubble; none
    without pipeline parallelism."""
    from moeloop.parallel.pipeline import schedule_stretch
    from moeloop.plan.report import render
    cfg = load_config(DSV3, ["parallel.vpp=2", "parallel.last_stage_layers=0", "parallel.pp=4", "parallel.dp=3"])
    plan = build_plan(cfg)
    layout, m = plan.layout, num_micro_batches(cfg, plan.layout)
    # 61 layers over 8 chunks: 8 each on the first 5, 7 on the rest; chunk k on stage k % 4
    assert [r["layers"] for r in plan.pipeline] == [[(0, 7), (32, 39)], [(8, 15), (40, 46)], [(16, 23), (47, 53)],
                                                    [(24, 31), (54, 60)]]
    assert [r["in_flight"] for r in plan.pipeline] == [in_flight_micro_batches(layout, s, m) for s in range(4)]
    assert plan.pipeline[0]["bubble"] == pytest.approx(schedule_stretch(m, 4, 2) - 1)
    assert max(r["peak_gb"] for r in plan.pipeline) == pytest.approx(plan.ledger.peak_bytes / GB)
    text = render(plan)
    assert f"## pipeline (pp 4 x vpp 2, {m} micro-batches a mini-batch per stage)" in text
    assert "0-7, 32-39" in text and f"bubble: the stages wait {plan.pipeline[0]['bubble']:.1%}" in text
    one = build_plan(load_config(DSV3, ["parallel.pp=1", "parallel.last_stage_layers=0", "parallel.dp=12"]))
    assert one.pipeline == [] and "## pipeline" not in render(one)
    counted = build_plan(load_config(SEED002, ["parallel.pp=2", "parallel.dp=16"]))  # parameter counts: no layers
    assert [r["layers"] for r in counted.pipeline] == [[], []] and "    0               -" in render(counted)


def test_sequence_parallelism_plans_the_residual_stream_by_rows():
    """Under parallel.sequence_parallel a tp rank keeps its 1/tp of the rows of the residual stream (the layer input and
    the residual after attention, bf16) and of its two norms (fp32 input and bf16 output each), plus the whole rows it
    all-gathers for the attention's q/k/v (and a dense MLP's gate/up) input: per token and layer, at hidden size h and
    tp 2, (4h + 12h) / 2 + 2h against 16h in an MoE layer, + 2h more in a dense one."""
    from moeloop.model.factory import hf_config_dict
    from moeloop.plan.activations import layer_activation_bytes_per_token as per_token
    m = ModelConfig.from_hf_dict({**hf_config_dict("qwen3_moe", "small"), "mlp_only_layers": [1],
                                  "intermediate_size": 256})
    h = m.hidden_size
    assert m.is_moe_layer(0) and not m.is_moe_layer(1)
    for layer, gathered in ((0, 2 * h), (1, 4 * h)):
        whole, rows = per_token(m, layer, Layout(tp=2)), per_token(m, layer, Layout(tp=2, sequence_parallel=True))
        assert whole - rows == pytest.approx(16 * h - (8 * h + gathered), rel=1e-12)
        assert per_token(m, layer, Layout(sequence_parallel=True)) == per_token(m, layer, Layout())  # (tp 1: no-op)
    cfg = load_config(None, ["model.path=unused", "parallel.dp=2", "parallel.tp=2"])
    cfg.plan.hf_config = hf_config_dict("qwen3_moe", "small")
    stats = model_stats(ModelConfig.from_hf_dict(cfg.plan.hf_config))
    cfg_sp = load_config(None, ["model.path=unused", "parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true"])
    cfg_sp.plan.hf_config = cfg.plan.hf_config
    plain, split = (memory_ledger(c, stats, Layout.from_section(c.parallel)).entries["activations"] for c in (cfg, cfg_sp))
    assert split < plain
    assert Layout(tp=2, pp=2, sequence_parallel=True).validate() == [
        "sequence_parallel with cp=1, pp=2: the trainer splits the residual stream by rows only under tp alone "
        "(cp and pp 1)"]


def test_moeloops_own_engine_is_planned_whole_on_each_rank():
    """moeloop's rollout engine holds the whole model on each rank whatever the trainer's tp (no engine tensor
    parallelism), so a run's plan counts it whole; `parallel.rollout_tp` plans another engine's layout (the seed and
    DeepSeek-V3 examples: verl's vLLM engines), and a run refuses it (tests/test_rl_loop.py)."""
    from moeloop.model.factory import hf_config_dict
    from moeloop.plan.memory import BF16, decode_pack_bytes
    base = ["model.path=unused", "parallel.dp=2", "parallel.tp=2", "rollout.mode=colocated"]
    cfg, split = load_config(None, base), load_config(None, [*base, "parallel.rollout_tp=2"])
    for c in (cfg, split):
        c.plan.hf_config = hf_config_dict("qwen3_moe", "small")
    stats = model_stats(ModelConfig.from_hf_dict(cfg.plan.hf_config))
    whole, halved = (memory_ledger(c, stats, Layout.from_section(c.parallel)).entries["rollout_weights"]
                     for c in (cfg, split))
    assert whole == pytest.approx(BF16 * stats.total_params + decode_pack_bytes(stats.model, 1), rel=1e-12)
    assert halved == pytest.approx(BF16 * stats.total_params / 2 + decode_pack_bytes(stats.model, 2), rel=1e-12)
