"""`moeloop ckpt export CKPT_DIR --model MODEL_DIR --out OUT_DIR`: a DCP checkpoint (any layout it was
saved at) -> hub-named safetensors that `transformers` loads. MODEL_DIR gives config.json and tokenizer (and, for
a LoRA checkpoint, the base weights its adapters are merged into)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moeloop.checkpoint.manager import CheckpointManager
from moeloop.errors import InputError


def export_checkpoint(ckpt: str | Path, model_dir: str | Path, out_dir: str | Path) -> Path:
    from moeloop.model.hf_io import load_pretrained, save_pretrained
    from moeloop.model.tokenizer import load_folder_tokenizer
    from moeloop.train.lora import apply_lora_meta, merge_and_unload

    load_folder_tokenizer(model_dir, "--model")  # the folder, its config.json and its tokenizer, checked first
    if Path(out_dir).resolve() == Path(model_dir).resolve():  # (the export replaced the model it reads)
        raise InputError(f"--out {out_dir}: is the --model folder; export to another folder")
    ckpt = Path(ckpt)
    if (ckpt / "latest").is_file():  # a checkpoint directory: take its newest complete save
        ckpt = CheckpointManager(ckpt).latest() or ckpt
    if not (ckpt / ".metadata").is_file():
        raise FileNotFoundError(f"{ckpt} is not a DCP checkpoint (no .metadata)")
    model = load_pretrained(model_dir)
    lora = json.loads((ckpt / "meta.json").read_text()).get("lora") if (ckpt / "meta.json").is_file() else None
    if lora is not None:  # the checkpoint holds the adapters only: MODEL_DIR's weights are their base
        apply_lora_meta(model, lora)
    CheckpointManager(ckpt.parent).load(ckpt, model, optimizer=None, trainable_only=lora is not None)
    merge_and_unload(model)
    return save_pretrained(model, out_dir, tokenizer_dir=model_dir)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moeloop ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    export = sub.add_parser("export", help="DCP checkpoint -> HF safetensors")
    export.add_argument("ckpt", help="a step_N directory, or a checkpoints directory (its latest)")
    export.add_argument("--model", required=True, help="model folder with config.json and tokenizer")
    export.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    print(export_checkpoint(args.ckpt, args.model, args.out))
    return 0
