"""A deterministic, resumable order over a dataset: epoch-wise seeded permutations and a cursor.

The state is two integers (epoch, offset), saved with every checkpoint, so a resumed run sees
exactly the prompts an uninterrupted run would have seen.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeloop.errors import InputError


@dataclass
class EpochCursor:
    num_rows: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.num_rows <= 0:
            raise InputError("dataset is empty: no rows to iterate over")

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def take(self, count: int) -> list[int]:
        """The next `count` row indices, wrapping into the next epoch (with a new permutation)."""
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.epoch)
            chunk = order[self.offset:self.offset + count - len(out)]
            out.extend(int(i) for i in chunk)
            self.offset += len(chunk)
            if self.offset >= self.num_rows:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != self.num_rows:
            raise InputError(f"the checkpoint's data cursor runs over {state['num_rows']} training rows, and "
                             f"data.train_files now give {self.num_rows} (after data.train_max_samples and "
                             f"data.truncation): resume on the data it was saved with")
        self.epoch, self.offset, self.seed = state["epoch"], state["offset"], state["seed"]
