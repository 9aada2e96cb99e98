"""The benchmarks' engine: room for a whole batch at once, so no run is shaped by preemption."""
from __future__ import annotations

from torch import nn

from moeloop.config.schema import RolloutSection
from moeloop.rollout import Engine
from moeloop.rollout.kv_cache import kv_bytes_per_block


def sized_engine(model: nn.Module, batch: int, prompt_len: int, new_tokens: int, **rollout) -> Engine:
    """An engine for `batch` sequences of prompt_len + new_tokens tokens, all running together: 16-token blocks
    for every sequence plus 20% (and a few blocks) spare, the whole prompt batch in one prefill step.
    `rollout`: further `RolloutSection` fields."""
    total = prompt_len + new_tokens
    blocks = batch * -(-total // 16) + 8
    per_block = kv_bytes_per_block(model.cfg, 16, next(model.parameters()).dtype, rollout.get("record_routes", False))
    kv = int(1.2 * blocks * per_block)
    cfg = RolloutSection(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch * prompt_len), block_size=16,
                         kv_cache_bytes=kv, max_model_len=total, **rollout)
    return Engine(model, cfg, eos_token_ids=[])
