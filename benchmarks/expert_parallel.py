"""Expert parallelism against FSDP alone: the actor's update at N gloo ranks on this CPU, per rank per step: bytes each
collective moves (FSDP's all-gathers and reduce-scatters, EP's all_to_all, all-reduces), the largest block of weights
a rank holds unsharded at once, the training state it keeps (weights, grads, Adam), and the step's median seconds.
The planner's figure for the same layout (`moeloop plan`'s ledger: weights + grads + optimizer per rank) is printed
beside the measured state. `--experts-impl loop,grouped_mm` runs each layout with each experts implementation (under EP,
the one each rank's local experts run).

    python benchmarks/expert_parallel.py --size small --world 4 --ep 1,2,4 --steps 4
    python benchmarks/expert_parallel.py --size small --world 4 --ep 2,4 --experts-impl loop,grouped_mm

Each rank gets its own share of random RL samples (GRPO groups, prompt + response tokens), as the trainer's DP does;
fp32, one thread a rank. Timings on a 2-core VM with 4 ranks are indicative only: the ranks share the cores.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from moeloop.config.schema import ActorSection
from moeloop.model.config import ModelConfig
from moeloop.model.factory import build_model, hf_config_dict
from moeloop.types import Sample

# torch.distributed function -> column (FSDP2 calls the *_single forms in torch 2.13, *_tensor in older ones)
COLLECTIVES = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
               "all_to_all_single": "all_to_all", "all_reduce": "all_reduce"}
COLUMNS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
# counted: the whole tensor of an all-gather (its output) and of a reduce-scatter (its input), what a ring moves
# (N - 1) / N of through each rank; all_to_all: the rows this rank sends (its own included); all_reduce: the tensor


def samples_of(rank: int, groups: int, n: int, vocab: int, prompt: int, response: int) -> list[Sample]:
    rng = random.Random(1000 + rank)
    out = []
    for g in range(groups):
        ids = [rng.randrange(3, vocab) for _ in range(prompt)]
        for _ in range(n):
            resp = [rng.randrange(3, vocab) for _ in range(response)]
            out.append(Sample(prompt_ids=ids, response_ids=resp, group_id=rank * groups + g, reward=0.0,
                              reward_status="scored", old_logprobs=[-2.0] * response,
                              advantages=[rng.uniform(-1, 1)] * response))
    return out


def count_bytes(moved: dict[str, int]) -> None:
    """Wrap torch.distributed's collectives to add each call's input bytes to `moved` (FSDP2 and EP call them by
    module attribute)."""
    for name, column in COLLECTIVES.items():
        real = getattr(dist, name, None)
        if real is None:
            continue

        def spy(*args, _real=real, _name=name, _column=column, **kw):
            tensors = [a for a in list(args[:2]) + list(kw.values()) if isinstance(a, torch.Tensor)][:2]
            if tensors:  # (output, input) but all_reduce's one tensor: see COUNTED
                t = tensors[-1] if _name == "all_to_all_single" else max(tensors, key=torch.Tensor.numel)
                moved[_column] = moved.get(_column, 0) + t.numel() * t.element_size()
            return _real(*args, **kw)
        setattr(dist, name, spy)


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def rank_main(rank: int, world: int, init_file: str, args, ep: int, impl: str, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from moeloop.train.actor import Actor  # (after the group: FSDP and EP meshes are built from it)
    model = build_model("qwen3_moe", args.size, seed=0)
    model.set_experts_impl(impl)
    cfg = model.cfg
    actor_cfg = ActorSection()
    actor_cfg.ppo_mini_batch_size = args.groups * world
    actor_cfg.max_tokens_per_micro_batch = args.budget
    actor = Actor(model, actor_cfg, torch.device("cpu"), args.response, ep=ep)
    unit = max(sum(p.numel() * p.element_size() for p in layer.parameters(recurse=True)
                   if not (ep > 1 and p.dim() == 3)) for layer in model.model.layers)
    if ep > 1:  # an EP layer gathers its dense part only; its experts stay split (their expert_dp shards gathered)
        unit += max(sum(p.numel() // ep * p.element_size() for p in (m.gate_up_proj, m.down_proj))
                    for m in model.modules() if getattr(m, "ep_mesh", None) is not None)
    samples = samples_of(rank, args.groups, args.n, cfg.vocab_size, args.prompt, args.response)
    actor.update(samples)  # warm-up: lazy init, optimizer state
    moved, seconds = timed_updates(actor, samples, args.steps)
    state = sum(local_bytes(p) * 2 for p in model.parameters())  # weights + grads (fp32, the same sharding)
    state += sum(local_bytes(v) for s in actor.optimizer.state.values() for v in s.values() if v.dim() > 0)
    queue.put((rank, moved, unit, state, seconds))
    dist.destroy_process_group()


def launch(rank_main, world: int, *args, timeout_s: float = 3600) -> list[tuple]:
    """`rank_main(rank, world, init_file, *args, queue)` on `world` forked gloo ranks; what each put on the queue
    (a tuple that starts with its rank), in rank order."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, world, os.path.join(tmp, "rdv"), *args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = sorted(queue.get(timeout=timeout_s) for _ in procs)
        for p in procs:
            p.join()
    return out


