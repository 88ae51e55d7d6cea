"""Learners: the GRPO, SDPO and AsyncGRPO loops on the learner core, losses and advantages (pure
functions), importance sampling and score centering, tree packing.

>>> from treerl.learners import GRPOConfig, train       # doctest: +SKIP
>>> train(GRPOConfig(env="treerl/Calculator-v0", output_dir="runs/calc", steps=10))  # doctest: +SKIP
"""

from treerl.learners.advantages import AdvantageConfig, compute_advantages
from treerl.learners.async_grpo import AsyncGRPOConfig, train_async
from treerl.learners.centering import score_centering
from treerl.learners.config import LearnerConfig
from treerl.learners.core import LEARNERS, LearnerSpec, Run, TrainResult, build, finish, register_learner
from treerl.learners.forward import loss_inputs, packed_logprobs, packed_loss, window_normalizer
from treerl.learners.grpo import GRPOConfig, train
from treerl.learners.importance import ImportanceConfig, importance_weights
from treerl.learners.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossCoefficients,
    LossConfig,
    LossInputs,
    LossNormalizer,
    LossOutput,
    compute_loss,
    finish_policy_loss,
    register_loss,
)
from treerl.learners.packing import PackedBatch, PackingConfig, PackingError, pack_groups, packing_metrics
from treerl.rollout.rewards import RewardFunc
from treerl.learners.sdpo import SDPOConfig, train as train_sdpo

__all__ = [
    "GRPOConfig", "train", "SDPOConfig", "train_sdpo", "LearnerConfig", "TrainResult", "RewardFunc", "Run", "build",
    "finish", "AsyncGRPOConfig", "train_async", "score_centering",
    "LEARNERS", "LearnerSpec", "register_learner",
    "AdvantageConfig", "compute_advantages",
    "ImportanceConfig", "importance_weights",
    "LossConfig", "LossCoefficients", "LossInputs", "LossNormalizer", "LossOutput", "POLICY_LOSSES", "AGGREGATIONS",
    "compute_loss", "register_loss", "finish_policy_loss",
    "PackingConfig", "PackedBatch", "PackingError", "pack_groups", "packing_metrics",
    "packed_logprobs", "loss_inputs", "window_normalizer", "packed_loss",
]
