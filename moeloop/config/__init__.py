"""Typed run configuration: dataclass sections, YAML + dotted overrides, validation at load."""
from moeloop.config.load import load_config, to_yaml, validate
from moeloop.config.schema import (
    ActorSection, AlgorithmSection, CheckpointSection, CriticSection, DataSection, HardwareSection,
    ModelSection, OptimSection, ParallelSection, RewardSection, RolloutSection, RunConfig, SyncSection,
    TrainerSection,
)

__all__ = [
    "load_config", "to_yaml", "validate", "RunConfig", "ActorSection", "AlgorithmSection", "CheckpointSection",
    "CriticSection", "DataSection", "HardwareSection", "ModelSection", "OptimSection", "ParallelSection",
    "RewardSection", "RolloutSection", "SyncSection", "TrainerSection",
]
