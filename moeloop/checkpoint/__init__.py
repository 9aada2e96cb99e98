"""Checkpoints: atomic DCP saves with run metadata (reshardable to any layout), HF export."""
from moeloop.checkpoint.manager import CheckpointManager, rng_state, set_rng_state

__all__ = ["CheckpointManager", "rng_state", "set_rng_state"]
