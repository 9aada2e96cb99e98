"""Tensor parallelism (`parallel.tp`, Megatron's column / row split), applied to a plain model from outside with
torch's DTensor plans, before FSDP (torchtitan's 2-D layout):

    init_parallel_groups(cp, tp)                  # collective: ranks ordered (dp, cp, tp), tp innermost
    mesh = build_dp_mesh(device_type)             # (dp, tp): FSDP over "dp" (dp * cp ranks), TP over "tp"
    apply_tp(model, mesh["tp"])                   # attention heads and dense MLPs split, MoE tokens split
    apply_fsdp(model, mesh, ...)                  # the dense weights sharded over "dp", the routed experts over every rank

What is split: each attention's q, k and v projections by output (its heads: H / tp query heads and G / tp key/value
heads a rank, so the attention context sees only local heads) and o_proj by input, with one all-reduce of its output;
with tp above G (a multiple of it: Megatron's replicated kv heads) k and v stay whole on each rank, which projects only
the kv head its query heads attend to (`keep_kv_head`); MLA's head projections (q_proj or q_b_proj, kv_b_proj) the same
way as q, its low-rank latents kept whole; every dense MLP as gate and up by output, down by input. The tp ranks hold
the same tokens, so (without sequence parallelism, below) the norms and the residual stream are whole on each; the loss
is the same on each rank; a column split's backward all-reduces its input's gradient (once for q, k and v: they take one
replicated DTensor input). The logprob (or value) head takes a tp rank's share of the positions, and the ranks
all-gather the per-token values (`over_tp_rows`, called by the trainer's `over_positions`).

An MoE block (router, routed and shared experts) works token by token, so each tp rank runs it on its 1/tp of the
block's input rows and the ranks all-gather the outputs (`split_moe_tokens`; Megatron runs MoE on sequence-parallel
tokens the same way): the experts' work is split, not repeated. Its weights are not split by tp (`parallel.etp` stays
1: DCP cannot save the strided shards a gate_up split would need): FSDP shards the routed experts over every rank
(Megatron's expert data parallel, expert_dp = dp * cp * tp / ep, as `moeloop plan` counts) and the shared experts and
router over dp, whole on each tp rank. With `parallel.ep` the routed experts split over ep ranks as before
(`parallel.expert`), each rank sending its own share of the tokens.

Gradients: the trainer scales each rank's loss by dp (the data-parallel size); FSDP averages the dense gradients
over its dp * cp ranks, and the split weights' gradients are exact slices. What each tp rank holds a part of is
completed before the optimizer step (`reduce_tp_grads`): a per-head q/k norm's and whole k and v projections' (its
heads) and the router's, shared experts' and head's (its tokens) are summed over the tp ranks, and the routed
experts', averaged over every rank by FSDP, are scaled by tp; MLA's rope key, which every head shares, has its
gradient summed by a hook on its projection's output. The gradient norm weights each rank's squares by how many
ranks hold the same shard (`parallel.fsdp.grad_norm`). The weights are DTensors (whole k and v on FSDP's dp mesh
alone, as the norms), so the state dict, DCP checkpoints (which reshard across layouts) and `full_tensor` (weight
sync, HF export) see whole tensors under their usual names.

LoRA adapters (`train.lora`, applied before this) split with the linear they adapt (`ColumnSplit`, `RowSplit`): a
column split's A [R, I] whole and B [O, R] by output, a row split's A by input and B whole, its rank-R intermediate a
Partial DTensor that rides the output's one all-reduce. The whole pieces' gradients come out as each rank's part and
FSDP sums them over tp (a Replicate DTensor's); adapters of what tp leaves whole (MLA's latents, k and v above the
kv heads: `forward_rows` of the head's rows, shared and routed experts) are completed as their weights' would be.

Sequence parallelism (`parallel.sequence_parallel`, Megatron's; `shard_sequence`): the residual stream between the
layers and the norms on it hold a tp rank's rows (`_Rows`: the first T % tp ranks one more; the all-gathers pad to equal
blocks). The embedding's output is cut to the rank's rows; each attention and dense MLP all-gathers its normed input's
rows (its backward: the tp plan's all-reduce of the input gradient, then the rank's rows) and takes the rank's rows of
its all-reduced output (Megatron's reduce-scatter done as the all-reduce and a slice, both ways: an all-reduce moves
about twice a reduce-scatter's bytes, being one and an all-gather); an MoE block gets the rows as they come (no take and
gather inside it; its route tape seen through them); the final norm's rows are all-gathered whole for the head (which
takes a rank's share again: one all-gather of [T, D] each way that the head could do without). The layer norms', final
norm's and embedding's gradients are each rank's rows' and `reduce_tp_grads` sums them (a tied head's sum covers the
embedding's, so no 1/tp scale then). Attention is unchanged (it runs on the gathered rows, with the whole stream's
positions and cu_seqlens). What it saves is the residual stream's and the norms' activations, 1/tp; the gathered input
each column split keeps for its backward is still whole (Megatron re-gathers it in the backward instead). Not combined
with context or pipeline parallelism (refused by name: `parallel.groups.check_sequence_parallel`).
"""
# H query heads, G key/value heads
from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from moeloop.errors import InputError
from moeloop.model.attn import Attention
from moeloop.model.mla import MLAttention
from moeloop.model.moe import MoE


