"""Multi-step decode: K decode steps of one batch on the device with no host round trip in between.

Each step forwards the batch, samples every row and writes the sampled tokens (and their logprobs) into row k of
the output; the next step's inputs follow on the device: ids = the sampled tokens, positions and context lengths
+ 1, slots from the block tables (the scheduler reserved the blocks for all K positions). The host sees the K
tokens of each row at once and checks stops afterwards (`Engine._flush`). The same code runs eagerly (CPU) and
inside a CUDA graph (`DecodeGraphs.run_steps`): every tensor is updated in place and keeps its shape.
Shapes: B rows, K steps, N blocks per row, X = 1 (tokens) or 2 (tokens and logprobs).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from moeloop.model.kernel_switch import kernels_apply, triton
from moeloop.rollout.gumbel_kernel import StepRecord
from moeloop.rollout.sampler import SamplingTensors

if triton is not None:
    import triton.language as tl

    from moeloop.rollout.gumbel_kernel import record_next, record_rows

_kernel_failed = False  # set when `_record_advance` failed to compile or launch here


def decode_steps(forward: Callable[[int], torch.Tensor], sample: Callable[[torch.Tensor, StepRecord], tuple],
                 ids_B: torch.Tensor, pos_B: torch.Tensor, slots_B: torch.Tensor, lens_B: torch.Tensor,
                 tables_BN: torch.Tensor, block_size: int, steps: int, out_XKB: torch.Tensor) -> torch.Tensor:
    """Run `steps` steps: `forward(k)` -> logits [B, V] of the current inputs, `sample(logits, record)` -> (tokens
    [B], logprobs [B] or None) into out_XKB[k] and out_XKB[steps + k], then the next step's inputs (`StepRecord`:
    a one-launch sampler writes them itself, else `record_and_advance`). Returns the last step's tokens [B] (the
    next launch's inputs)."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    for k in range(steps):
        record = StepRecord(out_XKB, k, steps, None if k + 1 == steps else
                            (ids_B, pos_B, slots_B, lens_B, tables_BN, block_size))
        tokens_B, logprobs_B = sample(forward(k), record)
        if not record.written:
            record_and_advance(tokens_B, logprobs_B, out_XKB, k, steps, record.inputs)
    return tokens_B


def record_and_advance(tokens_B: torch.Tensor, logprobs_B: torch.Tensor | None, out_XKB: torch.Tensor, k: int,
                       steps: int, inputs: tuple | None) -> None:
    """out[k] = tokens, out[steps + k] = logprobs (float64); then, unless `inputs` is None (the last step), the next
    step's inputs in place: ids = tokens, positions and lengths + 1, slots from the block tables. One Triton launch
    on CUDA (eleven small torch ops otherwise: ~2 us each inside a graph at B=1)."""
    global _kernel_failed
    if kernels_apply(tokens_B) and not _kernel_failed:
        B = tokens_B.shape[0]
        ids_B, pos_B, slots_B, lens_B, tables_BN, block_size = inputs or (tokens_B,) * 5 + (1,)
        block_b = min(1024, max(16, triton.next_power_of_2(B)))
        try:  # (it compiles in the warm-up run before a graph capture, so a failure falls back before capturing)
            _record_advance[(triton.cdiv(B, block_b),)](  # (the kernel reads rows at stride 1)
                tokens_B.contiguous(), (tokens_B if logprobs_B is None else logprobs_B).contiguous(), out_XKB, ids_B, pos_B, lens_B, slots_B,
                tables_BN, B, out_XKB.stride(0), tables_BN.stride(0), k, steps, BLOCK_SIZE=block_size,
                HAS_LOGPROBS=logprobs_B is not None, ADVANCE=inputs is not None, BLOCK_B=block_b, num_warps=4)
            return
        except Exception as err:  # nothing was written: the torch ops below do the whole update
            if torch.cuda.is_current_stream_capturing():
                raise
            warnings.warn(f"the multi-step record/advance kernel failed ({err!r}); torch ops from now on")
            _kernel_failed = True
    out_XKB[k].copy_(tokens_B)
    if logprobs_B is not None:
        out_XKB[steps + k].copy_(logprobs_B)
    if inputs is None:
        return
    ids_B, pos_B, slots_B, lens_B, tables_BN, block_size = inputs
    ids_B.copy_(tokens_B)
    pos_B.add_(1)
    lens_B.add_(1)
    block_B = tables_BN.gather(1, torch.div(pos_B, block_size, rounding_mode="floor")[:, None].long())[:, 0]
    slots_B.copy_(block_B.long() * block_size + pos_B % block_size)


if triton is not None:
    @triton.jit
    def _record_advance(tokens_ptr, logprobs_ptr, out_ptr, ids_ptr, pos_ptr, lens_ptr, slots_ptr, tables_ptr, B,
                        s_out, s_tb, k, steps, BLOCK_SIZE: tl.constexpr, HAS_LOGPROBS: tl.constexpr,
                        ADVANCE: tl.constexpr, BLOCK_B: tl.constexpr):
        r = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        ok = r < B
        tok = tl.load(tokens_ptr + r, mask=ok, other=0)
        lp = tok  # (not stored without logprobs)
        if HAS_LOGPROBS:
            lp = tl.load(logprobs_ptr + r, mask=ok, other=0.0)
        p, n, slot = record_next(r, ok, pos_ptr, lens_ptr, tables_ptr, s_tb, BLOCK_SIZE, ADVANCE)
        record_rows(tok, lp, r, ok, out_ptr, s_out, k, steps, ids_ptr, pos_ptr, slots_ptr, lens_ptr, p, n, slot,
                    HAS_LOGPROBS, ADVANCE)


def step_sampler(sampler: Callable, st: SamplingTensors, keys_KB: torch.Tensor,
                 want_logprobs: bool) -> Callable[[torch.Tensor, StepRecord], tuple]:
    """`decode_steps`'s sample(logits, record): `sampler` with the batch's parameters and step k's row keys; with a
    repetition penalty (st.seen_BV), each step's tokens join the seen mask before the next step draws."""
    def sample(logits_BV: torch.Tensor, record: StepRecord) -> tuple:
        tokens_B, logprobs_B = sampler(logits_BV, replace(st, keys_B=keys_KB[record.k]), want_logprobs, record)
        if st.seen_BV is not None and record.inputs is not None:  # (the last step's tokens: the next launch's)
            st.seen_BV.scatter_(1, tokens_B[:, None].long(), True)
        return tokens_B, logprobs_B

    return sample
