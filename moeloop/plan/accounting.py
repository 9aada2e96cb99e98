"""Model accounting from a `ModelConfig`: parameters (dense vs routed-expert, total vs active), FLOPs per token,
KV-cache bytes per token. Pure arithmetic, exact for the supported architectures (biases and norms included).

"Expert" parameters are the routed experts, the ones expert parallelism splits; shared experts, routers,
attention, embeddings and norms are "dense". Counts exclude DeepSeek's MTP layer (not in `ModelConfig`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moeloop.config.schema import ActorSection
from moeloop.model.config import ModelConfig


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer: matmul weights split by TP (`dense`), routed experts split by EP*ETP, replicated rest."""

    dense: int  # attention + dense MLP (tensor-parallel)
    router: int  # router (+ sigmoid correction bias): a matmul, replicated across tp
    norms: int  # RMSNorm weights (incl. q/k norms, MLA latent norms), replicated
    experts: int  # routed experts (expert-parallel)
    active_experts: int  # routed-expert parameters one token touches (top-k)
    whole: int = 0  # matmuls whole on each tp rank: the shared experts (a tp rank runs them on 1/tp of the MoE
    # block's tokens) and MLA's latent projections
    kv_proj: int = 0  # of `dense`: the k and v projections (biases included), whole on each tp rank above kv_heads
    kv_heads: int = 0  # GQA key/value heads (0: MLA, or unknown)

    @property
    def replicated(self) -> int:
        return self.router + self.norms + self.whole

    def tp_split(self, tp: int) -> float:
        """The `dense` parameters one of `tp` ranks keeps: 1/tp of them, but the k and v projections whole when tp is
        above the kv heads (`parallel.tensor.keep_kv_head`)."""
        kept_whole = self.kv_proj if self.kv_heads and tp > self.kv_heads else 0
        return (self.dense - kept_whole) / tp + kept_whole


