"""Triton kernels for a chunk of the chunked logprob head (`moeloop.model.logprobs`), used on CUDA.

Per chunk of C tokens the torch ops make ~7 passes over the fp32 [C, V] logits forward (scale, logsumexp,
gather, log-probs, exp, product, sum) and ~9 backward. Here, after the same logits GEMM:
- `chunk_stats`: one program per token, an online logsumexp over the vocab, the label's logprob, and (second
  pass) the entropy -sum p log p: two reads of the row.
- `chunk_dlogits`: one program per token writes d(loss)/d(logits) straight in the GEMM input dtype: one read.
Same formulas as the torch path (`_dlogits`), summation order aside.
"""
# C tokens in the chunk, V vocab
from __future__ import annotations

import torch

from moeloop.model.kernel_switch import kernels_apply, triton

BLOCK_V = 1024

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _chunk_stats(z_ptr, labels_ptr, lse_ptr, picked_ptr, ent_ptr, inv_temp, V: tl.constexpr,
                     BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * V
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        for v0 in range(0, V, BLOCK_V):  # online logsumexp, one block at a time (block 0 always has entries)
            v = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(base + v, mask=v < V, other=float("-inf")) * inv_temp
            new_top = tl.maximum(top, tl.max(z, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(z - new_top), 0)
            top = new_top
        lse = top + tl.log(total)
        label = tl.load(labels_ptr + row)
        picked = tl.load(base + tl.maximum(label, 0)) * inv_temp - lse
        tl.store(lse_ptr + row, lse)
        tl.store(picked_ptr + row, tl.where(label >= 0, picked, 0.0))
        if WITH_ENTROPY:  # -sum p log p (not lse - E_p[z], which cancels when lse is large)
            acc = tl.zeros([BLOCK_V], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                v = v0 + tl.arange(0, BLOCK_V)
                ok = v < V
                logp = tl.load(base + v, mask=ok, other=0.0) * inv_temp - lse
                acc += tl.where(ok, tl.exp(logp) * logp, 0.0)
            tl.store(ent_ptr + row, -tl.sum(acc, 0))

    @triton.jit
    def _chunk_dlogits(z_ptr, dz_ptr, labels_ptr, g_lp_ptr, g_ent_ptr, lse_ptr, ent_ptr, inv_temp, V: tl.constexpr,
                       BLOCK_V: tl.constexpr, HAS_ENTROPY: tl.constexpr):
        """dz = (p * ((log p + H) * -g_ent - g_lp) + onehot(label) * g_lp) * inv_temp (without entropy: g_ent = 0)."""
        row = tl.program_id(0).to(tl.int64)
        label = tl.load(labels_ptr + row)
        g_lp = tl.where(label >= 0, tl.load(g_lp_ptr + row).to(tl.float32), 0.0)
        lse = tl.load(lse_ptr + row)
        if HAS_ENTROPY:
            g_ent = tl.load(g_ent_ptr + row).to(tl.float32)
            ent = tl.load(ent_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            ok = v < V
            logp = tl.load(z_ptr + row * V + v, mask=ok, other=0.0) * inv_temp - lse
            p = tl.exp(logp)
            if HAS_ENTROPY:
                dz = p * ((logp + ent) * -g_ent - g_lp)
            else:
                dz = p * -g_lp
            dz = tl.where(v == label, dz + g_lp, dz) * inv_temp
            tl.store(dz_ptr + row * V + v, dz.to(dz_ptr.dtype.element_ty), mask=ok)


def chunk_stats(z_CV: torch.Tensor, labels_C: torch.Tensor, inv_temp: float, with_entropy: bool,
                lse_C: torch.Tensor, picked_C: torch.Tensor, entropy_C: torch.Tensor) -> None:
    """Fill lse, the label logprob (0 for labels < 0) and the entropy (when asked) of fp32 logits z [C, V]."""
    C, V = z_CV.shape
    if C:
        _chunk_stats[(C,)](z_CV, labels_C, lse_C, picked_C, entropy_C, inv_temp, V=V, BLOCK_V=BLOCK_V,
                           WITH_ENTROPY=with_entropy, num_warps=4)


def chunk_dlogits(z_CV: torch.Tensor, labels_C: torch.Tensor, g_lp_C: torch.Tensor, g_ent_C: torch.Tensor | None,
                  lse_C: torch.Tensor, entropy_C: torch.Tensor, inv_temp: float, dtype: torch.dtype) -> torch.Tensor:
    """d(loss)/d(logits) [C, V] in `dtype` from the fp32 logits (before the temperature) and the saved stats."""
    C, V = z_CV.shape
    dz_CV = torch.empty(C, V, dtype=dtype, device=z_CV.device)
    if C:
        g_ent = g_ent_C if g_ent_C is not None else g_lp_C
        _chunk_dlogits[(C,)](z_CV, dz_CV, labels_C, g_lp_C.contiguous(), g_ent.contiguous(), lse_C, entropy_C,
                             inv_temp, V=V, BLOCK_V=BLOCK_V, HAS_ENTROPY=g_ent_C is not None, num_warps=4)
    return dz_CV
