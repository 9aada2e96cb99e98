"""Pipeline parallelism (`parallel.pp`) against data parallelism alone: the actor's update at N gloo ranks on this CPU,
per stage per step: the weights a rank keeps and the most activation bytes autograd holds for the backward at once
(the micro-batches in flight together), each beside `moeloop plan`'s entry for the same stage; the bytes a rank sends
to the neighbouring stages (activations forward, gradients backward); FSDP's all-gathers and reduce-scatters; and the
step's median seconds (the slowest rank's), and a forward-only logprob pass's.

    python benchmarks/pipeline_parallel.py --world 4 --pp 1,2,4 --prompt 256 --response 768
    python benchmarks/pipeline_parallel.py --world 2 --pp 1,2 --vpp 1,2 --groups 2   # interleaved against not

Every layout trains the same global batch: `--groups` GRPO groups a rank at pp 1, so at pp p each of the N / p dp
groups holds p x as many (its stages train them together). A micro-batch is one sequence. bf16 weights and
activations (the planner's units), one thread a rank. The update runs in 1F1B order, so stage s holds up to pp - s
micro-batches' activations, as the planner counts; with `--vpp` v > 1 (each pp > 1 layout at each v) in the
interleaved order, each stage holding v chunks of layers. Timings on a 2-core VM with 4 ranks are indicative only: the ranks
share the cores, so a stage that waits gives its core to another.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from torch import nn
from torch.distributed.tensor import DTensor

from expert_parallel import launch, timed_updates
from tensor_parallel import layout_actor, layout_args, plan_inputs

COLUMNS = ("p2p_sent", "all_gather", "reduce_scatter")


class InFlight:
    """The bytes of the distinct tensors autograd holds for backward at once (parameters left out: the state counts
    them), and their peak: what 1F1B's forwards ahead add up to."""

    def __init__(self):
        self.held: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references to it]
        self.now = self.peak = 0

    def pack(self, saved: torch.Tensor):
        t = saved._local_tensor if isinstance(saved, DTensor) else saved
        base = t._base if t._base is not None else t
        if any(isinstance(x, nn.Parameter) for x in (saved, t, base)):
            return saved
        key = t.untyped_storage().data_ptr()
        entry = self.held.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(saved, key, self)

    def release(self, key: int) -> None:
        entry = self.held[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.held[key]


class _Held:
    """A saved tensor; autograd drops it after the backward that used it (or with its graph)."""

    def __init__(self, tensor: torch.Tensor, key: int, meter: InFlight):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter.release(self.key)


def peak_in_flight(actor, samples) -> int:
    """One update of `actor` on `samples`; the most activation bytes autograd held at once."""
    meter = InFlight()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda held: held.tensor if isinstance(held, _Held)
                                                  else held):
        actor.update(samples)
    return meter.peak


def count_p2p(moved: dict[str, int]) -> None:
    """Wrap `dist.isend` (activations and gradients to the neighbouring stages) to add its bytes to `moved`."""
    isend = dist.isend

    def sent(tensor, *args, **kw):
        moved["p2p_sent"] = moved.get("p2p_sent", 0) + tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kw)
    dist.isend = sent


def rank_main(rank: int, world: int, init_file: str, args, pp: int, vpp: int, queue) -> None:
    from moeloop.parallel.groups import pp_rank
    actor, samples, weights = layout_actor(rank, world, init_file, args, pp=pp, vpp=vpp)
    saved = peak_in_flight(actor, samples)
    p2p: dict[str, int] = {}
    count_p2p(p2p)
    moved, seconds = timed_updates(actor, samples, args.steps)
    moved.update({k: v / args.steps for k, v in p2p.items()})
    forward = []
    for _ in range(args.steps):  # a forward-only pass (the old or reference logprobs)
        dist.barrier()
        start = time.perf_counter()
        actor.compute_logprobs(samples, None)
        forward.append(time.perf_counter() - start)
    queue.put((rank, pp_rank(), weights, saved, moved, seconds, len(actor.micro_batches(samples)),
               statistics.median(forward)))
    dist.destroy_process_group()


def planned_mb(args, pp: int, vpp: int) -> list[tuple[float, float]]:
    """`moeloop plan`'s (weights, activations) a rank of each stage (MB) for the layout (the mini-batch's micro-batch
    count bounds 1F1B's in-flight ones)."""
    from moeloop.plan.memory import stage_ledgers
    ledgers = stage_ledgers(*plan_inputs(args, f"parallel.dp={args.world // pp}", f"parallel.pp={pp}",
                                         f"parallel.vpp={vpp}",
                                         f"actor.ppo_mini_batch_size={args.groups * args.world}", f"rollout.n={args.n}"))
    return [(led.entries["weights"] / 1e6, led.entries["activations"] / 1e6) for led in ledgers]


def main() -> None:
    args = layout_args(__doc__.split("\n")[0], "pp", "1,2,4", vpp="1")
    print(f"{args.size} qwen3_moe, {args.world} gloo ranks, {args.groups * args.world} groups x {args.n} samples x "
          f"({args.prompt} + {args.response}) tokens a step, bf16; a micro-batch is one sequence; per rank per update "
          "step (the stage's first rank; max over all ranks for seconds); MB moved a step: p2p_sent to the neighbouring "
          "stages, FSDP's all_gather and reduce_scatter")
    print("| pp | vpp | dp | stage | micro-batches | weights MB measured | planned | activations MB measured | planned | "
          + " | ".join(COLUMNS) + " | step s | logprob pass s |")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(COLUMNS) + "---|---|")
    layouts = [(pp, vpp) for pp in (int(p) for p in args.pp.split(","))
               for vpp in ([1] if pp == 1 else [int(v) for v in args.vpp.split(",")])]
    for pp, vpp in layouts:
        rows = launch(rank_main, args.world, args, pp, vpp)
        step, forward = max(r[5] for r in rows), max(r[7] for r in rows)
        plan = planned_mb(args, pp, vpp)
        for stage in range(pp):
            _, _, weights, saved, moved, _, micro, _ = next(r for r in rows if r[1] == stage)
            print(f"| {pp} | {vpp} | {args.world // pp} | {stage} | {micro} | {weights / 1e6:.2f} | {plan[stage][0]:.2f} | "
                  f"{saved / 1e6:.1f} | {plan[stage][1]:.1f} | "
                  + " | ".join(f"{moved.get(k, 0) / 1e6:.1f}" for k in COLUMNS) + f" | {step:.2f} | {forward:.2f} |", flush=True)


if __name__ == "__main__":
    main()
