"""LoRA adapters on the actor's linear modules and routed experts, applied to a plain model from outside (before
FSDP), as TRL's peft_config and verl's lora_rank do; the merged weights are what the rollout engine and the HF export
get.

    names = apply_lora(model, cfg.actor, seed)  # targeted nn.Linear -> LoRALinear, Experts -> LoRAExperts; base frozen
    actor = Actor(model, ...)                   # (the Actor calls it) the optimizer holds the adapters only
    for name, w in merged_weights(model): ...   # base names, W + (alpha / r) B @ A: the plain model's weights
    with adapters_off(model): ...               # the base model (the KL reference under LoRA)
    save_adapter(model, cfg.actor, out_dir, base)  # the adapters alone, in peft's format
Adapters are held and computed in fp32 for a bf16 or fp32 model (peft's autocast_adapter_dtype): the adapter's output
is added to the base output in fp32 and the sum cast back to the base dtype. Tensor parallelism (`parallel.tensor`)
splits them with the weights they adapt (`ADAPTED` names them): the forward here runs on the DTensors as it comes.
"""
# I in features, O out features, R rank, E experts, S rows sorted by expert
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
from moeloop.model.experts import (EXPERTS_IMPLS, Experts, grouped_linear, grouped_mm_works, impl_runs_overrides,
                                   silu_mul)
from moeloop.model.hf_names import hub_slots
from moeloop.parallel.fsdp import full_tensor
from moeloop.types import Sample

if TYPE_CHECKING:
    from moeloop.train.actor import PolicyForward


def adapter_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """fp32 for a bf16 / fp16 / fp32 base weight (peft's autocast_adapter_dtype), fp64 for fp64."""
    return torch.promote_types(weight_dtype, torch.float32)


def lora_linear(x_NI: torch.Tensor, w_OI: torch.Tensor, bias_O: torch.Tensor | None, a_RI: torch.Tensor,
                b_OR: torch.Tensor, scale: float) -> torch.Tensor:
    """x W^T + b + scale (x A^T) B^T: the base term in x's dtype, the adapter's in A's (fp32), summed in fp32 and cast
    back to x's dtype (peft's order of rounding). With B = 0 it is the base term bit for bit."""
    y_NO = F.linear(x_NI, w_OI, bias_O)
    delta_NO = F.linear(F.linear(x_NI.to(a_RI.dtype), a_RI), b_OR)
    return (y_NO + scale * delta_NO).to(y_NO.dtype)


