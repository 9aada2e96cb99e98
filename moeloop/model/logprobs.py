"""Memory-lean token logprobs and entropy from hidden states (the "fused CE" of seed 002).

`token_logprobs` never holds a full [T, V] logits tensor: it walks the tokens in chunks of
`chunk_tokens`, keeps only per-token scalars (logsumexp, entropy), and recomputes each chunk's logits
in backward. Peak extra memory is about chunk_tokens * V * 4 bytes * 3 instead of T * V * 4 * 3+.
Math is fp32 inside every chunk whatever the input dtype. On CUDA, bf16/fp16 hidden states and weights go
into the logits GEMM as they are, with fp32 accumulation and fp32 output (`mm(..., out_dtype=float32)`): the
same products as upcasting both first (every bf16 value is exact in fp32) at tensor-core speed, and no fp32
copy of the [V, D] weight. The backward's two GEMMs take dlogits rounded to that dtype (what every bf16
trainer's logits gradient is), accumulating in fp32. On CUDA the per-chunk softmax statistics and dlogits are
Triton kernels (`logprob_kernels`): two reads of the chunk's logits forward, one backward.

Shapes: T tokens, D model dim, V vocab, C tokens in a chunk.
"""
from __future__ import annotations

import torch

from moeloop.model.kernel_switch import kernels_apply
from moeloop.model.logprob_kernels import chunk_dlogits, chunk_stats

IGNORE_INDEX = -100  # labels < 0 give logprob 0, entropy still computed, and no logprob gradient


