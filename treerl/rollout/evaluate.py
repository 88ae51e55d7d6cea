"""Held-out evaluation: play a policy in an environment and measure how often it succeeds.

Evaluation plays through the rollout engine, the one episode loop: the same rendering and
bridge tokens, tool-call parsing, per-episode token and wall-clock limits, and environment
errors recorded as data, as in ``treerl rollout`` and ``treerl learn``. Each of the
``num_episodes`` tasks is played once (a group of one), task ``i`` with seed ``seed + i``,
and the figures are :meth:`~treerl.rollout.summary.RolloutStats.summary`'s. An environment
that draws its tasks from a dataset plays rows ``0..N-1``, each at most once: asked for more
episodes than it has rows, the evaluation plays every row once and says so, since rows played
twice would weigh the success rate by accident.

An episode *succeeds* when its final reward reaches ``success_threshold``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treerl.agents.chat_templates import resolve_chat_template
from treerl.agents.policy import Policy, SamplingParams
from treerl.config import field_help
from treerl.envs.registry import make
from treerl.rollout.engine import RolloutEngine
from treerl.rollout.options import EpisodeOptions
from treerl.rollout.summary import summary_table, task_rows, task_table
from treerl.rollout.trajectory import Group

__all__ = ["EvalConfig", "EvalReport", "evaluate", "aevaluate", "evaluate_with"]

logger = logging.getLogger(__name__)


@dataclass
class EvalConfig(EpisodeOptions):
    """Options of ``treerl eval``."""

    num_episodes: int = field_help(64, "How many episodes (one task each, seeds seed..seed+N-1; a dataset's "
                                       "rows 0..N-1, each at most once).")
    seed: int = field_help(10_000, "First task seed; the default keeps evaluation tasks apart from small training "
                                   "seeds.")
    success_threshold: float = field_help(1.0, "Final reward at or above which an episode counts as solved.")
    json: bool = field_help(False, "Print the report as JSON.")
    per_task: bool = field_help(False, "Also report each task: answer, reward, success, turns, tokens, tool calls "
                                       "and how it ended (a table, or a `tasks` list with --json).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_episodes < 1:
            raise ValueError(f"num_episodes={self.num_episodes} must be >= 1: evaluate at least one episode.")


@dataclass
class EvalReport:
    """What :func:`evaluate` measured: the summary's figures and the episodes' groups."""

    env: str
    figures: dict[str, Any]
    """:meth:`RolloutStats.summary` of the evaluation's episodes."""
    groups: list[Group] = field(default_factory=list, repr=False)
    success_threshold: float = 1.0

    @property
    def num_episodes(self) -> int:
        return self.figures["episodes"]

    @property
    def success_rate(self) -> float:
        return self.figures["success_rate"]

    @property
    def tool_calls(self) -> dict[str, int]:
        return self.figures["tool_calls"]

    def summary(self) -> dict[str, Any]:
        """The figures with the environment id (what ``treerl eval --json`` prints)."""
        return {"env": self.env, **self.figures}

    def table(self) -> str:
        return summary_table(self.figures, environment=self.env)

    def task_rows(self) -> list[dict[str, Any]]:
        """One record per task (see :func:`~treerl.rollout.summary.task_rows`)."""
        return task_rows(self.groups, self.success_threshold)

    def task_table(self) -> str:
        return task_table(self.task_rows())


async def aevaluate(env_factory: Callable[[], Any], policy: Policy, tokenizer: Any, *, env_id: str = "",
                    num_episodes: int = 64, seed: int = 10_000, params: SamplingParams | None = None,
                    max_concurrency: int = 32, max_episode_tokens: int = 2048, max_episode_seconds: float = 300.0,
                    success_threshold: float = 1.0, chat_template: str | None = None,
                    lockstep: bool = False) -> EvalReport:
    """Play ``num_episodes`` tasks (seeds ``seed..seed+N-1``) once each, concurrently; see :func:`evaluate`.

    ``chat_template`` (a template's text) overrides the tokenizer's, and ``lockstep`` generates in
    waves of every episode (batches, and with them every float, repeat), as in the engine.
    """
    num_episodes = _at_most_one_per_row(env_factory, num_episodes)
    engine = RolloutEngine(policy, tokenizer, params=params or SamplingParams(max_new_tokens=96),
                           max_concurrency=max_concurrency, max_episode_tokens=max_episode_tokens,
                           max_episode_seconds=max_episode_seconds, seed=seed, chat_template=chat_template,
                           lockstep=lockstep)
    groups, stats = await engine.run(env_factory, env_id, range(num_episodes), group_size=1)
    return EvalReport(env=env_id, figures=stats.summary(success_threshold), groups=groups,
                      success_threshold=success_threshold)


def _at_most_one_per_row(env_factory: Callable[[], Any], num_episodes: int) -> int:
    """``num_episodes``, or the number of rows of the environment's dataset when that is smaller (with a warning)."""
    env = env_factory()
    try:
        dataset = getattr(env, "dataset", None)
        num_rows = None if dataset is None else len(dataset)
    finally:
        env.close()
    if num_rows is None or num_episodes <= num_rows:
        return num_episodes
    message = (f"num_episodes={num_episodes} but the dataset has {num_rows} rows: evaluating each row once "
               f"({num_rows} episodes), as rows played twice would count twice")
    logger.warning(message)
    print(f"warning: {message}", file=sys.stderr)
    return num_rows


def evaluate(env_id: str, policy: Policy, tokenizer: Any, *, env_kwargs: dict[str, Any] | None = None,
             **kwargs: Any) -> EvalReport:
    """Evaluate ``policy`` on the registered environment ``env_id`` (built with ``env_kwargs``).

    >>> from treerl.models import load_default_model            # doctest: +SKIP
    >>> from treerl.agents import TransformersPolicy            # doctest: +SKIP
    >>> model, tok = load_default_model()                       # doctest: +SKIP
    >>> policy = TransformersPolicy(model, tok)                 # doctest: +SKIP
    >>> evaluate("treerl/Calculator-v0", policy, tok, num_episodes=8).success_rate  # doctest: +SKIP
    """
    env_kwargs = dict(env_kwargs or {})
    return asyncio.run(aevaluate(lambda: make(env_id, **env_kwargs), policy, tokenizer, env_id=env_id, **kwargs))


def evaluate_with(cfg: EpisodeOptions, policy: Policy, tokenizer: Any, *, num_episodes: int, seed: int,
                  success_threshold: float = 1.0, env_factory: Callable[[], Any] | None = None,
                  env_id: str = "", **sampling_overrides: Any) -> EvalReport:
    """:func:`evaluate` with a command's :class:`EpisodeOptions` (environment, sampling, limits, lockstep).

    ``env_factory`` replaces the one ``cfg`` describes (a learner given its own factory), and
    ``env_id`` then names it (default: ``cfg.env``).
    """
    return asyncio.run(aevaluate(
        env_factory or cfg.env_factory(), policy, tokenizer, env_id=env_id or cfg.env, num_episodes=num_episodes, seed=seed,
        params=cfg.sampling(**sampling_overrides), max_concurrency=cfg.max_concurrency,
        max_episode_tokens=cfg.max_episode_tokens, max_episode_seconds=cfg.max_episode_seconds,
        success_threshold=success_threshold, chat_template=resolve_chat_template(cfg.chat_template, tokenizer),
        lockstep=cfg.lockstep,
    ))