def _init_a(rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A [R, I], Kaiming-uniform as nn.Linear's and peft's (|a| <= 1 / sqrt(I)), drawn in fp32 on the host: the same
    values on any device."""
    a_RI = torch.empty(rank, in_features)
    return nn.init.kaiming_uniform_(a_RI, a=math.sqrt(5), generator=generator)


class LoRALinear(nn.Linear):
    """y = x W^T + b + scale * (x A^T) B^T. W and b are the wrapped Linear's own Parameters under their own names
    (`<module>.weight`, frozen); A [R, I] (Kaiming-uniform) and B [O, R] (zeros, so the wrapped model starts exactly
    as the base one) are `<module>.lora_A` / `.lora_B`, in fp32."""

    ADAPTED = {"weight": ("lora_A", "lora_B")}  # base weight -> (A, B) leaves
    scale: float = 1.0
    adapter_on: bool = True

    @classmethod
    def wrap(cls, base: nn.Linear, rank: int, scale: float, generator: torch.Generator) -> "LoRALinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = base.in_features, base.out_features
        layer.register_parameter("weight", base.weight)
        layer.register_parameter("bias", base.bias)
        device, dtype = base.weight.device, adapter_dtype(base.weight.dtype)
        layer.lora_A = nn.Parameter(_init_a(rank, base.in_features, generator).to(device, dtype))
        layer.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device, dtype=dtype))
        layer.scale = scale
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_on:
            return F.linear(x, self.weight, self.bias)
        return lora_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, self.scale)

    def forward_rows(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Output features lo:hi only: the base's rows and B's, A whole (tensor parallelism's `keep_kv_head`)."""
        bias = None if self.bias is None else self.bias[lo:hi]
        if not self.adapter_on:
            return F.linear(x, self.weight[lo:hi], bias)
        return lora_linear(x, self.weight[lo:hi], bias, self.lora_A, self.lora_B[lo:hi], self.scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


class LoRAExperts(Experts):
    """Routed experts with one adapter per expert on each stacked projection: expert e's gate_up rows are
    x W_gu[e]^T + scale (x A_gu[e]^T) B_gu[e]^T (one A for gate and up: peft's gate_proj and up_proj adapters with
    B split in rows), its down rows likewise. Computed on the expert-sorted rows in the experts' own implementation:
    three grouped_mm per projection, or one loop over experts. `gate_up_lora_A` [E, R, D], `gate_up_lora_B` [E, 2F, R],
    `down_lora_A` [E, R, F], `down_lora_B` [E, D, R], fp32; dim 0 is the expert, so FSDP's dim-0 shards and expert
    parallelism's split (`parallel.expert`, which runs `grouped_over` or `looped_over` on each rank's experts) keep
    each expert's adapters with its weights."""

    ADAPTED = {"gate_up_proj": ("gate_up_lora_A", "gate_up_lora_B"), "down_proj": ("down_lora_A", "down_lora_B")}
    scale: float = 1.0
    adapter_on: bool = True

    @classmethod
    def wrap(cls, base: Experts, rank: int, scale: float, generator: torch.Generator) -> "LoRAExperts":
        with torch.device("meta"):  # (its own weights are replaced by the base's at once)
            layer = cls(base.num_experts, base.dim, base.ffn_dim, base.impl)
        for weight, (a, b) in cls.ADAPTED.items():
            w_EOI = getattr(base, weight)
            layer.register_parameter(weight, w_EOI)
            E, O, I = w_EOI.shape
            a_ERI = torch.stack([_init_a(rank, I, generator) for _ in range(E)])  # each expert's A as LoRALinear's
            dtype = adapter_dtype(w_EOI.dtype)
            setattr(layer, a, nn.Parameter(a_ERI.to(w_EOI.device, dtype)))
            setattr(layer, b, nn.Parameter(torch.zeros(E, O, rank, device=w_EOI.device, dtype=dtype)))
        layer.scale = scale
        return layer

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, name: str) -> None:
        """The built-in implementations and plugged ones that compute through `grouped_over` / `looped_over` (expert
        parallelism): any other (the engine's decode kernels) runs the stacked base weights and would leave the
        adapters out."""
        if not impl_runs_overrides(name):
            raise ValueError(f"experts impl {name!r} does not run LoRA adapters: LoRA on the routed experts takes "
                             f"{'|'.join(EXPERTS_IMPLS)} or expert parallelism (merge the adapters for any other: "
                             f"merged_weights)")
        Experts.impl.fset(self, name)

    def grouped_over(self, x_SD: torch.Tensor, offsets_E: torch.Tensor,
                     params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Experts.grouped_over with each projection's adapter (`params` holds them too, as in `looped_over`)."""
        if not self.adapter_on:
            return super().grouped_over(x_SD, offsets_E, params)
        h_S2F = self._grouped_projection("gate_up_proj", x_SD, offsets_E, params)
        return self._grouped_projection("down_proj", silu_mul(h_S2F), offsets_E, params)

    def _grouped_projection(self, weight: str, x_SI: torch.Tensor, offsets_E: torch.Tensor,
                            params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each sorted row through its expert's weight and adapter. The adapter's grouped_mm runs in fp32, which
        needs a kernel for it on this device and 16-byte rows (I and R multiples of 4); else a loop over experts."""
        a_ERI, b_EOR = (params[leaf] for leaf in self.ADAPTED[weight])
        y_SO = grouped_linear(x_SI, params[weight], offsets_E)
        x32_SI = x_SI.to(a_ERI.dtype)
        align = 16 // a_ERI.element_size()
        aligned = x_SI.shape[-1] % align == 0 and a_ERI.shape[1] % align == 0
        if aligned and grouped_mm_works(x_SI.device.type, a_ERI.dtype):
            delta_SO = grouped_linear(grouped_linear(x32_SI, a_ERI, offsets_E), b_EOR, offsets_E)
        else:
            counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
            pairs = zip(x32_SI.split(counts), a_ERI.unbind(0), b_EOR.unbind(0))
            delta_SO = torch.cat([F.linear(F.linear(x_nI, a_RI), b_OR) for x_nI, a_RI, b_OR in pairs])
        return (y_SO + self.scale * delta_SO).to(y_SO.dtype)

    def looped_over(self, x_SD: torch.Tensor, counts_E: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """Experts.looped_over with each projection's adapter (`params` holds them too: this module's own, or the
        local experts' rows under expert parallelism)."""
        if not self.adapter_on:
            return super().looped_over(x_SD, counts_E, params)
        # unbind once, as Experts.looped_over: per-expert indexing would zero-fill a full [E, ...] gradient each
        w_gu, a_gu, b_gu = (params[n].unbind(0) for n in ("gate_up_proj", *self.ADAPTED["gate_up_proj"]))
        w_d, a_d, b_d = (params[n].unbind(0) for n in ("down_proj", *self.ADAPTED["down_proj"]))
        outs = []
        for e, x_nD in enumerate(x_SD.split(counts_E.tolist())):
            if x_nD.shape[0] == 0:
                continue
            h_n2F = lora_linear(x_nD, w_gu[e], None, a_gu[e], b_gu[e], self.scale)
            outs.append(lora_linear(silu_mul(h_n2F), w_d[e], None, a_d[e], b_d[e], self.scale))
        return torch.cat(outs) if outs else x_SD.new_zeros(0, self.dim)

    def extra_repr(self) -> str:
        return f"rank={self.gate_up_lora_A.shape[1]}, scale={self.scale:g}"


ADAPTER_TYPES = (LoRALinear, LoRAExperts)


def linear_module_names(model: nn.Module) -> list[str]:
    """The nn.Linear modules LoRA can target: those of the decoder layers (not lm_head; the router and the routed
    experts are not nn.Linear)."""
    return _decoder_modules(model, nn.Linear)


def expert_module_names(model: nn.Module) -> list[str]:
    """The routed experts (stacked `Experts`) LoRA can target: `model.layers.<i>.mlp.experts` of each MoE layer."""
    return _decoder_modules(model, Experts)


def _decoder_modules(model: nn.Module, kinds: type | tuple[type, ...]) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, kinds) and name.startswith("model.layers.")]


def apply_lora(model: nn.Module, cfg: ActorSection, seed: int = 0) -> list[str]:
    """Freeze every parameter of `model` and wrap the modules `cfg.lora_target_modules` names (linear modules,
    routed experts) in rank `cfg.lora_rank` adapters (scale lora_alpha / lora_rank); returns their names. A is drawn
    from a generator seeded by `seed` (the run's trainer.seed), module by module in model order, not from the global
    RNG, which differs across DP ranks: every rank draws the same adapters."""
    names = cfg.lora_targets(_decoder_modules(model, (nn.Linear, Experts)), set(expert_module_names(model)))
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    scale = cfg.lora_alpha / cfg.lora_rank
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        base = getattr(owner, leaf)
        kind = LoRAExperts if isinstance(base, Experts) else LoRALinear
        setattr(owner, leaf, kind.wrap(base, cfg.lora_rank, scale, generator))
    return names


def lora_meta(cfg: ActorSection) -> dict:
    """The adapters' settings as a LoRA checkpoint's meta.json records them (`lora`)."""
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "target_modules": list(cfg.lora_target_modules)}


