"""Tensor parallelism (`parallel.tp`) against data parallelism alone: the actor's update at N gloo ranks on this CPU,
per rank per step: the weights a rank keeps and the activation bytes autograd saves for the backward (the largest
micro-batch's), each beside `moeloop plan`'s entry for the same layout; the bytes each collective moves (FSDP's
all-gathers and reduce-scatters, tensor parallelism's all-reduces); and the step's median seconds.

    python benchmarks/tensor_parallel.py --world 4 --tp 1,2 --prompt 256 --response 768
    python benchmarks/tensor_parallel.py --world 4 --tp 2,4 --sequence-parallel   # the residual stream by rows too

(`moeloop plan` counts the residual stream by rows under sequence parallelism, whole on each tp rank without it.)

Every layout trains the same global batch: `--groups` GRPO groups a rank at tp 1, so at tp t each of the N / t dp
groups holds t x as many. A micro-batch is one sequence. bf16 weights and activations (the planner's units), one
thread a rank. Timings on a 2-core VM with 4 ranks are indicative only: the ranks share the cores.
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from context_parallel import largest_saved
from expert_parallel import launch, local_bytes, samples_of, timed_updates
from moeloop.config.schema import ActorSection
from moeloop.model.config import ModelConfig
from moeloop.model.factory import build_model, hf_config_dict

FUNCOL = {"all_reduce": "tp_all_reduce", "all_gather_tensor": "tp_all_gather", "reduce_scatter_tensor": "tp_reduce_scatter"}
COLUMNS = ("all_gather", "reduce_scatter", "all_reduce", "tp_all_reduce", "tp_all_gather", "tp_reduce_scatter",
           "moe_rows")


def count_tp(moved: dict[str, int]) -> None:
    """Wrap the functional collectives DTensor's redistributions call (tensor parallelism's all-reduces) to add each
    call's input bytes to `moved`, and `dist.all_gather` (the MoE blocks' rows, gathered from the tp ranks) to add its
    output's."""
    import torch.distributed._functional_collectives as funcol
    for name, column in FUNCOL.items():
        real = getattr(funcol, name)

        def spy(tensor, *args, _real=real, _column=column, **kw):
            moved[_column] = moved.get(_column, 0) + tensor.numel() * tensor.element_size()
            return _real(tensor, *args, **kw)
        setattr(funcol, name, spy)
    gather = dist.all_gather

    def rows(parts, tensor, *args, **kw):
        moved["moe_rows"] = moved.get("moe_rows", 0) + sum(p.numel() * p.element_size() for p in parts)
        return gather(parts, tensor, *args, **kw)
    dist.all_gather = rows


def layout_actor(rank: int, world: int, init_file: str, args, tp: int = 1, pp: int = 1, vpp: int = 1):
    """On a forked rank, one thread: the gloo group, the tp and pp groups, the bf16 actor of the `args.size` model
    (one sequence a micro-batch) and its dp group's samples (tp * pp x a single rank's), after a warm-up update (lazy
    init, optimizer state). Returns (actor, samples, the weight bytes this rank keeps)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    from moeloop.parallel.groups import dp_rank, init_parallel_groups
    from moeloop.train.actor import Actor  # (after the group: the meshes are built from it)
    init_parallel_groups(1, tp, pp, vpp=vpp, sequence_parallel=getattr(args, "sequence_parallel", False))
    model = build_model("qwen3_moe", args.size, seed=0).to(torch.bfloat16)
    actor_cfg = ActorSection()
    actor_cfg.ppo_mini_batch_size = args.groups * world
    actor_cfg.max_tokens_per_micro_batch = args.prompt + args.response
    actor = Actor(model, actor_cfg, torch.device("cpu"), args.response, master_weights=False)
    weights = sum(local_bytes(p) for p in model.parameters())
    share = tp * pp  # `samples_of` seeds by its first argument
    samples = [s for r in range(share) for s in samples_of(dp_rank() * share + r, args.groups, args.n,
                                                             model.cfg.vocab_size, args.prompt, args.response)]
    actor.update(samples)
    return actor, samples, weights


def rank_main(rank: int, world: int, init_file: str, args, tp: int, queue) -> None:
    actor, samples, weights = layout_actor(rank, world, init_file, args, tp=tp)
    saved = largest_saved(actor, samples)
    tp_moved: dict[str, int] = {}
    count_tp(tp_moved)
    moved, seconds = timed_updates(actor, samples, args.steps)
    moved.update({k: v / args.steps for k, v in tp_moved.items()})
    queue.put((rank, weights, saved, moved, seconds, len(actor.micro_batches(samples))))
    dist.destroy_process_group()


def plan_inputs(args, *overrides: str):
    """The run config (bf16 weights, no fp32 masters, one sequence a micro-batch) with `overrides`, its model's stats
    and its layout: what `moeloop plan`'s ledger takes."""
    from moeloop.config.load import load_config
    from moeloop.parallel import Layout
    from moeloop.plan import model_stats
    cfg = load_config(None, ["model.path=unused", "model.dtype=bfloat16", "model.fp32_master_weights=false",
                             f"actor.max_tokens_per_micro_batch={args.prompt + args.response}",
                             f"data.max_prompt_length={args.prompt}", f"data.max_response_length={args.response}",
                             *overrides])
    cfg.plan.hf_config = hf_config_dict("qwen3_moe", args.size)
    return cfg, model_stats(ModelConfig.from_hf_dict(cfg.plan.hf_config)), Layout.from_section(cfg.parallel)


