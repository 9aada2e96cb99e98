"""Moving rows between token order and expert-sorted order, with Triton kernels on CUDA.

`Experts.sorted_forward` gathers each token's row once per assignment into expert-sorted order and sums the
expert outputs back per token, weighted. In torch ops that is an advanced-index gather (whose backward is a
sort-based index_put), an inverse-permutation gather and an fp32 [T, K, D] product and sum. Here, with
`dest_TK[t, k]` = the sorted row of token t's k-th assignment (a permutation of 0..T*K-1):
- `gather_rows(x_TD, token_S, dest_TK)` = x_TD[token_S]; backward: grad_x[t] = sum_k grad[dest[t, k]], summed in
  fp32 and rounded once (one kernel, deterministic: no atomics).
- `combine_rows(y_SD, dest_TK, weights_TK)` = sum_k weights[t, k] * y[dest[t, k]] in fp32, rounded to y's dtype
  (the rounding points of `(y.float() * w).sum(1).to(dtype)`); backward in one kernel: grad_y[dest[t, k]] =
  (weights[t, k] * grad[t]) rounded, grad_weights[t, k] = <y[dest[t, k]], grad[t]> in fp32.
The kernels also serve the rollout engine's decode (`moeloop.rollout.moe_kernel`).
"""
# T tokens, D model dim, K experts per token, S = T*K sorted rows
from __future__ import annotations

import torch

from moeloop.model.kernel_switch import kernels_apply as row_kernels_apply, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _combine_rows(y_ptr, dest_ptr, wts_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr,
                      WEIGHTED: tl.constexpr):
        """out[t] = sum_k w[t, k] * y[dest[t, k]] (fp32, rounded to out's dtype); w = 1 without WEIGHTED."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for k in tl.static_range(K):
            row = tl.load(dest_ptr + t * K + k)
            y = tl.load(y_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
            acc += y * tl.load(wts_ptr + t * K + k) if WEIGHTED else y
        tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _combine_rows_backward(g_ptr, y_ptr, dest_ptr, wts_ptr, grad_y_ptr, grad_w_ptr, D: tl.constexpr,
                               K: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program t (the whole row): grad_y[dest[t, k]] = w[t, k] * g[t]; grad_w[t, k] = <y[dest[t, k]], g[t]>."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        g = tl.load(g_ptr + t * D + d, mask=ok, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            row = tl.load(dest_ptr + t * K + k)
            y = tl.load(y_ptr + row * D + d, mask=ok, other=0.0).to(tl.float32)
            tl.store(grad_w_ptr + t * K + k, tl.sum(y * g, 0))
            w = tl.load(wts_ptr + t * K + k)
            tl.store(grad_y_ptr + row * D + d, (g * w).to(grad_y_ptr.dtype.element_ty), mask=ok)


def combine(y_SD: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor | None, T: int) -> torch.Tensor:
    """The `_combine_rows` launch: [T, D] in y's dtype; unit weights when `weights_TK` is None."""
    D, K = y_SD.shape[1], dest_TK.shape[1]
    out_TD = y_SD.new_empty(T, D)
    if T == 0:
        return out_TD
    block_d = min(1024, triton.next_power_of_2(D))
    _combine_rows[(T, triton.cdiv(D, block_d))](y_SD, dest_TK, dest_TK if weights_TK is None else weights_TK, out_TD,
                                                D=D, K=K, BLOCK_D=block_d, WEIGHTED=weights_TK is not None,
                                                num_warps=4)
    return out_TD


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_S, dest_TK):
        ctx.save_for_backward(dest_TK)
        return x_TD.index_select(0, token_S)

    @staticmethod
    def backward(ctx, grad_SD):
        (dest_TK,) = ctx.saved_tensors
        return combine(grad_SD.contiguous(), dest_TK, None, dest_TK.shape[0]), None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_SD, dest_TK, weights_TK):
        ctx.save_for_backward(y_SD, dest_TK, weights_TK)
        return combine(y_SD, dest_TK, weights_TK, dest_TK.shape[0])

    @staticmethod
    def backward(ctx, grad_TD):
        y_SD, dest_TK, weights_TK = ctx.saved_tensors
        T, K = dest_TK.shape
        D = y_SD.shape[1]
        grad_y = torch.empty_like(y_SD)
        grad_w = torch.empty(T, K, dtype=torch.float32, device=y_SD.device)
        if T == 0:
            return grad_y, None, grad_w
        _combine_rows_backward[(T,)](grad_TD.contiguous(), y_SD, dest_TK, weights_TK, grad_y, grad_w, D=D, K=K,
                                     BLOCK_D=triton.next_power_of_2(D), num_warps=8)
        return grad_y, None, grad_w


def gather_rows(x_TD: torch.Tensor, token_S: torch.Tensor, dest_TK: torch.Tensor) -> torch.Tensor:
    """x_TD[token_S] (sorted rows); its backward sums each token's K row gradients in one kernel."""
    return _GatherRows.apply(x_TD, token_S, dest_TK)


def combine_rows(y_SD: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * y[dest[t, k]] per token, fp32 math, in y's dtype (weights: fp32 [T, K])."""
    return _CombineRows.apply(y_SD.contiguous(), dest_TK.contiguous(), weights_TK.float().contiguous())