@dataclass(frozen=True)
class ModelStats:
    layers: tuple[LayerParams, ...]
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int
    model: Optional[ModelConfig] = None  # None when built from bare parameter counts

    @property
    def expert_params(self) -> int:
        return sum(layer.experts for layer in self.layers)

    @property
    def dense_params(self) -> int:
        return self.total_params - self.expert_params

    @property
    def total_params(self) -> int:
        body = sum(layer.dense + layer.replicated + layer.experts for layer in self.layers)
        return body + self.embedding + self.lm_head + self.final_norm

    @property
    def active_params(self) -> int:
        return self.total_params - self.expert_params + sum(layer.active_experts for layer in self.layers)

    @property
    def matmul_active_params(self) -> int:
        """Active parameters that cost 2 FLOPs per token: everything but the embedding lookup and norms."""
        lm_head = self.lm_head or self.embedding
        return sum(layer.dense + layer.router + layer.whole + layer.active_experts for layer in self.layers) + lm_head

    def attention_flops_per_token(self, context_tokens: int) -> int:
        """Forward QK^T and AV FLOPs of one token attending to `context_tokens` keys, all layers."""
        m = self.model
        if m is None:
            return 0
        return 2 * m.num_layers * m.num_heads * (m.qk_head_dim + m.attn_v_head_dim) * context_tokens

    def forward_flops_per_token(self, seq_tokens: int) -> int:
        """Forward FLOPs per token of a causal pass over sequences of `seq_tokens` (average context seq/2)."""
        return 2 * self.matmul_active_params + self.attention_flops_per_token(seq_tokens // 2)

    def train_flops_per_token(self, seq_tokens: int, recompute: bool = False) -> int:
        """Forward + backward (2x forward); full activation recompute adds one more forward."""
        return (4 if recompute else 3) * self.forward_flops_per_token(seq_tokens)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token adds, all layers. MLA caches its latent (kv_lora_rank + rope dims) only."""
        m = self.model
        if m is None:
            return 0
        if m.is_mla:
            return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * dtype_bytes
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * dtype_bytes

    def expanded_kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV bytes if MLA keys/values were materialised per head (what a non-MLA-aware engine would cache)."""
        m = self.model
        if m is None or not m.is_mla:
            return self.kv_bytes_per_token(dtype_bytes)
        return m.num_layers * m.num_heads * (m.qk_head_dim + m.v_head_dim) * dtype_bytes

    def summary(self, seq_tokens: int) -> dict[str, float]:
        return {
            "total_params": self.total_params, "active_params": self.active_params,
            "dense_params": self.dense_params, "expert_params": self.expert_params,
            "forward_flops_per_token": self.forward_flops_per_token(seq_tokens),
            "train_flops_per_token": self.train_flops_per_token(seq_tokens),
            "kv_bytes_per_token": self.kv_bytes_per_token(), "seq_tokens": seq_tokens,
        }


def model_stats(m: ModelConfig) -> ModelStats:
    layers = tuple(_layer(m, i) for i in range(m.num_layers))
    embedding = m.vocab_size * m.hidden_size
    lm_head = 0 if m.tie_word_embeddings else embedding
    return ModelStats(layers, embedding, lm_head, m.hidden_size, m)


def stats_from_counts(dense: float, expert: float, active: float = 0.0, num_layers: int = 1) -> ModelStats:
    """A stand-in when only published parameter counts are known: everything spread evenly over `num_layers`.

    `active` = 0 means "all dense, no experts active" is unknown: the routed share is then taken as 0.
    """
    routed_active = max(0.0, active - dense) if active else 0.0
    layer = LayerParams(dense=round(dense / num_layers), router=0, norms=0, experts=round(expert / num_layers),
                        active_experts=round(routed_active / num_layers))
    return ModelStats(tuple([layer] * num_layers), embedding=0, lm_head=0, final_norm=0)


def _layer(m: ModelConfig, i: int) -> LayerParams:
    attn, latents, attn_norms = _attention(m)
    norms = 2 * m.hidden_size + attn_norms
    kv = {} if m.is_mla else dict(kv_proj=2 * m.num_kv_heads * m.head_dim * (m.hidden_size + int(m.attention_bias)),
                                  kv_heads=m.num_kv_heads)
    if not m.num_experts or not m.is_moe_layer(i):
        return LayerParams(dense=attn + 3 * m.hidden_size * m.intermediate_size, router=0, norms=norms, experts=0,
                           active_experts=0, whole=latents, **kv)
    per_expert = 3 * m.hidden_size * m.moe_intermediate_size
    shared = m.n_shared_experts * per_expert
    router = m.hidden_size * m.num_experts + (m.num_experts if m.scoring_func == "sigmoid" else 0)
    return LayerParams(dense=attn, router=router, norms=norms, experts=m.num_experts * per_expert,
                       active_experts=m.num_experts_per_tok * per_expert, whole=shared + latents, **kv)


def _attention(m: ModelConfig) -> tuple[int, int]:
    """(matmul weights incl. biases split by tp, those whole on each tp rank, norm weights) of one attention block:
    MLA's head projections split, its latent ones (q_a_proj, kv_a_proj_with_mqa) whole."""
    h = m.hidden_size
    if m.is_mla:
        q_out = m.num_heads * m.qk_head_dim
        q_a, q_b = (h * m.q_lora_rank, m.q_lora_rank * q_out) if m.q_lora_rank else (0, h * q_out)
        kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv_b = m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = m.num_heads * m.v_head_dim * h
        return q_b + kv_b + o, q_a + kv_a, (m.q_lora_rank or 0) + m.kv_lora_rank
    q_out, kv_out = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    weights = h * q_out + 2 * h * kv_out + q_out * h
    bias = q_out + 2 * kv_out if m.attention_bias else 0
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    return weights + bias, 0, qk_norm


def decoder_linears(m: ModelConfig) -> list[tuple[str, int, int]]:
    """(module name, in features, out features) of each nn.Linear of the decoder layers, as the model builds them:
    the modules LoRA can target (`train.lora.linear_module_names`; tests/test_lora.py checks the two agree)."""
    out = []
    for i in range(m.num_layers):
        prefix = f"model.layers.{i}."
        out += [(prefix + "self_attn." + name, d_in, d_out) for name, d_in, d_out in _attention_linears(m)]
        if not m.num_experts or not m.is_moe_layer(i):
            ffn, mlp = m.intermediate_size, "mlp."
        elif m.n_shared_experts:
            ffn, mlp = m.moe_intermediate_size * m.n_shared_experts, "mlp.shared_experts."
        else:
            continue
        h = m.hidden_size
        out += [(prefix + mlp + "gate_proj", h, ffn), (prefix + mlp + "up_proj", h, ffn), (prefix + mlp + "down_proj", ffn, h)]
    return out


def _attention_linears(m: ModelConfig) -> list[tuple[str, int, int]]:
    h = m.hidden_size
    if not m.is_mla:
        q_out, kv_out = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        return [("q_proj", h, q_out), ("k_proj", h, kv_out), ("v_proj", h, kv_out), ("o_proj", q_out, h)]
    q_out = m.num_heads * m.qk_head_dim
    q = [("q_a_proj", h, m.q_lora_rank), ("q_b_proj", m.q_lora_rank, q_out)] if m.q_lora_rank else [("q_proj", h, q_out)]
    return q + [("kv_a_proj_with_mqa", h, m.kv_lora_rank + m.qk_rope_head_dim),
                ("kv_b_proj", m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)),
                ("o_proj", m.num_heads * m.v_head_dim, h)]