def planned_mb(args, tp: int) -> tuple[float, float]:
    """`moeloop plan`'s weights and activations a rank (MB) for the layout."""
    from moeloop.plan import memory_ledger
    sp = f"parallel.sequence_parallel={str(bool(getattr(args, 'sequence_parallel', False))).lower()}"
    led = memory_ledger(*plan_inputs(args, f"parallel.dp={args.world // tp}", f"parallel.tp={tp}", sp))
    return led.entries["weights"] / 1e6, led.entries["activations"] / 1e6


def layout_args(description: str, layout: str, sizes: str, **more: str) -> argparse.Namespace:
    """The layout benchmarks' arguments; `--<layout>`: the sizes to compare (`sizes` by default); `more`: further
    comma-separated size lists (name: default)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument(f"--{layout}", default=sizes, help="comma-separated; 1 = data parallel alone")
    for name, default in more.items():  # (a None default: an on/off flag)
        if default is None:
            ap.add_argument(f"--{name.replace('_', '-')}", dest=name, action="store_true")
        else:
            ap.add_argument(f"--{name}", default=default, help="comma-separated")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=1, help=f"GRPO groups a rank at {layout} 1")
    ap.add_argument("--n", type=int, default=2, help="samples a group")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=768)
    return ap.parse_args()


def main() -> None:
    args = layout_args(__doc__.split("\n")[0], "tp", "1,2", sequence_parallel=None)
    print(f"{args.size} qwen3_moe, {args.world} gloo ranks, {args.groups * args.world} groups x {args.n} samples x "
          f"({args.prompt} + {args.response}) tokens a step, bf16; a micro-batch is one sequence; per rank per update "
          "step (rank 0; max over ranks for seconds); MB moved a step by collective (moe_rows: the MoE blocks' rows gathered "
          "from the tp ranks, forward and backward)")
    print("| tp | dp | micro-batches | weights MB measured | planned | activations MB measured | planned | "
          + " | ".join(COLUMNS) + " | step s |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(COLUMNS) + "---|")
    for tp in (int(t) for t in args.tp.split(",")):
        rows = launch(rank_main, args.world, args, tp)
        _, weights, saved, moved, _, micro = rows[0]
        step = max(r[4] for r in rows)
        plan_weights, plan_acts = planned_mb(args, tp)
        print(f"| {tp} | {args.world // tp} | {micro} | {weights / 1e6:.2f} | {plan_weights:.2f} | {saved / 1e6:.1f} | "
              f"{plan_acts:.1f} | " + " | ".join(f"{moved.get(k, 0) / 1e6:.1f}" for k in COLUMNS) + f" | {step:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
