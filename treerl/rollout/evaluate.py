"""Held-out evaluation: play a policy in an environment and measure how often it succeeds.

Evaluation plays through the rollout engine, the one episode loop: the same rendering and
bridge tokens, tool-call parsing, per-episode token and wall-clock limits, and environment
errors recorded as data, as in ``treerl rollout`` and ``treerl learn``. Each of the
``num_episodes`` tasks (task ``i`` with seed ``seed + i``) is played ``rollouts_per_task``
times, as one group sharing the prompt (verifiers' ``-n N -r R``, TRL's ``num_generations``),
and the figures are :meth:`~treerl.rollout.summary.RolloutStats.summary`'s. An environment
that draws its tasks from a dataset plays rows ``0..N-1``, each as one task at most: asked for
more tasks than it has rows, the evaluation plays every row once and says so, since rows played
twice would weigh the success rate by accident. An :class:`~treerl.envs.group.EnvGroup` stops
before the first task that would replay a row of its dataset or of a member's
(:meth:`~treerl.envs.group.EnvGroup.num_distinct_tasks`).

An episode *succeeds* when its final environment reward reaches ``success_threshold``; the
success rate is over all episodes. With ``rollouts_per_task`` R > 1 the report adds
``pass@k`` for k = 1, the powers of 2 below R, and R: the unbiased estimate (Chen et al.,
2021) of the chance that at least one of k episodes of a task succeeds, ``1 - C(n-c, k) /
C(n, k)`` for a task with c successes in n episodes, averaged over tasks. With reward
functions (:class:`~treerl.rollout.rewards.RewardOptions`), ``reward/mean`` is their weighted
sum with the environment's reward (what ``treerl learn`` trains on), beside ``reward/env_mean``
and each function's ``reward_fn/<name>_mean``, the names of learn's metrics.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from treerl.agents.chat_templates import resolve_chat_template
from treerl.agents.policy import Policy, SamplingParams
from treerl.config import AcceptsAliases, field_help
from treerl.envs.group import EnvGroup
from treerl.envs.loops import run_until_done
from treerl.envs.registry import make
from treerl.errors import ConfigError
from treerl.rollout.engine import RolloutEngine
from treerl.rollout.options import EpisodeOptions
from treerl.rollout.record import recorded_model, tokenizer_info
from treerl.rollout.rewards import RewardFunc, RewardOptions, StepState, check_reward_weights, combine_rewards, score
from treerl.rollout.summary import summary_table, task_rows, task_table
from treerl.rollout.trajectory import Group, GroupWriter, is_foreign_file, make_header

__all__ = ["EvalConfig", "EvalReport", "evaluate", "aevaluate", "evaluate_with", "pass_at_k", "write_episodes"]

logger = logging.getLogger(__name__)


@dataclass
class EvalConfig(RewardOptions, EpisodeOptions, metaclass=AcceptsAliases):
    """Options of ``treerl eval``."""

    ALIASES: ClassVar[dict[str, str]] = {"num_generations": "rollouts_per_task"}

    num_episodes: int = field_help(64, "How many tasks (seeds seed..seed+N-1; a dataset's rows 0..N-1, each at "
                                       "most once), each played rollouts_per_task times: N episodes at the "
                                       "default of 1, N x R with --rollouts-per-task R (verifiers' -n).")
    rollouts_per_task: int = field_help(1, "Episodes per task, played as one group sharing the prompt (verifiers' "
                                           "-r); above 1 the report adds pass@k for k = 1, the powers of 2 below R, "
                                           "and R.")
    seed: int = field_help(10_000, "First task seed; the default keeps evaluation tasks apart from small training "
                                   "seeds.")
    success_threshold: float = field_help(1.0, "Final environment reward at or above which an episode counts as "
                                               "solved (success rate and pass@k; the reward functions of "
                                               "--reward-funcs do not count).")
    out: str | None = field_help(None, "Also write the episodes' trajectory trees to this JSON Lines file, in "
                                       "treerl rollout --out's format (treerl view and read_groups read it), the "
                                       "report in its header line; an existing trajectory file is replaced "
                                       "(another kind of file is refused).")
    json: bool = field_help(False, "Print the report as JSON.")
    progress: bool = field_help(True, "Show a progress bar of finished tasks (on stderr).")
    per_task: bool = field_help(False, "Also report each task: answer, reward, success, turns, tokens, tool calls "
                                       "and how it ended (a table, or a `tasks` list with --json).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_episodes < 1:
            raise ValueError(f"num_episodes={self.num_episodes} must be >= 1: evaluate at least one episode.")
        if self.rollouts_per_task < 1:
            raise ValueError(f"rollouts_per_task={self.rollouts_per_task} must be >= 1: play each task at least "
                             "once (--rollouts-per-task 1).")
        self.check_reward_options()

    def run_header(self, tokenizer: Any) -> dict[str, Any]:
        """What produced the episodes of ``--out`` (its header's ``run``, as ``treerl rollout``'s)."""
        template = resolve_chat_template(self.chat_template, tokenizer) or getattr(tokenizer, "chat_template", None)
        return {
            "command": "eval",
            "env_id": self.env,
            "env_kwargs": self.env_kwargs,
            "model": recorded_model(self.model),
            "tokenizer": tokenizer_info(tokenizer, template),
            "sampling": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self.sampling()).items()},
            "group_size": self.rollouts_per_task,
            "num_episodes": self.num_episodes,
            "seed": self.seed,
            "success_threshold": self.success_threshold,
            "reward_funcs": self.reward_funcs,
            "reward_weights": self.reward_weights,
            "max_episode_tokens": self.max_episode_tokens,
        }

    def check_out(self) -> None:
        """``out`` can be written, and is not another kind of file (checked before the model loads, not after the
        evaluation)."""
        if not self.out:
            return
        path = Path(self.out)
        if path.is_file() and is_foreign_file(path):  # a dataset or notes: not an earlier evaluation's to replace
            raise ConfigError(f"--out {self.out} is not a treerl trajectory file (no line of it is a trajectory "
                              "group), so it is not replaced; pass another --out, e.g. --out runs/eval.jsonl.")
        try:
            if path.is_dir():
                raise IsADirectoryError(21, "a directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            probe = path.with_name(path.name + ".tmp")
            with open(probe, "w"):
                pass
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"--out {self.out}: cannot write there ({exc.strerror or exc}). Pass a writable file "
                              "path, e.g. --out runs/eval.jsonl.") from None


@dataclass
class EvalReport:
    """What :func:`evaluate` measured: the summary's figures and the episodes' groups."""

    env: str
    figures: dict[str, Any]
    """:meth:`RolloutStats.summary` of the evaluation's episodes."""
    groups: list[Group] = field(default_factory=list, repr=False)
    success_threshold: float = 1.0
    rewards: torch.Tensor | None = field(default=None, repr=False)
    """With reward functions: each episode's rewards ``(E, 1 + F)``, the environment's then each function's
    (NaN where it returned None), the episodes of :attr:`groups` in order."""

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

    @property
    def pass_at_k(self) -> dict[int, float]:
        """``{k: pass@k}`` (empty when each task was played once)."""
        return {int(key[5:]): v for key, v in self.figures.items() if key.startswith("pass@")}

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
                    lockstep: bool = False, rollouts_per_task: int = 1, reward_funcs: Sequence[RewardFunc] = (),
                    reward_weights: Sequence[float] | None = None, progress: bool = False,
                    max_completion_tokens: int | None = None, trainer_state: StepState | None = None) -> EvalReport:
    """Play ``num_episodes`` tasks (seeds ``seed..seed+N-1``) ``rollouts_per_task`` times each, concurrently;
    see :func:`evaluate`.

    ``chat_template`` (a template's text) overrides the tokenizer's, and ``lockstep`` generates in
    waves of every episode (batches, and with them every float, repeat), as in the engine.
    ``reward_funcs`` (TRL's signature) are scored as in ``treerl learn``, weighted by
    ``reward_weights`` (the environment's first; default all 1); their ``trainer_state`` is ``trainer_state``
    (a learner's, where it evaluates during or after its run), else TRL's before training, ``global_step`` and
    ``max_steps`` 0 (no step is taken here). ``progress`` shows a bar of
    finished tasks on stderr. ``max_completion_tokens`` bounds each episode's completion (the engine's; TRL's
    ``max_completion_length``).
    """
    weights = check_reward_weights(reward_funcs, reward_weights)
    num_episodes = _at_most_one_per_row(env_factory, num_episodes, rollouts_per_task)
    engine = RolloutEngine(policy, tokenizer, params=params or SamplingParams(max_new_tokens=96),
                           max_concurrency=max_concurrency, max_episode_tokens=max_episode_tokens,
                           max_episode_seconds=max_episode_seconds, seed=seed, chat_template=chat_template,
                           lockstep=lockstep, max_completion_tokens=max_completion_tokens)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_episodes, desc="eval", unit="task", file=sys.stderr, dynamic_ncols=True)
    try:
        groups, stats = await engine.run(env_factory, env_id, range(num_episodes), group_size=rollouts_per_task,
                                         on_group=None if bar is None else lambda group: bar.update(1))
    finally:
        if bar is not None:
            bar.close()
    figures = stats.summary(success_threshold)
    if rollouts_per_task > 1:
        figures.update({f"pass@{k}": v for k, v in pass_at_k(groups, success_threshold).items()})
    rewards = None
    if reward_funcs:
        state = trainer_state or StepState(global_step=0, max_steps=0)  # TRL's state before training
        reward_figures, rewards = _reward_figures(groups, reward_funcs, weights, state)
        figures.update(reward_figures)
    return EvalReport(env=env_id, figures=figures, groups=groups, success_threshold=success_threshold,
                      rewards=rewards)


