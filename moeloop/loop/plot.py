"""`moeloop plot RUN_DIR`: PNG charts from metrics.jsonl — reward/accuracy curve (an SFT run: train and held-out
loss) and stacked phase times."""
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


def curves(rows: list[dict], val_rows: list[dict]) -> dict[str, tuple[list[tuple[int, float]], str | None]]:
    """The first chart's series, label -> ((step, value) points, marker): an RL run's reward and accuracy (the
    held-out ones, pass@k among them, with markers), or an SFT run's train and held-out loss."""
    passes = sorted({k for r in val_rows for k in r if k.startswith("acc/val_pass@") and k.count("/") == 1})
    if any("sft_loss" in r for r in rows):
        train_keys, val_keys = ("sft_loss",), ("val/sft_loss",)
    else:
        train_keys, val_keys = ("reward/mean", "acc/train"), ("acc/val", "acc/val_sampled", *passes)
    out = {}
    for keys, source, marker in ((train_keys, rows, None), (val_keys, val_rows, "o")):  # held out: from step 0
        for key in keys:
            points = [(r["step"], r[key]) for r in source if key in r]
            if points:
                out[key] = (points, marker)
    return out


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
    sft = any("sft_loss" in r for r in rows)
    for key, (points, marker) in curves(rows, val_rows).items():
        ax.plot(*zip(*points), marker=marker, label=key)
    ax.set_xlabel("step"), ax.set_ylabel("loss" if sft else "value"), ax.legend()
    ax.set_title("SFT loss" if sft else "reward and accuracy")
    written.append(run_dir / ("loss.png" if sft else "reward.png"))
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
    if argv in (["-h"], ["--help"]):  # (it looked for a run directory named --help)
        print("usage: moeloop plot RUN_DIR")
        return 0
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
