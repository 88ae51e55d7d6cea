"""``check_env``: Gymnasium's checker plus treerl's own checks.

Gymnasium's ``check_env`` covers the API shapes, spaces and seeding. treerl adds what
multi-turn tool environments need: seeded tasks are reproducible, ``fork()`` is independent,
``validate()`` proves gold answers earn the full reward (where the environment has them), tool schemas are valid JSON Schema,
``astep`` agrees with ``step``, and malformed model output never raises (nor do
``feedback()`` and ``episode_metrics()`` on what it led to).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any

import gymnasium
import jsonschema
from gymnasium.utils.env_checker import check_env as gymnasium_check_env
from gymnasium.utils.env_checker import data_equivalence

from treerl.envs.core import Env, ToolEnv, run_sync
from treerl.errors import EnvError, ToolErrorKind

__all__ = ["EnvCheckError", "check_env", "ADVERSARIAL_ACTIONS"]

ADVERSARIAL_ACTIONS = (
    "",
    "I don't know.",
    "<tool_call>",
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": 3, "arguments": [1, 2]}\n</tool_call>',
    "[TOOL_CALLS][{]",
    "<function=x><parameter=y>",
    "\\boxed{",
    "\x00\uffff" * 8,
)

_KINDS = {k.value for k in ToolErrorKind}


class EnvCheckError(EnvError):
    """An environment failed one of treerl's checks; the message names the call and the fix."""


def check_env(env: Env, *, seed: int = 0, num_validate: int = 4, gymnasium_checks: bool = True) -> None:
    """Run Gymnasium's and treerl's checks on ``env`` (raises :class:`EnvCheckError`).

    Args:
        env: A bare treerl environment (``treerl.make(...)`` or ``gymnasium.make(...).unwrapped``).
        seed: Seed for the determinism checks.
        num_validate: Tasks on which ``validate()`` must earn the full reward; an environment without
            gold answers (neither ``gold_actions`` nor ``validate`` overridden) is skipped with a warning.
        gymnasium_checks: Also run ``gymnasium.utils.env_checker.check_env``.
    """
    env = env.unwrapped
    if not isinstance(env, Env):
        raise EnvCheckError(f"{type(env).__name__} is not a treerl Env: subclass treerl.envs.Env or ToolEnv.")
    if gymnasium_checks:
        gymnasium_check_env(env, skip_render_check=env.spec is None)
    _check_tool_schemas(env)
    _check_seeded_reset(env, seed)
    _check_fork(env, seed)
    _check_async_agrees(env, seed)
    _check_adversarial(env, seed)
    if not _has_gold_answers(env):  # optional: an environment may not know its answers
        warnings.warn(f"{type(env).__name__} has no gold answers, so check_env could not check that a correct answer "
                      "earns the full reward: override gold_actions(task) (ToolEnv) or validate().", stacklevel=2)
        return
    report = env.validate(num_tasks=num_validate, seed=seed)
    if not report.ok:
        raise EnvCheckError(
            f"{type(env).__name__}.validate(): {report.num_passed}/{report.num_tasks} gold answers earned the full "
            f"reward: {report.failures[:3]}. Fix score() or gold_actions() so that a correct answer is rewarded."
        )


def _has_gold_answers(env: Env) -> bool:
    """Whether ``env`` overrides ``validate()``, or the ``gold_actions()`` that ``ToolEnv.validate`` plays."""
    cls = type(env)
    if cls.validate is not Env.validate and cls.validate is not ToolEnv.validate:
        return True
    return isinstance(env, ToolEnv) and cls.gold_actions is not ToolEnv.gold_actions


def _check_tool_schemas(env: Env) -> None:
    names = set()
    for schema in env.tool_schemas:
        fn = schema.get("function", {})
        name = fn.get("name")
        if schema.get("type") != "function" or not name:
            raise EnvCheckError(f"Tool schema {schema!r} must be {{'type': 'function', 'function': {{'name': ...}}}}.")
        if name in names:
            raise EnvCheckError(f"Two tools are named {name!r}: tool names must be unique.")
        names.add(name)
        try:
            jsonschema.Draft202012Validator.check_schema(fn.get("parameters", {}))
        except jsonschema.SchemaError as exc:
            raise EnvCheckError(f"Tool {name!r} has an invalid JSON Schema: {exc.message}. Fix its type hints.") from None


