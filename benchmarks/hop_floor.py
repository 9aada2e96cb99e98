"""The floor of a dependent hop on this GPU, with no data to move: what a B=1 decode layer's eight PDL-chained
kernels cost before they read a byte, against a grid barrier inside one persistent launch.

Each variant does N rounds of "every program reads and bumps its own int32, then waits for all of them":
  plain     N launches, one after another (a CUDA graph of N kernel nodes)
  pdl       N launches with programmatic dependent launch, each letting the next one launch at its start and then
            waiting on the one before (`kernel_switch.pdl_launch_next` + `pdl_wait`, as the decode kernels do)
  barrier   one launch of N rounds, each ending at a grid barrier (an atomic counter and a spin on it; the grid is
            at most one program per SM so that all are resident)
Time per round = (graph replay with N rounds - with 1 round) / (N - 1), the best of `--trials`. The grid sizes are
the B=1 decode's: 24 (the paged decode's split programs), 132 (one per SM) and 640 (q|k|v's row programs; not for
the barrier, which needs every program resident).

    python3 benchmarks/hop_floor.py [--rounds 64] [--trials 5]
"""
from __future__ import annotations

import argparse

import torch

from cuda_kernels import captured, replay_seconds
from moeloop.model.kernel_switch import pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from moeloop.model.kernel_switch import pdl_launch_next, pdl_wait

    @triton.jit
    def _hop(x_ptr, PDL: tl.constexpr):
        pdl_launch_next(PDL, True)
        pdl_wait(PDL, True)
        i = tl.program_id(0)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)

    @triton.jit
    def _rounds(x_ptr, count_ptr, rounds, P):
        """`rounds` rounds over a zeroed counter; round n ends when the counter reaches (n + 1) * P."""
        i = tl.program_id(0)
        for n in range(rounds):
            tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)
            tl.debug_barrier()
            tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
            target = (n + 1) * P
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


def per_round_us(make_run, rounds: int, trials: int, replays: int = 50) -> float:
    """us per round: the replay time of `rounds` rounds minus that of one, over rounds - 1 (best of `trials`)."""
    (many, _), (one, _) = captured(make_run(rounds)), captured(make_run(1))
    best_many = min(replay_seconds(many, replays) for _ in range(trials))
    best_one = min(replay_seconds(one, replays) for _ in range(trials))
    return 1e6 * (best_many - best_one) / (rounds - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.zeros(4096, dtype=torch.int32, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs; torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.rounds} rounds, best of {args.trials}")

    def hops(programs: int, pdl: bool):
        def make(n: int):
            return lambda: [_hop[(programs,)](x, PDL=pdl, num_warps=1, **pdl_launch(pdl)) for _ in range(n)]
        return make

    def barrier(programs: int):
        def make(n: int):
            def run():
                count.zero_()
                _rounds[(programs,)](x, count, n, programs, num_warps=1)
            return run
        return make

    for programs in (24, sms, 640):
        row = [f"{per_round_us(hops(programs, False), args.rounds, args.trials):6.2f} plain",
               f"{per_round_us(hops(programs, True), args.rounds, args.trials):6.2f} pdl"]
        if programs <= sms:
            row.append(f"{per_round_us(barrier(programs), args.rounds, args.trials):6.2f} barrier")
        print(f"{programs:4d} programs: us per round  " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
