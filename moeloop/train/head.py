"""`LogprobHead`: the lm_head as a module whose forward returns token logprobs and entropy.

It replaces `model.lm_head` (same Parameter, same FQN `lm_head.weight`), so the memory-lean
chunked kernel runs inside a module forward: under FSDP2 that is what unshards the weight and
reduce-scatters its gradient.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from moeloop.model.logprobs import token_logprobs


class LogprobHead(nn.Linear):
    chunk_tokens: int = 1024

    @classmethod
    def replace_in(cls, model: nn.Module, chunk_tokens: int) -> "LogprobHead":
        old: nn.Linear = model.lm_head
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.in_features, head.out_features = old.in_features, old.out_features
        head.weight = old.weight
        head.bias = None
        head.chunk_tokens = chunk_tokens
        model.lm_head = head
        return head

    def forward(self, hidden_TD: torch.Tensor, labels_T: torch.Tensor | None = None, temperature: float = 1.0,
                with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if labels_T is None:
            return F.linear(hidden_TD, self.weight)
        return token_logprobs(hidden_TD, self.weight, labels_T, temperature, self.chunk_tokens, with_entropy)
