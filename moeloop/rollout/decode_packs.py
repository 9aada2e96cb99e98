"""Weights the engine's fused decode derives from a model's parameters and keeps beside them (`fused_decode`):
each attention layer's q|k|v weights packed into one buffer (`QKVPack`, for batches of several tokens), and each
MoE layer's router composed with the o_proj and the norm before it (`ComposedRouter`, for one token). Both are
refreshed in place when their sources change (`DerivedWeights`), so CUDA graphs keep their pointers.
Shapes: D model dim, A attention output width (heads x head dim), E experts.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from moeloop.model.moe import MoE
from moeloop.model.norm import RMSNorm

# B=1: the router composed into the o_proj launch (`ComposedRouter`, `fused_decode.o_proj_router`), the router's
# launch gone; MOELOOP_ROUTER_COMPOSE=off runs the router's own norm-folded launch. H200, reference model, B=1
# engine.step 2.926 ms per 8 steps against 3.017-3.019 (37.8-37.9% -> 38.9-39.2% of the roofline), and the
# engine-trainer logprob mismatch of a bf16 B=1 generation 1.28e-2 against 1.00e-2 (BENCHMARKS.md, session 22)
ROUTER_COMPOSE = os.environ.get("MOELOOP_ROUTER_COMPOSE", "on").lower() != "off"
ROW_MAX_D = 2048  # the widest weight row one decode program holds whole (`fused_decode.ROW_LINEAR_MAX_D`)


class DerivedWeights:
    """Weights derived from a model's parameters (a copy or a product) for the fused decode, refreshed in place
    (the CUDA graphs keep their pointers): `refresh()` recomputes when a source's autograd version counter moved
    (an optimizer step or a no-grad copy into the engine's own parameters; the engine checks when it starts work
    from idle, not every decode step), `refresh(force=True)` from `Engine.update_weights` (a parameter shared with
    the trainer changes under the trainer's tensor's counter, not the engine's). Subclasses give `_sources()` (the
    tensors read) and `_compute(sources)`."""

    def _versions(self) -> list | object:
        """(version, address) of each source, read from tensors held here (~12 us for 16 layers; through the
        modules' attribute lookups ~80 us)."""
        try:
            return [(t._version, t.data_ptr()) for t in self._held]
        except RuntimeError:  # an inference tensor has no version counter: recompute every time (correct, slower)
            return object()

    def refresh(self, force: bool = False) -> None:
        if not force and self._versions() == self._seen:
            return
        # re-read the modules' tensors: a forced refresh also follows a replaced Parameter object
        self._held = self._sources()
        with torch.no_grad():
            self._compute(self._held)
        self._seen = self._versions()


class QKVPack(DerivedWeights):
    """One attention layer's q|k|v weights (and biases) copied into one [Nq + Nk + Nv, D] buffer, so a decode
    batch of several tokens runs one GEMM instead of three."""

    def __init__(self, attn: nn.Module):
        self.linears = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.sizes = [m.weight.shape[0] for m in self.linears]
        w = self.linears[0].weight
        self.weight = torch.empty(sum(self.sizes), w.shape[1], dtype=w.dtype, device=w.device)
        biases = [m.bias for m in self.linears]
        self.bias = None if any(b is None for b in biases) else self.weight.new_empty(sum(self.sizes))
        self.refresh(force=True)

    def _sources(self) -> list[torch.Tensor]:
        return [m.weight for m in self.linears] + ([m.bias for m in self.linears] if self.bias is not None else [])

    def _compute(self, sources: list[torch.Tensor]) -> None:
        torch.cat(sources[:3], out=self.weight)
        if self.bias is not None:
            torch.cat(sources[3:], out=self.bias)


class ComposedRouter(DerivedWeights):
    """One MoE layer's router composed with the attention output projection and the RMSNorm between them, for a
    one-token decode (`ROUTER_COMPOSE`). The module path computes logits = W_r (w * (h + W_o a) / rms), with h
    the residual, a the attention output, w the norm weight. A positive scale does not change the ranking, so the
    raw logits R [a | h] with R = [W_r diag(w) W_o | W_r diag(w)] (fp32, [E, A + D], products taken in fp64) can
    be computed in the o_proj launch itself (`fused_decode._row_linear_router`); gate_up ranks them as they are,
    and down multiplies them by the 1 / rms it computes from the residual row: the router's own launch, and its
    hop, are gone.
    What it changes: the experts are ranked by the exact product in fp32 (the routing weights take it times
    1 / rms, rounded to the model dtype), where the module path rounds the o_proj output, the residual sum, the
    normed row and the logits first. In fp32 that is summation order; in bf16 a choice whose top-K boundary lies
    within that rounding can differ (H200, reference model, one bf16 sequence of 256 tokens: mean |engine -
    trainer logprob| 1.28e-2 against 1.00e-2 with the router's own launch). MOELOOP_ROUTER_COMPOSE=off."""

    def __init__(self, layer: nn.Module):
        self.o_proj, self.norm, self.gate = layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp.gate
        E, D = self.gate.weight.shape
        self.A = self.o_proj.weight.shape[1]
        self.weight = torch.empty(E, self.A + D, dtype=torch.float32, device=self.gate.weight.device)
        self.refresh(force=True)

    def _sources(self) -> list[torch.Tensor]:
        return [self.o_proj.weight, self.norm.weight, self.gate.weight]

    def _compute(self, sources: list[torch.Tensor]) -> None:
        w_o, w_norm, w_r = (t.double() for t in sources)
        scaled = w_r * w_norm[None, :]
        self.weight[:, :self.A] = scaled @ w_o
        self.weight[:, self.A:] = scaled


def derive_decode_weights(model: nn.Module) -> list[DerivedWeights]:
    """A `QKVPack` on every attention layer and, with `ROUTER_COMPOSE`, a `ComposedRouter` on every MoE block
    whose layer it fits (`composed_router_fits`); kept in the module's __dict__ (not a parameter, not in the state
    dict); the fused forward uses them (the q|k|v pack for more than one token, the composed router for one)."""
    packs = []
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.__dict__["_decode_qkv"] = pack = QKVPack(attn)
        packs.append(pack)
    return packs + (pack_routers(model) if ROUTER_COMPOSE else [])


def composed_router_fits(layer: nn.Module) -> bool:
    """A softmax MoE block after bias-free o_proj and RMSNorm, whose widths one program holds whole."""
    attn, mlp = layer.self_attn, layer.mlp
    return (isinstance(mlp, MoE) and mlp.gate.scoring_func == "softmax" and getattr(attn.o_proj, "bias", None) is None
            and isinstance(layer.post_attention_layernorm, RMSNorm)
            and max(attn.o_proj.weight.shape) <= ROW_MAX_D)


def pack_routers(model: nn.Module) -> list[ComposedRouter]:
    """A `ComposedRouter` on every MoE block it fits (in the block's __dict__ as "_decode_router")."""
    packs = []
    for layer in model.model.layers:
        if composed_router_fits(layer):
            layer.mlp.__dict__["_decode_router"] = pack = ComposedRouter(layer)
            packs.append(pack)
    return packs
