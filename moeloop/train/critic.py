"""The PPO critic: the policy's transformer with a scalar value head, trained on GAE returns.

    critic = Critic(load_policy(cfg), cfg.critic, device, total_steps)   # initialised from the policy
    critic.compute_values(samples)        # sample.values: V at each response token's predicting position
    metrics = critic.update(samples)      # clipped value loss, same micro-batching / DP rules as the actor
Values line up with logprobs: the value stored for response token j is read at the position that
predicts token j (the state before it), as `moeloop.train.packing` documents.
"""
from __future__ import annotations

import torch
from torch import nn

from moeloop.algo.losses import reduce_metrics, value_loss
from moeloop.config.schema import CriticSection
from moeloop.train.actor import (PolicyForward, all_reduce_scalar, build_optimizer, clip_and_step, dp_size,
                                 global_metrics, num_mini_batches, over_positions, packed_hidden, split_groups)
from moeloop.parallel.pipeline import forward_passes, holds_head, last_stage_value, run_passes
from moeloop.train.packing import PackedBatch, global_loss_denominators
from moeloop.types import Sample


class ValueHead(nn.Module):
    """hidden [T, D] -> value [T] in fp32; zero-initialised so the first values are 0."""

    def __init__(self, dim: int):
        super().__init__()
        self.score = nn.Linear(dim, 1, bias=True)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        return self.score(hidden_TD).squeeze(-1).float()


class Critic(PolicyForward):
    def __init__(self, model: nn.Module, cfg: CriticSection, device: torch.device, max_response_length: int,
                 total_steps: int = 1, param_dtype: torch.dtype | None = None, ep: int = 1,
                 master_weights: bool = True):
        head = ValueHead(model.cfg.hidden_size).to(next(model.parameters()).dtype)
        super().__init__(model, device, cfg.max_tokens_per_micro_batch, 0, param_dtype, head=head, ep=ep,
                         master_weights=master_weights)
        self.cfg, self.max_response_length = cfg, max_response_length
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_steps)

    def values_of(self, batch: PackedBatch) -> torch.Tensor:
        return over_positions(self.model.lm_head, packed_hidden(self.model, batch))

    @torch.no_grad()
    def compute_values(self, samples: list[Sample]) -> None:
        self.model.eval()
        passes = forward_passes(self.packed_micro_batches(samples), lambda item: self.values_of(item[1]))
        for (part, batch), values_T in passes:
            for seq, sample in enumerate(part):
                sample.values = values_T[batch.response_slice(seq)].cpu().tolist()

    def update(self, samples: list[Sample]) -> dict[str, float]:
        self.model.train()
        metrics = []
        for _ in range(self.cfg.ppo_epochs):
            for mini in split_groups(samples, num_mini_batches(samples, self.cfg.ppo_mini_batch_size)):
                metrics.append(self._step(mini))
        self.scheduler.step()
        return {f"critic/{k}": v for k, v in reduce_metrics(metrics).items()}

    def _step(self, samples: list[Sample]) -> dict[str, float]:
        denominator = max(all_reduce_scalar(global_loss_denominators(samples, self.cfg.loss_agg_mode,
                                                                     self.max_response_length)), 1.0)
        per_micro = []

        def micro_loss(item: tuple[list[Sample], PackedBatch]) -> torch.Tensor:
            part, batch = item
            values_T = self.values_of(batch)
            loss, m = value_loss(values_T, batch.values_T, batch.returns_T, batch.loss_mask_T, batch.cu_seqlens,
                                 self.cfg, denominator)
            if part and holds_head():
                per_micro.append(m)
            return loss * dp_size()

        run_passes(self.packed_micro_batches(samples), micro_loss)
        per_micro = last_stage_value(per_micro)  # (under pipeline parallelism only the last stage's are real)
        grad_norm = clip_and_step(self.model, self.optimizer, self.cfg.grad_clip)
        return {**global_metrics(reduce_metrics(per_micro) if per_micro else {}), "grad_norm": grad_norm}
