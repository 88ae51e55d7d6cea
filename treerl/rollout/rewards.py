"""Reward scoring: the environment's verifier plus reward functions with TRL's signature, weighted.

Every episode gets a row of rewards: first the environment's own (its verifier's score,
summed over turns), then one per reward function. The advantage stage combines the columns
with ``reward_weights`` (one per column). A reward function takes TRL's arguments::

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

``prompts`` are the opening messages, ``completions`` every message after them,
``completion_ids`` the sampled ids; the task's columns come as keyword arguments
(``answer``, ``task_id``, ``termination``, ``env_reward``; a dataset column of one of those names gives
its own value instead, as TRL passes the row's columns), ``trainer_state`` (its ``global_step``
and ``max_steps``, as TRL's), with ``log_metric(name, value)``
(logged as ``reward_fn/<name>``) and ``log_extra(name, values)`` callbacks (the values, one per
completion, go to ``reward_extras.jsonl`` in the run's directory), and the columns of the task's
dataset row that the environment keeps in ``Task.info`` (TRL passes extra dataset columns the same
way). ``None`` means "not applicable": the reward is NaN and left out of the weighted sum, as in
TRL. An ``async def`` reward function is awaited; several run concurrently.

From the command line, ``--reward-funcs my_rewards:short,pkg.mod:fmt`` names them
(:func:`load_reward_funcs`: a module on the path or a ``.py`` file, then the function), with
the flags of :class:`RewardOptions` (``--judge '{...}'`` adds an LLM judge, :mod:`treerl.envs.judge`), which
``treerl learn`` (trains on the weighted sum) and
``treerl eval`` (reports it) share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treerl.config import field_help
from treerl.errors import ConfigError
from treerl.rollout.trajectory import Group

__all__ = ["RewardFunc", "RewardOptions", "StepState", "check_reward_weights", "combine_rewards", "load_reward_funcs",
           "make_judge", "reward_func_name", "score", "write_extras"]

_RESERVED = {"prompts", "completions", "completion_ids", "log_metric", "log_extra", "trainer_state"}

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Sequence[float | None]]
"""TRL's signature: ``f(prompts, completions, completion_ids, **kwargs) -> list[float | None]``."""


@dataclass(frozen=True)
class StepState:
    """The ``trainer_state`` reward functions get: the fields of TRL's that a schedule reads."""

    global_step: int
    """Optimizer steps taken before this one (0 while scoring the first step's episodes; a step that
    takes several updates (``num_iterations`` x ``num_minibatches``) counts them all, as TRL's does)."""
    max_steps: int
    """Optimizer steps the run takes in all."""


@dataclass
class RewardOptions:
    """The reward functions scored beside the environment's reward, and their weights (a base of the
    configs of ``treerl learn`` and ``treerl eval``; its subclass's ``__post_init__`` calls
    :meth:`check_reward_options`)."""

    reward_funcs: list[str] = field_help(
        help="Reward functions with TRL's signature, as MODULE:FUNCTION or FILE.py:FUNCTION (comma-separated or "
             "repeated), added to the environment's reward.", default_factory=list)
    reward_weights: list[float] | None = field_help(None, "One weight for the environment's reward, then one per "
                                                          "reward function (default: all 1).")
    judge: dict[str, Any] = field_help(
        help='An LLM judge as one more reward function, after --reward-funcs (its weight is the last of '
             '--reward-weights): treerl.envs.judge.JudgeReward\'s keyword arguments, e.g. \'{"base_url": '
             '"http://127.0.0.1:8001/v1", "model": "Qwen/Qwen3-8B", "api_key_env": "JUDGE_API_KEY"}\' (a mapping in '
             'YAML; needs the extra treerl[judge]).', default_factory=dict)

    def reward_functions(self) -> list[RewardFunc]:
        """The functions of ``reward_funcs``, then the ``judge`` when one is given."""
        funcs = load_reward_funcs(self.reward_funcs)
        if self.judge:
            funcs.append(make_judge(self.judge))
        return funcs

    def check_reward_options(self) -> None:
        """A judge must be one :class:`~treerl.envs.judge.JudgeReward` takes; given weights, there must be one per
        reward function plus the environment's."""
        if not isinstance(self.judge, dict):
            raise ConfigError(f"judge must be a mapping of JudgeReward's keyword arguments, got {self.judge!r}; "
                              'write e.g. --judge \'{"base_url": "http://127.0.0.1:8001/v1", "model": "judge"}\'.')
        if self.judge:
            make_judge(self.judge).close()
        if self.reward_weights is not None and (self.reward_funcs or self.judge):
            num = len(load_reward_funcs(self.reward_funcs)) + bool(self.judge)
            if len(self.reward_weights) != 1 + num:
                raise ValueError(f"reward_weights has {len(self.reward_weights)} entries for {num} reward "
                                 f"function(s); give {1 + num}: the environment's reward first, then one per "
                                 "function (--reward-weights 1.0 0.5 ...).")


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


