"""Loss aggregation over packed tokens with a GLOBAL denominator, so per-micro-batch losses sum to
the loss of the whole mini-batch however it was cut (and across DP ranks).

Modes (verl names; N = loss tokens, S = sequences with >= 1 loss token, L = max_response_length,
all counted over the whole optimizer-step mini-batch on all DP ranks):
  token-mean               sum_i sum_t l_it / N
  seq-mean-token-sum       sum_i (sum_t l_it) / S
  seq-mean-token-mean      sum_i (sum_t l_it / n_i) / S       (n_i = loss tokens of sequence i)
  seq-mean-token-sum-norm  sum_i (sum_t l_it) / (S * L)       (Dr.GRPO: a constant length normaliser)
`loss_denominator` gives the denominator; `aggregate_loss` the micro-batch's share of the loss.
Sequences are never split across micro-batches, so n_i is always local.
"""
from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r}; expected one of {'|'.join(LOSS_AGG_MODES)}")


def loss_denominator(num_loss_tokens: int, num_loss_seqs: int, mode: str, max_response_length: int | None = None) -> float:
    """The global denominator of `mode` (linear in the counts, so per-rank values may be summed)."""
    check_mode(mode)
    if mode == "token-mean":
        return float(num_loss_tokens)
    if mode == "seq-mean-token-sum-norm":
        if not max_response_length or max_response_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs max_response_length > 0 (data.max_response_length)")
        return float(num_loss_seqs * max_response_length)
    return float(num_loss_seqs)


def seq_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] int64 index of the sequence each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if int(lengths.sum()) != num_tokens:
        raise ValueError(f"cu_seqlens covers {int(lengths.sum())} tokens, tensors have {num_tokens}")
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)


def per_seq_sum(values_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S] sum of `values_T` within each packed sequence (differentiable)."""
    ids = seq_ids(cu_seqlens, values_T.shape[0]).to(values_T.device)
    out = values_T.new_zeros(len(cu_seqlens) - 1)
    return out.index_add(0, ids, values_T)


def aggregate_loss(loss_T: torch.Tensor, loss_mask_T: torch.Tensor, cu_seqlens: torch.Tensor, mode: str, denominator: float) -> torch.Tensor:
    """This micro-batch's share of the `mode` aggregate; `denominator` is from `loss_denominator`
    over the whole mini-batch (all ranks). Summing the shares over micro-batches gives the full loss."""
    check_mode(mode)
    if denominator <= 0:
        return (loss_T * 0.0).sum()  # nothing in the loss anywhere: a zero that keeps the graph
    masked = torch.where(loss_mask_T.bool(), loss_T, torch.zeros_like(loss_T))  # no NaN leaks from unmasked slots
    if mode != "seq-mean-token-mean":
        return masked.sum() / denominator
    tokens_per_seq = per_seq_sum(loss_mask_T.to(loss_T.dtype), cu_seqlens)
    seq_means = per_seq_sum(masked, cu_seqlens) / tokens_per_seq.clamp(min=1)
    return seq_means.sum() / denominator
