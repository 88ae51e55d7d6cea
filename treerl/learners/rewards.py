"""Reward scoring: the environment's verifier plus reward functions with TRL's signature, weighted.

Every episode gets a row of rewards: first the environment's own (its verifier's score,
summed over turns), then one per reward function. The advantage stage combines the columns
with ``reward_weights`` (one per column). A reward function takes TRL's arguments::

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

``prompts`` are the opening messages, ``completions`` every message after them,
``completion_ids`` the sampled ids; the task's columns come as keyword arguments
(``answer``, ``task_id``, ``termination``, ``env_reward``), with ``log_metric(name, value)``
(logged as ``reward_fn/<name>``) and ``log_extra(name, values)`` callbacks. ``None`` means
"not applicable" and counts as 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from treerl.rollout.trajectory import Group

__all__ = ["RewardFunc", "check_reward_weights", "score"]

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Sequence[float | None]]
"""TRL's signature: ``f(prompts, completions, completion_ids, **kwargs) -> list[float | None]``."""


def check_reward_weights(reward_funcs: Sequence[RewardFunc], weights: Sequence[float] | None) -> list[float]:
    """One weight for the environment's reward and one per reward function (default: all 1).

    >>> check_reward_weights([len], None)
    [1.0, 1.0]
    >>> check_reward_weights([len], [1.0])
    Traceback (most recent call last):
    ...
    ValueError: reward_weights has 1 entries; pass one for the environment reward and one per reward function (2).
    """
    if weights is None:
        return [1.0] * (1 + len(reward_funcs))
    if len(weights) != 1 + len(reward_funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries; pass one for the environment reward and one "
                         f"per reward function ({1 + len(reward_funcs)}).")
    return [float(w) for w in weights]


def score(groups: Sequence[Group], reward_funcs: Sequence[RewardFunc], metrics: dict[str, float]) -> torch.Tensor:
    """Rewards ``(E, 1 + len(reward_funcs))``: the environment's, then each reward function's."""
    episodes = [(g, e) for g in groups for e in g.episodes]
    columns = [[e.reward for _, e in episodes]]
    if reward_funcs:
        prompts, completions, completion_ids = [], [], []
        for g, e in episodes:
            n = g.info.get("num_prompt_messages", 2)
            prompts.append(e.messages[:n])
            completions.append(e.messages[n:])
            completion_ids.append([t for t, m in zip(e.token_ids, e.sampled_mask) if m])
        kwargs = {
            "answer": [g.info.get("answer") for g, _ in episodes],
            "task_id": [g.info.get("task_id") for g, _ in episodes],
            "termination": [e.termination for _, e in episodes],
            "env_reward": list(columns[0]),
        }

        def log_metric(name: str, value: float) -> None:
            metrics[f"reward_fn/{name}"] = float(value)

        def log_extra(name: str, values: Sequence[Any]) -> None:
            logger.debug("reward function extra %s: %s", name, list(values)[:4])

        for func in reward_funcs:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                          log_metric=log_metric, log_extra=log_extra, **kwargs)
            values = [0.0 if v is None else float(v) for v in values]
            if len(values) != len(episodes):
                raise ValueError(f"reward function {getattr(func, '__name__', func)!r} returned {len(values)} "
                                 f"rewards for {len(episodes)} completions; return one per completion.")
            name = getattr(func, "__name__", type(func).__name__)
            metrics[f"reward_fn/{name}_mean"] = sum(values) / len(values)
            columns.append(values)
    return torch.tensor(columns, dtype=torch.float32).T  # (E, R)
