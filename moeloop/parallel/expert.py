"""Expert parallelism (`parallel.ep`): each MoE layer's routed experts split over ep ranks, applied to a plain model
from outside, before FSDP (Megatron's and torchtitan's layout).

    mesh = build_expert_mesh(device_type, ep)     # (expert_dp, ep) over all ranks: ep ranks split the experts
    experts = apply_ep(model, mesh)               # stacked expert weights (and LoRA adapters) -> DTensor(Shard(0)) on ep
    apply_fsdp(model, dp_mesh, experts=experts)   # dense weights sharded over every rank, as without EP; the experts
                                                  # (expert_dp > 1) over their expert_dp dim (FSDP's 2-D sharding)
    ... forward / backward ...                    # tokens go to their experts' rank and back by all_to_all
    reduce_expert_grads(model)                    # before the optimizer step (`train.actor.clip_and_step`)

Ranks r*ep .. r*ep + ep - 1 form one EP group; rank i of it holds experts [i*E/ep, (i+1)*E/ep) of every MoE layer,
and the expert_dp = world / ep groups hold the same experts, sharded among them by FSDP (Megatron's expert data
parallel with a distributed optimizer: each rank stores 1 / world of the experts' weights, gradients and Adam state,
as `moeloop plan` counts). A forward sorts its (token, expert) pairs by expert,
sends each rank the rows of its experts (`all_to_all_single` with uneven splits, their sizes exchanged first), runs
the local experts on what arrived (grouped_mm or the loop, by the implementation the module had before EP), and sends
the results back; the backward runs the same exchanges reversed. Every rank runs the same MoE layers in the same order
(the trainer equalises micro-batch counts for FSDP already), so the exchanges pair up.

Gradients: the trainer scales each rank's loss by the world size for FSDP's averaging, so an expert's gradient, summed
over the rows every rank of its EP group sent it, is world x that group's share; FSDP averages the expert_dp groups'
(ep x the whole gradient), and `reduce_expert_grads` divides by ep: one process's gradient. The expert weights are
DTensors, so the state dict, DCP checkpoints (which reshard across layouts) and `full_tensor` (weight sync, HF
export) see whole experts.
Shapes: T tokens, K experts a token, S = T*K (token, expert) rows, R EP ranks, L = E / R local experts, D model dim.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moeloop.errors import InputError
from moeloop.model.experts import Experts, register_experts_impl
from moeloop.parallel.collectives import all_to_all
from moeloop.parallel.fsdp import stage_mesh, stage_world

EP_IMPL = "expert_parallel"


def build_expert_mesh(device_type: str, ep: int) -> DeviceMesh:
    """The (expert_dp, ep) mesh over every rank of the default group (of this rank's pipeline stage under pipeline
    parallelism)."""
    world = stage_world()
    if ep < 2 or world % ep:
        raise InputError(f"parallel.ep={ep} must divide the {world} data-parallel ranks (ep ranks split the experts)")
    return stage_mesh(device_type, (world // ep, ep), ("expert_dp", "ep"))


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Split every routed-experts module of `model` over the mesh's ep dim: each rank keeps its experts' rows of the
    stacked weights (every rank holds the same whole model before: nothing is sent), as DTensors on the ep dim; the
    module then runs `ep_experts`, its local experts by the implementation it had (`local_impl`). Returns the new
    parameters (the dense FSDP leaves them to `apply_fsdp`'s experts units)."""
    ep = mesh.size(1)
    params: set[nn.Parameter] = set()
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        if module.num_experts % ep:
            raise InputError(f"parallel.ep={ep} must divide the model's num_experts={module.num_experts}")
        local = module.num_experts // ep
        first = mesh.get_local_rank("ep") * local
        for name, full in list(module.named_parameters(recurse=False)):  # (LoRA's per-expert adapters too)
            shard = full.detach()[first:first + local].clone()
            param = nn.Parameter(DTensor.from_local(shard, mesh["ep"], [Shard(0)], run_check=False),
                                 requires_grad=full.requires_grad)
            setattr(module, name, param)
            params.add(param)
        module.ep_mesh = mesh
        module.local_impl = module.impl  # what its local experts run: "auto" | "grouped_mm" | "loop", as before
        module.impl = EP_IMPL
    return params


