"""`RotaryEmbedding.table`: the decode's cached cos/sin by position hold, row for row, the bits `tables` computes for
those positions (the fused decode indexes it instead of recomputing), and grow in powers of two."""
from types import SimpleNamespace

import torch

from moeloop.model.rope import RotaryEmbedding


def test_table_rows_equal_the_per_position_tables():
    cfg = SimpleNamespace(rope_dim=128, rope_theta=1e6, rope_scaling={}, model_type="qwen3_moe", hf_config={})
    rotary = RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 2, 900, 3, 1999, 37])
    for dtype in (torch.bfloat16, torch.float32):
        table = rotary.table(1000, dtype, torch.device("cpu"))
        assert table.cos_TR.shape == (1024, 128) and rotary.table(600, dtype, torch.device("cpu")) is table
        grown = rotary.table(2000, dtype, torch.device("cpu"))  # longer contexts: rebuilt once, 2048 rows
        assert grown.cos_TR.shape[0] == 2048 and rotary.table(1000, dtype, torch.device("cpu")) is grown
        want = rotary.tables(pos, dtype)
        assert torch.equal(grown.cos_TR[pos], want.cos_TR) and torch.equal(grown.sin_TR[pos], want.sin_TR)
