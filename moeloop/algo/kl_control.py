"""The coefficient of the KL penalty in the reward (`algorithm.use_kl_in_reward`): fixed, or adaptive.

Adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"; verl's `kl_ctrl.type:
adaptive`): after each step the coefficient moves toward keeping the measured KL at `kl_target`,

    coef <- coef * (1 + clip(kl / kl_target - 1, -0.2, 0.2) * num_samples / kl_horizon)

with kl the step's mean per-token KL(old || ref) over every DP rank's in-loss response tokens and num_samples the
global batch size. The step's rewards use the coefficient from before the update. The coefficient is run state:
checkpoints save it and `--resume` restores it, so a resumed run continues with the same penalty.
"""
from __future__ import annotations

from moeloop.config.schema import AlgorithmSection

MAX_PROPORTIONAL_ERROR = 0.2


class KLController:
    def __init__(self, cfg: AlgorithmSection):
        self.adaptive = cfg.kl_ctrl == "adaptive"
        self.coef, self.target, self.horizon = float(cfg.kl_coef), float(cfg.kl_target), int(cfg.kl_horizon)

    def update(self, kl: float, num_samples: int) -> None:
        """Move the coefficient after a step whose mean per-token KL was `kl` (no-op when fixed)."""
        if not self.adaptive:
            return
        error = min(max(kl / self.target - 1.0, -MAX_PROPORTIONAL_ERROR), MAX_PROPORTIONAL_ERROR)
        self.coef *= 1.0 + error * num_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
