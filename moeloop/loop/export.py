"""HF export from a (possibly sharded) trainer: gather full tensors, write hub safetensors, reload and compare.

Collective under FSDP: every rank iterates the weights; rank 0 writes and verifies.
Under LoRA the export is the merged model, and the adapters alone go beside it in peft's format (`export_policy`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from moeloop.model.config import ModelConfig
from moeloop.model.hf_io import load_pretrained, save_pretrained
from moeloop.model.transformer import MoEForCausalLM
from moeloop.train.actor import Actor
from moeloop.train.lora import save_adapter


def export_hf(named_weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, out_dir: str | Path,
              tokenizer_dir: str | Path | None, write: bool = True, verify: bool = True) -> Path | None:
    """Write `out_dir` from a full-tensor stream; re-load it and check every tensor equals the stream."""
    state = {name: t.detach().cpu() for name, t in named_weights}
    if not write:
        return None
    with torch.device("meta"):
        shell = MoEForCausalLM(cfg)
    shell.load_state_dict(state, assign=True, strict=True)
    out = save_pretrained(shell, out_dir, tokenizer_dir=tokenizer_dir, cfg=cfg)
    if verify:
        reloaded = load_pretrained(out, dtype=next(iter(state.values())).dtype).state_dict()
        bad = [n for n, t in state.items() if not torch.equal(reloaded[n], t)]
        if bad:
            raise RuntimeError(f"HF export in {out} does not reload to the same weights: {bad[:4]}")
    return out


def export_policy(actor: Actor, run_dir: Path, model_path: str, write: bool = True) -> None:
    """The run's policy export: <run_dir>/hf (the full model; under LoRA merged) and, under LoRA, <run_dir>/lora_adapter
    (the adapters, for peft over model.path's model, as verl's lora_adapter folder)."""
    export_hf(actor.named_weights(), actor.model.cfg, run_dir / "hf", model_path, write=write)
    if actor.lora_modules:
        save_adapter(actor.model, actor.cfg, run_dir / "lora_adapter", model_path, write=write)
