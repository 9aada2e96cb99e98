"""`moeloop generate`: sample completions for a JSONL file of prompts with the rollout engine.

    moeloop generate MODEL_DIR --prompts p.jsonl --out o.jsonl [--temperature T] [--top-p P] [--top-k K]
                     [--min-p P] [--repetition-penalty R] [--max-tokens N] [--n N] [--seed S] [--stop STR ...]
                     [--stop-token-id ID ...] [--ignore-eos] [--device cpu|cuda] [--dtype float32|bfloat16]

Input lines: {"prompt": "..."} or {"messages": [...]} (chat template of MODEL_DIR's tokenizer).
Output lines: prompt, sample_index, completion (text), response_token_ids, logprobs, finish_reason, policy_version.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moeloop.config.schema import RolloutSection
from moeloop.data.dataset import chat_messages, json_object, render_chat
from moeloop.errors import InputError
from moeloop.rollout.engine import Engine
from moeloop.rollout.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _device(text: str) -> str:
    """--device as argparse checks it: cpu, or a visible CUDA device."""
    if text == "cpu":
        return text
    kind, _, index = text.partition(":")
    if kind != "cuda" or not (index == "" or index.isdigit()):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    if torch.cuda.device_count() <= int(index or 0):
        raise argparse.ArgumentTypeError(f"{text}: {torch.cuda.device_count()} CUDA devices are visible")
    return text


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moeloop generate", description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--prompts", required=True, help="JSONL with a 'prompt' or 'messages' field per line")
    p.add_argument("--out", required=True)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (transformers/vLLM semantics)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string (repeatable): a sample ends once its text holds one (kept in the completion)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[],
                   help="stop token id (repeatable), besides the model's EOS; kept in response_token_ids")
    p.add_argument("--ignore-eos", action="store_true", help="generate through EOS up to --max-tokens")
    p.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when one is visible)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-bytes", type=int, default=0, help="0 = a fraction of free GPU memory / 256 MiB on CPU")
    return p.parse_args(argv)


def read_prompts(path: Path, tokenizer, max_tokens: int, max_model_len: int) -> tuple[list[str], list[list[int]]]:
    """(prompt texts, their token ids) of a prompts file; a bad line (its JSON, fields, or a prompt with no tokens
    or too many for max_model_len with max_tokens more) is an InputError naming the file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    texts, ids = [], []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        row = json_object(line, where)
        if "messages" in row:
            messages = chat_messages(row["messages"], f"{where}: 'messages'")
            if not getattr(tokenizer, "chat_template", None):
                raise InputError(f"{where}: 'messages' are rendered by the tokenizer's chat template, and this model's "
                                 f"tokenizer has none (give the text as 'prompt')")
            text = render_chat(tokenizer, messages, where)
        elif "prompt" in row:
            text = row["prompt"]
            if not isinstance(text, str):
                raise InputError(f"{where}: 'prompt' must be a string, got {type(text).__name__} (chat turns go in "
                                 f"'messages')")
        else:
            raise InputError(f"{where}: needs a 'prompt' or 'messages' field")
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not tokens:
            raise InputError(f"{where}: the prompt has no tokens")
        if len(tokens) + max_tokens > max_model_len:
            raise InputError(f"{where}: the prompt's {len(tokens)} tokens + --max-tokens {max_tokens} are more than "
                             f"--max-model-len {max_model_len}")
        texts.append(text)
        ids.append(tokens)
    return texts, ids


def main(argv: list[str]) -> int:
    from moeloop.model.hf_io import load_pretrained
    from moeloop.model.tokenizer import load_folder_tokenizer
    args = parse_args(argv)
    out = Path(args.out)
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):  # checked before anything is generated
        raise InputError(f"--out {out}: {out.parent} is not a writable directory")
    if out.resolve() == Path(args.prompts).resolve():  # (the completions replaced the prompts)
        raise InputError(f"--out {out}: is the --prompts file; write the completions to another file")
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")]
    tokenizer = load_folder_tokenizer(args.model_dir, "model_dir")
    texts, prompt_ids = read_prompts(Path(args.prompts), tokenizer, args.max_tokens, args.max_model_len)
    # the flags checked before the model loads
    params = [SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             min_p=args.min_p, repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
                             seed=args.seed + i, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
                             ignore_eos=args.ignore_eos)
              for i in range(len(prompt_ids))]
    model = load_pretrained(args.model_dir, dtype=dtype, device=args.device)
    cfg_eos = model.cfg.eos_token_id
    eos = {t for t in [tokenizer.eos_token_id, *(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])] if t is not None}
    cfg = RolloutSection(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         kv_cache_bytes=args.kv_cache_bytes)
    engine = Engine(model, cfg, detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    eos_token_ids=eos, seed=args.seed)
    start = time.perf_counter()
    with tqdm(total=len(prompt_ids) * args.n, desc="generate", unit="sample", file=sys.stderr) as bar:
        outs = engine.generate(prompt_ids, params, progress=bar.update)
    elapsed = time.perf_counter() - start
    partial = out.with_name(out.name + ".tmp")  # written whole, then renamed: a failed write leaves an older --out
    with open(partial, "w") as f:
        for c in outs:
            f.write(json.dumps({"prompt": texts[int(c.request_id)], "sample_index": c.sample_index,
                                "completion": c.text, "response_token_ids": c.response_ids, "logprobs": c.logprobs,
                                "finish_reason": c.finish_reason, "policy_version": c.policy_version}) + "\n")
    partial.replace(out)
    num_tokens = sum(len(c.response_ids) for c in outs)
    print(f"{len(outs)} samples, {num_tokens} generated tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tok/s "
          f"({engine.num_prefill_tokens} prefill tokens, {engine.scheduler.num_preemptions} preemptions) -> {args.out}")
    return 0
