"""`SamplingParams`: how one request is sampled (n, temperature, top-k/top-p/min-p, repetition penalty, stops, seed,
logprobs)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moeloop.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature 0 means greedy. top_k -1, top_p 1.0, min_p 0 and repetition_penalty 1.0 are off. They apply in
    transformers' `generate` order: the repetition penalty on the raw logits (HF `RepetitionPenaltyLogitsProcessor`,
    vLLM: every token id in the sequence so far, prompt and response, has its logit divided by the penalty when
    > 0, else multiplied; a greedy row takes the argmax of the penalised logits), then temperature, top-k, top-p,
    min-p (HF `MinPLogitsWarper`: drop a token whose probability under the temperature-scaled softmax is below
    min_p times the largest; greedy rows are not affected). Top-p's mass is measured under the temperature-1
    softmax of the (penalised) logits, as the sampler always has (`sampler.nucleus_drop`). `seed` makes the
    request reproducible whatever else is in the batch: sample i of the request draws its noise from (seed, i,
    token index) only. `seed=None` takes a fresh seed from the engine's seed sequence. Logprobs, when on, are
    always those of the raw model distribution at temperature 1 (see `Completion`), not of the sampling one (nor
    of the penalised logits).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; need a detokenize callback on the engine
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True
    # a repetition penalty, or min-p on a sampled row: its logits are processed before the draw, in torch ops
    # (`Sampler`; in multi-step launches too, inside their graphs). Set once here: the runner reads it for every row
    # of every decode step
    processes_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "processes_logits",
                           self.repetition_penalty != 1 or (self.min_p > 0 and self.temperature != 0))
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
        if not 0 <= self.min_p <= 1:
            raise InputError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise InputError(f"SamplingParams.repetition_penalty must be finite and > 0 (1 = off), got "
                             f"{self.repetition_penalty}")
        if self.max_tokens < 1:
            raise InputError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise InputError("SamplingParams.stop: an empty stop string would stop every sample at once")
        if any(t < 0 for t in self.stop_token_ids):
            raise InputError(f"SamplingParams.stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

