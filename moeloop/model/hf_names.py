"""Tensor names: our in-memory names (== transformers-5 in-memory) <-> the hub's on-disk per-expert names.

In memory a MoE layer holds fused experts: `mlp.experts.gate_up_proj` [E, 2F, D] (rows [:F] gate, [F:] up)
and `mlp.experts.down_proj` [E, D, F]. On disk (`save_pretrained`, the hub, vLLM) each expert is split:
`mlp.experts.{e}.gate_proj.weight` [F, D], `.up_proj.weight` [F, D], `.down_proj.weight` [D, F].
Mixtral on disk also renames `mlp.` -> `block_sparse_moe.` and gate/up/down -> w1/w3/w2.

Shapes: E experts, F expert ffn dim, D model dim.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from moeloop.model.config import ModelConfig

_FUSED_RE = re.compile(r"^(?P<prefix>.*\.)mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")
_HUB_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PROJ_FROM_HUB = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                  "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass(frozen=True)
class HubSlot:
    """Where one on-disk tensor lives inside one in-memory tensor: mem[expert][rows[0]:rows[1]]."""
    hub_name: str
    mem_name: str
    expert: int | None = None  # index along dim 0 of a fused [E, ...] tensor; None = the whole tensor
    rows: tuple[int, int] | None = None  # row range inside gate_up_proj[e] ([:F] gate, [F:] up)
    shape: tuple[int, ...] = ()

    def take(self, mem_tensor: torch.Tensor) -> torch.Tensor:
        """The view of `mem_tensor` that this hub tensor is (no copy)."""
        t = mem_tensor if self.expert is None else mem_tensor[self.expert]
        return t if self.rows is None else t[self.rows[0]:self.rows[1]]


def _plain_hub_name(mem_name: str, cfg: ModelConfig) -> str:
    if cfg.model_type == "mixtral" and ".mlp." in mem_name:
        return mem_name.replace(".mlp.", ".block_sparse_moe.", 1)
    return mem_name


def _expert_hub_name(prefix: str, expert: int, proj: str, cfg: ModelConfig) -> str:
    """prefix 'model.layers.3.', proj 'gate_proj' | 'up_proj' | 'down_proj' -> the hub name of one expert matrix."""
    if cfg.model_type == "mixtral":
        return f"{prefix}block_sparse_moe.experts.{expert}.{_MIXTRAL_PROJ[proj]}.weight"
    return f"{prefix}mlp.experts.{expert}.{proj}.weight"


def hub_slots(mem_name: str, shape: tuple[int, ...] | torch.Size, cfg: ModelConfig) -> list[HubSlot]:
    """The on-disk tensors that make up in-memory tensor `mem_name` of shape `shape`."""
    shape = tuple(shape)
    m = _FUSED_RE.match(mem_name)
    if m is None:
        return [HubSlot(_plain_hub_name(mem_name, cfg), mem_name, shape=shape)]
    if len(shape) != 3:
        raise ValueError(f"{mem_name}: fused expert tensor must be [E, out, in], got shape {shape}")
    num_experts, out_dim, in_dim = shape
    if m["kind"] == "down_proj":
        return [HubSlot(_expert_hub_name(m["prefix"], e, "down_proj", cfg), mem_name, e, None, (out_dim, in_dim))
                for e in range(num_experts)]
    if out_dim % 2:
        raise ValueError(f"{mem_name}: gate_up_proj rows {out_dim} must be even (gate and up stacked)")
    ffn = out_dim // 2
    return [HubSlot(_expert_hub_name(m["prefix"], e, proj, cfg), mem_name, e, rows, (ffn, in_dim))
            for e in range(num_experts) for proj, rows in (("gate_proj", (0, ffn)), ("up_proj", (ffn, out_dim)))]


def canonical_hub_name(hub_name: str, cfg: ModelConfig) -> str:
    """Any accepted spelling (mlp/block_sparse_moe, gate_proj/w1) -> the one `hub_slots` writes for `cfg`.
    Fused in-memory expert names map to themselves."""
    mem_name, expert, proj = parse_hub_name(hub_name)
    if expert is not None:
        return _expert_hub_name(mem_name.rsplit("mlp.experts.", 1)[0], expert, proj, cfg)
    return mem_name if _FUSED_RE.match(mem_name) else _plain_hub_name(mem_name, cfg)


def hub_named_tensors(state_dict_items: Iterable[tuple[str, torch.Tensor]],
                      cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """In-memory (name, tensor) pairs -> on-disk hub (name, tensor) pairs, in order; tensors are views."""
    for mem_name, tensor in state_dict_items:
        for slot in hub_slots(mem_name, tensor.shape, cfg):
            yield slot.hub_name, slot.take(tensor)


def parse_hub_name(hub_name: str) -> tuple[str, int | None, str | None]:
    """Hub name -> (in-memory name, expert index or None, 'gate_proj' | 'up_proj' | 'down_proj' | None).

    Accepts both hub spellings and fused in-memory names (which map to themselves).
    """
    m = _HUB_EXPERT_RE.match(hub_name)
    if m is None:
        return hub_name.replace(".block_sparse_moe.", ".mlp.", 1), None, None
    proj = _PROJ_FROM_HUB[m["proj"]]
    kind = "down_proj" if proj == "down_proj" else "gate_up_proj"
    return f"{m['prefix']}mlp.experts.{kind}", int(m["e"]), proj


def fuse_hub_tensors(hub_items: Iterable[tuple[str, torch.Tensor]],
                     cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of `hub_named_tensors`: hub (name, tensor) pairs -> in-memory (name, tensor) pairs.

    Per-expert tensors are held until all `cfg.num_experts` experts of a fused tensor arrived (in any order),
    then yielded stacked. Raises ValueError for a duplicate tensor or a fused tensor left incomplete.
    """
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for hub_name, tensor in hub_items:
        mem_name, expert, proj = parse_hub_name(hub_name)
        if expert is None:
            yield mem_name, tensor
            continue
        if not 0 <= expert < cfg.num_experts:
            raise ValueError(f"{hub_name}: expert index {expert} out of range 0..{cfg.num_experts - 1}")
        parts = pending.setdefault(mem_name, {})
        if (expert, proj) in parts:
            raise ValueError(f"{hub_name}: duplicate tensor")
        parts[(expert, proj)] = tensor
        per_expert = 1 if proj == "down_proj" else 2
        if len(parts) == cfg.num_experts * per_expert:
            yield mem_name, _stack_experts(pending.pop(mem_name), cfg.num_experts, proj == "down_proj")
    if pending:
        name, parts = next(iter(pending.items()))
        projs = ("down_proj",) if name.endswith("down_proj") else ("gate_proj", "up_proj")
        missing = [f"{e}.{p}" for e in range(cfg.num_experts) for p in projs if (e, p) not in parts]
        raise ValueError(f"{name}: incomplete experts, missing {len(missing)} tensors, e.g. {missing[:4]}")


def _stack_experts(parts: dict[tuple[int, str], torch.Tensor], num_experts: int, is_down: bool) -> torch.Tensor:
    if is_down:
        return torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
    return torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num_experts)])
