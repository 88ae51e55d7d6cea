"""Learners: losses and advantages (pure functions), importance sampling, and the training loops."""

from treerl.learners.advantages import AdvantageConfig, compute_advantages
from treerl.learners.importance import ImportanceConfig, importance_weights
from treerl.learners.losses import (
    POLICY_LOSSES,
    LossConfig,
    LossInputs,
    LossNormalizer,
    LossOutput,
    compute_loss,
)

__all__ = [
    "AdvantageConfig", "compute_advantages",
    "ImportanceConfig", "importance_weights",
    "LossConfig", "LossInputs", "LossNormalizer", "LossOutput", "POLICY_LOSSES", "compute_loss",
]