def token_logprobs(hidden_TD: torch.Tensor, lm_head_weight_VD: torch.Tensor, labels_T: torch.Tensor,
                   temperature: float = 1.0, chunk_tokens: int = 1024,
                   with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (logprobs_T, entropy_T) in fp32 for logits = hidden @ W.T / temperature.

    logprobs_T[t] = log_softmax(logits_t)[labels_T[t]] (0 where labels_T[t] < 0);
    entropy_T[t] = -sum_v p_tv log p_tv, or None when `with_entropy` is False.
    Differentiable with respect to `hidden_TD` and `lm_head_weight_VD`.
    """
    if hidden_TD.dim() != 2 or lm_head_weight_VD.dim() != 2:
        raise ValueError(f"expected hidden [T, D] and weight [V, D], got {tuple(hidden_TD.shape)} "
                         f"and {tuple(lm_head_weight_VD.shape)}")
    if hidden_TD.shape[1] != lm_head_weight_VD.shape[1]:
        raise ValueError(f"hidden dim {hidden_TD.shape[1]} != lm_head weight dim {lm_head_weight_VD.shape[1]}")
    if labels_T.shape != hidden_TD.shape[:1]:
        raise ValueError(f"labels shape {tuple(labels_T.shape)} != tokens ({hidden_TD.shape[0]},)")
    if chunk_tokens < 1 or temperature <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 and temperature={temperature} > 0")
    logprobs_T, entropy_T = _ChunkedLogprobs.apply(hidden_TD, lm_head_weight_VD, labels_T, float(temperature),
                                                   int(chunk_tokens), bool(with_entropy))
    return logprobs_T, (entropy_T if with_entropy else None)


def naive_token_logprobs(hidden_TD: torch.Tensor, lm_head_weight_VD: torch.Tensor, labels_T: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full fp32 [T, V] logits, log_softmax, gather. Same conventions as `token_logprobs`."""
    logits_TV = (hidden_TD.float() @ lm_head_weight_VD.float().T) / temperature
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    valid_T = labels_T >= 0
    picked_T = logp_TV.gather(1, labels_T.clamp(min=0).long()[:, None])[:, 0]
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return torch.where(valid_T, picked_T, torch.zeros_like(picked_T)), entropy_T


def _low_precision_gemm(h_CD: torch.Tensor, w_VD: torch.Tensor) -> bool:
    """Whether the GEMMs run in the inputs' 16-bit dtype with fp32 accumulation (CUDA), not upcast to fp32."""
    return h_CD.is_cuda and h_CD.dtype in (torch.bfloat16, torch.float16) and w_VD.dtype == h_CD.dtype


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a @ b: 16-bit CUDA inputs as they are (fp32 accumulate and output), anything else upcast."""
    if _low_precision_gemm(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _chunk_stats(h_CD: torch.Tensor, w_VD: torch.Tensor, labels_C: torch.Tensor, inv_temp: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (logits, logsumexp, logprob of label, entropy) for one chunk."""
    z_CV = _mm_f32(h_CD, w_VD.T).mul_(inv_temp)
    lse_C = torch.logsumexp(z_CV, dim=-1)
    picked_C = z_CV.gather(1, labels_C.clamp(min=0)[:, None])[:, 0] - lse_C
    picked_C = torch.where(labels_C >= 0, picked_C, torch.zeros_like(picked_C))
    if with_entropy:  # -sum p log p, not lse - E_p[z]: that cancels badly when lse is large
        logp_CV = z_CV - lse_C[:, None]
        entropy_C = logp_CV.exp().mul_(logp_CV).sum(-1).neg_()
    else:
        entropy_C = torch.zeros_like(lse_C)
    return z_CV, lse_C, picked_C, entropy_C


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, labels_T, temperature, chunk_tokens, with_entropy):
        w_VD = weight_VD if _low_precision_gemm(hidden_TD, weight_VD) else weight_VD.float()
        labels_T = labels_T.long()
        num_tokens = hidden_TD.shape[0]
        logprobs_T = hidden_TD.new_empty(num_tokens, dtype=torch.float32)
        entropy_T = torch.zeros_like(logprobs_T)
        lse_T = torch.empty_like(logprobs_T)
        kernels = kernels_apply(hidden_TD)
        for s in range(0, num_tokens, chunk_tokens):
            e = min(s + chunk_tokens, num_tokens)
            if kernels:
                chunk_stats(_mm_f32(hidden_TD[s:e], w_VD.T), labels_T[s:e], 1.0 / temperature, with_entropy,
                            lse_T[s:e], logprobs_T[s:e], entropy_T[s:e])
                continue
            _, lse_T[s:e], logprobs_T[s:e], entropy_T[s:e] = _chunk_stats(
                hidden_TD[s:e], w_VD, labels_T[s:e], 1.0 / temperature, with_entropy)
        ctx.save_for_backward(hidden_TD, weight_VD, labels_T, lse_T, entropy_T)
        ctx.temperature, ctx.chunk_tokens, ctx.with_entropy = temperature, chunk_tokens, with_entropy
        return logprobs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprobs_T, grad_entropy_T):
        hidden_TD, weight_VD, labels_T, lse_T, entropy_T = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        inv_temp = 1.0 / ctx.temperature
        low = _low_precision_gemm(hidden_TD, weight_VD)
        w_VD = weight_VD if low else weight_VD.float()
        grad_h_TD = torch.empty_like(hidden_TD) if need_h else None
        grad_w_VD = torch.zeros_like(weight_VD, dtype=torch.float32) if need_w else None
        if grad_logprobs_T is None:
            grad_logprobs_T = torch.zeros_like(lse_T)
        use_entropy = ctx.with_entropy and grad_entropy_T is not None
        kernels = kernels_apply(hidden_TD)
        num_tokens = hidden_TD.shape[0]
        for s in range(0, num_tokens, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, num_tokens)
            h_CD, labels_C = (hidden_TD[s:e] if low else hidden_TD[s:e].float()), labels_T[s:e]
            g_ent_C = grad_entropy_T[s:e] if use_entropy else None
            if kernels:
                dz_CV = chunk_dlogits(_mm_f32(h_CD, w_VD.T), labels_C, grad_logprobs_T[s:e], g_ent_C, lse_T[s:e],
                                      entropy_T[s:e], inv_temp, h_CD.dtype)
            else:
                logp_CV = _mm_f32(h_CD, w_VD.T).mul_(inv_temp).sub_(lse_T[s:e, None])
                dz_CV = _dlogits(logp_CV, labels_C, grad_logprobs_T[s:e], g_ent_C, entropy_T[s:e])
                dz_CV = dz_CV.mul_(inv_temp).to(h_CD.dtype)
            if need_h:
                grad_h_TD[s:e] = (dz_CV @ w_VD).to(hidden_TD.dtype)
            if need_w:
                if low:
                    grad_w_VD.add_(torch.mm(dz_CV.T, h_CD, out_dtype=torch.float32))
                else:
                    grad_w_VD.addmm_(dz_CV.T, h_CD)
        if need_w:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        return grad_h_TD, grad_w_VD, None, None, None, None


def _dlogits(logp_CV: torch.Tensor, labels_C: torch.Tensor, g_lp_C: torch.Tensor, g_ent_C: torch.Tensor | None,
             entropy_C: torch.Tensor) -> torch.Tensor:
    """d(loss)/dz for one chunk from log-probabilities (overwritten in place).

    d logp[y]/dz = onehot(y) - p;  dH/dz = -p * (z - E_p[z]) = -p * (log p + H)  (since E_p[z] = lse - H).
    """
    g_lp_C = torch.where(labels_C >= 0, g_lp_C.float(), torch.zeros((), dtype=torch.float32, device=g_lp_C.device))
    p_CV = logp_CV.exp()
    if g_ent_C is None:
        dz_CV = p_CV.mul_(-g_lp_C[:, None])
    else:
        coef_CV = logp_CV.add_(entropy_C[:, None]).mul_(-g_ent_C.float()[:, None]).sub_(g_lp_C[:, None])
        dz_CV = p_CV.mul_(coef_CV)
    dz_CV[torch.arange(len(labels_C), device=dz_CV.device), labels_C.clamp(min=0)] += g_lp_C
    return dz_CV
