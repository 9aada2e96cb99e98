"""fp32 master weights for a model trained in bf16 (`model.fp32_master_weights`, on by default): the trained model
holds its trainable parameters in fp32 (so do its gradients and Adam's state) and computes in bf16, as verl's FSDP
mixed precision and TRL's bf16 autocast do. Pure bf16 training loses every update below bf16's resolution: at the RL
learning rates (1e-6) an AdamW step moved 0.3% of a tiny bf16 model's weights, against 90.8% in fp32
(tests/test_master_weights.py keeps that as a check).

    compute, names = upcast_trainable(model) # trainable bf16 parameters -> fp32 in place; bf16 (None: nothing)
    under FSDP:  MixedPrecisionPolicy(param_dtype=compute)    # FSDP casts each unit's gathered weights
    one process: with cast_params(model, compute): forward; backward   # every fp32 parameter reads as its bf16 cast

`cast_params` swaps each parameter for its cast (an autograd op) for the duration: the forward runs on bf16 weights,
the gradient flows back through the cast into the fp32 parameter and accumulates there in fp32 over micro-batches.
The backward stays inside too, so an activation-checkpointing recompute sees the same bf16 weights. The weights the
engine and the HF export get are the masters rounded to bf16 (`Actor.named_weights`), which are the weights the
forward used.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


def upcast_trainable(model: nn.Module) -> tuple[torch.dtype | None, set[str]]:
    """Trainable parameters in bf16/fp16 become fp32 (in place; frozen ones, e.g. a LoRA base, and buffers stay).
    Returns the dtype they had (the dtype to compute in; None when none was low precision) and their names."""
    low = {p.dtype for p in model.parameters() if p.requires_grad and p.dtype in LOW_PRECISION}
    if len(low) > 1:
        raise ValueError(f"trainable parameters in several low-precision dtypes: {sorted(map(str, low))}")
    names = set()
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype in LOW_PRECISION:
            p.data = p.data.float()
            names.add(name)
    return (low.pop() if low else None), names


@contextlib.contextmanager
def cast_params(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Inside, every fp32 trainable parameter of `model` reads as its `dtype` cast (`module.weight`, getattr; one
    cast per parameter, shared by the modules that hold it), while `named_parameters()` still lists the fp32
    parameters; outside, attribute reads are the parameters again. (The cast sits in the module's instance dict,
    which attribute lookup reads before nn.Module's parameter table.)"""
    casts: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str]] = []
    try:
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None or not p.requires_grad or p.dtype != torch.float32:
                    continue
                cast = casts.get(id(p))
                if cast is None:
                    cast = casts[id(p)] = p.to(dtype)
                module.__dict__[name] = cast
                swapped.append((module, name))
        yield
    finally:
        for module, name in swapped:
            module.__dict__.pop(name, None)