def load_reward_funcs(specs: Sequence[str]) -> list[RewardFunc]:
    """The functions named ``module:function`` or ``path/to/file.py:function`` (commas separate several).

    >>> [f.__name__ for f in load_reward_funcs(["math:sqrt,math:floor"])]
    ['sqrt', 'floor']
    >>> load_reward_funcs(["math"])
    Traceback (most recent call last):
    ...
    treerl.errors.ConfigError: reward_funcs: 'math' is not MODULE:FUNCTION; write e.g. --reward-funcs my_rewards:short_answers (a module on the path or a .py file, then the function).
    """
    import importlib
    import runpy

    funcs = []
    for spec in (s.strip() for item in specs for s in str(item).split(",") if s.strip()):
        module_name, sep, attr = spec.rpartition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(f"reward_funcs: {spec!r} is not MODULE:FUNCTION; write e.g. --reward-funcs "
                              "my_rewards:short_answers (a module on the path or a .py file, then the function).")
        if module_name.endswith(".py"):
            if not Path(module_name).is_file():
                raise ConfigError(f"reward_funcs: {module_name}: no such file.")
            namespace = runpy.run_path(module_name, run_name=f"treerl_user_module:{Path(module_name).resolve()}")
        else:
            try:
                namespace = vars(importlib.import_module(module_name))
            except ImportError as exc:
                raise ConfigError(f"reward_funcs: cannot import {module_name!r} ({exc}); is it on PYTHONPATH? A file "
                                  "works too: --reward-funcs path/to/rewards.py:my_reward.") from None
        func = namespace.get(attr)
        if not callable(func):
            public = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))
            raise ConfigError(f"reward_funcs: {module_name} has no function {attr!r}; it has {public[:12]}.")
        funcs.append(func)
    return funcs


def make_judge(options: dict[str, Any]) -> RewardFunc:
    """The :class:`~treerl.envs.judge.JudgeReward` of ``--judge``'s keyword arguments."""
    from treerl.envs.judge import JudgeReward

    try:
        return JudgeReward(**options)
    except TypeError as exc:
        known = sorted(p for p in inspect.signature(JudgeReward).parameters)
        raise ConfigError(f"judge: {exc}; JudgeReward takes {known}.") from None
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"judge: {exc}") from None


_TRL_SHAPE = ("it is called once per batch as f(prompts, completions, completion_ids, **kwargs), each a list with "
              "one entry per completion, and returns a list of rewards (None where one does not apply); a function "
              "that scores one completion needs a loop around it")


def reward_func_name(func: RewardFunc) -> str:
    """What metrics call a reward function (``reward_fn/NAME_mean``): its ``__name__``, else its class's."""
    return getattr(func, "__name__", type(func).__name__)


