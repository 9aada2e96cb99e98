"""Full-vocab Gumbel-max sampling in one Triton kernel (plus a reduction over its splits): the sampler's
no-filter path on CUDA.

The torch path builds the [B, V] noise in int64 (about 25 elementwise kernels over 8 bytes per entry), takes two
logs, divides, adds and reduces: some 30 kernels and ~2 GB of memory traffic at B=128, V=32000. Here SPLITS
programs per row stream its logits once, each keeping a running argmax over its vocab slice, and an argmax over
the slices' maxima picks the token (two small torch ops). Same bits as the torch path: the `_mix32` hash in
uint32 (products wrap mod 2**32, the low 32 bits the torch path keeps), the exact 24-bit uniform, libdevice
logf (what torch's CUDA log calls), IEEE division, and the first index among equal maxima (torch.argmax's rule).
`topk_gumbel_argmax` is the top-k path's draw among each row's candidates (torch.topk's values and ids): the
same scores by vocab id, so the same token as the full-vocab draw restricted to the kept candidates.
Shapes: B rows, V vocab, N candidates.
"""
from __future__ import annotations

import torch

from moeloop.rollout.decode_kernel import triton, triton_interpreting

SPLITS = 8  # programs per row: one per row left most SMs idle at B <= 128 (~34 us for B=128, V=32000 on the H200)

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _mix32(x):
        """lowbias32 on uint32 (the sampler's `_mix32`)."""
        x = x ^ (x >> 16)
        x = x * tl.full([1], 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full([1], 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _gumbel_score(z, v, key, temp, LIBDEVICE: tl.constexpr):
        """z / T - log(-log(u(key, v))) in fp32 for logits z at vocab ids v (the torch path's bits)."""
        h = _mix32(_mix32(key ^ v.to(tl.uint32)) ^ key)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        if LIBDEVICE:
            gumbel = -libdevice.log(-libdevice.log(u))
        else:
            gumbel = -tl.log(-tl.log(u))
        return tl.math.div_rn(z, temp) + gumbel

    @triton.jit
    def _topk_gumbel(vals_ptr, ids_ptr, keys_ptr, temps_ptr, top_ks_ptr, drop_ptr, out_ptr, N,
                     BLOCK_N: tl.constexpr, HAS_DROP: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Program b: among row b's N candidates (descending values, their vocab ids), those of rank < top_k
        (rank 0 always) and not dropped (top-p), the id with the max Gumbel score; the first rank among equal
        maxima, as torch.argmax over the candidate row picks."""
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK_N)
        ok = r < N
        z = tl.load(vals_ptr + b * N + r, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(ids_ptr + b * N + r, mask=ok, other=0)
        keep = ok & (r < tl.load(top_ks_ptr + b))
        if HAS_DROP:
            keep = keep & (tl.load(drop_ptr + b * N + r, mask=ok, other=1) == 0)
        keep = keep | (r == 0)
        key = tl.load(keys_ptr + b).to(tl.uint32)
        temp = tl.load(temps_ptr + b)
        temp = tl.where(temp > 0, temp, 1.0)
        score = tl.where(keep, _gumbel_score(z, v, key, temp, LIBDEVICE), float("-inf"))
        top = tl.max(score, 0)
        first = tl.min(tl.where(score == top, r, BLOCK_N), 0)
        tl.store(out_ptr + b, tl.sum(tl.where(r == first, v, 0), 0))

    @triton.jit
    def _gumbel_argmax(logits_ptr, keys_ptr, temps_ptr, score_ptr, idx_ptr, s_lb, V: tl.constexpr,
                       SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Program (b, s): over vocab ids [s * SPLIT_V, (s + 1) * SPLIT_V) of row b, the max and its first id of
        logits[b, v] / T_b - log(-log(u(key_b, v))), T_b = 1 for a greedy (T = 0) row, into score/idx [B, S].
        LIBDEVICE: logf from libdevice (compiled; the interpreter has no libdevice and uses numpy's log)."""
        b = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        key = tl.load(keys_ptr + b).to(tl.uint32)
        temp = tl.load(temps_ptr + b)
        temp = tl.where(temp > 0, temp, 1.0)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_v = tl.zeros([BLOCK_V], tl.int32)
        for v0 in range(0, SPLIT_V, BLOCK_V):
            v = split * SPLIT_V + v0 + tl.arange(0, BLOCK_V)
            ok = v < V
            z = tl.load(logits_ptr + b * s_lb + v, mask=ok, other=0.0).to(tl.float32)
            score = tl.where(ok, _gumbel_score(z, v, key, temp, LIBDEVICE), float("-inf"))
            better = score > best  # strict: within a lane the earlier vocab id keeps a tie
            best_v = tl.where(better, v, best_v)
            best = tl.where(better, score, best)
        top = tl.max(best, 0)
        n_splits = tl.num_programs(1)
        tl.store(score_ptr + b * n_splits + split, top)
        tl.store(idx_ptr + b * n_splits + split, tl.min(tl.where(best == top, best_v, 2147483647), 0).to(tl.int64))


def gumbel_argmax(logits_BV: torch.Tensor, keys_B: torch.Tensor, temperatures_B: torch.Tensor) -> torch.Tensor:
    """Sampled token ids [B] (int64) of the no-filter Gumbel-max draw; the same as the torch path's."""
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    B, V = logits_BV.shape
    if not B:
        return torch.empty(0, dtype=torch.int64, device=logits_BV.device)
    block_v = 1024
    split_v = block_v * max(1, triton.cdiv(V, block_v * SPLITS))
    num_splits = triton.cdiv(V, split_v)
    score_BS = torch.empty(B, num_splits, dtype=torch.float32, device=logits_BV.device)
    idx_BS = torch.empty(B, num_splits, dtype=torch.int64, device=logits_BV.device)
    _gumbel_argmax[(B, num_splits)](logits_BV, keys_B.contiguous(), temperatures_B.float().contiguous(), score_BS,
                                    idx_BS, logits_BV.stride(0), V=V, SPLIT_V=split_v, BLOCK_V=block_v,
                                    LIBDEVICE=not triton_interpreting(), num_warps=4)
    # the first split holding the row's max: its ids are the smallest among equal maxima, as torch.argmax picks
    return idx_BS.gather(1, score_BS.argmax(1, keepdim=True))[:, 0]


def topk_gumbel_argmax(vals_BN: torch.Tensor, ids_BN: torch.Tensor, keys_B: torch.Tensor, temperatures_B: torch.Tensor,
                       top_ks_B: torch.Tensor, drop_BN: torch.Tensor | None = None) -> torch.Tensor:
    """Sampled token ids [B] (int64) among each row's candidates (`Sampler`'s top-k path, one program per row):
    `vals_BN`/`ids_BN` from torch.topk, `drop_BN` the top-p mask (None: no top-p)."""
    B, N = vals_BN.shape
    out_B = torch.empty(B, dtype=torch.int64, device=vals_BN.device)
    if B:
        vals_BN, ids_BN = vals_BN.contiguous(), ids_BN.contiguous()  # any float dtype: widened on load
        drop = drop_BN.to(torch.int8).contiguous() if drop_BN is not None else vals_BN  # unread without HAS_DROP
        _topk_gumbel[(B,)](vals_BN, ids_BN, keys_B.contiguous(), temperatures_B.float().contiguous(),
                           top_ks_B.contiguous(), drop, out_B, N, BLOCK_N=max(16, triton.next_power_of_2(N)),
                           HAS_DROP=drop_BN is not None, LIBDEVICE=not triton_interpreting(), num_warps=4)
    return out_B
