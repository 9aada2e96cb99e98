"""Colocated weight sharing: the rollout engine's parameters alias the trainer's where they can, so the
engine holds no second copy and a push moves nothing (each copy is onto the same memory, a no-op).

    share_parameters(actor.model, engine_model)      # before the engine is built (CUDA graphs see final pointers)
    engine = Engine(engine_model, ...)
    drain_before_step(actor.optimizer, engine)       # every optimizer step first pauses and drains the engine
    actor.update(samples)                            # changes the engine's weights in place; engine paused
    syncer.push(actor.named_weights(), engine, v)    # update_weights (raises unless drained), version bump, resume
The drain gate moves to the moment the weights really change (the optimizer step); the version still changes
only at the push. A parameter that cannot alias (an FSDP shard, another dtype or device) keeps its own copy
and is copied at the push as before, so sharing is never needed for correctness.
"""
from __future__ import annotations

from typing import Collection

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from moeloop.sync.syncer import WeightReceiver


def share_parameters(trainer: nn.Module, engine: nn.Module, skip: Collection[str] = ()) -> list[str]:
    """Point each engine parameter at the trainer parameter of the same name when shape, dtype and device
    match (plain tensors only), but those named in `skip` (under LoRA: the adapted weights, whose engine copy
    holds the merged weight); returns the names now shared."""
    source = dict(trainer.named_parameters())
    shared = []
    for name, param in engine.named_parameters():
        src = source.get(name)
        if src is None or name in skip or isinstance(src, DTensor) or isinstance(param, DTensor):
            continue
        if src.shape != param.shape or src.dtype != param.dtype or src.device != param.device:
            continue
        param.data = src.detach()
        shared.append(name)
    return shared


def drain_before_step(optimizer: torch.optim.Optimizer, receiver: WeightReceiver) -> RemovableHandle:
    """Pause and drain `receiver` before every `optimizer.step()` that can move a weight: in-flight samples finish
    on the weights they started with, and nothing is admitted until the next push resumes it.

    A step with every group's lr at 0 moves nothing (AdamW scales both its update and its decay by lr) and passes
    ungated: DCP takes one to initialise an optimizer that has no state yet (a checkpoint saved before any
    gradient, e.g. after DAPO filtered every group), and no push follows it to resume the engine."""
    def gate(*_: object) -> None:
        if all(float(group["lr"]) == 0.0 for group in optimizer.param_groups):
            return
        receiver.pause()
        receiver.drain()
    return optimizer.register_step_pre_hook(gate)
