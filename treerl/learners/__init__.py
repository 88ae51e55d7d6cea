"""Learners: losses and advantages (pure functions), importance sampling, and the training loops."""

from treerl.learners.advantages import AdvantageConfig, compute_advantages
from treerl.learners.forward import loss_inputs, packed_logprobs, packed_loss, window_normalizer
from treerl.learners.importance import ImportanceConfig, importance_weights
from treerl.learners.losses import (
    POLICY_LOSSES,
    LossConfig,
    LossInputs,
    LossNormalizer,
    LossOutput,
    compute_loss,
)
from treerl.learners.packing import PackedBatch, PackingConfig, PackingError, pack_groups, packing_metrics

__all__ = [
    "AdvantageConfig", "compute_advantages",
    "ImportanceConfig", "importance_weights",
    "LossConfig", "LossInputs", "LossNormalizer", "LossOutput", "POLICY_LOSSES", "compute_loss",
    "PackingConfig", "PackedBatch", "PackingError", "pack_groups", "packing_metrics",
    "packed_logprobs", "loss_inputs", "window_normalizer", "packed_loss",
]
