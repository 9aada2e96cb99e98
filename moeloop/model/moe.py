"""The sparse MoE block of a decoder layer: router (`gate`), stacked routed `experts`, optional
`shared_experts` (DeepSeek-V3), and the `RouterStats` of its latest forward.

Stats protocol: the model calls `clear_stats()` on every MoE block at the start of a forward; the block records
stats once per forward, so an activation-checkpointing recompute in backward does not replace them.
`record_stats = False` skips them (the rollout engine's decode: no balance loss, fewer kernels).
"""
# T tokens, D model dim, E routed experts, K experts per token
from __future__ import annotations

import torch
from torch import nn

from moeloop.model.config import ModelConfig
from moeloop.model.experts import Experts, expert_counts
from moeloop.model.mlp import GatedMLP
from moeloop.model.router import Router, RouterStats


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, experts_impl: str = "auto"):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, experts_impl)
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.stats: RouterStats | None = None
        self.record_stats = True
        self.moe_index = 0  # among the model's MoE blocks (set by the model): its row of a route tape

    def clear_stats(self) -> None:
        self.stats = None

    def forward(self, x_TD: torch.Tensor, routes=None) -> torch.Tensor:
        """`routes`: a route tape (`moeloop.model.routes`) to replay this block's experts from and record them to."""
        routing = self.gate(x_TD, routes.replay(self.moe_index) if routes is not None else None)
        if routes is not None:
            routes.record(self.moe_index, routing.ids_TK)
        counts_E = expert_counts(routing.ids_TK, self.experts.num_experts) if self.record_stats else None
        y_TD = self.experts(x_TD, routing.ids_TK, routing.weights_TK, counts_E)
        if hasattr(self, "shared_experts"):
            y_TD = y_TD + self.shared_experts(x_TD)
        if self.record_stats and self.stats is None:
            self.stats = RouterStats(counts_E, routing.scores_TE.sum(dim=0), x_TD.shape[0], routing.ids_TK.shape[1])
        return y_TD
