"""Deterministic random models + tokenizer for tests, the demo and benchmarks (no hub access).

    moeloop init-model --arch qwen3_moe --size tiny --out /tmp/m [--seed 0] [--dtype auto]

Writes config.json (loads with `transformers.AutoConfig`), hub-named safetensors and a character-level
tokenizer with a chat template. Same arguments -> byte-identical files.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from moeloop.errors import InputError
from moeloop.model.config import ModelConfig
from moeloop.model.hf_io import save_pretrained
from moeloop.model.tokenizer import BOS, EOS, PAD, build_tokenizer, tokenizer_vocab
from moeloop.model.transformer import MoEForCausalLM

ARCHS = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen3")
SIZES = ("tiny", "small", "reference")
INIT_STD = 0.02
E_SCORE_BIAS_STD = 0.01
VOCAB_MULTIPLE = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Attention and width per size; the MoE geometry below. "reference" is the H200 benchmark config.
_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, max_position_embeddings=4096),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, max_position_embeddings=4096),
    "reference": dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=128, intermediate_size=4096, max_position_embeddings=32768, vocab_size=32000),
}
_MOE: dict[str, dict[str, int]] = {  # routed experts, top-k, expert ffn width
    "tiny": dict(experts=8, top_k=2, ffn=32),
    "small": dict(experts=8, top_k=2, ffn=128),
    "reference": dict(experts=64, top_k=4, ffn=512),
}
_MLA: dict[str, dict[str, int]] = {
    "tiny": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
    "small": dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32),
    "reference": dict(q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config_dict(arch: str, size: str) -> dict[str, Any]:
    """The config.json contents for `arch` at `size`, normalised through transformers' own config class."""
    if arch not in ARCHS or size not in SIZES:
        raise ValueError(f"arch={arch!r} size={size!r}: expected arch in {ARCHS} and size in {SIZES}")
    base = dict(_SIZES[size])
    vocab = base.pop("vocab_size", _round_up(len(tokenizer_vocab()), VOCAB_MULTIPLE))
    ids = tokenizer_vocab()
    kw: dict[str, Any] = dict(base, vocab_size=vocab, tie_word_embeddings=False, initializer_range=INIT_STD,
                              rms_norm_eps=1e-6, rope_theta=1e6 if arch.startswith("qwen3") else 1e4,
                              bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD],
                              architectures=[_ARCHITECTURES[arch]])
    kw.update(_ARCH_FIELDS[arch](size, _MOE[size]))
    return transformers.AutoConfig.for_model(arch, **kw).to_dict()


def _qwen3_moe(size: str, moe: dict[str, int]) -> dict[str, Any]:
    return dict(num_experts=moe["experts"], num_experts_per_tok=moe["top_k"], moe_intermediate_size=moe["ffn"],
                norm_topk_prob=True, router_aux_loss_coef=0.001)


def _mixtral(size: str, moe: dict[str, int]) -> dict[str, Any]:
    return dict(num_local_experts=moe["experts"], num_experts_per_tok=moe["top_k"], intermediate_size=moe["ffn"],
                router_aux_loss_coef=0.001)


def _deepseek_v3(size: str, moe: dict[str, int]) -> dict[str, Any]:
    num_layers = _SIZES[size]["num_hidden_layers"] + (1 if size == "tiny" else 0)  # tiny: 1 dense + 2 MoE
    orig = _SIZES[size]["max_position_embeddings"] // 4
    mla = _MLA[size]
    return dict(  # head_dim: transformers sizes DeepSeek's rotary tables from it, so it must be the rope dim
        mla, head_dim=mla["qk_rope_head_dim"], num_hidden_layers=num_layers,
        num_key_value_heads=_SIZES[size]["num_attention_heads"],
        n_routed_experts=moe["experts"], num_experts_per_tok=moe["top_k"], moe_intermediate_size=moe["ffn"],
        n_shared_experts=1, n_group=2 if size != "reference" else 8, topk_group=1 if size != "reference" else 4,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": orig,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def _qwen3(size: str, moe: dict[str, int]) -> dict[str, Any]:
    return {}


_ARCH_FIELDS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3, "qwen3": _qwen3}


def build_model(arch: str, size: str, seed: int = 0) -> MoEForCausalLM:
    """A seeded random fp32 model: N(0, 0.02) matrices (routers included), unit norms, and for DeepSeek-V3
    a small random e_score_correction_bias so that the aux-loss-free bias path is exercised."""
    cfg = ModelConfig.from_hf_dict(hf_config_dict(arch, size), source=f"{arch}/{size}")
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        torch.manual_seed(seed)
        model = MoEForCausalLM(cfg)  # init_weights: normal(0, initializer_range) etc.
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, E_SCORE_BIAS_STD)
    return model


def init_model(arch: str, size: str, out_dir: str | Path, seed: int = 0, dtype: str = "auto") -> Path:
    """Write model + tokenizer to `out_dir`; dtype "auto" is float32, bfloat16 for the reference size."""
    dtype = ("bfloat16" if size == "reference" else "float32") if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected auto or one of {list(DTYPES)}")
    model = build_model(arch, size, seed).to(DTYPES[dtype])
    out = Path(out_dir)
    build_tokenizer(out)
    save_pretrained(model, out, max_shard_bytes=2 * 2**30)
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeloop init-model", description=__doc__.splitlines()[0])
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--size", default="tiny", choices=SIZES)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.out.exists() and not args.out.is_dir():
        raise InputError(f"--out {args.out}: exists and is not a directory")
    out = init_model(args.arch, args.size, args.out, seed=args.seed, dtype=args.dtype)
    cfg = ModelConfig.from_pretrained(out)  # re-read: proves config.json parses
    print(f"wrote {args.arch}/{args.size} (seed {args.seed}, {args.dtype}) to {out}: "
          f"{cfg.num_layers} layers, {cfg.num_experts} experts, vocab {cfg.vocab_size}")
    return 0
