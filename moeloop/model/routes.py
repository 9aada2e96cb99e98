"""Router replay: which experts each MoE layer chose for each row of a forward, recorded or replayed.

An MoE policy's logprobs move with its routing, and the routing is brittle: a near tie between two experts flips
with the kernels' rounding (the rollout engine's against the trainer's), and with every optimizer step. Replay
holds the choice fixed and lets the router's probabilities of the chosen experts carry the gradient:
- R2 (vanilla routing replay): the old-logprob pass records the routes and every update pass replays them, so
  later mini-batches and epochs see the routing their old logprobs saw.
- R3 (rollout routing replay, Ma et al. 2025): the rollout engine records the routes of every token it computed
  and the trainer's passes replay them, so the trainer's logprobs are taken through the experts that sampled.
A tape travels on the attention context (`ctx.routes`) and the MoE blocks read it by their `moe_index`. The
reference model and the critic route afresh: they are other networks, and the replayed experts are the policy's.
Shapes: L MoE layers, T rows of the forward, K experts per token.
"""
from __future__ import annotations

from typing import Optional

import torch


class RouteTape:
    """Training side. `replay_LTK` (any integer dtype): each MoE layer takes those expert ids at the rows where
    `valid_T` holds (every row when None) and its own top-k elsewhere. `record`: each layer's choice is kept
    (`stacked`)."""

    def __init__(self, replay_LTK: Optional[torch.Tensor] = None, valid_T: Optional[torch.Tensor] = None,
                 record: bool = False):
        self.replay_LTK, self.valid_T = replay_LTK, valid_T
        self.recorded: Optional[dict[int, torch.Tensor]] = {} if record else None

    def replay(self, moe_index: int) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        if self.replay_LTK is None:
            return None
        return self.replay_LTK[moe_index], self.valid_T

    def record(self, moe_index: int, ids_TK: torch.Tensor) -> None:
        if self.recorded is not None:
            self.recorded[moe_index] = ids_TK.detach()

    def stacked(self) -> torch.Tensor:
        """The recorded ids [L, T, K] in MoE-layer order."""
        return torch.stack([self.recorded[i] for i in sorted(self.recorded)])


class SlotRoutes:
    """Rollout side: each MoE layer's ids are written into the engine's route buffer [L, num_slots, K] at the
    forward's KV slots, so they live, are shared and are recomputed exactly as the K/V of those tokens are."""

    def __init__(self, buffer_LSK: torch.Tensor, slot_mapping_T: torch.Tensor):
        self.buffer_LSK, self.slot_mapping_T = buffer_LSK, slot_mapping_T

    def replay(self, moe_index: int) -> None:
        return None

    def record(self, moe_index: int, ids_TK: torch.Tensor) -> None:
        self.buffer_LSK[moe_index].index_copy_(0, self.slot_mapping_T, ids_TK.to(self.buffer_LSK.dtype))