def pass_at_k(groups: Sequence[Group], success_threshold: float = 1.0) -> dict[int, float]:
    """``{k: pass@k}`` for k = 1, the powers of 2 below n, and n (n: the fewest episodes of a group), each
    the unbiased estimate of Chen et al. (2021) averaged over groups: ``1 - C(n-c, k) / C(n, k)`` for a
    group with ``c`` successes (final reward at or above ``success_threshold``) in ``n`` episodes.

    >>> from treerl.rollout.trajectory import Episode
    >>> def group(*finals):
    ...     return Group(task_key="t", env_id="", episodes=[Episode(leaf=0, reward=r, rewards=[r])
    ...                                                      for r in finals])
    >>> pass_at_k([group(1, 0, 0, 0), group(0, 0, 0, 0)])
    {1: 0.125, 2: 0.25, 4: 0.5}
    """
    if not groups:
        return {}
    n_min = min(len(g.episodes) for g in groups)
    ks = sorted({1, n_min, *(2 ** i for i in range(1, n_min.bit_length()))})
    out = {}
    for k in ks:
        estimates = []
        for g in groups:
            n = len(g.episodes)
            c = sum((e.rewards[-1] if e.rewards else 0.0) >= success_threshold for e in g.episodes)
            estimates.append(1.0 - math.comb(n - c, k) / math.comb(n, k))
        out[k] = sum(estimates) / len(estimates)
    return out


