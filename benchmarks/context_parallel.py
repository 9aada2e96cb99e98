"""Context parallelism (`parallel.cp`, Ulysses) against data parallelism alone: the actor's update at N gloo ranks on
this CPU with long sequences, per rank per step: the activation bytes autograd keeps for the backward (the tensors
saved during one micro-batch's forward, parameters left out), beside `moeloop plan`'s activation entry for the same
layout and budget; the bytes the all-to-alls and all-gathers move; and the step's median seconds.

    python benchmarks/context_parallel.py --world 4 --cp 1,2,4 --prompt 256 --response 1792

Every layout trains the same global batch: `--groups` GRPO groups a data-parallel rank at cp 1, so at cp c each of
the N / c dp groups holds c x as many, and each rank still runs 1/N of the tokens. A micro-batch is one sequence: the
budget (actor.max_tokens_per_micro_batch, the tokens one rank holds) is the sequence's length / cp, so at cp c a
rank holds 1/c of it. bf16 weights and activations (the planner's units), one thread a rank. Timings on a 2-core VM
with 4 ranks are indicative only: the ranks share the cores.
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from expert_parallel import COLUMNS, launch, samples_of, timed_updates
from moeloop.config.schema import ActorSection
from moeloop.model.config import ModelConfig
from moeloop.model.factory import build_model, hf_config_dict


class SavedBytes:
    """Bytes of the distinct tensors autograd saves for backward while active (parameters and their views left out:
    weights are counted by the state, not the activations)."""

    def __init__(self):
        self.seen: dict[int, int] = {}

    def pack(self, saved: torch.Tensor):
        t = saved._local_tensor if isinstance(saved, DTensor) else saved  # (tensor parallel: the shard's bytes)
        base = t._base if t._base is not None else t
        params = (nn.Parameter,)
        if not any(isinstance(x, params) for x in (saved, t, base)) and t.device.type == "cpu":
            storage = t.untyped_storage()
            self.seen[storage.data_ptr()] = storage.nbytes()
        return saved

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def largest_saved(actor, samples) -> int:
    """One update of `actor` on `samples`; the bytes autograd saved in its largest micro-batch's forward."""
    saved = SavedBytes()
    forward_batch = actor.forward_batch

    def measured(*a, **kw):
        probe = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
            out = forward_batch(*a, **kw)
        saved.seen = max(saved.seen, probe.seen, key=lambda d: sum(d.values()))
        return out

    actor.forward_batch = measured
    try:
        actor.update(samples)
    finally:
        actor.forward_batch = forward_batch
    return saved.total


def rank_main(rank: int, world: int, init_file: str, args, cp: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    from moeloop.parallel.groups import dp_rank, init_parallel_groups
    from moeloop.train.actor import Actor  # (after the group: FSDP's mesh is built from it)
    init_parallel_groups(cp)
    model = build_model("qwen3_moe", args.size, seed=0).to(torch.bfloat16)
    actor_cfg = ActorSection()
    actor_cfg.ppo_mini_batch_size = args.groups * world
    actor_cfg.max_tokens_per_micro_batch = budget(args, cp)
    actor = Actor(model, actor_cfg, torch.device("cpu"), args.response, master_weights=False)
    # each dp group's samples (cp x a cp-1 rank's); `samples_of` seeds by its first argument
    samples = [s for r in range(cp) for s in samples_of(dp_rank() * cp + r, args.groups, args.n, model.cfg.vocab_size,
                                                          args.prompt, args.response)]
    actor.update(samples)  # warm-up: lazy init, optimizer state
    saved = largest_saved(actor, samples)
    moved, seconds = timed_updates(actor, samples, args.steps)
    queue.put((rank, saved, moved, seconds, len(actor.micro_batches(samples))))
    dist.destroy_process_group()


def run_layout(args, cp: int) -> list[tuple]:
    return launch(rank_main, args.world, args, cp)


def budget(args, cp: int) -> int:
    """One rank's share of one sequence."""
    return -(-(args.prompt + args.response) // cp)


def planned_activations_mb(args, cp: int) -> float:
    from moeloop.config.load import load_config
    from moeloop.parallel import Layout
    from moeloop.plan import memory_ledger, model_stats
    cfg = load_config(None, ["model.path=unused", f"parallel.dp={args.world // cp}", f"parallel.cp={cp}",
                             "model.dtype=bfloat16", f"actor.max_tokens_per_micro_batch={budget(args, cp)}",
                             f"data.max_prompt_length={args.prompt}", f"data.max_response_length={args.response}"])
    cfg.plan.hf_config = hf_config_dict("qwen3_moe", args.size)
    stats = model_stats(ModelConfig.from_hf_dict(cfg.plan.hf_config))
    return memory_ledger(cfg, stats, Layout.from_section(cfg.parallel)).entries["activations"] / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small", "reference"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--cp", default="1,2,4", help="comma-separated; 1 = data parallel alone")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=1, help="GRPO groups a data-parallel rank at cp 1")
    ap.add_argument("--n", type=int, default=2, help="samples a group")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=1792)
    args = ap.parse_args()
    print(f"{args.size} qwen3_moe, {args.world} gloo ranks, {args.groups * args.world} groups x {args.n} samples x "
          f"({args.prompt} + {args.response}) tokens a step, bf16; a micro-batch is one sequence; per rank per update "
          "step (rank 0; max over ranks for seconds)")
    print("| cp | dp | budget (tokens a rank) | micro-batches | activations MB measured | activations MB planned | "
          "all_to_all MB | all_gather MB | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cp in (int(c) for c in args.cp.split(",")):
        rows = run_layout(args, cp)
        _, saved, moved, _, micro = rows[0]
        step = max(r[3] for r in rows)
        mb = {k: moved.get(k, 0) / 1e6 for k in COLUMNS}
        print(f"| {cp} | {args.world // cp} | {budget(args, cp)} | {micro} | {saved / 1e6:.1f} | {planned_activations_mb(args, cp):.1f} | "
              f"{mb['all_to_all']:.1f} | {mb['all_gather']:.1f} | {step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