def apply_lora_meta(model: nn.Module, meta: dict) -> list[str]:
    """`apply_lora` with the settings a LoRA checkpoint records (`lora_meta`)."""
    return apply_lora(model, ActorSection(lora_rank=meta["rank"], lora_alpha=meta["alpha"],
                                          lora_target_modules=list(meta["target_modules"])))


def merge_and_unload(model: nn.Module) -> None:
    """Each adapted module back to a plain nn.Linear / Experts holding the merged weights (peft's merge_and_unload):
    `model` is then the plain model. Unsharded models only (an export's)."""
    for name, layer in lora_modules(model).items():
        with torch.no_grad():
            for weight, (a, b) in layer.ADAPTED.items():
                getattr(layer, weight).copy_(merge(getattr(layer, weight), getattr(layer, a), getattr(layer, b),
                                                   layer.scale))
        with torch.device("meta"):
            if isinstance(layer, LoRAExperts):
                plain = Experts(layer.num_experts, layer.dim, layer.ffn_dim, layer.impl)
            else:
                plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        for leaf in (*layer.ADAPTED, *(["bias"] if isinstance(layer, LoRALinear) else [])):
            setattr(plain, leaf, getattr(layer, leaf))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, plain)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear | LoRAExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ADAPTER_TYPES)}


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
    """W + scale * B @ A, computed in the adapter's dtype (fp32 for a bf16 W), in W's dtype; stacked experts
    ([E, O, I] from [E, O, R] @ [E, R, I]) merge expert by expert."""
    dtype = adapter_dtype(weight_OI.dtype)
    return (weight_OI.to(dtype) + scale * (b_OR.to(dtype) @ a_RI.to(dtype))).to(weight_OI.dtype)


