"""Reward scoring moved to :mod:`treerl.rollout.rewards` (``treerl eval`` scores with it too); these
names stay importable from here."""

from treerl.rollout.rewards import (  # noqa: F401
    RewardFunc,
    RewardOptions,
    StepState,
    check_reward_weights,
    load_reward_funcs,
    reward_func_name,
    score,
    write_extras,
)

__all__ = ["RewardFunc", "RewardOptions", "StepState", "check_reward_weights", "load_reward_funcs", "reward_func_name",
           "score", "write_extras"]
