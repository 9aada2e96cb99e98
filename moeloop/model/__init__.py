"""moeloop.model: one MoE transformer (Qwen3-MoE, DeepSeek-V3, Mixtral, dense Qwen3/Llama) built from a HF
config.json, with transformers' parameter names, a packed forward and pluggable attention contexts."""
from moeloop.model.attention import AttentionContext, PackedAttention, cu_seqlens_from_lengths, position_ids_from_lengths
from moeloop.model.config import ModelConfig
from moeloop.model.router import RouterStats, load_balance_loss
from moeloop.model.transformer import MoEForCausalLM

__all__ = ["AttentionContext", "ModelConfig", "MoEForCausalLM", "PackedAttention", "RouterStats",
           "cu_seqlens_from_lengths", "load_balance_loss", "position_ids_from_lengths"]