def check_tp(cfg, tp: int) -> None:
    """The model's dimensions tp splits: every message names the field (before anything is built)."""
    if tp == 1:
        return
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.intermediate_size and any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)) \
            and cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    messages = [f"parallel.tp={tp} must divide the model's {', '.join(problems)}"] if problems else []
    if not cfg.is_mla and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:  # above the kv heads: each on tp / G ranks
        messages.append(f"parallel.tp={tp} must divide the model's num_key_value_heads={cfg.num_kv_heads} or be a "
                        "multiple of it")
    if messages:
        raise InputError("; ".join(messages))


def apply_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split `model`'s attention and dense MLPs over the 1-D tp `mesh` (see the module docstring), in place;
    `sequence_parallel`: the residual stream and the norms by rows too (`shard_sequence`)."""
    tp = mesh.size()
    check_tp(model.cfg, tp)
    col, row = ColumnSplit(), RowSplit()

    def replicated_input(num_args: int) -> PrepareModuleInput:  # the first of num_args positional inputs a DTensor
        layouts = (Replicate(),) + (None,) * (num_args - 1)
        return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False)

    partial: list[nn.Module] = []  # modules whose parameters' gradients each tp rank holds a part of
    split_experts: list[nn.Module] = []  # routed experts that run on a tp rank's share of the tokens
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, MLAttention):
            heads = {"q_proj" if hasattr(attn, "q_proj") else "q_b_proj": col, "kv_b_proj": col, "o_proj": row}
            # its rope key is shared by every head: each rank's gradient of it covers its heads only
            attn.kv_a_proj_with_mqa.register_forward_hook(_sum_grad_of_columns(attn.kv_lora_rank, mesh))
        elif isinstance(attn, Attention):
            # x enters as one replicated DTensor: the three column splits' input gradients sum into one all-reduce
            heads = {"": replicated_input(3), "q_proj": col, "k_proj": col, "v_proj": col, "o_proj": row}
            if tp > attn.num_kv_heads:  # GQA with fewer kv heads than tp ranks: k_proj and v_proj whole on each
                del heads["k_proj"], heads["v_proj"]
                keep_kv_head(attn, mesh)
                partial += [attn.k_proj, attn.v_proj]
            else:
                attn.num_kv_heads //= tp
        else:
            raise InputError(f"parallel.tp={tp}: no tensor-parallel plan for {type(attn).__name__}")
        parallelize_module(attn, mesh, heads)
        attn.num_heads //= tp
        # a per-head q/k norm (Qwen3) normalises only this rank's heads: its weight's gradient is a part of the whole
        partial += [norm for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if norm is not None]
        if isinstance(layer.mlp, MoE):
            if not sequence_parallel:  # (under sequence parallelism the block's input is already this rank's rows)
                split_moe_tokens(layer.mlp, mesh)
            partial += [layer.mlp.gate] + ([layer.mlp.shared_experts] if hasattr(layer.mlp, "shared_experts") else [])
            split_experts.append(layer.mlp.experts)
        else:
            parallelize_module(layer.mlp, mesh, {"": replicated_input(1), "gate_proj": col, "up_proj": col,
                                                 "down_proj": row})
    if model.lm_head is not None:  # (a pipeline stage before the last has none)
        partial.append(model.lm_head)  # the logprob (or value) head takes a tp rank's share of the positions
    tied = getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", False)
    if sequence_parallel:  # the embedding's gradient a part too (its rows'): summed once, through the head's if tied
        partial += shard_sequence(model, mesh) + ([] if tied else [model.model.embed_tokens])
    elif tied:
        # tied to the embedding, which every tp rank runs on every token: each rank's gradient of the weight holds
        # the whole embedding part beside its share of the head's, and the sum over tp would count the former tp
        # times, so the embedding's part is taken at 1/tp on each rank
        model.model.embed_tokens.register_forward_hook(lambda module, args, out: _ScaleGrad.apply(out, 1 / tp))
    model.tp_mesh, model.tp_partial_grads, model.tp_split_experts = mesh, partial, split_experts


@torch.no_grad()
def reduce_tp_grads(model: nn.Module) -> None:
    """Before the optimizer step, in place: sum over the tp ranks the gradients each holds a part of (the per-head
    norms' weights, each rank's covering its heads; the router's and the shared experts', each rank's covering its
    tokens), so every rank has the whole gradient (FSDP shards them over dp alike on the tp ranks: the dp mesh of a
    rank is its tp coordinate's, so the local shards line up); and scale the routed experts' by tp (FSDP, or EP and
    FSDP, average them over every rank, tp ranks included, whose tokens differ). A no-op without TP."""
    mesh = getattr(model, "tp_mesh", None)
    if mesh is None:
        return
    for module in model.tp_partial_grads:
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(_local(p.grad), group=mesh.get_group())
    for experts in model.tp_split_experts:
        for p in experts.parameters(recurse=False):
            if p.grad is not None:
                _local(p.grad).mul_(mesh.size())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def keep_kv_head(attn: Attention, mesh: DeviceMesh) -> None:
    """tp above the attention's G kv heads (tp a multiple of G; Megatron replicates the kv heads): k_proj and v_proj
    stay whole on each tp rank, which projects only the kv head its H / tp query heads attend to (head t // (tp / G)
    on tp rank t, the rows of that head in both weights), so the attention sees one kv head. Each rank's gradient of
    the two weights covers that head's rows and its query heads' part of it (`reduce_tp_grads` sums it over tp), and
    its gradient of x is a part too, summed with q_proj's in the replicated input's one all-reduce."""
    tp, G, Dh = mesh.size(), attn.num_kv_heads, attn.head_dim
    head = mesh.get_local_rank() // (tp // G)
    for proj in (attn.k_proj, attn.v_proj):
        proj.tp_head_rows = (head * Dh, (head + 1) * Dh)
        proj.forward = types.MethodType(_project_head_rows, proj)
    attn.num_kv_heads = 1


def _project_head_rows(self: nn.Linear, x_TD: torch.Tensor) -> torch.Tensor:
    """`keep_kv_head`'s forward of a k or v projection: its rows `tp_head_rows` only (a module with low-rank adapters
    computes them itself, `forward_rows`: its B's rows, A whole)."""
    if isinstance(x_TD, DTensor):  # replicated; the gradient this rank gives it is a part (summed over tp)
        x_TD = x_TD.to_local(grad_placements=[Partial()])
    lo, hi = self.tp_head_rows
    if hasattr(self, "forward_rows"):
        return self.forward_rows(x_TD, lo, hi)
    return F.linear(x_TD, self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi])


