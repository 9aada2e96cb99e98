"""`moeloop config show FILE [overrides]`: print the resolved, validated config as YAML."""
from __future__ import annotations

import sys

from moeloop.config.load import load_config, to_yaml


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "show":
        print("usage: moeloop config show FILE [key=value ...]", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[1], argv[2:])
    except (ValueError, FileNotFoundError) as err:
        print(f"moeloop config: {err}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0
