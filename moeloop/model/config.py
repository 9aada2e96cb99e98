"""`ModelConfig`: one flat description of every supported architecture, parsed from a HF `config.json`.

Supported `model_type`s: qwen3_moe, deepseek_v3, mixtral, and the dense qwen3 / llama / qwen2.
Both transformers-4 (`rope_theta` + `rope_scaling`) and transformers-5 (`rope_parameters`) spellings load.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moeloop.errors import InputError

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "mixtral", "qwen3", "qwen2", "llama")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers / dense models)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each q/k head
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {"rope_type": "yarn", "factor": ..., ...}
    # MoE
    num_experts: int = 0  # routed experts; 0 = dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"  # softmax (Qwen3-MoE, Mixtral) | sigmoid (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    moe_layers: list[int] = field(default_factory=list)  # indices of MoE layers; the rest are dense
    router_aux_loss_coef: float = 0.0
    # MLA (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # ids
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)  # the raw config.json, written back on save

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def attn_v_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layers

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json" if Path(model_dir).is_dir() else Path(model_dir)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: not valid JSON ({err})") from None
        return cls.from_hf_dict(raw, source=str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{source}: model_type={model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; architectures={raw.get('architectures')})")
        get = _Getter(raw, source)
        num_heads = get.req("num_attention_heads")
        hidden = get.req("hidden_size")
        rope_theta, rope_scaling = _parse_rope(raw)
        cfg = cls(
            model_type=model_type, vocab_size=get.req("vocab_size"), hidden_size=hidden,
            num_layers=get.req("num_hidden_layers"), num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            intermediate_size=raw.get("intermediate_size") or 0,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"), hf_config=dict(raw),
        )
        _MOE_PARSERS.get(model_type, lambda c, r, g: None)(cfg, raw, get)
        cfg.check(source)
        return cfg

    def check(self, source: str = "config") -> None:
        def bad(key: str, rule: str) -> ValueError:
            return ValueError(f"{source}: {key}: {rule}")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_key_value_heads", f"{self.num_kv_heads} must divide num_attention_heads={self.num_heads}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise bad("num_experts_per_tok", f"must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")
            if self.num_experts % self.n_group:
                raise bad("n_group", f"{self.n_group} must divide n_routed_experts={self.num_experts}")
            if not 0 < self.topk_group <= self.n_group:
                raise bad("topk_group", f"must be in 1..n_group={self.n_group}, got {self.topk_group}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise bad("scoring_func", f"must be softmax or sigmoid, got {self.scoring_func!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("hf_config")
        return d


class _Getter:
    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def req(self, key: str) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise ValueError(f"{self.source}: missing required key {key!r} for model_type={self.raw.get('model_type')!r}")
        return self.raw[key]


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    if merged.get("rope_type") in (None, "default"):
        merged = {}
    return float(theta), merged


def _parse_qwen3_moe(cfg: ModelConfig, raw: dict[str, Any], get: _Getter) -> None:
    cfg.num_experts = raw.get("num_experts") or get.req("num_local_experts")
    cfg.num_experts_per_tok = get.req("num_experts_per_tok")
    cfg.moe_intermediate_size = get.req("moe_intermediate_size")
    cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", False))
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or [])
    cfg.moe_layers = [i for i in range(cfg.num_layers) if i not in dense and (i + 1) % step == 0]
    cfg.router_aux_loss_coef = raw.get("router_aux_loss_coef", 0.0)


def _parse_mixtral(cfg: ModelConfig, raw: dict[str, Any], get: _Getter) -> None:
    cfg.num_experts = get.req("num_local_experts")
    cfg.num_experts_per_tok = get.req("num_experts_per_tok")
    cfg.moe_intermediate_size = get.req("intermediate_size")
    cfg.norm_topk_prob = True  # Mixtral renormalises the top-k softmax weights
    cfg.moe_layers = list(range(cfg.num_layers))
    cfg.router_aux_loss_coef = raw.get("router_aux_loss_coef", 0.0)


def _parse_deepseek_v3(cfg: ModelConfig, raw: dict[str, Any], get: _Getter) -> None:
    cfg.num_experts = get.req("n_routed_experts")
    cfg.num_experts_per_tok = get.req("num_experts_per_tok")
    cfg.moe_intermediate_size = get.req("moe_intermediate_size")
    cfg.norm_topk_prob = bool(raw.get("norm_topk_prob", True))
    cfg.scoring_func = raw.get("scoring_func", "sigmoid")
    cfg.n_group = raw.get("n_group") or 1
    cfg.topk_group = raw.get("topk_group") or 1
    cfg.routed_scaling_factor = float(raw.get("routed_scaling_factor", 1.0))
    cfg.n_shared_experts = raw.get("n_shared_experts") or 0
    first_dense = raw.get("first_k_dense_replace", 0) or 0
    freq = raw.get("moe_layer_freq", 1) or 1
    cfg.moe_layers = [i for i in range(cfg.num_layers) if i >= first_dense and i % freq == 0]
    cfg.q_lora_rank = raw.get("q_lora_rank")
    cfg.kv_lora_rank = get.req("kv_lora_rank")
    cfg.qk_nope_head_dim = get.req("qk_nope_head_dim")
    cfg.qk_rope_head_dim = get.req("qk_rope_head_dim")
    cfg.v_head_dim = get.req("v_head_dim")
    cfg.head_dim = cfg.qk_head_dim
    cfg.num_kv_heads = cfg.num_heads  # MLA expands the latent into one K/V per query head


_MOE_PARSERS = {"qwen3_moe": _parse_qwen3_moe, "mixtral": _parse_mixtral, "deepseek_v3": _parse_deepseek_v3}
