"""`CircuitBreaker`: stop calling a reward backend that keeps failing, probe it again later.

closed --(threshold consecutive failures)--> open --(reset_s elapsed)--> half-open (one probe)
half-open --success--> closed; half-open --failure--> open. threshold=0 disables it.
Not thread-safe: the `RewardPool` uses it from its event loop only.
"""
from __future__ import annotations

import time


class CircuitBreaker:
    def __init__(self, threshold: int = 10, reset_s: float = 5.0) -> None:
        if threshold < 0 or reset_s <= 0:
            raise ValueError(f"circuit breaker: threshold={threshold} must be >= 0 and reset_s={reset_s} > 0")
        self.threshold = threshold
        self.reset_s = reset_s
        self.state = "closed"
        self.failures = 0
        self._open_until = 0.0

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open only the single probe may."""
        if self.threshold == 0 or self.state == "closed":
            return True
        if self.state == "open" and time.monotonic() >= self._open_until:
            self.state = "half-open"
            return True
        return False

    def success(self) -> None:
        self.state, self.failures = "closed", 0

    def failure(self) -> None:
        self.failures += 1
        if self.threshold and (self.state == "half-open" or self.failures >= self.threshold):
            self.state = "open"
            self._open_until = time.monotonic() + self.reset_s
