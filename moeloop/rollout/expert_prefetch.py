"""Speculative expert prefetch for the one-token decode (B=1): experimental, off by default, not yet measured on a
GPU (BENCHMARKS.md, session 18).

At B=1 a layer's gate_up kernel cannot read a weight before the router's logits exist, while the attention hops
before it (q/k norm + RoPE, paged decode, merge, o_proj, router) leave HBM idle. Here the layer's q|k|v launch also
computes router logits from the layer's *input* (`spec_router_rows`, stored after q|k|v in the `QKVPack`), and
extra programs of the q/k norm + RoPE launch (`prefetch_experts`) prefetch into L2 the weights of the S experts
those logits rank first. The residual stream moves little across one attention block, so the guess mostly holds
(`benchmarks/expert_prediction.py`); a wrong one costs only idle bandwidth, never an output.

    MOELOOP_EXPERT_PREFETCH=S          experts prefetched per layer (0: off)
    MOELOOP_EXPERT_PREFETCH_DOWN=on    their down rows too, not only gate_up

Shapes: E experts, D model dim; addresses and strides in bytes.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from moeloop.model.kernel_switch import triton_interpreting
from moeloop.model.moe import MoE
from moeloop.rollout.decode_kernel import triton
from moeloop.rollout.moe_kernel import routed_experts_apply

if TYPE_CHECKING:
    from moeloop.rollout.fused_decode import QKVPack

EXPERT_PREFETCH = int(os.environ.get("MOELOOP_EXPERT_PREFETCH", "0"))
EXPERT_PREFETCH_DOWN = os.environ.get("MOELOOP_EXPERT_PREFETCH_DOWN", "off").lower() == "on"
PREFETCH_CHUNK = 16384  # bytes per bulk prefetch
PREFETCH_LANES = 32  # chunks per prefetch program (one warp)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _prefetch_lanes(spec_ptr, j, E: tl.constexpr, E_PAD: tl.constexpr, S: tl.constexpr, CHUNKS: tl.constexpr,
                        LANES: tl.constexpr):
        """Prefetch program j's LANES chunks: (expert, chunk within the expert, in use) per lane. The chunks are
        numbered rank-major over the S experts ranked first by the speculative logits spec [E] (logit descending,
        expert id ascending), CHUNKS per expert; program j owns numbers j * LANES + lane."""
        e = tl.arange(0, E_PAD)
        z = tl.load(spec_ptr + e, mask=e < E, other=float("-inf")).to(tl.float32)
        ahead = tl.sum(((z[None, :] > z[:, None]) | ((z[None, :] == z[:, None]) & (e[None, :] < e[:, None])))
                       .to(tl.int32), 1)  # per expert: those ranked before it
        flat = j * LANES + tl.arange(0, LANES)
        rank = flat // CHUNKS
        expert = tl.sum(tl.where(ahead[None, :] == rank[:, None], e[None, :], 0), 1)
        # (a NaN logit can tie ranks and sum two ids: clamped, so every address stays inside the weights)
        return tl.minimum(expert, E - 1), flat % CHUNKS, rank < S

    @triton.jit
    def prefetch_experts(spec_ptr, gu_addr, s_gu, d_addr, s_d, j, E: tl.constexpr, E_PAD: tl.constexpr,
                         S: tl.constexpr, GU_CHUNKS: tl.constexpr, D_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
                         LANES: tl.constexpr):
        """L2 prefetches (`cp.async.bulk.prefetch.L2`, CHUNK bytes each) of program j's share of the speculated
        experts' weights: an expert's gate_up rows in GU_CHUNKS chunks from gu_addr + expert * s_gu, then (D_CHUNKS
        > 0) its down rows from d_addr + expert * s_d. Compiled only (inline PTX, sm_90 and later)."""
        expert, c, ok = _prefetch_lanes(spec_ptr, j, E, E_PAD, S, GU_CHUNKS + D_CHUNKS, LANES)
        expert = expert.to(tl.int64)
        addr = tl.where(c < GU_CHUNKS, gu_addr + expert * s_gu + c.to(tl.int64) * CHUNK,
                        d_addr + expert * s_d + (c - GU_CHUNKS).to(tl.int64) * CHUNK)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [addr, tl.full([LANES], CHUNK, tl.int32), ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
            pack=1)


def spec_router_rows(router_w: torch.Tensor, in_norm_w: torch.Tensor, post_norm_w: torch.Tensor) -> torch.Tensor:
    """Router rows [E, D] that, applied to the layer's input after its input norm (w_in * n(x)), give the router's
    logits of the post-attention norm of that same input (w_post * n(x)): W_r * w_post / w_in by column (0 where
    w_in is 0), computed in fp32."""
    w_in, w_post = in_norm_w.float(), post_norm_w.float()
    scale = torch.where(w_in != 0, w_post / torch.where(w_in != 0, w_in, 1.0), 0.0)
    return (router_w.float() * scale[None, :]).to(router_w.dtype)


def spec_sources(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """(router, input norm, post-attention norm) whose `spec_router_rows` the layer's `QKVPack` holds when the
    prefetch is on and the layer's MoE has a softmax router; else None."""
    mlp = layer.mlp
    if EXPERT_PREFETCH > 0 and isinstance(mlp, MoE) and mlp.gate.scoring_func == "softmax":
        return mlp.gate, layer.input_layernorm, layer.post_attention_layernorm
    return None


