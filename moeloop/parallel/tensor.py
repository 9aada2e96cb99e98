"""Tensor parallelism (`parallel.tp`, Megatron's column / row split), applied to a plain model from outside with
torch's DTensor plans, before FSDP (torchtitan's 2-D layout):

    init_parallel_groups(cp, tp)                  # collective: ranks ordered (dp, cp, tp), tp innermost
    mesh = build_dp_mesh(device_type)             # (dp, tp): FSDP over "dp" (dp * cp ranks), TP over "tp"
    apply_tp(model, mesh["tp"])                   # attention heads and dense MLPs split over the tp ranks
    apply_fsdp(model, mesh, ...)                  # the dense weights sharded over "dp", the routed experts over every rank

What is split: each attention's q, k and v projections by output (its heads: H / tp query heads and G / tp key/value
heads a rank, so the attention context sees only local heads) and o_proj by input, with one all-reduce of its output;
MLA's head projections (q_proj or q_b_proj, kv_b_proj) the same way, its low-rank latents kept whole; every dense MLP
and shared expert as gate and up by output, down by input. The tp ranks hold the same tokens (no sequence
parallelism: norms, the router, the head and the token-wise activations are whole on each), so the layers' outputs,
and so the loss, are the same on each rank; the column split's backward all-reduces its input's gradient. A per-head
q/k norm sees only its rank's heads, so its weight's gradient is summed over the tp ranks (`reduce_tp_grads`), and
so is the gradient of MLA's rope key, which every head shares (a hook on its projection's output).

The routed experts are not split by tp (`parallel.etp` stays 1): each tp rank computes them on its tokens, and FSDP
shards them over every rank (Megatron's expert data parallel, expert_dp = dp * cp * tp / ep, as `moeloop plan`
counts), so they take no more memory a rank than the planner says, and their gradients, equal on the tp ranks of
a replica, average to one process's. With `parallel.ep` the experts split over ep ranks as before (`parallel.expert`).

Gradients: the trainer scales each rank's loss by dp (the data-parallel size); FSDP averages the dense gradients
over its dp * cp ranks, and the split weights' gradients are exact slices, so every weight gets one process's
gradient. The gradient norm weights each rank's squares by how many ranks hold the same shard
(`parallel.fsdp.grad_norm`).
The weights are DTensors, so the state dict, DCP checkpoints (which reshard across layouts) and `full_tensor`
(weight sync, HF export) see whole tensors under their usual names.
"""
# H query heads, G key/value heads
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from moeloop.errors import InputError
from moeloop.model.attn import Attention
from moeloop.model.mla import MLAttention
from moeloop.model.mlp import GatedMLP


def check_tp(cfg, tp: int) -> None:
    """The model's dimensions tp splits: every message names the field (before anything is built)."""
    if tp == 1:
        return
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if not cfg.is_mla and cfg.num_kv_heads % tp:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads}")
    if cfg.intermediate_size and any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)) \
            and cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if cfg.n_shared_experts and (cfg.moe_intermediate_size * cfg.n_shared_experts) % tp:
        problems.append(f"the shared experts' width {cfg.moe_intermediate_size * cfg.n_shared_experts}")
    if problems:
        raise InputError(f"parallel.tp={tp} must divide the model's {', '.join(problems)}")


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split `model`'s attention and dense MLPs over the 1-D tp `mesh` (see the module docstring), in place."""
    tp = mesh.size()
    check_tp(model.cfg, tp)
    col, row = ColwiseParallel(), RowwiseParallel()


    def replicated_input(num_args: int) -> PrepareModuleInput:  # the first of num_args positional inputs a DTensor
        layouts = (Replicate(),) + (None,) * (num_args - 1)
        return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False)
    partial: list[nn.Module] = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, MLAttention):
            heads = {"q_proj" if hasattr(attn, "q_proj") else "q_b_proj": col, "kv_b_proj": col, "o_proj": row}
            # its rope key is shared by every head: each rank's gradient of it covers its heads only
            attn.kv_a_proj_with_mqa.register_forward_hook(_sum_grad_of_columns(attn.kv_lora_rank, mesh))
        elif isinstance(attn, Attention):
            # x enters as one replicated DTensor: the three column splits' input gradients sum into one all-reduce
            heads = {"": replicated_input(3), "q_proj": col, "k_proj": col, "v_proj": col, "o_proj": row}
            attn.num_kv_heads //= tp
        else:
            raise InputError(f"parallel.tp={tp}: no tensor-parallel plan for {type(attn).__name__}")
        parallelize_module(attn, mesh, heads)
        attn.num_heads //= tp
        # a per-head q/k norm (Qwen3) normalises only this rank's heads: its weight's gradient is a part of the whole
        partial += [norm for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if norm is not None]
        for mlp in _dense_mlps(layer.mlp):
            parallelize_module(mlp, mesh, {"": replicated_input(1), "gate_proj": col, "up_proj": col, "down_proj": row})
    model.tp_mesh, model.tp_partial_grads = mesh, partial


@torch.no_grad()
def reduce_tp_grads(model: nn.Module) -> None:
    """Sum over the tp ranks the gradients each holds a part of (the per-head norms' weights: each rank's covers its
    heads), in place, before the optimizer step: the whole gradient on every rank. FSDP shards them over dp alike on
    the tp ranks (the dp mesh of a rank is its tp coordinate's), so the local shards line up. A no-op without TP."""
    mesh = getattr(model, "tp_mesh", None)
    if mesh is None:
        return
    for module in model.tp_partial_grads:
        grad = module.weight.grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=mesh.get_group())


class _SumGradOfColumns(torch.autograd.Function):
    """Identity forward; the backward sums the gradient of the last dim's columns from `first` on over `group` (Megatron's
    copy-to-tensor-parallel-region, for the columns that feed every rank's heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, first: int, group) -> torch.Tensor:
        ctx.first, ctx.group = first, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        part = grad[..., ctx.first:].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.first:] = part
        return grad, None, None


def _sum_grad_of_columns(first: int, mesh: DeviceMesh):
    group = mesh.get_group()
    return lambda module, args, out: _SumGradOfColumns.apply(out, first, group)


def _dense_mlps(mlp: nn.Module) -> list[GatedMLP]:
    if isinstance(mlp, GatedMLP):
        return [mlp]
    shared = getattr(mlp, "shared_experts", None)
    return [shared] if shared is not None else []
