"""PackedAttention's batched (right-padded) path equals its per-sequence path, values and gradients,
with GQA and with a value head dim different from the query/key one (MLA)."""
import pytest
import torch

from moeloop.model.attention import PackedAttention, cu_seqlens_from_lengths


@pytest.mark.parametrize("heads,kv_heads,dk,dv", [(4, 2, 8, 8), (4, 4, 12, 8)])
def test_batched_equals_per_sequence(heads, kv_heads, dk, dv):
    lengths = [5, 9, 3, 7]
    T = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, d, generator=g, requires_grad=True)
               for h, d in ((heads, dk), (kv_heads, dk), (kv_heads, dv)))
    results = []
    for factor in (100.0, 0.0):  # 100: batched; 0: one call per sequence
        ctx = PackedAttention(cu_seqlens_from_lengths(lengths))
        ctx.batched = ctx.batched if factor else False
        assert ctx.batched == (factor > 0)
        out = ctx.attend(0, q, k, v, scale=0.3)
        grads = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out).sin()).sum(), (q, k, v))
        results.append((out, grads))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_very_uneven_lengths_fall_back_to_per_sequence():
    ctx = PackedAttention(cu_seqlens_from_lengths([100, 1, 1, 1]))
    assert not ctx.batched
