"""Tiny random `transformers` models (fp32, seeded) for the HF import/export tests."""
from __future__ import annotations

import torch
import transformers

from moeloop.model.config import ModelConfig

TINY_HF_CONFIGS = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False),
    "mixtral": dict(
        model_type="mixtral", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False),
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=256),
    "llama_tied": dict(
        model_type="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True),
}


def hf_config(arch: str) -> transformers.PretrainedConfig:
    raw = dict(TINY_HF_CONFIGS[arch])
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A transformers model with every parameter and buffer that a checkpoint holds set at random."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * (0.01 if "e_score_correction_bias" in name else 0.1))
                if name.endswith("norm.weight"):
                    t.add_(1.0)
    return model


def moeloop_config(model: torch.nn.Module) -> ModelConfig:
    return ModelConfig.from_hf_dict(model.config.to_dict())


def hf_logits(model: torch.nn.Module, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits
