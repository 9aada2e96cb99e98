"""Tiny seeded `transformers` models and the moeloop model loaded with the same weights, for model parity tests.

Every floating tensor of the HF state dict is re-randomised: routers get a wide spread (decisive top-k, no
ties) and DeepSeek's e_score_correction_bias a non-zero one, so routing and group-limited selection are
actually exercised; norm weights sit around 1.
"""
from __future__ import annotations

import torch
import transformers

from moeloop.model import ModelConfig, MoEForCausalLM

_COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=False)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}

ARCHS = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=3, head_dim=8, intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen3_moe_nonorm": dict(model_type="qwen3_moe", num_hidden_layers=2, head_dim=8, intermediate_size=48,
                             num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=False),
    "mixtral": dict(model_type="mixtral", num_hidden_layers=2, intermediate_size=24, num_local_experts=6,
                    num_experts_per_tok=2),
    "deepseek_v3": dict(
        model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
        moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=3, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
        rope_scaling={**_YARN, "mscale": 1.0, "mscale_all_dim": 0.7}),
    "deepseek_v3_noqlora": dict(
        model_type="deepseek_v3", num_hidden_layers=2, num_key_value_heads=4, intermediate_size=48,
        moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=False, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, head_dim=8, intermediate_size=48, rope_scaling=_YARN),
    "llama": dict(model_type="llama", num_hidden_layers=2, intermediate_size=48, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


def hf_config(arch: str) -> transformers.PretrainedConfig:
    raw = {**_COMMON, **ARCHS[arch]}
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(arch), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if "e_score_correction_bias" in name:
                t.copy_(torch.randn_like(t) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                t.copy_(torch.randn_like(t) * 0.5)
            elif name.endswith("norm.weight"):
                t.copy_(1.0 + 0.2 * torch.randn_like(t))
            else:
                t.copy_(torch.randn_like(t) * 0.15)
    return model.eval()


def our_model(hf: torch.nn.Module, **kw) -> MoEForCausalLM:
    model = MoEForCausalLM(ModelConfig.from_hf_dict(hf.config.to_dict()), **kw)
    model.load_state_dict(hf.state_dict(), strict=True)
    return model.eval()


def token_batch(vocab_size: int, batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|: the tolerance measure used by the model tests."""
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
