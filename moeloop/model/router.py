"""Top-k expert routing and per-layer router statistics.

Two scoring rules, each matching transformers on the same weights:
- softmax (Qwen3-MoE, Mixtral): p = softmax(logits) in fp32, top-k of p, optional renormalisation of the k
  weights (Mixtral always renormalises, which equals a softmax over the top-k logits).
- sigmoid (DeepSeek-V3): s = sigmoid(logits); experts are *selected* on s + e_score_correction_bias, restricted
  to the `topk_group` best of `n_group` groups (group score = sum of its top-2 biased scores); the weights are
  the unbiased s of the chosen experts, optionally renormalised, times `routed_scaling_factor`.

`RouterStats` carries what a load-balance loss needs; `load_balance_loss` is the Switch / transformers
auxiliary loss E * sum_i f_i * P_i (f_i: fraction of tokens routed to expert i, summing to K over experts;
P_i: mean normalised router score, softmax probs or sigmoid scores / their sum).
"""
# T tokens, D model dim, E routed experts, K experts per token, Ng groups, Eg experts per group
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moeloop.model.config import ModelConfig


@dataclass
class Routing:
    ids_TK: torch.Tensor  # int64 expert ids
    weights_TK: torch.Tensor  # fp32 combine weights
    scores_TE: torch.Tensor  # fp32 normalised scores (rows sum to 1), for the balance loss


@dataclass
class RouterStats:
    """One MoE layer, one forward. `load_counts_E` sums to num_tokens * top_k; `prob_sum_E` has gradients."""

    load_counts_E: torch.Tensor  # int64, assignments per expert
    prob_sum_E: torch.Tensor  # fp32, sum over tokens of the normalised router score
    num_tokens: int
    top_k: int

    @property
    def aux_loss(self) -> torch.Tensor:
        return load_balance_loss([self])


def load_balance_loss(stats: list[RouterStats]) -> torch.Tensor:
    """E * sum_i f_i * P_i with counts and probabilities pooled over the given layers (as transformers does)."""
    if not stats:
        raise ValueError("load_balance_loss needs the stats of at least one MoE layer")
    num_rows = sum(s.num_tokens for s in stats)
    f_E = sum(s.load_counts_E.float() for s in stats) / num_rows
    p_E = sum(s.prob_sum_E for s in stats) / num_rows
    return (f_E * p_E).sum() * f_E.shape[0]


def _replayed(own_TK: torch.Tensor, replay_TK: torch.Tensor, valid_T: Optional[torch.Tensor]) -> torch.Tensor:
    replay_TK = replay_TK.to(own_TK.device, own_TK.dtype)
    return replay_TK if valid_T is None else torch.where(valid_T[:, None], replay_TK, own_TK)


class Router(nn.Module):
    """`weight` [E, D]; DeepSeek-V3 adds the persistent buffer `e_score_correction_bias` [E] (kept in fp32 math)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.scoring_func, self.norm_topk_prob = cfg.scoring_func, cfg.norm_topk_prob
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if self.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x_TD: torch.Tensor, replay: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None) -> Routing:
        """`replay` = (ids [T, K], valid [T] or None): route to those experts (at the valid rows; the own top-k
        elsewhere), weighted by this router's scores of them (`moeloop.model.routes`)."""
        if self.scoring_func == "sigmoid":
            return self._route_sigmoid(F.linear(x_TD.float(), self.weight.float()), replay)
        return self._route_softmax(F.linear(x_TD, self.weight), replay)

    def _route_softmax(self, logits_TE: torch.Tensor, replay=None) -> Routing:
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if replay is not None:
            ids_TK = _replayed(ids_TK, *replay)
            weights_TK = probs_TE.gather(1, ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return Routing(ids_TK, weights_TK * self.routed_scaling_factor, probs_TE)

    def _route_sigmoid(self, logits_TE: torch.Tensor, replay=None) -> Routing:
        scores_TE = logits_TE.sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias.float()
        if self.n_group > 1:
            choice_TE = self._mask_groups(choice_TE)
        ids_TK = torch.topk(choice_TE, self.top_k, dim=-1, sorted=False)[1]
        if replay is not None:
            ids_TK = _replayed(ids_TK, *replay)
        weights_TK = scores_TE.gather(1, ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        normalised_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        return Routing(ids_TK, weights_TK * self.routed_scaling_factor, normalised_TE)

    def _mask_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        T = choice_TE.shape[0]
        grouped_TNgEg = choice_TE.view(T, self.n_group, choice_TE.shape[1] // self.n_group)  # (T may be 0)
        group_scores_TNg = grouped_TNgEg.topk(2, dim=-1)[0].sum(dim=-1)
        keep_idx = torch.topk(group_scores_TNg, self.topk_group, dim=-1, sorted=False)[1]
        keep_TNg = torch.zeros_like(group_scores_TNg, dtype=torch.bool).scatter_(1, keep_idx, True)
        return grouped_TNgEg.masked_fill(~keep_TNg[..., None], float("-inf")).view(T, choice_TE.shape[1])