def timed_updates(actor, samples: list[Sample], steps: int) -> tuple[dict[str, int], float]:
    """`steps` updates after a barrier each: the bytes each collective moved a step (`count_bytes`, counted from
    here on) and the median seconds."""
    moved: dict[str, int] = {}
    count_bytes(moved)
    seconds = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        actor.update(samples)
        seconds.append(time.perf_counter() - start)
    return {k: v / steps for k, v in moved.items()}, statistics.median(seconds)


def run_layout(args, ep: int, impl: str) -> list[tuple]:
    return launch(rank_main, args.world, args, ep, impl)


def planned_state_gb(args, ep: int) -> float:
    from moeloop.config.load import load_config
    from moeloop.plan import memory_ledger, model_stats
    from moeloop.parallel import Layout
    cfg = load_config(None, ["model.path=unused", f"parallel.dp={args.world}", f"parallel.ep={ep}", "model.dtype=float32"])
    cfg.plan.hf_config = hf_config_dict("qwen3_moe", args.size)
    stats = model_stats(ModelConfig.from_hf_dict(cfg.plan.hf_config))
    led = memory_ledger(cfg, stats, Layout.from_section(cfg.parallel))
    return sum(led.entries[k] for k in ("weights", "grads", "optimizer")) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small", "reference"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", default="1,2,4", help="comma-separated; 1 = FSDP alone")
    ap.add_argument("--experts-impl", default="auto", help="comma-separated: auto | grouped_mm | loop")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="GRPO groups a rank")
    ap.add_argument("--n", type=int, default=4, help="samples a group")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--budget", type=int, default=4096, help="actor.max_tokens_per_micro_batch")
    args = ap.parse_args()
    print(f"{args.size} qwen3_moe, {args.world} gloo ranks, {args.groups} groups x {args.n} samples x "
          f"({args.prompt} + {args.response}) tokens a rank, fp32; per rank per update step (rank 0; max over ranks "
          "for seconds)")
    print("| ep | experts impl | all_gather MB | reduce_scatter MB | all_to_all MB | all_reduce MB | "
          "largest unsharded unit MB | state MB measured | state MB planned | step s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ep in (int(e) for e in args.ep.split(",")):
        for impl in args.experts_impl.split(","):
            rows = run_layout(args, ep, impl)
            _, moved, unit, state, _ = rows[0]
            step = max(r[4] for r in rows)
            mb = {k: moved.get(k, 0) / 1e6 for k in COLUMNS}
            planned = planned_state_gb(args, ep) * 1e3 if ep > 0 else float("nan")
            print(f"| {ep} | {impl} | {mb['all_gather']:.2f} | {mb['reduce_scatter']:.2f} | "
                  f"{mb['all_to_all']:.2f} | {mb['all_reduce']:.3f} | {unit / 1e6:.2f} | {state / 1e6:.2f} | "
                  f"{planned:.2f} | {step:.3f} |", flush=True)

if __name__ == "__main__":
    main()
