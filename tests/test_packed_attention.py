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


def test_gather_rows_grad_equals_index_select_grad():
    """Rows read 1, 2 or 3 times, in any order: `gather_rows` gives index_select's values and gradients."""
    from moeloop.model.attention import RowMap, gather_rows
    gather = torch.tensor([2, 0, 1, 2, 0, 2, 3])  # row 2 three times, row 0 twice, 1 and 3 once
    owner = torch.tensor([4, 2, 5, 6])  # each row's primary reader: any one of its readers
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(len(gather), 3)
    got = torch.autograd.grad((gather_rows(x, RowMap.of_gather(gather, owner)) * w).sum(), x)[0]
    want = torch.autograd.grad((x.index_select(0, gather) * w).sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.equal(got, torch.autograd.grad((x[[0, 0, 1, 2, 2, 2, 3]] * w).sum(), x)[0])  # can fail


@pytest.mark.parametrize("batched", [True, False])
def test_gathered_attention_equals_packed_attention_on_copies(batched):
    """A group of 3 samples sharing a 4-token prompt, run once on the stream rows (GatheredAttention) vs on the
    full packed copies (PackedAttention per sequence): the same outputs at owner rows and the same gradients."""
    from moeloop.model.attention import GatheredAttention
    prompt, bodies = 4, [5, 3, 6]
    lengths = [prompt + b for b in bodies]
    gather, owner, start = [], list(range(prompt)), 0
    for b in bodies:
        gather += range(prompt)
        first = len(owner)
        owner += range(start + prompt, start + prompt + b)
        gather += range(first, first + b)
        start += prompt + b
    gather_T, owner_U = torch.tensor(gather), torch.tensor(owner)
    U, g = len(owner), torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(U, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(U, 4, 8, generator=g)
    ctx = GatheredAttention(cu_seqlens_from_lengths(lengths), gather_T, owner_U)
    ctx.packed.batched = batched
    out = ctx.attend(0, q, k, v, scale=0.3)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_ctx = PackedAttention(cu_seqlens_from_lengths(lengths))
    ref_ctx.batched = False
    ref = ref_ctx.attend(0, q[gather_T], k[gather_T], v[gather_T], scale=0.3)[owner_U]
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
