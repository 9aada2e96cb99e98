"""The built-in verifiable task: multi-digit addition/subtraction with exact integer answers.

`synthetic:arith` (train) and `synthetic:arith-val` (held out) are disjoint: a problem belongs to
the validation split when a hash of its operands falls in one bucket of ten.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from moeloop.errors import InputError


@dataclass(frozen=True)
class ArithTask:
    num_digits: int = 2
    ops: str = "+"
    size: int = 4096  # rows per split

    def rows(self, split: str, seed: int = 0) -> list[dict]:
        if split not in ("train", "val"):
            raise InputError(f"synthetic split must be train or val, got {split!r}")
        rng = random.Random(f"arith-{self.num_digits}-{self.ops}-{split}-{seed}")
        lo, hi = 10 ** (self.num_digits - 1), 10 ** self.num_digits - 1
        out: list[dict] = []
        while len(out) < self.size:
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.ops)
            if _is_val(a, b, op) != (split == "val"):
                continue
            out.append(self.make_row(a, b, op))
        return out

    @staticmethod
    def make_row(a: int, b: int, op: str) -> dict:
        value = a + b if op == "+" else a - b
        return {"prompt": f"{a}{op}{b}=", "answer": str(value), "response": str(value), "data_source": "synthetic:arith"}


def _is_val(a: int, b: int, op: str) -> bool:
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return digest[0] % 10 == 0


def parse_synthetic_spec(spec: str) -> tuple[ArithTask, str]:
    """"synthetic:arith" -> train split, "synthetic:arith-val" -> held-out split."""
    name = spec.split(":", 1)[1]
    split = "val" if name.endswith("-val") else "train"
    if name.removesuffix("-val") != "arith":
        raise InputError(f"unknown synthetic dataset {spec!r} (known: synthetic:arith, synthetic:arith-val)")
    return ArithTask(), split
