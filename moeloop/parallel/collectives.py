"""Host-side reductions over the data-parallel ranks: what the loop, the trainer and the advantage estimators sum
(or max) across ranks so that N ranks compute what one process would; and the differentiable exchanges that
expert and context parallelism run inside the model.

Under context or tensor parallelism (`parallel.context`, `parallel.tensor`, `parallel.groups`) the data-parallel ranks
are one rank of each replica group: the others hold the same samples, so a sum over every rank would count them
cp * tp times."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moeloop.parallel.groups import dp_group, dp_size


def global_values(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM,
                  every_rank: bool = False) -> list[float]:
    """`values` reduced over the DP ranks with `op`, in float64 (as they are in one process). Collective under DP.
    `every_rank`: over every process instead, for what each generated (its engine's share of the prompts) before
    the cp * tp ranks of a replica group pooled their samples."""
    if (dist.get_world_size() if every_rank and dist.is_initialized() else dp_size()) == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op, group=None if every_rank else dp_group())
    return t.tolist()


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with uneven splits whose backward is the reverse exchange. (torch's functional
    `all_to_all_single_autograd` does the same, but its first call imports torch._dynamo: ~6 s a rank on gloo,
    notes/cpu-stack.md.)"""

    @staticmethod
    def forward(ctx, x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x_SD, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_SD: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad_SD, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x_SD.new_empty((sum(out_splits),) + tuple(x_SD.shape[1:]))
    dist.all_to_all_single(out, x_SD.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows x_SD[sum(in_splits[:j]) : ...] go to rank j of `group`; returns the rows received, rank by rank
    (`out_splits` of them from each). Differentiable: the backward sends the gradients back the same way."""
    return _AllToAll.apply(x_SD, out_splits, in_splits, group)


class _AllGather(torch.autograd.Function):
    """Equal row blocks of every rank of `group`, concatenated in rank order; the backward sums the gradient over
    the ranks (each rank's loss used every block) and keeps this rank's block. An all-reduce, not a reduce-scatter:
    gloo has no reduce-scatter, and these tensors are small (hidden rows, per-token logprobs)."""

    @staticmethod
    def forward(ctx, x_UX: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rows, ctx.rank = group, x_UX.shape[0], dist.get_rank(group)
        parts = [torch.empty_like(x_UX) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_UX.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_PX: torch.Tensor):
        grad_PX = grad_PX.contiguous().clone()  # (reduced in place: not autograd's buffer)
        dist.all_reduce(grad_PX, group=ctx.group)
        return grad_PX[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def all_gather_rows(x_UX: torch.Tensor, group) -> torch.Tensor:
    """Every rank's [U, ...] block of `group` in rank order ([world * U, ...]), differentiable (`_AllGather`)."""
    return _AllGather.apply(x_UX, group)
