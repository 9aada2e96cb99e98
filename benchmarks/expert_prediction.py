"""How well a layer's input predicts the experts its router will pick: the speculation behind the B=1 expert
prefetch (`rollout.expert_prefetch`). Per MoE layer, the share of the routed experts (the top-k of the
router on the post-attention norm of h + attn(h)) found among the top S of the router on the post-attention norm
of h alone, for one random-token sequence through a random-init model (as `rollout.py` decodes it).

    python benchmarks/expert_prediction.py [--size reference] [--tokens 384] [--spec 4,6,8,12]

CPU is enough (the reference model in bf16 takes ~5 GB and about half a minute to build)."""
from __future__ import annotations

import argparse
import time

import torch

from moeloop.model.factory import build_model
from moeloop.model.moe import MoE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--size", default="reference")
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--spec", default="4,6,8,12", help="the S values: experts prefetched per layer")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    spec_sizes = [int(s) for s in args.spec.split(",")]
    t0 = time.perf_counter()
    model = build_model(args.arch, args.size, args.seed).to(torch.bfloat16).eval()
    print(f"{args.arch}/{args.size}, bf16, built in {time.perf_counter() - t0:.0f} s; {args.tokens} random tokens")
    seen: dict[tuple[str, int], torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            layer.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("in", i), a[0].detach()))
            layer.mlp.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("y", i), a[0].detach()))
    ids = torch.randint(0, model.cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        model.forward_packed(ids, [args.tokens])
        hits = {s: [] for s in spec_sizes}
        for i, layer in enumerate(model.model.layers):
            if ("y", i) not in seen:
                continue
            router = layer.mlp.gate
            w = router.weight.float()
            routed = (seen[("y", i)].float() @ w.T).topk(router.top_k, -1).indices
            guess = layer.post_attention_layernorm(seen[("in", i)]).float() @ w.T
            row = []
            for s in spec_sizes:
                top = guess.topk(s, -1).indices
                hit = (routed[:, :, None] == top[:, None, :]).any(-1).float().mean().item()
                hits[s].append(hit)
                row.append(f"S={s}: {hit:.3f}")
            print(f"layer {i:2d}: " + "  ".join(row))
    print("mean over layers: " + "  ".join(f"S={s}: {sum(h) / len(h):.3f}" for s, h in hits.items()))


if __name__ == "__main__":
    main()
