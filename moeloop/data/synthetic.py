"""The built-in verifiable tasks: multi-digit arithmetic with exact integer answers.

`synthetic:arith` (train) and `synthetic:arith-val` (held out): two-digit addition. `synthetic:mul-tools` and
`synthetic:mul-tools-val`: two-digit multiplication, which a tiny model cannot do in its head; each row's SFT response
is a conversation that asks the built-in calculator tool (a Hermes tool call), reads its answer and repeats it, for
multi-turn tool-calling RL (`rollout.multi_turn`). `synthetic:mul-mixed`: the same problems, every other row's SFT
response the bare answer instead, so an SFT model calls the tool about half the time and RL can teach it to call it
always. The splits are disjoint: a problem belongs to the validation split when a hash of its operands falls in one
bucket of ten.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from moeloop.errors import InputError


@dataclass(frozen=True)
class ArithTask:
    num_digits: int = 2
    ops: str = "+"
    size: int = 4096  # rows per split
    tool_calls: bool = False  # the SFT response asks the calculator (a conversation) instead of answering
    direct_every: int = 0  # with tool_calls: every this-many-th row's SFT response is the bare answer (0: none)

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
            direct = self.direct_every > 0 and len(out) % self.direct_every == 0
            out.append(self.make_row(a, b, op, direct))
        return out

    def make_row(self, a: int, b: int, op: str, direct: bool = False) -> dict:
        value = str({"+": a + b, "-": a - b, "*": a * b}[op])
        if not self.tool_calls:
            return {"prompt": f"{a}{op}{b}=", "answer": value, "response": value, "data_source": "synthetic:arith"}
        if direct:
            return {"prompt": f"{a}{op}{b}=", "answer": value, "response": [{"role": "assistant", "content": value}],
                    "data_source": "synthetic:mul-tools"}
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}})
        response = [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                    {"role": "tool", "content": value}, {"role": "assistant", "content": value}]
        return {"prompt": f"{a}{op}{b}=", "answer": value, "response": response, "data_source": "synthetic:mul-tools"}


def _is_val(a: int, b: int, op: str) -> bool:
    digest = hashlib.sha256(f"{a}{op}{b}".encode()).digest()
    return digest[0] % 10 == 0


def parse_synthetic_spec(spec: str) -> tuple[ArithTask, str]:
    """"synthetic:arith" -> train split, "synthetic:arith-val" -> held-out split."""
    name = spec.split(":", 1)[1]
    split = "val" if name.endswith("-val") else "train"
    tasks = {"arith": ArithTask(), "mul-tools": ArithTask(ops="*", tool_calls=True),
             "mul-mixed": ArithTask(ops="*", tool_calls=True, direct_every=2)}
    if name.removesuffix("-val") not in tasks:
        raise InputError(f"unknown synthetic dataset {spec!r} (known: synthetic:arith, synthetic:arith-val, "
                         f"synthetic:mul-tools, synthetic:mul-tools-val, synthetic:mul-mixed)")
    return tasks[name.removesuffix("-val")], split
