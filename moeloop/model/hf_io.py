"""HF checkpoint folders: load sharded safetensors into our model, save them in the hub's per-expert naming.

    model = load_pretrained("ckpt/", dtype=torch.bfloat16, device="cuda")
    save_pretrained(model, "out/", max_shard_bytes=2 * 2**30, tokenizer_dir="ckpt/")

Loading accepts hub per-expert names (what `transformers.save_pretrained` and the hub write, incl. Mixtral's
`block_sparse_moe.experts.{e}.w1/w3/w2`) and fused in-memory names, mixed freely. It copies each file tensor
straight into its slot of the model's parameter, so peak memory is the model plus one tensor read.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moeloop.model.config import ModelConfig
from moeloop.model.hf_names import HubSlot, canonical_hub_name, hub_named_tensors, hub_slots

if TYPE_CHECKING:
    from moeloop.model.transformer import MoEForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")
DEFAULT_SHARD_BYTES = 4 * 2**30


def load_pretrained(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> "MoEForCausalLM":
    """Build `MoEForCausalLM` from `model_dir/config.json` and fill it from the folder's safetensors.

    Parameters are created on the meta device (no memory, no random init) and then allocated once, in
    `dtype` on `device`, as the files are read.
    """
    from moeloop.model.transformer import MoEForCausalLM  # the model imports nothing from here
    cfg = ModelConfig.from_pretrained(model_dir)
    with _parameters_on_meta():
        model = MoEForCausalLM(cfg)
    load_weights(model, model_dir, cfg, dtype=dtype, device=device)
    return model.to(device).eval()


def load_weights(model: nn.Module, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
    """Fill every parameter and persistent buffer of `model` (in-memory names) from `model_dir`'s safetensors.

    Each tensor is allocated anew, parameters in `dtype` (default: keep theirs), on `device` (default: where
    it is now; required for meta tensors), and swapped in once all files are read; buffers keep their dtype.
    Raises ValueError naming the tensor and file for missing, unexpected or mis-shaped tensors.
    """
    targets = _load_targets(model, cfg, dtype, device)
    slots = _expected_slots(model, cfg)
    seen: set[str] = set()
    for hub_name, path, handle in _iter_file_tensors(Path(model_dir)):
        slot = slots.get(hub_name) or slots.get(canonical_hub_name(hub_name, cfg)) or _fused_target(hub_name, targets)
        if slot is not None:
            _copy(slot, hub_name, path, handle, targets, seen)
        elif not _is_ignored(hub_name, cfg):
            raise ValueError(f"unexpected tensor {hub_name!r} in {path} (no such tensor in a {cfg.model_type} "
                             f"model with this config.json)")
    missing = [s.hub_name for s in slots.values() if s.hub_name not in seen and s.mem_name not in seen]
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in {model_dir} ({len(missing)} missing in all, "
                         f"e.g. {missing[:4]})")
    _assign(model, targets)
    if cfg.tie_word_embeddings and hasattr(model, "tie_weights"):
        model.tie_weights()


def save_pretrained(model: nn.Module, out_dir: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    tokenizer_dir: str | Path | None = None, *, cfg: ModelConfig | None = None) -> Path:
    """Write config.json, hub-named safetensors shards (+ index when > 1 shard) and tokenizer files.

    `cfg` defaults to `model.cfg`. Earlier `model*.safetensors` files and the index in `out_dir` are removed
    first so that shards from a previous save can't be mixed in. Returns `out_dir`.
    """
    cfg = cfg if cfg is not None else model.cfg
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model-*-of-*.safetensors"), out / SINGLE_FILE, out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    items = [(n, t) for n, t in model.state_dict().items()
             if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    shards = _plan_shards(list(hub_named_tensors(items, cfg)), max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        tensors = {n: _owned_cpu(t) for n, t in shard}
        save_file(tensors, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    _write_config(cfg, out, next(model.parameters()).dtype)
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return out


def copy_tokenizer(src_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Copy the tokenizer files that exist in `src_dir` into `out_dir`."""
    src, out = Path(src_dir), Path(out_dir)
    if src.resolve() == out.resolve():
        return []
    copied = [Path(shutil.copy2(src / n, out / n)) for n in TOKENIZER_FILES if (src / n).is_file()]
    if not copied:
        raise ValueError(f"tokenizer_dir={src} holds none of {', '.join(TOKENIZER_FILES[:3])}")
    return copied


