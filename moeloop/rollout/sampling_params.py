"""`SamplingParams`: how one request is sampled (n, temperature, top-k/top-p, stops, seed, logprobs)."""
from __future__ import annotations

from dataclasses import dataclass

from moeloop.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature 0 means greedy. top_k -1 and top_p 1.0 are off. `seed` makes the request reproducible
    whatever else is in the batch: sample i of the request draws its noise from (seed, i, token index)
    only. `seed=None` takes a fresh seed from the engine's seed sequence. Logprobs, when on, are always
    those of the raw model distribution at temperature 1 (see `Completion`), not of the sampling one.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; need a detokenize callback on the engine
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.n < 1:
            raise InputError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise InputError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not (self.top_k == -1 or self.top_k > 0):
            raise InputError(f"SamplingParams.top_k must be -1 (off) or > 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InputError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise InputError("SamplingParams.stop: an empty stop string would stop every sample at once")
        if any(t < 0 for t in self.stop_token_ids):
            raise InputError(f"SamplingParams.stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