def _tp_split(m: ModelConfig, name: str, tp: int) -> str | None:
    """How `parallel.tensor.apply_tp` splits the decoder linear `name` over tp ranks: "column" (by output), "row" (by
    input) or None (whole on each: MLA's latents, shared experts, k/v above the kv heads)."""
    if tp == 1 or ".shared_experts." in name:
        return None
    leaf = name.rsplit(".", 1)[1]
    if leaf in ("k_proj", "v_proj") and not m.is_mla and tp > m.num_kv_heads:
        return None
    if leaf in ("q_proj", "q_b_proj", "kv_b_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return "column"
    return "row" if leaf in ("o_proj", "down_proj") else None


def decoder_experts(m: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(module name, experts E, model dim D, expert ffn dim F) of the routed experts of each MoE layer: the stacked
    experts LoRA can target (`train.lora.expert_module_names`)."""
    return [(f"model.layers.{i}.mlp.experts", m.num_experts, m.hidden_size, m.moe_intermediate_size)
            for i in range(m.num_layers) if m.num_experts and m.is_moe_layer(i)]


def lora_layer_params(m: ModelConfig, actor: ActorSection, tp: int = 1) -> tuple[list[float], list[int]]:
    """(dense, expert) adapter parameters of each decoder layer under `actor.lora_rank`: A [r, in] + B [out, r] per
    targeted linear module; per expert A [r, D] + B [2F, r] on gate_up and A [r, F] + B [D, r] on down for targeted
    routed experts. Zeros without LoRA. `tp`: the dense ones a tp rank holds, split as `parallel.tensor` splits them
    with the linear they adapt (a column split's B by output, A whole; a row split's A by input, B whole; adapters of
    the linears tp leaves whole, whole); the experts' are whole here (the caller divides them by ep * etp)."""
    dense, expert = [0.0] * m.num_layers, [0] * m.num_layers
    if not actor.lora_rank:
        return dense, expert
    r = actor.lora_rank

    def per_rank(name: str, d_in: int, d_out: int) -> float:
        split = _tp_split(m, name, tp)
        return r * (d_in + d_out / tp if split == "column" else d_in / tp + d_out if split == "row" else d_in + d_out)
    sizes = {name: per_rank(name, d_in, d_out) for name, d_in, d_out in decoder_linears(m)}
    experts = {name: num * r * ((d + 2 * f) + (f + d)) for name, num, d, f in decoder_experts(m)}
    candidates = sorted([*sizes, *experts], key=lambda name: int(name.split(".")[2]))
    for name in actor.lora_targets(candidates, set(experts)):
        layer = int(name.split(".")[2])
        if name in experts:
            expert[layer] += experts[name]
        else:
            dense[layer] += sizes[name]
    return dense, expert
