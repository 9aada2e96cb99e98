"""LoRA adapters on the actor's linear modules, applied to a plain model from outside (before FSDP), as TRL's
peft_config and verl's lora_rank do; the merged weights are what the rollout engine and the HF export get.

    names = apply_lora(model, cfg.actor)        # targeted nn.Linear -> LoRALinear; every base parameter frozen
    actor = Actor(model, ...)                   # (the Actor calls it) the optimizer holds the adapters only
    for name, w in merged_weights(model): ...   # base names, W + (alpha / r) B @ A: the plain model's weights
    with adapters_off(model): ...               # the base model (the KL reference under LoRA)
    save_adapter(model, cfg.actor, out_dir, base)  # the adapters alone, in peft's format
"""
# I in features, O out features, R rank
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from moeloop.config.schema import ActorSection
from moeloop.parallel.fsdp import full_tensor
from moeloop.types import Sample

if TYPE_CHECKING:
    from moeloop.train.actor import PolicyForward

ADAPTER_LEAVES = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """y = x W^T + b + scale * (x A^T) B^T. W and b are the wrapped Linear's own Parameters under their own names
    (`<module>.weight`, frozen); A [R, I] (Kaiming-uniform, as nn.Linear's and peft's) and B [O, R] (zeros, so the
    wrapped model starts exactly as the base one) are `<module>.lora_A` / `.lora_B`."""

    scale: float = 1.0
    adapter_on: bool = True

    @classmethod
    def wrap(cls, base: nn.Linear, rank: int, scale: float, generator: torch.Generator) -> "LoRALinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = base.in_features, base.out_features
        layer.register_parameter("weight", base.weight)
        layer.register_parameter("bias", base.bias)
        w = base.weight
        a_RI = torch.empty(rank, base.in_features)  # drawn in fp32 on the host: the same values on any device
        nn.init.kaiming_uniform_(a_RI, a=math.sqrt(5), generator=generator)
        layer.lora_A = nn.Parameter(a_RI.to(device=w.device, dtype=w.dtype))
        layer.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        layer.scale = scale
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return y
        return y + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def linear_module_names(model: nn.Module) -> list[str]:
    """The nn.Linear modules LoRA can target: those of the decoder layers (not lm_head; the router and the routed
    experts are not nn.Linear)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith("model.layers.")]


def apply_lora(model: nn.Module, cfg: ActorSection, seed: int = 0) -> list[str]:
    """Freeze every parameter of `model` and wrap the linear modules `cfg.lora_target_modules` names in rank
    `cfg.lora_rank` adapters (scale lora_alpha / lora_rank); returns their names. A is drawn from a generator
    seeded by `seed` (module by module in model order), not the global RNG, which differs across DP ranks."""
    names = cfg.lora_targets(linear_module_names(model))
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    scale = cfg.lora_alpha / cfg.lora_rank
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoRALinear.wrap(getattr(owner, leaf), cfg.lora_rank, scale, generator))
    return names


def lora_meta(cfg: ActorSection) -> dict:
    """The adapters' settings as a LoRA checkpoint's meta.json records them (`lora`)."""
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "target_modules": list(cfg.lora_target_modules)}


def apply_lora_meta(model: nn.Module, meta: dict) -> list[str]:
    """`apply_lora` with the settings a LoRA checkpoint records (`lora_meta`)."""
    return apply_lora(model, ActorSection(lora_rank=meta["rank"], lora_alpha=meta["alpha"],
                                          lora_target_modules=list(meta["target_modules"])))


def merge_and_unload(model: nn.Module) -> None:
    """Each adapted module back to a plain nn.Linear holding the merged weight (peft's merge_and_unload): `model` is
    then the plain model. Unsharded models only (an export's)."""
    for name, layer in lora_modules(model).items():
        with torch.no_grad():
            layer.weight.copy_(merge(layer.weight, layer.lora_A, layer.lora_B, layer.scale))
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight, plain.bias = layer.weight, layer.bias
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, plain)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside, every adapter of `model` is off: its forward is the base model's, bit for bit."""
    layers = list(lora_modules(model).values())
    for layer in layers:
        layer.adapter_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_on = True


def merge(weight_OI: torch.Tensor, a_RI: torch.Tensor, b_OR: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A, computed in fp32, in W's dtype."""
    return (weight_OI.float() + scale * (b_OR.float() @ a_RI.float())).to(weight_OI.dtype)


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's (name, full tensor) stream, in state_dict order: each adapted weight merged under its base
    name, the adapters themselves left out. Collective under FSDP (all ranks iterate)."""
    state = model.state_dict()
    scales = {name: m.scale for name, m in lora_modules(model).items()}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if module in scales and leaf in ADAPTER_LEAVES:
            continue
        full = full_tensor(tensor)
        if module in scales and leaf == "weight":
            full = merge(full, full_tensor(state[f"{module}.lora_A"]), full_tensor(state[f"{module}.lora_B"]), scales[module])
        yield name, full


def save_adapter(model: nn.Module, cfg: ActorSection, out_dir: str | Path, base_model: str,
                 write: bool = True) -> Path | None:
    """The adapters alone in peft's format (adapter_model.safetensors + adapter_config.json), which
    `peft.PeftModel.from_pretrained` loads onto `base_model`'s transformers model. Collective under FSDP (all ranks
    gather); only where `write` does it write."""
    tensors = {f"base_model.model.{name}.{leaf}.weight": full_tensor(getattr(layer, leaf)).cpu().contiguous()
               for name, layer in lora_modules(model).items() for leaf in ADAPTER_LEAVES}
    if not write:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
              "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(lora_modules(model)), "fan_in_fan_out": False, "use_rslora": False,
              "init_lora_weights": True, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


class AdapterOffReference:
    """The KL reference under LoRA (as verl's): the actor's own forward with its adapters off, i.e. the frozen base
    model, with no second copy of the weights."""

    def __init__(self, actor: "PolicyForward"):
        self.actor = actor

    def compute_logprobs(self, samples: list[Sample], field: str | None, routes: str = "off",
                         entropy_field: str | None = None) -> None:
        with adapters_off(self.actor.model):
            self.actor.compute_logprobs(samples, field, routes, entropy_field)