def pack_for(layer: nn.Module, x_TD: torch.Tensor) -> QKVPack | None:
    """The layer's `QKVPack` with speculative router rows when its decode of x prefetches experts: one token,
    compiled on a CUDA device of compute capability 9 or more (bulk prefetch), every expert's gate_up and down
    rows whole chunks apart, the routed expert kernels taking the layer."""
    pack = layer.self_attn.__dict__.get("_decode_qkv")
    if pack is None or pack.spec is None or x_TD.shape[0] != 1 or not x_TD.is_cuda or triton_interpreting():
        return None
    experts = layer.mlp.experts
    gu, down = experts.gate_up_proj, experts.down_proj
    whole = all(w.is_contiguous() and w.data_ptr() % 16 == 0 and (w.stride(0) * w.element_size()) % PREFETCH_CHUNK == 0
                for w in (gu, down))
    if not (whole and _bulk_prefetch_device(x_TD.device) and routed_experts_apply(x_TD, layer.mlp)):
        return None
    return pack


_BULK_PREFETCH: dict[torch.device, bool] = {}


def _bulk_prefetch_device(device: torch.device) -> bool:
    """`cp.async.bulk.prefetch.L2` needs compute capability 9 or more (looked up once per device)."""
    if device not in _BULK_PREFETCH:
        _BULK_PREFETCH[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _BULK_PREFETCH[device]


def prefetch_launch(spec_TE: torch.Tensor, experts: nn.Module, programs: int) -> tuple[int, dict]:
    """(programs, keywords) of a `fused_decode._qk_norm_rope_store` launch whose programs from `programs` on
    prefetch the experts that the speculative logits spec_TE [1, E] rank first."""
    gu, down = experts.gate_up_proj, experts.down_proj
    E, S = spec_TE.shape[1], min(EXPERT_PREFETCH, spec_TE.shape[1])
    gu_chunks = gu.stride(0) * gu.element_size() // PREFETCH_CHUNK
    d_chunks = down.stride(0) * down.element_size() // PREFETCH_CHUNK if EXPERT_PREFETCH_DOWN else 0
    extra = dict(spec_ptr=spec_TE, gu_addr=gu.data_ptr(), s_gu=gu.stride(0) * gu.element_size(),
                 d_addr=down.data_ptr(), s_d=down.stride(0) * down.element_size(), E=E,
                 E_PAD=triton.next_power_of_2(E), S=S, GU_CHUNKS=gu_chunks, D_CHUNKS=d_chunks, CHUNK=PREFETCH_CHUNK,
                 LANES=PREFETCH_LANES)
    return programs + triton.cdiv(S * (gu_chunks + d_chunks), PREFETCH_LANES), extra
