"""Data parallelism with FSDP2 (`fully_shard`), applied to a plain model from outside.

    mesh = build_dp_mesh(device_type)            # "dp" over the default group; (dp, tp) under tensor parallelism
    apply_fsdp(model, mesh)                      # per decoder layer, lm_head (on the last stage), then the root
Each decoder layer is its own FSDP unit; lm_head (a `LogprobHead` in the trainer) is one too, so its
weight is unsharded exactly while the chunked logprob kernel runs and its gradient is
reduce-scattered by FSDP's own hooks. Under tensor parallelism (`parallel.tensor`) the dense units shard over the
mesh's dp dim (the dp * cp ranks of one tp rank) and the routed experts, whose weights tp does not split, over every
rank. Under pipeline parallelism (`parallel.pipeline`) all of it runs within the ranks of one stage (`stage_mesh`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from moeloop.model.experts import Experts
from moeloop.parallel.groups import group_timeout, pp_rank, pp_size, stage_ranks, tp_size


def stage_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A mesh of `shape` (dims `names`) over the ranks of this rank's pipeline stage, in their (d, c, t) order: every
    rank without pipeline parallelism. Its groups are made here with the run's timeout (`groups.group_timeout`;
    DeviceMesh's own would take torch's 30-minute default): collective, every rank makes every stage's, dim by dim."""
    ranks = torch.tensor(stage_ranks()).reshape(pp_size(), *shape)
    mine = []
    for dim in range(len(shape)):
        for line in ranks.movedim(dim + 1, -1).reshape(-1, shape[dim]).tolist():  # a group a line along the dim
            group = dist.new_group(line, timeout=group_timeout())
            if dist.get_rank() in line:
                mine.append(group)
    return DeviceMesh.from_group(mine if len(mine) > 1 else mine[0], device_type, mesh=ranks[pp_rank()],
                                 mesh_dim_names=names)


def stage_world() -> int:
    """The ranks of one pipeline stage (every rank without pipeline parallelism)."""
    return (dist.get_world_size() if dist.is_initialized() else 1) // pp_size()


def build_dp_mesh(device_type: str) -> DeviceMesh | None:
    """A 1-D data-parallel mesh over the ranks of this rank's pipeline stage (all ranks without pipeline parallelism),
    or None when that is one rank; under tensor parallelism (`parallel.groups.tp_size()` > 1) the 2-D (dp, tp) mesh,
    tp innermost."""
    world, tp = stage_world(), tp_size()
    if world == 1:
        return None
    if tp > 1:
        return stage_mesh(device_type, (world // tp, tp), ("dp", "tp"))
    return stage_mesh(device_type, (world,), ("dp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               experts: set[nn.Parameter] = frozenset()) -> None:
    """`experts`: expert-parallel experts' parameters (`parallel.expert`), DTensors on their ep mesh: their modules
    become FSDP units over their mesh's expert_dp dim when it is > 1, and the dense units leave them alone. A (dp, tp)
    `mesh`: the dense units over dp, the routed experts (without EP) units over every rank."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard_experts(model, policy)
    if mesh.ndim == 2:
        experts = set(experts) | shard_experts_over_every_rank(model, mesh.device_type, policy)
        mesh = mesh["dp"]
    kw = dict(mesh=mesh, mp_policy=policy, ignored_params=set(experts) or None)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    # (a pipeline stage before the last has no head; a head tied to the embedding stays in the root's unit, which
    # holds the embedding: FSDP shards a shared parameter once and gathers it for every module that uses it)
    if model.lm_head is not None and not model.cfg.tie_word_embeddings:
        fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)


def shard_experts(model: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Each expert-parallel experts module (`parallel.expert`) an FSDP unit over its mesh's expert_dp dim, when that
    is > 1 (FSDP's 2-D sharding with the experts' own ep split)."""
    for module in model.modules():
        mesh = getattr(module, "ep_mesh", None)
        if mesh is not None and mesh.size(0) > 1:
            fully_shard(module, mesh=mesh["expert_dp"], mp_policy=policy)


def shard_experts_over_every_rank(model: nn.Module, device_type: str, policy: MixedPrecisionPolicy) -> set[nn.Parameter]:
    """Under tensor parallelism without EP: each routed-experts module an FSDP unit over every rank (Megatron's expert
    data parallel: tp does not split their weights; each tp rank runs them on its share of the tokens, and
    `parallel.tensor.reduce_tp_grads` scales the average FSDP takes over every rank back to the sum over the tp ranks).
    Returns their parameters, for the dense units to leave alone."""
    modules = [m for m in model.modules() if isinstance(m, Experts) and getattr(m, "ep_mesh", None) is None]
    if not modules:
        return set()
    mesh = stage_mesh(device_type, (stage_world(),), ("expert_dp",))
    for module in modules:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    return {p for m in modules for p in m.parameters()}


def reshard(model: nn.Module) -> None:
    """Every FSDP module of `model` back to its sharded parameters. The root keeps its own parameters (embedding,
    final norm) gathered after a forward, as plain tensors, until its next backward or this call; code that reads
    the parameters as shards (`train.actor.mix_into`) calls it first. A no-op without FSDP."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's or state entry's whole value: gathered when FSDP sharded it (a DTensor; collective), else as it
    is (detached). On a 2-D mesh (FSDP over dp, a tensor-parallel split over tp) the dp dim is gathered first, then the
    tp one: one all-gather a dim, where a single redistribution warns that it runs two in a row."""
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    if tensor.device_mesh.ndim == 2 and not isinstance(tensor.placements[0], Replicate):
        tensor = tensor.redistribute(placements=[Replicate(), tensor.placements[1]])
    return tensor.full_tensor()


@torch.no_grad()
def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients of `params`, whose shards lie on DTensor meshes of their own (FSDP's over
    dp, tp's, the experts' over every rank or over ep and expert_dp): each rank's squares, divided by the number of
    ranks holding the same shard, summed over every rank. (torch's norm and clip take DTensors of one mesh only.) Under
    pipeline parallelism the stages hold different parameters: a shard is held within a stage, and the sum over every
    rank adds the stages' squares."""
    world = stage_world()
    total = torch.zeros((), dtype=torch.float32, device=params[0].grad.device)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            shards = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not isinstance(pl, Replicate))
            total += g.to_local().float().pow(2).sum() * (shards / world)
        else:  # whole on every rank
            total += g.float().pow(2).sum() / world
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def scale_grads(params: list[nn.Parameter], factor: float) -> None:
    for p in params:
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(factor)
