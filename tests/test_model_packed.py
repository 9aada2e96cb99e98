"""Packed variable-length forward == each sequence run alone (positions restart, no cross-sequence attention),
and the forward's input checks. Tolerance: max rel err 1e-5 (different matmul shapes, fp32)."""
import pytest
import torch

from moeloop.model import PackedAttention, cu_seqlens_from_lengths
from tests.model_pairs import hf_model, max_rel_err, our_model

LENGTHS = [5, 9, 3]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "llama"])
def test_packed_forward_equals_per_sequence(arch):
    model = our_model(hf_model(arch))
    ids = torch.randint(0, model.cfg.vocab_size, (sum(LENGTHS),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = model.forward_packed(ids, LENGTHS)
        alone = torch.cat([model.forward_packed(seq, [len(seq)]) for seq in ids.split(LENGTHS)])
    assert max_rel_err(packed, alone) < 1e-5


def test_forward_uses_the_given_positions_and_context():
    model = our_model(hf_model("qwen3_moe"))
    ids = torch.randint(0, model.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(0))
    attn = PackedAttention(cu_seqlens_from_lengths([8]))
    with torch.no_grad():
        base = model(ids, torch.arange(8), attn)
        shifted = model(ids, torch.arange(8) + 5, attn)  # RoPE is relative: same scores
        moved = model(ids, torch.tensor([0, 1, 2, 3, 9, 5, 6, 7]), attn)
        assert max_rel_err(model.forward_packed(ids, [8]), base) == 0.0
    assert max_rel_err(shifted, base) < 1e-5
    assert max_rel_err(moved[:4], base[:4]) < 1e-6 and max_rel_err(moved[4:], base[4:]) > 1e-3


def test_bad_inputs_raise():
    model = our_model(hf_model("qwen3_moe"))
    with pytest.raises(ValueError, match="sum\\(lengths\\)"):
        model.forward_packed(torch.zeros(6, dtype=torch.long), [2, 3])
    with pytest.raises(ValueError, match="flat input_ids"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), None)