def _distribute(module: nn.Module, leaf: str, mesh: DeviceMesh, placement: Placement,
                src_data_rank: int | None) -> None:
    """`module`'s parameter `leaf` a DTensor on the 1-D `mesh` at `placement` (as torch's styles distribute theirs)."""
    param = getattr(module, leaf)
    dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(leaf, nn.Parameter(dist_param, requires_grad=param.requires_grad))


class ColumnSplit(ColwiseParallel):
    """torch's column split (weight and bias by output, dim 0) of a linear module that may carry low-rank adapters
    (`ADAPTED`: base weight [O, I] -> its A [R, I] and B [O, R], LoRA's W + s B A): B splits by output with the weight,
    A stays whole (its rows are the rank). The rank-R intermediate x A^T is then whole on each tp rank, B's rows make
    this rank's output columns, and A's gradient, each rank's part (through its B rows), is summed over tp where
    FSDP reduces it (a Replicate DTensor's gradient)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        whole = {a for a, _ in getattr(module, "ADAPTED", {}).values()}
        for leaf, _ in list(module.named_parameters()):
            _distribute(module, leaf, device_mesh, Replicate() if leaf in whole else Shard(0), self.src_data_rank)


class RowSplit(RowwiseParallel):
    """torch's row split (weight by input, dim 1; bias whole) of a linear module that may carry low-rank adapters
    (`ADAPTED`, as `ColumnSplit`): A splits by input with the weight, B stays whole. Each rank's x A^T is then a part
    of the rank-R intermediate (a Partial DTensor): through the whole B it stays one, and is summed over tp with the
    base output in the split's one all-reduce (the sum is linear: (sum_t h_t) B^T = sum_t h_t B^T)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._partition_linear_fn(name, module, device_mesh)
        for a, b in getattr(module, "ADAPTED", {}).values():
            _distribute(module, a, device_mesh, Shard(1), self.src_data_rank)
            _distribute(module, b, device_mesh, Replicate(), self.src_data_rank)


