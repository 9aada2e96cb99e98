"""`MoEForCausalLM`: the one decoder-only model (Qwen3-MoE, DeepSeek-V3, Mixtral, dense Qwen3/Qwen2/Llama)
shared by trainer, rollout engine, reference model and HF import/export.

Parameter names are transformers' in-memory names, so `hf_model.load_state_dict(model.state_dict())` works
both ways. The forward takes one packed token stream (no batch dim, no padding) and an `AttentionContext`:

    model = MoEForCausalLM(ModelConfig.from_pretrained(path))
    hidden_TD = model(input_ids_T, position_ids_T, PackedAttention(cu_seqlens))   # after the final norm
    logits_TV = model.compute_logits(hidden_TD)
    aux = model.load_balance_loss()            # from the router stats of that forward
"""
# T tokens, D model dim, V vocab
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moeloop.model.attention import AttentionContext, PackedAttention, cu_seqlens_from_lengths, position_ids_from_lengths
from moeloop.model.attn import Attention
from moeloop.model.config import ModelConfig
from moeloop.model.experts import Experts
from moeloop.model.mla import MLAttention
from moeloop.model.mlp import GatedMLP
from moeloop.model.moe import MoE
from moeloop.model.norm import RMSNorm
from moeloop.model.rope import RopeTables, RotaryEmbedding
from moeloop.model.router import Router, RouterStats, load_balance_loss


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, experts_impl: str = "auto"):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx) if cfg.is_mla else Attention(cfg, layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoE(cfg, experts_impl)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=bool(cfg.hf_config.get("mlp_bias")))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_TD: torch.Tensor, rope: RopeTables, attn: AttentionContext) -> torch.Tensor:
        x_TD = x_TD + self.self_attn(self.input_layernorm(x_TD), rope, attn)
        routes = getattr(attn, "routes", None)  # a route tape rides on the context (router replay)
        if routes is not None and isinstance(self.mlp, MoE):
            return x_TD + self.mlp(self.post_attention_layernorm(x_TD), routes)
        return x_TD + self.mlp(self.post_attention_layernorm(x_TD))


class DecoderStack(nn.Module):
    """transformers' `*Model`: `embed_tokens`, `layers`, `norm` (the `model.` prefix of every name)."""

    def __init__(self, cfg: ModelConfig, experts_impl: str = "auto"):
        super().__init__()
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, experts_impl) for i in range(cfg.num_layers))
        for i, block in enumerate(layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)):
            block.moe_index = i
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoEForCausalLM(nn.Module):
    """Router stats: after each forward, `router_stats()` lists one `RouterStats` per MoE layer (load counts [E]
    summing to T*K, differentiable score sums); `load_balance_loss()` pools them into the transformers
    aux loss E * sum f_i P_i. Scale it by `cfg.router_aux_loss_coef` (or your own) in the training loss."""

    def __init__(self, cfg: ModelConfig, experts_impl: str = "auto", gradient_checkpointing: bool = False):
        super().__init__()
        act = cfg.hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only silu)")
        self.cfg = cfg
        self.model = DecoderStack(cfg, experts_impl)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.gradient_checkpointing = gradient_checkpointing
        self.tie_weights()
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, std: float | None = None) -> None:
        """Random init as transformers does: N(0, initializer_range) matrices, unit norms, zero biases."""
        std = self.cfg.hf_config.get("initializer_range", 0.02) if std is None else std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            if isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            if isinstance(module, Router):
                module.weight.normal_(0.0, std)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.zero_()
        self.tie_weights()

    def forward(self, input_ids_T: torch.Tensor, position_ids_T: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        """Hidden states [T, D] after the final norm, for one packed stream of T tokens."""
        if input_ids_T.dim() != 1 or position_ids_T.shape != input_ids_T.shape:
            raise ValueError(f"expected flat input_ids [T] and position_ids [T], got "
                             f"{tuple(input_ids_T.shape)} and {tuple(position_ids_T.shape)}")
        for block in self.moe_blocks():
            block.clear_stats()
        x_TD = self.model.embed_tokens(input_ids_T)
        rope = self.rotary.tables(position_ids_T, x_TD.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x_TD = checkpoint(layer, x_TD, rope, attn, use_reentrant=False)
            else:
                x_TD = layer(x_TD, rope, attn)
        return self.model.norm(x_TD)

    def compute_logits(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_TD)

    def forward_packed(self, input_ids_T: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Forward over `len(lengths)` sequences laid end to end in `input_ids_T` (causal within each)."""
        if sum(lengths) != input_ids_T.shape[0]:
            raise ValueError(f"sum(lengths)={sum(lengths)} != number of tokens {input_ids_T.shape[0]}")
        device = input_ids_T.device
        attn = PackedAttention(cu_seqlens_from_lengths(lengths, device))
        return self(input_ids_T, position_ids_from_lengths(lengths).to(device), attn)

    def moe_blocks(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def router_stats(self) -> list[RouterStats]:
        """One entry per MoE layer, in layer order, from the latest forward."""
        stats = [block.stats for block in self.moe_blocks()]
        if any(s is None for s in stats):
            raise RuntimeError("router_stats() needs a forward first")
        return stats  # type: ignore[return-value]

    def load_balance_loss(self) -> torch.Tensor:
        return load_balance_loss(self.router_stats())

    def set_experts_impl(self, name: str) -> None:
        """"auto" | "grouped_mm" | "loop" for every MoE layer (see moeloop/model/experts.py)."""
        for block in self.moe_blocks():
            block.experts.impl = name
