"""Where the actor update's time goes: moeloop's `Actor.update` vs a TRL-style padded forward/backward of the
same model (transformers, bf16) on the same GRPO batch, in one run, plus the top CUDA kernels of moeloop's update.

    python benchmarks/profile_update.py                      # H200: reference Qwen3-MoE, 16 x 8 x (20 + 256) tokens
    python benchmarks/profile_update.py --micro-batch-tokens 40000,16384

The transformers side is what TRL's update does per step (on-policy, no KL): one padded forward of
prompt + completion, log-softmax of the completion logits, the clipped loss, backward, clip, AdamW.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cuda_kernels import kernel_times
from moeloop.config import load_config
from moeloop.model.factory import build_model, init_model
from moeloop.train.actor import Actor
from moeloop.types import Sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_samples(groups: int, n: int, prompt_len: int, new_tokens: int, vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for gi in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len + gi % 5,), generator=g).tolist()
        for _ in range(n):
            resp = torch.randint(3, vocab, (new_tokens,), generator=g).tolist()
            adv = float(torch.randn((), generator=g))
            out.append(Sample(prompt_ids=prompt, response_ids=resp, group_id=gi, loss_mask=[1] * new_tokens,
                              advantages=[adv] * new_tokens, old_logprobs=None))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def time_it(fn, repeats: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def top_kernels(fn, top: int) -> None:
    if not torch.cuda.is_available():
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    by_name = kernel_times(prof)
    total = sum(sum(v) for v in by_name.values())
    print(f"    GPU busy {total / 1e3:.1f} ms, {sum(len(v) for v in by_name.values())} kernels")
    for name, ts in list(by_name.items())[:top]:
        print(f"    {sum(ts) / 1e3:8.2f} ms {len(ts):6d}x  {name[:110]}")


def top_ops(fn, top: int) -> None:
    """The aten ops that launch the most GPU time (self time: kernels launched by the op itself)."""
    if not torch.cuda.is_available() or top <= 0:
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))


def host_stalls(fn, top: int) -> None:
    """Where the host waits on the GPU or the GPU on the host: each synchronizing CUDA call of one `fn()` by the
    source line that made it (torch's sync debug mode), and the GPU's idle gaps between kernels."""
    if not torch.cuda.is_available() or top <= 0:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print(f"    host syncs: {sum(lines.values())} (by source line: {', '.join(f'{k} x{v}' for k, v in lines.most_common(top))})")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA")
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    idle = sum(g for g, _, _ in gaps)
    print(f"    GPU span {(spans[-1][1] - spans[0][0]) / 1e3:.1f} ms, idle between kernels {idle / 1e3:.1f} ms "
          f"({sum(g > 100 for g, _, _ in gaps)} gaps over 0.1 ms); the largest:")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"    {g / 1e3:7.2f} ms after {before[:60]} before {after[:60]}")


def hf_update(model_dir: Path, samples: list[Sample], lr: float):
    """TRL's update in miniature: padded batch, logits -> selective log-softmax, clipped loss, backward, AdamW."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    P = max(len(s.prompt_ids) for s in samples)
    C = len(samples[0].response_ids)
    ids = torch.zeros(len(samples), P + C, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(samples):  # left-padded prompts, as TRL
        ids[i, P - len(s.prompt_ids):P] = torch.tensor(s.prompt_ids)
        ids[i, P:] = torch.tensor(s.response_ids)
        attn[i, P - len(s.prompt_ids):] = 1
    adv = torch.tensor([s.advantages[0] for s in samples])
    ids, attn, adv = ids.to(DEVICE), attn.to(DEVICE), adv.to(DEVICE)

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=C + 1).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss = -(torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="reference")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", default="16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--ops", type=int, default=0, help="also print the top N aten ops by GPU self time")
    ap.add_argument("--host", type=int, default=0, help="also print the update's host syncs by source line and "
                    "the N largest GPU idle gaps")
    ap.add_argument("--zero-adv", action="store_true", help="every advantage 0 (a batch whose groups' rewards are all "
                    "equal): the update with nothing to train (actor.skip_zero_advantage)")
    ap.add_argument("--masters", default="on", help="fp32 master weights (model.fp32_master_weights): on, off, "
                    "or on,off to compare them in one run")
    args = ap.parse_args()
    model_dir = Path(tempfile.gettempdir()) / "moeloop_e2e_vs_trl" / f"model-{args.size}"  # e2e_vs_trl.py's model
    if not (model_dir / "config.json").exists():
        init_model("qwen3_moe", args.size, model_dir, seed=0)
    vocab = build_model("qwen3_moe", args.size, seed=0).cfg.vocab_size
    samples = make_samples(args.groups, args.n, args.prompt_len, args.new_tokens, vocab)
    if args.zero_adv:
        for s in samples:
            s.advantages = [0.0] * len(s.response_ids)
    tokens = sum(s.num_tokens for s in samples)
    print(f"batch: {len(samples)} samples, {tokens} tokens; torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    runs = [(int(b), m == "on") for b in args.micro_batch_tokens.split(",") for m in args.masters.split(",")]
    for budget, masters in runs:
        cfg = load_config(str(Path(__file__).resolve().parents[1] / "examples/tiny.yaml"), [
            f"model.path={model_dir}", "model.dtype=bfloat16", "actor.optim.lr=1e-6",
            f"actor.ppo_mini_batch_size={args.groups}", f"actor.max_tokens_per_micro_batch={budget}",
            "actor.use_kl_loss=false"])
        model = build_model("qwen3_moe", args.size, seed=0).to(torch.bfloat16)
        actor = Actor(model, cfg.actor, DEVICE, args.new_tokens, cfg.model.logprob_chunk_tokens,
                      master_weights=masters)
        step = lambda: actor.update(samples)  # noqa: E731
        s = time_it(step, args.repeats)
        print(f"moeloop Actor.update, micro-batch budget {budget}, fp32 masters {'on' if masters else 'off'}: "
              f"{s:.3f} s/update "
              f"({len(actor.micro_batches(samples))} micro-batches), peak {peak_gib():.1f} GiB")
        top_kernels(step, args.top)
        top_ops(step, args.ops)
        host_stalls(step, args.host)
        del actor, model, step
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if not args.skip_hf:
        step = hf_update(model_dir, samples, 1e-6)
        s = time_it(step, args.repeats)
        print(f"transformers padded fwd/bwd + AdamW (TRL-style update): {s:.3f} s/update, "
              f"peak {peak_gib():.1f} GiB")
        top_kernels(step, args.top)


if __name__ == "__main__":
    main()