def ep_modules(model: nn.Module) -> list[Experts]:
    """The expert-parallel experts modules of `model` (none without EP)."""
    return [m for m in model.modules() if isinstance(m, Experts) and getattr(m, "ep_mesh", None) is not None]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of `model` (none without EP)."""
    return [p for m in ep_modules(model) for p in m.parameters(recurse=False)]  # (LoRA's adapters too)


def ep_experts(experts: Experts, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """The routed experts' output [T, D] with the experts split over the EP group (the module's `ep_mesh`)."""
    mesh = experts.ep_mesh
    group, R = mesh.get_group("ep"), mesh.size(1)
    T, K = ids_TK.shape
    L = experts.num_experts // R
    perm_S = torch.argsort(ids_TK.reshape(-1), stable=True)  # sorted by expert: by destination rank, then expert
    inv_perm_S = torch.empty_like(perm_S)
    inv_perm_S[perm_S] = torch.arange(perm_S.numel(), device=perm_S.device)
    counts_RL = torch.bincount(ids_TK.reshape(-1), minlength=experts.num_experts).view(R, L)
    got_RL = torch.empty_like(counts_RL)  # [source rank, local expert]: rows each rank sends each of my experts
    dist.all_to_all_single(got_RL, counts_RL, group=group)
    send, recv = counts_RL.sum(1).tolist(), got_RL.sum(1).tolist()
    x_SD = all_to_all(x_TD[perm_S // K], recv, send, group)
    # what arrived is by source rank, then local expert: regroup by local expert for the grouped products
    local_S = torch.repeat_interleave(torch.arange(L, device=x_TD.device).repeat(R), got_RL.reshape(-1))
    order_S = torch.argsort(local_S, stable=True)
    y_SD = torch.empty_like(x_SD)
    y_SD[order_S] = _local_experts(experts, x_SD[order_S], got_RL.sum(0))
    y_SD = all_to_all(y_SD, send, recv, group)
    y_TKD = y_SD[inv_perm_S].view(T, K, experts.dim)  # (T may be 0: a tensor-parallel rank's share)
    return (y_TKD * weights_TK.float()[..., None]).sum(dim=1).to(x_TD.dtype)


def _local_experts(experts: Experts, x_SD: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """This rank's experts on rows grouped by local expert (counts_L rows each), the stacked weights in the rows'
    dtype, through the module's `grouped_over` or `looped_over` as its `local_impl` resolves for these rows (LoRA's
    adapted experts add their adapters there, in their own dtype)."""
    local = {name: p.to_local() for name, p in experts.named_parameters(recurse=False)}
    for name in ("gate_up_proj", "down_proj"):
        local[name] = local[name].to(x_SD.dtype)
    if x_SD.shape[0]:
        return experts.computed_over(x_SD, counts_L, local, experts.resolved_impl(x_SD, experts.local_impl))
    # no rows arrived: the output still depends on the rows and the parameters, so this rank's backward runs the
    # reverse exchanges its peers run (and the parameters get a zero gradient)
    return x_SD.new_zeros(0, experts.dim) + 0 * (x_SD.sum() + sum(t.sum() for t in local.values()))


register_experts_impl(EP_IMPL, ep_experts, runs_overrides=True)


@torch.no_grad()
def reduce_expert_grads(model: nn.Module) -> None:
    """Each expert-parallel parameter's gradient divided by its ep, in place (see the module's note): the gradient
    one process would compute."""
    for m in ep_modules(model):
        for p in m.parameters(recurse=False):  # (LoRA's adapters too)
            if p.grad is not None:
                p.grad.to_local().div_(m.ep_mesh.size(1))