def _check_seeded_reset(env: Env, seed: int) -> None:
    obs_1, info_1 = env.reset(seed=seed)
    obs_2, info_2 = env.reset(seed=seed)
    if not data_equivalence(obs_1, obs_2) or info_1.get("task_id") != info_2.get("task_id"):
        raise EnvCheckError(
            f"reset(seed={seed}) twice gave different tasks: draw tasks from self.np_random after super().reset(seed=seed)."
        )
    if not env.observation_space.contains(obs_1):
        raise EnvCheckError(f"reset(seed={seed}) returned {obs_1!r}, which is not a list of chat messages.")


def _check_fork(env: Env, seed: int) -> None:
    env.reset(seed=seed)
    action = "\\boxed{1}"
    before = copy.deepcopy(env.messages)
    child = env.fork()
    if child is env:
        raise EnvCheckError("fork() returned the same object: return an independent copy (the default deep-copies).")
    child_result = child.step(action)
    if env.messages != before:
        raise EnvCheckError("Stepping a fork changed the original environment: fork() must not share mutable state.")
    result = env.step(action)
    if not data_equivalence(child_result[:4], result[:4]):
        raise EnvCheckError("A fork and its original gave different results for the same action: fork() must copy the full state.")


def _check_async_agrees(env: Env, seed: int) -> None:
    env.reset(seed=seed)
    sync = env.fork().step("\\boxed{1}")
    async_ = run_sync(env.astep("\\boxed{1}"))
    if not data_equivalence(sync[:4], async_[:4]):
        raise EnvCheckError("astep() and step() disagree for the same state and action: implement one in terms of the other.")


def _check_adversarial(env: Env, seed: int) -> None:
    for action in ADVERSARIAL_ACTIONS:
        env.reset(seed=seed)
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except Exception as exc:  # the check's whole point: report which output crashed it
            raise EnvCheckError(
                f"step({action!r}) raised {type(exc).__name__}: {exc}. Model output must become an observation, never an exception."
            ) from exc
        if not env.observation_space.contains(obs):
            raise EnvCheckError(f"step({action!r}) returned an observation outside the space: {obs!r}.")
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvCheckError(f"step({action!r}) returned reward {reward!r}: rewards must be finite floats.")
        for record in info.get("tool_calls", []):
            kind = record.get("error")
            if kind is not None and kind not in _KINDS:
                raise EnvCheckError(f"step({action!r}) recorded error kind {kind!r}: use one of {sorted(_KINDS)}.")
        try:
            feedback = env.feedback()
        except Exception as exc:
            raise EnvCheckError(f"feedback() after step({action!r}) raised {type(exc).__name__}: {exc}. It must say "
                                "what went wrong in words (a str), or return None.") from exc
        if feedback is not None and not isinstance(feedback, str):
            raise EnvCheckError(f"feedback() after step({action!r}) returned {type(feedback).__name__}: return a "
                                "str or None.")
        try:
            numbers = env.episode_metrics()
        except Exception as exc:
            raise EnvCheckError(f"episode_metrics() after step({action!r}) raised {type(exc).__name__}: {exc}. It is "
                                "asked however the episode ended (a malformed reply, no final answer, a time "
                                "limit): return the numbers it has, e.g. {'answer_chars': len(answer or '')}.") from exc
        if not isinstance(numbers, Mapping):
            raise EnvCheckError(f"episode_metrics() after step({action!r}) returned {type(numbers).__name__}: return "
                                "a dict of numbers by name, e.g. {'format_ok': True}.")


def check_registered(env_id: str, **kwargs: Any) -> None:
    """``check_env`` on the registered ``env_id``, built through ``gymnasium.make``."""
    check_env(gymnasium.make(env_id, **kwargs).unwrapped)
