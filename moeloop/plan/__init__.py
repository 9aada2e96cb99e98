"""moeloop.plan: pure functions of a run config that say, before launch, whether and how a run fits.

    plan = build_plan(cfg); print(render(plan))        # what `moeloop plan CONFIG` prints
    predict_peak_bytes(cfg, model_cfg)                  # the trainer logs this beside the measured peak
"""
from moeloop.plan.accounting import ModelStats, model_stats, stats_from_counts
from moeloop.plan.build import Plan, build_plan, load_stats
from moeloop.plan.decode import decode_roofline, decode_tokens_per_s
from moeloop.plan.interval import save_every_steps, young_daly_interval_s
from moeloop.plan.memory import Ledger, memory_ledger, predict_peak_bytes
from moeloop.plan.report import render
from moeloop.plan.sync_cost import offload_round_trip_s, sync_costs, transfer_s

__all__ = ["Ledger", "ModelStats", "Plan", "build_plan", "decode_roofline", "decode_tokens_per_s", "load_stats",
           "memory_ledger", "model_stats", "offload_round_trip_s", "predict_peak_bytes", "render", "save_every_steps",
           "stats_from_counts", "sync_costs", "transfer_s", "young_daly_interval_s"]
