"""Paged attention context: mixed prefill/decode streams over scattered blocks equal dense causal attention;
the Triton decode kernel (CUDA, or CPU under TRITON_INTERPRET=1 when triton is installed) equals the gather path."""
import os
import random

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from moeloop.model.config import ModelConfig  # noqa: E402
from moeloop.rollout.decode_kernel import paged_decode_attention, triton_available  # noqa: E402
from moeloop.rollout.kv_cache import KVCache  # noqa: E402
from moeloop.rollout.paged_attention import AttentionMetadata, PagedAttention, PrefillChunk, slots_of  # noqa: E402

H, G, DK, DV, BS = 4, 2, 16, 8, 4  # Dk != Dv as in MLA


def cache(num_blocks=40):
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=8, hidden_size=8, num_layers=1, num_heads=H, num_kv_heads=G,
                      head_dim=DK, intermediate_size=8, kv_lora_rank=1, qk_nope_head_dim=DK - 4, qk_rope_head_dim=4,
                      v_head_dim=DV)
    return KVCache(cfg, num_blocks, BS, torch.float32, "cpu")


def dense_reference(q, k, v, scale):
    """Causal attention of the last q rows of one sequence over all its k/v."""
    L, n = k.shape[0], q.shape[0]
    mask = torch.arange(L)[None] <= (L - n + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                          scale=scale, enable_gqa=True).transpose(0, 1)


# (context length, new tokens this step): decode rows, prefills with a cached prefix, a fresh prefill
MIXED = {"one cached chunk": [(9, 1), (3, 1), (13, 5), (6, 6), (17, 1)],
         "cached chunks batched": [(9, 1), (13, 5), (6, 6), (20, 3), (17, 1), (11, 4), (5, 2)],
         "cached chunks too far apart to pad": [(9, 1), (13, 5), (70, 2), (9, 4), (6, 6), (17, 1)]}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_stream_over_scattered_blocks_matches_dense(case):
    """Every row's attention equals a dense causal attention over its whole sequence; chunks that continue a cached
    prefix run as one padded SDPA (`CachedPrefills`) when there are several of similar size, else one each."""
    torch.manual_seed(0)
    kv = cache()
    free = list(range(kv.num_blocks))
    random.Random(0).shuffle(free)
    seqs = MIXED[case]
    full = [(torch.randn(L, H, DK), torch.randn(L, G, DK), torch.randn(L, G, DV)) for L, _ in seqs]
    tables = [[free.pop() for _ in range(-(-L // BS))] for L, _ in seqs]
    for (L, n), (q, k, v), table in zip(seqs, full, tables):  # earlier steps wrote the cached prefix
        old = slots_of(torch.tensor(table), torch.arange(L - n), BS)
        kv.k[0][old], kv.v[0][old] = k[:L - n], v[:L - n]
    slots, decode_rows, prefills, start = [], [], [], 0
    for (L, n), table in zip(seqs, tables):
        new = slots_of(torch.tensor(table), torch.arange(L - n, L), BS)
        slots.append(new)
        if n == 1:
            decode_rows.append(start)
        else:
            prefills.append(PrefillChunk(start, n, L, None if L == n else table))
        start += n
    dec = [i for i, (L, n) in enumerate(seqs) if n == 1]
    width = max(len(tables[i]) for i in dec)
    meta = AttentionMetadata(torch.cat(slots), torch.tensor(decode_rows),
                             torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in dec], dtype=torch.int32),
                             torch.tensor([seqs[i][0] for i in dec], dtype=torch.int32), max(seqs[i][0] for i in dec),
                             prefills)
    q = torch.cat([f[0][L - n:] for (L, n), f in zip(seqs, full)])
    k = torch.cat([f[1][L - n:] for (L, n), f in zip(seqs, full)])
    v = torch.cat([f[2][L - n:] for (L, n), f in zip(seqs, full)])
    attention = PagedAttention(kv, meta)
    assert (attention._cached is not None) == (case == "cached chunks batched")
    out = attention.attend(0, q, k, v, 0.3)
    ref = torch.cat([dense_reference(f[0][L - n:], f[1], f[2], 0.3) for (L, n), f in zip(seqs, full)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (CPU torch wheel)")
def test_triton_decode_kernel_matches_gather_path():
    torch.manual_seed(1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kv = cache(num_blocks=64)
    kv.k.normal_(), kv.v.normal_()
    lens = torch.tensor([1, 5, 37, 70, 16], dtype=torch.int32)
    perm = torch.randperm(64)
    tables = torch.zeros(5, 18, dtype=torch.int32)
    used = 0
    for b, L in enumerate(lens.tolist()):
        nb = -(-L // BS)
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
    q = torch.randn(5, H, DK)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), None, tables, lens, int(lens.max()), [])
    ref = PagedAttention(kv, meta)._decode(q, kv.k[0], kv.v[0], 0.25)
    out = paged_decode_attention(q.to(dev), kv.k[0].to(dev), kv.v[0].to(dev), tables.to(dev), lens.to(dev), BS, 0.25,
                                 block_n=16)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    # one row (len 70): its context split over programs, then merged
    from moeloop.rollout import decode_kernel
    for v_early in (True, False):  # V read with K, or after the scores
        decode_kernel.V_EARLY = v_early
        try:
            one = paged_decode_attention(q[3:4].to(dev), kv.k[0].to(dev), kv.v[0].to(dev), tables[3:4].to(dev),
                                         lens[3:4].to(dev), BS, 0.25, block_n=16)
        finally:
            decode_kernel.V_EARLY = True
        torch.testing.assert_close(one.cpu(), ref[3:4], atol=1e-4, rtol=1e-4)
    assert decode_kernel.num_splits(torch.device(dev), G, tables.shape[1] * BS, 16) > 1


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (CPU torch wheel)")
def test_one_row_runs_its_own_warps(monkeypatch):
    """One row launches the paged decode with PAGED_WARPS_ONE_ROW warps (8: measured at B=1 on the H200), more rows
    with PAGED_WARPS; the split merge runs MERGE_WARPS (1, measured); both equal the gather path."""
    from moeloop.rollout import decode_kernel
    from tests.kernels import recorded_grids
    warps = recorded_grids(monkeypatch, decode_kernel, ("_paged_decode", "_merge_splits"),
                           lambda name, grid, kw: (name, kw["num_warps"]))
    torch.manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kv = cache(num_blocks=24)
    kv.k.normal_(), kv.v.normal_()
    tables = torch.randperm(24)[:16].int().view(2, 8)  # 32 positions a row: two splits of 16
    for rows in (1, 2):
        lens = torch.tensor([30, 9][:rows], dtype=torch.int32)
        q = torch.randn(rows, H, DK)
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), None, tables[:rows], lens, int(lens.max()), [])
        ref = PagedAttention(kv, meta)._decode(q, kv.k[0], kv.v[0], 0.25)
        out = paged_decode_attention(q.to(dev), kv.k[0].to(dev), kv.v[0].to(dev), tables[:rows].to(dev), lens.to(dev),
                                     BS, 0.25, block_n=16)
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    assert warps == [("_paged_decode", 8), ("_merge_splits", 1), ("_paged_decode", 4), ("_merge_splits", 1)]
    assert (decode_kernel.PAGED_WARPS_ONE_ROW, decode_kernel.PAGED_WARPS, decode_kernel.MERGE_WARPS) == (8, 4, 1)
