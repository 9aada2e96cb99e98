"""Activation and logits memory per rank for a token budget, with and without activation checkpointing.

Bytes per token per layer count the tensors autograd keeps for backward in bf16 (fp32 where kernels keep
fp32: softmax statistics, router logits). As the trainer's tensor parallelism runs them (`moeloop.parallel.tensor`):
head-wise tensors (attention, dense MLP widths) are split by tp, expert intermediates by etp; the MoE block's (router,
routed and shared experts) by tp too, each tp rank running it on 1/tp of the tokens; the logits too, the head taking
1/tp of the positions (over the whole vocabulary); the other token-wise ones (the residual stream, norms) are whole on
each tp rank, unless sequence parallelism splits them by rows too (`parallel.tensor.shard_sequence`), which then keeps
the whole rows it all-gathers for each attention's (and dense MLP's) input projections. Full checkpointing keeps each layer's input and, during
backward, one layer's full set at a time. Formulas in the spirit of Korthikanti et al. 2022 with flash attention.
"""
from __future__ import annotations

from moeloop.model.config import ModelConfig
from moeloop.parallel.layout import Layout
from moeloop.parallel.pipeline import peak_in_flight

BF16, FP32 = 2, 4
# RMSNorm in fp32 (as transformers): keeps its fp32 upcast input and the bf16 normalised output per element.
# Measured on the H200 (benchmarks/plan_vs_measured.py): counting only the bf16 output under-predicted by ~10%.
NORM_BYTES = FP32 + BF16


def layer_activation_bytes_per_token(m: ModelConfig, layer_idx: int, layout: Layout) -> float:
    """Bytes one token leaves saved in one decoder layer (no checkpointing), on one rank."""
    tp, h = layout.tp, m.hidden_size
    x = 2 * BF16 * h  # layer input and the residual after attention
    norms = 2 * NORM_BYTES * h  # the two RMSNorms
    stream = x + norms
    if layout.sequence_parallel and tp > 1:  # a tp rank's rows of the stream and its norms, and the whole rows gathered
        dense_mlp = not m.num_experts or not m.is_moe_layer(layer_idx)  # for q/k/v (and a dense MLP's gate/up)
        stream = stream / tp + BF16 * h * (2 if dense_mlp else 1)
    return stream + _attention_bytes(m, tp) + _mlp_bytes(m, layer_idx, layout)


def checkpoint_bytes_per_token(m: ModelConfig, layout: Layout) -> float:
    """Bytes one token leaves per layer under full recompute: the layer input only."""
    return BF16 * m.hidden_size


def _attention_bytes(m: ModelConfig, tp: int) -> float:
    if m.is_mla:
        q_kv = m.num_heads * (2 * m.qk_head_dim + m.v_head_dim)
        latents = 2 * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim)  # before and after their norms
        return BF16 * (q_kv + m.num_heads * m.v_head_dim) / tp + FP32 * m.num_heads / tp + BF16 * latents
    kv_heads = max(m.num_kv_heads, tp)  # over tp: a tp rank above the kv heads keeps one (`keep_kv_head`)
    q_kv = m.num_heads * m.head_dim + 2 * kv_heads * m.head_dim
    out = m.num_heads * m.head_dim  # attention output = o_proj input
    qk_norm = NORM_BYTES * (m.num_heads + kv_heads) * m.head_dim if m.qk_norm else 0.0  # Qwen3 per-head norms
    return (BF16 * (q_kv + out) + qk_norm) / tp + FP32 * m.num_heads / tp  # + flash-attention logsumexp


def _mlp_bytes(m: ModelConfig, layer_idx: int, layout: Layout) -> float:
    tp, h = layout.tp, m.hidden_size
    swiglu = 3 * BF16  # gate out, up out, silu(gate)*up: 3 x width
    if not m.num_experts or not m.is_moe_layer(layer_idx):
        return swiglu * m.intermediate_size / tp
    k = m.num_experts_per_tok
    upcast = FP32 * h if m.scoring_func == "sigmoid" else 0.0  # DeepSeek's router runs on an fp32 copy of its input
    # the MoE block runs on this tp rank's 1/tp of the tokens (`parallel.tensor`), whole width
    router = (upcast + 2 * FP32 * m.num_experts) / tp  # + logits and probabilities
    routed = k * (BF16 * h + swiglu * m.moe_intermediate_size / layout.etp) / tp  # permuted copies, balanced routing
    combine = k * BF16 * h / tp  # expert outputs before the weighted sum
    shared = swiglu * m.n_shared_experts * m.moe_intermediate_size / tp
    return router + routed + combine + shared


def in_flight_micro_batches(layout: Layout, stage: int, num_micro_batches: int) -> float:
    """Micro-batches whose activations a stage holds at once in the runtime's 1F1B order (`parallel.pipeline.schedule`:
    min(m, pp - s) with one chunk a stage; interleaved, its chunks' passes counted in whole stages)."""
    if layout.pp == 1:
        return 1.0
    return max(1.0, peak_in_flight(max(1, num_micro_batches), layout.pp, layout.vpp, stage))


def stage_activation_bytes(m: ModelConfig, layout: Layout, layer_ids: list[int], tokens: int,
                           num_micro_batches: int, stage: int, checkpointing: bool) -> float:
    """Activation bytes one rank of `stage` holds at its peak for micro-batches of `tokens` tokens."""
    if not layer_ids:
        return 0.0
    full = [layer_activation_bytes_per_token(m, i, layout) for i in layer_ids]
    inflight = in_flight_micro_batches(layout, stage, num_micro_batches)
    if not checkpointing:
        return inflight * tokens * sum(full)
    ckpt = checkpoint_bytes_per_token(m, layout)
    return inflight * tokens * ckpt * len(layer_ids) + tokens * max(f - ckpt for f in full)


def logits_bytes(m: ModelConfig, layout: Layout, tokens: int, chunk_tokens: int, chunked: bool) -> float:
    """Logprob workspace on the last stage: bf16 logits, fp32 log-softmax and its gradient over the vocabulary, for
    a tp rank's 1/tp of the positions (the trainer's head splits the positions, not the vocabulary).

    Chunked keeps only `chunk_tokens` rows of that at a time, plus fp32 logprob and entropy per token.
    """
    per_row = (BF16 + 2 * FP32) * m.vocab_size
    mine = tokens / layout.tp
    rows = min(mine, chunk_tokens) if chunked else mine
    return rows * per_row + (2 * FP32 * tokens if chunked else 0)


def alltoall_bytes(m: ModelConfig, layout: Layout, tokens: int) -> float:
    """Expert-parallel dispatch and combine buffers of one MoE layer, and context parallelism's exchanges of one
    attention (q, k, v and its output, each sent and received; k and v repeated to the query heads when the key/value
    heads do not divide over cp), for one micro-batch of `tokens` a rank."""
    ep = 0.0
    if layout.ep > 1 and m.num_experts:
        ep = 2 * tokens * m.num_experts_per_tok * BF16 * m.hidden_size / layout.tp  # (a tp rank's 1/tp of the tokens)
    if layout.cp == 1:
        return ep
    kv_heads = m.num_heads if m.is_mla or m.num_kv_heads % (layout.tp * layout.cp) else m.num_kv_heads
    per_token = (m.num_heads + kv_heads) * m.qk_head_dim + (kv_heads + m.num_heads) * m.attn_v_head_dim
    return ep + 2 * tokens * per_token * BF16 / layout.tp