def adapted_weights(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """Each adapted base weight's state name -> (its A's, its B's state names, scale)."""
    return {f"{name}.{weight}": (f"{name}.{a}", f"{name}.{b}", layer.scale)
            for name, layer in lora_modules(model).items() for weight, (a, b) in layer.ADAPTED.items()}


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's (name, full tensor) stream, in state_dict order: each adapted weight merged under its base
    name, the adapters themselves left out. Collective under FSDP (all ranks iterate)."""
    state = model.state_dict()
    adapted = adapted_weights(model)
    adapters = {leaf for a, b, _ in adapted.values() for leaf in (a, b)}
    for name, tensor in state.items():
        if name in adapters:
            continue
        full = full_tensor(tensor)
        if name in adapted:
            a, b, scale = adapted[name]
            full = merge(full, full_tensor(state[a]), full_tensor(state[b]), scale)
        yield name, full


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under peft's names for the hub-named modules (`base_model.model.<module>.lora_A.weight`, as
    `save_pretrained` names them): a routed experts' stacked adapters become each expert's gate_proj / up_proj /
    down_proj adapters, gate and up sharing the expert's A with B cut in rows (B_gate A and B_up A are exactly the
    two halves of B_gu A). Collective under FSDP (all ranks gather)."""
    state = model.state_dict()
    tensors = {}
    for weight, (a, b, _) in adapted_weights(model).items():
        a_full, b_full = full_tensor(state[a]).cpu(), full_tensor(state[b]).cpu()
        for slot in hub_slots(weight, state[weight].shape, model.cfg):
            module = slot.hub_name.removesuffix(".weight")
            a_RI = a_full if slot.expert is None else a_full[slot.expert]
            # (copies: gate and up share A's storage, which safetensors refuses to write twice)
            tensors[f"base_model.model.{module}.lora_A.weight"] = a_RI.clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = slot.take(b_full).clone()
    return tensors


def save_adapter(model: nn.Module, cfg: ActorSection, out_dir: str | Path, base_model: str,
                 write: bool = True) -> Path | None:
    """The adapters alone in peft's format (adapter_model.safetensors + adapter_config.json), which
    `peft.PeftModel.from_pretrained` loads onto `base_model`'s transformers model (routed experts: where they are
    per-expert nn.Linear modules, as in transformers 4). target_modules lists exactly the adapted modules. Collective
    under FSDP (all ranks gather); only where `write` does it write."""
    tensors = peft_tensors(model)
    if not write:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    modules = sorted({key[len("base_model.model."):].rsplit(".lora_", 1)[0] for key in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
              "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": modules, "fan_in_fan_out": False, "use_rslora": False,
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
