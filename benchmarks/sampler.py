"""The rollout sampler's cost per decode step on a GPU, inside CUDA graphs (as the engine runs it), at the reference
vocab (32000, bf16 logits), temperature 1:

- top-k 50 (what `benchmarks/rollout.py` samples with): the fused `topk_sample` launch (tokens and logprobs) against
  the path it replaced (torch.topk 50, `_topk_gumbel`, log_softmax + gather);
- top-k 50 + top-p 0.9: the one-launch `topk_sample` with top-p (session 11) against the path it replaced
  (`ranked_topk`, nucleus mask, `_topk_gumbel`, log_softmax) and that path on plain torch.topk candidates (what it
  ran before `ranked_topk`);
- no filter (the RL default, top-k off, top-p 1): the one-launch `gumbel_sample` against the same draw in torch
  ops (`MOELOOP_KERNELS=off`'s path; the two-kernel version it replaced is gone);
- an agreement check: 300 random batches (ties at the top, greedy rows, top-k 1..256 or off, top-p on a third)
  drawn by the kernels and by the torch path on the same GPU, which must give the same tokens and logprobs within
  4e-6.

    python benchmarks/sampler.py                 # CUDA only
    python benchmarks/sampler.py --topk-sweep    # top-k 50's slices per row and warps per program instead

`--topk-sweep`: `topk_sample` at top-k 50 for each `topk_kernel.TOPK_SPLITS` (slices per row: phase 1 ranks
V / S values per program, phase 2 up to S * 128 candidates in the row's last program) and `TOPK_WARPS`, with the tokens
compared with the defaults' (the slicing must not change them).
"""
from __future__ import annotations

import torch

from cuda_kernels import captured, replay_seconds
from moeloop.rollout import sampler as sampler_mod
from moeloop.rollout.gumbel_kernel import topk_gumbel_argmax
from moeloop.rollout.sampler import Sampler, SamplingTensors, row_key

V = 32000


def tensors(B: int, temps=None, top_ks=None, top_p: float | torch.Tensor = 1.0, counter: int = 0) -> SamplingTensors:
    dev = "cuda"
    temps = torch.ones(B, device=dev) if temps is None else temps
    top_ks = torch.full((B,), 50, device=dev) if top_ks is None else top_ks
    top_ps = top_p if isinstance(top_p, torch.Tensor) else torch.full((B,), top_p, device=dev)
    any_top_p = bool((top_ps < 1).any())
    keys = torch.tensor([row_key(s, counter) for s in range(B)], device=dev)
    return SamplingTensors(temps, top_ks, top_ps, keys, any_filter=any_top_p or bool((top_ks < V).any()),
                           all_greedy=False, max_top_k=int(top_ks.max()), any_greedy=bool((temps == 0).any()),
                           any_top_p=any_top_p)