def _reward_figures(groups: Sequence[Group], reward_funcs: Sequence[RewardFunc], weights: Sequence[float],
                    trainer_state: StepState) -> tuple[dict[str, float], torch.Tensor]:
    """Learn's reward metrics over the episodes: ``reward/mean`` and ``reward/std`` of the weighted sum,
    ``reward/env_mean`` and ``reward/env_std`` of the environment's reward, ``reward_fn/<name>_mean``
    per function (and what the functions log with ``log_metric``); and the rewards scored ``(E, 1 + F)``, the
    functions given ``trainer_state``."""
    metrics: dict[str, float] = {}
    rewards = score(groups, reward_funcs, metrics, trainer_state=trainer_state)  # (E, 1 + F)
    combined = combine_rewards(rewards, torch.tensor(weights, dtype=rewards.dtype))  # (E,)
    env = rewards[:, 0]
    return {
        "reward/mean": combined.mean().item(),
        "reward/std": combined.std(unbiased=False).item(),
        "reward/env_mean": env.mean().item(),
        "reward/env_std": env.std(unbiased=False).item(),
        **metrics,
    }, rewards


def write_episodes(path: str | os.PathLike, report: EvalReport, run: dict[str, Any]) -> Path:
    """Write ``report``'s groups as a trajectory file (``treerl rollout --out``'s format), replacing ``path``;
    the header line holds ``run`` (what produced them) and the report (``read_header(path)["report"]``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")  # written whole, then moved: a killed write leaves the old file
    try:
        tmp.unlink(missing_ok=True)
        with GroupWriter(tmp, header={**make_header(run), "report": report.summary()}) as writer:
            for group in report.groups:
                writer.write(group)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"--out {path}: cannot write there ({exc.strerror or exc}). Pass a writable file path, "
                          "e.g. --out runs/eval.jsonl.") from None
    return path


def _at_most_one_per_row(env_factory: Callable[[], Any], num_episodes: int, rollouts_per_task: int = 1) -> int:
    """``num_episodes`` (tasks), or the number of rows of the environment's dataset when that is smaller
    (with a warning)."""
    env = env_factory()
    try:
        if isinstance(env, EnvGroup):  # its members' datasets, each played along the group's schedule
            num_rows = env.num_distinct_tasks()
            rows = f"the group's datasets give {num_rows} tasks before a row repeats"
        else:
            dataset = getattr(env, "dataset", None)
            num_rows = None if dataset is None else len(dataset)
            rows = f"the dataset has {num_rows} rows"
    finally:
        env.close()
    if num_rows is None or num_episodes <= num_rows:
        return num_episodes
    message = (f"the evaluation asks for {num_episodes} tasks (--eval-episodes of learn, --num-episodes of eval) "
               f"but {rows}: it plays each row once ({num_rows * rollouts_per_task} episodes), as rows played "
               "twice would count twice")
    if message not in _SAID:  # a run evaluating every few steps says it once
        _SAID.add(message)
        logger.info(message)  # printed below: at warning level Python's last-resort handler printed it twice
        print(f"warning: {message}", file=sys.stderr)
    return num_rows


_SAID: set[str] = set()
"""The warnings of :func:`_at_most_one_per_row` this process has printed."""


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
    return run_until_done(aevaluate(lambda: make(env_id, **env_kwargs), policy, tokenizer, env_id=env_id, **kwargs))


def evaluate_with(cfg: EpisodeOptions, policy: Policy, tokenizer: Any, *, num_episodes: int, seed: int,
                  success_threshold: float = 1.0, env_factory: Callable[[], Any] | None = None,
                  env_id: str = "", rollouts_per_task: int = 1, reward_funcs: Sequence[RewardFunc] = (),
                  reward_weights: Sequence[float] | None = None, progress: bool = False,
                  trainer_state: StepState | None = None, **sampling_overrides: Any) -> EvalReport:
    """:func:`evaluate` with a command's :class:`EpisodeOptions` (environment, sampling, limits, lockstep).

    ``env_factory`` replaces the one ``cfg`` describes (a learner given its own factory), and
    ``env_id`` then names it (default: ``cfg.env``). ``rollouts_per_task``, ``reward_funcs``,
    ``reward_weights`` and ``trainer_state`` are :func:`aevaluate`'s (``cfg``'s own are not read: a learner's held-out
    evaluation plays each task ``num_generations_eval`` times, on the environment's reward). A learner's ``max_completion_length``
    (TRL's) bounds each episode's completion, as in its training.
    """
    return run_until_done(aevaluate(
        env_factory or cfg.env_factory(), policy, tokenizer, env_id=env_id or cfg.env, num_episodes=num_episodes, seed=seed,
        params=cfg.sampling(**sampling_overrides), max_concurrency=cfg.max_concurrency,
        max_episode_tokens=cfg.max_episode_tokens, max_episode_seconds=cfg.max_episode_seconds,
        success_threshold=success_threshold, chat_template=resolve_chat_template(cfg.chat_template, tokenizer),
        lockstep=cfg.lockstep, rollouts_per_task=rollouts_per_task, reward_funcs=reward_funcs,
        reward_weights=reward_weights, progress=progress,
        max_completion_tokens=getattr(cfg, "max_completion_length", None), trainer_state=trainer_state,
    ))
