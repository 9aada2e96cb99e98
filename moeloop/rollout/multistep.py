"""Multi-step decode: K decode steps of one batch on the device with no host round trip in between.

Each step forwards the batch, samples every row and writes the sampled tokens (and their logprobs) into row k of
the output; the next step's inputs follow on the device: ids = the sampled tokens, positions and context lengths
+ 1, slots from the block tables (the scheduler reserved the blocks for all K positions). The host sees the K
tokens of each row at once and checks stops afterwards (`Engine._flush`). The same code runs eagerly (CPU) and
inside a CUDA graph (`DecodeGraphs.run_steps`): every tensor is updated in place and keeps its shape.
Shapes: B rows, K steps, N blocks per row, X = 1 (tokens) or 2 (tokens and logprobs).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from moeloop.rollout.sampler import SamplingTensors


def decode_steps(forward: Callable[[int], torch.Tensor], sample: Callable[[torch.Tensor, int], tuple],
                 ids_B: torch.Tensor, pos_B: torch.Tensor, slots_B: torch.Tensor, lens_B: torch.Tensor,
                 tables_BN: torch.Tensor, block_size: int, steps: int, out_XKB: torch.Tensor) -> torch.Tensor:
    """Run `steps` steps: `forward(k)` -> logits [B, V] of the current inputs, `sample(logits, k)` -> (tokens [B],
    logprobs [B] or None) into out_XKB[k] and out_XKB[steps + k]. Returns the last step's tokens [B] (the next
    launch's inputs)."""
    for k in range(steps):
        tokens_B, logprobs_B = sample(forward(k), k)
        out_XKB[k].copy_(tokens_B)
        if logprobs_B is not None:
            out_XKB[steps + k].copy_(logprobs_B)
        if k + 1 == steps:
            return tokens_B
        ids_B.copy_(tokens_B)
        pos_B.add_(1)
        lens_B.add_(1)
        block_B = tables_BN.gather(1, torch.div(pos_B, block_size, rounding_mode="floor")[:, None].long())[:, 0]
        slots_B.copy_(block_B.long() * block_size + pos_B % block_size)
    raise ValueError("steps must be >= 1")


def step_sampling(st: SamplingTensors, keys_KB: torch.Tensor, k: int) -> SamplingTensors:
    """Step k's sampling tensors: the batch's parameters with that step's row keys."""
    return SamplingTensors(st.temperatures_B, st.top_ks_B, st.top_ps_B, keys_KB[k], st.any_filter, st.all_greedy,
                           st.max_top_k, st.any_greedy, st.any_top_p, st.same_top_k)