def _check_arguments(func: RewardFunc, kwargs: dict[str, Any]) -> None:
    """A function that cannot take TRL's arguments is told so before it is called, in TRL's terms."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself says
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise TypeError(f"reward function {reward_func_name(func)!r} cannot take TRL's arguments ({exc}): {_TRL_SHAPE}; the "
                        f"keyword arguments here are {sorted(kwargs)}.") from None


def _call_all(calls: list[tuple[RewardFunc, dict[str, Any]]]) -> list[Any]:
    """Each reward function's result; coroutines (``async def`` functions) awaited concurrently."""
    for func, kwargs in calls:
        _check_arguments(func, kwargs)
    results = [func(**kwargs) for func, kwargs in calls]
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if pending:
        async def gather() -> list[Any]:
            return await asyncio.gather(*(results[i] for i in pending))

        try:
            asyncio.get_running_loop()
            running = True
        except RuntimeError:
            running = False
        if running:  # called from inside an event loop (e.g. an async learner): await in a thread of its own
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                done = pool.submit(asyncio.run, gather()).result()
        else:
            done = asyncio.run(gather())
        for i, value in zip(pending, done):
            results[i] = value
    return results


def write_extras(path: str | Path, step: int, extras: dict[str, list[Any]]) -> None:
    """Append one line ``{"step": s, name: values, ...}`` of ``log_extra`` values to ``path``."""
    if extras:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **extras}, default=str) + "\n")


def score(groups: Sequence[Group], reward_funcs: Sequence[RewardFunc], metrics: dict[str, float],
          extras: dict[str, list[Any]] | None = None, trainer_state: StepState | None = None) -> torch.Tensor:
    """Rewards ``(E, 1 + len(reward_funcs))``: the environment's, then each reward function's
    (NaN where a function returned ``None``). ``extras`` collects the ``log_extra`` values;
    ``trainer_state`` is passed on to the functions (as TRL's)."""
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
            "trainer_state": trainer_state,
        }
        # The dataset row's own columns the environment kept (TRL passes extra columns as kwargs), as written:
        # a column named task_id, termination, env_reward or answer wins over treerl's value of that name,
        # which stays for the rows that lack it.
        rows = [g.info.get("row") or {} for g, _ in episodes]
        for key in sorted({k for row in rows for k in row} - _RESERVED):
            ours = kwargs.get(key) or [None] * len(episodes)
            kwargs[key] = [row[key] if key in row else value for row, value in zip(rows, ours)]
        extras = {} if extras is None else extras

        def log_metric(name: str, value: float) -> None:
            metrics[f"reward_fn/{name}"] = float(value)

        def log_extra(name: str, values: Sequence[Any]) -> None:
            extras[str(name)] = list(values)

        calls = [(func, dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                             log_metric=log_metric, log_extra=log_extra, **kwargs)) for func in reward_funcs]
        for func, values in zip(reward_funcs, _call_all(calls)):
            name = reward_func_name(func)
            if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise ValueError(f"reward function {name!r} returned {_a(values)}, not a list of rewards: {_TRL_SHAPE}.")
            if len(values) != len(episodes):
                raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {len(episodes)} "
                                 "completions; return one per completion (None where it does not apply).")
            values = [math.nan if v is None else float(v) for v in values]
            applicable = [v for v in values if not math.isnan(v)]
            metrics[f"reward_fn/{name}_mean"] = sum(applicable) / len(applicable) if applicable else math.nan
            columns.append(values)
    return torch.tensor(columns, dtype=torch.float32).T  # (E, R)


def combine_rewards(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of several rewards: (E, R) x (R,) -> (E,). A NaN reward (a reward function's
    ``None``: "not applicable") is left out of its episode's sum, as TRL does.

    >>> combine_rewards(torch.tensor([[1.0, float("nan")], [1.0, 2.0]]), torch.tensor([1.0, 0.5]))
    tensor([1., 2.])
    """
    return torch.nansum(rewards * weights, dim=-1)


def _a(value: Any) -> str:
    """``None``, or ``a float``/``an int``: what a function returned, in words."""
    if value is None:
        return "None"
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
