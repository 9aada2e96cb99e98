"""`RewardStats`: what one `RewardPool.score` call reports, counts plus rates per sample."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardStats:
    """Rates divide a count by `num_samples`. Each count is of samples, except `retried`: attempts, so its rate can
    pass 1."""
    num_samples: int = 0
    scored: int = 0  # samples with a reward from the function
    timed_out: int = 0  # samples with at least one attempt that hit reward.timeout_s (once each)
    errored: int = 0  # samples with at least one attempt that raised (once each, however many attempts raised)
    retried: int = 0  # attempts after the first, whatever failed before them
    rejected: int = 0  # samples refused by the open circuit breaker
    fallen_back: int = 0  # samples given the fallback (status "fallback" or "masked")
    masked: int = 0  # of those, samples excluded from the loss
    elapsed_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # last error of each fallen-back sample

    def rate(self, count: int) -> float:
        return count / self.num_samples if self.num_samples else 0.0

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat numbers for the step log: counts, per-sample rates and the wall time."""
        counts = {"scored": self.scored, "timed_out": self.timed_out, "errored": self.errored,
                  "retried": self.retried, "rejected": self.rejected, "fallen_back": self.fallen_back,
                  "masked": self.masked}
        out = {f"{prefix}{k}": float(v) for k, v in counts.items()}
        out.update({f"{prefix}{k}_rate": self.rate(v) for k, v in counts.items()})
        out[f"{prefix}samples"] = float(self.num_samples)
        out[f"{prefix}elapsed_s"] = self.elapsed_s
        return out
