"""Forward+backward tokens/s and peak memory: moeloop's MoEForCausalLM vs transformers' Qwen3MoeForCausalLM on
the same config and weights (seeded HF init, loaded into ours), same token batch, in one run.

    python benchmarks/model.py                                    # tiny, CPU, fp32
    python benchmarks/model.py --device cuda --size reference --dtype bfloat16

Each side runs in its own subprocess so memory numbers do not interfere. One warm-up step, then memory of the
second step: CUDA = peak allocated minus allocated before it (parameters excluded, gradients included); CPU =
peak RSS sampled every 1 ms minus RSS before it, with glibc's mmap threshold pinned at 64 KiB so freed tensors
go back to the OS. Loss = next-token cross entropy over full logits (both); the first-step losses of both
sides are printed as a same-weights check.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

SIZES = {
    "tiny": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 seqs=4, seq_len=256),
    "reference": dict(vocab_size=32000, hidden_size=1536, num_hidden_layers=16, num_attention_heads=12,
                      num_key_value_heads=4, head_dim=128, intermediate_size=4096, num_experts=64,
                      num_experts_per_tok=4, moe_intermediate_size=512, seqs=4, seq_len=2048),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--experts-impl", default="auto", help="moeloop experts: auto | grouped_mm | loop")
    p.add_argument("--hf-experts-impl", default=None, help="transformers experts_implementation (default: its own)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="both sides")
    p.add_argument("--only", choices=["transformers", "moeloop"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def build_hf(args: argparse.Namespace) -> torch.nn.Module:
    import transformers
    size = {k: v for k, v in SIZES[args.size].items() if k not in ("seqs", "seq_len")}
    cfg = transformers.Qwen3MoeConfig(**size, norm_topk_prob=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    kw = {"experts_implementation": args.hf_experts_impl} if args.hf_experts_impl else {}
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype), **kw)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def build_ours(args: argparse.Namespace, hf: torch.nn.Module) -> torch.nn.Module:
    from moeloop.model import ModelConfig, MoEForCausalLM
    with torch.device("meta"):
        model = MoEForCausalLM(ModelConfig.from_hf_dict(hf.config.to_dict()), experts_impl=args.experts_impl,
                               gradient_checkpointing=args.gradient_checkpointing)
    model.load_state_dict(hf.state_dict(), strict=True, assign=True)
    model.tie_weights()
    return model.train()


def make_step(args: argparse.Namespace, model: torch.nn.Module, ids_BS: torch.Tensor):
    B, S = ids_BS.shape
    labels = ids_BS[:, 1:].reshape(-1)

    def step() -> float:
        if args.only == "transformers":
            logits = model(input_ids=ids_BS).logits
        else:
            logits = model.compute_logits(model.forward_packed(ids_BS.reshape(-1), [S] * B)).view(B, S, -1)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels)
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.item()
    return step


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_step(args: argparse.Namespace, step) -> tuple[float, float]:
    """(loss, peak extra MiB) of one step."""
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = step()
        torch.cuda.synchronize()
        return loss, (torch.cuda.max_memory_allocated() - before) / 2**20
    before, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)
    sampler = threading.Thread(target=sample)
    sampler.start()
    loss = step()
    done.set()
    sampler.join()
    return loss, (max(peak[0], _rss_bytes()) - before) / 2**20


def run_one(args: argparse.Namespace) -> dict:
    hf = build_hf(args)
    model = hf if args.only == "transformers" else build_ours(args, hf)
    del hf
    size = SIZES[args.size]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab_size"], (size["seqs"], size["seq_len"]), generator=g).to(args.device)
    step = make_step(args, model, ids)
    loss = step()  # warm-up: one-time initialisations stay out of the memory figure
    _, peak_mib = measure_step(args, step)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    return dict(loss=loss, peak_mib=peak_mib, step_s=step_s, tokens_per_s=ids.numel() / step_s)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.only:
        print(json.dumps(run_one(args)))
        return
    size = SIZES[args.size]
    tokens = size["seqs"] * size["seq_len"]
    print(f"size={args.size} device={args.device} dtype={args.dtype} tokens/step={tokens} "
          f"({size['seqs']}x{size['seq_len']}) steps={args.steps} moeloop experts_impl={args.experts_impl} "
          f"hf experts_impl={args.hf_experts_impl or 'default'} grad_ckpt={args.gradient_checkpointing} "
          f"torch={torch.__version__} threads={torch.get_num_threads()}")
    results = {}
    for side in ("transformers", "moeloop"):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--only", side]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        results[side] = r = json.loads(out.strip().splitlines()[-1])
        print(f"{side:>12}: {r['tokens_per_s']:10.0f} tokens/s  step {r['step_s'] * 1e3:9.1f} ms  "
              f"peak +{r['peak_mib']:9.1f} MiB  first-step loss {r['loss']:.5f}")
    ours, ref = results["moeloop"], results["transformers"]
    print(f"moeloop/transformers: tokens/s {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x, "
          f"peak memory {ours['peak_mib'] / max(ref['peak_mib'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