def before_topk(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k-only path before `topk_sample`: unsorted torch.topk, one-kernel draw, log_softmax + gather."""
    vals, ids = logits.topk(st.max_top_k, dim=-1, sorted=False)
    tokens = topk_gumbel_argmax(vals, ids, st.keys_B, st.temperatures_B, st.top_ks_B)
    return tokens, torch.log_softmax(logits, -1, dtype=torch.float32).gather(1, tokens[:, None])[:, 0]


def before_top_p(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p path on plain (sorted) torch.topk candidates, as before `ranked_topk`."""
    vals, ids = logits.topk(st.max_top_k, dim=-1)
    probs = (vals.float() - logits.float().logsumexp(dim=-1, keepdim=True)).exp()
    drop = (probs.cumsum(dim=-1) - probs) > st.top_ps_B[:, None]
    tokens = topk_gumbel_argmax(vals, ids, st.keys_B, st.temperatures_B, st.top_ks_B, drop)
    return tokens, torch.log_softmax(logits, -1, dtype=torch.float32).gather(1, tokens[:, None])[:, 0]


def ranked_top_p(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p path of session 10: `ranked_topk` candidates, the nucleus mask in torch ops, `_topk_gumbel`,
    log_softmax + gather."""
    tokens = sampler_mod._sample_top_k(logits, st)
    return tokens, torch.log_softmax(logits, -1, dtype=torch.float32).gather(1, tokens[:, None])[:, 0]


def now(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    return Sampler()(logits, st, True)


def torch_ops(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler with the kernels off (on the bf16 logits' fp32 copy, as that path runs)."""
    sampler_mod.kernels_apply = lambda t: False
    try:
        return Sampler()(logits, st, True)
    finally:
        sampler_mod.kernels_apply = lambda t: True


def graph_us(fn, logits: torch.Tensor, st: SamplingTensors, calls: int = 20) -> tuple[float, bool]:
    """Microseconds per call of fn captured `calls` times in one CUDA graph, and whether the replayed outputs
    equal an eager call's."""
    graph, outs = captured(lambda: [fn(logits, st) for _ in range(calls)])
    for _ in range(3):
        graph.replay()
    seconds = replay_seconds(graph, 10)
    want = fn(logits, st)
    same = all(torch.equal(o[0], want[0]) and torch.equal(o[1], want[1]) for o in outs)
    return seconds / calls * 1e6, same


def agreement(batches: int = 300) -> int:
    """Batches whose kernel draw differs from the torch path's on the same GPU (tokens, or logprobs by > 4e-6)."""
    bad = 0
    for it in range(batches):
        B = [1, 7, 64, 256][it % 4]
        logits = (torch.randn(B, V, device="cuda") * (1 + it % 5)).to(torch.bfloat16)
        logits[:, 100:140] = logits.max()  # a run of equal maxima
        temps = torch.rand(B, device="cuda") + 0.2
        temps[::5] = 0
        top_ks = torch.randint(1, 257, (B,), device="cuda") if it % 3 else torch.full((B,), V, device="cuda")
        top_ps = torch.where(torch.rand(B, device="cuda") < 0.7, torch.rand(B, device="cuda") * 0.95 + 0.05, 1.0)
        # one batch in three: no filter (`gumbel_sample`), top-k (`topk_sample`), top-k + top-p (its TOP_P phase)
        st = tensors(B, temps, top_ks, top_ps if it % 3 == 2 else 1.0, counter=it)
        tokens, lp = Sampler()(logits, st, True)
        want_tokens, want_lp = torch_ops(logits, st)
        bad += (not torch.equal(tokens, want_tokens)) or (lp - want_lp).abs().max().item() > 4e-6
    return bad


def topk_sweep() -> None:
    from moeloop.rollout import topk_kernel
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; top-k 50 `topk_sample`, us per sampling step "
          f"in a CUDA graph, V={V}")
    defaults = topk_kernel.TOPK_SPLITS, topk_kernel.TOPK_WARPS
    for B in (1, 32, 256):
        logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
        st = tensors(B)
        want = now(logits, st)
        row = []
        for splits in (8, 16, 32, 64):
            for warps in (0, 2, 4, 8):
                topk_kernel.TOPK_SPLITS, topk_kernel.TOPK_WARPS = splits, warps
                us, _ = graph_us(now, logits, st)
                tokens, lp = now(logits, st)
                same = torch.equal(tokens, want[0]) and (lp - want[1]).abs().max().item() <= 4e-6
                row.append(f"S{splits}/w{warps or 'auto'} {us:5.1f}{'' if same else ' (DIFFERS)'}")
        topk_kernel.TOPK_SPLITS, topk_kernel.TOPK_WARPS = defaults
        print(f"B={B:3d}: " + ", ".join(row))


def main() -> None:
    import sys
    if "--topk-sweep" in sys.argv[1:]:
        return topk_sweep()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per sampling step in a CUDA graph, V={V}")
    for B in (1, 8, 32, 128, 256):
        logits = (torch.randn(B, V, device="cuda") * 3).to(torch.bfloat16)
        st, st_p = tensors(B), tensors(B, top_p=0.9)
        (t_old, _), (t_new, same) = graph_us(before_topk, logits, st), graph_us(now, logits, st)
        (tp_old, _), (tp_new, same_p) = graph_us(before_top_p, logits, st_p), graph_us(now, logits, st_p)
        tp_ranked, _ = graph_us(ranked_top_p, logits, st_p)
        st_n = tensors(B, top_ks=torch.full((B,), V, device="cuda"))
        (tn_old, _), (tn_new, same_n) = graph_us(torch_ops, logits, st_n), graph_us(now, logits, st_n)
        print(f"B={B:3d}  top-k 50: before {t_old:6.1f}  fused {t_new:6.1f}   |  top-k 50 + top-p 0.9: "
              f"torch.topk {tp_old:6.1f}  ranked_topk {tp_ranked:6.1f}  one launch {tp_new:6.1f}   |  no filter: "
              f"torch ops {tn_old:6.1f}  "
              f"one launch {tn_new:6.1f}   (replay == eager: {same and same_p and same_n})")
    print(f"random batches, kernels vs torch path on the GPU: {agreement()} of 300 differ")


if __name__ == "__main__":
    main()