class _Rows:
    """This tp rank's share of a [T, ...] tensor's rows: rank r takes sizes[r] consecutive rows (T split as evenly as
    it goes: the first T % tp ranks one more; a rank may take none)."""

    def __init__(self, num_rows: int, group):
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.sizes = [num_rows // tp + (r < num_rows % tp) for r in range(tp)]
        self.lo = sum(self.sizes[:rank])
        self.hi, self.group = self.lo + self.sizes[rank], group

    def gather(self, x_nX: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in order (equal blocks padded for the all-gather, the pads dropped)."""
        most = max(self.sizes)
        parts = [x_nX.new_empty((most,) + tuple(x_nX.shape[1:])) for _ in self.sizes]
        dist.all_gather(parts, F.pad(x_nX, (0, 0) * (x_nX.dim() - 1) + (0, most - x_nX.shape[0])).contiguous(),
                        group=self.group)
        return torch.cat([part[:n] for part, n in zip(parts, self.sizes)])


class _TakeRows(torch.autograd.Function):
    """Forward: this rank's rows of a tensor every tp rank holds whole; backward: every rank's rows' gradients
    gathered (the rows fed only their own rank's block, and the whole gradient is needed on each)."""

    @staticmethod
    def forward(ctx, x_TX: torch.Tensor, rows: _Rows) -> torch.Tensor:
        ctx.rows = rows
        return x_TX[rows.lo:rows.hi]

    @staticmethod
    def backward(ctx, grad_nX: torch.Tensor):
        return ctx.rows.gather(grad_nX), None


class _GatherRows(torch.autograd.Function):
    """Forward: every tp rank's rows gathered into the whole tensor; backward: this rank's rows of the gradient (each
    rank's loss, the same, used every row: its gradient is whole on each)."""

    @staticmethod
    def forward(ctx, x_nX: torch.Tensor, rows: _Rows) -> torch.Tensor:
        ctx.rows = rows
        return rows.gather(x_nX)

    @staticmethod
    def backward(ctx, grad_TX: torch.Tensor):
        return grad_TX[ctx.rows.lo:ctx.rows.hi], None


class _RowsTape:
    """A route tape (`model.routes.RouteTape`) seen through a tp rank's rows: replayed ids sliced, recorded ids
    gathered from every rank into the whole tape."""

    def __init__(self, tape, rows: _Rows):
        self.tape, self.rows = tape, rows

    def replay(self, moe_index: int):
        replayed = self.tape.replay(moe_index)
        if replayed is None:
            return None
        ids_TK, valid_T = replayed
        lo, hi = self.rows.lo, self.rows.hi
        return ids_TK[lo:hi], (None if valid_T is None else valid_T[lo:hi])

    def record(self, moe_index: int, ids_nK: torch.Tensor) -> None:
        if getattr(self.tape, "recorded", None) is not None:  # (the same on every tp rank)
            self.tape.record(moe_index, self.rows.gather(ids_nK))


def over_tp_rows(head, group, hidden_TD: torch.Tensor, *per_position_T: torch.Tensor):
    """`head(hidden_TD, *per_position_T)` (per-position values: a tensor, or a tuple of tensors and Nones) with each tp
    rank of `group` taking its share of the positions and every rank getting all the values back: the head's work
    and its logits split over tp, not repeated. The hidden rows' gradient is gathered whole on each rank; the head's
    weights' is each rank's part (`reduce_tp_grads` sums it)."""
    rows = _Rows(hidden_TD.shape[0], group)
    out = head(_TakeRows.apply(hidden_TD, rows), *(x[rows.lo:rows.hi] for x in per_position_T))
    if isinstance(out, tuple):
        return tuple(None if x is None else _GatherRows.apply(x, rows) for x in out)
    return _GatherRows.apply(out, rows)


def split_moe_tokens(moe: nn.Module, mesh: DeviceMesh) -> None:
    """Run the MoE block `moe` on this tp rank's share of its input rows (router, routed and shared experts: token by
    token), and gather every rank's output rows: the tp ranks of a replica hold the same tokens, so each computes
    1/tp of the block's tokens, not all of them (Megatron's MoE under sequence parallelism, inside the block only)."""
    group = mesh.get_group()

    def take(module, args):
        x_TD, *rest = args
        module.tp_rows = rows = _Rows(x_TD.shape[0], group)
        if rest and rest[0] is not None:
            rest[0] = _RowsTape(rest[0], rows)
        return (_TakeRows.apply(x_TD, rows), *rest)

    moe.register_forward_pre_hook(take)
    moe.register_forward_hook(lambda module, args, y_nD: _GatherRows.apply(y_nD, module.tp_rows))


def shard_sequence(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Megatron's sequence parallelism (after `apply_tp` split the heads and dense MLPs): the residual stream between
    the layers holds this tp rank's rows (`_Rows` of the layer's T rows), so do the norms that run on it. The
    embedding's output is cut to the rank's rows; each attention and dense MLP gathers the rows of its (normed) input
    and takes the rank's rows of its output; an MoE block runs on the rank's rows as they come (its route tape seen
    through them); the final norm's rows are gathered whole for the head. Returns the modules whose weights'
    gradients are each rank's part (its rows'): the layer norms and the final norm."""
    group = mesh.get_group()
    stack = model.model

    def cut(module, args, x_TD):  # (a slice: the embedding's gradient is this rank's rows' part)
        model.tp_rows = rows = _Rows(x_TD.shape[0], group)
        return x_TD[rows.lo:rows.hi]

    def rows_of(layer, args):  # the layer's T, from its rope tables (checkpointing re-runs this with the layer)
        layer.self_attn.tp_rows = layer.mlp.tp_rows = rows = _Rows(args[1].cos_TR.shape[0], group)
        assert args[0].shape[0] == rows.hi - rows.lo, (args[0].shape, rows.sizes)

    def gather(module, args):  # before the tp plan's own input hook (prepend): it takes the whole rows
        return (_GatherRows.apply(args[0], module.tp_rows), *args[1:])

    def tape(module, args):
        x_nD, *rest = args
        if rest and rest[0] is not None:
            rest[0] = _RowsTape(rest[0], module.tp_rows)
        return (x_nD, *rest)

    stack.embed_tokens.register_forward_hook(cut)
    stack.norm.register_forward_hook(lambda module, args, h_nD: _GatherRows.apply(h_nD, model.tp_rows))
    for layer in stack.layers:
        layer.register_forward_pre_hook(rows_of)
        for mixer in [layer.self_attn] + ([] if isinstance(layer.mlp, MoE) else [layer.mlp]):
            mixer.register_forward_pre_hook(gather, prepend=True)
            mixer.register_forward_hook(lambda module, args, y_TD: _TakeRows.apply(y_TD, module.tp_rows))
        if isinstance(layer.mlp, MoE):
            layer.mlp.register_forward_pre_hook(tape)
    return [stack.norm] + [norm for layer in stack.layers
                           for norm in (layer.input_layernorm, layer.post_attention_layernorm)]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


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
