"""Data parallelism with FSDP2 (`fully_shard`), applied to a plain model from outside.

    mesh = build_dp_mesh(device_type)            # 1-D "dp" mesh over the default group
    apply_fsdp(model, mesh)                      # per decoder layer, lm_head, then the root
Each decoder layer is its own FSDP unit; lm_head (a `LogprobHead` in the trainer) is one too, so its
weight is unsharded exactly while the chunked logprob kernel runs and its gradient is
reduce-scattered by FSDP's own hooks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def build_dp_mesh(device_type: str) -> DeviceMesh | None:
    """A 1-D data-parallel mesh over all ranks, or None without a process group (single process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               experts: set[nn.Parameter] = frozenset()) -> None:
    """`experts`: expert-parallel experts' parameters (`parallel.expert`), DTensors on their ep mesh: their modules
    become FSDP units over their mesh's expert_dp dim when it is > 1, and the dense units leave them alone."""
    if model.cfg.tie_word_embeddings:
        raise ValueError("FSDP with tied embeddings is not supported: set tie_word_embeddings=false")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard_experts(model, policy)
    kw = dict(mesh=mesh, mp_policy=policy, ignored_params=set(experts) or None)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)


def shard_experts(model: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Each expert-parallel experts module (`parallel.expert`) an FSDP unit over its mesh's expert_dp dim, when that
    is > 1 (FSDP's 2-D sharding with the experts' own ep split)."""
    for module in model.modules():
        mesh = getattr(module, "ep_mesh", None)
        if mesh is not None and mesh.size(0) > 1:
            fully_shard(module, mesh=mesh["expert_dp"], mp_policy=policy)


def reshard(model: nn.Module) -> None:
    """Every FSDP module of `model` back to its sharded parameters. The root keeps its own parameters (embedding,
    final norm) gathered after a forward, as plain tensors, until its next backward or this call; code that reads
    the parameters as shards (`train.actor.mix_into`) calls it first. A no-op without FSDP."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's or state entry's whole value: gathered when FSDP sharded it (a DTensor; collective), else as it
    is (detached)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
