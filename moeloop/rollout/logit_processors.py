"""Repetition penalty and min-p (`SamplingParams.repetition_penalty`, `.min_p`): the rows' tensors for them (the
penalised rows' token ids as a [B, V] mask built on the device) and their effect on logits, with the semantics of
transformers' `RepetitionPenaltyLogitsProcessor` and `MinPLogitsWarper` (tests/test_rollout_penalties.py checks
both against them). Only a batch with such a row builds them; the `Sampler` then draws in torch ops, in a multi-step
launch too (inside its CUDA graph; each step's tokens join the seen mask on the device, `multistep.step_sampler`).
Shapes: B rows, V vocab, K steps of a launch, S rows of a launch.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from moeloop.rollout.sequence import Sequence
from moeloop.transfer import to_device, upload

# (rows, their rows in the previous launch's tokens, those tokens [K, S]: each of its K steps' tokens of S rows)
PendingTokens = tuple[list[int], list[int], torch.Tensor]


def penalise_repetitions(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalties_B: torch.Tensor) -> torch.Tensor:
    """The logits with each seen token's logit multiplied by its row's penalty when < 0, else divided by it (a
    penalty of 1 leaves the row as it is, bit for bit)."""
    p_B1 = penalties_B[:, None]
    return torch.where(seen_BV, torch.where(logits_BV < 0, logits_BV * p_B1, logits_BV / p_B1), logits_BV)


def min_p_drop(scaled_BV: torch.Tensor, min_ps_B: torch.Tensor) -> torch.Tensor:
    """Mask of the tokens min-p drops, from logits already divided by the temperature: those whose softmax
    probability is below min_p times the row's largest (fp32, as HF computes it; min_p 0 drops none, and the
    largest is never dropped)."""
    probs_BV = torch.softmax(scaled_BV, dim=-1)
    return probs_BV < min_ps_B[:, None] * probs_BV.amax(dim=-1, keepdim=True)


def processing_fields(seqs: list[Sequence], pending: PendingTokens | None, vocab_size: int,
                      device: torch.device) -> dict[str, torch.Tensor | None]:
    """`SamplingTensors`' penalties_B, seen_BV and min_ps_B for the rows `seqs`; penalties_B and seen_BV are None
    when no row has a repetition penalty, min_ps_B when no sampled row has min-p. `pending`: the penalised rows
    whose last tokens are still on the device only (async scheduling: all K tokens of the launch before), with
    where they are. A multi-step launch adds each step's tokens to seen_BV itself (`multistep.step_sampler`)."""
    params = [s.params for s in seqs]
    fields: dict[str, torch.Tensor | None] = dict(penalties_B=None, seen_BV=None, min_ps_B=None)
    penalised = [j for j, p in enumerate(params) if p.repetition_penalty != 1]
    if penalised:
        fields["penalties_B"] = to_device([p.repetition_penalty for p in params], device, torch.float32)
        fields["seen_BV"] = seen_tokens([seqs[j].token_ids for j in penalised], penalised, pending,
                                        (len(seqs), vocab_size), device)
    if any(p.min_p > 0 and p.temperature > 0 for p in params):
        fields["min_ps_B"] = to_device([p.min_p if p.temperature > 0 else 0.0 for p in params], device, torch.float32)
    return fields


def seen_tokens(histories: list[list[int]], rows: list[int], pending: PendingTokens | None,
                shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Bool [B, V]: True at (row, id) for each token id of rows[i]'s history (host token ids: prompt and response),
    and at each pending row's tokens, read from the previous launch's tokens on the device (every one of its K
    steps). One upload and one or two index fills."""
    B, V = shape
    seen_N = torch.zeros(B * V, dtype=torch.bool, device=device)
    lengths = np.fromiter(map(len, histories), dtype=np.int64, count=len(histories))
    ids = np.fromiter(chain.from_iterable(histories), dtype=np.int64, count=int(lengths.sum()))
    flat = np.repeat(np.asarray(rows, dtype=np.int64) * V, lengths) + ids
    seen_N.index_fill_(0, upload(torch.from_numpy(flat), device), True)
    if pending is not None:
        dst, src, tokens_KS = pending
        ids_KN = tokens_KS[:, to_device(src, device)].long()
        seen_N.index_fill_(0, (to_device(dst, device) * V + ids_KN).reshape(-1), True)
    return seen_N.view(B, V)
