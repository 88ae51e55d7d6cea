"""Advantages from episode rewards, as pure functions.

A **group** is all the episodes of one task (DESIGN.md); its rewards are compared with
each other, so no value model is needed:

- ``grpo``: subtract the group mean, ``A_i = r_i - mean_g(r)``
  (DeepSeekMath, https://arxiv.org/abs/2402.03300);
- ``rloo``: subtract the mean of the *other* episodes of the group,
  ``A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g(r))``, an unbiased
  baseline ("Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
  Human Feedback in LLMs", https://arxiv.org/abs/2402.14740).

Then scale by the group's reward std (GRPO), by the std of the whole batch (more robust
for small groups, as TRL's ``scale_rewards="batch"``), or not at all (Dr. GRPO: the std
division over-weights easy and hard tasks). Stds are unbiased (``n - 1``), as in TRL.

Several rewards per episode, ``(E, R)``, are combined with weights ``(R,)``: summed then
normalized (TRL's default, ``sum_then_normalize``), or TRL's ``normalize_then_sum`` (GDPO,
https://arxiv.org/abs/2601.05242), so that one reward's scale cannot drown the others: each
reward ``(r - group mean) / (group std + eps)``, the weighted sum of those, then that sum
``(x - batch mean) / (batch std + eps)`` (:func:`normalize_then_sum`). A reward function's
``None`` (NaN) is left out of the sum; an episode that no weighted reward scored is left out of
its group's baseline and the batch's figures, with advantage 0, as in TRL.

A group whose rewards are all equal carries no signal: its advantages are 0. The
metrics count these groups, ``reward/num_zero_std_groups``: when most groups are like
that, the tasks are too easy or too hard for the policy.

Example:
    >>> import torch
    >>> out = compute_advantages(
    ...     torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([7, 7, 9, 9]),
    ...     AdvantageConfig(scale="none"))
    >>> out.adv.tolist()
    [0.5, -0.5, 0.0, 0.0]
    >>> out.metrics["reward/num_zero_std_groups"].item()
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from treerl.rollout.rewards import combine_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "MULTI_REWARD_MODES",
    "AdvantageConfig",
    "AdvantageOutput",
    "combine_rewards",
    "compute_advantages",
    "group_ids",
    "grpo_advantages",
    "normalize_then_sum",
    "rloo_advantages",
]

ADVANTAGE_SCALES = ("group", "batch", "none")
MULTI_REWARD_MODES = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class AdvantageConfig:
    """How rewards become advantages."""

    estimator: str = "grpo"
    """Baseline: ``grpo`` (group mean) or ``rloo`` (leave-one-out mean)."""
    scale: str = "group"
    """Divide by the std of the ``group``, of the whole ``batch``, or ``none``."""
    multi_reward: str = "sum_then_normalize"
    """With rewards (E, R): ``sum_then_normalize`` or ``normalize_then_sum`` (TRL's formula, which
    takes the group mean and std and then the batch's: ``estimator="grpo"``, ``scale="group"``)."""
    eps: float = 1e-4
    """Added to the std before dividing, so zero-variance groups give 0, not NaN."""

    def __post_init__(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"AdvantageConfig.estimator is {self.estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}."
            )
        if self.scale not in ADVANTAGE_SCALES:
            raise ValueError(f"AdvantageConfig.scale is {self.scale!r}; choose one of {ADVANTAGE_SCALES}.")
        if self.multi_reward not in MULTI_REWARD_MODES:
            raise ValueError(
                f"AdvantageConfig.multi_reward is {self.multi_reward!r}; choose one of {MULTI_REWARD_MODES}."
            )
        if self.multi_reward == "normalize_then_sum" and (self.estimator, self.scale) != ("grpo", "group"):
            raise ValueError(
                f"AdvantageConfig.multi_reward='normalize_then_sum' centres each reward on its group's mean and "
                f"divides by its group's std, then the sum by the batch's (TRL's formula), so it takes "
                f"estimator='grpo' and scale='group', not {self.estimator!r} and {self.scale!r}."
            )
        if not (self.eps > 0.0 and math.isfinite(self.eps)):
            raise ValueError(
                f"AdvantageConfig.eps is {self.eps}; it must be a small positive number such as 1e-4 "
                "so that dividing by a zero std stays finite."
            )


@dataclass
class AdvantageOutput:
    """Per-episode advantages and metrics."""

    adv: Tensor
    """(E,) advantage of each episode."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """``reward/mean``, ``reward/std``, ``reward/num_zero_std_groups``, ``reward/zero_std_frac``,
    ``adv/mean``, ``adv/std``, ``adv/abs_mean``; with several rewards also ``reward/<r>/mean``."""


def group_ids(group: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group labels (E,) to dense ids in ``[0, G)``; returns ``(ids, G)``.

    Example:
        >>> import torch
        >>> ids, g = group_ids(torch.tensor([42, 7, 42]))
        >>> ids.tolist(), g
        ([1, 0, 1], 2)
    """
    unique, ids = torch.unique(group, return_inverse=True)
    return ids, int(unique.numel())


def _group_stats(rewards: Tensor, ids: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (size, mean, unbiased std), each (G,)."""
    size = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add(
        0, ids, torch.ones_like(rewards)
    )
    mean = torch.zeros_like(size).index_add(0, ids, rewards) / size
    sq_dev = torch.zeros_like(size).index_add(0, ids, (rewards - mean[ids]) ** 2)
    # A group of one has no spread; dividing by max(n - 1, 1) keeps its std at 0, not NaN.
    std = torch.sqrt(sq_dev / (size - 1.0).clamp(min=1.0))
    return size, mean, std


def _scale(centered: Tensor, rewards: Tensor, ids: Tensor, group_std: Tensor, scale: str, eps: float) -> Tensor:
    if scale == "group":
        return centered / (group_std[ids] + eps)
    if scale == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        return centered / (batch_std + eps)
    return centered


def grpo_advantages(rewards: Tensor, group: Tensor, *, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-mean baseline: ``(r_i - mean_g) / (std + eps)``. (E,) -> (E,).

    Example:
        >>> import torch
        >>> grpo_advantages(torch.tensor([2.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), scale="none").tolist()
        [1.0, -1.0, 0.0]
    """
    ids, num_groups = group_ids(group)
    _, mean, std = _group_stats(rewards, ids, num_groups)
    return _scale(rewards - mean[ids], rewards, ids, std, scale, eps)


def rloo_advantages(rewards: Tensor, group: Tensor, *, scale: str = "none", eps: float = 1e-4) -> Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j``, then optional scaling. (E,) -> (E,).

    An episode alone in its group has no baseline and gets 0.

    Example:
        >>> import torch
        >>> rloo_advantages(torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0, 0, 0])).tolist()
        [3.0, -1.5, -1.5]
    """
    ids, num_groups = group_ids(group)
    size, mean, std = _group_stats(rewards, ids, num_groups)
    n = size[ids]  # (E,)
    # r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); 0 for n = 1.
    centered = torch.where(n > 1, n / (n - 1.0).clamp(min=1.0) * (rewards - mean[ids]), torch.zeros_like(rewards))
    return _scale(centered, rewards, ids, std, scale, eps)


Estimator = Callable[..., Tensor]

ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
}
"""Baselines by name; ``AdvantageConfig.estimator`` picks one."""


def compute_advantages(
    rewards: Tensor,
    group: Tensor,
    cfg: AdvantageConfig,
    *,
    weights: Tensor | Sequence[float] | None = None,
    scorers: Tensor | Sequence[bool] | None = None,
) -> AdvantageOutput:
    """Advantages of a batch of episodes, with metrics.

    Args:
        rewards: (E,) one reward per episode, or (E, R) several.
        group: (E,) group label of each episode (any integers; e.g. the task index).
        cfg: estimator, scaling and multi-reward mode.
        weights: (R,) weight of each reward column; all ones when omitted.
        scorers: (R,) the columns whose number makes an episode scorable (TRL's: every reward
            function's, weighted 0 or not); default: those weighted other than 0.
    """
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(1)  # (E, 1)
    if rewards.dim() != 2:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; pass (E,) or (E, R).")
    num_episodes, num_rewards = rewards.shape
    if tuple(group.shape) != (num_episodes,):
        raise ValueError(
            f"group has shape {tuple(group.shape)} but rewards has {num_episodes} episodes; "
            "pass one group label per episode."
        )
    if num_episodes == 0:
        raise ValueError("rewards is empty; there are no episodes to compute advantages for.")
    if bool(torch.isinf(rewards).any()) or (num_rewards == 1 and bool(torch.isnan(rewards).any())):
        raise ValueError(
            "rewards contains NaN or inf; a verifier returned a non-number. Make the reward "
            "functions return finite floats (a failed rollout should score, e.g., 0)."
        )
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if weights is None:
        w = torch.ones(num_rewards, dtype=rewards.dtype, device=rewards.device)
    else:
        w = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if tuple(w.shape) != (num_rewards,):
        raise ValueError(
            f"weights has shape {tuple(w.shape)} but rewards has {num_rewards} columns; pass one "
            "weight per reward."
        )

    estimator = ADVANTAGE_ESTIMATORS[cfg.estimator]
    combined = combine_rewards(rewards, w)  # (E,)
    ids, num_groups = group_ids(group)
    # An episode that no weighted reward scored (each function returned None) is unscorable: as in TRL it
    # is left out of its group's baseline and of the batch's figures, and its advantage is 0.
    scoring = rewards[:, torch.as_tensor(scorers, dtype=torch.bool) if scorers is not None else w != 0]  # (E, R')
    scored = ~scoring.isnan().all(dim=1) if scoring.shape[1] else torch.ones_like(combined, dtype=torch.bool)
    if cfg.multi_reward == "sum_then_normalize":
        if bool(scored.all()):
            adv = estimator(combined, group, scale=cfg.scale, eps=cfg.eps)
        else:
            adv = torch.zeros_like(combined)
            adv[scored] = estimator(combined[scored], group[scored], scale=cfg.scale, eps=cfg.eps)
        constant = _group_range(combined.masked_fill(~scored, math.nan), ids, num_groups) == 0  # (G,)
    else:
        adv = normalize_then_sum(rewards, group, w, eps=cfg.eps, scored=scored)
        # A group carries no signal of its own when each weighted reward is constant in it (its
        # advantages are then all equal: minus the batch mean of the sums, over the batch std).
        weighted = rewards[:, w != 0]  # (E, R')
        constant = torch.stack(
            [_group_range(weighted[:, r], ids, num_groups) == 0 for r in range(weighted.shape[1])], dim=1
        ).all(dim=1)

    num_zero = constant.sum().to(rewards.dtype)
    metrics: dict[str, Tensor] = {
        "reward/mean": combined[scored].mean(),
        "reward/std": combined[scored].std(unbiased=False),  # population std, as the rollout summary's
        "reward/num_zero_std_groups": num_zero,
        "reward/zero_std_frac": num_zero / num_groups,
        "adv/mean": adv.mean(),
        "adv/std": adv.std() if num_episodes > 1 else adv.new_zeros(()),
        "adv/abs_mean": adv.abs().mean(),
    }
    if num_rewards > 1:
        for r in range(num_rewards):
            metrics[f"reward/{r}/mean"] = rewards[:, r].nanmean()
    return AdvantageOutput(adv=adv, metrics=metrics)


def _group_range(values: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """max - min per group over the values that are not NaN, (G,): exactly 0 when all of a group's
    values are equal, or when it has none."""
    high = torch.full((num_groups,), -math.inf, dtype=values.dtype, device=values.device)
    low = torch.full((num_groups,), math.inf, dtype=values.dtype, device=values.device)
    missing = values.isnan()
    high = high.scatter_reduce(0, ids, values.masked_fill(missing, -math.inf), reduce="amax")
    low = low.scatter_reduce(0, ids, values.masked_fill(missing, math.inf), reduce="amin")
    return torch.where(high == -math.inf, torch.zeros_like(high), high - low)


def _nan_group_stats(values: Tensor, ids: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group (mean, unbiased std) of each column over its values that are not NaN, each (G, R):
    the mean is NaN for a group without values, the std for one with fewer than two (TRL's nanstd)."""
    present = ~values.isnan()  # (E, R)
    zeros = values.new_zeros((num_groups, values.shape[1]))
    count = zeros.index_add(0, ids, present.to(values.dtype))  # (G, R)
    mean = zeros.index_add(0, ids, values.nan_to_num(0.0)) / count  # 0/0 = NaN where none
    sq_dev = zeros.index_add(0, ids, torch.where(present, values - mean[ids], 0.0) ** 2)
    std = torch.where(count > 1, (sq_dev / (count - 1.0)).sqrt(), torch.full_like(count, math.nan))
    return mean, std


def normalize_then_sum(rewards: Tensor, group: Tensor, weights: Tensor, *, eps: float = 1e-4,
                       scored: Tensor | None = None) -> Tensor:
    """TRL's ``multi_objective_aggregation="normalize_then_sum"`` (GDPO). (E, R), (E,), (R,) -> (E,).

    Each reward column is normalized in its group, ``(r - mean_g) / (std_g + eps)`` (always divided
    by the std, whatever the scale), the columns' weighted sum is taken, and that sum is normalized
    over the batch, ``(x - mean) / (std + eps)``. NaN (a reward function's ``None``) is left out of
    every mean, std and sum, as TRL's ``nanmean``/``nanstd``/``nansum``; a column with fewer than two
    values in a group adds nothing to that group's sums. An episode that is not ``scored`` (E,) bool
    (default: one that no weighted reward scored) is unscorable: left out of the batch's mean and std,
    with advantage 0. A column of weight 0 adds nothing.

    Example:
        >>> import torch
        >>> r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 5.0], [1.0, 0.0]])  # the second reward's scale is 5x
        >>> adv = normalize_then_sum(r, torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 1.0]))
        >>> [round(a, 3) for a in adv.tolist()]
        [0.866, -0.866, 0.866, -0.866]
    """
    used = weights != 0
    rewards, weights = rewards[:, used], weights[used]  # (E, R'), (R',)
    ids, num_groups = group_ids(group)
    mean, std = _nan_group_stats(rewards, ids, num_groups)  # (G, R') each
    normalized = (rewards - mean[ids]) / (std[ids] + eps)  # (E, R'), NaN where not applicable
    summed = (normalized * weights).nansum(dim=1)  # (E,)
    if scored is None:
        scored = ~rewards.isnan().all(dim=1)  # (E,)
    batch_mean, batch_std = _nan_group_stats(
        torch.where(scored, summed, math.nan).unsqueeze(1), torch.zeros_like(ids), 1)
    adv = (summed - batch_mean[0, 0]) / (batch_std[0, 0] + eps)
    return torch.where(scored, adv, 0.0).nan_to_num(0.0)
