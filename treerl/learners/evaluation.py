"""Held-out evaluation at the start and the end of a run, and every ``eval_every`` steps, through the rollout engine.

``eval_episodes`` tasks from seed ``eval_seed`` on (kept apart from the training tasks),
each played ``num_generations_eval`` times (default once; TRL's name), as one group sharing the
prompt, at ``eval_temperature`` with the run's environment and limits; the figures are
:meth:`~treerl.rollout.summary.RolloutStats.summary`'s, over all the episodes, with ``pass@k``
when a task is played more than once. The start is written to
``eval_start.json`` so that a resumed run reports it without evaluating again; the evaluations
of ``eval_every`` are logged with their step as :func:`eval_metrics`, and :func:`metric_key` finds the figure
``metric_for_best_model`` names among them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from treerl.agents.policy import Policy
from treerl.errors import ConfigError
from treerl.learners.config import LearnerConfig
from treerl.rollout.evaluate import evaluate_with

__all__ = ["evaluate_policy", "evaluate_at_start", "eval_metrics", "improves", "metric_key"]

TRL_EVAL_NAMES = {"reward": "reward/mean", "reward_std": "reward/std"}
"""TRL's names of GRPO's evaluation figures (after ``eval_``) and the held-out figures of the same meaning here
(after ``eval/``); ``rewards/NAME/mean`` is ``reward_fn/NAME_mean``."""


def evaluate_policy(cfg: LearnerConfig, policy: Policy, tokenizer: Any, env_factory: Callable[[], Any],
                    env_id: str = "") -> dict:
    """The held-out figures of ``policy`` now (``env_id``: what they call the environment; default ``cfg.env``)."""
    report = evaluate_with(cfg, policy, tokenizer, num_episodes=cfg.eval_episodes, seed=cfg.eval_seed,
                           env_factory=env_factory, env_id=env_id, rollouts_per_task=cfg.num_generations_eval or 1,
                           temperature=cfg.eval_temperature)
    return report.summary()


def evaluate_at_start(cfg: LearnerConfig, policy: Policy, tokenizer: Any, env_factory: Callable[[], Any],
                      out_dir: Path, resumed: bool, env_id: str = "") -> dict | None:
    """Evaluate before the first step, or read what a resumed run's first start measured."""
    path = Path(out_dir) / "eval_start.json"
    if resumed:
        return json.loads(path.read_text()) if path.exists() else None
    if cfg.eval_episodes == 0 or cfg.eval_on_start is False:
        return None
    figures = evaluate_policy(cfg, policy, tokenizer, env_factory, env_id)
    path.write_text(json.dumps(figures, indent=2))
    return figures


def eval_metrics(figures: dict[str, Any]) -> dict[str, float]:
    """Held-out ``figures`` as a step's metrics: each number under ``eval/`` and its name in ``summary.json``
    (``eval/success_rate``, ``eval/reward/mean``), each entry of a table under ``eval/TABLE/KEY``
    (``eval/tool_calls/ok``), the environments' own numbers as ``eval/env/KEY``.

    >>> eval_metrics({"success_rate": 0.5, "reward/mean": 0.5, "tool_calls": {"ok": 3}, "env_metrics": {"env/x": 1.0}})
    {'eval/success_rate': 0.5, 'eval/reward/mean': 0.5, 'eval/tool_calls/ok': 3.0, 'eval/env/x': 1.0}
    """
    out: dict[str, float] = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            prefix = "eval/" if key == "env_metrics" else f"eval/{key}/"  # env_metrics' keys are env/KEY already
            out.update({prefix + k: float(v) for k, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"eval/{key}"] = float(value)
    return out


def improves(value: float, best: float | None, greater_is_better: bool) -> bool:
    """Whether ``value`` of ``metric_for_best_model`` beats ``best`` (None: no evaluation yet), as transformers'
    ``_determine_best_metric`` compares them; NaN never does.

    >>> improves(0.5, None, True), improves(0.5, 0.5, True), improves(0.4, 0.5, False)
    (True, False, True)
    """
    if best is None:
        best = -math.inf if greater_is_better else math.inf
    return value > best if greater_is_better else value < best


def metric_key(name: str, available: Iterable[str]) -> str:
    """The evaluation metric of ``available`` that ``metric_for_best_model`` ``name`` names: the name itself,
    with transformers' ``eval_`` prefix or treerl's ``eval/`` added, in TRL's names of GRPO's figures
    (``eval_reward``, ``eval_rewards/NAME/mean``) or treerl's (``eval/reward/mean``, ``eval/reward_fn/NAME_mean``),
    whichever the evaluation logs. A name of none of them is refused, listing those it has.

    >>> metric_key("reward", ["eval/reward/mean", "eval/success_rate"])
    'eval/reward/mean'
    >>> metric_key("eval/reward/mean", ["eval_reward", "eval_reward_std"])
    'eval_reward'
    >>> metric_key("success_rate", ["eval/success_rate"])
    'eval/success_rate'
    """
    available = list(available)
    base = re.sub(r"^eval[_/]", "", name)
    bases = [base, TRL_EVAL_NAMES.get(base), *(k for k, v in TRL_EVAL_NAMES.items() if v == base)]
    if m := re.fullmatch(r"rewards/(.+)/mean", base):
        bases.append(f"reward_fn/{m[1]}_mean")
    if m := re.fullmatch(r"reward_fn/(.+)_mean", base):
        bases.append(f"rewards/{m[1]}/mean")
    for key in [name, *(prefix + b for b in bases if b for prefix in ("eval_", "eval/"))]:
        if key in available:
            return key
    raise ConfigError(f"metric_for_best_model={name!r} is not among the evaluation's figures: "
                      f"{', '.join(sorted(available)) or 'none'}; name one of them (with or without its eval_ or "
                      "eval/ prefix), e.g. --metric-for-best-model reward (GRPO's evaluation logs no loss, which "
                      "transformers' Trainer compares by default).")