# -- loading -------------------------------------------------------------------------------------------------

def _load_targets(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype | None,
                  device: str | torch.device | None) -> dict[str, torch.Tensor]:
    """Fresh, uninitialised tensors (one per in-memory name in the state dict) that loading fills."""
    targets = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        want = dtype if (dtype is not None and isinstance(t, nn.Parameter) and t.is_floating_point()) else t.dtype
        where = device if device is not None else t.device
        if torch.device(where).type == "meta":
            raise ValueError(f"{name} is on the meta device: pass device= to load_weights")
        targets[name] = torch.empty(t.shape, dtype=want, device=where)
    return targets


def _expected_slots(model: nn.Module, cfg: ModelConfig) -> dict[str, HubSlot]:
    slots = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        for slot in hub_slots(name, t.shape, cfg):
            slots[slot.hub_name] = slot
    return slots


def _fused_target(name: str, targets: dict[str, torch.Tensor]) -> HubSlot | None:
    """A file tensor stored under its fused in-memory name fills the whole target."""
    mem_name = name.replace(".block_sparse_moe.", ".mlp.", 1)
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and mem_name in targets:
        return HubSlot(name, mem_name, shape=tuple(targets[mem_name].shape))
    return None


def _is_ignored(name: str, cfg: ModelConfig) -> bool:
    """A tied lm_head copy, and DeepSeek-V3's multi-token-prediction layers past num_hidden_layers, are skipped."""
    if cfg.tie_word_embeddings and name == "lm_head.weight":
        return True
    if cfg.model_type != "deepseek_v3" or not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= cfg.num_layers


def _copy(slot: HubSlot, name: str, path: Path, handle, targets: dict[str, torch.Tensor], seen: set[str]) -> None:
    if slot.hub_name in seen or slot.mem_name in seen:
        raise ValueError(f"duplicate tensor {name!r} in {path} (already loaded from another spelling or file)")
    src = handle.get_tensor(name)
    if tuple(src.shape) != slot.shape:
        raise ValueError(f"tensor {name!r} in {path} has shape {tuple(src.shape)}, the model expects "
                         f"{slot.shape} from config.json")
    slot.take(targets[slot.mem_name]).copy_(src)
    seen.add(slot.hub_name)
    if slot.expert is None:
        seen.add(slot.mem_name)


def _iter_file_tensors(model_dir: Path) -> Iterator[tuple[str, Path, object]]:
    """(name, file, open handle) for every tensor in the folder, one file open at a time."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (model_dir / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {model_dir}")
    for fname in files:
        path = model_dir / fname
        if not path.is_file():
            raise FileNotFoundError(f"{INDEX_FILE} names {fname}, which is not in {model_dir}")
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, path, handle


def _assign(model: nn.Module, targets: dict[str, torch.Tensor]) -> None:
    """Swap the filled tensors in as new Parameters/buffers (the caller re-ties shared weights)."""
    for name, tensor in targets.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        current = getattr(module, leaf)
        if isinstance(current, nn.Parameter):
            setattr(module, leaf, nn.Parameter(tensor, requires_grad=current.requires_grad))
        else:
            module._buffers[leaf] = tensor


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Register every new Parameter on the meta device; buffers and plain tensors stay real (as accelerate's
    init_empty_weights). The model then skips its random init, and loading allocates each tensor once."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)
    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


# -- saving --------------------------------------------------------------------------------------------------

def _plan_shards(items: list[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy, in order: start a new shard when the next tensor would push this one past `max_shard_bytes`."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def _owned_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with its own storage (safetensors refuses tensors that share memory)."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu").contiguous()
    return t.clone(memory_format=torch.contiguous_format)


def _write_config(cfg: ModelConfig, out: Path, dtype: torch.dtype) -> None:
    hf = dict(cfg.hf_config)
    hf["dtype"] = str(dtype).removeprefix("torch.")
    hf.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
