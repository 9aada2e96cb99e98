"""`moeloop plot RUN_DIR`: PNG charts from metrics.jsonl — reward/accuracy curve and stacked phase times."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from moeloop.loop.metrics import PHASES


def read_metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = run_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"no {name} in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    val_rows = read_metrics(run_dir, "val.jsonl") if (run_dir / "val.jsonl").is_file() else []
    steps = [r["step"] for r in rows]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    curves = [(key, rows, None) for key in ("reward/mean", "acc/train")]
    curves += [(key, val_rows, "o") for key in ("acc/val", "acc/val_sampled")]  # held out, from step 0
    for key, source, marker in curves:
        pts = [(r["step"], r[key]) for r in source if key in r]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=key)
    ax.set_xlabel("step"), ax.set_ylabel("value"), ax.set_title("reward and accuracy"), ax.legend()
    written.append(run_dir / "reward.png")
    fig.savefig(written[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [r.get(f"time/{phase}", 0.0) for r in rows]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step"), ax.set_ylabel("seconds"), ax.set_title("time per phase"), ax.legend(fontsize=7)
    written.append(run_dir / "phases.png")
    fig.savefig(written[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: moeloop plot RUN_DIR", file=sys.stderr)
        return 2
    try:
        for path in plot_run(argv[0]):
            print(path)
    except FileNotFoundError as err:
        print(f"moeloop plot: {err}", file=sys.stderr)
        return 2
    return 0
