"""`moeloop plan CONFIG [key=value ...] [--json]`: memory, layout, split, sync and checkpoint plan before launch.

Exit code 0 when the layout is valid and the peak fits, 1 when not, 2 on a config error.
"""
from __future__ import annotations

import json
import sys

from moeloop.config.load import load_config
from moeloop.plan.build import build_plan
from moeloop.plan.report import render


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--json"]
    if not args or args[0] in ("-h", "--help"):
        print("usage: moeloop plan CONFIG [key=value ...] [--json]", file=sys.stderr)
        return 2
    try:
        plan = build_plan(load_config(args[0], args[1:]))
    except (ValueError, FileNotFoundError) as err:
        print(f"moeloop plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if "--json" in argv else render(plan), end="" if "--json" not in argv else "\n")
    return 0 if not plan.problems and plan.gpu_verdict != "OOM" else 1
